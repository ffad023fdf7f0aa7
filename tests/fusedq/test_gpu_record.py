"""The GPU test record (scripts/gpu_record.py): the kernel tree that CI tests must have passed
its GPU tests on an H100/H200, and the record's key follows code, not prose.

``test_the_kernel_tree_has_a_passing_gpu_record`` is the gate: it fails after any change to
fusedq's code until ``python scripts/gpu_record.py`` has run on a Hopper GPU and its record is
committed. The other tests show the gate does what it says on copies of the tree.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("gpu_record", REPO / "scripts" / "gpu_record.py")
gr = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(gr)

KERNEL = Path("fusedq") / "kernels" / "cute_mla_query.py"


def test_the_kernel_tree_has_a_passing_gpu_record():
    failure = gr.check(gr.fingerprint())
    assert failure is None, failure


def _passing_record(fp: str) -> dict:
    return {
        "schema": gr.SCHEMA,
        "fusedq_fingerprint": fp,
        "gpu": "NVIDIA H200",
        "versions": {"nvidia-cutlass-dsl": "4.3.5"},
        "tests": {"totals": {"passed": 988, "failed": 0, "errors": 0, "skipped": 3}},
        "bench": {"recipes": {"bf16": {"shapes": 12}}, "errors": 0},
    }


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """A copy of the product tree, as a later commit would change it."""
    for name in ("fusedq", "orchestrator"):
        shutil.copytree(REPO / name, tmp_path / name, ignore=shutil.ignore_patterns("__pycache__"))
    return tmp_path


def test_a_code_change_needs_a_record_and_a_comment_does_not(tree: Path, tmp_path: Path):
    records = tmp_path / "records"
    fp = gr.fingerprint(tree)
    assert fp == gr.fingerprint()  # the copy is this tree
    records.mkdir()
    gr.record_path(fp, records).write_text(json.dumps(_passing_record(fp)))
    assert gr.check(fp, records) is None

    kernel = tree / KERNEL
    source = kernel.read_text()
    # Prose only: a comment, a docstring, line layout. The record still holds.
    kernel.write_text(
        source.replace('"""', '"""Reworded. ', 1) + "\n# a note on why, added later\n"
    )
    assert gr.fingerprint(tree) == fp and gr.check(gr.fingerprint(tree), records) is None

    # One line of code added to the kernel: a new fingerprint, and no record for it.
    kernel.write_text(source + "\nMAX_M_OVERRIDE = 16\n")
    changed = gr.fingerprint(tree)
    assert changed != fp
    failure = gr.check(changed, records)
    assert failure is not None
    assert f"fingerprint {changed}" in failure and "python scripts/gpu_record.py" in failure
    assert "there is none" in failure


def test_the_key_is_the_kernel_tree_not_the_vllm_integration(tree: Path):
    fp = gr.fingerprint(tree)
    # The vLLM integration is proved by other evidence: no module of its subpackage is in the
    # key, a new one included; nor is the provenance module. (The bench is not in fusedq.)
    for name in ("vllm/plugin.py", "vllm/query.py", "provenance.py"):
        module = tree / "fusedq" / name
        module.write_text(module.read_text() + "\nEXTRA = 1\n")
        assert gr.fingerprint(tree) == fp, name
    (tree / "fusedq" / "vllm" / "new_part.py").write_text("EXTRA = 1\n")
    assert gr.fingerprint(tree) == fp
    # Every module that decides or computes the query is.
    for name in ("selection.py", "dispatch.py", "kernels/common.py"):
        module = tree / "fusedq" / name
        original = module.read_text()
        module.write_text(original + "\nEXTRA = 1\n")
        assert gr.fingerprint(tree) != fp, name
        module.write_text(original)


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (lambda r: r["tests"]["totals"].update(failed=2), "2 GPU tests failed"),
        (lambda r: r["tests"]["totals"].update(passed=0), "no GPU test passed"),
        (lambda r: r.pop("tests"), "no GPU test results"),
        (lambda r: r.pop("bench"), "no bench summary"),
        (lambda r: r["bench"].update(errors=1), "1 bench shapes erred"),
        (lambda r: r["versions"].update({"nvidia-cutlass-dsl": None}), "without the CUTLASS DSL"),
        (lambda r: r.update(fusedq_fingerprint="0" * 16), "of fingerprint 0000000000000000"),
    ],
)
def test_a_record_that_did_not_pass_does_not_count(tmp_path: Path, edit, why):
    fp = "abcdef0123456789"
    record = _passing_record(fp)
    edit(record)
    gr.record_path(fp, tmp_path).write_text(json.dumps(record))
    failure = gr.check(fp, tmp_path)
    assert failure is not None and why in failure


JUNIT = """<?xml version="1.0" encoding="utf-8"?>
<testsuites><testsuite name="pytest" tests="5">
<testcase classname="tests.fusedq.test_api" name="test_a[H8]" time="0.1"/>
<testcase classname="tests.fusedq.test_api" name="test_b" time="0.1"><failure message="x"/></testcase>
<testcase classname="tests.fusedq.test_cute_mla_query" name="test_c" time="0.1"><skipped message="y"/></testcase>
<testcase classname="tests.fusedq.test_cute_mla_query" name="test_d" time="0.1"><error message="z"/></testcase>
<testcase classname="tests.fusedq.test_cute_mla_query" name="test_e" time="0.1"/>
</testsuite></testsuites>
"""


def test_junit_is_counted_per_file(tmp_path: Path):
    (tmp_path / "j.xml").write_text(JUNIT)
    counts = gr.junit_counts(tmp_path / "j.xml")
    assert counts["files"] == {
        "tests/fusedq/test_api.py": {"passed": 1, "failed": 1, "errors": 0, "skipped": 0},
        "tests/fusedq/test_cute_mla_query.py": {
            "passed": 1,
            "failed": 0,
            "errors": 1,
            "skipped": 1,
        },
    }
    assert counts["totals"] == {"passed": 2, "failed": 1, "errors": 1, "skipped": 1}
    assert counts["failed_ids"] == [
        "tests/fusedq/test_api.py::test_b",
        "tests/fusedq/test_cute_mla_query.py::test_d",
    ]


def test_bench_summary_gives_each_recipes_ratios():
    rows = [
        {"format": "bf16", "H": 8, "M": 1, "fused_us": 2.4, "staged_us": 5.0, "read_us": 2.0,
         "fused_over_staged": 0.48, "max_abs_err_vs_staged": 0.01},
        {"format": "bf16", "H": 16, "M": 1, "fused_us": 3.0, "staged_us": 6.0, "read_us": 2.5,
         "fused_over_staged": 0.5, "max_abs_err_vs_staged": 0.02},
        {"format": "mxfp8", "H": 8, "M": 1, "error": "RuntimeError()"},
    ]  # fmt: skip
    bars = [{"H": 8, "M": 1, "bf16_ok": False, "mxfp8_ok": None, "e4m3_ok": True}]
    s = gr.bench_summary({"rows": rows, "floor_bars": bars})
    assert s["recipes"]["bf16"] == {
        "shapes": 2, "fused_over_staged": [0.48, 0.5], "fused_over_read": [1.2, 1.2]
    }  # fmt: skip
    assert s["recipes"]["mxfp8"]["shapes"] == 0 and s["errors"] == 1
    assert s["bars_met"] == "1 of 2" and s["max_abs_err_vs_staged"] == 0.02


def test_the_command_refuses_a_host_without_a_hopper_gpu(tmp_path: Path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has a GPU")
    before = sorted(gr.RECORDS.glob("*.json")) if gr.RECORDS.is_dir() else []
    done = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "gpu_record.py"), "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=REPO,
    )  # fmt: skip
    assert done.returncode == 2
    assert done.stderr.strip() == "gpu_record: no CUDA device: the record is made on an H100/H200"
    assert list(tmp_path.iterdir()) == []
    assert (sorted(gr.RECORDS.glob("*.json")) if gr.RECORDS.is_dir() else []) == before


def test_a_record_made_in_two_parts_is_one_record(tmp_path: Path):
    fp = "0123456789abcdef"
    env = {"gpu": "NVIDIA H200", "versions": {"nvidia-cutlass-dsl": "4.3.5"}, "commit": "abc"}
    good = _passing_record(fp)
    path = gr.write_record(fp, env, {"tests": good["tests"]}, tmp_path)
    first = json.loads(path.read_text())
    assert first["passed"] is False and "no bench summary" in gr.check(fp, tmp_path)
    gr.write_record(fp, env, {"bench": good["bench"]}, tmp_path)
    both = json.loads(path.read_text())
    assert (
        both["passed"] is True and both["tests"] == good["tests"] and gr.check(fp, tmp_path) is None
    )
    # A part from another GPU starts the record afresh: parts of two machines never mix.
    gr.write_record(fp, {**env, "gpu": "NVIDIA H100"}, {"bench": good["bench"]}, tmp_path)
    assert "tests" not in json.loads(path.read_text())
