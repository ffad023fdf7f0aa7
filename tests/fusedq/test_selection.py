"""The kernel choice (fusedq.selection): its rules, and that what ``kernel_choice`` and
``kernel_summary`` report is what the dispatcher binds, on every qualified shape, in every
environment the choice reads."""

from __future__ import annotations

import pytest
import torch
from fusedq_cases import E4M3, Q_SCALE, make_q, make_weight

import fusedq
from fusedq import capability, dispatch, selection
from fusedq.contract import GLM5, QUALIFIED
from fusedq.kernels import common, cute_mla_query, gluon_mla_query, triton_launch, triton_mla_query

QUALIFIED_HEADS = QUALIFIED[GLM5.name].heads
MAX_M = QUALIFIED[GLM5.name].max_m

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
    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setattr(capability, "resolve_device", lambda d: torch.device("cuda", 0))
    monkeypatch.setattr(capability, "_capability", lambda index: (9, 0))
    monkeypatch.setattr(gluon_mla_query, "AVAILABLE", gluon)
    monkeypatch.setattr(triton_launch.LaunchConfig, "_check_gluon", lambda self: None)
    monkeypatch.setattr(triton_mla_query, "HAS_PDL", True)
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


def _dispatched(
    h: int, m: int, weight, out_dtype, pdl: bool, backend: str = "auto"
) -> tuple[str, str, bool | None]:
    """(path, kernel name, the Triton launch's pdl) of the plan the dispatcher binds for one
    call with `backend`."""
    gen = torch.Generator().manual_seed(m)
    q_nope, q_pe = make_q(m, h, torch.device("cpu"), gen)
    values, scales = dispatch.split_weight(weight)
    q_scale = torch.tensor([Q_SCALE]) if out_dtype == E4M3 else None
    plan = dispatch._new_plan(
        q_nope, values, scales, q_pe, None, out_dtype, q_scale, backend, pdl, real=True
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
    if not common.interpreting():
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


@pytest.mark.parametrize(
    ("kwargs", "path", "why"),
    [
        ({"weight_format": "mxfp8", "m": 1}, "cute", "CuTe DSL kernel measured faster"),
        ({"weight_format": "mxfp8", "m": selection.CUTE_MAX_M["mxfp8"]}, "cute", "M <= 4"),
        ({"weight_format": "mxfp8", "m": selection.CUTE_MAX_M["mxfp8"] + 1}, "triton", "Triton kernel measured faster"),
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
    _fake_gpu(monkeypatch, dsl=True, gluon=True)
    m = kwargs.pop("m")
    got = fusedq.kernel_choice(16, m, **kwargs)
    assert got[0] == path and why in got[1]


def test_kernel_choice_says_why_mxfp8_falls_back_to_triton(monkeypatch):
    """Where nvidia-cutlass-dsl is absent (a plain install) MXFP8 runs the Triton kernel, and
    the choice names the reason."""
    _fake_gpu(monkeypatch, dsl=False, gluon=True)
    assert fusedq.kernel_choice(8, 1, weight_format="mxfp8") == ("triton", DSL_MISSING)


def test_kernel_choice_off_the_gpu():
    path, why = fusedq.kernel_choice(16, 1, weight_format="mxfp8", device="cpu")
    if common.interpreting():
        assert (path, why) == ("triton", "CPU tensors run the Triton kernel in its interpreter")
    else:
        assert path == "staged" and "TRITON_INTERPRET" in why
    assert fusedq.kernel_choice(4, 1)[0] == "staged"  # an unqualified head count


def _per_m(line: str) -> dict[int, str]:
    """A kernels line ("M=1-2 cute (...); M=4 gluon-convert [note]") as M -> kernel name."""
    out = {}
    for part in line.split(" [")[0].split("; "):
        span, name = part.removeprefix("M=").split(" ", 1)
        lo, _, hi = span.partition("-")
        out |= {m: name for m in range(int(lo), int(hi or lo) + 1)}
    return out


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, E4M3], ids=["bf16-out", "e4m3-out"])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_the_vllm_hooks_kernels_line_names_what_its_calls_bind(monkeypatch, fmt, out_dtype):
    """The server log's kernels line is the hook's (its calls pass ``query.BACKEND``), not
    ``backend="auto"``'s: on an H200 the auto line named CuTe at M=1-2 while the profile of
    the server's CUDA graphs found the Gluon kernel in every query step."""
    from fusedq.vllm import query

    device = _fake_gpu(monkeypatch, dsl=True, gluon=True)
    weights = _weights(fmt)
    ms = range(1, MAX_M + 1)
    for h in QUALIFIED_HEADS:
        kw = dict(weight_format=fmt, out_dtype=out_dtype, device=device, pdl=False)
        line = query.kernel_summary(h, ms, **kw)
        named = _per_m(line)
        for m in ms:
            _, name, _ = _dispatched(h, m, weights[h], out_dtype, False, query.BACKEND)
            assert named[m] == name, (h, m, line)
        # Where auto would take CuTe, the line says the hook does not.
        assert ("cute" in fusedq.kernel_summary(h, ms, **kw)) == ("[CuTe: not in vLLM" in line)


def test_with_backend_auto_the_kernels_line_is_the_packages(monkeypatch):
    """FUSEDQ_BACKEND=auto: the hook's calls bind what kernel_choice picks, CuTe included,
    and the server's kernels line is fusedq.kernel_summary's own."""
    from fusedq.vllm import query

    device = _fake_gpu(monkeypatch, dsl=True, gluon=True)
    monkeypatch.setattr(query, "BACKEND", "auto")
    weights = _weights("bf16")
    ms = range(1, MAX_M + 1)
    for h in QUALIFIED_HEADS:
        kw = dict(weight_format="bf16", out_dtype=torch.bfloat16, device=device, pdl=False)
        line = query.kernel_summary(h, ms, **kw)
        assert line == fusedq.kernel_summary(h, ms, **kw) and "cute" in line
        path, _, _ = _dispatched(h, 1, weights[h], torch.bfloat16, False, query.BACKEND)
        assert path == "cute", h


def test_kernel_summary_merges_runs_and_says_why_cute_is_not_used(monkeypatch):
    """The plugin's kernels line: equal choices over consecutive M merged; without the CuTe
    kernel it says why (here: the DSL missing)."""
    _fake_gpu(monkeypatch, dsl=True, gluon=True)
    ms = (1, 2, 4, 8, 16, 32)
    assert fusedq.kernel_summary(16, ms, weight_format="mxfp8") == (
        "M=1-4 cute (graphs; eager: gluon-convert); M=8-32 gluon-convert"
    )
    assert fusedq.kernel_summary(8, ms, weight_format="bf16") == (
        "M=1 cute (graphs; eager: register); M=2 cute (graphs; eager: gluon-convert); "
        "M=4-32 gluon-convert"
    )
    _fake_gpu(monkeypatch, dsl=False, gluon=True)
    assert fusedq.kernel_summary(8, (1, 4), weight_format="mxfp8") == (
        f"M=1 register; M=4 gluon-convert [CuTe: {DSL_MISSING}]"
    )
    assert fusedq.kernel_summary(8, (1,), weight_format="bf16") == (
        f"M=1 register [CuTe: {DSL_MISSING}]"
    )


@pytest.mark.parametrize(
    ("h", "m", "fmt", "out_fp8", "expect"),
    [
        (16, 4, "bf16", False, ("gluon", "convert", 64, 4, "mul")),
        (11, 2, "bf16", False, ("gluon", "convert", 64, 4, "mul")),  # wide from 11 heads
        (8, 32, "mxfp8", False, ("gluon", "convert", 32, 4, "mul")),
        (8, 4, "bf16", True, ("gluon", "smem", 32, 4, "mul")),
        (8, 32, "bf16", True, ("gluon", "smem", 32, 4, "wide")),  # E4M3's wide store from M=16
        (11, 16, "bf16", True, ("gluon", "smem", 64, 4, "wide")),
        (8, 1, "bf16", False, ("fma", None, 32, 4, "mul")),  # the register path keeps its ties
        (16, 1, "bf16", False, ("gluon", "convert", 64, 4, "mul")),  # ... and not its losses
        (16, 4, "mxfp8", True, ("gluon", "smem", 64, 8, "mul")),  # MXFP8 -> E4M3: 8 warps wide
        (11, 1, "mxfp8", True, ("gluon", "smem", 64, 8, "mul")),
        (16, 32, "mxfp8", True, ("gluon", "convert", 64, 4, "wide")),
        (16, 1, "mxfp8", True, ("fma", None, 32, 4, "mul")),
    ],
)  # fmt: skip
def test_launch_config_picks_gluon_where_it_measured_faster(
    monkeypatch, h, m, fmt, out_fp8, expect
):
    """On a GPU with Gluon, the tl.dot shapes of the swept recipes take the Gluon kernel
    (GLUON_TUNED); the register path keeps its shapes (FMA_TUNED)."""
    _fake_gpu(monkeypatch, dsl=True, gluon=True)
    cfg = selection.launch_config(h, m, fmt, out_fp8, pdl=False)
    path = "gluon" if cfg.gluon else "fma" if cfg.fma else "dot"
    assert path == expect[0]
    if path == "gluon":
        assert (cfg.gluon_operands, cfg.block_n, cfg.num_warps, cfg.e4m3_epilogue) == expect[1:]
    elif path == "fma":
        assert (cfg.block_n, cfg.num_warps, cfg.e4m3_epilogue) == expect[2:]
    monkeypatch.setattr(gluon_mla_query, "AVAILABLE", False)  # an older Triton
    assert not selection.launch_config(h, m, fmt, out_fp8, pdl=False).gluon


def test_the_interpreter_never_gets_gluon():
    if not common.interpreting():
        pytest.skip("runs where the CPU suite runs: under TRITON_INTERPRET=1")
    for fmt in ("bf16", "mxfp8"):
        for out_fp8 in (False, True):
            for m in (1, 2, 16, 32):
                assert not selection.launch_config(8, m, fmt, out_fp8).gluon
