"""The A/B of a matrix's variants: is the candidate faster than the baseline, by how much, and
how sure are we?

One H200 (2026-12-02, a GLM-5-width stand-in) showed where the noise lives: one server's
repeats agree to 0.04 %, two servers of one configuration differ by 0.1-0.35 %, as much as
the effect under test. So the samples are taken at the level where the variance is (Kalibera
& Jones, "Rigorous benchmarking in reasonable time", 2013):

- restarts mode: each **server start** is one unit, its figure the mean over its repeats;
  the units of two variants are independent, and the candidate/baseline ratio of their means
  gets Fieller's 95 % interval (orchestrator.analysis.stats.ratio_interval);
- switch mode: one server serves every variant in **rounds** (orchestrator.analysis.paired),
  each round one pair; the change is the mean log ratio over rounds with Student's t interval
  (stats.paired_ratio_interval), at equal MTP acceptance where the acceptance is synthetic.

Per topology and candidate one figure is **primary** (``ab.primary``, default ctx0 output
tok/s), judged at 95 %; every other figure is **secondary**, judged with Holm's correction
over the topology's secondary figures, so that nine figures do not make nine chances of a
false verdict. Each interval also states the change its units would find with 80 % power.
Where the run has a paired profile, orchestrator.analysis.evidence sets the profile's
per-layer saving x layers beside the measured TPOT change. `compare` (and so `nightly`)
gates on the units through `server_groups` and `unit_values`.

Only the run directory is read (orchestrator.results.recorded_run.Run). docs/statistics.md is the
user's page.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.analysis.paired import (
    DECODE_SHARE,
    FIRST_TOKEN,
    PAIRED_SERVERS,
    PER_TOKEN,
    ROUNDS,
    Adjustment,
    acceptance_adjustment,
)
from orchestrator.analysis.sequential import StoppingRule
from orchestrator.analysis.stats import (
    CONFIDENCE,
    POWER,
    TOO_FEW,
    Interval,
    MeanEstimate,
    holm,
    paired_ratio_interval,
    ratio_interval,
)
from orchestrator.config.schema import DEFAULT_PRIMARY_METRIC, primary_workload
from orchestrator.results.recorded_run import Run
from orchestrator.results.rows import CaseResult, Repeat, WorkloadSummary

SERVERS, BLOCKS = "server starts", "blocks"
FASTER, SLOWER = "faster", "slower"
PRIMARY, SECONDARY = "primary", "secondary"


@dataclass(frozen=True)
class Metric:
    """A figure the A/B judges: how to read it from a server's workload and from a block."""

    key: str
    label: str
    unit: str
    higher_is_better: bool
    of_server: Callable[[WorkloadSummary], float | None]
    of_block: Callable[[Repeat], float | None]
    moves_as: str  # how it moves with MTP acceptance (orchestrator.analysis.paired)


def _latency(key: str, q: str) -> tuple[Callable[[WorkloadSummary], Any], Callable[[Repeat], Any]]:
    # A server's latency figure is over every request of its repeats (pooled, as the reports
    # show it); a block is one repeat, with its own distribution.
    def of_server(w: WorkloadSummary) -> float | None:
        return getattr(w.latency_ms(key), q)

    def of_block(r: Repeat) -> float | None:
        found = getattr(r, key)
        return getattr(found, q) if found is not None else None

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
        DECODE_SHARE,
    ),
    Metric("tpot_p50_ms", "TPOT p50", "ms", False, *_latency("tpot_ms", "p50"), PER_TOKEN),
    Metric("tpot_mean_ms", "TPOT mean", "ms", False, *_latency("tpot_ms", "mean"), PER_TOKEN),
    # A path that is faster per token may still be slower to its first one (a step it runs
    # outside CUDA graphs, a prefill it slows): judged too, not only seen in the tables.
    Metric("ttft_p50_ms", "TTFT p50", "ms", False, *_latency("ttft_ms", "p50"), FIRST_TOKEN),
)


def verdict(interval: Interval | None, higher_is_better: bool, holm_p: float | None = None) -> str:
    """`faster` or `slower` when the whole 95 % interval of the change lies on one side of
    0 (and, for a secondary figure, its Holm-adjusted p-value `holm_p` is below 5 %), else
    ``no change detectable at ±h%`` (h: the interval's half-width; a true change of h is
    found only about half the time, `Interval.detectable` says what 80 % power finds);
    TOO_FEW without an interval."""
    if interval is None:
        return TOO_FEW
    past = interval.low > 0.0 or interval.high < 0.0
    if past and (holm_p is None or holm_p < 1.0 - interval.confidence):
        up = interval.low > 0.0
        return FASTER if up == higher_is_better else SLOWER
    text = f"no change detectable at ±{interval.half_width:.2f}%"
    if past and holm_p is not None:
        text += f" after Holm (p {interval.p_value:.3f}, adjusted {holm_p:.3f}"
        level = 1.0 - interval.confidence
        # A stopping rule's per-look level: the adjusted p must clear it, not 0.05.
        text += ")" if abs(level - (1.0 - CONFIDENCE)) < 1e-12 else f" against {level:.4f})"
    return text


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
    """The sampling unit of one (topology, variant) and one figure per unit: each measured
    server start's figure (CaseResult.measured: passed, or failed only in the profile phase
    after it) when the variant was served two or more times; otherwise the blocks of its one
    switch-mode server. A unit without the figure is left out."""
    passed = [r for r in rows if r.measured and workload in r.workloads]
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
    interval: Interval | None  # Fieller's over server starts, or the paired one over pairs
    why: str = ""  # why there is no interval
    pairs: tuple[tuple[float, float], ...] = ()  # paired units: (baseline, candidate) each
    adjustment: Adjustment | None = None  # MTP: the acceptance each path saw, and the change
    role: str = PRIMARY
    holm_p: float | None = None  # a secondary figure's Holm-adjusted p-value

    @property
    def judged(self) -> Interval | None:
        """The interval the verdict reads: at equal MTP acceptance where the figure was
        adjusted for it, else `interval`."""
        adjusted = self.adjustment.interval if self.adjustment is not None else None
        return adjusted if adjusted is not None else self.interval

    @property
    def verdict(self) -> str:
        holm_p = self.holm_p if self.role == SECONDARY else None
        return verdict(self.judged, self.metric.higher_is_better, holm_p)

    @property
    def ratio(self) -> float | None:
        """The judged change as a ratio (Fieller's: of the means; paired: the geometric mean
        of the pairs' ratios); the ratio of the means where there is no interval."""
        iv = self.judged
        if iv is not None:
            return 1.0 + iv.estimate / 100.0
        b, c = self.baseline.mean, self.candidate.mean
        return None if not b or c is None else c / b

    @property
    def detectable(self) -> float | None:
        """The change (%) the judged interval's units find with 80 % power."""
        return None if self.judged is None else self.judged.detectable(POWER)

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

        iv, plain = self.judged, self.interval
        return {
            "topology_id": self.topology_id,
            "workload": self.workload,
            "column": self.column,
            "metric": self.metric.key,
            "higher_is_better": self.metric.higher_is_better,
            "unit": self.unit,
            "role": self.role,
            "baseline": side(self.baseline),
            "candidate": side(self.candidate),
            "pairs": [list(p) for p in self.pairs] if self.pairs else None,
            "ratio": self.ratio,
            "change_pct": None if iv is None else iv.estimate,
            "interval_pct": None if iv is None else [iv.low, iv.high],
            "half_width_pct": None if iv is None else iv.half_width,
            "detectable_pct": self.detectable,
            "power": POWER,
            "confidence": CONFIDENCE,
            "method": None if iv is None else iv.method,
            "p_value": None if iv is None else iv.p_value,
            "holm_p": self.holm_p,
            "verdict": self.verdict,
            "why": self.why or None,
            "unadjusted": None
            if plain is None or plain is iv
            else {
                "change_pct": plain.estimate,
                "interval_pct": [plain.low, plain.high],
                "method": plain.method,
                "p_value": plain.p_value,
            },
            "acceptance": None if self.adjustment is None else self.adjustment.to_dict(),
        }


Side = tuple[str, Sequence[CaseResult]]  # a variant and its rows of one topology


def paired_units(
    base: Sequence[CaseResult], cand: Sequence[CaseResult], workload: str, metric: Metric
) -> tuple[str, list[tuple[int, float, float]]]:
    """Switch mode's pairs of one figure, each (index, baseline, candidate): the rounds of
    one server (index: the round, from 0), or the server starts that served both variants
    (index: the start), each variant's figure the mean of its blocks there. A pair without
    both figures, or with a row whose figures do not stand (CaseResult.measured), is left
    out."""

    def ok(rows: Sequence[CaseResult]) -> list[CaseResult]:
        return [r for r in rows if r.measured and workload in r.workloads]

    b_rows, c_rows = ok(base), ok(cand)
    if len(base) == 1 and len(cand) == 1:
        if not b_rows or not c_rows:
            return ROUNDS, []
        b_blocks = [metric.of_block(x) for x in b_rows[0].workloads[workload].repeats]
        c_blocks = [metric.of_block(x) for x in c_rows[0].workloads[workload].repeats]
        return ROUNDS, round_pairs(b_blocks, c_blocks)
    c_by = {r.ab_server: r for r in c_rows}
    out = []
    for r in b_rows:
        other = c_by.get(r.ab_server)
        if other is None:
            continue
        b, c = metric.of_server(r.workloads[workload]), metric.of_server(other.workloads[workload])
        if b is not None and c is not None:
            out.append((r.ab_server or 0, float(b), float(c)))
    return PAIRED_SERVERS, out


def round_pairs(
    base: Sequence[float | None], cand: Sequence[float | None]
) -> list[tuple[int, float, float]]:
    """One server's rounds as pairs (round from 0, baseline, candidate), from each variant's
    block figures in order; a round without both figures is left out."""
    return [
        (k, float(b), float(c))
        for k, (b, c) in enumerate(zip(base, cand, strict=False))
        if b is not None and c is not None
    ]


def judge_units(
    topology_id: str,
    workload: tuple[str, str],
    metric: Metric,
    base: Side,
    cand: Side,
    *,
    paired_by: bool = False,
    rule: StoppingRule | None = None,
) -> ABResult:
    """The A/B of one figure: `workload` is (name, report column), `base` and `cand` are
    (variant, its rows of this topology); `paired_by`: the rows are switch mode's, whose
    variants share servers and so pair (else the units are independent server starts);
    `rule`: the stopping rule they ran under, whose looks the interval pays for."""
    unit, b_values = unit_values(base[1], workload[0], metric)
    _, c_values = unit_values(cand[1], workload[0], metric)

    def figure(variant: str, rows: Sequence[CaseResult], values: list[float]) -> VariantFigure:
        expected = len(rows) if unit == SERVERS else len(values)
        return VariantFigure(variant, tuple(values), expected)

    b, c = figure(base[0], base[1], b_values), figure(cand[0], cand[1], c_values)
    if paired_by:
        return _judge_pairs(topology_id, workload, metric, base, cand, (b, c), rule)
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


def _judge_pairs(
    topology_id: str,
    workload: tuple[str, str],
    metric: Metric,
    base: Side,
    cand: Side,
    figures: tuple[VariantFigure, VariantFigure],
    rule: StoppingRule | None = None,
) -> ABResult:
    unit, pairs = paired_units(base[1], cand[1], workload[0], metric)
    # Under the stopping rule every figure is read at the look the run stopped at: each at
    # the per-look level, which makes it a 95 % interval whatever look that was.
    confidence = CONFIDENCE if rule is None else rule.confidence
    found = tuple((b, c) for _, b, c in pairs)
    interval, why, adjustment = None, "", None
    if len(pairs) < 2:
        why = f"{len(pairs)} {unit} with both variants measured; 2 or more are needed"
    elif min(v for p in found for v in p) <= 0:
        why = "a unit measured 0"
    else:
        interval = _per_look(
            paired_ratio_interval([p[0] for p in found], [p[1] for p in found], confidence),
            rule,
        )
        if unit == ROUNDS:
            b_row, c_row = base[1][0], cand[1][0]
            adjustment = acceptance_adjustment(
                pairs,
                b_row.workloads[workload[0]],
                c_row.workloads[workload[0]],
                b_row.mtp,
                metric.moves_as,
                confidence,
            )
            if adjustment is not None and adjustment.interval is not None:
                per_look = _per_look(adjustment.interval, rule)
                adjustment = dataclasses.replace(adjustment, interval=per_look)
    return ABResult(
        topology_id, *workload, metric, unit, *figures, interval, why, found, adjustment
    )


def _per_look(interval: Interval | None, rule: StoppingRule | None) -> Interval | None:
    """`interval`, its method naming the looks it pays for under a stopping rule."""
    if interval is None or rule is None:
        return interval
    return dataclasses.replace(interval, method=f"{interval.method}, {rule.method}")


def primary_of(run: Run) -> tuple[str | None, str]:
    """The primary figure (workload name, metric key) of the run's A/B: the matrix's
    ``ab.primary``, else ctx0's (or the first workload's) output tok/s."""
    spec = (run.manifest.ab or {}).get("primary") or {}
    names = [name for name, _ in run.columns]
    return primary_workload(spec.get("workload"), names), spec.get("metric", DEFAULT_PRIMARY_METRIC)


def with_roles(results: Sequence[ABResult], primary: tuple[str | None, str]) -> list[ABResult]:
    """`results` of one topology and candidate with their roles: the primary figure, and the
    secondary ones with their Holm-adjusted p-values (over those that have a p-value)."""
    roles = [PRIMARY if (r.workload, r.metric.key) == primary else SECONDARY for r in results]
    tested = [
        i
        for i, (r, role) in enumerate(zip(results, roles, strict=True))
        if role == SECONDARY and r.judged is not None and r.judged.p_value is not None
    ]
    adjusted = dict(
        zip(tested, holm([results[i].judged.p_value for i in tested]), strict=True)  # type: ignore[union-attr,misc]
    )
    return [
        dataclasses.replace(r, role=role, holm_p=adjusted.get(i))
        for i, (r, role) in enumerate(zip(results, roles, strict=True))
    ]


def ab_results(run: Run) -> list[ABResult]:
    """Every A/B figure of the run: per topology, candidate variant, workload and metric."""
    ab = run.manifest.ab
    if ab is None or len(run.variants) < 2:
        return []
    groups = server_groups(run.ordered)
    base = run.variants[0]
    switch = ab.get("mode", "restarts") == "switch"
    primary = primary_of(run)
    rule = StoppingRule.of(ab)
    topologies = list(dict.fromkeys(t for t, _ in groups))
    out = []
    for topo in topologies:
        if (topo, base) not in groups:
            continue
        for cand in run.variants[1:]:
            if (topo, cand) not in groups:
                continue
            family = [
                judge_units(
                    topo,
                    workload,
                    metric,
                    (base, groups[(topo, base)]),
                    (cand, groups[(topo, cand)]),
                    paired_by=switch,
                    rule=rule,
                )
                for workload in run.columns
                for metric in AB_METRICS
            ]
            out += with_roles(family, primary)
    return out
