"""What `orchestrator audit PATH...` prints: the paths given audited, as text or JSON.

Run directories (or cases' logs inside them) are audited as their run audited them
(orchestrator.audit.rundir), other logs as they are (orchestrator.audit.scope). Without
``--since`` the kernel log is not searched (its whole ring buffer would report every Xid since
boot, from other jobs) and the verdict says so.

Stdlib only, like the rest of the audit.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from orchestrator.audit.findings import AuditInputError
from orchestrator.audit.rundir import RunAudit, audit_run, kernel_log_skipped, split_run_paths
from orchestrator.audit.scope import audit_logs
from orchestrator.audit.sources import parse_since
from orchestrator.audit.verdict import AuditResult, verdict
from orchestrator.common.redact import redact, redact_text


@dataclass(frozen=True)
class AuditOutput:
    """What `orchestrator audit` prints, and whether everything it audited was clean."""

    text: str
    clean: bool


def audit_paths(paths: Sequence[Path], *, since: str | None, json_out: bool) -> AuditOutput:
    """Audit `paths` (logs, directories, run directories) and put the result as text or
    JSON. Raises AuditInputError (a missing path, a bad --since, runs mixed with other logs)
    or CatalogueError, before anything is printed."""
    since_dt = parse_since(since) if since is not None else None
    runs, plain = split_run_paths(paths)
    if runs and plain:
        raise AuditInputError(
            f"{plain[0]}: audit run directories (or their cases' server.log) and other "
            "logs in separate calls: a run's logs are judged by the run's own settings"
        )
    kernel = since_dt is not None
    if runs:
        audits = [
            audit_run(root, logs=logs, since=since_dt, include_kernel_log=kernel)
            for root, logs in runs.items()
        ]
        return _runs_output(audits, kernel=kernel, json_out=json_out)
    result = audit_logs(paths, since=since_dt, include_kernel_log=kernel)
    if not kernel:
        result.searched.kernel_log = kernel_log_skipped()
        result.verdict = verdict(result.findings, result.searched)
    # The scanner redacts what it quotes; this catches whatever else reached the output.
    if json_out:
        return AuditOutput(json.dumps(redact(result.to_dict()), indent=2), result.verdict.clean)
    return AuditOutput(redact_text(audit_text(result)), result.verdict.clean)


def _runs_output(audits: list[RunAudit], *, kernel: bool, json_out: bool) -> AuditOutput:
    for ra in audits:
        for ca in ra.cases if not kernel else []:
            ca.result.searched.kernel_log = kernel_log_skipped()
            ca.result.verdict = verdict(ca.result.findings, ca.result.searched)
    if json_out:
        out = [ra.to_dict() for ra in audits]
        text = json.dumps(out[0] if len(out) == 1 else out, indent=2)
    else:
        text = "\n\n".join(run_audit_text(ra) for ra in audits)
    return AuditOutput(text, all(ra.clean for ra in audits))


def run_audit_text(ra: RunAudit) -> str:
    """A run's audit: per case its findings, verdict (beside the run's) and what was
    discounted, then the run's verdict."""
    n = len(ra.cases)
    out = [
        f"run {ra.run_id} ({ra.root}): {n} case log{'' if n == 1 else 's'} audited as the run "
        "audited them (the matrix's expected lines, each server's recorded stop line)"
    ]
    for ca in ra.cases:
        c, r = ca.case, ca.result
        out += ["", f"== {c.case_id}: {c.log}"]
        out += finding_lines(r)
        for f in r.discounted:
            out.append(
                f"{f.location()}: discounted {f.signature}: logged after the orchestrator "
                f"stopped the server (stop began at line {c.stop_line}: {c.stop_basis})"
            )
        run_said = "no result recorded" if c.run_verdict is None else c.run_verdict
        agree = {True: "agrees", False: "DIFFERS", None: "nothing to compare"}[ca.agrees]
        worst = "" if r.verdict.clean else f" (worst: {r.verdict.worst_severity})"
        out.append(f"verdict: {r.verdict.status}{worst}; the run: {run_said} ({agree})")
    for case_id, why in ra.missing:
        out += ["", f"== {case_id}: not audited: {why}"]
    caveats = dict.fromkeys(cv for ca in ra.cases for cv in ca.result.verdict.caveats)
    out += ["", f"run verdict: {'clean' if ra.clean else 'findings'}"]
    out += [f"not searched: {cv}" for cv in caveats]
    return "\n".join(out)


def audit_text(result: AuditResult) -> str:
    """One scope's audit as text: each finding with its context, meaning and action, what
    was capped, the verdict and the summary sentence."""
    out = finding_lines(result)
    out.append(f"verdict: {result.verdict}")
    out.append(result.summary_sentence())
    return "\n".join(out)


def finding_lines(result: AuditResult) -> list[str]:
    """Each finding of an audit with its context, meaning and action, and what was capped."""
    out = []
    for f in result.findings:
        mark = " (root cause)" if f.root_cause else ""
        out.append(f"{f.location()}: {f.severity} {f.signature}{mark}: {f.text}")
        out += [f"    | {c}" for c in f.context_before]
        out.append(f"    > {f.text}")
        out += [f"    | {c}" for c in f.context_after]
        if f.meaning:
            out.append(f"    meaning: {f.meaning}")
        if f.action:
            out.append(f"    action:  {f.action}")
    for sf in result.searched.files:
        for sig, n in sf.suppressed.items():
            out.append(f"{sf.path}: {n} more {sig} findings not shown")
    return out
