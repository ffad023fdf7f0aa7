"""``--sweep``: launch-config variants of the fused kernel timed against the staged path, to
pick the heuristic."""

from __future__ import annotations

import dataclasses

from fusedq_bench.common import (
    RECIPES,
)
from fusedq_bench.harness import (
    build_layers,
    capture,
    cute_step,
    every_layer,
    fused_step,
    graph_error,
    median_us,
    staged_step,
    time_graphs,
)
from fusedq_bench.options import Options


def sweep_configs(fmt: str, h: int, m: int, opts: Options) -> dict:
    """Launch configs to time for one shape: the tl.dot grid, the tl.dot path's current
    choice (``dot``), the default choice (``auto``), the register-path and the Gluon
    variants."""
    from fusedq.contract import geometry_named
    from fusedq.kernels.triton_launch import LaunchConfig
    from fusedq.kernels.triton_mla_query import FMA_BLOCK_MS, MAX_BLOCK_M
    from fusedq.selection import launch_config

    weight_format, out_fp8 = RECIPES[fmt]
    g = geometry_named(opts.geometry)
    block_m = min(max(16, 1 << (m - 1).bit_length()), MAX_BLOCK_M)
    # --sweep-block-m: the named rows per CTA, where they can serve M (a block under M must
    # tile it, which only MAX_BLOCK_M does); each such variant's name carries its block.
    block_ms = [bm for bm in opts.sweep_block_m if bm >= m or bm == MAX_BLOCK_M]
    configs = {
        f"bn{bn}_w{nw}_k{bk}{f'_m{bm}' if opts.sweep_block_m else ''}{'_pdl' if pdl else ''}": (
            LaunchConfig(block_m=bm, block_n=bn, num_warps=nw, block_k=bk, pdl=bool(pdl))
        )
        for bm in (block_ms if opts.sweep_block_m else [block_m])
        for bn in opts.sweep_block_n
        for nw in opts.sweep_warps
        for bk in opts.sweep_block_k
        for pdl in opts.sweep_pdl
    }
    configs["dot"] = launch_config(h, m, weight_format, out_fp8, allow_fma=False, geometry=g)
    configs["auto"] = launch_config(h, m, weight_format, out_fp8, geometry=g)
    fma_m = 1 << (m - 1).bit_length()
    if fma_m in FMA_BLOCK_MS:
        for spec, pdl in [(v, False) for v in opts.sweep_fma] + [
            (v, True) for v in opts.sweep_fma_pdl
        ]:
            bn, nw = (int(x) for x in spec.split(":"))
            configs[f"fma_bn{bn}_w{nw}{'_pdl' if pdl else ''}"] = LaunchConfig(
                block_m=fma_m, block_n=bn, num_warps=nw, pdl=pdl, fma=True
            )
    from fusedq.kernels import gluon_mla_query

    # (the Gluon kernel is built for GLM-5's geometry only)
    for spec in opts.sweep_gluon if g in gluon_mla_query.GEOMETRIES else ():
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
    steps = {name: fused_step(lay, cfg) for name, cfg in configs.items()}
    if opts.sweep_cute:
        step, reason = cute_step(lay, fmt)
        if step is None:
            print(f"sweep {fmt} H={h} M={m}: no cute variant: {reason}", flush=True)
        else:
            steps["cute"] = step
    graphs = {name: capture(every_layer(lay, step)) for name, step in steps.items()}
    graphs["staged"] = capture(every_layer(lay, staged_step(lay)))
    # vLLM 0.26's BF16 block (the bmm alone; reference.SERVED_FORM), the baseline a BF16-out
    # variant must beat to be served.
    graphs["bmm"] = capture(every_layer(lay, staged_step(lay, form="bmm")))
    times = time_graphs(graphs, opts.samples, opts.warmup)
    errors = {}
    for name in steps:  # every variant's output, checked against the staged path
        errors[name] = graph_error(lay, graphs[name])
    rows = []
    for name, ms in times.items():
        cfg = configs.get(name)
        rows.append(
            {
                "format": fmt, "geometry": opts.geometry, "H": h, "M": m, "variant": name,
                "config": dataclasses.asdict(cfg) if cfg else None,
                "us": median_us(ms, n),
                "max_abs_err_vs_staged": errors.get(name),
            }
        )  # fmt: skip
    del graphs, lay
    torch.cuda.empty_cache()
    return rows
