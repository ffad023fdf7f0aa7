"""scripts/test_times.py: a JUnit XML as a table per module (set-up, call, teardown, count), the
budget on the suite's wall time, and the modules named when it is overrun (pure logic)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("times_script", REPO / "scripts" / "test_times.py")
times = importlib.util.module_from_spec(_spec)
sys.modules["times_script"] = times  # its dataclasses look their module up there
_spec.loader.exec_module(times)

# Two modules as pytest writes them with tests/conftest.py's phase properties; a class-based
# test; one test without properties (another runner's file) in a third module.
JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" errors="0" failures="1" skipped="0" tests="5" time="400.0">
<testcase classname="tests.orchestrator.test_cluster" name="test_a" time="300.5">
 <properties><property name="setup_s" value="299.000"/><property name="call_s" value="1.000"/>
 <property name="teardown_s" value="0.500"/></properties></testcase>
<testcase classname="tests.orchestrator.test_cluster" name="test_b" time="2.0">
 <properties><property name="setup_s" value="0.000"/><property name="call_s" value="2.000"/>
 <property name="teardown_s" value="0.000"/></properties><failure message="x"/></testcase>
<testcase classname="tests.fusedq.test_api.TestShapes" name="test_c" time="50.0">
 <properties><property name="setup_s" value="0.000"/><property name="call_s" value="50.000"/>
 <property name="teardown_s" value="0.000"/></properties></testcase>
<testcase classname="tests.fusedq.test_api" name="test_d" time="10.0">
 <properties><property name="setup_s" value="1.000"/><property name="call_s" value="9.000"/>
 <property name="teardown_s" value="0.000"/></properties></testcase>
<testcase classname="tests.docs.test_links" name="test_e" time="7.0"/>
</testsuite></testsuites>
"""


@pytest.fixture
def junit(tmp_path: Path) -> Path:
    path = tmp_path / "junit.xml"
    path.write_text(JUNIT)
    return path


def test_modules_sum_their_tests_phases_and_a_class_counts_with_its_module(junit: Path):
    suite = times.read(junit)
    assert suite.wall_s == 400.0
    cluster, api, docs = (
        suite.modules[m]
        for m in ("tests/orchestrator/test_cluster.py", "tests/fusedq/test_api.py",
                  "tests/docs/test_links.py")
    )  # fmt: skip
    assert (cluster.tests, cluster.failed, cluster.total_s) == (2, 1, 302.5)
    assert cluster.phases == pytest.approx({"setup": 299.0, "call": 3.0, "teardown": 0.5})
    assert (api.tests, api.phases["setup"], api.phases["call"]) == (2, 1.0, 59.0)
    assert not docs.split and docs.total_s == 7.0


def test_the_table_is_slowest_first_and_says_what_it_cannot_split(junit: Path):
    lines = times.table(times.read(junit)).splitlines()
    assert lines[0] == "| Module | Tests | Setup s | Call s | Teardown s | Total s |"
    assert (
        lines[2]
        == "| tests/orchestrator/test_cluster.py | 2 (1 failed) | 299.0 | 3.0 | 0.5 | 302.5 |"
    )
    assert lines[4] == "| tests/docs/test_links.py | 1 | - | - | - | 7.0 |"
    assert lines[-1] == (
        "5 tests in 3 modules: 370 s of test time (set-up 300 s), 400 s of wall time (6.7 min)"
    )


def test_within_budget_exits_0_and_over_it_exits_1_naming_what_grew(junit, tmp_path, capsys):
    reference = tmp_path / "ref.json"
    reference.write_text(json.dumps({"modules_s": {
        "tests/orchestrator/test_cluster.py": 200.0,  # +102 s, +51 %: grew
        "tests/fusedq/test_api.py": 50.0,  # +10 s: noise
    }}))  # fmt: skip
    args = [str(junit), "--reference", str(reference)]
    assert times.main([*args, "--budget-min", "7"]) == 0
    assert times.main([*args, "--budget-min", "6"]) == 1
    err = capsys.readouterr().err
    assert "the suite took 6.7 min, over its budget of 6 min" in err
    assert "tests/orchestrator/test_cluster.py: 200 s -> 302 s (+102 s)" in err
    assert "test_api" not in err and "test_links" not in err  # new, but 7 s is no growth


def test_write_records_each_modules_seconds_for_the_next_comparison(junit, tmp_path):
    out = tmp_path / "times.json"
    assert times.main([str(junit), "--write", str(out), "--reference", str(out)]) == 0
    data = json.loads(out.read_text())
    assert data["wall_s"] == 400.0
    assert data["modules_s"]["tests/orchestrator/test_cluster.py"] == 302.5
    assert not list(tmp_path.glob("*.tmp"))


def test_a_file_that_is_no_junit_is_named(tmp_path: Path):
    bad = tmp_path / "junit.xml"
    bad.write_text("<html>")
    with pytest.raises(SystemExit, match=r"junit.xml: not a readable JUnit XML"):
        times.read(bad)
