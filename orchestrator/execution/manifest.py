"""A run directory's record of what ran it: the manifest a new run writes, and each resume
adds to (``resumes``): the matrix as written and as read, the cases, the versions, the code's
provenance, the cluster and the driver."""

from __future__ import annotations

import datetime as dt
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fusedq import provenance
from orchestrator.common import probes
from orchestrator.common.redact import redact_argv
from orchestrator.config.expand import Case
from orchestrator.config.schema import Matrix


def now() -> str:
    """This moment in UTC, to the second, as the manifest and the run's log write it."""
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def manifest(
    run_id: str,
    matrix_path: str | Path,
    matrix: Matrix,
    cases: list[Case],
    *,
    sets: Sequence[str],
    only: Sequence[str],
    launcher: Any,
) -> dict[str, Any]:
    """The record of one attempt: a new run's manifest, or an entry of its ``resumes``."""
    driver = probes.driver_info()
    return {
        "run_id": run_id,
        "created_at": now(),
        "matrix_path": str(matrix_path),
        "matrix_text": Path(matrix_path).read_text(encoding="utf-8"),
        "matrix": matrix.model_dump(mode="json"),
        "sets": list(sets),
        "only": list(only),
        "cases": [c.to_dict() for c in cases],
        "versions": probes.versions(_engine_version(matrix)),
        "git": probes.git_commit(),
        # The commit and fingerprints of the code that runs, even where `git` above is a
        # copied tree's stale HEAD or absent (fusedq.provenance).
        "provenance": provenance.describe(),
        "cluster": launcher.cluster,
        "fusedq_fingerprint": launcher.driver_fingerprints.get("fusedq"),
        "gpus": probes.gpu_inventory(),
        "driver": {**driver, "argv": redact_argv(driver["argv"])},
    }


def _engine_version(matrix: Matrix) -> str:
    """The matrix's engine's version for the manifest, asked of its own metadata
    (Engine.probe_version): a missing engine is recorded, and the first case fails naming
    it."""
    from orchestrator.engines import engine_for

    try:
        return engine_for(matrix.engine.kind).probe_version()
    except Exception as exc:
        return f"unavailable: {exc}"
