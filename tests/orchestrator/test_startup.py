"""Start-up phases from vLLM's log lines: the phase edges, vLLM's own durations, the compile
cache's state, the longest silences, and the clock checks."""

from __future__ import annotations

import time

from orchestrator.engines.vllm.startup import PHASE_NAMES, startup_record

T0 = time.mktime((2026, 12, 2, 10, 0, 0, 0, 0, -1))  # the process was started here


def stamp(seconds: int) -> str:
    return time.strftime("%m-%d %H:%M:%S", time.localtime(T0 + seconds))


def line(seconds: int, message: str, process: str = "EngineCore_DP0 pid=7") -> str:
    # vLLM colours the process label; the audit's and this reader's parsers strip it.
    return f"\x1b[36m({process})\x1b[0m INFO {stamp(seconds)} [x.py:1] {message}\n"


# A 0.26 GPU start-up, as the log tells it (times in seconds from the process start).
COLD = [
    line(12, "vLLM API server version 0.26.0", "APIServer pid=5"),
    line(14, "non-default args: {...}", "APIServer pid=5"),
    line(
        80, "Initializing a V1 LLM engine (v0.26.0) with config: model=...", "EngineCore_DP0 pid=7"
    ),
    line(95, "Starting to load model /m...", "Worker pid=9"),
    line(101, "Loading weights took 0.00 seconds", "Worker pid=9"),
    line(101, "Model loading took 92.1 GiB memory and 5.712345 seconds", "Worker pid=9"),
    line(108, "Dynamo bytecode transform time: 6.50 s", "Worker pid=9"),
    line(140, "Compiling a graph for compile range (1, 8192) takes 30.10 s", "Worker pid=9"),
    line(141, "torch.compile took 39.80 s in total", "Worker pid=9"),
    line(150, "Available KV cache memory: 25.1 GiB", "Worker pid=9"),
    line(170, "Graph capturing finished in 19 secs, took 0.55 GiB", "Worker pid=9"),
    line(
        172,
        "init engine (profile, create kv cache, warmup model) took 77.00 s",
        "EngineCore_DP0 pid=7",
    ),
    line(175, "Starting vLLM API server 0 on http://127.0.0.1:8000", "APIServer pid=5"),
    line(400, "a line long after the server was ready", "APIServer pid=5"),
]


def test_phases_of_a_cold_start() -> None:
    r = startup_record(COLD, spawned_at=T0, ready_at=T0 + 176.5)
    assert r["phases"] == {
        "imports": 12.0,
        "api_server": 68.0,
        "engine_init": 15.0,
        "weights": 6.0,
        "compile": 40.0,
        "profile": 9.0,
        "graphs": 20.0,
        "engine_ready": 2.0,
        "serving": 4.5,
    }
    assert list(r["phases"]) == list(PHASE_NAMES)
    # The phases cover the start-up exactly: spawn to ready.
    assert sum(r["phases"].values()) == 176.5
    assert r["vllm"] == {
        "weights_s": 5.712,
        "dynamo_s": 6.5,
        "inductor_s": 30.1,
        "torch_compile_s": 39.8,
        "graph_capture_s": 19.0,
        "engine_init_s": 77.0,
    }
    assert r["compile_cache"] == "miss"


def test_silences_name_where_time_went() -> None:
    r = startup_record(COLD, spawned_at=T0, ready_at=T0 + 176.5)
    longest = r["silences"][0]
    assert longest["s"] == 66.0
    assert longest["after"].startswith("non-default args")
    assert longest["before"].startswith("Initializing a V1 LLM engine")
    assert [s["s"] for s in r["silences"]] == sorted((s["s"] for s in r["silences"]), reverse=True)
    assert len(r["silences"]) == 3


def test_a_warm_start_loads_the_compile_cache() -> None:
    warm = [
        line(3, "vLLM API server version 0.26.0", "APIServer pid=5"),
        line(10, "Initializing a V1 LLM engine (v0.26.0) with config: model=..."),
        line(20, "Starting to load model /m...", "Worker pid=9"),
        line(26, "Model loading took 92.1 GiB memory and 5.7 seconds", "Worker pid=9"),
        line(
            28,
            "Directly load the compiled graph(s) for compile range (1, 8192) from the cache, took 1.234 s",
            "Worker pid=9",
        ),
        line(29, "torch.compile took 2.90 s in total", "Worker pid=9"),
        line(60, "init engine (profile, create kv cache, warmup model) took 40.00 s"),
    ]
    r = startup_record(warm, spawned_at=T0, ready_at=T0 + 62)
    assert r["compile_cache"] == "hit"
    assert r["vllm"]["cache_load_s"] == 1.234
    # No profile or graph lines (an eager or CPU server): their time falls to the next phase.
    assert list(r["phases"]) == [
        "imports",
        "api_server",
        "engine_init",
        "weights",
        "compile",
        "engine_ready",
        "serving",
    ]
    assert r["phases"]["engine_ready"] == 31.0


def test_each_rank_logs_its_own_and_the_slowest_counts() -> None:
    ranks = [
        line(5, "Initializing a V1 LLM engine (v0.26.0) with config: ..."),
        line(9, "Starting to load model /m...", "Worker_TP0 pid=10"),
        line(10, "Starting to load model /m...", "Worker_TP1 pid=11"),
        line(20, "Model loading took 1 GiB memory and 9.5 seconds", "Worker_TP0 pid=10"),
        line(23, "Model loading took 1 GiB memory and 12.25 seconds", "Worker_TP1 pid=11"),
        # The MTP draft compiles in the same process after the target: their times add up.
        line(30, "torch.compile took 5.00 s in total", "Worker_TP0 pid=10"),
        line(31, "torch.compile took 2.00 s in total", "Worker_TP0 pid=10"),
        line(31, "torch.compile took 6.00 s in total", "Worker_TP1 pid=11"),
    ]
    r = startup_record(ranks, spawned_at=T0, ready_at=T0 + 40)
    # Loading begins with the first rank and ends with the last.
    assert r["phases"]["engine_init"] == 4.0
    assert r["phases"]["weights"] == 14.0
    assert r["vllm"]["weights_s"] == 12.25
    assert r["vllm"]["torch_compile_s"] == 7.0


def test_a_server_that_never_got_ready() -> None:
    r = startup_record(COLD[:6], spawned_at=T0, ready_at=None)
    assert list(r["phases"]) == ["imports", "api_server", "engine_init", "weights"]
    assert r["compile_cache"] is None


def test_another_clock_drops_what_the_orchestrators_clock_anchors() -> None:
    """A node whose local time is an hour off: the log's own intervals stand, the spawn and
    ready edges (the driver's clock) are not mixed in."""
    shifted = [
        line(-3600 + 12, "vLLM API server version 0.26.0"),
        line(-3600 + 80, "Initializing a V1 LLM engine (v0.26.0) with config: ..."),
    ]
    r = startup_record(shifted, spawned_at=T0, ready_at=T0 + 176.5)
    assert r["phases"] == {"api_server": 68.0}


def test_lines_without_a_header_and_millisecond_stamps() -> None:
    lines = [
        "Traceback (most recent call last):\n",
        f"INFO {stamp(2)}.250 [x.py:1] vLLM API server version 0.26.0\n",
        f"INFO {stamp(9)}.750 [x.py:1] Initializing a V1 LLM engine (v0.26.0)\n",
    ]
    r = startup_record(lines, spawned_at=T0, ready_at=None)
    assert r["phases"] == {"imports": 2.25, "api_server": 7.5}


def test_a_cache_vllm_cannot_load_is_told_apart_from_a_cold_one() -> None:
    """vLLM 0.32's CPU build finds the AOT artifact a first server saved and fails to load it
    (its eager backend's function has no finalize_loading), then compiles again; the CPU
    runner logs its loader's line, not "Model loading took"."""
    cpu = [
        line(8, "Initializing a V1 LLM engine (v0.32.0) with config: ..."),
        line(17, "Starting to load model /m...", "Worker pid=9"),
        line(17, "Loading weights took 0.01 seconds", "Worker pid=9"),
        line(
            18,
            "[backbone] Compiling model again due to a load failure from /c/vllm-cache/"
            "torch_compile_cache/torch_aot_compile/abc/rank_0_0/model, reason: 'function' "
            "object has no attribute 'finalize_loading'",
            "Worker pid=9",
        ),
        line(28, "[backbone] saved AOT compiled function to /c/vllm-cache/...", "Worker pid=9"),
        line(28, "[backbone] Initial profiling/warmup run took 0.06 s", "Worker pid=9"),
    ]
    r = startup_record(cpu, spawned_at=T0, ready_at=T0 + 35)
    assert r["compile_cache"] == "load-failed"
    assert r["compile_cache_failure"] == "'function' object has no attribute 'finalize_loading'"
    assert r["phases"]["weights"] == 0.0 and r["phases"]["compile"] == 11.0
    fresh = [x for x in cpu if "load failure" not in x]
    assert startup_record(fresh, spawned_at=T0, ready_at=T0 + 35)["compile_cache"] == "miss"
    aot_hit = [
        *fresh[:3],
        line(19, "Directly load AOT compilation from path /c/...", "Worker pid=9"),
    ]
    assert startup_record(aot_hit, spawned_at=T0, ready_at=T0 + 35)["compile_cache"] == "hit"
