"""The report sections about how servers ran: start-up phases and MTP acceptance, from the
rows, and absent where the rows carry neither (older runs)."""

from __future__ import annotations

import json

from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix
from orchestrator.reports import write_reports
from orchestrator.results.rows import CaseResult
from orchestrator.results.store import RunStore

MATRIX = """
name: s
models: [{label: m, path: /m, num_heads: 16}]
topologies: [{tp: 1, mtp: [0, 1], mtp_acceptance: 0.7}]
workloads: [{name: ctx0, prompt_tokens: 1, output_tokens: 8}]
"""
STARTUP = {
    "phases": {"imports": 12.0, "api_server": 68.0, "weights": 6.0, "compile": 40.0},
    "vllm": {"torch_compile_s": 39.8, "graph_capture_s": 19.0},
    "compile_cache": "miss",
    "silences": [{"s": 66.0, "after": "non-default args: {...}", "before": "Initializing"}],
}
SEEN = {
    "drafts": 100,
    "draft_tokens": 100,
    "accepted_tokens": 69,
    "acceptance_rate": 0.69,
    "acceptance_length": 1.69,
    "per_position": [0.69],
    "configured_rates": [0.7],
    "expected_rate": 0.7,
}


def _store(tmp_path, with_figures: bool) -> RunStore:
    m = parse_matrix(MATRIX, "s.yaml")
    store = RunStore.create(tmp_path, "run")
    cases = expand(m)
    store.write_manifest(
        {
            "run_id": "run",
            "matrix_path": "s.yaml",
            "matrix": m.model_dump(mode="json"),
            "cases": [c.to_dict() for c in cases],
        }
    )
    for c in cases:
        workload = {"mean": {"aggregate_tok_s": 100.0}, "errors": 0}
        row = {**c.to_dict(), "status": "passed", "workloads": {"ctx0": workload}}
        if with_figures:
            row["startup"] = STARTUP
            row["timings"] = {"startup_s": 176.5}
            if c.mtp:
                workload["spec_decode"] = SEEN
        store.append_result(CaseResult.model_validate(row))
    return store


def test_sections_show_phases_cache_and_acceptance(tmp_path) -> None:
    store = _store(tmp_path, with_figures=True)
    write_reports(store)
    md = (store.root / "report.md").read_text()
    assert "## Server start-up (s)" in md
    assert "| Case | Start-up s | imports | api_server | weights | compile |" in md
    assert (
        "| m/tp1-dcp1-mtp0/default | 176.5 | 12.0 | 68.0 | 6.0 | 40.0 | 39.8 | 19.0 | miss |" in md
    )
    assert "66 s after `non-default args: {...}`" in md
    assert "## MTP acceptance" in md
    assert "| m/tp1-dcp1-mtp1/default | ctx0 | 0.700 | 0.690 | 1.69 | 69/100 |" in md
    report = json.loads((store.root / "report.json").read_text())
    mtp1 = next(c for c in report["cases"] if c["mtp"] == 1)
    assert mtp1["workloads"]["ctx0"]["spec_decode"]["acceptance_rate"] == 0.69
    assert mtp1["startup"]["compile_cache"] == "miss"


def test_rows_without_them_leave_the_sections_out(tmp_path) -> None:
    store = _store(tmp_path, with_figures=False)
    write_reports(store)
    md = (store.root / "report.md").read_text()
    assert "Server start-up" not in md and "MTP acceptance" not in md
