"""The capability gates: one recipe per (weight format, out dtype), queried as data; which
kernel then runs is tests/fusedq/test_selection.py's."""

from __future__ import annotations

import pytest
import torch

import fusedq
from fusedq import capability
from fusedq.kernels.common import interpreting


@pytest.mark.parametrize("h", [8, 11, 16])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float8_e4m3fn])
def test_qualified_shapes_supported_here(h, fmt, out_dtype, device):
    if device.type == "cuda" and torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this GPU predates fp8 conversions")
    for m in (1, 32):
        assert fusedq.explain(h, m, weight_format=fmt, out_dtype=out_dtype, device=device) is None
        assert fusedq.can_implement(h, m, weight_format=fmt, out_dtype=out_dtype, device=device)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"num_heads": 12, "max_m": 4}, "num_heads=12"),
        ({"num_heads": 8, "max_m": 0}, "max_m=0"),
        ({"num_heads": 8, "max_m": 33}, "max_m=33"),
        ({"num_heads": 8, "max_m": 4, "weight_format": "nvfp4"}, "nvfp4"),
        ({"num_heads": 8, "max_m": 4, "out_dtype": torch.float16}, "float16"),
    ],
)
def test_unqualified_explained(kwargs, match, device):
    why = fusedq.explain(device=device, **kwargs)
    assert why is not None and match in why
    assert not fusedq.can_implement(device=device, **kwargs)


def test_bf16_recipe_needs_only_sm80():
    recipe = capability.RECIPES[("bf16", torch.bfloat16)]
    assert recipe.min_capability == (8, 0)
    for key, r in capability.RECIPES.items():
        if key != ("bf16", torch.bfloat16):
            assert r.min_capability == (8, 9), key


def test_capability_gate_uses_device(monkeypatch):
    monkeypatch.setattr(capability, "_interpreting", lambda: False)
    monkeypatch.setattr(capability, "_capability", lambda index: (8, 6))
    cuda0 = torch.device("cuda", 0)
    assert fusedq.explain(8, 4, device=cuda0) is None
    why = fusedq.explain(8, 4, weight_format="mxfp8", device=cuda0)
    assert why is not None and "sm_86" in why and "sm_89" in why
    monkeypatch.setattr(capability, "_capability", lambda index: (7, 5))
    assert "sm_80" in fusedq.explain(8, 4, device=cuda0)


def test_cpu_needs_interpreter(monkeypatch):
    monkeypatch.setattr(capability, "_interpreting", lambda: False)
    assert "TRITON_INTERPRET" in fusedq.explain(8, 4, device="cpu")


def test_interpreter_state_matches_environment():
    assert interpreting() == (not torch.cuda.is_available())
