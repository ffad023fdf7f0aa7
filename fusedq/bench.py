"""``fusedq-bench``: the fused kernel against vLLM's staged path, in CUDA-graph replay.

For each (format, H, M) four graphs are captured, each holding one call per layer with the
weights rotated over enough layers to exceed ``--l2-factor`` x L2 (so every call reads its
weight from HBM, as in a real forward pass):

- ``fused``: ``mla_query_projection`` (one launch per layer);
- ``staged``: vLLM 0.32's staged block (``reference.staged``, form "bmm+cat"): ``torch.bmm`` on
  the strided ``W_UK_T`` view, then ``torch.cat`` with ``q_pe`` (BF16 out), or ``bmm`` + a
  one-kernel concat-and-quantise, as vLLM's op (E4M3 out);
- ``bmm``: vLLM 0.26's FLASH_ATTN_MLA form (form "bmm"): the ``torch.bmm`` alone, since that
  backend takes the (nope, pe) pair. What the served vLLM runs for BF16 output; each row names
  its ``served_baseline`` (``reference.SERVED_FORM``);
- ``copy``: a device copy of exactly the weight bytes of each layer, the physical anchor.

The staged baselines of MXFP8 are the BF16 staged path's.

Replays are interleaved ABBA-style, each timed with CUDA events; the figure is the median
replay divided by the number of layers.

``--chain`` puts each call where vLLM has it: after the ``q_b_proj`` GEMM that writes ``q``
and an elementwise KV-cache write (``concat_and_cache_mla``'s shape), neither of which lets
dependents start early. A fourth graph holds only those predecessors, and every figure is
the increment over it: what the query step adds to a decode layer. It also times the fused
kernel with programmatic dependent launch (``fused_pdl``), so PDL is judged behind the
kernels it would really follow, not behind itself. ``--sweep`` times launch-config variants of the
fused kernel instead, to pick the heuristic.

``--floors`` adds, in the same ABBA set, what no single-launch version of the operation can
beat in this harness: ``empty`` (a kernel node that stores one word per CTA and loads nothing:
the graph's per-launch cost) and ``read`` (one launch that only reads the layer's weight bytes,
contiguous, 16-byte vectors, every load issued before any use; the fastest of five tile sizes
``read_w{256,...,4096}``, each timed). ``read / staged`` is the lowest fused/staged ratio any
one-launch kernel could show, since the fused kernel must at least read those bytes. Beside
them, kernels that each do less than the fused one must, to say where the rest goes:
``store_w*`` (the reads, then the output bytes written), ``grid`` (the read kernel on the fused
kernel's own CTA count), ``split_k`` (the read floor's grid joined over K by atomics),
``view`` (the fused kernel's own tiles of the real weight view, no math) and, on sm_90+ with
Gluon, ``view_tma`` (those tiles read by TMA bulk copies); see FLOOR_SPLIT_K.

``--eager`` measures something else: host time per call outside graphs (``bench_eager``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence

from fusedq import provenance
from fusedq.bench_common import (
    FORMATS,
    RECIPES,
    NvidiaSmiError,
    abba_order,
    md_table,
    nvidia_smi,
    out_dtype_of,
)
from fusedq.kernels.common import BLOCK_K
from fusedq.kernels.triton_mla_query import SINGLE_BLOCK_K
from fusedq.limits import (
    E4M3_MAX,
    KV_LORA,
    MX_BLOCK,
    QK_NOPE,
    QK_ROPE,
    QUALIFIED_HEADS,
    QUERY_WIDTH,
    V_HEAD,
)

# H200 L2 is 60 MB; rotating over 2x that keeps every layer's weight out of L2.
DEFAULT_L2_MB = 60.0
# The staged baselines' row keys and titles (reference.STAGED_FORMS): "staged_us" is vLLM
# 0.32's bmm + cat, the key it had before the bmm-only baseline was added beside it.
SERVED_KEYS = {"bmm+cat": "staged_us", "bmm": "bmm_us"}
BASELINE_TITLES = {"bmm+cat": "bmm+cat", "bmm": "bmm-only"}
SERVED_NOTE = (
    "served vLLM (0.26): BF16 output runs FLASH_ATTN_MLA, which takes the (nope, pe) pair: "
    "the bmm alone, so fused/bmm-only is its figure; E4M3 output (no FP8 in FLASH_ATTN_MLA) "
    "runs bmm + concat-quantise: fused/bmm+cat."
)
# The targets the kernel was built to (fused / staged, fused / copy), per format.
TARGETS = {
    "bf16": (0.40, 1.3), "mxfp8": (0.35, None), "e4m3": (None, None), "mxfp8-e4m3": (None, None)
}  # fmt: skip


@dataclasses.dataclass(frozen=True)
class Options:
    heads: tuple[int, ...] = QUALIFIED_HEADS
    ms: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    formats: tuple[str, ...] = FORMATS
    samples: int = 1000
    warmup: int = 20
    l2_mb: float = DEFAULT_L2_MB
    l2_factor: float = 2.0
    q_scale: float = 0.02
    chain: bool = False
    sweep: bool = False
    sweep_block_n: tuple[int, ...] = (16, 32, 64)
    sweep_warps: tuple[int, ...] = (4, 8)
    sweep_block_k: tuple[int, ...] = (BLOCK_K, SINGLE_BLOCK_K)
    sweep_pdl: tuple[int, ...] = (0,)
    # Register-path (no tl.dot) variants "BLOCK_N:WARPS", for M <= 8, any output; and those
    # of them to time with PDL as well.
    sweep_fma: tuple[str, ...] = ()
    sweep_fma_pdl: tuple[str, ...] = ()
    # The CuTe DSL MXFP8 kernel (cute_mla_query) as one more sweep variant, "cute".
    sweep_cute: bool = False
    # Gluon-kernel variants "BLOCK_N:WARPS[:BLOCK_M]" (BLOCK_M defaults to the tl.dot path's
    # padded row count, 16 or 32), any M <= 32, any output.
    sweep_gluon: tuple[str, ...] = ()
    # Each of those with each of these operand paths (gluon_mla_query.OPERANDS).
    sweep_gluon_operands: tuple[str, ...] = ("convert", "smem", "direct")
    # E4M3 formats: each variant again as "<name>_<epilogue>" for each of these epilogues
    # (LaunchConfig.e4m3_epilogue): "mul" and "wide" (the product's two stores), "div" (an IEEE
    # division per element, before 2026-12-01), "noscale" (no q_scale: wrong output by design).
    sweep_e4m3: tuple[str, ...] = ()
    # BF16 formats: each Gluon and register-path variant again with its scheduling fence after
    # the loads flipped (LaunchConfig.load_fence), as "<name>_fence" or "<name>_nofence".
    sweep_fence: bool = False
    floors: bool = False
    # --eager: host time per call outside graphs (bench_eager), calls per run, runs per path.
    eager: bool = False
    eager_calls: int = 2000
    eager_repeats: int = 5
    commit: str | None = None


def _layers(bytes_per_layer: int, opts: Options) -> int:
    return max(2, math.ceil(opts.l2_factor * opts.l2_mb * 1e6 / bytes_per_layer))


def time_graphs(graphs: dict, samples: int, warmup: int) -> dict[str, list[float]]:
    """Replay every graph ``samples`` times, ABBA-interleaved; ms per replay, per graph."""
    import torch

    names = list(graphs)
    for name in abba_order(names, warmup):
        graphs[name].replay()
    torch.cuda.synchronize()
    order = abba_order(names, samples)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in order
    ]
    for name, (start, end) in zip(order, events, strict=True):
        start.record()
        graphs[name].replay()
        end.record()
    torch.cuda.synchronize()
    out: dict[str, list[float]] = {n: [] for n in names}
    for name, (start, end) in zip(order, events, strict=True):
        out[name].append(start.elapsed_time(end))
    return out


def _capture(fn: Callable[[], None]):
    import torch

    fn()  # eager warm-up: allocator pools, cuBLAS handles, kernel compiles
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    torch.cuda.synchronize()
    return graph


def _concat_quant_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def kernel(
        ql_ptr, pe_ptr, out_ptr, qs_ptr, H, s_qm, s_qh, s_pm, s_ph, s_om, s_oh,
        N: tl.constexpr, R: tl.constexpr, QMAX: tl.constexpr,
    ):  # fmt: skip
        # One program per (token, head) row, as vLLM's concat-and-quantise decode op does.
        row = tl.program_id(0)
        m = row // H
        h = row % H
        # vLLM's static_scaled_fp8_quant: 1 / scale once (IEEE), then a multiply per element.
        inv = tl.math.div_rn(tl.full([], 1.0, tl.float32), tl.load(qs_ptr))
        offs = tl.arange(0, N)
        x = tl.load(ql_ptr + m * s_qm + h * s_qh + offs).to(tl.float32)
        x = tl.minimum(tl.maximum(x * inv, -QMAX), QMAX)
        tl.store(out_ptr + m * s_om + h * s_oh + offs, x.to(out_ptr.dtype.element_ty))
        offs_r = tl.arange(0, R)
        r = tl.load(pe_ptr + m * s_pm + h * s_ph + offs_r).to(tl.float32)
        r = tl.minimum(tl.maximum(r * inv, -QMAX), QMAX)
        tl.store(out_ptr + m * s_om + h * s_oh + N + offs_r, r.to(out_ptr.dtype.element_ty))

    return kernel


_CONCAT_QUANT = None


def concat_quant_kernel(ql_nope, q_pe, q_scale, out) -> None:
    """E4M3's concat and quantisation in one launch, as vLLM's op runs it on a GPU (the staged
    baseline's ``concat_quant``; the reference's torch ops take several launches)."""
    global _CONCAT_QUANT
    if _CONCAT_QUANT is None:
        _CONCAT_QUANT = _concat_quant_kernel()
    m, h, _ = ql_nope.shape
    _CONCAT_QUANT[(m * h,)](
        ql_nope, q_pe, out, q_scale, h,
        ql_nope.stride(0), ql_nope.stride(1), q_pe.stride(0), q_pe.stride(1),
        out.stride(0), out.stride(1), N=KV_LORA, R=QK_ROPE, QMAX=E4M3_MAX,
    )  # fmt: skip


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
        SCALE_COLS: tl.constexpr, MX: tl.constexpr,
    ):  # fmt: skip
        # The fused kernel's CTA tile of the real weight view (head h, BLOCK_N columns from
        # pid_n * BLOCK_N, all 3 x CHUNK_K rows; MXFP8: with its scales), loaded as the fused
        # kernels load it (three K chunks, every load issued before any use), folded
        # elementwise in the layout it arrives in, then into one word.
        pid_n = tl.program_id(0)
        h = tl.program_id(1)
        offs_k = tl.arange(0, CHUNK_K)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rows = w_ptr + h.to(tl.int64) * s_wh + offs_k[:, None] * s_wk + offs_n[None, :]
        w0 = tl.load(rows)
        w1 = tl.load(rows + CHUNK_K * s_wk)
        w2 = tl.load(rows + 2 * CHUNK_K * s_wk)
        if SCALES:
            offs_s = (pid_n * BLOCK_N) // MX + tl.arange(0, SCALE_COLS)
            srows = s_ptr + h.to(tl.int64) * s_sh + offs_k[:, None] * s_sk + offs_s[None, :]
            c0 = tl.load(srows)
            c1 = tl.load(srows + CHUNK_K * s_sk)
            c2 = tl.load(srows + 2 * CHUNK_K * s_sk)
        x = w0.to(tl.int32) + w1.to(tl.int32) + w2.to(tl.int32)
        total = tl.sum(tl.sum(x, axis=1), axis=0)
        if SCALES:
            c = c0.to(tl.int32) + c1.to(tl.int32) + c2.to(tl.int32)
            total += tl.sum(tl.sum(c, axis=1), axis=0)
        tl.store(sink_ptr + h * tl.num_programs(0) + pid_n, total)

    return (
        read_kernel, empty_kernel, read_store_kernel, grid_read_kernel, split_k_kernel,
        view_read_kernel,
    )  # fmt: skip


_TMA_FLOOR: tuple | None = None


def _tma_floor_kernel():
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
        SCALE_COLS: gl.constexpr, MX: gl.constexpr,
    ):  # fmt: skip
        pid_n = gl.program_id(0)
        h = gl.program_id(1)
        num_warps: gl.constexpr = gl.num_warps()
        tiles = gl.allocate_shared_memory(w_desc.dtype, [3, CHUNK_K, BLOCK_N], w_desc.layout)
        bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        mbarrier.init(bar, count=1)
        fence_async_shared()
        row = h * rows_per_head
        col = pid_n * BLOCK_N
        mbarrier.expect(bar, 3 * w_desc.block_type.nbytes)
        tma_load(w_desc, [row, col], bar, tiles.index(0))
        tma_load(w_desc, [row + CHUNK_K, col], bar, tiles.index(1))
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
            c2 = gl.load(srows + 2 * CHUNK_K * s_sk)
        mbarrier.wait(bar, 0)
        mbarrier.invalidate(bar)
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])
        x = tiles.index(0).load(layout).to(gl.int32) + tiles.index(1).load(layout).to(gl.int32)
        x = x + tiles.index(2).load(layout).to(gl.int32)
        total = gl.sum(gl.sum(x, axis=1), axis=0)
        if SCALES:
            c = c0.to(gl.int32) + c1.to(gl.int32) + c2.to(gl.int32)
            total += gl.sum(gl.sum(c, axis=1), axis=0)
        gl.store(sink_ptr + h * gl.num_programs(0) + pid_n, total)

    return view_tma_kernel


def tma_weight_rows(values):
    """vLLM's W_UK_T view ``[H, 192, 512]`` (rows of every head ``stride(0) // stride(1)``
    apart in one ``[rows, 512]`` matrix, as kv_b_proj's weight lays them out) as that 2-D
    matrix, up to the last head's 192nd row: what a TMA descriptor can address."""
    import torch

    h, k, n = values.shape
    s_h, s_k, s_n = values.stride()
    if s_n != 1 or s_h % s_k:
        raise ValueError(f"strides {values.stride()}: not rows of one [rows, {n}] matrix")
    rows = (h - 1) * (s_h // s_k) + k
    return torch.as_strided(values, (rows, n), (s_k, 1)), s_h // s_k


def _floor_kernel_set() -> tuple:
    """The floor kernels, defined (and Triton imported) on first use."""
    global _FLOOR_KERNELS
    if _FLOOR_KERNELS is None:
        _FLOOR_KERNELS = _floor_kernels()
    return _FLOOR_KERNELS


def _floor_steps(lay: Layers) -> dict[str, Callable[[int], None]]:
    """The floor kernels for each layer: the empty node, the read-only kernel per tile, and the
    read+store kernel per tile."""
    import torch
    import triton

    read_kernel, empty_kernel, read_store_kernel = _floor_kernel_set()[:3]
    words = [src.view(torch.int32) for src in lay.copy_src]
    n_words = words[0].numel()
    sink = lay.floor_sink

    def read(block: int) -> Callable[[int], None]:
        grid = (-(-n_words // block),)
        return lambda i: read_kernel[grid](words[i], sink, n_words, WORDS=block, num_warps=4)

    dst = lay.floor_out
    n_out = dst.numel()

    def read_store(block: int) -> Callable[[int], None]:
        grid = (-(-n_words // block),)
        out_words = max(16, triton.next_power_of_2(-(-n_out // grid[0])))
        return lambda i: read_store_kernel[grid](
            words[i], dst, n_words, n_out, WORDS=block, OUT_WORDS=out_words, num_warps=4
        )

    steps = {f"read_w{w}": read(w) for w in FLOOR_READ_WORDS}
    steps["empty"] = lambda i: empty_kernel[(FLOOR_EMPTY_CTAS,)](sink, num_warps=4)
    steps.update({f"store_w{w}": read_store(w) for w in FLOOR_STORE_WORDS})
    return steps


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


def fused_grid_ctas(fmt: str, h: int, m: int) -> int:
    """How many CTAs the fused kernel the product picks launches for one layer (a grid of
    (512 / BLOCK_N, H))."""
    return h * (KV_LORA // fused_block_n(fmt, h, m))


def fused_block_n(fmt: str, h: int, m: int) -> int:
    """The output columns per CTA of the fused kernel the product picks (the CuTe kernel's:
    its MX block)."""
    from fusedq.kernels import cute_mla_query
    from fusedq.selection import select

    weight_format, out_fp8 = RECIPES[fmt]
    chosen = select(h, m, weight_format=weight_format, out_dtype=out_dtype_of(out_fp8))
    if chosen.path == "cute":
        return cute_mla_query.BLOCK_N
    return chosen.config.block_n


def _grid_floor_steps(lay: Layers, fmt: str) -> dict[str, Callable[[int], None]]:
    """The "grid", "split_k" and "view" floors for each layer (see FLOOR_SPLIT_K)."""
    import torch
    import triton

    grid_read_kernel, split_k_kernel, view_read_kernel = _floor_kernel_set()[3:]
    words = [src.view(torch.int32) for src in lay.copy_src]
    n_words = words[0].numel()
    m, h = lay.q_nope.shape[0], lay.q_nope.shape[1]
    block_n = fused_block_n(fmt, h, m)
    ctas = h * (KV_LORA // block_n)
    per_cta = -(-n_words // ctas // 16) * 16
    cover = triton.next_power_of_2(per_cta)
    sink, dst = lay.floor_sink, lay.floor_out
    n_out = dst.numel()
    tiles = -(-n_words // (FLOOR_SPLIT_WORDS * FLOOR_SPLIT_K))
    out_words = max(16, triton.next_power_of_2(-(-n_out // tiles)))

    def grid(i: int) -> None:
        grid_read_kernel[(ctas,)](
            words[i], sink, n_words, per_cta, WORDS=cover, num_warps=4 if cover <= 2048 else 8
        )

    def split_k(i: int) -> None:
        split_k_kernel[(tiles * FLOOR_SPLIT_K,)](
            words[i], lay.floor_part, lay.floor_count, dst, n_words, n_out,
            WORDS=FLOOR_SPLIT_WORDS, SPLIT=FLOOR_SPLIT_K, OUT_WORDS=out_words, num_warps=4,
        )  # fmt: skip

    ws = [(w.values, w.scales) if hasattr(w, "scales") else (w, None) for w in lay.fused_w]
    values = [v.view({2: torch.int16, 1: torch.uint8}[v.element_size()]) for v, _ in ws]
    scales = [values[i] if sc is None else sc for i, (_, sc) in enumerate(ws)]
    v0, s0 = values[0], scales[0]
    view_meta = dict(
        BLOCK_N=block_n, CHUNK_K=BLOCK_K, SCALES=ws[0][1] is not None,
        SCALE_COLS=max(1, block_n // MX_BLOCK), MX=MX_BLOCK, num_warps=4 if block_n <= 32 else 8,
    )  # fmt: skip

    def view(i: int) -> None:
        view_read_kernel[(KV_LORA // block_n, h)](
            values[i], scales[i], sink, v0.stride(0), v0.stride(1), s0.stride(0), s0.stride(1),
            **view_meta,
        )  # fmt: skip

    steps = {"grid": grid, "split_k": split_k, "view": view}
    tma_kernel, why = _tma_floor_kernel()
    if tma_kernel is None:
        if why not in _TMA_SAID:
            _TMA_SAID.add(why)
            print(f"floors: no view_tma floor: {why}", flush=True)
        return steps
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    chunk_k = view_meta["CHUNK_K"]
    shared = gl.NVMMASharedLayout.get_default_for(
        [chunk_k, block_n], gl.int16 if v0.element_size() == 2 else gl.uint8
    )
    mats = [tma_weight_rows(v) for v in values]
    descs = [TensorDescriptor.from_tensor(mat, [chunk_k, block_n], shared) for mat, _ in mats]
    rows_per_head = mats[0][1]

    def view_tma(i: int) -> None:
        tma_kernel[(KV_LORA // block_n, h)](
            descs[i], scales[i], sink, rows_per_head, s0.stride(0), s0.stride(1), **view_meta
        )

    steps["view_tma"] = view_tma
    return steps


_TMA_SAID: set[str] = set()


@dataclasses.dataclass
class Layers:
    """Per-layer weights (rotated) and the shared activations of one (format, H, M)."""

    staged_w: list
    fused_w: list
    copy_src: list
    copy_dst: list
    q_nope: object
    q_pe: object
    out: object
    q_scale: object
    out_dtype: object
    weight_bytes: int
    floor_sink: object = None
    # The read+store floor's output: as many int32 words as the layer's out has bytes / 4.
    floor_out: object = None
    # The split-K floor's partial sums and arrival counts, one per output tile (zeros).
    floor_part: object = None
    floor_count: object = None


def build_layers(fmt: str, h: int, m: int, opts: Options) -> Layers:
    import torch

    import fusedq

    dev = torch.device("cuda")
    bf16_bytes = h * QK_NOPE * KV_LORA * 2
    mxfp8_bytes = h * QK_NOPE * KV_LORA + h * QK_NOPE * (KV_LORA // MX_BLOCK)
    weight_format, out_fp8 = RECIPES[fmt]
    fused_bytes = mxfp8_bytes if weight_format == "mxfp8" else bf16_bytes
    n_layers = _layers(min(bf16_bytes, fused_bytes), opts)
    staged_w, fused_w, copy_src, copy_dst = [], [], [], []
    for _ in range(n_layers):
        # vLLM's W_UK_T: kv_b_proj.weight.T viewed [H, P+V, L], sliced to the P rows.
        base = torch.randn(h, QK_NOPE + V_HEAD, KV_LORA, device=dev, dtype=torch.bfloat16) * 0.05
        w = base[:, :QK_NOPE, :]
        staged_w.append(w)
        fused_w.append(fusedq.quantize_mxfp8(w) if weight_format == "mxfp8" else w)
        copy_src.append(torch.empty(fused_bytes, dtype=torch.uint8, device=dev))
        copy_dst.append(torch.empty(fused_bytes, dtype=torch.uint8, device=dev))
    q = torch.randn(m, h, QK_NOPE + QK_ROPE, device=dev, dtype=torch.bfloat16)
    out_dtype = out_dtype_of(out_fp8)
    q_scale = torch.tensor([opts.q_scale], device=dev) if out_fp8 else None
    out = torch.empty(m, h, QUERY_WIDTH, device=dev, dtype=out_dtype)
    # Random bytes for the floor kernels too: never time on zeros.
    for src in copy_src:
        src.copy_(torch.randint(0, 256, src.shape, dtype=torch.uint8, device=dev))
    ctas = -(-fused_bytes // (4 * min(FLOOR_READ_WORDS)))
    sink = torch.empty(max(FLOOR_EMPTY_CTAS, ctas), dtype=torch.int32, device=dev)
    floor_out = torch.empty(
        -(-out.numel() * out.element_size() // 4), dtype=torch.int32, device=dev
    )
    tiles = -(-fused_bytes // (4 * FLOOR_SPLIT_WORDS * FLOOR_SPLIT_K))
    return Layers(
        staged_w, fused_w, copy_src, copy_dst, q[..., :QK_NOPE], q[..., QK_NOPE:], out, q_scale,
        out_dtype, fused_bytes, sink, floor_out,
        torch.zeros(tiles, dtype=torch.int32, device=dev),
        torch.zeros(tiles, dtype=torch.int32, device=dev),
    )  # fmt: skip


def _fused_step(lay: Layers, config=None, backend: str = "auto") -> Callable[[int], None]:
    """Layer i's fused call: the public op (``backend``: "auto" is the product's own choice of
    kernel, "triton"/"cute" that kernel), or the Triton kernel launched with ``config``."""
    import fusedq
    from fusedq.kernels import triton_launch

    def step(i: int) -> None:
        w = lay.fused_w[i]
        if config is None:
            fusedq.mla_query_projection(
                lay.q_nope, w, lay.q_pe, out=lay.out, out_dtype=lay.out_dtype,
                q_scale=lay.q_scale, backend=backend,
            )  # fmt: skip
        else:
            values, scales = (w.values, w.scales) if hasattr(w, "scales") else (w, None)
            triton_launch.launch(
                lay.q_nope, values, scales, lay.q_pe, lay.out, lay.q_scale, config=config
            )

    return step


def _kernel_steps(lay: Layers, fmt: str) -> dict[str, Callable[[int], None]]:
    """Each fused kernel that can run this format, forced, beside the "auto" choice: so one
    run shows what the choice picked and what it passed over (MXFP8: Triton and, where
    nvidia-cutlass-dsl is installed, CuTe)."""
    import fusedq

    m, h = lay.q_nope.shape[0], lay.q_nope.shape[1]
    weight_format = RECIPES[fmt][0]
    path, why = fusedq.kernel_choice(
        h, m, weight_format=weight_format, out_dtype=lay.out_dtype, device=lay.q_nope.device
    )
    if path == "staged":
        raise RuntimeError(f"{fmt} H={h} M={m}: the fused kernel cannot run here: {why}")
    cute, _ = cute_step(lay, fmt)
    if cute is None:
        return {}
    return {"triton": _fused_step(lay, backend="triton"), "cute": cute}


def _staged_step(lay: Layers, form: str = "bmm+cat") -> Callable[[int], None]:
    """Layer i's staged block in one of ``reference.STAGED_FORMS``, on the BF16 weight, with
    E4M3's concat and quantisation in one launch as vLLM runs it."""
    from fusedq.reference import staged

    return lambda i: staged(
        lay.q_nope, lay.staged_w[i], None, lay.q_pe, None, lay.q_scale, form=form,
        concat_quant=concat_quant_kernel,
    )  # fmt: skip


def _copy_step(lay: Layers) -> Callable[[int], None]:
    return lambda i: lay.copy_dst[i].copy_(lay.copy_src[i])


def _every_layer(lay: Layers, step: Callable[[int], None]) -> Callable[[], None]:
    """What one graph holds: `step` for every layer, in order."""

    def fn() -> None:
        for i in range(len(lay.fused_w)):
            step(i)

    return fn


def _max_error(lay: Layers) -> float:
    """Max |fused - staged| of the last layer's output, after the timed replays."""
    import fusedq

    ref = fusedq.staged_mla_query(
        lay.q_nope, lay.fused_w[-1], lay.q_pe, out_dtype=lay.out_dtype, q_scale=lay.q_scale
    )
    return float((lay.out.float() - ref.float()).abs().max())


def _graph_error(lay: Layers, graph) -> float:
    """``_max_error`` of one graph's own output: ``out`` poisoned, that graph replayed alone."""
    import torch

    lay.out.fill_(float("nan") if lay.out.dtype == torch.bfloat16 else 0)
    graph.replay()
    torch.cuda.synchronize()
    return _max_error(lay)


def _median_us(ms: list[float], n_layers: int) -> float:
    return statistics.median(ms) * 1000.0 / n_layers


# --chain: vLLM's q_lora_rank (DeepSeek-V3 / GLM-5): q_b_proj maps 1536 -> H * 256.
Q_LORA_RANK = 1536


@dataclasses.dataclass
class Producers:
    """The predecessors' operands, shared by every chained graph of one shape.

    Held by ``bench_shape`` until its graphs are gone: a graph records raw addresses, and a
    tensor freed after capture would hand its memory to the next allocation.
    """

    q2d: object
    q_c: object
    w_qb: object
    kv_new: object
    kv_row: object


def _producers(lay: Layers) -> Producers:
    import torch

    m, h = lay.q_nope.shape[0], lay.q_nope.shape[1]
    dev = lay.q_nope.device
    q = lay.q_nope._base if lay.q_nope._base is not None else lay.q_nope
    return Producers(
        q2d=q.view(m, h * (QK_NOPE + QK_ROPE)),
        q_c=torch.randn(m, Q_LORA_RANK, device=dev, dtype=torch.bfloat16),
        w_qb=torch.randn(Q_LORA_RANK, h * (QK_NOPE + QK_ROPE), device=dev, dtype=torch.bfloat16)
        * 0.02,
        kv_new=torch.randn(m, QUERY_WIDTH, device=dev, dtype=torch.bfloat16),
        kv_row=torch.empty(m, QUERY_WIDTH, device=dev, dtype=torch.bfloat16),
    )


def _chained(
    lay: Layers, prod: Producers, step: Callable[[int], None] | None
) -> Callable[[], None]:
    """Per layer: the q_b_proj GEMM writing q, a KV-cache row write, then `step(layer)`."""
    import torch

    def chained(i: int) -> None:
        torch.mm(prod.q_c, prod.w_qb, out=prod.q2d)
        prod.kv_row.copy_(prod.kv_new)
        if step is not None:
            step(i)

    return _every_layer(lay, chained)


def _steps(
    lay: Layers, fmt: str, *, pdl: bool, floors: bool = False
) -> dict[str, Callable[[int], None]]:
    """One layer's call of each timed path: fused, the two staged baselines, copy (and fused
    with PDL, and the floor kernels)."""
    from fusedq.kernels import triton_mla_query
    from fusedq.selection import launch_config

    steps = {
        "fused": _fused_step(lay),
        "staged": _staged_step(lay, "bmm+cat"),
        "bmm": _staged_step(lay, "bmm"),
        "copy": _copy_step(lay),
    }
    steps.update(_kernel_steps(lay, fmt))
    if pdl and triton_mla_query.HAS_PDL:
        m, h = lay.q_nope.shape[0], lay.q_nope.shape[1]
        steps["fused_pdl"] = _fused_step(lay, launch_config(h, m, *RECIPES[fmt], pdl=True))
    if floors:
        steps.update(_floor_steps(lay))
        steps.update(_grid_floor_steps(lay, fmt))
    return steps


def bench_shape(fmt: str, h: int, m: int, opts: Options) -> dict:
    import torch

    lay = build_layers(fmt, h, m, opts)
    n = len(lay.fused_w)
    prod = _producers(lay) if opts.chain else None
    if prod is not None:
        graphs = {"chain": _capture(_chained(lay, prod, None))}
        for name, step in _steps(lay, fmt, pdl=True, floors=opts.floors).items():
            graphs[name] = _capture(_chained(lay, prod, step))
    else:
        graphs = {
            name: _capture(_every_layer(lay, step))
            for name, step in _steps(lay, fmt, pdl=False, floors=opts.floors).items()
        }
    times = time_graphs(graphs, opts.samples, opts.warmup)
    row = {"format": fmt, "H": h, "M": m, "layers": n, "weight_bytes": lay.weight_bytes}
    for name, ms in times.items():
        row[f"{name}_us"] = _median_us(ms, n)
        row[f"{name}_p10_us"] = statistics.quantiles(ms, n=10)[0] * 1000.0 / n
        row[f"{name}_p90_us"] = statistics.quantiles(ms, n=10)[-1] * 1000.0 / n
    if opts.chain:
        # Increments over the predecessors alone: what the query step adds to the layer.
        row["chained"] = True
        for name in times:
            if name != "chain":
                row[f"{name}_us"] -= row["chain_us"]
        if "fused_pdl_us" in row:
            row["fused_pdl_over_staged"] = row["fused_pdl_us"] / row["staged_us"]
    add_baseline_ratios(row, lay.out_dtype)
    row["fused_over_copy"] = row["fused_us"] / row["copy_us"]
    if opts.floors:
        add_floor_ratios(row)
    row["max_abs_err_vs_staged"] = _max_error(lay)
    del graphs, lay, prod
    torch.cuda.empty_cache()
    return row


def add_baseline_ratios(row: dict, out_dtype) -> None:
    """fused against both staged baselines (``staged_us``: vLLM 0.32's bmm + cat, the key it
    always had; ``bmm_us``: the bmm alone, vLLM 0.26's FLASH_ATTN_MLA form), and which of them
    the served vLLM runs for this output (``served_baseline``, ``fused_over_served``)."""
    from fusedq.reference import SERVED_FORM

    row["fused_over_staged"] = row["fused_us"] / row["staged_us"]
    row["fused_over_bmm"] = row["fused_us"] / row["bmm_us"]
    served = SERVED_FORM[out_dtype]
    row["served_baseline"] = served
    row["fused_over_served"] = row["fused_us"] / row[SERVED_KEYS[served]]


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


def sweep_configs(fmt: str, h: int, m: int, opts: Options) -> dict:
    """Launch configs to time for one shape: the tl.dot grid, the tl.dot path's current
    choice (``dot``), the default choice (``auto``), the register-path and the Gluon
    variants."""
    from fusedq.kernels.triton_launch import LaunchConfig
    from fusedq.kernels.triton_mla_query import FMA_BLOCK_MS
    from fusedq.selection import launch_config

    weight_format, out_fp8 = RECIPES[fmt]
    block_m = max(16, 1 << (m - 1).bit_length())
    configs = {
        f"bn{bn}_w{nw}_k{bk}{'_pdl' if pdl else ''}": LaunchConfig(
            block_m=block_m, block_n=bn, num_warps=nw, block_k=bk, pdl=bool(pdl)
        )
        for bn in opts.sweep_block_n
        for nw in opts.sweep_warps
        for bk in opts.sweep_block_k
        for pdl in opts.sweep_pdl
    }
    configs["dot"] = launch_config(h, m, weight_format, out_fp8, allow_fma=False)
    configs["auto"] = launch_config(h, m, weight_format, out_fp8)
    fma_m = 1 << (m - 1).bit_length()
    if fma_m in FMA_BLOCK_MS:
        for spec, pdl in [(v, False) for v in opts.sweep_fma] + [
            (v, True) for v in opts.sweep_fma_pdl
        ]:
            bn, nw = (int(x) for x in spec.split(":"))
            configs[f"fma_bn{bn}_w{nw}{'_pdl' if pdl else ''}"] = LaunchConfig(
                block_m=fma_m, block_n=bn, num_warps=nw, pdl=pdl, fma=True
            )
    for spec in opts.sweep_gluon:
        bn, nw, *bm = parse_gluon_spec(spec)
        bm = bm[0] if bm else block_m
        if bm < m:
            continue  # a tile of fewer rows than tokens cannot serve this M
        for operands in opts.sweep_gluon_operands:
            for pdl in opts.sweep_pdl:  # as the tl.dot grid: with PDL where that is swept
                name = f"gluon_{operands}_bn{bn}_w{nw}_m{bm}{'_pdl' if pdl else ''}"
                configs[name] = LaunchConfig(
                    block_m=bm, block_n=bn, num_warps=nw, pdl=bool(pdl), gluon=True,
                    gluon_operands=operands,
                )  # fmt: skip
    if opts.sweep_fence and not out_fp8:
        for name, cfg in list(configs.items()):
            if cfg.gluon or cfg.fma:
                flipped = not cfg.fence
                twin = f"{name}_{'fence' if flipped else 'nofence'}"
                configs[twin] = dataclasses.replace(cfg, load_fence=flipped)
    if out_fp8:
        for name, cfg in list(configs.items()):
            for epilogue in opts.sweep_e4m3:
                # (no twin of a variant that already has it, and "wide" is Gluon's only)
                if epilogue != cfg.e4m3_epilogue and (epilogue != "wide" or cfg.gluon):
                    twin = dataclasses.replace(cfg, e4m3_epilogue=epilogue)
                    configs[f"{name}_{epilogue}"] = twin
    return configs


def cute_step(lay: Layers, fmt: str) -> tuple[Callable[[int], None] | None, str | None]:
    """Layer i's call forced onto the CuTe DSL kernel (the public op, ``backend="cute"``), or
    None and why it cannot run here (checked before capture, which must not fail)."""
    from fusedq.capability import cute_problem
    from fusedq.dispatch import split_weight
    from fusedq.kernels import cute_mla_query as cute

    reason = cute_problem(RECIPES[fmt][0], lay.out_dtype)
    if reason is None:
        values, scales = split_weight(lay.fused_w[0])
        reason = cute.unsupported_reason(lay.q_nope, values, scales, lay.q_pe, lay.out)
    if reason is not None:
        return None, reason
    return _fused_step(lay, backend="cute"), None


def parse_gluon_spec(spec: str) -> tuple[int, ...]:
    """``BLOCK_N:WARPS[:BLOCK_M]`` of ``--sweep-gluon`` as integers (ValueError naming the
    spec otherwise)."""
    parts = spec.split(":")
    if len(parts) not in (2, 3) or not all(p.isdigit() for p in parts):
        raise ValueError(f"--sweep-gluon {spec!r}: expected BLOCK_N:WARPS or BLOCK_N:WARPS:BLOCK_M")
    return tuple(int(p) for p in parts)


def sweep_shape(fmt: str, h: int, m: int, opts: Options) -> list[dict]:
    import torch

    lay = build_layers(fmt, h, m, opts)
    n = len(lay.fused_w)
    configs = sweep_configs(fmt, h, m, opts)
    steps = {name: _fused_step(lay, cfg) for name, cfg in configs.items()}
    if opts.sweep_cute:
        step, reason = cute_step(lay, fmt)
        if step is None:
            print(f"sweep {fmt} H={h} M={m}: no cute variant: {reason}", flush=True)
        else:
            steps["cute"] = step
    graphs = {name: _capture(_every_layer(lay, step)) for name, step in steps.items()}
    graphs["staged"] = _capture(_every_layer(lay, _staged_step(lay)))
    times = time_graphs(graphs, opts.samples, opts.warmup)
    errors = {}
    for name in steps:  # every variant's output, checked against the staged path
        errors[name] = _graph_error(lay, graphs[name])
    rows = []
    for name, ms in times.items():
        cfg = configs.get(name)
        rows.append(
            {
                "format": fmt, "H": h, "M": m, "variant": name,
                "config": dataclasses.asdict(cfg) if cfg else None,
                "us": _median_us(ms, n),
                "max_abs_err_vs_staged": errors.get(name),
            }
        )  # fmt: skip
    del graphs, lay
    torch.cuda.empty_cache()
    return rows


def environment(commit: str | None) -> dict:
    import platform

    import torch
    import triton

    import fusedq

    code = provenance.describe()
    env = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "gpu": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "fusedq": fusedq.__version__,
        "python": platform.python_version(),
        "commit": commit or provenance.commit_label(code),
        # The code that ran, by commit and fingerprint, even from a copied tree whose .git is
        # stale or absent (fusedq.provenance).
        "provenance": code,
        "FUSEDQ_PDL": os.environ.get("FUSEDQ_PDL", "0"),
    }
    query = "name,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit,driver_version"
    try:
        out = nvidia_smi([f"--query-gpu={query}", "--format=csv,noheader"])
        env["nvidia_smi"] = dict(zip(query.split(","), out.strip().split(", "), strict=False))
    except NvidiaSmiError as exc:
        env["nvidia_smi"] = f"unavailable: {exc}"
    return env


def format_table(rows: list[dict]) -> str:
    """Markdown table of benchmark rows: fused against both staged baselines side by side (rows
    written before the bmm-only baseline existed show "-" there), which one the served vLLM
    runs, and the targets each row meets."""
    floors = any("read_us" in r for r in rows)
    kinds = [k for g in FLOOR_GROUPS if any(f"{g[0]}_us" in r for r in rows) for k in g]
    header = ["format", "H", "M", "fused µs", "bmm+cat µs", "bmm-only µs", "copy µs"]
    header += ["fused/bmm+cat", "fused/bmm-only", "fused/copy", "served vLLM runs"]
    header += ["empty µs", "read µs", "read/bmm+cat"] * floors
    header += [f"{FLOOR_TITLES[k]} µs" for k in kinds] + ["target"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["format"], r["H"], r["M"], f"error: {r['error']}"])
            continue
        keys = ("fused_us", "staged_us", "bmm_us", "copy_us", "fused_over_staged")
        keys += ("fused_over_bmm", "fused_over_copy")
        cells = [r["format"], r["H"], r["M"], *(f"{r[k]:.2f}" if k in r else "-" for k in keys)]
        cells.append(BASELINE_TITLES.get(r.get("served_baseline"), "-"))
        if "read_us" in r:
            cells += [f"{r[k]:.2f}" for k in ("empty_us", "read_us", "read_over_staged")]
        elif floors:
            cells += ["-"] * 3
        cells += [f"{r[f'{k}_us']:.2f}" if f"{k}_us" in r else "-" for k in kinds]
        body.append([*cells, verdict(r)])
    return md_table(header, body)


# The bars a kernel change is held to, measured against the floor in the same run: fused /
# read-only floor per weight format, and E4M3 output / BF16 output of the same recipe (weight
# format), per shape.
FLOOR_BARS = {"bf16": 1.15, "mxfp8": 1.25}
E4M3_OVER_BF16_BAR = 1.10
# (E4M3-output format, the BF16-output format of the same weights, the bar's key in a row).
E4M3_PAIRS = (("e4m3", "bf16", "e4m3"), ("mxfp8-e4m3", "mxfp8", "mxfp8_e4m3"))


def floor_bars(rows: list[dict]) -> list[dict]:
    """Per (H, M): BF16 and MXFP8 fused / read floor, and for each weight format the E4M3 /
    BF16-output fused time, each with its bar and whether it holds (``None`` where the run
    lacks the rows that ratio needs)."""
    by = {(r["format"], r["H"], r["M"]): r for r in rows if "error" not in r}
    shapes = sorted({(h, m) for _, h, m in by})
    out = []
    for h, m in shapes:
        row: dict = {"H": h, "M": m}
        for fmt, bar in FLOOR_BARS.items():
            r = by.get((fmt, h, m))
            ratio = r["fused_us"] / r["read_us"] if r and "read_us" in r else None
            row[f"{fmt}_over_read"] = ratio
            row[f"{fmt}_ok"] = None if ratio is None else ratio <= bar
            # Where the bar is out of reach, the measurements that show why: the read+store,
            # grid, split-K and view floors (see FLOOR_SPLIT_K), each against the read floor.
            for name in FLOOR_KINDS:
                has = r is not None and f"{name}_us" in r and "read_us" in r
                row[f"{fmt}_{name}_over_read"] = r[f"{name}_us"] / r["read_us"] if has else None
        for e4m3_fmt, bf16_fmt, key in E4M3_PAIRS:
            e4, bf = by.get((e4m3_fmt, h, m)), by.get((bf16_fmt, h, m))
            ratio = e4["fused_us"] / bf["fused_us"] if e4 and bf else None
            row[f"{key}_over_{bf16_fmt}"] = ratio
            row[f"{key}_ok"] = None if ratio is None else ratio <= E4M3_OVER_BF16_BAR
        out.append(row)
    return out


def format_floor_bars(bars: list[dict]) -> str:
    """The bar table: each ratio with ok/MISS against its bar."""

    def cell(ratio: float | None, ok: bool | None) -> str:
        return "-" if ratio is None else f"{ratio:.2f} {'ok' if ok else 'MISS'}"

    header = [
        "H", "M", f"BF16 fused/read (≤{FLOOR_BARS['bf16']})",
        f"MXFP8 fused/read (≤{FLOOR_BARS['mxfp8']})",
        f"BF16 weights E4M3/BF16 out (≤{E4M3_OVER_BF16_BAR})",
        f"MXFP8 weights E4M3/BF16 out (≤{E4M3_OVER_BF16_BAR})",
    ]  # fmt: skip
    keys = ["bf16", "mxfp8"] + [key for _, _, key in E4M3_PAIRS]
    ratios = [("bf16_over_read", "bf16_ok"), ("mxfp8_over_read", "mxfp8_ok")]
    ratios += [(f"{key}_over_{bf}", f"{key}_ok") for _, bf, key in E4M3_PAIRS]
    body = [[b["H"], b["M"], *(cell(b.get(r), b.get(ok)) for r, ok in ratios)] for b in bars]
    for key, title in ((k, f"{FLOOR_TITLES[k]}/read") for k in FLOOR_KINDS):
        if any(b.get(f"{fmt}_{key}_over_read") for b in bars for fmt in FLOOR_BARS):
            header += [f"{fmt.upper()} {title}" for fmt in FLOOR_BARS]
            for b, line in zip(bars, body, strict=True):
                for fmt in FLOOR_BARS:
                    v = b.get(f"{fmt}_{key}_over_read")
                    line.append("-" if v is None else f"{v:.2f}")
    met = [b.get(f"{k}_ok") for b in bars for k in keys]
    measured = [ok for ok in met if ok is not None]
    return md_table(header, body) + f"\n\nbars met: {sum(measured)} of {len(measured)}"


def verdict(row: dict) -> str:
    max_staged, max_copy = TARGETS[row["format"]]
    parts = []
    if max_staged is not None:
        ok = row["fused_over_staged"] <= max_staged
        parts.append(f"{'ok' if ok else 'MISS'} <={max_staged}x staged")
    if max_copy is not None:
        ok = row["fused_over_copy"] <= max_copy
        parts.append(f"{'ok' if ok else 'MISS'} <={max_copy}x copy")
    return ", ".join(parts) or "-"


class NoCudaError(SystemExit):
    """No CUDA GPU here: `main` says so in one line and exits 2, the usage code (nothing was
    measured); other callers of `run` exit with the message, as SystemExit does."""


# Exit code of a refusal before anything ran (argparse's for bad arguments).
EXIT_USAGE = 2


def run(opts: Options) -> dict:
    """Run the benchmark (or the sweep) and return every figure."""
    import torch

    from fusedq import bench_eager

    if not torch.cuda.is_available():
        raise NoCudaError(bench_eager.NO_CUDA if opts.eager else "fusedq-bench needs a CUDA GPU")
    result = {"environment": environment(opts.commit), "options": dataclasses.asdict(opts)}
    if opts.eager:
        result["eager"] = bench_eager.run(opts)
        return result
    rows: list[dict] = []
    for fmt in opts.formats:
        for h in opts.heads:
            for m in opts.ms:
                t0 = time.time()
                try:
                    new = _one(fmt, h, m, opts, t0)
                except Exception as exc:  # one broken shape must not lose the others
                    print(f"{fmt} H={h} M={m}: FAILED {type(exc).__name__}: {exc}", flush=True)
                    new = [{"format": fmt, "H": h, "M": m, "error": repr(exc)}]
                rows.extend(new)
    result["sweep" if opts.sweep else "rows"] = rows
    return result


def _one(fmt: str, h: int, m: int, opts: Options, t0: float) -> list[dict]:
    if opts.sweep:
        new = sweep_shape(fmt, h, m, opts)
        best = min((r for r in new if r["variant"] != "staged"), key=lambda r: r["us"])
        staged = next(r for r in new if r["variant"] == "staged")
        print(
            f"sweep {fmt} H={h} M={m}: best {best['variant']} {best['us']:.2f} µs, "
            f"staged {staged['us']:.2f} µs; "
            + " ".join(
                f"{r['variant']}={r['us']:.2f}"
                + (
                    f"(err {r['max_abs_err_vs_staged']:.2g})"
                    if r["max_abs_err_vs_staged"] is not None
                    else ""
                )
                for r in new
            ),
            flush=True,
        )
    else:
        new = [bench_shape(fmt, h, m, opts)]
        r = new[0]
        print(
            f"{fmt} H={h} M={m} L={r['layers']}: fused {r['fused_us']:.2f} µs, "
            f"bmm+cat {r['staged_us']:.2f} µs, bmm-only {r['bmm_us']:.2f} µs, "
            f"copy {r['copy_us']:.2f} µs, ratio {r['fused_over_staged']:.3f} / "
            f"{r['fused_over_bmm']:.3f} / {r['fused_over_copy']:.3f}, "
            + (
                f"PDL {r['fused_pdl_us']:.2f} µs ({r['fused_pdl_over_staged']:.3f}), "
                if "fused_pdl_us" in r
                else ""
            )
            + (
                f"floors: read {r['read_us']:.2f} µs ({r['read_over_staged']:.3f}), "
                f"empty {r['empty_us']:.2f} µs, "
                if "read_us" in r
                else ""
            )
            + "".join(f"{k} {r[f'{k}_us']:.2f} µs, " for k in ("triton", "cute") if f"{k}_us" in r)
            + f"err {r['max_abs_err_vs_staged']:.3g} ({time.time() - t0:.1f} s)",
            flush=True,
        )
    return new


def parse_args(argv: Sequence[str] | None) -> tuple[Options, str | None]:
    p = argparse.ArgumentParser(prog="fusedq-bench", description=__doc__.split("\n")[0])
    p.add_argument("--heads", type=int, nargs="+", default=list(Options.heads))
    p.add_argument("--m", type=int, nargs="+", default=list(Options.ms), dest="ms")
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--samples", type=int, default=Options.samples, help="timed replays per graph")
    p.add_argument("--warmup", type=int, default=Options.warmup)
    p.add_argument("--l2-mb", type=float, default=DEFAULT_L2_MB)
    p.add_argument("--l2-factor", type=float, default=2.0)
    p.add_argument("--chain", action="store_true", help="time each call behind vLLM's predecessors")
    p.add_argument("--sweep", action="store_true", help="time launch-config variants instead")
    p.add_argument(
        "--floors", action="store_true", help="also time an empty and a read-only kernel per layer"
    )
    p.add_argument("--sweep-block-n", type=int, nargs="*", default=list(Options.sweep_block_n))
    p.add_argument("--sweep-warps", type=int, nargs="+", default=list(Options.sweep_warps))
    p.add_argument("--sweep-block-k", type=int, nargs="+", default=list(Options.sweep_block_k))
    p.add_argument("--sweep-pdl", type=int, nargs="+", default=list(Options.sweep_pdl))
    p.add_argument("--sweep-fma", nargs="*", default=[], help="register-path BLOCK_N:WARPS")
    p.add_argument("--sweep-fma-pdl", nargs="*", default=[], help="the same, with PDL")
    p.add_argument(
        "--sweep-cute",
        action="store_true",
        help="--sweep: also time the CuTe DSL MXFP8 kernel (needs nvidia-cutlass-dsl)",
    )
    p.add_argument(
        "--sweep-gluon", nargs="*", default=[], help="Gluon-kernel BLOCK_N:WARPS[:BLOCK_M]"
    )
    p.add_argument(
        "--sweep-gluon-operands",
        nargs="+",
        choices=("convert", "smem", "direct"),
        default=list(Options.sweep_gluon_operands),
        help="the Gluon operand paths to time for each --sweep-gluon spec",
    )
    p.add_argument(
        "--sweep-e4m3",
        nargs="+",
        default=[],
        choices=("mul", "wide", "div", "noscale"),
        help="--sweep, E4M3 formats: time each variant again with these epilogues: mul (vLLM's "
        "quantisation stored from the MMA layout), wide (the same stored 16 bytes a thread "
        "through shared memory; Gluon only), div (an IEEE division by q_scale per element, the "
        "old one), noscale (no scaling; wrong output)",
    )
    p.add_argument(
        "--sweep-fence",
        action="store_true",
        help="--sweep, BF16 formats: time each Gluon and register-path variant again with its "
        "scheduling fence after the loads flipped (on for the register path, off for Gluon)",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="host time per call outside CUDA graphs: public op, custom op, bare launch, "
        "vLLM's staged block",
    )
    p.add_argument("--calls", type=int, default=Options.eager_calls, help="--eager: calls per run")
    p.add_argument(
        "--repeats",
        type=int,
        default=Options.eager_repeats,
        help="--eager: runs per path (best taken)",
    )
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse)")
    p.add_argument("--json", default=None, help="write every figure to this path")
    a = p.parse_args(argv)
    if a.eager:
        clash = [f for f in ("chain", "sweep", "floors") if getattr(a, f)]
        if clash:
            p.error(f"--eager times calls outside graphs; it does not combine with --{clash[0]}")
    for flag in ("sweep_cute", "sweep_e4m3", "sweep_fence"):
        if getattr(a, flag) and not a.sweep:
            name = "--" + flag.replace("_", "-")
            p.error(f"{name} adds variants to --sweep; pass --sweep too")
    for spec in a.sweep_gluon:
        try:
            parse_gluon_spec(spec)
        except ValueError as exc:
            p.error(str(exc))
    if a.calls < 1 or a.repeats < 1:
        p.error(f"--calls {a.calls} and --repeats {a.repeats} must be at least 1")
    opts = Options(
        heads=tuple(a.heads), ms=tuple(a.ms), formats=tuple(a.formats), samples=a.samples,
        warmup=a.warmup, l2_mb=a.l2_mb, l2_factor=a.l2_factor, chain=a.chain, sweep=a.sweep,
        floors=a.floors, eager=a.eager, eager_calls=a.calls, eager_repeats=a.repeats,
        sweep_block_n=tuple(a.sweep_block_n), sweep_warps=tuple(a.sweep_warps),
        sweep_block_k=tuple(a.sweep_block_k), sweep_pdl=tuple(a.sweep_pdl),
        sweep_fma=tuple(a.sweep_fma), sweep_fma_pdl=tuple(a.sweep_fma_pdl),
        sweep_cute=a.sweep_cute, sweep_gluon=tuple(a.sweep_gluon),
        sweep_gluon_operands=tuple(a.sweep_gluon_operands),
        sweep_e4m3=tuple(a.sweep_e4m3), sweep_fence=a.sweep_fence, commit=a.commit,
    )  # fmt: skip
    return opts, a.json


def main(argv: Sequence[str] | None = None) -> int:
    opts, json_path = parse_args(argv)
    try:
        result = run(opts)
    except NoCudaError as exc:
        print(exc, file=sys.stderr)  # one line, naming the tool
        return EXIT_USAGE
    if opts.eager:
        from fusedq import bench_eager

        print(bench_eager.format_table(result["eager"]))
    elif not opts.sweep:
        print(format_table(result["rows"]))
        print(SERVED_NOTE)
        if opts.floors:
            result["floor_bars"] = floor_bars(result["rows"])
            print(format_floor_bars(result["floor_bars"]))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
