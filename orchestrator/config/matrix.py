"""The topology matrix: YAML -> validated `Matrix` -> expanded list of `Case`s.

Everything here is pure (no torch, ray or vllm) so `orchestrator plan` answers instantly and
every validation rule is unit-testable. Errors name the file, the field and the value:
``matrices/tp8.yaml: topologies[2].dcp=3 does not divide tp=8``.
"""

from __future__ import annotations

import difflib
import math
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orchestrator.common import safe_io
from orchestrator.common.fusedq_files import limits
from orchestrator.common.layout import case_slug
from orchestrator.config import policy as matrix_policy
from orchestrator.config.owned_flags import ALWAYS_OWNED, PROFILE_OWNED, args_problem, owned_flag
from orchestrator.models import standins, tinymodel

# The unmeasured warm-up request (warmup_requests of them per server): short, because what
# it absorbs is one-time cost (the workers' first collective), not throughput.
WARMUP_PROMPT_TOKENS = 16
WARMUP_OUTPUT_TOKENS = 8
# A model path with this prefix is built locally by orchestrator.models.tinymodel (the embedded
# default).
BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = tuple(tinymodel.BUILTINS) + tuple(standins.STANDINS)


class MatrixError(ValueError):
    """A matrix that cannot run; the message names file, field and value."""

    def __init__(self, source: str, field_path: str, message: str) -> None:
        self.source = source
        self.field_path = field_path
        self.detail = message
        # "topologies[2].dcp=3 does not divide tp=8" reads as a sentence; "x.y: unknown key" as a label.
        sep = " " if "=" in field_path else ": "
        where = f"{source}: {field_path}{sep}" if field_path else f"{source}: "
        super().__init__(where + message)


class _Strict(BaseModel):
    # extra="forbid": a typo in a YAML key is an error naming the key (GuideLLM's habit).
    model_config = ConfigDict(extra="forbid", frozen=True)


def _check_env(env: Mapping[str, str]) -> dict[str, str]:
    for key in env:
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise ValueError(f"{key!r} is not a valid environment variable name")
    return dict(env)


def _check_args(args: Sequence[str]) -> list[str]:
    # Owned flags in every spelling vLLM reads, --config files included
    # (orchestrator.config.owned_flags).
    problem = args_problem(args, ALWAYS_OWNED)
    if problem is not None:
        raise ValueError(f"{problem}; remove it from args")
    return list(args)


class _EnvArgs(_Strict):
    """Environment and passthrough vLLM arguments; every level of the matrix may add some."""

    args: list[str] = Field(default_factory=list, description="Passed through to `vllm serve`.")
    env: dict[str, str] = Field(default_factory=dict)

    @field_validator("env")
    @classmethod
    def _env_names(cls, v: dict[str, str]) -> dict[str, str]:
        return _check_env(v)

    @field_validator("args")
    @classmethod
    def _no_owned_flags(cls, v: list[str]) -> list[str]:
        return _check_args(v)


class ModelSpec(_EnvArgs):
    label: str = Field(min_length=1, description="Name in reports, e.g. 'Luke BF16'.")
    path: str = Field(
        min_length=1,
        description="Checkpoint path, or builtin:tiny-mla / tiny-glm5 (tiny random models), "
        "builtin:glm5 / glm5-dsa (GLM-5 stand-ins, config only: docs/standins.md).",
    )
    num_heads: int = Field(
        gt=0, description="Total attention heads of the model (a built-in model is built so)."
    )
    layers: int | None = Field(
        None, gt=0, description="Built-in models only: decoder layers (default 2; GLM-5's 78)."
    )
    weight_format: str = Field(
        "bf16",
        description="A label, except for a GLM-5 stand-in: mxfp8 serves it quantised by "
        "vLLM at load (--quantization mxfp8).",
    )
    standin_tp: int | None = Field(
        None,
        gt=0,
        description="GLM-5 stand-ins: the TP whose one rank it does (num_heads must be "
        "ceil(64 / standin_tp)); default: derived from num_heads (16 -> 4, 11 -> 6, 8 -> 8).",
    )
    experts: int | None = Field(
        None,
        gt=0,
        description="GLM-5 stand-ins: routed experts kept (top-8 always); default: as many "
        "as fit one H200.",
    )
    served_name: str | None = None
    has_mtp: bool = Field(True, description="The checkpoint carries MTP layers.")

    @field_validator("path")
    @classmethod
    def _builtin_known(cls, v: str) -> str:
        if v.startswith(BUILTIN_PREFIX) and v[len(BUILTIN_PREFIX) :] not in BUILTIN_MODELS:
            raise ValueError(f"unknown built-in model {v!r}; known: {list(BUILTIN_MODELS)}")
        return v

    @model_validator(mode="after")
    def _builtin_size(self) -> ModelSpec:
        if not self.is_standin:
            for key in ("standin_tp", "experts"):
                if getattr(self, key) is not None:
                    raise ValueError(
                        f"{key}={getattr(self, key)} is for GLM-5 stand-ins "
                        f"(builtin:{' / builtin:'.join(standins.STANDINS)}); {self.path!r} is not one"
                    )
        if not self.is_builtin:
            if self.layers is not None:
                raise ValueError(
                    f"layers={self.layers} is for built-in models; {self.path!r} is not one"
                )
            return self
        if self.is_standin:
            _check_standin(self)
            return self
        tinymodel.arch(self.builtin_name, heads=self.num_heads, layers=self.builtin_layers)
        return self

    @property
    def is_builtin(self) -> bool:
        return self.path.startswith(BUILTIN_PREFIX)

    @property
    def builtin_name(self) -> str:
        return self.path[len(BUILTIN_PREFIX) :]

    @property
    def builtin_layers(self) -> int:
        if self.layers is not None:
            return self.layers
        if self.is_standin:
            return int(standins.GLM5["num_hidden_layers"])
        return tinymodel.DEFAULT_LAYERS

    @property
    def is_standin(self) -> bool:
        """A GLM-5 stand-in: config only, served with dummy weights
        (orchestrator.models.standins)."""
        return self.is_builtin and standins.is_standin(self.builtin_name)

    @property
    def stands_for_tp(self) -> int:
        """A stand-in's TP (its `standin_tp`, else derived from num_heads)."""
        if self.standin_tp is not None:
            return self.standin_tp
        return standins.standin_tp_for_heads(self.num_heads)


def _check_standin(model: ModelSpec) -> None:
    """num_heads is one rank's share at standin_tp; sizes and weight format are servable."""
    tp = model.stands_for_tp
    want = standins.heads_per_rank(tp)
    if model.num_heads != want:
        raise ValueError(
            f"num_heads={model.num_heads} does not match standin_tp={tp}: one rank of GLM-5 "
            f"at TP{tp} holds {want} of its {standins.GLM5['num_attention_heads']} heads"
        )
    if model.weight_format not in standins.WEIGHT_FORMATS:
        raise ValueError(
            f"weight_format={model.weight_format!r} cannot be served by a stand-in; "
            f"known: {list(standins.WEIGHT_FORMATS)}"
        )
    standins.config(
        model.builtin_name, standin_tp=tp, layers=model.builtin_layers, experts=model.experts
    )


class EngineSpec(_EnvArgs):
    kind: Literal["vllm"] = "vllm"
    pads_heads: bool = Field(
        False,
        description="The engine build pads heads to a multiple of TP ('virtual TP'); "
        "upstream vLLM refuses num_heads % tp != 0.",
    )
    vllm_bin: str | None = Field(
        None,
        description="`vllm` executable; default: next to python, else on PATH, else "
        "`python -m vllm.entrypoints.cli.main`.",
    )
    compile_cache: Literal["shared", "case"] = Field(
        "shared",
        description="Where vLLM's and Inductor's compile caches live: `shared` by every server "
        "of one configuration, in this run and later ones "
        "(orchestrator.engines.vllm.compile_cache), or `case`, each server its own in its case "
        "directory.",
    )


class ResourceSpec(_Strict):
    accelerator: Literal["gpu", "cpu"] = "gpu"
    cpus_per_rank: int = Field(1, gt=0, description="CPUs reserved per TP rank on a CPU cluster.")
    gpus_per_node: int | None = Field(
        None, gt=0, description="Largest GPU count of one node, for plan-time checks."
    )


class TopologySpec(_EnvArgs):
    tp: int = Field(gt=0)
    dcp: list[int] | Literal["divisors"] = Field(default_factory=lambda: [1])
    mtp: list[int] = Field(default_factory=lambda: [0])
    mtp_acceptance: float | None = Field(
        None,
        ge=0,
        le=1,
        description="MTP cases: vLLM's synthetic acceptance instead of the draft's own "
        "(a random-weight draft accepts almost nothing): each draft position is accepted with "
        "this probability given the one before it was.",
    )

    @field_validator("dcp", "mtp", mode="before")
    @classmethod
    def _scalar_to_list(cls, v: Any) -> Any:
        if isinstance(v, str) and v != "divisors":
            raise ValueError("must be a list of integers, or 'divisors' (dcp only)")
        return [v] if isinstance(v, int) and not isinstance(v, bool) else v

    def dcp_values(self) -> list[int]:
        if self.dcp == "divisors":
            return [d for d in range(1, self.tp + 1) if self.tp % d == 0]
        return list(self.dcp)


class WorkloadSpec(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    column: str | None = Field(None, description="Report column; default: the name.")
    prompt_tokens: int = Field(gt=0)
    output_tokens: int = Field(gt=0)
    concurrency: int = Field(1, gt=0)
    requests: int | None = Field(None, gt=0)
    duration_s: float | None = Field(None, gt=0)
    repeats: int = Field(1, gt=0)
    same_tokens: bool = Field(
        False,
        description="Record every request's greedy token ids; each variant after a topology's "
        "first must produce the first's ids, request by request (orchestrator/client/tokens.py).",
    )

    @model_validator(mode="after")
    def _one_mode(self) -> WorkloadSpec:
        if self.requests is not None and self.duration_s is not None:
            raise ValueError("set either requests or duration_s, not both")
        if self.same_tokens and (self.duration_s is not None or self.concurrency != 1):
            # Request i must be the same request in every variant, and alone in its batch:
            # batch composition changes vLLM's numerics, which is not what this compares.
            raise ValueError("same_tokens needs request mode (no duration_s) and concurrency 1")
        return self

    @property
    def report_column(self) -> str:
        return self.column or self.name

    @property
    def request_count(self) -> int | None:
        if self.duration_s is not None:
            return None
        return self.requests if self.requests is not None else self.concurrency


class VariantSpec(_EnvArgs):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    expect: list[ExpectSpec] = Field(
        default_factory=list, description="Lines only this variant's servers must log."
    )
    baseline: bool = Field(
        False,
        description="The variant the reports compare the others against (at most one; "
        "default: the first). Cases still run in the matrix's order, so a baseline listed "
        "last runs after what it is compared with.",
    )


class TimeoutSpec(_Strict):
    placement_s: float = Field(600, gt=0, description="Ray placement group ready.")
    ready_s: float = Field(1800, gt=0, description="Server start-up until /health answers.")
    request_s: float = Field(1800, gt=0, description="One request (64k prefill included).")
    case_s: float = Field(7200, gt=0, description="One case, start to stop.")


class ExpectSpec(_Strict):
    """A line the server log must contain, e.g. fusedq's warmup line from every worker."""

    pattern: str = Field(min_length=1, description="Regular expression.")
    description: str | None = None

    @field_validator("pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        try:
            re.compile(v)
        except re.error as exc:
            raise ValueError(f"is not a regular expression: {exc}") from None
        return v


class AuditSpec(_Strict):
    expect: list[ExpectSpec] = Field(default_factory=list)
    kernel_log: bool = Field(True, description="Also scan the kernel log (Xid lines land there).")


class ProfileSpec(_Strict):
    """A profile phase per case (orchestrator.execution.measure): after the measured workloads, so
    it never disturbs them, the server's torch profiler records exactly `decode_steps` model
    steps of one request (a `prompt_tokens` prompt, `decode_steps` output tokens, alone on
    the server), and every rank's trace is brought into the case directory and read
    (orchestrator.analysis.trace)."""

    decode_steps: int = Field(
        4, gt=0, le=4096, description="Output tokens of the profiled request: its model steps."
    )
    prompt_tokens: int = Field(
        1,
        gt=0,
        description="Prompt of the profiled request; 1 (ctx0) keeps every step a decode step "
        "(vLLM's MLA runs a one-token prompt through the decode path).",
    )
    wait_s: float = Field(
        300, gt=0, description="How long to wait for every rank's trace after /stop_profile."
    )


# The worker extension a switch-mode server loads (vLLM's --worker-extension-cls): fusedq's,
# whose methods flip every worker between the staged and the fused decode query.
SWITCH_EXTENSION = "fusedq.vllm_worker_ext.FusedqWorkerExtension"
# Server starts per variant when ab.servers is not given: 4 starts per variant put the 95 %
# interval at about +-0.3 % where servers differ by 0.2 % (docs/statistics.md).
DEFAULT_AB_SERVERS = 4


class ABSpec(_Strict):
    """An A/B of the variants that can resolve a fraction of a percent (orchestrator.analysis.ab).

    ``restarts``: per topology each variant is served `servers` times, round by round
    (A B A B ..., never A A B B); every server start is a case and the interval is over
    server starts. ``switch``: per topology `servers` servers (default 1) that each serve
    every variant, flipping the decode path between blocks of the workloads through the
    worker extension (orchestrator.execution.switch); the interval is over blocks (over servers when
    there are two or more)."""

    mode: Literal["restarts", "switch"] = "restarts"
    servers: int | None = Field(
        None,
        ge=1,
        le=100,
        description=f"Server starts per variant and topology (restarts, default "
        f"{DEFAULT_AB_SERVERS}, at least 2), or switch servers per topology (switch, default 1).",
    )
    blocks: int = Field(
        8, ge=2, le=1000, description="switch: blocks of the workloads per variant and server."
    )
    order: Literal["abba", "alternate"] = Field(
        "abba",
        description="switch: ABBA (A B B A A B B A ..., cancels a linear drift) or alternate "
        "(A B A B ...).",
    )
    first: Literal["baseline", "candidate"] = Field(
        "baseline", description="switch: the path of each server's first block."
    )
    extension: str = Field(
        SWITCH_EXTENSION,
        pattern=r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)+$",
        description="switch: the worker extension class (module.Class) the server loads.",
    )
    serve_as: str | None = Field(
        None,
        description="switch: the variant whose args and env the server runs with (default: "
        "the first that is not the baseline: the one that loads the fused path).",
    )
    paths: dict[str, str] = Field(
        default_factory=dict,
        description="switch: variant -> the path fusedq_set_path is asked for (default: the "
        "variant's name).",
    )

    @property
    def server_count(self) -> int:
        if self.servers is not None:
            return self.servers
        return DEFAULT_AB_SERVERS if self.mode == "restarts" else 1

    def path_of(self, variant: str) -> str:
        return self.paths.get(variant, variant)


class RaySpec(_Strict):
    address: str | None = Field(None, description="Join this cluster; default: a local Ray.")


VariantSpec.model_rebuild()


class Matrix(_Strict):
    name: str = Field(min_length=1, pattern=r"^[A-Za-z0-9_.-]+$")
    description: str = ""
    models: list[ModelSpec] = Field(min_length=1)
    engine: EngineSpec = Field(default_factory=EngineSpec)
    resources: ResourceSpec = Field(default_factory=ResourceSpec)
    topologies: list[TopologySpec] = Field(min_length=1)
    workloads: list[WorkloadSpec] = Field(min_length=1)
    variants: list[VariantSpec] = Field(default_factory=lambda: [VariantSpec(name="default")])
    timeouts: TimeoutSpec = Field(default_factory=TimeoutSpec)
    audit: AuditSpec = Field(default_factory=AuditSpec)
    ray: RaySpec = Field(default_factory=RaySpec)
    profile: ProfileSpec | None = Field(
        None, description="Profile each case's decode after its workloads (see ProfileSpec)."
    )
    ab: ABSpec | None = Field(
        None, description="Serve the variants several times each, interleaved (see ABSpec)."
    )
    host: str = Field(
        "127.0.0.1",
        description="Address servers bind; loopback unless you need more: `node` binds the "
        "address Ray knows each server's node by (servers on other nodes of a cluster), "
        "0.0.0.0 every interface.",
    )
    bind_all_interfaces: bool = Field(
        False,
        description="Say yes to a host that binds every interface (0.0.0.0, ::); plan, run "
        "and the report then warn about it (orchestrator/config/policy.py).",
    )
    max_mtp: int = Field(8, ge=0, description="Sanity bound on speculative tokens.")

    @property
    def baseline_variant(self) -> VariantSpec:
        """The variant marked ``baseline``, else the first."""
        return next((v for v in self.variants if v.baseline), self.variants[0])

    @property
    def switch_mode(self) -> bool:
        """An A/B whose variants share one server per topology (``ab.mode: switch``)."""
        return self.ab is not None and self.ab.mode == "switch"

    warmup_requests: int = Field(
        1,
        ge=0,
        le=100,
        description="Unmeasured requests sent to each server once ready: a fresh server's "
        "first request pays one-time costs (worker warm-up, lazy allocations) that are not "
        "throughput.",
    )
    seed: int = 0


@dataclass(frozen=True)
class Case:
    """One server launch: a topology of one model under one variant, measured with every workload."""

    model: ModelSpec
    tp: int
    dcp: int
    mtp: int
    variant: VariantSpec
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    # An A/B matrix's server start of this variant (1, 2, ...); None outside an A/B.
    server: int | None = None
    # vLLM's synthetic acceptance rate (conditional per draft position); MTP cases only.
    mtp_acceptance: float | None = None

    @property
    def topology_id(self) -> str:
        return f"{self.model.label}/tp{self.tp}-dcp{self.dcp}-mtp{self.mtp}"

    @property
    def case_id(self) -> str:
        start = f"/s{self.server}" if self.server is not None else ""
        return f"{self.topology_id}/{self.variant.name}{start}"

    @property
    def slug(self) -> str:
        return case_slug(self.case_id)

    @property
    def heads_per_rank(self) -> int:
        return math.ceil(self.model.num_heads / self.tp)

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env)

    def to_dict(self) -> dict[str, Any]:
        start = {} if self.server is None else {"ab_server": self.server}
        return {
            "case_id": self.case_id,
            **start,
            "topology_id": self.topology_id,
            "model": self.model.label,
            "model_path": self.model.path,
            "weight_format": self.model.weight_format,
            "tp": self.tp,
            "dcp": self.dcp,
            "mtp": self.mtp,
            "variant": self.variant.name,
            "heads_per_rank": self.heads_per_rank,
            "fusedq_qualified_heads": self.heads_per_rank in limits.QUALIFIED_HEADS,
            "args": list(self.args),
            "env": dict(self.env),
            **({"mtp_acceptance": self.mtp_acceptance} if self.mtp_acceptance is not None else {}),
        }


# ---------------------------------------------------------------------------------------------
# Loading: YAML text -> --set overrides -> ${ENV} interpolation -> pydantic -> semantic checks.

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _is_union_tag(part: Any) -> bool:
    # pydantic adds union-member tags ("list[int]", "literal['divisors']") to the location.
    return isinstance(part, str) and bool(
        re.match(r"^(list|dict|literal|function-\w+|str|int)\b|.*\[", part)
    )


def _loc_to_path(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        if _is_union_tag(part):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model inside a field's annotation: ``list[WorkloadSpec]`` -> WorkloadSpec."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _mapping_at(raw: Any, loc: Sequence[Any]) -> tuple[type[BaseModel] | None, Any]:
    """The model that validates the mapping at `loc` (a location under Matrix) and the
    mapping the user wrote there."""
    model: type[BaseModel] | None = Matrix
    node = raw
    for part in loc:
        if _is_union_tag(part):
            continue
        if isinstance(part, int):
            node = node[part] if isinstance(node, list) and part < len(node) else None
            continue
        field = model.model_fields.get(part) if model is not None else None
        model = _model_of(field.annotation) if field is not None else None
        node = node.get(part) if isinstance(node, dict) else None
    return model, node


def _unknown_key_message(raw: Any, loc: Sequence[Any]) -> tuple[str, str | None]:
    """``unknown key; did you mean output_tokens?`` for a key no model field is called, and
    the suggested key (a known key of that mapping spelled alike and not given already)."""
    model, mapping = _mapping_at(raw, loc[:-1])
    key = str(loc[-1])
    given = set(mapping) if isinstance(mapping, dict) else set()
    known = [f for f in model.model_fields if f not in given] if model is not None else []
    # 0.6 is difflib's default: it pairs dpc/dcp, topologys/topologies and output_tokne/
    # output_tokens and leaves colour/models unpaired.
    close = difflib.get_close_matches(key.lower(), known, n=1, cutoff=0.6)
    if not close:
        return "unknown key", None
    return f"unknown key; did you mean {close[0]}?", close[0]


def _first_error(errors: list[Any], raw: Any) -> tuple[str, str]:
    """The error to report, as (field path, message). A required key reported missing
    because it was misspelled is reported as the misspelling, once: the misspelled key's
    error names both."""
    suggested: dict[tuple[Any, ...], tuple[str, str]] = {}
    for err in errors:
        if err["type"] == "extra_forbidden":
            message, key = _unknown_key_message(raw, err["loc"])
            if key is not None:
                suggested[(*err["loc"][:-1], key)] = (_loc_to_path(err["loc"]), message)
    err = errors[0]
    path = _loc_to_path(err["loc"])
    if err["type"] == "missing" and tuple(err["loc"]) in suggested:
        return suggested[tuple(err["loc"])]
    if err["type"] == "extra_forbidden":
        return path, _unknown_key_message(raw, err["loc"])[0]
    if err["type"] == "missing":
        return path, "is required"
    value = err.get("input")
    msg = err["msg"].removeprefix("Value error, ")
    msg = msg[:1].lower() + msg[1:]
    if isinstance(value, (dict, list)) or value is None:
        return path, msg
    return f"{path}={value!r}:", msg


def _interpolate(
    node: Any, path: str, env: Mapping[str, str], source: str, unresolved: list[str] | None
) -> Any:
    """Replace ${VAR} / ${VAR:-default}; an unset VAR is an error, or kept as text for `plan`."""
    if isinstance(node, dict):
        return {
            k: _interpolate(v, f"{path}.{k}" if path else str(k), env, source, unresolved)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [
            _interpolate(v, f"{path}[{i}]", env, source, unresolved) for i, v in enumerate(node)
        ]
    if isinstance(node, str):

        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in env:
                return env[name]
            if default is not None:
                return default
            if unresolved is not None:
                unresolved.append(f"{path}: ${{{name}}} is not set")
                return m.group(0)
            raise MatrixError(source, path, f"environment variable ${{{name}}} is not set")

        return _ENV_REF.sub(sub, node)
    return node


def _apply_set(raw: dict[str, Any], assignment: str, source: str) -> None:
    """Apply one ``--set a.b[0].c=value`` (value parsed as a YAML scalar) to the raw document."""
    if "=" not in assignment:
        raise MatrixError(source, "--set", f"{assignment!r} is not key=value")
    key, value_text = assignment.split("=", 1)
    tokens = re.findall(r"[^.\[\]]+|\[\d+\]", key)
    if not tokens:
        raise MatrixError(source, "--set", f"{assignment!r} names no key")
    node: Any = raw
    walked = ""
    for i, tok in enumerate(tokens):
        last = i == len(tokens) - 1
        index: int | str = int(tok.strip("[]")) if tok.startswith("[") or tok.isdigit() else tok
        walked += (
            f"[{index}]" if isinstance(index, int) else (f".{index}" if walked else str(index))
        )
        if isinstance(index, int):
            if not isinstance(node, list) or index >= len(node):
                raise MatrixError(source, f"--set {key}", f"{walked} does not exist")
        elif not isinstance(node, dict):
            raise MatrixError(source, f"--set {key}", f"{walked} is not a mapping")
        if last:
            try:
                value = yaml.safe_load(value_text) if value_text else ""
            except yaml.YAMLError:
                value = value_text
            node[index] = value
        else:
            if isinstance(index, str) and index not in node:
                node[index] = {}
            node = node[index]


def parse_matrix(
    text: str,
    source: str = "<matrix>",
    *,
    sets: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    unresolved: list[str] | None = None,
) -> Matrix:
    """Parse and validate matrix YAML text; raise `MatrixError` naming source, field and value.

    With `unresolved` given (a list), unset ${VAR}s are left in place and described there
    instead of raising: `plan` shows a matrix whose model paths the user has not supplied yet.
    """
    env = os.environ if env is None else env
    try:
        raw = safe_io.load_yaml(text, source)
    except safe_io.UnsafeFileError as exc:
        raise MatrixError(source, "", exc.reason) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "YAML"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise MatrixError(source, "", f"invalid YAML at {where}: {problem}") from None
    if raw is None:
        lines = [ln.strip() for ln in text.splitlines()]
        content = [ln for ln in lines if ln and not ln.startswith("#")]
        detail = (
            f" (its YAML is null: {content[0][:40]!r})"
            if content
            else " (only comments)"
            if any(lines)
            else ""
        )
        raise MatrixError(
            source, "", f"the file is empty{detail}; a matrix is a YAML mapping (see matrices/)"
        )
    if not isinstance(raw, dict):
        raise MatrixError(source, "", f"a matrix is a YAML mapping, got {type(raw).__name__}")
    for assignment in sets:
        _apply_set(raw, assignment, source)
    raw = _interpolate(raw, "", env, source, unresolved)
    try:
        matrix = Matrix.model_validate(raw)
    except ValidationError as exc:
        raise MatrixError(source, *_first_error(exc.errors(), raw)) from None
    check_matrix(matrix, source)
    return matrix


def load_matrix(
    path: str | Path,
    *,
    sets: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    unresolved: list[str] | None = None,
) -> Matrix:
    """Read, parse and validate a matrix file."""
    try:
        text = safe_io.read_text(Path(path), safe_io.MAX_YAML_BYTES)
    except FileNotFoundError:
        raise MatrixError(str(path), "", "no such file") from None
    except safe_io.UnsafeFileError as exc:
        raise MatrixError(str(path), "", exc.reason) from None
    except OSError as exc:
        raise MatrixError(str(path), "", f"cannot read: {exc}") from None
    return parse_matrix(text, str(path), sets=sets, env=env, unresolved=unresolved)


def _dups(names: Iterable[str]) -> list[str]:
    seen: set[str] = set()
    return sorted({n for n in names if n in seen or seen.add(n)})  # type: ignore[func-returns-value]


def _check_variants(m: Matrix, source: str) -> None:
    """At least one variant, at most one baseline, and a baseline that same_tokens compares
    against runs first."""
    if not m.variants:
        raise MatrixError(
            source, "variants", "needs at least one variant (omit the key for one default)"
        )
    baselines = [v.name for v in m.variants if v.baseline]
    if len(baselines) > 1:
        raise MatrixError(
            source, "variants", f"more than one baseline: {', '.join(map(repr, baselines))}"
        )
    same = [w.name for w in m.workloads if w.same_tokens]
    if baselines and same and baselines[0] != m.variants[0].name:
        raise MatrixError(
            source, "variants", f"workload {same[0]!r} compares tokens against the baseline "
            f"{baselines[0]!r}, which must run first: list it first",
        )  # fmt: skip


def check_matrix(m: Matrix, source: str = "<matrix>") -> None:
    """Semantic checks that need more than one field; raise the first problem found."""
    for kind, names in (
        ("models", [x.label for x in m.models]),
        ("workloads", [x.name for x in m.workloads]),
        ("variants", [x.name for x in m.variants]),
    ):
        dup = _dups(names)
        if dup:
            raise MatrixError(source, kind, f"duplicate name {dup[0]!r}")
    _check_variants(m, source)
    columns = _dups(w.report_column for w in m.workloads)
    if columns:
        raise MatrixError(source, "workloads", f"two workloads report into column {columns[0]!r}")

    for ti, topo in enumerate(m.topologies):
        where = f"topologies[{ti}]"
        if not topo.mtp:
            raise MatrixError(source, f"{where}.mtp", "is empty; use [0] for MTP off")
        if topo.dcp != "divisors" and not topo.dcp:
            raise MatrixError(source, f"{where}.dcp", "is empty; use [1] for DCP off")
        for d in topo.dcp_values():
            if d < 1:
                raise MatrixError(source, f"{where}.dcp={d}", "must be >= 1")
            if topo.tp % d:
                raise MatrixError(source, f"{where}.dcp={d}", f"does not divide tp={topo.tp}")
            if d > 1 and m.resources.accelerator == "cpu":
                raise MatrixError(
                    source,
                    f"{where}.dcp={d}",
                    "is not possible on CPU: DCP needs an attention backend that returns the softmax LSE; vLLM's CPU MLA "
                    "backends do not (resources.accelerator=cpu): use dcp: [1] on CPU",
                )
        for k in topo.mtp:
            if k < 0 or k > m.max_mtp:
                raise MatrixError(source, f"{where}.mtp={k}", f"must be within 0..{m.max_mtp}")
        _check_acceptance(m, topo, f"{where}.mtp_acceptance", source)
        if (
            m.resources.gpus_per_node
            and m.resources.accelerator == "gpu"
            and topo.tp > m.resources.gpus_per_node
        ):
            raise MatrixError(
                source,
                f"{where}.tp={topo.tp}",
                f"needs {topo.tp} GPUs on one node; resources.gpus_per_node={m.resources.gpus_per_node}",
            )
        for mi, model in enumerate(m.models):
            if model.num_heads % topo.tp and not m.engine.pads_heads:
                raise MatrixError(
                    source,
                    f"{where}.tp={topo.tp}",
                    f"does not divide models[{mi}].num_heads={model.num_heads} ({model.label}); "
                    f"upstream vLLM refuses this. If your engine build pads heads "
                    f"({math.ceil(model.num_heads / topo.tp)} per rank), set engine.pads_heads: true",
                )
            if model.num_heads < topo.tp:
                raise MatrixError(
                    source,
                    f"{where}.tp={topo.tp}",
                    f"exceeds models[{mi}].num_heads={model.num_heads}",
                )
            if any(k > 0 for k in topo.mtp) and not model.has_mtp:
                raise MatrixError(
                    source,
                    f"{where}.mtp",
                    f"MTP > 0 but models[{mi}] ({model.label}) has_mtp: false",
                )
    _check_host(m, source)
    cases = expand(m)
    _check_profile(m, cases, source)
    _check_ab(m, cases, source)
    dup = _dups(c.case_id for c in cases)
    if dup:
        raise MatrixError(source, "topologies", f"case {dup[0]!r} appears twice")
    _check_case_folders(cases, source)


def _check_host(m: Matrix, source: str) -> None:
    problem = matrix_policy.host_problem(m.host, m.bind_all_interfaces)
    if problem is not None:
        raise MatrixError(source, "host", problem)


# A case folder's name is one path component; most filesystems stop at 255 bytes.
_MAX_FOLDER_BYTES = 255


def _check_case_folders(cases: Sequence[Case], source: str) -> None:
    """Every case gets a folder of its own: two case ids that map to one folder name (or to
    names only case differs in, which a case-insensitive filesystem makes one) are refused,
    naming both. The mapping itself stays: committed runs are read by it."""
    seen: dict[str, Case] = {}
    for case in cases:
        slug = case.slug
        if len(slug.encode()) > _MAX_FOLDER_BYTES:
            raise MatrixError(
                source, "models", f"case {case.case_id!r} needs a folder name of "
                f"{len(slug.encode())} bytes, over the {_MAX_FOLDER_BYTES} a filesystem takes: "
                "shorten its model label",
            )  # fmt: skip
        other = seen.setdefault(slug.casefold(), case)
        if other is not case:
            raise MatrixError(
                source, "models", f"cases {other.case_id!r} and {case.case_id!r} would share "
                f"the folder cases/{slug}: give their models (or variants) labels that differ "
                "in more than punctuation, spaces or case",
            )  # fmt: skip


def _check_acceptance(m: Matrix, topo: TopologySpec, where: str, source: str) -> None:
    """Synthetic acceptance needs an MTP case, and a GPU."""
    if topo.mtp_acceptance is None:
        return
    if not any(k > 0 for k in topo.mtp):
        raise MatrixError(
            source, f"{where}={topo.mtp_acceptance}", "is for MTP cases, and every mtp here is 0"
        )
    if m.resources.accelerator == "cpu":
        # vllm/utils/cpu_triton_utils.py (0.32): `assert not SYNTHETIC_MODE`.
        raise MatrixError(
            source,
            f"{where}={topo.mtp_acceptance}",
            "is not possible on CPU: vLLM's CPU sampler refuses synthetic acceptance "
            "('Synthetic acceptance not supported with CPU sampling'); leave it out on CPU",
        )


def _check_profile(m: Matrix, cases: Sequence[Case], source: str) -> None:
    """The profile phase owns vLLM's profiler flag: a case that passes its own is refused."""
    if m.profile is None:
        return
    owner = next((c for c in cases if any(_profiler_flag(a) for a in c.args)), None)
    if owner is not None:
        raise MatrixError(
            source,
            "profile",
            f"case {owner.case_id!r} passes --profiler-config itself; the profile phase "
            "sets it (remove it from args, or the profile key)",
        )


# Flags a switch-mode server gets from the orchestrator (orchestrator.plan.units): the
# extension that flips its path, and no prefix caching (the blocks of one pair send the same
# prompts).
SWITCH_SERVER_VARIANT = "switch"  # the name a switch-mode server's own case directory carries
SWITCH_FLAGS = ("--worker-extension-cls", "--enable-prefix-caching", "--no-enable-prefix-caching")


def _check_ab(m: Matrix, cases: Sequence[Case], source: str) -> None:
    """An A/B needs a baseline and a candidate and, in restarts mode, two starts of each;
    switch mode's server owns its extension and prefix-cache flags, and its blocks are the
    repeats."""
    ab = m.ab
    if ab is None:
        return
    names = [v.name for v in m.variants]
    if len(names) < 2:
        raise MatrixError(source, "ab", "needs two or more variants: a baseline and a candidate")
    if ab.mode == "restarts":
        if ab.server_count < 2:
            raise MatrixError(
                source, f"ab.servers={ab.server_count}",
                "restarts mode needs 2 or more server starts per variant: one cannot show how "
                "far two servers of one configuration differ",
            )  # fmt: skip
        switch_only = {"blocks", "order", "first", "serve_as", "paths", "extension"}
        extra = sorted(ab.model_fields_set & switch_only)
        if extra:
            raise MatrixError(source, f"ab.{extra[0]}", "is for mode: switch")
        return
    if SWITCH_SERVER_VARIANT in names:
        raise MatrixError(
            source, "variants", f"{SWITCH_SERVER_VARIANT!r} names a switch-mode server's own "
            "directory; call the variant something else",
        )  # fmt: skip
    for key in ([ab.serve_as] if ab.serve_as else []) + list(ab.paths):
        if key not in names:
            raise MatrixError(source, "ab", f"names variant {key!r}; the variants are {names}")
    for i, w in enumerate(m.workloads):
        if w.repeats != 1:
            raise MatrixError(
                source, f"workloads[{i}].repeats={w.repeats}",
                "ab.mode switch runs each workload once per block; the blocks are the repeats "
                "(set ab.blocks)",
            )  # fmt: skip
    for c in cases:
        flag = next((a for a in c.args if a.split("=", 1)[0] in SWITCH_FLAGS), None)
        if flag is not None:
            raise MatrixError(
                source, "ab",
                f"case {c.case_id!r} passes {flag.split('=', 1)[0]}; a switch-mode server gets "
                "it from the orchestrator (ab.extension, and no prefix caching)",
            )  # fmt: skip


def _profiler_flag(arg: str) -> bool:
    # Every spelling vLLM reads as --profiler-config: dotted, abbreviated (owned_flags).
    return owned_flag(arg, PROFILE_OWNED) is not None


def expand(m: Matrix) -> list[Case]:
    """Every case in run order: variants of one topology are adjacent so they are measured paired."""
    cases: list[Case] = []
    for model in m.models:
        # A stand-in's own serve args and env come first: the matrix's, given later, win.
        own_args, own_env = (
            standins.serve_defaults(model.weight_format) if model.is_standin else ([], {})
        )
        for topo in m.topologies:
            for dcp in topo.dcp_values():
                for mtp in topo.mtp:
                    for variant in m.variants:
                        env = {**own_env, **m.engine.env, **model.env, **topo.env, **variant.env}
                        args = [*own_args, *m.engine.args, *model.args, *topo.args, *variant.args]
                        cases.append(
                            Case(
                                model=model,
                                tp=topo.tp,
                                dcp=dcp,
                                mtp=mtp,
                                variant=variant,
                                args=tuple(args),
                                env=tuple(sorted(env.items())),
                                mtp_acceptance=topo.mtp_acceptance if mtp > 0 else None,
                            )
                        )
    return cases if m.ab is None else _ab_rounds(cases, m)


def _ab_rounds(cases: list[Case], m: Matrix) -> list[Case]:
    """Each topology's variants served `ab.server_count` times, round by round: A B A B,
    never A A B B (a drift of the machine over the run then lands on every variant alike)."""
    assert m.ab is not None
    per_topology = len(m.variants)
    out: list[Case] = []
    for i in range(0, len(cases), per_topology):
        variants = cases[i : i + per_topology]
        for start in range(1, m.ab.server_count + 1):
            out += [replace(c, server=start) for c in variants]
    return out


def units_needed(m: Matrix) -> int:
    """GPUs (or CPUs on a CPU cluster) that the largest case needs on one node."""
    largest = max(t.tp for t in m.topologies)
    return largest * (m.resources.cpus_per_rank if m.resources.accelerator == "cpu" else 1)
