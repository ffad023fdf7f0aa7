"""Real CPU `vllm serve` (0.32) through `orchestrator run`: synthetic MTP acceptance read back
from the server's /metrics, start-up phases from its log, and the compile cache a second
server of one configuration loads instead of compiling, in one run and in the next.

The tiny model, MTP 1 at a synthetic acceptance of 0.7, torch.compile on (no --enforce-eager):
two variants with equal settings are two servers of one configuration. A second run of the
first case alone meets the cache the first run left. Nothing is mocked.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from orch_cli import run_cli

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

ACCEPTANCE = 0.7
MATRIX = f"""
name: cpu-serving
models:
  - {{label: tiny-mla, path: builtin:tiny-mla, num_heads: 8}}
engine:
  args: [--attention-backend=CPU_MLA, --max-model-len=2048, --max-num-seqs=4]
  env: {{VLLM_CPU_KVCACHE_SPACE: "2"}}
resources: {{accelerator: cpu, cpus_per_rank: 1}}
topologies:
  - {{tp: 1, mtp: [1], mtp_acceptance: {ACCEPTANCE}}}
workloads:
  - {{name: ctx0, prompt_tokens: 1, output_tokens: 128, requests: 4}}
variants:
  - {{name: first}}
  - {{name: second}}
timeouts: {{placement_s: 300, ready_s: 900, request_s: 300, case_s: 1500}}
"""


def _rows(run_dir: Path) -> dict[str, dict]:
    rows = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    return {r["variant"]: r for r in rows}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict]]:
    """Two runs against one cold cache folder: both cases, then the first case again."""
    tmp = tmp_path_factory.mktemp("serving")
    (tmp / "m.yaml").write_text(MATRIX)
    env = {"ORCHESTRATOR_CACHE": str(tmp / "cache")}
    common = ["run", str(tmp / "m.yaml"), "--logs-dir", str(tmp / "logs"), "--quiet"]
    first = run_cli(*common, "--run-id", "one", timeout=1800, env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    again = run_cli(*common, "--run-id", "two", "--only", "first", timeout=1200, env=env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    return {"one": _rows(tmp / "logs" / "one"), "two": _rows(tmp / "logs" / "two")}


def test_acceptance_seen_is_the_synthetic_rate(runs) -> None:
    for row in runs["one"].values():
        assert row["status"] == "passed", row["reason"]
        seen = row["workloads"]["ctx0"]["spec_decode"]
        assert seen["configured_rates"] == [ACCEPTANCE]
        # ~300 drafts: a standard error near 0.03 around the configured rate.
        assert seen["draft_tokens"] >= 100
        assert abs(seen["acceptance_rate"] - ACCEPTANCE) < 0.12, seen
        assert seen["acceptance_length"] == pytest.approx(1 + seen["acceptance_rate"], abs=1e-3)


def test_startup_phases_cover_the_start(runs) -> None:
    row = runs["one"]["first"]
    phases = row["startup"]["phases"]
    for name in ("imports", "api_server", "engine_init", "weights", "compile", "serving"):
        assert name in phases, phases
    # Consecutive phases from spawn to ready: they add up to the start-up the case timed.
    assert sum(phases.values()) == pytest.approx(row["timings"]["startup_s"], abs=3.0)
    assert row["startup"]["vllm"]["torch_compile_s"] > 0


def test_second_server_of_a_configuration_loads_the_compile_cache(runs) -> None:
    first, second = runs["one"]["first"], runs["one"]["second"]
    assert first["startup"]["compile_cache_dir"] == second["startup"]["compile_cache_dir"]
    assert first["startup"]["compile_cache"] == "miss"
    assert second["startup"]["compile_cache"] == "hit"
    assert second["startup"]["phases"]["compile"] < first["startup"]["phases"]["compile"]


def test_the_next_run_meets_the_cache_too(runs) -> None:
    (row,) = runs["two"].values()
    assert (
        row["startup"]["compile_cache_dir"] == runs["one"]["first"]["startup"]["compile_cache_dir"]
    )
    assert row["startup"]["compile_cache"] == "hit"
