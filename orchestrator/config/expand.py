"""A validated `Matrix` expanded into its `Case`s, in run order; and what its largest case
needs of one node."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Any

from orchestrator.common.layout import case_slug
from orchestrator.config.axes import ModelSpec, VariantSpec
from orchestrator.config.schema import Matrix
from orchestrator.models import standins


@dataclass(frozen=True)
class Case:
    """One server launch: a topology of one model under one variant, measured with every
    workload."""

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
            "fusedq_qualified_heads": self.heads_per_rank in self.model.qualified_heads,
            "args": list(self.args),
            "env": dict(self.env),
            **({"mtp_acceptance": self.mtp_acceptance} if self.mtp_acceptance is not None else {}),
        }


def expand(m: Matrix) -> list[Case]:
    """Every case in run order: variants of one topology are adjacent so they are measured
    paired."""
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
