"""Triton kernels for the fused MLA decode query projection: the tl.dot kernel and the
register (FMA) path.

One launch computes, for every token ``m`` and head ``h``::

    out[m, h, :512]    = q_nope[m, h, :K] @ W[h, :K, :512]   (BF16 or E4M3 out)
    out[m, h, 512:576] = q_pe[m, h, :64]

K is the geometry's qk_nope, a constexpr (GEOMETRIES: GLM-5's 192, DeepSeek-V3's 128), taken in
64-wide chunks; the weight's head stride is read from the tensor (vLLM's W_UK_T view spans
qk_nope + v_head rows of kv_b_proj per head).

The work is latency bound (a few MB of weights, ~2 µs budget), so the grid spreads the
weight read over ``heads x N-tiles`` CTAs, every CTA issues all of its loads before its
first ``tl.dot``, and the RoPE copy rides along in the first N-tile CTA of each head.

Specialisation is under host control (``common.JIT_OPTIONS``): every integer argument is
``do_not_specialize`` and no pointer is specialised on alignment, so the compiled variant
depends only on the launch's ``KernelKey`` (``triton_launch``: constexprs + dtypes).
Alignment comes back as ``tl.multiple_of`` hints behind constexpr flags that the host
computes. Which configuration runs a problem is ``fusedq.selection``'s to say.
"""

# long because the tl.dot and register kernels share their jit building blocks (the loads,
# the MXFP8 dequantisation, the MMA chunks, the E4M3 epilogue) with the decode front's kernel
# (triton_decode_front), and those blocks belong with the kernels they were cut from.

from __future__ import annotations

import triton
import triton.language as tl

from fusedq.contract import DEEPSEEK_V3, E4M3_MAX, GLM5, MX_BLOCK
from fusedq.kernels.common import JIT_OPTIONS, OUT_E4M3, OUT_E4M3_DIV, OUT_E4M3_NOSCALE

try:  # programmatic dependent launch (griddepcontrol); Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None
    HAS_PDL = False

# What the kernels read as globals must be constexprs: the OUT_FP8 modes they compare against
# (common.E4M3_EPILOGUES), E4M3's clamp, the MX block of the scales.
_OUT_E4M3 = tl.constexpr(OUT_E4M3)
_OUT_E4M3_DIV = tl.constexpr(OUT_E4M3_DIV)
_OUT_E4M3_NOSCALE = tl.constexpr(OUT_E4M3_NOSCALE)
_E4M3_MAX = tl.constexpr(E4M3_MAX)
_MX_BLOCK = tl.constexpr(MX_BLOCK)

# The geometries both kernels here are built for (qk_nope is their K constexpr).
GEOMETRIES = (GLM5, DEEPSEEK_V3)
# The tl.dot kernel can also take K as one chunk (the power of two above it, masked down) instead
# of common.BLOCK_K's chunks: one shared-memory staging instead of three. Per geometry.
SINGLE_BLOCK_K = {g.name: triton.next_power_of_2(g.qk_nope) for g in GEOMETRIES}
# tl.dot needs at least 16 rows, so small M is padded with masks to 16 (one MMA tile).
MIN_BLOCK_M = 16
# Up to 32 tokens one CTA row covers M (the measured variants, BLOCK_M 16|32); above, M is
# tiled in 64-row blocks over the grid's third axis (a [64, BLOCK_N] fp32 accumulator).
MAX_BLOCK_M = 64
# The register (FMA) path: no tl.dot, so no shared-memory staging of the MMA operands and no
# padding of M to 16. Rows are unrolled (BLOCK_M in FMA_BLOCK_MS), so it serves small M only.
FMA_BLOCK_MS = (1, 2, 4, 8)


@triton.jit
def _round_mantissa(x, DROP: tl.constexpr):
    # Round fp32 to nearest even at 2^DROP ulps (integer ops, so the interpreter agrees with
    # the GPU, whose conversions round to nearest even while the interpreter truncates).
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)
    return ((bits >> DROP) << DROP).to(tl.float32, bitcast=True)


@triton.jit
def _to_bf16(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        x = _round_mantissa(x, 16)
    return x.to(tl.bfloat16, fp_downcast_rounding="rtne")


@triton.jit
def _e4m3_factor(qs_ptr, OUT_FP8: tl.constexpr):
    # What _to_e4m3 applies: 1 / q_scale, rounded once (as vLLM's CUDA op computes it), or
    # q_scale itself for the dividing measurement variant, or 1 (no load) for "noscale".
    if OUT_FP8 == _OUT_E4M3_NOSCALE:
        q_scale = tl.full([], 1.0, tl.float32)
    else:
        q_scale = tl.load(qs_ptr)
        if OUT_FP8 == _OUT_E4M3:
            q_scale = tl.math.div_rn(tl.full([], 1.0, tl.float32), q_scale)
    return q_scale


@triton.jit
def _to_e4m3(x, factor, out_ty: tl.constexpr, INTERPRET: tl.constexpr, OUT_FP8: tl.constexpr):
    if OUT_FP8 == _OUT_E4M3_DIV:  # noqa: SIM108 (a constexpr branch)
        y = tl.math.div_rn(x, factor)
    else:
        y = x * factor
    y = tl.minimum(tl.maximum(y, -_E4M3_MAX), _E4M3_MAX)
    if INTERPRET:
        # Normal E4M3 keeps 3 of fp32's 23 mantissa bits; below 2^-6 the grid is 2^-9
        # (subnormals), where adding and removing 2^14 rounds to nearest even.
        sub = (tl.abs(y) + 16384.0) - 16384.0
        sub = tl.where(y < 0, -sub, sub)
        y = tl.where(tl.abs(y) < 0.015625, sub, _round_mantissa(y, 20))
    return y.to(out_ty, fp_downcast_rounding="rtne")


@triton.jit
def _load_w(
    w_ptr, offs_k, offs_n, k_mask, stride_wk, stride_wn,
    W_LAYOUT: tl.constexpr, W_ALIGNED: tl.constexpr, K_MASKED: tl.constexpr,
):  # fmt: skip
    if W_LAYOUT == 1:
        ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :]
    elif W_LAYOUT == 2:
        ptrs = w_ptr + offs_k[:, None] + offs_n[None, :] * stride_wn
    else:
        ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    if W_ALIGNED:
        ptrs = tl.multiple_of(ptrs, [16, 16])
    if K_MASKED:  # noqa: SIM108
        w = tl.load(ptrs, mask=k_mask[:, None], other=0.0)
    else:
        w = tl.load(ptrs)
    return w


@triton.jit
def _load_scales(
    ws_ptr, offs_k, offs_n, k_mask, pid_n, stride_sk, stride_sn,
    BLOCK_N: tl.constexpr, K_MASKED: tl.constexpr,
):  # fmt: skip
    if BLOCK_N <= _MX_BLOCK:
        # One scale per K row for the whole tile: a [BLOCK_K] load, broadcast along N.
        ptrs = ws_ptr + offs_k * stride_sk + ((pid_n * BLOCK_N) // _MX_BLOCK) * stride_sn
        if K_MASKED:  # noqa: SIM108 (constexpr branches read clearer than IfExp in Triton)
            s = tl.load(ptrs, mask=k_mask, other=127)
        else:
            s = tl.load(ptrs)
        s = s.to(tl.int32)[:, None]
    else:
        ptrs = ws_ptr + offs_k[:, None] * stride_sk + (offs_n[None, :] // _MX_BLOCK) * stride_sn
        if K_MASKED:  # noqa: SIM108
            s = tl.load(ptrs, mask=k_mask[:, None], other=127)
        else:
            s = tl.load(ptrs)
        s = s.to(tl.int32)
    return s


@triton.jit
def _dequant(raw, s, INTERPRET: tl.constexpr):
    # 2^(s-127) built from the exponent bits (exact); byte 0 is the subnormal 2^-127.
    scale = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
    # e4m3 * 2^k has at most 4 significant bits, so this bf16 rounding is exact.
    return _to_bf16(raw.to(tl.float32) * scale, INTERPRET)


@triton.jit
def _load_q(
    q_rows, m_mask, k_mask, BLOCK_K: tl.constexpr, SINGLE: tl.constexpr, NUM_K: tl.constexpr
):
    if SINGLE:
        q0 = tl.load(q_rows, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        q1 = q0
        q2 = q0
    else:
        q0 = tl.load(q_rows, mask=m_mask[:, None], other=0.0)
        q1 = tl.load(q_rows + BLOCK_K, mask=m_mask[:, None], other=0.0)
        if NUM_K > 2:  # noqa: SIM108 (a constexpr branch)
            q2 = tl.load(q_rows + 2 * BLOCK_K, mask=m_mask[:, None], other=0.0)
        else:
            q2 = q0  # (two chunks: never used)
    return q0, q1, q2


@triton.jit
def _dot(q, w, acc, INTERPRET: tl.constexpr):
    if INTERPRET:
        # The interpreter multiplies raw bf16 bit patterns in some versions: go through fp32.
        acc = tl.dot(q.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(q, w, acc)
    return acc


@triton.jit
def _load_weight_chunks(
    w_head, ws_head, offs_k, offs_n, k_mask, pid_n, stride_wk, stride_wn, stride_sk, stride_sn,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SINGLE: tl.constexpr, NUM_K: tl.constexpr,
    MXFP8: tl.constexpr, W_LAYOUT: tl.constexpr, W_ALIGNED: tl.constexpr,
):  # fmt: skip
    # One head's [K, BLOCK_N] weight tile as the tl.dot kernels load it: one masked chunk
    # (SINGLE) or NUM_K exact BLOCK_K chunks, MXFP8 scales before their values. Chunks and
    # scales a variant does not use come back as placeholders that are never read.
    s0 = 0
    s1 = 0
    s2 = 0
    if SINGLE:
        if MXFP8:
            s0 = _load_scales(
                ws_head, offs_k, offs_n, k_mask, pid_n, stride_sk, stride_sn, BLOCK_N, True
            )
        w0 = _load_w(
            w_head, offs_k, offs_n, k_mask, stride_wk, stride_wn, W_LAYOUT, W_ALIGNED, True
        )
        w1 = w0
        w2 = w0
    else:
        if MXFP8:
            s0 = _load_scales(
                ws_head, offs_k, offs_n, k_mask, pid_n, stride_sk, stride_sn, BLOCK_N, False
            )
            s1 = _load_scales(
                ws_head + BLOCK_K * stride_sk, offs_k, offs_n, k_mask, pid_n, stride_sk,
                stride_sn, BLOCK_N, False,
            )  # fmt: skip
            if NUM_K > 2:
                s2 = _load_scales(
                    ws_head + 2 * BLOCK_K * stride_sk, offs_k, offs_n, k_mask, pid_n, stride_sk,
                    stride_sn, BLOCK_N, False,
                )  # fmt: skip
        w1_head = w_head + BLOCK_K * stride_wk
        w2_head = w_head + 2 * BLOCK_K * stride_wk
        w0 = _load_w(
            w_head, offs_k, offs_n, k_mask, stride_wk, stride_wn, W_LAYOUT, W_ALIGNED, False
        )
        w1 = _load_w(
            w1_head, offs_k, offs_n, k_mask, stride_wk, stride_wn, W_LAYOUT, W_ALIGNED, False
        )
        if NUM_K > 2:
            w2 = _load_w(
                w2_head, offs_k, offs_n, k_mask, stride_wk, stride_wn, W_LAYOUT, W_ALIGNED, False
            )
        else:
            w2 = w0
    return w0, w1, w2, s0, s1, s2


@triton.jit
def _dot_chunks(
    q0, q1, q2, w0, w1, w2, s0, s1, s2, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SINGLE: tl.constexpr, NUM_K: tl.constexpr, MXFP8: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    # The fp32 [BLOCK_M, BLOCK_N] accumulator of q @ W over the chunks _load_weight_chunks
    # loaded (MXFP8 dequantised in registers first, exactly).
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SINGLE:
        if MXFP8:
            w0 = _dequant(w0, s0, INTERPRET)
        acc = _dot(q0, w0, acc, INTERPRET)
    else:
        if MXFP8:
            w0 = _dequant(w0, s0, INTERPRET)
            w1 = _dequant(w1, s1, INTERPRET)
            if NUM_K > 2:
                w2 = _dequant(w2, s2, INTERPRET)
        acc = _dot(q0, w0, acc, INTERPRET)
        acc = _dot(q1, w1, acc, INTERPRET)
        if NUM_K > 2:
            acc = _dot(q2, w2, acc, INTERPRET)
    return acc


@triton.jit
def _store_latent(
    acc, out_ptr, offs_m, offs_n, m_mask, h, stride_om, stride_oh, q_scale,
    IO_ALIGNED: tl.constexpr, OUT_FP8: tl.constexpr, INTERPRET: tl.constexpr,
):  # fmt: skip
    # out[m, h, offs_n] of the 512-wide part: the accumulator rounded to bf16, or for E4M3
    # out that bf16 value quantised with q_scale's factor (_e4m3_factor).
    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + h * stride_oh
    o_ptrs = o_ptrs + offs_n[None, :]
    if IO_ALIGNED:
        o_ptrs = tl.multiple_of(o_ptrs, [16, 16])
    if OUT_FP8:
        # vLLM's staged path rounds the bmm result to bf16 before quantising: so do we.
        y = _to_bf16(acc, INTERPRET).to(tl.float32)
        if OUT_FP8 == _OUT_E4M3_DIV:
            # Padding rows divide 1, not 0 (div.rn's slow path); they are not stored anyway.
            y = tl.where(m_mask[:, None], y, 1.0)
        y = _to_e4m3(y, q_scale, out_ptr.dtype.element_ty, INTERPRET, OUT_FP8)
        tl.store(o_ptrs, y, mask=m_mask[:, None])
    else:
        tl.store(o_ptrs, _to_bf16(acc, INTERPRET), mask=m_mask[:, None])


@triton.jit(**JIT_OPTIONS)
def _mla_query_kernel(
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
    K: tl.constexpr,
    N: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_LAYOUT: tl.constexpr,
    W_ALIGNED: tl.constexpr,
    IO_ALIGNED: tl.constexpr,
    MXFP8: tl.constexpr,
    OUT_FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,
    LOAD_FENCE: tl.constexpr,  # (unused here: the three kernels share one parameter list)
):
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    # BLOCK_M <= 32 (the measured variants) covers M in one CTA row; larger blocks tile M over
    # the grid's third axis (MAX_BLOCK_M rows each).
    M_TILED: tl.constexpr = BLOCK_M > 32
    if M_TILED:
        offs_m = tl.program_id(2) * BLOCK_M + tl.arange(0, BLOCK_M)
    else:
        offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    k_mask = offs_k < K
    # BLOCK_K == K / NUM_K: NUM_K exact chunks (3 for K = 192, 2 for 128; the host checks
    # common.k_chunks). BLOCK_K >= K: one chunk, padded with masks where K is not a power of
    # two (fewer layout round trips through shared memory; 25% idle MMA work at K = 192).
    SINGLE: tl.constexpr = BLOCK_K >= K
    NUM_K: tl.constexpr = K // BLOCK_K

    # Every global load is issued before the first use of any loaded value, so the CTA pays
    # one memory round trip. Triton converts the layout of fp8 tiles right after their load,
    # which waits for the data: so the small L2-resident loads go first and the weight last
    # (and MXFP8 wants the single-chunk variant, whose one weight load is the last load).
    w_head = w_ptr + h.to(tl.int64) * stride_wh
    ws_head = ws_ptr + h.to(tl.int64) * stride_sh
    q_rows = q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + h * stride_qh + offs_k[None, :]
    if IO_ALIGNED:
        q_rows = tl.multiple_of(q_rows, [16, 16])
    if not USE_PDL:
        q0, q1, q2 = _load_q(q_rows, m_mask, k_mask, BLOCK_K, SINGLE, NUM_K)
    w0, w1, w2, s0, s1, s2 = _load_weight_chunks(
        w_head, ws_head, offs_k, offs_n, k_mask, pid_n, stride_wk, stride_wn, stride_sk,
        stride_sn, BLOCK_N, BLOCK_K, SINGLE, NUM_K, MXFP8, W_LAYOUT, W_ALIGNED,
    )  # fmt: skip
    if USE_PDL:
        # Weights depend on no earlier kernel; q, q_pe, q_scale and out may (RAW and WAR).
        gdc_wait()
        gdc_launch_dependents()
        q0, q1, q2 = _load_q(q_rows, m_mask, k_mask, BLOCK_K, SINGLE, NUM_K)
    if OUT_FP8:
        q_scale = _e4m3_factor(qs_ptr, OUT_FP8)

    if pid_n == 0:
        # The RoPE half is a plain copy (quantised for E4M3); one CTA per head does it.
        offs_r = tl.arange(0, R)
        pe_ptrs = qpe_ptr + offs_m[:, None].to(tl.int64) * stride_pm + h * stride_ph
        pe_ptrs = pe_ptrs + offs_r[None, :]
        pe_out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + h * stride_oh
        pe_out = pe_out + N + offs_r[None, :]
        if IO_ALIGNED:
            pe_ptrs = tl.multiple_of(pe_ptrs, [16, 16])
            pe_out = tl.multiple_of(pe_out, [16, 16])
        if OUT_FP8:
            # Padding rows load 1, not 0: dividing 0 (OUT_E4M3_DIV) takes div.rn's slow path.
            pe = tl.load(pe_ptrs, mask=m_mask[:, None], other=1.0)
            pe = _to_e4m3(pe.to(tl.float32), q_scale, out_ptr.dtype.element_ty, INTERPRET, OUT_FP8)
        else:
            pe = tl.load(pe_ptrs, mask=m_mask[:, None], other=0.0)
        tl.store(pe_out, pe, mask=m_mask[:, None])

    acc = _dot_chunks(
        q0, q1, q2, w0, w1, w2, s0, s1, s2, BLOCK_M, BLOCK_N, SINGLE, NUM_K, MXFP8, INTERPRET
    )
    if not OUT_FP8:
        q_scale = 0.0  # (no E4M3 epilogue: never read)
    _store_latent(
        acc, out_ptr, offs_m, offs_n, m_mask, h, stride_om, stride_oh, q_scale, IO_ALIGNED,
        OUT_FP8, INTERPRET,
    )  # fmt: skip


@triton.jit
def _fma_weight(raw, s, MXFP8: tl.constexpr):
    # The weight chunk in fp32, in the layout it was loaded in (no conversion).
    if MXFP8:
        # 2^(s-127) from the exponent bits (byte 0 is the subnormal 2^-127); e4m3 x 2^k is
        # exact in fp32, so this equals the staged path's dequantised bf16 weight.
        scale = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
        w = raw.to(tl.float32) * scale
    else:
        w = raw.to(tl.float32)
    return w


@triton.jit
def _fma_load_q(
    q_head, m, M, stride_qm, offs_k, BLOCK_K: tl.constexpr, IO_ALIGNED: tl.constexpr,
    NUM_K: tl.constexpr,
):  # fmt: skip
    # Row m of q_nope as NUM_K [BLOCK_K, 1] chunks (zeros past M; the third is the first again
    # where there are two, never used): K along dim 0, as in the weight tile, so that the
    # product broadcasts along N.
    row = q_head + m * stride_qm.to(tl.int64) + offs_k[:, None]
    if IO_ALIGNED:
        row = tl.multiple_of(row, [16, 1])
    valid = offs_k[:, None] * 0 + m < M  # a tensor mask (the interpreter rejects a bool)
    q0 = tl.load(row, mask=valid, other=0.0)
    q1 = tl.load(row + BLOCK_K, mask=valid, other=0.0)
    if NUM_K > 2:  # noqa: SIM108 (a constexpr branch)
        q2 = tl.load(row + 2 * BLOCK_K, mask=valid, other=0.0)
    else:
        q2 = q0
    return q0, q1, q2


@triton.jit
def _fma_f32(q0, q1, q2, NUM_K: tl.constexpr):
    q0 = q0.to(tl.float32)
    q1 = q1.to(tl.float32)
    if NUM_K > 2:
        q2 = q2.to(tl.float32)
    return q0, q1, q2


@triton.jit
def _fma_row(q0, q1, q2, w0, w1, w2, acc, m, offs_m, NUM_K: tl.constexpr):
    # acc[m, n] = sum_k q[m, k] w[k, n]: exact bf16 x bf16 (or dequantised e4m3) products,
    # fp32 sums, as the MMA computes them.
    p = q0 * w0
    p += q1 * w1
    if NUM_K > 2:
        p += q2 * w2
    row = tl.sum(p, axis=0)
    return tl.where(offs_m[:, None] == m, row[None, :], acc)


@triton.jit(**JIT_OPTIONS)
def _mla_query_fma_kernel(
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
    K: tl.constexpr,
    N: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_LAYOUT: tl.constexpr,
    W_ALIGNED: tl.constexpr,
    IO_ALIGNED: tl.constexpr,
    MXFP8: tl.constexpr,
    OUT_FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,
    LOAD_FENCE: tl.constexpr,
):
    # The register path: the weight tile stays in the registers it is loaded into (threads
    # along its unit-stride axis), each of the BLOCK_M (<= 8) rows is a broadcast multiply and
    # a reduction over K. No tl.dot, so no shared-memory staging and no padding of M to 16.
    # The epilogues (RoPE copy, output store) repeat the tl.dot kernel's rather than share a
    # helper: written once as helpers they measured slower on the H200 (Triton 3.6 compiled the
    # moved address arithmetic differently), and the BF16 code here is kept token for token as
    # it was measured.
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = offs_k < K
    # K in NUM_K exact chunks of BLOCK_K (3 for K = 192, 2 for 128; the host checks it).
    NUM_K: tl.constexpr = K // BLOCK_K
    w_head = w_ptr + h.to(tl.int64) * stride_wh
    ws_head = ws_ptr + h.to(tl.int64) * stride_sh
    q_head = q_ptr + h.to(tl.int64) * stride_qh
    out_head = out_ptr + h.to(tl.int64) * stride_oh

    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M

    # Every load is issued before any loaded value is used: q rows, scales, weights.
    if not USE_PDL:
        qa0, qa1, qa2 = _fma_load_q(q_head, 0, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
        if BLOCK_M > 1:
            qb0, qb1, qb2 = _fma_load_q(q_head, 1, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
        if BLOCK_M > 2:
            qc0, qc1, qc2 = _fma_load_q(q_head, 2, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
            qd0, qd1, qd2 = _fma_load_q(q_head, 3, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
        if BLOCK_M > 4:
            qe0, qe1, qe2 = _fma_load_q(q_head, 4, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
            qf0, qf1, qf2 = _fma_load_q(q_head, 5, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
            qg0, qg1, qg2 = _fma_load_q(q_head, 6, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
            qh0, qh1, qh2 = _fma_load_q(q_head, 7, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
    if MXFP8:
        s0 = _load_scales(
            ws_head, offs_k, offs_n, k_mask, pid_n, stride_sk, stride_sn, BLOCK_N, False
        )
        s1 = _load_scales(
            ws_head + BLOCK_K * stride_sk, offs_k, offs_n, k_mask, pid_n, stride_sk, stride_sn,
            BLOCK_N, False,
        )  # fmt: skip
        if NUM_K > 2:
            s2 = _load_scales(
                ws_head + 2 * BLOCK_K * stride_sk, offs_k, offs_n, k_mask, pid_n, stride_sk,
                stride_sn, BLOCK_N, False,
            )  # fmt: skip
        else:
            s2 = 0
    else:
        s0 = 0
        s1 = 0
        s2 = 0
    r0 = _load_w(w_head, offs_k, offs_n, k_mask, stride_wk, stride_wn, W_LAYOUT, W_ALIGNED, False)
    r1 = _load_w(
        w_head + BLOCK_K * stride_wk, offs_k, offs_n, k_mask, stride_wk, stride_wn, W_LAYOUT,
        W_ALIGNED, False,
    )  # fmt: skip
    if NUM_K > 2:
        r2 = _load_w(
            w_head + 2 * BLOCK_K * stride_wk, offs_k, offs_n, k_mask, stride_wk, stride_wn,
            W_LAYOUT, W_ALIGNED, False,
        )  # fmt: skip
    else:
        r2 = r0
    if USE_PDL:
        # Weights depend on no earlier kernel; q, q_pe and out may (RAW and WAR).
        gdc_wait()
        gdc_launch_dependents()
        qa0, qa1, qa2 = _fma_load_q(q_head, 0, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
        if BLOCK_M > 1:
            qb0, qb1, qb2 = _fma_load_q(q_head, 1, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
        if BLOCK_M > 2:
            qc0, qc1, qc2 = _fma_load_q(q_head, 2, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
            qd0, qd1, qd2 = _fma_load_q(q_head, 3, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
        if BLOCK_M > 4:
            qe0, qe1, qe2 = _fma_load_q(q_head, 4, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
            qf0, qf1, qf2 = _fma_load_q(q_head, 5, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
            qg0, qg1, qg2 = _fma_load_q(q_head, 6, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
            qh0, qh1, qh2 = _fma_load_q(q_head, 7, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED, NUM_K)
    # The RoPE half, by the first N tile of each head (quantised for E4M3): its load is
    # predicated, not branched, and for E4M3 issued before q_scale's reciprocal. ptxas
    # schedules nothing across that reciprocal's slow-path call, and a load in a branch of its
    # own came after the q loads' first use: either way the load was issued only after an
    # earlier one had arrived, a second round trip (sm_90 SASS, 2026-12-01; test_sass.py).
    offs_r = tl.arange(0, R)
    pe_ptrs = qpe_ptr + offs_m[:, None].to(tl.int64) * stride_pm + h * stride_ph
    pe_ptrs = pe_ptrs + offs_r[None, :]
    pe_out = out_head + offs_m[:, None].to(tl.int64) * stride_om + N + offs_r[None, :]
    if IO_ALIGNED:
        pe_ptrs = tl.multiple_of(pe_ptrs, [16, 16])
        pe_out = tl.multiple_of(pe_out, [16, 16])
    # All M rows in the first N tile, none in the others.
    pe_mask = offs_m[:, None] < tl.where(pid_n == 0, M, 0)
    if OUT_FP8:
        # Padding rows load 1, not 0: dividing 0 (OUT_E4M3_DIV) takes div.rn's slow path.
        pe = tl.load(pe_ptrs, mask=pe_mask, other=1.0)
        q_scale = _e4m3_factor(qs_ptr, OUT_FP8)
        pe = _to_e4m3(pe.to(tl.float32), q_scale, out_ptr.dtype.element_ty, INTERPRET, OUT_FP8)
    else:
        pe = tl.load(pe_ptrs, mask=pe_mask, other=0.0)
        if LOAD_FENCE and not INTERPRET:
            # BF16 out has no reciprocal: the same fence, from a division that cannot change
            # the mask (M >= 1). Without it ptxas converted q before issuing this load.
            fence = tl.math.div_rn(tl.full([], 1.0, tl.float32), M.to(tl.float32))
            pe_mask = pe_mask & (fence > 0.0)
    tl.store(pe_out, pe, mask=pe_mask)

    # q in fp32, all rows, before the first use of the weights.
    qa0, qa1, qa2 = _fma_f32(qa0, qa1, qa2, NUM_K)
    if BLOCK_M > 1:
        qb0, qb1, qb2 = _fma_f32(qb0, qb1, qb2, NUM_K)
    if BLOCK_M > 2:
        qc0, qc1, qc2 = _fma_f32(qc0, qc1, qc2, NUM_K)
        qd0, qd1, qd2 = _fma_f32(qd0, qd1, qd2, NUM_K)
    if BLOCK_M > 4:
        qe0, qe1, qe2 = _fma_f32(qe0, qe1, qe2, NUM_K)
        qf0, qf1, qf2 = _fma_f32(qf0, qf1, qf2, NUM_K)
        qg0, qg1, qg2 = _fma_f32(qg0, qg1, qg2, NUM_K)
        qh0, qh1, qh2 = _fma_f32(qh0, qh1, qh2, NUM_K)
    w0 = _fma_weight(r0, s0, MXFP8)
    w1 = _fma_weight(r1, s1, MXFP8)
    if NUM_K > 2:  # noqa: SIM108 (a constexpr branch)
        w2 = _fma_weight(r2, s2, MXFP8)
    else:
        w2 = w0
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _fma_row(qa0, qa1, qa2, w0, w1, w2, acc, 0, offs_m, NUM_K)
    if BLOCK_M > 1:
        acc = _fma_row(qb0, qb1, qb2, w0, w1, w2, acc, 1, offs_m, NUM_K)
    if BLOCK_M > 2:
        acc = _fma_row(qc0, qc1, qc2, w0, w1, w2, acc, 2, offs_m, NUM_K)
        acc = _fma_row(qd0, qd1, qd2, w0, w1, w2, acc, 3, offs_m, NUM_K)
    if BLOCK_M > 4:
        acc = _fma_row(qe0, qe1, qe2, w0, w1, w2, acc, 4, offs_m, NUM_K)
        acc = _fma_row(qf0, qf1, qf2, w0, w1, w2, acc, 5, offs_m, NUM_K)
        acc = _fma_row(qg0, qg1, qg2, w0, w1, w2, acc, 6, offs_m, NUM_K)
        acc = _fma_row(qh0, qh1, qh2, w0, w1, w2, acc, 7, offs_m, NUM_K)
    # One store of all rows (one layout conversion of the result, not one per row).
    o_ptrs = out_head + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if IO_ALIGNED:
        o_ptrs = tl.multiple_of(o_ptrs, [16, 16])
    if OUT_FP8:
        # As the tl.dot kernel: bf16 rounding first (vLLM's staged path).
        y = _to_bf16(acc, INTERPRET).to(tl.float32)
        if OUT_FP8 == _OUT_E4M3_DIV:
            y = tl.where(m_mask[:, None], y, 1.0)
        y = _to_e4m3(y, q_scale, out_ptr.dtype.element_ty, INTERPRET, OUT_FP8)
        tl.store(o_ptrs, y, mask=m_mask[:, None])
    else:
        tl.store(o_ptrs, _to_bf16(acc, INTERPRET), mask=m_mask[:, None])
