"""What a server's Prometheus endpoint says about speculative decoding, around a workload.

vLLM counts drafts, draft tokens and accepted tokens (``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, and ``..._num_accepted_tokens_per_pos``
by ``position``) in ``/metrics``, 0.26 and 0.32 alike (vllm/v1/spec_decode/metrics.py). Read
before and after a workload, their differences are the acceptance that workload saw, as
``vllm bench serve`` reports it (vllm/benchmarks/serve.py, ``fetch_spec_decode_metrics``):

- acceptance rate: accepted tokens / draft tokens;
- acceptance length: 1 + accepted tokens / drafts (tokens a verification step yields);
- per position: accepted at position i / drafts.

The counters are the server's, so they include every request it served in between: the
workloads run one at a time, and the warm-up before the first read.

Only httpx and the standard library.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import httpx

PREFIX = "vllm:spec_decode_num_"
_SAMPLE = re.compile(
    r"^(?P<name>vllm:spec_decode_num_\w+?)_total(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$"
)
_POSITION = re.compile(r'position="(?P<pos>\d+)"')


@dataclass
class SpecDecodeCounters:
    """The speculative-decoding counters of one `/metrics` read, summed over engines."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted_tokens: float = 0.0
    accepted_per_position: dict[int, float] = field(default_factory=dict)

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted over proposed draft tokens; None where none was proposed."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens > 0 else None


def parse_spec_decode(text: str) -> SpecDecodeCounters | None:
    """The counters in a Prometheus text exposition; None where it has none (a server
    without speculative decoding)."""
    found = False
    c = SpecDecodeCounters()
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m is None:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        found = True
        name = m["name"][len(PREFIX) :]
        if name == "drafts":
            c.drafts += value
        elif name == "draft_tokens":
            c.draft_tokens += value
        elif name == "accepted_tokens":
            c.accepted_tokens += value
        elif name == "accepted_tokens_per_pos":
            pos = _POSITION.search(m["labels"] or "")
            if pos is not None:
                i = int(pos["pos"])
                c.accepted_per_position[i] = c.accepted_per_position.get(i, 0.0) + value
    return c if found else None


def read_spec_decode(
    base_url: str, *, timeout_s: float = 10.0, headers: dict[str, str] | None = None
) -> SpecDecodeCounters | None:
    """GET /metrics and parse it; None where the server has no such counters or does not
    answer (acceptance is then not reported, and the workload's figures stand)."""
    url = base_url.rstrip("/") + "/metrics"
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, headers=headers or {}) as client:
            reply = client.get(url)
    except httpx.HTTPError:
        return None
    if reply.status_code != 200:
        return None
    return parse_spec_decode(reply.text)


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
    `configured` (vLLM's synthetic per-position rates), the rate expected. None where
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
