"""Running the `orchestrator` console script as a user would, shared by the e2e tests."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def user_environ() -> dict[str, str]:
    """The environment a user's shell would hand the orchestrator: this test process's, less
    TRITON_INTERPRET, which tests/conftest.py sets for fusedq's kernels on CPU and which
    every local server would otherwise inherit (a matrix sets it where a case wants it)."""
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


def run_cli(
    *args: str, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`orchestrator ARGS...` from the repository root, output captured, unbuffered."""
    return subprocess.run(
        [str(VENV_BIN / "orchestrator"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env={**user_environ(), "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def marked_processes(var: str, mark: str) -> dict[int, dict[str, str]]:
    """Processes whose environment has ``var=mark`` (a test's own, on a machine where other
    jobs start and stop servers too): pid -> their ORCHESTRATOR_* variables and cmdline."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            raw = (entry / "environ").read_bytes()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        items = dict(i.split(b"=", 1) for i in raw.split(b"\0") if b"=" in i)
        if items.get(var.encode()) == mark.encode():
            env = {k.decode(): v.decode() for k, v in items.items() if k.startswith(b"ORCH")}
            found[int(entry.name)] = {**env, "cmdline": cmd}
    return found


def wait_for(
    predicate,
    timeout: float,
    what: str,
    proc: subprocess.Popen | None = None,
    interval: float = 0.1,
):
    """Poll ``predicate`` every ``interval`` seconds until it returns something truthy; fail
    naming ``what`` on timeout or when ``proc`` (the orchestrator) exits first."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"orchestrator exited ({proc.returncode}) before {what}")
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
