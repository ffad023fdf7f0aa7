"""The timing harness: per-layer weights rotated past L2, each path's call per layer captured in
a CUDA graph, the graphs replayed ABBA-interleaved and timed with CUDA events."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable

from fusedq.contract import (
    E4M3_MAX,
    KV_LORA,
    MX_BLOCK,
    QK_ROPE,
    QUERY_WIDTH,
    Geometry,
    geometry_named,
)
from fusedq.kernels.common import BLOCK_K, k_chunks
from fusedq_bench.common import (
    RECIPES,
    abba_order,
    out_dtype_of,
)
from fusedq_bench.floors import (
    FLOOR_EMPTY_CTAS,
    FLOOR_READ_WORDS,
    FLOOR_SPLIT_K,
    FLOOR_SPLIT_WORDS,
    FLOOR_STORE_WORDS,
    floor_kernel_set,
    fused_block_n,
    tma_floor_kernel,
    tma_weight_rows,
)
from fusedq_bench.options import Options, layer_count


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


def capture(fn: Callable[[], None]):
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
    geometry: Geometry
    # The fused step's backend: "auto" (the product's choice) where the geometry is qualified
    # for the shape, "triton" past it (what qualifying a shape measures).
    fused_backend: str = "auto"
    floor_sink: object = None
    # The read+store floor's output: as many int32 words as the layer's out has bytes / 4.
    floor_out: object = None
    # The split-K floor's partial sums and arrival counts, one per output tile (zeros).
    floor_part: object = None
    floor_count: object = None


def build_layers(fmt: str, h: int, m: int, opts: Options, device: str = "cuda") -> Layers:
    """``device``: "cuda" to time; "cpu" lets the step functions run eagerly in the CPU tests."""
    import torch

    import fusedq

    dev = torch.device(device)
    g = geometry_named(opts.geometry)
    nope = g.qk_nope
    bf16_bytes = h * nope * KV_LORA * 2
    mxfp8_bytes = h * nope * KV_LORA + h * nope * (KV_LORA // MX_BLOCK)
    weight_format, out_fp8 = RECIPES[fmt]
    fused_bytes = mxfp8_bytes if weight_format == "mxfp8" else bf16_bytes
    n_layers = layer_count(min(bf16_bytes, fused_bytes), opts)
    staged_w, fused_w, copy_src, copy_dst = [], [], [], []
    for _ in range(n_layers):
        # vLLM's W_UK_T: kv_b_proj.weight.T viewed [H, P+V, L], sliced to the P rows.
        base = torch.randn(h, g.head_stride_rows, KV_LORA, device=dev, dtype=torch.bfloat16) * 0.05
        w = base[:, :nope, :]
        staged_w.append(w)
        fused_w.append(fusedq.quantize_mxfp8(w) if weight_format == "mxfp8" else w)
        copy_src.append(torch.empty(fused_bytes, dtype=torch.uint8, device=dev))
        copy_dst.append(torch.empty(fused_bytes, dtype=torch.uint8, device=dev))
    q = torch.randn(m, h, nope + QK_ROPE, device=dev, dtype=torch.bfloat16)
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
    qualified = fusedq.can_implement(
        h, m, geometry=g, weight_format=weight_format, out_dtype=out_dtype, device=dev
    )
    return Layers(
        staged_w, fused_w, copy_src, copy_dst, q[..., :nope], q[..., nope:], out, q_scale,
        out_dtype, fused_bytes, g, "auto" if qualified else "triton", sink, floor_out,
        torch.zeros(tiles, dtype=torch.int32, device=dev),
        torch.zeros(tiles, dtype=torch.int32, device=dev),
    )  # fmt: skip


def fused_step(lay: Layers, config=None, backend: str | None = None) -> Callable[[int], None]:
    """Layer i's fused call: the public op (``backend``: "auto" is the product's own choice of
    kernel, "triton"/"cute" that kernel; ``None`` is ``lay.fused_backend``), or the Triton
    kernel launched with ``config``."""
    import fusedq
    from fusedq.kernels import triton_launch

    backend = lay.fused_backend if backend is None else backend

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


def kernel_steps(lay: Layers, fmt: str) -> dict[str, Callable[[int], None]]:
    """Each fused kernel that can run this format, forced, beside the "auto" choice: so one
    run shows what the choice picked and what it passed over (MXFP8: Triton and, where
    nvidia-cutlass-dsl is installed, CuTe)."""
    import fusedq

    m, h = lay.q_nope.shape[0], lay.q_nope.shape[1]
    weight_format = RECIPES[fmt][0]
    kw = dict(
        geometry=lay.geometry, weight_format=weight_format, out_dtype=lay.out_dtype,
        device=lay.q_nope.device,
    )  # fmt: skip
    path, why = fusedq.kernel_choice(h, m, **kw)
    if path == "staged" and lay.fused_backend == "triton":
        # Past the qualified shapes: the fused step forces the Triton kernels, if they run.
        why = fusedq.explain(h, m, qualified=False, **kw)
        path = "triton" if why is None else path
    if path == "staged":
        raise RuntimeError(f"{fmt} H={h} M={m}: the fused kernel cannot run here: {why}")
    cute, _ = cute_step(lay, fmt)
    if cute is None:
        return {}
    return {"triton": fused_step(lay, backend="triton"), "cute": cute}


def staged_step(lay: Layers, form: str = "bmm+cat") -> Callable[[int], None]:
    """Layer i's staged block in one of ``reference.STAGED_FORMS``, on the BF16 weight, with
    E4M3's concat and quantisation in one launch as vLLM runs it."""
    from fusedq.reference import staged

    return lambda i: staged(
        lay.q_nope, lay.staged_w[i], None, lay.q_pe, None, lay.q_scale, form=form,
        concat_quant=concat_quant_kernel,
    )  # fmt: skip


def copy_step(lay: Layers) -> Callable[[int], None]:
    return lambda i: lay.copy_dst[i].copy_(lay.copy_src[i])


def every_layer(lay: Layers, step: Callable[[int], None]) -> Callable[[], None]:
    """What one graph holds: `step` for every layer, in order."""

    def fn() -> None:
        for i in range(len(lay.fused_w)):
            step(i)

    return fn


def max_error(lay: Layers) -> float:
    """Max |fused - staged| of the last layer's output, after the timed replays."""
    import fusedq

    ref = fusedq.staged_mla_query(
        lay.q_nope, lay.fused_w[-1], lay.q_pe, out_dtype=lay.out_dtype, q_scale=lay.q_scale
    )
    return float((lay.out.float() - ref.float()).abs().max())


def graph_error(lay: Layers, graph) -> float:
    """``_max_error`` of one graph's own output: ``out`` poisoned, that graph replayed alone."""
    import torch

    lay.out.fill_(float("nan") if lay.out.dtype == torch.bfloat16 else 0)
    graph.replay()
    torch.cuda.synchronize()
    return max_error(lay)


def median_us(ms: list[float], n_layers: int) -> float:
    return statistics.median(ms) * 1000.0 / n_layers


def cute_step(lay: Layers, fmt: str) -> tuple[Callable[[int], None] | None, str | None]:
    """Layer i's call forced onto the CuTe DSL kernel (the public op, ``backend="cute"``), or
    None and why it cannot run here (checked before capture, which must not fail)."""
    from fusedq.capability import cute_problem
    from fusedq.dispatch import split_weight
    from fusedq.kernels import cute_mla_query as cute

    reason = cute_problem(RECIPES[fmt][0], lay.out_dtype, geometry=lay.geometry)
    if reason is None:
        values, scales = split_weight(lay.fused_w[0])
        reason = cute.unsupported_reason(lay.q_nope, values, scales, lay.q_pe, lay.out)
    if reason is not None:
        return None, reason
    return fused_step(lay, backend="cute"), None


def floor_steps(lay: Layers) -> dict[str, Callable[[int], None]]:
    """The floor kernels for each layer: the empty node, the read-only kernel per tile, and the
    read+store kernel per tile."""
    import torch
    import triton

    read_kernel, empty_kernel, read_store_kernel = floor_kernel_set()[:3]
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


def grid_floor_steps(lay: Layers, fmt: str) -> dict[str, Callable[[int], None]]:
    """The "grid", "split_k" and "view" floors for each layer (see FLOOR_SPLIT_K)."""
    import torch
    import triton

    grid_read_kernel, split_k_kernel, view_read_kernel = floor_kernel_set()[3:]
    words = [src.view(torch.int32) for src in lay.copy_src]
    n_words = words[0].numel()
    m, h = lay.q_nope.shape[0], lay.q_nope.shape[1]
    block_n = fused_block_n(fmt, h, m, lay.geometry)
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
        NUM_K=k_chunks(lay.geometry.qk_nope),
    )  # fmt: skip

    def view(i: int) -> None:
        view_read_kernel[(KV_LORA // block_n, h)](
            values[i], scales[i], sink, v0.stride(0), v0.stride(1), s0.stride(0), s0.stride(1),
            **view_meta,
        )  # fmt: skip

    steps = {"grid": grid, "split_k": split_k, "view": view}
    tma_kernel, why = tma_floor_kernel()
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
