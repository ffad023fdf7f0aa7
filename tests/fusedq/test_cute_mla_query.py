"""The CuTe DSL kernel (MXFP8 or bf16 weights) against the staged reference (GPU), and its
offline trace, PTX and SASS (CPU).

nvidia-cutlass-dsl is not a CI dependency: without it both tests skip and say so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
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
from fusedq.dispatch import split_weight
from fusedq.kernels import cute_mla_query as cute
from fusedq_bench import sass

HEADS = (8, 11, 16)
MS = (1, 2, 3, 4, 8, 16, 31, 32)
OUT_DTYPES = [pytest.param(torch.bfloat16, id="bf16"), pytest.param(E4M3, id="e4m3")]
# Weights as the kernel takes them: MXFP8, or bf16 in vLLM's W_UK_T view (rows of 512, the
# head stride spanning V's rows) or contiguous.
WEIGHTS = ("mxfp8", "bf16-vllm", "bf16-contiguous")


def _weight(h: int, weights: str, device, gen: torch.Generator):
    """(the weight the public op takes, its format: the tolerance table's key)."""
    if weights == "mxfp8":
        return fusedq.quantize_mxfp8(make_weight(h, "vllm", device, gen)), "mxfp8"
    return make_weight(h, weights.removeprefix("bf16-"), device, gen), "bf16"


def _needs_cute() -> None:
    reason = cute.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def _q_scale(out_dtype: torch.dtype, device) -> torch.Tensor | None:
    return torch.tensor([Q_SCALE], device=device) if out_dtype == E4M3 else None


def _check(h: int, m: int, wq, q_nope, q_pe, device, out_dtype=torch.bfloat16, fmt: str = "mxfp8"):
    values, scales = split_weight(wq)
    q_scale = _q_scale(out_dtype, device)
    out, buf = make_out(m, h, out_dtype, device, pitched=True)
    cute.launch(q_nope, values, scales, q_pe, out, q_scale)
    torch.cuda.synchronize()
    assert_matches(out, fusedq.staged_mla_query(q_nope, wq, q_pe), fmt, q_scale)
    # The pitch's spare head and columns stay poisoned: nothing written outside out.
    buf = buf.float()
    assert buf[:, h:].isnan().all() and buf[..., 576:].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("weights", WEIGHTS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("h", HEADS)
def test_matches_staged(h, m, out_dtype, weights, device):
    # E4M3 at Q_SCALE: the largest outputs exceed 448, so the clamp is exercised too.
    _needs_cute()
    gen = torch.Generator().manual_seed(1000 * h + m)
    wq, fmt = _weight(h, weights, device, gen)
    q_nope, q_pe = make_q(m, h, device, gen)
    _check(h, m, wq, q_nope, q_pe, device, out_dtype, fmt)


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
    wq = fusedq.quantize_mxfp8(
        (make_weight(h, "contiguous", device, gen).float() * 2.0**16).bfloat16()
    )
    assert (wq.scales >= 128).any()
    q_nope, q_pe = make_q(m, h, device, gen)
    q = torch.cat([q_nope * 2.0**-16, q_pe], dim=-1)  # outputs stay O(1); exact scaling
    _check(h, m, wq, q[..., :192], q[..., 192:], device)


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
    assert_matches(out, fusedq.staged_mla_query(q_nope, wq, q_pe), "mxfp8", q_scale)


def test_only_validated_dsl_releases_run_unless_asked():
    # 4.3.5 and 4.6.0 (vLLM 0.26's pin) ran on the H200; a later release has not
    assert cute.version_reason("4.3.5", override=False) is None
    assert cute.version_reason("4.6.0", override=False) is None
    why = cute.version_reason("4.7.0", override=False)
    assert "nvidia-cutlass-dsl 4.7.0 has not run" in why and "FUSEDQ_CUTE_UNVALIDATED=1" in why
    assert cute.version_reason("4.7.0", override=True) is None
    assert "of unknown version" in cute.version_reason(None, override=False)


def test_an_unvalidated_dsl_is_named_as_the_reason(monkeypatch):
    # The gate sits in unavailable_reason, which explain/kernel_choice/kernel_summary report
    # (a server log's kernels line ends "[CuTe: nvidia-cutlass-dsl 4.7.0 has not run ...]").
    monkeypatch.setattr(cute, "_import_reason", lambda: None)
    monkeypatch.setattr(cute, "dsl_version", lambda: "4.7.0")
    for override, expect in (("", "4.7.0 has not run"), ("1", None)):
        monkeypatch.setenv(cute.UNVALIDATED_ENV, override)
        cute._version_reason.cache_clear()
        try:
            reason = cute.unavailable_reason()
        finally:
            cute._version_reason.cache_clear()
        if expect is None:
            assert reason is None or "4.7.0" not in reason  # (here: no CUDA device)
        else:
            assert expect in reason


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


def test_bf16_weights_take_rows_of_512_with_any_aligned_head_stride():
    """bf16 weights (scales None): vLLM's W_UK_T view and a contiguous weight pass every
    operand check (only the CPU device is refused); a weight with K or no unit stride, a
    misaligned head stride, or fp8 values without scales are named."""
    gen = torch.Generator().manual_seed(9)
    cpu = torch.device("cpu")
    q = torch.zeros(4, 8, 256, dtype=torch.bfloat16)
    out = torch.zeros(4, 8, 576, dtype=torch.bfloat16)

    def reason(w):
        return cute.unsupported_reason(q[..., :192], w, None, q[..., 192:], out)

    for layout in ("vllm", "contiguous"):
        assert reason(make_weight(8, layout, cpu, gen)) == "q_nope: on cpu, not a CUDA device"
    assert "values: strides (192, 1, 1536) are not (any, 512, 1)" in reason(
        make_weight(8, "unit_k", cpu, gen)
    )
    assert "are not (any, 512, 1)" in reason(make_weight(8, "generic", cpu, gen))
    odd = torch.zeros(8 * 192 * 512 + 8 * 4, dtype=torch.bfloat16).as_strided(
        (8, 192, 512), (192 * 512 + 4, 512, 1)
    )
    assert "values: pointer or strides" in reason(odd)
    assert "values: dtype torch.float8_e4m3fn is not bfloat16 (scales is None)" in reason(
        torch.zeros(8, 192, 512, dtype=torch.float8_e4m3fn)
    )


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
    from fusedq.kernels import triton_launch
    from fusedq.selection import Selection, launch_config

    calls = []
    monkeypatch.setattr(cute, "prewarm", lambda *a, **k: calls.append((a, k)) or 1)
    monkeypatch.setattr(cute, "unsupported_reason", lambda *a: None)
    gen = torch.Generator().manual_seed(5)
    cpu = torch.device("cpu")
    wq = fusedq.quantize_mxfp8(make_weight(8, "vllm", cpu, gen))
    q_nope, q_pe = make_q(1, 8, cpu, gen)
    out = torch.empty(1, 8, 576, dtype=E4M3)
    bound = dispatch._bind_cute(object(), "auto", (q_nope, wq.values, wq.scales, q_pe, out), False)
    assert isinstance(bound, cute.BoundCute)
    assert bound.key == (8, 1, 0, cute.E4M3_TAG) != cute.variant_key(8, 1, 0, False)
    assert calls == [((8, 1, cpu), {"out_fp8": True, "bf16_weights": False})]
    calls.clear()
    chosen = Selection("cute", "measured faster", launch_config(8, 1))
    monkeypatch.setattr(api, "select", lambda *a, **k: chosen)
    monkeypatch.setattr(triton_launch, "prewarm", lambda *a, **k: 0)
    assert fusedq.prewarm(wq, [1], out_dtype=E4M3) == 1
    assert calls == [((8, 1, cpu), {"out_fp8": True, "bf16_weights": False})]
    # bf16 weights: their own variant, beside the MXFP8 one of the same heads and bucket
    w = make_weight(8, "vllm", cpu, gen)
    bound = dispatch._bind_cute(object(), "auto", (q_nope, w, None, q_pe, out), False)
    assert bound.key == (8, 1, 0, cute.E4M3_TAG, cute.BF16_WEIGHTS_TAG)
    calls.clear()
    assert fusedq.prewarm(w, [1], out_dtype=E4M3) == 1
    assert calls == [((8, 1, cpu), {"out_fp8": True, "bf16_weights": True})]


def test_m_buckets():
    assert [cute.m_bucket(m) for m in (1, 2, 3, 5, 9, 17, 32)] == [1, 2, 4, 8, 16, 32, 32]
    with pytest.raises(ValueError, match="M=33"):
        cute.m_bucket(33)


def _compile_offline(
    h: int, bucket: int, env: dict[str, str], out_fp8: bool = False, bf16_weights: bool = False
) -> subprocess.CompletedProcess:
    # A fresh process, because the DSL reads its environment once, at import.
    if cute._import_reason() is not None:
        pytest.skip(cute._import_reason())
    code = (
        "from fusedq.kernels import cute_mla_query as c; "
        f"c.compile_variant({h}, {bucket}, out_fp8={out_fp8}, bf16_weights={bf16_weights}, "
        "device=False)"
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
SPLIT = re.compile(r"^\s*mov\.b(?:32|64)\s+(\{[^}]*\}),\s*(%\w+);")
# The reciprocal of q_scale, correctly rounded: NVPTX writes fdiv 1.0, x as rcp.rn.f32 (the
# same value as div.rn.f32 1.0, x); an approximate form (rcp.approx, div.approx/full) would
# differ from vLLM's 1.0f / scale.
RECIPROCAL = re.compile(r"\b(?:div|rcp)\.rn\.f32\b")
APPROX_DIVISION = re.compile(r"\b(?:div|rcp)\.(?:approx|full)\b")
E4M3_CVT = re.compile(r"\bcvt\.rn\.satfinite\.e4m3x2\.f32\b")
# q_scale's load, the one scalar 32-bit global load (weights, scales and q are vectors or bytes)
SCALAR_32 = re.compile(r"\s*ld\.global\.[fb]32\s")


def _keep_env(tmp: Path) -> dict[str, str]:
    # A full compile without a GPU (the DSL writes its PTX and cubin before it needs a
    # driver): KEEP_PTX/KEEP_CUBIN are 4.3's switches, KEEP 4.6's.
    env = {**cute.dry_run_env(), "CUTE_DSL_DUMP_DIR": str(tmp)}
    del env["CUTE_DSL_DRYRUN"]
    return {
        **env,
        "CUTE_DSL_KEEP_PTX": "1",
        "CUTE_DSL_KEEP_CUBIN": "1",
        "CUTE_DSL_KEEP": "ptx,cubin",
    }


@pytest.mark.parametrize("bf16_weights", [False, True], ids=["mxfp8", "bf16w"])
@pytest.mark.parametrize("out_fp8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("h,bucket", [(8, 1), (16, 32)])
def test_ptx_issues_every_load_before_any_use(h, bucket, out_fp8, bf16_weights, tmp_path):
    # The design's point, checked in the PTX the DSL generates (it writes the PTX before it
    # needs a driver, so this runs on a machine without a GPU too): no register loaded from
    # global memory is read before the kernel's last global load is issued, and no shared
    # store or barrier comes before it either.
    proc = _compile_offline(h, bucket, _keep_env(tmp_path), out_fp8, bf16_weights)
    ptx_files = list(tmp_path.glob("*.ptx"))
    assert ptx_files, proc.stderr[-3000:]
    lines = ptx_files[0].read_bytes().replace(b"\0", b"").decode().splitlines()
    loads = [(i, m.group(1)) for i, line in enumerate(lines) if (m := LD_GLOBAL.match(line))]
    # weight vectors, scale bytes (MXFP8), q and q_pe vectors; E4M3 out: and q_scale, one
    # fp32 load
    assert len(loads) >= 4 + 4 * (not bf16_weights) + 2 + out_fp8
    # (nvidia-cutlass-dsl 4.3 writes typed loads, .u8 and .f32; 4.6 untyped ones, .b8 and .b32)
    assert any(re.match(r"\s*ld\.global\S*\.[ub]8\s", lines[i]) for i, _ in loads) != bf16_weights
    assert sum(bool(SCALAR_32.match(lines[i])) for i, _ in loads) == out_fp8
    last = loads[-1][0]
    for i, dest in loads:
        regs = [(reg, i) for reg in re.findall(r"%\w+", dest)]
        while regs:
            reg, at = regs.pop()
            used = [j for j in range(at + 1, last) if re.search(rf"{reg}\b", lines[j])]
            # A register split into halves (bf16 weights: mov.b32 {%rs1, %rs2}, %r25) is no
            # use: ptxas emits no instruction for it. Its halves are followed instead.
            if used and (split := SPLIT.match(lines[used[0]])) and split.group(2) == reg:
                regs += [(half, used[0]) for half in re.findall(r"%\w+", split.group(1))]
                used = used[1:]
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


def _product_variants() -> list[tuple[int, int, int, int]]:
    from fusedq.selection import CUTE_MAX_M

    variants = []
    for bf16_weights in (0, 1):
        limit = CUTE_MAX_M["bf16" if bf16_weights else "mxfp8"]
        buckets = sorted({cute.m_bucket(m) for m in range(1, limit + 1)})
        variants += [
            (h, bucket, out_fp8, bf16_weights)
            for h in (8, 16) for bucket in buckets for out_fp8 in (0, 1)
        ]  # fmt: skip
    return variants


# In the bf16-weight E4M3 variant for one token row, ptxas gives q_pe's head stride (a
# constant-bank load) the scoreboard of q's global load, and q_pe's load waits for q's data.
# Measured as it is, it still beats Triton's E4M3 kernel (docs/decisions/0001-cute-for-small-m.md).
KNOWN_EARLY_BF16W_E4M3_M1 = 1


@pytest.mark.parametrize("h,bucket,out_fp8,bf16_weights", _product_variants())
def test_sass_issues_every_load_before_waiting_on_any(h, bucket, out_fp8, bf16_weights, tmp_path):
    # What ptxas makes of that PTX (fusedq_bench/sass.py), in every variant the
    # product runs (M <= CUTE_MAX_M): no wait on a global load's data before the last global
    # load is issued. The 1-row E4M3 variant failed this while q_scale's reciprocal sat next
    # to the loads (ptxas waited for q_scale before the weight loads); the
    # 2-row variants while they staged q through shared memory (its stores and the
    # dequantisation moved above the last loads), and, loading q per thread, without the
    # fence (three of four weight rows' loads sunk below the first row's FMAs).
    # The SASS read is the DSL's own cubin (what runs), disassembled by Triton's cuobjdump;
    # where the DSL wrote none, its PTX assembled by Triton's ptxas (same figures for 4.3.5).
    if sass.triton_bin("cuobjdump") is None:
        pytest.skip("Triton bundles no cuobjdump here")
    proc = _compile_offline(h, bucket, _keep_env(tmp_path), out_fp8, bf16_weights)
    cubins = list(tmp_path.glob("*.cubin"))
    if cubins:
        text = sass.cubin_sass(cubins[0])
    else:
        ptx_files = list(tmp_path.glob("*.ptx"))
        assert ptx_files, proc.stderr[-3000:]
        if sass.triton_bin("ptxas") is None:
            pytest.skip("Triton bundles no ptxas here")
        ptx = tmp_path / "kernel.ptx"
        ptx.write_bytes(ptx_files[0].read_bytes().replace(b"\0", b""))
        text = sass.ptx_sass(ptx)
    instructions = sass.parse(text)
    assert sum(i.is_global_load for i in instructions) >= 4 + 4 * (not bf16_weights) + 2 + out_fp8
    waits = sass.early_waits(instructions)
    known = KNOWN_EARLY_BF16W_E4M3_M1 if bf16_weights and out_fp8 and bucket == 1 else 0
    # (a known wait that goes away fails too: then the note above is stale)
    assert len(waits) == known, "\n".join(map(str, waits))


@pytest.mark.gpu
@pytest.mark.parametrize("weights", ("mxfp8", "bf16-vllm"))
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
@pytest.mark.parametrize("m", (1, 2, 3, 4, 5))
def test_public_op_auto_picks_cute_at_small_m(m, out_dtype, weights, device):
    """backend="auto" runs the CuTe kernel for MXFP8 or bf16 weights -> BF16 or E4M3 at
    M <= CUTE_MAX_M[format] (the plan's launch is a BoundCute), Triton above; both match the
    staged path. A misaligned out falls back to Triton; backend="cute" refuses it by name."""
    _needs_cute()
    from fusedq import dispatch
    from fusedq.selection import CUTE_MAX_M

    h = 16
    gen = torch.Generator().manual_seed(50 + m)
    wq, fmt = _weight(h, weights, device, gen)
    max_m = CUTE_MAX_M[fmt]
    q_nope, q_pe = make_q(m, h, device, gen)
    q_scale = _q_scale(out_dtype, device)

    def run(**kw):
        return fusedq.mla_query_projection(
            q_nope, wq, q_pe, out_dtype=out_dtype, q_scale=q_scale, **kw
        )

    ref = fusedq.staged_mla_query(q_nope, wq, q_pe)
    dispatch.clear_plans()
    out = run()
    torch.cuda.synchronize()
    assert_matches(out, ref, fmt, q_scale)
    (plan,) = dispatch._plans.values()
    assert isinstance(plan.launch, cute.BoundCute) == (m <= max_m)
    if m > max_m:
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
    assert_matches(out, ref, fmt, q_scale)
    # Lead-in of one element (bf16) or one byte (E4M3): out rows off the 16-byte boundary
    # (same signature's strides).
    buf = torch.empty(1 + m * h * 576, dtype=out_dtype, device=device)
    odd = buf[1:].view(m, h, 576)
    run(out=odd)
    torch.cuda.synchronize()
    assert_matches(odd, ref, fmt, q_scale)
    # backend="cute": a signature first seen with a misaligned out is refused when its plan is
    # made, one first seen aligned per call (same strides, the address differs).
    with pytest.raises(ValueError, match=r"backend='cute' cannot run this call: out: pointer"):
        run(out=odd, backend="cute")
    dispatch.clear_plans()
    run(out=torch.empty_like(odd), backend="cute")
    with pytest.raises(ValueError, match="backend='cute': an operand's address is not 16-byte"):
        run(out=odd, backend="cute")

    # Compiled already (CuTe, and Triton for aligned and misaligned rows): prewarm finds every
    # variant this signature needs and compiles none.
    def no_compile(*args, **kwargs):
        raise AssertionError(f"prewarm compiled a CuTe variant again: {args} {kwargs}")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cute, "compile_variant", no_compile)
        assert fusedq.prewarm(wq, [m], out_dtype=out_dtype) == 0
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
    assert_matches(out, ref, fmt, q_scale)


@pytest.mark.gpu
def test_prewarm_compiles_the_e4m3_variant(device):
    """fusedq.prewarm for E4M3 out compiles the E4M3 CuTe variant, so a graph captured with
    no eager warm-up runs the CuTe kernel."""
    _needs_cute()
    from fusedq import dispatch
    from fusedq.selection import CUTE_MAX_M

    h, m = 8, CUTE_MAX_M["mxfp8"]
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
    assert_matches(out, fusedq.staged_mla_query(q_nope, wq, q_pe), "mxfp8", q_scale)
