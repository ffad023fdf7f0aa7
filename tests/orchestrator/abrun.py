"""Recorded A/B run directories for the tests of orchestrator.analysis.ab, the reports and compare:
the manifest and rows `orchestrator run` writes for an A/B matrix, with figures the test
chooses. The cases are the real matrix expander's, so ids, order and fields are exactly a
run's."""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix
from orchestrator.plan.units import run_units
from orchestrator.results.rows import CaseResult
from orchestrator.results.store import RunStore

RESTARTS = """\
name: ab-h16
models: [{label: glm5-h16, path: /models/glm5-h16, num_heads: 16}]
topologies: [{tp: 1}]
workloads:
  - {name: ctx0, prompt_tokens: 1, output_tokens: 512, duration_s: 12, repeats: 3}
variants: [{name: staged}, {name: fused}]
ab: {servers: 4}
"""

SWITCH = """\
name: ab-switch
models: [{label: glm5-h16, path: /models/glm5-h16, num_heads: 16}]
topologies: [{tp: 1}]
workloads:
  - {name: ctx0, prompt_tokens: 1, output_tokens: 512, duration_s: 12}
variants: [{name: staged}, {name: fused}]
ab: {mode: switch, blocks: 4}
"""

# One figure of a unit: (output tok/s, TPOT p50 ms, TPOT mean ms), and the TTFT p50 ms where
# the test gives one (a run recorded without it has no TTFT to judge).
Unit = tuple[float, ...]


def _figures(unit: Unit) -> dict[str, Any]:
    tok, p50, mean = unit[:3]
    out = {
        "aggregate_tok_s": tok,
        "per_user_tok_s": tok,
        "tpot_ms": {"p50": p50, "p99": p50 * 1.01, "mean": mean},
    }
    if len(unit) > 3:
        out["ttft_ms"] = {"p50": unit[3], "p99": unit[3] * 1.2, "mean": unit[3]}
    return out


def _server(units: Sequence[Unit]) -> dict[str, Any]:
    """A workload measured in `units` repeats (restarts) or blocks (switch)."""
    repeats = [{"repeat": i, **_figures(u)} for i, u in enumerate(units, 1)]
    pooled = tuple(statistics.fmean(u[i] for u in units) for i in range(min(map(len, units))))
    mean = _figures(pooled)
    return {
        "name": "ctx0",
        "repeats": repeats,
        "mean": mean,
        "latency": {k: mean[k] for k in ("tpot_ms", "ttft_ms") if k in mean},
        "requests": len(units),
        "errors": 0,
    }


def write_run(
    root: Path,
    figures: Mapping[str, Sequence[Unit]],
    *,
    matrix: str = RESTARTS,
    run_id: str = "ab",
    created_at: str = "2026-12-02T10:00:00+00:00",
    edit: Mapping[str, Mapping[str, Any]] | None = None,
) -> Path:
    """An A/B run directory: `figures` maps each case id to its repeats' (restarts) or
    blocks' (switch) figures; `edit` sets fields of some rows (status, profile, ...)."""
    m = parse_matrix(matrix, "test.yaml")
    cases = expand(m)
    store = RunStore.create(root, run_id)
    store.write_manifest(
        {
            "run_id": run_id,
            "created_at": created_at,
            "matrix_path": "test.yaml",
            "matrix": m.model_dump(mode="json"),
            "cases": [c.to_dict() for c in cases],
            "versions": {"vllm": "0.26.0"},
        }
    )
    # A switch server's schedule as the planner makes it (the rows record it).
    planned = {
        c.case_id: unit.blocks
        for unit in (run_units(m, cases, cases) if m.switch_mode else [])
        for c in unit.cases
    }
    for c in cases:
        if c.case_id not in figures:
            continue
        row: dict[str, Any] = {
            **c.to_dict(),
            "status": "passed",
            "workloads": {"ctx0": _server(figures[c.case_id])},
            "timings": {"total_s": 60.0},
        }
        if m.switch_mode:
            plan = list(planned[c.case_id])
            row["switch"] = {
                "server_case": f"{c.topology_id}/switch/s1",
                "path": c.variant.name,
                "schedule": plan,
                "blocks": [i for i, v in enumerate(plan, 1) if v == c.variant.name],
            }
        row.update((edit or {}).get(c.case_id, {}))
        store.append_result(CaseResult.model_validate(row))
    return store.root


def restarts(staged: Sequence[Unit], fused: Sequence[Unit]) -> dict[str, list[Unit]]:
    """Figures of a restarts run: server i's three repeats all at its figure."""
    out: dict[str, list[Unit]] = {}
    for variant, servers in (("staged", staged), ("fused", fused)):
        for i, unit in enumerate(servers, 1):
            out[f"glm5-h16/tp1-dcp1-mtp0/{variant}/s{i}"] = [unit] * 3
    return out


def switch(staged: Sequence[Unit], fused: Sequence[Unit]) -> dict[str, list[Unit]]:
    """Figures of a switch run: one server, each variant's blocks."""
    return {
        "glm5-h16/tp1-dcp1-mtp0/staged/s1": list(staged),
        "glm5-h16/tp1-dcp1-mtp0/fused/s1": list(fused),
    }
