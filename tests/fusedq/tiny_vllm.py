"""Real CPU `vllm serve` of the tiny model for fusedq's end-to-end tests: start and stop one,
ask it for greedy tokens, profile its decode, flip its decode path over the worker extension's
RPC, and the recorded runs that tests/fusedq/conftest.py shares between test_vllm_plugin.py
and test_vllm_worker_ext.py (each server started once, asked everything its tests read, and
stopped before they read it).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import lanes
import pytest
import torch

from fusedq import contract

PROMPT = [5, 17, 99, 123, 7, 300, 42, 8, 1000, 64, 11, 512]
MAX_TOKENS = 16
# Greedy tokens must match the staged run exactly; when bf16 rounding (fp32 accumulation
# order in the kernel vs torch.bmm) flips a near-tie, the tokens after it legitimately
# diverge, so the fallback check is on the first divergent step's chosen-token logprobs:
# both runs' top-1 logprobs there must agree within this many nats (a tie, not a bug).
LOGPROB_TOL = 0.02
ENABLED = f"{contract.ENABLED_LINE} ("
DISABLED = f"{contract.DISABLED_LINE}: "
FIRST_USE = "fusedq: first fused MLA decode query"
# A test's set-up may start two servers (25-50 s each on a 2-core machine, minutes when it is
# busy or half as fast) and decode in Triton's interpreter (~0.1-1 s a layer and step).
E2E_TIMEOUT_S = 1800


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# The CPU build's MLA backend that takes the generic query path (DESIGN.md), run eagerly.
CPU_ENGINE_ARGS = ("--attention-backend", "CPU_MLA", "--enforce-eager")


def vllm_cli() -> Path:
    """vLLM's ``vllm`` command: beside this Python (a venv), else on PATH (a ``--target``
    install whose ``bin`` is on PATH). Where vLLM imports but has no command, the test that
    needs a server skips, naming why, instead of failing on a missing file."""
    beside = Path(sys.executable).with_name("vllm")
    if beside.is_file():
        return beside
    found = shutil.which("vllm")
    if found is None:
        pytest.skip(
            f"vLLM imports but its `vllm` command is neither beside {sys.executable} nor on PATH"
        )
    return Path(found)


@contextlib.contextmanager
def vllm_server(
    workdir: Path,
    env: dict[str, str],
    *,
    tp: int = 1,
    expect_ready: bool = True,
    profile_dir: Path | None = None,
    model: Path | None = None,
    engine_args: Sequence[str] = CPU_ENGINE_ARGS,
):
    """Start ``vllm serve`` on the tiny model (loopback only), yield (port, log path), stop it
    (SIGTERM to its process group, SIGKILL after 20 s). `profile_dir`: with vLLM's torch
    profiler writing there (the orchestrator's profile phase's flag). `model` (default the
    CPU tiny model) and `engine_args` (default the CPU build's) serve something else."""
    from orchestrator.engines.vllm.compile_cache import inductor_dir, share_model_info
    from orchestrator.engines.vllm.server import PROFILER_FLAG, profiler_config
    from orchestrator.models.tinymodel import build_tiny_model

    model = model if model is not None else build_tiny_model()
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    full_env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("TRITON_INTERPRET", "FUSEDQ_MLA_QUERY", "FUSEDQ_MLA_FRONT", "VLLM_PLUGINS")
    }
    # vLLM binds ZeroMQ IPC sockets under TMPDIR and a socket path holds at most 107 bytes;
    # pytest's tmp_path is deeper than that, so the server gets a short private temp dir.
    short_tmp = tempfile.mkdtemp(prefix="fq-")
    full_env.update(
        VLLM_HOST_IP="127.0.0.1",
        VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_CACHE_ROOT=str(workdir / "vllm-cache"),
        # The orchestrator's folder of every configuration
        # (orchestrator.engines.vllm.compile_cache): the sampler's logprobs gather is compiled once
        # for all of the suite's servers.
        TORCHINDUCTOR_CACHE_DIR=str(inductor_dir()),
        TMPDIR=short_tmp,
    )
    if tp == 2:
        full_env["VLLM_CPU_OMP_THREADS_BIND"] = "0|1"
    elif lanes.LANE_CORE is not None:  # the suite's lanes: this lane's own core
        full_env["VLLM_CPU_OMP_THREADS_BIND"] = lanes.LANE_CORE
    else:
        # TP1: vLLM's `auto` binding (worker on core 0) measured 4x faster than "0-1" here.
        full_env.pop("VLLM_CPU_OMP_THREADS_BIND", None)
    full_env.update(env)
    vllm_bin = vllm_cli()
    argv = [
        str(vllm_bin), "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
        *engine_args, "--max-model-len", "4096", "--tensor-parallel-size", str(tp),
        "--max-num-seqs", "4",
    ]  # fmt: skip
    if profile_dir is not None:
        argv += [PROFILER_FLAG, profiler_config(str(profile_dir.absolute()))]
    # vLLM's model-class inspection (a subprocess, ~11 s) once for every server of the suite,
    # as the orchestrator shares it between configurations.
    share_model_info(Path(full_env["VLLM_CACHE_ROOT"]))
    log = workdir / "server.log"
    with open(log, "wb") as fh:
        proc = subprocess.Popen(
            argv, env=full_env, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        if expect_ready:
            _wait_ready(proc, port, log)
        else:
            proc.wait(timeout=600)
        yield port, log
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        shutil.rmtree(short_tmp, ignore_errors=True)


def _wait_ready(proc: subprocess.Popen, port: int, log: Path, timeout: float = 600) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve exited {proc.returncode}:\n{log.read_text()[-4000:]}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=2).status_code == 200:
                return
        time.sleep(1)
    raise AssertionError(f"vllm serve not ready after {timeout} s:\n{log.read_text()[-4000:]}")


def _model(port: int) -> str:
    import httpx

    return httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()["data"][0]["id"]


def _completions(
    port: int, model: str, prompt, max_tokens: int, timeout: float
) -> list[tuple[list[int], list[float]]]:
    """Greedy token ids and their logprobs of each choice of one completion request (one per
    prompt where ``prompt`` is a list of prompts), in prompt order."""
    import httpx

    body = _greedy_body(model, prompt, max_tokens)
    reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=timeout)
    reply.raise_for_status()
    out = []
    for choice in sorted(reply.json()["choices"], key=lambda c: c["index"]):
        lp = choice["logprobs"]
        out.append((_token_ids(lp["tokens"]), lp["token_logprobs"]))
    return out


def _greedy_body(model: str, prompt, max_tokens: int) -> dict:
    """A greedy completion request's body: token ids and their logprobs back, no early end."""
    return {
        "model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
        "logprobs": 1, "return_tokens_as_token_ids": True, "ignore_eos": True,
    }  # fmt: skip


def _token_ids(tokens: Sequence[str]) -> list[int]:
    return [int(t.removeprefix("token_id:")) for t in tokens]


def greedy(port: int) -> tuple[list[int], list[float]]:
    """Greedy token ids and their logprobs for the fixed prompt."""
    return _completions(port, _model(port), PROMPT, MAX_TOKENS, timeout=600)[0]


def greedy_together(
    port: int, prompts: Sequence[list[int]], max_tokens: int = MAX_TOKENS
) -> list[tuple[list[int], list[float]]]:
    """Greedy token ids and logprobs of each prompt, sent in one completion request: the
    server takes them in at once, so they run in the same steps from the first decode on."""
    return _completions(port, _model(port), [list(p) for p in prompts], max_tokens, timeout=900)


def greedy_batch(
    port: int, prompts: Sequence[tuple[list[int], int]]
) -> list[tuple[list[int], list[float]]]:
    """Greedy token ids and logprobs of each ``(prompt, max_tokens)``, all requests sent at
    once (one thread each), so the server batches them and steps mix decode and prefill."""
    from concurrent.futures import ThreadPoolExecutor

    model = _model(port)

    def one(case: tuple[list[int], int]) -> tuple[list[int], list[float]]:
        prompt, max_tokens = case
        return _completions(port, model, prompt, max_tokens, timeout=900)[0]

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(one, prompts))


def greedy_staggered(
    port: int, first: tuple[list[int], int], second: tuple[list[int], int]
) -> list[tuple[list[int], list[float]]]:
    """Greedy token ids and logprobs of two ``(prompt, max_tokens)`` requests, the second sent
    once the first has streamed its first token. The first then decodes alone until the
    second arrives, so the step that takes the second's prefill holds the first's one decode
    token beside it: a mixed step whatever the timing, as long as ``first`` still has tokens to
    produce (a concurrent batch mixes only when its arrivals happen to straddle a step)."""
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    model = _model(port)
    body = _greedy_body(model, *first) | {"stream": True}
    ids: list[int] = []
    lps: list[float] = []
    url = f"http://127.0.0.1:{port}/v1/completions"
    with (
        ThreadPoolExecutor(1) as pool,
        httpx.stream("POST", url, json=body, timeout=900) as reply,
    ):
        reply.raise_for_status()
        later = None
        for line in reply.iter_lines():
            data = line.removeprefix("data: ").strip()
            if not data or data == "[DONE]" or not line.startswith("data: "):
                continue
            for choice in json.loads(data)["choices"]:
                lp = choice.get("logprobs") or {}
                ids += _token_ids(lp.get("tokens") or [])
                lps += lp.get("token_logprobs") or []
            if ids and later is None:
                later = pool.submit(_completions, port, model, second[0], second[1], 900)
        assert later is not None, f"the first request streamed no token: {ids}"
        return [(ids, lps), later.result()[0]]


# Decode steps the staged and fused servers are profiled for (interpreted fused query: ~1 s
# per layer and step).
PROFILE_STEPS = 2


def profile_decode(port: int) -> None:
    """What the orchestrator's profile phase does: start the profiler, one one-token request
    of PROFILE_STEPS output tokens alone on the server, stop the profiler."""
    import httpx

    from orchestrator.engines.vllm.server import profile_request

    base = f"http://127.0.0.1:{port}"
    model = httpx.get(f"{base}/v1/models", timeout=10).json()["data"][0]["id"]
    profile_request(base, "start", timeout_s=120)
    body = {"model": model, "prompt": [5], "max_tokens": PROFILE_STEPS, "min_tokens":
            PROFILE_STEPS, "ignore_eos": True, "temperature": 0}  # fmt: skip
    httpx.post(f"{base}/v1/completions", json=body, timeout=600).raise_for_status()
    profile_request(base, "stop", timeout_s=300)


def log_lines(log: Path, needle: str) -> list[str]:
    return [ln for ln in log.read_text(errors="replace").splitlines() if needle in ln]


def worker_pids(lines: list[str]) -> set[str]:
    return {m.group(1) for ln in lines if (m := re.search(r"pid=(\d+)\)", ln))}


def assert_greedy_agree(
    fused: tuple[list[int], list[float]], staged: tuple[list[int], list[float]]
) -> None:
    """The fused run's greedy tokens equal the staged run's, or part at a near-tie (see
    LOGPROB_TOL) after equal tokens; equal tokens carry logprobs within LOGPROB_TOL."""
    (fused_ids, fused_lp), (staged_ids, staged_lp) = fused, staged
    same = fused_ids == staged_ids
    print(f"greedy ids {'identical' if same else 'differ'}: fused {fused_ids} staged {staged_ids}")
    print(f"logprobs fused {fused_lp}\nlogprobs staged {staged_lp}")
    if not same:
        first = next(
            i for i, (a, b) in enumerate(zip(fused_ids, staged_ids, strict=True)) if a != b
        )
        assert abs(fused_lp[first] - staged_lp[first]) <= LOGPROB_TOL, (
            first,
            fused_ids,
            staged_ids,
        )
        assert fused_ids[:first] == staged_ids[:first]
    else:
        torch.testing.assert_close(
            torch.tensor(fused_lp), torch.tensor(staged_lp), atol=LOGPROB_TOL, rtol=0
        )


EXTENSION = ("--worker-extension-cls", "fusedq.vllm.worker_ext.FusedqWorkerExtension")
SWITCHED = "fusedq: decode path switched to "
FIRST_STAGED = "fusedq: first staged MLA decode query since the switch"


def rpc(port: int, method: str, *args: str) -> list:
    """vLLM's dev-mode collective RPC: one result per worker."""
    import httpx

    reply = httpx.post(
        f"http://127.0.0.1:{port}/collective_rpc",
        json={"method": method, "args": list(args)},
        timeout=600,
    )
    reply.raise_for_status()
    return reply.json()["results"]


def profiled_trace(port: int, profile_dir: Path) -> Path:
    """The trace of a short profiled request (this cycle's only one in `profile_dir`)."""
    from orchestrator.analysis.trace import find_rank_traces

    before = set(find_rank_traces(profile_dir)) if profile_dir.exists() else set()
    profile_decode(port)
    new = [p for p in find_rank_traces(profile_dir) if p not in before]
    assert len(new) == 1, new
    return new[0]


def profiled_query(port: int, profile_dir: Path):
    """The decode query step of a short profiled request."""
    from orchestrator.analysis.trace import read_trace

    return read_trace(profiled_trace(port, profile_dir)).query


def switch_run(port: int, profile_dir: Path, log: Path | None = None) -> dict:
    """Flip a started (fused) server staged -> fused -> staged; after each flip its greedy
    tokens and the query step its profile shows. Given the server's `log`, also what the
    server had logged once it had answered on its start-up path, and a profiled trace of
    that path, before the first flip."""
    run: dict = {"state": rpc(port, "fusedq_state"), "start": greedy(port)}
    if log is not None:
        run["start_log"] = log.read_bytes().decode(errors="replace")
        run["start_trace"] = profiled_trace(port, profile_dir)
    for i, path in enumerate(("staged", "fused", "staged")):
        results = rpc(port, "fusedq_set_path", path)
        run[f"{i}:{path}"] = {
            "results": results,
            "greedy": greedy(port),
            "query": profiled_query(port, profile_dir),
            "state": rpc(port, "fusedq_state"),
        }
    return run


def text_lines(text: str, needle: str) -> list[str]:
    return [ln for ln in text.splitlines() if needle in ln]


def refused_switch(port: int, path: str) -> dict:
    """POST a switch the server must refuse: its status and body."""
    import httpx

    reply = httpx.post(
        f"http://127.0.0.1:{port}/collective_rpc",
        json={"method": "fusedq_set_path", "args": [path]}, timeout=600,
    )  # fmt: skip
    return {"status": reply.status_code, "body": reply.text}


# --- the recorded runs both modules read (tests/fusedq/conftest.py) --------------------------


def record_switch_server(workdir: Path) -> dict:
    """TP1 on CPU, eager, the plugin in auto mode (the fused query in Triton's interpreter),
    the worker extension and vLLM's dev endpoint: its start-up path (greedy tokens, the log,
    a profile), the flips of `switch_run`, a refused switch and the tokens after it, and the
    whole log. What test_vllm_plugin.py reads as its fused server and test_vllm_worker_ext.py
    as its switched one."""
    env = {"TRITON_INTERPRET": "1", "VLLM_SERVER_DEV_MODE": "1"}
    profile = workdir / "profile"
    args = (*EXTENSION, *CPU_ENGINE_ARGS)
    with vllm_server(workdir, env, profile_dir=profile, engine_args=args) as (port, log):
        run = switch_run(port, profile, log)
        run["run_log"] = log.read_bytes().decode(errors="replace")
        run["refused"] = refused_switch(port, "eager")
        run["after"] = greedy(port)  # the refused call left the server serving, on its path
    run["log"] = log.read_text(errors="replace")
    return run


def record_tp2_server(workdir: Path) -> dict:
    """TP2 on the 8-head model (4 heads per rank: not qualified), the plugin in auto mode,
    the worker extension and the dev endpoint: greedy tokens and the log as served, then each
    worker's state over the RPC, a refused switch and the tokens after it, and the whole log."""
    env = {"TRITON_INTERPRET": "1", "VLLM_SERVER_DEV_MODE": "1"}
    args = (*EXTENSION, *CPU_ENGINE_ARGS)
    with vllm_server(workdir, env, tp=2, engine_args=args) as (port, log):
        run: dict = {"served": greedy(port)}
        run["start_log"] = log.read_bytes().decode(errors="replace")
        run["states"] = rpc(port, "fusedq_state")
        run["refused"] = refused_switch(port, "staged")
        run["after"] = greedy(port)
    run["log"] = log.read_text(errors="replace")
    return run
