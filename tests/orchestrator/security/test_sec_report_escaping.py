"""report.md renders what a run recorded as text: a newline in a label cannot split a table
row, NUL and ESC never reach the file or a terminal, and no text from a label or a log
renders as HTML. `orchestrator report` prints that same escaped Markdown."""

from __future__ import annotations

import contextlib
import io
import json
import re

import pytest
from security_helpers import make_run, passed_row, rewrite_json, run_cli

from orchestrator.cli import _print_outcome
from orchestrator.common.mdtable import md_cell, md_table
from orchestrator.execution.runner import RunSummary
from orchestrator.results.store import RunStore

HOSTILE = "a\nb|<script>alert(1)</script>\x00\x1b[31mred\x1b[0m\x07"
CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f\x80-\x9f]")
RAW_HTML = re.compile(r"(?<!\\)<(?:script|img|/script)", re.I)


@pytest.mark.parametrize("value", [HOSTILE, "x\r\ny", "tab\there", "\x9b31m"])
def test_a_cell_is_one_line_of_text(value):
    cell = md_cell(value)
    assert "\n" not in cell and "\r" not in cell and not CONTROL.search(cell)
    assert not RAW_HTML.search(cell)
    table = md_table(["h"], [[value]])
    assert len(table.splitlines()) == 3


def test_kernel_names_keep_their_angle_brackets_readable():
    assert md_cell("void k<128, 64>(float*)") == "void k<128, 64>(float*)"


def _hostile_run(tmp_path):
    reason = "<img src=x onerror=alert(1)> server died\x00\x1b[2J\nTraceback <b>bold</b>\x1b[0m"
    root = make_run(tmp_path, rows=[passed_row(status="failed", reason=reason)])
    manifest = json.loads((root / "manifest.json").read_text())
    case = manifest["cases"][0]
    label = "Luke\nBF16 <script>x</script>\x1b[31m"
    case_id = case["case_id"].replace("tiny", label)
    rewrite_json(root / "manifest.json", {"run_id": "run<script>\x00", "cases": [
        {**case, "case_id": case_id, "model": label}]})  # fmt: skip
    row = passed_row(status="failed", reason=reason, case_id=case_id, model=label)
    (root / "results.jsonl").write_text(json.dumps(row) + "\n")
    return root


def test_report_md_escapes_labels_headings_and_reasons(tmp_path):
    root = _hostile_run(tmp_path)
    out = run_cli("report", str(root))
    assert out.returncode == 0, out.stderr
    md = (root / "report.md").read_text()
    assert not CONTROL.search(md.replace("\n", "").replace("\t", ""))
    # Outside code blocks, no tag opens: a reader's Markdown renderer shows them as text.
    prose = re.sub(r"(?ms)^ *(`{3,})text\n.*?^ *\1$", "", md)
    assert not RAW_HTML.search(prose), prose
    assert "onerror" in md  # shown as text, not dropped
    table_rows = [ln for ln in md.splitlines() if ln.startswith("| Luke")]
    # The two tok/s tables: one row each, every row whole (the latency table lists only
    # workloads with latency samples, which this row has none of).
    assert len(table_rows) == 2 and all(ln.endswith("|") for ln in table_rows), table_rows
    # stdout is the same escaped file
    assert out.stdout.rstrip("\n") == md.rstrip("\n") and not CONTROL.search(
        out.stdout.replace("\n", "")
    )


def test_run_prints_failed_reasons_without_control_characters(tmp_path):
    root = _hostile_run(tmp_path)
    results = RunStore(root).results()
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        _print_outcome(RunSummary(run_dir=root, results=results))
    assert "FAILED" in err.getvalue() and not CONTROL.search(err.getvalue().replace("\n", ""))
