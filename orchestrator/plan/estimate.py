"""How long a run will take: a plan-time estimate from the matrix, refined by measured cases.

Nothing is known about the model's speed before a run, so the estimate is built from assumed
speeds per accelerator kind (below, each with where it came from) and the matrix's own
counts: per case one server start-up, the warm-up requests and every workload; per request a
prefill of its prompt and a decode of its output at one user's speed.

- request mode: repeats x ceil(requests / concurrency) waves x one request's time (users in a
  wave run side by side; batching slows each a little, which the estimate ignores).
- duration mode: repeats x (duration_s + one request's time): requests still in flight when
  the duration ends run to completion (orchestrator.client.workload).

`orchestrator plan` prints it; `orchestrator run`'s ETA starts from it and, once cases have
finished, scales the rest by how far the finished cases' measured times were from their
estimates.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass

from orchestrator.config.axes import WorkloadSpec
from orchestrator.config.expand import Case
from orchestrator.config.schema import WARMUP_OUTPUT_TOKENS, WARMUP_PROMPT_TOKENS, Matrix


@dataclass(frozen=True)
class Speeds:
    """Assumed figures for one accelerator kind; every one is a guess the ETA corrects."""

    startup_s: float  # `vllm serve` from exec to /v1/models answering, a real checkpoint
    builtin_startup_s: float  # the same for a built-in tiny model: no weights to load
    case_overhead_s: float  # Ray placement + stop + audit, per case
    run_overhead_s: float  # local Ray start-up, reports, shutdown, once per run
    decode_tok_s: float  # one user's output tokens per second
    prefill_tok_s: float  # prompt tokens per second of one request's prefill
    # vLLM's CPU MLA backend verifies MTP drafts through the prefill path, which re-expands
    # the whole latent context every step (docs/cpu-vllm.md): each output token then also
    # costs a prefill of the context so far. GPU backends have a real decode path.
    mtp_step_rereads_context: bool = False
    # The fused query where it runs in Triton's interpreter (CPU): seconds per head of a
    # rank, per decode layer and step. 0 where the kernel is compiled (its cost is in
    # decode_tok_s).
    interpreted_query_s_per_head: float = 0.0


ASSUMED: dict[str, Speeds] = {
    # The embedded default (tiny MLA model, vLLM's CPU build, 2 cores), between the two
    # machines it was measured on: start-up 54-90 s per case on 2 AVX2 cores, 29-37 s on 2
    # AVX-512 EPYC cores; one user's decode 65 and 198 tok/s at TP1 MTP0; prefill ~470 and
    # ~3,300 tok/s at 1k tokens (64k took ~105 s, docs/cpu-vllm.md); placement ~1-2.4 s and
    # stop ~2 s per case, Ray start ~6 s. The whole smoke matrix took 9m04s and 3m09s; this
    # estimates ~6.5 min. A real model on CPU is far slower; the ETA learns that from the
    # first case.
    "cpu": Speeds(
        startup_s=60.0,  # only the tiny model was measured; a real checkpoint loads longer
        builtin_startup_s=60.0,
        case_overhead_s=6.0,
        run_overhead_s=10.0,
        decode_tok_s=60.0,
        prefill_tok_s=1500.0,
        mtp_step_rereads_context=True,
        # fusedq's kernel in the interpreter inside the smoke matrix's TP2 server (8 heads a
        # rank, 2 layers) on the 2-core EPYC, 2026-12-02: TPOT 170.5 ms fused against 12.5 ms
        # staged, 0.0099 s per head, layer and step (alone at M = 1: 0.09 s at 8 heads).
        interpreted_query_s_per_head=0.011,
    ),
    # A large MLA checkpoint (GLM-5, DeepSeek-V3) on one 8-GPU node: weight loading from local
    # disk, torch.compile and CUDA-graph capture take minutes (the shipped matrices allow
    # ready_s=2400); decode 66-124 tok/s per user in the seeds' TP8 table; a 64k prefill
    # costs a few seconds. A built-in tiny model skips the weights but not vLLM's imports,
    # torch.compile and CUDA-graph capture: ~2 min -- measured 95-145 s for tiny-glm5 with
    # vLLM 0.26 on H200s, TP1 and TP2 (docs/validation/h200-2026-11-30). The start-up figure
    # dominates short matrices: read it as a scale.
    "gpu": Speeds(
        startup_s=600.0,
        builtin_startup_s=120.0,
        case_overhead_s=30.0,
        run_overhead_s=30.0,
        decode_tok_s=70.0,
        prefill_tok_s=20000.0,
    ),
}


def request_s(
    prompt_tokens: int, output_tokens: int, mtp: int, speeds: Speeds, query_s: float = 0.0
) -> float:
    """One request's estimated latency: prefill, then decode (see Speeds for CPU MTP), each
    step `query_s` more where the fused query runs interpreted (`interpreted_query_s`)."""
    t = prompt_tokens / speeds.prefill_tok_s + output_tokens * (1 / speeds.decode_tok_s + query_s)
    if mtp and speeds.mtp_step_rereads_context:
        # Each step re-reads the context, which grows from the prompt by one token a step.
        t += output_tokens * (prompt_tokens + output_tokens / 2) / speeds.prefill_tok_s
    return t


def interpreted_query_s(case: Case, accelerator: str, speeds: Speeds) -> float:
    """Seconds the fused query adds to one decode step where Triton's interpreter runs it:
    every decoder layer's, or on CPU with MTP only the draft layer's (the verify step takes
    the prefill path); 0 where the fused query does not run or is compiled."""
    from orchestrator.plan.fused import fused_plan

    if not speeds.interpreted_query_s_per_head or not fused_plan(case, accelerator).runs:
        return 0.0
    layers = case.model.builtin_layers if case.model.is_builtin else 2
    if case.mtp and speeds.mtp_step_rereads_context:
        layers = case.mtp
    return layers * case.heads_per_rank * speeds.interpreted_query_s_per_head


def workload_s(w: WorkloadSpec, mtp: int, speeds: Speeds, query_s: float = 0.0) -> float:
    one = request_s(w.prompt_tokens, w.output_tokens, mtp, speeds, query_s)
    if w.duration_s is not None:
        return w.repeats * (w.duration_s + one)
    assert w.request_count is not None
    return w.repeats * math.ceil(w.request_count / w.concurrency) * one


@dataclass(frozen=True)
class CaseEstimate:
    case_id: str
    startup_s: float
    warmup_s: float
    workloads_s: dict[str, float]
    overhead_s: float

    @property
    def total_s(self) -> float:
        return self.startup_s + self.warmup_s + sum(self.workloads_s.values()) + self.overhead_s


@dataclass(frozen=True)
class RunEstimate:
    accelerator: str
    speeds: Speeds
    cases: list[CaseEstimate]
    run_overhead_s: float
    interpreted: bool = False  # a case's fused query runs in Triton's interpreter

    @property
    def total_s(self) -> float:
        return self.run_overhead_s + sum(c.total_s for c in self.cases)

    def per_case(self) -> dict[str, float]:
        return {c.case_id: c.total_s for c in self.cases}

    def basis(self) -> str:
        """How the figure was made, in a sentence a plan prints beside it."""
        s = self.speeds
        starts = sorted({round(c.startup_s) for c in self.cases if c.startup_s})
        start = " or ".join(f"{x} s" for x in starts) or f"{s.startup_s:.0f} s"
        out = (
            f"an estimate from assumed {self.accelerator.upper()} speeds, not a measurement: "
            f"server start-up {start} per case, one user decodes "
            f"{s.decode_tok_s:g} tok/s and prefills {s.prefill_tok_s:g} tok/s"
        )
        if s.mtp_step_rereads_context:
            out += ", an MTP step re-reads its context (vLLM's CPU MLA backend)"
        if self.interpreted:
            out += (
                f", the fused query in Triton's interpreter {s.interpreted_query_s_per_head:g} s "
                "per head of a rank, layer and step"
            )
        return out + "; the run's ETA corrects it with measured cases"

    def to_dict(self) -> dict[str, object]:
        return {
            "total_s": round(self.total_s, 1),
            "basis": self.basis(),
            "assumed": asdict(self.speeds),
            "cases": {c.case_id: round(c.total_s, 1) for c in self.cases},
        }


def estimate_run(matrix: Matrix, cases: Sequence[Case]) -> RunEstimate:
    speeds = ASSUMED[matrix.resources.accelerator]
    out = []
    interpreted = False
    for c in cases:
        q = interpreted_query_s(c, matrix.resources.accelerator, speeds)
        interpreted = interpreted or q > 0
        warm = request_s(WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS, c.mtp, speeds, q)
        out.append(
            CaseEstimate(
                case_id=c.case_id,
                startup_s=speeds.builtin_startup_s if c.model.is_builtin else speeds.startup_s,
                warmup_s=matrix.warmup_requests * warm,
                workloads_s={w.name: workload_s(w, c.mtp, speeds, q) for w in matrix.workloads},
                overhead_s=speeds.case_overhead_s,
            )
        )
    if matrix.switch_mode:
        out = _switch_servers(matrix, cases, out)
    return RunEstimate(
        matrix.resources.accelerator, speeds, out, speeds.run_overhead_s, interpreted
    )


def _switch_servers(
    matrix: Matrix, cases: Sequence[Case], estimates: list[CaseEstimate]
) -> list[CaseEstimate]:
    """A switch-mode server measures every variant of its topology and start (one start-up,
    `blocks` (or `max_blocks`) runs of the workloads per variant, a warm-up after each flip): the whole
    server is estimated on its baseline case, which the run begins it with, the others at 0."""
    assert matrix.ab is not None
    baseline = matrix.baseline_variant.name
    # The worst case under the stopping rule: it may run every round up to ab.max_blocks.
    rounds = matrix.ab.worst_case_blocks * len(matrix.variants)
    out = []
    for c, e in zip(cases, estimates, strict=True):
        if c.variant.name != baseline:
            out.append(CaseEstimate(c.case_id, 0.0, 0.0, {}, 0.0))
            continue
        workloads = {k: v * rounds for k, v in e.workloads_s.items()}
        out.append(
            CaseEstimate(c.case_id, e.startup_s, e.warmup_s * (rounds + 1), workloads, e.overhead_s)
        )
    return out


class Eta:
    """Time left in a run: the estimate of what is left, scaled by how the finished cases
    measured against their own estimates (passed cases only once there is one: a case that
    failed at start-up says nothing about how long measuring takes)."""

    def __init__(self, estimates: Mapping[str, float], todo: Sequence[str]) -> None:
        self.estimates = dict(estimates)
        self.left = list(todo)
        self._measured: list[tuple[float, float, bool]] = []  # (estimated, measured, passed)

    def finished(self, case_id: str, measured_s: float, passed: bool) -> None:
        if case_id in self.left:
            self.left.remove(case_id)
        if case_id in self.estimates:
            self._measured.append((self.estimates[case_id], measured_s, passed))

    @property
    def factor(self) -> float:
        basis = [m for m in self._measured if m[2]] or self._measured
        est = sum(e for e, _, _ in basis)
        return sum(m for _, m, _ in basis) / est if est > 0 else 1.0

    def remaining_s(self, current: str | None = None, current_elapsed_s: float = 0.0) -> float:
        f = self.factor
        rest = sum(self.estimates.get(c, 0.0) for c in self.left if c != current)
        now = max(f * self.estimates.get(current, 0.0) - current_elapsed_s, 0.0) if current else 0
        return f * rest + now


def human_s(seconds: float) -> str:
    """12 s, 4m05s, 2h03m: short enough for a status line."""
    s = max(round(seconds), 0)
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"
