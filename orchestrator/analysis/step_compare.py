"""Two paths' decode steps compared kernel family by kernel family: where the GPU time of one
model step went on each path, and what changed, each change with an interval.

The unit of replication is the model step: the profiled request runs the same steps in the
same order on each path (the first one's one-token prompt, then the decode steps), so the
i-th step of one path is paired with the i-th of the other, and a family's change is Student's
t interval over those paired differences (each step's figure the mean over the trace's ranks,
and over the variant's profiled servers where it has several). The steps of one profile share
a server, its graphs and its memory: the interval measures how much a step's time moves from
step to step, not from one server start to another.

The figures come from each trace's stored step figures (orchestrator.analysis.step_work); a
row written before they were stored has them read again from its trace files, when the run
directory still holds them (``row_steps``).
"""

from __future__ import annotations

import functools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.analysis.kernel_names import FAMILIES, FAMILY_LABELS
from orchestrator.analysis.stats import Interval, t_interval
from orchestrator.common.layout import CASES, case_slug
from orchestrator.results.profile_figures import StepWork, TraceFigures
from orchestrator.results.rows import CaseResult

TOTAL, BUSY = "total", "busy"
ROW_LABELS = {
    **FAMILY_LABELS,
    TOTAL: "whole step (sum of the families)",
    BUSY: "GPU busy (union of intervals)",
}


@dataclass(frozen=True)
class FamilyChange:
    """One family (or the whole step) per model step on each path, and the change."""

    family: str
    base_events: float
    cand_events: float
    base_kernels: float
    cand_kernels: float
    base_us: float
    cand_us: float
    change: Interval | None  # µs per step, candidate - baseline; None with one step

    @property
    def delta_us(self) -> float:
        return self.cand_us - self.base_us

    @property
    def changed(self) -> bool:
        """The interval excludes 0: the family's time moved beyond its step-to-step noise."""
        iv = self.change
        return iv is not None and (iv.low > 0 or iv.high < 0)

    @property
    def label(self) -> str:
        return ROW_LABELS.get(self.family, self.family)

    def change_text(self) -> str:
        """``-58.64 (-59.31 … -57.97)``, or the bare difference without an interval."""
        iv = self.change
        if iv is None:
            return f"{self.delta_us:+,.2f}"
        return f"{iv.estimate:+,.2f} ({iv.low:+,.2f} … {iv.high:+,.2f})"

    def to_dict(self) -> dict[str, Any]:
        iv = self.change
        return {
            "family": self.family,
            "events_per_step": [self.base_events, self.cand_events],
            "kernels_per_step": [self.base_kernels, self.cand_kernels],
            "us_per_step": [self.base_us, self.cand_us],
            "change_us": self.delta_us,
            "interval_us": None if iv is None else [iv.low, iv.high],
            "changed": self.changed,
        }


@dataclass(frozen=True)
class StepComparison:
    """Every family's change per model step, their sum (the whole step) and the busy time."""

    steps: int  # step positions paired
    ranks: tuple[int, int]  # traces averaged on each side
    families: list[FamilyChange]
    total: FamilyChange
    busy: FamilyChange

    def rows(self) -> list[FamilyChange]:
        return [*self.families, self.total, self.busy]

    def changed(self) -> list[FamilyChange]:
        return [f for f in self.families if f.changed]

    def unit(self) -> str:
        base, cand = self.ranks
        traces = (
            f"{base} and {cand} traces"
            if base != cand
            else f"{base} trace{'s' if base > 1 else ''} a side"
        )
        how = (
            f"Student's t over the {self.steps} paired differences"
            if self.steps > 1
            else "no interval from one step"
        )
        return (
            f"Per model step, {self.steps} steps a path paired by position ({traces}, each "
            f"step's figure their mean); 95% interval: {how}."
        )

    def changed_text(self) -> str:
        """``changed: query step -58.64 µs, attention -8.10 µs`` or that none did."""
        moved = [f"{f.label} {f.delta_us:+,.2f} µs" for f in self.changed()]
        return "changed: " + ", ".join(moved) if moved else "no family changed beyond its noise"

    def recorded_apart(self) -> list[str]:
        """Families whose kernel count differs while their device events do not: the same
        work recorded as kernels on one path and as copy-engine records on the other (a CUDA
        graph's memcpy node run either way: orchestrator.analysis.step_work)."""
        out = []
        for f in self.families:
            if f.base_events == f.cand_events and f.base_kernels != f.cand_kernels:
                out.append(
                    f"{f.label}: {f.base_events:,.1f} events per step on both paths, of which "
                    f"{f.base_kernels:,.1f} vs {f.cand_kernels:,.1f} kernels"
                )
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "traces": list(self.ranks),
            "families": [f.to_dict() for f in self.families],
            "total": self.total.to_dict(),
            "busy": self.busy.to_dict(),
            "changed": [f.family for f in self.changed()],
            "unit": self.unit(),
        }


def compare_steps(
    base: Sequence[Sequence[StepWork]], cand: Sequence[Sequence[StepWork]]
) -> StepComparison | None:
    """Per family, the baseline's traces (each a list of model steps) against the
    candidate's; None where a side has no trace with step figures."""
    base = [t for t in base if t]
    cand = [t for t in cand if t]
    if not base or not cand:
        return None
    n = min(len(t) for t in (*base, *cand))
    present = {f for side in (base, cand) for t in side for s in t[:n] for f in s.families}
    families = [f for f in (*FAMILIES, *sorted(present - set(FAMILIES))) if f in present]

    def change(name: str, get: Callable[[StepWork], tuple[float, float, float]]) -> FamilyChange:
        b, c = _per_position(base, n, get), _per_position(cand, n, get)
        diffs = [cu - bu for (_, _, bu), (_, _, cu) in zip(b, c, strict=True)]

        def mean(side: list[tuple[float, float, float]], k: int) -> float:
            return statistics.fmean(x[k] for x in side)

        return FamilyChange(
            name, mean(b, 0), mean(c, 0), mean(b, 1), mean(c, 1), mean(b, 2), mean(c, 2),
            t_interval(diffs),
        )  # fmt: skip

    def family(name: str) -> Callable[[StepWork], tuple[float, float, float]]:
        def get(s: StepWork) -> tuple[float, float, float]:
            f = s.families.get(name)
            return (f.events, f.kernels, f.us) if f else (0.0, 0.0, 0.0)

        return get

    def whole(s: StepWork) -> tuple[float, float, float]:
        return s.events, sum(f.kernels for f in s.families.values()), s.us

    def busy(s: StepWork) -> tuple[float, float, float]:
        return s.events, sum(f.kernels for f in s.families.values()), s.busy_us

    return StepComparison(
        n,
        (len(base), len(cand)),
        [change(f, family(f)) for f in families],
        change(TOTAL, whole),
        change(BUSY, busy),
    )


def _per_position(
    traces: Sequence[Sequence[StepWork]],
    n: int,
    get: Callable[[StepWork], tuple[float, float, float]],
) -> list[tuple[float, float, float]]:
    """Each of the first `n` steps' figures, the mean over the traces."""
    out = []
    for i in range(n):
        got = [get(t[i]) for t in traces]
        events, kernels, us = (statistics.fmean(g[k] for g in got) for k in range(3))
        out.append((events, kernels, us))
    return out


# --------------------------------------------------------------------------- a row's steps


def row_steps(row: CaseResult, root: Path | None) -> list[list[StepWork]]:
    """Each rank's model steps of a profiled row: the stored figures, or, for a GPU trace
    written before they were stored, its file read again from the row's case directory under
    `root` (the run directory), where it is still there; [] per rank where neither is."""
    profile = row.profile
    if profile is None:
        return []
    case_dir = None if root is None else server_case_dir(row, Path(root))
    return [_trace_steps(t, case_dir) for t in profile.traces]


def server_case_dir(row: CaseResult, root: Path) -> Path:
    """The case directory of the server that wrote a row's traces under the run directory
    `root` (a switch server's, for every variant it served)."""
    server = row.switch.server_case if row.switch and row.switch.server_case else row.case_id
    return root / CASES / case_slug(server)


def kept_trace(case_dir: Path, file: str) -> Path | None:
    """A row's trace file (named relative to its case directory) where it is still there;
    None for one that is gone or points elsewhere (docs/security.md: what the reports read)."""
    path = (case_dir / file).resolve()
    if not path.is_relative_to(case_dir.resolve()) or not path.is_file():
        return None
    return path


def _trace_steps(t: TraceFigures, case_dir: Path | None) -> list[StepWork]:
    if t.steps or t.domain != "kernel" or case_dir is None or not t.file:
        return list(t.steps)
    path = kept_trace(case_dir, t.file)
    if path is None:
        return []
    stat = path.stat()
    return list(_read_steps(str(path), stat.st_mtime_ns, stat.st_size))


@functools.lru_cache(maxsize=64)
def _read_steps(path: str, mtime_ns: int, size: int) -> tuple[StepWork, ...]:
    """A trace's step figures, read once per file version (the three report formats, and
    the A/B's evidence chain, ask for the same ones)."""
    from orchestrator.analysis.trace import TraceError, read_trace

    try:
        return tuple(read_trace(path).steps)
    except TraceError:
        return ()
