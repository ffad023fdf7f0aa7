"""The A/B of a matrix's variants: is the candidate faster than the baseline, by how much, and
how sure are we?

One H200 (2026-12-02, a GLM-5-width stand-in) showed where the noise lives: one server's
repeats agree to 0.04 %, two servers of one configuration differ by 0.1-0.35 %, as much as
the effect under test. So the samples are taken at the level where the variance is (Kalibera
& Jones, "Rigorous benchmarking in reasonable time", 2013): each **server start** is one
unit, its figure the mean over its repeats; or, on a switch-mode server that serves every
variant (orchestrator.execution.switch), each **block** of the workloads between two path flips. Per
topology, workload and metric this module gives each variant's mean of unit figures and
their spread, the candidate/baseline ratio with Fieller's 95 % interval
(orchestrator.analysis.stats.ratio_interval) and the verdict read from it; and, where the run has a
paired profile, the evidence chain: the profile's per-layer saving x layers beside the
measured TPOT change. `compare` (and so `nightly`) gates on the same units through
`server_groups` and `unit_values`.

Only the run directory is read (orchestrator.results.recorded_run.Run). docs/statistics.md is the
user's page.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.analysis.stats import (
    CONFIDENCE,
    TOO_FEW,
    Interval,
    MeanEstimate,
    ratio_interval,
)
from orchestrator.results.recorded_run import Run
from orchestrator.results.rows import CaseResult, Repeat, WorkloadSummary

SERVERS, BLOCKS = "server starts", "blocks"
FASTER, SLOWER = "faster", "slower"


@dataclass(frozen=True)
class Metric:
    """A figure the A/B judges: how to read it from a server's workload and from a block."""

    key: str
    label: str
    unit: str
    higher_is_better: bool
    of_server: Callable[[WorkloadSummary], float | None]
    of_block: Callable[[Repeat], float | None]


def _tpot(q: str) -> tuple[Callable[[WorkloadSummary], Any], Callable[[Repeat], Any]]:
    # A server's TPOT is over every request of its repeats (pooled, as the reports show it);
    # a block is one repeat, with its own distribution.
    def of_server(w: WorkloadSummary) -> float | None:
        return getattr(w.latency_ms("tpot_ms"), q)

    def of_block(r: Repeat) -> float | None:
        return getattr(r.tpot_ms, q) if r.tpot_ms is not None else None

    return of_server, of_block


# The figures an A/B judges, under the keys its report.json names them by (``output_tok_s`` is
# the aggregate tok/s a row's mean holds as ``aggregate_tok_s``).
AB_METRICS = (
    Metric(
        "output_tok_s",
        "output tok/s",
        "tok/s",
        True,
        lambda w: w.mean_of("aggregate_tok_s"),
        lambda r: r.aggregate_tok_s,
    ),
    Metric("tpot_p50_ms", "TPOT p50", "ms", False, *_tpot("p50")),
    Metric("tpot_mean_ms", "TPOT mean", "ms", False, *_tpot("mean")),
)


def verdict(interval: Interval | None, higher_is_better: bool) -> str:
    """`faster` or `slower` when the whole 95 % interval of the change lies on one side of
    0, else ``no change detectable at ±h%`` (h: the interval's half-width, the smallest
    change these units could have shown); TOO_FEW without an interval."""
    if interval is None:
        return TOO_FEW
    if interval.low > 0.0 or interval.high < 0.0:
        up = interval.low > 0.0
        return FASTER if up == higher_is_better else SLOWER
    return f"no change detectable at ±{interval.half_width:.2f}%"


# --------------------------------------------------------------------------- units


def server_groups(rows: Iterable[CaseResult]) -> dict[tuple[str, str], list[CaseResult]]:
    """(topology, variant) -> the rows of its A/B server starts, in run order."""
    groups: dict[tuple[str, str], list[CaseResult]] = {}
    for r in rows:
        if r.ab_server is not None:
            groups.setdefault((r.topology_id, r.variant), []).append(r)
    return groups


def group_id(topology_id: str, variant: str) -> str:
    """The name a (topology, variant) group of server starts goes by in a comparison."""
    return f"{topology_id}/{variant}"


def unit_values(
    rows: Sequence[CaseResult], workload: str, metric: Metric
) -> tuple[str, list[float]]:
    """The sampling unit of one (topology, variant) and one figure per unit: each passed
    server start's figure when the variant was served two or more times; otherwise the
    blocks of its one switch-mode server. A unit without the figure is left out."""
    passed = [r for r in rows if r.passed and workload in r.workloads]
    if len(rows) == 1 and passed and passed[0].switch is not None:
        blocks = (metric.of_block(b) for b in passed[0].workloads[workload].repeats)
        return BLOCKS, [float(v) for v in blocks if v is not None]
    servers = (metric.of_server(r.workloads[workload]) for r in passed)
    return SERVERS, [float(v) for v in servers if v is not None]


@dataclass(frozen=True)
class VariantFigure:
    """One variant's units for one figure: their mean, spread and count."""

    variant: str
    values: tuple[float, ...]
    expected: int  # units run (a failed server start is run and left out)

    @property
    def n(self) -> int:
        return len(self.values)

    @property
    def mean(self) -> float | None:
        return statistics.fmean(self.values) if self.values else None

    @property
    def estimate(self) -> MeanEstimate | None:
        return MeanEstimate.of(self.values) if self.n >= 2 else None

    @property
    def spread_pct(self) -> float | None:
        """The units' sample standard deviation, % of their mean."""
        est = self.estimate
        return None if est is None else 100.0 * est.relative_sd

    def text(self, digits: int = 2) -> str:
        """``116.93 (sd 0.10%, n 4)``."""
        if self.mean is None:
            return "-"
        sd = f"sd {self.spread_pct:.2f}%, " if self.spread_pct is not None else ""
        left = f" of {self.expected}" if self.expected != self.n else ""
        return f"{self.mean:,.{digits}f} ({sd}n {self.n}{left})"


@dataclass(frozen=True)
class ABResult:
    """One topology, workload and metric: the candidate against the baseline."""

    topology_id: str
    workload: str
    column: str
    metric: Metric
    unit: str
    baseline: VariantFigure
    candidate: VariantFigure
    interval: Interval | None
    why: str = ""  # why there is no interval

    @property
    def verdict(self) -> str:
        return verdict(self.interval, self.metric.higher_is_better)

    @property
    def ratio(self) -> float | None:
        b, c = self.baseline.mean, self.candidate.mean
        return None if not b or c is None else c / b

    def to_dict(self) -> dict[str, Any]:
        def side(f: VariantFigure) -> dict[str, Any]:
            return {
                "variant": f.variant,
                "mean": f.mean,
                "sd_pct": f.spread_pct,
                "n": f.n,
                "units_run": f.expected,
                "values": list(f.values),
            }

        iv = self.interval
        return {
            "topology_id": self.topology_id,
            "workload": self.workload,
            "column": self.column,
            "metric": self.metric.key,
            "higher_is_better": self.metric.higher_is_better,
            "unit": self.unit,
            "baseline": side(self.baseline),
            "candidate": side(self.candidate),
            "ratio": self.ratio,
            "change_pct": None if iv is None else iv.estimate,
            "interval_pct": None if iv is None else [iv.low, iv.high],
            "half_width_pct": None if iv is None else iv.half_width,
            "confidence": CONFIDENCE,
            "method": None if iv is None else iv.method,
            "verdict": self.verdict,
            "why": self.why or None,
        }


def judge_units(
    topology_id: str,
    workload: tuple[str, str],
    metric: Metric,
    base: tuple[str, Sequence[CaseResult]],
    cand: tuple[str, Sequence[CaseResult]],
) -> ABResult:
    """The A/B of one figure: `workload` is (name, report column), `base` and `cand` are
    (variant, its rows of this topology)."""
    unit, b_values = unit_values(base[1], workload[0], metric)
    _, c_values = unit_values(cand[1], workload[0], metric)

    def figure(variant: str, rows: Sequence[CaseResult], values: list[float]) -> VariantFigure:
        expected = len(rows) if unit == SERVERS else len(values)
        return VariantFigure(variant, tuple(values), expected)

    b, c = figure(base[0], base[1], b_values), figure(cand[0], cand[1], c_values)
    interval, why = None, ""
    if b.estimate is None or c.estimate is None:
        short = b if b.estimate is None else c
        why = f"{short.variant}: {short.n} {unit} measured; 2 or more are needed"
    elif min(b.values + c.values) <= 0:
        why = "a unit measured 0"
    else:
        interval = ratio_interval(b.estimate, c.estimate)
        if interval is None:
            why = f"{b.variant}'s {unit} spread too widely to bound the ratio"
    return ABResult(topology_id, *workload, metric, unit, b, c, interval, why)


def ab_results(run: Run) -> list[ABResult]:
    """Every A/B figure of the run: per topology, candidate variant, workload and metric."""
    if run.manifest.ab is None or len(run.variants) < 2:
        return []
    groups = server_groups(run.ordered)
    base = run.variants[0]
    topologies = list(dict.fromkeys(t for t, _ in groups))
    out = []
    for topo in topologies:
        if (topo, base) not in groups:
            continue
        for cand in run.variants[1:]:
            if (topo, cand) not in groups:
                continue
            for workload in run.columns:
                for metric in AB_METRICS:
                    out.append(
                        judge_units(
                            topo,
                            workload,
                            metric,
                            (base, groups[(topo, base)]),
                            (cand, groups[(topo, cand)]),
                        )
                    )
    return out


def design(run: Run) -> str:
    """How the units were taken, as a sentence for the reports (empty outside an A/B)."""
    ab = run.manifest.ab
    if ab is None:
        return ""
    variants = run.variants
    if ab.get("mode", "restarts") == "restarts":
        servers = {len(rows) for rows in server_groups(run.ordered).values()}
        count = "/".join(str(n) for n in sorted(servers)) or "?"
        order = " ".join([*variants, *variants, "…"])
        return (
            f"Sampling unit: server starts, {count} per variant and topology, served round by "
            f"round ({order}); a start's output tok/s is the mean over its repeats, its TPOT "
            "over all its requests. 95% interval: Fieller's, of the ratio of the variants' "
            "means over server starts (docs/statistics.md)."
        )
    rows = [r for r in run.ordered if r.switch is not None]
    schedule = rows[0].switch.schedule if rows else []
    flips = [f.seconds for r in rows for f in r.switch.flips if f.seconds is not None]
    timing = (
        f"; a flip took {statistics.median(flips):.2f} s (median; longest {max(flips):.2f} s)"
        if flips
        else ""
    )
    servers = max((r.ab_server or 1 for r in rows), default=1)
    unit = "blocks" if servers == 1 else "server starts (each the mean of its blocks)"
    preview = " ".join(schedule[: 2 * len(variants) + 2]) + (" …" if schedule else "")
    return (
        f"Sampling unit: {unit}: {ab.get('blocks')} blocks per variant on each of "
        f"{servers} server(s) per topology, which serve every variant and flip the decode path "
        f"between blocks ({preview}) through {ab.get('extension')}; every worker confirmed "
        f"the path before each block{timing}. 95% interval: Fieller's, of the ratio of the "
        "variants' means (docs/statistics.md)."
    )
