"""The served MLA geometries (fusedq.contract.GEOMETRIES): DeepSeek-V3's (qk_nope 128, v_head
128, W_UK_T heads 256 rows of kv_b_proj apart) beside GLM-5's, read from the tensors; the Triton
kernels past the qualified shapes (any H in 1..128, M up to 512, tiled over the grid); and the
gates that keep ``backend="auto"`` and the plugin to the qualified shapes.

Comparisons use the tolerance table (fusedq.reference.TOLERANCES) unchanged: its BF16 bound is
one bf16 ulp after fp32 sums of exact products, whatever the contraction length (128 or 192),
and its atol covers cancellation for qk_nope up to 192. Under the interpreter every case runs on
CPU; the ``gpu`` cases run the same shapes on CUDA (the selection's real kernels)."""

from __future__ import annotations

import re

import pytest
import torch
from fusedq_cases import E4M3, Q_SCALE, W_SCALE, assert_matches, poison
from test_selection import _fake_gpu

import fusedq
from fusedq import capability, contract, dispatch, selection
from fusedq.contract import DEEPSEEK_V3, GLM5, QK_ROPE, QUERY_WIDTH, Geometry
from fusedq.kernels import common, cute_mla_query, gluon_mla_query, triton_launch
from fusedq.kernels.triton_launch import LaunchConfig

N = contract.KV_LORA


@pytest.fixture(autouse=True)
def no_plans():
    dispatch.clear_plans()
    yield
    dispatch.clear_plans()


def kv_b_proj_w_uk_t(g: Geometry, h: int, device, gen: torch.Generator) -> torch.Tensor:
    """W_UK_T as vLLM builds it from a kv_b_proj weight ``[H * (qk_nope + v_head), kv_lora]``:
    a strided view whose heads are ``qk_nope + v_head`` rows apart."""
    weight = torch.randn(h * g.head_stride_rows, N, generator=gen) * W_SCALE
    weight = weight.to(torch.bfloat16).to(device)
    w_uk, _ = weight.T.view(N, h, g.head_stride_rows).split([g.qk_nope, g.v_head], dim=-1)
    return w_uk.permute(1, 2, 0)


def operands(g: Geometry, h: int, m: int, device, gen, *, pitched: bool, out_dtype):
    """q_nope/q_pe sliced from one ``[m, h, qk_nope + 64]`` q, and ``out`` (pitched: inside a
    wider, poisoned workspace with a spare head)."""
    q = torch.randn(m, h, g.qk_nope + QK_ROPE, generator=gen).to(torch.bfloat16).to(device)
    width, heads = (QUERY_WIDTH + 64, h + 1) if pitched else (QUERY_WIDTH, h)
    buf = poison(torch.empty(m, heads, width, dtype=out_dtype, device=device))
    return q[..., : g.qk_nope], q[..., g.qk_nope :], buf[:, :h, :QUERY_WIDTH]


def run_case(g, h, m, fmt, out_dtype, device, backend, *, pitched=True, seed=0):
    gen = torch.Generator().manual_seed(seed or h * 1000 + m)
    w = kv_b_proj_w_uk_t(g, h, device, gen)
    assert w.stride(0) == g.head_stride_rows * N  # the kv_b_proj head stride, not qk_nope's
    weight = fusedq.quantize_mxfp8(w) if fmt == "mxfp8" else w
    q_nope, q_pe, out = operands(g, h, m, device, gen, pitched=pitched, out_dtype=out_dtype)
    q_scale = torch.tensor([Q_SCALE], device=device) if out_dtype == E4M3 else None
    fusedq.mla_query_projection(q_nope, weight, q_pe, out=out, q_scale=q_scale, backend=backend)
    assert_matches(out, fusedq.staged_mla_query(q_nope, weight, q_pe), fmt, q_scale)
    return out


def fused_plans() -> list:
    return [p for p in dispatch._plans.values() if getattr(p, "fused", False)]


# --- the kernels, under the interpreter (CPU) ------------------------------------------------

# A sample, not the product: the interpreter pays per program (H programs per launch).
DEEPSEEK_CASES = [
    # (H, M, weight format, out dtype, backend)
    (8, 1, "bf16", torch.bfloat16, "auto"),
    (16, 3, "mxfp8", torch.bfloat16, "auto"),
    (32, 7, "bf16", E4M3, "auto"),
    (64, 2, "mxfp8", E4M3, "auto"),
    (128, 5, "bf16", torch.bfloat16, "triton"),  # past the qualified heads
    (8, 33, "bf16", torch.bfloat16, "auto"),  # one 64-row block
    (16, 64, "mxfp8", E4M3, "auto"),
    (2, 512, "bf16", torch.bfloat16, "triton"),  # past the qualified M: eight 64-row M tiles
]


@pytest.mark.parametrize(("h", "m", "fmt", "out_dtype", "backend"), DEEPSEEK_CASES)
def test_deepseek_matches_staged(h, m, fmt, out_dtype, backend):
    run_case(DEEPSEEK_V3, h, m, fmt, out_dtype, torch.device("cpu"), backend)
    (plan,) = fused_plans()
    assert plan.launch.config.block_m == min(max(16, 1 << (m - 1).bit_length()), 64)


@pytest.mark.parametrize(("h", "m"), [(10, 5), (10, 33), (16, 64)])
def test_glm5_past_the_qualified_shapes_with_the_triton_backend(h, m):
    """GLM-5 at an unqualified H and at M > 32: backend="triton" runs them, "auto" does not."""
    run_case(GLM5, h, m, "bf16", torch.bfloat16, torch.device("cpu"), "triton")
    assert len(fused_plans()) == 1
    dispatch.clear_plans()
    run_case(GLM5, h, m, "bf16", torch.bfloat16, torch.device("cpu"), "auto")
    assert fused_plans() == []


CHUNKED = [
    LaunchConfig(block_m=16, block_n=128, block_k=common.BLOCK_K),  # tl.dot, K in chunks
    LaunchConfig(block_m=4, block_n=128, num_warps=1, fma=True),  # the register path
]


def chunked_case(g: Geometry, config: LaunchConfig, fmt: str, device) -> None:
    """A direct launch of ``config`` on a strided kv_b_proj view of ``g``, against staged."""
    h, m = 3, 3
    gen = torch.Generator().manual_seed(7)
    w = kv_b_proj_w_uk_t(g, h, device, gen)
    weight = fusedq.quantize_mxfp8(w) if fmt == "mxfp8" else w
    values, scales = dispatch.split_weight(weight)
    q_nope, q_pe, out = operands(g, h, m, device, gen, pitched=True, out_dtype=torch.bfloat16)
    key = triton_launch.launch(q_nope, values, scales, q_pe, out, None, config=config)
    assert key.qk_nope == g.qk_nope
    assert_matches(out, fusedq.staged_mla_query(q_nope, weight, q_pe), fmt)


@pytest.mark.parametrize("g", [DEEPSEEK_V3, GLM5], ids=lambda g: g.name)
@pytest.mark.parametrize("config", CHUNKED, ids=["tl.dot-chunks", "register"])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_kernels_take_k_in_chunks_of_either_geometry(g, config, fmt):
    """The chunked variants the GPU selects (the interpreter's own choice is one K chunk):
    two 64-wide chunks for DeepSeek-V3, three for GLM-5, from a strided kv_b_proj view."""
    chunked_case(g, config, fmt, torch.device("cpu"))


def test_launches_refuse_what_their_kernel_is_not_built_for(monkeypatch):
    device = torch.device("cpu")
    gen = torch.Generator().manual_seed(1)
    w = kv_b_proj_w_uk_t(DEEPSEEK_V3, 2, device, gen)
    q_nope, q_pe, out = operands(
        DEEPSEEK_V3, 2, 20, device, gen, pitched=False, out_dtype=torch.bfloat16
    )
    with pytest.raises(ValueError, match="M=20 exceeds block_m=16"):
        triton_launch.launch(q_nope, w, None, q_pe, out, None, config=LaunchConfig(16, 128))
    monkeypatch.setattr(LaunchConfig, "_check_gluon", lambda self: None)  # (no Gluon on CPU)
    gluon = LaunchConfig(16, 32, gluon=True)
    with pytest.raises(ValueError, match="Gluon kernel is built for glm5"):
        gluon.check_problem(DEEPSEEK_V3.qk_nope, 1)
    with pytest.raises(ValueError, match="qk_nope=96 is not 2 or 3 chunks of 64"):
        common.k_chunks(96)


# --- shapes: the geometry read from the tensors, refusals --------------------------------------


def test_a_shape_of_no_served_geometry_is_refused_naming_the_known_ones():
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 8, 96 + QK_ROPE, generator=gen).bfloat16()
    w = torch.randn(8, 96, N, generator=gen).bfloat16()
    with pytest.raises(
        ValueError,
        match=r"q_nope: shape \(1, 8, 96\) .*glm5 \(qk_nope 192.*deepseek-v3 \(qk_nope 128",
    ):
        fusedq.mla_query_projection(q[..., :96], w, q[..., 96:])
    with pytest.raises(ValueError, match=r"must be \[H, qk_nope, 512\] with qk_nope 192 or 128"):
        fusedq.quantize_mxfp8(w)


def test_weight_and_q_of_different_geometries_are_refused():
    gen = torch.Generator().manual_seed(3)
    w = kv_b_proj_w_uk_t(DEEPSEEK_V3, 8, "cpu", gen)
    q_nope, q_pe, _ = operands(GLM5, 8, 1, "cpu", gen, pitched=False, out_dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"deepseek-v3's .* q_nope's last dim 192 is glm5's"):
        fusedq.mla_query_projection(q_nope, w, q_pe)


def test_mxfp8_scales_block_kv_lora_in_both_geometries():
    gen = torch.Generator().manual_seed(4)
    for g in contract.GEOMETRIES:
        wq = fusedq.quantize_mxfp8(kv_b_proj_w_uk_t(g, 2, "cpu", gen))
        assert wq.values.shape == (2, g.qk_nope, N) and wq.scales.shape == (2, g.qk_nope, 16)


def test_common_widths_and_geometry_lookup():
    assert contract.GEOMETRIES == (GLM5, DEEPSEEK_V3)
    assert (contract.KV_LORA, contract.QK_ROPE, contract.QUERY_WIDTH) == (512, 64, 576)
    assert DEEPSEEK_V3.head_stride_rows == 256 and GLM5.head_stride_rows == 448
    assert contract.geometry_of(128) is DEEPSEEK_V3 and contract.geometry_of(192) is GLM5
    assert contract.geometry_of(128, 64, 256) is None
    with pytest.raises(ValueError, match="known: glm5, deepseek-v3"):
        contract.geometry_named("llama")
    # The CuTe kernel's buckets reach GLM-5's qualified M (the geometry it is built for).
    assert contract.QUALIFIED[GLM5.name].max_m in contract.DECODE_M_BUCKETS
    q = contract.Qualification(heads=(8, 16, 128), max_m=64, m_by_heads=((128, 16),))
    assert [q.max_m_for(h) for h in (8, 128, 11)] == [64, 16, 0]
    assert q.describe() == "8, 16, 128 heads, M <= 64 (128 heads: M <= 16)"


# --- the gates and the selection --------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"num_heads": 64, "max_m": 1}, "num_heads=64 is not qualified for glm5"),
        ({"num_heads": 11, "max_m": 1, "geometry": "deepseek-v3"}, "not qualified for deepseek-v3 \\(qualified: \\(8, 16, 32, 64\\)\\)"),
        ({"num_heads": 8, "max_m": 65, "geometry": DEEPSEEK_V3}, "max_m=65 is outside deepseek-v3's qualified range 1..64 at 8 heads"),
        ({"num_heads": 8, "max_m": 33}, "max_m=33 is outside glm5's qualified range 1..32 at 8 heads"),
        ({"num_heads": 8, "max_m": 1, "geometry": "llama"}, "geometry 'llama' is not served"),
        ({"num_heads": 129, "max_m": 1, "qualified": False}, "outside the kernels' range 1..128"),
        ({"num_heads": 8, "max_m": 513, "qualified": False}, "outside the kernels' range 1..512"),
    ],
)  # fmt: skip
def test_explain_names_the_geometry_and_what_is_unqualified(kwargs, match):
    why = fusedq.explain(**kwargs)
    assert why is not None and re.search(match, why), why


@pytest.mark.parametrize("h", contract.QUALIFIED[DEEPSEEK_V3.name].heads)
def test_deepseek_qualified_heads_run_fused_here(h):
    assert fusedq.explain(h, 64, geometry=DEEPSEEK_V3) is None
    assert fusedq.explain(h, 512, geometry=DEEPSEEK_V3, qualified=False) is None


@pytest.mark.parametrize("gluon", [True, False])
@pytest.mark.parametrize("dsl", [True, False])
def test_deepseek_selects_the_tl_dot_kernel_on_a_gpu(monkeypatch, dsl, gluon):
    """No register, Gluon or CuTe kernel for DeepSeek-V3 (unmeasured, or not built for it):
    the tl.dot kernel at every qualified shape and recipe, as DSV3_TUNED says."""
    device = _fake_gpu(monkeypatch, dsl=dsl, gluon=gluon)
    for fmt, out in [
        ("bf16", torch.bfloat16),
        ("mxfp8", torch.bfloat16),
        ("bf16", E4M3),
        ("mxfp8", E4M3),
    ]:
        for h in contract.QUALIFIED[DEEPSEEK_V3.name].heads:
            for m in (1, 2, 3, 4, 8, 16, 17, 32, 33, 64):
                kw = dict(geometry=DEEPSEEK_V3, weight_format=fmt, out_dtype=out, device=device)
                chosen = selection.select(h, m, **kw)
                assert chosen.path == "triton" and chosen.kernel == "tl.dot", (fmt, h, m, chosen)
                padded = min(max(16, 1 << (m - 1).bit_length()), 64)
                entry = selection.DSV3_TUNED[(fmt, out == E4M3, padded)][h]
                c = chosen.config
                assert (c.block_n, c.num_warps, c.block_k, c.block_m) == entry, (fmt, h, m)
                assert fmt == "bf16" or c.block_m == 64  # MXFP8: warpgroup-MMA rows
                assert fusedq.kernel_choice(h, m, **kw)[0] == "triton"
        problem = capability.cute_problem(fmt, out, geometry=DEEPSEEK_V3)
        assert problem == "the CuTe DSL kernel is built for glm5, not deepseek-v3"
    assert GLM5 in cute_mla_query.GEOMETRIES and DEEPSEEK_V3 not in gluon_mla_query.GEOMETRIES


def test_past_32_tokens_the_tl_dot_kernel_tiles_m(monkeypatch):
    device = _fake_gpu(monkeypatch, dsl=True, gluon=True)
    for g in contract.GEOMETRIES:
        for m, tiles in [(33, 1), (64, 1), (65, 2), (512, 8)]:
            chosen = selection.select(8, m, geometry=g, device=device, qualified=False)
            assert chosen.kernel == "tl.dot" and chosen.config.tiles_m
            assert triton_launch.grid_for(chosen.config, 8, m) == (16, 8, tiles)
        past = contract.QUALIFIED[g.name].max_m_for(8) + 1
        assert selection.select(8, past, geometry=g, device=device).path == "staged"


# --- the vLLM plugin's gate ---------------------------------------------------------------------


def test_plugin_serves_a_deepseek_layer_fused(mla):
    """A DeepSeek-V3-geometry MLA layer (qk_nope 128, v_head 128) is planned fused, and its
    decode query, through vLLM's patched forward_impl, is the staged one."""
    from test_vllm_plugin import run_forward_impl, stand_in_layer

    from fusedq.vllm import layer_plan, patch

    found = patch.check_vllm()
    patch.apply(found)
    layer = stand_in_layer(
        mla, 16, fp8=False, gen=torch.Generator().manual_seed(0), geometry=DEEPSEEK_V3
    )
    plan, note = layer_plan.plan_layer(layer)
    assert plan is not None and plan.geometry is DEEPSEEK_V3, note
    layer.__dict__[layer_plan.PLAN_ATTR] = plan
    got = run_forward_impl(found.forward_impl, layer, 3, torch.Generator().manual_seed(3))
    ref = run_forward_impl(
        found.forward_impl.__wrapped__, layer, 3, torch.Generator().manual_seed(3)
    )
    assert_matches(got, ref, "bf16")
    layer.num_heads = 11  # not a DeepSeek-V3 TP shape: staged, and the reason names it
    plan, note = layer_plan.plan_layer(layer)
    assert plan is None and "not qualified for deepseek-v3" in note


# --- GPU (skipped without CUDA): the same shapes on the selection's real kernels -------------


@pytest.mark.gpu
@pytest.mark.parametrize(("h", "m", "fmt", "out_dtype", "backend"), DEEPSEEK_CASES)
def test_deepseek_matches_staged_on_gpu(h, m, fmt, out_dtype, backend):
    run_case(DEEPSEEK_V3, h, m, fmt, out_dtype, torch.device("cuda"), backend)
    (plan,) = fused_plans()
    assert not plan.launch.config.gluon and not plan.launch.config.fma


@pytest.mark.gpu
@pytest.mark.parametrize("h", contract.QUALIFIED[DEEPSEEK_V3.name].heads)
@pytest.mark.parametrize("m", [1, 2, 7, 32, 48, 64])
@pytest.mark.parametrize("recipe", [("bf16", torch.bfloat16), ("mxfp8", E4M3)])
def test_deepseek_qualified_shapes_on_gpu(h, m, recipe):
    fmt, out_dtype = recipe
    run_case(DEEPSEEK_V3, h, m, fmt, out_dtype, torch.device("cuda"), "auto", pitched=m % 2 == 1)
    assert len(fused_plans()) == 1


@pytest.mark.gpu
@pytest.mark.parametrize(("h", "m"), [(128, 1), (128, 32), (16, 65), (32, 200)])
def test_deepseek_past_the_qualified_on_gpu(h, m):
    """Past the qualified shapes (128 heads; M above 64) the kernel runs fused when forced,
    correct, and "auto" serves them staged."""
    run_case(DEEPSEEK_V3, h, m, "bf16", torch.bfloat16, torch.device("cuda"), "triton")
    assert len(fused_plans()) == 1
    dispatch.clear_plans()
    run_case(DEEPSEEK_V3, h, m, "bf16", torch.bfloat16, torch.device("cuda"), "auto")
    assert fused_plans() == []


@pytest.mark.gpu
@pytest.mark.parametrize(("h", "m"), [(10, 5), (10, 33), (16, 64), (8, 512)])
@pytest.mark.parametrize("recipe", [("bf16", torch.bfloat16), ("mxfp8", E4M3)])
def test_glm5_past_the_qualified_shapes_on_gpu(h, m, recipe):
    run_case(GLM5, h, m, *recipe, torch.device("cuda"), "triton")
    assert len(fused_plans()) == 1


@pytest.mark.gpu
@pytest.mark.parametrize("g", [DEEPSEEK_V3, GLM5], ids=lambda g: g.name)
@pytest.mark.parametrize("config", CHUNKED, ids=["tl.dot-chunks", "register"])
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_kernels_take_k_in_chunks_of_either_geometry_on_gpu(g, config, fmt):
    """The two-chunk (DeepSeek) and three-chunk (GLM-5) variants compiled for the GPU."""
    chunked_case(g, config, fmt, torch.device("cuda"))


@pytest.mark.gpu
@pytest.mark.parametrize("g", contract.GEOMETRIES, ids=lambda g: g.name)
def test_prewarm_then_capture_deepseek_and_glm5(g):
    """prewarm compiles what the geometry's calls bind, so a CUDA graph captures without
    compiling (a variant compiled for one qk_nope is not the other's)."""
    device = torch.device("cuda")
    h, m = 16, 4
    gen = torch.Generator().manual_seed(5)
    w = kv_b_proj_w_uk_t(g, h, device, gen)
    fusedq.prewarm(w, [m])
    q_nope, q_pe, out = operands(g, h, m, device, gen, pitched=False, out_dtype=torch.bfloat16)
    keys = {k.qk_nope for k in triton_launch.compiled_keys()}
    assert g.qk_nope in keys
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fusedq.mla_query_projection(q_nope, w, q_pe, out=out, backend="triton")
    graph.replay()
    torch.cuda.synchronize()
    assert_matches(out, fusedq.staged_mla_query(q_nope, w, q_pe), "bf16")


# --- the GPU code, compiled for sm_90 without a GPU -------------------------------------------

# In a child process (the interpreter patches Triton's tensor class in this one): the
# DeepSeek-V3 variants of the Triton kernels compile, and only the M-tiled one reads the
# grid's third axis.
_COMPILE_DEEPSEEK = """
import json, triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fusedq.kernels import common, triton_mla_query as t
out = {}
for name, fn, bm, bn, bk, mxfp8, e4m3 in (
        ("dot-2chunks", t._mla_query_kernel, 16, 32, 64, False, False),
        ("dot-1chunk", t._mla_query_kernel, 32, 64, 128, True, True),
        ("dot-tiled", t._mla_query_kernel, 64, 32, 64, True, False),
        ("register", t._mla_query_fma_kernel, 2, 32, 64, True, True)):
    cx = {"K": 128, "N": 512, "R": 64, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk,
          "W_LAYOUT": 1, "W_ALIGNED": True, "IO_ALIGNED": True, "MXFP8": mxfp8,
          "OUT_FP8": common.out_mode(e4m3), "INTERPRET": False, "USE_PDL": False,
          "LOAD_FENCE": fn is t._mla_query_fma_kernel}
    ptr = {"q_ptr": "*bf16", "qpe_ptr": "*bf16", "w_ptr": "*fp8e4nv" if mxfp8 else "*bf16",
           "ws_ptr": "*u8" if mxfp8 else "*bf16", "out_ptr": "*fp8e4nv" if e4m3 else "*bf16",
           "qs_ptr": "*fp32" if e4m3 else "*bf16"}
    sig = {n: ptr.get(n, "constexpr" if n in cx else "i32") for n in fn.arg_names}
    k = triton.compile(ASTSource(fn, sig, constexprs=cx), target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 1})
    out[name] = "%ctaid.z" in k.asm["ptx"]
print(json.dumps(out))
"""


def test_deepseek_variants_compile_for_sm90():
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (Triton 3.9 warns when it is unset)
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_DEEPSEEK], env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    tiled = json.loads(done.stdout.strip().splitlines()[-1])
    assert tiled == {
        "dot-2chunks": False,
        "dot-1chunk": False,
        "dot-tiled": True,
        "register": False,
    }
