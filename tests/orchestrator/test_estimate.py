"""The run-duration estimate `plan` prints and the ETA a run refines from it."""

from __future__ import annotations

import pytest

from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix
from orchestrator.config.schema import WARMUP_OUTPUT_TOKENS, WARMUP_PROMPT_TOKENS
from orchestrator.plan.estimate import ASSUMED, Eta, estimate_run, human_s, request_s, workload_s
from orchestrator.plan.render import plan_matrix, render_plan

CPU = ASSUMED["cpu"]
MATRIX = """
name: est
models: [{label: M, path: /m, num_heads: 8}]
resources: {accelerator: ACCEL}
topologies: [{tp: 1, mtp: [0, 1]}]
workloads:
  - {name: ctx0, prompt_tokens: 1, output_tokens: 64, requests: 5, concurrency: 2, repeats: 2}
  - {name: soak, prompt_tokens: 100, output_tokens: 10, duration_s: 30}
warmup_requests: 2
"""


@pytest.fixture(autouse=True)
def _no_interpreter_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The estimate reads whether the fused query will run interpreted from the environment a
    local Ray's servers inherit; tests/conftest.py sets TRITON_INTERPRET for the whole test run."""
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("FUSEDQ_MLA_QUERY", raising=False)


def _matrix(accel: str):
    return parse_matrix(MATRIX.replace("ACCEL", accel), "est.yaml")


def test_request_time_is_prefill_then_decode() -> None:
    assert request_s(800, 40, 0, CPU) == pytest.approx(
        800 / CPU.prefill_tok_s + 40 / CPU.decode_tok_s
    )
    # CPU MTP re-reads the context every step: 40 steps over a context of 800 + 20 on average.
    extra = 40 * (800 + 20) / CPU.prefill_tok_s
    assert request_s(800, 40, 1, CPU) == pytest.approx(request_s(800, 40, 0, CPU) + extra)
    gpu = ASSUMED["gpu"]
    assert request_s(800, 40, 3, gpu) == request_s(800, 40, 0, gpu)  # GPUs decode for real


def test_workload_modes() -> None:
    m = _matrix("cpu")
    req, dur = m.workloads
    one = request_s(1, 64, 0, CPU)
    assert workload_s(req, 0, CPU) == pytest.approx(2 * 3 * one)  # 2 repeats x 3 waves of 2
    # Duration mode: the duration, plus the requests in flight at its end running out.
    assert workload_s(dur, 0, CPU) == pytest.approx(30 + request_s(100, 10, 0, CPU))


def test_run_estimate_adds_startup_warmup_workloads_and_overheads() -> None:
    m = _matrix("cpu")
    cases = expand(m)
    est = estimate_run(m, cases)
    warm = 2 * request_s(WARMUP_PROMPT_TOKENS, WARMUP_OUTPUT_TOKENS, 0, CPU)
    first = (
        CPU.startup_s + CPU.case_overhead_s + warm + sum(workload_s(w, 0, CPU) for w in m.workloads)
    )
    assert est.per_case()[cases[0].case_id] == pytest.approx(first)
    assert est.per_case()[cases[1].case_id] > first  # MTP1 on CPU costs more
    assert est.total_s == pytest.approx(CPU.run_overhead_s + sum(est.per_case().values()))
    gpu = estimate_run(_matrix("gpu"), cases)
    assert gpu.total_s > est.total_s  # a big GPU checkpoint starts in minutes, not seconds
    assert gpu.cases[0].startup_s == ASSUMED["gpu"].startup_s
    tiny = parse_matrix(MATRIX.replace("ACCEL", "gpu").replace("/m", "builtin:tiny-mla"), "t.yaml")
    assert estimate_run(tiny, expand(tiny)).cases[0].startup_s == ASSUMED["gpu"].builtin_startup_s
    assert "not a measurement" in est.basis() and "CPU" in est.basis()


def test_plan_prints_the_estimate_and_how_it_was_made(tmp_path) -> None:
    path = tmp_path / "est.yaml"
    path.write_text(MATRIX.replace("ACCEL", "cpu"))
    plan = plan_matrix(path)
    assert plan["estimate"]["total_s"] == round(
        estimate_run(_matrix("cpu"), expand(_matrix("cpu"))).total_s, 1
    )
    assert plan["estimate"]["assumed"]["startup_s"] == CPU.startup_s
    assert [c["estimated_s"] for c in plan["cases"]] == list(plan["estimate"]["cases"].values())
    text = render_plan(plan)
    assert f"estimated duration: ~{human_s(plan['estimate']['total_s'])} (an estimate" in text
    assert f"server start-up {CPU.startup_s:.0f} s per case" in text


def test_eta_learns_from_passed_cases_only() -> None:
    eta = Eta({"a": 100.0, "b": 100.0, "c": 200.0}, ["a", "b", "c"])
    assert eta.remaining_s() == 400.0
    eta.finished("a", 10.0, passed=False)  # failed at start-up: all there is, so it counts
    assert eta.factor == pytest.approx(0.1)
    eta.finished("b", 150.0, passed=True)  # once a case passed, failures stop counting
    assert eta.factor == pytest.approx(1.5)
    assert eta.remaining_s() == pytest.approx(300.0)
    assert eta.remaining_s("c", 100.0) == pytest.approx(200.0)


@pytest.mark.parametrize(
    ("seconds", "text"),
    [(0.4, "0 s"), (59.4, "59 s"), (61, "1m01s"), (3599, "59m59s"), (7380, "2h03m")],
)
def test_human_s(seconds: float, text: str) -> None:
    assert human_s(seconds) == text


def test_a_fused_query_in_the_interpreter_costs_decode_steps() -> None:
    """On CPU the fused variant's kernel runs in Triton's interpreter: each decode step pays
    it per layer (at MTP on CPU, the draft layer's only: the verify takes the prefill path),
    in proportion to a rank's heads; the staged variant pays nothing."""
    from orchestrator.plan.estimate import interpreted_query_s

    text = MATRIX.replace("ACCEL", "cpu").replace("path: /m", 'path: "builtin:tiny-mla"')
    text += "variants: [{name: staged, env: {FUSEDQ_MLA_QUERY: '0'}}, {name: fused, env: {TRITON_INTERPRET: '1'}}]\n"
    m = parse_matrix(text, "est.yaml")
    by_id = {c.case_id: c for c in expand(m)}
    fused0, fused1 = by_id["M/tp1-dcp1-mtp0/fused"], by_id["M/tp1-dcp1-mtp1/fused"]
    per = CPU.interpreted_query_s_per_head
    assert interpreted_query_s(by_id["M/tp1-dcp1-mtp0/staged"], "cpu", CPU) == 0.0
    assert interpreted_query_s(fused0, "cpu", CPU) == pytest.approx(2 * 8 * per)  # 2 layers
    assert interpreted_query_s(fused1, "cpu", CPU) == pytest.approx(1 * 8 * per)  # the draft
    est = estimate_run(m, list(by_id.values()))
    cases = est.per_case()
    assert cases["M/tp1-dcp1-mtp0/fused"] > cases["M/tp1-dcp1-mtp0/staged"]
    assert "Triton's interpreter" in est.basis()
    assert (
        "Triton's interpreter" not in estimate_run(_matrix("cpu"), expand(_matrix("cpu"))).basis()
    )
