"""Live progress: the plain line format for logs, its throttle, the server-log line it quotes,
and the terminal block; all on a fake clock, nothing launched."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
from rich.console import Console

from orchestrator.engines import engine_for
from orchestrator.execution.progress import (
    PLAIN_EVERY_S,
    PLAIN_MAX_EVERY_S,
    ProgressView,
    last_log_line,
)
from orchestrator.results.rows import CaseResult

VLLM = engine_for("vllm")

CASES = ["tiny-mla/tp1-dcp1-mtp0/default", "tiny-mla/tp2-dcp1-mtp0/default"]
SERVER_LOG = (
    "INFO 11-30 10:00:00 [api_server.py:1] vLLM API server version 0.32.0\n"
    "(EngineCore_DP0 pid=42) INFO 11-30 10:00:05 [default_loader.py:267] "
    "Loading weights took 0.51 seconds\n"
    "(EngineCore_DP0 pid=42) WARNING 11-30 10:00:06 [cpu.py:9] \x1b[33mno AMX\x1b[0m, "
    "HF_TOKEN=hf_abcdefghijklmnopqrstuvwxyz serving sekrit\n"
    "\n"
)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _view(clock: Clock, out: io.StringIO, **kw) -> ProgressView:
    v = ProgressView(len(CASES), engine=VLLM, stream=out, tty=False, clock=clock, **kw)
    v.expect(CASES, {CASES[0]: 100.0, CASES[1]: 200.0}, done=0)
    return v


def test_last_log_line_strips_vllm_prefix_ansi_and_secrets(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    assert last_log_line(log, VLLM) is None  # not written yet
    log.write_text(SERVER_LOG)
    line = last_log_line(log, VLLM, secrets=("sekrit",))
    assert line == "WARNING no AMX, HF_TOKEN=*** serving ***"
    log.write_text(SERVER_LOG.splitlines()[1] + "\n")
    assert last_log_line(log, VLLM) == "Loading weights took 0.51 seconds"  # INFO loses its level
    # A tqdm bar redraws with carriage returns: the last drawing is the line.
    log.write_text("Loading shards:   0% 0/4\rLoading shards:  50% 2/4\r" + "x" * 300 + "\n")
    line = last_log_line(log, VLLM)
    assert line is not None and len(line) == 120 and line.endswith("…")


def test_plain_lines_name_case_phase_elapsed_counts_and_eta(tmp_path: Path) -> None:
    clock, out = Clock(), io.StringIO()
    log = tmp_path / "server.log"
    log.write_text(SERVER_LOG)
    v = _view(clock, out, secrets=("sekrit",))
    v.start()
    v.stop()  # no ticker thread: the test drives tick() on its own clock
    v.begin(CASES[0])
    clock.t += 2
    v.update(CASES[0], "starting", server_log=log)
    clock.t += 30
    v.tick()
    clock.t += 40
    v.update(CASES[0], "ctx0")
    clock.t += 11
    v.update(CASES[0], "ctx0", {"repeat": 1, "repeats": 2, "done": 3, "total": 8,
                                "errors": 1, "elapsed_s": 11.0, "tok_s": 57.25})  # fmt: skip
    v.tick()
    clock.t += 2
    v.update(CASES[0], "ctx0", {"repeat": 2, "repeats": 2, "done": 8, "total": 8,
                                "errors": 1, "elapsed_s": 9.0, "tok_s": 60.0})  # fmt: skip
    v.update(CASES[0], "stopping")
    clock.t += 15
    v.finish(
        CASES[0],
        CaseResult(
            case_id=CASES[0],
            status="passed",
            workloads={"ctx0": {"mean": {"aggregate_tok_s": 60.5}}},
        ),
    )
    v.begin(CASES[1])
    clock.t += 5
    # A reason's later lines (what happened, the log's tail) wait for the end of the run.
    reason = "ValueError: boom (root cause, server.log:7)\nserver process exited with code 1"
    v.finish(CASES[1], CaseResult(case_id=CASES[1], status="failed", reason=reason))
    lines = out.getvalue().splitlines()
    assert lines == [
        f"case 1/2 {CASES[0]}: placing",
        f"[0/2 done | run 2 s | ETA 4m58s] {CASES[0]}: starting, 0 s (case 2 s)"
        " | server: WARNING no AMX, HF_TOKEN=*** serving ***",
        f"[0/2 done | run 32 s | ETA 4m28s] {CASES[0]}: starting, 30 s (case 32 s)"
        " | server: WARNING no AMX, HF_TOKEN=*** serving ***",
        f"[0/2 done | run 1m12s | ETA 3m48s] {CASES[0]}: ctx0, 0 s (case 1m12s)",
        f"[0/2 done | run 1m23s | ETA 3m37s] {CASES[0]}: ctx0 repeat 1/2, 3/8 requests, "
        "1 error, 57.2 tok/s, 11 s (case 1m23s)",
        # A workload's last state is written when the next phase begins.
        f"[0/2 done | run 1m25s | ETA 3m35s] {CASES[0]}: ctx0 repeat 2/2, 8/8 requests, "
        "1 error, 60.0 tok/s, 13 s (case 1m25s)",
        f"[0/2 done | run 1m25s | ETA 3m35s] {CASES[0]}: stopping, 0 s (case 1m25s)",
        # The first case took 100 s against 100 estimated: the rest keeps its estimate.
        f"PASSED {CASES[0]} in 1m40s: ctx0 60.50 tok/s | 1/2 done | run 1m40s | ETA 3m20s",
        f"case 2/2 {CASES[1]}: placing",
        f"FAILED {CASES[1]} in 5 s (ValueError: boom (root cause, server.log:7)) "
        "| 2/2 done, 1 failed | run 1m45s",
    ]
    # Logs, not terminals: no control code reaches them.
    assert not re.search(r"[\x00-\x08\x0b-\x1f\x7f]", out.getvalue())


def test_plain_lines_are_throttled_per_phase() -> None:
    clock, out = Clock(), io.StringIO()
    v = _view(clock, out)
    v.begin(CASES[0])
    v.update(CASES[0], "ctx0")
    for _ in range(600):  # ten minutes of one workload reporting every second
        clock.t += 1
        v.update(CASES[0], "ctx0", {"done": 1, "total": 2, "tok_s": 1.0})
        v.tick()
    progress = out.getvalue().splitlines()[2:]
    assert PLAIN_EVERY_S == 10 and PLAIN_MAX_EVERY_S == 60
    # Every 10 s for the first minute, then a sixth of the phase's age: 19 lines, not 600.
    assert len(progress) == 19, progress
    v.update(CASES[0], "ctx1k")  # a new phase is an event, and the throttle starts over
    clock.t += 10
    v.tick()
    assert out.getvalue().splitlines()[-2:][1].endswith("ctx1k, 10 s (case 10m10s)")


def test_quiet_view_writes_nothing() -> None:
    clock, out = Clock(), io.StringIO()
    v = _view(clock, out, enabled=False)
    v.start()
    v.begin(CASES[0])
    clock.t += 60
    v.tick()
    v.finish(CASES[0], CaseResult(case_id=CASES[0], status="passed"))
    v.stop()
    assert out.getvalue() == ""


def test_eta_scales_with_measured_cases() -> None:
    clock, out = Clock(), io.StringIO()
    v = _view(clock, out)
    v.begin(CASES[0])
    clock.t += 150  # 1.5x its estimate: the second case's 200 s become 300 s
    v.finish(CASES[0], CaseResult(case_id=CASES[0], status="passed"))
    assert "ETA 5m00s" in out.getvalue().splitlines()[-1]
    v.begin(CASES[1])
    clock.t += 400  # past its scaled estimate: nothing left, never negative
    assert "ETA 0 s" in v.status_line()


@pytest.mark.parametrize("phase", ["starting", "ctx0"])
def test_terminal_block(tmp_path: Path, phase: str) -> None:
    clock = Clock()
    log = tmp_path / "server.log"
    log.write_text(SERVER_LOG)
    v = _view(clock, io.StringIO(), secrets=("sekrit",))
    v.begin(CASES[0])
    clock.t += 3
    v.update(CASES[0], phase, server_log=log)
    clock.t += 4
    console = Console(record=True, width=200, force_terminal=True)
    console.print(v)
    text = console.export_text().splitlines()
    assert text[0] == "0/2 done | run 7 s | ETA 4m53s"
    assert text[1] == f"{CASES[0]}: {phase}, 4 s (case 7 s)"
    # The server's last line is shown while it starts, and only then.
    assert text[2:] == (
        ["server: WARNING no AMX, HF_TOKEN=*** serving ***"] if phase == "starting" else []
    )


def test_terminal_mode_prints_case_lines_above_the_live_block() -> None:
    """With a terminal, rich's Live runs for real (a thread redrawing into the stream)."""
    out = io.StringIO()
    v = ProgressView(len(CASES), engine=VLLM, stream=out, tty=True)
    v.expect(CASES, {c: 60.0 for c in CASES}, done=0)
    v.start()
    try:
        v.begin(CASES[0])
        v.update(CASES[0], "ctx0", {"done": 1, "total": 2, "tok_s": 3.5})
        v.finish(CASES[0], CaseResult(case_id=CASES[0], status="passed"))
    finally:
        v.stop()
    text = out.getvalue()
    assert f"case 1/2 {CASES[0]}: placing" in text
    assert f"PASSED {CASES[0]} in 0 s | 1/2 done" in text
    assert "\x1b[" in text  # it drew in place: control codes belong to terminals only
