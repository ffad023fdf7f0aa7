"""`report.html`: one self-contained page per run that a person reads in the morning.

The page holds the seeds' topology tables, inline SVG bar charts of aggregate tok/s per
topology (one per workload column, e.g. ctx0 and ctx64k), a chart of paired-variant deltas
when the matrix has two or more variants, a trend chart over earlier runs when a history is
given (``orchestrator nightly`` passes it), an optional comparison verdict, and the audit
findings with their log excerpts.

Self-contained on purpose: the file is mailed, attached to CI jobs and opened from shared
disks on machines without network, so there are no scripts, fonts, stylesheets or images
from elsewhere; charts are inline SVG and the page has no JavaScript at all.

The markup is a Jinja2 template (``templates/report.html.j2``, the charts in
``templates/charts.html.j2``) rendered with autoescape: this module computes what the page
shows (the figures, the charts' geometry) and no string of markup is built here. Every
string that came from a log, a matrix or a run (finding text, reasons, labels, ids) is
escaped by the template and stripped of control characters (``_printable``): a log line
is attacker-controlled text.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import jinja2
from markupsafe import Markup

from orchestrator.common.layout import REPORT_HTML
from orchestrator.reports.measures import STATS_NOTE, bursty
from orchestrator.reports.run import (
    LATENCY_NOTE,
    audit_sentence,
    exposure_warning,
    findings,
    interpreted_note,
    interrupted_sentence,
    paired_deltas,
    token_checks,
)
from orchestrator.reports.run import fmt_tok as _fmt
from orchestrator.reports.summary import latency_table, totals_table
from orchestrator.results.recorded_run import Run, workload_defs
from orchestrator.results.rows import CaseResult
from orchestrator.results.store import write_text_atomic

if TYPE_CHECKING:
    from orchestrator.analysis.compare import Comparison


# Tableau 10: distinguishable for the common colour-vision deficiencies and in greyscale print.
PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)
# Past ten series colours repeat; a dash pattern keeps lines 11..40 apart in the trend chart.
DASHES = ("", "6 3", "2 3", "8 3 2 3")
GOOD, BAD, MUTED, GRID, ZERO = "#2e7d32", "#c62828", "#757575", "#e0e0e0", "#9e9e9e"

CHART_WIDTH = 960
LABEL_WIDTH = 300  # room for "NF3 MXFP8/tp8-dcp8-mtp3" at 12 px
BAR_HEIGHT = 16
BAR_GAP = 3
GROUP_GAP = 10
MAX_LABEL_CHARS = 44
# A month of nightlies: more points than this makes the trend unreadable at page width.
MAX_TREND_RUNS = 30
# The page must stay small enough to mail: the findings list is capped like report.md's.
MAX_FINDINGS = 200

# C0 controls (except tab/newline/CR), DEL and C1 controls: invalid or invisible in HTML text.
_CONTROL_RE = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f-\x9f]")


def _printable(value: Any) -> Any:
    """Every value the template prints, before autoescape: control characters removed.
    Markup (a chart the template rendered) is already safe and passes as it is."""
    if isinstance(value, Markup):
        return value
    return _CONTROL_RE.sub("", str(value))


_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).with_name("templates")),
    autoescape=True,
    finalize=_printable,
    trim_blocks=True,
    lstrip_blocks=True,
    keep_trailing_newline=True,
    undefined=jinja2.StrictUndefined,
)


def _short(label: str, limit: int = MAX_LABEL_CHARS) -> str:
    return label if len(label) <= limit else label[: limit - 1] + "…"


# Axis maxima whose quarters are round (0.25, 0.3, 0.4, …): ticks sit at 0, ¼, ½, ¾, 1.
_NICE_STEPS = (1.0, 1.2, 1.6, 2.0, 2.4, 3.2, 4.0, 6.0, 8.0, 10.0)


def _nice_max(value: float) -> float:
    """The smallest nice step × 10^k at or above value, so bars use most of the width."""
    if value <= 0:
        return 1.0
    exp = 10 ** math.floor(math.log10(value))
    return next(m * exp for m in _NICE_STEPS if m * exp >= value)


# --------------------------------------------------------------------------- charts
# A chart is data: its title, legend and SVG elements with their coordinates already
# formatted (``templates/charts.html.j2`` writes the markup). Element kinds: line, text,
# rect, circle, polyline; their keys are the attributes the template writes.


@dataclass
class Chart:
    title: str
    height: str
    elements: list[dict[str, Any]] = field(default_factory=list)
    legend: list[dict[str, str]] = field(default_factory=list)  # name, style
    note: str | None = None  # a line under the chart


def _swatch(name: str, colour: str, dash: str = "") -> dict[str, str]:
    """A legend entry; HTML wraps long legends, SVG would not."""
    style = f"background:{colour}" if not dash else f"border-top:3px dashed {colour}"
    return {"name": name, "style": style}


def _text(x: Any, y: Any, text: str, **attrs: Any) -> dict[str, Any]:
    return {"kind": "text", "x": x, "y": y, "text": text, **attrs}


def _axis(x0: float, width: float, top: float, bottom: float, vmax: float, unit: str) -> list:
    out: list[dict[str, Any]] = []
    for i in range(5):
        x = f"{x0 + width * i / 4:.1f}"
        out.append({"kind": "line", "x1": x, "y1": top, "x2": x, "y2": bottom, "stroke": GRID})
        out.append(_text(x, bottom + 14, f"{vmax * i / 4:g}", anchor="middle", fill=MUTED))
    out.append(_text(f"{x0 + width:.1f}", bottom + 28, unit, anchor="end", fill=MUTED))
    return out


def bar_chart(
    title: str,
    groups: Sequence[tuple[str, Sequence[tuple[str, float | None, bool]]]],
    series: Sequence[str],
    unit: str = "tok/s",
) -> Chart:
    """Horizontal grouped bars: one group per label, one bar per (series, value, failed)."""
    colour = {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(series)}
    values = [v for _, bars in groups for _, v, _ in bars if v is not None]
    vmax = _nice_max(max(values, default=0.0) * 1.08)  # room for the value label
    plot_w = CHART_WIDTH - LABEL_WIDTH - 20
    y, top = 8.0, 8.0
    body: list[dict[str, Any]] = []
    for label, bars in groups:
        h = len(bars) * (BAR_HEIGHT + BAR_GAP)
        body.append(
            _text(LABEL_WIDTH - 8, f"{y + h / 2 + 4:.1f}", _short(label), anchor="end", title=label)
        )
        for name, v, failed in bars:
            tip = f"{label} {name}: {_fmt(v)} {unit}" + (" (case failed)" if failed else "")
            text_y = y + BAR_HEIGHT - 4
            if v is None:
                body.append(_text(LABEL_WIDTH + 4, text_y, "- no figure", fill=MUTED, title=tip))
            else:
                w = max(plot_w * v / vmax, 1.0)
                bar = {"kind": "rect", "x": LABEL_WIDTH, "y": f"{y:.1f}", "width": f"{w:.1f}"}
                bar |= {"height": BAR_HEIGHT, "fill": colour[name], "title": tip}
                if failed:
                    bar |= {"stroke": BAD, "stroke_width": 2}
                body.append(bar)
                value = f"{v:.2f}" + (" FAILED" if failed else "")
                fill = {"fill": BAD} if failed else {}
                body.append(_text(f"{LABEL_WIDTH + w + 4:.1f}", text_y, value, **fill))
            y += BAR_HEIGHT + BAR_GAP
        y += GROUP_GAP
    chart = Chart(title, f"{y + 30:.0f}")
    chart.elements = _axis(LABEL_WIDTH, plot_w, top, y - GROUP_GAP, vmax, unit) + body
    if len(series) > 1:
        chart.legend = [_swatch(s, colour[s]) for s in series]
    return chart


def delta_chart(title: str, items: Sequence[tuple[str, float | None]]) -> Chart:
    """Diverging horizontal bars around 0%: green right for faster, red left for slower."""
    values = [abs(v) for _, v in items if v is not None]
    vmax = _nice_max(max(values, default=0.0) * 1.15)
    plot_w = CHART_WIDTH - LABEL_WIDTH - 20
    mid = LABEL_WIDTH + plot_w / 2
    y = 8.0
    body: list[dict[str, Any]] = []
    for label, v in items:
        text_y = y + BAR_HEIGHT - 4
        body.append(_text(LABEL_WIDTH - 8, text_y, _short(label), anchor="end", title=label))
        if v is None:
            body.append(_text(f"{mid + 4:.1f}", text_y, "- no pair", fill=MUTED))
        else:
            w = plot_w / 2 * abs(v) / vmax
            x = mid if v >= 0 else mid - w
            tx, anchor = (mid + w + 4, "start") if v >= 0 else (mid - w - 4, "end")
            bar = {"kind": "rect", "x": f"{x:.1f}", "y": f"{y:.1f}", "width": f"{max(w, 1.0):.1f}"}
            bar |= {"height": BAR_HEIGHT, "fill": GOOD if v >= 0 else BAD}
            body.append(bar | {"title": f"{label}: {v:+.2f}%"})
            body.append(_text(f"{tx:.1f}", text_y, f"{v:+.2f}%", anchor=anchor))
        y += BAR_HEIGHT + BAR_GAP + 2
    bottom = y
    ticks: list[dict[str, Any]] = []
    for i in range(-2, 3):
        x = f"{mid + plot_w / 2 * i / 2:.1f}"
        stroke = ZERO if i == 0 else GRID
        ticks.append({"kind": "line", "x1": x, "y1": 8, "x2": x, "y2": f"{bottom:.1f}"})
        ticks[-1]["stroke"] = stroke
        label = f"{vmax * i / 2:+g}%"
        ticks.append(_text(x, f"{bottom + 14:.1f}", label, anchor="middle", fill=MUTED))
    return Chart(title, f"{bottom + 24:.0f}", ticks + body)


def line_chart(
    title: str,
    xlabels: Sequence[tuple[str, str]],
    series: Sequence[tuple[str, Sequence[float | None]]],
    tips: Sequence[Sequence[str]],
    unit: str,
) -> Chart:
    """Lines over runs; xlabels are (tick text, full run id), tips one hover text per point.

    A missing point (case absent or without that workload) breaks its line. The y axis spans
    the observed values and 0, padded; a zero line is drawn darker.
    """
    left, right, top, plot_h = 120, 20, 10, 260  # left: room for the rotated first date
    plot_w = CHART_WIDTH - left - right
    values = [v for _, vs in series for v in vs if v is not None]
    lo, hi = min([*values, 0.0]), max([*values, 0.0])
    # Round ticks (1/2/2.5/5 × 10^k apart) with at least half a step of air at both ends.
    raw = max((hi - lo) / 4, 0.25)
    exp = 10 ** math.floor(math.log10(raw))
    step = next(m * exp for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * exp >= raw)
    lo = step * math.floor(lo / step - 0.5)
    hi = step * math.ceil(hi / step + 0.5)
    n = len(xlabels)

    def px(i: int) -> str:
        return f"{left + (plot_w * i / (n - 1) if n > 1 else plot_w / 2):.1f}"

    def py(v: float) -> str:
        return f"{top + plot_h * (1 - (v - lo) / (hi - lo)):.1f}"

    def rule(v: float, stroke: str) -> dict[str, Any]:
        y = py(v)
        return {"kind": "line", "x1": left, "y1": y, "x2": left + plot_w, "y2": y, "stroke": stroke}

    out: list[dict[str, Any]] = []
    for k in range(round((hi - lo) / step) + 1):
        v = lo + step * k
        out.append(rule(v, GRID))
        label = "0" if abs(v) < step / 1e6 else f"{v:+g}"
        y = f"{top + plot_h * (1 - (v - lo) / (hi - lo)) + 4:.1f}"
        out.append(_text(left - 6, y, label, anchor="end", fill=MUTED))
    out.append(rule(0.0, ZERO))
    bottom = top + plot_h
    for i, (tick, full) in enumerate(xlabels):
        turn = f"rotate(-30 {px(i)} {bottom + 14})"
        out.append(_text(px(i), bottom + 14, tick, anchor="end", fill=MUTED, transform=turn))
        out[-1]["title"] = full
    chart = Chart(title, str(bottom + 80), note=f"{unit}. Hover a point for its run and tok/s.")
    for si, ((name, vs), tip) in enumerate(zip(series, tips, strict=True)):
        colour = PALETTE[si % len(PALETTE)]
        dash = DASHES[(si // len(PALETTE)) % len(DASHES)]
        chart.legend.append(_swatch(name, colour, dash))
        segments: list[list[str]] = [[]]
        for i, v in enumerate(vs):
            if v is None:
                segments.append([])
                continue
            segments[-1].append(f"{px(i)},{py(v)}")
            out.append({"kind": "circle", "cx": px(i), "cy": py(v), "r": 3, "fill": colour})
            out[-1]["title"] = tip[i]
        out += [
            {"kind": "polyline", "points": " ".join(s), "stroke": colour, "dash": dash}
            for s in segments
            if len(s) > 1
        ]
    chart.elements = out
    return chart


# --------------------------------------------------------------------------- page sections


def _topology_table(run: Run, metric: str) -> dict[str, Any]:
    """The seeds' table (Model | TP | DCP | MTP | [Variant] | columns | Errors | Status)."""
    multi = len(run.variants) > 1
    header = ["Model", "TP", "DCP", "MTP"] + (["Variant"] if multi else [])
    header += [name for name, _ in run.columns] + ["Errors"]
    rows = []
    for r in run.ordered:
        cells: list[Any] = [r.model, r.tp, r.dcp, r.mtp] + ([r.variant] if multi else [])
        cells += [_fmt(r.mean_of(name, metric)) for name, _ in run.columns] + [r.errors]
        rows.append({"cells": cells, "passed": r.passed})
    return {"header": header, "rows": rows}


def _throughput_charts(run: Run) -> list[Chart]:
    topologies: dict[str, dict[str, CaseResult]] = {}
    for r in run.ordered:
        topologies.setdefault(r.topology_id, {})[r.variant] = r
    out = []
    for name, _ in run.columns:
        groups = [
            (
                topo,
                [(v, by_v[v].mean_of(name), not by_v[v].passed) for v in run.variants if v in by_v],
            )
            for topo, by_v in topologies.items()
        ]
        out.append(bar_chart(f"{name}: aggregate output tok/s per topology", groups, run.variants))
    return out


def _delta_charts(run: Run) -> list[Chart]:
    by_pair: dict[tuple[str, str], list[tuple[str, float | None]]] = {}
    for d in paired_deltas(run):
        item = (f"{d.topology_id} {d.workload or d.column}", d.delta_pct)
        by_pair.setdefault((d.baseline, d.candidate), []).append(item)
    return [
        delta_chart(f"{cand} vs {base}: aggregate tok/s delta", items)
        for (base, cand), items in by_pair.items()
    ]


def _paired_table(run: Run) -> dict[str, Any]:
    """The paired deltas as a table, each with the samples its two figures stand on."""
    header = ["Topology", "Workload", "Baseline", "Candidate", "Baseline tok/s",
              "Candidate tok/s", "Delta", "Samples each"]  # fmt: skip
    body = [
        [d.topology_id, d.workload or d.column, d.baseline, d.candidate, _fmt(d.baseline_tok_s),
         _fmt(d.candidate_tok_s), "-" if d.delta_pct is None else f"{d.delta_pct:+.2f}%",
         d.samples or "-"]
        for d in paired_deltas(run)
    ]  # fmt: skip
    return {"header": header, "body": body}


def _run_label(run: Run) -> str:
    created = str(run.manifest.created_at or "")
    return created[:16].replace("T", " ") if created else str(run.manifest.run_id)


def _trend(run: Run, history: Sequence[Run]) -> tuple[int, list[Chart]]:
    """(runs shown, one chart per workload column); no runs without two of them."""
    # The current run is the last point; it is added if the caller's history left it out.
    current = run.root.resolve()
    runs = [h for h in history if h.root.resolve() != current] + [run]
    runs.sort(key=lambda h: str(h.manifest.created_at or ""))
    runs = runs[-MAX_TREND_RUNS:]
    if len(runs) < 2:
        return 0, []
    xlabels = [(_run_label(h), str(h.manifest.run_id)) for h in runs]
    by_run = [{r.case_id: r for r in h.results} for h in runs]
    charts = []
    # Relative to each case's first run in the window: absolute tok/s of 60-125 on one axis
    # flatten a 5% regression into a pixel; as % change every case's drift reads the same.
    for name, _ in run.columns:
        series, tips = [], []
        for cid in run.manifest.case_ids:
            absolute = [rows[cid].mean_of(name) if cid in rows else None for rows in by_run]
            first = next((i for i, v in enumerate(absolute) if v), None)
            if first is None:
                continue
            v0 = absolute[first]
            rel = [None if v is None else 100.0 * (v / v0 - 1.0) for v in absolute]
            series.append((cid, rel))
            tips.append(
                [
                    f"{cid} {xlabels[i][1]}: {_fmt(v)} tok/s"
                    + ("" if r is None else f" ({r:+.2f}% vs {xlabels[first][1]})")
                    for i, (v, r) in enumerate(zip(absolute, rel, strict=True))
                ]
            )
        if series:
            charts.append(
                line_chart(
                    f"{name}: aggregate output tok/s per case, change since its first run",
                    xlabels,
                    series,
                    tips,
                    unit="% change of aggregate tok/s against the case's first run shown",
                )
            )
    return len(runs), charts


def _profile(run: Run) -> dict[str, Any]:
    """The decode profile as the template shows it: each pair's table, sentences and ranks,
    or the profiled cases' rows where nothing is paired (orchestrator.reports.profile)."""
    from orchestrator.reports.profile import case_profile_rows, profile_pairs

    pairs = [
        {
            "title": f"{p.topology_id}: {p.baseline} vs {p.candidate}",
            "header": ["Metric", p.baseline.title(), p.candidate.title(), "Delta"],
            "rows": p.table(),
            "sentences": [p.identity(), p.sync(), p.paths() + "."],
            "ranks": p.per_rank(),
            "families": p.family_table(),
            "family_notes": p.family_notes(),
        }
        for p in profile_pairs(run.ordered, run.variants, run.root)
    ]
    header, body = ([], []) if pairs else case_profile_rows(run.ordered)
    return {"pairs": pairs, "header": header, "rows": body}


def _ab(run: Run) -> Any:
    """The A/B tables, design and evidence chain (orchestrator.reports.ab_section), or None."""
    from orchestrator.reports.ab_section import ab_section

    return ab_section(run)


def _page(run: Run, history: Sequence[Run], comparison: Comparison | None) -> dict[str, Any]:
    """Everything the template shows, computed: the run's figures, tables and charts."""
    m = run.manifest
    ordered = run.ordered
    failed = [r for r in ordered if not r.passed]
    latency_header, latency_body = latency_table(run)
    trend_runs, trend_charts = _trend(run, history)
    listed = findings(run)
    ab = _ab(run)
    return {
        "run_id": run.run_id,
        "status": "bad" if failed else "warn" if len(ordered) < len(m.cases) else "ok",
        "interrupted": interrupted_sentence(run),
        "matrix_path": m.matrix_path or "",
        "matrix_name": m.matrix.get("name", ""),
        "created_at": m.created_at or "-",
        "finished": len(ordered),
        "total": len(m.cases),
        "versions": {name: m.version(name) for name in ("vllm", "fusedq", "torch", "ray")},
        "commit": m.commit,
        "corrections": [c.sentence() for c in run.corrections],
        "warning": exposure_warning(run),
        "comparison": comparison,
        "tables": [_topology_table(run, "aggregate_tok_s"), _topology_table(run, "per_user_tok_s")],
        "throughput_charts": _throughput_charts(run) if ordered else [],
        "latency": {
            "note": LATENCY_NOTE,
            "stats_note": STATS_NOTE,
            "header": latency_header,
            "body": latency_body,
            "bursty": bursty(run),
        },
        "workloads": [{"title": w.title, "text": w.describe()} for w in workload_defs(run)],
        "totals": dict(zip(("header", "body"), totals_table(run), strict=True)),
        "ab": ab,
        # An A/B's section supersedes the one-server deltas of the paired table and chart.
        "paired": _paired_table(run) if ab is None else {"header": [], "body": []},
        "paired_note": interpreted_note(run),
        "delta_charts": [] if ab is not None else _delta_charts(run),
        "token_checks": token_checks(run),
        "profile": _profile(run),
        "trend_runs": trend_runs,
        "trend_charts": trend_charts,
        "failed": failed,
        "audit_sentence": audit_sentence(run.results),
        "findings": listed[:MAX_FINDINGS],
        "more_findings": max(0, len(listed) - MAX_FINDINGS),
    }


def render_html(
    run: Run,
    history: Sequence[Run] | None = None,
    comparison: Comparison | None = None,
) -> str:
    """The whole page as a string; `history` adds the trend, `comparison` its verdict."""
    template = _ENV.get_template("report.html.j2")
    return template.render(page=_page(run, history or [], comparison))


def write_html(
    run: Run,
    history: Sequence[Run] | None = None,
    comparison: Comparison | None = None,
) -> Path:
    """(Re)write report.html in the run directory and return its path."""
    path = run.root / REPORT_HTML
    write_text_atomic(path, render_html(run, history, comparison))
    return path
