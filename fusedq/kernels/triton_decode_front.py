"""The fused MLA decode front: RoPE, the absorbed query projection and the KV-cache write in
one Triton launch.

For every token ``m`` (position ``p = positions[m]``, cache slot ``s = slot_mapping[m]``) and
head ``h``::

    out[m, h, :512]     = q[m, h, :K] @ W[h, :K, :512]           (BF16 or E4M3 out)
    out[m, h, 512:576]  = rope(q[m, h, K:K + 64], p)             (BF16 or E4M3 out)
    cache[s // B, s % B] = [kv_c[m] | rope(k_pe[m], p)]          (s >= 0 only; BF16 or E4M3)

The grid is the tl.dot query kernel's, ``(N tiles, heads, M tiles)``, with one more column
of programs along N: ``pid_n < N_TILES`` are the query programs (triton_mla_query's loads,
dequantisation, MMA and epilogue, reused as its jit functions; the first N tile of each head
also rotates that head's q_pe, where the query kernel copies it), ``pid_n == N_TILES`` are
the cache programs: ``CACHE_M`` tokens each, so the cache write never lengthens a
weight-streaming CTA.

RoPE, as vLLM serves it under torch.compile (inductor loads bf16, computes in fp32 and rounds
once on store): with ``x1, x2`` a pair (neox: ``i, i + 32``; GPT-J: ``2i, 2i + 1``) and
``cos, sin`` the cache row's entries ``i`` and ``32 + i`` in fp32,
``o1 = x1 cos - x2 sin``, ``o2 = x2 cos + x1 sin``, each rounded once to bf16. The host
launches with ``enable_fp_fusion=False`` so that no multiply and add is contracted into an
FMA: the products are rounded as the staged reference's separate torch ops round them.

An fp8 cache stores ``E4M3(clamp(x / k_scale, ±448))`` of the bf16 value, the correctly
rounded division, as vLLM's ``concat_and_cache_mla`` (``fusedq.front_reference`` cites its
source).
"""

from __future__ import annotations

import triton
import triton.language as tl

from fusedq.kernels.common import JIT_OPTIONS, OUT_E4M3_DIV
from fusedq.kernels.triton_mla_query import (
    GEOMETRIES,
    _dot_chunks,
    _e4m3_factor,
    _load_q,
    _load_weight_chunks,
    _store_latent,
    _to_bf16,
    _to_e4m3,
)

__all__ = ["FRONT_JIT_OPTIONS", "GEOMETRIES", "_mla_decode_front_kernel"]

# The cache's E4M3 conversion divides by k_scale (vLLM's scaled_convert), correctly rounded:
# the query kernel's "div" epilogue mode, clamp and round-to-nearest-even included.
_DIVIDE = tl.constexpr(OUT_E4M3_DIV)

# The query kernel's specialisation rules, extended to this kernel's own integers and
# pointers: the compiled variant depends only on the host's key (front_launch.FrontKey).
FRONT_JIT_OPTIONS = dict(
    do_not_specialize=[
        *JIT_OPTIONS["do_not_specialize"],
        "stride_cm",
        "stride_km",
        "stride_pos",
        "stride_cs",
        "stride_slot",
        "stride_cb",
        "stride_ce",
        "block_size",
    ],
    do_not_specialize_on_alignment=[
        *JIT_OPTIONS["do_not_specialize_on_alignment"],
        "kvc_ptr",
        "kpe_ptr",
        "pos_ptr",
        "cs_ptr",
        "slot_ptr",
        "cache_ptr",
        "ks_ptr",
    ],
)


@triton.jit
def _rotate(
    rows, pos, cs_ptr, stride_cs, mask, HALF: tl.constexpr, NEOX: tl.constexpr,
    INTERPRET: tl.constexpr,
):  # fmt: skip
    # RoPE of [ROWS, 2 * HALF] bf16 rows (``rows``: a [ROWS, 1] pointer to each row's first
    # element) at positions ``pos``: the rotated pairs rounded once to bf16, and the columns
    # each half of a pair goes to.
    offs_i = tl.arange(0, HALF)
    if NEOX:
        i1 = offs_i
        i2 = offs_i + HALF
    else:
        i1 = 2 * offs_i
        i2 = 2 * offs_i + 1
    x1 = tl.load(rows + i1[None, :], mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(rows + i2[None, :], mask=mask, other=0.0).to(tl.float32)
    cs = cs_ptr + pos[:, None].to(tl.int64) * stride_cs + offs_i[None, :]
    cos = tl.load(cs, mask=mask, other=0.0).to(tl.float32)
    sin = tl.load(cs + HALF, mask=mask, other=0.0).to(tl.float32)
    o1 = _to_bf16(x1 * cos - x2 * sin, INTERPRET)
    o2 = _to_bf16(x2 * cos + x1 * sin, INTERPRET)
    return o1, o2, i1, i2


@triton.jit(**FRONT_JIT_OPTIONS)
def _mla_decode_front_kernel(
    q_ptr,
    qpe_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    qs_ptr,
    kvc_ptr,
    kpe_ptr,
    pos_ptr,
    cs_ptr,
    slot_ptr,
    cache_ptr,
    ks_ptr,
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
    stride_cm,
    stride_km,
    stride_pos,
    stride_cs,
    stride_slot,
    stride_cb,
    stride_ce,
    block_size,
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
    NEOX: tl.constexpr,
    CACHE_FP8: tl.constexpr,
    CACHE_M: tl.constexpr,
):
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    N_TILES: tl.constexpr = N // BLOCK_N
    HALF: tl.constexpr = R // 2
    # As the query kernel: up to 32 rows one CTA row covers M, larger blocks tile M over the
    # grid's third axis.
    M_TILED: tl.constexpr = BLOCK_M > 32
    if M_TILED:  # noqa: SIM108 (a constexpr branch)
        m0 = tl.program_id(2) * BLOCK_M
    else:
        m0 = 0
    if pid_n < N_TILES:
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_mask = offs_m < M
        k_mask = offs_k < K
        SINGLE: tl.constexpr = BLOCK_K >= K
        NUM_K: tl.constexpr = K // BLOCK_K
        # Every global load before the first use of a loaded value (the query kernel's
        # order: q, then the scales and weights).
        w_head = w_ptr + h.to(tl.int64) * stride_wh
        ws_head = ws_ptr + h.to(tl.int64) * stride_sh
        q_rows = q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + h * stride_qh
        q_rows = q_rows + offs_k[None, :]
        if IO_ALIGNED:
            q_rows = tl.multiple_of(q_rows, [16, 16])
        q0, q1, q2 = _load_q(q_rows, m_mask, k_mask, BLOCK_K, SINGLE, NUM_K)
        w0, w1, w2, s0, s1, s2 = _load_weight_chunks(
            w_head, ws_head, offs_k, offs_n, k_mask, pid_n, stride_wk, stride_wn, stride_sk,
            stride_sn, BLOCK_N, BLOCK_K, SINGLE, NUM_K, MXFP8, W_LAYOUT, W_ALIGNED,
        )  # fmt: skip
        if OUT_FP8:  # noqa: SIM108 (a constexpr branch)
            q_scale = _e4m3_factor(qs_ptr, OUT_FP8)
        else:
            q_scale = 0.0  # (no E4M3 epilogue: never read)
        if pid_n == 0:
            # The RoPE part: rotated in the CTA where the query kernel copies it.
            pos = tl.load(pos_ptr + offs_m.to(tl.int64) * stride_pos, mask=m_mask, other=0)
            pe_rows = qpe_ptr + offs_m[:, None].to(tl.int64) * stride_pm + h * stride_ph
            o1, o2, i1, i2 = _rotate(
                pe_rows, pos, cs_ptr, stride_cs, m_mask[:, None], HALF, NEOX, INTERPRET
            )
            pe_out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + h * stride_oh + N
            if OUT_FP8:
                # The rotated bf16 value, quantised as the query's concat-and-quantise does.
                ty = out_ptr.dtype.element_ty
                o1 = _to_e4m3(o1.to(tl.float32), q_scale, ty, INTERPRET, OUT_FP8)
                o2 = _to_e4m3(o2.to(tl.float32), q_scale, ty, INTERPRET, OUT_FP8)
            tl.store(pe_out + i1[None, :], o1, mask=m_mask[:, None])
            tl.store(pe_out + i2[None, :], o2, mask=m_mask[:, None])
        acc = _dot_chunks(
            q0, q1, q2, w0, w1, w2, s0, s1, s2, BLOCK_M, BLOCK_N, SINGLE, NUM_K, MXFP8,
            INTERPRET,
        )  # fmt: skip
        _store_latent(
            acc, out_ptr, offs_m, offs_n, m_mask, h, stride_om, stride_oh, q_scale, IO_ALIGNED,
            OUT_FP8, INTERPRET,
        )  # fmt: skip
    else:
        # A cache program: CACHE_M tokens of this M tile (CACHE_M * heads >= BLOCK_M).
        local = h * CACHE_M + tl.arange(0, CACHE_M)
        rows = m0 + local
        r_mask = (rows < M) & (local < BLOCK_M)
        slot = tl.load(slot_ptr + rows.to(tl.int64) * stride_slot, mask=r_mask, other=-1)
        # A negative slot is vLLM's padding: nothing is written for it.
        ok = r_mask & (slot >= 0)
        slot = tl.where(ok, slot, 0).to(tl.int64)
        entry = cache_ptr + (slot // block_size) * stride_cb + (slot % block_size) * stride_ce
        entry = entry[:, None]
        offs_c = tl.arange(0, N)
        kvc = tl.load(
            kvc_ptr + rows[:, None].to(tl.int64) * stride_cm + offs_c[None, :],
            mask=ok[:, None],
            other=0.0,
        )
        pos = tl.load(pos_ptr + rows.to(tl.int64) * stride_pos, mask=ok, other=0)
        kpe_rows = kpe_ptr + rows[:, None].to(tl.int64) * stride_km
        o1, o2, i1, i2 = _rotate(
            kpe_rows, pos, cs_ptr, stride_cs, ok[:, None], HALF, NEOX, INTERPRET
        )
        if CACHE_FP8:
            k_scale = tl.load(ks_ptr)
            ty = cache_ptr.dtype.element_ty
            kvc = _to_e4m3(kvc.to(tl.float32), k_scale, ty, INTERPRET, _DIVIDE)
            o1 = _to_e4m3(o1.to(tl.float32), k_scale, ty, INTERPRET, _DIVIDE)
            o2 = _to_e4m3(o2.to(tl.float32), k_scale, ty, INTERPRET, _DIVIDE)
        tl.store(entry + offs_c[None, :], kvc, mask=ok[:, None])
        tl.store(entry + N + i1[None, :], o1, mask=ok[:, None])
        tl.store(entry + N + i2[None, :], o2, mask=ok[:, None])
