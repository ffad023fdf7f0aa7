"""Start-up hygiene: real processes marked as a run's, found when their orchestrator is gone,
left alone while it runs, and stopped (even when stopped or deaf to SIGTERM) when asked."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from orchestrator.cluster import leftovers as lo
from orchestrator.execution.leftover_check import LeftoverError, handle_leftovers
from orchestrator.execution.runner import RunOptions, run_matrix
from orchestrator.results.store import RunStore

# A driver tag naming this (live) process with a start time it never had: what a recycled
# pid of a dead orchestrator looks like, and dead for certain.
DEAD_DRIVER = f"{socket.gethostname()}:{os.getpid()}:0"
# Deaf to SIGTERM, so stopping it needs the SIGKILL step.
DEAF = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(300)"


@pytest.fixture
def spawn() -> Iterator:
    procs: list[subprocess.Popen] = []

    def start(run_id: str, driver: str, case: str | None = "m/tp1/v", code: str = "") -> int:
        env = {**os.environ, lo.RUN_ENV: run_id, lo.DRIVER_ENV: driver}
        if case:
            env[lo.CASE_ENV] = case
        p = subprocess.Popen(
            [sys.executable, "-c", code or "import time; time.sleep(300)"], env=env
        )
        procs.append(p)
        # Ready once its environment is readable (exec done).
        end = time.monotonic() + 10
        while time.monotonic() < end and lo._environ(p.pid, lo.PROC) in (None, {}):
            time.sleep(0.01)
        return p.pid

    yield start
    for p in procs:
        p.kill()
        p.wait()


def _by_pid(found: list[lo.Leftover]) -> dict[int, lo.Leftover]:
    return {p.pid: p for p in found}


def test_dead_drivers_processes_are_leftovers_live_and_foreign_ones_are_not(spawn) -> None:
    dead = spawn("r1", DEAD_DRIVER, case="m/tp1/a")
    live = spawn("r2", lo.driver_tag())
    foreign = spawn("r3", f"another-host.invalid:{os.getpid()}:0")
    found = _by_pid(lo.find_leftovers())
    assert dead in found and live not in found and foreign not in found
    p = found[dead]
    assert (p.run_id, p.case, p.driver) == ("r1", "m/tp1/a", DEAD_DRIVER)
    assert "time.sleep(300)" in p.cmdline
    assert p.describe().startswith(f"pid {dead} [run r1, case m/tp1/a] ")


def test_driver_tag_names_this_process() -> None:
    assert lo.driver_alive(lo.driver_tag()) is True
    assert lo.driver_alive(DEAD_DRIVER) is False
    assert lo.driver_alive("another-host.invalid:1:1") is None
    assert lo.run_env("r", "c") == {
        lo.RUN_ENV: "r",
        lo.DRIVER_ENV: lo.driver_tag(),
        lo.CASE_ENV: "c",
    }


def test_stop_leftovers_handles_stopped_and_sigterm_deaf_processes(spawn) -> None:
    stopped = spawn("r1", DEAD_DRIVER)
    os.kill(stopped, 19)  # SIGSTOP: a hung server
    deaf = spawn("r1", DEAD_DRIVER, code=DEAF)
    time.sleep(0.3)  # the handler is installed
    mine = [p for p in lo.find_leftovers() if p.pid in (stopped, deaf)]
    t0 = time.monotonic()
    assert lo.stop_leftovers(mine, grace_s=1.0) == []
    assert time.monotonic() - t0 < 8
    assert not {stopped, deaf} & set(_by_pid(lo.find_leftovers()))


def test_stop_leftovers_spares_a_recycled_pid(spawn) -> None:
    pid = spawn("r1", lo.driver_tag())  # a live run's process under a dead run's pid record
    ghost = lo.Leftover(pid=pid, run_id="r1", case=None, driver=DEAD_DRIVER, cmdline="x")
    assert lo.stop_leftovers([ghost], grace_s=0.2) == []
    os.kill(pid, 0)  # still running


def test_resume_refuses_while_its_own_leftovers_run_and_others_are_reported(spawn, capsys) -> None:
    pid = spawn("run-a", DEAD_DRIVER)
    logged: list[str] = []
    with pytest.raises(LeftoverError, match=f"pid {pid} ") as info:
        handle_leftovers("run-a", resuming=True, kill=False, log=logged.append)
    assert "--kill-leftovers" in str(info.value)
    # Another run's leftovers are reported, and that run goes on.
    found = handle_leftovers("run-b", resuming=True, kill=False, log=logged.append)
    assert pid in _by_pid(found)
    assert f"pid {pid} [run run-a" in capsys.readouterr().err
    assert any("crashed runs are still running" in m for m in logged)
    # (--kill-leftovers is exercised by test_faults.py: here it would stop every leftover on
    # this shared machine, not only this test's.)


def test_run_matrix_refuses_before_launching_anything(spawn, tmp_path: Path) -> None:
    """A resume of a run whose server was left over exits as bad input, with no Ray started
    and the run directory unlocked for the retry."""
    matrix = tmp_path / "m.yaml"
    matrix.write_text(
        "name: m\nmodels: [{label: x, path: /nonexistent, num_heads: 8}]\n"
        "resources: {accelerator: cpu}\ntopologies: [{tp: 1}]\n"
        "workloads: [{name: w, prompt_tokens: 1, output_tokens: 1}]\n"
    )
    from orchestrator.config.expand import expand
    from orchestrator.config.load import load_matrix

    store = RunStore.create(tmp_path, "run-x")
    store.write_manifest({"cases": [c.to_dict() for c in expand(load_matrix(matrix))]})
    pid = spawn("run-x", DEAD_DRIVER)
    t0 = time.monotonic()
    with pytest.raises(LeftoverError, match=f"pid {pid} "):
        run_matrix(matrix, RunOptions(logs_dir=tmp_path, resume="run-x", progress=False))
    assert time.monotonic() - t0 < 5  # no Ray was started
    assert not _ray_initialized()
    store.lock()  # free again
    store.unlock()


def _ray_initialized() -> bool:
    ray = sys.modules.get("ray")
    return bool(ray and ray.is_initialized())


def test_staging_directories_of_dead_orchestrators_are_removed(tmp_path: Path) -> None:
    """A SIGKILLed orchestrator skips Launcher.__exit__; the next run removes its py_modules
    staging directory, and never a live one's."""
    from orchestrator.cluster.ship import remove_stale_stages

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"orch-ship-{dead.pid}-abc"
    live = tmp_path / f"orch-ship-{os.getpid()}-def"
    other = tmp_path / "orch-ship-notapid-x"
    for d in (stale, live, other):
        (d / "fusedq-1.0.dist-info").mkdir(parents=True)
    remove_stale_stages(tmp_path)
    assert not stale.exists() and live.exists() and other.exists()
