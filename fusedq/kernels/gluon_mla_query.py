"""Gluon (explicit-layout) kernels for the fused MLA decode query projection.

Same arguments, constexprs and specialisation options as ``_mla_query_kernel`` (the launch
machinery in ``triton_launch``, its ``KernelKey`` and ``fast_launch`` treat them alike);
``LaunchConfig(gluon=True, gluon_operands=...)`` selects one. Why it exists: plain Triton puts
the layout conversion of a loaded fp8 tile (and of the MXFP8 scales) right after its load, so
MXFP8 on the ``tl.dot`` path waits on DRAM two or three times in series
(docs/decisions/0006-gluon-for-larger-m.md). Here every layout is chosen by hand:

- every global load (q chunks, scales, weight chunks, the RoPE CTA's q_pe, q_scale) is
  issued, in program order, before any loaded value is used: one memory round trip per CTA;
- scales are loaded in a slice (or the whole) of the weight's own layout, so the MXFP8
  dequantisation broadcasts in registers with no conversion;
- only then: dequantise → bf16 → to the mma.sync operand layouts (one of ``OPERANDS``) →
  ``mma_v2`` → epilogue stored straight from the accumulator's layout (no conversion of the
  result).

Gluon is an optional import (``triton.experimental.gluon``, Triton >= 3.5 era); without it
``AVAILABLE`` is False and ``UNAVAILABLE_REASON`` says why. Gluon kernels do not run under
``TRITON_INTERPRET=1``: the ``INTERPRET`` constexpr is kept for the shared parameter list and
rejected at compile time.
"""

# long because the three Gluon kernels, the operand table that picks one, and their offline
# compile (which the PTX and SASS checks read) are one kernel family, read together.

from __future__ import annotations

from fusedq.contract import E4M3_MAX, GLM5, KV_LORA, MX_BLOCK, QK_ROPE
from fusedq.kernels import common

try:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import mma_v2

    AVAILABLE = True
    UNAVAILABLE_REASON = ""
except ImportError as exc:  # pragma: no cover - older Triton without Gluon's mma_v2
    gluon = gl = mma_v2 = None
    AVAILABLE = False
    UNAVAILABLE_REASON = (
        f"this Triton has no usable Gluon (triton.experimental.gluon with nvidia.ampere.mma_v2): "
        f"{exc}"
    )

# How the operand tiles reach the mma.sync operand layouts (one kernel each, see below):
# "convert": loaded in coalesced blocked layouts, converted register to register (Gluon stages
# each conversion through shared memory behind its own barriers); "smem": the same loads, all
# six tiles stored to shared memory, one barrier, ldmatrix; "direct": loaded straight from
# global memory in the operand layouts (no shared memory, no barrier; 16-byte vectors only
# along K, so W_UK_T's unit-N rows come in 2-byte (bf16) or 1-byte (e4m3) pieces).
OPERANDS = ("convert", "smem", "direct")
# mma.sync m16n8k16: the accumulator tile of one warp's instruction.
MMA_INSTR = (16, 8)
# k_width of a bf16 mma.sync operand: two 16-bit elements per 32-bit register. The direct
# variant takes 8 consecutive K elements per thread instead (A and B alike, so the sum over K
# is only reordered): 16-byte loads along K.
BF16_K_WIDTH = 2
DIRECT_K_WIDTH = 8
# Gluon's kernel is written for three unrolled 64-wide K chunks (K = 192 exactly): GLM-5's
# geometry only (it static-asserts K = 3 * BLOCK_K). Selection routes other geometries to the
# Triton tl.dot kernel, and triton_launch refuses a Gluon launch of another K.
GEOMETRIES = (GLM5,)
GLUON_BLOCK_K = common.BLOCK_K
GLUON_BLOCK_MS = (16, 32)
# Triton versions this kernel was compiled with (sm_90, offline): the GPU's 3.6 and CI's 3.9.
# Gluon's API moves between releases; on others a compile failure is a version limitation.
COMPILED_WITH = ("3.6.", "3.9.")
# Wider N tiles would hold three [64, BLOCK_N] weight chunks in registers per CTA: 128 is
# already 48 KB of bf16 in the registers of 4-8 warps.
GLUON_MAX_BLOCK_N = 128


if AVAILABLE:
    # Globals a Gluon function reads must be constexprs.
    _K_WIDTH = gl.constexpr(BF16_K_WIDTH)
    _DIRECT_K_WIDTH = gl.constexpr(DIRECT_K_WIDTH)
    _MX_BLOCK = gl.constexpr(MX_BLOCK)
    _E4M3_MAX = gl.constexpr(E4M3_MAX)
    # The OUT_FP8 modes (common.E4M3_EPILOGUES) the kernel branches on.
    _OUT_E4M3 = gl.constexpr(common.OUT_E4M3)
    _OUT_E4M3_DIV = gl.constexpr(common.OUT_E4M3_DIV)
    _OUT_E4M3_NOSCALE = gl.constexpr(common.OUT_E4M3_NOSCALE)
    _OUT_E4M3_WIDE = gl.constexpr(common.OUT_E4M3_WIDE)

    @gluon.constexpr_function
    def _tile_layout(rows, cols, vec, unit_axis, num_warps):
        # A blocked layout of a [rows, cols] tile whose unit-stride axis is ``unit_axis``:
        # ``vec`` elements (16 bytes) per thread along it, a warp's threads filling that axis
        # first, then the warps along the other axis (where the tile has room for them).
        vec = min(vec, rows if unit_axis == 0 else cols)
        along = rows if unit_axis == 0 else cols
        across = cols if unit_axis == 0 else rows
        t_along = min(32, max(1, along // vec))
        t_across = 32 // t_along
        w_across = min(num_warps, max(1, across // t_across))
        w_along = num_warps // w_across
        if unit_axis == 0:
            return gl.BlockedLayout([vec, 1], [t_along, t_across], [w_along, w_across], [0, 1])
        return gl.BlockedLayout([1, vec], [t_across, t_along], [w_across, w_along], [1, 0])

    @gluon.constexpr_function
    def _mma_layout(block_n, num_warps):
        # Warps along N first (at M <= 32 the rows fit one or two 16-row instructions); with
        # more warps than 8-wide column groups the rest go along M.
        warps_n = min(num_warps, max(1, block_n // MMA_INSTR[1]))
        return gl.NVMMADistributedLayout(
            version=[2, 0],
            warps_per_cta=[num_warps // warps_n, warps_n],
            instr_shape=list(MMA_INSTR),
        )

    @gluon.constexpr_function
    def _smem_layout(inner, order_inner):
        # Swizzled so that ldmatrix rows of a bf16 tile hit distinct banks: 16-byte vectors,
        # phases cycling every 128 bytes of the contiguous dimension.
        per_phase = max(1, 128 // (inner * 2))
        order = [1, 0] if order_inner == 1 else [0, 1]
        return gl.SwizzledSharedLayout(8, per_phase, 8 // per_phase, order)

    @gluon.constexpr_function
    def _vec(elem_bits, aligned):
        # 16-byte vectors where the host promised alignment; otherwise one element per thread
        # along the axis (the loads could not be vectorised anyway).
        return 128 // elem_bits if aligned else 1

    @gluon.jit
    def _gdc_wait():
        gl.inline_asm_elementwise(
            "griddepcontrol.wait; // dummy $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1
        )

    @gluon.jit
    def _gdc_launch_dependents():
        gl.inline_asm_elementwise(
            "griddepcontrol.launch_dependents; // dummy $0", "=r", [], dtype=gl.int32,
            is_pure=False, pack=1,
        )  # fmt: skip

    @gluon.jit
    def _w_ptrs(w_head, offs_k, offs_n, stride_wk, stride_wn, W_LAYOUT: gl.constexpr,
                W_ALIGNED: gl.constexpr):  # fmt: skip
        if W_LAYOUT == 1:
            ptrs = w_head + offs_k[:, None] * stride_wk + offs_n[None, :]
        elif W_LAYOUT == 2:
            ptrs = w_head + offs_k[:, None] + offs_n[None, :] * stride_wn
        else:
            ptrs = w_head + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
        if W_ALIGNED:
            ptrs = gl.multiple_of(ptrs, [16, 16])
        return ptrs

    @gluon.jit
    def _load_scales(ws_head, offs_k, offs_n, pid_n, stride_sk, stride_sn,
                     BLOCK_N: gl.constexpr):  # fmt: skip
        # Loaded in the weight tile's layout (or its slice along N), so the dequantisation
        # broadcasts without a conversion.
        if BLOCK_N <= _MX_BLOCK:
            s = gl.load(ws_head + offs_k * stride_sk + ((pid_n * BLOCK_N) // _MX_BLOCK) * stride_sn)
            s = s.to(gl.int32)[:, None]
        else:
            ptrs = (
                ws_head + offs_k[:, None] * stride_sk + (offs_n[None, :] // _MX_BLOCK) * stride_sn
            )
            s = gl.load(ptrs).to(gl.int32)
        return s

    @gluon.jit
    def _dequant(raw, s):
        # 2^(s-127) from the exponent bits (exact; byte 0 is the subnormal 2^-127), as the
        # Triton kernel's _dequant: e4m3 * 2^k has at most 4 significant bits, so the bf16
        # rounding is exact.
        scale = gl.where(s == 0, 0x00400000, s << 23).to(gl.float32, bitcast=True)
        return (raw.to(gl.float32) * scale).to(gl.bfloat16, fp_downcast_rounding="rtne")

    @gluon.jit
    def _to_e4m3(x, factor, out_ty: gl.constexpr, OUT_FP8: gl.constexpr):
        # factor: 1 / q_scale (OUT_E4M3, vLLM's quantisation), q_scale (OUT_E4M3_DIV) or 1.
        if OUT_FP8 == _OUT_E4M3_DIV:  # noqa: SIM108 (a constexpr branch, as in the kernels)
            y = gl.div_rn(x, factor)
        else:
            y = x * factor
        y = gl.minimum(gl.maximum(y, -_E4M3_MAX), _E4M3_MAX)
        return y.to(out_ty, fp_downcast_rounding="rtne")

    @gluon.jit
    def _gluon_body(
        q_ptr,
        qpe_ptr,
        w_ptr,
        ws_ptr,
        out_ptr,
        qs_ptr,
        M,
        stride_qm,
        stride_qh,
        stride_pm,
        stride_ph,
        stride_wh,
        stride_wk,
        stride_wn,
        stride_sh,
        stride_sk,
        stride_sn,
        stride_om,
        stride_oh,
        K: gl.constexpr,
        N: gl.constexpr,
        R: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        W_LAYOUT: gl.constexpr,
        W_ALIGNED: gl.constexpr,
        IO_ALIGNED: gl.constexpr,
        MXFP8: gl.constexpr,
        OUT_FP8: gl.constexpr,
        INTERPRET: gl.constexpr,
        USE_PDL: gl.constexpr,
        PATH: gl.constexpr,  # index into OPERANDS: 0 convert, 1 smem, 2 direct
        LOAD_FENCE: gl.constexpr,
    ):
        gl.static_assert(not INTERPRET, "Gluon kernels do not run under TRITON_INTERPRET=1")
        gl.static_assert(BLOCK_K * 3 == K, "the Gluon kernel covers K in three exact chunks")
        NUM_WARPS: gl.constexpr = gl.num_warps()
        W_BITS: gl.constexpr = 8 if MXFP8 else 16
        mma: gl.constexpr = _mma_layout(BLOCK_N, NUM_WARPS)
        K_WIDTH: gl.constexpr = _DIRECT_K_WIDTH if PATH == 2 else _K_WIDTH
        a_op: gl.constexpr = gl.DotOperandLayout(0, mma, K_WIDTH)
        b_op: gl.constexpr = gl.DotOperandLayout(1, mma, K_WIDTH)
        # Load layouts: the operand layouts themselves (direct), or blocked layouts matched to
        # each operand's unit-stride axis.
        if PATH == 2:
            w_layout: gl.constexpr = b_op
            q_layout: gl.constexpr = a_op
        else:
            w_layout: gl.constexpr = _tile_layout(
                BLOCK_K, BLOCK_N, _vec(W_BITS, W_LAYOUT != 0), 0 if W_LAYOUT == 2 else 1,
                NUM_WARPS,
            )  # fmt: skip
            q_layout: gl.constexpr = _tile_layout(BLOCK_M, BLOCK_K, 8, 1, NUM_WARPS)
        pe_layout: gl.constexpr = _tile_layout(BLOCK_M, R, 8, 1, NUM_WARPS)

        pid_n = gl.program_id(0)
        h = gl.program_id(1)
        w_head = w_ptr + h.to(gl.int64) * stride_wh
        ws_head = ws_ptr + h.to(gl.int64) * stride_sh
        offs_wk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, w_layout))
        offs_wn = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, w_layout))
        w0_ptrs = _w_ptrs(w_head, offs_wk, offs_wn, stride_wk, stride_wn, W_LAYOUT, W_ALIGNED)
        w_step = BLOCK_K * stride_wk

        offs_qm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_layout))
        offs_qk = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, q_layout))
        q_rows = q_ptr + offs_qm[:, None].to(gl.int64) * stride_qm + h * stride_qh
        q_rows = q_rows + offs_qk[None, :]
        if IO_ALIGNED:
            q_rows = gl.multiple_of(q_rows, [16, 16])
        q_mask = offs_qm[:, None] < M

        offs_pm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, pe_layout))
        offs_r = gl.arange(0, R, layout=gl.SliceLayout(0, pe_layout))
        pe_ptrs = qpe_ptr + offs_pm[:, None].to(gl.int64) * stride_pm + h * stride_ph
        pe_ptrs = pe_ptrs + offs_r[None, :]
        pe_out = out_ptr + offs_pm[:, None].to(gl.int64) * stride_om + h * stride_oh
        pe_out = pe_out + N + offs_r[None, :]
        if IO_ALIGNED:
            pe_ptrs = gl.multiple_of(pe_ptrs, [16, 16])
            pe_out = gl.multiple_of(pe_out, [16, 16])
        # The RoPE half is a plain copy (quantised for E4M3) by the first N-tile CTA of each
        # head: predicated rather than branched, so its load joins the one round trip.
        pe_mask = (offs_pm[:, None] < M) & (pid_n == 0)

        # Every global load, in program order, before any use. Weights (and scales) depend on
        # no earlier kernel, so under PDL they go before griddepcontrol.wait; q, q_pe,
        # q_scale and out may (RAW and WAR) and follow it.
        if not USE_PDL:
            q0 = gl.load(q_rows, mask=q_mask, other=0.0)
            q1 = gl.load(q_rows + BLOCK_K, mask=q_mask, other=0.0)
            q2 = gl.load(q_rows + 2 * BLOCK_K, mask=q_mask, other=0.0)
        if MXFP8:
            s0 = _load_scales(ws_head, offs_wk, offs_wn, pid_n, stride_sk, stride_sn, BLOCK_N)
            s1 = _load_scales(
                ws_head + BLOCK_K * stride_sk, offs_wk, offs_wn, pid_n, stride_sk, stride_sn,
                BLOCK_N,
            )  # fmt: skip
            s2 = _load_scales(
                ws_head + 2 * BLOCK_K * stride_sk, offs_wk, offs_wn, pid_n, stride_sk,
                stride_sn, BLOCK_N,
            )  # fmt: skip
        w0 = gl.load(w0_ptrs)
        w1 = gl.load(w0_ptrs + w_step)
        w2 = gl.load(w0_ptrs + 2 * w_step)
        if USE_PDL:
            _gdc_wait()
            _gdc_launch_dependents()
            q0 = gl.load(q_rows, mask=q_mask, other=0.0)
            q1 = gl.load(q_rows + BLOCK_K, mask=q_mask, other=0.0)
            q2 = gl.load(q_rows + 2 * BLOCK_K, mask=q_mask, other=0.0)
        if OUT_FP8:
            # Padding rows load 1, not 0: dividing 0 (OUT_E4M3_DIV) takes div.rn's slow path.
            pe = gl.load(pe_ptrs, mask=pe_mask, other=1.0)
            if OUT_FP8 != _OUT_E4M3_NOSCALE:  # (that measurement variant loads no scale)
                q_scale = gl.load(qs_ptr)
        else:
            pe = gl.load(pe_ptrs, mask=pe_mask, other=0.0)

        # From here on only loaded values are used.
        if OUT_FP8 == _OUT_E4M3 or OUT_FP8 == _OUT_E4M3_WIDE:  # noqa: SIM109 (constexprs)
            # vLLM's CUDA op: the reciprocal once, correctly rounded, then one multiply each.
            q_scale = gl.div_rn(1.0, q_scale)
        if OUT_FP8 == _OUT_E4M3_NOSCALE:
            q_scale = 1.0
        if OUT_FP8:
            pe = _to_e4m3(pe.to(gl.float32), q_scale, out_ptr.dtype.element_ty, OUT_FP8)
        elif LOAD_FENCE:
            # A scheduling fence for ptxas (off by default: LaunchConfig.load_fence): a
            # correctly rounded division compiles to a slow-path subroutine call, and ptxas
            # moves no instruction across a call. Placed here (M >= 1, so the mask is
            # unchanged), it keeps every global load above it issued before the first use of
            # any; without it ptxas sinks the last q loads of the MXFP8 kernels below the
            # dequantisation, which waits for the weights (sm_90 SASS, 2026-12-01). Measured on
            # the H200 it costs more than that wait saves
            # (docs/decisions/0006-gluon-for-larger-m.md).
            # E4M3 out has q_scale's reciprocal at this point already.
            fence = gl.div_rn(1.0, M.to(gl.float32))
            pe_mask = pe_mask & (fence > 0.0)
        gl.store(pe_out, pe, mask=pe_mask)

        if MXFP8:
            w0 = _dequant(w0, s0)
            w1 = _dequant(w1, s1)
            w2 = _dequant(w2, s2)
        acc = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=mma)
        if PATH == 2:
            acc = mma_v2(q0, w0, acc)
            acc = mma_v2(q1, w1, acc)
            acc = mma_v2(q2, w2, acc)
        elif PATH == 1:
            # All six operand tiles to shared memory first, then one barrier (the membar
            # pass places it before the first read), then ldmatrix into the operand layouts.
            q_smem: gl.constexpr = _smem_layout(BLOCK_K, 1)
            w_smem: gl.constexpr = _smem_layout(BLOCK_N if W_LAYOUT != 2 else BLOCK_K,
                                                0 if W_LAYOUT == 2 else 1)  # fmt: skip
            sq0 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_K], q_smem, q0)
            sq1 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_K], q_smem, q1)
            sq2 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_M, BLOCK_K], q_smem, q2)
            sw0 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_K, BLOCK_N], w_smem, w0)
            sw1 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_K, BLOCK_N], w_smem, w1)
            sw2 = gl.allocate_shared_memory(gl.bfloat16, [BLOCK_K, BLOCK_N], w_smem, w2)
            acc = mma_v2(sq0.load(a_op), sw0.load(b_op), acc)
            acc = mma_v2(sq1.load(a_op), sw1.load(b_op), acc)
            acc = mma_v2(sq2.load(a_op), sw2.load(b_op), acc)
        else:
            # One register-to-register conversion per operand tile (Gluon stages each through
            # a shared scratch buffer with its own barriers).
            acc = mma_v2(gl.convert_layout(q0, a_op), gl.convert_layout(w0, b_op), acc)
            acc = mma_v2(gl.convert_layout(q1, a_op), gl.convert_layout(w1, b_op), acc)
            acc = mma_v2(gl.convert_layout(q2, a_op), gl.convert_layout(w2, b_op), acc)

        # The result is stored from the accumulator's layout (2 adjacent columns per thread):
        # a conversion to a wider-vector layout costs a shared-memory round trip. BF16 never
        # pays it; E4M3's "wide" epilogue (_OUT_E4M3_WIDE) does from 16 tokens, where its 2-byte
        # stores cost more than the round trip (fusedq.selection.GLUON_TUNED picks it).
        o_layout: gl.constexpr = (
            _tile_layout(BLOCK_M, BLOCK_N, 16, 1, NUM_WARPS) if OUT_FP8 == _OUT_E4M3_WIDE else mma
        )
        offs_om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, o_layout))
        offs_on = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, o_layout))
        o_ptrs = out_ptr + offs_om[:, None].to(gl.int64) * stride_om + h * stride_oh
        o_ptrs = o_ptrs + offs_on[None, :]
        if IO_ALIGNED:
            o_ptrs = gl.multiple_of(o_ptrs, [16, 16])
        o_mask = offs_om[:, None] < M
        y = acc.to(gl.bfloat16, fp_downcast_rounding="rtne")
        if OUT_FP8:
            # vLLM's staged path rounds the bmm result to bf16 before quantising: so do we.
            y = y.to(gl.float32)
            if OUT_FP8 == _OUT_E4M3_DIV:
                # Padding rows divide 1, not 0 (div.rn's slow path); they are not stored.
                y = gl.where(o_mask, y, 1.0)
            y = _to_e4m3(y, q_scale, out_ptr.dtype.element_ty, OUT_FP8)
            if OUT_FP8 == _OUT_E4M3_WIDE:
                y = gl.convert_layout(y, o_layout)
        gl.store(o_ptrs, y, mask=o_mask)

    # One kernel per OPERANDS choice, each with the shared parameter list (the launch
    # machinery passes exactly those, so the choice cannot be one more constexpr).
    @gluon.jit(**common.JIT_OPTIONS)
    def _mla_query_gluon_kernel(
        q_ptr,
        qpe_ptr,
        w_ptr,
        ws_ptr,
        out_ptr,
        qs_ptr,
        M,
        stride_qm,
        stride_qh,
        stride_pm,
        stride_ph,
        stride_wh,
        stride_wk,
        stride_wn,
        stride_sh,
        stride_sk,
        stride_sn,
        stride_om,
        stride_oh,
        K: gl.constexpr,
        N: gl.constexpr,
        R: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        W_LAYOUT: gl.constexpr,
        W_ALIGNED: gl.constexpr,
        IO_ALIGNED: gl.constexpr,
        MXFP8: gl.constexpr,
        OUT_FP8: gl.constexpr,
        INTERPRET: gl.constexpr,
        USE_PDL: gl.constexpr,
        LOAD_FENCE: gl.constexpr,
    ):
        _gluon_body(
            q_ptr,
            qpe_ptr,
            w_ptr,
            ws_ptr,
            out_ptr,
            qs_ptr,
            M,
            stride_qm,
            stride_qh,
            stride_pm,
            stride_ph,
            stride_wh,
            stride_wk,
            stride_wn,
            stride_sh,
            stride_sk,
            stride_sn,
            stride_om,
            stride_oh,
            K,
            N,
            R,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            W_LAYOUT,
            W_ALIGNED,
            IO_ALIGNED,
            MXFP8,
            OUT_FP8,
            INTERPRET,
            USE_PDL,
            0,
            LOAD_FENCE,
        )

    @gluon.jit(**common.JIT_OPTIONS)
    def _mla_query_gluon_smem_kernel(
        q_ptr,
        qpe_ptr,
        w_ptr,
        ws_ptr,
        out_ptr,
        qs_ptr,
        M,
        stride_qm,
        stride_qh,
        stride_pm,
        stride_ph,
        stride_wh,
        stride_wk,
        stride_wn,
        stride_sh,
        stride_sk,
        stride_sn,
        stride_om,
        stride_oh,
        K: gl.constexpr,
        N: gl.constexpr,
        R: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        W_LAYOUT: gl.constexpr,
        W_ALIGNED: gl.constexpr,
        IO_ALIGNED: gl.constexpr,
        MXFP8: gl.constexpr,
        OUT_FP8: gl.constexpr,
        INTERPRET: gl.constexpr,
        USE_PDL: gl.constexpr,
        LOAD_FENCE: gl.constexpr,
    ):
        _gluon_body(
            q_ptr,
            qpe_ptr,
            w_ptr,
            ws_ptr,
            out_ptr,
            qs_ptr,
            M,
            stride_qm,
            stride_qh,
            stride_pm,
            stride_ph,
            stride_wh,
            stride_wk,
            stride_wn,
            stride_sh,
            stride_sk,
            stride_sn,
            stride_om,
            stride_oh,
            K,
            N,
            R,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            W_LAYOUT,
            W_ALIGNED,
            IO_ALIGNED,
            MXFP8,
            OUT_FP8,
            INTERPRET,
            USE_PDL,
            1,
            LOAD_FENCE,
        )

    @gluon.jit(**common.JIT_OPTIONS)
    def _mla_query_gluon_direct_kernel(
        q_ptr,
        qpe_ptr,
        w_ptr,
        ws_ptr,
        out_ptr,
        qs_ptr,
        M,
        stride_qm,
        stride_qh,
        stride_pm,
        stride_ph,
        stride_wh,
        stride_wk,
        stride_wn,
        stride_sh,
        stride_sk,
        stride_sn,
        stride_om,
        stride_oh,
        K: gl.constexpr,
        N: gl.constexpr,
        R: gl.constexpr,
        BLOCK_M: gl.constexpr,
        BLOCK_N: gl.constexpr,
        BLOCK_K: gl.constexpr,
        W_LAYOUT: gl.constexpr,
        W_ALIGNED: gl.constexpr,
        IO_ALIGNED: gl.constexpr,
        MXFP8: gl.constexpr,
        OUT_FP8: gl.constexpr,
        INTERPRET: gl.constexpr,
        USE_PDL: gl.constexpr,
        LOAD_FENCE: gl.constexpr,
    ):
        _gluon_body(
            q_ptr,
            qpe_ptr,
            w_ptr,
            ws_ptr,
            out_ptr,
            qs_ptr,
            M,
            stride_qm,
            stride_qh,
            stride_pm,
            stride_ph,
            stride_wh,
            stride_wk,
            stride_wn,
            stride_sh,
            stride_sk,
            stride_sn,
            stride_om,
            stride_oh,
            K,
            N,
            R,
            BLOCK_M,
            BLOCK_N,
            BLOCK_K,
            W_LAYOUT,
            W_ALIGNED,
            IO_ALIGNED,
            MXFP8,
            OUT_FP8,
            INTERPRET,
            USE_PDL,
            2,
            LOAD_FENCE,
        )

else:  # pragma: no cover - see UNAVAILABLE_REASON
    _mla_query_gluon_kernel = _mla_query_gluon_smem_kernel = _mla_query_gluon_direct_kernel = None


def kernel_for_operands(operands: str):
    """The Gluon kernel of an ``OPERANDS`` choice."""
    return {
        "convert": _mla_query_gluon_kernel,
        "smem": _mla_query_gluon_smem_kernel,
        "direct": _mla_query_gluon_direct_kernel,
    }[operands]


def offline_signature(mxfp8: bool, out_fp8: bool, constexprs) -> dict[str, str]:
    """The kernel's ``ASTSource`` signature (pointer element types, 32-bit integers, the
    names in ``constexprs``), for compiling without a GPU."""
    pointers = {
        "q_ptr": "*bf16",
        "qpe_ptr": "*bf16",
        "w_ptr": "*fp8e4nv" if mxfp8 else "*bf16",
        "ws_ptr": "*u8" if mxfp8 else "*bf16",
        "out_ptr": "*fp8e4nv" if out_fp8 else "*bf16",
        "qs_ptr": "*fp32" if out_fp8 else "*bf16",
    }
    names = _mla_query_gluon_kernel.arg_names
    return {n: pointers.get(n, "constexpr" if n in constexprs else "i32") for n in names}


def offline_compile(
    *,
    block_m: int,
    block_n: int,
    num_warps: int,
    pdl: bool,
    mxfp8: bool,
    out_fp8: bool,
    w_layout: int,
    w_aligned: bool,
    io_aligned: bool,
    operands: str = "convert",
    arch: int = 90,
    e4m3_epilogue: str = "mul",
    load_fence: bool = False,
):
    """Compile the kernel for ``sm_<arch>`` without a GPU (``triton.compile``); the result's
    ``asm`` holds the TTGIR and PTX. Takes the launch parameters one by one rather than a
    ``LaunchConfig``, which refuses ``gluon=True`` under the interpreter (where CPU CI runs
    this)."""
    if not AVAILABLE:
        raise RuntimeError(UNAVAILABLE_REASON)
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    constexprs = {
        "K": GLM5.qk_nope,
        "N": KV_LORA,
        "R": QK_ROPE,
        "BLOCK_M": block_m,
        "BLOCK_N": block_n,
        "BLOCK_K": GLUON_BLOCK_K,
        "W_LAYOUT": w_layout,
        "W_ALIGNED": w_aligned,
        "IO_ALIGNED": io_aligned,
        "MXFP8": mxfp8,
        "OUT_FP8": common.out_mode(out_fp8, e4m3_epilogue),
        "INTERPRET": False,
        "USE_PDL": pdl,
        "LOAD_FENCE": load_fence,
    }
    fn = kernel_for_operands(operands)
    src = GluonASTSource(
        fn,
        offline_signature(mxfp8, out_fp8, constexprs),
        constexprs=constexprs,
    )
    return triton.compile(
        src,
        target=GPUTarget("cuda", arch, 32),
        options={"num_warps": num_warps, "num_stages": common.DEFAULT_NUM_STAGES},
    )


# PTX instructions that mark the end of the load phase: a shared-memory store (a layout
# conversion or operand staging) or a CTA barrier; both come after the data they wait for.
_SHARED_OR_BARRIER = ("st.shared", "bar.sync", "barrier.sync", "stmatrix")


def ptx_memory_order(ptx: str) -> dict[str, int]:
    """Counts that show the one-round-trip property in a kernel's PTX: global loads, shared
    stores, barriers, MMAs, and how many global loads come after the first shared store or
    barrier (0 means every global load is issued before any data waits)."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    first_sync = next(
        (i for i, ln in enumerate(lines) if ln.startswith(_SHARED_OR_BARRIER)), len(lines)
    )
    # Predicated instructions start with "@%p"; strip the guard before matching.
    ops = [ln.split(None, 1)[1] if ln.startswith("@") and " " in ln else ln for ln in lines]
    loads = [i for i, op in enumerate(ops) if op.startswith("ld.global")]
    return {
        "ld_global": len(loads),
        "ld_global_after_first_sync": sum(i > first_sync for i in loads),
        "st_shared": sum(op.startswith(("st.shared", "stmatrix")) for op in ops),
        "bar_sync": sum(op.startswith(("bar.sync", "barrier.sync")) for op in ops),
        "mma_sync": sum(op.startswith("mma.sync") for op in ops),
        "cp_async": sum(op.startswith("cp.async.") for op in ops),
    }
