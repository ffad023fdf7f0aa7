"""Lines a log must hold (expectations), counted per process label, and the worker labels the
log shows: an expectation of every worker (``ranks=None``) is held against those."""

from __future__ import annotations

import mmap
import re
from collections.abc import Sequence
from dataclasses import dataclass, field

from orchestrator.audit.findings import AuditInputError, Expectation, ExpectationResult
from orchestrator.audit.linetext import CONTEXT_BYTES, clean, split_label

# Worker process prefixes, for expectations that must hold on every worker.
_WORKER_SUFFIX = rb"(_[A-Za-z0-9_]+| rank=\d+) pid="


@dataclass
class _ExpectationState:
    spec: Expectation
    regex: re.Pattern[bytes]
    labels: dict[str, int] = field(default_factory=dict)
    unlabelled: int = 0


class ExpectationTally:
    """The expectations' occurrences per process label over every block a scan reads, and
    the worker labels seen (collected only when an expectation needs every worker)."""

    def __init__(self, expectations: Sequence[Expectation] = ()) -> None:
        self.expectations = [_ExpectationState(e, _compile_expectation(e)) for e in expectations]
        self.want_workers = any(e.ranks is None for e in expectations)
        self.workers: set[str] = set()
        self._worker_suffixes: set[bytes] = set()

    def count(self, data: bytes | mmap.mmap, max_line_bytes: int) -> None:
        """Count the expectations in `data` (whole lines) and collect its worker labels; a
        line's start is looked for no further back than `max_line_bytes`."""
        self._count_expectations(data, max_line_bytes)
        if self.want_workers:
            self._collect_workers(data)

    def _count_expectations(self, block: bytes | mmap.mmap, max_line_bytes: int) -> None:
        for ex in self.expectations:
            for m in ex.regex.finditer(block):
                # Only the line's start is read: the process label is there.
                lo = max(0, m.start() - max_line_bytes)
                ls = block.rfind(b"\n", lo, m.start()) + 1
                head = block[ls : ls + CONTEXT_BYTES].split(b"\n", 1)[0]
                label = None if ls == 0 and lo > 0 else split_label(clean(head))[0]
                if label is None:
                    ex.unlabelled += 1
                else:
                    ex.labels[label] = ex.labels.get(label, 0) + 1

    def _collect_workers(self, data: bytes | mmap.mmap) -> None:
        """Distinct worker labels in ``data``.

        Nearly every line of a TP8 log carries a worker prefix: one Python step per match
        would cost seconds per GB, so the regex is rebuilt to skip the labels already
        known and each search runs in C until a new label turns up (≤ one per rank).
        """
        pos = 0
        while True:
            known = sorted(self._worker_suffixes)
            skip = b"(?!(?:" + b"|".join(map(re.escape, known)) + b") pid=)" if known else b""
            m = re.compile(b"Worker" + skip + _WORKER_SUFFIX).search(data, pos)
            if m is None:
                return
            suffix = m.group(1)
            self._worker_suffixes.add(suffix)
            lp = data.rfind(b"(", max(0, m.start() - 32), m.start())
            if lp >= 0:
                self.workers.add(data[lp + 1 : m.end() - 5].decode(errors="replace"))
            pos = m.start()

    def results(self) -> list[ExpectationResult]:
        """Each expectation: the labels it was seen under, the ones it is missing from."""
        out = []
        for ex in self.expectations:
            seen = sorted(ex.labels)
            occurrences = ex.unlabelled + sum(ex.labels.values())
            # ranks=None: every worker prefix the logs showed (none: one occurrence anywhere).
            expected = sorted(self.workers) if ex.spec.ranks is None else list(ex.spec.ranks)
            aliases = set().union(*(_label_aliases(s) for s in seen)) if seen else set()
            missing = [r for r in expected if r not in aliases]
            out.append(
                ExpectationResult(
                    description=ex.spec.label,
                    pattern=ex.spec.pattern,
                    expected=expected,
                    seen=seen,
                    missing=missing,
                    occurrences=occurrences,
                )
            )
        return out


def _label_aliases(label: str) -> set[str]:
    """Names a caller may use for a process label: Worker_TP3 -> {Worker_TP3, TP3}."""
    out = {label}
    if "_" in label:
        out.add(label.split("_", 1)[1])
    m = re.search(r"rank=?(\d+)$", label)
    if m:
        out |= {f"rank={m.group(1)}", f"rank{m.group(1)}", m.group(1)}
    return out


def _compile_expectation(e: Expectation) -> re.Pattern[bytes]:
    try:
        return re.compile(e.pattern.encode())
    except re.error as exc:
        raise AuditInputError(
            f"expectation {e.label!r}: {e.pattern!r} is not a valid regex: {exc}"
        ) from exc
