"""The floors: kernels that each do less than the fused one must, timed beside it (``--floors``).

What no single-launch version of the operation can beat in this harness (``empty``, ``read``),
and kernels that take apart where the rest of the fused kernel's time goes (``store_w*``,
``grid``, ``split_k``, ``view``, ``view_tma``); the steps that run them per layer are in
``fusedq_bench.harness``.
"""

from __future__ import annotations

from fusedq.contract import (
    GLM5,
    KV_LORA,
    Geometry,
)
from fusedq_bench.common import (
    RECIPES,
    out_dtype_of,
)

# --floors: int32 words per CTA of the read-only kernel (pow2; the grid follows from it).
FLOOR_READ_WORDS = (256, 512, 1024, 2048, 4096)
FLOOR_EMPTY_CTAS = 128
# The read+store floor: the read kernel's tiles that measured fastest at every shape, each CTA
# then storing its share of the layer's output bytes (M x H x QUERY_WIDTH),
# written with a value its loads produced, so the stores wait for the round trip as the fused
# kernel's do. What no single launch that reads the weights and writes the output can beat.
FLOOR_STORE_WORDS = (512, 1024)
_FLOOR_KERNELS = None


def _floor_kernels():
    import triton
    import triton.language as tl

    @triton.jit
    def read_kernel(src_ptr, sink_ptr, n_words, WORDS: tl.constexpr):
        # Every load of the CTA issued at once (one DRAM round trip), then folded into one
        # word so the loads cannot be dropped; n_words is specialised as a multiple of 16,
        # so the masked loads stay 16 bytes wide.
        pid = tl.program_id(0)
        offs = pid * WORDS + tl.arange(0, WORDS)
        x = tl.load(src_ptr + offs, mask=offs < n_words, other=0)
        tl.store(sink_ptr + pid, tl.sum(x, axis=0))

    @triton.jit
    def empty_kernel(sink_ptr):
        tl.store(sink_ptr + tl.program_id(0), tl.program_id(0))

    @triton.jit
    def read_store_kernel(
        src_ptr, dst_ptr, n_words, n_out, WORDS: tl.constexpr, OUT_WORDS: tl.constexpr
    ):
        # As read_kernel, then the CTA's OUT_WORDS of the output, each holding the sum.
        pid = tl.program_id(0)
        offs = pid * WORDS + tl.arange(0, WORDS)
        x = tl.load(src_ptr + offs, mask=offs < n_words, other=0)
        total = tl.sum(x, axis=0)
        o = pid * OUT_WORDS + tl.arange(0, OUT_WORDS)
        tl.store(dst_ptr + o, tl.zeros([OUT_WORDS], dtype=tl.int32) + total, mask=o < n_out)

    @triton.jit
    def grid_read_kernel(src_ptr, sink_ptr, n_words, per_cta, WORDS: tl.constexpr):
        # read_kernel over the fused kernel's grid: per_cta words (a multiple of 16) per CTA,
        # WORDS their power-of-two cover.
        pid = tl.program_id(0)
        idx = tl.arange(0, WORDS)
        offs = pid * per_cta + idx
        x = tl.load(src_ptr + offs, mask=(idx < per_cta) & (offs < n_words), other=0)
        tl.store(sink_ptr + pid, tl.sum(x, axis=0))

    @triton.jit
    def split_k_kernel(
        src_ptr, part_ptr, count_ptr, dst_ptr, n_words, n_out,
        WORDS: tl.constexpr, SPLIT: tl.constexpr, OUT_WORDS: tl.constexpr,
    ):  # fmt: skip
        # The read kernel's best grid, its CTAs in groups of SPLIT (the K slices of one output
        # tile): each adds its sum to the tile's partial and counts itself in; the last one
        # takes the total (and resets both for the next replay) and stores the tile's share of
        # the output. The least any split-K kernel adds: one atomic round trip to L2, then
        # one more for the partial.
        pid = tl.program_id(0)
        offs = pid * WORDS + tl.arange(0, WORDS)
        x = tl.load(src_ptr + offs, mask=offs < n_words, other=0)
        tile = pid // SPLIT
        tl.atomic_add(part_ptr + tile, tl.sum(x, axis=0), sem="relaxed")
        arrived = tl.atomic_add(count_ptr + tile, 1, sem="acq_rel")
        if arrived == SPLIT - 1:
            total = tl.atomic_xchg(part_ptr + tile, 0, sem="acq_rel")
            tl.atomic_xchg(count_ptr + tile, 0, sem="relaxed")
            o = tile * OUT_WORDS + tl.arange(0, OUT_WORDS)
            tl.store(dst_ptr + o, tl.zeros([OUT_WORDS], dtype=tl.int32) + total, mask=o < n_out)

    @triton.jit
    def view_read_kernel(
        w_ptr, s_ptr, sink_ptr, s_wh, s_wk, s_sh, s_sk,
        BLOCK_N: tl.constexpr, CHUNK_K: tl.constexpr, SCALES: tl.constexpr,
        SCALE_COLS: tl.constexpr, MX: tl.constexpr, NUM_K: tl.constexpr,
    ):  # fmt: skip
        # The fused kernel's CTA tile of the real weight view (head h, BLOCK_N columns from
        # pid_n * BLOCK_N, all NUM_K x CHUNK_K rows: 3 for GLM-5, 2 for DeepSeek-V3; MXFP8:
        # with its scales), loaded as the fused kernels load it (K chunks, every load issued
        # before any use), folded elementwise in the layout it arrives in, then into one word.
        pid_n = tl.program_id(0)
        h = tl.program_id(1)
        offs_k = tl.arange(0, CHUNK_K)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = w_ptr + h.to(tl.int64) * s_wh + offs_k[:, None] * s_wk + offs_n[None, :]
        w0 = tl.load(rows)
        w1 = tl.load(rows + CHUNK_K * s_wk)
        if NUM_K > 2:
            w2 = tl.load(rows + 2 * CHUNK_K * s_wk)
        if SCALES:
            offs_s = (pid_n * BLOCK_N) // MX + tl.arange(0, SCALE_COLS)
            srows = s_ptr + h.to(tl.int64) * s_sh + offs_k[:, None] * s_sk + offs_s[None, :]
            c0 = tl.load(srows)
            c1 = tl.load(srows + CHUNK_K * s_sk)
            if NUM_K > 2:
                c2 = tl.load(srows + 2 * CHUNK_K * s_sk)
        x = w0.to(tl.int32) + w1.to(tl.int32)
        if NUM_K > 2:
            x = x + w2.to(tl.int32)
        total = tl.sum(tl.sum(x, axis=1), axis=0)
        if SCALES:
            c = c0.to(tl.int32) + c1.to(tl.int32)
            if NUM_K > 2:
                c = c + c2.to(tl.int32)
            total += tl.sum(tl.sum(c, axis=1), axis=0)
        tl.store(sink_ptr + h * tl.num_programs(0) + pid_n, total)

    return (
        read_kernel, empty_kernel, read_store_kernel, grid_read_kernel, split_k_kernel,
        view_read_kernel,
    )  # fmt: skip


_TMA_FLOOR: tuple | None = None


def tma_floor_kernel():
    """(kernel, None) of the "view_tma" floor, or (None, why it cannot run here). It reads
    the fused kernel's tiles of the real weight view as the "view" floor does, but with TMA
    bulk copies (one per K chunk into shared memory, one mbarrier), then folds them as that
    floor does: the one way of reading W_UK_T in tiles the "view" floor does not bound."""
    global _TMA_FLOOR
    if _TMA_FLOOR is not None:
        return _TMA_FLOOR
    import torch

    from fusedq.kernels import gluon_mla_query
    from fusedq.kernels.common import interpreting

    if interpreting() or not torch.cuda.is_available():
        _TMA_FLOOR = (None, "TMA needs a CUDA GPU (not the interpreter)")
    elif torch.cuda.get_device_capability() < (9, 0):
        _TMA_FLOOR = (None, "TMA needs sm_90 or later")
    elif not gluon_mla_query.AVAILABLE:
        _TMA_FLOOR = (None, gluon_mla_query.UNAVAILABLE_REASON)
    else:
        try:
            _TMA_FLOOR = (_define_tma_floor_kernel(), None)
        except Exception as exc:  # an older Gluon without these names
            _TMA_FLOOR = (None, f"Gluon's Hopper TMA API: {type(exc).__name__}: {exc}")
    return _TMA_FLOOR


def _define_tma_floor_kernel():
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

    # Triton 3.6 (the H200's) names the bulk copy async_copy_global_to_shared; 3.9 async_load.
    tma_load = getattr(tma, "async_load", None) or tma.async_copy_global_to_shared

    @gluon.jit
    def view_tma_kernel(
        w_desc, s_ptr, sink_ptr, rows_per_head, s_sh, s_sk,
        BLOCK_N: gl.constexpr, CHUNK_K: gl.constexpr, SCALES: gl.constexpr,
        SCALE_COLS: gl.constexpr, MX: gl.constexpr, NUM_K: gl.constexpr,
    ):  # fmt: skip
        pid_n = gl.program_id(0)
        h = gl.program_id(1)
        num_warps: gl.constexpr = gl.num_warps()
        tiles = gl.allocate_shared_memory(w_desc.dtype, [NUM_K, CHUNK_K, BLOCK_N], w_desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        fence_async_shared()
        row = h * rows_per_head
        col = pid_n * BLOCK_N
        mbarrier.expect(bar, NUM_K * w_desc.block_type.nbytes)
        tma_load(w_desc, [row, col], bar, tiles.index(0))
        tma_load(w_desc, [row + CHUNK_K, col], bar, tiles.index(1))
        if NUM_K > 2:
            tma_load(w_desc, [row + 2 * CHUNK_K, col], bar, tiles.index(2))
        if SCALES:  # (1-2 bytes a row: below TMA's 16-byte minimum box; plain loads, issued
            # before the wait so they share the round trip)
            s_layout: gl.constexpr = gl.BlockedLayout(
                [1, SCALE_COLS], [32, 1], [num_warps, 1], [1, 0]
            )
            offs_k = gl.arange(0, CHUNK_K, layout=gl.SliceLayout(1, s_layout))
            offs_s = (pid_n * BLOCK_N) // MX + gl.arange(
                0, SCALE_COLS, layout=gl.SliceLayout(0, s_layout)
            )
            srows = s_ptr + h.to(gl.int64) * s_sh + offs_k[:, None] * s_sk + offs_s[None, :]
            c0 = gl.load(srows)
            c1 = gl.load(srows + CHUNK_K * s_sk)
            if NUM_K > 2:
                c2 = gl.load(srows + 2 * CHUNK_K * s_sk)
        mbarrier.wait(bar, 0)
        mbarrier.invalidate(bar)
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        x = tiles.index(0).load(layout).to(gl.int32) + tiles.index(1).load(layout).to(gl.int32)
        if NUM_K > 2:
            x = x + tiles.index(2).load(layout).to(gl.int32)
        total = gl.sum(gl.sum(x, axis=1), axis=0)
        if SCALES:
            c = c0.to(gl.int32) + c1.to(gl.int32)
            if NUM_K > 2:
                c = c + c2.to(gl.int32)
            total += gl.sum(gl.sum(c, axis=1), axis=0)
        gl.store(sink_ptr + h * gl.num_programs(0) + pid_n, total)

    return view_tma_kernel


def tma_weight_rows(values):
    """vLLM's W_UK_T view ``[H, qk_nope, 512]`` (rows of every head ``stride(0) // stride(1)``
    apart in one ``[rows, 512]`` matrix, as kv_b_proj's weight lays them out) as that 2-D
    matrix, up to the last head's last nope row: what a TMA descriptor can address."""
    import torch

    h, k, n = values.shape
    s_h, s_k, s_n = values.stride()
    if s_n != 1 or s_h % s_k:
        raise ValueError(f"strides {values.stride()}: not rows of one [rows, {n}] matrix")
    rows = (h - 1) * (s_h // s_k) + k
    return torch.as_strided(values, (rows, n), (s_k, 1)), s_h // s_k


def floor_kernel_set() -> tuple:
    """The floor kernels, defined (and Triton imported) on first use."""
    global _FLOOR_KERNELS
    if _FLOOR_KERNELS is None:
        _FLOOR_KERNELS = _floor_kernels()
    return _FLOOR_KERNELS


# Why the fused kernel stays above the read floor. The read floor's best grid has 2-4 KB per
# CTA (768-1536 CTAs), while one CTA of the fused kernel owns BLOCK_N output columns over the
# whole K (192 rows): 6-24 KB, H x 512 / BLOCK_N CTAs, reading BLOCK_N-wide segments of
# W_UK_T's 1 KB rows. Three floors take those apart:
# "grid": the read kernel on the fused kernel's own grid (its CTA count, the layer's bytes
# shared evenly); "split_k": the read kernel's best grid, its CTAs in K groups of
# FLOOR_SPLIT_K, joined with the least a split-K kernel must add (see split_k_kernel);
# "view": the fused kernel's own tiles of the real weight view (vLLM's W_UK_T: BLOCK_N-wide
# segments of 1 KB rows), read as it reads them, with no math (see view_read_kernel).
FLOOR_SPLIT_WORDS = 512
FLOOR_SPLIT_K = 6
# The floors measured beside the read floor (the row keys of their best variants' times).
# "view_tma": the "view" floor's tiles read by TMA bulk copies (GPU only, sm_90+).
# In groups a run has or lacks together (older runs lack the later ones): a table shows a
# group's columns where its first floor was measured.
FLOOR_GROUPS = (("store",), ("grid", "split_k", "view"), ("view_tma",))
FLOOR_KINDS = tuple(kind for group in FLOOR_GROUPS for kind in group)
# How the tables name them.
FLOOR_TITLES = {
    "store": "read+store", "grid": "grid", "split_k": "split-K", "view": "view",
    "view_tma": "TMA view",
}  # fmt: skip


def fused_grid_ctas(fmt: str, h: int, m: int, geometry: Geometry = GLM5) -> int:
    """How many CTAs the fused kernel the product picks launches for one layer (a grid of
    (512 / BLOCK_N, H))."""
    return h * (KV_LORA // fused_block_n(fmt, h, m, geometry))


def fused_block_n(fmt: str, h: int, m: int, geometry: Geometry = GLM5) -> int:
    """The output columns per CTA of the fused kernel the product picks (the CuTe kernel's:
    its MX block), or the Triton kernels' past the qualified shapes."""
    from fusedq.kernels import cute_mla_query
    from fusedq.selection import select

    weight_format, out_fp8 = RECIPES[fmt]
    chosen = select(
        h, m, geometry=geometry, weight_format=weight_format, out_dtype=out_dtype_of(out_fp8)
    )
    if chosen.path == "staged":  # unqualified: the bench times backend="triton"
        chosen = select(
            h, m, geometry=geometry, weight_format=weight_format,
            out_dtype=out_dtype_of(out_fp8), qualified=False,
        )  # fmt: skip
    if chosen.path == "cute":
        return cute_mla_query.BLOCK_N
    return chosen.config.block_n


def add_floor_ratios(row: dict) -> None:
    """``read_us``: the fastest read-only variant; and the floors as fractions of staged."""
    reads = {f"read_w{w}": row[f"read_w{w}_us"] for w in FLOOR_READ_WORDS}
    best = min(reads, key=reads.get)
    row["read_us"] = reads[best]
    row["read_variant"] = best
    row["read_over_staged"] = row["read_us"] / row["staged_us"]
    row["empty_over_staged"] = row["empty_us"] / row["staged_us"]
    row["fused_over_read"] = row["fused_us"] / row["read_us"]
    stores = {
        f"store_w{w}": row[f"store_w{w}_us"] for w in FLOOR_STORE_WORDS if f"store_w{w}_us" in row
    }
    if stores:  # runs before the read+store floor existed lack it
        best = min(stores, key=stores.get)
        row["store_us"], row["store_variant"] = stores[best], best
        row["fused_over_store"] = row["fused_us"] / row["store_us"]
    for name in FLOOR_KINDS[1:]:  # and before these floors existed
        if f"{name}_us" in row:
            row[f"{name}_over_read"] = row[f"{name}_us"] / row["read_us"]
            row[f"fused_over_{name}"] = row["fused_us"] / row[f"{name}_us"]
