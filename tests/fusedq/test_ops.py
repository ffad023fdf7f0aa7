"""Custom ops under torch.compile and CUDA graphs; prewarm and the capture guard."""

from __future__ import annotations

import pytest
import torch
from fusedq_cases import E4M3, Q_SCALE, assert_matches, make_out, make_q, make_weight

import fusedq
from fusedq import dispatch
from fusedq.kernels import triton_launch as kernel
from fusedq.kernels import triton_mla_query


@pytest.fixture
def fresh_process(monkeypatch):
    """As in a new process: no kernel variant known to fusedq, no call plan cached (a cached
    plan launches its compiled variants directly, without the capture guard)."""
    monkeypatch.setattr(kernel, "_compiled", set())
    dispatch.clear_plans()


def _operands(device, h=8, m=5, seed=21):
    gen = torch.Generator().manual_seed(seed)
    w = make_weight(h, "vllm", device, gen)
    q_nope, q_pe = make_q(m, h, device, gen)
    return w, q_nope, q_pe


def test_ops_are_registered_with_out_mutated():
    for name in ("mla_query_projection", "staged_mla_query"):
        schema = getattr(torch.ops.fusedq, name).default._schema
        out = next(a for a in schema.arguments if a.name == "out")
        assert out.alias_info is not None and out.alias_info.is_write


@pytest.mark.parametrize("backend", ["triton", "staged"])
def test_compile_fullgraph_cpu_or_gpu(backend, device):
    w, q_nope, q_pe = _operands(device)
    out, _ = make_out(5, 8, torch.bfloat16, device, pitched=True)

    def step(q_nope, q_pe, out):
        return fusedq.mla_query_projection(q_nope, w, q_pe, out=out, backend=backend)

    # Inductor needs a compiler on the host; aot_eager still traces the ops and fakes.
    compiler = "inductor" if device.type == "cuda" else "aot_eager"
    compiled = torch.compile(step, backend=compiler, fullgraph=True)
    got = compiled(q_nope, q_pe, out)
    assert got.data_ptr() == out.data_ptr()
    assert_matches(out, fusedq.staged_mla_query(q_nope, w, q_pe), "bf16")
    q_nope.mul_(-0.5)
    compiled(q_nope, q_pe, out)
    assert_matches(out, fusedq.staged_mla_query(q_nope, w, q_pe), "bf16")


def test_prewarm_counts_new_variants(device, monkeypatch):
    monkeypatch.setattr(kernel, "_compiled", set())
    w, _, _ = _operands(device, h=11)
    first = fusedq.prewarm(w, [1, 2, 4, 8, 16, 32])
    assert first >= 2  # at least one M bucket, q/out rows aligned and not
    assert fusedq.prewarm(w, [1, 2, 4, 8, 16, 32]) == 0
    # M values the fused kernel does not serve fall back to the staged path: nothing to do.
    assert fusedq.prewarm(w, [64]) == 0
    assert fusedq.prewarm(fusedq.quantize_mxfp8(w.contiguous()), [3]) >= 1


@pytest.mark.gpu
@pytest.mark.parametrize("fmt,out_dtype", [("bf16", torch.bfloat16), ("mxfp8", E4M3)])
def test_cuda_graph_replay_sees_mutated_inputs(fmt, out_dtype, fresh_process):
    device = torch.device("cuda")
    h, m = 16, 7
    gen = torch.Generator().manual_seed(5)
    w = make_weight(h, "vllm", device, gen)
    weight = fusedq.quantize_mxfp8(w) if fmt == "mxfp8" else w
    q_nope, q_pe = make_q(m, h, device, gen)
    q_scale = torch.tensor([Q_SCALE], device=device) if out_dtype == E4M3 else None
    out, _ = make_out(m, h, out_dtype, device, pitched=True)
    assert fusedq.prewarm(weight, [m], out_dtype=out_dtype) > 0
    before = kernel.compiled_keys()

    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fusedq.mla_query_projection(
            q_nope, weight, q_pe, out=out, out_dtype=out_dtype, q_scale=q_scale, backend="triton"
        )
    assert kernel.compiled_keys() == before  # nothing compiled mid-capture

    for step in range(3):
        q_nope.copy_(torch.randn(m, h, 192, generator=gen).bfloat16())
        q_pe.copy_(torch.randn(m, h, 64, generator=gen).bfloat16())
        if fmt == "bf16":
            w.copy_((torch.randn(h, 192, 512, generator=gen) * 0.05).bfloat16())
        if q_scale is not None:
            q_scale.fill_(Q_SCALE * (step + 1))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, fusedq.staged_mla_query(q_nope, weight, q_pe), fmt, q_scale)


@pytest.mark.gpu
def test_capture_without_prewarm_raises(fresh_process):
    device = torch.device("cuda")
    w, q_nope, q_pe = _operands(device, h=11, m=3)
    out = torch.empty(3, 11, 576, dtype=torch.bfloat16, device=device)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(RuntimeError, match="prewarm"):  # noqa: SIM117
        with torch.cuda.graph(graph):
            fusedq.mla_query_projection(q_nope, w, q_pe, out=out, backend="triton")
    # Outside capture the same call compiles and runs.
    fusedq.mla_query_projection(q_nope, w, q_pe, out=out, backend="triton")
    assert_matches(out, fusedq.staged_mla_query(q_nope, w, q_pe), "bf16")


@pytest.mark.gpu
def test_staged_path_captures(monkeypatch):
    device = torch.device("cuda")
    w, q_nope, q_pe = _operands(device, h=12, m=3)  # unqualified H: auto runs staged
    out = torch.empty(3, 12, 576, dtype=torch.bfloat16, device=device)
    fusedq.mla_query_projection(q_nope, w, q_pe, out=out)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fusedq.mla_query_projection(q_nope, w, q_pe, out=out)
    q_nope.mul_(2)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fusedq.staged_mla_query(q_nope, w, q_pe))


@pytest.mark.gpu
def test_pdl_chain_in_a_graph_replays_correctly():
    """Back-to-back PDL launches (weights prefetched before griddepcontrol.wait) in a graph,
    the second reading what the first wrote into q: the wait must order them."""
    if not triton_mla_query.HAS_PDL:
        pytest.skip("this Triton has no griddepcontrol")
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(9)
    h, m = 16, 4
    w = make_weight(h, "vllm", device, gen)
    q_nope, q_pe = make_q(m, h, device, gen)
    out1 = torch.empty(m, h, 576, dtype=torch.bfloat16, device=device)
    out2 = torch.empty_like(out1)
    config = kernel.LaunchConfig(block_m=16, block_n=32, pdl=True)

    def chain():
        kernel.launch(q_nope, w, None, q_pe, out1, None, config=config)
        # The second call's q is the first call's output: a true dependency.
        kernel.launch(out1[..., :192], w, None, out1[..., 512:], out2, None, config=config)

    chain()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        chain()
    q_nope.copy_(torch.randn(m, h, 192, generator=gen).bfloat16())
    graph.replay()
    torch.cuda.synchronize()
    ref1 = fusedq.staged_mla_query(q_nope, w, q_pe)
    assert_matches(out1, ref1, "bf16")
    ref2 = fusedq.staged_mla_query(out1[..., :192], w, out1[..., 512:])
    assert_matches(out2, ref2, "bf16")
