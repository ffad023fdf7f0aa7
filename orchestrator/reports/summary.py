"""Per case and workload: what was measured and how well, as the reports' shared tables.

One table model, built from a run's results, that several outputs render: the closing block
`orchestrator run` prints (in the manner of `vllm bench serve`'s; under it the A/B or paired
section and the same-token verdicts), and the workload, totals and latency sections of
report.md, report.json and report.html. What each figure means and
the samples behind it are orchestrator.reports.measures' (docs/workloads.md).

Rows are named by case (variant included) and the workload's one name; a workload that fills
another report column (the smoke matrix's ctx1k, for ctx64k) says so in the workload legend.

- Output tok/s: the mean over repeats of aggregate output tok/s, ± the sample standard
  deviation of the repeats (no spread with one repeat).
- Totals: `vllm bench serve`'s result block, summed over the repeats.
- TTFT / TPOT / ITL / E2EL (ms): n, mean, p50, p90, p99 over every successful request of
  every repeat (ITL: every gap between streamed chunks); a percentile only where n allows
  it. Rows recorded before pooled figures fall back to the mean over repeats of each
  repeat's figure (``WorkloadSummary.latency_ms``).
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass, field

from orchestrator.common.mdtable import plain_text
from orchestrator.reports.measures import (
    LATENCIES,
    PERCENTILES,
    Stat,
    Totals,
    burst_share,
    fmt_ms,
    fmt_n,
    stat,
    totals,
)
from orchestrator.reports.run import MISSING, interpreted_note, paired_tables, token_checks
from orchestrator.results.recorded_run import Run, legend

__all__ = ["LATENCIES", "SummaryRow", "fmt_ms", "latency_table", "render_summary"]


@dataclass(frozen=True)
class SummaryRow:
    case_id: str
    topology_id: str
    variant: str
    workload: str
    tok_s: float | None
    tok_s_sd: float | None
    repeats: int
    errors: int
    status: str
    reason: str | None = None
    totals: Totals | None = None
    stats: dict[str, Stat] = field(default_factory=dict)  # "ttft_ms" -> Stat
    tokens_per_chunk: float | None = None
    burst_share: float | None = None


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
        measured = [n for n, _ in run.columns if n in r.workloads]
        for name in measured:
            w = r.workloads[name]
            tok, sd, n = w.throughput()
            chunks = w.latency.chunking if w.latency is not None else None
            out.append(
                SummaryRow(
                    workload=name,
                    tok_s=tok,
                    tok_s_sd=sd,
                    repeats=n,
                    errors=w.errors,
                    totals=totals(w),
                    stats={key: stat(w, key) for _, key, _ in LATENCIES},
                    tokens_per_chunk=chunks.tokens_per_chunk_mean if chunks else None,
                    burst_share=burst_share(w),
                    **common,
                )
            )
        if not measured:
            nothing = {"tok_s": None, "tok_s_sd": None, "repeats": 0, "errors": r.errors}
            out.append(SummaryRow(workload=MISSING, **nothing, **common))
    return out


def fmt_tok_s(row: SummaryRow) -> str:
    if row.tok_s is None:
        return MISSING
    return f"{row.tok_s:.2f}" + (f" ± {row.tok_s_sd:.2f}" if row.tok_s_sd is not None else "")


def _num(v: float | None, digits: int = 2) -> str:
    return MISSING if v is None else f"{v:,.{digits}f}"


# --------------------------------------------------------------------------- report tables


def totals_table(run: Run) -> tuple[list[str], list[list[str]]]:
    """(header, body): `vllm bench serve`'s result block per case and workload, and how the
    tokens were streamed; plain strings, each report escapes its own way."""
    header = [
        "Case", "Workload", "Successful requests", "Failed", "Duration (s)", "Input tokens",
        "Output tokens", "Request/s", "Output tok/s", "Total tok/s", "Tokens per chunk",
        "Chunk gaps < 1 ms",
    ]  # fmt: skip
    body = []
    for r in summary_rows(run):
        t = r.totals
        if t is None:
            continue
        body.append(
            [
                r.case_id, r.workload, f"{t.successful:,}", f"{t.failed:,}", _num(t.duration_s),
                f"{t.input_tokens:,}", f"{t.output_tokens:,}", _num(t.request_throughput),
                _num(t.output_throughput), _num(t.total_throughput),
                _num(r.tokens_per_chunk), _pct(r.burst_share),
            ]
        )  # fmt: skip
    return header, body


def _pct(v: float | None) -> str:
    return MISSING if v is None else f"{100 * v:.0f}%"


def latency_table(run: Run) -> tuple[list[str], list[list[str]]]:
    """(header, body) of the reports' latency table: per case, measured workload and
    statistic, its samples, mean and the percentiles they allow (ms)."""
    header = ["Case", "Workload", "Metric", "n", "Mean", *PERCENTILES]
    body = []
    for r in summary_rows(run):
        for label, key, _ in LATENCIES:
            s = r.stats.get(key)
            if s is None or s.mean is None:
                continue
            cells = [fmt_ms(s.shown(q)) for q in ("mean", *PERCENTILES)]
            body.append([r.case_id, r.workload, label, fmt_n(s.n), *cells])
    return header, body


# --------------------------------------------------------------------------- the terminal


def render_summary(run: Run) -> str:
    """The closing block of `orchestrator run`: the workloads, then a fixed-width table, no
    control codes, so it reads the same in a terminal, a CI log and a pasted bug report."""
    lines = summary_rows(run)
    header = [
        "Case", "Workload", "OK", "Duration s", "Output tok/s", "Total tok/s",
        *(f"{label} mean" for label, _, _ in LATENCIES), "Tok/chunk", "Err", "Status",
    ]  # fmt: skip
    body = []
    for r in lines:
        t = r.totals
        means = [fmt_ms(r.stats[k].mean) if k in r.stats else MISSING for _, k, _ in LATENCIES]
        body.append(
            [
                _line(r.case_id), _line(r.workload), MISSING if t is None else f"{t.successful}",
                MISSING if t is None else _num(t.duration_s, 1), fmt_tok_s(r),
                MISSING if t is None else _num(t.total_throughput),
                *means, _num(r.tokens_per_chunk, 1), str(r.errors), r.status,
            ]
        )  # fmt: skip
    # Text columns left-aligned, figures right-aligned, as vLLM's block aligns them.
    table = fixed_width(header, body, {0, 1, len(header) - 1})
    width = max(len(t) for t in table)
    title = f" Run {_line(run.run_id)} "
    failed = len(run.failed)
    finished = len(run.results)
    total = len(run.manifest.cases)
    out = [title.center(width, "=")]
    for line in legend(run):
        out += textwrap.wrap(f"Workload {line}", width, subsequent_indent="  ")
    out += ["-" * width, *table, "-" * width]
    stopped = run.interrupted
    how = f" (interrupted by {stopped['interrupted']})" if stopped else ""
    note = (
        f"{finished}/{total} cases finished{how}, {finished - failed} passed, {failed} failed. "
        "OK: successful requests, the samples behind TTFT, TPOT and E2EL (ITL: the gaps "
        "between streamed chunks). Duration: the workload's wall time over its repeats. "
        "Output tok/s: mean over repeats ± their sample standard deviation. Latency: mean in "
        "ms; n, p50, p90 and p99 (where n allows) are in report.md. Err: failed requests."
    )
    out += textwrap.wrap(note, width)
    out.append("=" * width)
    return "\n".join(out) + _closing_sections(run, width)


def fixed_width(header: list[str], body: list[list[str]], text: set[int]) -> list[str]:
    """Rows padded to their columns' widths, two spaces apart: the columns in `text`
    left-aligned, the rest (figures) right-aligned."""
    widths = [max(len(x) for x in col) for col in zip(header, *body, strict=True)]

    def fmt(cells: list[str]) -> str:
        parts = [
            c.ljust(w) if i in text else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        ]
        return "  ".join(parts).rstrip()

    return [fmt(header), *(fmt(b) for b in body)]


def _closing_sections(run: Run, width: int) -> str:
    """Under the table, what report.md says after its tables: the A/B verdicts (what an A/B
    run is for: orchestrator.reports.ab_section) or the paired deltas of a matrix with
    variants, then the same-token verdicts."""
    from orchestrator.reports.ab_section import render_ab_terminal

    blocks = [
        render_ab_terminal(run, width) or _paired_block(run, width),
        _tokens_block(run, width),
    ]
    return "".join(f"\n\n{b}" for b in blocks if b)


def _paired_block(run: Run, width: int) -> str:
    out: list[str] = []
    for t in paired_tables(run):
        rows = fixed_width(t.header, [[_line(c) for c in b] for b in t.body], {0, 1, 5})
        span = max(width, *(len(r) for r in rows))
        title = f" Paired variants: {_line(t.baseline)} vs {_line(t.candidate)}, aggregate output tok/s "
        out += [title.center(span, "="), *rows, "-" * span]
    note = interpreted_note(run)
    if out and note:
        out += textwrap.wrap(note, max(width, 60))
    return "\n".join(out)


def _tokens_block(run: Run, width: int) -> str:
    checks = token_checks(run)
    if not checks:
        return ""
    out = ["Same tokens (greedy, request by request):"]
    for topology, workload, verdict, sentence in checks:
        line = f"{_line(topology)} {_line(workload)}: {_line(verdict)} -- {_line(sentence)}"
        out += textwrap.wrap(line, max(width, 60), initial_indent="- ", subsequent_indent="  ")
    return "\n".join(out)


def _line(text: str) -> str:
    # A label or id from the run: one line, no control codes (a terminal would obey them).
    return plain_text(text).replace("\n", " ")
