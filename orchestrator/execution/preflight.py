"""`orchestrator run`'s input checks, all of them before anything starts (no Ray, no server).

Bad input costs the user one line and exit 2, and nothing is launched or written. The
checks run in the order `orchestrator plan` reads a matrix, then what only a run needs:

1. the flags among themselves (``--resume X --run-id Y`` names two runs);
2. the matrix: its structure first (keys, values, a DCP that does not divide TP, ...), then
   the ``${VAR}``s it needs that are not set (`plan` lists those as notes, so a plan can be
   read before the paths exist; a run cannot start without them);
3. ``--only``: it must select a case;
4. this machine, for a local Ray: the largest topology must fit (GPUs, or CPUs on a CPU
   matrix), named with the matrix file; a cluster's nodes are checked once it is joined;
5. the run directory: a new run's id must be a valid name not taken in the logs directory.
   A resume's directory is opened (and locked) by the runner, still before anything starts.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from orchestrator.common import probes
from orchestrator.config.errors import MatrixError
from orchestrator.config.expand import Case
from orchestrator.config.load import load_matrix
from orchestrator.config.schema import Matrix


class FlagError(ValueError):
    """Flags of one command that contradict each other."""


def check_flags(*, resume: str | None, run_id: str | None, retry_failed: bool) -> None:
    """Flags that cannot mean anything together; FlagError naming both."""
    if resume is not None and run_id is not None and run_id != resume:
        raise FlagError(
            f"--resume {resume} continues that run, --run-id {run_id} names a new one: pass one"
        )
    if retry_failed and resume is None:
        raise FlagError("--retry-failed needs --resume RUN-ID")


def load_for_run(path: str | Path, sets: Sequence[str] = ()) -> Matrix:
    """The matrix, checked as `plan` checks it: structure first, then unset ${VAR}s (which a
    run cannot do without). A structural error in a value that still holds an unset
    ``${VAR}`` is the variable's fault, and is reported as that."""
    unresolved: list[str] = []
    try:
        matrix = load_matrix(path, sets=sets, unresolved=unresolved)
    except MatrixError as exc:
        if unresolved and "${" in str(exc):
            load_matrix(path, sets=sets)  # raises the unset variable, in the matrix's words
        raise
    if unresolved:
        load_matrix(path, sets=sets)  # raises the first unset variable
    return matrix


def select(cases: Sequence[Case], only: Sequence[str], path: str | Path) -> list[Case]:
    """The cases `--only` keeps (all without it); a selection of none is an error."""
    selected = [c for c in cases if not only or any(s in c.case_id for s in only)]
    if not selected:
        raise ValueError(f"{path}: --only {list(only)} matches no case")
    return selected


def local_gpus(environ: Mapping[str, str] = os.environ) -> tuple[int, str]:
    """(GPUs a local Ray would see, how that was found): CUDA_VISIBLE_DEVICES when set,
    else `nvidia-smi -L`."""
    visible = environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        ids = [d for d in visible.split(",") if d.strip() and d.strip() != "-1"]
        return len(ids), f"CUDA_VISIBLE_DEVICES={visible!r}"
    return len(probes.gpu_inventory()), "nvidia-smi -L"


def check_machine(matrix: Matrix, path: str | Path, *, cluster: bool) -> None:
    """For a local Ray: every topology fits this machine (a topology's ranks share one node).
    MatrixError naming the file, the topology and what the machine has."""
    if cluster:
        return
    cpu = matrix.resources.accelerator == "cpu"
    have, how = (os.cpu_count() or 1, "os.cpu_count()") if cpu else local_gpus()
    unit = "CPUs" if cpu else "GPUs"
    for ti, topo in enumerate(matrix.topologies):
        need = topo.tp * (matrix.resources.cpus_per_rank if cpu else 1)
        if need > have:
            raise MatrixError(
                str(path),
                f"topologies[{ti}].tp={topo.tp}",
                f"needs {need} {unit} on one node; this machine has {have} ({how}). "
                "Run it where they are, or join a cluster with --ray-address",
            )


def check_new_run(logs_dir: Path, run_id: str | None) -> None:
    """A new run's id (when given) must be a valid name that no run in `logs_dir` has."""
    from orchestrator.results.store import new_run_root

    if run_id is not None:
        new_run_root(logs_dir, run_id)
