"""The A/B section every report shows: per candidate variant, one table of its figures against
the baseline's (orchestrator.analysis.ab), the sentence saying how the units were taken, and the
evidence chain (orchestrator.analysis.evidence).

The table is built once here as plain strings; report.md, report.html and the closing table
of `orchestrator run` lay it out, report.json takes `ab_json`.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any

from orchestrator.analysis.ab import ABResult, ab_results, design
from orchestrator.analysis.evidence import Evidence, evidence_chain
from orchestrator.results.recorded_run import Run

TITLE = "A/B: {cand} vs {base}, 95% interval over {unit}"


@dataclass
class ABTable:
    """One candidate against the baseline: a title, a header and a row per figure."""

    title: str
    header: list[str]
    body: list[list[str]] = field(default_factory=list)


@dataclass
class ABSection:
    design: str
    tables: list[ABTable]
    evidence: list[str]


def _digits(r: ABResult) -> int:
    # TPOT in ms to the µs: the H200's effect is ~45 µs on an 8.5 ms step.
    return 2 if r.metric.unit == "tok/s" else 3


def _row(r: ABResult) -> list[str]:
    iv = r.interval
    return [
        r.topology_id,
        r.workload,
        r.metric.label
        if r.metric.unit in r.metric.label
        else f"{r.metric.label} ({r.metric.unit})",
        r.baseline.text(_digits(r)),
        r.candidate.text(_digits(r)),
        "-" if r.ratio is None else f"{r.ratio:.4f}",
        "-" if iv is None else iv.bounds(),
        r.verdict if iv is not None or not r.why else f"{r.verdict} ({r.why})",
    ]


def ab_section(run: Run) -> ABSection | None:
    """The section, or None for a run without an A/B."""
    results = ab_results(run)
    if not results:
        return None
    tables: dict[str, ABTable] = {}
    for r in results:
        base, cand = r.baseline.variant, r.candidate.variant
        table = tables.get(cand)
        if table is None:
            title = TITLE.format(cand=cand, base=base, unit=r.unit)
            header = ["Topology", "Workload", "Metric", base, cand, f"{cand}/{base}"]
            table = tables[cand] = ABTable(title, [*header, "95% interval", "Verdict"])
        table.body.append(_row(r))
    chain: list[Evidence] = evidence_chain(run, results)
    return ABSection(design(run), list(tables.values()), [e.sentence() for e in chain])


def ab_json(run: Run) -> dict[str, Any] | None:
    """report.json's ``ab``: the design, every figure, the evidence chain."""
    results = ab_results(run)
    if not results:
        return None
    return {
        "design": design(run),
        "matrix": run.manifest.ab,
        "results": [r.to_dict() for r in results],
        "evidence": [e.to_dict() for e in evidence_chain(run, results)],
    }


def render_ab_terminal(run: Run, width: int) -> str:
    """The A/B block under the closing table: fixed width, no control codes."""
    section = ab_section(run)
    if section is None:
        return ""
    out: list[str] = []
    for t in section.tables:
        widths = [max(len(x) for x in col) for col in zip(t.header, *t.body, strict=True)]

        def fmt(cells: list[str], widths: list[int] = widths) -> str:
            text = {0, 1, 2, len(cells) - 1}
            parts = [
                c.ljust(w) if i in text else c.rjust(w)
                for i, (c, w) in enumerate(zip(cells, widths, strict=True))
            ]
            return "  ".join(parts).rstrip()

        rows = [fmt(t.header), *(fmt(b) for b in t.body)]
        span = max(width, *(len(r) for r in rows))
        out += [f" {t.title} ".center(span, "="), *rows, "-" * span]
    wrap = max(width, 60)
    out += textwrap.wrap(section.design, wrap)
    for sentence in section.evidence:
        out += textwrap.wrap(f"Evidence: {sentence}", wrap)
    return "\n".join(out)
