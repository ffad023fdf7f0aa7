"""The one severity order of the audit: warning < fatal < quarantine-node.

Its own module, stdlib only, because the audit (which must import neither pydantic nor
anything heavy: ``orchestrator audit`` answers in a fraction of a second) and the result
models (pydantic, ``orchestrator.results.stored_audit``) both need it.
"""

from __future__ import annotations

import enum


class Severity(str, enum.Enum):
    """How bad a finding is (signatures.yaml says which applies). Members compare by how
    bad they are, not as strings, and read as their value (``f"{s}"`` is ``fatal``)."""

    WARNING = "warning"  # does not break a case: reported, not judged
    FATAL = "fatal"  # fails the case (and, new in a comparison, the comparison)
    QUARANTINE_NODE = "quarantine-node"  # fails the case; the node must be drained

    @property
    def rank(self) -> int:
        return _ORDER.index(self)

    @property
    def breaks_case(self) -> bool:
        """Fatal or worse: a case with such a finding failed, whatever it measured."""
        return self >= Severity.FATAL

    # Every comparison spelled out: the str mixin's would order them alphabetically.
    def __lt__(self, other: object) -> bool:
        return self.rank < other.rank if isinstance(other, Severity) else NotImplemented

    def __le__(self, other: object) -> bool:
        return self.rank <= other.rank if isinstance(other, Severity) else NotImplemented

    def __gt__(self, other: object) -> bool:
        return self.rank > other.rank if isinstance(other, Severity) else NotImplemented

    def __ge__(self, other: object) -> bool:
        return self.rank >= other.rank if isinstance(other, Severity) else NotImplemented

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


_ORDER = tuple(Severity)
