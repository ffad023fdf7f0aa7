"""The fused decode front (fusedq.mla_decode_front) against its staged reference
(fusedq.staged_decode_front), the reference against vLLM's own rotary embedding and cache
write, and the argument checking.

The query's 512-wide part is held to the tolerance table (fusedq_cases.assert_matches), its
RoPE part and the whole KV cache bit for bit: every cache starts poisoned (NaN in bf16, 0x7F
in E4M3) inside a wider buffer, so untouched slots, padding and the slots of negative
slot_mapping entries must come back as they were. Under the interpreter the shapes are a
sample (the interpreter pays per program); the ``gpu`` cases run more of them on CUDA."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fusedq_cases import E4M3, Q_SCALE, assert_matches, poison
from test_geometry import kv_b_proj_w_uk_t

import fusedq
from fusedq import front_dispatch, front_reference
from fusedq.contract import DEEPSEEK_V3, GLM5, KV_LORA, QK_ROPE, QUERY_WIDTH, Geometry
from fusedq.kernels import front_launch
from fusedq.kernels.triton_launch import LaunchConfig

# An fp8 cache's scale: make_case's few large kv_c entries pass 448 * K_SCALE, the clamp.
K_SCALE = 0.02
BLOCK_SIZE = 16
NUM_BLOCKS = 12
MAX_POSITION = 4096


@dataclasses.dataclass
class Case:
    """One call's operands, and its cache's backing buffer (padding included)."""

    args: list
    kwargs: dict
    cache_buf: torch.Tensor

    @property
    def cache(self) -> torch.Tensor:
        return self.args[6]

    def with_fresh_cache(self) -> Case:
        buf = self.cache_buf.clone()
        view = buf.as_strided(self.cache.shape, self.cache.stride(), self.cache.storage_offset())
        return Case([*self.args[:6], view, *self.args[7:]], dict(self.kwargs), buf)


def make_case(
    g: Geometry, h: int, m: int, *, fmt="bf16", out_dtype=torch.bfloat16, cache="auto",
    cache_tensor=torch.uint8, neox=False, cs_dtype=torch.float32, pos_dtype=torch.int64,
    device="cpu", seed=0,
) -> Case:  # fmt: skip
    gen = torch.Generator().manual_seed(seed or 7919 * h + m)
    width = g.qk_nope + QK_ROPE
    # q: one head of spare width and a lead-in, as a slice of a wider q_b_proj buffer.
    qbuf = torch.randn(m, h + 1, width + 24, generator=gen).to(torch.bfloat16).to(device)
    q = qbuf[:, :h, 8 : 8 + width]
    w = kv_b_proj_w_uk_t(g, h, device, gen)
    weight = fusedq.quantize_mxfp8(w) if fmt == "mxfp8" else w
    # kv_a_proj's output [kv_c | k_pe | spare]: k_pe a strided slice of it, [M, 1, 64].
    kva = torch.randn(m, KV_LORA + QK_ROPE + 8, generator=gen) * 2
    kva[:, ::97] *= 40  # a few entries past 448 * k_scale: the fp8 cache's clamp
    kva = kva.to(torch.bfloat16).to(device)
    kv_c, k_pe = kva[:, :KV_LORA], kva[:, KV_LORA : KV_LORA + QK_ROPE].unsqueeze(1)
    positions = torch.randint(0, MAX_POSITION, (m,), generator=gen).to(pos_dtype).to(device)
    angle = torch.rand(MAX_POSITION, QK_ROPE // 2, generator=gen) * 6.3
    cos_sin = torch.cat([angle.cos(), angle.sin()], dim=-1) * 1.1  # (a YaRN-like mscale)
    cos_sin = cos_sin.to(cs_dtype).to(device)
    cache_dtype = torch.bfloat16 if cache == "auto" else cache_tensor
    num_blocks = max(NUM_BLOCKS, -(-m // BLOCK_SIZE) + 2)
    # Padded strides: two spare slots a block and 64 spare elements an entry.
    buf = torch.empty(num_blocks, BLOCK_SIZE + 2, QUERY_WIDTH + 64, dtype=cache_dtype)
    buf = poison(buf.view(E4M3) if cache_dtype == torch.uint8 else buf).to(device)
    buf = buf.view(cache_dtype)
    kv_cache = buf[:, :BLOCK_SIZE, :QUERY_WIDTH]
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:m]
    slots[1::3] = -1  # vLLM's padding tokens: nothing written
    kwargs = {"is_neox": neox, "kv_cache_dtype": cache, "out_dtype": out_dtype}
    if cache != "auto":
        kwargs["k_scale"] = torch.tensor([K_SCALE], device=device)
    if out_dtype == E4M3:
        kwargs["q_scale"] = torch.tensor([Q_SCALE], device=device)
    args = [q, kv_c, k_pe, positions, cos_sin, weight, kv_cache, slots.to(device)]
    return Case(args, kwargs, buf)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8 if t.element_size() == 1 else torch.int16)


def run_and_compare(case: Case, backend: str, fmt: str) -> torch.Tensor:
    """The front through ``backend`` against the staged reference: the query (512 part by
    the tolerance table, RoPE part bit-exact) and the cache's whole buffer bit-exact."""
    fused, staged = case, case.with_fresh_cache()
    out = fusedq.mla_decode_front(*fused.args, **fused.kwargs, backend=backend)
    kwargs = dict(staged.kwargs, out_dtype=torch.bfloat16, q_scale=None)
    ref = fusedq.staged_decode_front(*staged.args, **kwargs)
    assert_matches(out, ref, fmt, case.kwargs.get("q_scale"))
    assert torch.equal(_bits(fused.cache_buf), _bits(staged.cache_buf)), "KV cache differs"
    # Exactly the entries of the non-negative slots were written (no written value is NaN).
    written = (case.args[7] >= 0).sum().item() * QUERY_WIDTH
    assert _poisoned(fused.cache_buf).logical_not().sum().item() == written
    return out


def _poisoned(buf: torch.Tensor) -> torch.Tensor:
    return (buf.view(E4M3) if buf.dtype == torch.uint8 else buf).float().isnan()


# --- fused vs staged, under the interpreter ---------------------------------------------------

# (geometry, H, M, weight format, out dtype, cache, neox, cos_sin dtype, positions dtype)
CASES = [
    (GLM5, 8, 1, "bf16", torch.bfloat16, "auto", False, torch.float32, torch.int64),
    (GLM5, 11, 7, "mxfp8", E4M3, "fp8", False, torch.bfloat16, torch.int32),
    (GLM5, 16, 32, "bf16", E4M3, "fp8_e4m3", True, torch.float32, torch.int64),
    (GLM5, 8, 17, "mxfp8", torch.bfloat16, "auto", True, torch.bfloat16, torch.int64),
    (GLM5, 16, 2, "bf16", torch.bfloat16, "fp8", False, torch.bfloat16, torch.int64),
    (DEEPSEEK_V3, 8, 3, "bf16", torch.bfloat16, "auto", False, torch.bfloat16, torch.int64),
    (DEEPSEEK_V3, 16, 48, "mxfp8", E4M3, "fp8", False, torch.float32, torch.int64),
    (DEEPSEEK_V3, 32, 5, "bf16", E4M3, "auto", True, torch.bfloat16, torch.int32),
    (DEEPSEEK_V3, 64, 1, "mxfp8", torch.bfloat16, "fp8_e4m3", False, torch.bfloat16, torch.int64),
    (DEEPSEEK_V3, 8, 64, "bf16", torch.bfloat16, "fp8", True, torch.float32, torch.int64),
]


def _case_id(c) -> str:
    g, h, m, fmt, out, cache, neox, cs, _ = c
    names = (str(out).replace("torch.", ""), str(cs).replace("torch.", ""))
    return f"{g.name}-H{h}-M{m}-{fmt}-{names[0]}-{cache}-{'neox' if neox else 'gptj'}-{names[1]}"


@pytest.mark.parametrize("c", CASES, ids=[_case_id(c) for c in CASES])
def test_fused_matches_staged(c, device):
    g, h, m, fmt, out_dtype, cache, neox, cs, pos = c
    case = make_case(
        g, h, m, fmt=fmt, out_dtype=out_dtype, cache=cache, neox=neox, cs_dtype=cs,
        pos_dtype=pos, device=device, cache_tensor=E4M3 if cache == "fp8_e4m3" else torch.uint8,
    )  # fmt: skip
    run_and_compare(case, "auto", fmt)


# The configurations a GPU runs (N tiles narrower than 512, K in 64-wide chunks, 64-row M
# blocks with more tokens than one cache program per head): the interpreter's own choice is
# one program per head.
DIRECT = [
    (GLM5, LaunchConfig(block_m=16, block_n=64), 2, 5, "bf16", E4M3, "fp8"),
    (DEEPSEEK_V3, LaunchConfig(block_m=64, block_n=128, block_k=128), 3, 70, "mxfp8",
     torch.bfloat16, "auto"),
    (GLM5, LaunchConfig(block_m=32, block_n=256, block_k=256), 1, 20, "mxfp8", E4M3, "fp8"),
]  # fmt: skip


@pytest.mark.parametrize(("g", "config", "h", "m", "fmt", "out_dtype", "cache"), DIRECT)
def test_gpu_launch_configs(g, config, h, m, fmt, out_dtype, cache, device):
    case = make_case(g, h, m, fmt=fmt, out_dtype=out_dtype, cache=cache, device=device)
    staged = case.with_fresh_cache()
    c = front_dispatch.validate(*case.args, **case.kwargs, out=None, backend="triton")
    out = torch.empty(m, h, QUERY_WIDTH, dtype=out_dtype, device=device)
    poison(out)
    front_launch.launch(
        case.args[0], c.values, c.scales, case.args[1], c.k_pe, case.args[3], case.args[4],
        c.cache, case.args[7], out, case.kwargs.get("q_scale"), case.kwargs.get("k_scale"),
        config=config, neox=False,
    )  # fmt: skip
    ref = fusedq.staged_decode_front(
        *staged.args, **dict(staged.kwargs, out_dtype=torch.bfloat16, q_scale=None)
    )
    assert_matches(out, ref, fmt, case.kwargs.get("q_scale"))
    assert torch.equal(_bits(case.cache_buf), _bits(staged.cache_buf))


def test_backends_past_the_qualified_shapes(device):
    """GLM-5 at M 40: "auto" runs the staged path (the query's qualified M is 32), "triton"
    the fused kernel; M 513 is past what the kernel runs at all, and says so."""
    case = make_case(GLM5, 8, 40, device=device)
    staged = case.with_fresh_cache()
    got = fusedq.mla_decode_front(*case.args, **case.kwargs)
    ref = fusedq.staged_decode_front(*staged.args, **staged.kwargs)
    assert torch.equal(_bits(got), _bits(ref))
    assert torch.equal(_bits(case.cache_buf), _bits(staged.cache_buf))
    run_and_compare(make_case(GLM5, 8, 40, device=device), "triton", "bf16")
    big = make_case(DEEPSEEK_V3, 1, 513, device=device)
    before = big.cache_buf.clone()
    with pytest.raises(ValueError, match=r"backend='triton' cannot run this call: max_m=513"):
        fusedq.mla_decode_front(*big.args, **big.kwargs, backend="triton")
    assert torch.equal(_bits(big.cache_buf), _bits(before))


def test_prewarm_registers_what_the_calls_launch(device):
    case = make_case(DEEPSEEK_V3, 8, 3, device=device)
    weight = case.args[5]
    kwargs = {"is_neox": False, "cos_sin_dtype": torch.float32}
    fusedq.prewarm_decode_front(weight, [3, 100], **kwargs)  # (M 100 runs staged)
    assert fusedq.prewarm_decode_front(weight, [3], **kwargs) == 0
    known = front_launch.compiled_keys()
    fusedq.mla_decode_front(*case.args, **case.kwargs)
    assert front_launch.compiled_keys() == known  # the call's variant was among them


# --- the reference against vLLM's own ops -----------------------------------------------------

ROPES = {
    # GLM-5 / plain RoPE (vLLM's RotaryEmbedding), both styles.
    "default-neox": ({"rope_type": "default", "rope_theta": 10000.0}, True, 1),
    "default-gptj": ({"rope_type": "default", "rope_theta": 10000.0}, False, 1),
    # DeepSeek-V3's YaRN (DeepseekScalingRotaryEmbedding), GPT-J style as served.
    "deepseek-yarn": (
        {"rope_type": "deepseek_yarn", "rope_theta": 10000.0, "factor": 40.0,
         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
         "mscale": 1.0, "mscale_all_dim": 1.0},
        False, 40,
    ),
}  # fmt: skip


@pytest.fixture(scope="module")
def vllm_rope():
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    def build(name: str):
        params, neox, scale = ROPES[name]
        with set_current_vllm_config(VllmConfig()):  # vLLM's CustomOps want one
            # dtype: the model dtype vLLM builds its layers under (set_default_torch_dtype).
            return get_rope(
                QK_ROPE, max_position=MAX_POSITION * scale, is_neox_style=neox,
                rope_parameters=params, dtype=torch.bfloat16,
            ), neox  # fmt: skip

    return build


@pytest.mark.parametrize("name", list(ROPES))
def test_reference_rope_is_vllms(name, vllm_rope):
    """vLLM's rotary embedding, ``forward_native`` on fp32 copies of the bf16 operands (what
    inductor computes for it under torch.compile), rounded once to bf16, equals
    ``front_reference.rope`` bit for bit; vLLM's cache is bf16 (the model dtype), as it
    serves it."""
    rotary, neox = vllm_rope(name)
    assert rotary.cos_sin_cache.dtype == torch.bfloat16
    gen = torch.Generator().manual_seed(5)
    m, h = 9, 4
    q_pe = torch.randn(m, h, QK_ROPE, generator=gen).bfloat16()
    k_pe = torch.randn(m, 1, QK_ROPE, generator=gen).bfloat16()
    positions = torch.randint(0, rotary.cos_sin_cache.shape[0], (m,), generator=gen)
    q_want, k_want = rotary.forward_native(positions, q_pe.float(), k_pe.float())
    cache = rotary.cos_sin_cache
    assert torch.equal(
        _bits(q_want.bfloat16()), _bits(front_reference.rope(q_pe, positions, cache, neox))
    )
    got_k = front_reference.rope(k_pe[:, 0], positions, cache, neox)
    assert torch.equal(_bits(k_want.bfloat16().reshape(m, QK_ROPE)), _bits(got_k))


def _vllm_cache_op(fp8: bool):
    """vLLM's concat_and_cache_mla where this build has one: the CUDA op, or the CPU build's
    ``concat_and_cache_mla_cpu`` (bf16 caches only), else None."""
    vllm = pytest.importorskip("vllm")
    from vllm.platforms import current_platform

    current_platform.import_kernels()
    cuda_op = getattr(torch.ops._C_cache_ops, "concat_and_cache_mla", None)
    if cuda_op is not None:
        return lambda kv_c, k_pe, cache, slots, k_scale: cuda_op(
            kv_c, k_pe, cache, slots, "fp8" if fp8 else "auto", k_scale
        )
    cpu_op = getattr(torch.ops._C, "concat_and_cache_mla_cpu", None)
    if cpu_op is None or fp8:
        pytest.skip(
            f"vLLM {vllm.__version__} here has no concat_and_cache_mla for "
            f"{'an fp8' if fp8 else 'a bf16'} cache (the CPU build's op writes bf16 only)"
        )
    return lambda kv_c, k_pe, cache, slots, k_scale: cpu_op(kv_c, k_pe, cache, slots)


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16-cache", "fp8-cache"])
def test_reference_cache_write_is_vllms(fp8, device):
    """``front_reference.write_cache`` and the fused kernel's cache against vLLM's own op,
    given the rotated k_pe. (The CPU build's op ignores the cache's strides: a dense cache
    here.)"""
    op = _vllm_cache_op(fp8)
    case = make_case(DEEPSEEK_V3, 8, 13, cache="fp8" if fp8 else "auto", device=device)
    q, kv_c, k_pe, positions, cos_sin, weight, _, slots = case.args
    dense = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, QUERY_WIDTH, dtype=case.cache.dtype, device=device)
    k_scale = case.kwargs.get("k_scale", torch.ones(1, device=device))
    rotated = front_reference.rope(k_pe[:, 0], positions, cos_sin, False)
    theirs, ours, fused = dense.clone(), dense.clone(), dense.clone()
    op(kv_c, rotated, theirs, slots, k_scale)
    front_reference.write_cache(kv_c, rotated, ours.view(E4M3) if fp8 else ours, slots, k_scale)
    assert torch.equal(_bits(theirs), _bits(ours))
    fusedq.mla_decode_front(
        q, kv_c, k_pe, positions, cos_sin, weight, fused, slots, **case.kwargs, backend="triton"
    )
    assert torch.equal(_bits(theirs), _bits(fused))


def test_fp8_cache_divides_and_saturates():
    """The E4M3 cache value is ``x / k_scale`` rounded once and clamped to ±448, as vLLM's
    scaled_convert: not the query's ``x * (1 / scale)`` (they differ at 28 for these)."""
    from fusedq_cases import TIE_SCALE, split_values

    x = split_values().reshape(1, -1)
    scale = torch.tensor([TIE_SCALE])
    got = front_reference.quantize_cache_e4m3(x, scale).view(torch.uint8)
    want = (x.float() / TIE_SCALE).to(E4M3).view(torch.uint8)
    assert torch.equal(got, want)
    assert not torch.equal(got, fusedq.reference.quantize_e4m3(x, scale).view(torch.uint8))
    big = torch.tensor([[1e4, -1e4]]).bfloat16()
    assert front_reference.quantize_cache_e4m3(big, torch.ones(1)).float().tolist() == [
        [448.0, -448.0]
    ]


# --- bad input -------------------------------------------------------------------------------


def _mutations():
    """(case id, the argument the message must name, mutate(args, kwargs))."""

    def arg(i, fn):
        def mutate(args, kwargs):
            args[i] = fn(args[i])

        return mutate

    def kw(name, fn):
        def mutate(args, kwargs):
            kwargs[name] = fn(kwargs.get(name))

        return mutate

    def cache_over_kv_c(args, kwargs):
        args[6] = args[1].as_strided((1, 2, QUERY_WIDTH), (2 * QUERY_WIDTH, QUERY_WIDTH, 1))

    def fp8_without_k_scale(args, kwargs):
        kwargs["kv_cache_dtype"] = "fp8"
        args[6] = torch.zeros(NUM_BLOCKS, BLOCK_SIZE, QUERY_WIDTH, dtype=torch.uint8)

    def e4m3_without_q_scale(args, kwargs):
        kwargs["out"], kwargs["out_dtype"] = None, E4M3

    return [
        ("q_dtype", "q", arg(0, lambda t: t.float())),
        ("q_width", "q", arg(0, lambda t: t[..., :200])),
        ("q_stride", "q", arg(0, lambda t: t.transpose(0, 2).contiguous().transpose(0, 2))),
        ("weight_heads", "weight", arg(5, lambda t: t[:4])),
        ("weight_geometry", "weight", arg(5, lambda t: torch.zeros(8, 128, 512).bfloat16())),
        ("kv_c_dtype", "kv_c", arg(1, lambda t: t.half())),
        ("kv_c_shape", "kv_c", arg(1, lambda t: t[:, :256])),
        ("k_pe_shape", "k_pe", arg(2, lambda t: t[:2])),
        ("k_pe_stride", "k_pe", arg(2, lambda t: t.transpose(0, 2).contiguous().transpose(0, 2))),
        ("positions_dtype", "positions", arg(3, lambda t: t.float())),
        ("positions_shape", "positions", arg(3, lambda t: t[:1])),
        ("cos_sin_dtype", "cos_sin_cache", arg(4, lambda t: t.half())),
        ("cos_sin_shape", "cos_sin_cache", arg(4, lambda t: torch.cat([t, t], -1))),
        ("cache_dtype", "kv_cache", arg(6, lambda t: t.view(torch.int16))),
        ("cache_shape", "kv_cache", arg(6, lambda t: t[..., :512])),
        (
            "cache_stride",
            "kv_cache",
            arg(6, lambda t: t.transpose(0, 2).contiguous().transpose(0, 2)),
        ),
        ("cache_over_kv_c", "kv_cache", cache_over_kv_c),
        ("slots_dtype", "slot_mapping", arg(7, lambda t: t.int())),
        ("slots_shape", "slot_mapping", arg(7, lambda t: t[None])),
        ("cache_dtype_name", "kv_cache_dtype", kw("kv_cache_dtype", lambda _: "fp8_e5m2")),
        ("fp8_without_k_scale", "k_scale", fp8_without_k_scale),
        ("k_scale_two", "k_scale", kw("k_scale", lambda _: torch.ones(2))),
        ("is_neox", "is_neox", kw("is_neox", lambda _: 1)),
        ("backend", "backend", kw("backend", lambda _: "cute")),
        ("e4m3_without_q_scale", "q_scale", e4m3_without_q_scale),
        ("out_shape", "out", kw("out", lambda _: torch.empty(3, 8, 512, dtype=torch.bfloat16))),
    ]


BAD = [name for name, _, _ in _mutations()]


@pytest.mark.parametrize("name", BAD)
def test_bad_input_names_the_argument_and_writes_nothing(name):
    arg, mutate = {n: (a, fn) for n, a, fn in _mutations()}[name]
    case = make_case(GLM5, 8, 3)
    out = poison(torch.empty(3, 8, QUERY_WIDTH, dtype=torch.bfloat16))
    case.kwargs["out"] = out
    mutate(case.args, case.kwargs)
    before = [_bits(t).clone() for t in (case.cache_buf, out, case.args[1])]
    with pytest.raises(ValueError, match=f"^{arg}: ") as info:
        fusedq.mla_decode_front(*case.args, **case.kwargs)
    assert str(info.value).count("\n") == 0
    after = [_bits(t) for t in (case.cache_buf, out, case.args[1])]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))


# --- GPU: more shapes, decode steps against vLLM's CUDA ops, CUDA graphs -----------------------


@pytest.mark.gpu
@pytest.mark.parametrize("g", [GLM5, DEEPSEEK_V3], ids=lambda g: g.name)
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, E4M3], ids=["bf16", "e4m3"])
@pytest.mark.parametrize("cache", ["auto", "fp8"])
def test_gpu_grid(g, fmt, out_dtype, cache):
    heads = (8, 11, 16) if g is GLM5 else (8, 16, 32, 64)
    ms = (1, 2, 3, 7, 16, 17, 31, 32) + (() if g is GLM5 else (48, 64))
    for h in heads:
        for m in ms:
            for neox, cs in ((False, torch.bfloat16), (True, torch.float32)):
                case = make_case(
                    g, h, m, fmt=fmt, out_dtype=out_dtype, cache=cache, neox=neox,
                    cs_dtype=cs, device="cuda",
                )  # fmt: skip
                run_and_compare(case, "auto", fmt)


@pytest.mark.gpu
@pytest.mark.parametrize("cache", ["auto", "fp8"])
def test_gpu_decode_steps_match_vllm(cache):
    """Several decode steps appending to one cache: the fused front's cache equals vLLM's
    (its rotary embedding, fp32 compute as inductor's, then its CUDA concat_and_cache_mla)
    bit for bit, and its query the staged reference's."""
    op = _vllm_cache_op(cache == "fp8")
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    params, neox, scale = ROPES["deepseek-yarn"]
    with set_current_vllm_config(VllmConfig()):
        rotary = get_rope(
            QK_ROPE, max_position=MAX_POSITION * scale, is_neox_style=neox,
            rope_parameters=params, dtype=torch.bfloat16,
        ).cuda()  # fmt: skip
    cos_sin = rotary.cos_sin_cache
    h, m = 16, 4
    first = make_case(DEEPSEEK_V3, h, m, cache=cache, device="cuda")
    fused_cache, vllm_cache = first.cache_buf.clone(), first.cache_buf.clone()
    view = first.cache
    fused_view = fused_cache.as_strided(view.shape, view.stride(), view.storage_offset())
    vllm_view = vllm_cache.as_strided(view.shape, view.stride(), view.storage_offset())
    k_scale = first.kwargs.get("k_scale", torch.ones(1, device="cuda"))
    for step in range(6):
        case = make_case(DEEPSEEK_V3, h, m, cache=cache, device="cuda", seed=100 + step)
        q, kv_c, k_pe, _, _, weight, _, _ = case.args
        positions = torch.arange(m, device="cuda") * 97 + step  # one token a sequence a step
        slots = torch.arange(m, device="cuda") * BLOCK_SIZE * 2 + step
        out = fusedq.mla_decode_front(
            q, kv_c, k_pe, positions, cos_sin, weight, fused_view, slots,
            is_neox=neox, kv_cache_dtype=cache, k_scale=case.kwargs.get("k_scale"),
        )  # fmt: skip
        q_rot, k_rot = rotary.forward_native(positions, q[..., 128:].float(), k_pe.float())
        op(kv_c, k_rot.bfloat16().reshape(m, QK_ROPE), vllm_view, slots, k_scale)
        assert torch.equal(_bits(fused_cache), _bits(vllm_cache)), f"step {step}"
        assert torch.equal(_bits(out[..., KV_LORA:]), _bits(q_rot.bfloat16()))


@pytest.mark.gpu
def test_gpu_graph_capture_after_prewarm():
    case = make_case(GLM5, 16, 4, fmt="mxfp8", out_dtype=E4M3, cache="fp8", device="cuda")
    kwargs = dict(case.kwargs)
    weight = case.args[5]
    staged = case.with_fresh_cache()  # (the cache as it was before any call)
    assert fusedq.prewarm_decode_front(
        weight, [4], is_neox=False, kv_cache_dtype="fp8", out_dtype=E4M3,
        cos_sin_dtype=torch.float32,
    ) >= 1  # fmt: skip
    out = torch.empty(4, 16, QUERY_WIDTH, dtype=E4M3, device="cuda")
    kwargs["out"] = out
    fusedq.mla_decode_front(*case.args, **kwargs)  # (a plan's first call: checks only)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fusedq.mla_decode_front(*case.args, **kwargs)
    case.cache_buf.copy_(staged.cache_buf)
    poison(out)
    graph.replay()
    ref = fusedq.staged_decode_front(*staged.args, **dict(staged.kwargs, out_dtype=torch.bfloat16,
                                                          q_scale=None))  # fmt: skip
    assert_matches(out, ref, "mxfp8", kwargs["q_scale"])
    assert torch.equal(_bits(case.cache_buf), _bits(staged.cache_buf))
