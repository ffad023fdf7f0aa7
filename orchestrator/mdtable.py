"""Markdown tables, with no dependency beyond the standard library: ``fusedq-bench`` prints
them on GPU machines that have torch and Triton but not the orchestrator's pydantic stack
(importing ``orchestrator.reports`` loads the result model)."""

from __future__ import annotations

from collections.abc import Sequence


def md_cell(value: object) -> str:
    """A table cell: a '|' in it (a label, a log line) would end the cell early."""
    return str(value).replace("|", "\\|")


def md_table(header: Sequence[object], body: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured Markdown table; every cell escaped (md_cell)."""
    lines = ["| " + " | ".join(map(md_cell, header)) + " |"]
    lines.append("|" + "|".join("---" for _ in header) + "|")
    lines += ["| " + " | ".join(map(md_cell, r)) + " |" for r in body]
    return "\n".join(lines)
