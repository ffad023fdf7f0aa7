"""What a matrix's env may do is visible in `plan`: variables that load code into every
server (LD_PRELOAD and friends) are allowed and listed; CUDA_VISIBLE_DEVICES and PYTHONPATH,
which the Ray worker's values replace, are warned about instead of being dropped silently."""

from __future__ import annotations

import pytest
from security_helpers import MATRIX, run_cli, write_matrix

from orchestrator.plan.render import plan_matrix


@pytest.mark.parametrize("name", ["LD_PRELOAD", "LD_LIBRARY_PATH", "PYTHONSTARTUP"])
def test_code_loading_variables_are_listed(tmp_path, name):
    path = write_matrix(tmp_path, f"engine: {{env: {{{name}: /opt/lib/x.so}}}}\n")
    notes = plan_matrix(path)["notes"]
    assert any(name in n and "engine.env" in n for n in notes), notes


@pytest.mark.parametrize("name", ["CUDA_VISIBLE_DEVICES", "PYTHONPATH"])
def test_ray_replaced_variables_are_warned_about(tmp_path, name):
    path = write_matrix(
        tmp_path, base=MATRIX.replace("{tp: 1}", f"{{tp: 1, env: {{{name}: '3'}}}}")
    )
    out = run_cli("plan", str(path))
    assert out.returncode == 0, out.stderr
    warned = [ln for ln in out.stdout.splitlines() if ln.startswith("warning:") and name in ln]
    assert warned and "topologies[0].env" in warned[0] and "Ray" in warned[0], out.stdout


def test_a_plain_matrix_has_no_such_warning(tmp_path):
    out = run_cli(
        "plan", str(write_matrix(tmp_path, "engine: {env: {VLLM_LOGGING_LEVEL: DEBUG}}\n"))
    )
    assert out.returncode == 0 and "warning:" not in out.stdout, out.stdout
