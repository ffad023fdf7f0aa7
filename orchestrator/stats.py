"""Intervals for noisy throughput figures: is a difference beyond the noise we can measure?

Two readers decide with these: `orchestrator compare` (and `nightly`'s gate) asks whether a
candidate run's aggregate tok/s dropped by more than a threshold, and `scripts/fidelity.py`
asks whether our workload client and `vllm bench serve` agree within a bar. Both used to
compare two point figures, and on a shared CPU machine, where single runs swing ±10 % and
more, two runs of one commit then read as a regression. Here each figure gets a 95 %
interval, and `position` says whether the interval lies inside a bar, outside it, or
across its edge (too few samples to tell).

- `bootstrap_change_pct`: the change of a mean of repeats, with each repeat's requests
  (in blocks of those in flight together) resampled inside it: a two-level percentile
  bootstrap, seeded, so the same inputs give the same interval.
- `t_interval`: Student's t interval of a mean, for a handful of paired differences (a
  bootstrap of two or three values cannot show how little they say).

Stdlib only: `compare` must run where only the run directories are.
"""

from __future__ import annotations

import math
import random
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from operator import itemgetter
from typing import Literal

CONFIDENCE = 0.95
# 2000 resamples put the 2.5th and 97.5th percentiles 50 replicates in from either end:
# enough that rerunning with another seed moves the bounds by a few hundredths of a percent
# on the figures compare sees, and about 0.1 s per workload in pure Python.
BOOTSTRAP_RESAMPLES = 2000
# Fixed, and a fresh generator per figure: the same two runs give the same report byte for
# byte, whatever else the comparison holds or in what order it is computed.
BOOTSTRAP_SEED = 12
# Fewer samples than this per run and the percentile bootstrap's interval is too narrow to
# trust (it cannot reach past the values it drew; at n=8 its standard error is still ~7 %
# short of the sample's), so no decision is made.
MIN_SAMPLES = 8

_TOKENS, _SECONDS = itemgetter(0), itemgetter(1)

Position = Literal["inside", "outside", "across"]


@dataclass(frozen=True)
class Interval:
    """A point estimate and its two-sided interval, in the unit of the figure (here: %)."""

    estimate: float
    low: float
    high: float
    confidence: float
    method: str

    def position(self, low_bar: float, high_bar: float) -> Position:
        """Where the interval lies against the bar [low_bar, high_bar]: all inside, all
        outside, or across an edge (the data cannot tell which side the truth is on)."""
        if low_bar <= self.low and self.high <= high_bar:
            return "inside"
        if self.high < low_bar or self.low > high_bar:
            return "outside"
        return "across"

    def bounds(self) -> str:
        """``-0.40% … +2.80%``."""
        return f"{self.low:+.2f}% … {self.high:+.2f}%"

    def describe(self) -> str:
        """``+1.20%, 95% interval -0.40% … +2.80%``."""
        return f"{self.estimate:+.2f}%, {100 * self.confidence:g}% interval {self.bounds()}"


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


# --------------------------------------------------------------------------- Student's t


def _beta_continued_fraction(a: float, b: float, x: float) -> float:
    # The regularized incomplete beta's continued fraction, evaluated by the modified Lentz
    # method (Numerical Recipes, 6.4); converges fast for x < (a + 1) / (a + b + 2).
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 400):
        for aa in (
            m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
            -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1)),
        ):
            d = 1.0 + aa * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + aa / c
            c = c if abs(c) > tiny else tiny
            h *= d * c
        if abs(d * c - 1.0) < 1e-15:
            break
    return h


def _incomplete_beta(a: float, b: float, x: float) -> float:
    """I_x(a, b), the regularized incomplete beta function."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = (
        math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    )
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _beta_continued_fraction(a, b, x) / a
    return 1.0 - math.exp(log_front) * _beta_continued_fraction(b, a, 1.0 - x) / b


def t_cdf(t: float, df: float) -> float:
    """P(T <= t) for Student's t with `df` degrees of freedom."""
    tail = 0.5 * _incomplete_beta(df / 2.0, 0.5, df / (df + t * t))
    return 1.0 - tail if t > 0 else tail


def t_quantile(p: float, df: float) -> float:
    """The `p` quantile of Student's t with `df` degrees of freedom (bisection on t_cdf)."""
    if not 0.0 < p < 1.0 or not df > 0:
        raise ValueError(f"t_quantile(p={p}, df={df}): need 0 < p < 1 and df > 0")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while t_cdf(hi, df) < p:
        lo, hi = hi, hi * 2.0
    for _ in range(200):
        mid = (lo + hi) / 2.0
        if t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return (lo + hi) / 2.0


def t_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> Interval | None:
    """Student's t interval of the mean of `values`; None with fewer than two values."""
    n = len(values)
    if n < 2:
        return None
    mean = statistics.fmean(values)
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * statistics.stdev(values) / math.sqrt(n)
    return Interval(mean, mean - half, mean + half, confidence, f"t, {n - 1} df")


# --------------------------------------------------------------------------- bootstrap


@dataclass(frozen=True)
class RepeatSample:
    """One repeat's figure and, when recorded, the samples inside it it was measured from.

    Each of `parts` is (output tokens, seconds) of one independent stretch of the repeat:
    a request, or a block of requests that were in flight together (they share every
    server step, so they are one sample of its speed, not several). A repeat's aggregate
    tok/s moves with the parts' rate, Σ tokens / Σ seconds (the concurrency that converts
    one into the other is the workload's, the same in every resample), so resampling the
    parts scales `value` by the ratio of the resampled rate to the recorded one. Without
    parts (results written before request records were read, or none recorded) the repeat
    counts as one sample.
    """

    value: float
    parts: tuple[tuple[float, float], ...] = ()

    @property
    def samples(self) -> int:
        return len(self.parts) if self.parts else 1

    @cached_property
    def _rate(self) -> float:
        seconds = sum(map(_SECONDS, self.parts))
        return sum(map(_TOKENS, self.parts)) / seconds if seconds > 0 else math.nan

    def resampled(self, rng: random.Random) -> float:
        """The repeat's figure under one resample of its parts."""
        if len(self.parts) < 2 or not self._rate > 0:
            return self.value
        drawn = rng.choices(self.parts, k=len(self.parts))
        seconds = sum(map(_SECONDS, drawn))
        if not seconds > 0:
            return self.value
        return self.value * sum(map(_TOKENS, drawn)) / seconds / self._rate


def sample_count(repeats: Sequence[RepeatSample]) -> int:
    """How many samples stand behind a run's figure: its repeats' parts, else its repeats."""
    return sum(r.samples for r in repeats)


def _mean_of(repeats: Sequence[RepeatSample], rng: random.Random) -> float:
    drawn = rng.choices(repeats, k=len(repeats)) if len(repeats) > 1 else repeats
    return statistics.fmean(r.resampled(rng) for r in drawn)


def bootstrap_change_pct(
    base: Sequence[RepeatSample],
    cand: Sequence[RepeatSample],
    *,
    resamples: int = BOOTSTRAP_RESAMPLES,
    seed: int = BOOTSTRAP_SEED,
    confidence: float = CONFIDENCE,
) -> Interval:
    """Percent change of CAND's mean over repeats against BASE's, with a percentile interval.

    Each replicate draws, for each run independently, its repeats with replacement and,
    inside each drawn repeat, that repeat's parts with replacement; the change of the two
    replicate means is one value of the bootstrap distribution. Repeats carry the noise
    between measurement windows (another job's load, a server's state), parts the noise
    inside one. Noise common to a whole run (a machine busier for all of it than for the
    other run) is in neither, and no interval from two runs can show it.
    """
    if not base or not cand:
        raise ValueError("bootstrap_change_pct needs at least one repeat per run")
    base_mean = statistics.fmean(r.value for r in base)
    if not base_mean > 0:
        raise ValueError(f"base mean {base_mean} must be positive")
    rng = random.Random(seed)
    changes = []
    for _ in range(resamples):
        b = _mean_of(base, rng)
        changes.append(100.0 * (_mean_of(cand, rng) / b - 1.0) if b > 0 else math.inf)
    tail = expanded_tail(confidence, min(sample_count(base), sample_count(cand)))
    estimate = 100.0 * (statistics.fmean(r.value for r in cand) / base_mean - 1.0)
    return Interval(
        estimate,
        percentile(changes, 100 * tail),
        percentile(changes, 100 * (1 - tail)),
        confidence,
        f"expanded percentile bootstrap, {resamples} resamples, seed {seed}",
    )


def expanded_tail(confidence: float, n: int) -> float:
    """The tail probability at which to read a bootstrap distribution of a mean of `n`
    samples for a `confidence` interval (Hesterberg's expanded percentile interval).

    The plain percentile interval is too narrow for small n twice over: the bootstrap's
    spread is the sample's divided by n, not n - 1, and it uses the normal's quantile
    where Student's t applies. Reading it further out, at the normal tail where
    z * sqrt(n / (n - 1)) equals t(n - 1), corrects both; at n = 8 the 95 % interval is
    read at the 0.6th and 99.4th percentiles, at n = 40 at the 2.0th and 98.0th.
    """
    plain = (1.0 - confidence) / 2.0
    if n < 2:
        return plain
    t = t_quantile(1.0 - plain, n - 1)
    return statistics.NormalDist().cdf(-t * math.sqrt(n / (n - 1)))
