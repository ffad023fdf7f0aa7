"""The matrix itself: its top-level keys and the run-wide blocks (resources, timeouts,
audit, profile, ab, ray) over the blocks a case is made of (`axes`); and the facts those
blocks default to: the warm-up request, the A/B's server starts, switch mode's extension,
its server's case directory and the flags its server gets from the orchestrator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

from pydantic import Field

from orchestrator.config.axes import (
    EngineSpec,
    ExpectSpec,
    ModelSpec,
    Strict,
    TopologySpec,
    VariantSpec,
    WorkloadSpec,
)

# The unmeasured warm-up request (warmup_requests of them per server): short, because what
# it absorbs is one-time cost (the workers' first collective), not throughput.
WARMUP_PROMPT_TOKENS = 16
WARMUP_OUTPUT_TOKENS = 8


class ResourceSpec(Strict):
    accelerator: Literal["gpu", "cpu"] = "gpu"
    cpus_per_rank: int = Field(1, gt=0, description="CPUs reserved per TP rank on a CPU cluster.")
    gpus_per_node: int | None = Field(
        None, gt=0, description="Largest GPU count of one node, for plan-time checks."
    )


class TimeoutSpec(Strict):
    placement_s: float = Field(600, gt=0, description="Ray placement group ready.")
    ready_s: float = Field(1800, gt=0, description="Server start-up until /health answers.")
    request_s: float = Field(1800, gt=0, description="One request (64k prefill included).")
    case_s: float = Field(7200, gt=0, description="One case, start to stop.")


class AuditSpec(Strict):
    expect: list[ExpectSpec] = Field(default_factory=list)
    kernel_log: bool = Field(True, description="Also scan the kernel log (Xid lines land there).")


class ProfileSpec(Strict):
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
SWITCH_EXTENSION = "fusedq.vllm.worker_ext.FusedqWorkerExtension"
# Server starts per variant when ab.servers is not given: 4 starts per variant put the 95 %
# interval at about +-0.3 % where servers differ by 0.2 % (docs/statistics.md).
DEFAULT_AB_SERVERS = 4
SWITCH_SERVER_VARIANT = "switch"  # the name a switch-mode server's own case directory carries
# Flags a switch-mode server gets from the orchestrator (orchestrator.plan.units): the
# extension that flips its path, and no prefix caching (the blocks of one pair send the same
# prompts).
SWITCH_FLAGS = ("--worker-extension-cls", "--enable-prefix-caching", "--no-enable-prefix-caching")


# The figures an A/B judges, by the keys report.json names them (orchestrator.analysis.ab's
# AB_METRICS reads each one; a test holds the two lists equal).
ABMetricKey = Literal["output_tok_s", "tpot_p50_ms", "tpot_mean_ms", "ttft_p50_ms"]
# The primary figure when the matrix names none: decode speed at one-token prompts, the
# workload the fused query's saving is largest in and the one every shipped A/B runs.
DEFAULT_PRIMARY_WORKLOAD, DEFAULT_PRIMARY_METRIC = "ctx0", "output_tok_s"


class ABPrimary(Strict):
    """The one figure per topology an A/B is judged on at 95 %; every other figure of the
    topology is secondary and judged with Holm's correction (docs/statistics.md)."""

    workload: str | None = Field(
        None,
        description=f"The primary figure's workload (its name; default {DEFAULT_PRIMARY_WORKLOAD}"
        " where the matrix has one, else its first workload).",
    )
    metric: ABMetricKey = Field(DEFAULT_PRIMARY_METRIC, description="The primary figure.")


def primary_workload(named: str | None, workloads: Sequence[str]) -> str | None:
    """The primary figure's workload: the one named, else ctx0 where there is one, else the
    first (None for a matrix without workloads)."""
    if named is not None:
        return named
    if DEFAULT_PRIMARY_WORKLOAD in workloads:
        return DEFAULT_PRIMARY_WORKLOAD
    return workloads[0] if workloads else None


class ABSpec(Strict):
    """An A/B of the variants that can resolve a fraction of a percent (orchestrator.analysis.ab).

    ``restarts``: per topology each variant is served `servers` times, round by round
    (A B A B ..., never A A B B); every server start is a case and the interval is over
    server starts. ``switch``: per topology `servers` servers (default 1) that each serve
    every variant, flipping the decode path between blocks of the workloads through the
    worker extension (orchestrator.execution.switch); each round (one block of each variant)
    is a pair, and the interval is over rounds (over servers, each a pair, when there are two
    or more)."""

    mode: Literal["restarts", "switch"] = "restarts"
    servers: int | None = Field(
        None,
        ge=1,
        le=100,
        description=f"Server starts per variant and topology (restarts, default "
        f"{DEFAULT_AB_SERVERS}, at least 2), or switch servers per topology (switch, default 1).",
    )
    blocks: int = Field(
        8,
        ge=2,
        le=1000,
        description="switch: blocks of the workloads per variant and server (one round of "
        "one block per variant each); even under order abba.",
    )
    order: Literal["abba", "alternate"] = Field(
        "abba",
        description="switch: abba (rounds in and against the variants' order, ABBA BAAB ...: "
        "each variant's blocks at the same mean position, which cancels a linear drift) or "
        "alternate (A B A B ...: not drift-balanced).",
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
    primary: ABPrimary = Field(
        default_factory=ABPrimary,
        description="The figure each topology is judged on (the others are secondary).",
    )
    target_half_width_pct: float | None = Field(
        None,
        gt=0,
        description="switch: after `blocks` rounds, add rounds two at a time until the primary "
        "figure's interval (adjusted for the looks: orchestrator.analysis.sequential) is within "
        "+-this many percent, or `max_blocks` rounds have run.",
    )
    max_blocks: int | None = Field(
        None,
        ge=2,
        le=1000,
        description="switch: the most rounds the stopping rule may run (even, >= blocks).",
    )

    @property
    def worst_case_blocks(self) -> int:
        """The rounds a switch server runs at most: `max_blocks` under the stopping rule."""
        return (
            self.max_blocks
            if self.target_half_width_pct is not None and self.max_blocks
            else self.blocks
        )

    @property
    def server_count(self) -> int:
        if self.servers is not None:
            return self.servers
        return DEFAULT_AB_SERVERS if self.mode == "restarts" else 1

    def path_of(self, variant: str) -> str:
        return self.paths.get(variant, variant)


class RaySpec(Strict):
    address: str | None = Field(None, description="Join this cluster; default: a local Ray.")


class Matrix(Strict):
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
