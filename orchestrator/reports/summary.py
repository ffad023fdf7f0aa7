"""Per case and workload: output tok/s over repeats and the latency percentiles of its requests.

One table model, built from a run's results, that several outputs render: the closing block
`orchestrator run` prints (in the manner of `vllm bench serve`'s), and the latency sections of
report.md, report.json and report.html.

Rows are named by case (variant included) and workload name: a workload's report column may
stand for another size (the smoke matrix's ctx1k fills the ctx64k column), its name does not.

- Output tok/s: the mean over repeats of aggregate output tok/s, ± the sample standard
  deviation of the repeats (no spread with one repeat).
- TTFT / TPOT / ITL p50 and p99 (ms): over every successful request of every repeat of the
  workload (orchestrator.workload.latency_metrics computes them when the workload ends). Rows
  recorded before that pooled figure existed fall back to the mean over repeats of each
  repeat's percentile (``WorkloadSummary.latency_ms``).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from orchestrator.reports.run import MISSING, Run

LATENCIES = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"))
QUANTILES = ("p50", "p99")


@dataclass(frozen=True)
class SummaryRow:
    case_id: str
    topology_id: str
    variant: str
    workload: str
    column: str
    tok_s: float | None
    tok_s_sd: float | None
    repeats: int
    latency_ms: dict[str, dict[str, float | None]]  # "ttft_ms" -> {"p50": .., "p99": ..}
    errors: int
    status: str
    reason: str | None = None


def summary_rows(run: Run) -> list[SummaryRow]:
    """One row per finished case and workload of the matrix, in matrix order; a case that
    failed before any workload gets one row with the workload shown as '-'."""
    out = []
    for r in run.ordered:
        common = {
            "case_id": r.case_id,
            "topology_id": r.topology_id,
            "variant": r.variant,
            "status": "passed" if r.passed else "FAILED",
            "reason": r.reason,
        }
        measured = [(n, c) for n, c in run.columns if n in r.workloads]
        for name, column in measured:
            w = r.workloads[name]
            tok, sd, n = w.throughput()
            latency = {
                key: {q: getattr(w.latency_ms(key), q) for q in QUANTILES} for _, key in LATENCIES
            }
            out.append(
                SummaryRow(
                    workload=name,
                    column=column,
                    tok_s=tok,
                    tok_s_sd=sd,
                    repeats=n,
                    latency_ms=latency,
                    errors=w.errors,
                    **common,
                )
            )
        if not measured:
            none = {k: dict.fromkeys(QUANTILES) for _, k in LATENCIES}
            out.append(
                SummaryRow(
                    workload=MISSING,
                    column=MISSING,
                    tok_s=None,
                    tok_s_sd=None,
                    repeats=0,
                    latency_ms=none,
                    errors=r.errors,
                    **common,
                )
            )
    return out


def fmt_ms(v: float | None) -> str:
    """Milliseconds with the digits that matter: 0.43, 12.7, 1834."""
    if v is None:
        return MISSING
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def fmt_tok_s(row: SummaryRow) -> str:
    if row.tok_s is None:
        return MISSING
    return f"{row.tok_s:.2f}" + (f" ± {row.tok_s_sd:.2f}" if row.tok_s_sd is not None else "")


def latency_cells(row: SummaryRow) -> list[str]:
    """TTFT p50, TTFT p99, TPOT p50, ... formatted, in LATENCIES x QUANTILES order."""
    return [fmt_ms(row.latency_ms[k][q]) for _, k in LATENCIES for q in QUANTILES]


def latency_header() -> list[str]:
    return [f"{name} {q}" for name, _ in LATENCIES for q in QUANTILES]


def latency_table(run: Run) -> tuple[list[str], list[list[str]]]:
    """(header, body) of the reports' latency table: per case and measured workload, the
    TTFT / TPOT / ITL p50 and p99 in ms; plain strings, each report escapes its own way."""
    header = ["Case", "Workload", *(f"{h} (ms)" for h in latency_header())]
    body = [
        [r.case_id, r.workload, *latency_cells(r)]
        for r in summary_rows(run)
        if r.workload != MISSING
    ]
    return header, body


def render_summary(run: Run) -> str:
    """The closing block of `orchestrator run`: a fixed-width table, no control codes, so it
    reads the same in a terminal, a CI log and a pasted bug report."""
    lines = summary_rows(run)
    header = ["Case", "Workload", "Output tok/s", *latency_header(), "Err", "Status"]
    body = [
        [r.case_id, r.workload, fmt_tok_s(r), *latency_cells(r), str(r.errors), r.status]
        for r in lines
    ]
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]

    def fmt(cells: list[str]) -> str:
        # Text columns left-aligned, figures right-aligned, as vLLM's block aligns them.
        parts = [
            c.ljust(w) if i < 2 or i == len(cells) - 1 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    table = [fmt(header), *(fmt(b) for b in body)]
    width = max(len(t) for t in table)
    title = f" Run {run.run_id} "
    failed = len(run.failed)
    finished = len(run.results)
    total = len(run.manifest.cases)
    out = [title.center(width, "="), *table, "-" * width]
    stopped = run.interrupted
    how = f" (interrupted by {stopped['interrupted']})" if stopped else ""
    note = (
        f"{finished}/{total} cases finished{how}, {finished - failed} passed, {failed} failed. "
        "Output tok/s: mean over repeats ± their sample standard deviation. TTFT, TPOT, ITL: "
        "ms, over every successful request of the workload. Err: failed requests."
    )
    out += textwrap.wrap(note, width)
    out.append("=" * width)
    return "\n".join(out)
