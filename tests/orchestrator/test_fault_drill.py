"""The GPU fault drill: a GPU vLLM server under the orchestrator hits a real device fault in its
decode path (an out-of-bounds write: illegal memory access), or loses a TP2 worker to SIGKILL
mid-decode, from the test-only plugin tests/fault_drill; product code has no fault switch.

On a GPU host (``gpu``-marked; scripts/gpu/fault_drill.sh runs them) the orchestrator runs
matrices/h200-fault-drill.yaml (and matrices/h200x2-fault-drill.yaml on two GPUs) and the
tests check what a user relies on: the audit names the fault from the real server log (and
the kernel log where it is readable), the case fails with that root cause first in its
reason, the next case still runs and passes, no process of the run outlives it, the GPUs'
memory is free afterwards, and report.md and junit.xml say so.

On CPU: the plugin is inert unless armed, loads in a real CPU ``vllm serve`` under the
orchestrator, the drill matrices plan, and the audit recognises the fault from a log of
vLLM 0.26's fault path (composed from vLLM 0.26's own messages until the H200 drill's real
server log is committed beside it: any ``*oob_drill*.log`` fixture is checked).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path

import pytest
from orch_cli import REPO, marked_processes, run_cli

from orchestrator.audit import audit_logs
from orchestrator.cluster.leftovers import RUN_ENV
from orchestrator.engines import log_tail
from orchestrator.execution.case_run import failure_reason

DRILL_SRC = REPO / "tests" / "fault_drill"
FIXTURES = REPO / "tests" / "orchestrator" / "fixtures" / "audit"
OOB_LOGS = sorted(FIXTURES.glob("*oob_drill*.log"))
ILLEGAL = "CUDA error: an illegal memory access was encountered"
WORKER_DIED = "died unexpectedly"


def install_drill(target: Path) -> Path:
    """The drill plugin installed the way a drill host gets it: pip --target, off the index.
    Built from a copy: setuptools builds in the source folder (build/, *.egg-info), which
    would leave a second fusedq_fault_drill.py under tests/."""
    src = target.parent / f"{target.name}-src"
    shutil.copytree(DRILL_SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info"))
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
         "--disable-pip-version-check", "--target", str(target), str(src)],
        check=True, capture_output=True, text=True,
    )  # fmt: skip
    return target


def _python(code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    path = os.pathsep.join([str(DRILL_SRC), str(REPO), os.environ.get("PYTHONPATH", "")])
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": path, **env},
    )  # fmt: skip


# --------------------------------------------------------------------------- CPU


def test_the_drill_plugin_does_nothing_unless_armed():
    done = _python(
        "import fusedq.vllm.query as h; from vllm.v1.worker import gpu_worker as g\n"
        "before = (h.decode_query, g.Worker.execute_model, g.Worker.compile_or_warm_up_model)\n"
        "import fusedq_fault_drill as d; d.register()\n"
        "after = (h.decode_query, g.Worker.execute_model, g.Worker.compile_or_warm_up_model)\n"
        "print(before == after)",
        {},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "True"


def test_the_armed_drill_plugin_wraps_the_decode_query_and_the_worker():
    done = _python(
        "import fusedq.vllm.query as h; from vllm.v1.worker import gpu_worker as g\n"
        "names = ('execute_model', 'compile_or_warm_up_model')\n"
        "before = [h.decode_query, *(getattr(g.Worker, n) for n in names)]\n"
        "import fusedq_fault_drill as d; d.register(); d.register()\n"
        "after = [h.decode_query, *(getattr(g.Worker, n) for n in names)]\n"
        "print([a is not b and a.__wrapped__ is b for a, b in zip(after, before)])",
        {"FUSEDQ_FAULT_DRILL_OOB_AFTER": "3", "FUSEDQ_FAULT_DRILL_KILL_AFTER": "2"},
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[True, True, True]"  # each wrapped once, twice registered
    assert "fault drill: armed: decode query call 3 after warm-up" in done.stderr
    assert "fault drill: armed: rank 1 is SIGKILLed at model step 2" in done.stderr


def test_the_drill_plugin_refuses_a_count_that_is_not_positive():
    done = _python(
        "import fusedq_fault_drill as d; d.register()", {"FUSEDQ_FAULT_DRILL_OOB_AFTER": "0"}
    )
    assert done.returncode != 0
    assert "FUSEDQ_FAULT_DRILL_OOB_AFTER='0' must be a positive integer" in done.stderr


@pytest.mark.parametrize("matrix", ["h200-fault-drill", "h200x2-fault-drill"])
def test_the_drill_matrices_plan_the_fault_first_then_a_clean_case(matrix):
    done = run_cli("plan", f"matrices/{matrix}.yaml", timeout=60)
    assert done.returncode == 0, done.stderr
    cases = [line.split()[0] for line in done.stdout.splitlines() if "/tp" in line]
    assert len(cases) == 2 and cases[1].endswith("/clean"), cases
    assert cases[0].endswith(("/fault", "/kill"))


@pytest.mark.parametrize("log", OOB_LOGS, ids=[p.name for p in OOB_LOGS])
def test_the_audit_names_the_drill_fault_first(log: Path):
    dmesg = (FIXTURES / "dmesg_xid31_oob_drill.composed.txt").read_text()

    def kernel_log(argv):
        if argv[0] != "dmesg":
            raise FileNotFoundError(argv[0])
        return subprocess.CompletedProcess(argv, 0, dmesg, "")

    since = datetime(2026, 12, 2, 9, 0, tzinfo=timezone.utc)
    result = audit_logs(
        [log], since=since, include_kernel_log=True, include_gpu_state=False,
        kernel_runner=kernel_log,
    )  # fmt: skip
    found = {(f.signature, f.file.rsplit("/", 1)[-1]) for f in result.findings}
    assert ("cuda-illegal-memory-access", log.name) in found
    assert ("xid", "kernel log (dmesg)") in found and ("mmu-fault", "kernel log (dmesg)") in found
    assert result.verdict.status != "clean"
    assert result.root_cause is not None and ILLEGAL in result.root_cause.text
    reason = failure_reason("server process exited with code 1", result.root_cause, log_tail(log))
    first = reason.splitlines()[0]
    assert ILLEGAL in first and "(root cause" in first
    # The drill's own lines are not findings: only the fault it causes is.
    assert not [f for f in result.findings if "fault drill" in f.text]


# The smoke matrix's CPU server (matrices/smoke.yaml says why each setting), one case, armed.
CPU_DRILL_MATRIX = """
name: drill-cpu
models:
  - {label: tiny-mla, path: "builtin:tiny-mla", num_heads: 8}
engine:
  args: [--enforce-eager, --attention-backend=CPU_MLA, --max-model-len=4096, --max-num-seqs=8]
  env: {VLLM_CPU_KVCACHE_SPACE: "2"}
resources: {accelerator: cpu, cpus_per_rank: 1}
topologies: [{tp: 1, mtp: [0]}]
workloads: [{name: ctx0, prompt_tokens: 1, output_tokens: 32, requests: 1}]
variants:
  - name: armed
    env: {FUSEDQ_FAULT_DRILL_OOB_AFTER: "8"}
    expect:
      - {pattern: "fault drill: armed: decode query call 8", description: the drill's armed line}
timeouts: {placement_s: 300, ready_s: 600, request_s: 120, case_s: 900}
"""


@pytest.mark.slow
@pytest.mark.e2e
def test_the_drill_plugin_loads_in_a_cpu_vllm_serve(tmp_path: Path):
    """The armed plugin in a real CPU server under the orchestrator: every vLLM process logs
    its armed line (the matrix's expectation), the case passes (no CUDA: nothing faults)."""
    target = install_drill(tmp_path / "drill")
    matrix = tmp_path / "drill-cpu.yaml"
    matrix.write_text(CPU_DRILL_MATRIX)
    run_id = f"drill-cpu-{uuid.uuid4().hex[:8]}"
    done = run_cli(
        "run", str(matrix), "--logs-dir", str(tmp_path / "logs"), "--run-id", run_id, "--quiet",
        timeout=900,
        env={"PYTHONPATH": os.pathsep.join([str(target), str(REPO), os.environ.get("PYTHONPATH", "")])},
    )  # fmt: skip
    run_dir = tmp_path / "logs" / run_id
    rows = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert [r["status"] for r in rows] == ["passed"]
    (case_dir,) = (run_dir / "cases").iterdir()
    log = (case_dir / "server.log").read_text()
    assert log.count("fault drill: armed: decode query call 8 after warm-up") >= 2  # API + core
    assert "All workers logged the drill's armed line" in (run_dir / "report.md").read_text()


# --------------------------------------------------------------------------- GPU


def _gpu_memory_used() -> list[int]:
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [int(x) for x in out.split()]


def _gpu_apps() -> list[str]:
    """Processes holding GPU memory, but this test's own."""
    out = subprocess.run(
        ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return [
        line for line in out.splitlines() if line.strip() and line.split(",")[0] != str(os.getpid())
    ]


def _needs_gpus(n: int) -> None:
    import torch

    if not torch.cuda.is_available() or torch.cuda.device_count() < n:
        pytest.skip(f"needs {n} CUDA GPU(s)")
    try:
        import vllm.v1.worker.gpu_worker  # noqa: F401
    except Exception as exc:  # a CPU-only vLLM, or none
        pytest.skip(f"needs a CUDA vLLM: {exc}")


def drill(tmp_path: Path, matrix: str) -> dict:
    """Run one drill matrix under the orchestrator with the plugin installed; return what the
    checks need. The run directory is copied to $OUT when it is set."""
    target = install_drill(tmp_path / "drill")
    before = _gpu_memory_used()
    run_id = f"{matrix}-{uuid.uuid4().hex[:8]}"
    logs = tmp_path / "logs"
    path = os.pathsep.join([str(target), str(REPO), os.environ.get("PYTHONPATH", "")])
    # `python -m`: a GPU host's stack is often installed with pip --target, whose console
    # scripts are not beside the interpreter.
    done = subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "run", f"matrices/{matrix}.yaml",
         "--logs-dir", str(logs), "--run-id", run_id],
        capture_output=True, text=True, cwd=REPO, timeout=900,
        env={**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": path},
    )  # fmt: skip
    run_dir = logs / run_id
    if os.environ.get("OUT"):
        shutil.copytree(run_dir, Path(os.environ["OUT"]) / run_id, dirs_exist_ok=True)
        (Path(os.environ["OUT"]) / f"{run_id}.stdout").write_text(done.stdout + done.stderr)
    rows = {
        r["case_id"]: r
        for r in map(json.loads, (run_dir / "results.jsonl").read_text().splitlines())
    }
    return {"done": done, "run_id": run_id, "dir": run_dir, "rows": rows, "before": before}


def check_drill(d: dict, fault_variant: str, cause: str) -> None:
    """The checks every drill makes, on the run ``drill`` returned."""
    done, rows, run_dir = d["done"], d["rows"], d["dir"]
    assert done.returncode == 1, done.stdout[-3000:] + done.stderr[-3000:]  # a case failed
    (fault_id,) = [c for c in rows if c.endswith(f"/{fault_variant}")]
    (clean_id,) = [c for c in rows if c.endswith("/clean")]
    fault, clean = rows[fault_id], rows[clean_id]
    # The case fails with the root cause first in its reason, named from the real log.
    assert fault["status"] == "failed"
    first = fault["reason"].splitlines()[0]
    assert cause in first and "(root cause" in first, fault["reason"][:2000]
    signatures = {f["signature"] for f in fault["audit"]["findings"]}
    assert signatures & {"cuda-illegal-memory-access", "vllm-engine-dead"}, signatures
    kernel_log = fault["audit"]["searched"]["kernel_log"]
    if kernel_log["audited"] and fault_variant == "fault":  # the Xid of the illegal access
        assert {"xid", "mmu-fault"} & signatures, signatures
    # The next case still ran, and passed on the same GPUs.
    assert clean["status"] == "passed", clean.get("reason")
    assert clean["workloads"]["ctx0"]["mean"]["aggregate_tok_s"] > 0
    # No process of the run outlives it; the GPUs' memory is free again.
    assert not [p for p in marked_processes(RUN_ENV, d["run_id"])], "processes outlived the run"
    assert not _gpu_apps(), _gpu_apps()
    after = _gpu_memory_used()
    assert all(a <= b + 512 for a, b in zip(after, d["before"], strict=True)), (d["before"], after)
    # The report and junit say so.
    md = (run_dir / "report.md").read_text()
    assert f"- **{fault_id}**: {first}" in md
    cases = {t.get("name"): t for t in ET.parse(run_dir / "junit.xml").getroot().iter("testcase")}
    failure = cases[fault_id].find("failure")
    assert failure is not None and cause in failure.get("message", "")
    assert cases[clean_id].find("failure") is None


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.parametrize(
    ("gpus", "matrix", "variant", "cause", "fired"),
    [
        (1, "h200-fault-drill", "fault", ILLEGAL, "fault drill: warm-up done"),
        (2, "h200x2-fault-drill", "kill", WORKER_DIED, "fault drill: rank 1 kills itself"),
    ],
    ids=["illegal_memory_access", "tp2_worker_killed_mid_decode"],
)
def test_gpu_fault_drill(tmp_path: Path, gpus, matrix, variant, cause, fired):
    _needs_gpus(gpus)
    d = drill(tmp_path, matrix)
    check_drill(d, variant, cause)
    # The drill fired where it was meant to: after warm-up, during the measured decode.
    log = next((d["dir"] / "cases").glob(f"*__{variant}")) / "server.log"
    assert fired in log.read_text()
