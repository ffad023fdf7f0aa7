"""Real CPU `vllm serve` (0.32) through `orchestrator run`: MTP acceptance read back from the
server's /metrics, start-up phases from its log, and the compile cache the next server of one
configuration loads instead of compiling.

The tiny model, MTP 1, torch.compile on (no --enforce-eager): two variants with equal
settings are one configuration. One run serves the first; the next run, against the same
cache root, serves the second, and meets the cache the first left: a folder named by the
configuration's settings, not by its variant's name or its run. Nothing is mocked.
(Synthetic acceptance cannot run here: vLLM's CPU sampler refuses it, and the matrix says so;
its GPU form is in the H200 matrices.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from orch_cli import run_cli

# Two runs, two servers compiling on a shared 2-core machine: past the default 900 s there.
pytestmark = [pytest.mark.slow, pytest.mark.e2e, pytest.mark.timeout(2400)]

MATRIX = """
name: cpu-serving
models:
  - {label: tiny-mla, path: builtin:tiny-mla, num_heads: 8}
engine:
  args: [--attention-backend=CPU_MLA, --max-model-len=2048, --max-num-seqs=4]
  env: {VLLM_CPU_KVCACHE_SPACE: "2"}
resources: {accelerator: cpu, cpus_per_rank: 1}
topologies:
  - {tp: 1, mtp: [1]}
workloads:
  - {name: ctx0, prompt_tokens: 1, output_tokens: 64, requests: 2}
variants:
  - {name: first}
  - {name: second}
timeouts: {placement_s: 300, ready_s: 900, request_s: 300, case_s: 1500}
"""


def _rows(run_dir: Path) -> dict[str, dict]:
    rows = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    return {r["variant"]: r for r in rows}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, dict]]:
    """Two runs against one cold cache folder: the first variant, then the second."""
    tmp = tmp_path_factory.mktemp("serving")
    (tmp / "m.yaml").write_text(MATRIX)
    env = {"ORCHESTRATOR_CACHE": str(tmp / "cache")}
    common = ["run", str(tmp / "m.yaml"), "--logs-dir", str(tmp / "logs"), "--quiet"]
    first = run_cli(*common, "--run-id", "one", "--only", "first", timeout=1200, env=env)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    again = run_cli(*common, "--run-id", "two", "--only", "second", timeout=1200, env=env)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    return {"one": _rows(tmp / "logs" / "one"), "two": _rows(tmp / "logs" / "two")}


def test_acceptance_seen_is_read_from_the_servers_counters(runs) -> None:
    for row in (runs["one"]["first"], runs["two"]["second"]):
        assert row["status"] == "passed", row["reason"]
        seen = row["workloads"]["ctx0"]["spec_decode"]
        # MTP 1: one draft token per verification step, ~one step per output token.
        assert seen["drafts"] == seen["draft_tokens"] >= 64
        assert 0 <= seen["accepted_tokens"] <= seen["draft_tokens"]
        assert seen["acceptance_rate"] == pytest.approx(
            seen["accepted_tokens"] / seen["draft_tokens"], abs=1e-4
        )
        assert seen["acceptance_length"] == pytest.approx(1 + seen["acceptance_rate"], abs=1e-3)
        assert "configured_rates" not in seen


def test_startup_phases_cover_the_start(runs) -> None:
    row = runs["one"]["first"]
    phases = row["startup"]["phases"]
    for name in ("imports", "api_server", "engine_init", "weights", "compile", "serving"):
        assert name in phases, phases
    # Consecutive phases from spawn to ready: they add up to the start-up the case timed.
    assert sum(phases.values()) == pytest.approx(row["timings"]["startup_s"], abs=3.0)
    # What vLLM states itself (the CPU runner logs no "torch.compile took" line).
    assert row["startup"]["vllm"]["engine_init_s"] > 0


def test_the_next_server_of_a_configuration_meets_the_first_ones_caches(runs) -> None:
    """The next server of the configuration (the next run's, its variant named otherwise)
    gets the first one's folder and finds its artifacts there. vLLM 0.32's CPU build cannot
    load its own AOT artifact ('function' object has no attribute 'finalize_loading': its
    eager backend) and compiles again, which the record says; the model inspection it caches
    beside them (modelinfos) it does reuse, and its API server phase drops by the two
    inspection subprocesses (target and MTP draft)."""
    first, second = runs["one"]["first"]["startup"], runs["two"]["second"]["startup"]
    assert first["compile_cache_dir"] == second["compile_cache_dir"]
    assert first["compile_cache"] == "miss"
    assert second["compile_cache"] in ("hit", "load-failed"), second
    if second["compile_cache"] == "load-failed":
        assert "finalize_loading" in second["compile_cache_failure"]
    assert second["phases"]["api_server"] < first["phases"]["api_server"]


def test_model_inspections_are_written_to_the_folder_every_configuration_shares(runs) -> None:
    """vLLM writes its model-class inspections through the configuration's link, into the
    one folder a server of any other configuration reads
    (orchestrator.engines.vllm.compile_cache)."""
    folder = Path(runs["one"]["first"]["startup"]["compile_cache_dir"])
    link = folder / "vllm-cache" / "modelinfos"
    assert link.is_symlink() and link.resolve() == (folder.parent / "modelinfos").resolve()
    written = sorted(p.name for p in link.iterdir())
    # The target and its MTP draft, one file each.
    assert any("DeepSeekMTP" in name for name in written), written
    assert len(written) >= 2, written
