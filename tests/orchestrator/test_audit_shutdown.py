"""Findings caused by the orchestrator's own stop are discounted, and only those.

vLLM 0.32 logs an EngineDeadError traceback whenever SIGTERM aborts its engine (the
fixture is a real CPU server's log tail); a fault of the same kind before the stop, or a
hardware fault after it, still counts.
"""

from __future__ import annotations

from pathlib import Path

from orchestrator.audit import audit_logs

FIXTURE = Path(__file__).parent / "fixtures" / "audit" / "vllm_sigterm_shutdown.log"


def _audit(path: Path, stop_line: int | None):
    return audit_logs(
        [path],
        include_kernel_log=False,
        include_gpu_state=False,
        stopped_at={str(path): stop_line} if stop_line else None,
    )


def test_shutdown_traceback_is_a_finding_without_stop_information():
    r = _audit(FIXTURE, None)
    assert {f.signature for f in r.findings} == {"python-traceback", "vllm-engine-dead"}


def test_shutdown_traceback_after_the_stop_is_discounted():
    r = _audit(FIXTURE, 1)
    assert r.verdict.clean
    assert {f.signature for f in r.discounted} == {"python-traceback", "vllm-engine-dead"}
    assert r.to_dict()["discounted"]


def test_faults_before_the_stop_and_hardware_faults_after_it_still_count(tmp_path):
    log = tmp_path / "server.log"
    xid = "NVRM: Xid (PCI:0000:1b:00): 79, pid=1, GPU has fallen off the bus.\n"
    log.write_text(FIXTURE.read_text() + xid)
    r = _audit(log, 1)
    assert [f.signature for f in r.findings] == ["xid"]
    last = len(FIXTURE.read_text().splitlines())
    r = _audit(log, last + 1)  # stop began after the traceback: it counts
    assert {"python-traceback", "vllm-engine-dead", "xid"} <= {f.signature for f in r.findings}
