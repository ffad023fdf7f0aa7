#!/usr/bin/env python3
"""Where the test suite's time goes: a JUnit XML (pytest's) as a table per test module.

    python scripts/test_times.py junit.xml                      # the table, slowest first
    python scripts/test_times.py junit.xml --budget-min 35      # exit 1 past 35 min of wall
    python scripts/test_times.py junit.xml --write tests/test_times.json  # the new reference

Per module: the tests it ran, their set-up (where a module's real servers start: its
fixtures' time is charged to the first test that asks for them), their calls and teardowns,
and the sum. tests/conftest.py records the three phases of every test as properties
(``setup_s``, ``call_s``, ``teardown_s``); a JUnit file without them (another runner's) still
gives each module's total. The suite's wall time is the XML's own (with pytest-xdist it is
less than the modules' sum: they ran side by side).

With ``--budget-min`` the wall time is held to that many minutes; past it, the exit code is 1
and the modules that grew against the committed reference (``tests/test_times.json``, written
by ``--write`` from an accepted run) are named with their growth.
"""

from __future__ import annotations

import argparse
import json
import sys
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "tests" / "test_times.json"
PHASES = ("setup", "call", "teardown")
# A module "grew" when it takes this much longer than its reference, in seconds and in
# relative terms both: a 2-core machine's run-to-run noise on a real-server module is ~10 %.
GREW_S = 30.0
GREW_FRACTION = 0.2


@dataclass
class Module:
    name: str
    tests: int = 0
    failed: int = 0
    phases: dict[str, float] = field(default_factory=lambda: dict.fromkeys(PHASES, 0.0))
    total_s: float = 0.0
    split: bool = True  # every test carried its phases
    lanes: dict[str, float] = field(default_factory=dict)  # pytest-xdist worker -> seconds

    def add(self, case: ET.Element) -> None:
        self.tests += 1
        seconds = float(case.get("time") or 0.0)
        self.total_s += seconds
        if case.find("failure") is not None or case.find("error") is not None:
            self.failed += 1
        props = {p.get("name"): p.get("value") for p in case.iter("property")}
        if props.get("lane", "-") != "-":
            self.lanes[props["lane"]] = self.lanes.get(props["lane"], 0.0) + seconds
        if not all(f"{p}_s" in props for p in PHASES):
            self.split = False
            return
        for p in PHASES:
            self.phases[p] += float(props[f"{p}_s"])


def module_of(case: ET.Element) -> str:
    """tests/orchestrator/test_cluster.py from classname tests.orchestrator.test_cluster[.Class]."""
    parts = (case.get("classname") or "?").split(".")
    for i, part in enumerate(parts):
        if part.startswith("test_") or part == "conftest":
            return "/".join(parts[: i + 1]) + ".py"
    return "/".join(parts)


@dataclass
class Suite:
    wall_s: float
    modules: dict[str, Module]

    @property
    def summed_s(self) -> float:
        return sum(m.total_s for m in self.modules.values())


def read(path: Path) -> Suite:
    try:
        root = ET.parse(path).getroot()
    except (OSError, ET.ParseError) as exc:
        raise SystemExit(f"test_times: {path}: not a readable JUnit XML ({exc})") from None
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    if not suites:
        raise SystemExit(f"test_times: {path}: no <testsuite> in it")
    modules: dict[str, Module] = {}
    for case in root.iter("testcase"):
        name = module_of(case)
        modules.setdefault(name, Module(name)).add(case)
    wall = sum(float(s.get("time") or 0.0) for s in suites)
    return Suite(wall, modules)


def table(suite: Suite, reference: dict[str, float] | None = None) -> str:
    ref = reference or {}
    head = "| Module | Tests | Setup s | Call s | Teardown s | Total s |"
    rule = "|---|---:|---:|---:|---:|---:|"
    if ref:
        head += " Reference s |"
        rule += "---:|"
    lines = [head, rule]
    for m in sorted(suite.modules.values(), key=lambda m: -m.total_s):
        cells = [m.name, str(m.tests) + (f" ({m.failed} failed)" if m.failed else "")]
        if m.split:
            cells += [f"{m.phases[p]:.1f}" for p in PHASES]
        else:
            cells += ["-", "-", "-"]
        cells.append(f"{m.total_s:.1f}")
        if ref:
            cells.append(f"{ref[m.name]:.1f}" if m.name in ref else "new")
        lines.append("| " + " | ".join(cells) + " |")
    tests = sum(m.tests for m in suite.modules.values())
    setup = sum(m.phases["setup"] for m in suite.modules.values())
    lines.append(
        f"\n{tests} tests in {len(suite.modules)} modules: {suite.summed_s:.0f} s of test time "
        f"(set-up {setup:.0f} s), {suite.wall_s:.0f} s of wall time"
        f" ({suite.wall_s / 60:.1f} min)"
    )
    busy: dict[str, float] = {}
    for m in suite.modules.values():
        for lane, seconds in m.lanes.items():
            busy[lane] = busy.get(lane, 0.0) + seconds
    if busy:
        lines.append(
            "lanes: " + ", ".join(f"{lane} {busy[lane]:.0f} s busy" for lane in sorted(busy))
        )
    return "\n".join(lines)


def grown(suite: Suite, reference: dict[str, float]) -> list[tuple[str, float, float]]:
    """(module, reference s, now s) for each module that grew past the noise, most first."""
    out = []
    for m in suite.modules.values():
        before = reference.get(m.name, 0.0)
        if m.total_s - before > GREW_S and m.total_s > before * (1 + GREW_FRACTION):
            out.append((m.name, before, m.total_s))
    return sorted(out, key=lambda g: g[1] - g[2])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("junit", type=Path, help="pytest's --junitxml file")
    ap.add_argument("--budget-min", type=float, help="fail past this many minutes of wall time")
    ap.add_argument("--reference", type=Path, default=REFERENCE, help="per-module seconds")
    ap.add_argument("--write", type=Path, help="write this run's per-module seconds there")
    args = ap.parse_args(argv)
    suite = read(args.junit)
    reference = None
    if args.reference.exists():
        reference = json.loads(args.reference.read_text())["modules_s"]
    print(table(suite, reference))
    if args.write:
        data = {
            "wall_s": round(suite.wall_s, 1),
            "modules_s": {k: round(m.total_s, 1) for k, m in sorted(suite.modules.items())},
        }
        tmp = args.write.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(args.write)
        print(f"test_times: wrote {args.write}")
    if args.budget_min is not None and suite.wall_s > args.budget_min * 60:
        print(
            f"test_times: the suite took {suite.wall_s / 60:.1f} min, over its budget of "
            f"{args.budget_min:g} min",
            file=sys.stderr,
        )
        if reference is None:
            print(f"  (no reference {args.reference} to say which modules grew)", file=sys.stderr)
        else:
            rows = grown(suite, reference)
            for name, before, now in rows:
                print(f"  {name}: {before:.0f} s -> {now:.0f} s (+{now - before:.0f} s)",
                      file=sys.stderr)  # fmt: skip
            if not rows:
                print("  no module grew past the noise: the machine is slower", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
