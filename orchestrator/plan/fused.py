"""Will a case's server run the fused query? What `orchestrator plan` says of each case.

Head counts alone do not decide it. The fusedq vLLM plugin (fusedq/vllm/) declines,
per worker, where the kernel cannot run, and the server then serves vLLM's staged path:

- ``FUSEDQ_MLA_QUERY=0``: the plugin is off (a staged variant, by choice);
- a head count per rank outside the ones fusedq qualified for the stand-in's geometry
  (``contract.QUALIFIED``; a checkpoint's geometry is read on the worker, so any served
  geometry's count passes here); with ``FUSEDQ_MLA_QUERY=1`` (required) the server refuses
  to start instead;
- a stand-in whose MLA widths are not among the geometries the fused op serves
  (``contract.GEOMETRIES``, compared as the plugin does: qk_nope, qk_rope, kv_lora), e.g.
  DeepSeek-V3's and Kimi-K2's 128-wide nope; likewise fails with ``FUSEDQ_MLA_QUERY=1``;
- on CPU, a worker without ``TRITON_INTERPRET=1``: CPU tensors run the kernel only in
  Triton's interpreter. The variable comes from the case's env, else the environment the
  orchestrator runs in (a local Ray's workers inherit it).

What is known only on the worker (the vLLM release's guard, a GPU's architecture) is not
judged here; the server log's decision line says it, and a matrix can expect that line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from fusedq import contract
from orchestrator.config.expand import Case
from orchestrator.models import standins

MODE_ENV = contract.MODE_ENV  # the plugin's switch: auto (unset), 0, 1
INTERPRET_ENV = "TRITON_INTERPRET"


@dataclass(frozen=True)
class FusedPlan:
    runs: bool
    why: str  # for a plan's column: "qualified", or "staged: <reason>"

    def to_dict(self) -> dict[str, object]:
        return {"runs": self.runs, "why": self.why}


def fused_plan(case: Case, accelerator: str, environ: Mapping[str, str] = os.environ) -> FusedPlan:
    """Whether `case`'s server will run the fused query, and why not where it will not."""
    env = case.env_dict
    mode = env.get(MODE_ENV, environ.get(MODE_ENV, "auto")).strip().lower() or "auto"
    if mode == "0":
        return FusedPlan(False, f"staged: {MODE_ENV}=0")
    unserved = _unserved_geometry(case)
    if unserved is not None:
        why = f"staged: {unserved}"
        if mode == "1":
            why = f"fails: {MODE_ENV}=1 and {unserved}"
        return FusedPlan(False, why)
    heads = case.heads_per_rank
    if heads not in case.model.qualified_heads:
        qualified = _qualified_words(case.model)
        why = f"staged: {heads} heads per rank (qualified: {qualified})"
        if mode == "1":
            why = f"fails: {MODE_ENV}=1 and {heads} heads per rank (qualified: {qualified})"
        return FusedPlan(False, why)
    if accelerator == "cpu" and env.get(INTERPRET_ENV, environ.get(INTERPRET_ENV)) != "1":
        why = f"staged: CPU without {INTERPRET_ENV}=1"
        if mode == "1":
            why = f"fails: {MODE_ENV}=1 on CPU without {INTERPRET_ENV}=1"
        return FusedPlan(False, why)
    return FusedPlan(True, "qualified")


def _qualified_words(model) -> str:
    """How a plan names the head counts ``model.qualified_heads`` holds: a built-in model's
    geometry's, or every served geometry's, each named, for a checkpoint."""
    g = model.geometry
    if g is not None:
        return ", ".join(map(str, contract.QUALIFIED[g.name].heads))
    return "; ".join(
        f"{g.name} {', '.join(map(str, contract.QUALIFIED[g.name].heads))}"
        for g in contract.GEOMETRIES
    )


def _unserved_geometry(case: Case) -> str | None:
    """Why a stand-in's MLA widths are not the fused op's, or None (served, or not a
    stand-in: a checkpoint's widths are read only on the worker)."""
    if not case.model.is_standin:
        return None
    g = standins.base_of(case.model.builtin_name).geometry
    served = {(s.qk_nope, s.qk_rope, s.kv_lora) for s in contract.GEOMETRIES}
    if (g.qk_nope, g.qk_rope, g.kv_lora) in served:
        return None
    return f"{g.name} widths (qk_nope {g.qk_nope}) not served by the fused op yet"
