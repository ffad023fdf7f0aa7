"""One bundle's side of `orchestrator gpu-check`, run as a process inside a Ray bundle.

The Launcher starts it exactly as it starts `vllm serve` (same actor, same environment: the
bundle's CUDA_VISIBLE_DEVICES and the driver's shipped fusedq on PYTHONPATH), so what it sees
is what a server of that topology would see. It reports

* the devices: CUDA_VISIBLE_DEVICES, torch's device count, each device's PCI bus id;
* the fusedq GPU tests (pytest -m gpu) run here, and fusedq-bench at this rank's head count;
* the DCP query gather: every rank of the bundle computes its fused ``[M, H_local, 576]``
  query, all-gathers it over the group into ``[M, H_local * ranks, 576]`` (vLLM's DCP step
  after the query), and checks it against the gather of the staged path;

and prints one ``GPUCHECK-RESULT {json}`` line, which the driver reads from the log (the log
travels from remote nodes; a file would not).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any

from fusedq import contract
from orchestrator.common.probes import gpu_bus_ids

MARKER = "GPUCHECK-RESULT "
# vLLM's MLA decode shapes of GLM-5: 192 nope + 64 rope dims in, 512 latent + 64 rope out.
P, R, L = contract.GLM5.qk_nope, contract.QK_ROPE, contract.KV_LORA


def device_report() -> dict[str, Any]:
    """What this process can see: the bundle's GPUs as CUDA and the driver see them."""
    import torch

    rep: dict[str, Any] = {
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_available": torch.cuda.is_available(),
        "device_count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "devices": [],
    }
    smi = gpu_bus_ids()
    for i in range(rep["device_count"]):
        props = torch.cuda.get_device_properties(i)
        uuid = str(getattr(props, "uuid", "") or "")
        bus = None
        if hasattr(props, "pci_bus_id"):
            bus = (
                f"{getattr(props, 'pci_domain_id', 0):08X}:{props.pci_bus_id:02X}:"
                f"{getattr(props, 'pci_device_id', 0):02X}.0"
            )
        bus = smi.get(f"GPU-{uuid}", bus) if uuid else bus
        rep["devices"].append({"index": i, "name": props.name, "uuid": uuid, "pci_bus_id": bus})
    return rep


def run_gpu_tests(tests: str, timeout_s: float) -> dict[str, Any]:
    """`pytest -m gpu` on the fusedq tests, from a neutral directory so `fusedq` is imported
    from PYTHONPATH (the shipped copy), not from the checkout the tests live in."""
    t0 = time.monotonic()
    argv = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "-p", "no:cacheprovider", tests]
    try:
        out = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            cwd=tempfile.gettempdir(),
        )
    except subprocess.TimeoutExpired:
        return {"ok": False, "summary": f"timed out after {timeout_s:.0f} s", "seconds": timeout_s}
    tail = out.stdout.strip().splitlines()[-1:] or [""]
    counts = {k: int(v) for v, k in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail[0])}
    print(out.stdout[-6000:], out.stderr[-3000:], sep="\n", flush=True)
    return {
        "ok": out.returncode == 0 and counts.get("passed", 0) > 0,
        "returncode": out.returncode,
        "summary": tail[0],
        "counts": counts,
        "seconds": round(time.monotonic() - t0, 1),
    }


def run_bench(heads: Sequence[int], ms: Sequence[int], samples: int, commit: str | None) -> Any:
    from fusedq_bench import cli, options

    opts = options.Options(
        heads=tuple(heads), ms=tuple(ms), formats=("bf16", "mxfp8"), samples=samples, commit=commit
    )
    rows = cli.run(opts)["rows"]
    keep = ("format", "H", "M", "fused_us", "staged_us", "copy_us", "fused_over_staged", "error")
    return [{k: r[k] for k in keep if k in r} for r in rows]


# -- DCP gather ------------------------------------------------------------------------------
def _rank_inputs(rank: int, m: int, h: int, device: Any) -> tuple[Any, Any, Any]:
    """Rank `rank`'s operands, the same on whichever process builds them (seeded on the CPU),
    laid out as vLLM holds them: q sliced into nope/rope parts, W_UK_T a permuted view."""
    import torch

    gen = torch.Generator().manual_seed(1000 + rank)
    q = torch.randn(m, h, P + R, generator=gen).to(torch.bfloat16).to(device)
    w_uk = (torch.randn(L, h, P, generator=gen) * 0.05).to(torch.bfloat16).to(device)
    return q[..., :P], w_uk.permute(1, 2, 0), q[..., P:]


def _dcp_rank(rank: int, world: int, port: int, m: int, h: int, backend: str, result: Any) -> None:
    import torch
    import torch.distributed as dist

    import fusedq
    from fusedq.reference import TOLERANCES

    cuda = backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    try:
        checks = []
        q_scale = torch.tensor([0.02], device=device)
        for out_dtype in (torch.bfloat16, torch.float8_e4m3fn):
            scale = q_scale if out_dtype == torch.float8_e4m3fn else None

            def fused(r: int, out_dtype: Any = out_dtype, scale: Any = scale) -> Any:
                qn, w, qp = _rank_inputs(r, m, h, device)
                return fusedq.mla_query_projection(
                    qn, w, qp, out_dtype=out_dtype, q_scale=scale, backend="triton"
                )

            def staged(r: int, out_dtype: Any = out_dtype, scale: Any = scale) -> Any:
                qn, w, qp = _rank_inputs(r, m, h, device)
                return fusedq.staged_mla_query(qn, w, qp, out_dtype=out_dtype, q_scale=scale)

            local = fused(rank)
            # NCCL moves bf16 natively (as vLLM's DCP all-gather does); E4M3, and anything on
            # gloo, travels as its bytes.
            as_bytes = out_dtype == torch.float8_e4m3fn or not cuda
            send = local.view(torch.uint8) if as_bytes else local
            parts = [torch.empty_like(send) for _ in range(world)]
            dist.all_gather(parts, send)
            gathered = torch.cat(parts, dim=1)
            if as_bytes:
                gathered = gathered.view(out_dtype)
            # Every rank rebuilds every rank's operands: the gather must equal the local
            # kernel's output bit for bit, and the staged gather within the tolerance table.
            want_fused = torch.cat([fused(r) for r in range(world)], dim=1)
            want_staged = torch.cat([staged(r) for r in range(world)], dim=1)
            atol, rtol = TOLERANCES[("bf16", out_dtype)]
            bits = torch.uint8 if out_dtype == torch.float8_e4m3fn else torch.int16
            diff = (gathered[..., :L].float() - want_staged[..., :L].float()).abs()
            bound = atol + rtol * want_staged[..., :L].float().abs()
            checks.append(
                {
                    "out_dtype": str(out_dtype).removeprefix("torch."),
                    "shape": list(gathered.shape),
                    "gather_equals_local_fused": bool(
                        torch.equal(gathered.view(bits), want_fused.view(bits))
                    ),
                    "max_abs_diff_vs_staged": float(diff.max()),
                    "within_tolerance_vs_staged": bool((diff <= bound).all()),
                    "rope_bit_exact_vs_staged": bool(
                        torch.equal(
                            gathered[..., L:].contiguous().view(bits),
                            want_staged[..., L:].contiguous().view(bits),
                        )
                    ),
                }
            )
        ok = all(
            c["gather_equals_local_fused"]
            and c["within_tolerance_vs_staged"]
            and c["rope_bit_exact_vs_staged"]
            for c in checks
        )
        result[rank] = {"rank": rank, "device": str(device), "ok": ok, "checks": checks}
    finally:
        dist.destroy_process_group()


def _dcp_entry(rank: int, world: int, port: int, m: int, h: int, backend: str, q: Any) -> None:
    out: dict[int, Any] = {}
    try:
        _dcp_rank(rank, world, port, m, h, backend, out)
        q.put(out[rank])
    except Exception:
        q.put({"rank": rank, "ok": False, "error": traceback.format_exc()[-3000:]})


def dcp_check(world: int, port: int, m: int, h: int, backend: str) -> dict[str, Any]:
    """Run the gather over `world` processes (one per GPU of the bundle) and collect them."""
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [
        ctx.Process(target=_dcp_entry, args=(r, world, port, m, h, backend, q))
        for r in range(world)
    ]
    t0 = time.monotonic()
    for p in procs:
        p.start()
    ranks = []
    for _ in procs:
        try:
            ranks.append(q.get(timeout=300))
        except Exception:
            ranks.append({"ok": False, "error": "a rank gave no answer within 300 s"})
    for p in procs:
        p.join(timeout=30)
        if p.is_alive():
            p.kill()
    ranks.sort(key=lambda r: r.get("rank", 1 << 30))
    return {
        "ok": len(ranks) == world and all(r.get("ok") for r in ranks),
        "world": world,
        "backend": backend,
        "M": m,
        "H_local": h,
        "ranks": ranks,
        "seconds": round(time.monotonic() - t0, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m orchestrator.cluster.gpucheck_worker")
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--bench-heads", type=int, nargs="*", default=[])
    p.add_argument("--bench-m", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--bench-samples", type=int, default=300)
    p.add_argument("--tests", default=None, help="fusedq test directory to run with -m gpu")
    p.add_argument("--tests-timeout", type=float, default=900)
    p.add_argument("--dcp-port", type=int, default=0, help="0: no DCP check")
    p.add_argument("--dcp-heads", type=int, default=8)
    p.add_argument("--dcp-m", type=int, default=5)
    p.add_argument("--allow-cpu", action="store_true", help="gloo + Triton interpreter (tests)")
    p.add_argument("--commit", default=None)
    a = p.parse_args(argv)

    result: dict[str, Any] = {"tp": a.tp, "pid": os.getpid()}
    try:
        import fusedq

        result["fusedq_file"] = fusedq.__file__
        result["devices"] = device_report()
        if a.tests:
            result["tests"] = run_gpu_tests(a.tests, a.tests_timeout)
        if a.bench_heads:
            result["bench"] = run_bench(a.bench_heads, a.bench_m, a.bench_samples, a.commit)
        if a.dcp_port:
            cuda = result["devices"]["device_count"] > 0
            if not cuda and not a.allow_cpu:
                raise RuntimeError("no CUDA device visible for the DCP check")
            world = result["devices"]["device_count"] if cuda else a.tp
            result["dcp"] = dcp_check(
                world, a.dcp_port, a.dcp_m, a.dcp_heads, "nccl" if cuda else "gloo"
            )
    except Exception:
        result["error"] = traceback.format_exc()[-4000:]
    print(MARKER + json.dumps(result), flush=True)
    return 0 if "error" not in result else 1


if __name__ == "__main__":
    raise SystemExit(main())
