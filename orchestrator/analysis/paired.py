"""The pairs of a switch-mode A/B: the order its server ran, how far that order was from
drift-balanced, and the MTP acceptance each pair saw.

A switch-mode server measures the variants in rounds (orchestrator.plan.units.schedule): the
k-th block of each variant is in round k, back to back on one loaded server, so the round's
blocks share the server's state and whatever it drifted to by then. A round is one pair, and
its log ratio (candidate / baseline) is one sample of the change
(orchestrator.analysis.stats.paired_ratio_interval); with two or more switch servers per
topology each server is one pair, the mean of its blocks per variant.

Pairing takes out what the two blocks share, not a drift *within* the round: with a linear
drift of δ per block, a round whose candidate ran second adds +δ to its log ratio and one
whose candidate ran first −δ, so the mean carries δ × (the candidate's mean position − the
baseline's), `drift_offset`. Order abba makes that 0 over an even number of rounds; order
alternate leaves one whole block's drift in the change, and three ABBA rounds (A B B A A B)
a third of one.

Under vLLM's synthetic MTP acceptance the draft tokens a step keeps are drawn from the GPU's
random stream, at points fixed by where a block sits in the server's life, not by its path:
unless the server reseeds its workers per round (orchestrator.execution.switch does since
2026-12-06), the two blocks of a round see different draws, and the acceptance they see moves
their throughput by more than the kernel does. `acceptance_adjustment` takes that out: the
path cannot change synthetic acceptance, so the rounds' log ratios are judged at equal
acceptance (docs/statistics.md, "MTP acceptance").
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.analysis.stats import (
    CONFIDENCE,
    Interval,
    Slope,
    fitted_slope,
    log_change_interval,
)
from orchestrator.results.rows import Repeat, WorkloadSummary

ROUNDS, PAIRED_SERVERS = "rounds", "server starts, paired"
# How a figure moves with the acceptance length L (tokens a decode step emits per request):
# output tok/s as L over the share of its time the workload spends decoding (a prefill emits
# one token whatever L is); a TPOT, a decode step's time per token, as 1 / L; the time to the
# first token not at all (it comes before any draft is verified).
DECODE_SHARE, PER_TOKEN, FIRST_TOKEN = "decode share", "per token", "first token"
# The elasticities the structure fixes (DECODE_SHARE's is each round's own).
_FIXED_ELASTICITY = {PER_TOKEN: -1.0, FIRST_TOKEN: 0.0}
_ORDER_GROUPS = 32  # pairs of rounds the order's text spells out before "…"


def mean_positions(schedule: Sequence[str]) -> dict[str, float]:
    """Each variant's mean position (from 1) on the server's schedule."""
    at: dict[str, list[int]] = {}
    for i, variant in enumerate(schedule, 1):
        at.setdefault(variant, []).append(i)
    return {v: statistics.fmean(p) for v, p in at.items()}


def drift_offset(schedule: Sequence[str], base: str, cand: str) -> float | None:
    """The candidate's mean position minus the baseline's, in blocks: how many blocks' worth
    of a linear drift the change carries (0: drift-balanced); None where either is absent."""
    mean = mean_positions(schedule)
    if base not in mean or cand not in mean:
        return None
    return mean[cand] - mean[base]


def order_text(schedule: Sequence[str], variants: Sequence[str]) -> str:
    """The order that ran, a letter a block, grouped by round: ``ABBA BAAB (A staged, B
    fused)``; `variants` in the schedule's first round's order name the letters."""
    present = [v for v in variants if v in schedule]
    letters = {v: chr(ord("A") + i) for i, v in enumerate(present)}
    width = max(1, len(present))
    rounds = [
        "".join(letters[v] for v in schedule[i : i + 2 * width])
        for i in range(0, len(schedule), 2 * width)
    ]
    spelled = " ".join(rounds[:_ORDER_GROUPS]) + (" …" if len(rounds) > _ORDER_GROUPS else "")
    legend = ", ".join(f"{letter} {v}" for v, letter in letters.items())
    return f"{spelled} ({legend})"


# --------------------------------------------------------------------------- MTP acceptance


@dataclass(frozen=True)
class Adjustment:
    """One figure of an MTP topology at equal acceptance: both paths' acceptance over the
    rounds, the elasticity the adjustment used, the adjusted interval, and the rounds' own fit
    of the elasticity (a check of the assumed one). `interval` is None where the figure is not
    adjusted, and `why` says why."""

    baseline_rate: float | None
    candidate_rate: float | None
    synthetic: bool
    elasticity: float | None = None
    interval: Interval | None = None
    fitted: Slope | None = None
    why: str = ""

    def to_dict(self) -> dict[str, Any]:
        iv, fit = self.interval, self.fitted
        return {
            "baseline_rate": self.baseline_rate,
            "candidate_rate": self.candidate_rate,
            "synthetic": self.synthetic,
            "elasticity": self.elasticity,
            "change_pct": None if iv is None else iv.estimate,
            "interval_pct": None if iv is None else [iv.low, iv.high],
            "method": None if iv is None else iv.method,
            "p_value": None if iv is None else iv.p_value,
            "fitted_elasticity": None if fit is None else [fit.estimate, fit.low, fit.high],
            "why": self.why or None,
        }


def _mean_of(dist: Any) -> float | None:
    value = dist.get("mean") if isinstance(dist, dict) else getattr(dist, "mean", None)
    return float(value) if isinstance(value, int | float) else None


def decode_share(block: Repeat) -> float | None:
    """The share of a block's request time spent decoding: 1 - TTFT / end-to-end latency
    (their means over the block's requests); None where either was not recorded."""
    ttft = _mean_of(block.ttft_ms) if block.ttft_ms is not None else None
    e2el = _mean_of(getattr(block, "e2el_ms", None))
    if ttft is None or e2el is None or not e2el > 0:
        return None
    return min(1.0, max(0.0, 1.0 - ttft / e2el))


def _block_rates(w: WorkloadSummary) -> list[float | None]:
    sd = w.spec_decode
    return list(sd.block_rates or []) if sd is not None else []


def acceptance_adjustment(
    rounds: Sequence[tuple[int, float, float]],
    base: WorkloadSummary,
    cand: WorkloadSummary,
    mtp: int,
    moves_as: str,
    confidence: float = CONFIDENCE,
) -> Adjustment | None:
    """The figure's paired `rounds` ((round index from 0, baseline, candidate)) judged at
    equal MTP acceptance; None where neither workload read the spec-decode counters.

    Per round k, x = log(L_cand / L_base), L = 1 + mtp × the block's acceptance rate (the
    tokens a decode step emits per request), and the log ratio less e × x is the round's
    change at equal acceptance, e the figure's elasticity to L (`moves_as`: DECODE_SHARE, the
    round's mean decode share, for tok/s; PER_TOKEN, -1, for a TPOT; FIRST_TOKEN, 0, for a
    time to first token). Adjusted only under
    synthetic acceptance, which the path cannot change: a real draft's acceptance may move
    with the kernel's numerics, and that would be part of the change. `confidence`: the
    adjusted interval's (a stopping rule's per-look level)."""
    if base.spec_decode is None or cand.spec_decode is None:
        return None
    rates_b, rates_c = _block_rates(base), _block_rates(cand)
    used = [
        (k, b, c, rates_b[k], rates_c[k])
        for k, b, c in rounds
        if k < min(len(rates_b), len(rates_c)) and rates_b[k] is not None and rates_c[k] is not None
    ]
    synthetic = bool(base.spec_decode.configured_rates and cand.spec_decode.configured_rates)
    seen = Adjustment(
        statistics.fmean(r[3] for r in used) if used else base.spec_decode.acceptance_rate,
        statistics.fmean(r[4] for r in used) if used else cand.spec_decode.acceptance_rate,
        synthetic,
    )
    if not synthetic:
        return _not(seen, "acceptance not synthetic: the path may change it, so it is kept")
    if len(used) < len(rounds) or len(used) < 2:
        return _not(seen, "a round's blocks lack their acceptance rates")
    xs = [math.log((1 + mtp * rc) / (1 + mtp * rb)) for _, _, _, rb, rc in used]
    shares: list[float | None]
    if moves_as == DECODE_SHARE:
        shares = [_round_share(base.repeats, cand.repeats, k) for k, *_ in used]
    else:
        shares = [_FIXED_ELASTICITY[moves_as]] * len(used)
    if any(e is None for e in shares):
        return _not(seen, "a block's TTFT or end-to-end latency was not recorded")
    es = [float(e) for e in shares if e is not None]
    logs = [math.log(c / b) for _, b, c, _, _ in used]
    adjusted = [d - e * x for d, e, x in zip(logs, es, xs, strict=True)]
    return Adjustment(
        seen.baseline_rate,
        seen.candidate_rate,
        True,
        statistics.fmean(es),
        log_change_interval(
            adjusted, confidence, label="paired t on log ratios at equal MTP acceptance"
        ),
        fitted_slope(xs, logs),
    )


def _not(seen: Adjustment, why: str) -> Adjustment:
    return Adjustment(seen.baseline_rate, seen.candidate_rate, seen.synthetic, why=why)


def _round_share(base: Sequence[Repeat], cand: Sequence[Repeat], k: int) -> float | None:
    if k >= len(base) or k >= len(cand):
        return None
    shares = [decode_share(base[k]), decode_share(cand[k])]
    return None if None in shares else statistics.fmean(s for s in shares if s is not None)
