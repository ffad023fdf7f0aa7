"""`trace-summary` and `report` on hostile files: each one exits 2 with one line naming the
file, within a memory cap and a time limit, instead of a traceback, a hang or the machine's
memory. A lone surrogate in a row is no reason to lose the reports."""

from __future__ import annotations

import gzip
import json
import os
from pathlib import Path

import pytest
from security_helpers import assert_refused, make_run, passed_row, run_cli

from orchestrator.analysis import trace
from orchestrator.analysis.trace import TraceError, read_trace

CAP_MB = 640  # a few hundred MiB over what the commands need for a small input
EVENT = {"ph": "X", "cat": "kernel", "name": "k", "pid": 0, "tid": 1, "ts": 0.0, "dur": 1.0}


def _trace(path: Path, body: str) -> Path:
    path.write_text('{"traceEvents": [' + body + "]}")
    return path


# --------------------------------------------------------------------------- trace-summary


@pytest.mark.parametrize("depth", [40_000, 100_000])
def test_deep_nesting_in_a_trace(tmp_path, depth):
    """80 KB of nesting took 3.9 GB (the parser's prefix per level); 100,000 levels more."""
    path = _trace(tmp_path / "deep.json", '{"args": ' + "[" * depth + "]" * depth + "}")
    assert_refused(run_cli("trace-summary", str(path), mem_mb=CAP_MB), path, "nest")


def test_a_fifo_trace_does_not_hang(tmp_path):
    path = tmp_path / "rank0.pt.trace.json"
    os.mkfifo(path)
    assert_refused(run_cli("trace-summary", str(path), timeout=30), path, "not a regular file")


def test_dev_zero_as_a_trace(tmp_path):
    path = tmp_path / "rank0.pt.trace.json"
    path.symlink_to("/dev/zero")
    out = run_cli("trace-summary", str(path), timeout=30, mem_mb=CAP_MB)
    assert_refused(out, path, "not a regular file")


def test_a_huge_string_in_a_trace(tmp_path):
    path = _trace(tmp_path / "t.json", json.dumps({**EVENT, "name": "k" * (64 << 20)}))
    assert_refused(run_cli("trace-summary", str(path), mem_mb=CAP_MB), path, "MiB")


def test_a_trace_gzip_bomb_is_refused_at_the_stated_cap(tmp_path, monkeypatch):
    path = tmp_path / "rank0.pt.trace.json.gz"
    with gzip.open(path, "wb") as f:
        f.write(b'{"traceEvents": [')
        f.write(b",".join([json.dumps(EVENT).encode()] * 200_000))
        f.write(b"]}")
    monkeypatch.setattr(trace, "MAX_TRACE_BYTES", 4 << 20, raising=False)
    with pytest.raises(TraceError, match="4 MiB") as err:
        read_trace(path)
    assert str(path) in str(err.value)


def test_the_trace_bounds_are_stated():
    assert trace.MAX_TRACE_BYTES >= 1 << 30 and trace.MAX_JSON_DEPTH >= 16
    assert trace.MAX_TRACE_EVENTS >= 1_000_000


def test_a_normal_trace_still_reads(tmp_path):
    events = [{**EVENT, "ts": float(i), "args": {"correlation": i, "grid": [1, 2, 3]}}
              for i in range(10)]  # fmt: skip
    path = _trace(tmp_path / "t.json", ",".join(map(json.dumps, events)))
    figures = read_trace(path)
    assert figures.kernel_events == 10 and figures.trace_events == 10


# --------------------------------------------------------------------------- report


def _report(root: Path, **kw):
    return run_cli("report", str(root), mem_mb=CAP_MB, **kw)


def test_results_linked_to_dev_zero(tmp_path):
    root = make_run(tmp_path, rows=[])
    (root / "results.jsonl").symlink_to("/dev/zero")
    assert_refused(_report(root, timeout=60), root / "results.jsonl")


def test_results_as_a_fifo_does_not_hang(tmp_path):
    root = make_run(tmp_path, rows=[])
    os.mkfifo(root / "results.jsonl")
    assert_refused(_report(root, timeout=30), root / "results.jsonl", "not a regular file")


def test_manifest_as_a_fifo_does_not_hang(tmp_path):
    root = make_run(tmp_path)
    (root / "manifest.json").unlink()
    os.mkfifo(root / "manifest.json")
    assert_refused(_report(root, timeout=30), root / "manifest.json")


@pytest.mark.parametrize("depth", [900, 100_000])
def test_deep_nesting_in_a_row(tmp_path, depth):
    root = make_run(tmp_path, rows=[])
    row = json.dumps(passed_row()).replace(
        '"errors": 0', '"errors": 0, "x": ' + "[" * depth + "]" * depth
    )
    (root / "results.jsonl").write_text(row + "\n")
    assert_refused(_report(root), root / "results.jsonl", "nest")


def test_a_row_longer_than_the_stated_bound(tmp_path):
    root = make_run(tmp_path, rows=[])
    row = passed_row(reason="x" * (80 << 20), status="failed")
    (root / "results.jsonl").write_text(json.dumps(row) + "\n")
    assert_refused(_report(root), root / "results.jsonl", "MiB")


@pytest.mark.parametrize(
    "content", ["[1, 2]", '{"wall_s": "soon"}', '{"run": 5}', "{not json", '{"run": {"wall_s": 1}}']
)
def test_malformed_overhead_json(tmp_path, content):
    root = make_run(tmp_path)
    (root / "overhead.json").write_text(content)
    assert_refused(_report(root), root / "overhead.json")


@pytest.mark.parametrize(
    "change",
    [{"cases": 5}, {"matrix": []}, {"cases": [{"case_id": []}]}, {"run_id": {"x": 1}}],
    ids=["cases", "matrix", "case-id", "run-id"],
)
def test_malformed_manifest(tmp_path, change):
    root = make_run(tmp_path)
    manifest = json.loads((root / "manifest.json").read_text())
    (root / "manifest.json").write_text(json.dumps({**manifest, **change}))
    assert_refused(_report(root), root / "manifest.json")


def test_a_lone_surrogate_in_a_row_still_gives_every_report(tmp_path):
    root = make_run(tmp_path, rows=[])
    row = json.dumps(passed_row(status="failed", reason="bad byte \udc80 here"))
    assert "\\udc80" in row
    (root / "results.jsonl").write_text(row + "\n")
    out = _report(root)
    assert out.returncode == 0, out.stderr
    for name in ("report.md", "report.html", "junit.xml"):
        assert "bad byte \ufffd here" in (root / name).read_text(encoding="utf-8"), name
    as_json = json.dumps(json.loads((root / "report.json").read_text()), ensure_ascii=False)
    assert "bad byte \ufffd here" in as_json
