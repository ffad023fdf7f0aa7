"""One trace's device work, model step by model step, split by kernel family.

A model step is what vLLM annotates ``execute_context_N(..)_generation_M(..)`` with tokens;
it owns every device event launched from the start of its annotation to the start of the
next one (any step's, the empty closing ones included). So the work vLLM launches between two
``execute_model`` calls (sampling, and an MTP draft's forward, which vLLM 0.26 runs after the
annotation closes) counts to the step before it. An event is placed by the runtime call that
launched it (``args.correlation``): a CUDA-graph replay's kernels all carry their
``cudaGraphLaunch``'s. What has no launch in a model step (before the first, after the last,
all of a trace without annotations) is ``outside``.

Device events are kernels and CUPTI's copy and memset records (``gpu_memcpy``,
``gpu_memset``): a memcpy node of a CUDA graph is executed either as a kernel
(``memcpy32_post``) or by a copy engine (a ``Memcpy DtoD`` record), and only counting both
keeps the same copy in the same family whichever way one graph ran it (docs/profiling.md).
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from orchestrator.analysis.kernel_names import DEFAULT_FAMILIES, QUERY, FamilyTable
from orchestrator.results.profile_figures import FamilyWork, StepWork


class DeviceEvent(Protocol):
    ts: float
    end: float
    name: str
    correlation: Any


# correlation id -> the runtime call that launched it: (pid, tid, ts, name)
Launches = dict[Any, tuple[Any, Any, float, str]]


@dataclass
class _Step:
    # (event, its family, whether it is a kernel)
    events: list[tuple[DeviceEvent, str, bool]] = field(default_factory=list)

    def work(self) -> StepWork:
        families: dict[str, FamilyWork] = {}
        for e, fam, kernel in self.events:
            f = families.setdefault(fam, FamilyWork())
            f.events += 1
            f.kernels += kernel
            f.us += e.end - e.ts
        for f in families.values():
            f.us = round(f.us, 3)
        return StepWork(families=families, busy_us=round(busy(e for e, _, _ in self.events), 3))


def step_work(
    kernels: Iterable[DeviceEvent],
    copies: Iterable[DeviceEvent],
    query: set[int],
    launches: Launches,
    marks: Sequence[tuple[float, bool]],
    table: FamilyTable = DEFAULT_FAMILIES,
) -> tuple[list[StepWork], StepWork | None]:
    """Each model step's work and the work outside every model step (None when there is
    none). `query` holds the ids of the events the query-step rule counted; `marks` the step
    annotations' start times, each with whether it is a model step (it has tokens)."""
    marks = sorted(marks)
    starts = [ts for ts, _ in marks]
    model = [i for i, (_, is_model) in enumerate(marks) if is_model]
    index = {mark: n for n, mark in enumerate(model)}
    steps = [_Step() for _ in model]
    outside = _Step()
    for kernel, events in ((True, kernels), (False, copies)):
        for e in events:
            fam = QUERY if id(e) in query else table.family(e.name)
            launch = launches.get(e.correlation) if e.correlation is not None else None
            at = bisect.bisect_right(starts, launch[2]) - 1 if launch else -1
            where = steps[index[at]] if at in index else outside
            where.events.append((e, fam, kernel))
    return [s.work() for s in steps], (outside.work() if outside.events else None)


def busy(events: Iterable[DeviceEvent]) -> float:
    """The union of the events' intervals (overlapping streams count once): time something
    ran."""
    ordered = sorted(events, key=lambda e: e.ts)
    if not ordered:
        return 0.0
    total, start, end = 0.0, ordered[0].ts, ordered[0].end
    for e in ordered[1:]:
        if e.ts > end:
            total += end - start
            start, end = e.ts, e.end
        else:
            end = max(end, e.end)
    return total + end - start
