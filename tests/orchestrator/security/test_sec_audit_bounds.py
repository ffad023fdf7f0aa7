"""The audit's memory does not grow with the input: a log without newlines, a line of any
length, a gzip bomb. Each runs as `orchestrator audit` under an address-space cap a little
above what the audit needs for a small log (the mapped file's own size added where the
file is memory-mapped), so a regression shows as a MemoryError, not as a slow machine."""

from __future__ import annotations

import gzip
import json
import os
import time
from pathlib import Path

import pytest
from security_helpers import assert_refused, run_cli
from typer.testing import CliRunner

from orchestrator.audit import sources
from orchestrator.audit.scan import GREP_MAX_LINE_BYTES, MAX_LINE_BYTES
from orchestrator.cli import app

NEEDLE = b" CUDA error: an illegal memory access was encountered "
MIB = 1 << 20
# `orchestrator audit` of a small log fits in ~110 MiB of address space (Python, its imports,
# a thread's malloc arena); the cap leaves some 60 MiB for whatever the input is. Before the
# bounds (2026-12-02), these 128 MiB lines needed over 350 MiB and died of MemoryError.
HEAP_CAP_MB = 176


def _one_line_log(path: Path, mib: int, every_mib: int = 4) -> Path:
    """`mib` MiB without a newline, a fault needle every `every_mib` MiB."""
    piece = b"x" * (every_mib * MIB - len(NEEDLE)) + NEEDLE
    with path.open("wb") as f:
        for _ in range(mib // every_mib):
            f.write(piece)
    return path


@pytest.fixture(scope="module")
def long_line(tmp_path_factory) -> Path:
    return _one_line_log(tmp_path_factory.mktemp("audit") / "one-line.log", 128)


def _assert_found_in_bounds(out, started: float) -> None:
    assert out.returncode == 1, out.stderr[-1500:]
    assert "illegal-memory-access" in out.stdout
    assert time.monotonic() - started < 60


def test_a_128_mib_line_in_a_plain_file(long_line):
    """At e3a37d8, 1 GiB without a newline peaked at 3.1 GB; here 128 MiB. The file
    is memory-mapped while it is looked at, hence its size on top of the cap."""
    t0 = time.monotonic()
    out = run_cli("audit", str(long_line), mem_mb=HEAP_CAP_MB + 128, timeout=120)
    _assert_found_in_bounds(out, t0)


def test_long_lines_that_grep_still_takes(tmp_path):
    """Lines of 4 MiB (over MAX_LINE_BYTES, under GREP_MAX_LINE_BYTES) in a mapped file:
    each is read in a piece around its fault, and the finding keeps its line number."""
    assert MAX_LINE_BYTES < 4 * MIB < GREP_MAX_LINE_BYTES
    half = b"y" * (2 * MIB)
    log = tmp_path / "long-lines.log"
    log.write_bytes(b"".join(half + NEEDLE + half + b"\n" for _ in range(12)))
    out = run_cli("audit", str(log), "--json", mem_mb=HEAP_CAP_MB + 48, timeout=120)
    assert out.returncode == 1, out.stderr[-1500:]
    lines = [f["line"] for f in json.loads(out.stdout)["findings"]]
    assert lines == list(range(1, 13)), lines


def test_a_128_mib_line_streamed(long_line):
    t0 = time.monotonic()
    out = run_cli(
        "audit", str(long_line), mem_mb=HEAP_CAP_MB, timeout=120,
        env={"ORCHESTRATOR_AUDIT_PREFILTER": "python"},
    )  # fmt: skip
    _assert_found_in_bounds(out, t0)


def test_a_128_mib_line_in_a_gzip_log(long_line, tmp_path):
    gz = tmp_path / "one-line.log.gz"
    with long_line.open("rb") as src, gzip.open(gz, "wb", compresslevel=1) as dst:
        while chunk := src.read(8 * MIB):
            dst.write(chunk)
    t0 = time.monotonic()
    out = run_cli("audit", str(gz), mem_mb=HEAP_CAP_MB, timeout=120)
    _assert_found_in_bounds(out, t0)


def test_a_gzip_bomb_is_refused_at_the_stated_cap(tmp_path, monkeypatch):
    """Past MAX_GZIP_BYTES of decompressed text a .gz is no log: exit 2 naming it (the cap
    is lowered here so that the test decompresses 64 MiB, not gigabytes)."""
    bomb = tmp_path / "server.log.1.gz"
    with gzip.open(bomb, "wb") as f:
        line = b"INFO nothing to see here\n" * 4096
        for _ in range((64 * MIB) // len(line)):
            f.write(line)
    monkeypatch.setattr(sources, "MAX_GZIP_BYTES", 16 * MIB, raising=False)
    out = CliRunner().invoke(app, ["audit", str(bomb)])
    assert out.exit_code == 2, out.output
    lines = out.output.strip().splitlines()
    assert len(lines) == 1 and str(bomb) in lines[0] and "16 MiB" in lines[0], out.output


def test_the_gzip_cap_is_stated():
    assert sources.MAX_GZIP_BYTES >= 1 << 30  # a real rotated log fits


@pytest.mark.parametrize("kind", ["fifo", "dev-zero-link"])
def test_special_files_are_refused(tmp_path, kind):
    path = tmp_path / "server.log"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        path.symlink_to("/dev/zero")
    assert_refused(run_cli("audit", str(path), timeout=30, mem_mb=HEAP_CAP_MB), path)
