"""The tiled read+store floor of ``fusedq-bench --floors`` (see ``bench.FLOOR_TILES``).

A module of its own because Triton resolves a kernel's helper functions among its module's
globals: the other floor kernels, which need none, stay beside their caller in ``bench``.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _load_tile(
    w_ptr, s_ptr, q_ptr, offs_k, offs_n, offs_m, m_mask, s_wk, s_sk, s_qm, s_cols,
    SCALES: tl.constexpr, SCALE_COLS: tl.constexpr,
):  # fmt: skip
    w = tl.load(w_ptr + offs_k[:, None] * s_wk + offs_n[None, :])
    q = tl.load(q_ptr + offs_m[:, None] * s_qm + offs_k[None, :], mask=m_mask[:, None], other=0)
    if SCALES:
        offs_s = s_cols + tl.arange(0, SCALE_COLS)
        sc = tl.load(s_ptr + offs_k[:, None] * s_sk + offs_s[None, :])
    else:
        sc = tl.zeros([1, 1], dtype=tl.int32)
    return w, q, sc


@triton.jit
def _fold(w, q, sc):
    # Every loaded word feeds the stored value, so no load can be dropped.
    x = tl.sum(w.to(tl.int32), axis=0) + tl.sum(tl.sum(q.to(tl.int32), axis=1), axis=0)
    return x + tl.sum(tl.sum(sc.to(tl.int32), axis=1), axis=0)


@triton.jit
def tile_kernel(
    w_ptr, s_ptr, q_ptr, pe_ptr, out_ptr, M,
    s_wh, s_wk, s_sh, s_sk, s_qm, s_qh, s_pm, s_ph, s_om, s_oh,
    CHUNK_K: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr, N: tl.constexpr, R: tl.constexpr, SCALES: tl.constexpr,
):  # fmt: skip
    """CTA (pid_n, h, ks): CHUNKS x CHUNK_K weight rows from ks * CHUNK_K * CHUNKS, BLOCK_N
    columns from pid_n * BLOCK_N; the integer sums of what it loaded into its output tile."""
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    ks = tl.program_id(2)
    offs_k = ks * CHUNK_K * CHUNKS + tl.arange(0, CHUNK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    w_head = w_ptr + h.to(tl.int64) * s_wh
    s_head = s_ptr + h.to(tl.int64) * s_sh
    q_head = q_ptr + h * s_qh
    SCALE_COLS: tl.constexpr = BLOCK_N // 32 if BLOCK_N >= 32 else 1
    s_cols = (pid_n * BLOCK_N) // 32
    # Every load issued before any use (as the fused kernels do): up to three K chunks.
    w0, q0, c0 = _load_tile(
        w_head, s_head, q_head, offs_k, offs_n, offs_m, m_mask, s_wk, s_sk, s_qm, s_cols,
        SCALES, SCALE_COLS,
    )  # fmt: skip
    if CHUNKS == 3:
        w1, q1, c1 = _load_tile(
            w_head, s_head, q_head, offs_k + CHUNK_K, offs_n, offs_m, m_mask, s_wk, s_sk, s_qm,
            s_cols, SCALES, SCALE_COLS,
        )  # fmt: skip
        w2, q2, c2 = _load_tile(
            w_head, s_head, q_head, offs_k + 2 * CHUNK_K, offs_n, offs_m, m_mask, s_wk, s_sk,
            s_qm, s_cols, SCALES, SCALE_COLS,
        )  # fmt: skip
        # pid_n is a runtime value and CHUNKS a constexpr: one `if` each.
        if pid_n == 0:
            offs_r = tl.arange(0, R)
            pe_rows = offs_m[:, None] * s_pm + h * s_ph + offs_r[None, :]
            pe = tl.load(pe_ptr + pe_rows, mask=m_mask[:, None], other=0)
            pe_out = out_ptr + offs_m[:, None] * s_om + h * s_oh + N + offs_r[None, :]
            tl.store(pe_out, pe.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])
    x = _fold(w0, q0, c0)
    if CHUNKS == 3:
        x += _fold(w1, q1, c1) + _fold(w2, q2, c2)
    o = out_ptr + offs_m[:, None] * s_om + h * s_oh + offs_n[None, :]
    y = x[None, :] + offs_m[:, None] * 0
    tl.store(o, y.to(out_ptr.dtype.element_ty), mask=m_mask[:, None])
