"""A run directory audited as the run audited it: one truth for `orchestrator audit RUN`.

During a run each case's server log is audited once its server has stopped, with the lines
its matrix expects (the plugin's decision line from every worker, a variant's own) and the
line at which the orchestrator began the stop: what vLLM logs because it was told to stop
(the EngineDeadError traceback of a SIGTERM) is discounted from there on. An audit of the
run directory afterwards must judge the same way, or a nightly job auditing its runs fails
on every clean one. So a run directory (or a log inside one) is audited here per case, with

- the case's expectations, from the matrix the run recorded in manifest.json;
- the case's stop line as the run recorded it (``stopped_at`` in audit.json), or, for runs
  recorded before that was kept, the first line the run discounted (every line it
  discounted came after the stop, and nothing the run counted did: the same findings are
  discounted again);
- findings of sources outside the run directory (the node's kernel log, GPU state) as the
  run recorded them, where this audit does not search that source itself (no ``--since``):
  they cannot be read again, and the verdict must not forget them.

Only each case's ``server.log`` is the case's log, as in the run: a log set aside from an
earlier attempt (``server-attempt1.log``) belongs to that attempt.

Stdlib only, like the rest of the audit: run directories are read as plain JSON.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from orchestrator.audit.findings import Expectation, Finding, SourceStatus
from orchestrator.audit.scope import audit_logs
from orchestrator.audit.verdict import AuditResult, verdict
from orchestrator.common.layout import (
    AUDIT_RECORD,
    CASES,
    INTERRUPTED_MARK,
    MANIFEST,
    RESULTS,
    SERVER_LOG,
    case_slug,
)

# Out-of-file sources, as a finding names its file (orchestrator.audit.sources).
KERNEL_LOG_PREFIX = "kernel log ("
GPU_STATE_FILE = "nvidia-smi -q -d ECC,ROW_REMAPPER"
RECORDED = "recorded by the run (its node's source cannot be read again)"


@dataclass
class CaseLog:
    """One case of a run, as its audit needs it."""

    case_id: str
    log: Path
    expectations: list[Expectation]
    stop_line: int | None  # the first line written after the stop began
    stop_basis: str  # where stop_line came from, in words
    run_verdict: str | None  # the run's own ("clean" / "findings"), None without a row
    recorded: dict[str, Any] = field(default_factory=dict)  # the case's audit.json


@dataclass
class CaseAudit:
    case: CaseLog
    result: AuditResult

    @property
    def agrees(self) -> bool | None:
        """Whether this audit reached the run's verdict (None: the run recorded none)."""
        if self.case.run_verdict is None:
            return None
        return self.result.verdict.status == self.case.run_verdict

    def to_dict(self) -> dict[str, Any]:
        return {
            "case_id": self.case.case_id,
            "log": str(self.case.log),
            "stop_line": self.case.stop_line,
            "stop_basis": self.case.stop_basis,
            "run_verdict": self.case.run_verdict,
            "agrees_with_run": self.agrees,
            **self.result.to_dict(),
        }


@dataclass
class RunAudit:
    """Every audited case of one run directory, and the cases that could not be."""

    root: Path
    run_id: str
    cases: list[CaseAudit]
    missing: list[tuple[str, str]]  # (case id, why its log was not audited)

    @property
    def clean(self) -> bool:
        return all(c.result.verdict.clean for c in self.cases)

    def to_dict(self) -> dict[str, Any]:
        return {
            "run": self.run_id,
            "run_dir": str(self.root),
            "verdict": "clean" if self.clean else "findings",
            "cases": [c.to_dict() for c in self.cases],
            "not_audited": [{"case_id": c, "why": why} for c, why in self.missing],
        }


# --------------------------------------------------------------------------- reading a run


def run_root_of(path: Path) -> Path | None:
    """The run directory `path` is (a folder holding manifest.json) or lies in, else None."""
    start = path if path.is_dir() else path.parent
    return next((d for d in (start, *start.parents) if (d / MANIFEST).is_file()), None)


def _json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None


def _rows(root: Path) -> dict[str, dict[str, Any]]:
    """The last row of each case in results.jsonl (complete lines only, as the runner reads)."""
    rows: dict[str, dict[str, Any]] = {}
    try:
        raw = (root / RESULTS).read_bytes()
    except OSError:
        return rows
    for line in raw.split(b"\n")[:-1]:
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and "case_id" in row:
            rows[row["case_id"]] = row
    return rows


def _expectations(matrix: dict[str, Any], variant: str) -> list[Expectation]:
    """What the run expected of the case's log: the matrix's lines, then its variant's (the
    order orchestrator.execution.case_run audits them in)."""
    specs = list((matrix.get("audit") or {}).get("expect") or [])
    for v in matrix.get("variants") or []:
        if v.get("name") == variant:
            specs += v.get("expect") or []
    return [
        Expectation(pattern=e["pattern"], ranks=None, description=e.get("description") or "")
        for e in specs
        if e.get("pattern")
    ]


def _named(mapping: dict[str, Any], name: str) -> Any:
    """The value of the key whose last path part is `name` (the run wrote absolute paths of
    its own machine)."""
    return next((v for k, v in mapping.items() if Path(k).name == name), None)


def stop_line(audit: dict[str, Any] | None) -> tuple[int | None, str]:
    """The line the run's stop of the server began at, and how it is known."""
    if not audit:
        return None, "the run recorded no audit of this case"
    recorded = _named(audit.get("stopped_at") or {}, SERVER_LOG)
    if isinstance(recorded, int):
        return recorded, "recorded by the run"
    lines = [
        f["line"]
        for f in audit.get("discounted") or []
        if isinstance(f.get("line"), int) and Path(str(f.get("file", ""))).name == SERVER_LOG
    ]
    if lines:
        return min(lines), "the first line the run discounted as logged after its stop"
    return None, "the run discounted nothing after its stop"


def read_cases(root: Path) -> tuple[str, list[CaseLog], list[tuple[str, str]]]:
    """(run id, the cases whose server log is here, the others with why) in manifest order."""
    manifest = _json(root / MANIFEST) or {}
    matrix = manifest.get("matrix") or {}
    rows = _rows(root)
    found, missing = [], []
    for case in manifest.get("cases") or []:
        case_id = case.get("case_id")
        if not case_id:
            continue
        folder = root / CASES / case_slug(case_id)
        log = folder / SERVER_LOG
        row = rows.get(case_id)
        record = _json(folder / AUDIT_RECORD) or (row or {}).get("audit") or {}
        if not log.is_file():
            why = "the run has no result for it" if row is None else f"no {SERVER_LOG} kept"
            missing.append((case_id, why))
            continue
        line, basis = stop_line(record)
        cut = _json(folder / INTERRUPTED_MARK) if row is None else None
        if line is None and cut:
            # A case an interrupt cut short: no audit, but its stop line was kept.
            line = _named(cut.get("stopped_at") or {}, SERVER_LOG)
            basis = "recorded when the run was interrupted" if line else basis
        verdict_of_run = ((row or {}).get("audit") or {}).get("verdict") or {}
        found.append(
            CaseLog(
                case_id=case_id,
                log=log,
                expectations=_expectations(matrix, case.get("variant", "")),
                stop_line=line,
                stop_basis=basis,
                run_verdict=verdict_of_run.get("status") if row is not None else None,
                recorded=record,
            )
        )
    return str(manifest.get("run_id") or root.name), found, missing


# --------------------------------------------------------------------------- auditing


def _recorded_elsewhere(record: dict[str, Any], kernel_log: bool, gpu_state: bool) -> list:
    """The run's findings of its node's kernel log and GPU state, for the sources this audit
    does not search itself."""
    out = []
    for f in record.get("findings") or []:
        source = str(f.get("file", ""))
        kernel = source.startswith(KERNEL_LOG_PREFIX)
        if (kernel and not kernel_log) or (source == GPU_STATE_FILE and not gpu_state):
            fields = {**(f.get("fields") or {}), "recorded": RECORDED}
            known = set(Finding.__dataclass_fields__)
            out.append(Finding(**{**{k: v for k, v in f.items() if k in known}, "fields": fields}))
    return out


def audit_case(
    case: CaseLog,
    *,
    since: datetime | None = None,
    include_kernel_log: bool = False,
    include_gpu_state: bool = True,
) -> AuditResult:
    """One case's log, judged as the run judged it (see the module docstring)."""
    result = audit_logs(
        [case.log],
        since=since,
        expectations=case.expectations,
        include_kernel_log=include_kernel_log,
        include_gpu_state=include_gpu_state,
        stopped_at={str(case.log): case.stop_line} if case.stop_line else None,
    )
    carried = _recorded_elsewhere(
        case.recorded,
        kernel_log=result.searched.kernel_log.audited,
        gpu_state=result.searched.gpu_state.audited,
    )
    if carried:
        result.findings += carried
        result.verdict = verdict(result.findings, result.searched)
    return result


def audit_run(
    root: Path,
    *,
    logs: Sequence[Path] = (),
    since: datetime | None = None,
    include_kernel_log: bool = False,
    include_gpu_state: bool = True,
) -> RunAudit:
    """Every case of the run at `root` (or only those whose server log is among `logs`)."""
    run_id, cases, missing = read_cases(root)
    if logs:
        wanted = {p.resolve() for p in logs}
        cases = [c for c in cases if c.log.resolve() in wanted]
        missing = []
    audits = [
        CaseAudit(
            c,
            audit_case(
                c,
                since=since,
                include_kernel_log=include_kernel_log,
                include_gpu_state=include_gpu_state,
            ),
        )
        for c in cases
    ]
    return RunAudit(root, run_id, audits, missing)


def kernel_log_skipped() -> SourceStatus:
    """What a verdict says of the kernel log when no --since was given."""
    return SourceStatus(
        False, None, "no --since given; pass --since to audit kernel lines after that time"
    )


def split_run_paths(paths: Sequence[Path]) -> tuple[dict[Path, list[Path]], list[Path]]:
    """The paths that are runs, or cases' logs inside runs ({run root: the case logs named,
    [] for every case}), and the others (plain logs, audited as they are). A case folder
    stands for its server.log; other files inside a run (orchestrator.log, an earlier
    attempt's server-attempt1.log) are plain logs: the run's verdict is not about them."""
    runs: dict[Path, list[Path]] = {}
    plain: list[Path] = []
    for p in map(Path, paths):
        root = run_root_of(p) if p.exists() else None
        if root is not None and p.is_dir() and p.resolve() == root.resolve():
            runs[root] = []
            continue
        if root is not None and p.is_dir() and p.parent.name == CASES:
            p = p / SERVER_LOG
        in_case = p.name == SERVER_LOG and p.parent.parent.name == CASES
        if root is None or not in_case:
            plain.append(p)
        elif runs.get(root) != []:  # a whole run asked for already covers it
            runs.setdefault(root, []).append(p)
    return runs, plain
