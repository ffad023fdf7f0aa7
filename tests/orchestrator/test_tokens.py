"""Same tokens (orchestrator/client/tokens.py): the comparison rules, and the runner's glue that
holds a variant's recorded requests against its topology's first variant."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.client import tokens
from orchestrator.config.errors import MatrixError
from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix
from orchestrator.execution.measure import token_checks
from orchestrator.results.store import RunStore


def rec(index: int, ids: list[int], tops: list[dict] | None = None, **kw) -> dict:
    """A request record as workload.py writes it (after a JSON round trip: str keys)."""
    tops = tops if tops is not None else [{i: -1.0} for i in ids]
    r = {"repeat": 0, "index": index, "token_ids": ids, "top_logprobs": tops, "error": None}
    return json.loads(json.dumps(r | kw))


def test_identical_requests():
    check = tokens.compare([rec(0, [5, 6, 7]), rec(1, [9])], [rec(1, [9]), rec(0, [5, 6, 7])])
    assert (check["verdict"], check["identical"], check["requests"]) == ("identical", 2, 2)
    assert tokens.describe(check, reference="staged", variant="fused") == (
        "fused vs staged: identical token ids in 2/2 requests"
    )


def test_a_flip_between_near_equal_tokens_is_a_near_tie():
    # Position 1: staged picks 6 over 8 by 0.01 nats, fused picks 8 over 6 by 0.02.
    ref = rec(0, [5, 6, 3], [{5: -1.0}, {6: -2.00, 8: -2.01}, {3: -1.0}])
    got = rec(0, [5, 8, 4], [{5: -1.0}, {8: -2.00, 6: -2.02}, {4: -1.0}])
    check = tokens.compare([ref], [got])
    assert check["verdict"] == "near-tie" and check["ties"] == 1
    d = check["divergences"][0]
    assert (d["position"], d["reference_choice"], d["choice"], d["tie"]) == (1, 6, 8, True)
    assert d["reference_margin"] == pytest.approx(0.01) and d["margin"] == pytest.approx(0.02)
    assert "1 near-tie(s) within 0.05 nats" in tokens.describe(check, reference="a", variant="b")


@pytest.mark.parametrize(
    "got_tops",
    [
        [{5: -1.0}, {8: -0.5, 6: -3.0}],  # the fused run preferred 8 by 2.5 nats
        [{5: -1.0}, {8: -0.5}],  # the staged choice is not even in the fused run's top
    ],
)
def test_a_clear_change_differs_and_says_where(got_tops):
    ref = rec(0, [5, 6], [{5: -1.0}, {6: -2.0, 8: -2.01}])
    got = rec(0, [5, 8], got_tops)
    check = tokens.compare([rec(1, [1]), ref], [rec(1, [1]), got])
    assert check["verdict"] == "differs" and (check["identical"], check["differs"]) == (1, 1)
    sentence = tokens.describe(check, reference="staged", variant="fused")
    assert "request 0/0 parts at output token 1: staged 6, fused 8" in sentence, sentence
    assert "1 real difference(s)" in sentence


def test_a_tie_wider_than_the_recorded_top_is_a_bounded_near_tie():
    # Seen on the H200 (h200-heads, 11 heads, request 0/1, output token 39): three tokens tie
    # to 1e-5 in BF16; staged recorded two of them, fused chose the third.
    ref = rec(0, [1, 1416], [{1: -1.0}, {1416: -6.647697, 1525: -6.647697}])
    got = rec(0, [1, 382], [{1: -1.0}, {382: -6.647693, 1416: -6.647693}])
    check = tokens.compare([ref], [got])
    assert check["verdict"] == "near-tie", check
    d = check["divergences"][0]
    assert d["tie"] and d["reference_margin_bounded"] and "margin_bounded" not in d
    assert (d["reference_margin"], d["margin"]) == (0.0, 0.0)
    sentence = tokens.describe(check, reference="staged", variant="fused")
    assert "staged 1416, fused 382 (margins >= 0.000 nats (other's choice below its" in sentence


@pytest.mark.parametrize(
    ("ref_top", "got_top"),
    [
        # The staged run's recorded rivals lie 0.2 nats below its choice, and fused's choice
        # below them all: staged preferred its own by at least 0.2 -- a real change.
        ({6: -2.0, 7: -2.2}, {8: -2.0, 6: -2.0}),
        # Neither run recorded the other's choice: nothing measured the pair.
        ({6: -2.0, 7: -2.0}, {8: -2.0, 9: -2.0}),
    ],
)
def test_a_bound_beyond_the_tolerance_or_on_both_sides_differs(ref_top, got_top):
    ref = rec(0, [5, 6], [{5: -1.0}, ref_top])
    got = rec(0, [5, 8], [{5: -1.0}, got_top])
    assert tokens.compare([ref], [got])["verdict"] == "differs"


@pytest.mark.parametrize(
    ("got", "why"),
    [
        ([], "the compared run has no complete request here"),
        ([rec(0, [5], error="HTTP 500")], "the compared run has no complete request here"),
        ([rec(0, [5, 6, 7])], "lengths differ (2 vs 3 tokens)"),
        ([rec(0, [5, 6], token_ids=None)], "no token ids recorded"),
    ],
)
def test_missing_failed_or_short_requests_differ(got, why):
    check = tokens.compare([rec(0, [5, 6])], got)
    assert check["verdict"] == "differs"
    assert check["divergences"][0]["why"] == why
    assert why in tokens.describe(check, reference="a", variant="b")


MATRIX = """
name: t
models: [{label: m, path: /ckpt, num_heads: 16}]
resources: {accelerator: cpu}
topologies: [{tp: 1, mtp: [0]}]
workloads:
  - {name: ctx0, prompt_tokens: 1, output_tokens: 4, duration_s: 1}
  - {name: greedy, prompt_tokens: 8, output_tokens: 4, requests: 2, same_tokens: true}
variants: [{name: staged}, {name: fused}]
"""


def test_runner_holds_each_later_variant_against_the_first(tmp_path: Path):
    matrix = parse_matrix(MATRIX, "t.yaml", env={})
    staged, fused = expand(matrix)
    store = RunStore.create(tmp_path, "r")
    store.write_records(staged.slug, "greedy", [rec(0, [1, 2]), rec(1, [3, 4])])
    store.write_records(fused.slug, "greedy", [rec(0, [1, 2]), rec(1, [3, 5])])
    measured = {"ctx0": {}, "greedy": {}}
    assert token_checks(staged, matrix, store, measured) == {}, "the reference checks nothing"
    check = token_checks(fused, matrix, store, measured)["greedy"]
    assert check["verdict"] == "differs" and check["reference"] == staged.case_id
    assert "request 0/1 parts at output token 1: staged 4, fused 5" in check["sentence"]
    # A reference that recorded nothing (filtered out, or failed before this workload).
    other = RunStore.create(tmp_path, "r2")
    other.write_records(fused.slug, "greedy", [rec(0, [1, 2])])
    assert token_checks(fused, matrix, other, measured)["greedy"]["verdict"] == "no-reference"


SYNTHETIC = """
name: t
models: [{label: m, path: /ckpt, num_heads: 16}]
topologies: [{tp: 1, mtp: [0, 1], mtp_acceptance: 0.7}]
workloads:
  - {name: greedy, prompt_tokens: 8, output_tokens: 4, requests: 2, same_tokens: true}
variants: [{name: staged}, {name: fused}]
"""


@pytest.mark.parametrize(
    ("ab", "mtp", "reseeded", "verdict"),
    [
        ("{mode: switch}", 1, False, tokens.NOT_COMPARED),
        ("{mode: switch}", 1, True, tokens.DIFFERS),
        ("{mode: switch}", 0, False, tokens.DIFFERS),
        ("{mode: restarts}", 1, False, tokens.DIFFERS),
        ("{mode: restarts}", 0, False, tokens.DIFFERS),
    ],
)
def test_synthetic_acceptance_on_a_switch_server_is_compared_only_reseeded(
    tmp_path: Path, ab, mtp, reseeded, verdict
):
    """Synthetic acceptance draws at random: without a seed per round a switch server's
    blocks draw at different points of the GPU's stream, so their tokens are not compared;
    reseeded per round, MTP 0, and two servers started alike (restarts mode), they are."""
    matrix = parse_matrix(SYNTHETIC + f"ab: {ab}\n", "t.yaml", env={})
    staged, fused = (c for c in expand(matrix) if c.mtp == mtp and c.server == 1)
    store = RunStore.create(tmp_path, "r")
    store.write_records(staged.slug, "greedy", [rec(0, [1, 2]), rec(1, [3, 4])])
    store.write_records(fused.slug, "greedy", [rec(0, [1, 2]), rec(1, [3, 5])])
    check = token_checks(fused, matrix, store, {"greedy": {}}, reseeded=reseeded)["greedy"]
    assert check["verdict"] == verdict and check["reference"] == staged.case_id
    if verdict == tokens.NOT_COMPARED:
        assert check["why"] == tokens.SYNTHETIC_IN_SWITCH
        assert check["sentence"] == f"fused vs staged: not compared: {tokens.SYNTHETIC_IN_SWITCH}"
        assert "requests" not in check
        # Not compared even where the baseline recorded nothing.
        empty = RunStore.create(tmp_path, "r2")
        assert token_checks(fused, matrix, empty, {"greedy": {}})["greedy"] == check
    else:
        assert "why" not in check
        assert "request 0/1 parts at output token 1: staged 4, fused 5" in check["sentence"]


def test_not_compared_needs_mtp_synthetic_acceptance_and_a_switch_server():
    assert tokens.not_compared(mtp=1, mtp_acceptance=0.7, switch=True) == tokens.SYNTHETIC_IN_SWITCH
    assert tokens.not_compared(mtp=1, mtp_acceptance=0.7, switch=True, reseeded=True) is None
    assert tokens.not_compared(mtp=1, mtp_acceptance=0.7, switch=False) is None
    assert tokens.not_compared(mtp=1, mtp_acceptance=None, switch=True) is None
    assert tokens.not_compared(mtp=0, mtp_acceptance=None, switch=True) is None


@pytest.mark.parametrize(
    "workload",
    [
        "{name: g, prompt_tokens: 8, output_tokens: 4, duration_s: 5, same_tokens: true}",
        "{name: g, prompt_tokens: 8, output_tokens: 4, requests: 4, concurrency: 2, same_tokens: true}",
    ],
)
def test_same_tokens_needs_one_request_at_a_time_in_request_mode(workload):
    doc = MATRIX.split("workloads:")[0] + f"workloads: [{workload}]\n"
    with pytest.raises(MatrixError, match="same_tokens needs request mode"):
        parse_matrix(doc, "t.yaml", env={})


def test_a_check_survives_the_results_redaction():
    """Rows are redacted before they are stored; no key of a check may look like a secret
    (a first version named the chosen ids 'token' and stored '***')."""
    from orchestrator.common.redact import redact

    ref = rec(0, [5, 6], [{5: -1.0}, {6: -2.0, 8: -2.01}])
    got = rec(0, [5, 8], [{5: -1.0}, {8: -2.0, 6: -2.005}])
    check = tokens.compare([ref], [got])
    assert redact(check, ("secret",)) == check


def test_reports_list_every_check():
    """report.md and report.html carry each check's verdict and sentence (the committed H200
    run: a near-tie at MTP0, identical at MTP1)."""
    from orchestrator.reports.html import render_html
    from orchestrator.reports.markdown import render_markdown
    from orchestrator.results.recorded_run import Run

    store = Run.load(Path(__file__).parents[2] / "docs/validation/h200-2026-11-30/h200-1")
    md, page = render_markdown(store), render_html(store)
    for text in (md, page):
        assert "Same tokens (greedy, request by request)" in text
        assert "glm5-h16/tp1-dcp1-mtp1 greedy" in text and "identical token ids in 4/4" in text
    assert "**near-tie**" in md and "<b>near-tie</b>" in page
