"""orchestrator.stats: Student's t, the expanded percentile bootstrap and where an interval
lies against a bar (pure logic)."""

from __future__ import annotations

import math
import random

import pytest

from orchestrator.stats import (
    Interval,
    RepeatSample,
    bootstrap_change_pct,
    expanded_tail,
    sample_count,
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


def test_expanded_tail_reads_further_out_for_small_samples():
    assert expanded_tail(0.95, 8) == pytest.approx(0.00574, abs=1e-5)
    assert expanded_tail(0.95, 40) == pytest.approx(0.0203, abs=1e-4)
    assert expanded_tail(0.95, 100_000) == pytest.approx(0.025, abs=1e-4)


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


def test_bootstrap_is_deterministic_and_seeded():
    rng = random.Random(3)
    base, cand = _run(rng, 1.0), _run(rng, 0.9)
    first = bootstrap_change_pct(base, cand)
    assert bootstrap_change_pct(base, cand) == first
    other = bootstrap_change_pct(base, cand, seed=13)
    assert other != first and other.estimate == first.estimate
    assert abs(other.low - first.low) < 1.0 and abs(other.high - first.high) < 1.0
    assert first.method == "expanded percentile bootstrap, 2000 resamples, seed 12"
    assert first.low < first.estimate < first.high
    assert sample_count(base) == 24 and sample_count([RepeatSample(5.0)]) == 1


def test_repeats_without_parts_are_resampled_as_repeats():
    base = [RepeatSample(v) for v in (100.0, 101.0, 99.0, 100.5, 99.5, 100.2, 99.8, 100.0)]
    cand = [RepeatSample(v * 0.9) for v in (100.0, 101.0, 99.0, 100.5, 99.5, 100.2, 99.8, 100.0)]
    iv = bootstrap_change_pct(base, cand)
    assert iv.estimate == pytest.approx(-10.0)
    assert -11.5 < iv.low < -10.0 < iv.high < -8.5
    with pytest.raises(ValueError, match="at least one repeat"):
        bootstrap_change_pct([], cand)


def test_same_commit_pairs_are_not_flagged_and_a_large_drop_is():
    # 60 simulated pairs of runs (2 repeats x 12 requests, ±10 % per request, ±3 % per
    # repeat). Of same-commit pairs, none has its whole interval past -3 %; a 20 % drop
    # almost always does.
    rng = random.Random(11)
    same = [bootstrap_change_pct(_run(rng, 1.0), _run(rng, 1.0), resamples=1000) for _ in range(60)]
    drop = [bootstrap_change_pct(_run(rng, 1.0), _run(rng, 0.8), resamples=1000) for _ in range(60)]
    assert sum(iv.position(-3.0, math.inf) == "outside" for iv in same) == 0
    assert sum(iv.position(-3.0, math.inf) == "outside" for iv in drop) >= 57
    # Point figures alone would have called many of the same-commit pairs regressions.
    assert sum(iv.estimate < -3.0 for iv in same) >= 10
