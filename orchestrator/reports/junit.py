"""`junit.xml`: a run as JUnit XML, so CI dashboards (Jenkins, GitLab, GitHub) show each case.

One ``<testcase>`` per case of the matrix: classname is the topology (``model/tpX-dcpY-mtpZ``),
name is the case id. A case gets one ``<failure>`` when it failed (its reason), when its
audit has a fatal or quarantine-node finding, or, given a comparison, when it regressed;
the message names the first cause and the body lists them all. Several ``<failure>``
elements per test case would be clearer but the common JUnit schema (Jenkins' XSD) allows
one. Cases the run never reached (interrupted, ``--only``) are ``<skipped>``.

Every string is stripped of the characters XML 1.0 forbids (NUL and most C0 controls,
lone surrogates, U+FFFE/U+FFFF) before ElementTree escapes it: a log line can hold any byte,
and one bad character makes the whole file unparsable for the dashboard.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator.common.layout import JUNIT
from orchestrator.reports.measures import LATENCIES, fmt_ms, fmt_n, stat, totals
from orchestrator.results.recorded_run import Run, WorkloadDef, workload_defs
from orchestrator.results.rows import CaseResult
from orchestrator.results.store import write_text_atomic
from orchestrator.results.stored_audit import Finding

if TYPE_CHECKING:
    from orchestrator.analysis.compare import Comparison

# Dashboards show the message attribute in one line; the full text is in the element body.
MAX_MESSAGE_CHARS = 300

_XML_FORBIDDEN_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xml_text(value: Any) -> str:
    """`value` as a string XML 1.0 can carry (forbidden characters removed)."""
    return _XML_FORBIDDEN_RE.sub("", str(value))


def _finding_line(f: Finding) -> str:
    return f"{f.severity} finding {f.signature} at {f.location()}: {f.text}"


def _case_failures(row: CaseResult, comparison: Comparison | None) -> list[tuple[str, str]]:
    """(type, message) of every reason this case is red, the run's own verdict first."""
    out: list[tuple[str, str]] = []
    if not row.passed:
        out.append(("failed", f"case failed: {row.reason or 'no reason recorded'}"))
    out += [("fatal-finding", _finding_line(f)) for f in row.audit.case_breaking]
    if comparison is not None:
        out += [
            ("regression", r.message) for r in comparison.regressions if r.case_id == row.case_id
        ]
    return out


def _system_out(row: CaseResult, defs: dict[str, WorkloadDef]) -> str:
    # The figures in the test's output: dashboards show them next to the case, no other file
    # needed; each workload said with what it was and the samples its figures stand on.
    lines = []
    for name, w in row.workloads.items():
        d = defs.get(name)
        t = totals(w)
        means = ", ".join(
            f"{label} mean {fmt_ms(s.mean)} ms (n={fmt_n(s.n)})"
            for label, key, _ in LATENCIES
            if (s := stat(w, key)).mean is not None
        )
        done = "" if t is None else f"{t.successful} successful requests in {t.duration_s:.2f} s, "
        lines.append(
            f"{name}{f' ({d.describe()})' if d else ''}: {done}"
            f"aggregate {w.mean.aggregate_tok_s} tok/s, "
            f"active per-user {w.mean.per_user_tok_s} tok/s, errors {w.errors}"
            + (f"; {means}" if means else "")
        )
    return "\n".join(lines)


def _not_run(run: Run, case_id: str) -> str:
    """Why a case of the matrix has no result, as precisely as the run directory says."""
    figures = run.interrupted
    if figures is None:
        return "not run (run interrupted or case not selected)"
    cut = figures.get("cut_short") or {}
    during = " during this case" if cut.get("case_id") == case_id else ""
    return f"not run: the run was interrupted ({figures['interrupted']}){during}"


def _ab_properties(run: Run) -> list[tuple[str, str]]:
    """The A/B verdicts (orchestrator.analysis.ab) as suite properties: a dashboard shows them
    beside the run, and they are figures about variants, not a test a case passed or failed."""
    from orchestrator.analysis.ab import ab_results

    out = []
    for r in ab_results(run):
        key = f"ab.{r.topology_id}.{r.workload}.{r.metric.key}.{r.candidate.variant}"
        iv = r.judged
        bounds = "no interval" if iv is None else f"95% interval {iv.bounds()}"
        ratio = "-" if r.ratio is None else f"{r.ratio:.4f}"
        value = f"{r.candidate.variant}/{r.baseline.variant} {ratio}, {bounds} over {r.unit}"
        out.append((key, f"{value} ({r.role}): {r.verdict}"))
    return out


def render_junit(run: Run, comparison: Comparison | None = None) -> str:
    """The run (and, given one, its comparison's regressions) as a JUnit XML document."""
    m = run.manifest
    rows = {r.case_id: r for r in run.results}
    defs = {d.name: d for d in workload_defs(run)}
    suite = ET.Element("testsuite", name=xml_text(run.run_id))
    if m.created_at:
        suite.set("timestamp", xml_text(m.created_at))
    props = ET.SubElement(suite, "properties")
    for key, value in (
        ("matrix", m.matrix_name),
        ("matrix_path", m.matrix_path),
        ("commit", m.commit),
        *((f"version.{k}", v) for k, v in (m.versions or {}).items()),
        ("compared_with", comparison.base_run if comparison else None),
        *_ab_properties(run),
        ("interrupted", (run.interrupted or {}).get("interrupted")),
    ):
        if value is not None:
            ET.SubElement(props, "property", name=xml_text(key), value=xml_text(value))
    tests = failures = skipped = 0
    total_time = 0.0
    for case in m.cases:
        case_id = case["case_id"]
        tests += 1
        tc = ET.SubElement(
            suite,
            "testcase",
            classname=xml_text(case.get("topology_id", "")),
            name=xml_text(case_id),
        )
        row = rows.get(case_id)
        if row is None:
            skipped += 1
            ET.SubElement(tc, "skipped", message=_not_run(run, case_id))
            continue
        seconds = row.timings.get("total_s", 0.0)
        total_time += seconds
        tc.set("time", f"{seconds:.3f}")
        causes = _case_failures(row, comparison)
        if causes:
            failures += 1
            # The message is one line: a reason's first names its root cause when one is known.
            first = causes[0][1].partition("\n")[0]
            failure = ET.SubElement(
                tc,
                "failure",
                type=xml_text(",".join(dict.fromkeys(t for t, _ in causes))),
                message=xml_text(first[:MAX_MESSAGE_CHARS]),
            )
            failure.text = xml_text("\n".join(message for _, message in causes))
        out = _system_out(row, defs)
        if out:
            ET.SubElement(tc, "system-out").text = xml_text(out)
    root = ET.Element("testsuites", name="orchestrator")
    for el in (root, suite):
        el.set("tests", str(tests))
        el.set("failures", str(failures))
        el.set("errors", "0")
        el.set("skipped", str(skipped))
        el.set("time", f"{total_time:.3f}")
    root.append(suite)
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def write_junit(run: Run, comparison: Comparison | None = None) -> Path:
    """(Re)write junit.xml in the run directory and return its path."""
    path = run.root / JUNIT
    write_text_atomic(path, render_junit(run, comparison))
    return path
