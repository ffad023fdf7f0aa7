"""report.json: the run's figures for machines (dashboards, release tooling)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from orchestrator.reports.profile import profile_pairs
from orchestrator.reports.run import Run, audit_sentence, paired_deltas
from orchestrator.reports.summary import LATENCIES, QUANTILES
from orchestrator.results import WorkloadSummary


def _workload(w: WorkloadSummary) -> dict[str, Any]:
    return {
        "aggregate_tok_s": w.mean.aggregate_tok_s,
        "aggregate_tok_s_sd": w.throughput()[1],
        "per_user_tok_s": w.mean.per_user_tok_s,
        "latency_ms": {
            key: {q: getattr(w.latency_ms(key), q) for q in QUANTILES} for _, key in LATENCIES
        },
        "repeats": [
            {"aggregate_tok_s": x.aggregate_tok_s, "per_user_tok_s": x.per_user_tok_s}
            for x in w.repeats
        ],
        "spec_decode": None if w.spec_decode is None else w.spec_decode.model_dump(mode="json"),
    }


def render_json(run: Run) -> dict[str, Any]:
    m = run.manifest
    rows = run.ordered
    return {
        "run_id": m.run_id,
        "matrix": m.matrix_name,
        "versions": m.versions,
        "git": m.git,
        "cases_total": len(m.cases),
        "cases_finished": len(rows),
        "cases_failed": sum(not r.passed for r in rows),
        "overhead": run.overhead.run,
        "overhead_resumes": run.overhead.resumes,
        "cases": [
            {
                "case_id": r.case_id,
                "model": r.model,
                "tp": r.tp,
                "dcp": r.dcp,
                "mtp": r.mtp,
                "variant": r.variant,
                "status": r.status,
                "reason": r.reason,
                "errors": r.errors,
                "audit_verdict": r.audit.verdict.status,
                "same_tokens": {
                    k: c.model_dump(mode="json", exclude_unset=True)
                    for k, c in r.same_tokens.items()
                },
                "workloads": {name: _workload(w) for name, w in r.workloads.items()},
                "profile": None if r.profile is None else r.profile.model_dump(mode="json"),
                "startup": None if r.startup is None else r.startup.model_dump(mode="json"),
            }
            for r in rows
        ],
        "paired": [asdict(d) for d in paired_deltas(run)],
        "profile_pairs": [p.to_dict() for p in profile_pairs(rows, run.variants)],
        "audit_summary": audit_sentence(run.results),
    }
