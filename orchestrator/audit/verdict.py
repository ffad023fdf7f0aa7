"""The verdict of one audit scope (a case): what counts, the root cause, clean or not.

Findings logged after the orchestrator began stopping the server that are known
consequences of the stop are discounted (kept, shown, never counted); the root cause is
marked by one rule; a missing expected line is a finding; the verdict names the worst
severity and what could not be searched.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.audit.findings import ExpectationResult, Finding, Searched, Verdict
from orchestrator.audit.sentences import summary_sentence
from orchestrator.audit.severity import Severity

# What vLLM logs because it was told to stop (SIGTERM aborts the engine: the API server's output
# handler then raises EngineDeadError with a traceback). Only these may be discounted after a stop.
SHUTDOWN_NOISE = frozenset({"python-traceback", "vllm-engine-dead"})


class AuditView:
    """What an audit's result says of itself, for the audit's record and the stored one
    (orchestrator.results.stored_audit.AuditSummary) alike."""

    @property
    def root_cause(self) -> Finding | None:
        """The first non-DEBUG traceback of the scope (its exception line), if any
        (`mark_root_cause` marks it)."""
        return next((f for f in self.findings if f.root_cause), None)

    @property
    def clean(self) -> bool:
        return self.verdict.clean

    @property
    def case_breaking(self) -> list[Finding]:
        """Findings of fatal or worse severity: each one fails the case."""
        return [f for f in self.findings if f.breaks_case]


@dataclass
class AuditResult(AuditView):
    """Findings, verdict and coverage of one audit scope."""

    findings: list[Finding]
    searched: Searched
    verdict: Verdict
    # Findings logged after the orchestrator began stopping the server that are known
    # consequences of the stop itself (see SHUTDOWN_NOISE); kept and shown, never counted.
    discounted: list[Finding] = field(default_factory=list)
    # Log path -> the first line written after its server's stop began: recorded with the
    # audit, so a later `orchestrator audit` of the run discounts exactly what the run did.
    stopped_at: dict[str, int] = field(default_factory=dict)

    def summary_sentence(self) -> str:
        return summary_sentence(self.findings, self.searched, self.verdict)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": {**asdict(self.verdict), "text": str(self.verdict)},
            "summary": self.summary_sentence(),
            "findings": [f.to_dict() for f in self.findings],
            "discounted": [f.to_dict() for f in self.discounted],
            "stopped_at": dict(self.stopped_at),
            "searched": {**asdict(self.searched), "lines": self.searched.lines},
        }


def judge(
    findings: list[Finding], searched: Searched, stopped_at: Mapping[str, int] | None = None
) -> AuditResult:
    """The scope's result from everything it found: stop noise discounted (see
    `discount_after_stop`), the root cause marked, the verdict drawn."""
    kept, discounted = discount_after_stop(findings, stopped_at or {})
    mark_root_cause(kept)
    return AuditResult(kept, searched, verdict(kept, searched), discounted, dict(stopped_at or {}))


def discount_after_stop(
    findings: Sequence[Finding], stopped_at: Mapping[str, int]
) -> tuple[list[Finding], list[Finding]]:
    """(kept, discounted): `stopped_at` maps a log path to the first line written after the
    orchestrator began stopping that server; findings from there on whose signature is in
    SHUTDOWN_NOISE are discounted (vLLM logs an EngineDeadError traceback whenever SIGTERM
    aborts its engine). Hardware and memory faults are never discounted."""
    limits = {str(Path(k)): v for k, v in stopped_at.items()}
    kept, discounted = [], []
    for f in findings:
        limit = limits.get(str(Path(f.file)))
        if (
            limit is not None
            and f.line is not None
            and f.line >= limit
            and f.signature in SHUTDOWN_NOISE
        ):
            f.fields["discounted"] = "logged after the orchestrator stopped the server"
            discounted.append(f)
        else:
            kept.append(f)
    return kept, discounted


def mark_root_cause(findings: Sequence[Finding]) -> Finding | None:
    """Flag the root cause of a scope, the one rule every reader of `root_cause` relies on:
    the first traceback that is not a recovered (DEBUG-level, hence warning) one. Later
    tracebacks of a case are almost always its consequences (vLLM's "Engine core
    initialization failed. See root cause above." chain). Pass the findings that count,
    after discounting: a traceback of the orchestrator's own stop explains nothing."""
    cause = next(
        (
            f
            for f in findings
            if f.signature == "python-traceback" and f.severity != Severity.WARNING
        ),
        None,
    )
    for f in findings:
        f.root_cause = f is cause
    return cause


def expectation_finding(er: ExpectationResult) -> Finding:
    """A line every worker must log that some (or all) did not: a fatal finding."""
    if er.occurrences == 0:
        text = f"no process logged {er.description!r}"
    else:
        text = f"{', '.join(er.missing)} did not log {er.description!r}"
    return Finding(
        file="(expectations)",
        line=None,
        rank=", ".join(er.missing) or None,
        signature="expectation-missing",
        severity=Severity.FATAL,
        category="expectation",
        text=text,
        meaning=f"Every expected rank must log a line matching {er.pattern!r}.",
        action="Check that the feature was enabled and loaded in every worker process.",
        fields={"pattern": er.pattern, "expected": ", ".join(er.expected)},
    )


def verdict(findings: Sequence[Finding], searched: Searched) -> Verdict:
    """Clean or not, the count per severity, the worst, and what was not searched."""
    counts: dict[str, int] = {}
    for f in findings:
        counts[f.severity.value] = counts.get(f.severity.value, 0) + 1
    worst = max((f.severity for f in findings), default=None)
    caveats = []
    if not searched.kernel_log.audited:
        caveats.append(f"kernel log not audited: {searched.kernel_log.reason}")
    if not searched.gpu_state.audited:
        caveats.append(f"GPU ECC state not checked: {searched.gpu_state.reason}")
    return Verdict("findings" if findings else "clean", worst, counts, caveats)
