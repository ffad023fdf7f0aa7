"""SIGTERM (a job scheduler's stop) unwinds a run like Ctrl-C: the server stopped, finished
results kept, reports written, exit 130. Real local Ray; the server is a stand-in that never
becomes ready (what is tested is the orchestrator's signal path, not vLLM), so no vLLM starts.

Found on the H200 (2026-11-30): ray.init() replaced the orchestrator's SIGTERM handler, and a
SIGTERM killed the driver outright -- no report, servers left to the machine's cleanup.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from orch_cli import REPO, VENV_BIN, marked_processes, user_environ

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MARK = uuid.uuid4().hex
STAND_IN = f"""#!{sys.executable}
# Stand-in `vllm serve`: logs, then waits to be stopped (never ready).
import sys, time
print("stand-in server up", flush=True)
time.sleep(600)
"""
MATRIX = """
name: sigterm
models: [{{label: m, path: /, num_heads: 8}}]
engine: {{vllm_bin: {bin}}}
resources: {{accelerator: cpu, cpus_per_rank: 1}}
topologies: [{{tp: 1, mtp: [0]}}]
workloads: [{{name: ctx0, prompt_tokens: 1, output_tokens: 4, requests: 1}}]
audit: {{kernel_log: false}}
timeouts: {{placement_s: 120, ready_s: 300}}
"""


def _alive_with_mark() -> list[int]:
    return list(marked_processes("SIGTERM_TEST_MARK", MARK))


def test_sigterm_stops_the_server_and_writes_the_reports(tmp_path: Path) -> None:
    stand_in = tmp_path / "vllm"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    matrix = tmp_path / "m.yaml"
    matrix.write_text(MATRIX.format(bin=stand_in))
    env = {**user_environ(), "PYTHONUNBUFFERED": "1", "SIGTERM_TEST_MARK": MARK}
    proc = subprocess.Popen(
        [str(VENV_BIN / "orchestrator"), "run", str(matrix), "--logs-dir", str(tmp_path / "logs"),
         "--run-id", "t", "--quiet"],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    log = tmp_path / "logs" / "t" / "orchestrator.log"
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and proc.poll() is None:
        if log.exists() and "starting on" in log.read_text():
            break
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    server_log = next((tmp_path / "logs" / "t" / "cases").glob("*/server.log"))
    while "stand-in server up" not in server_log.read_text() and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, out[-3000:]
    assert "interrupted" in out and "*** SIGTERM received" not in out, out[-3000:]
    assert "interrupted (SIGTERM): servers stopped" in log.read_text()
    # Where the run is and how to continue it, on the terminal.
    assert "orchestrator: interrupted (SIGTERM): run t keeps 0 of 1 cases in" in out
    assert "orchestrator: continue with: orchestrator run " in out and "--resume t" in out
    assert (tmp_path / "logs" / "t" / "report.md").is_file()
    for _ in range(40):  # the stand-in is stopped by the orchestrator, not left to anyone
        if not _alive_with_mark():
            break
        time.sleep(0.25)
    assert not _alive_with_mark()
