"""The fused MLA decode front: RoPE of q_pe and k_pe, the absorbed query projection, the
concat (and E4M3 quantisation) of the query, and the KV-cache write, in one launch.

vLLM runs these per layer and decode step as separate graph nodes: the rotary embedding,
the ``bmm`` with ``W_UK_T`` and the concat (or concat-and-quantise), and
``concat_and_cache_mla``. ``mla_decode_front`` does all of it in one Triton launch
(``kernels/triton_decode_front.py``); ``staged_decode_front`` composes the same steps the way
vLLM does, with torch ops, and is the fallback and the oracle.

The numerics, step by step, and the vLLM sources they follow:

- RoPE (both q_pe and k_pe): pairs ``(x1, x2)`` are ``(i, i + 32)`` for neox style and
  ``(2i, 2i + 1)`` for GPT-J style (DeepSeek-V3 and GLM-5 serve ``is_neox_style=False``);
  ``cos, sin`` are entries ``i`` and ``32 + i`` of ``cos_sin_cache[position]``, read in the
  cache's dtype; ``o1 = x1 cos - x2 sin``, ``o2 = x2 cos + x1 sin`` computed in fp32 and
  rounded once to bf16. That is what vLLM serves under torch.compile: its rotary embeddings'
  ``forward_native`` (``RotaryEmbedding.forward_static`` through
  ``ApplyRotaryEmb.forward_static``, and ``DeepseekScalingRotaryEmbedding.forward_static``:
  ``x * cos + rotate_gptj(x) * sin``, the same products) is traced by inductor, which loads
  the bf16 operands, computes in fp32 and rounds once on store. The ``cos_sin_cache`` vLLM
  feeds there is bf16: ``RotaryEmbeddingBase.__init__`` stores ``cache.to(dtype)`` (the model
  dtype) unless ``use_flashinfer``, which needs the custom op enabled, and custom ops are off
  under torch.compile; ``RotaryEmbedding.forward_native`` casts it to the query's dtype again
  (``_match_cos_sin_cache_dtype``). An fp32 cache (flashinfer's path,
  ``DeepseekV4ScalingRotaryEmbedding``) is taken as it is. (vLLM 0.26.0 wheel,
  ``vllm/model_executor/layers/rotary_embedding/{base,common,deepseek_scaling_rope}.py``.)
- The query: ``fusedq.reference.staged`` on the rotated q_pe (bmm, then cat or vLLM's static
  E4M3 quantisation ``x * (1 / q_scale)``), as ``mla_query_projection``.
- The cache write, vLLM's ``concat_and_cache_mla`` (``csrc/cache_kernels.cu``,
  ``concat_and_cache_mla_kernel``): a token with ``slot < 0`` writes nothing; otherwise entry
  ``[slot // block_size, slot % block_size]`` gets ``kv_c`` in ``[:512]`` and the rotated
  ``k_pe`` in ``[512:]``, copied for ``"auto"``, and for ``"fp8"``/``"fp8_e4m3"`` each value
  through ``fp8::scaled_convert<uint8_t, bf16, kFp8E4M3>(x, *scale)``, i.e.
  ``scaled_vec_conversion<uint8_t, __nv_bfloat16>``
  (``csrc/quantization/fp8/nvidia/quant_utils.cuh``): ``__nv_cvt_float_to_fp8(
  __bfloat162float(x) / scale, __NV_SATFINITE, __NV_E4M3)``: a correctly rounded fp32
  division (not the query's reciprocal multiply), saturated to ±448, rounded to nearest
  even.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fusedq import capability, dispatch, ops, reference  # noqa: F401 (ops registers the ops)
from fusedq.contract import (
    E4M3_MAX,
    KV_LORA,
    QK_ROPE,
    QUERY_WIDTH,
    Geometry,
    describe_geometries,
    geometry_of,
)
from fusedq.kernels import front_launch
from fusedq.mxfp8 import MXFP8Weight
from fusedq.selection import launch_config

E4M3 = torch.float8_e4m3fn
BACKENDS = ("auto", "triton", "staged")
# vLLM's kv_cache_dtype names this front writes, and the cache tensor dtypes each takes (vLLM
# allocates an fp8 cache as uint8 bytes or as float8_e4m3fn).
KV_CACHE_DTYPES: dict[str, tuple[torch.dtype, ...]] = {
    "auto": (torch.bfloat16,),
    "fp8": (torch.uint8, E4M3),
    "fp8_e4m3": (torch.uint8, E4M3),
}
POSITION_DTYPES = (torch.int64, torch.int32)
COS_SIN_DTYPES = (torch.float32, torch.bfloat16)
HALF = QK_ROPE // 2

Weight = torch.Tensor | MXFP8Weight


# --- validation (metadata only) -------------------------------------------------------------


def _tensor(name: str, t: object, dtypes: tuple[torch.dtype, ...], device) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: {type(t).__name__} is not a tensor")
    if t.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        raise ValueError(f"{name}: dtype {t.dtype} must be {want}")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: device {t.device} differs from q's {device}")
    return t


def _unit_last(name: str, t: torch.Tensor) -> None:
    if t.stride(-1) != 1:
        raise ValueError(f"{name}: last-dim stride {t.stride(-1)} must be 1")


class Checked:
    """A call's arguments, validated: the geometry, sizes, the output dtype, the weight's
    parts, ``k_pe`` as ``[M, 64]`` and the cache as E4M3 where it is fp8."""

    __slots__ = (
        "cache_fp8",
        "geometry",
        "k_pe_arg",
        "kv_cache",
        "m",
        "num_heads",
        "out_dtype",
        "scales",
        "values",
    )

    def __init__(self, **fields) -> None:
        for name, value in fields.items():
            setattr(self, name, value)

    # Views made where asked for: a traced call's checks would otherwise leave them as dead
    # nodes in its graph.
    @property
    def k_pe(self) -> torch.Tensor:
        k_pe = self.k_pe_arg
        return k_pe.reshape(self.m, QK_ROPE) if k_pe.dim() == 3 else k_pe

    @property
    def cache(self) -> torch.Tensor:
        return self.kv_cache.view(E4M3) if self.cache_fp8 else self.kv_cache


def validate(
    q, kv_c, k_pe, positions, cos_sin_cache, weight, kv_cache, slot_mapping, *, is_neox,
    kv_cache_dtype="auto", k_scale=None, out=None, out_dtype=None, q_scale=None, backend="auto",
    addresses=True,
) -> Checked:  # fmt: skip
    """Check every argument (``ValueError`` naming the first bad one, before anything is
    written). ``addresses=False`` leaves out the overlap checks, the only ones that read
    addresses: tensors being traced (fake tensors) have none."""
    values, scales = dispatch.split_weight(weight)
    return check(
        q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
        is_neox=is_neox, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, out=out,
        out_dtype=out_dtype, q_scale=q_scale, backend=backend, addresses=addresses,
    )  # fmt: skip


def check(
    q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping, *, is_neox,
    kv_cache_dtype, k_scale, out, out_dtype, q_scale, backend, addresses,
) -> Checked:  # fmt: skip
    """``validate`` on the weight's parts (``dispatch.split_weight``), as the custom op
    receives them."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} must be one of {BACKENDS}")
    if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype: {kv_cache_dtype!r} must be one of {sorted(KV_CACHE_DTYPES)} "
            "(vLLM's names this front writes)"
        )
    if not isinstance(is_neox, bool):
        raise ValueError(f"is_neox: {is_neox!r} must be True or False")
    _tensor("q", q, (torch.bfloat16,), None)
    device = q.device
    geometry = geometry_of(q.shape[2] - QK_ROPE) if q.dim() == 3 else None
    if geometry is None:
        raise ValueError(
            f"q: shape {tuple(q.shape)} must be [M, H, qk_nope + {QK_ROPE}] of a served "
            f"geometry ({describe_geometries()})"
        )
    _unit_last("q", q)
    m, num_heads, _ = q.shape
    dispatch.check_weight_for(
        values, scales, geometry.qk_nope, num_heads, device, anchor="q", anchor_dim="qk_nope"
    )
    _tensor("kv_c", kv_c, (torch.bfloat16,), device)
    if tuple(kv_c.shape) != (m, KV_LORA):
        raise ValueError(f"kv_c: shape {tuple(kv_c.shape)} must be [{m}, {KV_LORA}]")
    _unit_last("kv_c", kv_c)
    _tensor("k_pe", k_pe, (torch.bfloat16,), device)
    if tuple(k_pe.shape) not in ((m, QK_ROPE), (m, 1, QK_ROPE)):
        raise ValueError(
            f"k_pe: shape {tuple(k_pe.shape)} must be [{m}, {QK_ROPE}] or [{m}, 1, {QK_ROPE}]"
        )
    _unit_last("k_pe", k_pe)
    _tensor("positions", positions, POSITION_DTYPES, device)
    if tuple(positions.shape) != (m,):
        raise ValueError(f"positions: shape {tuple(positions.shape)} must be [{m}]")
    _tensor("cos_sin_cache", cos_sin_cache, COS_SIN_DTYPES, device)
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[1] != QK_ROPE:
        raise ValueError(
            f"cos_sin_cache: shape {tuple(cos_sin_cache.shape)} must be [max_position, "
            f"{QK_ROPE}] (cos | sin)"
        )
    _unit_last("cos_sin_cache", cos_sin_cache)
    _tensor("kv_cache", kv_cache, KV_CACHE_DTYPES[kv_cache_dtype], device)
    if kv_cache.dim() != 3 or kv_cache.shape[2] != QUERY_WIDTH:
        raise ValueError(
            f"kv_cache: shape {tuple(kv_cache.shape)} must be [num_blocks, block_size, "
            f"{QUERY_WIDTH}]"
        )
    _unit_last("kv_cache", kv_cache)
    _tensor("slot_mapping", slot_mapping, (torch.int64,), device)
    if tuple(slot_mapping.shape) != (m,):
        raise ValueError(f"slot_mapping: shape {tuple(slot_mapping.shape)} must be [{m}]")
    cache_fp8 = kv_cache_dtype != "auto"
    if k_scale is None and cache_fp8:
        raise ValueError(
            f"k_scale: a one-element fp32 tensor is required for kv_cache_dtype={kv_cache_dtype!r}"
        )
    if k_scale is not None:  # (vLLM passes the layer's k_scale with "auto" too: unused)
        _tensor("k_scale", k_scale, (torch.float32,), device)
        if k_scale.numel() != 1:
            raise ValueError(f"k_scale: {k_scale.numel()} elements, must be one")
    if out is not None and not isinstance(out, torch.Tensor):
        raise ValueError(f"out: {type(out).__name__} is not a tensor")
    out_dtype = dispatch.resolve_out_dtype(out, out_dtype)
    dispatch.check_q_scale(q_scale, out_dtype, device, anchor="q")
    if out is not None:
        dispatch.check_out(out, m, num_heads, device, anchor="q")
    if addresses:
        inputs = (q, kv_c, k_pe, positions, cos_sin_cache, values, scales, slot_mapping, k_scale,
                  q_scale)  # fmt: skip
        check_overlaps(out, kv_cache, inputs, extents_of(out, kv_cache, inputs))
    return Checked(
        geometry=geometry, m=m, num_heads=num_heads, out_dtype=out_dtype, values=values,
        scales=scales, k_pe_arg=k_pe, kv_cache=kv_cache, cache_fp8=cache_fp8,
    )  # fmt: skip


# The inputs an overlap check compares ``out`` and ``kv_cache`` with, in this order.
INPUT_NAMES = (
    "q", "kv_c", "k_pe", "positions", "cos_sin_cache", "weight", "weight scales",
    "slot_mapping", "k_scale", "q_scale",
)  # fmt: skip


def extents_of(out, kv_cache, inputs) -> tuple[int, int, tuple[int, ...]]:
    """The byte extents (``dispatch._extent``: 0 where None or empty) of ``out``,
    ``kv_cache`` and the inputs (``INPUT_NAMES`` order): metadata only, so a plan keeps
    them."""
    return (
        dispatch._extent(out),
        dispatch._extent(kv_cache),
        tuple(dispatch._extent(t) for t in inputs),
    )


def check_overlaps(out, kv_cache, inputs, extents) -> None:
    """``ValueError`` where the bytes ``out`` or ``kv_cache`` span intersect an input's, or
    each other's: what the call writes must not alias what it reads, and the addresses
    change from call to call, so this runs on every call."""
    out_extent, cache_extent, input_extents = extents
    for written, extent, name in ((out, out_extent, "out"), (kv_cache, cache_extent, "kv_cache")):
        if not extent:
            continue
        lo = written.data_ptr()
        hi = lo + extent
        for t, size, other in zip(inputs, input_extents, INPUT_NAMES, strict=True):
            if size:
                start = t.data_ptr()
                if start < hi and lo < start + size:
                    raise ValueError(
                        f"{name}: overlaps the memory of {other}; it must not alias it"
                    )
    if out_extent and cache_extent:
        lo_out, lo_cache = out.data_ptr(), kv_cache.data_ptr()
        if lo_out < lo_cache + cache_extent and lo_cache < lo_out + out_extent:
            raise ValueError("out: overlaps the memory of kv_cache")


# --- the fused path's selection ---------------------------------------------------------------


def choice(
    num_heads: int,
    m: int,
    *,
    geometry: Geometry | str,
    weight_format: str,
    out_dtype: torch.dtype,
    cache_fp8: bool,
    device: torch.device | str | None = None,
    qualified: bool = True,
):
    """(the front kernel's ``LaunchConfig``, None) where it runs this problem, else (None,
    why). The query part's configuration is the tl.dot kernel's entry of the query kernel's
    selection tables (``selection.launch_config``); ``qualified`` holds H and M to the
    geometry's qualified shapes, as ``backend="auto"`` does (``"triton"`` runs M up to 512)."""
    why = capability.explain(
        num_heads, m, geometry=geometry, weight_format=weight_format, out_dtype=out_dtype,
        device=device, qualified=qualified,
    )  # fmt: skip
    if why is None and cache_fp8:
        # An E4M3 cache needs the fp8 conversions an E4M3 output needs.
        why = capability.explain(
            num_heads, m, geometry=geometry, weight_format=weight_format, out_dtype=E4M3,
            device=device, qualified=qualified,
        )  # fmt: skip
        why = why and f"an fp8 KV cache: {why}"
    if why is not None:
        return None, why
    config = launch_config(
        num_heads, m, weight_format, out_dtype == E4M3, allow_fma=False, allow_gluon=False,
        pdl=False, geometry=capability.served_geometry(geometry),
    )  # fmt: skip
    return config, None


# --- the reference ------------------------------------------------------------------------


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    """RoPE of bf16 ``x`` (``[M, 64]`` or ``[M, H, 64]``) at ``positions``, in fp32, rounded
    once to bf16 (the module docstring says why)."""
    cos_sin = cos_sin_cache.index_select(0, positions.long()).float()
    cos, sin = cos_sin[:, :HALF], cos_sin[:, HALF:]
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    xf = x.float()
    if is_neox:
        x1, x2 = xf[..., :HALF], xf[..., HALF:]
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    # Each rotated half goes back to the columns its pair came from.
    rotated = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
    return rotated.to(torch.bfloat16)


def quantize_cache_e4m3(x: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """``E4M3(clamp(x / k_scale, ±448))`` in fp32: vLLM's ``scaled_convert`` into an fp8
    cache (a division, saturating; the module docstring cites it)."""
    y = x.float() / k_scale.reshape(()).float()
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def write_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
) -> None:
    """vLLM's ``concat_and_cache_mla`` with torch ops: ``cache`` (bf16, or E4M3 given
    ``k_scale``) entry ``[slot // block_size, slot % block_size] = [kv_c | k_pe]`` for every
    token whose slot is not negative."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = cache.shape[1]
    entries = torch.cat((kv_c, k_pe), dim=-1)[keep]
    if cache.dtype == E4M3:
        assert k_scale is not None
        entries = quantize_cache_e4m3(entries, k_scale)
    cache[slots // block_size, slots % block_size] = entries


def _staged(qk_nope, q, values, scales, kv_c, k_pe, positions, cos_sin_cache, cache,
            slot_mapping, out, q_scale, k_scale, *, neox) -> None:  # fmt: skip
    """The staged path on checked operands (``k_pe`` ``[M, 64]``, an fp8 cache as E4M3 with
    its ``k_scale``, else ``k_scale`` None)."""
    q_pe = rope(q[..., qk_nope:], positions, cos_sin_cache, neox)
    k_pe = rope(k_pe, positions, cos_sin_cache, neox)
    reference.staged(q[..., :qk_nope], values, scales, q_pe, out, q_scale)
    write_cache(kv_c, k_pe, cache, slot_mapping, k_scale)


# --- plans: each call signature checked once (as the query's, dispatch.call) -----------------


class FrontPlan:
    """What every eager call of one signature runs: allocate ``out`` or check it and the
    cache for overlaps, then the fused launch (``config``) or the staged path (None)."""

    __slots__ = (
        "cache_bytes", "cache_fp8", "config", "device", "extents", "flat_k_pe", "fused",
        "m", "out_dtype", "out_shape", "qk_nope",
    )  # fmt: skip

    def __init__(self, c: Checked, config, k_pe: torch.Tensor, kv_cache: torch.Tensor,
                 extents, device) -> None:  # fmt: skip
        self.config = config
        self.fused = config is not None
        self.qk_nope = c.geometry.qk_nope
        self.m = c.m
        self.out_shape = (c.m, c.num_heads, QUERY_WIDTH)
        self.out_dtype = c.out_dtype
        self.device = device
        self.cache_fp8 = c.cache_fp8
        self.cache_bytes = kv_cache.dtype == torch.uint8  # viewed as E4M3 for the launch
        self.flat_k_pe = k_pe.dim() == 3  # [M, 1, 64], viewed as [M, 64]
        self.extents = extents  # extents_of(...) of the signature's tensors

    def __call__(self, q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache,
                 slot_mapping, k_scale, out, q_scale, neox) -> torch.Tensor:  # fmt: skip
        inputs = (q, kv_c, k_pe, positions, cos_sin_cache, values, scales, slot_mapping, k_scale,
                  q_scale)  # fmt: skip
        check_overlaps(out, kv_cache, inputs, self.extents)
        if out is None:  # (fresh memory: nothing to check it against)
            out = torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)
        if self.flat_k_pe:
            k_pe = k_pe.view(self.m, QK_ROPE)
        cache = kv_cache.view(E4M3) if self.cache_bytes else kv_cache
        k_scale = k_scale if self.cache_fp8 else None
        if self.config is None:
            _staged(
                self.qk_nope, q, values, scales, kv_c, k_pe, positions, cos_sin_cache, cache,
                slot_mapping, out, q_scale, k_scale, neox=neox,
            )  # fmt: skip
        else:
            front_launch.launch(
                q, values, scales, kv_c, k_pe, positions, cos_sin_cache, cache, slot_mapping,
                out, q_scale, k_scale, config=self.config, neox=neox,
            )  # fmt: skip
        return out


class _FrontOpPlan:
    """Tensor subclasses (fake, functional, ...) go through the custom op, whose fake twin
    the active mode traces: no addresses to read, nothing to launch."""

    __slots__ = ("backend", "kv_cache_dtype", "out_dtype", "out_shape")

    def __init__(self, c: Checked, kv_cache_dtype: str, backend: str) -> None:
        self.out_shape = (c.m, c.num_heads, QUERY_WIDTH)
        self.out_dtype = c.out_dtype
        self.kv_cache_dtype, self.backend = kv_cache_dtype, backend

    def __call__(self, q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache,
                 slot_mapping, k_scale, out, q_scale, neox) -> torch.Tensor:  # fmt: skip
        if out is None:
            out = q.new_empty(self.out_shape, dtype=self.out_dtype)
        torch.ops.fusedq.mla_decode_front(
            q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
            out, k_scale, q_scale, neox, self.kv_cache_dtype, self.backend,
        )  # fmt: skip
        return out


def call(
    q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping, *, is_neox,
    kv_cache_dtype, k_scale, out, out_dtype, q_scale, backend, real=False,
) -> torch.Tensor:  # fmt: skip
    """Run the front eagerly through its signature's plan (``dispatch.cached_plan``); returns
    the query. The signature: every tensor's type, dtype, shape, strides and device, and the
    options (``is_neox`` with its type, so that ``1`` is still refused after ``True``).

    ``real``: the caller is the custom op's real implementation, so the tensors are real and
    must be launched on, never handed back to the custom op (which would call this again)."""
    meta = dispatch.meta
    try:
        key = (
            "decode_front", real, meta(q), meta(kv_c), meta(k_pe), meta(positions),
            meta(cos_sin_cache), meta(values), meta(scales), meta(kv_cache), meta(slot_mapping),
            meta(k_scale), meta(out), meta(q_scale), is_neox, type(is_neox), kv_cache_dtype,
            out_dtype, backend,
        )  # fmt: skip
    except Exception:  # an argument without tensor metadata: validate names it
        key = None
    key, plan = dispatch.cached_plan(key)
    if plan is None:
        plan = dispatch.keep_plan(
            key,
            _new_plan(
                q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache,
                slot_mapping, is_neox, kv_cache_dtype, k_scale, out, out_dtype, q_scale,
                backend, real,
            ),
        )  # fmt: skip
    return plan(
        q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
        k_scale, out, q_scale, is_neox,
    )  # fmt: skip


def _new_plan(q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
              is_neox, kv_cache_dtype, k_scale, out, out_dtype, q_scale, backend, real):  # fmt: skip
    tensors = (q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
               k_scale, out, q_scale)  # fmt: skip
    plain = real or all(not isinstance(t, torch.Tensor) or dispatch._is_plain(t) for t in tensors)
    c = check(
        q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
        is_neox=is_neox, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, out=out,
        out_dtype=out_dtype, q_scale=q_scale, backend=backend, addresses=False,
    )  # fmt: skip
    if not plain:
        return _FrontOpPlan(c, kv_cache_dtype, backend)
    config = None
    if backend != "staged":
        config, why = choice(
            c.num_heads, c.m, geometry=c.geometry,
            weight_format="bf16" if c.scales is None else "mxfp8", out_dtype=c.out_dtype,
            cache_fp8=c.cache_fp8, device=q.device, qualified=backend != "triton",
        )  # fmt: skip
        if config is None and backend == "triton":
            raise ValueError(f"backend='triton' cannot run this call: {why}")
    inputs = (q, kv_c, k_pe, positions, cos_sin_cache, values, scales, slot_mapping, k_scale,
              q_scale)  # fmt: skip
    return FrontPlan(c, config, k_pe, kv_cache, extents_of(out, kv_cache, inputs), q.device)


# --- the public entry points ------------------------------------------------------------------


def mla_decode_front(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    weight: Weight,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    is_neox: bool,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    q_scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """One MLA decode step's front, in one launch: RoPE of q_pe and k_pe, ``[q_nope @ W_UK_T |
    rope(q_pe)]`` into the query (BF16 or E4M3), ``[kv_c | rope(k_pe)]`` into the KV cache.

    Parameters
    ----------
    q : bf16 ``[M, H, qk_nope + 64]``, q_b_proj's output per head, q_pe not yet rotated; any
        row and head strides, unit last stride. Its width names the geometry.
    kv_c : bf16 ``[M, 512]`` (kv_c_normed), unit last stride.
    k_pe : bf16 ``[M, 64]`` or ``[M, 1, 64]``, not yet rotated, unit last stride (vLLM passes
        a strided slice of kv_a_proj's output).
    positions : int64 or int32 ``[M]``, each below ``cos_sin_cache``'s rows (not checked: that
        would read the device).
    cos_sin_cache : fp32 or bf16 ``[max_position, 64]``, cos then sin (the layer's own, any
        scaling baked in), unit last stride.
    weight : bf16 ``W_UK_T`` ``[H, qk_nope, 512]`` with any strides, or an ``MXFP8Weight``.
    kv_cache : ``[num_blocks, block_size, 576]``, any block and slot strides, unit last
        stride: bf16 for ``kv_cache_dtype="auto"``, uint8 or float8_e4m3fn for ``"fp8"`` /
        ``"fp8_e4m3"``.
    slot_mapping : int64 ``[M]``; a negative slot writes nothing (vLLM's padding).
    is_neox : rotary style: neox (halves) or GPT-J (interleaved pairs, DeepSeek-V3 and GLM-5).
    kv_cache_dtype : vLLM's name of the cache's format.
    k_scale : one-element fp32 tensor; the cache stores ``E4M3(x / k_scale)`` where fp8.
    out, out_dtype, q_scale : the query's output, as ``mla_query_projection``.
    backend : ``"auto"`` (the fused kernel at the geometry's qualified H and M, else
        staged), ``"triton"`` (the fused kernel at any H and M it runs, M up to 512; raises
        ``ValueError`` with the reason where it cannot), ``"staged"`` (the reference).

    Returns the query ``[M, H, 576]``. Bad input raises ``ValueError`` naming the argument
    before anything is written.

    The first call with a signature (every tensor's type, dtype, shape, strides and device,
    and the options) is checked in full and its plan cached; later calls with that signature
    only check that ``out`` and ``kv_cache`` overlap no input. While ``torch.compile``
    traces, the call is the custom op ``fusedq::mla_decode_front`` (``fusedq.ops``).
    """
    values, scales = dispatch.split_weight(weight)
    if torch.compiler.is_compiling():
        out = prepare_traced(
            q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
            is_neox=is_neox, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, out=out,
            out_dtype=out_dtype, q_scale=q_scale, backend=backend,
        )  # fmt: skip
        torch.ops.fusedq.mla_decode_front(
            q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
            out, k_scale, q_scale, is_neox, kv_cache_dtype, backend,
        )  # fmt: skip
        return out
    return call(
        q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
        is_neox=is_neox, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, out=out,
        out_dtype=out_dtype, q_scale=q_scale, backend=backend,
    )  # fmt: skip


def prepare_traced(
    q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping, *, is_neox,
    kv_cache_dtype, k_scale, out, out_dtype, q_scale, backend,
) -> torch.Tensor:  # fmt: skip
    """The traced path (``torch.compile``) before its custom-op call: the checks that read
    metadata only (the overlaps and the backend's choice are the op's, when it runs), and
    ``out`` allocated where None; returns ``out``."""
    c = check(
        q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
        is_neox=is_neox, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, out=out,
        out_dtype=out_dtype, q_scale=q_scale, backend=backend, addresses=False,
    )  # fmt: skip
    if out is None:
        out = torch.empty((c.m, c.num_heads, QUERY_WIDTH), dtype=c.out_dtype, device=q.device)
    return out


def staged_decode_front(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    weight: Weight,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    is_neox: bool,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The staged reference of ``mla_decode_front`` (same arguments and results): RoPE, then
    ``fusedq.reference.staged``, then vLLM's ``concat_and_cache_mla`` with torch ops."""
    if torch.compiler.is_compiling():
        values, scales = dispatch.split_weight(weight)
        out = prepare_traced(
            q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
            is_neox=is_neox, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, out=out,
            out_dtype=out_dtype, q_scale=q_scale, backend="staged",
        )  # fmt: skip
        torch.ops.fusedq.staged_decode_front(
            q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
            out, k_scale, q_scale, is_neox, kv_cache_dtype,
        )  # fmt: skip
        return out
    return mla_decode_front(
        q, kv_c, k_pe, positions, cos_sin_cache, weight, kv_cache, slot_mapping,
        is_neox=is_neox, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, out=out,
        out_dtype=out_dtype, q_scale=q_scale, backend="staged",
    )  # fmt: skip


def prewarm_decode_front(
    weight: Weight,
    m_values: Iterable[int],
    *,
    is_neox: bool,
    kv_cache_dtype: str = "auto",
    out_dtype: torch.dtype = torch.bfloat16,
    cos_sin_dtype: torch.dtype = torch.bfloat16,
    positions_dtype: torch.dtype = torch.int64,
) -> int:
    """Compile every front variant that ``backend="auto"`` calls with these M values need
    (before capturing CUDA graphs: an uncompiled variant raises under capture). Returns how
    many variants were compiled now."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype: {kv_cache_dtype!r} must be one of {sorted(KV_CACHE_DTYPES)}"
        )
    values, scales = dispatch.split_weight(weight)
    geometry = dispatch.check_weight(values, scales)
    cache_fp8 = kv_cache_dtype != "auto"
    compiled = 0
    for m in sorted({int(m) for m in m_values}):
        config, _ = choice(
            values.shape[0], m, geometry=geometry,
            weight_format="bf16" if scales is None else "mxfp8", out_dtype=out_dtype,
            cache_fp8=cache_fp8, device=values.device,
        )  # fmt: skip
        if config is not None:
            compiled += front_launch.prewarm(
                values, scales, m, out_dtype, config, neox=is_neox, cache_fp8=cache_fp8,
                cos_sin_dtype=cos_sin_dtype, positions_dtype=positions_dtype,
            )  # fmt: skip
    return compiled
