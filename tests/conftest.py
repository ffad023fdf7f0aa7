"""Set-up every test directory needs before any test module is imported.

Without CUDA fusedq's kernels run in Triton's interpreter on CPU tensors. Triton picks the
interpreter when ``@triton.jit`` decorates a function (it reads ``TRITON_INTERPRET`` from the
environment at that moment), so it must be set before anything imports ``fusedq.kernels`` --
and test modules of other directories (tests/benchmarks reads ``fusedq_bench``) are collected
before tests/fusedq's own conftest would run. This root conftest runs first.

It also records each test's phases for scripts/test_times.py and, under pytest-xdist, lays
the suite out on the lanes tests/lanes.py describes.
"""

import os

import lanes
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
lanes.bind_lane_core()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):  # a lane: its share of the plan
        lanes.plan(items)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    # `--dist loadscope` (make test's) gets the lanes' units; another --dist, xdist's own.
    if config.getoption("dist") == "loadscope":
        return lanes.make_scheduler(config, log)
    return None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each phase's duration as a property of the test in the JUnit XML (setup_s, call_s,
    teardown_s): JUnit's one `time` per test hides that a module's real servers start in the
    set-up of its first test. scripts/test_times.py tables them per module."""
    outcome = yield
    props = [(f"{call.when}_s", f"{call.duration:.3f}")]
    if call.when == "setup":  # when and on which lane the test began (for the lanes' table)
        props += [
            ("start", f"{call.start:.3f}"),
            ("lane", os.environ.get("PYTEST_XDIST_WORKER", "-")),
        ]
    outcome.get_result().user_properties.extend(props)
    if call.when != "teardown":  # the teardown report, made last, copies the item's list
        item.user_properties.extend(props)
