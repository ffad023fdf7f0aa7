#!/usr/bin/env python3
"""The GPU test record of the fusedq kernel tree: run it on an H100/H200, commit what it writes.

    python scripts/gpu_record.py [--out DIR] [--part all|tests|bench]

On a Hopper GPU with the ``cute`` extra installed (``pip install -e '.[cute]'``, or the DSL's
wheels on the path), it runs the ``gpu``-marked tests (``pytest -m gpu tests/fusedq``) and a
short ``fusedq-bench --floors``, and writes one small record,
``tests/fusedq/gpu_records/<fingerprint>.json``: the fingerprint of the fusedq tree it tested
(fusedq.provenance: code only, so a comment or docstring edit keeps it), the commit,
GPU, driver, torch / Triton / CUDA / nvidia-cutlass-dsl versions, passed / failed / skipped per
test file, and the bench summary (fused/staged and fused/read-floor ratios per recipe).
``--out`` (default ``$OUT`` when set) also gets a copy of the record, the junit XML, the bench
JSON and both logs. ``--part tests`` and ``--part bench`` run one half each (for hosts that
limit one command's time); a later part is added to the record of the same fingerprint and GPU
in ``--records`` (default the repository's folder; name one that outlives the tree's copy, such
as /tmp/gpu_records, where each command gets a fresh copy of the tree).

``tests/fusedq/test_gpu_record.py`` (a CPU test, run by CI) fails while the current tree has
no passing record, naming this command: no kernel change lands untested on a GPU.

Exit status: 0 when the record passes, 1 when a test failed or a bench shape erred (the
record is written all the same: it says what failed), 2 when it cannot run here (no Hopper
GPU, no CUDA, no CUTLASS DSL), writing nothing.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.metadata as md
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # the tree a GPU host was given, installed or not
    sys.path.insert(0, str(REPO))

from fusedq.contract import GLM5, QUALIFIED  # noqa: E402 (after the path above)

RECORDS = REPO / "tests" / "fusedq" / "gpu_records"
COMMAND = "python scripts/gpu_record.py"
SCHEMA = 1
# Hopper: the kernels' target (Gluon/TMA and the CuTe DSL kernel are sm_90 code).
CAPABILITY = (9, 0)
TESTS = ["-m", "gpu", "tests/fusedq"]
# A short floors run: every recipe, the qualified head counts, one M per kernel regime.
BENCH_HEADS = QUALIFIED[GLM5.name].heads
BENCH_M = (1, 2, 4, 32)
BENCH_SAMPLES = 200
VERSIONS = ("torch", "triton", "nvidia-cutlass-dsl", "cuda-python", "cuda-bindings")


class RecordError(RuntimeError):
    """This host cannot make a record; one line says why (exit 2)."""


# --------------------------------------------------------------------------- what counts


def fingerprint(root: Path = REPO) -> str:
    """The fusedq kernel tree's code fingerprint (fusedq.provenance.kernel_tree_fingerprint:
    the package but its vLLM integration and the provenance module), the record's key; the
    bench is a package of its own, outside it."""
    from fusedq.provenance import kernel_tree_fingerprint

    return kernel_tree_fingerprint(root)


def record_path(fp: str, records: Path = RECORDS) -> Path:
    return records / f"{fp}.json"


def problems(record: dict[str, Any], fp: str) -> list[str]:
    """Why ``record`` is not a passing record of the tree ``fp`` (empty: it is)."""
    out = []
    if record.get("fusedq_fingerprint") != fp:
        out.append(f"it is of fingerprint {record.get('fusedq_fingerprint')}")
    tests = record.get("tests")
    if not tests:
        out.append("it has no GPU test results")
    else:
        t = tests.get("totals", {})
        if t.get("failed") or t.get("errors"):
            out.append(f"{t.get('failed', 0)} GPU tests failed, {t.get('errors', 0)} erred")
        if not t.get("passed"):
            out.append("no GPU test passed")
    if not (record.get("versions") or {}).get("nvidia-cutlass-dsl"):
        out.append("it ran without the CUTLASS DSL (the CuTe tests skipped)")
    bench = record.get("bench")
    if not bench:
        out.append("it has no bench summary")
    elif bench.get("errors"):
        out.append(f"{bench['errors']} bench shapes erred")
    return out


def check(fp: str, records: Path = RECORDS) -> str | None:
    """None when ``records`` holds a passing record of ``fp``; else the failure message, which
    names the command that makes one."""
    path = record_path(fp, records)
    if not path.is_file():
        why = "there is none"
    else:
        found = problems(json.loads(path.read_text(encoding="utf-8")), fp)
        if not found:
            return None
        why = "; ".join(found)
    rel = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    return (
        f"the fusedq kernel tree (fingerprint {fp}) has no passing GPU test record ({rel}: "
        f"{why}). On an H100/H200 with the cute extra installed run `{COMMAND}` and commit "
        f"{rel} (docs/gpu-validation.md)."
    )


# --------------------------------------------------------------------------- summaries


def _test_file(classname: str, root: Path) -> str:
    """``tests.fusedq.test_api[.Class]`` -> ``tests/fusedq/test_api.py``."""
    parts = classname.split(".")
    for n in range(len(parts), 0, -1):
        rel = "/".join(parts[:n]) + ".py"
        if (root / rel).is_file():
            return rel
    return classname


def junit_counts(junit: Path, root: Path = REPO) -> dict[str, Any]:
    """passed / failed / errors / skipped per test file, totals, and the failed test ids."""
    files: dict[str, dict[str, int]] = {}
    failed_ids = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        name = _test_file(case.get("classname", ""), root)
        kind = "passed"
        for child, outcome in (("failure", "failed"), ("error", "errors"), ("skipped", "skipped")):
            if case.find(child) is not None:
                kind = outcome
                break
        counts = files.setdefault(name, {"passed": 0, "failed": 0, "errors": 0, "skipped": 0})
        counts[kind] += 1
        if kind in ("failed", "errors"):
            failed_ids.append(f"{name}::{case.get('name')}")
    totals = {
        k: sum(c[k] for c in files.values()) for k in ("passed", "failed", "errors", "skipped")
    }
    return {"files": dict(sorted(files.items())), "totals": totals, "failed_ids": failed_ids}


def _span(values: list[float]) -> list[float] | None:
    return [round(min(values), 3), round(max(values), 3)] if values else None


def bench_summary(result: dict[str, Any]) -> dict[str, Any]:
    """Per recipe (``fusedq-bench`` format): shapes, fused/staged and fused/read-floor ranges,
    and the floor bars met, from a ``fusedq-bench --floors --json`` result."""
    rows = result.get("rows", [])
    recipes: dict[str, Any] = {}
    for fmt in dict.fromkeys(r["format"] for r in rows):
        mine = [r for r in rows if r["format"] == fmt and "error" not in r]
        recipes[fmt] = {
            "shapes": len(mine),
            "fused_over_staged": _span([r["fused_over_staged"] for r in mine]),
            "fused_over_read": _span(
                [r["fused_us"] / r["read_us"] for r in mine if "read_us" in r]
            ),
        }
    bars = [
        v for b in result.get("floor_bars", []) for k, v in b.items() if k.endswith("_ok")
    ]  # fmt: skip
    measured = [ok for ok in bars if ok is not None]
    return {
        "recipes": recipes,
        "errors": sum("error" in r for r in rows),
        "bars_met": f"{sum(measured)} of {len(measured)}",
        "max_abs_err_vs_staged": max(
            (r["max_abs_err_vs_staged"] for r in rows if "error" not in r), default=None
        ),
    }


# --------------------------------------------------------------------------- running


def environment() -> dict[str, Any]:
    """GPU, driver and versions; RecordError where this is no Hopper GPU with the DSL."""
    import torch

    if not torch.cuda.is_available():
        raise RecordError("no CUDA device: the record is made on an H100/H200")
    cap = torch.cuda.get_device_capability()
    name = torch.cuda.get_device_name()
    if tuple(cap) != CAPABILITY:
        raise RecordError(f"{name} is sm_{cap[0]}{cap[1]}: the record is made on sm_90 (H100/H200)")
    versions = {v: _version(v) for v in VERSIONS}
    if not versions["nvidia-cutlass-dsl"]:
        raise RecordError(
            "nvidia-cutlass-dsl is not installed: install the cute extra "
            "(pip install -e '.[cute]') so the CuTe kernel's GPU tests run"
        )
    sys.path.insert(0, str(REPO))
    from fusedq.kernels import cute_mla_query

    # Installed is not enough: the CuTe tests skip unless the kernel can run here (the DSL
    # imports -- pip --target skips its .pth -- and is a release fusedq takes).
    why = cute_mla_query.unavailable_reason()
    if why is not None:
        raise RecordError(
            f"the CuTe kernel cannot run here ({why}); with pip --target, put the DSL's "
            "python_packages (4.3) or dsl_packages (4.6) directory on PYTHONPATH"
        )
    from fusedq.provenance import describe
    from orchestrator.common.probes import NvidiaSmiError, nvidia_smi

    try:
        driver = nvidia_smi(["--query-gpu=driver_version", "--format=csv,noheader"]).split()[0]
    except (NvidiaSmiError, IndexError):
        driver = None
    code = describe(REPO)
    return {
        "gpu": name,
        "capability": list(cap),
        "driver": driver,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "versions": versions,
        "commit": code["commit"],
        "dirty": code["dirty"],
        "commit_source": code["source"],
        "product_fingerprint": code["product_fingerprint"],
    }


def _version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def _run(argv: list[str], log: Path) -> tuple[int, float]:
    print("+", " ".join(argv), flush=True)
    start = time.monotonic()
    # This checkout's fusedq, whatever else is installed.
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    with log.open("w") as f:
        rc = subprocess.run(
            argv, cwd=REPO, stdout=f, stderr=subprocess.STDOUT, check=False,
            env={**os.environ, "PYTHONPATH": path},
        )  # fmt: skip
    wall = time.monotonic() - start
    print(f"  exit {rc.returncode} after {wall:.0f} s; log {log}", flush=True)
    return rc.returncode, round(wall, 1)


def run_tests(work: Path) -> dict[str, Any]:
    junit = work / "pytest_gpu.xml"
    argv = [sys.executable, "-m", "pytest", *TESTS, "-q", "-p", "no:cacheprovider", "-rfE",
            f"--junitxml={junit}"]  # fmt: skip
    rc, wall = _run(argv, work / "pytest_gpu.log")
    if not junit.is_file():
        raise RecordError(f"pytest wrote no junit XML (exit {rc}); see {work / 'pytest_gpu.log'}")
    counts = junit_counts(junit)
    return {"command": "pytest " + " ".join(TESTS), "exit": rc, "wall_s": wall, **counts}


def run_bench(work: Path, heads: list[int], ms: list[int], samples: int) -> dict[str, Any]:
    out = work / "bench_floors.json"
    args = ["--floors", "--samples", str(samples), "--heads", *map(str, heads),
            "--m", *map(str, ms), "--json", str(out)]  # fmt: skip
    rc, wall = _run([sys.executable, "-m", "fusedq_bench", *args], work / "bench_floors.log")
    if not out.is_file():
        raise RecordError(
            f"fusedq-bench wrote no JSON (exit {rc}); see {work / 'bench_floors.log'}"
        )
    summary = bench_summary(json.loads(out.read_text()))
    return {"command": "fusedq-bench " + " ".join(args[:-2]), "exit": rc, "wall_s": wall, **summary}


def write_record(fp: str, env: dict[str, Any], parts: dict[str, Any], records: Path) -> Path:
    """Write (or complete, for the same fingerprint and GPU) the record of ``fp``."""
    path = record_path(fp, records)
    record: dict[str, Any] = {}
    if path.is_file():
        old = json.loads(path.read_text(encoding="utf-8"))
        if old.get("fusedq_fingerprint") == fp and old.get("gpu") == env["gpu"]:
            record = old
    now = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    record.update({"schema": SCHEMA, "fusedq_fingerprint": fp, "date_utc": now, **env})
    record.update(parts)
    record["passed"] = not problems(record, fp)
    records.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.environ.get("OUT"), help="also copy everything here")
    p.add_argument("--part", choices=("all", "tests", "bench"), default="all")
    p.add_argument("--records", default=str(RECORDS), help="where the record is written")
    p.add_argument("--bench-heads", type=int, nargs="+", default=list(BENCH_HEADS))
    p.add_argument("--bench-m", type=int, nargs="+", default=list(BENCH_M))
    p.add_argument("--bench-samples", type=int, default=BENCH_SAMPLES)
    a = p.parse_args(argv)
    try:
        env = environment()
        fp = fingerprint()
        with tempfile.TemporaryDirectory(prefix="gpu-record-") as tmp:
            work = Path(a.out) if a.out else Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            parts: dict[str, Any] = {}
            if a.part in ("all", "tests"):
                parts["tests"] = run_tests(work)
            if a.part in ("all", "bench"):
                parts["bench"] = run_bench(work, a.bench_heads, a.bench_m, a.bench_samples)
            path = write_record(fp, env, parts, Path(a.records))
            if a.out:
                shutil.copy2(path, work / path.name)
    except RecordError as exc:
        print(f"gpu_record: {exc}", file=sys.stderr)
        return 2
    record = json.loads(path.read_text())
    print(f"wrote {path} (fusedq {fp}, commit {env['commit']})")
    if "tests" in record:
        print(f"GPU tests: {record['tests']['totals']}")
    if "bench" in record:
        for fmt, s in record["bench"]["recipes"].items():
            print(
                f"bench {fmt}: fused/staged {s['fused_over_staged']}, fused/read {s['fused_over_read']}"
            )
    missing = problems(record, fp)
    print("record passes" if not missing else "record does not pass: " + "; ".join(missing))
    failed = any(
        part in parts and (parts[part].get("failed_ids") or parts[part].get("errors"))
        for part in ("tests", "bench")
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
