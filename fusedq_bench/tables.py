"""The Markdown table of a run's rows: fused against both staged baselines, which one the served
vLLM runs, the floors and the targets each row meets."""

from __future__ import annotations

from fusedq_bench.bars import verdict
from fusedq_bench.common import (
    md_table,
)
from fusedq_bench.floors import FLOOR_GROUPS, FLOOR_TITLES

BASELINE_TITLES = {"bmm+cat": "bmm+cat", "bmm": "bmm-only"}
SERVED_NOTE = (
    "served vLLM (0.26): BF16 output runs FLASH_ATTN_MLA, which takes the (nope, pe) pair: "
    "the bmm alone, so fused/bmm-only is its figure; E4M3 output (no FP8 in FLASH_ATTN_MLA) "
    "runs bmm + concat-quantise: fused/bmm+cat."
)


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
