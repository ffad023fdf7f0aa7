"""One scope's audit (a case): its log files, the kernel log since it started, the GPU state.

The steps of the package in order: the catalogue's needles prefiltered (``prefilter``), the
lines holding one matched (``scan``), the out-of-file sources read (``sources``), and the
findings judged (``verdict``).
"""

from __future__ import annotations

import io
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from pathlib import Path

from orchestrator.audit.catalogue import Catalogue, load_catalogue
from orchestrator.audit.findings import Expectation, FileSearched, Finding, Searched
from orchestrator.audit.prefilter import Prefilter, make_prefilter
from orchestrator.audit.scan import Scanner
from orchestrator.audit.severity import Severity
from orchestrator.audit.sources import collect_log_files, read_gpu_state, read_kernel_log
from orchestrator.audit.verdict import AuditResult, expectation_finding, judge
from orchestrator.common.probes import Runner


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
            kscan = Scanner(cat, pf)
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
    scanner = Scanner(cat, pf, expectations)
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
