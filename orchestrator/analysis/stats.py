"""Intervals for noisy throughput figures: is a difference beyond the noise we can measure?

Three readers decide with these: `orchestrator compare` (and `nightly`'s gate) asks whether a
candidate run's aggregate tok/s dropped by more than a threshold, an A/B matrix
(orchestrator.analysis.ab) whether a variant is faster than the baseline, and `scripts/fidelity.py`
whether our workload client and `vllm bench serve` agree within a bar. Comparing two point
figures fails all three: on a shared CPU machine single runs swing ±10 % and more, and on an
H200 two servers of one configuration differ by 0.1-0.35 %, as much as the effect under
test. Here each figure gets a 95 % interval, and `position` says whether the interval lies
inside a bar, outside it, or across its edge (too few samples to tell).

- `ratio_interval`: the one interval of a ratio of two means in this project: Fieller's,
  with Welch-Satterthwaite degrees of freedom (docs/statistics.md says why). It is fed
  `MeanEstimate`s: a mean, the variance of that mean and its degrees of freedom, from
  whatever the experiment's independent units are (server starts, blocks, repeats).
- `change_interval`: `ratio_interval` of one run's mean over repeats against another's,
  the repeats being the units and each repeat's recorded requests setting a floor under
  its variance (`RunFigure`).
- `t_interval`: Student's t interval of a mean, for a handful of paired differences.
- `paired_ratio_interval`: the ratio of paired figures (an A/B's rounds on one switch-mode
  server): Student's t interval of the mean log ratio, back-transformed.
- `holm`: Holm's step-down adjustment of p-values (a family of secondary figures);
  `Interval.detectable` the change a figure's units find with 80 % power.

All are closed-form: the same inputs give the same interval, with no seed to fix.
Stdlib only: `compare` must run where only the run directories are.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

CONFIDENCE = 0.95
# Repeats are the samples of a run: with one, nothing says how far the machine's speed
# moves between measurement windows, and two runs of one commit on a shared machine
# differed by 20 % while each run's requests agreed to a few percent.
MIN_REPEATS = 2
# The verdict on a figure these units cannot bound (an A/B's and compare's gate alike).
TOO_FEW = "too few samples to tell"

# The power at which an A/B states the smallest change its units would find (Cohen's
# convention): a true change the size of the interval's half-width is found only about half
# the time.
POWER = 0.8

Position = Literal["inside", "outside", "across"]


@dataclass(frozen=True)
class Interval:
    """A point estimate and its two-sided interval, in the unit of the figure (here: %)."""

    estimate: float
    low: float
    high: float
    confidence: float
    method: str
    df: float | None = None  # of the t quantile the bounds used; None where not a t interval
    p_value: float | None = None  # two-sided, of no change (a ratio of 1, a difference of 0)

    def position(self, low_bar: float, high_bar: float) -> Position:
        """Where the interval lies against the bar [low_bar, high_bar]: all inside, all
        outside, or across an edge (the data cannot tell which side the truth is on)."""
        if low_bar <= self.low and self.high <= high_bar:
            return "inside"
        if self.high < low_bar or self.low > high_bar:
            return "outside"
        return "across"

    @property
    def half_width(self) -> float:
        """Half the interval's width (a Fieller interval is not symmetric about its estimate)."""
        return (self.high - self.low) / 2.0

    def detectable(self, power: float = POWER) -> float | None:
        """The change (in %) these units find with probability `power` at the interval's
        confidence: (t(1 - a/2, df) + t(power, df)) / t(1 - a/2, df) x the half-width (the
        normal-approximation sample-size formula with t quantiles; about 1.25-1.45 x h at
        2-20 df). None without degrees of freedom."""
        if self.df is None or not self.df > 0:
            return None
        t_conf = t_quantile(0.5 + self.confidence / 2.0, self.df)
        return (t_conf + t_quantile(power, self.df)) / t_conf * self.half_width

    def bounds(self) -> str:
        """``-0.40% … +2.80%``."""
        return f"{self.low:+.2f}% … {self.high:+.2f}%"

    def describe(self) -> str:
        """``+1.20%, 95% interval -0.40% … +2.80%``."""
        return f"{self.estimate:+.2f}%, {100 * self.confidence:g}% interval {self.bounds()}"


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
    se = statistics.stdev(values) / math.sqrt(n)
    half = t_quantile(0.5 + confidence / 2.0, n - 1) * se
    p = _two_sided_p(mean, se, n - 1)
    return Interval(mean, mean - half, mean + half, confidence, f"t, {n - 1} df", n - 1, p)


def _two_sided_p(estimate: float, se: float, df: float) -> float:
    """P(|T| >= |estimate / se|) under Student's t with `df`; a zero standard error gives 0
    for a nonzero estimate and 1 for zero (every unit agreed)."""
    if se > 0:
        return 2.0 * (1.0 - t_cdf(abs(estimate) / se, df))
    return 0.0 if estimate else 1.0


def paired_ratio_interval(
    base: Sequence[float], cand: Sequence[float], confidence: float = CONFIDENCE
) -> Interval | None:
    """The change of CAND against BASE measured in pairs (base[i] and cand[i] share a round
    on one server): Student's t interval of the mean of log(cand[i] / base[i]) over the n
    pairs, n - 1 df, back-transformed to a percent change of the geometric mean ratio. The
    pairing takes out what a round's two blocks share (the server's state, a drift); the
    log makes the change a ratio whatever the figure's scale. None with fewer than two
    pairs; ValueError for a figure that is not positive."""
    if len(base) != len(cand):
        raise ValueError(f"paired figures need equal counts: {len(base)} and {len(cand)}")
    if min([*base, *cand], default=1.0) <= 0:
        raise ValueError(f"paired ratios need positive figures: {list(base)}, {list(cand)}")
    return log_change_interval(
        [math.log(c / b) for b, c in zip(base, cand, strict=True)], confidence
    )


def log_change_interval(
    logs: Sequence[float], confidence: float = CONFIDENCE, label: str = "paired t on log ratios"
) -> Interval | None:
    """Student's t interval of the mean of `logs` (log ratios), as a percent change:
    100 (exp(x) - 1) of the estimate and of each bound. None with fewer than two."""
    iv = t_interval(logs, confidence)
    if iv is None:
        return None

    def pct(x: float) -> float:
        return 100.0 * math.expm1(x)

    return Interval(
        pct(iv.estimate),
        pct(iv.low),
        pct(iv.high),
        confidence,
        f"{label}, {iv.df} df",
        iv.df,
        iv.p_value,
    )


@dataclass(frozen=True)
class Slope:
    """The least-squares slope of y on x with its t interval (n - 2 df)."""

    estimate: float
    low: float
    high: float
    df: int


def fitted_slope(
    x: Sequence[float], y: Sequence[float], confidence: float = CONFIDENCE
) -> Slope | None:
    """The slope of y on x (with an intercept) and its interval; None with fewer than three
    points or no spread in x (nothing to fit, or nothing left to judge the fit by)."""
    n = len(x)
    if n < 3 or len(y) != n:
        return None
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((a - mx) ** 2 for a in x)
    if not sxx > 0:
        return None
    beta = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sxx
    residual = sum((b - my - beta * (a - mx)) ** 2 for a, b in zip(x, y, strict=True))
    half = t_quantile(0.5 + confidence / 2.0, n - 2) * math.sqrt(residual / (n - 2) / sxx)
    return Slope(beta, beta - half, beta + half, n - 2)


def holm(p_values: Sequence[float]) -> list[float]:
    """Holm's step-down adjusted p-values, in the order given: the i-th smallest p times
    (m - i), made non-decreasing, capped at 1 (Holm 1979). A figure is judged at level a
    when its adjusted p is below a; the family's chance of any false verdict stays <= a."""
    m = len(p_values)
    order = sorted(range(m), key=lambda i: p_values[i])
    adjusted = [1.0] * m
    running = 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (m - rank) * p_values[i]))
        adjusted[i] = running
    return adjusted


# --------------------------------------------------------------------------- run figures


@dataclass(frozen=True)
class RepeatSample:
    """One repeat's figure and, when recorded, the independent parts it was measured from.

    Each of `parts` is (output tokens, seconds) of one stretch of the repeat: a request, or
    a block of requests that were in flight together (they share every server step, so
    they are one sample of its speed, not several). The repeat's aggregate tok/s moves
    with the parts' rate, Σ tokens / Σ seconds, so the spread of the parts says how
    precisely the repeat measured it.
    """

    value: float
    parts: tuple[tuple[float, float], ...] = ()

    def relative_variance(self) -> float:
        """Variance of `value` relative to its square, from its parts: the ratio
        estimator's variance (Cochran, Sampling Techniques, 6.3); 0 with fewer than two."""
        n = len(self.parts)
        seconds = sum(s for _, s in self.parts)
        if n < 2 or not seconds > 0:
            return 0.0
        rate = sum(t for t, _ in self.parts) / seconds
        residual = sum((t - rate * s) ** 2 for t, s in self.parts) / (n - 1)
        return residual / (n * (seconds / n) ** 2) / rate**2


@dataclass(frozen=True)
class RunFigure:
    """A run's figure (the mean over its repeats) and how well its repeats pin it down."""

    mean: float
    relative_variance: float  # of `mean`, relative to mean²
    df: int  # degrees of freedom of that variance: repeats - 1

    @classmethod
    def of(cls, repeats: Sequence[RepeatSample]) -> RunFigure:
        """From at least MIN_REPEATS repeats with positive figures.

        A repeat's variance is taken as the larger of what the repeats' spread says and
        what the repeats' own parts say: two repeats can agree by chance more closely than
        their requests allow, and the parts cannot see what moved between repeats.
        """
        k = len(repeats)
        values = [r.value for r in repeats]
        if k < MIN_REPEATS or min(values) <= 0:
            raise ValueError(f"need {MIN_REPEATS} or more repeats with positive figures: {values}")
        mean = statistics.fmean(values)
        between = statistics.variance(values) / mean**2
        within = statistics.fmean(r.relative_variance() * (r.value / mean) ** 2 for r in repeats)
        return cls(mean, max(between, within) / k, k - 1)

    def estimate(self) -> MeanEstimate:
        """The figure as `ratio_interval` takes it: the variance of the mean, not relative."""
        return MeanEstimate(self.mean, self.relative_variance * self.mean**2, self.df, self.df + 1)


def change_interval(
    base: Sequence[RepeatSample],
    cand: Sequence[RepeatSample],
    confidence: float = CONFIDENCE,
) -> Interval | None:
    """Percent change of CAND's mean over repeats against BASE's: `ratio_interval` of the two
    runs' figures (see `RunFigure.of`); None when it is unbounded (a run's repeats too far
    apart to tell its mean from 0)."""
    return ratio_interval(RunFigure.of(base).estimate(), RunFigure.of(cand).estimate(), confidence)


# --------------------------------------------------------------------------- ratio of means


@dataclass(frozen=True)
class MeanEstimate:
    """A sample mean, the variance of that mean (s² / n) and its degrees of freedom."""

    mean: float
    variance: float
    df: float
    n: int

    @classmethod
    def of(cls, values: Sequence[float]) -> MeanEstimate:
        """From two or more values (the units of the experiment: server starts, blocks)."""
        n = len(values)
        if n < 2:
            raise ValueError(f"need 2 or more values for a mean and its variance: {list(values)}")
        return cls(statistics.fmean(values), statistics.variance(values) / n, n - 1, n)

    @property
    def relative_sd(self) -> float:
        """The values' sample standard deviation relative to their mean (the spread of one
        unit, not of the mean): sqrt(variance * n) / mean."""
        return math.sqrt(self.variance * self.n) / self.mean if self.mean else math.nan


def ratio_interval(
    base: MeanEstimate, cand: MeanEstimate, confidence: float = CONFIDENCE
) -> Interval | None:
    """Fieller's interval of cand.mean / base.mean, as a percent change (``+0.64%``).

    The set of ratios r for which ``cand.mean - r * base.mean`` is not significantly
    different from 0 (Fieller 1954): the roots of
    ``(c - r b)² = t² (v_c + r² v_b)``, with v the variances of the means and t Student's
    quantile at the Welch-Satterthwaite degrees of freedom of ``c - r b`` taken at the
    estimated ratio (Tamhane & Logan 2004). None when the interval is unbounded: the
    baseline's mean is itself not told from 0 at this confidence (t² v_b >= b²).
    """
    b, c = base.mean, cand.mean
    if not b > 0 or not c > 0:
        raise ValueError(f"ratio_interval needs positive means: base {b}, candidate {c}")
    ratio = c / b
    spread = cand.variance + ratio**2 * base.variance
    if spread > 0:
        df = spread**2 / (cand.variance**2 / cand.df + ratio**4 * base.variance**2 / base.df)
        t = t_quantile(0.5 + confidence / 2.0, df)
    else:  # every unit identical: the ratio is known exactly
        df, t = float(base.df + cand.df), 0.0
    a = b * b - t * t * base.variance
    if a <= 0:
        return None
    root = t * math.sqrt(cand.variance * a + c * c * base.variance)
    low, high = (b * c - root) / a, (b * c + root) / a
    # The p-value of a ratio of 1 with the df the bounds used: 1 lies outside the interval
    # at confidence 1 - a exactly when this is below a.
    p = _two_sided_p(c - b, math.sqrt(cand.variance + base.variance), df)
    return Interval(
        100.0 * (ratio - 1.0),
        100.0 * (low - 1.0),
        100.0 * (high - 1.0),
        confidence,
        f"Fieller, {df:.1f} df",
        df,
        p,
    )
