"""tests/lanes.py: the units xdist hands out (a module, or the modules SHARED keeps together),
their order (longest first), and each lane's core (pure logic)."""

from __future__ import annotations

import os
import types
from pathlib import Path

import lanes
import pytest

REPO = Path(__file__).resolve().parents[1]


def test_every_shared_module_exists():
    for unit, modules in lanes.SHARED.items():
        for module in modules:
            assert (REPO / module).is_file(), f"{unit}: {module}"


def test_a_test_belongs_to_its_module_or_the_unit_its_module_shares():
    assert lanes.scope_of("tests/orchestrator/test_faults.py::test_x") == "leftovers"
    assert lanes.scope_of("tests/orchestrator/test_cluster.py::test_y[1]") == "leftovers"
    assert lanes.scope_of("tests/fusedq/test_api.py::TestA::test_b") == "tests/fusedq/test_api.py"


def test_units_run_longest_first_each_in_pytests_order(tmp_path, monkeypatch):
    times = tmp_path / "times.json"
    times.write_text(
        '{"modules_s": {"tests/a/test_short.py": 5, "tests/orchestrator/test_faults.py": 100,'
        ' "tests/orchestrator/test_cluster.py": 150, "tests/a/test_long.py": 200}}'
    )
    monkeypatch.setattr(lanes, "TIMES", times)
    ids = [
        "tests/a/test_short.py::t1",
        "tests/orchestrator/test_cluster.py::c1",
        "tests/a/test_new.py::n1",  # not in the reference: after every known unit
        "tests/orchestrator/test_faults.py::f1",
        "tests/a/test_long.py::l1",
        "tests/orchestrator/test_cluster.py::c2",
        "tests/a/test_short.py::t2",
    ]
    items = [types.SimpleNamespace(nodeid=i) for i in ids]
    lanes.plan(items)
    assert [i.nodeid.split("::")[1] for i in items] == ["c1", "f1", "c2", "l1", "t1", "t2", "n1"]


def test_each_lane_binds_its_own_core():
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        pytest.skip("one CPU: no lanes")
    lane = {"PYTEST_XDIST_WORKER": "gw1", "PYTEST_XDIST_WORKER_COUNT": "2"}
    assert lanes.lane_core(lane) == str(cpus[1])
    assert lanes.lane_core({**lane, "PYTEST_XDIST_WORKER": "gw0"}) == str(cpus[0])
    assert lanes.lane_core({}) is None  # no xdist
    assert lanes.lane_core({**lane, "PYTEST_XDIST_WORKER_COUNT": "1"}) is None
