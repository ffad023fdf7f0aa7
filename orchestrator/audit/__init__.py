"""GPU-fault log auditor: one case's logs, its node's kernel log and GPU state, one verdict.

One case's server, worker and orchestrator logs (plain, rotated or gzip-compressed), the
kernel log since the case started and the GPUs' ECC / row-remapper state are searched for
the fault signatures of ``signatures.yaml``. The result is a list of findings, a verdict
per scope (``clean`` or ``findings`` with the worst severity) that says what could *not*
be searched, and a summary sentence in the style of the validation write-ups.

Imports are stdlib + PyYAML only: ``orchestrator audit`` must answer fast and run on
machines without torch, ray or vllm (and without loading pydantic).

The package, in the order a log travels through it:

- ``catalogue``: signatures.yaml, loaded and checked;
- ``sources``: log files, the kernel log, nvidia-smi's GPU state;
- ``prefilter``: the lines holding a catalogue needle (GNU grep where present; docs/audit.md
  has the measured figures);
- ``scan``: those lines matched, tracebacks followed, expected lines counted per worker;
- ``verdict``: stop noise discounted, the root cause marked, clean or not;
- ``sentences``: the summary sentence;
- ``findings``: the records all of them pass along.
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path

from orchestrator.audit.catalogue import CATALOGUE_PATH, Catalogue, CatalogueError, load_catalogue
from orchestrator.audit.findings import (
    AuditInputError,
    Expectation,
    ExpectationResult,
    FileSearched,
    Finding,
    Searched,
    SourceStatus,
    Verdict,
)
from orchestrator.audit.prefilter import Prefilter, grep_binary, make_prefilter
from orchestrator.audit.scan import MAX_FINDINGS_PER_SIGNATURE, MAX_REPORT_CHARS, _Scanner
from orchestrator.audit.sources import (
    collect_log_files,
    parse_nvidia_smi_q,
    parse_since,
    read_gpu_state,
    read_kernel_log,
)
from orchestrator.audit.verdict import (
    SHUTDOWN_NOISE,
    AuditResult,
    expectation_finding,
    judge,
    mark_root_cause,
    verdict,
)
from orchestrator.probes import Runner
from orchestrator.severity import Severity

__all__ = [
    "CATALOGUE_PATH",
    "MAX_FINDINGS_PER_SIGNATURE",
    "MAX_REPORT_CHARS",
    "SHUTDOWN_NOISE",
    "AuditInputError",
    "AuditResult",
    "Catalogue",
    "CatalogueError",
    "Expectation",
    "ExpectationResult",
    "FileSearched",
    "Finding",
    "Prefilter",
    "Searched",
    "Severity",
    "SourceStatus",
    "Verdict",
    "audit_logs",
    "collect_log_files",
    "grep_binary",
    "load_catalogue",
    "make_prefilter",
    "mark_root_cause",
    "parse_nvidia_smi_q",
    "parse_since",
    "read_gpu_state",
    "read_kernel_log",
    "verdict",
]


def audit_logs(
    paths: Iterable[Path | str],
    *,
    since: datetime | None = None,
    expectations: Sequence[Expectation] = (),
    include_kernel_log: bool = True,
    include_gpu_state: bool = True,
    catalogue: Catalogue | None = None,
    prefilter: str | None = None,
    kernel_runner: Runner | None = None,
    gpu_runner: Runner | None = None,
    stopped_at: Mapping[str, int] | None = None,
) -> AuditResult:
    """Audit one scope (a case): its logs, the kernel log since ``since``, the GPU state.

    ``paths`` may name files (any name; gzip detected by content) and directories
    (walked for ``*.log``/``*.out``/``*.err``/``*.txt`` and their rotated / .gz forms).
    ``prefilter`` ("grep", "python") and the runners exist for tests and benchmarks.
    ``stopped_at`` maps a log path to the first line written after the orchestrator began
    stopping that server: findings from there on whose signature is in SHUTDOWN_NOISE are
    moved to ``discounted`` (vLLM logs an EngineDeadError traceback whenever SIGTERM aborts
    its engine); hardware and memory faults are never discounted.
    Raises AuditInputError for a missing path or an invalid expectation pattern.
    """
    cat = catalogue or load_catalogue()
    files = collect_log_files(paths)
    pf = make_prefilter(cat, prefilter)
    searched = Searched(
        categories=list(cat.categories), catalogue_version=cat.version, prefilter=pf.kind
    )
    findings = _scan_logs(files, cat, pf, expectations, searched)
    if include_kernel_log:
        klog = read_kernel_log(since, runner=kernel_runner)
        searched.kernel_log = klog.status
        if klog.status.audited:
            kscan = _Scanner(cat, pf)
            name = f"kernel log ({klog.status.source})"
            kscan.scan_stream(name, io.BytesIO("\n".join(klog.lines).encode() + b"\n"))
            findings += kscan.findings
    if include_gpu_state:
        gpu_findings, searched.gpu_state = read_gpu_state(cat, runner=gpu_runner)
        findings += gpu_findings
    findings += [expectation_finding(er) for er in searched.expectations if not er.met]
    return judge(findings, searched, stopped_at)


def _scan_logs(
    files: list[Path],
    cat: Catalogue,
    pf: Prefilter,
    expectations: Sequence[Expectation],
    searched: Searched,
) -> list[Finding]:
    """Scan every log file into `searched`; a file that cannot be read (whole or in part)
    is said so, as a warning finding, and the rest are scanned."""
    scanner = _Scanner(cat, pf, expectations)
    for path in files:
        try:
            sf = scanner.scan_file(path)
        except OSError as exc:  # unreadable (permissions, vanished): say so, scan the rest
            sf = FileSearched(path=str(path), lines=0, bytes=0, error=f"could not read: {exc}")
        searched.files.append(sf)
        if sf.error:
            scanner.findings.append(
                Finding(
                    file=str(path),
                    line=None,
                    rank=None,
                    signature="unreadable-log",
                    severity=Severity.WARNING,
                    category="unreadable",
                    text=sf.error,
                    meaning="Part of this log could not be read, so it was not fully audited.",
                    action="Check the file (a truncated .gz from a rotation cut short, permissions).",
                )
            )
    searched.expectations = scanner.expectation_results()
    return scanner.findings
