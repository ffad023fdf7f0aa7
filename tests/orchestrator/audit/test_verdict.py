"""The verdict of one scope (orchestrator.audit.verdict): what its record holds, and what the
orchestrator's own stop discounts, and only that.

vLLM 0.32 logs an EngineDeadError traceback whenever SIGTERM aborts its engine (the
fixture is a real CPU server's log tail); a fault of the same kind before the stop, or a
hardware fault after it, still counts.
"""

from __future__ import annotations

import json
from pathlib import Path

from audit_cases import FIXTURES, run_audit


def test_to_dict_is_json_and_carries_verdict_summary_and_coverage():
    result = run_audit(FIXTURES / "vllm_tp4_crash.log")
    d = json.loads(json.dumps(result.to_dict()))
    assert d["verdict"]["status"] == "findings" and d["verdict"]["worst_severity"] == "fatal"
    assert d["searched"]["lines"] == 21 and d["searched"]["catalogue_version"] >= 1
    assert d["summary"] == result.summary_sentence()
    assert {
        "file",
        "line",
        "rank",
        "signature",
        "severity",
        "category",
        "text",
        "context_before",
        "context_after",
    } <= set(d["findings"][0])


SHUTDOWN_LOG = FIXTURES / "vllm_sigterm_shutdown.log"


def _stopped(path: Path, stop_line: int | None):
    return run_audit(path, stopped_at={str(path): stop_line} if stop_line else None)


def test_shutdown_traceback_is_a_finding_without_stop_information():
    r = _stopped(SHUTDOWN_LOG, None)
    assert {f.signature for f in r.findings} == {"python-traceback", "vllm-engine-dead"}


def test_shutdown_traceback_after_the_stop_is_discounted():
    r = _stopped(SHUTDOWN_LOG, 1)
    assert r.verdict.clean
    assert {f.signature for f in r.discounted} == {"python-traceback", "vllm-engine-dead"}
    assert r.to_dict()["discounted"]


def test_faults_before_the_stop_and_hardware_faults_after_it_still_count(tmp_path):
    log = tmp_path / "server.log"
    xid = "NVRM: Xid (PCI:0000:1b:00): 79, pid=1, GPU has fallen off the bus.\n"
    log.write_text(SHUTDOWN_LOG.read_text() + xid)
    r = _stopped(log, 1)
    assert [f.signature for f in r.findings] == ["xid"]
    last = len(SHUTDOWN_LOG.read_text().splitlines())
    r = _stopped(log, last + 1)  # stop began after the traceback: it counts
    assert {"python-traceback", "vllm-engine-dead", "xid"} <= {f.signature for f in r.findings}
