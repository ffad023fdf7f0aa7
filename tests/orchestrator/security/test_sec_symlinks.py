"""A run directory someone prepared cannot make the orchestrator write elsewhere: every file
a run writes is opened without following a symbolic link, and resuming a run whose folder
holds links is refused, in one line, before anything starts."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from security_helpers import assert_refused, make_run, run_cli, write_matrix

from orchestrator.common.redact import redact_file
from orchestrator.engines.vllm.server import start_server
from orchestrator.execution.runner import _Log
from orchestrator.results.store import RunStore, StoreError, append_jsonl

PRECIOUS = "precious contents\n"


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file outside the run directory that a link inside it points at."""
    path = tmp_path / "elsewhere" / "victim.txt"
    path.parent.mkdir()
    path.write_text(PRECIOUS)
    return path


def _link(at: Path, target: Path) -> Path:
    if at.is_dir() and not at.is_symlink():
        at.rmdir()
    elif at.exists() or at.is_symlink():
        at.unlink()
    at.symlink_to(target)
    return at


def _one_line_naming(exc: BaseException, path: Path) -> None:
    msg = str(exc)
    assert "\n" not in msg and str(path) in msg and "link" in msg, msg


def test_lock_file_link_is_refused_not_truncated(tmp_path, victim):
    root = make_run(tmp_path)
    lock = _link(root / ".lock", victim)
    store = RunStore(root)  # as the runner holds it, the folder checked or not
    with pytest.raises(StoreError) as err:
        store.lock()
    _one_line_naming(err.value, lock)
    assert victim.read_text() == PRECIOUS


def test_results_link_is_refused_on_append(tmp_path, victim):
    root = make_run(tmp_path, rows=[])
    results = _link(root / "results.jsonl", victim)
    with pytest.raises(StoreError) as err:
        append_jsonl(results, {"case_id": "x"})
    _one_line_naming(err.value, results)
    assert victim.read_text() == PRECIOUS


def test_driver_log_link_is_refused(tmp_path, victim):
    log = _link(tmp_path / "orchestrator.log", victim)
    with pytest.raises(ValueError) as err:
        _Log(log, echo=False)("a line")
    _one_line_naming(err.value, log)
    assert victim.read_text() == PRECIOUS


def test_server_log_link_is_refused(tmp_path, victim):
    log = _link(tmp_path / "server.log", victim)
    with pytest.raises(ValueError) as err:
        start_server(["true"], {"PATH": os.environ["PATH"]}, log)
    _one_line_naming(err.value, log)
    assert victim.read_text() == PRECIOUS


def test_redacting_a_linked_log_is_refused(tmp_path, victim):
    victim.write_text("secret --api-key K1secret\n")
    log = _link(tmp_path / "server.log", victim)
    with pytest.raises(ValueError) as err:
        redact_file(log, ("K1secret",))
    _one_line_naming(err.value, log)
    assert log.is_symlink() and "K1secret" in victim.read_text()


@pytest.mark.parametrize(
    "entry", [".lock", "results.jsonl", "orchestrator.log", "cases/tiny__tp1-dcp1-mtp0__default"]
)
def test_resuming_a_prepared_folder_is_refused_before_anything_starts(tmp_path, victim, entry):
    root = make_run(tmp_path)
    (root / "cases" / "tiny__tp1-dcp1-mtp0__default").mkdir(exist_ok=True)
    target = victim if "/" not in entry else victim.parent
    link = _link(root / entry, target)
    with pytest.raises(StoreError) as err:
        RunStore.open(tmp_path, "run")
    _one_line_naming(err.value, link)
    assert victim.read_text() == PRECIOUS


def test_the_refusal_reaches_the_cli_as_one_line(tmp_path, victim):
    root = make_run(tmp_path)
    link = _link(root / ".lock", victim)
    # A CPU matrix: the machine check comes before the run folder is opened.
    matrix = write_matrix(tmp_path, "resources: {accelerator: cpu}\n")
    out = run_cli("run", str(matrix), "--resume", "run", "--logs-dir", str(tmp_path))
    assert_refused(out, link)
    assert victim.read_text() == PRECIOUS


def test_a_fifo_in_place_of_results_does_not_hang_the_append(tmp_path):
    root = make_run(tmp_path, rows=[])
    fifo = root / "results.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(StoreError, match="not a regular file"):
        append_jsonl(fifo, {"case_id": "x"})


def test_an_ordinary_run_still_writes(tmp_path):
    root = make_run(tmp_path)
    store = RunStore.open(tmp_path, "run")
    store.lock()
    assert (root / ".lock").read_text().startswith("pid ")
    store.unlock()
    assert not (root / ".lock").exists()  # a finished run leaves no lock naming a dead pid
    proc = start_server(["true"], {"PATH": os.environ["PATH"]}, root / "server.log")
    assert proc.wait(timeout=30) == 0
    assert isinstance(proc, subprocess.Popen)
