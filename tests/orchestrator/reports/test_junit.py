"""junit.xml: parses with xml.etree, one test case per case, the right failure counts."""

from __future__ import annotations

import importlib.util
import xml.etree.ElementTree as ET
from pathlib import Path

from orchestrator.analysis.compare import compare_runs
from orchestrator.reports.junit import render_junit, write_junit, xml_text
from orchestrator.results.recorded_run import Run

_spec = importlib.util.spec_from_file_location(
    "recorded_runs", Path(__file__).parents[1] / "fixtures" / "runs" / "make_fixtures.py"
)
runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runs)

CASE = "Luke BF16/tp8-dcp2-mtp0/fused"
# Characters XML 1.0 forbids (NUL, ESC, form feed, U+FFFE) next to ones it must escape.
NASTY = "NUL\x00 ESC\x1b[31m FF\x0c BOM-ish\ufffe <script>alert(1)</script> & \"q\" 'a'"


def _parse(text: str) -> ET.Element:
    root = ET.fromstring(text.encode())
    assert root.tag == "testsuites"
    return root


def _counts(el: ET.Element) -> tuple[int, int, int, int]:
    return tuple(int(el.get(k)) for k in ("tests", "failures", "errors", "skipped"))


def test_clean_run_one_testcase_per_case(tmp_path):
    run = runs.copy_run(tmp_path, "r", created_at="2026-11-28T02:00:00+00:00")
    root = _parse(render_junit(Run.load(run)))
    [suite] = root.findall("testsuite")
    assert _counts(root) == _counts(suite) == (10, 0, 0, 0)
    cases = suite.findall("testcase")
    assert [(c.get("classname"), c.get("name")) for c in cases[:2]] == [
        ("Luke BF16/tp8-dcp1-mtp0", "Luke BF16/tp8-dcp1-mtp0/staged"),
        ("Luke BF16/tp8-dcp1-mtp0", "Luke BF16/tp8-dcp1-mtp0/fused"),
    ]
    out = cases[0].find("system-out").text
    # Each workload with what it is and the figures' samples (the seed rows kept no n).
    assert out.startswith(
        "ctx0 (prompt 1 token, output 512 tokens, concurrency 1, 120 s x 2 repeats): "
        "aggregate 86.32 tok/s"
    )
    assert "TTFT mean 41.5 ms (n=?)" in out
    props = {p.get("name"): p.get("value") for p in suite.iter("property")}
    assert props["matrix"] == "seed-tp8" and props["version.vllm"] == "0.32.0"


def test_failures_faults_and_forbidden_characters(tmp_path):
    run = runs.copy_run(tmp_path, "r", created_at="2026-11-28T02:00:00+00:00")
    finding = {**runs.XID_FINDING, "text": NASTY}

    def edit(r):
        if r["case_id"] == CASE:  # failed by the audit, as the runner does
            return runs.plant(r, finding, fail=True)
        if r["case_id"] == "Luke BF16/tp8-dcp4-mtp0/staged":  # server died, no finding
            r.update(status="failed", reason=f"server exited with 1: {NASTY}")
        if r["case_id"] == "Luke BF16/tp8-dcp8-mtp0/staged":  # fatal finding in a passed row
            runs.plant(r, runs.XID_FINDING)
        if r["case_id"].endswith("mtp3/fused"):
            return None  # never ran: the run was interrupted
        return r

    runs.edit_rows(run, edit)
    text = render_junit(Run.load(run))
    root = _parse(text)  # would raise on a forbidden character or a bad escape
    assert "\x00" not in text and "\x1b" not in text and "<script>" not in text
    assert _counts(root) == (10, 3, 0, 1)
    by_name = {c.get("name"): c for c in root.iter("testcase")}
    fail = by_name[CASE].find("failure")
    assert fail.get("type") == "failed,fatal-finding"
    assert fail.get("message").startswith("case failed: audit: xid (fatal)")
    assert xml_text(NASTY) in fail.text  # the text survives, minus what XML cannot carry
    assert "<script>alert(1)</script> & \"q\" 'a'" in fail.text
    passed_but_fatal = by_name["Luke BF16/tp8-dcp8-mtp0/staged"].find("failure")
    assert passed_but_fatal.get("type") == "fatal-finding"
    assert passed_but_fatal.get("message").startswith(
        "fatal finding xid at cases/x/server.log:2207"
    )
    assert by_name["Luke BF16/tp8-dcp4-mtp3/fused"].find("skipped") is not None
    assert by_name["Luke BF16/tp8-dcp1-mtp0/fused"].find("failure") is None


def test_regressions_from_a_comparison_are_failures(tmp_path):
    base = runs.copy_run(tmp_path, "base", created_at="2026-11-27T02:00:00+00:00")
    cand = runs.copy_run(tmp_path, "cand", created_at="2026-11-28T02:00:00+00:00")
    runs.edit_rows(cand, lambda r: runs.scale(r, "ctx0", 0.95) if r["case_id"] == CASE else r)
    cmp = compare_runs(base, cand)
    assert _counts(_parse(render_junit(Run.load(cand))))[1] == 0  # without it: all green
    path = write_junit(Run.load(cand), comparison=cmp)
    root = _parse(path.read_text())
    assert _counts(root) == (10, 1, 0, 0)
    [failed] = [c for c in root.iter("testcase") if c.find("failure") is not None]
    assert failed.get("name") == CASE
    assert failed.find("failure").get("type") == "regression"
    assert "ctx0 aggregate tok/s" in failed.find("failure").get("message")
    props = {p.get("name"): p.get("value") for p in root.iter("property")}
    assert props["compared_with"] == "base"
