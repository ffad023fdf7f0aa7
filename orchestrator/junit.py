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

from orchestrator.compare import FATAL_SEVERITIES, finding_location
from orchestrator.store import RunStore, write_text_atomic

if TYPE_CHECKING:
    from orchestrator.compare import Comparison

JUNIT_NAME = "junit.xml"
# Dashboards show the message attribute in one line; the full text is in the element body.
MAX_MESSAGE_CHARS = 300

_XML_FORBIDDEN_RE = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ud800-\udfff\ufffe\uffff]")


def xml_text(value: Any) -> str:
    """`value` as a string XML 1.0 can carry (forbidden characters removed)."""
    return _XML_FORBIDDEN_RE.sub("", str(value))


def _fatal_findings(row: dict[str, Any]) -> list[dict[str, Any]]:
    return [
        f
        for f in (row.get("audit") or {}).get("findings", [])
        if f.get("severity") in FATAL_SEVERITIES
    ]


def _finding_line(f: dict[str, Any]) -> str:
    where = finding_location(f)
    return f"{f.get('severity')} finding {f.get('signature')} at {where}: {f.get('text', '')}"


def _case_failures(row: dict[str, Any], comparison: Comparison | None) -> list[tuple[str, str]]:
    """(type, message) of every reason this case is red, the run's own verdict first."""
    out: list[tuple[str, str]] = []
    if row.get("status") != "passed":
        out.append(("failed", f"case failed: {row.get('reason') or 'no reason recorded'}"))
    out += [("fatal-finding", _finding_line(f)) for f in _fatal_findings(row)]
    if comparison is not None:
        out += [
            ("regression", r.message) for r in comparison.regressions if r.case_id == row["case_id"]
        ]
    return out


def _system_out(row: dict[str, Any]) -> str:
    # Throughput in the test's output: dashboards show it next to the case, no other file needed.
    lines = []
    for name, w in (row.get("workloads") or {}).items():
        mean = w.get("mean", {})
        lines.append(
            f"{name}: aggregate {mean.get('aggregate_tok_s')} tok/s, "
            f"active per-user {mean.get('per_user_tok_s')} tok/s, errors {w.get('errors', 0)}"
        )
    return "\n".join(lines)


def render_junit(store: RunStore, comparison: Comparison | None = None) -> str:
    """The run (and, given one, its comparison's regressions) as a JUnit XML document."""
    manifest = store.manifest()
    rows = {r["case_id"]: r for r in store.results() if "case_id" in r}
    run_id = xml_text(manifest.get("run_id", store.run_id))
    suite = ET.Element("testsuite", name=run_id)
    if manifest.get("created_at"):
        suite.set("timestamp", xml_text(manifest["created_at"]))
    props = ET.SubElement(suite, "properties")
    versions = manifest.get("versions") or {}
    for key, value in (
        ("matrix", (manifest.get("matrix") or {}).get("name")),
        ("matrix_path", manifest.get("matrix_path")),
        ("commit", (manifest.get("git") or {}).get("commit")),
        *((f"version.{k}", v) for k, v in versions.items()),
        ("compared_with", comparison.base_run if comparison else None),
    ):
        if value is not None:
            ET.SubElement(props, "property", name=xml_text(key), value=xml_text(value))
    tests = failures = skipped = 0
    total_time = 0.0
    for case in manifest.get("cases", []):
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
            ET.SubElement(tc, "skipped", message="not run (run interrupted or case not selected)")
            continue
        seconds = float((row.get("timings") or {}).get("total_s", 0.0))
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
            failure.text = xml_text("\n".join(m for _, m in causes))
        out = _system_out(row)
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


def write_junit(store: RunStore, comparison: Comparison | None = None) -> Path:
    """(Re)write junit.xml in the run directory and return its path."""
    path = store.root / JUNIT_NAME
    write_text_atomic(path, render_junit(store, comparison))
    return path
