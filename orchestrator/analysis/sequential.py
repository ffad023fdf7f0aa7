"""A switch-mode A/B's sequential stopping rule (``ab.target_half_width_pct``, ``ab.max_blocks``).

After the first ``ab.blocks`` rounds, and after every two rounds more, the run looks at the
primary figure's paired interval of each candidate and stops once every one's half-width is
within the target, or at ``ab.max_blocks`` rounds. Two rounds at a time are the next pair of
Thue-Morse rounds, a round and its mirror (AB BA), so every look's blocks are drift-balanced.

Looking several times and stopping when the interval is narrow makes the number of rounds
depend on the data, and an interval read at a data-chosen time is not a 95 % interval unless
the looks are paid for. They are paid by Bonferroni over the K looks fixed before the run
(``blocks``, ``blocks`` + 2, ..., ``max_blocks``): every look's interval is at 1 - 0.05 / K,
so the chance that any look's interval misses the true change is at most 0.05, and the
interval at whichever look the run stopped is a 95 % interval whatever the rule (it holds for
every stopping time over these looks, not only this one). The same level judges every figure
of the run, secondary ones included, since all were read at the stopped look.
docs/statistics.md ("Stopping on precision") says why this and not the nominal interval.

The looks are never stored apart: the rule is a function of the rounds, so the run (deciding)
and the reports (saying what it decided, from the stored rows) compute the same looks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from orchestrator.analysis.stats import CONFIDENCE, Interval, paired_ratio_interval

# Rounds added between looks: a round and its mirror keep each variant's blocks at one mean
# position (orchestrator.plan.units.schedule), so no look carries a drift.
LOOK_STEP = 2
TARGET, CAP = "target reached", "cap reached"

Pairs = Sequence[tuple[int, float, float]]  # (round from 0, baseline, candidate) per round


@dataclass(frozen=True)
class Look:
    """One look: the rounds it read and each candidate's half-width (%, None where the rounds
    cannot bound the change), and whether every candidate was within the target."""

    rounds: int
    half_widths: dict[str, float | None]
    reached: bool

    def to_dict(self) -> dict[str, Any]:
        return {"rounds": self.rounds, "half_width_pct": self.half_widths, "reached": self.reached}


@dataclass(frozen=True)
class StoppingRule:
    """Look after `first` rounds and every LOOK_STEP after, up to `cap`; stop once the primary
    figure's half-width is at most `target_pct` for every candidate."""

    first: int
    cap: int
    target_pct: float

    @classmethod
    def of(cls, ab: Mapping[str, Any] | None) -> StoppingRule | None:
        """The rule of a matrix's ``ab`` block as run (ABSpec's JSON dump, as the manifest keeps
        it); None without one."""
        if not ab or ab.get("mode") != "switch" or ab.get("target_half_width_pct") is None:
            return None
        return cls(int(ab["blocks"]), int(ab["max_blocks"]), float(ab["target_half_width_pct"]))

    @property
    def looks(self) -> tuple[int, ...]:
        """The rounds after which the run looks, fixed before it starts."""
        return tuple(range(self.first, self.cap + 1, LOOK_STEP))

    @property
    def confidence(self) -> float:
        """Each look's confidence: 1 - 0.05 / K (Bonferroni over the K planned looks)."""
        return 1.0 - (1.0 - CONFIDENCE) / len(self.looks)

    @property
    def method(self) -> str:
        """``at 99.29% per look, Bonferroni over 7 looks``: the interval's level, said."""
        return f"at {100 * self.confidence:.2f}% per look, Bonferroni over {len(self.looks)} looks"

    def interval(self, pairs: Pairs) -> Interval | None:
        """The paired interval of `pairs` at the per-look confidence; None with fewer than two
        pairs or a figure that is not positive (nothing to bound)."""
        if len(pairs) < 2 or min(v for _, b, c in pairs for v in (b, c)) <= 0:
            return None
        return paired_ratio_interval(
            [b for _, b, _ in pairs], [c for _, _, c in pairs], self.confidence
        )

    def look(self, rounds: int, pairs: Mapping[str, Pairs]) -> Look:
        """The look after `rounds` rounds, over each candidate's pairs of the primary figure
        (those of later rounds are left out)."""
        widths: dict[str, float | None] = {}
        for cand, found in pairs.items():
            iv = self.interval([p for p in found if p[0] < rounds])
            widths[cand] = None if iv is None else iv.half_width
        reached = bool(widths) and all(
            h is not None and h <= self.target_pct for h in widths.values()
        )
        return Look(rounds, widths, reached)

    def stops(self, look: Look) -> bool:
        """Whether the run stops at `look`: the target reached, or no rounds left."""
        return look.reached or look.rounds >= self.cap

    def history(self, rounds_run: int, pairs: Mapping[str, Pairs]) -> list[Look]:
        """The looks a server that ran `rounds_run` rounds took, recomputed from its pairs."""
        return [self.look(n, pairs) for n in self.looks if n <= rounds_run]

    def why_stopped(self, looks: Sequence[Look], rounds_run: int) -> str:
        """TARGET, CAP, or what else ended the rounds (a server that ran fewer rounds than
        its last look names: a failure, not the rule)."""
        if looks and looks[-1].rounds == rounds_run and looks[-1].reached:
            return TARGET
        if rounds_run >= self.cap:
            return CAP
        return f"ended after {rounds_run} rounds, not at a look that stops"
