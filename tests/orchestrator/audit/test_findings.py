"""The audit's records (orchestrator.audit.findings) are the one declaration: what a case's
audit.json and results.jsonl row hold reads back as them (orchestrator.results.stored_audit)."""

from __future__ import annotations

import json

from audit_cases import FIXTURES, FUSEDQ, run_audit, write_log

from orchestrator.audit import Expectation
from orchestrator.results.stored_audit import AuditSummary


def test_the_stored_audit_is_the_audits_own_record_read_back(tmp_path):
    """One declaration: every field the audit records is a field of its stored form (read
    typed, with its behaviour), and audit.json reads back and is written back unchanged."""
    stop = 'Traceback (most recent call last):\n  File "y.py", line 2, in run\n'
    stop += "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
    log = write_log(tmp_path, (FIXTURES / "vllm_tp4_crash.log").read_text() + stop)
    result = run_audit(
        log,
        stopped_at={str(log): len(log.read_text().splitlines()) - 2},
        expectations=[Expectation(FUSEDQ, ["TP0", "TP1", "TP2", "TP3"], "fused-query warmup")],
    )
    assert result.discounted and result.case_breaking and result.searched.expectations
    written = json.dumps(result.to_dict())
    stored = AuditSummary.model_validate(json.loads(written))
    assert json.dumps(stored.model_dump(mode="json", exclude_unset=True)) == written
    # Kept as written without a field of their own: only what to_dict derives.
    assert set(stored.model_extra) == {"summary"}
    assert set(stored.verdict.model_extra) == {"text"}
    assert set(stored.searched.model_extra) == {"lines"}
    parts = [*stored.findings, *stored.discounted, stored.searched.kernel_log]
    parts += [*stored.searched.files, *stored.searched.expectations]
    assert not any(p.model_extra for p in parts)
    assert stored.root_cause.location() == result.root_cause.location()
    assert [f.location() for f in stored.case_breaking] == [
        f.location() for f in result.case_breaking
    ]
    assert stored.searched.lines == result.searched.lines
    assert str(stored.verdict) == str(result.verdict) and not stored.clean
