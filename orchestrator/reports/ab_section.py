"""The A/B section every report shows: per candidate variant, one table of its figures against
the baseline's (orchestrator.analysis.ab), each figure's role (primary or secondary), its
interval and the change its units would find with 80 % power; for an MTP topology the
acceptance each path saw and the change at equal acceptance; the sentences saying how the
units were taken and judged (orchestrator.analysis.ab_design), and the evidence chain
(orchestrator.analysis.evidence).

The table is built once here as plain strings; report.md, report.html and the closing table
of `orchestrator run` lay it out, report.json takes `ab_json`.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field
from typing import Any

from orchestrator.analysis.ab import SECONDARY, ABResult, ab_results, primary_of
from orchestrator.analysis.ab_design import design, server_stops
from orchestrator.analysis.evidence import Evidence, evidence_chain
from orchestrator.analysis.sequential import StoppingRule
from orchestrator.results.recorded_run import Run

TITLE = "A/B: {cand} vs {base}, 95% interval over {unit}"
ACCEPTANCE_TITLE = "MTP acceptance: {cand} vs {base}, the change at equal acceptance"
ACCEPTANCE_HEADER = [
    "Topology",
    "Workload",
    "Metric",
    "acceptance {base}",
    "acceptance {cand}",
    "elasticity",
    "as measured",
    "at equal acceptance",
    "fitted elasticity",
]


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
    acceptance: list[ABTable] = field(default_factory=list)


def _digits(r: ABResult) -> int:
    # TPOT in ms to the µs: the H200's effect is ~45 µs on an 8.5 ms step.
    return 2 if r.metric.unit == "tok/s" else 3


def _label(r: ABResult) -> str:
    m = r.metric
    return m.label if m.unit in m.label else f"{m.label} ({m.unit})"


def _role(r: ABResult) -> str:
    if r.role == SECONDARY and r.holm_p is not None:
        return f"secondary (Holm p {r.holm_p:.3f})"
    return r.role


def _power(r: ABResult) -> str:
    """``±0.22% / 0.28%``: the half-width, and the change 80 % power finds."""
    iv = r.judged
    if iv is None:
        return "-"
    found = r.detectable
    return f"±{iv.half_width:.2f}%" + ("" if found is None else f" / {found:.2f}%")


def _row(r: ABResult) -> list[str]:
    iv = r.judged
    adjusted = iv is not None and iv is not r.interval
    verdict = r.verdict if iv is not None or not r.why else f"{r.verdict} ({r.why})"
    return [
        r.topology_id,
        r.workload,
        _label(r),
        _role(r),
        r.baseline.text(_digits(r)),
        r.candidate.text(_digits(r)),
        "-" if r.ratio is None else f"{r.ratio:.4f}",
        "-" if iv is None else iv.bounds(),
        _power(r),
        f"{verdict} (at equal MTP acceptance)" if adjusted else verdict,
    ]


def _rate(rate: float | None) -> str:
    return "-" if rate is None else f"{rate:.3f}"


def _acceptance_row(r: ABResult) -> list[str]:
    a = r.adjustment
    assert a is not None
    plain, fit = r.interval, a.fitted
    measured = "-" if plain is None else f"{plain.estimate:+.2f}% ({plain.bounds()})"
    at_equal = (
        a.why or "-"
        if a.interval is None
        else f"{a.interval.estimate:+.2f}% ({a.interval.bounds()})"
    )
    fitted = "-" if fit is None else f"{fit.estimate:.2f} ({fit.low:.2f} … {fit.high:.2f})"
    return [
        r.topology_id,
        r.workload,
        _label(r),
        _rate(a.baseline_rate),
        _rate(a.candidate_rate),
        "-" if a.elasticity is None else f"{a.elasticity:.2f}",
        measured,
        at_equal,
        fitted,
    ]


def ab_section(run: Run) -> ABSection | None:
    """The section, or None for a run without an A/B."""
    results = ab_results(run)
    if not results:
        return None
    tables: dict[str, ABTable] = {}
    accepted: dict[str, ABTable] = {}
    for r in results:
        base, cand = r.baseline.variant, r.candidate.variant
        table = tables.get(cand)
        if table is None:
            title = TITLE.format(cand=cand, base=base, unit=r.unit)
            header = ["Topology", "Workload", "Metric", "Role", base, cand, f"{cand}/{base}"]
            table = tables[cand] = ABTable(
                title, [*header, "95% interval", "±h / 80% power", "Verdict"]
            )
        table.body.append(_row(r))
        if r.adjustment is not None:
            if cand not in accepted:
                accepted[cand] = ABTable(
                    ACCEPTANCE_TITLE.format(cand=cand, base=base),
                    [h.format(base=base, cand=cand) for h in ACCEPTANCE_HEADER],
                )
            accepted[cand].body.append(_acceptance_row(r))
    chain: list[Evidence] = evidence_chain(run, results)
    return ABSection(
        design(run),
        list(tables.values()),
        [e.sentence() for e in chain],
        list(accepted.values()),
    )


def ab_json(run: Run) -> dict[str, Any] | None:
    """report.json's ``ab``: the design, every figure, the evidence chain."""
    results = ab_results(run)
    if not results:
        return None
    workload, metric = primary_of(run)
    out = {
        "design": design(run),
        "matrix": run.manifest.ab,
        "primary": {"workload": workload, "metric": metric},
        "results": [r.to_dict() for r in results],
        "evidence": [e.to_dict() for e in evidence_chain(run, results)],
    }
    rule = StoppingRule.of(run.manifest.ab)
    if rule is not None:
        out["stopping"] = {
            "target_half_width_pct": rule.target_pct,
            "looks_planned": list(rule.looks),
            "look_confidence": rule.confidence,
            "method": rule.method,
            "servers": [s.to_dict() for s in server_stops(run)],
        }
    return out


def render_ab_terminal(run: Run, width: int) -> str:
    """The A/B block under the closing table: fixed width, no control codes."""
    section = ab_section(run)
    if section is None:
        return ""
    out: list[str] = []
    for t in section.tables + section.acceptance:
        widths = [max(len(x) for x in col) for col in zip(t.header, *t.body, strict=True)]

        def fmt(cells: list[str], widths: list[int] = widths) -> str:
            text = {0, 1, 2, 3, len(cells) - 1}
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
