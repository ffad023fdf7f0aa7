"""How the suite shares a machine's cores: two lanes (pytest-xdist workers), each test module
whole on one lane, the longest first, each lane's servers on a core of their own.

`make test` runs ``pytest -n 2``; tests/conftest.py hands xdist the scheduler below.

- A module is one unit of work (``scope_of``): its servers (its module-scoped fixtures)
  start once, on one lane.
- ``SHARED`` makes one unit of several modules that must not run side by side: the scenarios
  that leave processes of a killed orchestrator behind, or stop such leftovers with
  ``--kill-leftovers``, share one lane (a leftover of one is a leftover to the other, and
  test_leftovers plants some of its own); and the two modules that read the recorded
  real-server runs of tests/fusedq/conftest.py run where those servers were started.
- Units are handed out longest first (the committed tests/test_times.json), so the short
  modules fill both lanes at the end instead of one long scenario running alone.
- Each lane's TP1 servers bind their worker to the lane's own core
  (``VLLM_CPU_OMP_THREADS_BIND``): vLLM's ``auto`` binding puts every TP1 worker on core 0,
  and two lanes' decodes would share it while the other core idles. TP2 servers bind both
  cores themselves (the smoke matrix, the plugin's TP2 server).

Without xdist (``pytest tests/...`` by hand) none of this applies and the order is pytest's.
Why and what it measured: docs/decisions/0017-two-test-lanes.md.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
TIMES = HERE / "test_times.json"

SHARED: dict[str, tuple[str, ...]] = {
    "leftovers": (
        "tests/orchestrator/test_faults.py",
        "tests/orchestrator/test_cluster.py",
        "tests/orchestrator/test_leftovers.py",
    ),
    "recorded-servers": (
        "tests/fusedq/test_vllm_plugin.py",
        "tests/fusedq/test_vllm_worker_ext.py",
    ),
}
_UNIT_OF = {module: unit for unit, modules in SHARED.items() for module in modules}


def scope_of(nodeid: str) -> str:
    """The unit of work a test belongs to: its module, or the SHARED unit its module is in."""
    module = nodeid.split("::", 1)[0]
    return _UNIT_OF.get(module, module)


def reference_seconds(path: Path | None = None) -> dict[str, float]:
    """Each module's seconds in the accepted run tests/test_times.json records (empty if none)."""
    try:
        return json.loads((path or TIMES).read_text())["modules_s"]
    except (OSError, ValueError, KeyError):
        return {}


def weight(unit: str, seconds: Mapping[str, float]) -> float:
    """A unit's expected seconds: its modules' (a module's unit is named after it)."""
    return sum(seconds.get(m, 0.0) for m in SHARED.get(unit, (unit,)))


def plan(items: list[pytest.Item]) -> None:
    """Order the items unit by unit, the longest unit first (in place; a unit's tests keep
    pytest's order). xdist hands the units out in this order."""
    seconds = reference_seconds()
    position = {item.nodeid: i for i, item in enumerate(items)}
    first = {}
    for item in items:
        first.setdefault(scope_of(item.nodeid), position[item.nodeid])
    items.sort(
        key=lambda it: (
            -weight(scope_of(it.nodeid), seconds),
            first[scope_of(it.nodeid)],
            position[it.nodeid],
        )
    )


def make_scheduler(config: pytest.Config, log):
    """xdist's scope scheduling with scope_of's units (xdist's own ``loadgroup`` marks no
    longer reach its scheduler under pytest 9.2, whose node ids it cannot suffix)."""
    from xdist.scheduler import LoadScopeScheduling

    class LaneScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid)

    return LaneScheduling(config, log)


# This lane's core, once bind_lane_core() has run (None without lanes).
LANE_CORE: str | None = None


def lane_core(environ: Mapping[str, str]) -> str | None:
    """Under xdist with a core per worker, the core of this worker's lane; else None."""
    worker = environ.get("PYTEST_XDIST_WORKER", "")
    count = int(environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    cpus = sorted(os.sched_getaffinity(0))
    if not worker.startswith("gw") or count < 2 or len(cpus) < count:
        return None
    return str(cpus[int(worker[2:]) % len(cpus)])


def bind_lane_core() -> None:
    """Bind this lane's TP1 servers to its core: VLLM_CPU_OMP_THREADS_BIND in the environment
    every server of the lane inherits, through the orchestrator and Ray or directly."""
    global LANE_CORE
    LANE_CORE = lane_core(os.environ)
    if LANE_CORE is not None:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = LANE_CORE
