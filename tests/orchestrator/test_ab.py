"""orchestrator.analysis.ab and orchestrator.analysis.evidence: the verdict rule, the sampling units
(server starts, blocks), the figures and interval of each variant, the evidence chain, and the A/B
section of every report, on recorded A/B run directories (abrun.py)."""

from __future__ import annotations

import json
import statistics
import xml.etree.ElementTree as ET

import abrun
import pytest

from orchestrator.analysis.ab import BLOCKS, FASTER, SERVERS, SLOWER, ab_results, verdict
from orchestrator.analysis.evidence import BMM_ALONE, BMM_CAT, evidence_chain
from orchestrator.analysis.stats import TOO_FEW, Interval, MeanEstimate, ratio_interval
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


def test_no_interval_is_too_few_samples():
    assert verdict(None, True) == TOO_FEW


def _results(tmp_path, figures, **kw):
    return ab_results(Run.load(abrun.write_run(tmp_path, figures, **kw)))


def test_restarts_are_judged_over_server_starts(tmp_path):
    results = _results(tmp_path, abrun.restarts(STAGED, FUSED))
    assert [(r.metric.key, r.unit) for r in results] == [
        ("output_tok_s", SERVERS),
        ("tpot_p50_ms", SERVERS),
        ("tpot_mean_ms", SERVERS),
    ]
    tok, p50, _ = results
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


def test_switch_mode_is_judged_over_blocks(tmp_path):
    results = _results(tmp_path, abrun.switch(STAGED, FUSED), matrix=abrun.SWITCH)
    tok = results[0]
    assert tok.unit == BLOCKS
    assert tok.baseline.values == tuple(u[0] for u in STAGED)
    assert tok.verdict == FASTER


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
    assert "| glm5-h16/tp1-dcp1-mtp0 | ctx0 | output tok/s | 116.92 (sd" in md
    assert "Sampling unit: server starts, 4 per variant and topology" in md
    assert "they agree within the interval" in md
    assert "## Paired variants" not in md  # the one-server deltas are superseded
    data = json.loads((root / "report.json").read_text())
    assert [r["verdict"] for r in data["ab"]["results"]] == [FASTER, FASTER, FASTER]
    assert data["ab"]["results"][0]["unit"] == SERVERS
    assert data["ab"]["evidence"][0]["agrees"] is True
    props = {
        p.get("name"): p.get("value")
        for p in ET.parse(root / "junit.xml").getroot().iter("property")
    }
    key = "ab.glm5-h16/tp1-dcp1-mtp0.ctx0.output_tok_s.fused"
    assert props[key].startswith("fused/staged 1.00") and props[key].endswith(": faster")
    html = (root / "report.html").read_text()
    assert "A/B: fused vs staged, 95% interval over server starts" in html
    closing = render_summary(run)
    assert "A/B: fused vs staged, 95% interval over server starts" in closing
    assert "Evidence: glm5-h16/tp1-dcp1-mtp0 ctx0, TPOT mean" in closing
