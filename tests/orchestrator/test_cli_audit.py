"""`orchestrator audit LOG...`: exit 0 clean, 1 findings (and --json), 2 bad input naming it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "orchestrator" / "fixtures" / "audit"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "audit", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def test_cli_clean_exit_0():
    proc = _cli(str(FIXTURES / "vllm_tp4_clean.log"))
    assert proc.returncode == 0, proc.stderr
    assert "verdict: clean" in proc.stdout
    assert "kernel log not audited: no --since given" in proc.stdout


def test_cli_findings_exit_1_and_json():
    proc = _cli(str(FIXTURES / "vllm_tp4_crash.log"), "--json")
    assert proc.returncode == 1, proc.stderr
    d = json.loads(proc.stdout)
    assert d["verdict"]["status"] == "findings"
    assert any(f["root_cause"] and f["rank"] == "Worker_TP2" for f in d["findings"])


def test_cli_missing_path_exit_2_names_it(tmp_path):
    proc = _cli(str(FIXTURES / "vllm_tp4_clean.log"), str(tmp_path / "missing.log"))
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"orchestrator audit: {tmp_path / 'missing.log'}: no such file or directory"
    )


def test_cli_bad_since_exit_2_names_it():
    proc = _cli(str(FIXTURES / "vllm_tp4_clean.log"), "--since", "yesterday-ish")
    assert proc.returncode == 2
    assert "--since 'yesterday-ish' is not an ISO 8601 time" in proc.stderr


def test_cli_empty_directory_exit_2(tmp_path):
    proc = _cli(str(tmp_path))
    assert proc.returncode == 2 and "holds no log files" in proc.stderr


def test_cli_since_audits_the_kernel_log_or_says_why_not(tmp_path):
    proc = _cli(str(FIXTURES / "vllm_tp4_clean.log"), "--since", "2099-01-01T00:00:00Z", "--json")
    d = json.loads(proc.stdout)
    kl = d["searched"]["kernel_log"]
    if kl["audited"]:
        assert proc.returncode == 0 and kl["lines"] == 0  # nothing logged after 2099
    else:
        assert "kernel log not audited" in d["verdict"]["text"]


def test_cli_via_typer_runner():
    from typer.testing import CliRunner

    from orchestrator.cli import app

    res = CliRunner().invoke(app, ["audit", str(FIXTURES / "vllm_tp4_clean.log")])
    assert res.exit_code == 0, res.output
