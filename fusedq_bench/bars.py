"""What a run is held to: the targets the kernel was first built to (against the staged path and
the weight copy), and the floor bars (against the read floor of the same run,
docs/decisions/0014-floors-are-the-yardstick.md)."""

from __future__ import annotations

from fusedq_bench.common import (
    md_table,
)
from fusedq_bench.floors import FLOOR_KINDS, FLOOR_TITLES

# The targets the kernel was built to (fused / staged, fused / copy), per format.
TARGETS = {
    "bf16": (0.40, 1.3), "mxfp8": (0.35, None), "e4m3": (None, None), "mxfp8-e4m3": (None, None)
}  # fmt: skip


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
