"""A case's audit in one paragraph, in the style of the validation write-ups.

What was searched (logs, lines, the kernel log), what was found (problems per category and
the worst severity, the root cause), what could not be searched, and whether every worker
logged each expected line. The run-level sentence over many cases is built from the stored
results (orchestrator.reports.run.audit_sentence).
"""

from __future__ import annotations

from collections.abc import Sequence

from orchestrator.audit.findings import Finding, Searched, Verdict
from orchestrator.common.wording import plural as _plural


def _or_list(items: Sequence[str]) -> str:
    if len(items) <= 2:
        return " or ".join(items)
    return ", ".join(items[:-1]) + ", or " + items[-1]


def summary_sentence(findings: Sequence[Finding], s: Searched, verdict: Verdict) -> str:
    """The audit of one scope in one paragraph (see the module docstring)."""
    scope = f"The final log audit of {_plural(len(s.files), 'log')} ({_plural(s.lines, 'line')})"
    if s.kernel_log.audited:
        scope += (
            f" and the kernel log ({s.kernel_log.source}, {_plural(s.kernel_log.lines, 'line')})"
        )
    log_findings = [f for f in findings if f.signature != "expectation-missing"]
    if not log_findings:
        parts = [f"{scope} found no {_or_list(list(s.categories))} failure."]
    else:
        by_cat: dict[str, int] = {}
        for f in log_findings:
            by_cat[f.category] = by_cat.get(f.category, 0) + 1
        listed = ", ".join(f"{n} {c}" for c, n in by_cat.items())
        parts = [
            f"{scope} found {_plural(len(log_findings), 'problem')} (worst: {verdict.worst_severity}): {listed}."
        ]
        rc = next((f for f in findings if f.root_cause), None)
        if rc is not None:
            parts.append(f"Root cause (first traceback) at {rc.location()}: {rc.text!r}.")
    if not s.kernel_log.audited:
        parts.append(f"The kernel log was not audited ({s.kernel_log.reason}).")
    if s.gpu_state.audited:
        parts.append(f"GPU ECC state was checked on {_plural(s.gpu_state.lines, 'GPU')}.")
    else:
        parts.append(f"GPU ECC state was not checked ({s.gpu_state.reason}).")
    for er in s.expectations:
        if er.met:
            who = "All workers" if er.expected else "The logs"
            parts.append(f"{who} logged {er.description}.")
        elif er.occurrences == 0:
            parts.append(f"No process logged {er.description}.")
        else:
            parts.append(f"{', '.join(er.missing)} did not log {er.description}.")
    return " ".join(parts)
