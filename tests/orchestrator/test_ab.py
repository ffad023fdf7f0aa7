"""orchestrator.analysis.ab and orchestrator.analysis.evidence: the verdict rule, the sampling units
(server starts, blocks), the figures and interval of each variant, the evidence chain, and the A/B
section of every report, on recorded A/B run directories (abrun.py)."""

from __future__ import annotations

import json
import math
import statistics
import typing
import xml.etree.ElementTree as ET

import abrun
import pytest

from orchestrator.analysis.ab import (
    AB_METRICS,
    FASTER,
    PRIMARY,
    SECONDARY,
    SERVERS,
    SLOWER,
    ab_results,
    verdict,
)
from orchestrator.analysis.ab_design import design
from orchestrator.analysis.evidence import BMM_ALONE, BMM_CAT, evidence_chain
from orchestrator.analysis.paired import PAIRED_SERVERS, ROUNDS
from orchestrator.analysis.stats import TOO_FEW, Interval, MeanEstimate, ratio_interval
from orchestrator.config.schema import ABMetricKey
from orchestrator.reports import write_reports
from orchestrator.reports.summary import render_summary
from orchestrator.results.recorded_run import Run

# Four server starts per variant at the spread the H200 showed between servers (0.1-0.35 %),
# fused ~0.5 % faster: output tok/s, TPOT p50 and mean (ms).
STAGED = [
    (116.99, 8.530, 8.532),
    (116.86, 8.540, 8.541),
    (117.05, 8.527, 8.529),
    (116.80, 8.545, 8.547),
]
FUSED = [
    (117.73, 8.480, 8.483),
    (117.32, 8.501, 8.503),
    (117.61, 8.489, 8.490),
    (117.50, 8.494, 8.496),
]


def _iv(low: float, high: float) -> Interval:
    return Interval((low + high) / 2, low, high, 0.95, "test")


@pytest.mark.parametrize(
    ("low", "high", "higher_is_better", "expected"),
    [
        (0.31, 0.73, True, FASTER),  # tok/s up
        (-0.73, -0.31, True, SLOWER),  # tok/s down
        (-0.70, -0.40, False, FASTER),  # TPOT down
        (0.40, 0.70, False, SLOWER),  # TPOT up
        (-0.10, 0.32, True, "no change detectable at ±0.21%"),
        (-0.32, 0.10, False, "no change detectable at ±0.21%"),
        (0.0, 0.42, True, "no change detectable at ±0.21%"),  # touching 0 is not past it
    ],
)
def test_the_verdict_rule(low, high, higher_is_better, expected):
    assert verdict(_iv(low, high), higher_is_better) == expected


def test_the_matrix_names_the_figures_the_ab_judges():
    # ab.primary.metric is checked against the schema's list; the analysis reads AB_METRICS.
    assert tuple(m.key for m in AB_METRICS) == typing.get_args(ABMetricKey)


def test_no_interval_is_too_few_samples():
    assert verdict(None, True) == TOO_FEW


def test_a_secondary_figure_needs_its_holm_adjusted_p_value():
    iv = Interval(0.52, 0.31, 0.73, 0.95, "test", df=4, p_value=0.03)
    assert verdict(iv, True, holm_p=0.049) == FASTER
    assert verdict(iv, True, holm_p=0.08) == (
        "no change detectable at ±0.21% after Holm (p 0.030, adjusted 0.080)"
    )
    across = Interval(0.11, -0.10, 0.32, 0.95, "test", df=4, p_value=0.3)
    assert verdict(across, True, holm_p=0.6) == "no change detectable at ±0.21%"


def _results(tmp_path, figures, **kw):
    return ab_results(Run.load(abrun.write_run(tmp_path, figures, **kw)))


def test_restarts_are_judged_over_server_starts(tmp_path):
    results = _results(tmp_path, abrun.restarts(STAGED, FUSED))
    assert [(r.metric.key, r.unit) for r in results] == [
        ("output_tok_s", SERVERS),
        ("tpot_p50_ms", SERVERS),
        ("tpot_mean_ms", SERVERS),
        ("ttft_p50_ms", SERVERS),
    ]
    tok, p50, _, ttft = results
    # These rows carry no time to first token: nothing to judge, and the report says so.
    assert ttft.interval is None and ttft.verdict == TOO_FEW
    staged, fused = [u[0] for u in STAGED], [u[0] for u in FUSED]
    # One value per server start (its mean over its 3 repeats), in run order.
    assert tok.baseline.values == tuple(staged) and tok.candidate.values == tuple(fused)
    assert tok.baseline.mean == pytest.approx(statistics.fmean(staged))
    assert tok.baseline.spread_pct == pytest.approx(
        100 * statistics.stdev(staged) / statistics.fmean(staged)
    )
    assert tok.interval == ratio_interval(MeanEstimate.of(staged), MeanEstimate.of(fused))
    assert tok.interval.low > 0 and tok.verdict == FASTER
    assert tok.ratio == pytest.approx(statistics.fmean(fused) / statistics.fmean(staged))
    # TPOT is lower for fused: lower is better there.
    assert p50.interval.high < 0 and p50.verdict == FASTER
    assert tok.baseline.text() == f"116.92 (sd {tok.baseline.spread_pct:.2f}%, n 4)"


def test_indistinguishable_variants_say_what_could_have_been_seen(tmp_path):
    results = _results(tmp_path, abrun.restarts(STAGED, STAGED[1:] + STAGED[:1]))
    tok = results[0]
    assert tok.interval.low < 0 < tok.interval.high
    assert tok.verdict == f"no change detectable at ±{tok.interval.half_width:.2f}%"


def test_a_failed_server_start_is_left_out_and_counted(tmp_path):
    failed = {"glm5-h16/tp1-dcp1-mtp0/fused/s4": {"status": "failed", "reason": "boom"}}
    tok = _results(tmp_path, abrun.restarts(STAGED, FUSED), edit=failed)[0]
    assert tok.candidate.values == tuple(u[0] for u in FUSED[:3])
    assert tok.candidate.expected == 4 and "n 3 of 4" in tok.candidate.text()


def test_one_server_start_of_a_variant_is_too_few(tmp_path):
    figures = abrun.restarts(STAGED, FUSED[:1])
    tok = _results(tmp_path, figures)[0]
    assert tok.interval is None and tok.verdict == TOO_FEW
    assert tok.why == "fused: 1 server starts measured; 2 or more are needed"


# A switch server's four rounds (schedule A B B A B A A B): the server's speed moves by up to
# 1.2 % from round to round, as much as both variants' blocks overlap; within a round fused
# is 0.4 % faster (± 0.03 %). Output tok/s, TPOT p50 and mean of each block.
LEVELS = (1.000, 1.012, 0.994, 1.006)
NOISE = ((0.0003, -0.0001), (-0.0002, 0.0003), (0.0001, -0.0003), (-0.0003, 0.0002))


def _block(level: float, gain: float, noise: float) -> tuple[float, float, float]:
    speed = level * gain * (1 + noise)
    return (117.0 * speed, 8.53 / speed, 8.54 / speed)


SWITCH_STAGED = [_block(lv, 1.0, n[0]) for lv, n in zip(LEVELS, NOISE, strict=True)]
SWITCH_FUSED = [_block(lv, 1.004, n[1]) for lv, n in zip(LEVELS, NOISE, strict=True)]
T3_975 = 3.182446  # Student's t, 3 df, two-sided 95 % (printed tables)


def test_switch_mode_pairs_the_blocks_of_each_round(tmp_path):
    results = _results(tmp_path, abrun.switch(SWITCH_STAGED, SWITCH_FUSED), matrix=abrun.SWITCH)
    tok = results[0]
    assert tok.unit == ROUNDS
    staged, fused = [u[0] for u in SWITCH_STAGED], [u[0] for u in SWITCH_FUSED]
    assert tok.baseline.values == tuple(staged) and tok.pairs == tuple(
        zip(staged, fused, strict=True)
    )
    # Unpaired, the rounds' levels swamp the change: the blocks overlap, no verdict.
    unpaired = ratio_interval(MeanEstimate.of(staged), MeanEstimate.of(fused))
    assert min(fused) < max(staged) and unpaired.low < 0 < unpaired.high
    # Paired, by hand: the mean log ratio over the 4 rounds and t at 3 df.
    d = [math.log(f / s) for s, f in zip(staged, fused, strict=True)]
    mean, sd = statistics.fmean(d), statistics.stdev(d)
    half = T3_975 * sd / 2
    assert (tok.interval.estimate, tok.interval.low, tok.interval.high) == pytest.approx(
        tuple(100 * math.expm1(x) for x in (mean, mean - half, mean + half)), abs=1e-5
    )
    assert tok.ratio == pytest.approx(math.exp(mean))
    assert tok.interval.low > 0.3 and tok.interval.high < 0.5 and tok.verdict == FASTER
    assert tok.role == PRIMARY and tok.adjustment is None  # MTP 0: no acceptance to adjust for
    for tpot in results[1:3]:
        assert tpot.interval.high < 0 and tpot.role == SECONDARY


def test_a_slower_first_token_is_judged_beside_a_faster_decode(tmp_path):
    """A path faster per token but slower to its first (a step it runs outside CUDA
    graphs): the time to first token is a secondary figure of its own, judged over the same
    rounds, with no MTP adjustment (the first token comes before any draft)."""
    staged = [(*u, 38.0 * lv) for u, lv in zip(SWITCH_STAGED, LEVELS, strict=True)]
    fused = [(*u, 88.0 * lv) for u, lv in zip(SWITCH_FUSED, LEVELS, strict=True)]
    results = _results(tmp_path, abrun.switch(staged, fused), matrix=abrun.SWITCH)
    tok, ttft = results[0], results[3]
    assert tok.verdict == FASTER and tok.role == PRIMARY
    assert ttft.metric.key == "ttft_p50_ms" and ttft.role == SECONDARY and ttft.unit == ROUNDS
    assert ttft.ratio == pytest.approx(88.0 / 38.0)
    assert ttft.interval.low > 0 and ttft.holm_p < 0.05 and ttft.verdict == SLOWER


def test_two_switch_servers_are_two_pairs(tmp_path):
    # Each server serves both variants: its blocks' mean per variant is one pair.
    matrix = abrun.SWITCH.replace("blocks: 4}", "blocks: 2, servers: 2}")
    figures = {}
    for s, units in ((1, (0, 2)), (2, (1, 3))):
        figures[f"glm5-h16/tp1-dcp1-mtp0/staged/s{s}"] = [SWITCH_STAGED[u] for u in units]
        figures[f"glm5-h16/tp1-dcp1-mtp0/fused/s{s}"] = [SWITCH_FUSED[u] for u in units]
    run = Run.load(abrun.write_run(tmp_path, figures, matrix=matrix))
    tok = ab_results(run)[0]
    assert tok.unit == PAIRED_SERVERS
    means = {
        v: [statistics.fmean(u[0] for u in figures[f"glm5-h16/tp1-dcp1-mtp0/{v}/s{s}"])
            for s in (1, 2)]
        for v in ("staged", "fused")
    }  # fmt: skip
    assert tok.pairs == tuple(zip(means["staged"], means["fused"], strict=True))
    d = [math.log(f / b) for b, f in tok.pairs]
    half = 12.706205 * statistics.stdev(d) / math.sqrt(2)  # t at 1 df: tan(0.475 pi)
    mean = statistics.fmean(d)
    assert (tok.interval.low, tok.interval.high) == pytest.approx(
        (100 * math.expm1(mean - half), 100 * math.expm1(mean + half)), abs=1e-4
    )


def test_a_switch_round_without_both_blocks_is_no_pair(tmp_path):
    edit = {"glm5-h16/tp1-dcp1-mtp0/fused/s1": {"status": "failed", "reason": "boom"}}
    figures = abrun.switch(SWITCH_STAGED, SWITCH_FUSED)
    tok = _results(tmp_path, figures, matrix=abrun.SWITCH, edit=edit)[0]
    assert tok.interval is None and tok.verdict == TOO_FEW
    assert tok.why == "0 rounds with both variants measured; 2 or more are needed"


def test_a_switch_server_failed_in_its_profile_keeps_its_rounds(tmp_path):
    """The profile phase runs after every block: a server that fails there (the engine ended
    in a profiled step) still measured its rounds, which are judged; the report says so."""
    failed = {"status": "failed", "reason": "CUDA error: invalid argument\nprofile: HTTP 500"}
    edit = {
        f"glm5-h16/tp1-dcp1-mtp0/{v}/s1": {**failed, "failed_in": "profile"}
        for v in ("staged", "fused")
    }
    figures = abrun.switch(SWITCH_STAGED, SWITCH_FUSED)
    run = Run.load(abrun.write_run(tmp_path, figures, matrix=abrun.SWITCH, edit=edit))
    tok = ab_results(run)[0]
    clean = _results(tmp_path / "clean", figures, matrix=abrun.SWITCH)[0]
    assert tok.interval == clean.interval and tok.verdict == FASTER
    text = design(run)
    assert (
        "failed in its profile phase, after its measurements (CUDA error: invalid argument)" in text
    )
    assert text.count("failed in its profile phase") == 1  # one server, named once
    assert not any(r.passed for r in run.ordered)  # the case stays failed


def test_a_failure_before_the_profile_leaves_the_figures_out(tmp_path):
    # failed_in is None: the failure came during the measurements (or the audit found a fault
    # logged before the profile began), so nothing of the server is judged.
    edit = {"glm5-h16/tp1-dcp1-mtp0/fused/s1": {"status": "failed", "reason": "boom"}}
    figures = abrun.switch(SWITCH_STAGED, SWITCH_FUSED)
    run = Run.load(abrun.write_run(tmp_path, figures, matrix=abrun.SWITCH, edit=edit))
    assert ab_results(run)[0].verdict == TOO_FEW and "profile phase" not in design(run)


def test_a_server_start_failed_in_its_profile_is_one_more_unit(tmp_path):
    failed = {"status": "failed", "reason": "boom", "failed_in": "profile"}
    edit = {"glm5-h16/tp1-dcp1-mtp0/fused/s4": failed}
    tok = _results(tmp_path, abrun.restarts(STAGED, FUSED), edit=edit)[0]
    assert tok.candidate.values == tuple(u[0] for u in FUSED)


def test_a_run_without_ab_has_no_ab_results(tmp_path):
    plain = abrun.RESTARTS.replace("ab: {servers: 4}\n", "")
    root = abrun.write_run(tmp_path, {"glm5-h16/tp1-dcp1-mtp0/staged": STAGED}, matrix=plain)
    assert ab_results(Run.load(root)) == []


# --------------------------------------------------------------------------- evidence chain


def _profile(per_layer_us: float, path: str, *, concat: bool = False) -> dict:
    steps = 78 * 4
    query = {
        "path": path,
        "occurrences": steps,
        path: steps,
        "events": steps * (2 if concat else 1),
        "total_us": per_layer_us * steps,
    }
    trace = {"file": "profile/dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json.gz", "rank": 0}
    return {"decode_steps": 4, "layers": 78, "traces": [{**trace, "query": query}]}


def _profiled(staged_us: float, fused_us: float, *, concat: bool = False) -> dict:
    edit = {}
    for i in range(1, 5):
        edit[f"glm5-h16/tp1-dcp1-mtp0/staged/s{i}"] = {
            "profile": _profile(staged_us, "staged", concat=concat)
        }
        edit[f"glm5-h16/tp1-dcp1-mtp0/fused/s{i}"] = {"profile": _profile(fused_us, "fused")}
    return edit


def test_the_evidence_chain_sets_the_profile_beside_the_tpot_change(tmp_path):
    root = abrun.write_run(tmp_path, abrun.restarts(STAGED, FUSED), edit=_profiled(3.270, 2.736))
    run = Run.load(root)
    chain = evidence_chain(run, ab_results(run))
    assert [e.result.metric.key for e in chain] == ["tpot_mean_ms"]
    [mean] = chain
    assert mean.saving_per_layer_us == pytest.approx(-0.534)
    assert mean.predicted_us == pytest.approx(-0.534 * 78)  # -41.7 µs a step
    staged = statistics.fmean(u[2] for u in STAGED)
    fused = statistics.fmean(u[2] for u in FUSED)
    change, low, high = mean.measured_us
    assert change == pytest.approx((fused - staged) * 1000)  # -44.2 µs a token
    assert low < mean.predicted_us < high and mean.agrees is True
    assert mean.baseline.staged_form == BMM_ALONE
    text = mean.sentence()
    assert "3.270 → 2.736 µs per layer (-0.534 µs) × 78 query steps = -41.7 µs" in text
    assert "staged baseline in vLLM 0.26.0: the bmm alone (the attention backend takes" in text
    assert text.endswith("they agree within the interval.")


def test_a_chain_that_does_not_hold_says_so_and_names_bmm_plus_cat(tmp_path):
    # A per-layer saving 4x the real one predicts -167 µs: outside the measured interval.
    edit = _profiled(4.047, 1.911, concat=True)
    root = abrun.write_run(tmp_path, abrun.restarts(STAGED, FUSED), edit=edit)
    run = Run.load(root)
    chain = evidence_chain(run, ab_results(run))
    assert chain[0].agrees is False and chain[0].baseline.staged_form == BMM_CAT
    assert chain[0].sentence().endswith("they do NOT agree.")


# --------------------------------------------------------------------------- reports


def test_every_report_carries_the_ab(tmp_path):
    root = abrun.write_run(tmp_path, abrun.restarts(STAGED, FUSED), edit=_profiled(3.270, 2.736))
    from orchestrator.results.store import RunStore

    run = write_reports(RunStore(root))
    md = (root / "report.md").read_text()
    assert "## A/B: fused vs staged, 95% interval over server starts" in md
    assert "| glm5-h16/tp1-dcp1-mtp0 | ctx0 | output tok/s | primary | 116.92 (sd" in md
    assert "| 95% interval | ±h / 80% power | Verdict |" in md
    tok = ab_results(run)[0]
    assert f"| ±{tok.interval.half_width:.2f}% / {tok.detectable:.2f}% | faster |" in md
    assert "Sampling unit: server starts, 4 per variant and topology" in md
    assert "Primary figure: ctx0 output tok/s, judged at 95%; every other figure is" in md
    assert "they agree within the interval" in md
    assert "## Paired variants" not in md  # the one-server deltas are superseded
    data = json.loads((root / "report.json").read_text())
    assert [r["verdict"] for r in data["ab"]["results"]] == [FASTER, FASTER, FASTER, TOO_FEW]
    roles = [PRIMARY, SECONDARY, SECONDARY, SECONDARY]
    assert [r["role"] for r in data["ab"]["results"]] == roles
    assert data["ab"]["results"][0]["unit"] == SERVERS
    assert data["ab"]["primary"] == {"workload": "ctx0", "metric": "output_tok_s"}
    assert data["ab"]["results"][0]["detectable_pct"] == pytest.approx(tok.detectable)
    assert data["ab"]["evidence"][0]["agrees"] is True
    props = {
        p.get("name"): p.get("value")
        for p in ET.parse(root / "junit.xml").getroot().iter("property")
    }
    key = "ab.glm5-h16/tp1-dcp1-mtp0.ctx0.output_tok_s.fused"
    assert props[key].startswith("fused/staged 1.00") and props[key].endswith("(primary): faster")
    html = (root / "report.html").read_text()
    assert "A/B: fused vs staged, 95% interval over server starts" in html
    closing = render_summary(run)
    assert "A/B: fused vs staged, 95% interval over server starts" in closing
    assert "Evidence: glm5-h16/tp1-dcp1-mtp0 ctx0, TPOT mean" in closing


# --------------------------------------------------------------------------- primary, Holm


def test_one_figure_is_primary_and_the_others_are_holm_corrected(tmp_path):
    results = _results(tmp_path, abrun.restarts(STAGED, FUSED))
    assert [r.role for r in results] == [PRIMARY, SECONDARY, SECONDARY, SECONDARY]
    tok, p50, mean, ttft = results
    assert tok.holm_p is None and ttft.holm_p is None  # (no TTFT recorded: no p-value)
    # Holm over the two secondary figures: the smaller p doubled, the larger kept (or raised
    # to the first), each capped at 1.
    low, high = sorted([p50.interval.p_value, mean.interval.p_value])
    adjusted = sorted([p50.holm_p, mean.holm_p])
    assert adjusted == pytest.approx([min(1, 2 * low), max(min(1, 2 * low), high)])


def test_the_matrix_names_its_primary_figure(tmp_path):
    matrix = abrun.RESTARTS.replace(
        "ab: {servers: 4}", "ab: {servers: 4, primary: {workload: ctx0, metric: tpot_mean_ms}}"
    )
    results = _results(tmp_path, abrun.restarts(STAGED, FUSED), matrix=matrix)
    assert [(r.metric.key, r.role) for r in results] == [
        ("output_tok_s", SECONDARY),
        ("tpot_p50_ms", SECONDARY),
        ("tpot_mean_ms", PRIMARY),
        ("ttft_p50_ms", SECONDARY),
    ]


def test_the_report_prints_the_order_that_ran_and_its_drift_balance(tmp_path):
    from orchestrator.analysis.ab_design import design

    figures = abrun.switch(SWITCH_STAGED, SWITCH_FUSED)
    run = Run.load(abrun.write_run(tmp_path / "abba", figures, matrix=abrun.SWITCH))
    text = design(run)
    assert "Order that ran: ABBA BAAB (A staged, B fused): drift-balanced" in text
    assert "per round, the log of fused/staged; Student's t interval" in text
    alternate = abrun.SWITCH.replace("blocks: 4}", "blocks: 4, order: alternate}")
    run = Run.load(abrun.write_run(tmp_path / "alt", figures, matrix=alternate))
    assert (
        "Order that ran: ABAB ABAB (A staged, B fused): NOT drift-balanced: fused's blocks sit "
        "1.00 of a block later on average than staged's" in design(run)
    )


# --------------------------------------------------------------------------- MTP acceptance


def _mtp_block(tok: float, rate: float, share: float) -> dict:
    """One block of an MTP workload: its figures, and TTFT / end-to-end latency so that the
    block spent `share` of its time decoding."""
    return {
        "aggregate_tok_s": tok,
        "tpot_ms": {"p50": 1000 / tok, "mean": 1000 / tok},
        "ttft_ms": {"mean": 100 * (1 - share)},
        "e2el_ms": {"mean": 100.0},
        "_rate": rate,
    }


def _mtp_run(tmp_path, synthetic: bool = True) -> list:
    """A switch server at MTP 1 whose blocks drew acceptance 0.64-0.74: each block's tok/s is
    the path's speed x the acceptance length (1 + rate), scaled by the decode share 0.9; fused
    is 0.5 % faster at equal acceptance."""
    matrix = abrun.SWITCH.replace("num_heads: 16}]", "num_heads: 16, has_mtp: true}]").replace(
        "topologies: [{tp: 1}]", "topologies: [{tp: 1, mtp: [1]}]"
    )
    rates = {"staged": (0.70, 0.74, 0.66, 0.72), "fused": (0.68, 0.64, 0.73, 0.70)}
    gain = {"staged": 1.0, "fused": 1.005}
    edit = {}
    for variant in ("staged", "fused"):
        blocks = [
            _mtp_block(100 * gain[variant] * (1 + r) ** 0.9 * (1 + n), r, 0.9)
            for r, n in zip(rates[variant], (0.0002, -0.0002, 0.0001, -0.0001), strict=True)
        ]
        repeats = [{"repeat": i, **{k: v for k, v in b.items() if k != "_rate"}}
                   for i, b in enumerate(blocks, 1)]  # fmt: skip
        spec = {"drafts": 100, "draft_tokens": 100, "accepted_tokens": 70,
                "acceptance_rate": 0.7, "block_rates": [b["_rate"] for b in blocks],
                "configured_rates": [0.7] if synthetic else None}  # fmt: skip
        mean = {"aggregate_tok_s": statistics.fmean(b["aggregate_tok_s"] for b in blocks)}
        workload = {"name": "ctx0", "repeats": repeats, "mean": mean, "spec_decode": spec}
        edit[f"glm5-h16/tp1-dcp1-mtp1/{variant}/s1"] = {"workloads": {"ctx0": workload}}
    figures = {case: [(1.0, 1.0, 1.0)] for case in edit}
    return _results(tmp_path, figures, matrix=matrix, edit=edit), rates


def test_mtp_figures_are_judged_at_equal_synthetic_acceptance(tmp_path):
    results, rates = _mtp_run(tmp_path)
    tok = results[0]
    a = tok.adjustment
    assert a.synthetic and a.elasticity == pytest.approx(0.9)
    assert a.baseline_rate == pytest.approx(statistics.fmean(rates["staged"]))
    assert a.candidate_rate == pytest.approx(statistics.fmean(rates["fused"]))
    # By hand: each round's log ratio less 0.9 x log(L_fused / L_staged), t at 3 df.
    staged, fused = ([b for b, _ in tok.pairs], [c for _, c in tok.pairs])
    d = [
        math.log(c / b) - 0.9 * math.log((1 + rf) / (1 + rs))
        for b, c, rs, rf in zip(staged, fused, rates["staged"], rates["fused"], strict=True)
    ]
    mean, half = statistics.fmean(d), T3_975 * statistics.stdev(d) / 2
    assert (a.interval.estimate, a.interval.low, a.interval.high) == pytest.approx(
        tuple(100 * math.expm1(x) for x in (mean, mean - half, mean + half)), abs=1e-6
    )
    assert tok.judged is a.interval and tok.ratio == pytest.approx(math.exp(mean))
    assert a.interval.low > 0.4 and a.interval.high < 0.6 and tok.verdict == FASTER
    # As measured, the acceptance the blocks drew hides the change.
    assert tok.interval.low < 0 < tok.interval.high
    # The rounds' own fit of the elasticity finds the 0.9 they were made with.
    assert a.fitted.low < 0.9 < a.fitted.high
    # TPOT moves as 1 / L (elasticity -1), whatever the decode share.
    assert results[1].adjustment.elasticity == -1.0


def test_real_acceptance_is_reported_not_adjusted(tmp_path):
    results, _ = _mtp_run(tmp_path, synthetic=False)
    tok = results[0]
    assert tok.adjustment.interval is None and tok.judged is tok.interval
    assert tok.adjustment.why == "acceptance not synthetic: the path may change it, so it is kept"
    assert tok.adjustment.baseline_rate == pytest.approx(0.705)
