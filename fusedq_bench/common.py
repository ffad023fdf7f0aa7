"""What fusedq-bench's two measurements (CUDA-graph replay in ``harness``, host time per call
in ``eager``) share: the recipes it names, the ABBA order, the Markdown table it prints, and
where a figure was measured (the checkout's commit, nvidia-smi's answer).

Standard library only, and nothing of the orchestrator: fusedq runs on GPU hosts without it.
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

FORMATS = ("bf16", "mxfp8", "e4m3", "mxfp8-e4m3")
# Each format's recipe: (weight format, E4M3 output). "e4m3" is BF16 weights with E4M3 output
# (its name predates the MXFP8 -> E4M3 rows); the staged path always has the BF16 weights.
RECIPES: dict[str, tuple[str, bool]] = {
    "bf16": ("bf16", False),
    "mxfp8": ("mxfp8", False),
    "e4m3": ("bf16", True),
    "mxfp8-e4m3": ("mxfp8", True),
}
# A probe that hangs (a wedged driver) must not hold a benchmark.
PROBE_TIMEOUT_S = 60


def out_dtype_of(out_fp8: bool):
    """The output dtype of a recipe with (True) or without E4M3 output."""
    import torch

    return torch.float8_e4m3fn if out_fp8 else torch.bfloat16


def abba_order(names: Sequence[str], samples: int) -> list[str]:
    """Forward order on even samples, reversed on odd ones (A B C, C B A, ...)."""
    order: list[str] = []
    for i in range(samples):
        order.extend(names if i % 2 == 0 else reversed(names))
    return order


def md_table(header: Sequence[object], body: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table; a '|' inside a cell (an error message) is escaped."""
    rows = [header, ["---"] * len(header), *body]
    return "\n".join("| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |" for r in rows)


class NvidiaSmiError(RuntimeError):
    """nvidia-smi gave no answer; the message says why in one line."""


def nvidia_smi(args: Sequence[str]) -> str:
    """The output of ``nvidia-smi ARGS``, or NvidiaSmiError naming why there is none."""
    try:
        proc = subprocess.run(
            ["nvidia-smi", *args], capture_output=True, text=True, timeout=PROBE_TIMEOUT_S
        )
    except FileNotFoundError:
        raise NvidiaSmiError("nvidia-smi not found") from None
    except (OSError, subprocess.SubprocessError) as exc:
        raise NvidiaSmiError(f"nvidia-smi: {exc}") from None
    if proc.returncode != 0:
        said = (proc.stdout + proc.stderr).strip().splitlines()
        raise NvidiaSmiError(f"nvidia-smi: {said[0] if said else f'exit {proc.returncode}'}")
    return proc.stdout
