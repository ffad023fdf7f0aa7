"""The names inside a run directory, for every module that reads one.

Stdlib only: the audit reads run directories too, and must not load pydantic (which
orchestrator.results.store, the owner of the directory, does).

    manifest.json, results.jsonl, orchestrator.log, overhead.json, corrections.json
    report.md, report.json, report.html, junit.xml
    cases/<slug>/server.log, audit.json, requests-<workload>.jsonl, interrupted.json
"""

from __future__ import annotations

import re

MANIFEST = "manifest.json"
RESULTS = "results.jsonl"
RUN_LOG = "orchestrator.log"  # the run's own log (orchestrator.execution.runner)
OVERHEAD = "overhead.json"  # each attempt's wall and overhead figures (reports.write_reports)
CORRECTIONS = "corrections.json"  # figures found wrong after the run (results.corrections)
REPORT_MD = "report.md"
REPORT_JSON = "report.json"
REPORT_HTML = "report.html"
JUNIT = "junit.xml"
CASES = "cases"
SERVER_LOG = "server.log"
AUDIT_RECORD = "audit.json"
INTERRUPTED_MARK = (
    "interrupted.json"  # a case an interrupt cut short (orchestrator.execution.interrupted)
)


def case_slug(case_id: str) -> str:
    """A case's folder under ``cases/``: ``tiny-mla/tp1-dcp1-mtp0/default`` ->
    ``tiny-mla__tp1-dcp1-mtp0__default``."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", case_id.replace("/", "__"))
