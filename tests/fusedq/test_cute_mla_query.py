"""The CuTe DSL MXFP8 kernel against the staged reference (GPU), and its offline trace (CPU).

nvidia-cutlass-dsl is not a CI dependency: without it both tests skip and say so.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from fusedq_cases import assert_matches, make_out, make_q, make_weight

import fusedq
from fusedq.kernels import cute_mla_query as cute

HEADS = (8, 11, 16)
MS = (1, 2, 3, 4, 8, 16, 31, 32)


def _needs_cute() -> None:
    reason = cute.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def _check(h: int, m: int, w: torch.Tensor, q_nope, q_pe, device) -> None:
    wq = fusedq.quantize_mxfp8(w)
    out, buf = make_out(m, h, torch.bfloat16, device, pitched=True)
    cute.launch(q_nope, wq.values, wq.scales, q_pe, out)
    torch.cuda.synchronize()
    assert_matches(out, fusedq.staged_mla_query(q_nope, wq, q_pe), "mxfp8")
    # The pitch's spare head and columns stay poisoned: nothing written outside out.
    assert buf[:, h:].isnan().all() and buf[..., 576:].isnan().all()


@pytest.mark.gpu
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("h", HEADS)
def test_matches_staged(h, m, device):
    _needs_cute()
    gen = torch.Generator().manual_seed(1000 * h + m)
    w = make_weight(h, "vllm", device, gen)
    q_nope, q_pe = make_q(m, h, device, gen)
    _check(h, m, w, q_nope, q_pe, device)


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
def test_graph_replay_reads_new_inputs(device):
    _needs_cute()
    h, m = 16, 3
    gen = torch.Generator().manual_seed(3)
    wq = fusedq.quantize_mxfp8(make_weight(h, "vllm", device, gen))
    q_nope, q_pe = make_q(m, h, device, gen)
    out, _ = make_out(m, h, torch.bfloat16, device, pitched=False)
    cute.launch(q_nope, wq.values, wq.scales, q_pe, out)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        cute.launch(q_nope, wq.values, wq.scales, q_pe, out)
    q_nope.copy_(torch.randn_like(q_nope))
    q_pe.copy_(torch.randn_like(q_pe))
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, fusedq.staged_mla_query(q_nope, wq, q_pe), "mxfp8")


def test_unsupported_operands_are_named():
    values = torch.zeros(8, 192, 512, dtype=torch.float8_e4m3fn)
    scales = torch.zeros(8, 192, 16, dtype=torch.uint8)
    q = torch.zeros(4, 8, 256, dtype=torch.bfloat16)
    out = torch.zeros(4, 8, 576, dtype=torch.bfloat16)
    args = (q[..., :192], values, scales, q[..., 192:], out)
    assert "not a CUDA device" in cute.unsupported_reason(*args)
    assert "is not bfloat16" in cute.unsupported_reason(*args[:4], out.float())
    assert "not contiguous" in cute.unsupported_reason(
        args[0], values.transpose(1, 2).contiguous().transpose(1, 2), *args[2:]
    )
    big = torch.zeros(33, 8, 256, dtype=torch.bfloat16)
    assert "M=33" in cute.unsupported_reason(big[..., :192], values, scales, big[..., 192:], out)
    with pytest.raises(ValueError, match="not a CUDA device"):
        cute.launch(*args)


def test_m_buckets():
    assert [cute.m_bucket(m) for m in (1, 2, 3, 5, 9, 17, 32)] == [1, 2, 4, 8, 16, 32, 32]
    with pytest.raises(ValueError, match="M=33"):
        cute.m_bucket(33)


def _compile_offline(h: int, bucket: int, env: dict[str, str]) -> subprocess.CompletedProcess:
    # A fresh process, because the DSL reads its environment once, at import.
    if cute._import_reason() is not None:
        pytest.skip(cute._import_reason())
    code = (
        "from fusedq.kernels import cute_mla_query as c; "
        f"c.compile_variant({h}, {bucket}, device=False)"
    )
    env = {**env, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize("h,bucket", [(11, 4), (16, 32)])
def test_offline_trace(h, bucket):
    # CUTE_DSL_DRYRUN traces the kernel to IR without a GPU: DSL authoring errors (types,
    # layouts, dynamic control flow) surface here.
    proc = _compile_offline(h, bucket, cute.dry_run_env())
    assert proc.returncode == 0, proc.stderr[-3000:]


LD_GLOBAL = re.compile(r"^\s*ld\.global\S*\s+(\{[^}]*\}|%\w+)")


@pytest.mark.parametrize("h,bucket", [(8, 1), (16, 32)])
def test_ptx_issues_every_load_before_any_use(h, bucket, tmp_path):
    # The design's point, checked in the PTX the DSL generates (it writes the PTX before it
    # needs a driver, so this runs on a machine without a GPU too): no register loaded from
    # global memory is read before the kernel's last global load is issued.
    env = {**cute.dry_run_env(), "CUTE_DSL_KEEP_PTX": "1", "CUTE_DSL_DUMP_DIR": str(tmp_path)}
    del env["CUTE_DSL_DRYRUN"]
    proc = _compile_offline(h, bucket, env)
    ptx_files = list(tmp_path.glob("*.ptx"))
    assert ptx_files, proc.stderr[-3000:]
    lines = ptx_files[0].read_bytes().replace(b"\0", b"").decode().splitlines()
    loads = [(i, m.group(1)) for i, line in enumerate(lines) if (m := LD_GLOBAL.match(line))]
    assert len(loads) >= 4 + 4 + 2  # weight vectors, scale bytes, q and q_pe vectors
    last = loads[-1][0]
    for i, dest in loads:
        for reg in re.findall(r"%\w+", dest):
            used = [j for j in range(i + 1, last) if re.search(rf"{reg}\b", lines[j])]
            assert not used, f"{reg} loaded at PTX line {i} is read at {used[0]}: {lines[used[0]]}"


@pytest.mark.gpu
@pytest.mark.parametrize("m", (1, 2, 3, 4, 5))
def test_public_op_auto_picks_cute_at_small_m(m, device):
    """backend="auto" runs the CuTe kernel for MXFP8 -> BF16 at M <= CUTE_MAX_M (the plan's
    launch is a BoundCute), Triton above; both match the staged path. A misaligned out falls
    back to Triton; backend="cute" refuses it by name."""
    _needs_cute()
    from fusedq import dispatch
    from fusedq.capability import CUTE_MAX_M

    h = 16
    gen = torch.Generator().manual_seed(50 + m)
    wq = fusedq.quantize_mxfp8(make_weight(h, "vllm", device, gen))
    q_nope, q_pe = make_q(m, h, device, gen)
    ref = fusedq.staged_mla_query(q_nope, wq, q_pe)
    dispatch.clear_plans()
    out = fusedq.mla_query_projection(q_nope, wq, q_pe)
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
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    launched = []
    real = cute.launch_unchecked
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(cute, "launch_unchecked", lambda *a: (launched.append(1), real(*a)))
        with torch.cuda.graph(graph):
            fusedq.mla_query_projection(q_nope, wq, q_pe, out=out)
    assert launched == [1]
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, ref, "mxfp8")
    # One element of lead-in: out rows off the 16-byte boundary (same signature's strides).
    buf = torch.empty(1 + m * h * 576, dtype=torch.bfloat16, device=device)
    odd = buf[1:].view(m, h, 576)
    fusedq.mla_query_projection(q_nope, wq, q_pe, out=odd)
    torch.cuda.synchronize()
    assert_matches(odd, ref, "mxfp8")
    # backend="cute": a signature first seen with a misaligned out is refused when its plan is
    # made, one first seen aligned per call (same strides, the address differs).
    with pytest.raises(ValueError, match=r"backend='cute' cannot run this call: out: pointer"):
        fusedq.mla_query_projection(q_nope, wq, q_pe, out=odd, backend="cute")
    dispatch.clear_plans()
    fusedq.mla_query_projection(q_nope, wq, q_pe, out=torch.empty_like(odd), backend="cute")
    with pytest.raises(ValueError, match="backend='cute': an operand's address is not 16-byte"):
        fusedq.mla_query_projection(q_nope, wq, q_pe, out=odd, backend="cute")
    assert fusedq.prewarm(wq, [m]) >= 0  # compiled already: prewarm finds it (no error)
    # A signature first seen inside a capture cannot compile there: the graph runs Triton,
    # with a warning, and is still right.
    dispatch.clear_plans()
    out.fill_(float("nan"))
    graph = torch.cuda.CUDAGraph()
    with pytest.MonkeyPatch.context() as mp, pytest.warns(RuntimeWarning, match="Triton kernel"):
        mp.setattr(cute, "_compiled", {})
        mp.setattr(cute, "_warned", set())
        with torch.cuda.graph(graph):
            fusedq.mla_query_projection(q_nope, wq, q_pe, out=out)
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, ref, "mxfp8")
