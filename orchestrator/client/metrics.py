"""Request metrics, computed from the request records alone (testable on synthetic ones).

Definitions (per repeat; failed requests are excluded from every latency figure):
- aggregate tok/s: output tokens of all successful requests / (last end - first start).
- active per-user tok/s: tokens streamed after each request's first chunk / time after its
  first chunk, summed over the requests (a ratio of sums); it excludes time to first token,
  so a long prefill does not hide decode speed. Not a mean of per-request rates: a starved
  API server (2 busy CPU cores) can flush a whole answer in one burst right after its first
  chunk, and one such request's near-zero time made a mean of rates read 20,324 tok/s.
- TTFT: first token - start. TPOT: (end - first token) / (output_tokens - 1).
- ITL: the gap between consecutive streamed chunks, one value per gap, as `vllm bench
  serve` counts it (with MTP a chunk may carry several tokens).
- E2EL: end-to-end request latency, start to the last chunk (`vllm bench serve`'s E2EL).
- every distribution carries ``n``, the samples behind it (requests, or chunk gaps for ITL);
- chunking: how the tokens reached the client (chunks, tokens per chunk, how many gaps were
  under BURST_GAP_S). An API server short of CPU flushes several chunks at once, so most
  gaps are near zero and one is long: ITL percentiles then describe that flushing, not the
  decode step, and the chunking says so.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from typing import Any

_PERCENTILES = (50, 90, 99)
# A gap between chunks shorter than this is delivery, not a decode step: no model step on
# any machine here is this fast, so such gaps are chunks the API server flushed together.
BURST_GAP_S = 0.001


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats_ms(values_s: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    out = {f"p{q}": percentile(ms, q) for q in _PERCENTILES}
    out["mean"] = sum(ms) / len(ms) if ms else math.nan
    out["n"] = len(ms)
    return out


def chunking(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How the successful requests' tokens were streamed: chunks, tokens per chunk (mean and
    largest), chunk gaps, and how many of those were under BURST_GAP_S (see the module
    docstring)."""
    ok = [r for r in records if r["error"] is None]
    sizes = [n for r in ok for n in (r.get("chunk_tokens") or [])]
    gaps = [b - a for r in ok for a, b in itertools.pairwise(r["chunk_s"])]
    return {
        "chunks": len(sizes),
        "tokens_per_chunk_mean": sum(sizes) / len(sizes) if sizes else math.nan,
        "tokens_per_chunk_max": max(sizes, default=0),
        "gaps": len(gaps),
        "gaps_under_1ms": sum(1 for g in gaps if g < BURST_GAP_S),
    }


def _decoding(ok: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Successful requests with a decode phase: more than one token, and time after the first."""
    return [r for r in ok if r["output_tokens"] > 1 and r["end_s"] > r["first_token_s"]]


def latency_metrics(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """TTFT, TPOT and ITL distributions (ms) over the successful requests among `records`.

    Times are differences within one request, so records of several repeats may be pooled:
    a workload's p99 over all its requests is a percentile, a mean of repeats' p99s is not."""
    ok = [r for r in records if r["error"] is None]
    tpot = [(r["end_s"] - r["first_token_s"]) / (r["output_tokens"] - 1) for r in _decoding(ok)]
    return {
        "ttft_ms": _stats_ms([r["first_token_s"] - r["start_s"] for r in ok]),
        "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms([b - a for r in ok for a, b in itertools.pairwise(r["chunk_s"])]),
        "e2el_ms": _stats_ms([r["end_s"] - r["start_s"] for r in ok]),
    }


def repeat_metrics(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The metrics of one repeat from its request records (see the module docstring)."""
    ok = [r for r in records if r["error"] is None]
    out_tokens = sum(r["output_tokens"] for r in ok)
    starts = [r["start_s"] for r in records]
    ends = [r["end_s"] for r in records if r["end_s"] is not None]
    wall = (max(ends) - min(starts)) if starts and ends else 0.0
    decoding = _decoding(ok)
    # Tokens of the first chunk arrived with the first token (older records lack chunk_tokens).
    after_first = sum(r["output_tokens"] - ((r.get("chunk_tokens") or [1])[0]) for r in decoding)
    active_s = sum(r["end_s"] - r["first_token_s"] for r in decoding)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "wall_s": wall,
        "aggregate_tok_s": out_tokens / wall if wall > 0 else 0.0,
        "per_user_tok_s": after_first / active_s if active_s > 0 else 0.0,
        **latency_metrics(records),
    }


def mean_of_repeats(repeats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Field-wise mean of the repeats' metrics (nested percentile dicts too). A
    distribution's sample count ``n`` is summed instead: the samples behind the averaged
    figures, an integer (with MTP, or in duration mode, repeats stream different counts,
    and their mean is fractional)."""
    if not repeats:
        return {}

    def avg(values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {k: (total if k == "n" else avg)([v[k] for v in values]) for k in values[0]}
        nums = [float(v) for v in values if not (isinstance(v, float) and math.isnan(v))]
        return sum(nums) / len(nums) if nums else math.nan

    def total(values: list[Any]) -> int | None:
        counts = [int(v) for v in values if v is not None]
        return sum(counts) if counts else None

    keys = [k for k in repeats[0] if k != "repeat"]
    return {k: avg([r[k] for r in repeats]) for k in keys}
