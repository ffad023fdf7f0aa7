"""Switch mode end to end: one real `vllm serve` (CPU build, the tiny model, eager) placed
through a real local Ray serves both variants of an A/B, the orchestrator flipping its path
between blocks through vLLM's real dev endpoint (POST /collective_rpc), with a worker
extension of this directory loaded through the matrix's PYTHONPATH (switch_extension.py: the
methods fusedq's extension promises). Then both paths are profiled on that server, the rows
are split per variant, and every report gets the A/B.

The matrix sets a stopping rule whose target any CPU run meets (±1000 %), so the server plans
6 rounds and stops at its first look, after 4: the loop cuts a real schedule at a look, and
every report says so.

About a minute and a half on a 2-core machine, most of it one vLLM start-up.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from orch_cli import REPO, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

HERE = Path(__file__).resolve().parent
TOPOLOGY = "tiny-mla/tp1-dcp1-mtp0"
BLOCKS = 4
MAX_BLOCKS = 6
MATRIX = f"""\
name: switch-e2e
models: [{{label: tiny-mla, path: "builtin:tiny-mla", num_heads: 8}}]
engine:
  args: [--enforce-eager, --attention-backend=CPU_MLA, --max-model-len=1024, --max-num-seqs=4]
  env:
    VLLM_CPU_KVCACHE_SPACE: "1"
    PYTHONPATH: {HERE}
resources: {{accelerator: cpu}}
topologies: [{{tp: 1}}]
workloads:
  - {{name: ctx0, prompt_tokens: 1, output_tokens: 16, requests: 2, same_tokens: true}}
variants:
  - {{name: staged, env: {{FUSEDQ_MLA_QUERY: "0"}}}}
  - {{name: fused}}
ab:
  mode: switch
  blocks: {BLOCKS}
  extension: switch_extension.PathSwitchExtension
  target_half_width_pct: 1000
  max_blocks: {MAX_BLOCKS}
profile: {{decode_steps: 2}}
timeouts: {{placement_s: 300, ready_s: 600, request_s: 120, case_s: 1200}}
"""


@pytest.fixture(scope="module")
def switch_run(tmp_path_factory):
    logs = tmp_path_factory.mktemp("logs")
    matrix = logs / "switch.yaml"
    matrix.write_text(MATRIX)
    out = run_cli(
        "run", str(matrix), "--logs-dir", os.path.relpath(logs, REPO), "--run-id", "sw",
        "--quiet", timeout=1200,
    )  # fmt: skip
    root = logs / "sw"
    if not (root / "results.jsonl").is_file():  # say why, not only that a file is missing
        pytest.fail(f"the run wrote no rows (exit {out.returncode}):\n{out.stderr[-4000:]}")
    rows = [json.loads(x) for x in (root / "results.jsonl").read_text().splitlines()]
    return {"out": out, "root": root, "rows": {r["variant"]: r for r in rows}, "all": rows}


def test_one_server_serves_both_variants_in_balanced_rounds(switch_run):
    out, rows = switch_run["out"], switch_run["rows"]
    assert out.returncode == 0, f"{out.stdout}\n{out.stderr[-4000:]}"
    assert [r["case_id"] for r in switch_run["all"]] == [
        f"{TOPOLOGY}/staged/s1",
        f"{TOPOLOGY}/fused/s1",
    ]
    # Rounds ABBA BAAB: each path's blocks at mean position 4.5.
    plan = ["staged", "fused", "fused", "staged", "fused", "staged", "staged", "fused"]
    for variant, blocks in (("staged", [1, 4, 6, 7]), ("fused", [2, 3, 5, 8])):
        row = rows[variant]
        assert row["status"] == "passed", row.get("reason")
        sw = row["switch"]
        assert sw["server_case"] == f"{TOPOLOGY}/switch/s1"
        assert sw["schedule"] == plan and sw["blocks"] == blocks and sw["path"] == variant
        # A flip before each block and one before the path's profile; every worker (TP1: one)
        # answered from inside vLLM with the loaded model's two MLA layers.
        assert [f["block"] for f in sw["flips"]] == [*blocks, 9 if variant == "staged" else 10]
        assert sw["seeds"] == []  # no synthetic acceptance on CPU: nothing to reseed
        for f in sw["flips"]:
            [worker] = f["workers"]
            assert worker["path"] == variant and worker["layers"] == 2 and worker["rank"] == 0
        ctx0 = row["workloads"]["ctx0"]
        assert [r["repeat"] for r in ctx0["repeats"]] == [1, 2, 3, 4]
        assert ctx0["errors"] == 0 and all(r["aggregate_tok_s"] > 0 for r in ctx0["repeats"])
    # Block k of each path sent the same prompts: greedy tokens compare request by request.
    assert rows["fused"]["same_tokens"]["ctx0"]["verdict"] == "identical"
    assert rows["fused"]["same_tokens"]["ctx0"]["requests"] == 2 * BLOCKS
    # Each block's figures are in the run log as it finishes, the same as its row's repeat.
    log = (switch_run["root"] / "orchestrator.log").read_text()
    rounds = {"staged": 0, "fused": 0}
    for block, variant in enumerate(plan, 1):
        repeat = rows[variant]["workloads"]["ctx0"]["repeats"][rounds[variant]]
        rounds[variant] += 1
        said = f"block {block}: {variant} ctx0: {repeat['aggregate_tok_s']:.2f} tok/s, TPOT p50"
        assert f"{TOPOLOGY}/switch/s1: {said}" in log, log


def test_the_server_ran_once_with_the_extension_and_its_time_counts_once(switch_run):
    root, rows = switch_run["root"], switch_run["rows"]
    server_dir = root / "cases" / "tiny-mla__tp1-dcp1-mtp0__switch__s1"
    log = (server_dir / "server.log").read_text()
    assert log.count("Starting vLLM server on") == 1  # one start-up served both paths
    argv = rows["staged"]["server"]["argv"]
    assert "--worker-extension-cls" in argv and "--no-enable-prefix-caching" in argv
    assert rows["fused"]["env"]["VLLM_SERVER_DEV_MODE"] == "1"
    assert rows["staged"]["server"] == rows["fused"]["server"]
    assert "startup_s" in rows["staged"]["timings"] and "startup_s" not in rows["fused"]["timings"]
    assert rows["fused"]["timings"]["workload_ctx0_s"] > 0
    for variant in ("staged", "fused"):
        slug = f"tiny-mla__tp1-dcp1-mtp0__{variant}__s1"
        assert not (root / "cases" / slug / "server.log").exists()
        records = (root / "cases" / slug / "requests-ctx0.jsonl").read_text().splitlines()
        assert sorted({json.loads(r)["repeat"] for r in records}) == [0, 1, 2, 3]


def test_each_path_is_profiled_on_the_same_server(switch_run):
    rows = switch_run["rows"]
    files = {}
    for variant in ("staged", "fused"):
        profile = rows[variant]["profile"]
        assert profile["decode_steps"] == 2 and profile["layers"] == 2
        [trace] = profile["traces"]
        assert trace["query"]["occurrences"] == 4  # 2 layers x 2 steps, found once each
        files[variant] = trace["file"]
    assert files["staged"] != files["fused"]


def test_every_report_states_the_ab_over_rounds(switch_run):
    root, out = switch_run["root"], switch_run["out"]
    md = (root / "report.md").read_text()
    assert "## A/B: fused vs staged, 95% interval over rounds" in md
    assert "Sampling unit: rounds: 4 to 6 rounds of one block per variant on each of 1 server" in md
    assert "through switch_extension.PathSwitchExtension; every worker confirmed" in md
    assert "Order that ran: ABBA BAAB (A staged, B fused): drift-balanced" in md
    # The CPU build's staged step is aten::bmm then aten::cat.
    assert "staged baseline in vLLM 0.32" in md and "bmm + cat" in md
    data = json.loads((root / "report.json").read_text())
    assert {r["unit"] for r in data["ab"]["results"]} == {"rounds"}
    # Output tok/s (primary), TPOT p50 and mean, TTFT p50: each over the same rounds.
    assert [len(r["pairs"]) for r in data["ab"]["results"]] == [BLOCKS] * 4
    assert [r["role"] for r in data["ab"]["results"]] == ["primary"] + ["secondary"] * 3
    assert [r["metric"] for r in data["ab"]["results"]][-1] == "ttft_p50_ms"
    assert "A/B: fused vs staged, 95% interval over rounds" in out.stdout
    # The stopping rule: one look of two planned, stopped there, said in every report.
    stop = "1 look(s) (4 rounds: fused ±"
    said = "stopped after 4 rounds, target reached; adjusted interval fused"
    assert stop in md and said in md
    assert said in " ".join(out.stdout.split())
    stopping = data["ab"]["stopping"]
    assert stopping["looks_planned"] == [BLOCKS, MAX_BLOCKS]
    [server] = stopping["servers"]
    assert (server["rounds"], server["stopped"]) == (BLOCKS, "target reached")
    assert "Bonferroni over 2 looks" in data["ab"]["results"][0]["method"]
    log = (root / "orchestrator.log").read_text()
    assert "look 1 of 2 after 4 rounds: fused ±" in log and "stop, target reached" in log
    again = run_cli("compare", str(root), str(root), timeout=120)
    assert again.returncode == 0, again.stdout + again.stderr
    assert f"| {TOPOLOGY}/fused | ctx0 |" in again.stdout
