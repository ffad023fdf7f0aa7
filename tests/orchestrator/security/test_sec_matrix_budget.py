"""A matrix cannot make `plan` hang or exhaust memory: YAML aliases are expanded within a
budget, deep nesting and oversized or special files are refused in one line."""

from __future__ import annotations

import os
import time

from security_helpers import ALIAS_BOMB, MATRIX, assert_refused, run_cli, write_matrix

BOMB = "bomb:\n" + "".join(f"  {line}\n" for line in ALIAS_BOMB.splitlines())


def test_alias_bomb_is_refused_quickly(tmp_path):
    path = write_matrix(tmp_path, BOMB)
    assert len(path.read_bytes()) < 700
    t0 = time.monotonic()
    out = run_cli("plan", str(path), timeout=60, mem_mb=1024)
    assert_refused(out, path, "expands")
    assert time.monotonic() - t0 < 10


def test_aliases_within_the_budget_still_work(tmp_path):
    text = MATRIX.replace(
        "workloads: [{name: w, prompt_tokens: 1, output_tokens: 1}]",
        "workloads: [{name: w, <<: &c {prompt_tokens: 1, output_tokens: 1}}, {name: v, <<: *c}]",
    )
    out = run_cli("plan", str(write_matrix(tmp_path, base=text)))
    assert out.returncode == 0, out.stderr


def test_deep_nesting_is_refused(tmp_path):
    path = write_matrix(tmp_path, "description: " + "[" * 50_000 + "]" * 50_000 + "\n")
    assert_refused(run_cli("plan", str(path), mem_mb=1024), path)


def test_a_fifo_matrix_does_not_hang(tmp_path):
    path = tmp_path / "m.yaml"
    os.mkfifo(path)
    assert_refused(run_cli("plan", str(path), timeout=30), path, "not a regular file")


def test_an_oversized_matrix_is_refused(tmp_path):
    path = write_matrix(tmp_path, "description: '" + "x" * (2 << 20) + "'\n")
    assert_refused(run_cli("plan", str(path)), path, "MiB")
