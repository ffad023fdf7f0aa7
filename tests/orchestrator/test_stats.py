"""orchestrator.analysis.stats: Student's t, the interval of a change between two runs' repeats,
Fieller's and the paired interval of a ratio, Holm's adjustment, the change 80 % power finds,
and where an interval lies against a bar (pure logic). Known answers come from closed forms
(Student's t at 1 and 2 df has one) or printed tables, not from the code under test."""

from __future__ import annotations

import math
import random

import pytest

from orchestrator.analysis.stats import (
    Interval,
    MeanEstimate,
    RepeatSample,
    RunFigure,
    change_interval,
    fitted_slope,
    holm,
    paired_ratio_interval,
    ratio_interval,
    t_cdf,
    t_interval,
    t_quantile,
)


def t2(p: float) -> float:
    """Student's t quantile at 2 df in closed form: (2p - 1) sqrt(2 / (4p(1 - p)))."""
    return (2 * p - 1) * math.sqrt(2 / (4 * p * (1 - p)))


def t1(p: float) -> float:
    """Student's t quantile at 1 df (the Cauchy): tan(pi (p - 1/2))."""
    return math.tan(math.pi * (p - 0.5))


@pytest.mark.parametrize(
    ("df", "t975"),
    # Printed tables of Student's t, two-sided 95 %.
    [(1, 12.706), (2, 4.303), (3, 3.182), (4, 2.776), (7, 2.365), (10, 2.228), (30, 2.042)],
)
def test_t_quantile_matches_the_tables(df, t975):
    assert t_quantile(0.975, df) == pytest.approx(t975, abs=5e-4)
    assert t_quantile(0.025, df) == pytest.approx(-t975, abs=5e-4)
    assert t_cdf(t975, df) == pytest.approx(0.975, abs=1e-4)


def test_t_quantile_tends_to_the_normal_and_rejects_nonsense():
    assert t_quantile(0.975, 1e6) == pytest.approx(1.95996, abs=1e-4)
    assert t_cdf(0.0, 5) == 0.5
    for p, df in ((0.0, 3), (1.0, 3), (0.9, 0)):
        with pytest.raises(ValueError, match="t_quantile"):
            t_quantile(p, df)


def test_t_interval_of_a_mean():
    iv = t_interval([1.0, 2.0, 3.0, 4.0, 5.0])
    # mean 3, sd 1.5811, se 0.7071, t(4) 2.7764
    assert (iv.estimate, iv.low, iv.high) == pytest.approx((3.0, 1.0368, 4.9632), abs=1e-4)
    assert iv.method == "t, 4 df" and iv.confidence == 0.95
    assert t_interval([2.0]) is None and t_interval([]) is None


@pytest.mark.parametrize(
    ("low", "high", "position"),
    [(-1.0, 2.0, "inside"), (-5.0, -4.0, "outside"), (4.0, 9.0, "outside"), (-4.0, 1.0, "across")],
)
def test_position_against_a_bar(low, high, position):
    assert Interval(0.0, low, high, 0.95, "t").position(-3.0, 3.0) == position


def test_one_sided_bar_for_a_drop():
    assert Interval(-5.0, -6.0, -4.0, 0.95, "x").position(-3.0, math.inf) == "outside"
    assert Interval(-2.0, -2.5, 9.0, 0.95, "x").position(-3.0, math.inf) == "inside"
    assert Interval(-3.0, -4.0, -2.0, 0.95, "x").position(-3.0, math.inf) == "across"
    assert (
        Interval(-3.0, -4.0, -2.0, 0.95, "x").describe() == "-3.00%, 95% interval -4.00% … -2.00%"
    )


def _run(rng: random.Random, level: float, *, repeats=2, requests=12, per_request=0.10):
    """One simulated run: each repeat ±3 % around `level`, each request ±`per_request`."""
    out = []
    for _ in range(repeats):
        rate = 200.0 * level * (1 + rng.gauss(0, 0.03))
        parts = tuple(
            (64.0, 64.0 / (rate * (1 + rng.gauss(0, per_request)))) for _ in range(requests)
        )
        out.append(RepeatSample(sum(t for t, _ in parts) / sum(s for _, s in parts), parts))
    return out


def test_a_repeats_parts_give_the_ratio_estimators_variance():
    # Four requests of 64 tokens taking 1.0, 1.2, 0.8 and 1.0 s: rate 64 tok/s; residuals
    # 0, -12.8, +12.8, 0 tok; variance 327.68 / 3 / (4 * 1.0**2) / 64**2 = 1/150.
    parts = tuple((64.0, s) for s in (1.0, 1.2, 0.8, 1.0))
    assert RepeatSample(64.0, parts).relative_variance() == pytest.approx(1 / 150)
    assert RepeatSample(64.0, parts[:1]).relative_variance() == 0.0
    assert RepeatSample(64.0).relative_variance() == 0.0


def test_run_figure_takes_the_larger_of_the_repeats_spread_and_their_parts():
    parts = tuple((64.0, s) for s in (1.0, 1.2, 0.8, 1.0))  # relative variance 1/150 each
    close = RunFigure.of([RepeatSample(64.0, parts), RepeatSample(64.0, parts)])
    assert (close.mean, close.relative_variance, close.df) == (64.0, pytest.approx(1 / 300), 1)
    apart = RunFigure.of([RepeatSample(50.0), RepeatSample(70.0)])
    assert apart.relative_variance == pytest.approx(200 / 60**2 / 2)
    for bad in ([RepeatSample(5.0)], [RepeatSample(5.0), RepeatSample(0.0)]):
        with pytest.raises(ValueError, match="2 or more repeats with positive figures"):
            RunFigure.of(bad)


def test_change_interval_of_identical_and_of_spread_repeats():
    same = [RepeatSample(100.0), RepeatSample(100.0)]
    iv = change_interval(same, [RepeatSample(90.0), RepeatSample(90.0)])
    assert (iv.estimate, iv.low, iv.high) == pytest.approx((-10.0, -10.0, -10.0))
    # Base 100 ± 1, candidate 90 ± 1 (two repeats each): each mean's variance s²/n = 2/2 = 1,
    # ratio 0.9. Welch-Satterthwaite at the ratio: (1 + 0.81)² / (1 + 0.81²) = 1.978 df.
    # Fieller: r = (b c ± t sqrt(v_c a + c² v_b)) / a with a = b² - t² v_b.
    iv = change_interval(
        [RepeatSample(99.0), RepeatSample(101.0)], [RepeatSample(89.0), RepeatSample(91.0)]
    )
    df = 1.81**2 / (1 + 0.81**2)
    t = t_quantile(0.975, df)
    a = 100.0**2 - t * t
    root = t * math.sqrt(a + 90.0**2)
    assert iv.estimate == pytest.approx(-10.0)
    assert iv.low == pytest.approx(100 * ((9000 - root) / a - 1))
    assert iv.high == pytest.approx(100 * ((9000 + root) / a - 1))
    assert iv.method == f"Fieller, {df:.1f} df"
    # Identical runs: the ratio is known exactly, and nothing speaks against "no change".
    iv = change_interval(same, same)
    assert (iv.estimate, iv.low, iv.high, iv.p_value) == (0.0, 0.0, 0.0, 1.0)
    # Two repeats 20 % apart at t(1) = 12.7: the base's mean cannot be told from 0, and
    # Fieller's set is unbounded; the gate reads that as too few samples.
    assert change_interval([RepeatSample(80.0), RepeatSample(120.0)], same) is None


def test_same_commit_pairs_are_not_flagged_and_a_large_drop_is():
    # 200 simulated pairs of runs (12 requests a repeat, ±10 % per request, ±3 % per
    # repeat). With 2 repeats no same-commit pair has its whole interval past -3 %, though
    # many move past -3 % on their means; with 4 repeats a 20 % drop is flagged every time.
    rng = random.Random(5)
    same = [change_interval(_run(rng, 1.0), _run(rng, 1.0)) for _ in range(200)]
    assert sum(iv.position(-3.0, math.inf) == "outside" for iv in same) == 0
    assert sum(iv.estimate < -3.0 for iv in same) >= 30
    four = [
        change_interval(_run(rng, 1.0, repeats=4), _run(rng, 1.0, repeats=4)) for _ in range(200)
    ]
    assert sum(iv.position(0.0, math.inf) == "outside" for iv in four) <= 10  # nominal 2.5 %
    drop = [
        change_interval(_run(rng, 1.0, repeats=4), _run(rng, 0.8, repeats=4)) for _ in range(200)
    ]
    assert sum(iv.position(-3.0, math.inf) == "outside" for iv in drop) >= 195


# --------------------------------------------------------------------------- Fieller


def test_fieller_by_hand_on_three_servers_each():
    # Base 98, 100, 102 and candidate 102, 100, 98: means 100, s² 4, variance of each mean
    # 4/3, ratio 1. Welch-Satterthwaite: (4/3 + 4/3)² / (2 (4/3)² / 2) = 4 df, t = 2.776445
    # (tables: 2.776). a = 100² - t² 4/3 = 9989.7218; root = t sqrt(4/3 a + 100² 4/3)
    # = 2.776445 x 163.2573 = 453.275; r = (10000 -/+ 453.275) / 9989.7218
    # = 0.955655 ... 1.046403: not symmetric about 1, as a ratio's interval should not be.
    iv = ratio_interval(
        MeanEstimate.of([98.0, 100.0, 102.0]), MeanEstimate.of([102.0, 100.0, 98.0])
    )
    assert iv is not None and iv.method == "Fieller, 4.0 df"
    assert (iv.estimate, iv.low, iv.high) == pytest.approx((0.0, -4.4345, 4.6403), abs=1e-3)
    assert iv.half_width == pytest.approx((4.6403 + 4.4345) / 2, abs=1e-3)


def test_fieller_bounds_are_where_the_ratio_t_statistic_reaches_the_quantile():
    # The definition, checked without the closed form: at each bound r the statistic
    # (c - r b) / sqrt(v_c + r² v_b) is -t and +t (t at the interval's degrees of freedom).
    base = MeanEstimate.of([116.99, 116.86, 117.05, 116.80])
    cand = MeanEstimate.of([117.73, 117.32, 117.61, 117.50])
    iv = ratio_interval(base, cand)
    df = float(iv.method.split()[1])
    ratio = cand.mean / base.mean
    spread = cand.variance + ratio**2 * base.variance
    exact_df = spread**2 / (cand.variance**2 / 3 + ratio**4 * base.variance**2 / 3)
    assert df == pytest.approx(exact_df, abs=0.05)
    t = t_quantile(0.975, exact_df)
    for pct, sign in ((iv.low, 1.0), (iv.high, -1.0)):
        r = 1 + pct / 100
        stat = (cand.mean - r * base.mean) / math.sqrt(cand.variance + r * r * base.variance)
        assert stat == pytest.approx(sign * t, rel=1e-9)


def test_fieller_matches_the_t_interval_of_log_means_at_small_spread():
    # At spreads like the H200's (0.1-0.35 % between servers) the two intervals the
    # literature offers for a ratio agree to a thousandth of a percent.
    base = [100.0 * (1 + 0.002 * d) for d in (-1.2, 0.3, 0.9, -0.4, 0.6, -0.2)]
    cand = [100.5 * (1 + 0.002 * d) for d in (0.8, -1.1, 0.2, 0.5, -0.6, 0.1)]
    fieller = ratio_interval(MeanEstimate.of(base), MeanEstimate.of(cand))
    lb, lc = (
        MeanEstimate.of([math.log(v) for v in base]),
        MeanEstimate.of([math.log(v) for v in cand]),
    )
    se = math.sqrt(lb.variance + lc.variance)
    df = se**4 / (lb.variance**2 / lb.df + lc.variance**2 / lc.df)
    half = t_quantile(0.975, df) * se
    diff = lc.mean - lb.mean
    assert fieller.low == pytest.approx(100 * math.expm1(diff - half), abs=1e-3)
    assert fieller.high == pytest.approx(100 * math.expm1(diff + half), abs=1e-3)


def test_fieller_degenerate_unbounded_and_bad_input():
    same = MeanEstimate.of([50.0, 50.0, 50.0])
    iv = ratio_interval(same, MeanEstimate.of([55.0, 55.0, 55.0]))
    assert (iv.estimate, iv.low, iv.high) == pytest.approx((10.0, 10.0, 10.0))
    # t(1) = 12.706 and a base mean 40 % uncertain: t² v_b > b², no bounded interval.
    assert ratio_interval(MeanEstimate.of([60.0, 140.0]), MeanEstimate.of([100.0, 101.0])) is None
    with pytest.raises(ValueError, match="positive means"):
        ratio_interval(MeanEstimate.of([0.0, 0.0]), same)
    with pytest.raises(ValueError, match="2 or more values"):
        MeanEstimate.of([1.0])
    assert MeanEstimate.of([99.0, 101.0]).relative_sd == pytest.approx(math.sqrt(2) / 100)


def test_fieller_p_value_says_what_the_interval_says():
    # The p-value of a ratio of 1 with the interval's df: 1 lies outside the 95 % interval
    # exactly when p < 0.05, and on its edge p is 0.05 (confidence 1 - p puts 1 on a bound).
    base = MeanEstimate.of([116.99, 116.86, 117.05, 116.80])
    for shift in (0.0, 0.05, 0.1, 0.2, 0.4, 0.8):
        cand = MeanEstimate.of([v + shift for v in (116.95, 116.90, 117.08, 116.77)])
        iv = ratio_interval(base, cand)
        assert (iv.p_value < 0.05) == (iv.low > 0 or iv.high < 0), shift
        if 0 < iv.p_value < 1:
            edge = ratio_interval(base, cand, confidence=1 - iv.p_value)
            assert min(abs(edge.low), abs(edge.high)) == pytest.approx(0.0, abs=1e-6)


# --------------------------------------------------------------------------- paired


def test_paired_interval_by_hand_on_three_rounds():
    # Rounds (base, candidate): the log ratios are worked out here, the t quantile from its
    # closed form at 2 df (4.302653), nothing from the code under test.
    base, cand = [100.0, 101.0, 99.5], [100.5, 101.3, 100.2]
    d = [math.log(c / b) for b, c in zip(base, cand, strict=True)]
    mean = sum(d) / 3
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / 2)
    half = t2(0.975) * sd / math.sqrt(3)
    iv = paired_ratio_interval(base, cand)
    assert iv.method == "paired t on log ratios, 2 df" and iv.df == 2
    assert iv.estimate == pytest.approx(100 * math.expm1(mean), rel=1e-12)
    assert iv.low == pytest.approx(100 * math.expm1(mean - half), rel=1e-9)
    assert iv.high == pytest.approx(100 * math.expm1(mean + half), rel=1e-9)
    # Written out: log ratios 0.0049875, 0.0029659, 0.0070105; mean 0.0049880, sd 0.0020223;
    # half-width 4.302653 x 0.0020223 / sqrt(3) = 0.0050236: +0.5000 % (-0.0036 % … +1.0062 %).
    assert (iv.estimate, iv.low, iv.high) == pytest.approx((0.5000, -0.0036, 1.0062), abs=1e-4)
    # Student's t at 2 df: P(|T| > t) = 1 - t / sqrt(2 + t²).
    t = mean / (sd / math.sqrt(3))
    assert iv.p_value == pytest.approx(1 - t / math.sqrt(2 + t * t), rel=1e-6)


def test_pairing_sees_through_what_a_round_shares():
    # The server drifts 1 % from round to round; the candidate is 0.5 % faster in every
    # round. Unpaired, the drift swamps the change; paired, the rounds agree exactly.
    base = [100.0, 101.0, 102.0, 103.0]
    cand = [b * 1.005 for b in base]
    iv = paired_ratio_interval(base, cand)
    assert (iv.estimate, iv.low, iv.high, iv.p_value) == pytest.approx((0.5, 0.5, 0.5, 0.0))
    unpaired = ratio_interval(MeanEstimate.of(base), MeanEstimate.of(cand))
    assert unpaired.low < 0 < unpaired.high
    assert paired_ratio_interval([100.0], [101.0]) is None
    with pytest.raises(ValueError, match="equal counts"):
        paired_ratio_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive figures"):
        paired_ratio_interval([1.0, 0.0], [1.0, 1.0])


def test_the_change_80_percent_power_finds():
    # At 2 df: (t(0.975) + t(0.8)) / t(0.975) = (4.302653 + 1.060660) / 4.302653 = 1.2465
    # times the half-width; at large df it tends to (1.960 + 0.842) / 1.960 = 1.4294.
    iv = Interval(0.3, -0.2, 0.8, 0.95, "x", df=2)
    assert iv.detectable() == pytest.approx((t2(0.975) + t2(0.8)) / t2(0.975) * 0.5, rel=1e-6)
    assert iv.detectable() == pytest.approx(0.5 * 1.24651, abs=1e-5)
    wide = Interval(0.3, -0.2, 0.8, 0.95, "x", df=1e6)
    assert wide.detectable() == pytest.approx(0.5 * (1.959964 + 0.841621) / 1.959964, rel=1e-5)
    assert Interval(0.3, -0.2, 0.8, 0.95, "x").detectable() is None  # no df: not a t interval


def test_holm_by_hand():
    # Sorted: 0.005 x 4 = 0.02, 0.01 x 3 = 0.03, 0.03 x 2 = 0.06, 0.04 x 1 = 0.04 -> 0.06
    # (never below the one before); back in the order given.
    assert holm([0.01, 0.04, 0.03, 0.005]) == pytest.approx([0.03, 0.06, 0.06, 0.02])
    assert holm([0.5, 0.9]) == pytest.approx([1.0, 1.0])  # capped at 1
    assert holm([0.02]) == [0.02] and holm([]) == []


def test_fitted_slope_by_hand():
    # y on x = 0, 1, 2: y = 1, 3, 2. Slope 0.5, residuals -0.5, 1, -0.5: s² = 1.5 / 1,
    # se = sqrt(1.5 / 2), t(0.975, 1 df) = tan(0.475 pi) = 12.7062.
    fit = fitted_slope([0.0, 1.0, 2.0], [1.0, 3.0, 2.0])
    half = t1(0.975) * math.sqrt(1.5 / 2)
    assert (fit.estimate, fit.low, fit.high, fit.df) == pytest.approx(
        (0.5, 0.5 - half, 0.5 + half, 1)
    )
    assert fitted_slope([0.0, 1.0], [1.0, 2.0]) is None  # nothing left to judge the fit by
    assert fitted_slope([1.0, 1.0, 1.0], [1.0, 2.0, 3.0]) is None  # no spread in x
