"""The decode front's argument checks and per-signature call plans, as ``fusedq.dispatch``
is the query's: ``validate`` / ``check`` (metadata only, so they also run while
``torch.compile`` traces), the fused kernel's ``choice``, ``call`` (the eager path through a
cached plan: the fused launch or ``front_reference.staged``) and ``prepare_traced`` (the
traced path before its custom-op call). The public entry points are ``fusedq.front``'s; the
custom ops (``fusedq.ops``) run ``call``.
"""

from __future__ import annotations

import torch

from fusedq import capability, dispatch, front_reference
from fusedq.contract import (
    KV_LORA,
    QK_ROPE,
    QUERY_WIDTH,
    Geometry,
    describe_geometries,
    geometry_of,
)
from fusedq.kernels import front_launch
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
            front_reference.staged(
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
