"""The worker extension that switches a running server between staged and fused: its contract
on stand-in workers, then (slow, e2e) real ``vllm serve`` runs flipped over vLLM's dev-mode
``/collective_rpc`` endpoint -- on CPU (eager, the tiny model, the fused op in Triton's
interpreter) and, ``gpu``-marked, on a CUDA vLLM whose CUDA graphs must be captured again
(scripts/gpu/switch_check.sh runs those on the H200).
"""

from __future__ import annotations

import json
import os
import shutil
import types
from pathlib import Path

import pytest
import torch
from test_vllm_plugin import stand_in_layer
from tiny_vllm import (
    DISABLED,
    E2E_TIMEOUT_S,
    ENABLED,
    EXTENSION,
    FIRST_STAGED,
    FIRST_USE,
    MAX_TOKENS,
    PROFILE_STEPS,
    SWITCHED,
    assert_greedy_agree,
    log_lines,
    switch_run,
    vllm_server,
)

from fusedq import contract
from fusedq.vllm import layer_plan, patch, report, switch, worker_ext
from fusedq.vllm.worker_ext import FusedqWorkerExtension


def eager_worker(**runner) -> types.SimpleNamespace:
    """What the extension reads of a vLLM worker: its config, device and model runner."""
    from vllm.config import CUDAGraphMode

    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(enforce_eager=True),
        compilation_config=types.SimpleNamespace(cudagraph_mode=CUDAGraphMode.NONE),
    )
    return types.SimpleNamespace(
        vllm_config=config, device=torch.device("cpu"), model_runner=types.SimpleNamespace(**runner)
    )


def graph_worker(**runner) -> types.SimpleNamespace:
    """A worker as vLLM's V1 GPU runner has it with CUDA graphs (nothing here runs on a GPU:
    the re-capture itself is replaced where it is used)."""
    from vllm.config import CUDAGraphMode

    worker = eager_worker(**runner)
    worker.vllm_config.model_config.enforce_eager = False
    worker.vllm_config.compilation_config.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    worker.device = types.SimpleNamespace(type="cuda")
    return worker


def set_up_layers(mla, heads: int = 8, n: int = 2) -> list:
    patch.apply(patch.check_vllm())
    layers = []
    for i in range(n):
        layer = stand_in_layer(mla, 8, fp8=False, gen=torch.Generator().manual_seed(i))
        layer.num_heads, layer.layer_name = heads, f"model.layers.{i}.self_attn.attn"
        layer_plan.setup_layer(layer)
        layers.append(layer)
    return layers


def test_set_path_on_an_eager_worker(mla, monkeypatch):
    monkeypatch.delenv(report.MODE_ENV, raising=False)
    layers = set_up_layers(mla)  # held, as vLLM's model holds them
    assert switch.planned_layers() == layers
    worker = eager_worker()
    state = FusedqWorkerExtension.fusedq_state(worker)
    assert state["line"].startswith(ENABLED) and state["kernels"]
    assert {k: state[k] for k in ("path", "active", "layers", "query", "graphs", "reason")} == {
        "path": "fused", "active": True, "layers": 2, "query": ["tensor"],
        "graphs": "no CUDA graphs: enforce-eager", "reason": None,
    }  # fmt: skip
    got = FusedqWorkerExtension.fusedq_set_path(worker, "staged")
    assert isinstance(got.pop("seconds"), float)
    assert got == {"path": "staged", "recaptured": False, "layers": 2}
    assert FusedqWorkerExtension.fusedq_state(worker)["path"] == "staged"
    got = FusedqWorkerExtension.fusedq_set_path(worker, "staged")  # already: nothing changes
    assert (got["path"], got["recaptured"]) == ("staged", False)
    with pytest.raises(ValueError, match="decode path 'eager' is not one of staged, fused"):
        FusedqWorkerExtension.fusedq_set_path(worker, "eager")
    assert switch.current_path() == "staged"


def test_seed_restarts_the_workers_random_stream():
    """fusedq_seed: what vLLM's synthetic MTP acceptance draws next is fixed by the seed (the
    default generator; on a GPU every device's, which torch.manual_seed seeds too)."""
    worker = eager_worker()
    assert FusedqWorkerExtension.fusedq_seed(worker, "5") == {
        "seed": 5,
        "path": switch.current_path(),
    }
    first = torch.rand(4, dtype=torch.float64)
    torch.rand(3)  # the stream moves on
    FusedqWorkerExtension.fusedq_seed(worker, 5)
    assert torch.equal(torch.rand(4, dtype=torch.float64), first)
    FusedqWorkerExtension.fusedq_seed(worker, 6)
    assert not torch.equal(torch.rand(4, dtype=torch.float64), first)


def test_set_path_refuses_where_the_plugin_is_not_active(mla, monkeypatch):
    monkeypatch.delenv(report.MODE_ENV, raising=False)
    layers = set_up_layers(mla, heads=4)
    assert layers and not switch.planned_layers()
    worker = eager_worker()
    with pytest.raises(switch.FusedqInactiveError, match=r"not active: .*num_heads=4 is not"):
        FusedqWorkerExtension.fusedq_set_path(worker, "staged")
    state = FusedqWorkerExtension.fusedq_state(worker)
    assert (state["path"], state["active"], state["layers"]) == ("staged", False, 0)
    assert state["line"].startswith(DISABLED) and "num_heads=4" in state["reason"]


def test_set_path_recaptures_graphs_after_switching(mla, monkeypatch):
    """Where graphs were captured, each change of path re-captures them once, after the
    switch (so capture runs the new path); no change captures nothing."""
    monkeypatch.delenv(report.MODE_ENV, raising=False)
    layers = set_up_layers(mla)  # held, as vLLM's model holds them
    assert switch.planned_layers() == layers
    captured: list[str] = []
    monkeypatch.setattr(worker_ext, "recapture", lambda w: captured.append(switch.current_path()))
    worker = graph_worker(cudagraph_dispatcher=object(), capture_model=lambda: None)
    got = FusedqWorkerExtension.fusedq_set_path(worker, "staged")
    assert (got["path"], got["recaptured"], captured) == ("staged", True, ["staged"])
    assert FusedqWorkerExtension.fusedq_set_path(worker, "staged")["recaptured"] is False
    FusedqWorkerExtension.fusedq_set_path(worker, "fused")
    assert captured == ["staged", "fused"]
    assert FusedqWorkerExtension.fusedq_state(worker)["graphs"] == "FULL_AND_PIECEWISE"


def test_failed_recapture_restores_the_previous_path(mla, monkeypatch):
    monkeypatch.delenv(report.MODE_ENV, raising=False)
    layers = set_up_layers(mla)  # held, as vLLM's model holds them
    assert switch.planned_layers() == layers
    captured: list[str] = []

    def recapture(worker) -> None:
        captured.append(switch.current_path())
        if len(captured) == 1:
            raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(worker_ext, "recapture", recapture)
    worker = graph_worker(cudagraph_dispatcher=object(), capture_model=lambda: None)
    with pytest.raises(RuntimeError, match="out of memory"):
        FusedqWorkerExtension.fusedq_set_path(worker, "staged")
    assert captured == ["staged", "fused"] and switch.current_path() == "fused"


def test_set_path_refuses_a_runner_it_cannot_recapture(mla, monkeypatch):
    """vLLM's V2 GPU runner keeps its own graph manager: refused before anything switches."""
    monkeypatch.delenv(report.MODE_ENV, raising=False)
    layers = set_up_layers(mla)  # held, as vLLM's model holds them
    assert switch.planned_layers() == layers
    worker = graph_worker(cudagraph_manager=object(), capture_model=lambda: None)
    with pytest.raises(NotImplementedError, match="only vLLM's V1 GPU model runner"):
        FusedqWorkerExtension.fusedq_set_path(worker, "staged")
    assert switch.current_path() == "fused"


def test_the_rpc_names_the_orchestrator_calls_are_the_extensions_methods():
    """The orchestrator calls the methods by their names in fusedq.contract; a rename on
    either side would fail every switch-mode run at its first flip."""
    for name in (contract.RPC_SET_PATH, contract.RPC_STATE):
        assert callable(getattr(FusedqWorkerExtension, name, None)), name
    assert switch.DECODE_PATHS == contract.DECODE_PATHS


# --- end to end: a real server flipped over /collective_rpc ---------------------------------


def check_switch_run(run: dict, log_text: str, *, layers: int, recaptured: bool) -> None:
    """What a flipped server must show, on CPU and GPU alike (``log_text``: its log up to the
    end of the run)."""

    def lines(needle: str) -> list[str]:
        return [ln for ln in log_text.splitlines() if needle in ln]

    for key in ("0:staged", "1:fused", "2:staged"):
        path = key.split(":")[1]
        step = run[key]
        for result in step["results"]:
            assert isinstance(result.pop("seconds"), float)
            assert result == {"path": path, "recaptured": recaptured, "layers": layers}, key
        assert [s["path"] for s in step["state"]] == [path] * len(step["results"])
        query = step["query"]
        print(f"{key}: {query.path} x{query.occurrences} {query.names}")
        assert query.path == path and query.occurrences >= layers, (key, query)
    start, staged, fused, staged_again = (
        run[k]["greedy"] if k != "start" else run[k]
        for k in ("start", "0:staged", "1:fused", "2:staged")
    )
    assert len(start[0]) == MAX_TOKENS
    # One server, one path: the same tokens and logprobs each time it runs.
    assert fused == start and staged_again == staged
    assert_greedy_agree(fused, staged)
    # Per worker: two switches to staged, one back; the first decode query on each path after
    # each switch (and the fused one at start-up) says which path the hook took.
    workers = len(run["state"])
    assert len(lines(SWITCHED + "staged")) == 2 * workers
    assert len(lines(SWITCHED + "fused")) == workers
    assert len(lines(FIRST_STAGED)) == 2 * workers
    assert len(lines(FIRST_USE)) == 2 * workers
    assert not lines("Traceback")


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_e2e_switch_on_a_running_cpu_server(switch_server):
    """TP1 on CPU, eager: nothing to re-capture; each flip shows in the tokens, the log and
    the profile (the fused op's custom op, or vLLM's aten::bmm + aten::cat). The server is
    tiny_vllm.record_switch_server's, shared with test_vllm_plugin.py."""
    run = switch_server
    (state,) = run["state"]
    assert (state["path"], state["active"], state["layers"], state["query"]) == (
        "fused", True, 2, ["tensor"]
    )  # fmt: skip
    assert state["graphs"] == "no CUDA graphs: enforce-eager"
    check_switch_run(run, run["run_log"], layers=2, recaptured=False)
    # A refused switch: its traceback goes to the log, the server keeps serving, on its path.
    assert run["after"] == run["2:staged"]["greedy"]
    assert run["refused"]["status"] >= 400
    assert "decode path 'eager' is not one of staged, fused" in run["log"]
    names = run["1:fused"]["query"].names
    assert names == {"fusedq::mla_query_projection": 2 * PROFILE_STEPS}, names
    n = 2 * PROFILE_STEPS
    assert run["0:staged"]["query"].names == {"aten::bmm": n, "aten::cat": n}


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_e2e_switch_refused_where_the_plugin_is_not_active(tp2_server):
    """TP2 on the 8-head model (4 heads per rank: not qualified): both workers say why over
    the RPC, and a switch is refused without disturbing the server (tiny_vllm's
    record_tp2_server, shared with test_vllm_plugin.py)."""
    states = tp2_server["states"]
    ids, _ = tp2_server["after"]
    assert len(states) == 2 and len({s["pid"] for s in states}) == 2
    for s in states:
        assert (s["active"], s["path"], s["layers"]) == (False, "staged", 0)
        assert "num_heads=4 is not qualified" in s["reason"]
    assert tp2_server["refused"]["status"] >= 400 and len(ids) == MAX_TOKENS
    assert "the fused MLA query is not active" in tp2_server["log"]


# --- on a CUDA vLLM (the H200): the graphs are captured again ------------------------------

GPU_ENGINE_ARGS = (*EXTENSION, "--gpu-memory-utilization", "0.3")
# The tiny GLM-5-geometry model as a DSA model: vLLM 0.26 takes its sparse-MLA decode path
# (FLASH_ATTN_MLA_SPARSE on sm_90) whenever the config has index_topk. Values as GLM-5's
# (transformers' configuration_glm_moe_dsa), weights from vLLM's dummy loader.
DSA_FIELDS = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "index_topk": 2048,
    "index_n_heads": 32,
    "index_head_dim": 128,
}


def gpu_model(kind: str, workdir: Path) -> tuple[Path, tuple[str, ...], str]:
    """(model directory, extra engine args, the query form the plan must pick) for ``kind``:
    ``dense`` (tiny-glm5, FLASH_ATTN_MLA) or ``dsa`` (the same with DSA_FIELDS, dummy weights)."""
    from orchestrator.models.tinymodel import build_tiny_model

    model = build_tiny_model(name="tiny-glm5", heads=16, layers=4, mtp=False)
    if kind == "dense":
        return model, (), "tensor"
    dsa = workdir / "tiny-glm5-dsa"
    shutil.copytree(model, dsa, ignore=shutil.ignore_patterns("*.safetensors*"))
    config = json.loads((dsa / "config.json").read_text())
    (dsa / "config.json").write_text(json.dumps({**config, **DSA_FIELDS}, indent=2) + "\n")
    return dsa, ("--load-format", "dummy"), "pair"


# One server start (~70 s on the H200 with graphs), three captures, four short requests, three
# profiles; under scripts/gpu/switch_check.sh's per-step limit, so a hung run still stops the
# server on its way out.
GPU_TIMEOUT_S = 290


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(GPU_TIMEOUT_S)
@pytest.mark.parametrize("kind", ["dense", "dsa"])
def test_e2e_switch_recaptures_cuda_graphs(tmp_path, kind):
    """A CUDA vLLM with its default CUDA graphs: every flip re-captures them, and the profile
    after it shows the fused kernel, or vLLM's W_UK_T GEMM, in each layer's decode step (both
    launched from the graph); the DSA model's sparse backend is handed the pair of views.
    ``FUSEDQ_SWITCH_OUT``: a folder that receives the server log, traces and a summary."""
    pytest.importorskip("vllm")
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    model, extra, form = gpu_model(kind, tmp_path)
    env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_USE_FLASHINFER_SAMPLER": "0"}
    profile = tmp_path / "profile"
    out = os.environ.get("FUSEDQ_SWITCH_OUT")
    try:
        with vllm_server(
            tmp_path / kind, env, profile_dir=profile, model=model,
            engine_args=(*GPU_ENGINE_ARGS, *extra),
        ) as (port, log):  # fmt: skip
            run = switch_run(port, profile)
        (state,) = run["state"]
        assert (state["path"], state["active"], state["query"]) == ("fused", True, [form])
        assert not state["graphs"].startswith("no CUDA graphs"), state["graphs"]
        enabled = log_lines(log, ENABLED)
        assert len(enabled) == 1 and f"query={form}, prewarmed M=1," in enabled[0], enabled
        check_switch_run(run, log.read_text(errors="replace"), layers=4, recaptured=True)
    finally:
        if out:
            dest = Path(out) / f"switch-{kind}"
            shutil.copytree(tmp_path, dest, dirs_exist_ok=True, ignore=shutil.ignore_patterns(
                "*.safetensors*", "vllm-cache", "inductor",
            ))  # fmt: skip
            if "run" in locals():
                summary = {k: v for k, v in run.items() if k in ("state", "start")}
                for k, v in run.items():
                    if ":" in k:
                        q = v["query"]
                        summary[k] = {
                            "results": v["results"], "greedy": v["greedy"],
                            "query": {"path": q.path, "occurrences": q.occurrences,
                                      "names": q.names, "per_layer_us": q.per_layer_us},
                        }  # fmt: skip
                (dest / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
