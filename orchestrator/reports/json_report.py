"""report.json: the run's figures for machines (dashboards, release tooling)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from orchestrator.reports.ab_section import ab_json
from orchestrator.reports.measures import LATENCIES, chunking, stat, totals
from orchestrator.reports.profile import profile_pairs
from orchestrator.reports.run import audit_sentence, paired_deltas
from orchestrator.results.recorded_run import Run, workload_defs
from orchestrator.results.rows import WorkloadSummary


def _workload(w: WorkloadSummary) -> dict[str, Any]:
    return {
        "aggregate_tok_s": w.mean.aggregate_tok_s,
        "aggregate_tok_s_sd": w.throughput()[1],
        "per_user_tok_s": w.mean.per_user_tok_s,
        # `vllm bench serve`'s block, summed over the repeats.
        "totals": None if (t := totals(w)) is None else t.to_dict(),
        # n (samples), mean, p50, p90, p99 in ms; a percentile is None where n is too small
        # for it (orchestrator.reports.measures.min_samples).
        "latency_ms": {key: stat(w, key).to_dict() for _, key, _ in LATENCIES},
        "chunking": chunking(w),
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
        "provenance": m.provenance,
        "corrections": [c.model_dump(exclude_none=True) for c in run.corrections],
        # What every figure below measured: each workload by its one name.
        "workloads": [w.to_dict() for w in workload_defs(run)],
        "cases_total": len(m.cases),
        "cases_finished": len(rows),
        "cases_failed": sum(not r.passed for r in rows),
        # The latest attempt's figures when it was interrupted (what, the case cut short,
        # the command that continues it); None for a run that was not.
        "interrupted": run.interrupted,
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
        "profile_pairs": [p.to_dict() for p in profile_pairs(rows, run.variants, run.root)],
        "ab": ab_json(run),
        "audit_summary": audit_sentence(run.results),
    }
