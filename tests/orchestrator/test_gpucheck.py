"""`orchestrator gpu-check`: the placement checks (pure logic) and one real run on CPU.

The real run places bundles through a real local Ray that declares two GPUs (so Ray assigns
CUDA_VISIBLE_DEVICES as it would on a GPU node), starts the worker in each through the same
Launcher path as `vllm serve`, and runs the DCP gather over gloo with fusedq's kernel in
Triton's interpreter. The H200 run of the same command is in docs/validation/.
"""

from __future__ import annotations

import json
import subprocess

import pytest
from orch_cli import run_cli

from orchestrator.cluster.gpucheck import (
    GpuCheckError,
    bench_heads,
    parse_tps,
    parse_worker_log,
    placement_problems,
    render_markdown,
)
from orchestrator.cluster.gpucheck_worker import MARKER


def _bundle(name, visible, ids, node="10.0.0.1", count=None, gpu_ids=None):
    return {
        "bundle": name,
        "node_ip": node,
        "cuda_visible_devices": visible,
        "ray_gpu_ids": gpu_ids if gpu_ids is not None else visible.split(","),
        "device_count": count if count is not None else len(ids),
        "devices": [{"pci_bus_id": i} for i in ids],
    }


def test_good_placement_has_no_problems():
    bundles = [_bundle("b0", "0,1", ["A", "B"]), _bundle("b1", "2,3", ["C", "D"])]
    assert placement_problems(2, bundles, cuda=True) == []


def test_overlapping_bundles_are_named():
    bundles = [_bundle("b0", "0,1", ["A", "B"]), _bundle("b1", "1,2", ["B", "C"])]
    (problem,) = placement_problems(2, bundles, cuda=True)
    assert "b1 and b0 share GPU B" in problem


def test_same_bus_id_on_two_nodes_is_not_an_overlap():
    bundles = [_bundle("b0", "0", ["A"]), _bundle("b1", "0", ["A"], node="10.0.0.2")]
    assert placement_problems(1, bundles, cuda=True) == []


@pytest.mark.parametrize(
    ("bundle", "needle"),
    [
        (_bundle("b0", "0", ["A"]), "CUDA_VISIBLE_DEVICES='0', want 2"),
        (_bundle("b0", "0,1", ["A", "B"], count=1), "torch sees 1 devices"),
        (_bundle("b0", "0,1", ["A", "A"]), "repeat a PCI bus id"),
        (_bundle("b0", "0,1", ["A", None]), "no PCI bus id"),
        (_bundle("b0", "0,1", ["A", "B"], gpu_ids=["0"]), "Ray assigned GPUs"),
    ],
)
def test_each_wrong_placement_is_reported(bundle, needle):
    assert any(needle in p for p in placement_problems(2, [bundle], cuda=True))


def test_without_cuda_visible_devices_stand_in_for_bus_ids():
    bundles = [_bundle("b0", "0", []), _bundle("b1", "0", [])]
    problems = placement_problems(1, bundles, cuda=False)
    assert problems == ["b1 and b0 share GPU 0 on 10.0.0.1"]


def test_worker_result_is_the_last_marker_line():
    text = f'noise\n{MARKER}{{"a": 1}}\nmore\n{MARKER}{{"a": 2}}\n'
    assert parse_worker_log(text) == {"a": 2}
    assert parse_worker_log("no result here") is None
    assert parse_worker_log(f"{MARKER}{{broken") is None


def test_bench_heads_follow_the_rank_shape():
    assert bench_heads(8, 64) == ([8], None)
    assert bench_heads(6, 64) == ([11], None)
    assert bench_heads(4, 64) == ([16], None)
    heads, note = bench_heads(2, 64)
    assert heads == [8, 16] and "32 heads per rank" in note


def test_tp_lists():
    assert parse_tps("1,2,4,8") == [1, 2, 4, 8]
    assert parse_tps("2 4") == [2, 4]
    with pytest.raises(GpuCheckError, match="not a list of integers"):
        parse_tps("two")


def test_markdown_says_failed_and_why():
    result = {
        "started_at": "t",
        "ok": False,
        "rounds": [
            {"tp": 8, "skipped": "no node has 8 GPUs (largest: 2)", "bundles": []},
            {
                "tp": 1,
                "bundles": [{**_bundle("b0", "0", ["A"]), "error": "boom <script>"}],
                "placement_problems": [],
            },
        ],
        "audit": {"status": "clean", "summary": "s"},
    }
    md = render_markdown(result)
    assert "**FAILED**" in md and "skipped: no node has 8 GPUs" in md and "FAILED: boom" in md


def _gpu_check(*args: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    return run_cli("gpu-check", *args, timeout=timeout)


def test_bad_input_exits_2_and_launches_nothing(tmp_path):
    out = _gpu_check("--tp", "0", "--out", str(tmp_path / "x"), timeout=60)
    assert out.returncode == 2 and "--tp" in out.stderr
    assert not (tmp_path / "x").exists()
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep").write_text("mine")
    out = _gpu_check("--out", str(tmp_path / "full"), timeout=60)
    assert out.returncode == 2 and "not empty" in out.stderr
    assert (tmp_path / "full" / "keep").read_text() == "mine"


@pytest.mark.slow
def test_real_run_on_cpu_with_declared_gpus(tmp_path):
    out_dir = tmp_path / "check"
    out = _gpu_check(
        "--tp", "1,2,4", "--local-gpus", "2", "--allow-cpu", "--out", str(out_dir)
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    result = json.loads((out_dir / "gpu-check.json").read_text())
    by_tp = {r["tp"]: r for r in result["rounds"]}
    # Two 1-GPU bundles side by side, each with its own GPU; then one 2-GPU bundle.
    assert sorted(b["cuda_visible_devices"] for b in by_tp[1]["bundles"]) == ["0", "1"]
    (tp2,) = by_tp[2]["bundles"]
    assert sorted(tp2["cuda_visible_devices"].split(",")) == ["0", "1"]
    assert "no node has 4 GPUs" in by_tp[4]["skipped"]
    # The worker ran the driver's shipped fusedq, not the checkout's.
    assert "py_modules_files" in tp2["fusedq_file"]
    dcp = tp2["dcp"]
    assert dcp["ok"] and dcp["world"] == 2
    for rank in dcp["ranks"]:
        for check in rank["checks"]:
            assert check["shape"] == [5, 16, 576]
            assert check["gather_equals_local_fused"] and check["within_tolerance_vs_staged"]
    assert result["audit"]["status"] == "clean"
    assert "| 2 | bundle0 |" in (out_dir / "gpu-check.md").read_text()
