"""The vLLM decode hook on a CUDA GPU, without vLLM (the H200 image has none).

The tensors are laid out exactly as ``MLAAttention.forward_impl`` holds them: ``W_UK_T`` is
``W_UK.permute(1, 2, 0)`` of a ``kv_b_proj``-shaped weight (a strided view), ``mqa_q_nope``
the ``transpose(0, 1)`` of a slice of ``q``, ``mqa_q_pe`` the other slice; outputs go to a
fresh contiguous buffer or a pitched workspace. The oracle is vLLM 0.32's staged code,
transcribed in ``fusedq_cases.staged_decode_query``, and ``fusedq.staged_mla_query``.

Run on the H200: ``pytest -m gpu tests/fusedq/test_vllm_hook_gpu.py``.
"""

from __future__ import annotations

import types

import pytest
import torch
from fusedq_cases import E4M3, Q_SCALE, assert_matches, poison, staged_decode_query

import fusedq
from fusedq.vllm import hook, layer_plan
from fusedq.vllm.query import decode_query, mxfp8_w_uk_t

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

P, R, L, V = 192, 64, 512, 128
HEADS = (8, 11, 16)
MS = (1, 2, 3, 7, 16, 17, 31, 32)
# vLLM's default CUDA-graph capture sizes up to the fused range (1, 2, 4, then steps of 8).
CAPTURE_SIZES = (1, 2, 4, 8, 16, 24, 32)


def kv_b_proj_weight(h: int, gen: torch.Generator) -> torch.Tensor:
    return (torch.randn(h * (P + V), L, generator=gen) * 0.05).to(torch.bfloat16).cuda()


def vllm_w_uk_t(weight: torch.Tensor, h: int) -> torch.Tensor:
    w_uk, _ = weight.T.view(L, h, P + V).split([P, V], dim=-1)
    return w_uk.permute(1, 2, 0)


def mxfp8_kv_b_proj(h: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    rows = h * (P + V)
    values = (torch.randn(rows, L, generator=gen) * 64).clamp(-448, 448).to(E4M3)
    scales = torch.randint(115, 125, (rows, L // 32), generator=gen, dtype=torch.uint8)
    return values.cuda(), scales.cuda()


def bf16_of(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    factors = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    return (values.float() * factors).to(torch.bfloat16)


def q_buffer(m: int, h: int, gen: torch.Generator) -> torch.Tensor:
    return torch.randn(m, h, P + R, generator=gen).to(torch.bfloat16).cuda()


def vllm_views(q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    q_nope, q_pe = q.split([P, R], dim=-1)
    return q_nope.transpose(0, 1), q_pe


def staged(q: torch.Tensor, w_uk_t: torch.Tensor, q_scale) -> torch.Tensor:
    """vLLM's staged query for ``q``, concatenated when vLLM hands on a pair."""
    q_nope, q_pe = vllm_views(q)
    result = staged_decode_query(q_nope, w_uk_t, q_pe, q_scale=q_scale)
    return torch.cat(result, dim=-1) if isinstance(result, tuple) else result


def fused(q: torch.Tensor, weight, **kwargs):
    """The hook on vLLM's views of ``q``."""
    q_nope, q_pe = vllm_views(q)
    return decode_query(q_nope, weight, q_pe, **kwargs)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, E4M3], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("h", HEADS)
def test_decode_query_matches_staged_on_cuda(h, m, out_dtype):
    gen = torch.Generator().manual_seed(h * 1000 + m)
    w_uk_t = vllm_w_uk_t(kv_b_proj_weight(h, gen), h)
    q = q_buffer(m, h, gen)
    q_scale = torch.tensor([Q_SCALE], device="cuda") if out_dtype == E4M3 else None
    got = fused(q, w_uk_t, out_dtype=out_dtype, q_scale=q_scale)
    assert got is not None and got.is_contiguous() and got.shape == (m, h, L + R)
    # E4M3 is compared with the rounding of the staged BF16 query (assert_matches), which is
    # what vLLM's own E4M3 query is.
    assert_matches(got, staged(q, w_uk_t, None), "bf16", q_scale)
    if q_scale is not None:
        assert_matches(staged(q, w_uk_t, q_scale), staged(q, w_uk_t, None), "bf16", q_scale)
    q_nope, q_pe = vllm_views(q)
    ref = fusedq.staged_mla_query(q_nope.transpose(0, 1), w_uk_t, q_pe)
    assert_matches(got, ref, "bf16", q_scale)


@pytest.mark.parametrize("h,m", [(8, 1), (11, 17), (16, 32)])
def test_decode_query_into_a_pitched_workspace(h, m):
    gen = torch.Generator().manual_seed(11)
    w_uk_t = vllm_w_uk_t(kv_b_proj_weight(h, gen), h)
    q = q_buffer(m, h, gen)
    workspace = poison(torch.empty(m, h + 2, 1024, dtype=torch.bfloat16, device="cuda"))
    out = workspace[:, 1 : h + 1, 128 : 128 + L + R]
    got = fused(q, w_uk_t, out=out)
    assert got.data_ptr() == out.data_ptr()
    assert_matches(got, staged(q, w_uk_t, None), "bf16")
    assert workspace[:, 0].isnan().all() and workspace[:, h + 1].isnan().all()
    assert workspace[..., :128].isnan().all() and workspace[..., 128 + L + R :].isnan().all()


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, E4M3], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("h,m", [(8, 1), (11, 7), (16, 32)])
def test_native_mxfp8_w_uk_matches_the_dequantised_path(h, m, out_dtype):
    gen = torch.Generator().manual_seed(h + m)
    values, scales = mxfp8_kv_b_proj(h, gen)
    wq = mxfp8_w_uk_t(values, scales, num_heads=h, v_head_dim=V)
    q = q_buffer(m, h, gen)
    q_scale = torch.tensor([Q_SCALE], device="cuda") if out_dtype == E4M3 else None
    got = fused(q, wq, out_dtype=out_dtype, q_scale=q_scale)
    assert got is not None
    # What vLLM builds today: kv_b_proj dequantised to bf16, then W_UK_T as a view.
    ref = staged(q, vllm_w_uk_t(bf16_of(values, scales), h), None)
    assert_matches(got, ref, "mxfp8", q_scale)


def test_declines_unqualified_steps_on_cuda():
    gen = torch.Generator().manual_seed(2)
    w_uk_t = vllm_w_uk_t(kv_b_proj_weight(4, gen), 4)
    assert fused(q_buffer(2, 4, gen), w_uk_t) is None
    w_uk_t = vllm_w_uk_t(kv_b_proj_weight(8, gen), 8)
    assert fused(q_buffer(33, 8, gen), w_uk_t) is None


def stand_in_layer(h: int, w_uk_t: torch.Tensor, *, fp8: bool) -> types.SimpleNamespace:
    layer = types.SimpleNamespace(
        W_UK_T=w_uk_t,
        _q_scale=torch.tensor(Q_SCALE, device="cuda"),
        impl=types.SimpleNamespace(supports_quant_query_input=fp8),
        layer_name=f"model.layers.0.h{h}",
    )
    layer.__dict__[layer_plan.PLAN_ATTR] = layer_plan.LayerPlan(h, "bf16", None)
    return layer


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("h", HEADS)
def test_cuda_graph_capture_after_prewarm_replays_mutated_inputs(h, fp8):
    """What vLLM's FULL CUDA graphs do with the patched step: prewarm the capture sizes at
    weight-processing time, capture the hook per size (no eager warm-up run first: prewarm
    must be enough), then replay after the inputs and the weight change in place."""
    gen = torch.Generator().manual_seed(h)
    weight = kv_b_proj_weight(h, gen)
    w_uk_t = vllm_w_uk_t(weight, h)
    out_dtype = E4M3 if fp8 else torch.bfloat16
    layer = stand_in_layer(h, w_uk_t, fp8=fp8)
    fusedq.prewarm(w_uk_t, CAPTURE_SIZES, out_dtype=out_dtype)
    torch.cuda.synchronize()

    max_m = max(CAPTURE_SIZES)
    q_static = q_buffer(max_m, h, gen)
    graphs = {}
    pool = torch.cuda.graph_pool_handle()
    for m in CAPTURE_SIZES:
        graph = torch.cuda.CUDAGraph()
        q_nope, q_pe = vllm_views(q_static[:m])
        with torch.cuda.graph(graph, pool=pool):
            # The call the patched forward_impl makes (fp8_attention=fp8, no DCP q-replicate).
            query = hook.decode_query_hook(layer, q_nope, q_pe, False, fp8)
        assert query is not None and query.dtype == out_dtype
        graphs[m] = (graph, query)

    for step in range(2):
        q_static.copy_(q_buffer(max_m, h, gen))
        weight.mul_(-1.5 if step else 0.5)  # W_UK_T is a view: the graph must read it live
        q_scale = layer._q_scale.view(1) if fp8 else None
        for m, (graph, query) in graphs.items():
            graph.replay()
            torch.cuda.synchronize()
            assert_matches(query, staged(q_static[:m], w_uk_t, None), "bf16", q_scale)


def test_capture_without_prewarm_fails_loudly_and_prewarm_fixes_it(monkeypatch):
    """A variant that was never compiled is not compiled mid-capture: the call raises a
    RuntimeError naming prewarm. The registry of compiled variants is emptied first, so the
    variant is new whatever ran before. After fusedq.prewarm the same capture works and its
    replay reads new inputs."""
    from fusedq import dispatch
    from fusedq.kernels import triton_launch as kernel

    h, m = 11, 5
    gen = torch.Generator().manual_seed(99)
    # A generic-layout weight (no unit stride) that the other tests never use.
    w = (torch.randn(h, P, 2 * L, generator=gen) * 0.05).to(torch.bfloat16).cuda()[..., ::2]
    q = q_buffer(m, h, gen)
    monkeypatch.setattr(kernel, "_compiled", set())
    dispatch.clear_plans()
    try:
        graph = torch.cuda.CUDAGraph()
        with pytest.raises(RuntimeError, match=r"fusedq\.prewarm"), torch.cuda.graph(graph):
            fused(q, w)
        assert fusedq.prewarm(w, [m]) > 0
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            query = fused(q, w)
        q.copy_(q_buffer(m, h, gen))
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(query, staged(q, w, None), "bf16")
    finally:
        dispatch.clear_plans()  # no plan bound against the emptied registry outlives the test


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_prewarm_compiles_what_the_hook_binds(monkeypatch, backend):
    """The hook's prewarm compiles the CuTe variants only where its calls can bind them
    (``BACKEND="auto"``); with the default ``"triton"`` it compiles the Triton variants alone,
    which a capture then runs without compiling."""
    from fusedq import capability, dispatch
    from fusedq.kernels import cute_mla_query
    from fusedq.kernels import triton_launch as kernel
    from fusedq.vllm import query

    if capability.cute_problem("bf16", torch.bfloat16) is not None:
        pytest.skip("the CuTe DSL kernel cannot run here: nothing to tell apart")
    h = 16
    gen = torch.Generator().manual_seed(7)
    w = vllm_w_uk_t(kv_b_proj_weight(h, gen), h)
    monkeypatch.setattr(query, "BACKEND", backend)
    monkeypatch.setattr(kernel, "_compiled", set())
    monkeypatch.setattr(cute_mla_query, "_compiled", {})
    dispatch.clear_plans()
    try:
        assert query.prewarm(w, [1, 2, 4], out_dtype=torch.bfloat16) > 0
        assert bool(cute_mla_query._compiled) == (backend == "auto")
        q = q_buffer(2, h, gen)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = fused(q, w)
        graph.replay()
        torch.cuda.synchronize()
        assert_matches(out, staged(q, w, None), "bf16")
    finally:
        dispatch.clear_plans()
