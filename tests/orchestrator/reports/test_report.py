"""Reports from a run directory: the seeds' table, paired variants, failures, audit sentence."""

from __future__ import annotations

import json
from pathlib import Path

from orchestrator.audit import audit_logs
from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix
from orchestrator.reports import write_reports
from orchestrator.reports.markdown import render_markdown
from orchestrator.reports.run import audit_sentence, paired_deltas
from orchestrator.results.recorded_run import Overhead, Run
from orchestrator.results.rows import CaseResult
from orchestrator.results.store import RunStore
from orchestrator.results.stored_audit import AuditSummary

AUDIT_FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audit"

MATRIX = """
name: r
models: [{label: Luke BF16, path: /m, num_heads: 64}]
topologies: [{tp: 8, dcp: [1, 2], mtp: [0]}]
workloads:
  - {name: ctx0, prompt_tokens: 1, output_tokens: 8, duration_s: 10, repeats: 2}
  - {name: ctx64k, prompt_tokens: 65536, output_tokens: 8}
variants: [{name: staged}, {name: fused}]
"""


def _audit(clean: bool = True) -> dict:
    findings = (
        []
        if clean
        else [
            {
                "file": "/x/server.log",
                "line": 7,
                "rank": "Worker_TP3",
                "signature": "xid",
                "severity": "fatal",
                "category": "Xid",
                "text": "NVRM: Xid (PCI:0000:1b:00): 31, pid=1 <script>",
            }
        ]
    )
    return {
        "verdict": {"status": "clean" if clean else "findings"},
        "findings": findings,
        "searched": {
            "files": [{"path": "/x/server.log", "lines": 100}],
            "lines": 100,
            "categories": ["traceback", "Xid", "CUBLAS_STATUS"],
            "kernel_log": {"audited": False, "reason": "dmesg: Operation not permitted"},
            "expectations": [],
        },
    }


def _row(case, agg: dict[str, float | None], status="passed", clean=True) -> dict:
    d = case.to_dict()
    wl = {}
    for name, v in agg.items():
        if v is None:
            continue
        reps = [
            {"aggregate_tok_s": v - 0.1, "per_user_tok_s": v},
            {"aggregate_tok_s": v + 0.1, "per_user_tok_s": v},
        ]
        wl[name] = {
            "mean": {"aggregate_tok_s": v, "per_user_tok_s": v + 0.5},
            "repeats": reps,
            "errors": 0,
        }
    return {**d, "status": status, "reason": None if status == "passed" else "boom", "errors": 0,
            "workloads": wl, "audit": _audit(clean)}  # fmt: skip


def _store(tmp_path, rows_for, matrix: str = MATRIX) -> RunStore:
    m = parse_matrix(matrix, "r.yaml")
    cases = expand(m)
    store = RunStore.create(tmp_path, "run")
    store.write_manifest(
        {
            "run_id": "run",
            "matrix_path": "r.yaml",
            "matrix": m.model_dump(mode="json"),
            "cases": [c.to_dict() for c in cases],
            "versions": {"vllm": "0.32.0"},
        }
    )
    for row in rows_for(cases):
        store.append_result(CaseResult.model_validate(row))
    return store


def test_seed_table_and_paired_deltas(tmp_path):
    store = _store(
        tmp_path,
        lambda cs: [
            _row(cs[0], {"ctx0": 80.0, "ctx64k": 70.0}),
            _row(cs[1], {"ctx0": 88.0, "ctx64k": 77.0}),
            _row(cs[2], {"ctx0": 73.0, "ctx64k": None}),
            _row(cs[3], {"ctx0": 73.73, "ctx64k": 71.33}, status="failed", clean=False),
        ],
    )
    run = Run.load(store)
    run.overhead = Overhead.of(
        {"wall_s": 100.0, "startup_and_measured_s": 96.0, "overhead_s": 4.0, "overhead_pct": 4.0}
    )
    md = render_markdown(run)
    assert "| Model | TP | DCP | MTP | Variant | ctx0 | ctx64k | Errors | Status |" in md
    assert "| Luke BF16 | 8 | 1 | 0 | staged | 80.00 | 70.00 | 0 | ok |" in md
    assert "| Luke BF16 | 8 | 2 | 0 | staged | 73.00 | - | 0 | ok |" in md  # missing value is '-'
    assert "**FAILED**" in md and "boom" in md
    assert "| Luke BF16/tp8-dcp1-mtp0 | ctx0 | 80.00 | 88.00 | +10.00% |" in md
    assert "aggregate 79.900/80.100 tok/s" in md  # every repeat, as the seeds report them
    assert "overhead 4.0 s (4.0%)" in md
    assert "found problems in 1 case: Luke BF16/tp8-dcp2-mtp0/fused" in md
    assert "kernel log was not audited for any case (dmesg: Operation not permitted)" in md
    deltas = paired_deltas(run)
    assert [round(d.delta_pct, 2) for d in deltas if d.delta_pct is not None] == [
        10.0,
        10.0,
        1.0,
    ]


def test_three_variants_get_one_paired_table_per_candidate(tmp_path):
    """staged / fused / fused-pdl (matrices/h200-pdl.yaml): each candidate under its own
    title, not both under the first candidate's."""
    matrix = MATRIX.replace("dcp: [1, 2]", "dcp: [1]").replace(
        "{name: fused}]", "{name: fused}, {name: fused-pdl}]"
    )
    store = _store(
        tmp_path,
        lambda cs: [
            _row(c, {"ctx0": v, "ctx64k": v}) for c, v in zip(cs, (80.0, 88.0, 96.0), strict=True)
        ],
        matrix,
    )
    md = render_markdown(Run.load(store))
    assert "## Paired variants: staged vs fused\n" in md
    assert "## Paired variants: staged vs fused-pdl\n" in md
    assert "| Topology | Workload | Staged | Fused-Pdl | Delta |" in md
    assert "| Luke BF16/tp8-dcp1-mtp0 | ctx0 | 80.00 | 96.00 | +20.00% |" in md


def test_clean_run_sentence_lists_what_was_searched(tmp_path):
    store = _store(tmp_path, lambda cs: [_row(c, {"ctx0": 1.0, "ctx64k": 1.0}) for c in cs])
    md = render_markdown(Run.load(store))
    assert "found no traceback, Xid, or CUBLAS_STATUS failure" in md
    assert "across 4 cases" in md


def test_run_sentence_over_cases():
    """The run-level sentence the reports print, over these audits as a run stores them."""

    def case(case_id, result):
        return CaseResult(case_id=case_id, audit=AuditSummary.model_validate(result.to_dict()))

    def audited(name):
        log = AUDIT_FIXTURES / name
        return audit_logs([log], include_kernel_log=False, include_gpu_state=False)

    clean, bad = audited("vllm_tp4_clean.log"), audited("vllm_tp4_crash.log")
    s = audit_sentence([case("tp4-ctx0", clean), case("tp4-64k", bad)])
    assert s.startswith(
        "The final log audit of 2 logs (41 lines) across 2 cases found problems in 1 case: tp4-64k."
    )
    assert "The kernel log was not audited for any case (not requested)." in s
    assert audit_sentence([case("a", clean)]).endswith(
        "or host-OOM-kill failure. The kernel log was not audited for any case (not requested)."
    )


def test_json_summary_and_rewrite(tmp_path):
    store = _store(tmp_path, lambda cs: [_row(cs[0], {"ctx0": 5.0, "ctx64k": 4.0})])
    write_reports(
        store,
        overhead={"wall_s": 1, "startup_and_measured_s": 1, "overhead_s": 0, "overhead_pct": 0},
    )
    data = json.loads((store.root / "report.json").read_text())
    assert data["cases_total"] == 4 and data["cases_finished"] == 1
    assert data["cases"][0]["workloads"]["ctx0"]["aggregate_tok_s"] == 5.0
    write_reports(store)  # overhead is kept from the first write
    assert "Orchestrator overhead" in (store.root / "report.md").read_text()


def test_a_baseline_listed_last_is_still_the_baseline(tmp_path):
    """A matrix may run the candidate first (variants: fused, then staged with baseline: true);
    the paired tables still read staged -> fused."""
    matrix = MATRIX.replace(
        "variants: [{name: staged}, {name: fused}]",
        "variants: [{name: fused}, {name: staged, baseline: true}]",
    )
    store = _store(
        tmp_path,
        lambda cs: [_row(c, {"ctx0": 88.0 if c.variant.name == "fused" else 80.0}) for c in cs],
        matrix,
    )
    run = Run.load(store)
    assert run.variants == ["staged", "fused"]
    (d, *_) = paired_deltas(run)
    assert (d.baseline, d.candidate, round(d.delta_pct, 6)) == ("staged", "fused", 10.0)
    assert "| Luke BF16/tp8-dcp1-mtp0 | ctx0 | 80.00 | 88.00 | +10.00% |" in render_markdown(run)
