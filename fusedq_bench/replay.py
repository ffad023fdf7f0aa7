"""One shape's CUDA-graph replay: every path's graph (fused, both staged baselines, copy, and
with ``--chain`` / ``--floors`` theirs), timed, and the row of figures it gives."""

from __future__ import annotations

import statistics
from collections.abc import Callable

from fusedq_bench.chain import chained, producers
from fusedq_bench.common import (
    RECIPES,
)
from fusedq_bench.floors import add_floor_ratios
from fusedq_bench.harness import (
    Layers,
    build_layers,
    capture,
    copy_step,
    every_layer,
    floor_steps,
    fused_step,
    grid_floor_steps,
    kernel_steps,
    max_error,
    median_us,
    staged_step,
    time_graphs,
)
from fusedq_bench.options import Options

# The staged baselines' row keys and titles (reference.STAGED_FORMS): "staged_us" is vLLM
# 0.32's bmm + cat, the key it had before the bmm-only baseline was added beside it.
SERVED_KEYS = {"bmm+cat": "staged_us", "bmm": "bmm_us"}


def shape_steps(
    lay: Layers, fmt: str, *, pdl: bool, floors: bool = False
) -> dict[str, Callable[[int], None]]:
    """One layer's call of each timed path: fused, the two staged baselines, copy (and fused
    with PDL, and the floor kernels)."""
    from fusedq.kernels import triton_mla_query
    from fusedq.selection import launch_config

    steps = {
        "fused": fused_step(lay),
        "staged": staged_step(lay, "bmm+cat"),
        "bmm": staged_step(lay, "bmm"),
        "copy": copy_step(lay),
    }
    steps.update(kernel_steps(lay, fmt))
    if pdl and triton_mla_query.HAS_PDL:
        m, h = lay.q_nope.shape[0], lay.q_nope.shape[1]
        config = launch_config(h, m, *RECIPES[fmt], pdl=True, geometry=lay.geometry)
        steps["fused_pdl"] = fused_step(lay, config)
    if floors:
        steps.update(floor_steps(lay))
        steps.update(grid_floor_steps(lay, fmt))
    return steps


def bench_shape(fmt: str, h: int, m: int, opts: Options) -> dict:
    import torch

    lay = build_layers(fmt, h, m, opts)
    n = len(lay.fused_w)
    prod = producers(lay) if opts.chain else None
    if prod is not None:
        graphs = {"chain": capture(chained(lay, prod, None))}
        for name, step in shape_steps(lay, fmt, pdl=True, floors=opts.floors).items():
            graphs[name] = capture(chained(lay, prod, step))
    else:
        graphs = {
            name: capture(every_layer(lay, step))
            for name, step in shape_steps(lay, fmt, pdl=False, floors=opts.floors).items()
        }
    times = time_graphs(graphs, opts.samples, opts.warmup)
    row = {"format": fmt, "H": h, "M": m, "layers": n, "weight_bytes": lay.weight_bytes}
    # Which MLA geometry (readers that predate it take rows without one as GLM-5's), and the
    # fused step's backend where it is not the product's choice (past the qualified shapes).
    row["geometry"] = lay.geometry.name
    if lay.fused_backend != "auto":
        row["fused_backend"] = lay.fused_backend
    for name, ms in times.items():
        row[f"{name}_us"] = median_us(ms, n)
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
    row["max_abs_err_vs_staged"] = max_error(lay)
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
