"""Workload client: metric maths on synthetic records, streaming against a fake server, and
exact lengths and modes against a real tiny vLLM server (slow, e2e)."""

from __future__ import annotations

import json
import math
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from orch_cli import user_environ

from orchestrator.client import metrics, prompts
from orchestrator.client import workload as wl

# ---------------------------------------------------------------------------- params


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prompt_tokens": 0}, "prompt_tokens=0"),
        ({"output_tokens": 0}, "output_tokens=0"),
        ({"concurrency": 0}, "concurrency=0"),
        ({"requests": 0}, "requests=0"),
        ({"duration_s": 0}, "duration_s=0"),
        ({"requests": 2, "duration_s": 1.0}, "not both"),
    ],
)
def test_params_validation(kwargs: dict[str, Any], match: str) -> None:
    base = {"name": "w", "prompt_tokens": 1, "output_tokens": 1}
    with pytest.raises(ValueError, match=match):
        wl.WorkloadParams(**{**base, **kwargs})


def test_total_requests() -> None:
    assert wl.WorkloadParams("w", 1, 1, concurrency=3).total_requests == 3
    assert wl.WorkloadParams("w", 1, 1, requests=7).total_requests == 7
    assert wl.WorkloadParams("w", 1, 1, duration_s=2).total_requests is None


# ---------------------------------------------------------------------------- prompts


def test_prompts_exact_seeded_and_in_safe_range() -> None:
    a = prompts.make_prompt(1000, vocab_size=2048, seed=1, key="x")
    assert len(a) == 1000
    assert a == prompts.make_prompt(1000, vocab_size=2048, seed=1, key="x")
    assert a != prompts.make_prompt(1000, vocab_size=2048, seed=2, key="x")
    assert a != prompts.make_prompt(1000, vocab_size=2048, seed=1, key="y")
    lo, hi = prompts.token_id_range(2048)
    assert (lo, hi) == (128, 1792)
    assert lo <= min(a) and max(a) < hi
    # Large vocabularies: the bottom 1000 ids and the top eighth are never used.
    assert prompts.token_id_range(151_552) == (1000, 132_608)


# ---------------------------------------------------------------------------- metrics


def _rec(start: float, first: float, end: float, n: int, *, error: str | None = None) -> dict:
    chunks = [first + (end - first) * i / max(n - 1, 1) for i in range(n)]
    return {
        "start_s": start,
        "first_token_s": first,
        "end_s": end,
        "chunk_s": chunks,
        "chunk_tokens": [1] * n,
        "output_tokens": n,
        "prompt_tokens": 10,
        "error": error,
    }


def test_repeat_metrics_maths() -> None:
    recs = [
        _rec(0.0, 0.5, 2.5, 11),  # 10 tokens over 2 s of decode: 5 tok/s, TPOT 200 ms
        _rec(1.0, 1.2, 3.0, 10),  # 9 tokens over 1.8 s: 5 tok/s, TPOT 200 ms
        _rec(0.5, 0.6, 0.7, 4, error="HTTP 500"),  # excluded from every figure
    ]
    m = metrics.repeat_metrics(recs)
    assert m["requests"] == 3 and m["errors"] == 1
    assert m["output_tokens"] == 21
    assert m["prompt_tokens"] == 20
    assert m["wall_s"] == pytest.approx(3.0)  # first start 0.0 to last end 3.0
    assert m["aggregate_tok_s"] == pytest.approx(7.0)
    assert m["per_user_tok_s"] == pytest.approx(5.0)
    assert m["ttft_ms"]["p50"] == pytest.approx(350.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(350.0)
    assert m["ttft_ms"]["p90"] == pytest.approx(200 + 300 * 0.9)
    assert m["tpot_ms"]["mean"] == pytest.approx(200.0)
    assert m["itl_ms"]["p50"] == pytest.approx(200.0)
    assert len([1 for r in recs[:2] for _ in r["chunk_s"][1:]]) == 19


def test_workload_latency_pools_every_repeat() -> None:
    """A workload's p99 is a percentile over all its requests, not a mean of repeats' p99s."""
    fast = [_rec(0.0, 0.1, 1.1, 11), _rec(0.0, 0.1, 1.1, 11)]  # TTFT 100 ms, TPOT 100 ms
    slow = [_rec(0.0, 0.9, 2.9, 11), _rec(0.0, 0.1, 1.1, 11, error="HTTP 500")]  # TTFT 900 ms
    params = wl.WorkloadParams("w", 10, 11, requests=2, repeats=2)
    reps = [{"repeat": i + 1, **metrics.repeat_metrics(r)} for i, r in enumerate((fast, slow))]
    d = wl.WorkloadResult(params, reps, [*fast, *slow]).to_dict()
    ttft = d["latency"]["ttft_ms"]
    assert ttft["p50"] == pytest.approx(100.0)  # three successful requests: 100, 100, 900
    assert ttft["p99"] == pytest.approx(100 + 800 * 0.98)
    assert d["mean"]["ttft_ms"]["p50"] == pytest.approx(500.0)  # (100 + 900) / 2: not this
    assert d["latency"]["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert d["latency"] == {
        **metrics.latency_metrics([*fast, *slow]),
        "chunking": metrics.chunking([*fast, *slow]),
    }
    # The samples behind each figure: three successful requests, each of 10 chunk gaps.
    assert [d["latency"][k]["n"] for k in ("ttft_ms", "tpot_ms", "e2el_ms", "itl_ms")] == [
        3,
        3,
        3,
        30,
    ]
    assert d["latency"]["e2el_ms"]["p50"] == pytest.approx(1100.0)  # start to last chunk
    assert d["latency"]["itl_ms"] == metrics.repeat_metrics([*fast, *slow])["itl_ms"]


def test_percentile_matches_numpy_linear() -> None:
    vals = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert metrics.percentile(vals, 50) == 3.0
    assert metrics.percentile(vals, 90) == pytest.approx(4.6)
    assert metrics.percentile(vals, 99) == pytest.approx(4.96)
    assert math.isnan(metrics.percentile([], 50))


def test_all_failed_repeat_is_zero_not_crash() -> None:
    m = metrics.repeat_metrics([_rec(0, 1, 2, 3, error="x")])
    assert m["aggregate_tok_s"] == 0.0 and m["per_user_tok_s"] == 0.0
    assert math.isnan(m["ttft_ms"]["p50"])
    json.dumps(m)  # NaN is allowed by json.dumps: summaries stay serialisable


def test_mean_of_repeats() -> None:
    r1 = {"repeat": 1, "aggregate_tok_s": 10.0, "ttft_ms": {"p50": 1.0, "mean": math.nan}}
    r2 = {"repeat": 2, "aggregate_tok_s": 20.0, "ttft_ms": {"p50": 3.0, "mean": 4.0}}
    assert metrics.mean_of_repeats([r1, r2]) == {
        "aggregate_tok_s": 15.0,
        "ttft_ms": {"p50": 2.0, "mean": 4.0},
    }
    assert metrics.mean_of_repeats([]) == {}


def test_mean_of_repeats_sums_sample_counts() -> None:
    # With MTP (or in duration mode) repeats stream different numbers of chunks: the mean
    # of the counts was 152.5 once, which a result row (an integer n) refused after the
    # case had been measured. The samples behind the averaged figures are their sum.
    r1 = {"repeat": 0, "itl_ms": {"p50": 10.0, "mean": 11.0, "n": 152}}
    r2 = {"repeat": 1, "itl_ms": {"p50": 12.0, "mean": 13.0, "n": 153}}
    assert metrics.mean_of_repeats([r1, r2]) == {"itl_ms": {"p50": 11.0, "mean": 12.0, "n": 305}}


def test_repeats_of_unequal_counts_make_a_valid_row() -> None:
    from orchestrator.results.rows import WorkloadSummary

    def repeat(k: int, chunks: int) -> list[dict]:
        # One request of `chunks` streamed chunks, as a drafted decode streams them.
        r = _rec(0, 0.01, 1.0, 64)
        r |= {"repeat": k, "chunk_s": [0.01 + i * (0.99 / (chunks - 1)) for i in range(chunks)]}
        r["chunk_tokens"] = [1] * (chunks - 1) + [64 - chunks + 1]
        return [r]

    records = repeat(0, 40) + repeat(1, 43)
    params = wl.WorkloadParams(name="ctx0", prompt_tokens=1, output_tokens=64, requests=1)
    repeats = [metrics.repeat_metrics([r]) | {"repeat": r["repeat"]} for r in records]
    summary = WorkloadSummary.model_validate(wl.WorkloadResult(params, repeats, records).to_dict())
    assert summary.mean.itl_ms.n == 39 + 42


# ---------------------------------------------------------------------------- fake server


class _Streamer(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    delay_s = 0.01
    prompt_fudge = 0

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        n = body["max_tokens"]
        sent = 0
        while sent < n:
            k = min(2, n - sent)  # two tokens per chunk, as MTP produces
            sent += k
            choice = {"text": "ab", "token_ids": [7] * k, "finish_reason": None}
            if sent == n:
                choice["finish_reason"] = "length"
            self._event({"choices": [choice]})
            time.sleep(self.delay_s)
        usage = {"prompt_tokens": len(body["prompt"]) + self.prompt_fudge, "completion_tokens": n}
        self._event({"choices": [], "usage": usage})
        self._send(b"data: [DONE]\n\n")
        self._send(b"")

    def _event(self, obj: dict) -> None:
        self._send(b"data: " + json.dumps(obj).encode() + b"\n\n")

    def _send(self, data: bytes) -> None:
        self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
        self.wfile.flush()

    def log_message(self, *args: object) -> None:
        pass


def _serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture
def fake_url() -> Iterator[str]:
    yield from _serve(_Streamer)


def test_fake_stream_counts_multi_token_chunks(fake_url: str) -> None:
    events: list[dict] = []
    p = wl.WorkloadParams("w", prompt_tokens=5, output_tokens=7, concurrency=2, requests=4)
    res = wl.run_workload(fake_url, "m", p, vocab_size=2048, progress=events.append)
    d = res.to_dict()
    assert d["errors"] == 0 and d["requests"] == 4
    for r in res.records:
        assert r["output_tokens"] == 7 and r["prompt_tokens"] == 5
        assert r["chunk_tokens"] == [2, 2, 2, 1]
        assert r["finish_reason"] == "length"
        assert r["start_s"] <= r["first_token_s"] <= r["end_s"]
    assert events and events[-1]["done"] == 4 and events[-1]["total"] == 4
    json.dumps(d)


def test_prompt_length_mismatch_is_an_error(fake_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_Streamer, "prompt_fudge", 1)
    p = wl.WorkloadParams("w", prompt_tokens=5, output_tokens=2)
    d = wl.run_workload(fake_url, "m", p, vocab_size=2048).to_dict()
    assert d["errors"] == 1
    assert "prompt_tokens 6 != 5" in d["error_samples"][0]


def test_duration_mode_repeats(fake_url: str) -> None:
    p = wl.WorkloadParams("d", 3, 4, concurrency=2, duration_s=0.5, repeats=2)
    res = wl.run_workload(fake_url, "m", p, vocab_size=2048)
    d = res.to_dict()
    assert [r["repeat"] for r in d["repeats"]] == [1, 2]
    for rep in d["repeats"]:
        assert rep["requests"] >= 4 and rep["errors"] == 0
        assert rep["wall_s"] >= 0.5  # in-flight requests finish and count
    assert {r["user"] for r in res.records} == {0, 1}
    assert d["mean"]["aggregate_tok_s"] == pytest.approx(
        sum(r["aggregate_tok_s"] for r in d["repeats"]) / 2
    )


def test_first_repeat_numbers_the_repeats_and_picks_their_prompts(
    fake_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A switch-mode server's k-th block of each path is repeat k: the same prompts for both.
    keys: list[str] = []
    make = prompts.make_prompt
    monkeypatch.setattr(wl, "make_prompt", lambda n, **kw: keys.append(kw["key"]) or make(n, **kw))
    p = wl.WorkloadParams("w", 3, 2, repeats=2)
    res = wl.run_workload(fake_url, "m", p, vocab_size=2048, first_repeat=3)
    assert keys == ["w/3/0", "w/4/0"]
    assert [r["repeat"] for r in res.records] == [3, 4]
    assert [r["repeat"] for r in res.to_dict()["repeats"]] == [4, 5]


def test_connection_refused_is_recorded() -> None:
    from orchestrator.common.net import free_port

    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    d = wl.run_workload(url, "m", wl.WorkloadParams("w", 1, 1), vocab_size=2048).to_dict()
    assert d["errors"] == 1 and "ConnectError" in d["error_samples"][0]
    # No latency figure exists: None rather than NaN, so strict JSON readers accept it.
    assert d["repeats"][0]["ttft_ms"]["p50"] is None
    assert d["latency"]["ttft_ms"]["p50"] is None
    json.dumps(d, allow_nan=False)


def test_server_death_aborts_within_a_second(
    fake_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_Streamer, "delay_s", 0.5)  # a request would take 50 s
    dead_at = time.monotonic() + 0.6
    p = wl.WorkloadParams("w", 2, 100, concurrency=2, requests=10)
    t0 = time.monotonic()
    with pytest.raises(wl.ServerDiedError, match="server died") as info:
        wl.run_workload(fake_url, "m", p, vocab_size=2048, alive=lambda: time.monotonic() < dead_at)
    assert time.monotonic() - t0 < 0.6 + 1.0
    assert len(info.value.records) == 2


def test_failed_requests_wait_for_a_dying_server_to_be_seen() -> None:
    # A killed server refuses connections before its pid polls as gone: requests that failed
    # are not a measurement while the watch may still turn. Here alive() turns 0.5 s after
    # the (refused) requests are over, and the workload still ends in ServerDiedError.
    from orchestrator.common.net import free_port

    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    calls: list[float] = []

    def alive() -> bool:
        calls.append(time.monotonic())
        return time.monotonic() < calls[0] + 0.5

    t0 = time.monotonic()
    with pytest.raises(wl.ServerDiedError, match="server died") as info:
        wl.run_workload(
            url, "m", wl.WorkloadParams("w", 1, 1, requests=3), vocab_size=2048, alive=alive
        )
    assert time.monotonic() - t0 < wl._DEATH_GRACE_S
    assert len(info.value.records) == 3 and all(r["error"] for r in info.value.records)
    # With a live server the same errors are measured, after the grace and no longer.
    t0 = time.monotonic()
    d = wl.run_workload(
        url, "m", wl.WorkloadParams("w", 1, 1, requests=2), vocab_size=2048, alive=lambda: True
    )
    assert d.to_dict()["errors"] == 2
    assert wl._DEATH_GRACE_S <= time.monotonic() - t0 < wl._DEATH_GRACE_S + 1.5


# ---------------------------------------------------------------------------- real vLLM


@pytest.fixture(scope="module")
def tiny_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, str, Any]]:
    pytest.importorskip("vllm", reason="vLLM not installed")
    from orchestrator.common.net import free_port
    from orchestrator.engines.vllm import server as eng
    from orchestrator.engines.vllm.compile_cache import inductor_dir, share_model_info
    from orchestrator.models.tinymodel import build_tiny_model

    model = str(build_tiny_model())
    run_dir = tmp_path_factory.mktemp("server")
    port = free_port("127.0.0.1")
    argv = eng.serve_argv(
        model,
        tp=1,
        dcp=1,
        mtp=0,
        host="127.0.0.1",
        port=port,
        served_name="tiny",
        extra_args=["--attention-backend", "CPU_MLA", "--enforce-eager", "--max-model-len", "4096"],
    )
    # A user's environment (no TRITON_INTERPRET: the plugin declines, the decode is vLLM's
    # own), and Inductor's cache every configuration shares
    # (orchestrator.engines.vllm.compile_cache).
    extra = {"VLLM_CPU_KVCACHE_SPACE": "1", "TORCHINDUCTOR_CACHE_DIR": str(inductor_dir())}
    env = eng.serve_env(user_environ(), host="127.0.0.1", run_dir=run_dir, extra=extra)
    share_model_info(Path(env["VLLM_CACHE_ROOT"]))  # vLLM's model inspection, run once
    log = run_dir / "server.log"
    proc = eng.start_server(argv, env, log)
    try:
        eng.wait_ready(
            f"http://127.0.0.1:{port}",
            timeout_s=400,
            alive=lambda: proc.poll() is None,
            log_path=log,
            returncode=proc.poll,
        )
        yield f"http://127.0.0.1:{port}", model, proc
    finally:
        eng.stop_server(proc, grace_s=10)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_real_exact_lengths_and_sane_metrics(tiny_server: tuple[str, str, Any]) -> None:
    from orchestrator.models.tinymodel import vocab_size

    url, model, proc = tiny_server
    p = wl.WorkloadParams("ctx", prompt_tokens=517, output_tokens=33, concurrency=2, requests=4)
    res = wl.run_workload(
        url, "tiny", p, vocab_size=vocab_size(model), alive=lambda: proc.poll() is None
    )
    d = res.to_dict()
    assert d["errors"] == 0, d["error_samples"]
    for r in res.records:
        assert r["prompt_tokens"] == 517
        assert r["output_tokens"] == 33 == sum(r["chunk_tokens"])
        assert r["finish_reason"] == "length"
    m = d["repeats"][0]
    assert m["output_tokens"] == 4 * 33
    assert 0 < m["aggregate_tok_s"] < 10_000
    assert 0 < m["per_user_tok_s"] < 10_000
    assert 0 < m["ttft_ms"]["p50"] <= m["ttft_ms"]["p99"]
    assert m["tpot_ms"]["p50"] > 0 and m["itl_ms"]["p50"] > 0
    # Two users at once: the aggregate beats one user's active rate only if batching works,
    # but it can never exceed the sum of both users' rates.
    assert m["aggregate_tok_s"] <= 2 * m["per_user_tok_s"] * 1.05


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_real_duration_mode_two_repeats(tiny_server: tuple[str, str, Any]) -> None:
    url, _, proc = tiny_server
    p = wl.WorkloadParams("dur", 64, 16, concurrency=2, duration_s=3.0, repeats=2)
    res = wl.run_workload(url, "tiny", p, vocab_size=2048, alive=lambda: proc.poll() is None)
    d = res.to_dict()
    assert d["errors"] == 0, d["error_samples"]
    assert len(d["repeats"]) == 2
    for rep in d["repeats"]:
        assert rep["requests"] >= 2
        assert rep["wall_s"] >= 3.0
        assert rep["output_tokens"] == 16 * rep["requests"]
    assert d["mean"]["aggregate_tok_s"] > 0


def test_import_stays_light() -> None:
    import subprocess
    import sys

    code = "import sys, orchestrator.client.workload as w; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).parents[2])


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(900)
def test_real_recorded_tokens_repeat_exactly(tiny_server: tuple[str, str, Any]) -> None:
    """Greedy ids and top logprobs as vLLM streams them; one server twice gives the same ids."""
    from orchestrator.client import tokens

    url, _, proc = tiny_server
    p = wl.WorkloadParams("greedy", 12, 8, requests=2, record_tokens=True)
    runs = [
        wl.run_workload(url, "tiny", p, vocab_size=2048, alive=lambda: proc.poll() is None)
        for _ in range(2)
    ]
    for res in runs:
        assert res.to_dict()["errors"] == 0, res.to_dict()["error_samples"]
        for r in res.records:
            assert len(r["token_ids"]) == 8 == len(r["top_logprobs"])
            for token, top in zip(r["token_ids"], r["top_logprobs"], strict=True):
                # Greedy: the chosen id is in its position's top and ranked first.
                assert token in top and top[token] == max(top.values())
    check = tokens.compare(runs[0].records, runs[1].records)
    assert check["verdict"] == "identical" and check["identical"] == 2, check


def test_per_user_rate_survives_a_burst_after_the_first_chunk() -> None:
    """A starved API server flushed 63 of 64 tokens 1 ms after the first chunk (seen on the
    2-core CPU machine: 20,324 tok/s 'per user'). The rate counts tokens after each request's
    first chunk over the time after it, summed: the burst request adds 1 token over 1 ms."""
    steady = _rec(0.0, 0.1, 2.1, 21)  # 20 tokens after the first, over 2 s
    burst = _rec(3.0, 3.1, 3.101, 2) | {"chunk_tokens": [63, 1], "output_tokens": 64}
    m = metrics.repeat_metrics([steady, burst])
    assert m["per_user_tok_s"] == pytest.approx(21 / 2.001)


def test_chunking_tells_bursts_from_decode_steps() -> None:
    """What the API server did with the tokens: one request streamed a chunk per token every
    100 ms; another got its 10 tokens in a burst of chunks 0.02 ms apart after a stall (a
    starved API server flushing), whose ITL p50 is 0.02 ms although no decode step was."""
    steady = _rec(0.0, 0.1, 1.0, 10)
    burst = _rec(0.0, 0.1, 1.0, 10)
    burst["chunk_s"] = [0.1] + [0.9998 + 0.00002 * i for i in range(9)]
    c = metrics.chunking([steady, burst])
    assert c == {
        "chunks": 20,
        "tokens_per_chunk_mean": 1.0,
        "tokens_per_chunk_max": 1,
        "gaps": 18,
        "gaps_under_1ms": 8,
    }
    mtp = _rec(0.0, 0.1, 1.0, 5)
    mtp["chunk_tokens"] = [1, 2, 2, 2, 2]  # a speculative step's chunk carries its tokens
    mtp["output_tokens"] = 9
    assert metrics.chunking([mtp])["tokens_per_chunk_mean"] == pytest.approx(1.8)
    assert metrics.chunking([mtp])["tokens_per_chunk_max"] == 2
