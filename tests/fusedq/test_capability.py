"""The capability gates: one recipe per (weight format, out dtype), queried as data."""

from __future__ import annotations

import pytest
import torch

import fusedq
from fusedq import capability
from fusedq.kernels.triton_mla_query import interpreting


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


def _cuda_here(monkeypatch, *, cute_reason: str | None) -> None:
    """Pretend a qualified CUDA device (explain passes) and a CuTe kernel that is, or is not,
    available: kernel_choice's own rule is what these tests check."""
    from fusedq.kernels import cute_mla_query

    monkeypatch.setattr(capability, "explain", lambda *a, **k: None)
    monkeypatch.setattr(capability, "_resolve_device", lambda d: torch.device("cuda", 0))
    monkeypatch.setattr(cute_mla_query, "unavailable_reason", lambda: cute_reason)


@pytest.mark.parametrize(
    ("kwargs", "path", "why"),
    [
        ({"weight_format": "mxfp8", "m": 1}, "cute", "CuTe DSL kernel measured faster"),
        ({"weight_format": "mxfp8", "m": capability.CUTE_MAX_M["mxfp8"]}, "cute", "M <= 4"),
        ({"weight_format": "mxfp8", "m": capability.CUTE_MAX_M["mxfp8"] + 1}, "triton", "Triton kernel measured faster"),
        ({"weight_format": "bf16", "m": 1}, "cute", "BF16 -> BF16 at M <= 2"),
        ({"weight_format": "bf16", "m": 3}, "triton", "M=3 > 2"),
        ({"weight_format": "bf16", "m": 2, "out_dtype": torch.float8_e4m3fn}, "cute", "BF16 -> E4M3 at M <= 2"),
        ({"weight_format": "mxfp8", "m": 1, "out_dtype": torch.float8_e4m3fn}, "cute", "MXFP8 -> E4M3 at M <= 4"),
        ({"weight_format": "mxfp8", "m": 5, "out_dtype": torch.float8_e4m3fn}, "triton", "M=5 > 4"),
        ({"weight_format": "mxfp8", "m": 1, "pdl": True}, "triton", "no PDL launch"),
        ({"weight_format": "bf16", "m": 1, "pdl": True}, "triton", "no PDL launch"),
    ],
)  # fmt: skip
def test_kernel_choice_rule(monkeypatch, kwargs, path, why):
    _cuda_here(monkeypatch, cute_reason=None)
    m = kwargs.pop("m")
    got = fusedq.kernel_choice(16, m, **kwargs)
    assert got[0] == path and why in got[1]


def test_kernel_choice_says_why_mxfp8_falls_back_to_triton(monkeypatch):
    """Where nvidia-cutlass-dsl is absent (CPU CI, a plain install) MXFP8 runs the Triton
    kernel, and the choice names the reason."""
    _cuda_here(monkeypatch, cute_reason="nvidia-cutlass-dsl does not import (ModuleNotFoundError)")
    assert fusedq.kernel_choice(8, 1, weight_format="mxfp8") == (
        "triton",
        "nvidia-cutlass-dsl does not import (ModuleNotFoundError)",
    )


def test_kernel_choice_off_the_gpu():
    path, why = fusedq.kernel_choice(16, 1, weight_format="mxfp8", device="cpu")
    if interpreting():
        assert (path, why) == ("triton", "CPU tensors run the Triton kernel in its interpreter")
    else:
        assert path == "staged" and "TRITON_INTERPRET" in why
    assert fusedq.kernel_choice(4, 1)[0] == "staged"  # an unqualified head count


def test_kernel_summary_merges_runs_and_says_why_cute_is_not_used(monkeypatch):
    """The plugin's kernels line: equal choices over consecutive M merged; MXFP8 -> BF16
    without the CuTe kernel says why (here: the DSL missing)."""
    from fusedq.kernels import triton_mla_query as kernel

    _cuda_here(monkeypatch, cute_reason=None)
    monkeypatch.setattr(kernel, "interpreting", lambda: False)
    monkeypatch.setattr(kernel, "_gluon_available", lambda: True)
    monkeypatch.setattr(kernel.LaunchConfig, "_check_gluon", lambda self: None)
    ms = (1, 2, 4, 8, 16, 32)
    assert fusedq.kernel_summary(16, ms, weight_format="mxfp8") == (
        "M=1-4 cute (graphs; eager: gluon-convert); M=8-32 gluon-convert"
    )
    assert fusedq.kernel_summary(8, ms, weight_format="bf16") == (
        "M=1 cute (graphs; eager: register); M=2 cute (graphs; eager: gluon-convert); "
        "M=4-32 gluon-convert"
    )
    _cuda_here(monkeypatch, cute_reason="nvidia-cutlass-dsl does not import (X)")
    assert fusedq.kernel_summary(8, (1, 4), weight_format="mxfp8") == (
        "M=1 register; M=4 gluon-convert [CuTe: nvidia-cutlass-dsl does not import (X)]"
    )
    assert fusedq.kernel_summary(8, (1,), weight_format="bf16") == (
        "M=1 register [CuTe: nvidia-cutlass-dsl does not import (X)]"
    )
