"""Bad input to `orchestrator run` costs one line and exit 2, and nothing is launched.

Each case is a real CLI call. While it runs, /proc is watched for any process carrying this
test's mark in its environment (the orchestrator's children inherit it: a local Ray's
daemons, a server): only the orchestrator itself may be seen, and no run directory may
appear. The checks come in `orchestrator plan`'s order (orchestrator/execution/preflight.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
from orch_cli import user_environ

REPO = Path(__file__).resolve().parents[3]
ORCHESTRATOR = Path(sys.executable).with_name("orchestrator")
MARK_ENV = "INPUT_FIRST_TEST_MARK"
FIXTURE_RUN = REPO / "tests/orchestrator/fixtures/runs/cpu-noise-a1"

CPU_MATRIX = """
name: m
models: [{label: tiny, path: "builtin:tiny-mla", num_heads: 8}]
resources: {accelerator: cpu, cpus_per_rank: 1}
topologies: [{tp: 1}]
workloads: [{name: ctx0, prompt_tokens: 1, output_tokens: 4, requests: 1}]
"""


def _marked_children(mark: str, own: int) -> list[str]:
    """Command lines of processes other than `own` whose environment holds the mark, but for
    its GPU probe (`nvidia-smi -L`, which a GPU matrix's check of this machine runs), seen
    as itself or, between fork and exec, as a copy of `own` (its command line, an instant)."""
    try:
        own_cmd = _cmdline(Path("/proc") / str(own))
    except OSError:  # it has exited
        own_cmd = None
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == own:
            continue
        try:
            env = (entry / "environ").read_bytes()
            cmd = _cmdline(entry)
        except OSError:
            continue
        if f"{MARK_ENV}={mark}".encode() not in env.split(b"\0"):
            continue
        if cmd == own_cmd or Path(cmd.split(" ", 1)[0]).name == "nvidia-smi":
            continue
        found.append(cmd)
    return found


def _cmdline(proc: Path) -> str:
    return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")


def refused(*args: str, logs: Path) -> str:
    """Run `orchestrator run ARGS --logs-dir LOGS` and assert it was refused before anything
    started: exit 2, one line on stderr, no child process, no run directory. The line."""
    mark = uuid.uuid4().hex
    before = set(os.listdir(logs)) if logs.exists() else set()
    proc = subprocess.Popen(
        [str(ORCHESTRATOR), "run", *args, "--logs-dir", str(logs), "--quiet"],
        cwd=REPO, env={**user_environ(), MARK_ENV: mark}, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    seen: list[str] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            seen.extend(_marked_children(mark, proc.pid))
            done.wait(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        done.set()
        watcher.join()
    assert proc.returncode == 2, (out, err)
    assert out == "" and len(err.strip().splitlines()) == 1, err
    assert not seen, f"started: {sorted(set(seen))}"
    after = set(os.listdir(logs)) if logs.exists() else set()
    assert after == before, f"written: {sorted(after - before)}"
    return err.strip()


@pytest.fixture
def cpu_matrix(tmp_path: Path) -> Path:
    path = tmp_path / "m.yaml"
    path.write_text(CPU_MATRIX)
    return path


def test_an_existing_run_folder_is_refused_before_ray(tmp_path: Path, cpu_matrix: Path) -> None:
    logs = tmp_path / "logs"
    (logs / "taken").mkdir(parents=True)
    line = refused(str(cpu_matrix), "--run-id", "taken", logs=logs)
    assert line.endswith("taken exists already; pass --resume taken to continue it"), line


@pytest.mark.parametrize("bad", ["a b", "../up", ".."])
def test_an_invalid_run_id_is_refused(tmp_path: Path, cpu_matrix: Path, bad: str) -> None:
    line = refused(str(cpu_matrix), "--run-id", bad, logs=tmp_path / "logs")
    assert f"run id {bad!r} may hold only" in line, line


def test_a_matrix_needing_more_gpus_than_the_machine_names_the_file(tmp_path: Path) -> None:
    from orchestrator.execution.preflight import local_gpus

    have, _ = local_gpus()
    if have >= 8:
        pytest.skip("a machine with 8 GPUs: the shortage is for a smaller one")
    matrix = tmp_path / "eight.yaml"
    matrix.write_text(
        CPU_MATRIX.replace("accelerator: cpu, cpus_per_rank: 1", "accelerator: gpu")
        .replace("num_heads: 8", "num_heads: 64")
        .replace("tp: 1", "tp: 8")
    )
    line = refused(str(matrix), logs=tmp_path / "logs")
    assert line.startswith(f"orchestrator: {matrix}: topologies[0].tp=8 needs 8 GPUs"), line
    assert f"this machine has {have} " in line


def test_a_matrix_needing_more_cpus_than_the_machine(tmp_path: Path) -> None:
    matrix = tmp_path / "wide.yaml"
    cpus = (os.cpu_count() or 1) + 1
    matrix.write_text(CPU_MATRIX.replace("cpus_per_rank: 1", f"cpus_per_rank: {cpus}"))
    line = refused(str(matrix), logs=tmp_path / "logs")
    assert f"{matrix}: topologies[0].tp=1 needs {cpus} CPUs on one node" in line, line


def test_a_structural_error_comes_before_an_unset_variable(tmp_path: Path) -> None:
    """`plan`'s order: the matrix's structure (a DCP that does not divide TP), then the
    ${VAR}s it needs."""
    matrix = tmp_path / "dcp.yaml"
    matrix.write_text(
        CPU_MATRIX.replace("builtin:tiny-mla", "${INPUT_FIRST_UNSET_PATH}")
        .replace("accelerator: cpu, cpus_per_rank: 1", "accelerator: gpu")
        .replace("tp: 1", "tp: 2, dcp: [3]")
    )
    assert "INPUT_FIRST_UNSET_PATH" not in os.environ
    line = refused(str(matrix), logs=tmp_path / "logs")
    assert "topologies[0].dcp=3 does not divide tp=2" in line, line
    # The same matrix with a valid DCP: now the unset variable is what is wrong.
    matrix.write_text(matrix.read_text().replace("dcp: [3]", "dcp: [1]"))
    line = refused(str(matrix), logs=tmp_path / "logs")
    assert "${INPUT_FIRST_UNSET_PATH} is not set" in line, line


def test_an_unset_variable_in_a_typed_field_is_named_as_the_variable(tmp_path: Path) -> None:
    matrix = tmp_path / "heads.yaml"
    matrix.write_text(CPU_MATRIX.replace("num_heads: 8", "num_heads: '${INPUT_FIRST_HEADS}'"))
    line = refused(str(matrix), logs=tmp_path / "logs")
    assert "${INPUT_FIRST_HEADS} is not set" in line, line


@pytest.mark.parametrize(
    "flags,says",
    [
        (["--resume", "one", "--run-id", "two"], "--resume one continues that run, --run-id two"),
        (["--retry-failed"], "--retry-failed needs --resume RUN-ID"),
        (["--only", "no-such-case"], "--only ['no-such-case'] matches no case"),
        (["--resume", "nowhere"], "no run to resume (missing manifest.json)"),
    ],
)
def test_flags_that_cannot_work_are_refused(
    tmp_path: Path, cpu_matrix: Path, flags: list[str], says: str
) -> None:
    line = refused(str(cpu_matrix), *flags, logs=tmp_path / "logs")
    assert says in line, line


def _torn_copy(tmp_path: Path) -> tuple[Path, Path, bytes]:
    """A finished run with a torn last row appended, and the matrix it ran."""
    run = tmp_path / "logs" / "torn"
    shutil.copytree(FIXTURE_RUN, run)
    matrix = tmp_path / "noise.yaml"
    matrix.write_text(json.loads((run / "manifest.json").read_text())["matrix_text"])
    torn = b'{"case_id":"tiny-mla/tp1-dcp1-mtp0/default","status":"pas'
    with (run / "results.jsonl").open("ab") as f:
        f.write(torn)
    return run, matrix, torn


def test_a_torn_last_row_is_reported_and_kept_aside_on_resume(tmp_path: Path) -> None:
    run, matrix, torn = _torn_copy(tmp_path)
    rows = (run / "results.jsonl").read_bytes()[: -len(torn)]
    out = subprocess.run(
        [str(ORCHESTRATOR), "run", str(matrix), "--resume", "torn",
         "--logs-dir", str(tmp_path / "logs"), "--quiet"],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    # Every case has a row: nothing is left to run, and nothing started.
    assert out.returncode == 0, out.stderr
    assert "nothing left to run" in out.stdout
    assert (
        f"its last line was incomplete ({len(torn)} bytes, no newline): kept in results.jsonl.partial"
        in (out.stderr)
    )
    assert (run / "results.jsonl").read_bytes() == rows
    assert (run / "results.jsonl.partial").read_bytes() == torn + b"\n"


def test_report_warns_of_a_torn_last_row(tmp_path: Path) -> None:
    run, _, torn = _torn_copy(tmp_path)
    out = subprocess.run(
        [str(ORCHESTRATOR), "report", str(run)],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert f"its last line is incomplete ({len(torn)} bytes, no newline) and is not read" in (
        out.stderr
    )
