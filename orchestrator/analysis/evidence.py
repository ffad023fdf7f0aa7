"""The evidence chain: what the paired profile says one model step gained on the GPU, beside
the TPOT change the A/B measured, and whether the two agree.

It is the seeds' chain (a kernel table, then a trace, then an end-to-end figure). The profile's
figure is the whole step's: every kernel family's change per model step, summed
(orchestrator.analysis.step_compare), with its own interval over the traced steps; the query
step alone (its per-layer saving x the query steps of a model step) is stated beside it.
Judging on the query step alone misses what else the path moved: on the dense stand-in
(builtin:glm5-dense, docs/validation/h100-2026-12-06/glm5-dense-profile) ctx0's TPOT moved by
-59.1 µs against the query step's -49.3 µs, because FlashAttention's kernels also ran faster
on the fused path's query layout, and the whole step's GPU time moved by -65.6 µs. A chain
that holds says the end-to-end change is the GPU's; one that does not says something else
moved (the host, a graph re-capture).

The two agree when their difference lies within the two intervals' half-widths added in
quadrature (each on the side facing the other figure); a profile without step figures (a
row written before they were stored, whose traces are gone) is judged, as before, by its
query-step figure lying within the measured interval.

Which staged baseline the served vLLM runs is read from the baseline's own traces, never
assumed: a staged query step of one GEMM is a backend that takes the query as a (nope, pe)
pair (vLLM 0.26's FLASH_ATTN_MLA: the bmm alone); a GEMM and a concat is one that takes an
[M, H, 576] query (vLLM 0.32's staged path: bmm + cat). A kernel figure quoted beside the
chain must be the one against that same baseline.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.analysis.ab import AB_METRICS, ABResult, server_groups
from orchestrator.analysis.stats import Interval
from orchestrator.analysis.step_compare import StepComparison, compare_steps, row_steps
from orchestrator.results.profile_figures import StepWork
from orchestrator.results.recorded_run import Run
from orchestrator.results.rows import CaseResult

# The TPOT the chain is held against: the mean, as the profile's saving is a mean over layer
# steps and a sum of step times moves the mean (a median need not move with it).
CHAIN_METRIC = next(m for m in AB_METRICS if m.key == "tpot_mean_ms")
BMM_ALONE = "the bmm alone (the attention backend takes the query as a (nope, pe) pair)"
BMM_CAT = "bmm + cat (the attention backend takes one [M, H, 576] query)"


@dataclass(frozen=True)
class QueryProfile:
    """One variant's decode query step from its profiled servers of one topology."""

    per_layer_us: float  # mean over the profiled servers of each one's mean over ranks
    layers: int | None  # query steps in one model step (decoder layers + MTP draft passes)
    servers: int
    staged_form: str | None  # for a staged trace: BMM_ALONE or BMM_CAT


def query_profile(rows: Sequence[CaseResult]) -> QueryProfile | None:
    """The query step of a variant's profiled, passed rows; None where none was found."""
    per_server, layers, forms = [], set(), set()
    for r in rows:
        p = r.profile
        if p is None or not r.passed:
            continue
        ranks = [t.query.per_layer_us for t in p.traces if t.query.per_layer_us is not None]
        if not ranks:
            continue
        per_server.append(statistics.fmean(ranks))
        layers.add(p.layers)
        for t in p.traces:
            if t.query.path == "staged":
                forms.add(BMM_CAT if t.query.events > t.query.occurrences else BMM_ALONE)
    if not per_server:
        return None
    return QueryProfile(
        statistics.fmean(per_server),
        layers.pop() if len(layers) == 1 else None,
        len(per_server),
        forms.pop() if len(forms) == 1 else None,
    )


@dataclass(frozen=True)
class Evidence:
    """One TPOT figure of the A/B beside what the paired profile predicts for it."""

    result: ABResult
    baseline: QueryProfile
    candidate: QueryProfile
    mtp: int
    vllm: str | None
    steps: StepComparison | None = None  # the whole step by kernel family, where traced

    @property
    def saving_per_layer_us(self) -> float:
        return self.candidate.per_layer_us - self.baseline.per_layer_us

    @property
    def query_us(self) -> float | None:
        """The query step's change per model step: per layer x query steps."""
        layers = self.baseline.layers
        return None if layers is None else self.saving_per_layer_us * layers

    @property
    def predicted_us(self) -> float | None:
        """The change per model step the profile predicts: the whole step's (the sum of the
        families' changes) where the step figures exist, else the query step's."""
        return self.steps.total.delta_us if self.steps is not None else self.query_us

    @property
    def judged_on(self) -> str:
        return "whole step" if self.steps is not None else "query step"

    @property
    def measured_us(self) -> tuple[float, float, float] | None:
        """The TPOT change in µs per token and its 95 % bounds, or None without an interval."""
        iv, base = self.result.interval, self.result.baseline.mean
        if iv is None or base is None:
            return None
        return tuple(base * 1000.0 * pct / 100.0 for pct in (iv.estimate, iv.low, iv.high))  # type: ignore[return-value]

    @property
    def agrees(self) -> bool | None:
        """Whether the prediction and the measured change differ by no more than their
        intervals allow (the module docstring); None where they cannot be compared (no
        interval, no prediction, or MTP: a step then emits more than one token and the TPOT
        is per token)."""
        measured, predicted = self.measured_us, self.predicted_us
        if measured is None or predicted is None or self.mtp:
            return None
        iv = self.steps.total.change if self.steps is not None else None
        return agree(measured, predicted, iv)

    def baseline_text(self) -> str:
        form = self.baseline.staged_form or "not read (the baseline's trace shows no staged step)"
        where = f"vLLM {self.vllm}" if self.vllm else "the served vLLM"
        return f"staged baseline in {where}: {form}"

    def sentence(self) -> str:
        r = self.result
        head = f"{r.topology_id} {r.workload}, {r.metric.label}"
        measured = self.measured_us
        if measured is None:
            told = f"measured: no interval ({r.why or r.verdict})"
        else:
            told = (
                f"measured {measured[0]:+.1f} µs per token (95% interval {measured[1]:+.1f} … "
                f"{measured[2]:+.1f} µs; {r.baseline.mean:.3f} → {r.candidate.mean:.3f} ms)"
            )
        if self.mtp:
            end = (
                f"not compared: at MTP {self.mtp} a model step emits up to {self.mtp + 1} "
                "tokens, and TPOT is per token"
            )
        elif self.agrees is None:
            end = "not compared"
        elif self.steps is not None:
            end = (
                "they agree within the intervals (judged on the whole step)"
                if self.agrees
                else "they do NOT agree (judged on the whole step)"
            )
        else:
            end = "they agree within the interval" if self.agrees else "they do NOT agree"
        return (
            f"{head}: {told}; the paired profile: {self.profile_text()}; "
            f"{self.baseline_text()}; {end}."
        )

    def profile_text(self) -> str:
        """The query step's change, then the whole step's by kernel family where traced."""
        b, c = self.baseline, self.candidate
        out = (
            f"query step {b.per_layer_us:.3f} → {c.per_layer_us:.3f} µs per layer "
            f"({self.saving_per_layer_us:+.3f} µs)"
        )
        if self.query_us is not None:
            out += f" × {b.layers} query steps = {self.query_us:+.1f} µs per model step"
        steps = self.steps
        if steps is not None:
            total = steps.total
            iv = total.change
            bounds = "" if iv is None else f" (95% interval {iv.low:+.1f} … {iv.high:+.1f})"
            out += (
                f"; the whole step on the GPU, every kernel family summed: {total.delta_us:+.1f} "
                f"µs per model step{bounds} over {steps.steps} traced steps, "
                f"{steps.changed_text()}"
            )
        return out

    def to_dict(self) -> dict[str, Any]:
        measured = self.measured_us
        return {
            "topology_id": self.result.topology_id,
            "workload": self.result.workload,
            "metric": self.result.metric.key,
            "baseline_per_layer_us": self.baseline.per_layer_us,
            "candidate_per_layer_us": self.candidate.per_layer_us,
            "saving_per_layer_us": self.saving_per_layer_us,
            "query_steps": self.baseline.layers,
            "query_step_us_per_step": self.query_us,
            "predicted_us_per_step": self.predicted_us,
            "judged_on": self.judged_on,
            "steps": None if self.steps is None else self.steps.to_dict(),
            "measured_us_per_token": None if measured is None else measured[0],
            "measured_interval_us": None if measured is None else list(measured[1:]),
            "agrees": self.agrees,
            "staged_baseline": self.baseline.staged_form,
            "vllm": self.vllm,
            "sentence": self.sentence(),
        }


def agree(measured: tuple[float, float, float], predicted: float, profile: Interval | None) -> bool:
    """Whether the measured change (estimate, low, high) and the profile's prediction (with
    its interval, where it has one) differ by no more than the two intervals' half-widths on
    the sides that face each other, added in quadrature. Without a profile interval: whether
    the prediction lies within the measured interval."""
    estimate, low, high = measured
    below = predicted < estimate
    measured_half = estimate - low if below else high - estimate
    profile_half = (
        0.0 if profile is None else profile.high - predicted if below else predicted - profile.low
    )
    return abs(estimate - predicted) <= math.hypot(measured_half, profile_half)


def evidence_chain(run: Run, results: Sequence[ABResult]) -> list[Evidence]:
    """The chain for the mean TPOT of every workload at concurrency 1 (the profile's own
    batch: one request, M = 1 per layer step) whose two variants were both profiled."""
    groups = server_groups(run.ordered)
    mtp = {r.topology_id: r.mtp for r in run.ordered}
    out = []
    for r in results:
        if r.metric != CHAIN_METRIC or run.manifest.concurrency(r.workload) != 1:
            continue
        base_rows = groups.get((r.topology_id, r.baseline.variant), [])
        cand_rows = groups.get((r.topology_id, r.candidate.variant), [])
        base, cand = query_profile(base_rows), query_profile(cand_rows)
        if base is None or cand is None:
            continue
        steps = compare_steps(_steps(base_rows, run), _steps(cand_rows, run))
        vllm = run.manifest.version("vllm")
        out.append(Evidence(r, base, cand, mtp.get(r.topology_id, 0), vllm, steps))
    return out


def _steps(rows: Sequence[CaseResult], run: Run) -> list[list[StepWork]]:
    """Every trace's model steps of a variant's passed, profiled rows (all its servers)."""
    return [t for r in rows if r.passed for t in row_steps(r, run.root)]
