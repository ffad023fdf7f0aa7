"""The result of a case, as results.jsonl stores it and every reader reads it back.

One ``CaseResult`` per line of ``results.jsonl``: the case (its topology, variant, argv and
env), where and how its server ran, each workload's figures (``WorkloadSummary``: every
repeat, their mean, and the latency distributions pooled over the workload's requests), the
same-token checks, the audit (``AuditSummary`` with its ``Finding`` list: the stored form of
the records orchestrator.audit declares) and the timings. The runner writes it; resume, the
reports (Markdown, JSON, HTML, JUnit, the closing table), compare and nightly read it, and none
of them digs in raw dicts for a field.

Reading is lenient on purpose. Rows were written by every earlier version of this tool (the
committed validation runs, the test fixtures) and by hand (tests): a field missing from an
old row takes its default, and a field this version does not know is kept and written back
as it was (``extra="allow"``), never an error. What a row holds that is of the wrong type is
an error naming the row's line and the field (``orchestrator.results.store`` raises it).

``schema_version``: 1 for rows written since the models exist; rows without it are the
earlier, compatible shape.
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import types
import typing
from typing import Any, Literal, Union

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    create_model,
    field_validator,
    model_serializer,
    model_validator,
)

from orchestrator.audit import findings as audit_records
from orchestrator.audit.severity import Severity
from orchestrator.audit.verdict import AuditResult
from orchestrator.common.fusedq_files import provenance as _provenance

SCHEMA_VERSION = 1

__all__ = [
    "SCHEMA_VERSION",
    "AuditSummary",
    "CaseResult",
    "Distribution",
    "ExpectationResult",
    "FileSearched",
    "Finding",
    "PathFlip",
    "ProfileResult",
    "RunManifest",
    "Searched",
    "Severity",
    "SourceStatus",
    "SpecDecode",
    "Startup",
    "SwitchRecord",
    "TraceFigures",
    "Verdict",
    "WorkloadSummary",
]


class _Record(BaseModel):
    # Lenient on purpose (see the module docstring): unknown fields are kept, not refused.
    model_config = ConfigDict(extra="allow")
    # The order the fields came in: a record is written back (results.jsonl, report.json)
    # with its keys in that order, so a row read from an older file reads as it did.
    _keys: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _remember_key_order(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        record = handler(data)
        if isinstance(data, dict):
            record._keys = tuple(data)
        return record

    @model_serializer(mode="wrap")
    def _in_key_order(self, handler: SerializerFunctionWrapHandler) -> Any:
        out = handler(self)
        if not self._keys or not isinstance(out, dict):
            return out
        first = {k: out[k] for k in self._keys if k in out}
        return {**first, **{k: v for k, v in out.items() if k not in first}}


def _none_is_default(value: Any, default: Any) -> Any:
    return default if value is None else value


# --------------------------------------------------------------------------- workloads


class _Figures(_Record):
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


LATENCY_KEYS = ("ttft_ms", "tpot_ms", "itl_ms")


class Figures(_Record):
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


class Latency(_Record):
    """The latency distributions pooled over every successful request of a workload, and
    how its tokens were streamed (rows recorded before E2EL and chunking lack them)."""

    ttft_ms: Distribution | None = None
    tpot_ms: Distribution | None = None
    itl_ms: Distribution | None = None
    e2el_ms: Distribution | None = None
    chunking: Chunking | None = None


class SpecDecode(_Record):
    """The speculative decoding a workload saw, from the server's /metrics counters read
    before and after it (orchestrator.engines.vllm.server_metrics)."""

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


class WorkloadSummary(_Record):
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
        return _none_is_default(v, {})

    @field_validator("errors", mode="before")
    @classmethod
    def _errors(cls, v: Any) -> Any:
        return _none_is_default(v, 0)

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


# --------------------------------------------------------------------------- audit
#
# The audit's records are declared once, in orchestrator.audit (stdlib dataclasses: `orchestrator
# audit` loads no pydantic). Their stored form is derived from those declarations here.

_EMPTY = {str: "", int: 0, float: 0.0, bool: False}
_STORED: dict[type, type[_Record]] = {}


def _stored_type(tp: Any) -> Any:
    """`tp` with every audit record in it (``list[FileSearched]``) read as its stored form."""
    if isinstance(tp, type) and tp in _STORED:
        return _STORED[tp]
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if not args or origin is Literal:
        return tp
    inner = tuple(_stored_type(a) for a in args)
    return Union[inner] if origin in (Union, types.UnionType) else origin[inner]  # noqa: UP007


def _stored_field(f: dataclasses.Field, tp: Any) -> tuple[Any, Any]:
    """(type, default) of one field as a stored row reads it: the declared default; for a field
    declared without one, its type's empty value ("", 0, [], {}) or None."""
    if f.default is not dataclasses.MISSING:
        return tp, f.default
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):  # a nested record: its stored form
            stored, data = _STORED[type(value)], dataclasses.asdict(value)
            return tp, Field(default_factory=lambda: stored.model_validate(data))
        return tp, Field(default_factory=f.default_factory)
    origin = typing.get_origin(tp) or tp
    if origin in (list, dict):
        return tp, Field(default_factory=origin)
    if tp in _EMPTY:
        return tp, _EMPTY[tp]
    return tp | None, None


def _stored(record: type) -> type[_Record]:
    """The stored form of an audit record: its fields, types and defaults as declared (a field
    a row lacks reads as in `_stored_field`), its behaviour (the record's ``…View`` base), read
    as leniently as every other row here."""
    hints = typing.get_type_hints(record)
    fields = {
        f.name: _stored_field(f, _stored_type(hints[f.name])) for f in dataclasses.fields(record)
    }
    views = tuple(b for b in record.__bases__ if b is not object)
    model = create_model(
        record.__name__,
        __base__=(*views, _Record),
        __module__=__name__,
        __doc__=record.__doc__,
        **fields,
    )
    _STORED[record] = model
    return model


Finding = _stored(audit_records.Finding)
FileSearched = _stored(audit_records.FileSearched)
SourceStatus = _stored(audit_records.SourceStatus)
ExpectationResult = _stored(audit_records.ExpectationResult)
Searched = _stored(audit_records.Searched)
Verdict = _stored(audit_records.Verdict)


class AuditSummary(_stored(AuditResult)):  # type: ignore[misc]
    """A case's audit as audit.json and results.jsonl hold it (AuditResult.to_dict): besides
    the record's fields, the derived ``summary`` sentence, ``verdict.text`` and
    ``searched.lines`` are kept as written."""

    # A row without an audit reads as one whose verdict says nothing (and whose ``searched``
    # is None: not audited).
    verdict: Verdict = Field(default_factory=Verdict)  # type: ignore[valid-type]

    @model_validator(mode="before")
    @classmethod
    def _empty_parts(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            if not data.get("searched"):
                data["searched"] = None
            if data.get("verdict") is None:
                data.pop("verdict", None)
        return data


# --------------------------------------------------------------------------- profiles


class KernelTotal(_Record):
    """One kernel (or CPU op) name of a trace: how often it ran and for how long in all."""

    name: str = ""
    count: int = 0
    total_us: float = 0.0


class QueryStep(_Record):
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


class TraceFigures(_Record):
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


class ProfileResult(_Record):
    """A case's profile phase: what was asked, where the traces are, each rank's figures."""

    decode_steps: int = 0
    prompt_tokens: int = 1
    layers: int | None = None  # query steps one model step should run (decoder + MTP draft)
    dir: str = "profile"
    traces: list[TraceFigures] = Field(default_factory=list)
    error: str | None = None


# --------------------------------------------------------------------------- the case


class TokenCheck(_Record):
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


class ServerInfo(_Record):
    """Where and how a case's server ran (node facts from its Ray actor, argv, port, exit)."""

    hostname: str | None = None
    node_ip: str | None = None
    node_id: str | None = None
    port: int | None = None
    argv: list[str] | None = None
    exit_code: int | None = None
    died_noticed_at: float | None = None
    port_clashes: list[int] | None = None


class Warmup(_Record):
    requests: int = 0
    errors: int = 0


class PathFlip(_Record):
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


class SwitchRecord(_Record):
    """How a switch-mode row was measured: its server (shared with the other variants' rows of
    that server), the path its blocks ran, where they sat in the schedule, and the flips."""

    server_case: str = ""  # the server's id; its log and audit are in cases/<its slug>/
    path: str = ""
    blocks: list[int] = Field(default_factory=list)  # schedule positions of this row's blocks
    schedule: list[str] = Field(default_factory=list)  # the server's whole schedule, by variant
    flips: list[PathFlip] = Field(default_factory=list)  # flips into this row's path


class Startup(_Record):
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


class CaseResult(_Record):
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
        return _none_is_default(v, {})

    @field_validator("errors", mode="before")
    @classmethod
    def _errors(cls, v: Any) -> Any:
        return _none_is_default(v, 0)

    @property
    def passed(self) -> bool:
        return self.status == "passed"

    def mean_of(self, workload: str, metric: str = "aggregate_tok_s") -> float | None:
        """The mean over repeats of `metric` in `workload`, None where not measured."""
        w = self.workloads.get(workload)
        return None if w is None else w.mean_of(metric)

    def to_record(self) -> dict[str, Any]:
        """The JSON-ready row: the fields that were set and the unknown ones kept (a row read
        back from an older file is written with what it held, nothing added)."""
        return self.model_dump(mode="json", exclude_unset=True)


# --------------------------------------------------------------------------- the run


class RunManifest(_Record):
    """manifest.json as its readers need it: the run, its matrix (as expanded, a JSON dump of
    orchestrator.config.schema.Matrix), its cases in run order, versions and commit. The rest (the
    cluster, the driver, resumes) is kept as it was written."""

    run_id: str | None = None
    created_at: str | None = None
    matrix_path: str | None = None
    matrix: dict[str, Any] = Field(default_factory=dict)
    cases: list[dict[str, Any]] = Field(default_factory=list)
    versions: dict[str, Any] | None = None
    git: dict[str, Any] | None = None
    fusedq_fingerprint: str | None = None
    # fusedq.provenance.describe() of the code that ran (absent before 2026-12-02).
    provenance: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _readable(self) -> RunManifest:
        """What the readers index: each case's id, each workload's and variant's name (a
        manifest someone else wrote is refused here, naming the field, not in a report)."""
        for i, case in enumerate(self.cases):
            if not isinstance(case.get("case_id"), str):
                raise ValueError(f"cases[{i}].case_id is not a string")
        for kind in ("workloads", "variants"):
            specs = self.matrix.get(kind) or []
            if not isinstance(specs, list):
                raise ValueError(f"matrix.{kind} is not a list")
            for i, spec in enumerate(specs):
                if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                    raise ValueError(f"matrix.{kind}[{i}] has no name")
        return self

    @property
    def matrix_name(self) -> str | None:
        return self.matrix.get("name")

    @property
    def commit(self) -> str | None:
        """The code's commit: the provenance record's (``+dirty`` where the tree differed from
        it), else git's HEAD as recorded before provenance existed."""
        if self.provenance is not None:
            return _provenance.commit_label(self.provenance)
        return (self.git or {}).get("commit")

    @property
    def product_fingerprint(self) -> str | None:
        return (self.provenance or {}).get("product_fingerprint")

    def version(self, name: str) -> Any:
        return (self.versions or {}).get(name)

    @property
    def case_ids(self) -> list[str]:
        return [c["case_id"] for c in self.cases]

    def columns(self) -> list[tuple[str, str]]:
        """(workload name, report column) in matrix order (``ctx1k`` may fill ``ctx64k``)."""
        return [(w["name"], w.get("column") or w["name"]) for w in self.matrix.get("workloads", [])]

    def variants(self) -> list[str]:
        """Variant names in matrix order, the baseline moved first (the reports compare the
        others against ``variants()[0]``); ``default`` for a matrix without variants."""
        specs = self.matrix.get("variants") or []
        names = [v["name"] for v in specs if v.get("baseline")]
        return names + [v["name"] for v in specs if not v.get("baseline")] or ["default"]

    @property
    def ab(self) -> dict[str, Any] | None:
        """The matrix's ``ab`` block as run (orchestrator.config.schema.ABSpec), or None."""
        return self.matrix.get("ab") or None

    def concurrency(self, workload: str) -> int:
        for w in self.matrix.get("workloads", []):
            if w.get("name") == workload:
                return max(1, int(w.get("concurrency") or 1))
        return 1
