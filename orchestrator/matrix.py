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
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from orchestrator import standins, tinymodel
from orchestrator.fusedq_limits import limits
from orchestrator.store import case_slug

# The unmeasured warm-up request (warmup_requests of them per server): short, because what
# it absorbs is one-time cost (the workers' first collective), not throughput.
WARMUP_PROMPT_TOKENS = 16
WARMUP_OUTPUT_TOKENS = 8
# A model path with this prefix is built locally by orchestrator.tinymodel (the embedded default).
BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = tuple(tinymodel.BUILTINS) + tuple(standins.STANDINS)
# vLLM flags the orchestrator owns; passing them through would fight the topology axes.
OWNED_FLAGS = (
    "--tensor-parallel-size",
    "-tp",
    "--decode-context-parallel-size",
    "-dcp",
    "--speculative-config",
    "--host",
    "--port",
    "--served-model-name",
)


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
    for arg in args:
        flag = arg.split("=", 1)[0]
        if flag in OWNED_FLAGS:
            raise ValueError(
                f"{arg!r} is set by the orchestrator from the topology; remove it from args"
            )
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
        """A GLM-5 stand-in: config only, served with dummy weights (orchestrator.standins)."""
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
    vllm_bin: str | None = Field(None, description="`vllm` executable; default: next to python.")
    compile_cache: Literal["shared", "case"] = Field(
        "shared",
        description="Where vLLM's and Inductor's compile caches live: `shared` by every server "
        "of one configuration, in this run and later ones (orchestrator.compile_cache), or "
        "`case`, each server its own in its case directory.",
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
        "first must produce the first's ids, request by request (orchestrator/tokens.py).",
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
    """A profile phase per case (orchestrator.case_run): after the measured workloads, so it
    never disturbs them, the server's torch profiler records exactly `decode_steps` model
    steps of one request (a `prompt_tokens` prompt, `decode_steps` output tokens, alone on
    the server), and every rank's trace is brought into the case directory and read
    (orchestrator.trace)."""

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
    host: str = Field(
        "127.0.0.1",
        description="Address servers bind; loopback unless you need more: `node` binds the "
        "address Ray knows each server's node by (servers on other nodes of a cluster), "
        "0.0.0.0 every interface.",
    )
    max_mtp: int = Field(8, ge=0, description="Sanity bound on speculative tokens.")

    @property
    def baseline_variant(self) -> VariantSpec:
        """The variant marked ``baseline``, else the first."""
        return next((v for v in self.variants if v.baseline), self.variants[0])

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
    # vLLM's synthetic acceptance rate (conditional per draft position); MTP cases only.
    mtp_acceptance: float | None = None

    @property
    def topology_id(self) -> str:
        return f"{self.model.label}/tp{self.tp}-dcp{self.dcp}-mtp{self.mtp}"

    @property
    def case_id(self) -> str:
        return f"{self.topology_id}/{self.variant.name}"

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
        return {
            "case_id": self.case_id,
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
        raw = yaml.safe_load(text)
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
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise MatrixError(str(path), "", "no such file") from None
    except (OSError, UnicodeDecodeError) as exc:
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
    cases = expand(m)
    _check_profile(m, cases, source)
    dup = _dups(c.case_id for c in cases)
    if dup:
        raise MatrixError(source, "topologies", f"case {dup[0]!r} appears twice")


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


def _profiler_flag(arg: str) -> bool:
    # vLLM's spellings: --profiler-config JSON, and its dotted --profiler-config.profiler=...
    return arg.split("=", 1)[0].replace("_", "-").split(".", 1)[0] == "--profiler-config"


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
    return cases


def units_needed(m: Matrix) -> int:
    """GPUs (or CPUs on a CPU cluster) that the largest case needs on one node."""
    largest = max(t.tp for t in m.topologies)
    return largest * (m.resources.cpus_per_rank if m.resources.accelerator == "cpu" else 1)
