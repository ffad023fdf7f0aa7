"""`orchestrator nightly MATRIX --history DIR`: run, compare with the last good run, report.

The history directory is the ``--logs-dir`` of every nightly: the new run is created in it,
and the baseline is the newest earlier run there (by manifest ``created_at``) of the same
matrix name that is *good*: every case of its manifest finished and passed, and no audit
found a fatal or quarantine-node fault. A run that faulted would make tomorrow's regression
look like a recovery, so it never serves as the baseline.

Into the new run directory go ``compare.md`` and ``compare.json`` (or, with no good run yet,
a ``compare.md`` that says the comparison was skipped), ``report.html`` with the comparison
and the trend over the history, and ``junit.xml`` with the regressions as failures.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from orchestrator.analysis.compare import (
    DEFAULT_THRESHOLD_PCT,
    CompareError,
    Comparison,
    compare,
    open_run,
)
from orchestrator.execution.runner import RunOptions, RunSummary
from orchestrator.reports.compare import comparison_json, comparison_markdown
from orchestrator.reports.html import write_html
from orchestrator.reports.junit import write_junit
from orchestrator.results.recorded_run import Run
from orchestrator.results.store import write_json_atomic, write_text_atomic

# The runner's signature: orchestrator.execution.runner.run_matrix, or a test's fake.
Runner = Callable[[Path, RunOptions], RunSummary]


@dataclass
class NightlyResult:
    """What one nightly did; `exit_code` is what `orchestrator nightly` exits with."""

    run_dir: Path
    failed_cases: list[str] = field(default_factory=list)
    baseline_dir: Path | None = None
    comparison: Comparison | None = None
    skipped_reason: str | None = None  # why there was no comparison
    history: list[Path] = field(default_factory=list)

    @property
    def exit_code(self) -> int:
        if self.failed_cases:
            return 1
        if self.comparison is not None and not self.comparison.ok:
            return 1
        return 0

    def summary_lines(self) -> list[str]:
        lines = [f"run directory: {self.run_dir}", f"report: {self.run_dir / 'report.html'}"]
        if self.comparison is not None:
            lines.append(f"baseline: {self.baseline_dir}")
            lines.append(self.comparison.verdict())
        else:
            lines.append(f"comparison skipped: {self.skipped_reason}")
        if self.failed_cases:
            lines.append(f"{len(self.failed_cases)} case(s) failed: {', '.join(self.failed_cases)}")
        return lines


def is_good_run(run: Run) -> bool:
    """Every case of the manifest finished and passed, and no audit found a fatal fault."""
    rows = {r.case_id: r for r in run.results}
    cases = run.manifest.case_ids
    if not cases or any(c not in rows for c in cases):
        return False
    return all(rows[c].passed and not rows[c].audit.case_breaking for c in cases)


def history_runs(history_dir: Path, matrix_name: str, *, exclude: Path | None = None) -> list[Run]:
    """Runs of this matrix in the history, oldest first; unreadable directories are passed over."""
    found: list[tuple[str, Run]] = []
    if not history_dir.is_dir():
        return []
    skip = exclude.resolve() if exclude is not None else None
    for d in sorted(history_dir.iterdir()):
        if not d.is_dir() or d.resolve() == skip:
            continue
        try:
            run = open_run(d)
        except CompareError:
            # Half-written or foreign directories (test-artifacts/, a crashed run) must not
            # stop tonight's comparison.
            continue
        if run.manifest.matrix_name == matrix_name:
            found.append((str(run.manifest.created_at or ""), run))
    found.sort(key=lambda cs: cs[0])
    return [s for _, s in found]


def _default_runner(matrix_path: Path, options: RunOptions) -> RunSummary:
    # Imported here so a test's fake runner never loads the launcher's machinery.
    from orchestrator.execution.runner import run_matrix

    return run_matrix(matrix_path, options)


def run_nightly(
    matrix_path: str | Path,
    history_dir: str | Path,
    *,
    sets: Sequence[str] = (),
    threshold_pct: float = DEFAULT_THRESHOLD_PCT,
    run_id: str | None = None,
    ray_address: str | None = None,
    kill_leftovers: bool = False,
    runner: Runner | None = None,
) -> NightlyResult:
    """Run the matrix into `history_dir`, compare with the last good run there, write reports.

    Bad input (matrix, run id, cluster too small, negative threshold) raises before anything
    runs, as `orchestrator run` does: MatrixError, StoreError, LaunchError or ValueError.
    """
    if not threshold_pct >= 0.0:  # also rejects NaN
        raise CompareError(f"--threshold-pct={threshold_pct}: must be a percentage >= 0")
    history = Path(history_dir)
    options = RunOptions(
        logs_dir=history,
        run_id=run_id,
        ray_address=ray_address,
        sets=list(sets),
        progress=False,  # unattended: a live view only fills the cron log with redraws
        # Unattended too: last night's crashed run may still hold the GPUs; by default the
        # run only warns (see orchestrator.execution.leftover_check.handle_leftovers).
        kill_leftovers=kill_leftovers,
    )
    summary = (runner or _default_runner)(Path(matrix_path), options)
    run = open_run(summary.run_dir)
    result = NightlyResult(
        run_dir=run.root, failed_cases=[r.case_id for r in run.results if not r.passed]
    )
    name = run.manifest.matrix_name or ""
    runs = history_runs(history, name, exclude=run.root)
    result.history = [s.root for s in runs]
    good = [s for s in runs if is_good_run(s)]
    if good:
        base = good[-1]
        result.baseline_dir = base.root
        result.comparison = compare(base, run, threshold_pct=threshold_pct)
        write_text_atomic(run.root / "compare.md", comparison_markdown(result.comparison))
        write_json_atomic(run.root / "compare.json", comparison_json(result.comparison))
    else:
        result.skipped_reason = (
            f"no good earlier run of matrix {name!r} in {history} "
            f"({len(runs)} earlier run(s), none complete without failures or fatal findings)"
        )
        write_text_atomic(
            run.root / "compare.md",
            f"# Compare {run.store.run_id}\n\nComparison skipped: {result.skipped_reason}.\n",
        )
    write_html(run, history=runs, comparison=result.comparison)
    write_junit(run, comparison=result.comparison)
    return result
