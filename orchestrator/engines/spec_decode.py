"""Speculative-decoding counters and what a workload saw of them, whatever the engine.

An engine's server counts drafts, draft tokens and accepted tokens (in total and by draft
position); the engine reads them (``Engine.spec_decode_counters``, vLLM's from ``/metrics``:
orchestrator.engines.vllm.server_metrics). Read before and after a workload, their
differences are the acceptance that workload saw, as ``vllm bench serve`` reports it
(vllm/benchmarks/serve.py, ``fetch_spec_decode_metrics``):

- acceptance rate: accepted tokens / draft tokens;
- acceptance length: 1 + accepted tokens / drafts (tokens a verification step yields);
- per position: accepted at position i / drafts.

The counters are the server's, so they include every request it served in between: the
workloads run one at a time, and the warm-up before the first read.

Standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class SpecDecodeCounters:
    """The speculative-decoding counters of one read, summed over the server's engine cores."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_position: dict[int, float] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed draft tokens; None where none was proposed."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens > 0 else None


def difference(
    before: SpecDecodeCounters | None, after: SpecDecodeCounters | None
) -> SpecDecodeCounters | None:
    """What the counters moved between two reads; None where either read is missing."""
    if before is None or after is None:
        return None
    positions = sorted(set(before.accepted_per_position) | set(after.accepted_per_position))
    return SpecDecodeCounters(
        drafts=after.drafts - before.drafts,
        draft_tokens=after.draft_tokens - before.draft_tokens,
        accepted_tokens=after.accepted_tokens - before.accepted_tokens,
        accepted_per_position={
            i: after.accepted_per_position.get(i, 0.0) - before.accepted_per_position.get(i, 0.0)
            for i in positions
        },
    )


def total(parts: Iterable[SpecDecodeCounters | None]) -> SpecDecodeCounters | None:
    """The sum of several workloads' differences (a switch-mode variant's blocks); None
    where any is missing, since a sum over part of the blocks would not be the variant's."""
    out = SpecDecodeCounters()
    seen = False
    for part in parts:
        if part is None:
            return None
        seen = True
        out.drafts += part.drafts
        out.draft_tokens += part.draft_tokens
        out.accepted_tokens += part.accepted_tokens
        for i, v in part.accepted_per_position.items():
            out.accepted_per_position[i] = out.accepted_per_position.get(i, 0.0) + v
    return out if seen else None


def acceptance(
    before: SpecDecodeCounters | None,
    after: SpecDecodeCounters | None,
    *,
    configured: list[float] | None = None,
) -> dict[str, Any] | None:
    """What a workload saw between two reads (summarize() of their difference())."""
    return summarize(difference(before, after), configured=configured)


def summarize(
    moved: SpecDecodeCounters | None, *, configured: list[float] | None = None
) -> dict[str, Any] | None:
    """Counter differences, acceptance rate and length, per-position rates; and, with
    `configured` (the engine's synthetic per-position rates), the rate expected. None where
    `moved` is missing or no draft token was proposed."""
    rate = moved.acceptance_rate if moved is not None else None
    if moved is None or rate is None:
        return None
    drafts, draft_tokens, accepted = moved.drafts, moved.draft_tokens, moved.accepted_tokens
    per_position = [
        round(moved.accepted_per_position[i] / drafts, 4)
        for i in sorted(moved.accepted_per_position)
        if drafts > 0
    ]
    out: dict[str, Any] = {
        "drafts": int(drafts),
        "draft_tokens": int(draft_tokens),
        "accepted_tokens": int(accepted),
        "acceptance_rate": round(rate, 4),
        "acceptance_length": round(1 + accepted / drafts, 4) if drafts > 0 else None,
        "per_position": per_position,
    }
    if configured:
        out["configured_rates"] = list(configured)
        # Each draft proposes every position, so the expected share of accepted draft
        # tokens is the mean of the unconditional per-position rates.
        out["expected_rate"] = round(sum(configured) / len(configured), 4)
    return out
