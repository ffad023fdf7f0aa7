"""`orchestrator compare`'s output: a ``Comparison`` (orchestrator.analysis.compare) as Markdown,
the page a person reads, and as JSON, the same verdict and figures for machines (``--json``,
nightly's compare.json).
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from orchestrator.analysis.compare import (
    CaseRow,
    Comparison,
    FindingChange,
    Judgement,
    MetricDelta,
)
from orchestrator.analysis.stats import MIN_REPEATS, TOO_FEW
from orchestrator.common.mdtable import md_table
from orchestrator.reports.run import fmt_tok as _fmt

THROUGHPUT_HEADER = [
    "Case",
    "Workload",
    "Aggregate base",
    "Aggregate cand",
    "Δ aggregate",
    "95% interval",
    "Per-user base",
    "Per-user cand",
    "Δ per-user",
    "Status",
]

_METHOD_NOTE = (
    "95% interval: of the change in aggregate tok/s, Fieller's over each run's repeats, "
    "with each repeat's requests as a floor under its noise (docs/statistics.md); over server "
    "starts for an A/B matrix's cases. A regression "
    "is a drop whose whole interval lies past the threshold; a run with fewer than "
    f"{MIN_REPEATS} repeats of a workload gives it no interval."
)


# --------------------------------------------------------------------------- JSON


def comparison_json(cmp: Comparison) -> dict[str, Any]:
    """The comparison as ``orchestrator compare --json`` prints it and compare.json holds it."""
    return {
        "base_run": cmp.base_run,
        "cand_run": cmp.cand_run,
        "base_dir": cmp.base_dir,
        "cand_dir": cmp.cand_dir,
        "threshold_pct": cmp.threshold_pct,
        "ok": cmp.ok,
        "verdict": cmp.verdict(),
        "regressions": [asdict(r) for r in cmp.regressions],
        "gated": len(cmp.gated),
        "too_few_samples": len(cmp.undecided),
        "unconfirmed_drops": [_delta_json(d) for d in cmp.unconfirmed_drops],
        "new_findings": [_finding_json(f) for f in cmp.new_findings],
        "cleared_findings": [_finding_json(f) for f in cmp.cleared_findings],
        "only_in_base": cmp.only_in_base,
        "only_in_cand": cmp.only_in_cand,
        "workloads": cmp.workloads,
        "rows": [_row_json(r) for r in cmp.rows],
    }


def _delta_json(d: MetricDelta) -> dict[str, Any]:
    return {**asdict(d), "delta_pct": d.delta_pct}


def _row_json(row: CaseRow) -> dict[str, Any]:
    return {**asdict(row), "deltas": [_delta_json(d) for d in row.deltas]}


def _finding_json(f: FindingChange) -> dict[str, Any]:
    return {**asdict(f), "fatal": f.fatal}


# --------------------------------------------------------------------------- Markdown


def comparison_markdown(cmp: Comparison) -> str:
    """The comparison as ``orchestrator compare`` prints it and compare.md holds it."""
    out = [f"# Compare {cmp.cand_run} against {cmp.base_run}", "", cmp.verdict(), ""]
    if cmp.regressions:
        out += ["## Regressions", ""]
        out += [f"- **{r.case_id}**: {r.message}" for r in cmp.regressions]
        out.append("")
    if cmp.unconfirmed_drops:
        out += [f"## Drops past the threshold, {TOO_FEW}", ""]
        out += [
            f"- **{d.case_id}**: {d.workload} aggregate tok/s {_fmt(d.base)} → {_fmt(d.cand)} "
            f"({_pct(d.delta_pct)}): {d.judgement.why}"
            for d in cmp.unconfirmed_drops
            if d.judgement
        ]
        out.append("")
    if cmp.new_findings:
        out += ["## New findings", ""]
        out += [_finding_line(f) for f in cmp.new_findings]
        out.append("")
    if cmp.cleared_findings:
        out += ["## Cleared findings", ""]
        out += [_finding_line(f) for f in cmp.cleared_findings]
        out.append("")
    out += _workloads_section(cmp.workloads)
    out += _throughput_section(cmp.rows)
    if cmp.only_in_base or cmp.only_in_cand:
        out += ["## Cases in one run only", ""]
        out += [f"- only in {cmp.base_run}: {c}" for c in cmp.only_in_base]
        out += [f"- only in {cmp.cand_run}: {c}" for c in cmp.only_in_cand]
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def _throughput_section(rows: list[CaseRow]) -> list[str]:
    """Both throughput figures of every case and workload, side by side, with the gate's
    interval and each case's status in both runs."""
    body = []
    for row in rows:
        by_wl: dict[str, dict[str, MetricDelta]] = {}
        for d in row.deltas:
            by_wl.setdefault(d.workload, {})[d.metric] = d
        status = (
            row.cand_status or "-"
            if row.base_status == row.cand_status
            else f"{row.base_status} → {row.cand_status}"
        )
        for metrics in by_wl.values():
            agg, usr = metrics["aggregate_tok_s"], metrics["per_user_tok_s"]
            body.append(
                [
                    row.case_id,
                    agg.workload,
                    *_delta_cells(agg),
                    _interval_cell(agg.judgement),
                    *_delta_cells(usr),
                    status,
                ]
            )
    out = ["## Throughput, base → candidate", ""]
    out.append(md_table(THROUGHPUT_HEADER, body) if body else "No case is in both runs.")
    out.append("")
    return [*out, _METHOD_NOTE, ""] if body else out


def _workloads_section(workloads: dict[str, list[str]]) -> list[str]:
    """What the compared figures measured: one list when both runs ran the same workloads,
    each run's otherwise (a figure of another workload is no regression of this one)."""
    if not workloads:
        return []
    lists = list(workloads.values())
    out = ["## Workloads", ""]
    if all(x == lists[0] for x in lists):
        out += [f"- {line}" for line in lists[0]]
    else:
        for run_id, lines in workloads.items():
            out += [f"- {run_id}:", *(f"  - {line}" for line in lines)]
    return [*out, ""]


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{v:+.2f}%"


def _delta_cells(d: MetricDelta) -> list[str]:
    return [_fmt(d.base), _fmt(d.cand), _pct(d.delta_pct)]


def _interval_cell(j: Judgement | None) -> str:
    if j is None:
        return "-"
    if j.interval is None:
        return "too few samples"
    cell = j.interval.bounds()
    return cell if j.decided else f"{cell} (can't tell)"


def _finding_line(f: FindingChange) -> str:
    text = f.text[:160].replace("`", "'")
    times = f" ×{f.count}" if f.count > 1 else ""
    return f"- {f.case_id}: `{f.signature}` ({f.severity}){times} {f.location}: `{text}`"
