#!/usr/bin/env python3
"""Fidelity check: our workload client vs `vllm bench serve` on the same server and workload.

    python scripts/fidelity.py                       # starts a tiny-model server (CPU) itself
    python scripts/fidelity.py --base-url URL --model PATH --served-name NAME

Both tools send the same shape of load (random prompts of the same length, fixed output
length with ignore_eos, the same concurrency and request count) and report output tok/s.
The runs alternate ABBA (ours, bench, bench, ours, ...) so a drift in machine load hits
both tools alike.

The verdict comes from an interval, not from two point figures: each ABBA round gives one
paired difference (our mean of its two runs against bench's, in percent; a linear drift
within the round cancels), and Student's t gives the 95 % interval of their mean. On a
shared 2-core machine single runs of either tool swing ±10 % and more, so two medians or
two means can land 3 % apart by chance, and a handful of rounds cannot show agreement.

    PASS          the interval lies within ±--bar percent (default 3)       exit 0
    FAIL          the interval lies wholly outside it                       exit 1
    inconclusive  the interval reaches across the bar: N rounds too few     exit 3
                  (run more --rounds, or on a quieter machine)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from orchestrator.analysis.stats import Interval, t_interval  # noqa: E402
from orchestrator.client.workload import WorkloadParams, run_workload  # noqa: E402
from orchestrator.common.net import free_port  # noqa: E402
from orchestrator.engines.vllm import server as eng  # noqa: E402

EXIT = {"PASS": 0, "FAIL": 1, "inconclusive": 3}
RUN_ORDER = ("ours", "bench", "bench", "ours")  # one ABBA round


def round_differences(ours: list[float], bench: list[float]) -> list[float]:
    """Per complete ABBA round, 100 * (our mean / bench's mean - 1); in RUN_ORDER each tool's
    runs 2r and 2r+1 belong to round r."""
    rounds = min(len(ours), len(bench)) // 2
    return [
        100.0
        * (
            statistics.fmean(ours[2 * r : 2 * r + 2]) / statistics.fmean(bench[2 * r : 2 * r + 2])
            - 1.0
        )
        for r in range(rounds)
    ]


def verdict(ours: list[float], bench: list[float], bar: float) -> tuple[str, Interval | None]:
    """PASS, FAIL or ``inconclusive: N rounds too few``, and the interval it was read from."""
    diffs = round_differences(ours, bench)
    interval = t_interval(diffs)
    n = len(diffs)
    too_few = f"inconclusive: {n} round{'' if n == 1 else 's'} too few"
    if interval is None:
        return too_few, None
    position = interval.position(-bar, bar)
    if position == "inside":
        return "PASS", interval
    if position == "outside":
        return "FAIL", interval
    return too_few, interval


CPU_ARGS = ["--attention-backend", "CPU_MLA", "--enforce-eager", "--max-model-len", "4096"]


def ours(url: str, served: str, a: argparse.Namespace, vocab: int, seed: int) -> float:
    p = WorkloadParams(
        "fidelity",
        prompt_tokens=a.prompt_tokens,
        output_tokens=a.output_tokens,
        concurrency=a.concurrency,
        requests=a.requests,
    )
    d = run_workload(url, served, p, vocab_size=vocab, seed=seed).to_dict()
    if d["errors"]:
        raise SystemExit(f"our client saw {d['errors']} errors: {d['error_samples']}")
    return float(d["repeats"][0]["aggregate_tok_s"])


def bench(url: str, served: str, model: str, a: argparse.Namespace, seed: int, out: Path) -> float:
    name = f"bench-{seed}.json"
    argv = [
        *([a.vllm_bin] if a.vllm_bin else eng.default_vllm_command()),
        "bench",
        "serve",
        "--backend",
        "vllm",
        "--base-url",
        url,
        "--endpoint",
        "/v1/completions",
        "--model",
        served,
        "--tokenizer",
        model,
        "--dataset-name",
        "random",
        "--random-input-len",
        str(a.prompt_tokens),
        "--random-output-len",
        str(a.output_tokens),
        "--random-range-ratio",
        "0",
        "--num-prompts",
        str(a.requests),
        "--max-concurrency",
        str(a.concurrency),
        "--request-rate",
        "inf",
        "--ignore-eos",
        "--temperature",
        "0",
        "--seed",
        str(seed),
        "--disable-tqdm",
        "--save-result",
        "--result-dir",
        str(out),
        "--result-filename",
        name,
    ]
    env = {**os.environ, "TMPDIR": str(out), "VLLM_CACHE_ROOT": str(out / "vllm-cache")}
    r = subprocess.run(argv, env=env, capture_output=True, text=True)
    (out / f"bench-{seed}.log").write_text(r.stdout + r.stderr)
    if r.returncode != 0:
        raise SystemExit(f"vllm bench serve failed ({r.returncode}):\n{r.stderr[-3000:]}")
    res = json.loads((out / name).read_text())
    if res.get("failed"):
        raise SystemExit(f"vllm bench serve saw {res['failed']} failed requests")
    return float(res["output_throughput"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--base-url", help="use this running server instead of starting one")
    ap.add_argument("--model", help="model path (tokenizer for vllm bench); default: tiny model")
    ap.add_argument("--served-name", default="tiny")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=128)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument(
        "--rounds",
        type=int,
        default=2,
        help="ABBA rounds (each = 2 runs per tool); 2 decide only when the tools agree closely",
    )
    ap.add_argument("--bar", type=float, default=3.0, help="allowed difference, percent")
    ap.add_argument("--vllm-bin")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()
    if a.rounds < 1:
        ap.error(f"--rounds {a.rounds}: need at least 1 (2 or more for a verdict)")

    model = a.model
    if model is None:
        from orchestrator.models.tinymodel import build_tiny_model

        model = str(build_tiny_model())
    from orchestrator.models.tinymodel import vocab_size

    vocab = vocab_size(model) if (Path(model) / "config.json").exists() else 1000
    work = Path(tempfile.mkdtemp(prefix="fidelity-"))
    proc = None
    url = a.base_url
    try:
        if url is None:
            port = free_port("127.0.0.1")
            argv = eng.serve_argv(
                model,
                tp=1,
                dcp=1,
                mtp=0,
                host="127.0.0.1",
                port=port,
                served_name=a.served_name,
                extra_args=CPU_ARGS,
                vllm_bin=a.vllm_bin,
            )
            env = eng.serve_env(
                os.environ,
                host="127.0.0.1",
                run_dir=work,
                extra={"VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1")},
            )
            proc = eng.start_server(argv, env, work / "server.log")
            url = f"http://127.0.0.1:{port}"
            alive = proc.poll
            waited = eng.wait_ready(
                url,
                timeout_s=600,
                alive=lambda: alive() is None,
                log_path=work / "server.log",
                returncode=alive,
            )
            print(f"server ready in {waited:.1f} s ({url}, log {work / 'server.log'})", flush=True)
        # Warm-up outside the measurement: the first requests of a fresh server are slower.
        ours(
            url,
            a.served_name,
            argparse.Namespace(**{**vars(a), "requests": a.concurrency}),
            vocab,
            99,
        )
        figures: dict[str, list[float]] = {"ours": [], "bench": []}
        order = list(RUN_ORDER) * a.rounds
        for i, tool in enumerate(order):
            t0 = time.monotonic()
            if tool == "ours":
                v = ours(url, a.served_name, a, vocab, seed=i)
            else:
                v = bench(url, a.served_name, model, a, seed=i, out=work)
            figures[tool].append(v)
            print(
                f"run {i + 1}/{len(order)} {tool:5s}: {v:8.2f} output tok/s ({time.monotonic() - t0:.0f} s)",
                flush=True,
            )
    finally:
        if proc is not None:
            eng.stop_server(proc)
    mean = {k: statistics.fmean(v) for k, v in figures.items()}
    median = {k: statistics.median(v) for k, v in figures.items()}
    mean_diff = 100 * (mean["ours"] - mean["bench"]) / mean["bench"]
    median_diff = 100 * (median["ours"] - median["bench"]) / median["bench"]
    diffs = round_differences(figures["ours"], figures["bench"])
    result, interval = verdict(figures["ours"], figures["bench"], a.bar)
    print(
        f"output tok/s: ours mean {mean['ours']:.2f} / median {median['ours']:.2f}, "
        f"vllm bench serve mean {mean['bench']:.2f} / median {median['bench']:.2f} "
        f"(means {mean_diff:+.2f}%, medians {median_diff:+.2f}%)"
    )
    print("per ABBA round, ours vs bench: " + ", ".join(f"{d:+.2f}%" for d in diffs))
    where = interval.describe() if interval else "no interval from fewer than 2 rounds"
    print(f"difference {where} ({interval.method if interval else 't'}), bar ±{a.bar:g}%: {result}")
    if a.json:
        workload = {
            k: getattr(a, k) for k in ("prompt_tokens", "output_tokens", "concurrency", "requests")
        }
        summary = {
            "runs": figures,
            "mean": mean,
            "median": median,
            "mean_diff_pct": mean_diff,
            "median_diff_pct": median_diff,
            "round_diff_pct": diffs,
            "interval_pct": None
            if interval is None
            else {
                "low": interval.low,
                "high": interval.high,
                "confidence": interval.confidence,
                "method": interval.method,
            },
            "bar_pct": a.bar,
            "verdict": result,
            "workload": workload,
        }
        a.json.write_text(json.dumps(summary, indent=2) + "\n")
    return EXIT[result.split(":")[0]]


if __name__ == "__main__":
    raise SystemExit(main())
