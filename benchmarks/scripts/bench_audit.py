"""Benchmark the log auditor against `grep -E -c` with the same patterns, side by side.

Builds a log under /tmp, warms the page cache, then times in one run:

  * grep -E -c '<the catalogue's alternation>' in the C locale and in the caller's locale
  * orchestrator.audit.audit_logs() with each prefilter (GNU grep, pure Python)

and prints MB/s for each and the ratio to grep. Two kinds of log (--lines):

  * real (the default): the lines of the real vLLM server logs in the repository (the audit
    tests' fixtures and the validation runs' server logs) that match no signature, repeated
    to the size asked, with one Xid line in the middle: what a healthy server writes, where
    a needle that ordinary lines hold (``fault`` in ``default``) costs Python time.
  * synthetic: a generated vLLM/NCCL line mix with six injected faults.

Usage:

    .venv/bin/python benchmarks/scripts/bench_audit.py [--lines real] [--size-gb 0.35] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from orchestrator.audit import audit_logs, grep_binary, load_catalogue

REPO = Path(__file__).resolve().parents[2]

# One line shape per source a vLLM TP8 server log interleaves; weights ~ a busy server
# with request logging on (request echo lines are the near misses that must not fire).
_E = "\x1b"
TEMPLATES: list[tuple[int, str]] = [
    (
        30,
        '(APIServer pid=4242) INFO:     127.0.0.1:{port} - "POST /v1/completions HTTP/1.1" 200 OK',
    ),
    (
        20,
        "(APIServer pid=4242) INFO 11-29 14:{mm:02d}:{ss:02d} [logger.py:71] Received request cmpl-{hex}-0: prompt: '{prompt}', params: SamplingParams(n=1, temperature=0.0, max_tokens=256), prompt_token_ids: None, lora_request: None.",
    ),
    (
        10,
        "(APIServer pid=4242) INFO 11-29 14:{mm:02d}:{ss:02d} [loggers.py:123] Engine 000: Avg prompt throughput: {f1:.1f} tokens/s, Avg generation throughput: {f2:.1f} tokens/s, Running: {n} reqs, Waiting: 0 reqs, GPU KV cache usage: {f3:.1f}%, Prefix cache hit rate: 0.0%",
    ),
    (
        10,
        _E
        + "[36m(Worker_TP{tp} pid=51{tp:02d})"
        + _E
        + "[0m DEBUG 11-29 14:{mm:02d}:{ss:02d} [gpu_model_runner.py:1923] decode step: batch {n}, spec tokens accepted {n2}, cudagraph hit",
    ),
    (
        8,
        "node-3:51{tp:02d}:52{tp:02d} [{tp}] NCCL INFO Channel {ch:02d}/32 : {tp}[{tp}] -> {tp2}[{tp2}] via P2P/CUMEM/read",
    ),
    (
        6,
        "(Worker_TP{tp} pid=51{tp:02d}) INFO 11-29 14:{mm:02d}:{ss:02d} [fusedq.py:41] fusedq: fused MLA query enabled (H=8, bf16, backend=triton)",
    ),
    (
        5,
        "(EngineCore_DP0 pid=5000) INFO 11-29 14:{mm:02d}:{ss:02d} [core.py:{n}] scheduler: {n} running, {n2} waiting, kv blocks free {port}",
    ),
    (
        4,
        "(Worker_TP{tp} pid=51{tp:02d}) INFO 11-29 14:{mm:02d}:{ss:02d} [gpu_worker.py:276] Memory profiling takes {f1:.2f} seconds; the rest of the memory reserved for KV Cache is 120.10 GiB.",
    ),
    (
        3,
        "Capturing CUDA graphs (decode, FULL): {n}%|#####     | {n}/67 [00:0{tp}<00:01, 22.1it/s]\rCapturing CUDA graphs (decode, FULL): 100%|##########| 67/67 [00:03<00:00, 21.7it/s]",
    ),
    (
        2,
        "(APIServer pid=4242) WARNING 11-29 14:{mm:02d}:{ss:02d} [protocol.py:90] The following fields were present in the request but ignored: {{'top_k'}}",
    ),
    (
        2,
        "(APIServer pid=4242) INFO 11-29 14:{mm:02d}:{ss:02d} [health.py:31] Health check: 0 errors, 0 warnings",
    ),
]
PROMPTS = [
    "Summarise the history of the printing press in three sentences",
    "Write a haiku about autumn rain over a quiet harbour",
    "Explain why GPU kernels prefer coalesced memory access patterns",
    "Translate 'good morning, how are you' into French and German",
    "List five prime numbers larger than one hundred",
]
# Injected faults (one line each): what a real failure leaves behind.
FAULTS = [
    "(Worker_TP3 pid=5103) ERROR 11-29 14:31:07 [multiproc_executor.py:671] torch.AcceleratorError: CUDA error: an illegal memory access was encountered",
    "node-3:5103:5377 [3] NCCL WARN Cuda failure 'an illegal memory access was encountered'",
    "[rank5]:[E1129 14:41:06.432379535 ProcessGroupNCCL.cpp:632] [Rank 5] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=808, OpType=ALLREDUCE, NumelIn=9801523, NumelOut=9801523, Timeout(ms)=600000) ran for 600020 milliseconds before timing out.",
    "RuntimeError: CUDA error: CUBLAS_STATUS_EXECUTION_FAILED when calling `cublasGemmStridedBatchedEx(handle, opa, opb, m, n, k, ...)`",
    "(APIServer pid=4242) ERROR 11-29 14:31:08 [core_client.py:564] Engine core proc EngineCore_DP0 died unexpectedly, shutting down client.",
    "2026-11-29T14:31:07,123456+00:00 NVRM: Xid (PCI:0000:65:00): 31, pid=5103, name=python3, Ch 00000008, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f3c_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ",
]


def generate(path: Path, size: int, seed: int = 4) -> int:
    """Write ``size`` bytes of log with FAULTS spread through it; returns the fault count."""
    rng = random.Random(seed)
    weights = [w for w, _ in TEMPLATES]
    pool = []
    for _ in range(20000):
        _, tpl = rng.choices(TEMPLATES, weights)[0]
        tp = rng.randrange(8)
        pool.append(
            tpl.format(
                port=rng.randrange(30000, 60000),
                mm=rng.randrange(60),
                ss=rng.randrange(60),
                hex=f"{rng.getrandbits(48):012x}",
                prompt=rng.choice(PROMPTS),
                f1=rng.random() * 900,
                f2=rng.random() * 300,
                f3=rng.random() * 90,
                n=rng.randrange(1, 64),
                n2=rng.randrange(64),
                tp=tp,
                tp2=(tp + 1) % 8,
                ch=rng.randrange(32),
            )
            + "\n"
        )
    chunk_lines = 50000
    n_chunks_est = max(1, size // (chunk_lines * 150))
    fault_at = {int(i * n_chunks_est / len(FAULTS)) + 1 for i in range(len(FAULTS))}
    written = 0
    chunk_no = 0
    faults = list(FAULTS)
    with path.open("w", encoding="utf-8") as fh:
        while written < size:
            lines = rng.choices(pool, k=chunk_lines)
            chunk_no += 1
            if chunk_no in fault_at and faults:
                lines[rng.randrange(chunk_lines)] = faults.pop(0) + "\n"
            text = "".join(lines)
            fh.write(text)
            written += len(text.encode())
        for f in faults:  # size too small for the spread: put the rest at the end
            fh.write(f + "\n")
    return len(FAULTS)


# The real vLLM server logs the repository holds: the audit tests' (CPU vLLM 0.32, a TP4 GPU
# run, a shutdown) and the H200 validation runs' (vLLM 0.26).
REAL_LOGS = ("tests/orchestrator/fixtures/audit/vllm_*.log", "docs/validation/**/server.log")
# The one fault of the real log: the kernel line of the silent-MTP Xid 31 (tests' dmesg fixture).
REAL_FAULT = (
    "2026-11-29T14:02:11,123456+00:00 NVRM: Xid (PCI:0000:65:00): 31, pid=4242, name=python3, "
    "Ch 00000008, intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ "
    "0x7f3c_00000000. Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ"
)


def real_lines(pattern: str) -> list[bytes]:
    """The real logs' lines that match no signature (blank ones dropped), in file order."""
    regex = re.compile(pattern.encode())
    lines = []
    for glob in REAL_LOGS:
        for path in sorted(REPO.glob(glob)):
            lines += [ln for ln in path.read_bytes().split(b"\n") if ln.strip()]
    return [ln + b"\n" for ln in lines if not regex.search(ln)]


def generate_real(path: Path, size: int, pattern: str) -> int:
    """Write ``size`` bytes of the real logs' clean lines, repeated, with REAL_FAULT halfway;
    returns the fault count (1)."""
    block = b"".join(real_lines(pattern))
    if not block:
        raise SystemExit(f"no real vLLM log under {REPO} matches {REAL_LOGS}")
    copies = max(1, size // len(block))
    with path.open("wb") as fh:
        for i in range(copies):
            if i == copies // 2:
                fh.write(REAL_FAULT.encode() + b"\n")
            fh.write(block)
    return 1


def _cpu() -> float:
    # CPU seconds of this process and its waited-for children (grep, wc): unlike wall time
    # it barely moves when other jobs share the 2-core sandbox.
    me = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime


def _time(fn: Callable[[], Any], repeat: int = 1) -> tuple[float, float, Any]:
    """Best wall seconds and best CPU seconds over ``repeat`` runs, and the last result."""
    walls, cpus, out = [], [], None
    for _ in range(repeat):
        c0, t0 = _cpu(), time.perf_counter()
        out = fn()
        walls.append(time.perf_counter() - t0)
        cpus.append(_cpu() - c0)
    return min(walls), min(cpus), out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--lines", choices=("real", "synthetic"), default="real")
    ap.add_argument("--size-gb", type=float, default=0.35)
    ap.add_argument("--path", type=Path, default=Path("/tmp/bench_audit.log"))
    ap.add_argument("--reuse", action="store_true", help="reuse --path if it is already big enough")
    ap.add_argument("--keep", action="store_true", help="keep the generated log")
    ap.add_argument("--repeat", type=int, default=3, help="runs per tool; the best is kept")
    ap.add_argument("--json", action="store_true", help="print the figures as JSON")
    args = ap.parse_args(argv)

    size = int(args.size_gb * (1 << 30))
    cat = load_catalogue()
    pattern = cat.grep_pattern()
    if not (args.reuse and args.path.exists() and args.path.stat().st_size >= size):
        if args.lines == "real":
            t, _, _ = _time(lambda: generate_real(args.path, size, pattern))
        else:
            t, _, _ = _time(lambda: generate(args.path, size))
        mib = args.path.stat().st_size / 2**20
        print(f"generated {args.path} ({mib:.0f} MiB) in {t:.1f} s", file=sys.stderr)
    mib = args.path.stat().st_size / 2**20
    # Warm the page cache so both tools read from memory.
    subprocess.run(["cat", str(args.path)], stdout=subprocess.DEVNULL, check=True)

    def grep_run(locale: str | None) -> int:
        env = dict(os.environ)
        if locale:
            env["LC_ALL"] = locale
        argv = ["grep", "-E", "-c", pattern, str(args.path)]
        out = subprocess.run(argv, capture_output=True, env=env, check=False)
        return int(out.stdout.strip() or 0)

    def audit_run(kind: str) -> tuple[int, int]:
        res = audit_logs(
            [args.path], include_kernel_log=False, include_gpu_state=False, prefilter=kind
        )
        return len({f.line for f in res.findings}), len(res.findings)

    locale_now = os.environ.get("LC_ALL") or os.environ.get("LANG") or "unset"
    tools: list[tuple[str, Callable[[], Any]]] = [
        ("grep -E -c (LC_ALL=C)", lambda: grep_run("C")),
        (f"grep -E -c (locale {locale_now})", lambda: grep_run(None)),
    ]
    for kind in ["grep", "python"] if grep_binary() else ["python"]:
        tools.append((f"orchestrator audit (prefilter={kind})", lambda kind=kind: audit_run(kind)))

    rows: list[dict[str, Any]] = []
    for name, fn in tools:
        wall, cpu, out = _time(fn, args.repeat)
        lines = out[0] if isinstance(out, tuple) else out
        rows.append(
            {
                "tool": name,
                "seconds": round(wall, 2),
                "cpu_seconds": round(cpu, 2),
                "mb_s": round(mib / wall, 1),
                "cpu_mb_s": round(mib / cpu, 1),
                "matching_lines": lines,
            }
        )
    base = rows[0]
    for r in rows:
        r["ratio"] = round(r["mb_s"] / base["mb_s"], 2)
        r["cpu_ratio"] = round(r["cpu_mb_s"] / base["cpu_mb_s"], 2)
    if args.json:
        doc = {"file_mib": round(mib), "lines": args.lines, "cpus": os.cpu_count(), "rows": rows}
        print(json.dumps(doc, indent=2))
    else:
        print(
            f"log: {args.path} ({mib:.0f} MiB, {args.lines} lines), {os.cpu_count()} CPUs, "
            f"catalogue v{cat.version}, "
            f"best of {args.repeat}; ratio = MB/s / MB/s of grep -E -c (LC_ALL=C)"
        )
        print(
            f"  {'tool':42s} {'wall s':>7s} {'MB/s':>8s} {'ratio':>6s} {'CPU s':>7s} "
            f"{'CPU MB/s':>9s} {'ratio':>6s}  lines"
        )
        for r in rows:
            print(
                f"  {r['tool']:42s} {r['seconds']:7.2f} {r['mb_s']:8.1f} {r['ratio']:6.2f} "
                f"{r['cpu_seconds']:7.2f} {r['cpu_mb_s']:9.1f} {r['cpu_ratio']:6.2f}  "
                f"{r['matching_lines']}"
            )
    if not args.keep:
        args.path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
