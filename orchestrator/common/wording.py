"""Counts in sentences, worded one way everywhere: ``1 repeat``, ``2 repeats``, ``1,024 lines``.

Stdlib only: the audit's summary sentence uses it too.
"""

from __future__ import annotations


def plural(n: int, word: str) -> str:
    """``n word``, with an ``s`` unless n is 1, and thousands separated."""
    return f"{n:,} {word}{'' if n == 1 else 's'}"
