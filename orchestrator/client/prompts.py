"""Exact-length prompts: random token ids, seeded, so a rerun sends the same prompts.

Sent as ids, the prompt length is exact without a tokenizer. Only the standard library is
imported.
"""

from __future__ import annotations

import random


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """[lo, hi) of ids safe for random prompts: tokenizers keep special and control tokens
    at the very start (bos/eos/pad, byte fallbacks) or the very end (chat and tool
    markers, padding rows), so the middle of the vocabulary holds ordinary text tokens."""
    if vocab_size < 64:
        raise ValueError(f"vocab_size={vocab_size} is too small for random prompts")
    return min(vocab_size // 16, 1000), vocab_size * 7 // 8


def make_prompt(n_tokens: int, *, vocab_size: int, seed: int, key: str) -> list[int]:
    """Random ids, the same for the same (seed, key): reruns send identical prompts."""
    lo, hi = token_id_range(vocab_size)
    rng = random.Random(f"{seed}/{key}")
    return [rng.randrange(lo, hi) for _ in range(n_tokens)]
