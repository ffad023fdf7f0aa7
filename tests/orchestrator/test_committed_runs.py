"""Every run committed to the repository still loads and renders with today's code.

The fixtures (older results.jsonl rows, from before schema_version and pooled latencies)
and the validation runs under docs/validation are the results a reader may rebuild with
`orchestrator report`; a change to the result model must not strand them.
"""

from __future__ import annotations

import json
import shutil
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from orchestrator.reports import write_reports
from orchestrator.store import RunStore, read_jsonl

REPO = Path(__file__).resolve().parents[2]
RUNS = sorted(
    p.parent
    for root in ("tests/orchestrator/fixtures/runs", "docs/validation")
    for p in (REPO / root).rglob("results.jsonl")
)


def test_the_committed_runs_are_found():
    names = {r.name for r in RUNS}
    assert {"seed-tp8", "cpu-noise-a1", "h200-1", "h200x2-dcp2"} <= names


@pytest.mark.parametrize("committed", RUNS, ids=[str(r.relative_to(REPO)) for r in RUNS])
def test_committed_run_renders_every_report(tmp_path: Path, committed: Path) -> None:
    run_dir = tmp_path / committed.name
    shutil.copytree(committed, run_dir)
    for old in ("report.md", "report.json", "report.html", "junit.xml"):
        (run_dir / old).unlink(missing_ok=True)
    rows = read_jsonl(committed / "results.jsonl")
    case_ids = {r["case_id"] for r in rows}

    write_reports(RunStore.read(run_dir))

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
