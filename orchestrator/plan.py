"""`orchestrator plan`: the expanded cases and what they need, instantly, nothing launched."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator import standins
from orchestrator.estimate import estimate_run, human_s
from orchestrator.matrix import Case, Matrix, expand, load_matrix, units_needed


def plan_matrix(path: str | Path, *, sets: Sequence[str] = ()) -> dict[str, Any]:
    """Validate and expand a matrix; unset ${VAR}s are reported, not fatal, so a plan can be
    read before model paths are supplied."""
    unresolved: list[str] = []
    matrix = load_matrix(path, sets=sets, unresolved=unresolved)
    cases = expand(matrix)
    unit = "GPU" if matrix.resources.accelerator == "gpu" else "CPU"
    per_rank = 1 if unit == "GPU" else matrix.resources.cpus_per_rank
    notes = [f"unresolved: {u} (set it before `orchestrator run`)" for u in unresolved]
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
        "servers": len(cases),
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
            }
            for c in cases
        ],
        "estimate": estimate.to_dict(),
        "notes": notes,
    }


def render_plan(plan: dict[str, Any]) -> str:
    unit = "gpus" if plan["accelerator"] == "gpu" else "cpus"
    lines = [
        f"{plan['path']}: matrix {plan['matrix']}, {plan['servers']} server launches "
        f"(one per case; workloads run one at a time on each), largest bundle "
        f"{next(iter(plan['largest_bundle'].values()))} {unit.upper()} on one node",
        "",
        f"{'case':<44} {'TP':>3} {'DCP':>4} {'MTP':>4} {'heads/rank':>10} {unit.upper():>5} "
        f"{'~time':>7}  fusedq",
    ]
    for c in plan["cases"]:
        lines.append(
            f"{c['case_id']:<44} {c['tp']:>3} {c['dcp']:>4} {c['mtp']:>4} {c['heads_per_rank']:>10} "
            f"{c[unit]:>5} {human_s(c['estimated_s']):>7}  "
            f"{'qualified' if c['fusedq_qualified_heads'] else 'staged fallback'}"
        )
    lines.append("")
    for w in plan["workloads"]:
        size = f"{w['requests']} requests" if w["requests"] else f"{w['duration_s']:g} s"
        lines.append(
            f"workload {w['name']} -> column {w['column']}: prompt {w['prompt_tokens']} tokens, "
            f"output {w['output_tokens']}, concurrency {w['concurrency']}, {size} x {w['repeats']} repeats"
        )
    est = plan["estimate"]
    lines.append(f"estimated duration: ~{human_s(est['total_s'])} ({est['basis']})")
    for n in plan["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def _model_notes(matrix: Matrix, cases: Sequence[Case]) -> list[str]:
    """What each GLM-5 stand-in is (orchestrator.standins), and MTP cases of a random-weight
    model whose draft would accept almost nothing."""
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
    return notes
