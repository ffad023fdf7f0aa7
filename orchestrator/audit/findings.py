"""What an audit finds and what it covered: findings, expectations, what was searched.

The one declaration of the audit's records. Plain dataclasses (no pydantic: ``orchestrator
audit`` must answer in a fraction of a second); ``orchestrator.results.stored_audit``
derives the stored form every reader of a run reads (audit.json, results.jsonl) from these
fields, and each record's behaviour (its ``…View`` base, used by both) comes along.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from orchestrator.audit.severity import Severity


class AuditInputError(ValueError):
    """Bad input to the audit (a missing path, an unparseable time): a usage error."""


@dataclass(frozen=True)
class Expectation:
    """A line every worker (or each of ``ranks``) must log, e.g. a kernel's warm-up line.

    ``ranks`` lists process labels (``Worker_TP3``), their short forms (``TP3``,
    ``rank=2``, ``2``) or ``None`` for "every worker prefix seen in the logs" (and, when
    the logs show no worker prefixes at all, at least one occurrence anywhere).
    """

    pattern: str
    ranks: Sequence[str] | None = None
    description: str = ""

    @property
    def label(self) -> str:
        return self.description or self.pattern


class FindingView:
    """What a finding says of itself, for the audit's record and the stored one alike.

    The views below hold behaviour only: a field declared here would become a field of the
    stored form too (pydantic reads the annotations of every base)."""

    @property
    def breaks_case(self) -> bool:
        """Fatal or worse (orchestrator.audit.severity): such a finding fails its case."""
        return self.severity is not None and self.severity.breaks_case

    def location(self, *, basename: bool = False) -> str:
        """``file:line [rank]`` (`basename`: the file's name only)."""
        where = self.file.split("/")[-1] if basename else self.file
        if self.line is not None:
            where += f":{self.line}"
        return f"{where} [{self.rank}]" if self.rank else where


@dataclass
class Finding(FindingView):
    """One fault seen in one place."""

    file: str
    line: int | None
    rank: str | None
    signature: str
    severity: Severity
    category: str
    text: str
    meaning: str = ""
    action: str = ""
    context_before: list[str] = field(default_factory=list)
    context_after: list[str] = field(default_factory=list)
    fields: dict[str, str] = field(default_factory=dict)
    root_cause: bool = False

    def __post_init__(self) -> None:
        self.severity = Severity(self.severity)  # a caller may name it by its value

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FileSearched:
    """What the scan of one log covered."""

    path: str
    lines: int
    bytes: int
    compressed: bool = False
    suppressed: dict[str, int] = field(default_factory=dict)  # findings beyond the cap
    error: str | None = None  # why the scan stopped early (a truncated .gz)


@dataclass
class SourceStatus:
    """Whether an out-of-file source (kernel log, GPU state) was searched, and why not."""

    audited: bool
    source: str | None = None
    reason: str | None = None
    lines: int = 0


class ExpectationView:
    @property
    def met(self) -> bool:
        return not self.missing and self.occurrences > 0


@dataclass
class ExpectationResult(ExpectationView):
    """Which ranks logged an expected line."""

    description: str
    pattern: str
    expected: list[str]
    seen: list[str]
    missing: list[str]
    occurrences: int


class SearchedView:
    @property
    def lines(self) -> int:
        return sum(f.lines for f in self.files)

    @property
    def bytes(self) -> int:
        return sum(f.bytes or 0 for f in self.files)


@dataclass
class Searched(SearchedView):
    """Everything the audit looked at: the basis of the summary sentence."""

    files: list[FileSearched] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    catalogue_version: int = 0
    prefilter: str = ""
    kernel_log: SourceStatus = field(
        default_factory=lambda: SourceStatus(False, reason="not requested")
    )
    gpu_state: SourceStatus = field(
        default_factory=lambda: SourceStatus(False, reason="not requested")
    )
    expectations: list[ExpectationResult] = field(default_factory=list)


class VerdictView:
    @property
    def clean(self) -> bool:
        return self.status == "clean"

    def __str__(self) -> str:
        head = "clean" if self.clean else f"findings (worst: {self.worst_severity})"
        return head + "".join(f"; {c}" for c in self.caveats)


@dataclass
class Verdict(VerdictView):
    """The verdict for one scope (a case): clean or not, and what could not be searched."""

    status: Literal["clean", "findings"]
    worst_severity: Severity | None
    counts: dict[str, int] = field(default_factory=dict)  # per severity
    caveats: list[str] = field(default_factory=list)  # "kernel log not audited: …"
