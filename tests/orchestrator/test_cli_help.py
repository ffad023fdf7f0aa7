"""The command line as a newcomer first meets it: `--version`, and help text that reads as
written (paragraphs re-wrapped to the terminal, flags without type labels)."""

from __future__ import annotations

import re

import pytest
from orch_cli import run_cli

from orchestrator.common.probes import dist_version


def test_version() -> None:
    out = run_cli("--version", timeout=60)
    assert out.returncode == 0, out.stderr
    assert re.fullmatch(
        rf"orchestrator {re.escape(dist_version('fusedq') or 'unknown')}"
        r"( \(commit [0-9a-f]{7}(, modified)?\))?\n",
        out.stdout,
    ), out.stdout


@pytest.mark.parametrize("columns", ["200", "72"])
def test_help_paragraphs_are_wrapped_whole(columns: str) -> None:
    out = run_cli("run", "--help", timeout=60, env={"COLUMNS": columns})
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "<bool>" not in text and "<list[str]>" not in text and "<str>" not in text
    assert "--resume RUN-ID" in text and "--set KEY=VALUE" in text
    # The docstring's second paragraph, its own line breaks gone: wrapped to the width.
    para = ("Exit 0 when every case passed, 1 when a case failed or could not be recorded, 2 "
            "on bad input or when processes of a crashed attempt of the resumed run still run "
            "(nothing launched).")  # fmt: skip
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith("Exit 0 when"))
    block = []
    for ln in lines[start:]:
        if not ln.strip():
            break
        block.append(ln.strip())
    assert " ".join(block) == para
    # Wrapped to the terminal, at most click's 80 columns.
    assert all(len(ln) <= min(int(columns), 80) for ln in lines)


def test_commands_list_whole_summaries() -> None:
    out = run_cli("--help", timeout=60, env={"COLUMNS": "80"})
    assert out.returncode == 0
    commands = out.stdout.split("Commands:", 1)[1]
    assert "..." not in commands, commands  # no summary cut short
    assert "  audit          Scan logs or a run directory for GPU faults." in out.stdout
