"""The blocks a case is made of: the engine, models, topologies and variants (each a level
that may add vLLM args and env), the workloads every case runs, and the log lines a variant
expects; with the strict base every block of the matrix shares.

A model block checks its built-in model (orchestrator.models): a tiny one is built to its
heads and layers, a stand-in (GLM-5, DeepSeek-V3, Kimi-K2) to one rank's share at its TP.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fusedq import contract
from orchestrator.config.owned_flags import ALWAYS_OWNED, args_problem
from orchestrator.models import standins, tinymodel

# A model path with this prefix is built locally by orchestrator.models.tinymodel (the embedded
# default).
BUILTIN_PREFIX = "builtin:"
BUILTIN_MODELS = tuple(tinymodel.BUILTINS) + tuple(standins.STANDINS)


class Strict(BaseModel):
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


class _EnvArgs(Strict):
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
        "builtin:glm5 / glm5-dense / glm5-dsa / glm5-dsa-dense / glm47-flash / deepseek-v3 / "
        "deepseek-v32 / kimi-k2 (stand-ins, config only: docs/standins.md).",
    )
    num_heads: int = Field(
        gt=0, description="Total attention heads of the model (a built-in model is built so)."
    )
    layers: int | None = Field(
        None,
        gt=0,
        description="Built-in models only: decoder layers (default 2; a stand-in: its base's, "
        "GLM-5's 78, DeepSeek-V3's and Kimi-K2's 61).",
    )
    weight_format: str = Field(
        "bf16",
        description="A label, except for a stand-in: mxfp8 serves it quantised by "
        "vLLM at load (--quantization mxfp8); mxfp8-checkpoint in a ModelOpt MXFP8 "
        "checkpoint's layout (dummy values, valid scales: --load-format fusedq_dummy).",
    )
    standin_tp: int | None = Field(
        None,
        gt=0,
        description="Stand-ins: the TP whose one rank it does (num_heads must be "
        "ceil(H / standin_tp), H the base's heads: GLM-5's and Kimi-K2's 64, DeepSeek-V3's "
        "128); default: derived from num_heads (64 heads: 16 -> 4, 11 -> 6, 8 -> 8; 128 heads: "
        "32 -> 4, 16 -> 8).",
    )
    experts: int | None = Field(
        None,
        gt=0,
        description="Stand-ins: routed experts kept (top-8 always); default: as many "
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
                        f"{key}={getattr(self, key)} is for stand-ins "
                        f"(builtin:{' / builtin:'.join(standins.STANDINS)}); "
                        f"{self.path!r} is not one"
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
            return int(standins.base_of(self.builtin_name).config["num_hidden_layers"])
        return tinymodel.DEFAULT_LAYERS

    @property
    def is_standin(self) -> bool:
        """A stand-in: config only, served with dummy weights
        (orchestrator.models.standins)."""
        return self.is_builtin and standins.is_standin(self.builtin_name)

    @property
    def geometry(self) -> contract.Geometry | None:
        """A built-in model's MLA geometry (a stand-in's base's; the tiny models have GLM-5's,
        orchestrator/models/tinymodel.py). None for a checkpoint: read on the worker."""
        if not self.is_builtin:
            return None
        return standins.base_of(self.builtin_name).geometry if self.is_standin else contract.GLM5

    @property
    def qualified_heads(self) -> set[int]:
        """The head counts per rank fusedq is qualified for at this model's geometry
        (``contract.QUALIFIED``); for a checkpoint, any served geometry's."""
        geometries = contract.GEOMETRIES if self.geometry is None else (self.geometry,)
        return {h for g in geometries for h in contract.QUALIFIED[g.name].heads}

    @property
    def context_tokens(self) -> int | None:
        """The longest request (prompt + output) a built-in model's own config lets vLLM
        serve: its max_position_embeddings (a stand-in's YaRN rope does not raise vLLM's
        limit). None for a checkpoint path or hub id: its config may be on another host, and
        is not guessed at."""
        if not self.is_builtin:
            return None
        if self.is_standin:
            return standins.context_tokens(self.builtin_name)
        return int(tinymodel.ARCH["max_position_embeddings"])

    @property
    def no_mtp(self) -> str | None:
        """Why the model has no MTP layer to serve MTP with, or None where it has one."""
        if not self.has_mtp:
            return "has_mtp: false"
        if self.is_standin and not standins.base_of(self.builtin_name).mtp_layers:
            base = standins.base_of(self.builtin_name).title
            return f"is {self.path}: {base} publishes no MTP layer (num_nextn_predict_layers 0)"
        return None

    @property
    def stands_for_tp(self) -> int:
        """A stand-in's TP (its `standin_tp`, else derived from num_heads and its base's
        heads)."""
        if self.standin_tp is not None:
            return self.standin_tp
        return standins.standin_tp_for_heads(self.num_heads, standins.base_name(self.builtin_name))


def _check_standin(model: ModelSpec) -> None:
    """num_heads is one rank's share of the base's heads at standin_tp; an MTP layer is
    asked of a base that has one; sizes and weight format are servable."""
    tp = model.stands_for_tp
    base = standins.base_of(model.builtin_name)
    want = standins.heads_per_rank(tp, standins.base_name(model.builtin_name))
    if model.num_heads != want:
        raise ValueError(
            f"num_heads={model.num_heads} does not match standin_tp={tp}: one rank of "
            f"{base.title} at TP{tp} holds {want} of its {base.heads} heads"
        )
    if "has_mtp" in model.model_fields_set and model.has_mtp and not base.mtp_layers:
        raise ValueError(
            f"has_mtp=True, but {model.path} has no MTP layer ({base.title} publishes "
            "num_nextn_predict_layers 0)"
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


class WorkloadSpec(Strict):
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


class ExpectSpec(Strict):
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
