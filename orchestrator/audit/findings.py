"""What an audit finds and what it covered: findings, expectations, what was searched.

Plain dataclasses (no pydantic: ``orchestrator audit`` must answer in a fraction of a
second); ``orchestrator.results`` reads their ``to_dict`` form back as the typed result.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from orchestrator.severity import Severity


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


@dataclass
class Finding:
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

    def location(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where} [{self.rank}]" if self.rank else where

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


@dataclass
class ExpectationResult:
    """Which ranks logged an expected line."""

    description: str
    pattern: str
    expected: list[str]
    seen: list[str]
    missing: list[str]
    occurrences: int

    @property
    def met(self) -> bool:
        return not self.missing and self.occurrences > 0


@dataclass
class Searched:
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

    @property
    def lines(self) -> int:
        return sum(f.lines for f in self.files)

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)


@dataclass
class Verdict:
    """The verdict for one scope (a case): clean or not, and what could not be searched."""

    status: Literal["clean", "findings"]
    worst_severity: Severity | None
    counts: dict[str, int] = field(default_factory=dict)  # per severity
    caveats: list[str] = field(default_factory=list)  # "kernel log not audited: …"

    @property
    def clean(self) -> bool:
        return self.status == "clean"

    def __str__(self) -> str:
        head = "clean" if self.clean else f"findings (worst: {self.worst_severity})"
        return head + "".join(f"; {c}" for c in self.caveats)
