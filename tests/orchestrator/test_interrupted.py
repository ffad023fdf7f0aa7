"""An interrupted run (Ctrl-C, SIGTERM) says where it is and how to continue it.

It prints its run id, its directory and the exact `--resume` command; every report says
"interrupted"; the overhead figures cover its finished cases only; the case it cut short
is marked in its folder instead of being a folder without a row. The end-to-end tests run
real CPU `vllm serve` (tiny model) through a real local Ray, and one with a stand-in
server that never becomes ready (the interrupt lands during start-up, before any case
finished).
"""

from __future__ import annotations

import json
import shlex
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from orch_cli import REPO, VENV_BIN, user_environ

from orchestrator.execution.interrupted import RunInterrupted, how, resume_command
from orchestrator.reports.markdown import overhead_sentence

# --------------------------------------------------------------------------- pure parts


def test_the_resume_command_repeats_what_selects_and_shapes_the_cases() -> None:
    cmd = resume_command(
        "matrices/smoke.yaml",
        "smoke-1",
        logs_dir=Path("/tmp/my logs"),
        sets=["workloads[0].output_tokens=16"],
        only=["tp1"],
        quiet=True,
    )
    assert shlex.split(cmd) == [
        "orchestrator", "run", "matrices/smoke.yaml", "--resume", "smoke-1",
        "--logs-dir", "/tmp/my logs", "--set", "workloads[0].output_tokens=16",
        "--only", "tp1", "--quiet",
    ]  # fmt: skip
    # The default logs directory is left out: what a user typed, not more.
    assert (
        resume_command("m.yaml", "r", logs_dir=Path("logs")) == "orchestrator run m.yaml --resume r"
    )


def test_what_interrupted_is_named() -> None:
    assert how(KeyboardInterrupt()) == "Ctrl-C"
    assert how(KeyboardInterrupt("SIGTERM")) == "SIGTERM"
    exc = RunInterrupted("SIGTERM", "r", Path("/l/r"), "orchestrator run m --resume r", 1, 4)
    assert exc.lines() == [
        "interrupted (SIGTERM): run r keeps 1 of 4 cases in /l/r",
        "continue with: orchestrator run m --resume r",
    ]
    assert isinstance(exc, KeyboardInterrupt)


def test_the_overhead_of_an_interrupted_attempt_says_what_it_covers() -> None:
    figures = {
        "wall_s": 100.0, "startup_and_measured_s": 80.0, "overhead_s": 20.0,
        "overhead_pct": 20.0, "cases_run": 1, "interrupted": "SIGTERM",
        "cut_short": {"case_id": "m/tp1-dcp1-mtp0/b", "phase": "starting", "s": 41.5},
    }  # fmt: skip
    assert overhead_sentence(figures) == (
        "Interrupted (SIGTERM); the 41.5 s of the case it cut short are left out. Up to its "
        "last finished case: wall 100.0 s, of which server start-up and measured workloads "
        "80.0 s; overhead 20.0 s (20.0%)."
    )
    assert "before any case finished" in overhead_sentence(
        {"cases_run": 0, "interrupted": "Ctrl-C"}
    )


def test_a_case_measured_but_not_recordable_stops_the_run_and_says_how_to_continue(
    tmp_path: Path,
) -> None:
    # Once (an H200, MTP 1, switch mode) the mean of the repeats' chunk counts was 152.5,
    # which a row's integer n refused after the case had run: the CLI printed pydantic's
    # text as bad input (exit 2), and the report said "Interrupted (?)".
    from pydantic import ValidationError

    from orchestrator.config.expand import expand
    from orchestrator.config.load import load_matrix
    from orchestrator.execution.runner import RunOptions, _Attempt
    from orchestrator.results.rows import Distribution
    from orchestrator.results.store import RunStore

    matrix = load_matrix(REPO / "matrices" / "smoke.yaml")
    cases = expand(matrix)
    store = RunStore.create(tmp_path, "r1")
    options = RunOptions(logs_dir=tmp_path, run_id="r1")
    attempt = _Attempt(
        "matrices/smoke.yaml", matrix, cases, cases, options, store, time.monotonic()
    )
    with pytest.raises(ValidationError) as bad:
        Distribution.model_validate({"n": 152.5})
    unit = cases[:2]
    message = str(attempt._aborted(unit, bad.value))
    assert message.startswith(f"{unit[0].case_id}: measured, but its result row is invalid")
    assert "n: Input should be a valid integer" in message and "152.5" in message
    assert str(store.case_dir(unit[1].slug)) in message
    assert message.endswith(
        f"continue with: orchestrator run matrices/smoke.yaml --resume r1 --logs-dir {tmp_path}"
    )
    for case in unit:  # each folder says why it has no row
        mark = json.loads((store.case_dir(case.slug) / "interrupted.json").read_text())
        assert mark["phase"] == "recording" and "152.5" in mark["error"]
    figures = attempt._overhead(0)
    assert figures["aborted"]["case_id"] == unit[0].case_id
    assert overhead_sentence(figures) == (
        f"Stopped by an orchestrator error recording {unit[0].case_id} before any case "
        "finished: no figures."
    )
    assert overhead_sentence({"cases_run": 0}) == "No case finished."


# --------------------------------------------------------------------------- end to end


MATRIX = """
name: interrupt
models: [{{label: tiny, path: "builtin:tiny-mla", num_heads: 8}}]
engine:
  args: [--enforce-eager, --attention-backend=CPU_MLA, --max-model-len=1024, --max-num-seqs=2]
  env: {{VLLM_CPU_KVCACHE_SPACE: "1"}}
  {engine_extra}
resources: {{accelerator: cpu, cpus_per_rank: 1}}
topologies: [{{tp: 1}}]
workloads: [{{name: ctx0, prompt_tokens: 1, output_tokens: 4, requests: 1}}]
variants: [{{name: first}}, {{name: second}}]
warmup_requests: 0
audit: {{kernel_log: false}}
timeouts: {{placement_s: 300, ready_s: 600, request_s: 120, case_s: 900}}
"""
STAND_IN = f"""#!{sys.executable}
# Stand-in `vllm serve`: logs, then waits to be stopped (never ready).
import time
print("stand-in server up", flush=True)
time.sleep(600)
"""


def _default_sigint() -> None:
    # A process started in the background of a script inherits SIGINT ignored, and Python
    # then installs no Ctrl-C handler: the orchestrator starts as from a terminal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start(matrix: Path, logs: Path, run_id: str) -> subprocess.Popen:
    return subprocess.Popen(
        [str(VENV_BIN / "orchestrator"), "run", str(matrix), "--logs-dir", str(logs),
         "--run-id", run_id, "--quiet"],
        cwd=REPO, env={**user_environ(), "PYTHONUNBUFFERED": "1"}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, preexec_fn=_default_sigint,
    )  # fmt: skip


def _wait_for_log(proc: subprocess.Popen, log: Path, needle: str, timeout: float) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise AssertionError(f"orchestrator exited {proc.returncode}: {proc.communicate()}")
        if log.exists() and needle in log.read_text():
            return
        time.sleep(0.3)
    raise AssertionError(f"no {needle!r} in {log} after {timeout:.0f} s")


@pytest.mark.slow
@pytest.mark.e2e
def test_ctrl_c_before_any_case_finished(tmp_path: Path) -> None:
    """Ctrl-C while the first server starts: the message names the run and its resume
    command, the case is marked in its folder, the reports say interrupted, and there is
    no overhead figure (no case finished)."""
    stand_in = tmp_path / "vllm"
    stand_in.write_text(STAND_IN)
    stand_in.chmod(0o755)
    matrix = tmp_path / "m.yaml"
    matrix.write_text(MATRIX.format(engine_extra=f"vllm_bin: {stand_in}"))
    logs = tmp_path / "logs"
    proc = _start(matrix, logs, "cc")
    run = logs / "cc"
    _wait_for_log(proc, run / "orchestrator.log", "starting on", 300)
    server_log = run / "cases" / "tiny__tp1-dcp1-mtp0__first" / "server.log"
    while "stand-in server up" not in server_log.read_text():
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    try:
        out, err = proc.communicate(timeout=120)
    except subprocess.TimeoutExpired:
        proc.terminate()  # leave no run behind: SIGTERM unwinds it
        proc.communicate(timeout=120)
        raise
    assert proc.returncode == 130, err[-3000:]
    assert f"orchestrator: interrupted (Ctrl-C): run cc keeps 0 of 2 cases in {run}" in err
    assert (
        f"orchestrator: continue with: orchestrator run {matrix} --resume cc --logs-dir {logs} --quiet"
        in err
    )
    assert "Token authentication" not in err
    assert "0/2 cases finished (interrupted by Ctrl-C)" in " ".join(out.split())
    mark = json.loads((server_log.parent / "interrupted.json").read_text())
    assert mark["case_id"] == "tiny/tp1-dcp1-mtp0/first" and mark["phase"] == "starting"
    figures = json.loads((run / "overhead.json").read_text())["run"]
    assert figures["cases_run"] == 0 and "wall_s" not in figures
    md = (run / "report.md").read_text()
    assert (
        "**Interrupted (Ctrl-C) during tiny/tp1-dcp1-mtp0/first (starting); it has no result.**"
        in md
    )
    assert "before any case finished: no figures" in md
    assert not (run / ".lock").exists()


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(1500)
def test_sigterm_after_a_finished_case_then_the_printed_resume(tmp_path: Path) -> None:
    """Real CPU vLLM: the first case finishes, SIGTERM lands while the second starts. Every
    report says interrupted, the overhead covers the finished case only; then the command
    the run printed, run as printed, finishes it and the run reads as whole again."""
    matrix = tmp_path / "m.yaml"
    matrix.write_text(MATRIX.format(engine_extra=""))
    logs = tmp_path / "logs"
    proc = _start(matrix, logs, "st")
    run = logs / "st"
    _wait_for_log(proc, run / "orchestrator.log", "tiny/tp1-dcp1-mtp0/second: starting on", 900)
    time.sleep(3)
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err[-3000:]
    assert f"orchestrator: interrupted (SIGTERM): run st keeps 1 of 2 cases in {run}" in err
    (resume,) = [
        ln.split("continue with: ", 1)[1] for ln in err.splitlines() if "continue with: " in ln
    ]
    assert resume == f"orchestrator run {matrix} --resume st --logs-dir {logs} --quiet"
    # Every format says it.
    md = (run / "report.md").read_text()
    assert (
        "**Interrupted (SIGTERM) during tiny/tp1-dcp1-mtp0/second (starting); it has no result.**"
        in md
    )
    data = json.loads((run / "report.json").read_text())
    assert data["interrupted"]["interrupted"] == "SIGTERM" and data["cases_finished"] == 1
    assert '<span class="pill warn">interrupted</span>' in (run / "report.html").read_text()
    suite = ET.parse(run / "junit.xml").getroot().find("testsuite")
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["interrupted"] == "SIGTERM"
    skipped = [s.get("message") for s in suite.iter("skipped")]
    assert skipped == ["not run: the run was interrupted (SIGTERM) during this case"]
    assert "1/2 cases finished (interrupted by SIGTERM)" in " ".join(out.split())
    # The overhead covers the finished case: its wall ends when that case's row was written.
    figures = json.loads((run / "overhead.json").read_text())["run"]
    row = json.loads((run / "results.jsonl").read_text())
    assert figures["cases_run"] == 1 and figures["cut_short"]["case_id"].endswith("/second")
    assert figures["startup_and_measured_s"] <= figures["wall_s"] <= row["timings"]["total_s"] + 60
    assert figures["overhead_pct"] < 50
    second = run / "cases" / "tiny__tp1-dcp1-mtp0__second"
    assert (second / "interrupted.json").is_file() and (second / "server.log").is_file()
    assert not (run / ".lock").exists()
    # The audit of the interrupted run: the finished case as the run judged it; the case cut
    # short (no verdict of the run's) with the stop line its interrupt recorded.
    audit = subprocess.run(
        [str(VENV_BIN / "orchestrator"), "audit", str(run), "--json"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    cases = {c["case_id"]: c for c in json.loads(audit.stdout)["cases"]}
    assert cases["tiny/tp1-dcp1-mtp0/first"]["agrees_with_run"] is True
    cut = cases["tiny/tp1-dcp1-mtp0/second"]
    assert cut["agrees_with_run"] is None
    assert cut["stop_basis"] == "recorded when the run was interrupted" and cut["stop_line"] > 0
    # The printed command, as printed (the orchestrator of this environment).
    argv = shlex.split(resume)
    again = subprocess.run(
        [str(VENV_BIN / argv[0]), *argv[1:]], cwd=REPO, capture_output=True, text=True,
        timeout=900,
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "2/2 cases finished, 2 passed" in " ".join(again.stdout.split())
    assert (second / "interrupted-attempt1.json").is_file()
    assert not (second / "interrupted.json").exists()
    assert "Interrupted" not in (run / "report.md").read_text().split("## Orchestrator overhead")[0]
    assert json.loads((run / "report.json").read_text())["interrupted"] is None
