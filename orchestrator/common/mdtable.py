"""Markdown tables and text, with no dependency beyond the standard library: ``fusedq-bench``
prints them on GPU machines that have torch and Triton but not the orchestrator's pydantic
stack (importing ``orchestrator.reports`` loads the result model).

Whatever is interpolated comes from a run: labels, log lines, kernel names, a manifest
someone else wrote. It reaches report.md and a terminal as text: colour codes and other
control characters (NUL, ESC, BEL, C1) are removed, a newline cannot end a table row, and a
``<`` that could open an HTML tag is escaped, so no renderer shows it as markup.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

# ANSI CSI sequences (colours, cursor moves) and two-byte escapes: vLLM and Ray colour the
# process prefix, and a warning's text.
ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# C0 controls but tab and newline, DEL, C1 controls (after colour codes are gone).
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# A '<' that could start a tag, comment or declaration (`<b`, `</`, `<!`, `<?`), and not
# already escaped by an odd run of backslashes. `<128, 64>` in a kernel name stays as it is.
_TAG_START = re.compile(r"(?<!\\)((?:\\\\)*)<(?=[A-Za-z/!?])")


def plain_text(value: object) -> str:
    """Text fit for a file or a terminal: colour codes and control characters removed,
    line breaks (any of \\r\\n, \\r, \\n) kept as newlines."""
    text = str(value).replace("\r\n", "\n").replace("\r", "\n")
    return _CONTROL.sub("", ANSI_RE.sub("", text))


def md_text(value: object) -> str:
    """One line of Markdown prose (a heading, a bullet): plain, newlines as spaces, no tag."""
    return _TAG_START.sub(r"\1\\<", plain_text(value)).replace("\n", " ")


def md_code(value: object) -> str:
    """A Markdown code span's content: plain, one line, no backtick to close it early."""
    return plain_text(value).replace("\n", " ").replace("`", "'")


def md_cell(value: object) -> str:
    """A table cell: one line (a newline would end the row; it shows as <br>), and a '|' in
    it (a label, a log line) escaped, since it would end the cell early."""
    text = _TAG_START.sub(r"\1\\<", plain_text(value)).replace("|", "\\|")
    return text.replace("\n", "<br>")


def md_table(header: Sequence[object], body: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table; every cell escaped (md_cell)."""
    lines = ["| " + " | ".join(map(md_cell, header)) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(map(md_cell, r)) + " |" for r in body]
    return "\n".join(lines)
