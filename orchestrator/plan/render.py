"""`orchestrator plan`: the expanded cases and what they need, instantly, nothing launched."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator.analysis.sequential import StoppingRule
from orchestrator.config.expand import Case, expand, units_needed
from orchestrator.config.load import load_matrix
from orchestrator.config.policy import env_notes, matrix_warnings
from orchestrator.config.schema import Matrix
from orchestrator.models import standins
from orchestrator.plan.estimate import estimate_run, human_s
from orchestrator.plan.fused import fused_plan
from orchestrator.plan.units import run_units
from orchestrator.results.recorded_run import WorkloadDef


def plan_matrix(path: str | Path, *, sets: Sequence[str] = ()) -> dict[str, Any]:
    """Validate and expand a matrix; unset ${VAR}s are reported, not fatal, so a plan can be
    read before model paths are supplied."""
    unresolved: list[str] = []
    matrix = load_matrix(path, sets=sets, unresolved=unresolved)
    cases = expand(matrix)
    unit = "GPU" if matrix.resources.accelerator == "gpu" else "CPU"
    per_rank = 1 if unit == "GPU" else matrix.resources.cpus_per_rank
    notes = [f"unresolved: {u} (set it before `orchestrator run`)" for u in unresolved]
    notes += env_notes(matrix)
    if matrix.resources.accelerator == "cpu":
        notes.append(
            "CPU build: DCP > 1 is not possible (vLLM's CPU MLA backends return no softmax LSE); "
            "only dcp: [1] topologies run."
        )
    for c in cases:
        if c.model.num_heads % c.tp:
            notes.append(
                f"{c.topology_id}: {c.model.num_heads} heads over TP{c.tp} -> "
                f"{c.heads_per_rank} per rank padded (engine.pads_heads: true)"
            )
    if matrix.ab is not None:
        notes.append(_ab_note(matrix))
    notes += _model_notes(matrix, cases)
    estimate = estimate_run(matrix, cases)
    per_case = estimate.per_case()
    seen: set[str] = set()
    notes = [n for n in notes if not (n in seen or seen.add(n))]  # type: ignore[func-returns-value]
    return {
        "matrix": matrix.name,
        "path": str(path),
        "accelerator": matrix.resources.accelerator,
        "largest_bundle": {unit: units_needed(matrix)},
        # Server launches: one per case, or one per topology and start in switch mode.
        "servers": len(run_units(matrix, cases, cases)),
        "workloads": [
            {
                "name": w.name,
                "column": w.report_column,
                "prompt_tokens": w.prompt_tokens,
                "output_tokens": w.output_tokens,
                "concurrency": w.concurrency,
                "requests": w.request_count,
                "duration_s": w.duration_s,
                "repeats": w.repeats,
            }
            for w in matrix.workloads
        ],
        "cases": [
            {
                **{k: v for k, v in c.to_dict().items() if k not in ("env", "args")},
                unit.lower() + "s": c.tp * per_rank,
                "estimated_s": round(per_case[c.case_id], 1),
                # Whether the server will run the fused query, not only whether its head
                # count is qualified (orchestrator.plan.fused).
                "fusedq": fused_plan(c, matrix.resources.accelerator).why,
            }
            for c in cases
        ],
        "estimate": estimate.to_dict(),
        "notes": notes,
        "warnings": matrix_warnings(matrix),
    }


def _ab_note(matrix: Matrix) -> str:
    ab = matrix.ab
    assert ab is not None
    if ab.mode == "restarts":
        return (
            f"A/B: each variant served {ab.server_count} times per topology, round by round; "
            "the 95% interval is over server starts (docs/statistics.md)"
        )
    text = (
        f"A/B switch: {ab.server_count} server(s) per topology serve every variant, "
        f"{ab.blocks} blocks each ({ab.order}), flipping the path through {ab.extension}; "
        "the 95% interval is over rounds, each a pair of blocks (docs/statistics.md)"
    )
    rule = StoppingRule.of(ab.model_dump(mode="json"))
    if rule is None:
        return text
    looks = ", ".join(str(n) for n in rule.looks)
    return (
        f"{text}. Stopping rule: after {looks} rounds, stop once the primary figure's interval "
        f"is within ±{rule.target_pct:g}% for every candidate, else at {rule.cap} rounds; "
        f"each look's interval {rule.method}, so the one it stops at is a 95% interval; "
        f"the estimate is the worst case, {rule.cap} blocks per variant"
    )


def render_plan(plan: dict[str, Any]) -> str:
    unit = "gpus" if plan["accelerator"] == "gpu" else "cpus"
    lines = [
        f"{plan['path']}: matrix {plan['matrix']}, {plan['servers']} server launches "
        f"(workloads run one at a time on each), largest bundle "
        f"{next(iter(plan['largest_bundle'].values()))} {unit.upper()} on one node",
        "",
        f"{'case':<44} {'TP':>3} {'DCP':>4} {'MTP':>4} {'heads/rank':>10} {unit.upper():>5} "
        f"{'~time':>7}  fusedq",
    ]
    for c in plan["cases"]:
        lines.append(
            f"{c['case_id']:<44} {c['tp']:>3} {c['dcp']:>4} {c['mtp']:>4} {c['heads_per_rank']:>10} "
            f"{c[unit]:>5} {human_s(c['estimated_s']):>7}  "
            f"{c['fusedq']}"
        )
    lines.append("")
    for w in plan["workloads"]:
        d = WorkloadDef.of(w)
        lines.append(f"workload {d.title}: {d.describe()}")
    est = plan["estimate"]
    lines.append(f"estimated duration: ~{human_s(est['total_s'])} ({est['basis']})")
    for n in plan["notes"]:
        lines.append(f"note: {n}")
    for w in plan["warnings"]:
        lines.append(f"warning: {w}")
    return "\n".join(lines)


def _model_notes(matrix: Matrix, cases: Sequence[Case]) -> list[str]:
    """What each stand-in is (orchestrator.models.standins), MTP cases of a random-weight
    model whose draft would accept almost nothing, and synthetic acceptance (which a
    switch-mode server reseeds per round, so its tokens are compared)."""
    switch = matrix.switch_mode
    same_tokens = any(w.same_tokens for w in matrix.workloads)
    notes = [
        f"{m.label} ({m.path}): "
        + standins.describe(
            m.builtin_name,
            standin_tp=m.stands_for_tp,
            layers=m.builtin_layers,
            experts=m.experts,
            mtp=m.has_mtp,
            weight_format=m.weight_format,
        )
        for m in matrix.models
        if m.is_standin
    ]
    for c in cases:
        if c.mtp and c.model.is_builtin and c.mtp_acceptance is None:
            notes.append(
                f"{c.topology_id}: MTP on random weights accepts almost no draft; set "
                "mtp_acceptance on the topology for vLLM's synthetic acceptance"
            )
        elif c.mtp_acceptance is not None:
            notes.append(
                f"{c.topology_id}: synthetic MTP acceptance {c.mtp_acceptance:g} per draft "
                "position (the acceptance seen is read from the server's /metrics)"
            )
        if same_tokens and switch and c.mtp and c.mtp_acceptance is not None:
            # The switch server reseeds its workers before each block (execution.switch).
            notes.append(
                f"{c.topology_id}: same tokens compared under synthetic acceptance: the switch "
                "server reseeds every worker with the round's seed before each block, so both "
                "paths of a round draw the same acceptance"
            )
    return notes
