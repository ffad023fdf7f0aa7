"""Argument validation and the per-signature call plan: checked once, then run.

In eager decode every layer of every step calls the query projection, so what a call checks
is paid ~78 times per step. A call's *signature* is everything the checks and the path
choice read: for each tensor its type, dtype, shape, strides and device, plus ``out_dtype``,
``backend`` and ``pdl``. The first call with a signature runs ``validate``, asks
``selection.select`` which kernel runs it (fused or staged, and its launch configuration) and
binds that launch (``fast_launch.BoundLaunch``, or the CuTe kernel's ``BoundCute``); the plan
is cached under the signature, as FlashInfer's ``skip_check`` does. Later calls build the key
(one tuple), probe the cache and run the plan. A call with any new stride, dtype or shape
misses the cache and is checked in full, so bad input still gets its error.

Two things depend on addresses and stay per call: ``out`` must not overlap an input (the byte
extents are computed once, the comparison per call), and the pointers' alignment picks among
the compiled variants (inside ``BoundLaunch``).

The decode front (``fusedq.front_dispatch``) keeps its plans in the same cache, through
``cached_plan`` and ``keep_plan``.

The selection depends on process-wide facts besides the signature (Triton importable, the
device's capability, ``TRITON_INTERPRET``, what is installed); they do not change within a
process, and ``clear_plans`` forgets every plan where a test changes them.

Every check here reads metadata only, so ``validate`` also runs while ``torch.compile``
traces with fake tensors (``through_op``).
"""

from __future__ import annotations

import torch

from fusedq.capability import OUT_DTYPES, cute_problem
from fusedq.contract import (
    GEOMETRIES,
    KV_LORA,
    QK_ROPE,
    QUERY_WIDTH,
    Geometry,
    describe_geometries,
    geometry_of,
)
from fusedq.kernels import fast_launch
from fusedq.kernels.triton_launch import DEFAULT_PDL
from fusedq.mxfp8 import SCALE_BLOCKS, MXFP8Weight
from fusedq.reference import staged
from fusedq.selection import select

BACKENDS = ("auto", "triton", "cute", "staged")
# Signatures are few in practice (one per M per weight layout); a caller whose shapes never
# repeat must not grow the cache without bound.
MAX_PLANS = 4096

Weight = torch.Tensor | MXFP8Weight


# --- validation (metadata only) -------------------------------------------------------------


def split_weight(weight: Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(values, scale bytes) of an ``MXFP8Weight``, or (weight, None)."""
    if isinstance(weight, MXFP8Weight):
        return weight.values, weight.scales
    return weight, None


_NOPE_WIDTHS = " or ".join(str(g.qk_nope) for g in GEOMETRIES)


def _check_activation(name: str, t: object, width: int | None, device: torch.device | None) -> None:
    """A bf16 ``[M, H, width]`` tensor with a unit last stride; ``width=None`` (q_nope) takes
    any served geometry's qk_nope, which then names the call's geometry."""
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: {type(t).__name__} is not a tensor")
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{name}: dtype {t.dtype} must be torch.bfloat16")
    if width is None:
        if t.dim() != 3 or geometry_of(t.shape[2]) is None:
            raise ValueError(
                f"{name}: shape {tuple(t.shape)} must be [M, H, qk_nope] with qk_nope "
                f"{_NOPE_WIDTHS}, a served geometry's ({describe_geometries()})"
            )
    elif t.dim() != 3 or t.shape[2] != width:
        raise ValueError(f"{name}: shape {tuple(t.shape)} must be [M, H, {width}]")
    if t.stride(2) != 1:
        raise ValueError(f"{name}: last-dim stride {t.stride(2)} must be 1")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: device {t.device} differs from q_nope's {device}")


def geometry_of_weight(values: torch.Tensor) -> Geometry | None:
    """The served geometry a ``[H, qk_nope, kv_lora]`` weight's shape names, or None."""
    if values.dim() != 3:
        return None
    return geometry_of(values.shape[1], QK_ROPE, values.shape[2])


def check_weight(values: object, scales: object) -> Geometry:
    """A bf16 ``[H, qk_nope, 512]`` tensor of a served geometry, or the parts of an
    ``MXFP8Weight`` (which checked them at construction; the custom op receives them apart).
    Returns the geometry the shape names."""
    if scales is None:
        if not isinstance(values, torch.Tensor):
            raise ValueError(f"weight: {type(values).__name__} is neither a tensor nor MXFP8Weight")
        if values.dtype != torch.bfloat16:
            raise ValueError(
                f"weight: dtype {values.dtype} must be torch.bfloat16 (or pass an MXFP8Weight)"
            )
    elif not (
        isinstance(values, torch.Tensor)
        and isinstance(scales, torch.Tensor)
        and values.dtype == torch.float8_e4m3fn
        and scales.dtype == torch.uint8
        and tuple(scales.shape) == (*values.shape[:2], SCALE_BLOCKS)
        and scales.device == values.device
    ):
        raise ValueError(
            "weight: MXFP8 parts must be float8_e4m3fn values [H, qk_nope, 512] and uint8 "
            f"scales [H, qk_nope, {SCALE_BLOCKS}] on one device (build them with MXFP8Weight)"
        )
    geometry = geometry_of_weight(values)
    if geometry is None:
        raise ValueError(
            f"weight: shape {tuple(values.shape)} must be [H, qk_nope, {KV_LORA}] with qk_nope "
            f"{_NOPE_WIDTHS}, a served geometry's ({describe_geometries()})"
        )
    return geometry


def check_weight_for(
    values: object,
    scales: object,
    qk_nope: int,
    num_heads: int,
    device: torch.device,
    anchor: str = "q_nope",
    anchor_dim: str = "last dim",
) -> Geometry:
    """``check_weight``, then that the weight is the query's: its geometry (the ``qk_nope`` the
    argument named ``anchor`` shows as its ``anchor_dim``), heads and device."""
    geometry = check_weight(values, scales)
    if geometry.qk_nope != qk_nope:
        raise ValueError(
            f"weight: shape {tuple(values.shape)} is {geometry.name}'s [H, {geometry.qk_nope}, "
            f"{KV_LORA}], {anchor}'s {anchor_dim} {qk_nope} is {geometry_of(qk_nope).name}'s"
        )
    if values.shape[0] != num_heads:
        raise ValueError(f"weight: {values.shape[0]} heads, {anchor} has {num_heads}")
    if values.device != device:
        raise ValueError(f"weight: device {values.device} differs from {anchor}'s {device}")
    return geometry


def resolve_out_dtype(out: torch.Tensor | None, out_dtype: torch.dtype | None) -> torch.dtype:
    """``out_dtype``, or when it is ``None`` the dtype of ``out`` (BF16 without ``out``);
    ``ValueError`` naming both dtypes when they disagree or naming the unsupported one."""
    if out_dtype is None:
        if out is None:
            return torch.bfloat16
        if out.dtype not in OUT_DTYPES:
            raise ValueError(
                f"out: dtype {out.dtype} must be torch.bfloat16 or torch.float8_e4m3fn "
                "(the output dtype is taken from out when out_dtype is None)"
            )
        return out.dtype
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype: {out_dtype} must be torch.bfloat16 or torch.float8_e4m3fn")
    if out is not None and out.dtype != out_dtype:
        raise ValueError(f"out: dtype {out.dtype} differs from out_dtype={out_dtype}")
    return out_dtype


def check_q_scale(
    q_scale: object, out_dtype: torch.dtype, device: torch.device, anchor: str = "q_nope"
) -> None:
    """``q_scale`` for the output dtype: a one-element fp32 tensor on ``device`` (that of the
    argument named ``anchor``) for E4M3, None for BF16."""
    if out_dtype == torch.bfloat16:
        if q_scale is not None:
            raise ValueError("q_scale: must be None for bf16 output (it is for E4M3 only)")
        return
    if q_scale is None:
        raise ValueError("q_scale: a one-element fp32 tensor is required for E4M3 output")
    if not isinstance(q_scale, torch.Tensor):
        raise ValueError(f"q_scale: {type(q_scale).__name__} is not a tensor")
    if q_scale.dtype != torch.float32 or q_scale.numel() != 1:
        raise ValueError(
            f"q_scale: dtype {q_scale.dtype} with {q_scale.numel()} elements must be a "
            "one-element torch.float32 tensor"
        )
    if q_scale.device != device:
        raise ValueError(f"q_scale: device {q_scale.device} differs from {anchor}'s {device}")


def check_out(
    out: object, m: int, num_heads: int, device: torch.device, anchor: str = "q_nope"
) -> None:
    """A given ``out``: ``[m, num_heads, 576]`` with a unit last stride on ``device``."""
    if tuple(out.shape) != (m, num_heads, QUERY_WIDTH):
        raise ValueError(f"out: shape {tuple(out.shape)} must be [{m}, {num_heads}, {QUERY_WIDTH}]")
    if out.stride(2) != 1:
        raise ValueError(f"out: last-dim stride {out.stride(2)} must be 1")
    if out.device != device:
        raise ValueError(f"out: device {out.device} differs from {anchor}'s {device}")


def validate(
    q_nope: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    q_pe: torch.Tensor,
    out: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    q_scale: torch.Tensor | None,
    backend: str,
    pdl: bool | None,
) -> tuple[torch.dtype, bool]:
    """Check every argument (``ValueError`` naming the first bad one); returns the output
    dtype (see ``resolve_out_dtype``) and ``pdl`` resolved (``None`` is ``DEFAULT_PDL``)."""
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"backend: {backend!r} must be one of {BACKENDS}")
    if pdl not in (None, True, False):
        raise ValueError(f"pdl: {pdl!r} must be True, False or None (the FUSEDQ_PDL default)")
    _check_activation("q_nope", q_nope, None, None)
    device = q_nope.device
    m, num_heads, qk_nope = q_nope.shape
    _check_activation("q_pe", q_pe, QK_ROPE, device)
    if tuple(q_pe.shape[:2]) != (m, num_heads):
        raise ValueError(f"q_pe: shape {tuple(q_pe.shape)} must be [{m}, {num_heads}, {QK_ROPE}]")
    check_weight_for(values, scales, qk_nope, num_heads, device)
    if out is not None and not isinstance(out, torch.Tensor):
        raise ValueError(f"out: {type(out).__name__} is not a tensor")
    out_dtype = resolve_out_dtype(out, out_dtype)
    check_q_scale(q_scale, out_dtype, device)
    if out is not None:
        check_out(out, m, num_heads, device)
    return out_dtype, DEFAULT_PDL if pdl is None else bool(pdl)


# --- plans ----------------------------------------------------------------------------------


def _extent(t: torch.Tensor | None) -> int:
    """Bytes from a tensor's first to one past its last element (0: nothing to overlap)."""
    if t is None or t.numel() == 0:
        return 0
    return (sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1) * (
        t.element_size()
    )


INPUT_NAMES = ("q_nope", "q_pe", "weight", "weight scales", "q_scale")


class Plan:
    """What every call of one signature runs: allocate or overlap-check ``out``, then
    ``launch`` (a ``BoundLaunch``, or the staged reference)."""

    __slots__ = ("device", "extents", "fused", "launch", "out_dtype", "out_shape", "pdl")

    def __init__(self, launch, fused: bool, out_shape, out_dtype, device, extents, pdl) -> None:
        self.launch = launch
        self.fused = fused
        self.out_shape = out_shape
        self.out_dtype = out_dtype
        self.device = device
        # (out extent, input extents in INPUT_NAMES order), or None when out is allocated.
        self.extents = extents
        self.pdl = pdl  # as validate resolved it (None is DEFAULT_PDL)

    def new_out(self) -> torch.Tensor:
        return torch.empty(self.out_shape, dtype=self.out_dtype, device=self.device)

    def __call__(self, q_nope, values, scales, q_pe, out, q_scale) -> torch.Tensor:
        if out is None:
            # Fresh memory cannot overlap an input: no check needed.
            out = self.new_out()
        elif self.extents is not None:
            self._check_overlap(out, (q_nope, q_pe, values, scales, q_scale))
        self.launch(q_nope, values, scales, q_pe, out, q_scale)
        return out

    def _check_overlap(self, out, inputs) -> None:
        out_extent, extents = self.extents
        lo = out.data_ptr()
        hi = lo + out_extent
        for t, extent, name in zip(inputs, extents, INPUT_NAMES, strict=True):
            if extent:
                start = t.data_ptr()
                if start < hi and lo < start + extent:
                    raise ValueError(
                        f"out: overlaps the memory of {name}; it must not alias an input"
                    )


class _OpPlan:
    """Tensor subclasses (fake, functional, ...) go through the custom op, whose fake twin
    the active mode traces: no addresses to read, nothing to launch."""

    __slots__ = ("backend", "out_dtype", "pdl")

    def __init__(self, out_dtype: torch.dtype, backend: str, pdl: bool) -> None:
        self.out_dtype, self.backend, self.pdl = out_dtype, backend, pdl

    def __call__(self, q_nope, values, scales, q_pe, out, q_scale) -> torch.Tensor:
        if out is None:
            m, num_heads, _ = q_nope.shape
            out = q_nope.new_empty((m, num_heads, QUERY_WIDTH), dtype=self.out_dtype)
        torch.ops.fusedq.mla_query_projection(
            q_nope, values, scales, q_pe, out, q_scale, self.backend, self.pdl
        )
        return out


_plans: dict[tuple, Plan | _OpPlan] = {}


def clear_plans() -> None:
    """Forget every plan (the next call of each signature is checked again)."""
    _plans.clear()


def plan_count() -> int:
    return len(_plans)


def _meta(t: torch.Tensor) -> tuple:
    return (type(t), t.dtype, t.shape, t.stride(), t.device)


def meta(t: torch.Tensor | None) -> tuple | None:
    """A tensor argument's part of a signature (None for an absent optional one); raises
    for what is not a tensor (the full checks then name it)."""
    return None if t is None else _meta(t)


def cached_plan(key: tuple | None) -> tuple[tuple | None, object]:
    """(``key``, the plan kept under it or None); the key comes back None where it cannot
    be hashed (an unhashable option, which the full checks then name): nothing to keep."""
    if key is None:
        return None, None
    try:
        return key, _plans.get(key)
    except TypeError:
        return None, None


def keep_plan(key: tuple | None, plan):
    """Keep ``plan`` under ``key`` (as ``cached_plan`` returned it); returns ``plan``. The
    query's and the decode front's plans share the cache (and ``MAX_PLANS``, and
    ``clear_plans``: both depend on the same process-wide facts); a front key starts with
    ``"decode_front"``, a query key with a bool."""
    if key is not None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        _plans[key] = plan
    return plan


def call(
    q_nope: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    q_pe: torch.Tensor,
    out: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    q_scale: torch.Tensor | None,
    backend: str,
    pdl: bool | None,
    *,
    real: bool = False,
) -> torch.Tensor:
    """Run the query projection eagerly through its signature's plan; returns ``out``.

    ``real``: the caller is a custom op's real implementation, so the tensors are real and
    must be launched on, never handed back to the custom op (which would call this again).
    """
    try:
        key = (
            real,
            _meta(q_nope),
            _meta(values),
            None if scales is None else _meta(scales),
            _meta(q_pe),
            None if out is None else _meta(out),
            None if q_scale is None else _meta(q_scale),
            out_dtype,
            backend,
            pdl,
        )
    except Exception:  # an argument without tensor metadata: validate names it
        key = None
    key, plan = cached_plan(key)
    if plan is None:
        plan = keep_plan(
            key,
            _new_plan(
                q_nope, values, scales, q_pe, out, out_dtype, q_scale, backend, pdl, real=real
            ),
        )
    if not real and isinstance(plan, Plan) and _profiling():
        # Under torch's profiler the call goes through the custom op, so traces name it
        # (a cpu_op fusedq::mla_query_projection) as they did before the fast path: the trace
        # reader's query-step rule reads that name where no kernel event exists (the CPU
        # build), and an eager GPU kernel's launcher is its ground truth. Otherwise the check
        # is one C call.
        if out is None:
            out = plan.new_out()
        torch.ops.fusedq.mla_query_projection(
            q_nope, values, scales, q_pe, out, q_scale, backend, plan.pdl
        )
        return out
    return plan(q_nope, values, scales, q_pe, out, q_scale)


_profiling = torch.autograd._profiler_enabled


def _is_plain(t: torch.Tensor) -> bool:
    # Parameters (vLLM's weights are Parameter subclasses) hold real storage: launch on them.
    # Found by vLLM's CPU e2e test: treating them as subclasses sent the call to the custom
    # op, whose real implementation came back here, until the recursion limit.
    return type(t) is torch.Tensor or isinstance(t, torch.nn.Parameter)


def _new_plan(q_nope, values, scales, q_pe, out, out_dtype, q_scale, backend, pdl, *, real):
    out_dtype, pdl = validate(q_nope, values, scales, q_pe, out, out_dtype, q_scale, backend, pdl)
    tensors = (q_nope, values, scales, q_pe, out, q_scale)
    if not real and any(t is not None and not _is_plain(t) for t in tensors):
        return _OpPlan(out_dtype, backend, pdl)
    m, num_heads, _ = q_nope.shape
    device = q_nope.device
    out_shape = (m, num_heads, QUERY_WIDTH)
    extents = None
    if out is not None and out.numel():
        extents = (_extent(out), tuple(_extent(t) for t in (q_nope, q_pe, values, scales, q_scale)))
    if backend != "staged":
        weight_format = "bf16" if scales is None else "mxfp8"
        # "triton" runs wherever the kernel runs; "auto" and "cute" only where qualified.
        chosen = select(
            num_heads, m, geometry=geometry_of(q_nope.shape[2]), weight_format=weight_format,
            out_dtype=out_dtype, device=device, pdl=pdl, qualified=backend != "triton",
        )  # fmt: skip
        if chosen.path != "staged":
            example = (
                out if out is not None else torch.empty(out_shape, dtype=out_dtype, device=device)
            )
            bound = fast_launch.BoundLaunch(q_nope, values, scales, q_pe, example, chosen.config)
            if backend == "cute" or (backend == "auto" and chosen.path == "cute"):
                bound = _bind_cute(bound, backend, (q_nope, values, scales, q_pe, example), pdl)
            return Plan(bound, True, out_shape, out_dtype, device, extents, pdl)
        if backend in ("triton", "cute"):
            raise ValueError(f"backend={backend!r} cannot run this call: {chosen.why}")
    return Plan(staged, False, out_shape, out_dtype, device, extents, pdl)


def _bind_cute(triton_launch, backend: str, operands: tuple, pdl: bool):
    """The CuTe kernel's launch, for ``backend="cute"`` or where ``backend="auto"``'s selection
    chose it; under ``"auto"`` the Triton launch is its fallback (eager calls, misaligned
    addresses) and stands in for it where these operands' signature does not qualify.
    ``backend="cute"`` names why it cannot run."""
    from fusedq.kernels import cute_mla_query

    q_nope, values, scales, q_pe, out = operands
    m, num_heads, _ = q_nope.shape
    why = None
    if backend == "cute":  # (under "auto" the selection checked this gate)
        weight_format = "bf16" if scales is None else "mxfp8"
        why = cute_problem(weight_format, out.dtype, pdl=pdl, geometry=geometry_of(q_nope.shape[2]))
    if why is None:
        # This signature's operands (strides, alignment) the CuTe kernel must also take.
        why = cute_mla_query.unsupported_reason(q_nope, values, scales, q_pe, out)
        if why is None:
            fallback = None if backend == "cute" else triton_launch
            return cute_mla_query.BoundCute(
                fallback, num_heads, m, out.device,
                out_fp8=out.dtype == torch.float8_e4m3fn, bf16_weights=scales is None,
            )  # fmt: skip
    if backend == "cute":
        raise ValueError(f"backend='cute' cannot run this call: {why}")
    return triton_launch


def prepare_traced(
    q_nope, weight, q_pe, out, out_dtype, q_scale, backend: str, pdl: bool | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor, bool]:
    """The traced path (``torch.compile``) before its custom-op call: validate, split the
    weight, allocate ``out``; returns (values, scales, out, pdl resolved)."""
    values, scales = split_weight(weight)
    out_dtype, pdl = validate(q_nope, values, scales, q_pe, out, out_dtype, q_scale, backend, pdl)
    if out is None:
        m, num_heads, _ = q_nope.shape
        out = torch.empty((m, num_heads, QUERY_WIDTH), dtype=out_dtype, device=q_nope.device)
    return values, scales, out, pdl
