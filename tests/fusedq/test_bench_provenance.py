"""Every committed benchmark JSON (benchmarks/results/raw) names the code that produced it: a commit that
``fusedq-bench`` recorded from a clean tree (environment.commit), or a ``provenance`` entry
saying which commit ran and on what evidence (git history, the file's own notes), or that it
is unknown. A figure whose recorded commit is a stale or unreadable HEAD, or was edited by
hand, must say so there."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
BENCH = sorted(
    p
    for p in (REPO / "benchmarks" / "results" / "raw").rglob("*.json")
    if not p.name.endswith(".kernels.json")
)
SHA = re.compile(r"[0-9a-f]{7,40}")


def _recorded(data: dict) -> str | None:
    env = data.get("environment") or {}
    return env.get("commit")


@pytest.mark.parametrize("path", BENCH, ids=[p.name for p in BENCH])
def test_bench_json_names_its_code(path: Path):
    data = json.loads(path.read_text())
    prov = data.get("provenance")
    if prov is None:
        recorded = _recorded(data)
        assert recorded and SHA.fullmatch(recorded), (
            f"{path.name}: environment.commit {recorded!r} is no clean commit and there is no "
            "'provenance' entry naming the code"
        )
        return
    assert set(prov) <= {"commit", "dirty", "basis", "hand_edited"}, prov
    assert prov["commit"] == "unknown" or SHA.fullmatch(prov["commit"]), prov
    assert prov["basis"].strip(), f"{path.name}: a provenance entry says on what evidence"
    if "commit_note" in data:  # a figure corrected by hand says so in the same place
        assert prov.get("hand_edited"), f"{path.name}: commit_note without hand_edited"


def test_every_named_commit_is_in_the_history():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    named = set()
    for path in BENCH:
        data = json.loads(path.read_text())
        commit = (data.get("provenance") or {}).get("commit") or _recorded(data)
        if commit and commit != "unknown":
            named.add(commit.removesuffix("+dirty"))
    for commit in sorted(named):
        done = subprocess.run(
            ["git", "-C", str(REPO), "cat-file", "-e", f"{commit}^{{commit}}"], capture_output=True
        )
        assert done.returncode == 0, f"{commit} is not a commit of this repository"
