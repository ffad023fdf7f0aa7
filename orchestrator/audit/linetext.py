"""A log line as the audit reads and quotes it: decoded, its ANSI codes stripped, its process
label split off, and the printable, bounded, redacted form a finding quotes it in."""

from __future__ import annotations

import re

from orchestrator.common.redact import redact_text
from orchestrator.engines.vllm.logline import LABEL_RE, strip_ansi

# Bytes read for one context line or a process label: the scanner's MAX_CONTEXT_CHARS of
# UTF-8 with room for colour codes, never the rest of a line that has no end.
CONTEXT_BYTES = 4096

_UNPRINTABLE_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def escape(text: str, limit: int, around: int | None = None) -> str:
    """Printable, bounded form of a log line: secrets redacted before anything is cut (a cut
    could leave half a password no pattern knows), control bytes escaped, long lines cut
    around the match."""
    if around is None:
        text = redact_text(text)
    else:  # the match stays where it was, relative to the redacted text
        left = redact_text(text[:around])
        text, around = left + redact_text(text[around:]), len(left)
    text = _UNPRINTABLE_RE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    if len(text) <= limit:
        return text
    start = 0 if around is None else max(0, min(around - limit // 4, len(text) - limit))
    cut = text[start : start + limit]
    return ("…" if start else "") + cut + ("…" if start + limit < len(text) else "")


def clean(raw: bytes) -> str:
    """The text of a line's bytes: invalid UTF-8 replaced, ANSI codes stripped."""
    return strip_ansi(raw.decode("utf-8", "replace"))


def split_label(text: str) -> tuple[str | None, str]:
    """(the process label a line starts with, or None; the rest of the line)."""
    m = LABEL_RE.match(text)
    if not m:
        return None, text
    if m.group("trank") is not None:
        return f"rank{m.group('trank')}", text[m.end() :]
    name = m.group("name")
    if m.group("rank") is not None:
        name = f"{name} rank={m.group('rank')}"
    return name, text[m.end() :]
