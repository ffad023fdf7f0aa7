"""What a resume, a report and a run directory tell: a resume with nothing left starts nothing
and still fails while a case failed; each attempt's wall and overhead figures are kept apart;
`report` names what is wrong with a folder that is not a run; every path handed to a server
is absolute. (The real-server side of each: test_run_e2e.py and test_faults.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from orchestrator.cli import app
from orchestrator.cluster import launch
from orchestrator.config.expand import expand
from orchestrator.config.load import load_matrix
from orchestrator.engines.vllm import server as eng
from orchestrator.execution.case_run import _absolute_if_path
from orchestrator.execution.runner import RunOptions, run_matrix
from orchestrator.reports import write_reports
from orchestrator.results.rows import CaseResult
from orchestrator.results.store import RunStore

SMOKE = "matrices/smoke.yaml"
FAILED_REASON = "ValueError: boom (root cause, server.log:7)\nserver process exited with code 1"


class _NoRay:
    """Stands where the Launcher (Ray) would: constructing it is the failure under test."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        raise AssertionError("a resume with nothing left to run started Ray")


def _finished_run(logs: Path, *, failed: int) -> Path:
    """A smoke run whose every case has a result, the first `failed` of them failed."""
    cases = expand(load_matrix(SMOKE))
    store = RunStore.create(logs, "r")
    store.write_manifest(
        {
            "run_id": "r",
            "matrix_path": SMOKE,
            "matrix": load_matrix(SMOKE).model_dump(mode="json"),
            "cases": [c.to_dict() for c in cases],
        }
    )
    for i, c in enumerate(cases):
        status = "failed" if i < failed else "passed"
        reason = FAILED_REASON if status == "failed" else None
        store.append_result(
            CaseResult.model_validate({**c.to_dict(), "status": status, "reason": reason})
        )
    write_reports(
        store,
        overhead={"wall_s": 500.0, "startup_and_measured_s": 470.0, "overhead_s": 30.0,
                  "overhead_pct": 6.0},
    )  # fmt: skip
    return store.root


def _snapshot(root: Path) -> dict[str, bytes]:
    # The lock file says who holds the run; it is not part of what the run records.
    files = [p for p in root.rglob("*") if p.is_file() and p.name != ".lock"]
    return {str(p.relative_to(root)): p.read_bytes() for p in files}


@pytest.mark.parametrize("failed", [0, 1])
def test_resume_with_nothing_left_starts_nothing_and_exits_on_the_runs_verdict(
    tmp_path, monkeypatch, failed
):
    monkeypatch.setattr(launch, "Launcher", _NoRay)
    root = _finished_run(tmp_path, failed=failed)
    before = _snapshot(root)
    res = CliRunner().invoke(
        app, ["run", SMOKE, "--logs-dir", str(tmp_path), "--resume", "r", "--quiet"]
    )
    assert res.exit_code == failed, res.output
    assert "nothing left to run: every selected case has a result" in res.output
    if failed:
        # The earlier attempt's reason, every line of it, marked as such.
        assert (
            "FAILED tiny-mla/tp1-dcp1-mtp1/staged (in an earlier attempt): ValueError: boom"
            in res.output
        )
        assert "\n    server process exited with code 1" in res.output
        assert "--retry-failed" in res.output
    # Nothing written: manifest (no resume recorded), figures and reports as they were.
    assert _snapshot(root) == before


def test_a_resume_still_to_run_is_judged_on_every_selected_case(tmp_path, monkeypatch):
    _finished_run(tmp_path, failed=1)
    # --retry-failed leaves the failed case to run: Ray is needed, and asked for.
    with monkeypatch.context() as m, pytest.raises(AssertionError, match="started Ray"):
        m.setattr(launch, "Launcher", _NoRay)
        run_matrix(SMOKE, RunOptions(logs_dir=tmp_path, resume="r", retry_failed=True))
    summary = run_matrix(SMOKE, RunOptions(logs_dir=tmp_path, resume="r", only=["tp2"]))
    assert summary.nothing_left and not summary.failed  # the failed case is not selected


def test_each_attempts_figures_are_kept_apart(tmp_path):
    root = _finished_run(tmp_path, failed=0)
    store = RunStore(root)
    resume = {"wall_s": 8.7, "startup_and_measured_s": 0.0, "overhead_s": 8.7,
              "overhead_pct": 100.0, "cases_run": 0}  # fmt: skip
    write_reports(store, overhead=resume, resume=True)
    write_reports(store)  # `orchestrator report`: shows what was saved
    data = json.loads((root / "report.json").read_text())
    assert data["overhead"]["wall_s"] == 500.0 and data["overhead"]["overhead_pct"] == 6.0
    assert data["overhead_resumes"] == [resume]
    md = (root / "report.md").read_text()
    assert "Wall 500.0 s, of which server start-up and measured workloads 470.0 s" in md
    assert "Resume 1, 0 cases run: Wall 8.7 s" in md
    # A run directory from before resumes were kept apart holds one bare figures object.
    (root / "overhead.json").write_text(json.dumps({**resume, "wall_s": 9.0}))
    write_reports(store)
    assert json.loads((root / "report.json").read_text())["overhead"]["wall_s"] == 9.0


def test_a_resume_of_a_killed_run_says_its_first_attempt_left_no_figures(tmp_path):
    root = _finished_run(tmp_path, failed=0)
    (root / "overhead.json").unlink()
    fig = {"wall_s": 60.0, "startup_and_measured_s": 50.0, "overhead_s": 10.0, "overhead_pct": 16.7}
    write_reports(RunStore(root), overhead=fig, resume=True)
    md = (root / "report.md").read_text()
    assert "The first attempt recorded no figures" in md and "Resume 1: Wall 60.0 s" in md


@pytest.mark.parametrize(
    ("make", "says"),
    [
        (lambda d: None, "not a run directory (does not exist)"),
        (lambda d: d.mkdir(), "not a run directory (missing manifest.json)"),
        (lambda d: (d.mkdir(), (d / "manifest.json").write_text("{")), "unreadable manifest"),
        (
            lambda d: (d.mkdir(), (d / "manifest.json").write_text('{"run_id": "x"}')),
            "manifest has no 'cases'",
        ),
    ],
)
def test_report_on_a_folder_that_is_not_a_run_names_it_and_what_is_missing(tmp_path, make, says):
    folder = tmp_path / "not-a-run"
    make(folder)
    res = CliRunner().invoke(app, ["report", str(folder)])
    assert res.exit_code == 2
    assert f"orchestrator: {folder}" in res.output and says in res.output
    assert "resume" not in res.output


def test_every_path_handed_to_a_server_is_absolute(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    store = RunStore.create(Path("logs"), "r")  # as `--logs-dir logs` gives it
    assert store.root == tmp_path / "logs" / "r"
    case_dir = store.case_dir("tiny-mla__tp1-dcp1-mtp0__default")
    assert case_dir.is_absolute()
    env = eng.serve_env(
        {}, host="127.0.0.1", run_dir=Path("rel/case"), extra={"TORCHINDUCTOR_CACHE_DIR": "ic"}
    )
    for key in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR", "TMPDIR"):
        assert Path(env[key]).is_absolute(), (key, env[key])
    assert env["VLLM_CACHE_ROOT"] == str(tmp_path / "rel" / "case" / "vllm-cache")
    assert env["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "ic")
    assert _absolute_if_path("scripts/vllm") == str(tmp_path / "scripts" / "vllm")
    assert _absolute_if_path("vllm") == "vllm"  # a name for PATH stays one
    assert _absolute_if_path("/opt/vllm") == "/opt/vllm"
    store.write_manifest({"run_id": "r", "cases": []})
    assert RunStore.open(Path("logs"), "r").root == store.root


def test_a_server_started_from_a_relative_log_path_writes_where_it_was_told(tmp_path, monkeypatch):
    """start_server runs the server in its log's folder: the directories it names must not
    appear a second time inside that folder."""
    monkeypatch.chdir(tmp_path)
    case = Path("logs/r/cases/c")
    env = eng.serve_env({}, host="127.0.0.1", run_dir=case, extra={})
    script = "import os; open(os.path.join(os.environ['VLLM_CACHE_ROOT'], 'x'), 'w').close()"
    proc = eng.start_server([sys.executable, "-c", script], env, case / "server.log")
    assert proc.wait(timeout=30) == 0
    assert (tmp_path / case / "vllm-cache" / "x").exists()
    assert not (tmp_path / case / "logs").exists()
