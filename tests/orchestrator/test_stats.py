"""orchestrator.stats: Student's t, the interval of a change between two runs' repeats and
where an interval lies against a bar (pure logic)."""

from __future__ import annotations

import math
import random

import pytest

from orchestrator.stats import (
    Interval,
    RepeatSample,
    RunFigure,
    change_interval,
    t_cdf,
    t_interval,
    t_quantile,
)


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
    # Base 100 ± 1, candidate 90 ± 1 (two repeats each): log ratio -0.1054, its standard
    # error sqrt(2e-4/2/100**2... ) -> Welch with 2 df, t 4.303.
    iv = change_interval(
        [RepeatSample(99.0), RepeatSample(101.0)], [RepeatSample(89.0), RepeatSample(91.0)]
    )
    se = math.sqrt(2 / 100**2 / 2 + 2 / 90**2 / 2)
    df = se**4 / ((2 / 100**2 / 2) ** 2 + (2 / 90**2 / 2) ** 2)
    half = t_quantile(0.975, df) * se
    assert iv.estimate == pytest.approx(-10.0)
    assert iv.low == pytest.approx(100 * math.expm1(math.log(0.9) - half))
    assert iv.high == pytest.approx(100 * math.expm1(math.log(0.9) + half))
    assert iv.method == f"Welch t of the log ratio, {df:.1f} df"
    assert change_interval(same, same) == change_interval(same, same)  # no seed, no state


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
