"""CuTe DSL kernel for the fused MLA decode query projection with MXFP8 or bf16 weights, BF16
or E4M3 out.

Same op as ``triton_mla_query``::

    out[m, h, :512]    = q_nope[m, h, :192] @ dequant(values, scales)[h]   (BF16)
    out[m, h, 512:576] = q_pe[m, h, :64]

or, for E4M3 out, both parts as vLLM's static FP8 quant: ``clamp(x * (1 / q_scale), ±448)``
rounded to nearest even, with ``x`` the BF16 value above and ``1 / q_scale`` one correctly
rounded reciprocal of the scale, which the kernel loads from its one-element fp32 tensor.
bf16 weights: ``values`` itself (vLLM's W_UK_T view), ``scales`` None.

Why CuTe: the work is latency bound, so the floor is one DRAM round trip. Triton re-lays-out
a loaded fp8 tile right after its load, which waits for it, so its MXFP8 kernel pays two
waits. Here every thread issues all of its global loads first — its 8-byte fp8 weight
vectors, its E8M0 scale bytes, its share of q_nope and q_pe, and for E4M3 out q_scale — into
registers, and only then touches any of them: one round trip per CTA. bf16 weights take the
same kernel with 16-byte vectors of 8 weights and no scales (their conversion to fp32 is a
shift).

Design (SIMT, fp32 FMAs): one CTA per (32-column N tile, head), 192 threads. Thread
``t`` owns weight rows ``4*(t//4) .. +4`` and columns ``8*(t%4) .. +8`` of the tile (one
8-byte load per row) plus the tile's one scale byte per row (32 columns = one MX block).
q_nope: for one token row it is staged through shared memory (each thread loads 16-byte
vectors of it with the weights, stores them after all loads are issued); for two or more each
thread loads the 4 values of its own rows per token row directly (8 bytes each, with the
weights), which measured faster from two token rows and slower at one
(docs/decisions/0001-cute-for-small-m.md). The E8M0 scale of a row
multiplies q (exact: a power of two), not the row's weights. Per token row: 32 FMAs into 8
partial sums, a butterfly reduce-scatter over the 8 lanes that share the columns, one
shared-memory partial per warp, and a final sum of the 6 warps' partials (E4M3: four adjacent
columns per thread, one 4-byte store). The RoPE copy is loaded by every CTA (clamped rows,
L2 hits) and stored by the first N tile of each head.

Rows past ``M`` are computed on clamped (valid) rows and never stored: no branches around
loads. Compiled once per (heads, M bucket, output dtype, weight format) with
``cute.compile``; a call passes raw pointers and integer strides (no DLPack conversion per
call), on torch's current stream, so a warm call is capture-safe inside a CUDA graph.

``cutlass`` (nvidia-cutlass-dsl) is imported lazily: this module imports without it. No
``from __future__ import annotations`` here: nvidia-cutlass-dsl 4.6 evaluates a kernel's
annotations (``cute.Tensor``) in the module's globals, where the lazily imported ``cute`` is
not; evaluated at definition, inside the builder, they are objects it need not look up.
"""

# long because one CuTe DSL kernel's whole life is here: its gates (DSL version, shapes,
# q_scale), its variants, prewarm and launch, and the builder of the kernel itself.

import functools
import os
import threading
import warnings
from typing import Any

import torch

from fusedq.contract import (
    DECODE_M_BUCKETS,
    E4M3_MAX,
    GLM5,
    KV_LORA,
    MX_BLOCK,
    QK_ROPE,
    QUERY_WIDTH,
    SCALE_BLOCKS,
)

# The geometries this kernel is built for: GLM-5's only. Its thread count derives from qk_nope
# and its bf16 weight head stride (qk_nope + v_head rows) is compiled in, so another geometry
# is another kernel; selection routes other geometries to the Triton tl.dot kernel, and
# ``unsupported_reason`` refuses their shapes.
GEOMETRIES = (GLM5,)
QK_NOPE = GLM5.qk_nope
V_HEAD = GLM5.v_head

# One MX block per CTA: a thread needs one scale byte per weight row it owns.
BLOCK_N = MX_BLOCK
# 16-byte q vectors (8 bf16 values); the alignment every operand must have.
VEC_BYTES = 16
# fp8 weights per thread and row: one 8-byte load. With ROWS_PER_THREAD below, the layout
# that measured fastest among 1-8 rows of 4-16 weights a thread
# (docs/decisions/0001-cute-for-small-m.md). More threads with fewer rows or
# weights each shorten each thread's dequantisation and FMAs (the work after the loads
# arrive, which a one-CTA-per-SM grid runs on few warps); below 8 weights the loads get
# small, and with more than 4 rows at 8 weights, fewer warps share the work.
W_VEC = 8
Q_VEC = VEC_BYTES // 2  # bf16 elements per vector
# E4M3 outputs per thread and store: the DSL stores fp8 in 32-bit vectors at least.
OUT_GROUP = 4
COL_GROUPS = BLOCK_N // W_VEC  # threads that share a weight row
# Four K rows per thread: 192 threads (6 warps) per CTA (see W_VEC).
ROWS_PER_THREAD = 4
THREADS = QK_NOPE // ROWS_PER_THREAD * COL_GROUPS
WARP = 32
WARPS = THREADS // WARP
# Token rows are compiled in power-of-two buckets, the decode batches a server prewarms; rows
# past M are computed, not stored.
M_BUCKETS = DECODE_M_BUCKETS
MAX_M = M_BUCKETS[-1]
# E8M0 byte 0 is 2^-127, a float32 subnormal: its bit pattern, not byte << 23.
E8M0_ZERO_BITS = 0x00400000
MIN_CAPABILITY = (8, 9)

OUT_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)
# A compiled variant's key: (heads, M bucket, device index), E4M3_TAG appended for E4M3 out
# and BF16_WEIGHTS_TAG for bf16 weights (MXFP8 -> BF16 keys keep the three fields they had
# before the kernel wrote E4M3 or read bf16).
E4M3_TAG = "e4m3"
BF16_WEIGHTS_TAG = "bf16w"

_compiled: dict[tuple, Any] = {}
_compiled_lock = threading.Lock()


# nvidia-cutlass-dsl releases this kernel has run and been timed with on a GPU (4.3.5). 4.6.0,
# the release vLLM 0.26 pins (with quack-kernels), traces and compiles for sm_90a offline (the
# CPU tests run under both) but has not run on a GPU, so by default the Triton kernels run
# there; FUSEDQ_CUTE_UNVALIDATED=1 takes it anyway
# (docs/decisions/0007-cute-dsl-validated-releases.md).
VALIDATED_DSL = ("4.3.", "4.6.")
UNVALIDATED_ENV = "FUSEDQ_CUTE_UNVALIDATED"


@functools.cache
def _import_reason() -> str | None:
    try:
        import cutlass
        import cutlass.cute  # noqa: F401
    except Exception as exc:
        return f"nvidia-cutlass-dsl does not import ({type(exc).__name__}: {exc})"
    return None


def dsl_version() -> str | None:
    """The installed nvidia-cutlass-dsl's version, or None where its metadata is not found."""
    import importlib.metadata

    try:
        return importlib.metadata.version("nvidia-cutlass-dsl")
    except importlib.metadata.PackageNotFoundError:
        return None


def version_reason(version: str | None, override: bool) -> str | None:
    """Why an installed nvidia-cutlass-dsl of ``version`` is not used (see VALIDATED_DSL), or
    None; ``override`` is ``FUSEDQ_CUTE_UNVALIDATED=1``."""
    if override or (version is not None and version.startswith(VALIDATED_DSL)):
        return None
    shown = "of unknown version" if version is None else version
    return (
        f"nvidia-cutlass-dsl {shown} has not run this kernel on a GPU (validated: 4.3.5); "
        f"{UNVALIDATED_ENV}=1 uses it anyway"
    )


@functools.cache
def _version_reason() -> str | None:
    # Read once per process: the decision is cached with the signatures that depend on it.
    return version_reason(dsl_version(), os.environ.get(UNVALIDATED_ENV) == "1")


def unavailable_reason() -> str | None:
    """Why this kernel cannot run here, or None: needs nvidia-cutlass-dsl (a release in
    VALIDATED_DSL, or ``FUSEDQ_CUTE_UNVALIDATED=1``) and a CUDA device of compute capability
    >= 8.9 (E4M3 conversions)."""
    reason = _import_reason() or _version_reason()
    if reason is not None:
        return reason
    if not torch.cuda.is_available():
        return "no CUDA device"
    cap = torch.cuda.get_device_capability()
    if cap < MIN_CAPABILITY:
        return f"CUDA capability {cap} is below {MIN_CAPABILITY}"
    return None


def m_bucket(m: int) -> int:
    """The compiled token-row bucket for ``m`` tokens (1 <= m <= 32)."""
    for bucket in M_BUCKETS:
        if m <= bucket:
            return bucket
    raise ValueError(f"M={m} exceeds {MAX_M}")


def _aligned(t: torch.Tensor) -> bool:
    return t.data_ptr() % VEC_BYTES == 0 and all(
        s * t.element_size() % VEC_BYTES == 0 for s in t.stride()[:-1]
    )


def unsupported_reason(
    q_nope: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    q_pe: torch.Tensor,
    out: torch.Tensor,
) -> str | None:
    """Why these operands are outside what the kernel implements, or None. Weights: MXFP8
    (``values`` float8_e4m3fn and ``scales`` E8M0 bytes, both contiguous) or bf16
    (``scales`` None; rows of KV_LORA unit-stride elements, consecutive, as vLLM's W_UK_T view
    has them; any 16-byte aligned head stride)."""
    bf16_weights = scales is None
    if bf16_weights:
        if values.dtype != torch.bfloat16:
            return f"values: dtype {values.dtype} is not bfloat16 (scales is None)"
    elif values.dtype != torch.float8_e4m3fn:
        return f"values: dtype {values.dtype} is not float8_e4m3fn"
    elif scales.dtype != torch.uint8:
        return f"scales: dtype {scales.dtype} is not uint8 (view E8M0 bytes as uint8)"
    if q_nope.dtype != torch.bfloat16 or q_pe.dtype != torch.bfloat16:
        return f"q_nope/q_pe: dtypes {q_nope.dtype}/{q_pe.dtype} must be bfloat16"
    if out.dtype not in OUT_DTYPES:
        return f"out: dtype {out.dtype} is not bfloat16 or float8_e4m3fn"
    m, h = q_nope.shape[:2]
    if not 1 <= m <= MAX_M:
        return f"M={m} is outside [1, {MAX_M}]"
    shapes = {
        "q_nope": (q_nope, (m, h, QK_NOPE)),
        "q_pe": (q_pe, (m, h, QK_ROPE)),
        "out": (out, (m, h, KV_LORA + QK_ROPE)),
        "values": (values, (h, QK_NOPE, KV_LORA)),
    }
    if not bf16_weights:
        shapes["scales"] = (scales, (h, QK_NOPE, SCALE_BLOCKS))
    for name, (t, shape) in shapes.items():
        if tuple(t.shape) != shape:
            return f"{name}: shape {tuple(t.shape)} must be {list(shape)}"
    if bf16_weights:
        if values.stride()[1:] != (KV_LORA, 1):
            return f"values: strides {values.stride()} are not (any, {KV_LORA}, 1)"
    else:
        for name in ("values", "scales"):
            if not shapes[name][0].is_contiguous():
                return f"{name}: strides {shapes[name][0].stride()} are not contiguous"
    for name in shapes:
        t = shapes[name][0]
        if t.stride(-1) != 1:
            return f"{name}: last stride {t.stride(-1)} is not 1"
        if not _aligned(t):
            return f"{name}: pointer or strides {t.stride()} are not {VEC_BYTES}-byte aligned"
    if max(q_nope.stride(0), q_pe.stride(0), out.stride(0)) * m >= 2**31:
        return "a token stride times M overflows int32"
    if values.stride(0) * h >= 2**31:
        return "the weights' head stride times H overflows int32"
    for name, (t, _) in shapes.items():
        if not t.is_cuda:
            return f"{name}: on {t.device}, not a CUDA device"
    return None


def _q_scale_reason(out: torch.Tensor, q_scale: torch.Tensor | None) -> str | None:
    if out.dtype != torch.float8_e4m3fn:
        return None if q_scale is None else "q_scale: must be None for bfloat16 out"
    if q_scale is None:
        return "q_scale: a one-element float32 tensor is required for float8_e4m3fn out"
    if q_scale.dtype != torch.float32 or q_scale.numel() != 1 or q_scale.device != out.device:
        return (
            f"q_scale: {q_scale.dtype} with {q_scale.numel()} elements on {q_scale.device} must "
            f"be one float32 element on {out.device}"
        )
    return None


def launch(
    q_nope: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    q_scale: torch.Tensor | None = None,
) -> None:
    """Write the projection into ``out`` on torch's current stream; for a float8_e4m3fn
    ``out``, quantised with the one-element fp32 ``q_scale`` (read on the device).

    Raises ``ValueError`` naming the operand the kernel does not implement (see
    ``unsupported_reason``) and ``RuntimeError`` when the DSL or device is missing. The first
    call per (heads, M bucket, output dtype, device) compiles; later calls only launch.
    """
    reason = unsupported_reason(q_nope, values, scales, q_pe, out) or _q_scale_reason(out, q_scale)
    if reason is not None:
        raise ValueError(reason)
    launch_unchecked(q_nope, values, scales, q_pe, out, q_scale)


def launch_unchecked(
    q_nope: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    q_scale: torch.Tensor | None = None,
) -> None:
    """``launch`` without ``unsupported_reason``: for callers that checked the operands'
    signature once (``BoundCute``) and only the addresses per call."""
    m, h = q_nope.shape[:2]
    out_fp8 = out.dtype == torch.float8_e4m3fn
    bf16_weights = scales is None
    compiled = _compiled_for(h, m_bucket(m), q_nope.device.index or 0, out_fp8, bf16_weights)
    import cutlass
    from cuda.bindings import driver as cuda
    from cutlass.cute.runtime import make_ptr

    stream = cuda.CUstream(torch.cuda.current_stream(q_nope.device).cuda_stream)
    # The BF16-out variant never loads q_scale, the bf16-weight one no scales: any valid
    # address fills their slots.
    scale_addr = q_scale.data_ptr() if out_fp8 else values.data_ptr()
    scales_addr = values.data_ptr() if bf16_weights else scales.data_ptr()
    compiled(
        make_ptr(cutlass.BFloat16, q_nope.data_ptr(), assumed_align=VEC_BYTES),
        make_ptr(cutlass.BFloat16, q_pe.data_ptr(), assumed_align=VEC_BYTES),
        make_ptr(
            cutlass.BFloat16 if bf16_weights else cutlass.Float8E4M3FN,
            values.data_ptr(),
            assumed_align=VEC_BYTES,
        ),
        make_ptr(cutlass.Uint8, scales_addr, assumed_align=VEC_BYTES),
        make_ptr(
            cutlass.Float8E4M3FN if out_fp8 else cutlass.BFloat16,
            out.data_ptr(),
            assumed_align=VEC_BYTES,
        ),
        make_ptr(cutlass.Float32, scale_addr, assumed_align=4),
        m,
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        out.stride(0),
        out.stride(1),
        values.stride(0),
        stream,
    )


def variant_key(
    num_heads: int, bucket: int, device_index: int, out_fp8: bool, bf16_weights: bool = False
) -> tuple:
    """The ``_compiled`` key of one variant (see ``E4M3_TAG``)."""
    key = (num_heads, bucket, device_index)
    if out_fp8:
        key = (*key, E4M3_TAG)
    return (*key, BF16_WEIGHTS_TAG) if bf16_weights else key


class BoundCute:
    """One signature's launch through the CuTe kernel (its strides, dtypes and shapes were
    checked once by the caller with ``unsupported_reason``). With a ``fallback`` (the Triton
    launch of the same signature; ``backend="auto"``) the CuTe kernel runs only under CUDA-graph
    capture, and an operand off the 16-byte boundary also goes to the fallback; without one
    (``backend="cute"``) every call runs it, and a misaligned address raises.

    Binding compiles the signature's variant (``out_fp8``: E4M3 output, else BF16;
    ``bf16_weights``: bf16 weights, else MXFP8) when it
    happens outside a capture (the usual first call: a warm-up before capture), since the
    eager calls that run the fallback would never compile it. A signature first seen inside a
    capture cannot compile there: with a fallback that capture records the Triton kernel (and
    says so once, as a warning)."""

    __slots__ = ("fallback", "key")

    def __init__(
        self,
        fallback,
        num_heads: int,
        m: int,
        device: torch.device,
        *,
        out_fp8: bool = False,
        bf16_weights: bool = False,
    ) -> None:
        self.fallback = fallback
        self.key = variant_key(num_heads, m_bucket(m), device.index or 0, out_fp8, bf16_weights)
        if device.type != "cuda" or not torch.cuda.is_current_stream_capturing():
            prewarm(num_heads, m, device, out_fp8=out_fp8, bf16_weights=bf16_weights)

    def __call__(self, q_nope, values, scales, q_pe, out, q_scale) -> None:
        if self.fallback is not None:
            if not torch.cuda.is_current_stream_capturing():
                # Eager: a CuTe DSL call costs far more host time (its argument marshalling)
                # than the Triton fast path, more than its GPU time saves. Inside a CUDA-graph
                # capture the host cost is paid once, and replays run the faster kernel
                # (docs/decisions/0001-cute-for-small-m.md).
                self.fallback(q_nope, values, scales, q_pe, out, q_scale)
                return
            if self.key not in _compiled:
                _warn_not_compiled(self.key)
                self.fallback(q_nope, values, scales, q_pe, out, q_scale)
                return
        ptrs = q_nope.data_ptr() | q_pe.data_ptr() | values.data_ptr()
        if scales is not None:
            ptrs |= scales.data_ptr()
        if (ptrs | out.data_ptr()) % VEC_BYTES:
            if self.fallback is None:
                raise ValueError(
                    f"backend='cute': an operand's address is not {VEC_BYTES}-byte aligned"
                )
            self.fallback(q_nope, values, scales, q_pe, out, q_scale)
            return
        launch_unchecked(q_nope, values, scales, q_pe, out, q_scale)


_warned: set[tuple] = set()


def _describe(key: tuple) -> str:
    heads, bucket, index = key[:3]
    weights = " bf16-weights" if BF16_WEIGHTS_TAG in key[3:] else ""
    out = " E4M3-out" if E4M3_TAG in key[3:] else ""
    return f"heads={heads} M-bucket={bucket}{weights}{out} on cuda:{index}"


def _warn_not_compiled(key: tuple) -> None:
    if key not in _warned:
        _warned.add(key)
        warnings.warn(
            f"fusedq: the CuTe variant for {_describe(key)} was not compiled before this "
            "CUDA-graph capture; the graph runs the Triton kernel instead (call the op once "
            "outside the capture, or fusedq.prewarm, first)",
            RuntimeWarning,
            stacklevel=3,
        )


def prewarm(
    num_heads: int,
    m: int,
    device: torch.device,
    *,
    out_fp8: bool = False,
    bf16_weights: bool = False,
) -> int:
    """Compile the variant calls with ``m`` tokens use (E4M3 output with ``out_fp8``, else
    BF16; bf16 weights with ``bf16_weights``, else MXFP8; before CUDA-graph capture); returns
    1 when it was compiled now, 0 when it already was."""
    args = (num_heads, m_bucket(m), device.index or 0, out_fp8, bf16_weights)
    if variant_key(*args) in _compiled:
        return 0
    with torch.cuda.device(device):
        _compiled_for(*args)
    return 1


def _compiled_for(
    num_heads: int, bucket: int, device_index: int, out_fp8: bool, bf16_weights: bool = False
):
    key = variant_key(num_heads, bucket, device_index, out_fp8, bf16_weights)
    fn = _compiled.get(key)
    if fn is not None:
        return fn
    reason = unavailable_reason()
    if reason is not None:
        raise RuntimeError(f"cute_mla_query: {reason}")
    if torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"cute_mla_query: {_describe(key)} was not compiled before CUDA-graph capture "
            "(call it once outside the capture, or fusedq.prewarm, first)"
        )
    with _compiled_lock:
        fn = _compiled.get(key)
        if fn is None:
            fn = compile_variant(num_heads, bucket, out_fp8=out_fp8, bf16_weights=bf16_weights)
            _compiled[key] = fn
    return fn


def compile_variant(
    num_heads: int,
    bucket: int,
    *,
    out_fp8: bool = False,
    bf16_weights: bool = False,
    device: bool = True,
):
    """``cute.compile`` the host function for (heads, M bucket, E4M3 output with ``out_fp8``
    else BF16, bf16 weights with ``bf16_weights`` else MXFP8). ``device=False`` builds the
    arguments without a GPU (for ``CUTE_DSL_DRYRUN=1`` traces on a CPU machine)."""
    import cutlass
    import cutlass.cute as cute
    from cuda.bindings import driver as cuda
    from cutlass.cute.runtime import make_ptr

    host = _build(num_heads, bucket, out_fp8, bf16_weights)
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream if device else 0)
    fake = 1 << 20  # any 16-byte aligned address: compilation never dereferences it
    # Strides as vLLM's operands have them (q sliced from [M, H, QK_NOPE + QK_ROPE], W_UK_T's
    # heads QK_NOPE + V_HEAD rows apart); as Int32 arguments their values are not compiled in.
    q_row = QK_NOPE + QK_ROPE
    w_head = (QK_NOPE + V_HEAD) * KV_LORA
    return cute.compile(
        host,
        make_ptr(cutlass.BFloat16, fake, assumed_align=VEC_BYTES),
        make_ptr(cutlass.BFloat16, fake, assumed_align=VEC_BYTES),
        make_ptr(
            cutlass.BFloat16 if bf16_weights else cutlass.Float8E4M3FN,
            fake,
            assumed_align=VEC_BYTES,
        ),
        make_ptr(cutlass.Uint8, fake, assumed_align=VEC_BYTES),
        make_ptr(
            cutlass.Float8E4M3FN if out_fp8 else cutlass.BFloat16, fake, assumed_align=VEC_BYTES
        ),
        make_ptr(cutlass.Float32, fake, assumed_align=4),
        # cutlass.Int32, not int: a Python int would be compiled in as a constant.
        *(cutlass.Int32(x) for x in (1, q_row * num_heads, q_row, q_row * num_heads, q_row)),
        *(cutlass.Int32(x) for x in (QUERY_WIDTH * num_heads, QUERY_WIDTH, w_head)),
        stream,
    )


def _clamp_scaled(x, inv_scale):
    """vLLM's static FP8 quant before its conversion, traced into a kernel (also by
    scripts/cute_mma_variant.py): fmaxf(-448, fminf(x * inv_scale, 448)). PTX min/max return
    the non-NaN operand, as fminf/fmaxf do (NaN becomes 448)."""
    import cutlass
    import cutlass.cute as cute

    y = cutlass.Float32(x * inv_scale)
    if hasattr(cute.arch, "fmin"):  # nvidia-cutlass-dsl 4.6 (not 4.3)
        y = cute.arch.fmin(y, E4M3_MAX)
    else:  # 4.3's nvvm.fmin takes the result type first
        from cutlass._mlir.dialects import nvvm
        from cutlass.cutlass_dsl import T

        hi = cutlass.Float32(E4M3_MAX).ir_value()
        y = cutlass.Float32(nvvm.fmin(T.f32(), y.ir_value(), hi))
    return cute.arch.fmax(y, -E4M3_MAX)


@functools.cache
def _build(num_heads: int, bucket: int, out_fp8: bool, bf16_weights: bool = False):
    """The @cute.jit host function and its @cute.kernel for (heads, M bucket, output dtype:
    E4M3 with ``out_fp8``, else BF16; weights: bf16 with ``bf16_weights``, else MXFP8)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass._mlir.dialects import llvm
    from cutlass.cutlass_dsl import T

    H, MB = num_heads, bucket
    # One token row: q staged through shared memory (q_loads 16-byte vectors a thread, spread
    # over the CTA). More: each thread loads its own rows' q values (see the module docstring).
    STAGE_Q = MB == 1
    # q is multiplied by each row's E8M0 scale (MXFP8), or by the fence's 1 (bf16 weights, q
    # loaded per thread); bf16 weights with q staged need neither.
    SCALE_Q = not (bf16_weights and STAGE_Q)
    KV = QK_NOPE // Q_VEC  # q vectors per token row
    q_loads = -(-MB * KV // THREADS)
    RV = QK_ROPE // Q_VEC  # q_pe vectors per token row
    pe_loads = -(-MB * RV // THREADS)
    out_per_thread = -(-MB * BLOCK_N // THREADS)
    groups_per_thread = -(-MB * BLOCK_N // OUT_GROUP // THREADS)
    lanes_per_cols = WARP // COL_GROUPS
    steps = lanes_per_cols.bit_length() - 1

    def as_f32(bits):
        return cutlass.Float32(llvm.bitcast(T.f32(), cutlass.Int32(bits).ir_value()))

    @cute.kernel
    def _mla_query_cute_kernel(
        gQ: cute.Tensor,
        gP: cute.Tensor,
        gW: cute.Tensor,
        gS: cute.Tensor,
        gO: cute.Tensor,
        gSc: cute.Tensor,
        M: cutlass.Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        pid_n, h, _ = cute.arch.block_idx()
        cols = tid % COL_GROUPS
        kq = tid // COL_GROUPS
        lane = tid % WARP
        warp = tid // WARP
        last = M - 1

        smem = cutlass.utils.SmemAllocator()
        if cutlass.const_expr(STAGE_Q):
            sQ = smem.allocate_tensor(
                cutlass.BFloat16, cute.make_layout((MB, QK_NOPE), stride=(QK_NOPE, 1)), VEC_BYTES
            )
        sRed = smem.allocate_tensor(
            cutlass.Float32,
            cute.make_layout((WARPS, MB, BLOCK_N), stride=(MB * BLOCK_N, BLOCK_N, 1)),
            VEC_BYTES,
        )

        # --- every global load, before any value is used (one round trip) ---
        tW = cute.zipped_divide(gW, (1, 1, W_VEC))
        w_raw = []
        for r in cutlass.range_constexpr(ROWS_PER_THREAD):
            k = kq * ROWS_PER_THREAD + r
            w_raw.append(tW[(None, (h, k, pid_n * COL_GROUPS + cols))].load())
        q_raw = []
        if cutlass.const_expr(STAGE_Q):
            tQ = cute.zipped_divide(gQ, (1, 1, Q_VEC))
            for i in cutlass.range_constexpr(q_loads):
                v = cutlass.min(tid + THREADS * i, MB * KV - 1)
                row = cutlass.min(v // KV, last)
                q_raw.append(tQ[(None, (row, h, v % KV))].load())
        else:
            # The 4 values of this thread's own K rows per token row (8 bytes; every N tile of
            # the head reads them, so they come from L2).
            tQ = cute.zipped_divide(gQ, (1, 1, ROWS_PER_THREAD))
            for m in cutlass.range_constexpr(MB):
                q_raw.append(tQ[(None, (cutlass.min(cutlass.Int32(m), last), h, kq))].load())
        tP = cute.zipped_divide(gP, (1, 1, Q_VEC))
        pe_raw = []
        for i in cutlass.range_constexpr(pe_loads):
            v = cutlass.min(tid + THREADS * i, MB * RV - 1)
            row = cutlass.min(v // RV, last)
            pe_raw.append(tP[(None, (row, h, v % RV))].load())
        if cutlass.const_expr(out_fp8):
            # Read on the device, not baked in at launch: a graph replays the current scale.
            q_scale = gSc[0]
        # The scale bytes last: LLVM places their (integer) processing right after each load,
        # and no use may come before the last load is issued.
        s_raw = []
        if cutlass.const_expr(not bf16_weights):
            for r in cutlass.range_constexpr(ROWS_PER_THREAD):
                s_raw.append(gS[(h, kq * ROWS_PER_THREAD + r, pid_n)])

        # --- stage q (one token row), dequantise the weights in registers ---
        if cutlass.const_expr(STAGE_Q):
            tsQ = cute.zipped_divide(sQ, (1, Q_VEC))
            for i in cutlass.range_constexpr(q_loads):
                v = cutlass.min(tid + THREADS * i, MB * KV - 1)
                tsQ[(None, (v // KV, v % KV))].store(q_raw[i])
            tsQk = cute.zipped_divide(sQ, (1, ROWS_PER_THREAD))  # (read after the barrier)
            zero_scale = as_f32(E8M0_ZERO_BITS)
        else:
            # A scheduling fence for ptxas: a correctly rounded division compiles to a
            # subroutine call that ptxas moves nothing across, and this one (of M: no load
            # feeds it) selects the 0-byte scale's value (bf16 weights: a factor of 1 on q;
            # M >= 1, so nothing changes), which puts it between the loads and their first
            # use. Without it (and without q's shared-memory stores, which kept the loads in
            # place) ptxas sank three of the four weight rows' loads below the first row's
            # dequantisation and FMAs.
            fenced = cutlass.Float32(1.0) / cutlass.Float32(M) > cutlass.Float32(0.0)
            zero_scale = cutlass.Float32(
                cutlass.select_(fenced, as_f32(E8M0_ZERO_BITS), cutlass.Float32(0.0))
            )
            one = cutlass.Float32(
                cutlass.select_(fenced, cutlass.Float32(1.0), cutlass.Float32(0.0))
            )
        w = []
        row_scale = []
        for r in cutlass.range_constexpr(ROWS_PER_THREAD):
            if cutlass.const_expr(not bf16_weights):
                # The DSL loads the byte sign-extended (ld.global.s8): mask it back to 0..255.
                s = cutlass.Int32(s_raw[r]) & 0xFF
                # 2^(s-127) from the exponent bits; byte 0 gives 0.0 there, and max() turns it
                # into 2^-127 (a subnormal) without an integer compare next to the load.
                row_scale.append(cute.arch.fmax(as_f32(s << 23), zero_scale))
            elif cutlass.const_expr(not STAGE_Q):
                row_scale.append(one)
            vals = w_raw[r].to(cutlass.Float32)
            w.append([vals[j] for j in range(W_VEC)])
        if cutlass.const_expr(STAGE_Q):
            cute.arch.sync_threads()

        # --- FMAs, butterfly reduce-scatter over the lanes sharing these columns ---
        col_off = 0
        for s in cutlass.range_constexpr(steps):
            bit = (lane >> (COL_GROUPS.bit_length() - 1 + s)) & 1
            col_off = col_off + bit * (W_VEC >> (s + 1))
        for m in cutlass.range_constexpr(MB):
            if cutlass.const_expr(STAGE_Q):
                qk = tsQk[(None, (m, kq))].load().to(cutlass.Float32)
            else:
                qk = q_raw[m].to(cutlass.Float32)
            # The row's power-of-two scale multiplies q (ROWS_PER_THREAD products per token
            # row), not the row's W_VEC weights: q * 2^e and w * 2^e are both exact, so the
            # FMAs see the same products as with dequantised weights, with fewer multiplies
            # between the loads' arrival and the store (measured faster:
            # docs/decisions/0001-cute-for-small-m.md).
            if cutlass.const_expr(SCALE_Q):
                qs = [qk[r] * row_scale[r] for r in range(ROWS_PER_THREAD)]
            else:  # bf16 weights, q staged: nothing to scale
                qs = [qk[r] for r in range(ROWS_PER_THREAD)]
            acc = [qs[0] * w[0][j] for j in range(W_VEC)]
            for r in cutlass.range_constexpr(1, ROWS_PER_THREAD):
                acc = [acc[j] + qs[r] * w[r][j] for j in range(W_VEC)]
            for s in cutlass.range_constexpr(steps):
                mask = COL_GROUPS << s
                upper = (lane & mask) != 0
                half = len(acc) // 2
                nxt = []
                for j in cutlass.range_constexpr(half):
                    keep = cutlass.Float32(cutlass.select_(upper, acc[j + half], acc[j]))
                    send = cutlass.Float32(cutlass.select_(upper, acc[j], acc[j + half]))
                    nxt.append(keep + cute.arch.shuffle_sync_bfly(send, offset=mask))
                acc = nxt
            for j in cutlass.range_constexpr(len(acc)):
                sRed[(warp, m, cols * W_VEC + col_off + j)] = acc[j]

        if cutlass.const_expr(out_fp8):
            # vLLM's reciprocal, once per thread and correctly rounded (the DSL's IEEE division
            # of 1 becomes rcp.rn.f32, the same value as div.rn.f32); every output multiplies
            # by it. x * (1/s) and x / s round differently for some x. Computed after the
            # FMAs, not next to the loads: its slow path is a subroutine call, which ptxas
            # schedules nothing across, and there the 1-row variant waited for q_scale before
            # it issued the weight loads (sm_90 SASS; docs/decisions/0004-e4m3-reciprocal.md).
            inv_scale = cutlass.Float32(1.0) / q_scale
        # --- RoPE copy (first N tile of each head) ---
        if pid_n == 0:
            tO = cute.zipped_divide(gO, (1, 1, Q_VEC))
            for i in cutlass.range_constexpr(pe_loads):
                v = tid + THREADS * i
                if v < MB * RV and v // RV < M:
                    pe = pe_raw[i]
                    if cutlass.const_expr(out_fp8):
                        pe_f = pe.to(cutlass.Float32)
                        frag = cute.make_rmem_tensor((Q_VEC,), cutlass.Float32)
                        for j in cutlass.range_constexpr(Q_VEC):
                            frag[j] = _clamp_scaled(pe_f[j], inv_scale)
                        pe = frag.load().to(cutlass.Float8E4M3FN)
                    tO[(None, (v // RV, h, KV_LORA // Q_VEC + v % RV))].store(pe)
        cute.arch.sync_threads()

        # --- sum the warps' partials, store ---
        if cutlass.const_expr(not out_fp8):
            for i in cutlass.range_constexpr(out_per_thread):
                o = tid + THREADS * i
                m = o // BLOCK_N
                n = o % BLOCK_N
                if o < MB * BLOCK_N and m < M:
                    total = sRed[(0, m, n)]
                    for wi in cutlass.range_constexpr(1, WARPS):
                        total = total + sRed[(wi, m, n)]
                    gO[(m, h, pid_n * BLOCK_N + n)] = total.to(cutlass.BFloat16)
        else:
            # E4M3: four adjacent columns per thread, converted and stored as one 4-byte vector.
            tO2 = cute.zipped_divide(gO, (1, 1, OUT_GROUP))
            for i in cutlass.range_constexpr(groups_per_thread):
                o = tid + THREADS * i
                m = o // (BLOCK_N // OUT_GROUP)
                n = o % (BLOCK_N // OUT_GROUP) * OUT_GROUP
                if o < MB * BLOCK_N // OUT_GROUP and m < M:
                    group = cute.make_rmem_tensor((OUT_GROUP,), cutlass.Float32)
                    for j in cutlass.range_constexpr(OUT_GROUP):
                        total = sRed[(0, m, n + j)]
                        for wi in cutlass.range_constexpr(1, WARPS):
                            total = total + sRed[(wi, m, n + j)]
                        # The staged path quantises bmm's bf16 result: round to bf16 first.
                        total = total.to(cutlass.BFloat16).to(cutlass.Float32)
                        group[j] = _clamp_scaled(total, inv_scale)
                    col = (pid_n * BLOCK_N + n) // OUT_GROUP
                    tO2[(None, (m, h, col))].store(group.load().to(cutlass.Float8E4M3FN))

    @cute.jit
    def host(
        q_ptr: cute.Pointer,
        pe_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        s_ptr: cute.Pointer,
        out_ptr: cute.Pointer,
        scale_ptr: cute.Pointer,
        M: cutlass.Int32,
        sqm: cutlass.Int32,
        sqh: cutlass.Int32,
        spm: cutlass.Int32,
        sph: cutlass.Int32,
        som: cutlass.Int32,
        soh: cutlass.Int32,
        swh: cutlass.Int32,
        stream,
    ):
        # The host checked 16-byte alignment of every token/head stride (unsupported_reason):
        # telling CuTe lets the q/q_pe/out vectors be 16-byte accesses. Strides are in
        # elements: 16 bytes of E4M3 out are 16 elements, so divby=Q_VEC (8) holds there too
        # (its 8-byte RoPE and 4-byte stores stay aligned).
        def lay(last_dim, sm, sh):
            return cute.make_layout(
                (MB, H, last_dim),
                stride=(cute.assume(sm, divby=Q_VEC), cute.assume(sh, divby=Q_VEC), 1),
            )

        gQ = cute.make_tensor(q_ptr, lay(QK_NOPE, sqm, sqh))
        gP = cute.make_tensor(pe_ptr, lay(QK_ROPE, spm, sph))
        gO = cute.make_tensor(out_ptr, lay(KV_LORA + QK_ROPE, som, soh))
        if cutlass.const_expr(bf16_weights):
            # vLLM's W_UK_T view: rows of KV_LORA, the head stride spanning the V rows too
            # (checked 16-byte aligned on the host, which keeps the 16-byte loads).
            w_head = cute.assume(swh, divby=W_VEC)
        else:
            w_head = QK_NOPE * KV_LORA  # (swh is the same; compiled in)
        gW = cute.make_tensor(
            w_ptr, cute.make_layout((H, QK_NOPE, KV_LORA), stride=(w_head, KV_LORA, 1))
        )
        gS = cute.make_tensor(
            s_ptr,
            cute.make_layout(
                (H, QK_NOPE, SCALE_BLOCKS), stride=(QK_NOPE * SCALE_BLOCKS, SCALE_BLOCKS, 1)
            ),
        )
        # q_scale (E4M3 out; the BF16 variant gets any address and never loads it).
        gSc = cute.make_tensor(scale_ptr, cute.make_layout(1))
        _mla_query_cute_kernel(gQ, gP, gW, gS, gO, gSc, M).launch(
            grid=[KV_LORA // BLOCK_N, H, 1], block=[THREADS, 1, 1], stream=stream
        )

    return host


def dry_run_env() -> dict[str, str]:
    """Environment for an offline trace (no GPU): the DSL stops after generating IR."""
    return {**os.environ, "CUTE_DSL_DRYRUN": "1", "CUTE_DSL_ARCH": "sm_90a"}
