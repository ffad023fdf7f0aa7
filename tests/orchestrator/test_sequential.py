"""The sequential stopping rule of a switch-mode A/B (orchestrator.analysis.sequential): its
looks and their level against closed forms of Student's t (1 and 2 df), the decision, the
schedule's balance as it is extended, the loop that runs it
(orchestrator.execution.switch) without vLLM, and the reports that recompute its looks from
the stored rows."""

from __future__ import annotations

import json
import math
import types

import pytest

from orchestrator.analysis.ab import ab_results
from orchestrator.analysis.ab_design import design, server_stops
from orchestrator.analysis.paired import drift_offset
from orchestrator.analysis.sequential import CAP, TARGET, StoppingRule
from orchestrator.client.workload import WorkloadParams, WorkloadResult
from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix
from orchestrator.execution import switch
from orchestrator.execution.case_run import CaseRun
from orchestrator.plan.estimate import estimate_run
from orchestrator.plan.render import plan_matrix
from orchestrator.plan.units import run_units, schedule
from orchestrator.reports import write_reports
from orchestrator.reports.ab_section import ab_json
from orchestrator.results.recorded_run import Run
from orchestrator.results.rows import PathFlip
from orchestrator.results.store import RunStore
from orchestrator.results.stored_audit import AuditSummary


def t1(p: float) -> float:
    """Student's t quantile at 1 df, in closed form (the Cauchy): tan(pi (p - 1/2))."""
    return math.tan(math.pi * (p - 0.5))


def t2(p: float) -> float:
    """Student's t quantile at 2 df, in closed form: (2p - 1) sqrt(2 / (4 p (1 - p)))."""
    return (2 * p - 1) * math.sqrt(2 / (4 * p * (1 - p)))


def pct(x: float) -> float:
    return 100 * math.expm1(x)


def test_the_looks_are_fixed_in_advance_and_each_pays_its_share_of_5_percent():
    rule = StoppingRule(first=4, cap=16, target_pct=0.25)
    assert rule.looks == (4, 6, 8, 10, 12, 14, 16)
    assert rule.confidence == pytest.approx(1 - 0.05 / 7)
    assert rule.method == "at 99.29% per look, Bonferroni over 7 looks"
    # One look: the rule is the fixed-size design, at 95 %.
    assert StoppingRule(first=8, cap=8, target_pct=1).confidence == pytest.approx(0.95)


def test_a_look_s_interval_is_the_paired_t_at_the_per_look_level():
    # Two looks: each at 97.5 %, so t at 1 - 0.025 / 2 = 0.9875. Three rounds whose log
    # ratios are 0.01, 0.02, 0.03: mean 0.02, sd 0.01, 2 df.
    rule = StoppingRule(first=2, cap=4, target_pct=1)
    pairs = [(k, 100.0, 100.0 * math.exp(d)) for k, d in enumerate((0.01, 0.02, 0.03))]
    iv = rule.interval(pairs)
    assert iv is not None
    half = t2(0.9875) * 0.01 / math.sqrt(3)  # 6.2053 x 0.005774 = 0.035826
    assert half == pytest.approx(0.035826, abs=1e-6)
    assert (iv.low, iv.high) == (pytest.approx(pct(0.02 - half)), pytest.approx(pct(0.02 + half)))
    assert iv.confidence == pytest.approx(0.975) and iv.df == 2
    # Fewer than two rounds, or a figure of 0, bound nothing.
    assert rule.interval(pairs[:1]) is None
    assert rule.interval([(0, 100.0, 0.0), (1, 100.0, 101.0)]) is None


def _two_round_width(a: float, b: float, p: float) -> float:
    """The % half-width of two rounds with log ratios a and b at the t quantile p (1 df):
    their sd is |a - b| / sqrt 2, its standard error |a - b| / 2."""
    m, h = (a + b) / 2, t1(p) * abs(a - b) / 2
    return (pct(m + h) - pct(m - h)) / 2


def test_the_rule_stops_once_every_candidate_is_within_the_target():
    rule = StoppingRule(first=2, cap=6, target_pct=1.0)  # 3 looks: t at 1 - 0.05 / 6
    p = 1 - 0.05 / 3 / 2
    # Round log ratios: 0.010 and 0.012 for fast, 0.0 and 0.0005 for same (t = 38.19).
    width_fast = _two_round_width(0.010, 0.012, p)
    width_same = _two_round_width(0.0, 0.0005, p)
    assert width_same < 1.0 < width_fast  # 0.95 % and 3.86 %: fast is not there yet
    pairs = {
        "fast": [(0, 100.0, 100 * math.exp(0.010)), (1, 100.0, 100 * math.exp(0.012))],
        "same": [(0, 100.0, 100.0), (1, 100.0, 100 * math.exp(0.0005))],
    }
    look = rule.look(2, pairs)
    assert look.half_widths["fast"] == pytest.approx(width_fast)
    assert look.half_widths["same"] == pytest.approx(width_same)
    assert not look.reached and not rule.stops(look)
    # Without fast, the same look stops the run.
    alone = rule.look(2, {"same": pairs["same"]})
    assert alone.reached and rule.stops(alone)
    assert rule.why_stopped([alone], 2) == TARGET
    # A look reads only the rounds before it; the cap stops the run whatever the width.
    late = {"fast": [*pairs["fast"], (2, 100.0, 150.0), (3, 100.0, 60.0)]}
    assert rule.look(2, late).half_widths == {"fast": pytest.approx(width_fast)}
    last = rule.look(6, late)
    assert not last.reached and rule.stops(last)
    assert [x.rounds for x in rule.history(6, late)] == [2, 4, 6]
    assert rule.why_stopped(rule.history(6, late), 6) == CAP
    # A candidate whose rounds bound nothing never reaches the target.
    assert not rule.look(2, {"x": pairs["fast"][:1]}).reached
    assert rule.why_stopped(rule.history(3, late), 3).startswith("ended after 3 rounds")


@pytest.mark.parametrize("first", ["baseline", "candidate"])
@pytest.mark.parametrize("variants", [["staged", "fused"], ["staged", "fused", "other"]])
def test_every_look_of_an_extended_schedule_is_drift_balanced(variants, first):
    """The worst-case schedule is planned once; the run stops at a look, and every look's
    prefix is the schedule of that many rounds (the next Thue-Morse pair appended) with each
    variant's blocks at the same mean position."""
    rule = StoppingRule(first=2, cap=16, target_pct=1)
    whole = schedule(variants, rule.cap, "abba", first)
    for rounds in rule.looks:
        prefix = whole[: rounds * len(variants)]
        assert prefix == schedule(variants, rounds, "abba", first)
        for cand in variants[1:]:
            assert drift_offset(prefix, variants[0], cand) == pytest.approx(0.0)


MATRIX = """\
name: seq
models: [{label: m, path: /models/m, num_heads: 16}]
topologies: [{tp: 1}]
workloads: [{name: ctx0, prompt_tokens: 1, output_tokens: 64, requests: 4}]
variants: [{name: staged}, {name: fused}]
warmup_requests: 0
ab: {mode: switch, blocks: 2, max_blocks: 6, target_half_width_pct: 5.0}
"""


def test_plan_shows_the_rule_and_estimates_its_worst_case(tmp_path):
    path = tmp_path / "seq.yaml"
    path.write_text(MATRIX)
    note = next(n for n in plan_matrix(path)["notes"] if "Stopping rule" in n)
    assert "after 2, 4, 6 rounds" in note and "within ±5%" in note
    assert "Bonferroni over 3 looks" in note and "worst case, 6 blocks per variant" in note
    # The estimate measures the worst case: three times the two rounds of `blocks`.
    ruled = parse_matrix(MATRIX, "seq.yaml")
    plain = parse_matrix(MATRIX.replace(", max_blocks: 6, target_half_width_pct: 5.0", ""), "p")
    work = [estimate_run(x, expand(x)).cases[0].workloads_s["ctx0"] for x in (plain, ruled)]
    assert work[1] == pytest.approx(3 * work[0]) and work[0] > 0


def _block(tok_s: float, repeat: int) -> WorkloadResult:
    """A measured block of ctx0 whose output tok/s is `tok_s`."""
    params = WorkloadParams("ctx0", 1, 64, requests=4)
    return WorkloadResult(params, [{"repeat": repeat, "aggregate_tok_s": tok_s}], [])


# Per round, fused's log ratio against staged: rounds 0-1 far apart (a wide interval), then
# rounds that agree, so the look after 4 rounds is within 5 % (about ±3 %, from ±57 %).
LOGS = [0.0, 0.03, 0.015, 0.015, 0.015, 0.015]


def _measured_server(tmp_path, monkeypatch, logs=LOGS):
    """A switch server of MATRIX measured by the real loop, with the flip and the workload
    scripted (no vLLM): staged runs 100 tok/s every block, fused 100 exp(LOGS[round])."""
    m = parse_matrix(MATRIX, "seq.yaml")
    cases = expand(m)
    (unit,) = run_units(m, cases, cases)
    blocks = switch.SwitchBlocks(unit, m)
    lines: list[str] = []
    store = RunStore.create(tmp_path, "r")
    progress = types.SimpleNamespace(update=lambda *a, **k: None)
    run = CaseRun(unit, blocks, m, None, store, lines.append, progress)
    run.handle = types.SimpleNamespace(base_url="http://127.0.0.1:9")

    def flip(engine, url, path, *, block, **_):
        return PathFlip(block=block, path=path, seconds=0.0, workers=[{"path": path}])

    def measured(run, wl, vocab, key, *, slug, first_repeat, **_):
        fused = "fused" in slug
        return _block(100.0 * math.exp(logs[first_repeat]) if fused else 100.0, first_repeat + 1)

    monkeypatch.setattr(switch, "flip", flip)
    monkeypatch.setattr(switch, "run_measured", measured)
    blocks.measure(run, "/models/m", 1000, None)
    return m, store, run, blocks, lines


def test_the_loop_stops_at_the_first_look_within_the_target(tmp_path, monkeypatch):
    _, _, run, blocks, lines = _measured_server(tmp_path, monkeypatch)
    assert len(blocks.blocks) == 8  # 4 rounds of the planned 6
    assert blocks.blocks == schedule(["staged", "fused"], 4, "abba", "baseline")
    looks = [x for x in lines if ": look " in x]
    assert len(looks) == 2, lines
    assert "look 1 of 3 after 2 rounds: fused ±" in looks[0] and looks[0].endswith("2 more rounds")
    assert "look 2 of 3 after 4 rounds" in looks[1] and looks[1].endswith("stop, target reached")
    # The rows hold what ran: four blocks a variant, and the schedule that ran.
    rows = blocks.rows(run, run.result(AuditSummary(), {}))
    for row in rows:
        assert row.switch.schedule == blocks.blocks and len(row.switch.blocks) == 4
        assert len(row.workloads["ctx0"].repeats) == 4


def test_the_loop_runs_to_the_cap_when_the_target_is_not_reached(tmp_path, monkeypatch):
    wild = [0.0, 0.1, -0.1, 0.1, -0.1, 0.1]
    *_, blocks, lines = _measured_server(tmp_path, monkeypatch, logs=wild)
    assert len(blocks.blocks) == 12
    assert [x.rsplit(": ", 1)[1] for x in lines if ": look " in x] == [
        "2 more rounds",
        "2 more rounds",
        "stop, cap reached",
    ]


def test_the_reports_recompute_the_looks_from_the_stored_rows(tmp_path, monkeypatch):
    """A finished server's rows are the record: the looks, why it stopped and the adjusted
    interval are recomputed from them (a resumed run reads the same rows)."""
    m, store, run, blocks, lines = _measured_server(tmp_path, monkeypatch)
    store.write_manifest(
        {
            "run_id": "r",
            "created_at": "2026-12-06T10:00:00+00:00",
            "matrix_path": "seq.yaml",
            "matrix": m.model_dump(mode="json"),
            "cases": [c.to_dict() for c in expand(m)],
        }
    )
    for row in blocks.rows(run, run.result(AuditSummary(), {})):
        store.append_result(row)
    recorded = Run.load(store.root)
    (stop,) = server_stops(recorded)
    assert (stop.rounds, stop.why, [x.rounds for x in stop.looks]) == (4, TARGET, [2, 4])
    rule = StoppingRule(first=2, cap=6, target_pct=5.0)
    # The loop's looks, as it logged them, are the reports'.
    for look, line in zip(stop.looks, [x for x in lines if ": look " in x], strict=True):
        assert f"fused ±{look.half_widths['fused']:.3f}%" in line
    (primary,) = [r for r in ab_results(recorded) if r.role == "primary"]
    iv = primary.judged
    assert (
        iv.confidence == pytest.approx(rule.confidence) and "Bonferroni over 3 looks" in iv.method
    )
    # The adjusted interval is the last look's: the four rounds that ran, at 98.33 %.
    last = rule.interval([(k, 100.0, 100 * math.exp(d)) for k, d in enumerate(LOGS[:4])])
    assert (iv.low, iv.high, iv.df) == (pytest.approx(last.low), pytest.approx(last.high), 3)
    assert last.half_width == pytest.approx(stop.looks[-1].half_widths["fused"])
    said = design(recorded)
    assert "Stopping rule: looks after 2, 4, 6 rounds" in said
    assert "stopped after 4 rounds, target reached; adjusted interval fused" in said
    stopping = ab_json(recorded)["stopping"]
    assert stopping["looks_planned"] == [2, 4, 6]
    assert stopping["servers"][0]["stopped"] == TARGET
    assert [x["rounds"] for x in stopping["servers"][0]["looks"]] == [2, 4]
    write_reports(RunStore.read(store.root))
    assert "stopped after 4 rounds, target reached" in (store.root / "report.md").read_text()
    report = json.loads((store.root / "report.json").read_text())
    assert report["ab"]["stopping"]["look_confidence"] == pytest.approx(1 - 0.05 / 3)
