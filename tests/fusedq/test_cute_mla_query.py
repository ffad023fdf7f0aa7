"""The CuTe DSL MXFP8 kernel against the staged reference (GPU), and its offline trace (CPU).

nvidia-cutlass-dsl is not a CI dependency: without it both tests skip and say so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import sass_scoreboard as sass
import torch
from fusedq_cases import (
    E4M3,
    Q_SCALE,
    TIE_SCALE,
    assert_matches,
    make_out,
    make_q,
    make_weight,
    poison,
    split_values,
)

import fusedq
from fusedq.kernels import cute_mla_query as cute

HEADS = (8, 11, 16)
MS = (1, 2, 3, 4, 8, 16, 31, 32)
OUT_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(E4M3, id="e4m3")]


def _needs_cute() -> None:
    reason = cute.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def _q_scale(out_dtype: torch.dtype, device) -> torch.Tensor | None:
    return torch.tensor([Q_SCALE], device=device) if out_dtype == E4M3 else None


def _check(h: int, m: int, w: torch.Tensor, q_nope, q_pe, device, out_dtype=torch.bfloat16):
    wq = fusedq.quantize_mxfp8(w)
    q_scale = _q_scale(out_dtype, device)
    out, buf = make_out(m, h, out_dtype, device, pitched=True)
    cute.launch(q_nope, wq.values, wq.scales, q_pe, out, q_scale)
    torch.cuda.synchronize()
    ref = fusedq.staged_mla_query(q_nope, wq, q_pe, out_dtype=out_dtype, q_scale=q_scale)
    assert_matches(out, ref, "mxfp8")
    # The pitch's spare head and columns stay poisoned: nothing written outside out.
    buf = buf.float()
    assert buf[:, h:].isnan().all() and buf[..., 576:].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("h", HEADS)
def test_matches_staged(h, m, out_dtype, device):
    # E4M3 at Q_SCALE: the largest outputs exceed 448, so the clamp is exercised too.
    _needs_cute()
    gen = torch.Generator().manual_seed(1000 * h + m)
    w = make_weight(h, "vllm", device, gen)
    q_nope, q_pe = make_q(m, h, device, gen)
    _check(h, m, w, q_nope, q_pe, device, out_dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("h,m", [(8, 1), (16, 2), (11, 32)])
def test_e4m3_rounds_as_vllm(h, m, device):
    """Values where x * (1/s) and x / s quantise differently, in both parts: q_pe holds them
    (the RoPE part), and q_nope holds one per (row, head) in column 5 against a weight whose
    row 5 is all ones (every other q_nope element 0), so the fp32 sum is the value itself.
    The kernel must round every one as vLLM does (one reciprocal, then multiplies)."""
    _needs_cute()
    x = split_values()
    assert len(x) >= 32, "no discriminating values: the test would pass either way"
    gen = torch.Generator().manual_seed(28)
    w = make_weight(h, "contiguous", torch.device("cpu"), gen)
    w[:, 5] = 1.0  # exact in MXFP8: each block of row 5 has amax 1
    wq = fusedq.quantize_mxfp8(w.to(device))
    pick = torch.randint(len(x), (m, h, 1 + 64), generator=gen)
    q_nope = torch.zeros(m, h, 192, dtype=torch.bfloat16)
    q_nope[..., 5] = x[pick[..., 0]]
    q_pe = x[pick[..., 1:]]
    q_nope, q_pe = q_nope.to(device), q_pe.to(device)
    s = torch.tensor([TIE_SCALE], device=device)
    out = poison(torch.empty(m, h, 576, dtype=E4M3, device=device))
    cute.launch(q_nope, wq.values, wq.scales, q_pe, out, s)
    torch.cuda.synchronize()
    vals = torch.cat([q_nope[..., 5:6].expand(m, h, 512), q_pe], dim=-1).float().cpu()
    want = (vals * s.cpu().reciprocal()).clamp(-448, 448).to(E4M3)
    divided = (vals / s.cpu()).clamp(-448, 448).to(E4M3)
    assert not torch.equal(want.view(torch.uint8), divided.view(torch.uint8))
    assert torch.equal(out.cpu().view(torch.uint8), want.view(torch.uint8))
    ref = fusedq.staged_mla_query(q_nope, wq, q_pe, out_dtype=E4M3, q_scale=s)
    assert torch.equal(out.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.gpu
def test_scale_bytes_past_127(device):
    # Weights ~2^16 larger get E8M0 bytes >= 128 (the test weights above stay near 116):
    # a byte read sign-extended would turn them into huge or negative factors.
    _needs_cute()
    h, m = 8, 4
    gen = torch.Generator().manual_seed(7)
    w = (make_weight(h, "contiguous", device, gen).float() * 2.0**16).bfloat16()
    assert (fusedq.quantize_mxfp8(w).scales >= 128).any()
    q_nope, q_pe = make_q(m, h, device, gen)
    q = torch.cat([q_nope * 2.0**-16, q_pe], dim=-1)  # outputs stay O(1); exact scaling
    _check(h, m, w, q[..., :192], q[..., 192:], device)


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_graph_replay_reads_new_inputs(out_dtype, device):
    # E4M3: q_scale too is read on the device at each replay, not baked in at capture.
    _needs_cute()
    h, m = 16, 3
    gen = torch.Generator().manual_seed(3)
    wq = fusedq.quantize_mxfp8(make_weight(h, "vllm", device, gen))
    q_nope, q_pe = make_q(m, h, device, gen)
    q_scale = _q_scale(out_dtype, device)
    out, _ = make_out(m, h, out_dtype, device, pitched=False)
    cute.launch(q_nope, wq.values, wq.scales, q_pe, out, q_scale)  # compiles outside capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute.launch(q_nope, wq.values, wq.scales, q_pe, out, q_scale)
    q_nope.copy_(torch.randn_like(q_nope))
    q_pe.copy_(torch.randn_like(q_pe))
    if q_scale is not None:
        q_scale.fill_(0.0125)
    graph.replay()
    torch.cuda.synchronize()
    ref = fusedq.staged_mla_query(q_nope, wq, q_pe, out_dtype=out_dtype, q_scale=q_scale)
    assert_matches(out, ref, "mxfp8")


def test_unsupported_operands_are_named():
    values = torch.zeros(8, 192, 512, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(8, 192, 16, dtype=torch.uint8)
    q = torch.zeros(4, 8, 256, dtype=torch.bfloat16)
    out = torch.zeros(4, 8, 576, dtype=torch.bfloat16)
    args = (q[..., :192], values, scales, q[..., 192:], out)
    assert "not a CUDA device" in cute.unsupported_reason(*args)
    assert cute.unsupported_reason(*args[:4], out.float()) == (
        "out: dtype torch.float32 is not bfloat16 or float8_e4m3fn"
    )
    assert "not contiguous" in cute.unsupported_reason(
        args[0], values.transpose(1, 2).contiguous().transpose(1, 2), *args[2:]
    )
    big = torch.zeros(33, 8, 256, dtype=torch.bfloat16)
    assert "M=33" in cute.unsupported_reason(big[..., :192], values, scales, big[..., 192:], out)
    with pytest.raises(ValueError, match="not a CUDA device"):
        cute.launch(*args)


def test_e4m3_out_is_accepted_with_16_byte_strides():
    # E4M3 out passes every operand check (only the CPU device, q_nope first, is refused); its
    # strides are 1-byte elements, so a row pitch of 592 is 16-byte aligned and 584 is not.
    values = torch.zeros(8, 192, 512, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(8, 192, 16, dtype=torch.uint8)
    q = torch.zeros(4, 8, 256, dtype=torch.bfloat16)
    ins = (q[..., :192], values, scales, q[..., 192:])
    for width in (576, 592):
        out = torch.zeros(4, 8, width, dtype=E4M3)[..., :576]
        assert cute.unsupported_reason(*ins, out) == "q_nope: on cpu, not a CUDA device"
    out = torch.zeros(4, 8, 584, dtype=E4M3)[..., :576]
    assert "out: pointer or strides (4672, 584, 1) are not 16-byte aligned" in (
        cute.unsupported_reason(*ins, out)
    )
    # launch's q_scale rules: one fp32 element for E4M3 out, none for BF16.
    out = torch.zeros(4, 8, 576, dtype=E4M3)
    assert "q_scale: a one-element float32 tensor is required" in cute._q_scale_reason(out, None)
    assert "must be one float32 element" in cute._q_scale_reason(out, torch.ones(2))
    assert cute._q_scale_reason(out, torch.ones(1)) is None
    assert "must be None for bfloat16" in cute._q_scale_reason(out.bfloat16(), torch.ones(1))


def test_e4m3_variant_is_bound_and_prewarmed_apart(monkeypatch):
    """An E4M3 out binds (dispatch) and prewarms (fusedq.prewarm) the E4M3 variant, under its
    own key: a compiled BF16 variant of the same heads and bucket does not stand in for it."""
    from fusedq import api, dispatch
    from fusedq.kernels import triton_mla_query

    calls = []
    monkeypatch.setattr(cute, "prewarm", lambda *a, **k: calls.append((a, k)) or 1)
    monkeypatch.setattr(cute, "unsupported_reason", lambda *a: None)
    monkeypatch.setattr(dispatch, "kernel_choice", lambda *a, **k: ("cute", "measured faster"))
    gen = torch.Generator().manual_seed(5)
    cpu = torch.device("cpu")
    wq = fusedq.quantize_mxfp8(make_weight(8, "vllm", cpu, gen))
    q_nope, q_pe = make_q(1, 8, cpu, gen)
    out = torch.empty(1, 8, 576, dtype=E4M3)
    bound = dispatch._cute_or(object(), "auto", (q_nope, wq.values, wq.scales, q_pe, out), False)
    assert isinstance(bound, cute.BoundCute)
    assert bound.key == (8, 1, 0, cute.E4M3_TAG) != cute.variant_key(8, 1, 0, False)
    assert calls == [((8, 1, cpu), {"out_fp8": True})]
    calls.clear()
    monkeypatch.setattr(api, "kernel_choice", lambda *a, **k: ("cute", "measured faster"))
    monkeypatch.setattr(triton_mla_query, "prewarm", lambda *a, **k: 0)
    assert fusedq.prewarm(wq, [1], out_dtype=E4M3) == 1
    assert calls == [((8, 1, cpu), {"out_fp8": True})]


def test_m_buckets():
    assert [cute.m_bucket(m) for m in (1, 2, 3, 5, 9, 17, 32)] == [1, 2, 4, 8, 16, 32, 32]
    with pytest.raises(ValueError, match="M=33"):
        cute.m_bucket(33)


def _compile_offline(
    h: int, bucket: int, env: dict[str, str], out_fp8: bool = False
) -> subprocess.CompletedProcess:
    # A fresh process, because the DSL reads its environment once, at import.
    if cute._import_reason() is not None:
        pytest.skip(cute._import_reason())
    code = (
        "from fusedq.kernels import cute_mla_query as c; "
        f"c.compile_variant({h}, {bucket}, out_fp8={out_fp8}, device=False)"
    )
    env = {**env, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("out_fp8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("h,bucket", [(11, 4), (16, 32)])
def test_offline_trace(h, bucket, out_fp8):
    # CUTE_DSL_DRYRUN traces the kernel to IR without a GPU: DSL authoring errors (types,
    # layouts, dynamic control flow) surface here.
    proc = _compile_offline(h, bucket, cute.dry_run_env(), out_fp8)
    assert proc.returncode == 0, proc.stderr[-3000:]


LD_GLOBAL = re.compile(r"^\s*ld\.global\S*\s+(\{[^}]*\}|%\w+)")
# The reciprocal of q_scale, correctly rounded: NVPTX writes fdiv 1.0, x as rcp.rn.f32 (the
# same value as div.rn.f32 1.0, x); an approximate form (rcp.approx, div.approx/full) would
# differ from vLLM's 1.0f / scale.
RECIPROCAL = re.compile(r"\b(?:div|rcp)\.rn\.f32\b")
APPROX_DIVISION = re.compile(r"\b(?:div|rcp)\.(?:approx|full)\b")
E4M3_CVT = re.compile(r"\bcvt\.rn\.satfinite\.e4m3x2\.f32\b")


@pytest.mark.parametrize("out_fp8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("h,bucket", [(8, 1), (16, 32)])
def test_ptx_issues_every_load_before_any_use(h, bucket, out_fp8, tmp_path):
    # The design's point, checked in the PTX the DSL generates (it writes the PTX before it
    # needs a driver, so this runs on a machine without a GPU too): no register loaded from
    # global memory is read before the kernel's last global load is issued, and no shared
    # store or barrier comes before it either.
    env = {**cute.dry_run_env(), "CUTE_DSL_KEEP_PTX": "1", "CUTE_DSL_DUMP_DIR": str(tmp_path)}
    del env["CUTE_DSL_DRYRUN"]
    proc = _compile_offline(h, bucket, env, out_fp8)
    ptx_files = list(tmp_path.glob("*.ptx"))
    assert ptx_files, proc.stderr[-3000:]
    lines = ptx_files[0].read_bytes().replace(b"\0", b"").decode().splitlines()
    loads = [(i, m.group(1)) for i, line in enumerate(lines) if (m := LD_GLOBAL.match(line))]
    # weight vectors, scale bytes, q and q_pe vectors; E4M3 out: and q_scale, one fp32 load
    assert len(loads) >= 4 + 4 + 2 + out_fp8
    assert sum(bool(re.match(r"\s*ld\.global\.f32\s", lines[i])) for i, _ in loads) == out_fp8
    last = loads[-1][0]
    for i, dest in loads:
        for reg in re.findall(r"%\w+", dest):
            used = [j for j in range(i + 1, last) if re.search(rf"{reg}\b", lines[j])]
            assert not used, f"{reg} loaded at PTX line {i} is read at {used[0]}: {lines[used[0]]}"
    first_sync = next(i for i, line in enumerate(lines) if re.match(r"\s*(st\.shared|bar)", line))
    assert last < first_sync, f"global load at PTX line {last} after line {first_sync}"
    text = "\n".join(lines)
    # E4M3: one reciprocal per thread (after the loads: q_scale is one of them), then only
    # multiplies; the conversions are the hardware's round-to-nearest-even E4M3 cvt. BF16
    # has neither. From two token rows (q loaded per thread, not staged) one more reciprocal,
    # of M: the scheduling fence.
    fence = bucket > 1
    assert len(RECIPROCAL.findall(text)) == out_fp8 + fence, RECIPROCAL.findall(text)
    assert all(i > last for i, line in enumerate(lines) if RECIPROCAL.search(line))
    assert not APPROX_DIVISION.search(text)
    assert bool(E4M3_CVT.search(text)) == out_fp8


def _product_variants() -> list[tuple[int, int, bool]]:
    from fusedq.capability import CUTE_MAX_M

    buckets = sorted({cute.m_bucket(m) for m in range(1, CUTE_MAX_M + 1)})
    return [(h, bucket, out_fp8) for h in (8, 16) for bucket in buckets for out_fp8 in (0, 1)]


@pytest.mark.parametrize("h,bucket,out_fp8", _product_variants())
def test_sass_issues_every_load_before_waiting_on_any(h, bucket, out_fp8, tmp_path):
    # What ptxas makes of that PTX (tests/fusedq/sass_scoreboard.py), in every variant the
    # product runs (M <= CUTE_MAX_M): no wait on a global load's data before the last global
    # load is issued. The 1-row E4M3 variant failed this while q_scale's reciprocal sat next
    # to the loads (ptxas waited for q_scale before the weight loads: 0.1-0.3 us slower); the
    # 2-row variants while they staged q through shared memory (its stores and the
    # dequantisation moved above the last loads), and, loading q per thread, without the
    # fence (three of four weight rows' loads sunk below the first row's FMAs).
    if sass.triton_bin("ptxas") is None:
        pytest.skip("Triton bundles no ptxas here")
    env = {**cute.dry_run_env(), "CUTE_DSL_KEEP_PTX": "1", "CUTE_DSL_DUMP_DIR": str(tmp_path)}
    del env["CUTE_DSL_DRYRUN"]
    proc = _compile_offline(h, bucket, env, out_fp8)
    ptx_files = list(tmp_path.glob("*.ptx"))
    assert ptx_files, proc.stderr[-3000:]
    ptx = tmp_path / "kernel.ptx"
    ptx.write_bytes(ptx_files[0].read_bytes().replace(b"\0", b""))
    instructions = sass.parse(sass.ptx_sass(ptx))
    assert sum(i.is_global_load for i in instructions) >= 4 + 4 + 2 + out_fp8
    waits = sass.early_waits(instructions)
    assert not waits, "\n".join(map(str, waits))


@pytest.mark.gpu
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("m", (1, 2, 3, 4, 5))
def test_public_op_auto_picks_cute_at_small_m(m, out_dtype, device):
    """backend="auto" runs the CuTe kernel for MXFP8 -> BF16 or E4M3 at M <= CUTE_MAX_M (the
    plan's launch is a BoundCute), Triton above; both match the staged path. A misaligned out
    falls back to Triton; backend="cute" refuses it by name."""
    _needs_cute()
    from fusedq import dispatch
    from fusedq.capability import CUTE_MAX_M

    h = 16
    gen = torch.Generator().manual_seed(50 + m)
    wq = fusedq.quantize_mxfp8(make_weight(h, "vllm", device, gen))
    q_nope, q_pe = make_q(m, h, device, gen)
    q_scale = _q_scale(out_dtype, device)

    def run(**kw):
        return fusedq.mla_query_projection(
            q_nope, wq, q_pe, out_dtype=out_dtype, q_scale=q_scale, **kw
        )

    ref = fusedq.staged_mla_query(q_nope, wq, q_pe, out_dtype=out_dtype, q_scale=q_scale)
    dispatch.clear_plans()
    out = run()
    torch.cuda.synchronize()
    assert_matches(out, ref, "mxfp8")
    (plan,) = dispatch._plans.values()
    assert isinstance(plan.launch, cute.BoundCute) == (m <= CUTE_MAX_M)
    if m > CUTE_MAX_M:
        return
    # Eagerly that was the Triton fallback (the CuTe call's host cost); a captured graph runs
    # the CuTe kernel: its replay matches too. No prewarm: the eager call above is the usual
    # warm-up, and binding its signature compiled the CuTe variant (found on the H200: it did
    # not, and the capture raised).
    poison(out)
    graph = torch.cuda.CUDAGraph()
    launched = []
    real = cute.launch_unchecked
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cute, "launch_unchecked", lambda *a: (launched.append(1), real(*a)))
        with torch.cuda.graph(graph):
            run(out=out)
    assert launched == [1]
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, ref, "mxfp8")
    # Lead-in of one element (bf16) or one byte (E4M3): out rows off the 16-byte boundary
    # (same signature's strides).
    buf = torch.empty(1 + m * h * 576, dtype=out_dtype, device=device)
    odd = buf[1:].view(m, h, 576)
    run(out=odd)
    torch.cuda.synchronize()
    assert_matches(odd, ref, "mxfp8")
    # backend="cute": a signature first seen with a misaligned out is refused when its plan is
    # made, one first seen aligned per call (same strides, the address differs).
    with pytest.raises(ValueError, match=r"backend='cute' cannot run this call: out: pointer"):
        run(out=odd, backend="cute")
    dispatch.clear_plans()
    run(out=torch.empty_like(odd), backend="cute")
    with pytest.raises(ValueError, match="backend='cute': an operand's address is not 16-byte"):
        run(out=odd, backend="cute")
    # compiled already: prewarm finds it (no error)
    assert fusedq.prewarm(wq, [m], out_dtype=out_dtype) >= 0
    # A signature first seen inside a capture cannot compile there: the graph runs Triton,
    # with a warning, and is still right.
    dispatch.clear_plans()
    poison(out)
    graph = torch.cuda.CUDAGraph()
    with pytest.MonkeyPatch.context() as mp, pytest.warns(RuntimeWarning, match="Triton kernel"):
        mp.setattr(cute, "_compiled", {})
        mp.setattr(cute, "_warned", set())
        with torch.cuda.graph(graph):
            run(out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, ref, "mxfp8")


@pytest.mark.gpu
def test_prewarm_compiles_the_e4m3_variant(device):
    """fusedq.prewarm for E4M3 out compiles the E4M3 CuTe variant, so a graph captured with
    no eager warm-up runs the CuTe kernel."""
    _needs_cute()
    from fusedq import dispatch
    from fusedq.capability import CUTE_MAX_M

    h, m = 8, CUTE_MAX_M
    gen = torch.Generator().manual_seed(77)
    wq = fusedq.quantize_mxfp8(make_weight(h, "vllm", device, gen))
    q_nope, q_pe = make_q(m, h, device, gen)
    q_scale = _q_scale(E4M3, device)
    out = poison(torch.empty(m, h, 576, dtype=E4M3, device=device))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cute, "_compiled", {})
        dispatch.clear_plans()
        assert fusedq.prewarm(wq, [m], out_dtype=E4M3) >= 1
        assert cute.variant_key(h, cute.m_bucket(m), device.index or 0, True) in cute._compiled
        graph = torch.cuda.CUDAGraph()
        launched = []
        real = cute.launch_unchecked
        mp.setattr(cute, "launch_unchecked", lambda *a: (launched.append(1), real(*a)))
        with torch.cuda.graph(graph):
            fusedq.mla_query_projection(q_nope, wq, q_pe, out=out, q_scale=q_scale)
        graph.replay()
        torch.cuda.synchronize()
    assert launched == [1]
    ref = fusedq.staged_mla_query(q_nope, wq, q_pe, out_dtype=E4M3, q_scale=q_scale)
    assert_matches(out, ref, "mxfp8")
