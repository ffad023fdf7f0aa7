"""What each figure of a run measured: the workloads' totals and the samples behind every
latency statistic. One home for all of it: the closing table, report.md, report.json,
report.html and junit.xml state it from here (the workloads themselves, ``WorkloadDef``, are
orchestrator.results.recorded_run's).

- ``Totals``: what `vllm bench serve` prints in its result block, summed over the repeats:
  successful requests, duration, input and output tokens, request and token throughput.
- ``Stat``: one latency statistic (TTFT, TPOT, ITL, E2EL) with ``n``, its samples. A
  percentile is shown only from ``1 / (1 - q)`` samples on -- p50 from 2, p90 from 10, p99
  from 100 -- where at least one sample lies beyond it: the "p99" of 2 requests is their
  maximum, and is not presented as a p99. The mean is shown from one sample.
- ``bursty``: where chunk gaps under 1 ms dominate, ITL measures how the API server flushed
  its output, not the decode step: such workloads are named, with what to read instead.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from orchestrator.reports.run import MISSING
from orchestrator.results.recorded_run import Run
from orchestrator.results.rows import Distribution, WorkloadSummary

LATENCIES = (
    ("TTFT", "ttft_ms", "time to first token"),
    ("TPOT", "tpot_ms", "time per output token after the first"),
    ("ITL", "itl_ms", "gap between streamed chunks"),
    ("E2EL", "e2el_ms", "end-to-end request latency"),
)
PERCENTILES = ("p50", "p90", "p99")
# A share of sub-millisecond chunk gaps past which ITL percentiles describe bursts.
BURSTY_SHARE = 0.25


def min_samples(q: str) -> int:
    """Samples from which percentile `q` ("p90") is shown: 1 / (1 - q), so that at least one
    sample lies above it."""
    return math.ceil(1.0 / (1.0 - int(q[1:]) / 100.0) - 1e-9)


# --------------------------------------------------------------------------- workloads


# --------------------------------------------------------------------------- totals


@dataclass(frozen=True)
class Totals:
    """`vllm bench serve`'s result block for one workload on one server, over its repeats."""

    successful: int
    failed: int
    duration_s: float
    input_tokens: int
    output_tokens: int

    @property
    def request_throughput(self) -> float | None:
        return self.successful / self.duration_s if self.duration_s > 0 else None

    @property
    def output_throughput(self) -> float | None:
        return self.output_tokens / self.duration_s if self.duration_s > 0 else None

    @property
    def total_throughput(self) -> float | None:
        tokens = self.input_tokens + self.output_tokens
        return tokens / self.duration_s if self.duration_s > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "request_throughput": self.request_throughput,
            "output_throughput": self.output_throughput,
            "total_token_throughput": self.total_throughput,
        }


def totals(w: WorkloadSummary) -> Totals | None:
    """Summed over the workload's repeats (each repeat's wall time is its duration: the
    repeats ran one after another); None where a repeat did not record its counts."""
    if not w.repeats or any(r.requests is None or r.wall_s is None for r in w.repeats):
        return None
    requests = sum(int(r.requests or 0) for r in w.repeats)
    errors = sum(int(r.errors or 0) for r in w.repeats)
    return Totals(
        successful=requests - errors,
        failed=errors,
        duration_s=sum(float(r.wall_s or 0.0) for r in w.repeats),
        input_tokens=sum(int(r.prompt_tokens or 0) for r in w.repeats),
        output_tokens=sum(int(r.output_tokens or 0) for r in w.repeats),
    )


# --------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class Stat:
    """One latency statistic of one workload: its samples and the figures they allow."""

    key: str
    n: int | None  # None: recorded before counts were kept, and not derivable
    mean: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    def shown(self, q: str) -> float | None:
        """The figure `q` ("mean", "p50", ...), or None where its samples do not allow it.
        With n unknown (older rows), percentiles are shown as they were recorded."""
        value = getattr(self, q)
        if q == "mean" or self.n is None:
            return value
        return value if self.n >= min_samples(q) else None

    def to_dict(self) -> dict[str, Any]:
        return {"n": self.n, **{q: self.shown(q) for q in ("mean", *PERCENTILES)}}


def stat(w: WorkloadSummary, key: str) -> Stat:
    """The pooled distribution `key` of a workload; a row recorded before sample counts were
    kept gets them from its request counts where they are what the figure is over (TTFT,
    TPOT and E2EL: one sample per successful request)."""
    d: Distribution = w.latency_ms(key)
    n = d.n
    t = totals(w)
    if n is None and key != "itl_ms" and d.mean is not None and t is not None:
        n = t.successful or None
    return Stat(key, n, d.mean, d.p50, d.p90, d.p99)


def chunking(w: WorkloadSummary) -> dict[str, Any] | None:
    """How the workload's tokens were streamed (None for rows recorded before it was)."""
    c = w.latency.chunking if w.latency is not None else None
    return None if c is None else c.model_dump(mode="json")


def burst_share(w: WorkloadSummary) -> float | None:
    """The share of chunk gaps under 1 ms (None where not recorded, or no gap)."""
    c = w.latency.chunking if w.latency is not None else None
    if c is None or not c.gaps:
        return None
    return (c.gaps_under_1ms or 0) / c.gaps


def bursty(run: Run) -> list[str]:
    """A sentence per case and workload whose chunks arrived in bursts."""
    out = []
    for r in run.ordered:
        for name, w in r.workloads.items():
            share = burst_share(w)
            c = w.latency.chunking if w.latency is not None else None
            if share is None or c is None or share < BURSTY_SHARE:
                continue
            out.append(
                f"{r.case_id} {name}: {c.gaps_under_1ms} of {c.gaps} chunk gaps were under "
                "1 ms: the tokens reached the client in bursts (an API server short of CPU "
                "flushes several chunks at once), so ITL describes that flushing, not the "
                "decode step; TPOT and E2EL measure the server."
            )
    return out


def fmt_ms(v: float | None) -> str:
    """Milliseconds with the digits that matter: 0.43, 12.7, 1834."""
    if v is None:
        return MISSING
    return f"{v:.2f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


def fmt_n(n: int | None) -> str:
    return "?" if n is None else f"{n:,}"


STATS_NOTE = (
    "n: the samples behind each line (successful requests; for ITL, the gaps between streamed "
    "chunks). A percentile is shown from 1/(1-q) samples on (p50 from 2, p90 from 10, p99 "
    "from 100), '-' below that; n '?' marks a row recorded before sample counts were kept."
)
