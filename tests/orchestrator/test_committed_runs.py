"""Every run committed to the repository still loads and renders with today's code, to the
same figures.

The fixtures (older results.jsonl rows, from before schema_version and pooled latencies)
and the validation runs under docs/validation are the results a reader may rebuild with
`orchestrator report`; a change to the result model must not strand them, and a change to
how a figure is derived must not silently change what a committed run says. Where the
committed report.json (rendered by the code of its day) exists, the re-rendered one must
give every case the same status, reason, audit verdict, same-token verdicts, tok/s (each
repeat), spread and latency quantiles (TTFT, TPOT, ITL), the same paired deltas and audit
summary, and the same A/B section. The A/B runs' reports were re-rendered on 2026-12-06, when
a switch-mode A/B began to pair its rounds (the verdicts they first gave are kept in
docs/validation/ab-first-verdicts.jsonl; test_committed_ab.py recomputes both from the rows).
Every run's figures must also be the means of its results.jsonl rows, and report.md must
show them.
"""

from __future__ import annotations

import json
import math
import shutil
import statistics
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from orchestrator.reports import write_reports
from orchestrator.reports.measures import PERCENTILES, min_samples
from orchestrator.reports.run import fmt_tok
from orchestrator.results.store import RunStore, read_jsonl

REPO = Path(__file__).resolve().parents[2]
RUNS = sorted(
    p.parent
    for root in ("tests/orchestrator/fixtures/runs", "docs/validation")
    for p in (REPO / root).rglob("results.jsonl")
)


def test_the_committed_runs_are_found():
    names = {r.name for r in RUNS}
    assert {"seed-tp8", "cpu-noise-a1", "h200-1", "h200x2-dcp2"} <= names


def _rerender(tmp_path: Path, committed: Path) -> Path:
    run_dir = tmp_path / committed.name
    shutil.copytree(committed, run_dir)
    for old in ("report.md", "report.json", "report.html", "junit.xml"):
        (run_dir / old).unlink(missing_ok=True)
    write_reports(RunStore.read(run_dir))
    return run_dir


def _withheld(key: str, new: dict) -> bool:
    """A percentile the report now withholds because it stands on too few samples (shown
    from 1/(1-q) on: orchestrator.reports.measures), the value itself unchanged in the rows."""
    n = new.get("n")
    return (
        key in PERCENTILES and new.get(key) is None and isinstance(n, int) and n < min_samples(key)
    )


def _differences(old: object, new: object, where: str) -> list[str]:
    """Where ``new`` differs from ``old`` (keys ``old`` lacks are new figures, not changes);
    floats to 1e-9 relative."""
    if isinstance(old, dict):
        if not isinstance(new, dict):
            return [f"{where}: {old!r} became {new!r}"]
        return [
            d
            for k, v in old.items()
            if not _withheld(k, new)
            for d in (
                _differences(v, new[k], f"{where}.{k}") if k in new else [f"{where}.{k}: gone"]
            )
        ]
    if isinstance(old, list):
        if not isinstance(new, list) or len(new) != len(old):
            return [f"{where}: {old!r} became {new!r}"]
        return [
            d
            for i, (a, b) in enumerate(zip(old, new, strict=True))
            for d in _differences(a, b, f"{where}[{i}]")
        ]
    if isinstance(old, float) and isinstance(new, int | float) and not isinstance(new, bool):
        return (
            []
            if math.isclose(old, new, rel_tol=1e-9, abs_tol=1e-12)
            else [f"{where}: {old} became {new}"]
        )
    return [] if old == new else [f"{where}: {old!r} became {new!r}"]


CASE_FIGURES = ("status", "reason", "errors", "audit_verdict", "same_tokens", "workloads")
RUN_FIGURES = ("cases_total", "cases_finished", "cases_failed", "paired", "audit_summary", "ab")
WITH_REPORT = [r for r in RUNS if (r / "report.json").is_file()]


def test_most_committed_runs_have_their_report_of_the_day():
    # The figure comparison below must not pass for want of reports to compare with.
    assert len(WITH_REPORT) >= 10


@pytest.mark.parametrize(
    "committed", WITH_REPORT, ids=[str(r.relative_to(REPO)) for r in WITH_REPORT]
)
def test_committed_run_rerenders_to_the_same_figures(tmp_path: Path, committed: Path) -> None:
    old = json.loads((committed / "report.json").read_text())
    new = json.loads((_rerender(tmp_path, committed) / "report.json").read_text())
    new_cases = {c["case_id"]: c for c in new["cases"]}
    changed = []
    for case in old["cases"]:
        mine = new_cases.get(case["case_id"])
        if mine is None:
            changed.append(f"{case['case_id']}: gone")
            continue
        for key in CASE_FIGURES:
            if key in case:
                changed += _differences(case[key], mine.get(key), f"{case['case_id']}.{key}")
    for key in RUN_FIGURES:
        if key in old:
            changed += _differences(old[key], new.get(key), key)
    assert not changed, "\n".join(changed[:20])


@pytest.mark.parametrize("committed", RUNS, ids=[str(r.relative_to(REPO)) for r in RUNS])
def test_committed_run_figures_are_its_results(tmp_path: Path, committed: Path) -> None:
    """Independently of the reports' code: each case's tok/s is the mean of its stored
    repeats, its status and audit verdict are the stored ones, and report.md shows the tok/s."""
    run_dir = _rerender(tmp_path, committed)
    report = {c["case_id"]: c for c in json.loads((run_dir / "report.json").read_text())["cases"]}
    md = (run_dir / "report.md").read_text()
    rows = {r["case_id"]: r for r in read_jsonl(committed / "results.jsonl")}  # latest wins
    checked = 0
    for case_id, row in rows.items():
        case = report[case_id]
        assert case["status"] == row["status"]
        if row.get("audit"):
            assert case["audit_verdict"] == row["audit"]["verdict"]["status"]
        for name, w in (row.get("workloads") or {}).items():
            reps = [
                r["aggregate_tok_s"] for r in w.get("repeats") or [] if r.get("aggregate_tok_s")
            ]
            if not reps:
                continue
            figure = case["workloads"][name]["aggregate_tok_s"]
            assert math.isclose(figure, statistics.fmean(reps), rel_tol=1e-9), (case_id, name)
            assert fmt_tok(figure) in md, f"{case_id} {name}: {fmt_tok(figure)} not in report.md"
            checked += 1
    assert checked or not any(r.get("workloads") for r in rows.values())


@pytest.mark.parametrize("committed", RUNS, ids=[str(r.relative_to(REPO)) for r in RUNS])
def test_committed_run_renders_every_report(tmp_path: Path, committed: Path) -> None:
    rows = read_jsonl(committed / "results.jsonl")
    case_ids = {r["case_id"] for r in rows}
    run_dir = _rerender(tmp_path, committed)

    md = (run_dir / "report.md").read_text()
    for case_id in case_ids:
        topology = case_id.rsplit("/", 1)[0]
        assert topology.split("/")[0] in md, f"{case_id} is missing from report.md"
    report = json.loads((run_dir / "report.json").read_text())
    assert case_ids <= {c["case_id"] for c in report["cases"]}
    junit = ET.parse(run_dir / "junit.xml").getroot()
    # Every case of the matrix is a test case; those with a result among them.
    assert case_ids <= {t.get("name") for t in junit.iter("testcase")}
    if (committed / "junit.xml").exists():  # rendered by the code of its day: same verdicts
        assert _verdicts(run_dir / "junit.xml") == _verdicts(committed / "junit.xml")
    html = (run_dir / "report.html").read_text()
    HTMLParser().feed(html)  # well-formed enough to parse
    assert html.startswith("<!DOCTYPE html>") and html.rstrip().endswith("</html>")


def _verdicts(path: Path) -> list[tuple]:
    """What a junit.xml says of each case (not the figures' wording in system-out, which
    says more today): suite counts, then each test's name, class and red or skipped cause."""
    root = ET.parse(path).getroot()
    out: list[tuple] = [tuple(root.get(k) for k in ("tests", "failures", "errors", "skipped"))]
    for tc in root.iter("testcase"):
        bad = tc.find("failure")
        skip = tc.find("skipped")
        out.append(
            (
                tc.get("classname"),
                tc.get("name"),
                None if bad is None else (bad.get("type"), bad.get("message")),
                None if skip is None else skip.get("message"),
            )
        )
    return out
