"""The one line per worker process: the plugin's mode, its enabled or disabled line, and the
kernels line beside it."""

from __future__ import annotations

import logging
import os
import threading

from fusedq.contract import DISABLED_LINE, ENABLED_LINE, MODE_ENV, MODES

logger = logging.getLogger("vllm.fusedq")  # under vLLM's logger: its handler and format


class FusedqRequiredError(RuntimeError):
    """FUSEDQ_MLA_QUERY=1 and the fused MLA query cannot be used (the message says why)."""


# Which kernels the decode hook's calls may bind: "triton" (the default) keeps them to the
# Triton family (Gluon, tl.dot, register); "auto" lets them take what fusedq.kernel_choice
# picks, the CuTe DSL kernel included where nvidia-cutlass-dsl imports (M <= 2 BF16 / <= 4
# MXFP8, GLM-5's geometry, in CUDA graphs). "triton" stays the default until a GPU server
# A/B has shown the CuTe kernel inside vLLM.
BACKEND_ENV = "FUSEDQ_BACKEND"
HOOK_BACKENDS = ("triton", "auto")


def hook_backend() -> str:
    """The normalised ``FUSEDQ_BACKEND`` value; ``ValueError`` naming it for anything else."""
    raw = os.environ.get(BACKEND_ENV, "").strip().lower() or HOOK_BACKENDS[0]
    if raw not in HOOK_BACKENDS:
        raise ValueError(
            f"{BACKEND_ENV}={os.environ.get(BACKEND_ENV)!r} is not one of "
            f"{', '.join(HOOK_BACKENDS)}"
        )
    return raw


def mode() -> str:
    """The normalised ``FUSEDQ_MLA_QUERY`` value; ``ValueError`` for anything else."""
    raw = os.environ.get(MODE_ENV, "auto").strip().lower() or "auto"
    if raw not in MODES:
        raise ValueError(
            f"{MODE_ENV}={os.environ.get(MODE_ENV)!r} is not one of {', '.join(MODES)}"
        )
    return raw


class WorkerReport:
    """The per-process state behind "one line per worker process"."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.first: str | None = None  # the line logged, once
        self.seen: set[tuple] = set()  # outcomes already told (later layers repeat them)
        self.refused: str | None = None  # why register() left vLLM untouched
        self.kernels: str | None = None  # the kernels line's text (fusedq.kernel_summary)

    def once(self, line: str, *, warn: bool = False) -> bool:
        with self.lock:
            if self.first is not None:
                return False
            self.first = line
        (logger.warning if warn else logger.info)(line)
        return True

    def new(self, outcome: tuple) -> bool:
        """Whether this outcome is news in this process (and remember it)."""
        with self.lock:
            fresh = outcome not in self.seen
            self.seen.add(outcome)
        return fresh


worker_report = WorkerReport()


def enabled_line(num_heads: int, fmt: str, prewarmed: str, pdl: bool, query: str) -> str:
    # pdl is the process default the decode hook's calls resolve to (FUSEDQ_PDL, read at
    # import): a run's server log then says which launch mode a measurement ran under. query
    # is the QUERY_FORMS name the backend is handed (a tensor, or the pair of views).
    return (
        f"{ENABLED_LINE} (heads={num_heads}, format={fmt}, query={query}, "
        f"prewarmed M={prewarmed}, pdl={'on' if pdl else 'off'})"
    )


def disabled_line(reason: str) -> str:
    return f"{DISABLED_LINE}: {reason}"


def report_line() -> str | None:
    """The one enabled/disabled line this process logged at set-up, if any yet."""
    return worker_report.first


def kernels_line() -> str | None:
    """The kernels line's text (which kernel each decode M runs), if an enabled line was."""
    return worker_report.kernels
