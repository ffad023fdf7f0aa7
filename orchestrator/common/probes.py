"""What the machine and the checkout are: git commit, package versions, the driver, nvidia-smi.

Every environment probe of the orchestrator lives here, so a run's manifest, gpu-check and
the audit's GPU-state reader ask the same way and name a failure the same way. Stdlib only:
the audit imports this and must stay light.

A probe that can run on another node (nvidia-smi, for the audit of a server placed there)
takes a ``runner``: ``argv -> CompletedProcess``, this machine's ``run_command`` by default,
a node agent's on a cluster (orchestrator.cluster.nodes).
"""

from __future__ import annotations

import getpass
import importlib.metadata as md
import os
import platform
import socket
import subprocess
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
# One command of a probe; a slow kernel log or a wedged driver must not hold a case for long.
COMMAND_TIMEOUT_S = 60

Runner = Callable[[list[str]], "subprocess.CompletedProcess[str]"]


def run_command(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """Run `argv` here (no shell), text out, undecodable bytes replaced, bounded in time."""
    return subprocess.run(
        argv,
        capture_output=True,
        text=True,
        errors="replace",
        timeout=COMMAND_TIMEOUT_S,
        check=False,
    )


def first_line(text: str) -> str:
    """The first non-blank line of a command's output, stripped ("" when there is none)."""
    for line in text.splitlines():
        if line.strip():
            return line.strip()
    return ""


class NvidiaSmiError(RuntimeError):
    """nvidia-smi gave no answer; the message says why in one line (for a report)."""


def nvidia_smi(args: Sequence[str], *, runner: Runner | None = None) -> str:
    """The output of ``nvidia-smi ARGS``, or NvidiaSmiError naming why there is none: not
    installed, could not run, or its exit code with its first line (the driver's complaint)."""
    argv = ["nvidia-smi", *args]
    try:
        proc = (runner or run_command)(argv)
    except FileNotFoundError:
        raise NvidiaSmiError("nvidia-smi not found") from None
    except (OSError, subprocess.SubprocessError) as exc:
        raise NvidiaSmiError(f"nvidia-smi: {exc}") from None
    if proc.returncode != 0:
        why = first_line(proc.stdout) or first_line(proc.stderr) or f"exit {proc.returncode}"
        raise NvidiaSmiError(f"nvidia-smi: {why}")
    return proc.stdout


def gpu_inventory(runner: Runner | None = None) -> list[str]:
    """`nvidia-smi -L` lines; empty where there is no NVIDIA GPU (or no working driver)."""
    try:
        out = nvidia_smi(["-L"], runner=runner)
    except NvidiaSmiError:
        return []
    return [line for line in out.splitlines() if line.strip()]


def gpu_bus_ids(runner: Runner | None = None) -> dict[str, str]:
    """GPU uuid -> PCI bus id, from nvidia-smi (which ignores CUDA_VISIBLE_DEVICES)."""
    try:
        out = nvidia_smi(["--query-gpu=uuid,pci.bus_id", "--format=csv,noheader"], runner=runner)
    except NvidiaSmiError:
        return {}
    ids = {}
    for line in out.splitlines():
        uuid, _, bus = (p.strip() for p in line.partition(","))
        if uuid and bus:
            ids[uuid] = bus
    return ids


def git_commit(root: Path = REPO_ROOT) -> dict[str, Any]:
    """Commit and dirtiness of the checkout the orchestrator (and the fusedq it ships) runs from
    (one home: fusedq/provenance.py, read without importing torch)."""
    from fusedq import provenance

    return provenance.git_commit(root)


def dist_version(name: str) -> str | None:
    """The installed version of a distribution, None when it is not installed."""
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def versions(vllm_version: str) -> dict[str, str | None]:
    """Versions of what a run's figures depend on; vLLM's is the engine's to read (its own
    metadata, asked of the interpreter that serves)."""
    return {
        "vllm": vllm_version,
        "fusedq": dist_version("fusedq"),
        "torch": dist_version("torch"),
        "triton": dist_version("triton"),
        "ray": dist_version("ray"),
        "python": platform.python_version(),
    }


def driver_info() -> dict[str, Any]:
    """Who runs the orchestrator, where, how (argv redacted by the caller that records it)."""
    return {
        "hostname": socket.gethostname(),
        "user": getpass.getuser(),
        "pid": os.getpid(),
        "python": sys.executable,
        "argv": list(sys.argv),
        "platform": platform.platform(),
    }
