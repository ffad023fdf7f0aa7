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
- ``scan``: those lines matched, tracebacks followed (``linetext``: a line decoded,
  labelled and quoted), expected lines counted per worker (``expectations``);
- ``verdict``: stop noise discounted, the root cause marked, clean or not;
- ``sentences``: the summary sentence;
- ``findings``: the records all of them pass along;
- ``scope``: ``audit_logs``, one scope (a case) through all of the above;
- ``rundir``: a run directory audited case by case, as the run audited it;
- ``render``: what ``orchestrator audit PATH...`` prints, as text or JSON.

This module only names the package's public parts: its modules import each other directly,
never through it (tests/orchestrator/test_structure.py keeps it so).
"""

from __future__ import annotations

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
from orchestrator.audit.scan import MAX_FINDINGS_PER_SIGNATURE, MAX_REPORT_CHARS
from orchestrator.audit.scope import audit_logs
from orchestrator.audit.severity import Severity
from orchestrator.audit.sources import (
    collect_log_files,
    parse_nvidia_smi_q,
    parse_since,
    read_gpu_state,
    read_kernel_log,
)
from orchestrator.audit.verdict import SHUTDOWN_NOISE, AuditResult, mark_root_cause, verdict

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
