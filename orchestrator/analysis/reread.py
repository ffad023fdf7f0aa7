"""Read a run's profile traces again: each profiled row's trace figures (the query step, the
kernel families, the top kernels) computed anew from the trace files its case directory still
holds, with this version's kernel names (orchestrator.analysis.kernel_names), and written back
into results.jsonl in place of the ones the run stored.

For a run whose traces name a kernel the version that ran did not know (the decode front's
kernel before its name was added: its query step was then the last GEMM before attention).
Every other byte of a row, and every row without a profile, is kept as it was written.
"""

from __future__ import annotations

import json

from orchestrator.analysis.step_compare import kept_trace, server_case_dir
from orchestrator.analysis.trace import TraceError, read_trace
from orchestrator.results.rows import CaseResult
from orchestrator.results.store import (
    RunStore,
    StoreError,
    read_jsonl_numbered,
    write_text_atomic,
)


def reread_traces(store: RunStore) -> int:
    """Re-read every profiled row's traces and rewrite results.jsonl atomically; returns how
    many rows changed. StoreError naming the row and file where a stored trace is missing,
    outside its case directory, or unreadable (nothing is written then)."""
    lines: list[str] = []
    changed = 0
    for number, raw in read_jsonl_numbered(store.results_path):
        profile = raw.get("profile") if isinstance(raw, dict) else None
        if not profile or not profile.get("traces"):
            lines.append(json.dumps(raw, default=str, separators=(",", ":")))
            continue
        row = CaseResult.model_validate(raw)
        case_dir = server_case_dir(row, store.root).resolve()
        figures = []
        for stored in row.profile.traces:
            path = kept_trace(case_dir, stored.file)
            where = f"{store.results_path}:{number} ({row.case_id})"
            if path is None:
                raise StoreError(f"{where}: trace {stored.file} is not in {case_dir}")
            try:
                fresh = read_trace(path)
            except TraceError as exc:
                raise StoreError(f"{where}: {exc}") from None
            fresh.file = stored.file
            figures.append(fresh.model_dump(mode="json"))
        if figures != profile["traces"]:
            changed += 1
        profile["traces"] = figures
        lines.append(json.dumps(raw, default=str, separators=(",", ":")))
    if changed:
        write_text_atomic(store.results_path, "".join(f"{line}\n" for line in lines))
    return changed
