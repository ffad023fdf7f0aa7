"""The tables and sentences every report shares, drawn from one ``Run``
(orchestrator.results.recorded_run).

Each renderer (Markdown, JSON, HTML, JUnit, the closing table) formats what it is handed
here. A figure is derived in one place (a paired delta, the run's audit sentence, a latency
row) and every report shows the same one.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from orchestrator.common.wording import plural
from orchestrator.config.policy import bind_all_warning
from orchestrator.results.recorded_run import Run
from orchestrator.results.rows import CaseResult

MISSING = "-"


def fmt_tok(v: float | None) -> str:
    """A throughput figure as the tables show it: two decimals, or '-'."""
    return MISSING if v is None else f"{v:.2f}"


# --------------------------------------------------------------------------- shared tables


@dataclass(frozen=True)
class PairedDelta:
    """One topology's column: the first variant as baseline against another variant."""

    topology_id: str
    column: str
    baseline: str
    candidate: str
    baseline_tok_s: float | None
    candidate_tok_s: float | None
    delta_pct: float | None
    # The workload's one name (`column` is the report column it fills), and the samples each
    # side's figure stands on: "2 requests x 1 repeat" (orchestrator.reports.measures).
    workload: str = ""
    samples: str = ""


def paired_deltas(run: Run) -> list[PairedDelta]:
    """Per topology and column: the first variant as baseline against each other variant."""
    variants = run.variants
    if len(variants) < 2:
        return []
    base = variants[0]
    by_topo: OrderedDict[str, dict[str, CaseResult]] = OrderedDict()
    for r in run.ordered:
        by_topo.setdefault(r.topology_id, {})[r.variant] = r
    out = []
    for topo, vs in by_topo.items():
        for cand in variants[1:]:
            if base not in vs or cand not in vs:
                continue
            for name, col in run.columns:
                b, c = vs[base].mean_of(name), vs[cand].mean_of(name)
                delta = None if b in (None, 0.0) or c is None else 100.0 * (c - b) / b
                samples = _samples(vs[base], vs[cand], name)
                out.append(PairedDelta(topo, col, base, cand, b, c, delta, name, samples))
    return out


@dataclass(frozen=True)
class PairedTable:
    """One candidate variant's paired deltas as a table: with three or more variants (staged,
    fused, fused-pdl) a single table would put every candidate under the first one's title."""

    baseline: str
    candidate: str
    header: list[str]
    body: list[list[str]]


def paired_tables(run: Run) -> list[PairedTable]:
    """The paired deltas, one table per candidate variant, in plain strings (report.md and the
    closing summary lay them out)."""
    by_cand: dict[str, list[PairedDelta]] = {}
    for d in paired_deltas(run):
        by_cand.setdefault(d.candidate, []).append(d)
    out = []
    for cand, deltas in by_cand.items():
        base = deltas[0].baseline
        body = [
            [
                d.topology_id,
                d.workload or d.column,
                fmt_tok(d.baseline_tok_s),
                fmt_tok(d.candidate_tok_s),
                MISSING if d.delta_pct is None else f"{d.delta_pct:+.2f}%",
                d.samples or MISSING,
            ]
            for d in deltas
        ]
        header = ["Topology", "Workload", base.title(), cand.title(), "Delta", "Samples each"]
        out.append(PairedTable(base, cand, header, body))
    return out


def interrupted_sentence(run: Run) -> str | None:
    """``Interrupted (SIGTERM) during tiny/tp1-dcp1-mtp0/fused (starting); it has no
    result. Continue with: orchestrator run ... --resume ID``; None for a run that was not."""
    figures = run.interrupted
    if figures is None:
        return None
    out = f"Interrupted ({figures['interrupted']})"
    cut = figures.get("cut_short")
    if cut:
        out += f" during {cut['case_id']} ({cut['phase']}); it has no result"
    out += "."
    if figures.get("resume"):
        out += f" Continue with: {figures['resume']}"
    return out


def interpreted_note(run: Run) -> str | None:
    """What a paired delta means where the fused query ran in Triton's interpreter (a CPU
    run): the interpreter's speed, not the kernel's."""
    if run.manifest.matrix.get("resources", {}).get("accelerator") != "cpu":
        return None
    variants = {
        c.get("variant")
        for c in run.manifest.cases
        if c.get("env", {}).get("TRITON_INTERPRET") == "1"
    }
    if not variants:
        return None
    return (
        f"On CPU the {', '.join(sorted(v for v in variants if v))} variant ran fusedq's "
        "kernel in Triton's interpreter (Python, a tenth of a second or more per layer and "
        "step): its deltas measure the interpreter, not the kernel. What the CPU run shows is that the "
        "fused path serves, gives the staged path's tokens, and is audited; the kernel's "
        "speed is measured on a GPU."
    )


def _samples(base: CaseResult, cand: CaseResult, workload: str) -> str:
    """What a paired delta stands on: each side's successful requests and repeats."""

    def side(r: CaseResult) -> str:
        w = r.workloads.get(workload)
        if w is None:
            return MISSING
        ok = sum(int(x.requests or 0) - int(x.errors or 0) for x in w.repeats)
        return f"{plural(ok, 'request')} x {plural(len(w.repeats), 'repeat')}"

    b, c = side(base), side(cand)
    return b if b == c else f"{b} / {c}"


def token_checks(run: Run) -> list[tuple[str, str, str, str]]:
    """(topology, workload, verdict, sentence) of every same_tokens check, in case order."""
    return [
        (r.topology_id, workload, c.verdict, c.sentence)
        for r in run.ordered
        for workload, c in r.same_tokens.items()
    ]


def exposure_warning(run: Run) -> str | None:
    """The warning for a run whose servers bound every interface (matrix_policy), or None."""
    host = run.manifest.matrix.get("host")
    return bind_all_warning(host) if isinstance(host, str) else None


def audit_sentence(results: list[CaseResult]) -> str:
    """One run-level sentence built from what the per-case audits actually searched."""
    audits = [(r.case_id, r.audit) for r in results if r.audit.searched is not None]
    if not audits:
        return "No case was audited."
    files = sum(len(a.searched.files) for _, a in audits if a.searched)
    lines = sum(a.searched.lines for _, a in audits if a.searched)
    first = audits[0][1].searched
    cats = list(first.categories) if first else []
    head = (
        f"The final log audit of {plural(files, 'log')} ({plural(lines, 'line')}) "
        f"across {plural(len(audits), 'case')}"
    )
    bad = [cid for cid, a in audits if not a.clean]
    if bad:
        out = f"{head} found problems in {plural(len(bad), 'case')}: {', '.join(bad)}."
    else:
        listed = ", ".join(cats[:-1]) + (f", or {cats[-1]}" if len(cats) > 1 else "".join(cats))
        out = f"{head} found no {listed} failure."
    unaudited = [(cid, a) for cid, a in audits if a.searched and not a.searched.kernel_log.audited]
    if unaudited:
        searched = unaudited[0][1].searched
        reason = searched.kernel_log.reason if searched else None
        which = "any case" if len(unaudited) == len(audits) else ", ".join(c for c, _ in unaudited)
        out += f" The kernel log was not audited for {which} ({reason})."
    expectations: dict[str, list[bool]] = {}
    for _, a in audits:
        for er in a.searched.expectations if a.searched else []:
            expectations.setdefault(er.description, []).append(er.met)
    for desc, met in expectations.items():
        out += f" All workers logged {desc}." if all(met) else f" Not every worker logged {desc}."
    return out


def findings(run: Run) -> list[tuple[str, Any]]:
    """(case id, finding) of every case's audit, in matrix order."""
    return [(r.case_id, f) for r in run.ordered for f in r.audit.findings]


def repeats(run: Run) -> list[tuple[str, str, list[Any]]]:
    """(case id, workload, repeats) of every workload measured more than once."""
    return [
        (r.case_id, name, w.repeats)
        for r in run.ordered
        for name, w in r.workloads.items()
        if len(w.repeats) > 1
    ]


LATENCY_NOTE = (
    "Time to first token, time per output token after the first, the gap between streamed "
    "chunks (one value per gap; with MTP a chunk may carry several tokens) and end-to-end "
    "request latency, over every successful request of the workload's repeats."
)
