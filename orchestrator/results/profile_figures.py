"""A case's profile phase as its row stores it: each trace's figures (one rank of a server)
and the decode query step found in it (orchestrator.analysis.trace computes them)."""

from __future__ import annotations

from pydantic import Field

from orchestrator.results.record import Record

__all__ = [
    "FamilyWork",
    "KernelTotal",
    "ProfileResult",
    "QueryStep",
    "StepWork",
    "TraceFigures",
]


class KernelTotal(Record):
    """One kernel (or CPU op) name of a trace: how often it ran and for how long in all."""

    name: str = ""
    count: int = 0
    total_us: float = 0.0


class QueryStep(Record):
    """The decode query step found in one trace (orchestrator.analysis.trace's rule): how many layer
    steps, their time in all and per layer step, and which path ran them."""

    # "fused", "staged", "mixed" (both in one trace), or None (no query step found).
    path: str | None = None
    occurrences: int = 0
    fused: int = 0
    staged: int = 0
    events: int = 0  # trace events counted in query steps: 2 per staged step with a concat
    total_us: float = 0.0
    names: dict[str, int] = Field(default_factory=dict)
    # What launched the counted kernels, where the trace says (eager: the CPU op around the
    # launch; CUDA graphs: cudaGraphLaunch): the rule's ground truth where one exists.
    launched_by: dict[str, int] = Field(default_factory=dict)

    @property
    def per_layer_us(self) -> float | None:
        return self.total_us / self.occurrences if self.occurrences else None


class FamilyWork(Record):
    """One kernel family's device work in one model step (orchestrator.analysis.kernel_names
    names the families): its events (kernels, and the copy and memset records CUPTI keeps
    apart from kernels), how many of them were kernels, their summed time."""

    events: int = 0
    kernels: int = 0
    us: float = 0.0


class StepWork(Record):
    """The device work of one model step of one trace (orchestrator.analysis.step_work): each
    family's, and the step's busy time (the union of its events' intervals)."""

    families: dict[str, FamilyWork] = Field(default_factory=dict)
    busy_us: float = 0.0

    @property
    def us(self) -> float:
        return sum(f.us for f in self.families.values())

    @property
    def events(self) -> int:
        return sum(f.events for f in self.families.values())


class TraceFigures(Record):
    """The figures of one torch-profiler trace (one rank of a server), from
    orchestrator.analysis.trace.

    ``domain`` is what the device work is: ``kernel`` (GPU kernel events) or ``cpu_op`` (a CPU
    build's trace, whose work is CPU ops); events, span and busy time are of that domain.
    """

    file: str = ""
    rank: int | None = None
    domain: str = "kernel"
    trace_events: int = 0
    kernel_events: int = 0
    work_events: int = 0
    work_us: float = 0.0
    span_us: float | None = None
    busy_us: float | None = None
    steps_seen: int | None = None
    calls: dict[str, int] = Field(default_factory=dict)
    runtime_calls: dict[str, int] = Field(default_factory=dict)
    top: list[KernelTotal] = Field(default_factory=list)
    query: QueryStep = Field(default_factory=QueryStep)
    # Each model step's device work by kernel family, in step order (a GPU trace with vLLM's
    # step annotations), and what was launched outside every model step (all of it in a
    # trace without annotations). Empty/None in a CPU trace and in rows written before them.
    steps: list[StepWork] = Field(default_factory=list)
    outside: StepWork | None = None


class ProfileResult(Record):
    """A case's profile phase: what was asked, where the traces are, each rank's figures."""

    decode_steps: int = 0
    prompt_tokens: int = 1
    layers: int | None = None  # query steps one model step should run (decoder + MTP draft)
    dir: str = "profile"
    traces: list[TraceFigures] = Field(default_factory=list)
    error: str | None = None
