"""`orchestrator compare BASE CAND`: what changed between two recorded runs.

Cases are matched by ``case_id``. For every matched case and workload the aggregate and the
active per-user tok/s of both runs are set side by side; findings are matched by case and
signature. What fails a comparison (``Comparison.ok`` is False, the CLI exits 1):

- a drop of aggregate tok/s of more than ``threshold_pct`` in any workload of a matched case,
  beyond the noise the two runs let us measure: the whole 95 % interval of the change (from
  each run's repeats, with their recorded requests as a floor under each repeat's noise;
  see orchestrator.analysis.stats) lies below ``-threshold_pct``. With fewer than ``MIN_REPEATS``
  repeats in either run, or an interval that reaches both sides of the threshold, the
  figure is *too few samples to tell*: reported, not a regression. An A/B matrix's server
  starts are judged together instead, one row per (topology, variant) over the units its
  own A/B report is judged on (server starts, or the blocks of a switch-mode server;
  orchestrator.analysis.ab): the noise of one server's repeats is not the noise between servers;
- a case that passed in BASE and failed in CAND;
- a new finding of severity ``fatal`` or ``quarantine-node``.

Per-user tok/s deltas, new warnings and cleared findings are reported, not judged: per-user
rates move with batch composition, and a warning does not break a case (see signatures.yaml).
Cases present in only one run are listed; a matrix that gained or lost a topology is not a
regression.

Only the run directories are read (manifest.json, results.jsonl, cases/*/requests-*.jsonl),
through the result models every report reads (orchestrator.results.recorded_run.Run). Runs recorded
before request records were read still compare: their repeats are the samples.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from orchestrator.analysis.ab import AB_METRICS, group_id, server_groups, unit_values
from orchestrator.analysis.stats import (
    MIN_REPEATS,
    TOO_FEW,
    Interval,
    RepeatSample,
    change_interval,
)
from orchestrator.audit.severity import Severity
from orchestrator.common.layout import case_slug
from orchestrator.common.wording import plural
from orchestrator.results.recorded_run import Run, legend
from orchestrator.results.rows import CaseResult
from orchestrator.results.store import RunStore, StoreError
from orchestrator.results.stored_audit import Finding

DEFAULT_THRESHOLD_PCT = 3.0
# The throughput figures set side by side, by the names a row's mean (and a MetricDelta's
# ``metric``) gives them.
THROUGHPUT_FIGURES = ("aggregate_tok_s", "per_user_tok_s")
# The gate: only aggregate tok/s is the throughput figure the seeds' tables are judged by.
GATED_FIGURE = "aggregate_tok_s"
# The A/B metric the gate reads for an A/B's groups: output tok/s, the same aggregate figure.
AB_GATED_METRIC = next(m for m in AB_METRICS if m.key == "output_tok_s")
# What the gate says of one gated figure (TOO_FEW: analysis.stats).
REGRESSION, NO_REGRESSION = "regression", "no regression"


class CompareError(ValueError):
    """A run directory that cannot be compared (missing, no manifest, unreadable)."""


def open_run(path: str | Path) -> Run:
    """Read a run directory, or raise CompareError naming the path and the fault."""
    try:
        return Run.load(RunStore.read(path))
    except StoreError as exc:
        raise CompareError(str(exc)) from None


@dataclass
class Judgement:
    """The gate's reading of one gated figure: the interval of its change and what it says."""

    verdict: str  # REGRESSION, NO_REGRESSION or TOO_FEW
    samples_base: str  # "2 repeats of 12 requests", "2 repeats (no request records)"
    samples_cand: str
    interval: Interval | None  # None when either run has fewer than MIN_REPEATS repeats
    why: str  # for TOO_FEW: what is missing

    @property
    def decided(self) -> bool:
        return self.verdict != TOO_FEW


@dataclass
class MetricDelta:
    """One throughput figure of one case and workload in both runs (judged when gated)."""

    case_id: str
    workload: str
    column: str
    metric: str
    base: float | None
    cand: float | None
    judgement: Judgement | None = None

    @property
    def delta_pct(self) -> float | None:
        if self.base is None or self.cand is None or self.base == 0.0:
            return None
        return 100.0 * (self.cand - self.base) / self.base


@dataclass
class CaseRow:
    """A case present in both runs: its status in each and every throughput delta."""

    case_id: str
    topology_id: str
    model: str
    variant: str
    base_status: str | None
    cand_status: str | None
    deltas: list[MetricDelta] = field(default_factory=list)


@dataclass
class Regression:
    """Why CAND is worse than BASE for one case."""

    case_id: str
    kind: str  # "throughput" or "status"
    message: str
    workload: str | None = None
    delta_pct: float | None = None
    interval: Interval | None = None


@dataclass
class FindingChange:
    """A (case, signature) pair seen in one run's audit and not in the other's."""

    case_id: str
    signature: str
    severity: Severity | None
    category: str
    count: int
    location: str
    text: str

    @property
    def fatal(self) -> bool:
        """Fatal or worse (a new one fails the comparison)."""
        return self.severity is not None and self.severity.breaks_case


@dataclass
class Comparison:
    """The result of comparing a candidate run against a base run."""

    base_run: str
    cand_run: str
    base_dir: str
    cand_dir: str
    threshold_pct: float
    rows: list[CaseRow] = field(default_factory=list)
    regressions: list[Regression] = field(default_factory=list)
    new_findings: list[FindingChange] = field(default_factory=list)
    cleared_findings: list[FindingChange] = field(default_factory=list)
    only_in_base: list[str] = field(default_factory=list)
    only_in_cand: list[str] = field(default_factory=list)
    # Each run's workloads, as the figures were measured ("ctx0: prompt 1 token, ...").
    workloads: dict[str, list[str]] = field(default_factory=dict)

    @property
    def new_fatal_findings(self) -> list[FindingChange]:
        return [f for f in self.new_findings if f.fatal]

    @property
    def ok(self) -> bool:
        return not self.regressions and not self.new_fatal_findings

    @property
    def gated(self) -> list[MetricDelta]:
        """Every judged figure (aggregate tok/s of a workload both runs measured)."""
        return [d for r in self.rows for d in r.deltas if d.judgement is not None]

    @property
    def undecided(self) -> list[MetricDelta]:
        """Gated figures the runs hold too few samples to judge."""
        return [d for d in self.gated if d.judgement and not d.judgement.decided]

    @property
    def unconfirmed_drops(self) -> list[MetricDelta]:
        """Undecided figures whose point change is a drop past the threshold: what a
        comparison of means alone would have called a regression."""
        return [
            d
            for d in self.undecided
            if d.delta_pct is not None and d.delta_pct < -self.threshold_pct
        ]

    def failures_for(self, case_id: str) -> list[str]:
        """Messages of everything that fails this comparison for one case (JUnit uses them)."""
        out = [r.message for r in self.regressions if r.case_id == case_id]
        out += [
            f"new {f.severity} finding {f.signature} at {f.location}: {f.text}"
            for f in self.new_fatal_findings
            if f.case_id == case_id
        ]
        return out

    def _undecided_clause(self) -> str:
        n, of = len(self.undecided), len(self.gated)
        return f"; {n} of {of} throughput figures: {TOO_FEW}" if n else ""

    def verdict(self) -> str:
        """One sentence for a log line or the head of a report."""
        if self.ok:
            return (
                f"{self.cand_run} vs {self.base_run}: no regression beyond the measured noise "
                f"(threshold {self.threshold_pct:g}% aggregate tok/s, 95% interval)"
                f"{self._undecided_clause()}; no new fatal finding."
            )
        parts = []
        if self.regressions:
            n = len(self.regressions)
            parts.append(f"{n} regression{'' if n == 1 else 's'}")
        if self.new_fatal_findings:
            n = len(self.new_fatal_findings)
            parts.append(f"{n} new fatal finding{'' if n == 1 else 's'}")
        return (
            f"{self.cand_run} vs {self.base_run}: "
            + " and ".join(parts)
            + f"{self._undecided_clause()}."
        )


class RunSamples(NamedTuple):
    """A run's gated figure for one workload as samples, and how to say what they are."""

    repeats: list[RepeatSample]
    text: str  # "2 repeats of 16 requests at concurrency 2"


def request_blocks(
    records: list[dict[str, Any]], concurrency: int
) -> dict[int, tuple[tuple[float, float], ...]]:
    """Repeat number (1-based, as the row's repeats count) -> (output tokens, seconds) of each
    block of `concurrency` successful requests in start order: requests in flight together
    share every server step, so a block is one sample. Records of another shape are passed
    over, not fatal."""
    by_repeat: dict[int, list[tuple[float, float, float]]] = {}
    for rec in records:
        try:
            if rec.get("error") is not None or rec.get("end_s") is None:
                continue
            start = float(rec["start_s"])
            request = (start, float(rec["output_tokens"]), float(rec["end_s"]) - start)
            repeat = int(rec.get("repeat", 0)) + 1
        except (KeyError, TypeError, ValueError):
            continue
        if request[2] > 0:
            by_repeat.setdefault(repeat, []).append(request)
    blocks = {}
    for repeat, requests in by_repeat.items():
        requests.sort()
        blocks[repeat] = tuple(
            (sum(r[1] for r in block), sum(r[2] for r in block))
            for block in (
                requests[i : i + concurrency] for i in range(0, len(requests), concurrency)
            )
        )
    return blocks


def repeat_samples(run: Run, row: CaseResult, workload: str) -> RunSamples:
    """A case's gated figure for one workload as samples: each repeat's aggregate tok/s, with
    its requests from ``cases/<case>/requests-<workload>.jsonl`` when that file is there."""
    summary = row.workloads.get(workload)
    repeats = [
        (r.repeat if r.repeat is not None else i + 1, float(value))
        for i, r in enumerate(summary.repeats if summary is not None else [])
        if (value := getattr(r, GATED_FIGURE)) is not None
    ]
    if not repeats:
        mean = row.mean_of(workload, GATED_FIGURE)
        samples = [] if mean is None else [RepeatSample(mean)]
        return RunSamples(samples, "no repeats recorded")
    concurrency = run.manifest.concurrency(workload)
    records = run.store.read_records(case_slug(row.case_id), workload)
    blocks = request_blocks(records, concurrency)
    samples = [RepeatSample(value, blocks.get(n, ())) for n, value in repeats]
    text = plural(len(samples), "repeat")
    if not any(s.parts for s in samples):
        return RunSamples(samples, f"{text} (no request records)")
    counts = [sum(1 for r in records if _ok(r) and r.get("repeat") == n - 1) for n, _ in repeats]
    per = str(min(counts)) if min(counts) == max(counts) else f"{min(counts)}-{max(counts)}"
    text += f" of {per} request{'' if per == '1' else 's'}"
    if concurrency > 1:
        text += f" at concurrency {concurrency}"
    return RunSamples(samples, text)


def _ok(record: dict[str, Any]) -> bool:
    return record.get("error") is None and record.get("end_s") is not None


def judge(base: RunSamples, cand: RunSamples, threshold_pct: float) -> Judgement:
    """The gate's verdict on one figure; see the module docstring."""
    texts = base.text, cand.text
    if min(len(base.repeats), len(cand.repeats)) < MIN_REPEATS:
        why = (
            f"base {texts[0]}, candidate {texts[1]}; {MIN_REPEATS} repeats per run needed "
            "(one cannot show how far the speed moves between measurement windows)"
        )
        return Judgement(TOO_FEW, *texts, None, why)
    if min(r.value for r in (*base.repeats, *cand.repeats)) <= 0:
        return Judgement(TOO_FEW, *texts, None, "a repeat measured 0 tok/s")
    interval = change_interval(base.repeats, cand.repeats)
    if interval is None:
        why = f"base {texts[0]}: its repeats are too far apart to bound the change at 95%"
        return Judgement(TOO_FEW, *texts, None, why)
    position = interval.position(-threshold_pct, math.inf)
    if position == "across":
        why = f"95% interval {interval.bounds()} reaches both sides of -{threshold_pct:g}%"
        return Judgement(TOO_FEW, *texts, interval, why)
    verdict = REGRESSION if position == "outside" else NO_REGRESSION
    return Judgement(verdict, *texts, interval, "")


def _findings(row: CaseResult) -> dict[str, list[Finding]]:
    by_sig: dict[str, list[Finding]] = {}
    for f in row.audit.findings:
        by_sig.setdefault(str(f.signature), []).append(f)
    return by_sig


def _change(case_id: str, signature: str, found: list[Finding]) -> FindingChange:
    # The worst occurrence stands for the signature: that is the one a reader must see.
    worst = max(found, key=lambda f: f.severity.rank if f.severity is not None else 0)
    return FindingChange(
        case_id=case_id,
        signature=signature,
        severity=worst.severity,
        category=worst.category,
        count=len(found),
        location=worst.location(basename=True),
        text=worst.text,
    )


def _ordered(run: Run) -> list[CaseResult]:
    listed = set(run.manifest.case_ids)
    # Rows of cases the manifest does not list (a hand-edited run) still count, after the rest.
    return run.ordered + [r for r in run.results if r.case_id not in listed]


def compare(base: Run, cand: Run, *, threshold_pct: float = DEFAULT_THRESHOLD_PCT) -> Comparison:
    """Compare two read runs; see the module docstring for what counts as a regression."""
    columns = {**dict(base.columns), **dict(cand.columns)}
    base_rows = {r.case_id: r for r in _ordered(base)}
    cand_rows = _ordered(cand)
    cmp = Comparison(
        base_run=base.run_id,
        cand_run=cand.run_id,
        base_dir=str(base.root),
        cand_dir=str(cand.root),
        threshold_pct=threshold_pct,
    )
    cmp.workloads = {base.run_id: legend(base), cand.run_id: legend(cand)}
    cand_ids = {r.case_id for r in cand_rows}
    cmp.only_in_base = [c for c in base_rows if c not in cand_ids]
    cmp.only_in_cand = [r.case_id for r in cand_rows if r.case_id not in base_rows]
    for c in cand_rows:
        b = base_rows.get(c.case_id)
        if b is None:
            continue
        case_id = c.case_id
        row = CaseRow(
            case_id=case_id,
            topology_id=c.topology_id,
            model=c.model,
            variant=c.variant,
            base_status=b.status,
            cand_status=c.status,
        )
        workloads = list(b.workloads)
        workloads += [w for w in c.workloads if w not in workloads]
        for wl in workloads:
            for metric in THROUGHPUT_FIGURES:
                d = MetricDelta(
                    case_id=case_id,
                    workload=wl,
                    column=columns.get(wl, wl),
                    metric=metric,
                    base=b.mean_of(wl, metric),
                    cand=c.mean_of(wl, metric),
                )
                # An A/B's server starts are judged together (_ab_rows), never one by one.
                if metric == GATED_FIGURE and d.delta_pct is not None and c.ab_server is None:
                    d.judgement = judge(
                        repeat_samples(base, b, wl), repeat_samples(cand, c, wl), threshold_pct
                    )
                row.deltas.append(d)
        cmp.rows.append(row)
        if b.passed and not c.passed:
            cmp.regressions.append(
                Regression(
                    case_id=case_id,
                    kind="status",
                    message=f"passed in {cmp.base_run}, failed in {cmp.cand_run}: "
                    f"{c.reason or 'no reason recorded'}",
                )
            )
        cmp.regressions += _throughput_regressions(row, threshold_pct)
        base_f, cand_f = _findings(b), _findings(c)
        cmp.new_findings += [_change(case_id, s, fs) for s, fs in cand_f.items() if s not in base_f]
        cmp.cleared_findings += [
            _change(case_id, s, fs) for s, fs in base_f.items() if s not in cand_f
        ]
    for row in _ab_rows(base, cand, columns, threshold_pct):
        cmp.rows.append(row)
        cmp.regressions += _throughput_regressions(row, threshold_pct)
    return cmp


def _throughput_regressions(row: CaseRow, threshold_pct: float) -> list[Regression]:
    """A regression for every gated figure of the row whose interval lies past the threshold."""
    out = []
    for d in row.deltas:
        j = d.judgement
        if j is not None and j.verdict == REGRESSION and j.interval is not None:
            out.append(
                Regression(
                    case_id=row.case_id,
                    kind="throughput",
                    workload=d.workload,
                    delta_pct=d.delta_pct,
                    interval=j.interval,
                    message=f"{d.workload} aggregate tok/s {d.base:.2f} → {d.cand:.2f} "
                    f"({j.interval.describe()}, threshold -{threshold_pct:g}%; "
                    f"{j.samples_base} vs {j.samples_cand})",
                )
            )
    return out


def _unit_samples(rows: list[CaseResult], workload: str) -> RunSamples:
    """An A/B group's gated figure as samples: one per unit, the same units (server starts,
    or the blocks of one switch-mode server) and figures the run's own A/B is judged on."""
    unit, values = unit_values(rows, workload, AB_GATED_METRIC)
    return RunSamples([RepeatSample(v) for v in values], plural(len(values), unit[:-1]))


def _group_status(rows: list[CaseResult]) -> str:
    failed = sum(not r.passed for r in rows)
    return "passed" if not failed else f"failed ({failed} of {len(rows)})"


def _ab_rows(base: Run, cand: Run, columns: dict[str, str], threshold_pct: float) -> list[CaseRow]:
    """One row per (topology, variant) of an A/B present in both runs: its figures are the
    means of its units, and the gate reads the interval over those units
    (orchestrator.analysis.ab)."""
    base_groups = server_groups(_ordered(base))
    rows = []
    for key, c_rows in server_groups(_ordered(cand)).items():
        b_rows = base_groups.get(key)
        if b_rows is None:
            continue
        row = CaseRow(
            group_id(*key), key[0], c_rows[0].model, key[1],
            _group_status(b_rows), _group_status(c_rows),
        )  # fmt: skip
        workloads = list(dict.fromkeys(w for r in [*b_rows, *c_rows] for w in r.workloads))
        for wl in workloads:
            for metric in THROUGHPUT_FIGURES:
                d = MetricDelta(
                    row.case_id, wl, columns.get(wl, wl), metric,
                    _mean_of(b_rows, wl, metric), _mean_of(c_rows, wl, metric),
                )  # fmt: skip
                if metric == GATED_FIGURE and d.delta_pct is not None:
                    samples = _unit_samples(b_rows, wl), _unit_samples(c_rows, wl)
                    d.judgement = judge(*samples, threshold_pct)
                row.deltas.append(d)
        rows.append(row)
    return rows


def _mean_of(rows: list[CaseResult], workload: str, metric: str) -> float | None:
    values = [v for r in rows if r.passed and (v := r.mean_of(workload, metric)) is not None]
    return statistics.fmean(values) if values else None


def compare_runs(
    base_dir: str | Path, cand_dir: str | Path, *, threshold_pct: float = DEFAULT_THRESHOLD_PCT
) -> Comparison:
    """Compare run directory CAND against BASE; CompareError names a bad path or threshold."""
    if not threshold_pct >= 0.0:  # also rejects NaN
        raise CompareError(f"--threshold-pct={threshold_pct}: must be a percentage >= 0")
    return compare(open_run(base_dir), open_run(cand_dir), threshold_pct=threshold_pct)
