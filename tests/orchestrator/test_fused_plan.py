"""`orchestrator plan` says "qualified" only where a case's server will run the fused query:
a qualified head count per rank, the plugin not switched off, and on CPU Triton's
interpreter on; elsewhere the reason (orchestrator/plan/fused.py)."""

from __future__ import annotations

import json

import pytest
from orch_cli import run_cli

from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix
from orchestrator.plan.fused import fused_plan

MATRIX = """
name: m
models: [{label: t, path: "builtin:tiny-mla", num_heads: 8}]
resources: {accelerator: ACCEL}
topologies: [{tp: 1}, {tp: 2}]
workloads: [{name: ctx0, prompt_tokens: 1, output_tokens: 4}]
variants:
  - {name: plain, env: {FUSEDQ_MLA_QUERY: "0"}}
  - {name: auto}
  - {name: interp, env: {TRITON_INTERPRET: "1"}}
  - {name: required, env: {FUSEDQ_MLA_QUERY: "1"}}
"""


def _plans(accelerator: str, environ: dict[str, str]) -> dict[str, str]:
    m = parse_matrix(MATRIX.replace("ACCEL", accelerator), "m.yaml", env={})
    return {c.case_id: fused_plan(c, accelerator, environ).why for c in expand(m)}


def test_on_cpu_only_the_interpreter_runs_the_kernel() -> None:
    plans = _plans("cpu", {})
    assert plans["t/tp1-dcp1-mtp0/plain"] == "staged: FUSEDQ_MLA_QUERY=0"
    assert plans["t/tp1-dcp1-mtp0/auto"] == "staged: CPU without TRITON_INTERPRET=1"
    assert plans["t/tp1-dcp1-mtp0/interp"] == "qualified"
    assert plans["t/tp1-dcp1-mtp0/required"] == (
        "fails: FUSEDQ_MLA_QUERY=1 on CPU without TRITON_INTERPRET=1"
    )
    # TP2 of 8 heads: 4 per rank, whatever the interpreter does.
    assert plans["t/tp2-dcp1-mtp0/interp"] == "staged: 4 heads per rank (qualified: 8, 11, 16)"
    assert plans["t/tp2-dcp1-mtp0/required"].startswith("fails: FUSEDQ_MLA_QUERY=1 and 4 heads")


def test_the_orchestrators_environment_reaches_a_local_rays_servers() -> None:
    assert _plans("cpu", {"TRITON_INTERPRET": "1"})["t/tp1-dcp1-mtp0/auto"] == "qualified"
    assert _plans("cpu", {"FUSEDQ_MLA_QUERY": "0"})["t/tp1-dcp1-mtp0/interp"].startswith("staged")


@pytest.mark.parametrize("case,why", [("auto", "qualified"), ("plain", "staged")])
def test_gpu_cases_need_no_interpreter(case: str, why: str) -> None:
    assert _plans("gpu", {})[f"t/tp1-dcp1-mtp0/{case}"].startswith(why)


def test_the_smoke_plan_shows_the_fused_kernel_where_it_runs() -> None:
    """The embedded default: every fused case qualified (16 heads: 16 per rank at TP1, 8 at
    TP2), every staged one staged by choice; the text says so per case."""
    out = run_cli("plan", "matrices/smoke.yaml", "--json", timeout=60,
                  env={"TRITON_INTERPRET": "", "FUSEDQ_MLA_QUERY": ""})  # fmt: skip
    assert out.returncode == 0, out.stderr
    cases = {c["case_id"]: c["fusedq"] for c in json.loads(out.stdout)["cases"]}
    assert cases == {
        "tiny-mla/tp1-dcp1-mtp1/staged": "staged: FUSEDQ_MLA_QUERY=0",
        "tiny-mla/tp1-dcp1-mtp1/fused": "qualified",
        "tiny-mla/tp2-dcp1-mtp0/staged": "staged: FUSEDQ_MLA_QUERY=0",
        "tiny-mla/tp2-dcp1-mtp0/fused": "qualified",
    }
    text = run_cli("plan", "matrices/smoke.yaml", timeout=60).stdout
    assert "tiny-mla/tp2-dcp1-mtp0/fused" in text and text.count(" qualified") == 2
