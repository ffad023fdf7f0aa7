#!/usr/bin/env python3
"""Fidelity check: our workload client vs `vllm bench serve` on the same server and workload.

    python scripts/fidelity.py                       # starts a tiny-model server (CPU) itself
    python scripts/fidelity.py --base-url URL --model PATH --served-name NAME

Both tools send the same shape of load (random prompts of the same length, fixed output
length with ignore_eos, the same concurrency and request count) and report output tok/s.
The runs alternate ABBA (ours, bench, bench, ours, ...) so a drift in machine load hits
both tools alike. The verdict compares the tools' medians: on a shared 2-core machine one
run that coincides with someone else's load spike moves a mean by several percent, and
the median ignores it (the means are printed too). Exit 1 when the medians differ by more
than --bar percent (default 3).
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

from orchestrator.engines import vllm as eng  # noqa: E402
from orchestrator.workload import WorkloadParams, run_workload  # noqa: E402

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
        a.vllm_bin or eng.default_vllm_bin(),
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
    ap.add_argument("--rounds", type=int, default=2, help="ABBA rounds (each = 2 runs per tool)")
    ap.add_argument("--bar", type=float, default=3.0, help="allowed difference, percent")
    ap.add_argument("--vllm-bin")
    ap.add_argument("--json", type=Path, help="write the figures here")
    a = ap.parse_args()

    model = a.model
    if model is None:
        from orchestrator.tinymodel import build_tiny_model

        model = str(build_tiny_model())
    from orchestrator.tinymodel import vocab_size

    vocab = vocab_size(model) if (Path(model) / "config.json").exists() else 1000
    work = Path(tempfile.mkdtemp(prefix="fidelity-"))
    proc = None
    url = a.base_url
    try:
        if url is None:
            port = eng.free_port("127.0.0.1")
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
        order = ["ours", "bench", "bench", "ours"] * a.rounds
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
    mean = {k: sum(v) / len(v) for k, v in figures.items()}
    median = {k: statistics.median(v) for k, v in figures.items()}
    mean_diff = 100 * (mean["ours"] - mean["bench"]) / mean["bench"]
    diff = 100 * (median["ours"] - median["bench"]) / median["bench"]
    verdict = "PASS" if abs(diff) <= a.bar else "FAIL"
    print(
        f"output tok/s (mean): ours {mean['ours']:.2f}, vllm bench serve {mean['bench']:.2f}, "
        f"difference {mean_diff:+.2f}%"
    )
    print(
        f"output tok/s (median): ours {median['ours']:.2f}, vllm bench serve "
        f"{median['bench']:.2f}, difference {diff:+.2f}% (bar ±{a.bar:.0f}%): {verdict}"
    )
    if a.json:
        workload = {
            k: getattr(a, k) for k in ("prompt_tokens", "output_tokens", "concurrency", "requests")
        }
        summary = {
            "runs": figures,
            "mean": mean,
            "median": median,
            "mean_diff_pct": mean_diff,
            "median_diff_pct": diff,
            "verdict": verdict,
            "workload": workload,
        }
        a.json.write_text(json.dumps(summary, indent=2) + "\n")
    return 0 if verdict == "PASS" else 1


if __name__ == "__main__":
    raise SystemExit(main())
