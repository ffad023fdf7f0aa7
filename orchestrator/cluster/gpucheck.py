"""`orchestrator gpu-check`: prove a cluster places topologies the way a matrix run needs.

Before a night of GLM-5 topologies, three things must hold on every node, and none of them
shows on one GPU:

1. **Placement.** Ray gives each TP-sized bundle exactly tp GPUs of one node: the server sees
   tp devices (CUDA_VISIBLE_DEVICES, torch's count), distinct PCI bus ids, and bundles placed
   side by side share none.
2. **The shipped kernel works on every rank.** Each bundle runs the driver's fusedq (shipped
   through Ray, fingerprint checked at placement): its GPU tests and ``fusedq-bench``.
3. **The DCP gather after the fused query.** The ranks of a bundle all-gather their fused
   ``[M, H_local, 576]`` queries over NCCL, as vLLM's DCP decode does, and the result equals
   the gather of the staged path (within fusedq's tolerance table; RoPE part bit-exact).

Rounds run in order of tp; within a round every bundle that fits is placed at once. The same
Launcher that starts `vllm serve` starts `python -m orchestrator.cluster.gpucheck_worker` in each
bundle, so the check exercises the real placement path. The audit then reads every log this
produced, plus the kernel log. Results: ``gpu-check.json`` and ``gpu-check.md`` in the output
directory; exit 0 all good, 1 a check failed, 2 bad input.
"""

from __future__ import annotations

import datetime as dt
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from fusedq import contract
from orchestrator.cluster.gpucheck_worker import MARKER
from orchestrator.common.mdtable import md_table

DEFAULT_TPS = (1, 2, 4, 8)
MODEL_HEADS = 64  # GLM-5 / DeepSeek-V3: the head count the per-rank shapes derive from


class GpuCheckError(ValueError):
    """Bad input for gpu-check: nothing was launched."""


@dataclass
class GpuCheckOptions:
    out_dir: Path
    tps: Sequence[int] = DEFAULT_TPS
    heads: int = MODEL_HEADS
    ray_address: str | None = None
    tests: Path | None = None
    bench: bool = True
    bench_samples: int = 300
    bench_m: Sequence[int] = (1, 8, 32)
    round_timeout_s: float = 1200.0
    placement_timeout_s: float = 120.0
    # Testing on a machine without GPUs: a local Ray declares this many, workers run the DCP
    # gather over gloo with Triton's interpreter, and device checks use CUDA_VISIBLE_DEVICES.
    local_gpus: int | None = None
    allow_cpu: bool = False
    log: Callable[[str], None] = field(default=print)


def bench_heads(tp: int, heads: int) -> tuple[list[int], str | None]:
    """The per-rank head counts to benchmark in a bundle of `tp` GPUs, and why if substituted.

    A rank of a TP-tp server holds heads/tp heads. fusedq is qualified for 8, 11 and 16 (TP8,
    TP6 and TP4 of 64 heads); a smaller bundle benchmarks the TP8 and TP4 shapes instead (the
    smallest and the largest qualified: 11 is TP6's padded count, between them).
    """
    qualified = contract.QUALIFIED[contract.GLM5.name].heads
    per_rank = -(-heads // tp)
    if per_rank in qualified:
        return [per_rank], None
    shapes = [min(qualified), max(qualified)]
    return shapes, (
        f"{heads}/{tp} = {per_rank} heads per rank is outside fusedq's qualified "
        f"{tuple(qualified)}; benchmarked the TP8 and TP4 per-rank shapes {tuple(shapes)}"
    )


# The worker serves nothing to the driver: its port is the DCP rendezvous, bound on loopback of
# its own node. A port free on every address is free there too, and a bundle on another node
# is not refused as unreachable (as a loopback-bound server there would be).
_PORT_HOST = "0.0.0.0"


def _round_matrix(tp: int, bundles: int, heads: int, host: str) -> Any:
    from orchestrator.config.load import parse_matrix

    doc = {
        "name": "gpu-check",
        "models": [{"label": "gpu-check", "path": "none", "num_heads": heads}],
        "resources": {"accelerator": "gpu"},
        "topologies": [{"tp": tp}],
        # The matrix format needs a workload; gpu-check measures none through it.
        "workloads": [{"name": "none", "prompt_tokens": 1, "output_tokens": 1, "requests": 1}],
        "variants": [{"name": f"bundle{i}"} for i in range(bundles)],
        "host": host,
        # _PORT_HOST picks free ports; nothing serves on it (see above).
        "bind_all_interfaces": True,
    }
    return parse_matrix(yaml.safe_dump(doc), f"gpu-check tp{tp}")


def parse_worker_log(text: str) -> dict[str, Any] | None:
    """The worker's result: the last ``GPUCHECK-RESULT {json}`` line of its log."""
    for line in reversed(text.splitlines()):
        if line.startswith(MARKER):
            try:
                return json.loads(line[len(MARKER) :])
            except ValueError:
                return None
    return None


def placement_problems(tp: int, bundles: list[dict[str, Any]], *, cuda: bool) -> list[str]:
    """What is wrong with how one round's bundles were given their GPUs (empty: nothing)."""
    problems: list[str] = []
    seen: dict[tuple[str, str], str] = {}
    for b in bundles:
        name = b["bundle"]
        visible = [v for v in (b.get("cuda_visible_devices") or "").split(",") if v.strip()]
        if len(visible) != tp:
            problems.append(
                f"{name}: CUDA_VISIBLE_DEVICES={b.get('cuda_visible_devices')!r}, want {tp} GPUs"
            )
        if len(b.get("ray_gpu_ids") or []) != tp:
            problems.append(f"{name}: Ray assigned GPUs {b.get('ray_gpu_ids')}, want {tp}")
        ids = visible
        if cuda:
            if b.get("device_count") != tp:
                problems.append(f"{name}: torch sees {b.get('device_count')} devices, want {tp}")
            ids = [d.get("pci_bus_id") or "" for d in b.get("devices", [])]
            if not all(ids):
                problems.append(f"{name}: a device has no PCI bus id: {ids}")
            if len(set(ids)) != len(ids):
                problems.append(f"{name}: devices repeat a PCI bus id: {ids}")
        # Bundles side by side on one node must not share a GPU.
        for i in ids:
            key = (b.get("node_ip") or "", i)
            if i and key in seen:
                problems.append(f"{name} and {seen[key]} share GPU {i} on {key[0]}")
            seen[key] = name
    return problems


def _summarise_bench(rows: list[dict[str, Any]] | None) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for r in rows or []:
        if "fused_over_staged" not in r:
            continue
        f = out.setdefault(r["format"], {"min": r["fused_over_staged"], "max": 0.0, "shapes": 0})
        f["min"] = min(f["min"], r["fused_over_staged"])
        f["max"] = max(f["max"], r["fused_over_staged"])
        f["shapes"] += 1
    return out


def _checked_out_dir(opts: GpuCheckOptions) -> Path:
    """The options' mistakes, each named, before anything starts; the output directory made."""
    if not opts.tps or any(t < 1 for t in opts.tps):
        raise GpuCheckError(f"--tp: {list(opts.tps)} must be positive GPU counts")
    if opts.tests is not None and not (opts.tests / "conftest.py").exists():
        raise GpuCheckError(f"--tests: {opts.tests} is not the fusedq test directory")
    out = Path(opts.out_dir)
    if out.exists() and any(out.iterdir()):
        raise GpuCheckError(f"--out: {out} exists and is not empty")
    out.mkdir(parents=True, exist_ok=True)
    return out


def _worker_env(opts: GpuCheckOptions) -> dict[str, str]:
    worker_env = {"PYTHONUNBUFFERED": "1"}
    for key in ("NCCL_NVLS_ENABLE", "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS"):
        # NVLink multicast stays off in every process (the shared hosts' rule), whatever the
        # caller's environment says.
        worker_env[key] = "0" if key == "NCCL_NVLS_ENABLE" else "1"
    if opts.allow_cpu:
        worker_env["TRITON_INTERPRET"] = "1"
    return worker_env


def run_gpu_check(opts: GpuCheckOptions) -> dict[str, Any]:
    """Run every round; return the result (also written to the output directory)."""
    from orchestrator.audit import audit_logs
    from orchestrator.cluster.launch import Launcher
    from orchestrator.common.probes import git_commit
    from orchestrator.results.store import write_json_atomic, write_text_atomic

    out = _checked_out_dir(opts)
    started = dt.datetime.now(dt.timezone.utc)
    commit = git_commit()["commit"]
    result: dict[str, Any] = {
        "started_at": started.isoformat(timespec="seconds"),
        "commit": commit,
        "heads": opts.heads,
        "rounds": [],
    }
    worker_env = _worker_env(opts)
    base = _round_matrix(1, 1, opts.heads, _PORT_HOST)
    t0 = time.monotonic()
    with Launcher(
        base,
        ray_address=opts.ray_address,
        # The bundles run the driver's fusedq-bench too, a package of its own.
        runtime_packages=("fusedq", "fusedq_bench", "orchestrator"),
        log=opts.log,
        local_gpus=opts.local_gpus,
    ) as launcher:
        result["cluster"] = launcher.cluster
        result["fusedq_fingerprint"] = launcher.driver_fingerprints.get("fusedq")
        for tp in sorted(set(opts.tps)):
            rnd: dict[str, Any] = {"tp": tp, "bundles": []}
            result["rounds"].append(rnd)
            _run_round(launcher, rnd, opts, out, worker_env, commit)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    audit = audit_logs([out], since=started, include_kernel_log=True, include_gpu_state=True)
    result["audit"] = {
        "status": audit.verdict.status,
        "summary": audit.summary_sentence(),
        "findings": [f.to_dict() for f in audit.findings][:50],
    }
    result["ok"] = _all_ok(result)
    write_json_atomic(out / "gpu-check.json", result)
    write_text_atomic(out / "gpu-check.md", render_markdown(result))
    return result


def _run_round(
    launcher: Any,
    rnd: dict[str, Any],
    opts: GpuCheckOptions,
    out: Path,
    worker_env: dict[str, str],
    commit: str | None,
) -> None:
    """One round: as many bundles of `rnd["tp"]` GPUs as the nodes hold, side by side, each
    running the worker; what each saw goes into `rnd`."""
    from orchestrator.cluster.launch import LaunchError
    from orchestrator.config.expand import expand

    tp = rnd["tp"]
    nodes = launcher.cluster["nodes"]
    fits = sum(n["gpus"] // tp for n in nodes)
    if fits == 0:
        rnd["skipped"] = (
            f"no node has {tp} GPUs (largest: {max((n['gpus'] for n in nodes), default=0)})"
        )
        opts.log(f"tp{tp}: skipped: {rnd['skipped']}")
        return
    heads, note = bench_heads(tp, opts.heads)
    if note:
        rnd["bench_note"] = note
    opts.log(f"tp{tp}: placing {fits} bundle(s) of {tp} GPU(s) side by side")
    cases = expand(_round_matrix(tp, fits, opts.heads, _PORT_HOST))
    handles = []
    try:
        for case in cases:
            handles.append(launcher.place(case, opts.placement_timeout_s))
    except LaunchError as exc:
        rnd["error"] = str(exc)
        opts.log(f"tp{tp}: {exc}")
        for h in handles:
            launcher.release(h)
        return
    try:
        for h in handles:
            _start_worker(launcher, h, tp, heads, opts, out, worker_env, commit)
        _wait_all(launcher, handles, opts.round_timeout_s)
    finally:
        for h in handles:
            # stop() copies a remote node's log while the actor that reads it lives.
            h.info["exit_code"] = launcher.stop(
                h, grace_s=5.0, log_dest=out / f"tp{tp}-{h.case.variant.name}.log"
            )
    for h in handles:
        rnd["bundles"].append(_bundle_entry(h, tp, out))
    rnd["placement_problems"] = placement_problems(tp, rnd["bundles"], cuda=not opts.allow_cpu)
    opts.log(_round_line(rnd))


def _start_worker(
    launcher: Any,
    handle: Any,
    tp: int,
    heads: list[int],
    opts: GpuCheckOptions,
    out: Path,
    env: dict[str, str],
    commit: str | None,
) -> None:
    def argv_for(port: int, host: str) -> list[str]:
        argv = [
            handle.info.get("python") or sys.executable,
            "-m",
            "orchestrator.cluster.gpucheck_worker",
        ]
        argv += ["--tp", str(tp), "--bench-samples", str(opts.bench_samples)]
        if opts.bench:
            argv += ["--bench-heads", *map(str, heads), "--bench-m", *map(str, opts.bench_m)]
        if opts.tests is not None:
            argv += ["--tests", str(opts.tests.resolve())]
        if tp >= 2:
            # The free port Ray's actor found on the node is the gather's rendezvous.
            argv += ["--dcp-port", str(port)]
        if opts.allow_cpu:
            argv += ["--allow-cpu"]
        if commit:
            argv += ["--commit", commit]
        return argv

    # On the driver's node the worker writes here directly and fetch_log leaves it be; from
    # another node fetch_log copies it here.
    log_path = out / f"tp{tp}-{handle.case.variant.name}.log"
    launcher.start(handle, argv_for, env, log_path)


def _wait_all(launcher: Any, handles: list[Any], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(handles)
    while pending and time.monotonic() < deadline:
        pending = [h for h in pending if launcher.exit_code(h) is None]
        if pending:
            time.sleep(1.0)
    for h in pending:
        h.info["timed_out"] = True


def _bundle_entry(handle: Any, tp: int, out: Path) -> dict[str, Any]:
    info = handle.info
    log = out / f"tp{tp}-{handle.case.variant.name}.log"
    text = log.read_text(errors="replace") if log.exists() else ""
    worker = parse_worker_log(text) or {}
    devices = worker.get("devices", {})
    entry: dict[str, Any] = {
        "bundle": handle.case.variant.name,
        "node_ip": info.get("node_ip"),
        "hostname": info.get("hostname"),
        "ray_gpu_ids": info.get("gpu_ids"),
        "cuda_visible_devices": devices.get(
            "cuda_visible_devices", info.get("cuda_visible_devices")
        ),
        "device_count": devices.get("device_count"),
        "devices": devices.get("devices", []),
        "fusedq_fingerprint": info.get("fusedq_fingerprint"),
        "fusedq_file": worker.get("fusedq_file"),
        "exit_code": info.get("exit_code", None),
        "log": str(log),
    }
    if info.get("timed_out"):
        entry["error"] = "timed out"
    elif not worker:
        entry["error"] = "the worker printed no result (see its log)"
    elif "error" in worker:
        entry["error"] = worker["error"].strip().splitlines()[-1]
    for key in ("tests", "dcp"):
        if key in worker:
            entry[key] = worker[key]
    if "bench" in worker:
        entry["bench"] = worker["bench"]
        entry["bench_summary"] = _summarise_bench(worker["bench"])
    return entry


def _bundle_ok(b: dict[str, Any]) -> bool:
    return (
        "error" not in b
        and b.get("tests", {}).get("ok", True)
        and b.get("dcp", {}).get("ok", True)
        and all("error" not in r for r in b.get("bench", []))
    )


def _all_ok(result: dict[str, Any]) -> bool:
    placed = [r for r in result["rounds"] if "skipped" not in r]
    return (
        bool(placed)
        and all("error" not in r and not r.get("placement_problems") for r in placed)
        and all(_bundle_ok(b) for r in placed for b in r["bundles"])
        and result.get("audit", {}).get("status") == "clean"
    )


def _round_line(rnd: dict[str, Any]) -> str:
    parts = []
    for b in rnd["bundles"]:
        ids = ",".join(d.get("pci_bus_id") or "?" for d in b.get("devices", [])) or "-"
        status = "ok" if _bundle_ok(b) else f"FAILED ({b.get('error', 'a check failed')})"
        parts.append(
            f"{b['bundle']} CUDA_VISIBLE_DEVICES={b['cuda_visible_devices']} [{ids}] {status}"
        )
    probs = rnd.get("placement_problems") or []
    return f"tp{rnd['tp']}: " + "; ".join(parts) + (f"; PLACEMENT: {probs}" if probs else "")


def _ratio(s: dict[str, Any], fmt: str) -> str:
    f = s.get(fmt)
    return f"{f['min']:.2f}–{f['max']:.2f}× ({f['shapes']})" if f else "-"


def render_markdown(result: dict[str, Any]) -> str:
    header = ["TP", "Bundle", "Node", "CUDA_VISIBLE_DEVICES", "PCI bus ids", "GPU tests"]
    header += ["DCP gather", "BF16 fused/staged", "MXFP8 fused/staged", "Status"]
    body: list[list[object]] = []
    notes = []
    for rnd in result["rounds"]:
        if "skipped" in rnd or "error" in rnd:
            why = rnd.get("skipped") or rnd.get("error")
            body.append([rnd["tp"], *["-"] * 8, f"skipped: {why}"])
            continue
        if rnd.get("bench_note"):
            notes.append(f"TP{rnd['tp']}: {rnd['bench_note']}.")
        for p in rnd.get("placement_problems") or []:
            notes.append(f"TP{rnd['tp']} placement: {p}.")
        for b in rnd["bundles"]:
            ids = ", ".join(d.get("pci_bus_id") or "?" for d in b.get("devices", [])) or "-"
            s = b.get("bench_summary", {})
            status = "ok" if _bundle_ok(b) else f"FAILED: {b.get('error', 'a check failed')}"
            body.append(
                [
                    rnd["tp"],
                    b["bundle"],
                    b.get("hostname") or b.get("node_ip"),
                    b["cuda_visible_devices"],
                    ids,
                    b.get("tests", {}).get("summary", "-"),
                    _dcp_cell(b.get("dcp")),
                    _ratio(s, "bf16"),
                    _ratio(s, "mxfp8"),
                    status,
                ]
            )
    audit = result.get("audit", {})
    lines = [
        "# gpu-check",
        "",
        f"Started {result['started_at']}, commit {result.get('commit') or '?'}, "
        f"fusedq {result.get('fusedq_fingerprint') or '?'}, wall {result.get('wall_s', 0)} s. "
        f"**{'PASSED' if result.get('ok') else 'FAILED'}**.",
        "",
        md_table(header, body),
        "",
        f"Audit ({audit.get('status')}): {audit.get('summary')}",
        "",
    ]
    lines += [f"- {n}" for n in notes]
    return "\n".join(lines).rstrip() + "\n"


def _dcp_cell(dcp: dict[str, Any] | None) -> str:
    """The DCP gather's verdict: equal or not, its shape, the largest difference from staged."""
    if not dcp:
        return "-"
    worst = max(
        (c["max_abs_diff_vs_staged"] for r in dcp["ranks"] for c in r.get("checks", [])),
        default=float("nan"),
    )
    return (
        f"{'equal' if dcp['ok'] else 'MISMATCH'} ({dcp['world']} ranks, "
        f"[{dcp['M']}, {dcp['H_local'] * dcp['world']}, {contract.QUERY_WIDTH}], max |Δ| {worst:.3g})"
    )


def default_out_dir(logs_dir: Path = Path("logs")) -> Path:
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
    return logs_dir / f"gpu-check-{stamp}"


def parse_tps(text: str) -> list[int]:
    """`1,2,4,8` or `1 2 4 8` -> [1, 2, 4, 8]."""
    items = [t for t in re.split(r"[,\s]+", text.strip()) if t]
    try:
        return [int(t) for t in items]
    except ValueError:
        raise GpuCheckError(f"--tp: {text!r} is not a list of integers") from None
