"""The decode-profile figures every report shows: the seeds' paired table per staged/fused
pair, per rank and averaged over ranks, and the one-trace summary of `orchestrator
trace-summary`.

A figure is computed here once (a rank mean and its spread, a delta, the removed-events
identity, the synchronisation comparison); report.md, report.html, report.json and the CLI
format what they are handed.
"""

from __future__ import annotations

import statistics
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.analysis.kernel_names import (
    FAMILIES,
    FAMILY_LABELS,
    FRONT_KERNEL_NAMES,
    KV_CACHE,
    ROPE,
)
from orchestrator.analysis.step_compare import BUSY, StepComparison, compare_steps, row_steps
from orchestrator.results.profile_figures import ProfileResult, TraceFigures

MISSING = "-"
# The runtime/driver call groups compared between the paired traces (orchestrator.analysis.trace).
SYNC_LABELS = {
    "stream_wait_event": "cudaStreamWaitEvent",
    "event_record": "event records",
    "graph_launch": "graph launches",
    "synchronize": "synchronizing calls",
}


@dataclass(frozen=True)
class Spread:
    """A figure over ranks: mean, lowest, highest, how many ranks had it."""

    mean: float
    lo: float
    hi: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float | None]) -> Spread | None:
        got = [float(v) for v in values if v is not None]
        if not got:
            return None
        return cls(statistics.fmean(got), min(got), max(got), len(got))

    def text(self, digits: int) -> str:
        """``4.048`` for one rank, ``4.048 (3.991-4.112)`` with the range over several."""
        mean = f"{self.mean:,.{digits}f}"
        if self.n < 2 or self.lo == self.hi:
            return mean
        return f"{mean} ({self.lo:,.{digits}f}-{self.hi:,.{digits}f})"


@dataclass(frozen=True)
class Metric:
    label: str
    get: Callable[[TraceFigures], float | None]
    digits: int
    delta: str  # "pct" (relative), "abs" (a count's difference)


def _calls(group: str) -> Callable[[TraceFigures], float | None]:
    return lambda t: t.calls.get(group) if t.domain == "kernel" else None


def metrics(steps: int | None, domain: str) -> list[Metric]:
    """The paired table's rows (the seeds': query step per layer, events for the steps, span),
    then busy time and the synchronising calls. Without `steps`, no per-step row."""
    what = "CUDA kernel events" if domain == "kernel" else "CPU op events"
    where = "GPU" if domain == "kernel" else "CPU"
    counted = [Metric(f"{what}, {steps} steps", lambda t: t.work_events, 0, "abs")]
    if steps:
        counted.append(Metric(f"{what} per step", lambda t: t.work_events / steps, 1, "abs"))
    else:
        counted = [Metric(what, lambda t: t.work_events, 0, "abs")]
    return [
        Metric("Query step per layer (us)", lambda t: t.query.per_layer_us, 3, "pct"),
        *counted,
        Metric(f"{where} trace span (us)", lambda t: t.span_us, 3, "pct"),
        Metric(f"{where} busy (us)", lambda t: t.busy_us, 3, "pct"),
        *(Metric(label, _calls(g), 0, "abs") for g, label in SYNC_LABELS.items()),
    ]


def delta_text(base: Spread | None, cand: Spread | None, kind: str) -> str:
    if base is None or cand is None:
        return MISSING
    if kind == "abs":
        diff = cand.mean - base.mean
        return f"{diff:+,.0f}" if diff == int(diff) else f"{diff:+,.1f}"
    if base.mean == 0:
        return MISSING
    return f"{100.0 * (cand.mean - base.mean) / base.mean:+.2f}%"


@dataclass
class ProfilePair:
    """One topology's staged/fused (first variant vs another) profile, rank by rank."""

    topology_id: str
    baseline: str
    candidate: str
    base: ProfileResult
    cand: ProfileResult
    rows: list[tuple[str, str, str, str]] = field(default_factory=list)
    # One model step by kernel family on each path (orchestrator.analysis.step_compare);
    # None where neither the rows nor the run directory hold the step figures.
    by_family: StepComparison | None = None

    @property
    def steps(self) -> int:
        return self.base.decode_steps

    @property
    def domain(self) -> str:
        return self.base.traces[0].domain if self.base.traces else "kernel"

    def table(self) -> list[tuple[str, str, str, str]]:
        """(metric, baseline, candidate, delta), each figure the mean over ranks with the
        range when the ranks differ."""
        out = []
        for m in metrics(self.steps, self.domain):
            b = Spread.of([m.get(t) for t in self.base.traces])
            c = Spread.of([m.get(t) for t in self.cand.traces])
            if b is None and c is None:
                continue
            out.append(
                (
                    m.label,
                    b.text(m.digits) if b else MISSING,
                    c.text(m.digits) if c else MISSING,
                    delta_text(b, c, m.delta),
                )
            )
        return out

    def paths(self) -> str:
        def one(p: ProfileResult) -> str:
            found = sorted({t.query.path or "none" for t in p.traces})
            return "/".join(found) or "none"

        return f"query path found: {one(self.base)} vs {one(self.cand)}"

    def identity(self) -> str:
        """The seeds' check, for the baseline the traces show: the events removed are exactly
        the query step's own (staged's query-step events minus the fused ones), so nothing
        else gained or lost a launch. Against a staged bmm + cat that is layers x steps (one
        launch fewer per layer and step); against the bmm alone it is 0 (one kernel replaced
        by one)."""
        b = Spread.of([t.work_events for t in self.base.traces])
        c = Spread.of([t.work_events for t in self.cand.traces])
        if b is None or c is None:
            return "Removed events: not measured (a side has no trace)."
        removed = b.mean - c.mean
        steps = self._steps_seen() or self.steps
        layers = self.base.layers
        if layers is None:
            return (
                f"Removed events: {removed:+,.1f} per rank; the model's layer count is not "
                "known, so layers x steps is not checked."
            )
        qb = statistics.fmean(t.query.events for t in self.base.traces)
        qc = statistics.fmean(t.query.events for t in self.cand.traces)
        expected = qb - qc
        per_step = expected / (layers * steps) if layers * steps else 0.0
        front = ""
        if _runs_front(self.cand):
            # The decode front's one launch also does the step's RoPE and KV-cache write:
            # those families' events are the candidate's to remove as well.
            ab, ac = (_absorbed_events(p) for p in (self.base, self.cand))
            expected += ab - ac
            front = (
                f"; the decode front also takes the RoPE and KV-cache writes, {ab:,.0f} -> "
                f"{ac:,.0f}"
            )
        verdict = "holds" if removed == expected else "does not hold"
        return (
            f"Removed events: {removed:,.1f} per rank (mean over ranks); the query step's own "
            f"{qb:,.0f} -> {qc:,.0f}, {per_step:g} a layer and step over layers x steps = "
            f"{layers} x {steps} = {layers * steps}{front}: {expected:,.0f} expected, the "
            f"identity {verdict}."
        )

    def _steps_seen(self) -> int | None:
        seen = {t.steps_seen for t in self.base.traces if t.steps_seen}
        return seen.pop() if len(seen) == 1 else None

    def sync(self) -> str:
        """Whether the candidate added hot-path synchronisation: every call group compared."""
        if self.domain != "kernel":
            return "Synchronising calls: not compared (a CPU trace has no CUDA runtime calls)."
        diffs, same = [], []
        for g, label in SYNC_LABELS.items():
            b = Spread.of([t.calls.get(g, 0) for t in self.base.traces])
            c = Spread.of([t.calls.get(g, 0) for t in self.cand.traces])
            if b is None or c is None:
                continue
            if b.mean == c.mean:
                same.append(f"{b.mean:,.0f} {label}")
            else:
                diffs.append(f"{label} {b.mean:,.1f} vs {c.mean:,.1f}")
        if diffs:
            return f"Synchronisation changed: {'; '.join(diffs)} (per rank, mean)."
        return f"No extra synchronisation: both traces contain {', '.join(same)} per rank."

    def per_rank(self) -> tuple[list[str], list[list[str]]]:
        """Rank | query/layer base, cand | events base, cand | span base, cand."""
        header = [
            "Rank",
            f"query/layer {self.baseline} (us)",
            f"query/layer {self.candidate} (us)",
            f"events {self.baseline}",
            f"events {self.candidate}",
            f"span {self.baseline} (us)",
            f"span {self.candidate} (us)",
        ]
        by_rank_b = {t.rank: t for t in self.base.traces}
        by_rank_c = {t.rank: t for t in self.cand.traces}
        body = []
        for rank in sorted(set(by_rank_b) | set(by_rank_c), key=lambda r: -1 if r is None else r):
            b, c = by_rank_b.get(rank), by_rank_c.get(rank)
            body.append(
                [
                    MISSING if rank is None else str(rank),
                    _num(b and b.query.per_layer_us, 3),
                    _num(c and c.query.per_layer_us, 3),
                    _num(b and b.work_events, 0),
                    _num(c and c.work_events, 0),
                    _num(b and b.span_us, 3),
                    _num(c and c.span_us, 3),
                ]
            )
        return header, body

    def family_table(self) -> tuple[list[str], list[list[str]]]:
        """Family | events per step on each side | µs per step on each side | the change with
        its interval; the whole step's sum and busy time last. ([], []) without steps."""
        if self.by_family is None:
            return [], []
        b, c = self.baseline, self.candidate
        header = [
            "Family", f"Events/step {b}", f"Events/step {c}", f"us/step {b}", f"us/step {c}",
            "Change us/step (95% interval)",
        ]  # fmt: skip
        body = [
            [
                f.label,
                MISSING if f.family == BUSY else f"{f.base_events:,.1f}",
                MISSING if f.family == BUSY else f"{f.cand_events:,.1f}",
                f"{f.base_us:,.2f}",
                f"{f.cand_us:,.2f}",
                f.change_text(),
            ]
            for f in self.by_family.rows()
        ]
        return header, body

    def family_notes(self) -> list[str]:
        """The unit and interval, what changed, and the work recorded as kernels on one path
        and as copies on the other (docs/profiling.md says why)."""
        s = self.by_family
        if s is None:
            return []
        notes = [s.unit(), f"Families: {s.changed_text()}."]
        for apart in s.recorded_apart():
            notes.append(
                f"Recorded apart: {apart}; the others are copy records, not kernels: a CUDA "
                "graph's memcpy node runs as a kernel (memcpy32_post) or on a copy engine, and "
                "the two paths' graphs ran the same copies differently."
            )
        return notes

    def to_dict(self) -> dict[str, Any]:
        return {
            "topology_id": self.topology_id,
            "baseline": self.baseline,
            "candidate": self.candidate,
            "decode_steps": self.steps,
            "domain": self.domain,
            "table": [
                {"metric": m, "baseline": b, "candidate": c, "delta": d}
                for m, b, c, d in self.table()
            ],
            "paths": self.paths(),
            "identity": self.identity(),
            "sync": self.sync(),
            "by_family": None if self.by_family is None else self.by_family.to_dict(),
            "ranks": {
                self.baseline: [t.model_dump(mode="json") for t in self.base.traces],
                self.candidate: [t.model_dump(mode="json") for t in self.cand.traces],
            },
        }


def _spread_text(
    traces: Sequence[TraceFigures], get: Callable[[TraceFigures], float | None], digits: int
) -> str:
    s = Spread.of([get(t) for t in traces])
    return MISSING if s is None else s.text(digits)


def _num(v: float | None, digits: int) -> str:
    return MISSING if v is None else f"{v:,.{digits}f}"


def profile_pairs(
    results: Sequence[Any], variants: Sequence[str], root: Path | None = None
) -> list[ProfilePair]:
    """Per topology: the first variant's profile against each other variant's (both profiled
    and with traces), in case order. `root`, the run directory, is where the traces of rows
    written before the step figures were stored are read again."""
    if len(variants) < 2:
        return []
    by_topo: OrderedDict[str, dict[str, Any]] = OrderedDict()
    for r in results:
        if r.profile is not None and r.profile.traces:
            by_topo.setdefault(r.topology_id, {})[r.variant] = r
    base = variants[0]
    pairs = []
    for topo, vs in by_topo.items():
        for cand in variants[1:]:
            if base in vs and cand in vs:
                b, c = vs[base], vs[cand]
                fams = compare_steps(row_steps(b, root), row_steps(c, root))
                pairs.append(ProfilePair(topo, base, cand, b.profile, c.profile, by_family=fams))
    return pairs


# --------------------------------------------------------------------------- one trace


def trace_rows(t: TraceFigures, steps: int | None) -> list[tuple[str, str]]:
    """(figure, value) of one trace, as trace-summary prints it."""
    events = "kernel events" if t.domain == "kernel" else "CPU op events (no kernel events)"
    rows = [
        ("rank", MISSING if t.rank is None else str(t.rank)),
        ("trace events", f"{t.trace_events:,}"),
        (events, f"{t.work_events:,}"),
    ]
    n = steps or t.steps_seen
    if n:
        how = "given" if steps else "seen in vLLM's step annotations"
        rows.append((f"per step ({n} steps, {how})", f"{t.work_events / n:,.1f}"))
    rows += [
        ("span (us)", _num(t.span_us, 3)),
        ("busy (us)", _num(t.busy_us, 3)),
        ("work time, summed (us)", f"{t.work_us:,.3f}"),
    ]
    if t.domain == "kernel":
        rows += [(SYNC_LABELS[g], f"{t.calls.get(g, 0):,}") for g in SYNC_LABELS]
    if t.steps and t.outside is not None:
        rows.append(
            ("device work outside the model steps",
             f"{t.outside.events:,} events, {t.outside.us:,.3f} us")
        )  # fmt: skip
    q = t.query
    if q.occurrences:
        rows.append(
            (
                "query step per layer (us)",
                f"{q.per_layer_us:,.3f} ({q.path}: {q.occurrences} layer steps, {q.events} events)",
            )
        )
        if q.launched_by:
            rows.append(("query kernels launched by", _counts(q.launched_by)))
    else:
        rows.append(("query step", "none found"))
    return rows


def family_rows(t: TraceFigures, steps: int | None) -> tuple[list[str], list[list[str]]]:
    """One trace's device work per model step by kernel family, as trace-summary prints it:
    the mean over vLLM's annotated steps with the range over them; for a trace without
    annotations, its whole work over the `steps` given. ([], []) where neither is known."""
    if t.steps:
        per_step = [
            [s.families[f].us if f in s.families else 0.0 for s in t.steps] for f in _fams(t)
        ]
        events = [
            statistics.fmean(s.families[f].events if f in s.families else 0 for s in t.steps)
            for f in _fams(t)
        ]
        how = f"mean over its {len(t.steps)} model steps (range)"
    elif steps and t.outside is not None:
        fams = t.outside.families
        per_step = [[fams[f].us / steps] for f in _fams(t)]
        events = [fams[f].events / steps for f in _fams(t)]
        how = f"the whole trace over the {steps} steps given"
    else:
        return [], []
    header = ["Family", "Events/step", f"us/step, {how}"]
    body = [
        [FAMILY_LABELS.get(f, f), f"{e:,.1f}", Spread.of(us).text(2)]  # type: ignore[union-attr]
        for f, e, us in zip(_fams(t), events, per_step, strict=True)
    ]
    return header, body


def _fams(t: TraceFigures) -> list[str]:
    got = {f for s in (*t.steps, *([t.outside] if t.outside else [])) for f in s.families}
    return [f for f in (*FAMILIES, *sorted(got - set(FAMILIES))) if f in got]


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in counts.items())


def mean_rows(traces: Sequence[TraceFigures], steps: int | None) -> list[tuple[str, str]]:
    """Figures averaged over the given traces (ranks), with their range."""
    rows = []
    for m in metrics(steps, traces[0].domain):
        s = Spread.of([m.get(t) for t in traces])
        if s is not None:
            rows.append((m.label, s.text(m.digits)))
    return rows


def case_profile_rows(results: Sequence[Any]) -> tuple[list[str], list[list[str]]]:
    """One row per profiled case, figures averaged over its ranks (the range where they
    differ): what a run without paired variants shows."""
    header = [
        "Case", "Ranks", "Query path", "Query step/layer (us)", "Events", "Events/step",
        "Span (us)", "Busy (us)",
    ]  # fmt: skip
    body = []
    for r in results:
        p = r.profile
        if p is None:
            continue
        if not p.traces:
            body.append([r.case_id, "0", MISSING, p.error or "no trace", *[MISSING] * 4])
            continue

        steps = p.decode_steps
        body.append(
            [
                r.case_id,
                str(len(p.traces)),
                "/".join(sorted({t.query.path or "none" for t in p.traces})),
                *(
                    _spread_text(p.traces, m.get, m.digits)
                    for m in metrics(steps, p.traces[0].domain)
                    if m.label.startswith(("Query", "CUDA", "CPU op", "GPU trace", "CPU trace"))
                    or "busy" in m.label
                ),
            ]
        )
    return header, body


def _runs_front(profile: ProfileResult) -> bool:
    """Whether the query step these traces found is the decode front's kernel."""
    return any(n in t.query.names for t in profile.traces for n in FRONT_KERNEL_NAMES)


def _absorbed_events(profile: ProfileResult) -> float:
    """The RoPE and KV-cache-write events of the traced model steps, mean over ranks."""
    return statistics.fmean(
        sum(st.families[f].events for st in t.steps for f in (ROPE, KV_CACHE) if f in st.families)
        for t in profile.traces
    )
