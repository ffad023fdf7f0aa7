"""The reports of a run: sibling renderers fed one ``Run`` (orchestrator.reports.run).

- ``markdown``: report.md, the seeds' topology tables for a release note (and ``md_table``,
  the one way this project writes a Markdown table);
- ``json_report``: report.json, the same figures for machines;
- ``html``: report.html, the page a person reads in the morning (charts, trend, findings);
- ``junit``: junit.xml, each case as a test for CI dashboards;
- ``summary``: the closing table `orchestrator run` prints, and the latency table the
  others show;
- ``ab_section``: an A/B matrix's verdicts with their intervals and the evidence chain
  (orchestrator.analysis.ab, orchestrator.analysis.evidence), which every report above shows.

Input is only the run directory (manifest, results.jsonl, overhead.json), so `orchestrator
report RUN` rebuilds the reports of any run, finished, interrupted or resumed.
"""

from __future__ import annotations

from typing import Any

from orchestrator.common.layout import OVERHEAD, REPORT_JSON, REPORT_MD
from orchestrator.results.recorded_run import Overhead, Run
from orchestrator.results.store import RunStore, write_json_atomic, write_text_atomic


def write_reports(
    store: RunStore, overhead: dict[str, Any] | None = None, *, resume: bool = False
) -> Run:
    """(Re)write report.md, report.json, report.html and junit.xml of a run directory.

    `overhead`, when given, is this attempt's figures: the run's own, or with `resume` one
    more resume's, kept beside the original run's and never in its place (overhead.json).
    Without it the saved figures are shown as they are.
    """
    # Imported here: html brings Jinja2, which `orchestrator compare` (a user of md_table)
    # does not need.
    from orchestrator.reports.html import write_html
    from orchestrator.reports.json_report import render_json
    from orchestrator.reports.junit import write_junit
    from orchestrator.reports.markdown import render_markdown

    if overhead is not None:
        saved = store.root / OVERHEAD
        figures = Overhead.load(saved)
        if resume:
            figures.resumes.append(overhead)
        else:
            figures = Overhead(overhead)
        write_json_atomic(saved, figures.to_dict())
    run = Run.load(store)
    write_text_atomic(store.root / REPORT_MD, render_markdown(run))
    write_json_atomic(store.root / REPORT_JSON, render_json(run))
    write_html(run)
    write_junit(run)
    return run
