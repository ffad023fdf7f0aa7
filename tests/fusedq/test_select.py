"""The kernel choice: what ``kernel_choice``/``kernel_summary`` report is what the dispatcher
binds, on every qualified shape, in every environment the choice reads."""

from __future__ import annotations

import pytest
import torch
from fusedq_cases import E4M3, Q_SCALE, make_q, make_weight

import fusedq
from fusedq import capability, dispatch
from fusedq.kernels import cute_mla_query
from fusedq.kernels import triton_mla_query as kernel
from fusedq.limits import MAX_M, QUALIFIED_HEADS

DSL_MISSING = "nvidia-cutlass-dsl does not import (ModuleNotFoundError: No module named 'cutlass')"


@pytest.fixture(autouse=True)
def no_plans():
    dispatch.clear_plans()
    yield
    dispatch.clear_plans()


def _fake_gpu(monkeypatch, *, dsl: bool, gluon: bool) -> torch.device:
    """An sm_90 CUDA device as the choice sees it (CPU tensors stand in for its memory), with
    or without nvidia-cutlass-dsl and Gluon. The CuTe kernel's per-operand check passes (the
    test's operands are aligned and contiguous, as on a GPU) and nothing is compiled."""
    monkeypatch.setattr(capability, "_interpreting", lambda: False)
    monkeypatch.setattr(capability, "_resolve_device", lambda d: torch.device("cuda", 0))
    monkeypatch.setattr(capability, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(kernel, "interpreting", lambda: False)
    monkeypatch.setattr(kernel, "_gluon_available", lambda: gluon)
    monkeypatch.setattr(kernel.LaunchConfig, "_check_gluon", lambda self: None)
    monkeypatch.setattr(kernel, "HAS_PDL", True)
    monkeypatch.setattr(cute_mla_query, "unavailable_reason", lambda: None if dsl else DSL_MISSING)
    monkeypatch.setattr(cute_mla_query, "unsupported_reason", lambda *a: None)
    monkeypatch.setattr(cute_mla_query, "prewarm", lambda *a, **k: 0)
    return torch.device("cuda", 0)


def _name(config) -> str:
    """The kernel a Triton-family launch config runs, as ``kernel_summary`` names it."""
    if config.gluon:
        return f"gluon-{config.gluon_operands}" + (
            "-widestore" if config.e4m3_epilogue == "wide" else ""
        )
    return "register" if config.fma else "tl.dot"


def _dispatched(h: int, m: int, weight, out_dtype, pdl: bool) -> tuple[str, str, bool | None]:
    """(path, kernel name, the Triton launch's pdl) of the plan the dispatcher binds for one
    ``backend="auto"`` call."""
    gen = torch.Generator().manual_seed(m)
    q_nope, q_pe = make_q(m, h, torch.device("cpu"), gen)
    values, scales = dispatch.split_weight(weight)
    q_scale = torch.tensor([Q_SCALE]) if out_dtype == E4M3 else None
    plan = dispatch._new_plan(
        q_nope, values, scales, q_pe, None, out_dtype, q_scale, "auto", pdl, real=True
    )
    if not plan.fused:
        return "staged", "staged", None
    if isinstance(plan.launch, cute_mla_query.BoundCute):
        triton = plan.launch.fallback
        return "cute", f"cute (graphs; eager: {_name(triton.config)})", triton.config.pdl
    return "triton", _name(plan.launch.config), plan.launch.config.pdl


def _reported(h: int, m: int, fmt: str, out_dtype, device, pdl: bool) -> tuple[str, str]:
    """(path, kernel name) as ``kernel_choice`` and ``kernel_summary`` report them."""
    kw = dict(weight_format=fmt, out_dtype=out_dtype, device=device, pdl=pdl)
    path, _ = fusedq.kernel_choice(h, m, **kw)
    summary = fusedq.kernel_summary(h, [m], **kw).split(" [CuTe: ")[0]
    prefix = f"M={m} "
    assert summary.startswith(prefix), summary
    return path, summary[len(prefix) :]


def _weights(fmt: str) -> dict[int, object]:
    gen = torch.Generator().manual_seed(7)
    ws = {h: make_weight(h, "vllm", torch.device("cpu"), gen) for h in QUALIFIED_HEADS}
    return {h: fusedq.quantize_mxfp8(w) if fmt == "mxfp8" else w for h, w in ws.items()}


@pytest.mark.parametrize("gluon", [True, False], ids=["gluon", "no-gluon"])
@pytest.mark.parametrize("dsl", [True, False], ids=["dsl", "no-dsl"])
@pytest.mark.parametrize("pdl", [False, True], ids=["pdl-off", "pdl-on"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, E4M3], ids=["bf16-out", "e4m3-out"])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_kernel_choice_and_the_dispatcher_agree_on_a_gpu(
    monkeypatch, fmt, out_dtype, pdl, dsl, gluon
):
    device = _fake_gpu(monkeypatch, dsl=dsl, gluon=gluon)
    weights = _weights(fmt)
    paths = set()
    for h in QUALIFIED_HEADS:
        for m in range(1, MAX_M + 1):
            path, name, launch_pdl = _dispatched(h, m, weights[h], out_dtype, pdl)
            assert (path, name) == _reported(h, m, fmt, out_dtype, device, pdl), (h, m)
            assert launch_pdl == pdl, (h, m)
            paths.add(path)
    # Every qualified shape runs a fused kernel; the CuTe one exactly where it may.
    assert paths == ({"cute", "triton"} if dsl and not pdl else {"triton"})


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, E4M3], ids=["bf16-out", "e4m3-out"])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_kernel_choice_and_the_dispatcher_agree_in_the_interpreter(fmt, out_dtype):
    if not kernel.interpreting():
        pytest.skip("the Triton interpreter runs only without CUDA")
    weights = _weights(fmt)
    cpu = torch.device("cpu")
    for h in QUALIFIED_HEADS:
        for m in range(1, MAX_M + 1):
            path, name, _ = _dispatched(h, m, weights[h], out_dtype, False)
            assert path == "triton", (h, m)
            assert (path, name) == _reported(h, m, fmt, out_dtype, cpu, False), (h, m)


@pytest.mark.parametrize(("h", "m"), [(4, 1), (12, 8), (16, MAX_M + 1)])
def test_unqualified_shapes_are_staged_for_both(monkeypatch, h, m):
    _fake_gpu(monkeypatch, dsl=True, gluon=True)
    gen = torch.Generator().manual_seed(h)
    weight = make_weight(h, "vllm", torch.device("cpu"), gen)
    assert _dispatched(h, m, weight, torch.bfloat16, False)[0] == "staged"
    assert fusedq.kernel_choice(h, m, device=torch.device("cuda", 0))[0] == "staged"
