"""`orchestrator run --resume`: the run directory reopened for the matrix it started with,
and what is left to run in it."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from orchestrator.config.expand import Case
from orchestrator.results.rows import CaseResult
from orchestrator.results.store import RunStore


def open_for_resume(
    logs_dir: Path, run_id: str, cases: list[Case], matrix_path: str | Path
) -> RunStore:
    """Run `run_id` under `logs_dir`, locked, once every case of the matrix is one of its."""
    store = RunStore.open(logs_dir, run_id)
    old_ids = {c["case_id"] for c in store.manifest().get("cases", [])}
    extra = sorted({c.case_id for c in cases} - old_ids)
    if extra:
        raise ValueError(
            f"{matrix_path}: case {extra[0]!r} is not in run {store.run_id}; "
            "a resumed run must use the matrix it started with"
        )
    store.lock()
    return store


def left_to_run(
    store: RunStore, selected: Sequence[Case], retry_failed: bool
) -> tuple[list[Case], list[CaseResult]]:
    """The selected cases still to run, and the stored rows of the others."""
    rows = {r.case_id: r for r in store.results()}
    done = store.finished_case_ids(include_failed=not retry_failed)
    todo = [c for c in selected if c.case_id not in done]
    return todo, [rows[c.case_id] for c in selected if c.case_id in done]
