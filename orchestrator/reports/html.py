"""`report.html`: one self-contained page per run that a person reads in the morning.

The page holds the seeds' topology tables, inline SVG bar charts of aggregate tok/s per
topology (one per workload column, e.g. ctx0 and ctx64k), a chart of paired-variant deltas
when the matrix has two or more variants, a trend chart over earlier runs when a history is
given (``orchestrator nightly`` passes it), an optional comparison verdict, and the audit
findings with their log excerpts.

Self-contained on purpose: the file is mailed, attached to CI jobs and opened from shared
disks on machines without network, so there are no scripts, fonts, stylesheets or images
from elsewhere; charts are SVG generated here and the page has no JavaScript at all.

Every string that came from a log, a matrix or a run (finding text, reasons, labels, ids) is
HTML-escaped and stripped of control characters: a log line is attacker-controlled text.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.reports.run import (
    LATENCY_NOTE,
    PairedDelta,
    Run,
    audit_sentence,
    findings,
    paired_deltas,
    token_checks,
)
from orchestrator.reports.run import fmt_tok as _fmt
from orchestrator.reports.summary import latency_table
from orchestrator.results import CaseResult, Finding
from orchestrator.store import write_text_atomic

if TYPE_CHECKING:
    from orchestrator.compare import Comparison

HTML_NAME = "report.html"

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
GOOD, BAD, MUTED = "#2e7d32", "#c62828", "#757575"

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

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
  margin:24px auto;max-width:1320px;padding:0 16px;color:#212121;background:#fff}
h1{font-size:22px;margin:0 0 6px}h2{font-size:18px;margin:28px 0 8px;border-bottom:1px solid #ddd}
h3{font-size:15px;margin:18px 0 6px}
table{border-collapse:collapse;margin:6px 0 12px;font-variant-numeric:tabular-nums}
th,td{border:1px solid #d0d0d0;padding:3px 9px;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}
.pill{display:inline-block;padding:1px 9px;border-radius:10px;color:#fff;font-weight:600}
.ok{background:#2e7d32}.bad{background:#c62828}.warn{background:#ef6c00}.muted{color:#757575}
.sev-warning{background:#ef6c00}.sev-fatal{background:#c62828}.sev-quarantine-node{background:#6a1b9a}
.legend{display:flex;flex-wrap:wrap;gap:4px 14px;margin:2px 0 6px;font-size:12px}
.legend span.sw{display:inline-block;width:12px;height:12px;margin-right:4px;vertical-align:-1px}
.finding{border:1px solid #ddd;border-radius:4px;margin:8px 0;padding:6px 10px}
.finding .where{font-family:ui-monospace,"DejaVu Sans Mono",monospace;font-size:12px}
pre.excerpt{background:#f7f7f7;border:1px solid #e0e0e0;padding:6px 8px;overflow-x:auto;
  font:12px/1.4 ui-monospace,"DejaVu Sans Mono",monospace;margin:4px 0;white-space:pre}
pre.excerpt mark{background:#ffe0b2;display:inline-block;min-width:100%}
svg{display:block;max-width:100%;height:auto}
svg text{font:12px system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif}
"""


def _e(value: Any) -> str:
    """Escape for HTML text and attribute values, control characters removed."""
    return html.escape(_CONTROL_RE.sub("", str(value)), quote=True)


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


def _legend(items: Sequence[tuple[str, str, str]]) -> str:
    """HTML legend of (name, colour, dash) swatches; HTML wraps long legends, SVG would not."""
    spans = []
    for name, colour, dash in items:
        style = f"background:{colour}" if not dash else f"border-top:3px dashed {colour}"
        spans.append(f'<span><span class="sw" style="{style}"></span>{_e(name)}</span>')
    return f'<div class="legend">{"".join(spans)}</div>'


def _axis(x0: float, width: float, top: float, bottom: float, vmax: float, unit: str) -> str:
    parts = []
    for i in range(5):
        v = vmax * i / 4
        x = x0 + width * i / 4
        parts.append(
            f'<line x1="{x:.1f}" y1="{top}" x2="{x:.1f}" y2="{bottom}" stroke="#e0e0e0"/>'
            f'<text x="{x:.1f}" y="{bottom + 14}" text-anchor="middle" fill="{MUTED}">'
            f"{v:g}</text>"
        )
    parts.append(
        f'<text x="{x0 + width:.1f}" y="{bottom + 28}" text-anchor="end" fill="{MUTED}">'
        f"{_e(unit)}</text>"
    )
    return "".join(parts)


def bar_chart(
    title: str,
    groups: Sequence[tuple[str, Sequence[tuple[str, float | None, bool]]]],
    series: Sequence[str],
    unit: str = "tok/s",
) -> str:
    """Horizontal grouped bars: one group per label, one bar per (series, value, failed)."""
    colour = {s: PALETTE[i % len(PALETTE)] for i, s in enumerate(series)}
    values = [v for _, bars in groups for _, v, _ in bars if v is not None]
    vmax = _nice_max(max(values, default=0.0) * 1.08)  # room for the value label
    plot_w = CHART_WIDTH - LABEL_WIDTH - 20
    y, top = 8.0, 8.0
    body = []
    for label, bars in groups:
        h = len(bars) * (BAR_HEIGHT + BAR_GAP)
        body.append(
            f'<text x="{LABEL_WIDTH - 8}" y="{y + h / 2 + 4:.1f}" text-anchor="end">'
            f"<title>{_e(label)}</title>{_e(_short(label))}</text>"
        )
        for name, v, failed in bars:
            tip = f"{label} {name}: {_fmt(v)} {unit}" + (" (case failed)" if failed else "")
            if v is None:
                body.append(
                    f'<text x="{LABEL_WIDTH + 4}" y="{y + BAR_HEIGHT - 4}" fill="{MUTED}">'
                    f"<title>{_e(tip)}</title>- no figure</text>"
                )
            else:
                w = max(plot_w * v / vmax, 1.0)
                stroke = f' stroke="{BAD}" stroke-width="2"' if failed else ""
                body.append(
                    f'<rect x="{LABEL_WIDTH}" y="{y:.1f}" width="{w:.1f}" height="{BAR_HEIGHT}" '
                    f'fill="{colour[name]}"{stroke}><title>{_e(tip)}</title></rect>'
                    f'<text x="{LABEL_WIDTH + w + 4:.1f}" y="{y + BAR_HEIGHT - 4}"'
                    f"{f' fill={chr(34)}{BAD}{chr(34)}' if failed else ''}>"
                    f"{v:.2f}{' FAILED' if failed else ''}</text>"
                )
            y += BAR_HEIGHT + BAR_GAP
        y += GROUP_GAP
    height = y + 30
    axis = _axis(LABEL_WIDTH, plot_w, top, y - GROUP_GAP, vmax, unit)
    svg = (
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{CHART_WIDTH}" height="{height:.0f}" '
        f'viewBox="0 0 {CHART_WIDTH} {height:.0f}" role="img" aria-label="{_e(title)}">'
        f"{axis}{''.join(body)}</svg>"
    )
    legend = _legend([(s, colour[s], "") for s in series]) if len(series) > 1 else ""
    return f"<h3>{_e(title)}</h3>{legend}{svg}"


def delta_chart(title: str, items: Sequence[tuple[str, float | None]]) -> str:
    """Diverging horizontal bars around 0%: green right for faster, red left for slower."""
    values = [abs(v) for _, v in items if v is not None]
    vmax = _nice_max(max(values, default=0.0) * 1.15)
    plot_w = CHART_WIDTH - LABEL_WIDTH - 20
    mid = LABEL_WIDTH + plot_w / 2
    y, body = 8.0, []
    for label, v in items:
        body.append(
            f'<text x="{LABEL_WIDTH - 8}" y="{y + BAR_HEIGHT - 4}" text-anchor="end">'
            f"<title>{_e(label)}</title>{_e(_short(label))}</text>"
        )
        if v is None:
            body.append(
                f'<text x="{mid + 4:.1f}" y="{y + BAR_HEIGHT - 4}" fill="{MUTED}">- no pair</text>'
            )
        else:
            w = plot_w / 2 * abs(v) / vmax
            x = mid if v >= 0 else mid - w
            fill = GOOD if v >= 0 else BAD
            tx, anchor = (mid + w + 4, "start") if v >= 0 else (mid - w - 4, "end")
            body.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{max(w, 1.0):.1f}" height="{BAR_HEIGHT}" '
                f'fill="{fill}"><title>{_e(label)}: {v:+.2f}%</title></rect>'
                f'<text x="{tx:.1f}" y="{y + BAR_HEIGHT - 4}" text-anchor="{anchor}">'
                f"{v:+.2f}%</text>"
            )
        y += BAR_HEIGHT + BAR_GAP + 2
    bottom = y
    ticks = []
    for i in range(-2, 3):
        x = mid + plot_w / 2 * i / 2
        ticks.append(
            f'<line x1="{x:.1f}" y1="8" x2="{x:.1f}" y2="{bottom:.1f}" '
            f'stroke="{"#9e9e9e" if i == 0 else "#e0e0e0"}"/>'
            f'<text x="{x:.1f}" y="{bottom + 14:.1f}" text-anchor="middle" fill="{MUTED}">'
            f"{vmax * i / 2:+g}%</text>"
        )
    height = bottom + 24
    return (
        f"<h3>{_e(title)}</h3>"
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{CHART_WIDTH}" height="{height:.0f}" '
        f'viewBox="0 0 {CHART_WIDTH} {height:.0f}" role="img" aria-label="{_e(title)}">'
        f"{''.join(ticks)}{''.join(body)}</svg>"
    )


def line_chart(
    title: str,
    xlabels: Sequence[tuple[str, str]],
    series: Sequence[tuple[str, Sequence[float | None]]],
    tips: Sequence[Sequence[str]],
    unit: str,
) -> str:
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

    def px(i: int) -> float:
        return left + (plot_w * i / (n - 1) if n > 1 else plot_w / 2)

    def py(v: float) -> float:
        return top + plot_h * (1 - (v - lo) / (hi - lo))

    parts = []
    for k in range(round((hi - lo) / step) + 1):
        v = lo + step * k
        parts.append(
            f'<line x1="{left}" y1="{py(v):.1f}" x2="{left + plot_w}" y2="{py(v):.1f}" '
            f'stroke="#e0e0e0"/><text x="{left - 6}" y="{py(v) + 4:.1f}" text-anchor="end" '
            f'fill="{MUTED}">{"0" if abs(v) < step / 1e6 else f"{v:+g}"}</text>'
        )
    parts.append(
        f'<line x1="{left}" y1="{py(0.0):.1f}" x2="{left + plot_w}" y2="{py(0.0):.1f}" '
        'stroke="#9e9e9e"/>'
    )
    bottom = top + plot_h
    for i, (tick, full) in enumerate(xlabels):
        parts.append(
            f'<text x="{px(i):.1f}" y="{bottom + 14}" text-anchor="end" fill="{MUTED}" '
            f'transform="rotate(-30 {px(i):.1f} {bottom + 14})"><title>{_e(full)}</title>'
            f"{_e(tick)}</text>"
        )
    legend = []
    for si, ((name, vs), tip) in enumerate(zip(series, tips, strict=True)):
        colour = PALETTE[si % len(PALETTE)]
        dash = DASHES[(si // len(PALETTE)) % len(DASHES)]
        legend.append((name, colour, dash))
        dash_attr = f' stroke-dasharray="{dash}"' if dash else ""
        segment: list[str] = []
        segments = [segment]
        for i, v in enumerate(vs):
            if v is None:
                segment = []
                segments.append(segment)
                continue
            segment.append(f"{px(i):.1f},{py(v):.1f}")
            parts.append(
                f'<circle cx="{px(i):.1f}" cy="{py(v):.1f}" r="3" fill="{colour}">'
                f"<title>{_e(tip[i])}</title></circle>"
            )
        parts += [
            f'<polyline points="{" ".join(s)}" fill="none" stroke="{colour}" '
            f'stroke-width="2"{dash_attr}/>'
            for s in segments
            if len(s) > 1
        ]
    height = bottom + 80
    return (
        f"<h3>{_e(title)}</h3>{_legend(legend)}"
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{CHART_WIDTH}" height="{height}" '
        f'viewBox="0 0 {CHART_WIDTH} {height}" role="img" aria-label="{_e(title)}">'
        f"{''.join(parts)}</svg>"
        f'<p class="muted">{_e(unit)}. Hover a point for its run and tok/s.</p>'
    )


# --------------------------------------------------------------------------- page sections


def _table(header: Sequence[str], body: Sequence[Sequence[str]], left: int) -> str:
    """An HTML table of already-escaped cells; the first `left` columns are text, left-aligned."""
    th = "".join(f"<th{' class=l' if i < left else ''}>{h}</th>" for i, h in enumerate(header))
    rows = [
        "<tr>"
        + "".join(f"<td{' class=l' if i < left else ''}>{c}</td>" for i, c in enumerate(r))
        + "</tr>"
        for r in body
    ]
    return f"<table><thead><tr>{th}</tr></thead><tbody>{''.join(rows)}</tbody></table>"


def topology_table_html(run: Run, metric: str) -> str:
    """The seeds' table (Model | TP | DCP | MTP | [Variant] | columns | Errors | Status)."""
    cols = run.columns
    multi = len(run.variants) > 1
    header = ["Model", "TP", "DCP", "MTP"] + (["Variant"] if multi else [])
    header = [_e(h) for h in header] + [_e(c) for _, c in cols] + ["Errors", "Status"]
    body = []
    for r in run.ordered:
        line = [_e(r.model), _e(r.tp), _e(r.dcp), _e(r.mtp)]
        if multi:
            line.append(_e(r.variant))
        line += [_e(_fmt(r.mean_of(name, metric))) for name, _ in cols]
        line += [
            _e(r.errors),
            '<span class="pill ok">ok</span>'
            if r.passed
            else '<span class="pill bad">FAILED</span>',
        ]
        body.append(line)
    return _table(header, body, left=1)


def _latency_section(run: Run) -> str:
    header, body = latency_table(run)
    if not body:
        return ""
    table = _table([_e(h) for h in header], [[_e(c) for c in r] for r in body], left=2)
    return f"<h2>Latency per request (ms)</h2><p>{_e(LATENCY_NOTE)}</p>{table}"


def _throughput_charts(run: Run) -> str:
    variants = run.variants
    ordered = run.ordered
    if not ordered:
        return '<p class="muted">No case has finished yet.</p>'
    topologies: dict[str, dict[str, CaseResult]] = {}
    for r in ordered:
        topologies.setdefault(r.topology_id, {})[r.variant] = r
    out = []
    for name, column in run.columns:
        groups = [
            (
                topo,
                [(v, by_v[v].mean_of(name), not by_v[v].passed) for v in variants if v in by_v],
            )
            for topo, by_v in topologies.items()
        ]
        out.append(bar_chart(f"{column}: aggregate output tok/s per topology", groups, variants))
    return "".join(out)


def _delta_section(run: Run) -> str:
    deltas = paired_deltas(run)
    if not deltas:
        return ""
    by_pair: dict[tuple[str, str], list[PairedDelta]] = {}
    for d in deltas:
        by_pair.setdefault((d.baseline, d.candidate), []).append(d)
    out = ["<h2>Paired variants</h2>"]
    for (base, cand), ds in by_pair.items():
        items = [(f"{d.topology_id} {d.column}", d.delta_pct) for d in ds]
        out.append(delta_chart(f"{cand} vs {base}: aggregate tok/s delta", items))
    return "".join(out)


def _tokens_section(run: Run) -> str:
    """The same_tokens checks (orchestrator/tokens.py), one line each, as report.md has them."""
    items = [
        f"<li>{_e(topo)} {_e(w)}: <b>{_e(verdict)}</b> &mdash; {_e(sentence)}</li>"
        for topo, w, verdict, sentence in token_checks(run)
    ]
    if not items:
        return ""
    return "<h2>Same tokens (greedy, request by request)</h2><ul>" + "".join(items) + "</ul>"


def _run_label(run: Run) -> str:
    created = str(run.manifest.created_at or "")
    return created[:16].replace("T", " ") if created else str(run.manifest.run_id)


def _trend_section(run: Run, history: Sequence[Run]) -> str:
    # The current run is the last point; it is added if the caller's history left it out.
    current = run.root.resolve()
    runs = [h for h in history if h.root.resolve() != current] + [run]
    runs.sort(key=lambda h: str(h.manifest.created_at or ""))
    runs = runs[-MAX_TREND_RUNS:]
    if len(runs) < 2:
        return ""
    xlabels = [(_run_label(h), str(h.manifest.run_id)) for h in runs]
    by_run = [{r.case_id: r for r in h.results} for h in runs]
    out = [f"<h2>Trend over {len(runs)} runs</h2>"]
    # Relative to each case's first run in the window: absolute tok/s of 60-125 on one axis
    # flatten a 5% regression into a pixel; as % change every case's drift reads the same.
    for name, column in run.columns:
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
            out.append(
                line_chart(
                    f"{column}: aggregate output tok/s per case, change since its first run",
                    xlabels,
                    series,
                    tips,
                    unit="% change of aggregate tok/s against the case's first run shown",
                )
            )
    return "".join(out)


def _comparison_section(comparison: Comparison) -> str:
    pill = (
        '<span class="pill ok">no regression</span>'
        if comparison.ok
        else '<span class="pill bad">REGRESSION</span>'
    )
    out = [
        f"<h2>Comparison with {_e(comparison.base_run)}</h2><p>{pill} {_e(comparison.verdict())}</p>"
    ]
    if comparison.regressions:
        out.append("<ul>")
        out += [f"<li><b>{_e(r.case_id)}</b>: {_e(r.message)}</li>" for r in comparison.regressions]
        out.append("</ul>")
    if comparison.new_findings:
        out.append("<h3>New findings</h3><ul>")
        out += [
            f'<li>{_e(f.case_id)}: <span class="pill sev-{_e(f.severity)}">{_e(f.severity)}</span> '
            f"<code>{_e(f.signature)}</code> {_e(f.location)}: <code>{_e(f.text)}</code></li>"
            for f in comparison.new_findings
        ]
        out.append("</ul>")
    if comparison.cleared_findings:
        out.append("<h3>Cleared findings</h3><ul>")
        out += [
            f"<li>{_e(f.case_id)}: <code>{_e(f.signature)}</code> ({_e(f.severity)})</li>"
            for f in comparison.cleared_findings
        ]
        out.append("</ul>")
    return "".join(out)


def _finding_html(case_id: str, f: Finding) -> str:
    sev = str(f.severity or "")
    lines = [_e(x) for x in f.context_before]
    lines.append(f"<mark>{_e(f.text)}</mark>")
    lines += [_e(x) for x in f.context_after]
    notes = "".join(
        f'<div class="muted">{label}: {_e(value)}</div>'
        for value, label in ((f.meaning, "Meaning"), (f.action, "Action"))
        if value
    )
    return (
        f'<div class="finding"><div><span class="pill sev-{_e(sev)}">{_e(sev)}</span> '
        f"<b>{_e(case_id)}</b> <code>{_e(f.signature)}</code> "
        f"({_e(f.category)})</div>"
        f'<div class="where">{_e(f.location())}</div>'
        f'<pre class="excerpt">{chr(10).join(lines)}</pre>{notes}</div>'
    )


def _audit_section(run: Run) -> str:
    out = ["<h2>Log audit</h2>", f"<p>{_e(audit_sentence(run.results))}</p>"]
    listed = findings(run)
    out += [_finding_html(cid, f) for cid, f in listed[:MAX_FINDINGS]]
    if len(listed) > MAX_FINDINGS:
        out.append(
            f'<p class="muted">{len(listed) - MAX_FINDINGS} more findings are in each '
            "case's audit.json.</p>"
        )
    return "".join(out)


def render_html(
    run: Run,
    history: Sequence[Run] | None = None,
    comparison: Comparison | None = None,
) -> str:
    """The whole page as a string; `history` adds the trend, `comparison` its verdict."""
    m = run.manifest
    ordered = run.ordered
    failed = [r for r in ordered if not r.passed]
    status = (
        '<span class="pill bad">FAILED</span>'
        if failed
        else '<span class="pill warn">incomplete</span>'
        if len(ordered) < len(m.cases)
        else '<span class="pill ok">all passed</span>'
    )
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        '<meta name="viewport" content="width=device-width, initial-scale=1">',
        f"<title>Run {_e(run.run_id)}</title><style>{_CSS}</style></head><body>",
        f"<h1>Run {_e(run.run_id)} {status}</h1>",
        f"<p>Matrix <code>{_e(m.matrix_path or '')}</code> "
        f"({_e(m.matrix.get('name', ''))}), created {_e(m.created_at or '-')}; "
        f"{len(ordered)}/{len(m.cases)} cases finished, {len(failed)} failed. "
        f"vLLM {_e(m.version('vllm'))}, fusedq {_e(m.version('fusedq'))}, "
        f"torch {_e(m.version('torch'))}, Ray {_e(m.version('ray'))}, "
        f"commit <code>{_e(m.commit)}</code>.</p>",
    ]
    if comparison is not None:
        parts.append(_comparison_section(comparison))
    parts += [
        "<h2>Aggregate output tok/s</h2>",
        "<p>Mean over repeats of aggregate output tok/s; every long-context case includes the "
        "prefill-to-decode transition. Servers were measured one at a time.</p>",
        topology_table_html(run, "aggregate_tok_s"),
        _throughput_charts(run),
        "<h2>Active per-user output tok/s (time to first token excluded)</h2>",
        topology_table_html(run, "per_user_tok_s"),
        _latency_section(run),
        _delta_section(run),
        _tokens_section(run),
        _trend_section(run, history or []),
    ]
    if failed:
        # A reason is its root cause, what happened and the log's last lines: preformatted,
        # or the lines run together into one paragraph.
        parts.append("<h2>Failed cases</h2><ul>")
        parts += [
            f'<li><b>{_e(r.case_id)}</b><pre class="excerpt reason">{_e(r.reason)}</pre></li>'
            for r in failed
        ]
        parts.append("</ul>")
    parts += [_audit_section(run), "</body></html>"]
    return "\n".join(p for p in parts if p) + "\n"


def write_html(
    run: Run,
    history: Sequence[Run] | None = None,
    comparison: Comparison | None = None,
) -> Path:
    """(Re)write report.html in the run directory and return its path."""
    path = run.root / HTML_NAME
    write_text_atomic(path, render_html(run, history, comparison))
    return path
