"""The result of a case, as results.jsonl stores it and every reader reads it back.

One ``CaseResult`` per line of ``results.jsonl``: the case (its topology, variant, argv and
env), where and how its server ran, each workload's figures (``WorkloadSummary``: every
repeat, their mean, and the latency distributions pooled over the workload's requests), the
same-token checks, the audit (``AuditSummary``, orchestrator.results.stored_audit), the
profile (``ProfileResult``, orchestrator.results.profile_figures) and the timings. The runner
writes it; resume, the reports (Markdown, JSON, HTML, JUnit, the closing table), compare and
nightly read it, and none of them digs in raw dicts for a field. Every record here reads
leniently (orchestrator.results.record says how and why).

``schema_version``: 1 for rows written since the models exist; rows without it are the
earlier, compatible shape.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from pydantic import Field, field_validator

from orchestrator.results.profile_figures import ProfileResult
from orchestrator.results.record import Record, none_is_default
from orchestrator.results.stored_audit import AuditSummary

SCHEMA_VERSION = 1

__all__ = [
    "SCHEMA_VERSION",
    "CaseResult",
    "Chunking",
    "Distribution",
    "Figures",
    "Latency",
    "PathFlip",
    "Repeat",
    "ServerInfo",
    "SpecDecode",
    "Startup",
    "SwitchRecord",
    "TokenCheck",
    "Warmup",
    "WorkloadSummary",
]


# --------------------------------------------------------------------------- workloads


# The phase after the measurements (CaseResult.failed_in).
PROFILE_PHASE = "profile"


class _Figures(Record):
    """Figures of which an undefined one (of no values) may have been written as NaN."""

    @field_validator("*", mode="before")
    @classmethod
    def _nan_is_none(cls, v: Any) -> Any:
        return None if isinstance(v, float) and math.isnan(v) else v


class Distribution(_Figures):
    """A latency distribution in ms: percentiles and mean (None where no request measured),
    and ``n``, the samples behind it (None in rows recorded before it was kept)."""

    p50: float | None = None
    p90: float | None = None
    p99: float | None = None
    mean: float | None = None
    n: int | None = None


class Figures(Record):
    """The figures of one repeat of a workload, or their field-wise mean over repeats.

    aggregate tok/s: output tokens of the successful requests / wall time; per-user tok/s:
    tokens after each request's first chunk / the time after it (orchestrator.client.metrics).
    """

    requests: float | None = None
    errors: float | None = None
    output_tokens: float | None = None
    prompt_tokens: float | None = None
    wall_s: float | None = None
    aggregate_tok_s: float | None = None
    per_user_tok_s: float | None = None
    ttft_ms: Distribution | None = None
    tpot_ms: Distribution | None = None
    itl_ms: Distribution | None = None


class Repeat(Figures):
    """One measured repeat (``repeat`` counts from 1); its counts are whole numbers."""

    repeat: int | None = None
    requests: int | None = None
    errors: int | None = None
    output_tokens: int | None = None
    prompt_tokens: int | None = None


class Chunking(_Figures):
    """How a workload's tokens were streamed to the client
    (orchestrator.client.metrics.chunking)."""

    chunks: int | None = None
    tokens_per_chunk_mean: float | None = None
    tokens_per_chunk_max: int | None = None
    gaps: int | None = None
    gaps_under_1ms: int | None = None


class Latency(Record):
    """The latency distributions pooled over every successful request of a workload, and
    how its tokens were streamed (rows recorded before E2EL and chunking lack them)."""

    ttft_ms: Distribution | None = None
    tpot_ms: Distribution | None = None
    itl_ms: Distribution | None = None
    e2el_ms: Distribution | None = None
    chunking: Chunking | None = None


class SpecDecode(Record):
    """The speculative decoding a workload saw, from the server's /metrics counters read
    before and after it (orchestrator.engines.spec_decode)."""

    drafts: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    acceptance_rate: float | None = None  # accepted / draft tokens
    acceptance_length: float | None = None  # 1 + accepted / drafts
    per_position: list[float] = Field(default_factory=list)
    configured_rates: list[float] | None = None  # vLLM's synthetic rates, where set
    expected_rate: float | None = None
    # Switch mode: each block's own acceptance rate (the variant's figures sum its blocks).
    block_rates: list[float | None] | None = None


class WorkloadSummary(Record):
    """One workload measured on one case's server: each repeat, their mean, the pooled
    latency distributions, request and error counts."""

    name: str | None = None
    params: dict[str, Any] | None = None
    repeats: list[Repeat] = Field(default_factory=list)
    mean: Figures = Field(default_factory=Figures)
    latency: Latency | None = None
    requests: int | None = None
    errors: int = 0
    error_samples: list[str] = Field(default_factory=list)
    spec_decode: SpecDecode | None = None

    @field_validator("mean", mode="before")
    @classmethod
    def _mean(cls, v: Any) -> Any:
        return none_is_default(v, {})

    @field_validator("errors", mode="before")
    @classmethod
    def _errors(cls, v: Any) -> Any:
        return none_is_default(v, 0)

    def mean_of(self, metric: str) -> float | None:
        """The mean over repeats of `metric` (``aggregate_tok_s``, ``per_user_tok_s``)."""
        value = getattr(self.mean, metric, None)
        return None if value is None else float(value)

    def repeat_values(self, metric: str = "aggregate_tok_s") -> list[float]:
        """`metric` of each repeat that recorded it, in repeat order."""
        values = (getattr(r, metric, None) for r in self.repeats)
        return [float(v) for v in values if v is not None and not math.isnan(v)]

    def throughput(self) -> tuple[float | None, float | None, int]:
        """(mean aggregate tok/s, sample standard deviation over repeats or None, repeats)."""
        reps = self.repeat_values()
        sd = statistics.stdev(reps) if len(reps) > 1 else None
        return self.mean_of("aggregate_tok_s"), sd, len(reps)

    def latency_ms(self, key: str) -> Distribution:
        """The pooled distribution of `key` (``ttft_ms``, ``tpot_ms``, ``itl_ms``); rows
        recorded before pooled figures existed fall back to the mean of each repeat's."""
        pooled = getattr(self.latency, key, None) if self.latency is not None else None
        found = pooled if pooled is not None else getattr(self.mean, key, None)
        return found if found is not None else Distribution()


# --------------------------------------------------------------------------- the case


class TokenCheck(Record):
    """A same_tokens check of one workload against the first variant's (orchestrator.client.tokens):
    its verdict and sentence, the reference case, and (when both ran) counts and the first
    divergences; a check not made (verdict ``not-compared``) says why."""

    verdict: str = ""  # identical, near-tie, differs, no-reference or not-compared
    sentence: str = ""
    reference: str | None = None
    why: str | None = None  # not-compared: why the tokens were not compared
    requests: int | None = None
    identical: int | None = None
    ties: int | None = None
    differs: int | None = None
    divergences: list[dict[str, Any]] | None = None
    tolerance_nats: float | None = None


class ServerInfo(Record):
    """Where and how a case's server ran (node facts from its Ray actor, argv, port, exit)."""

    hostname: str | None = None
    node_ip: str | None = None
    node_id: str | None = None
    port: int | None = None
    argv: list[str] | None = None
    exit_code: int | None = None
    died_noticed_at: float | None = None
    port_clashes: list[int] | None = None


class Warmup(Record):
    requests: int = 0
    errors: int = 0


class PathFlip(Record):
    """One flip of a switch-mode server's decode path (orchestrator.execution.switch): when in the
    server's schedule, the path asked for, how long the RPC took, and what the workers said
    (``fusedq_set_path``'s dict per worker: path, recaptured, seconds, layers)."""

    block: int = 0  # the block it preceded, counted from 1 over the server's whole schedule
    path: str = ""
    seconds: float | None = None  # the RPC's wall time, as the orchestrator waited for it
    workers: list[dict[str, Any]] = Field(default_factory=list)

    @property
    def worker_seconds(self) -> float | None:
        """The slowest worker's own figure for the flip (CUDA-graph re-capture included)."""
        got = [
            float(w["seconds"]) for w in self.workers if isinstance(w.get("seconds"), int | float)
        ]
        return max(got) if got else None


class SwitchRecord(Record):
    """How a switch-mode row was measured: its server (shared with the other variants' rows of
    that server), the path its blocks ran, where they sat in the schedule, and the flips."""

    server_case: str = ""  # the server's id; its log and audit are in cases/<its slug>/
    path: str = ""
    blocks: list[int] = Field(default_factory=list)  # schedule positions of this row's blocks
    schedule: list[str] = Field(default_factory=list)  # the server's whole schedule, by variant
    flips: list[PathFlip] = Field(default_factory=list)  # flips into this row's path
    # Synthetic MTP acceptance: the random seed each of this row's blocks started from (its
    # round's; empty where the server was not reseeded).
    seeds: list[int] = Field(default_factory=list)


class Startup(Record):
    """A server's start-up (orchestrator.engines.vllm.startup): consecutive phases in seconds (name
    -> s, in order), the durations vLLM reported, its compile cache's state and folder, and the
    longest silences of its log before it was ready."""

    phases: dict[str, float] = Field(default_factory=dict)
    vllm: dict[str, float] = Field(default_factory=dict)
    # hit, miss, partial, load-failed (vLLM found artifacts and could not load them: the
    # failure says why); None: nothing compiled.
    compile_cache: str | None = None
    compile_cache_failure: str | None = None
    compile_cache_dir: str | None = None  # the shared folder, where one was used
    silences: list[dict[str, Any]] = Field(default_factory=list)


class CaseResult(Record):
    """One finished case: one line of results.jsonl."""

    schema_version: int | None = None
    case_id: str
    topology_id: str = ""
    model: str = ""
    model_path: str | None = None
    weight_format: str | None = None
    tp: int = 0
    dcp: int = 0
    mtp: int = 0
    variant: str = ""
    heads_per_rank: int | None = None
    fusedq_qualified_heads: bool | None = None
    args: list[str] = Field(default_factory=list)
    env: dict[str, str] = Field(default_factory=dict)
    started_at: str | None = None
    server: ServerInfo = Field(default_factory=ServerInfo)
    warmup: Warmup | None = None
    same_tokens: dict[str, TokenCheck] = Field(default_factory=dict)
    status: str | None = None  # "passed" or "failed"; anything else reads as failed
    reason: str | None = None
    # "profile": a failed case that failed in its profile phase, after every workload (every
    # block, on a switch server) had been measured; None otherwise.
    failed_in: str | None = None
    ended_at: str | None = None
    workloads: dict[str, WorkloadSummary] = Field(default_factory=dict)
    errors: int = 0
    audit: AuditSummary = Field(default_factory=AuditSummary)
    profile: ProfileResult | None = None
    startup: Startup | None = None
    timings: dict[str, float] = Field(default_factory=dict)
    ab_server: int | None = None  # an A/B matrix's server start of this variant (1, 2, ...)
    switch: SwitchRecord | None = None  # measured on a switch-mode server

    @field_validator("audit", "server", "same_tokens", "workloads", "timings", mode="before")
    @classmethod
    def _null_is_empty(cls, v: Any) -> Any:
        return none_is_default(v, {})

    @field_validator("errors", mode="before")
    @classmethod
    def _errors(cls, v: Any) -> Any:
        return none_is_default(v, 0)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    @property
    def measured(self) -> bool:
        """Whether the row's figures stand: it passed, or it failed only in the profile phase
        that follows the measurements (the profiler never runs beside a measured figure)."""
        return self.passed or self.failed_in == PROFILE_PHASE

    def mean_of(self, workload: str, metric: str = "aggregate_tok_s") -> float | None:
        """The mean over repeats of `metric` in `workload`, None where not measured."""
        w = self.workloads.get(workload)
        return None if w is None else w.mean_of(metric)

    def to_record(self) -> dict[str, Any]:
        """The JSON-ready row: the fields that were set and the unknown ones kept (a row read
        back from an older file is written with what it held, nothing added)."""
        return self.model_dump(mode="json", exclude_unset=True)
