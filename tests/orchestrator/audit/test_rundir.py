"""`orchestrator audit RUN` (and a log inside a run) reaches the verdict the run reached.

Every committed run is audited both ways -- the run directory, and each case's server.log
on its own -- and each case's verdict is held against the one its results row recorded. A
run made here from a real CPU server's shutdown log checks the stop-line rule both ways:
the line the run recorded, and (for runs recorded before it was kept) the first line the
run discounted.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from orch_cli import REPO, run_cli
from typer.testing import CliRunner

from orchestrator.audit import Expectation, audit_logs
from orchestrator.cli import app
from orchestrator.common.layout import case_slug
from orchestrator.results.store import read_jsonl

RUNS = sorted(
    p.parent
    for root in ("tests/orchestrator/fixtures/runs", "docs/validation")
    for p in (REPO / root).rglob("manifest.json")
)
SHUTDOWN_LOG = REPO / "tests/orchestrator/fixtures/audit/vllm_sigterm_shutdown.log"


def _audit(*args: str) -> tuple[int, dict]:
    res = CliRunner().invoke(app, ["audit", *args, "--json"])
    assert res.exit_code in (0, 1), res.output
    return res.exit_code, json.loads(res.output)


@pytest.mark.parametrize("committed", RUNS, ids=[str(r.relative_to(REPO)) for r in RUNS])
def test_a_committed_run_is_audited_as_it_was(committed: Path) -> None:
    rows = {r["case_id"]: r for r in read_jsonl(committed / "results.jsonl")}
    code, whole = _audit(str(committed))
    audited = {c["case_id"]: c for c in whole["cases"]}
    not_audited = {c["case_id"] for c in whole["not_audited"]}
    assert set(audited) | not_audited == {
        c["case_id"] for c in json.loads((committed / "manifest.json").read_text())["cases"]
    }
    for case_id, row in rows.items():
        log = committed / "cases" / case_slug(case_id) / "server.log"
        if not log.exists():
            assert case_id in not_audited
            continue
        run_said = row["audit"]["verdict"]["status"]
        assert audited[case_id]["verdict"]["status"] == run_said, case_id
        assert audited[case_id]["agrees_with_run"] is True
        # The case's log alone: the same verdict.
        _, alone = _audit(str(log))
        assert [c["verdict"]["status"] for c in alone["cases"]] == [run_said], case_id
    assert code == (0 if all(c["verdict"]["status"] == "clean" for c in audited.values()) else 1)


def test_the_committed_runs_cover_a_discounted_stop() -> None:
    """One committed run discounted its shutdown traceback; the standalone audit finds the
    stop line from that record and discounts the same findings."""
    run = REPO / "docs/validation/h200-2026-11-30/h200x2-dcp2"
    _, whole = _audit(str(run))
    (case,) = whole["cases"]
    assert case["stop_basis"].startswith("the first line the run discounted")
    assert case["discounted"] and case["verdict"]["status"] == "clean"


def _run_of(tmp_path: Path, *, record_stop: bool, stop_line: int | None = 1) -> Path:
    """A run directory of one case whose server log is a real CPU server's SIGTERM shutdown
    (an EngineDeadError traceback), audited as orchestrator.execution.case_run audits: the stop
    began at `stop_line`, the matrix expects a line every worker logs."""
    root = tmp_path / "run"
    case_id = "tiny/tp1-dcp1-mtp0/staged"
    folder = root / "cases" / case_slug(case_id)
    folder.mkdir(parents=True)
    log = folder / "server.log"
    shutil.copy(SHUTDOWN_LOG, log)
    expect = {"pattern": "EngineCore", "description": "the engine's lines"}
    matrix = {"name": "m", "audit": {"expect": [expect]}, "variants": [{"name": "staged"}]}
    manifest = {"run_id": "run", "matrix": matrix, "cases": [{"case_id": case_id,
                "variant": "staged"}]}  # fmt: skip
    (root / "manifest.json").write_text(json.dumps(manifest))
    result = audit_logs(
        [log],
        expectations=[Expectation(expect["pattern"], None, expect["description"])],
        include_kernel_log=False,
        include_gpu_state=False,
        stopped_at={str(log): stop_line} if stop_line else None,
    )
    record = result.to_dict()
    if not record_stop:
        record.pop("stopped_at")  # as runs recorded before the stop line was kept
    (folder / "audit.json").write_text(json.dumps(record))
    row = {"case_id": case_id, "status": "passed", "audit": record}
    (root / "results.jsonl").write_text(json.dumps(row) + "\n")
    return root


@pytest.mark.parametrize("record_stop", [True, False], ids=["recorded", "inferred"])
def test_the_shutdown_traceback_is_discounted_as_the_run_did(tmp_path, record_stop) -> None:
    root = _run_of(tmp_path, record_stop=record_stop)
    run_said = json.loads((root / "results.jsonl").read_text())["audit"]["verdict"]["status"]
    assert run_said == "clean"
    log = next(root.glob("cases/*/server.log"))
    for target in (root, log, log.parent):
        code, out = _audit(str(target))
        (case,) = out["cases"]
        assert code == 0 and case["verdict"]["status"] == "clean", case
        assert {f["signature"] for f in case["discounted"]} == {
            "python-traceback",
            "vllm-engine-dead",
        }
        # Recorded: where the stop began; inferred: the first line the run discounted.
        first = min(f["line"] for f in case["discounted"])
        assert case["stop_line"] == (1 if record_stop else first), case["stop_basis"]
        assert case["agrees_with_run"] is True
        assert case["searched"]["expectations"][0]["occurrences"] > 0
    # The same log outside a run is judged without the run's stop: the traceback counts.
    plain = tmp_path / "server.log"
    shutil.copy(log, plain)
    code, out = _audit(str(plain))
    assert code == 1 and out["verdict"]["status"] == "findings"


def test_a_run_that_counted_its_shutdown_traceback_is_not_made_clean(tmp_path) -> None:
    """A run whose stop came after the traceback counted it (a crash, not the stop): the
    standalone audit must count it too."""
    last = len(SHUTDOWN_LOG.read_text().splitlines())
    root = _run_of(tmp_path, record_stop=True, stop_line=last + 1)
    code, out = _audit(str(root))
    (case,) = out["cases"]
    assert case["verdict"]["status"] == "findings" and case["agrees_with_run"] is True
    assert code == 1


def test_runs_and_other_logs_are_audited_in_separate_calls(tmp_path) -> None:
    root = _run_of(tmp_path, record_stop=True)
    res = CliRunner().invoke(app, ["audit", str(root), str(SHUTDOWN_LOG)])
    assert res.exit_code == 2
    assert "in separate calls" in res.output


def test_the_text_names_each_case_and_the_runs_verdict_beside_it(tmp_path) -> None:
    """The command as a user types it: exit 0, each case with its verdict beside the run's."""
    root = _run_of(tmp_path, record_stop=True)
    out = run_cli("audit", str(root), timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "== tiny/tp1-dcp1-mtp0/staged:" in out.stdout
    assert "discounted python-traceback: logged after the orchestrator stopped" in out.stdout
    assert "verdict: clean; the run: clean (agrees)" in out.stdout
    assert "\nrun verdict: clean\nnot searched: kernel log not audited: no --since" in out.stdout
