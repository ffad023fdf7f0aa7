"""What the security tests share: the CLI run under a memory cap and a time limit, the
one-line refusal every hostile input must get, and small matrices and run directories."""

from __future__ import annotations

import json
import resource
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from orch_cli import user_environ

from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix
from orchestrator.results.rows import CaseResult
from orchestrator.results.store import RunStore

REPO = Path(__file__).resolve().parents[3]
ORCHESTRATOR = Path(sys.executable).parent / "orchestrator"

# A matrix that plans in milliseconds: one model, one topology, one workload.
MATRIX = """\
name: m
models: [{label: tiny, path: /m, num_heads: 8}]
topologies: [{tp: 1}]
workloads: [{name: w, prompt_tokens: 1, output_tokens: 1}]
"""

# A "billion laughs" in 437 bytes: nine levels of ten aliases, 10^9 strings once expanded.
ALIAS_BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join([f'*{p}'] * 10)}]\n"
    for p, c in zip("abcdefgh", "bcdefghi", strict=True)
)


def run_cli(
    *args: str,
    timeout: float = 60,
    mem_mb: int | None = None,
    env: Mapping[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:
    """`orchestrator ARGS...` with its address space capped at `mem_mb` MiB (the machine is
    shared: a hostile input must never take it down, fixed or not) and a wall-clock limit."""

    def cap() -> None:
        if mem_mb is not None:
            limit = mem_mb << 20
            resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run(
        [str(ORCHESTRATOR), *args],
        capture_output=True,
        text=True,
        errors="replace",
        cwd=REPO,
        timeout=timeout,
        preexec_fn=cap,
        env={**user_environ(), "PYTHONUNBUFFERED": "1", **(env or {})},
    )


def assert_refused(out: subprocess.CompletedProcess[str], *names: object) -> str:
    """Exit 2 with exactly one line on stderr, no traceback, naming every one of `names`."""
    lines = out.stderr.strip().splitlines()
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert len(lines) == 1, out.stderr[-2000:]
    assert "Traceback" not in out.stderr and "Error:" not in lines[0].split(":", 1)[0]
    for name in names:
        assert str(name) in lines[0], (name, lines[0])
    return lines[0]


def write_matrix(tmp_path: Path, extra: str = "", base: str = MATRIX) -> Path:
    path = tmp_path / "m.yaml"
    path.write_text(base + extra)
    return path


def make_run(tmp_path: Path, rows: Sequence[Mapping[str, object]] | None = None) -> Path:
    """A finished run directory of MATRIX's one case, with `rows` (default: one passed row)
    as its results, written the way the runner writes them."""
    matrix = parse_matrix(MATRIX, "m.yaml")
    case = expand(matrix)[0]
    store = RunStore.create(tmp_path, "run")
    store.write_manifest(
        {
            "run_id": "run",
            "matrix_path": "m.yaml",
            "matrix": matrix.model_dump(mode="json"),
            "cases": [case.to_dict()],
            "versions": {"vllm": "0.32.0"},
        }
    )
    for row in rows if rows is not None else [passed_row()]:
        store.append_result(CaseResult.model_validate(row))
    return store.root


def passed_row(**changes: object) -> dict[str, object]:
    case = expand(parse_matrix(MATRIX, "m.yaml"))[0]
    row: dict[str, object] = {**case.to_dict(), "status": "passed", "reason": None, "errors": 0}
    row["workloads"] = {"w": {"mean": {"aggregate_tok_s": 10.0, "per_user_tok_s": 10.0}}}
    row.update(changes)
    return row


def rewrite_json(path: Path, change: Mapping[str, object]) -> None:
    data = json.loads(path.read_text())
    data.update(change)
    path.write_text(json.dumps(data))
