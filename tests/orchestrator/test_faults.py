"""Fault injection against real `vllm serve` processes (CPU build) placed through a real local
Ray: a server that exits during start-up, one SIGKILLed and one SIGSTOPped mid-measurement, a
port taken between choosing it and binding it, a server that logs an Xid while it serves, a
missing model path, and the orchestrator itself SIGKILLed mid-matrix and resumed. Nothing of
vLLM or Ray is mocked.

One matrix holds the server faults as variants of one topology (the fault is picked by the
variant's env), so one orchestrator run covers them: CI time is dominated by vLLM start-ups.
Faults are injected by a stand-in `vllm` (engine.vllm_bin) that execs the real one after
arranging its fault, so the process the orchestrator watches is the real server.

Every process the test causes carries FAULTS_TEST_MARK in its environment (inherited from the
orchestrator through Ray to the servers), which counts leaks precisely on a machine where other
jobs start and stop vLLM servers of their own.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest
from orch_cli import REPO, VENV_BIN, marked_processes, run_cli, user_environ, wait_for

from orchestrator.cluster.leftovers import RUN_ENV

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MARK = uuid.uuid4().hex
# Run ids of this test run's own: a machine that ran the tests before may still hold Ray
# helpers of that run's killed "faults" run (its dead Ray can start them after that run's last
# look), and a fixed id made this run's leftover reports name them (found running .ci/run
# twice on one machine).
RUN = f"faults-{MARK[:8]}"
MISSING = f"missing-{MARK[:8]}"
# Secrets that match no built-in pattern (no sk-/hf_ prefix): only the run's knowledge of its
# secret values can redact them.
API_KEY = f"apikey{uuid.uuid4().hex}"
HF_TOKEN = f"tok{uuid.uuid4().hex}"
CASE = "tiny-mla/tp1-dcp1-mtp0/{}"
# The faults land on the first measured request, after the warm-up request (which gets
# start-up's patience and absorbs a fresh server's one-time costs): the request timeout bounds
# a warmed server's 32 tokens (well under a second here) and is what the hung case waits.
REQUEST_S = 20
# A real vLLM CPU start-up failure (see test_failure_reason.py): its root cause is this line.
STARTUP_FAILURE_LOG = REPO / "tests/orchestrator/fixtures/audit/vllm_cpu_mtp_draft_amx.log"
ROOT_CAUSE = "ValueError: No common block size for 128 (CPU_MLA: [16]; AMX_MLA: [MultipleOf(32)])."

WRAPPER = """#!{python}
# Stand-in for `vllm`: arranges the fault its FAULT variable names, then execs the real vllm
# (same pid, so the orchestrator watches the real server).
import json, os, signal, socket, sys, time

REAL = {real!r}
STARTUP_FAILURE_LOG = {startup_failure_log!r}
fault = os.environ.get("FAULT", "")
args = sys.argv[1:]
# Secrets in the server log, as a library that echoes its environment would leave them.
print(f"fault-wrapper: {{fault}} HF_TOKEN={{os.environ.get('HF_TOKEN')}} argv {{args}}",
      file=sys.stderr, flush=True)


def after_first_measured_request(sig):
    # A forked watcher signals the server once the first measured completion is being
    # answered (uvicorn logs the access line when the streamed response starts; the first
    # such line is the warm-up's): the fault lands mid-measurement.
    server = os.getpid()
    if os.fork():
        return
    while True:
        time.sleep(0.005)  # tightly: a fast machine streams a request in ~0.1 s
        try:
            with open("server.log", "rb") as f:
                if f.read().count(b"POST /v1/completions") >= 2:
                    break
        except OSError:
            continue
    at = time.time()
    os.kill(server, sig)
    with open("fault-injected.json", "w") as f:
        json.dump({{"signal": int(sig), "at": at, "pid": server}}, f)
    os._exit(0)


if fault == "exit3":
    # What a real vLLM start-up failure logs: its root cause, then ~165 lines of consequences.
    with open(STARTUP_FAILURE_LOG) as f:
        sys.stderr.write(f.read())
    print("fault-wrapper: exiting with code 3 during start-up", file=sys.stderr, flush=True)
    sys.exit(3)
if fault == "xid":
    # What a GPU fault leaves in a server's log, here before a server that then serves its
    # workload in full: the audit fails the case though it measured.
    print("NVRM: Xid (PCI:0000:1b:00): 31, pid=4242, name=python3, Ch 00000008, intr 00000000. "
          "MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_12345000. Fault is of type "
          "FAULT_PDE ACCESS_TYPE_VIRT_READ", file=sys.stderr, flush=True)
if fault == "kill":
    after_first_measured_request(signal.SIGKILL)
if fault == "stop":
    after_first_measured_request(signal.SIGSTOP)
if fault == "clash" and not os.path.exists("clash-injected"):
    # Another process takes the port after the orchestrator chose it: the race a free-port
    # scheme cannot close, since vLLM binds seconds later, after its imports.
    open("clash-injected", "w").close()
    port = int(args[args.index("--port") + 1])
    r, w = os.pipe()
    if os.fork() == 0:
        s = socket.socket()
        s.bind(("127.0.0.1", port))
        s.listen()
        os.write(w, b"1")
        while True:
            time.sleep(3600)
    os.read(r, 1)
    with open("clash-port", "w") as f:
        f.write(str(port))
os.execv(REAL, [REAL, *args])
"""

MATRIX = """
name: faults
models:
  - label: tiny-mla
    path: builtin:tiny-mla
    num_heads: 8
engine:
  vllm_bin: {wrapper}
  args: [--enforce-eager, --attention-backend=CPU_MLA, --max-model-len=4096, --max-num-seqs=8,
         --api-key={api_key}]
  env: {{VLLM_CPU_KVCACHE_SPACE: "2", HF_TOKEN: {hf_token}}}
resources: {{accelerator: cpu, cpus_per_rank: 1}}
topologies: [{{tp: 1, mtp: [0]}}]
# ~1 s of streaming on an idle machine: the window in which the injected faults must land
# (on the first measured request: the one warm-up request before it is the first POST).
workloads: [{{name: ctx0, prompt_tokens: 1, output_tokens: 32, requests: 3}}]
variants:
  - {{name: exit3, env: {{FAULT: exit3}}}}
  - {{name: killed, env: {{FAULT: kill}}}}
  - {{name: clash, env: {{FAULT: clash}}}}
  - {{name: xid, env: {{FAULT: xid}}}}
  - {{name: hang, env: {{FAULT: stop}}}}
timeouts: {{placement_s: 120, ready_s: 900, request_s: {request_s}, case_s: 1500}}
"""


def _env() -> dict[str, str]:
    return {**user_environ(), "PYTHONUNBUFFERED": "1", "FAULTS_TEST_MARK": MARK}


def _orchestrator(*args: str, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=timeout, env={"FAULTS_TEST_MARK": MARK})


def _marked() -> dict[int, dict[str, str]]:
    return marked_processes("FAULTS_TEST_MARK", MARK)


def _at_least_two(pids: list[int]) -> list[int]:
    return pids if len(pids) >= 2 else []


def _rows(run_dir: Path) -> dict[str, dict]:
    rows = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    return {r["case_id"]: r for r in rows}


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    """The whole scenario, once: run 1 (killed during its last case), a new run with a missing
    model while run 1's server is left over, a refused resume, a resume that stops the leftovers."""
    t0 = time.monotonic()
    tmp = tmp_path_factory.mktemp("faults")
    logs = tmp / "logs"
    wrapper = tmp / "vllm-faulty"
    wrapper.write_text(
        WRAPPER.format(
            python=sys.executable,
            real=str(VENV_BIN / "vllm"),
            startup_failure_log=str(STARTUP_FAILURE_LOG),
        )
    )
    wrapper.chmod(0o755)
    matrix = tmp / "faults.yaml"
    matrix.write_text(
        MATRIX.format(wrapper=wrapper, api_key=API_KEY, hf_token=HF_TOKEN, request_s=REQUEST_S)
    )
    run_dir = logs / RUN
    out: dict = {"dir": run_dir, "logs": logs}

    # Run 1: every fault variant; SIGKILL the orchestrator once the last case's server runs.
    with (tmp / "run1.out").open("w") as o, (tmp / "run1.err").open("w") as e:
        run1 = subprocess.Popen(
            [str(VENV_BIN / "orchestrator"), "run", str(matrix), "--logs-dir", str(logs),
             "--run-id", RUN, "--quiet"],
            stdout=o, stderr=e, cwd=REPO, env=_env(),
        )  # fmt: skip
        try:
            hang_case = CASE.format("hang")
            log = run_dir / "orchestrator.log"
            wait_for(
                lambda: log.exists() and f"{hang_case}: starting" in log.read_text(),
                1200, "the last case to start", run1,
            )  # fmt: skip
            # The server and a child of its own (here the fault injector's watcher; in a real
            # crash vLLM's engine core): what a dead driver's Ray does not clean up.
            servers = wait_for(
                lambda: _at_least_two([p for p, v in _marked().items() if v.get("ORCHESTRATOR_CASE") == hang_case]),
                60, "the last case's server and its child", run1,
            )  # fmt: skip
            out["results_at_kill"] = (run_dir / "results.jsonl").read_bytes()
            os.kill(run1.pid, signal.SIGKILL)
            run1.wait(timeout=30)
        finally:
            if run1.poll() is None:
                run1.kill()
    out["run1_code"] = run1.returncode
    out["run1_pid"] = run1.pid
    out["left_servers"] = servers
    out["run1_err"] = (tmp / "run1.err").read_text()
    time.sleep(2)  # let Ray's reaper act on the dead driver before leftovers are counted
    out["left_after_kill"] = _marked()
    # Run 1's processes as seen from then on: the dead driver's Ray, which outlives it, may
    # still start helpers after that first look (found in CI under load: two of them, their
    # pids past a wrap-around of pid_max 32768, named by the next run and missing from the
    # first look; and, on a clean-clone CI run at d91daf4, one that lived only while the next
    # run ran, between two looks). So a thread looks every 0.2 s until the refused resume has
    # reported; each look keeps the processes that carry this test's mark and run 1's id.
    seen = dict(out["left_after_kill"])
    lock = threading.Lock()
    done = threading.Event()

    def look() -> None:
        # By run id, not by the mark: RUN is as much this test's own, and twice (clean-clone CI
        # at ea8e18b) two Ray helpers of run 1 carried its run id but were missed by the mark.
        found = marked_processes(RUN_ENV, RUN)
        with lock:
            seen.update(found)

    def keep_looking() -> None:
        while not done.is_set():
            look()
            done.wait(0.2)

    looker = threading.Thread(target=keep_looking, name="run1-looker", daemon=True)
    looker.start()
    try:
        # A new run while run 1's server is left over: a missing model path fails its case
        # clearly.
        t = time.monotonic()
        out["missing"] = _orchestrator(
            "run", str(matrix), "--logs-dir", str(logs), "--run-id", MISSING, "--quiet",
            "--only", "clash", "--set", "models[0].path=/nonexistent/checkpoint",
        )  # fmt: skip
        out["missing_s"] = time.monotonic() - t
        # Resuming run 1 refuses while its own leftovers run...
        out["refused"] = _orchestrator(
            "run", str(matrix), "--logs-dir", str(logs), "--resume", RUN, "--quiet"
        )
    finally:
        done.set()
        looker.join(timeout=30)
    look()
    out["run1_seen"] = dict(seen)
    out["results_after_refusal"] = (run_dir / "results.jsonl").read_bytes()
    # ...and completes with --kill-leftovers.
    out["resumed"] = _orchestrator(
        "run", str(matrix), "--logs-dir", str(logs), "--resume", RUN, "--quiet",
        "--kill-leftovers",
    )  # fmt: skip
    out["marked_after"] = _marked()
    # A resume of the finished run: nothing left, so nothing starts; the failures still count.
    out["again"] = _orchestrator(
        "run", str(matrix), "--logs-dir", str(logs), "--resume", RUN, "--quiet"
    )
    out["wall_s"] = time.monotonic() - t0
    print(f"\nfault scenario wall time: {out['wall_s']:.0f} s", file=sys.stderr)
    return out


def _explain(out: subprocess.CompletedProcess[str]) -> str:
    return f"rc={out.returncode}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"


def test_run_was_killed_mid_matrix_with_four_cases_finished(faults):
    assert faults["run1_code"] == -signal.SIGKILL
    rows = faults["results_at_kill"].decode().splitlines()
    assert [json.loads(r)["case_id"] for r in rows] == [
        CASE.format(v) for v in ("exit3", "killed", "clash", "xid")
    ], faults["run1_err"][-3000:]


def test_server_exiting_during_startup_fails_its_case_with_the_exit_code(faults):
    row = _rows(faults["dir"])[CASE.format("exit3")]
    assert row["status"] == "failed"
    cause, what, *tail = row["reason"].splitlines()
    # The root cause leads (the audit's, ~165 lines above the log's end), then what happened,
    # then the log's last lines, which end with the wrapper's exit.
    assert cause.startswith(f"{ROOT_CAUSE} (root cause, server.log:"), row["reason"]
    assert "exited with code 3" in what and "before it was ready" in what
    assert tail[0] == "--- last 10 lines of the server log ---"
    assert "exiting with code 3 during start-up" in tail[-1]
    # Its start-up was the server's time, not the orchestrator's overhead (it used to be
    # missing from the timings of a failed start-up).
    waited = float(re.search(r"after ([\d.]+) s", what).group(1))  # rounded to 0.1 s
    assert row["timings"]["startup_s"] >= waited - 0.05, row["timings"]


def test_the_root_cause_leads_in_every_report_and_the_terminal(faults):
    d, case = faults["dir"], CASE.format("exit3")
    md = (d / "report.md").read_text()
    assert f"- **{case}**: {ROOT_CAUSE} (root cause, server.log:" in md
    assert "  ```text\n" in md  # what happened and the log's tail, preformatted
    assert (
        '<pre class="excerpt reason">ValueError: No common block size'
        in (d / "report.html").read_text()
    )
    junit = (d / "junit.xml").read_text()
    assert f'message="case failed: {ROOT_CAUSE} (root cause, server.log:' in junit
    # The resume that finished the run names the earlier attempt's failures with the rest.
    err = faults["resumed"].stderr
    assert f"FAILED {case} (in an earlier attempt): {ROOT_CAUSE}" in err, err[-3000:]
    assert "\n    --- last 10 lines of the server log ---\n" in err


def test_a_resume_with_nothing_left_starts_nothing_and_still_fails(faults):
    out = faults["again"]
    assert out.returncode == 1, _explain(out)  # four cases of the run failed
    assert "nothing left to run" in out.stdout and "4 case(s) failed" in out.stderr
    manifest = json.loads((faults["dir"] / "manifest.json").read_text())
    assert len(manifest["resumes"]) == 1  # it recorded no attempt: it made none


def test_sigkill_mid_measurement_is_noticed_within_5_s(faults):
    row = _rows(faults["dir"])[CASE.format("killed")]
    injected = json.loads(
        (
            faults["dir"] / "cases" / row["case_id"].replace("/", "__") / "fault-injected.json"
        ).read_text()
    )
    assert injected["signal"] == signal.SIGKILL
    assert row["status"] == "failed"
    assert "server died during workload 'ctx0'" in row["reason"], row["reason"]
    assert "killed by SIGKILL" in row["reason"], row["reason"]
    assert row["server"]["exit_code"] == -signal.SIGKILL
    delay = row["server"]["died_noticed_at"] - injected["at"]
    assert 0 <= delay < 5, delay
    # The audit ran on the dead server's log and is part of the row and the case directory.
    assert row["audit"]["searched"]["files"], row["audit"]["searched"]
    case_dir = faults["dir"] / "cases" / row["case_id"].replace("/", "__")
    assert json.loads((case_dir / "audit.json").read_text())["verdict"] == row["audit"]["verdict"]


def test_a_port_taken_before_the_server_binds_it_costs_a_retry_not_the_case(faults):
    row = _rows(faults["dir"])[CASE.format("clash")]
    assert row["status"] == "passed", row["reason"]
    case_dir = faults["dir"] / "cases" / row["case_id"].replace("/", "__")
    taken = int((case_dir / "clash-port").read_text())
    assert row["server"]["port_clashes"] == [taken]
    assert row["server"]["port"] != taken
    assert "Address already in use" in (case_dir / "server-attempt1.log").read_text()
    assert row["workloads"]["ctx0"]["mean"]["aggregate_tok_s"] > 0 and row["errors"] == 0
    # The first attempt's traceback is kept aside, not audited as this server's fault.
    assert row["audit"]["verdict"]["status"] == "clean", row["audit"]["verdict"]


def test_a_hung_server_fails_by_request_timeout_and_is_stopped(faults):
    assert faults["resumed"].returncode == 1, _explain(faults["resumed"])
    row = _rows(faults["dir"])[CASE.format("hang")]
    case_dir = faults["dir"] / "cases" / row["case_id"].replace("/", "__")
    assert json.loads((case_dir / "fault-injected.json").read_text())["signal"] == signal.SIGSTOP
    assert row["status"] == "failed"
    assert f"within the request timeout ({REQUEST_S} s)" in row["reason"], row["reason"]
    # The request timeout was spent measuring, not orchestrating.
    assert row["timings"]["workload_ctx0_s"] >= REQUEST_S, row["timings"]
    # Stopped within the grace period (SIGCONT lets the stopped server act on SIGTERM).
    assert row["timings"]["stop_s"] < 30, row["timings"]
    assert not [p for p, v in faults["marked_after"].items() if v.get("ORCHESTRATOR_CASE")]


def test_an_xid_in_the_log_fails_its_case_though_throughput_was_measured(faults):
    row = _rows(faults["dir"])[CASE.format("xid")]
    assert row["status"] == "failed"
    assert row["workloads"]["ctx0"]["mean"]["aggregate_tok_s"] > 0  # measured, and still failed
    assert row["errors"] == 0
    assert "xid" in row["reason"].lower(), row["reason"]
    report = (faults["dir"] / "report.md").read_text()
    rows = [x for x in report.splitlines() if x.startswith("| tiny-mla |") and "| xid |" in x]
    assert rows and all(x.endswith("| **FAILED** |") for x in rows), rows  # every seed table
    assert f"- **{CASE.format('xid')}**: " in report and "Xid" in report


def test_missing_model_path_fails_clearly_without_starting_vllm(faults):
    out = faults["missing"]
    assert out.returncode == 1, _explain(out)
    row = _rows(faults["logs"] / MISSING)[CASE.format("clash")]
    assert row["reason"] == (
        "model path /nonexistent/checkpoint does not exist on node 127.0.0.1 "
        f"({os.uname().nodename})"
    )
    assert f"FAILED {CASE.format('clash')}: model path /nonexistent/checkpoint" in out.stderr
    case_dir = faults["logs"] / MISSING / "cases" / row["case_id"].replace("/", "__")
    assert not (case_dir / "server.log").exists()


def _named(stderr: str) -> dict[int, str]:
    """The processes of run RUN an orchestrator's leftover report names: pid -> case."""
    return {
        int(pid): case
        for pid, case in re.findall(rf"pid (\d+) \[run {re.escape(RUN)}, ([^]]*)\]", stderr)
    }


def _check_named(stderr: str, faults: dict) -> None:
    named = _named(stderr)
    # Only processes of the killed run (Ray's agents survive their driver's SIGKILL too)...
    assert set(named) <= set(faults["run1_seen"]), (named, faults["run1_seen"])
    # ...and among them processes of the case that was running. (Which ones depends on how
    # far Ray's own cleanup got: its workers notice the dead raylet and take their direct
    # children along, seconds later; the server's children stay.)
    hang = f"case {CASE.format('hang')}"
    assert {p for p, c in named.items() if c == hang} & set(faults["left_servers"]), stderr


def test_leftovers_of_another_run_are_reported_not_touched(faults):
    err = faults["missing"].stderr
    assert "process(es) of crashed runs are still running" in err, err[-3000:]
    _check_named(err, faults)


def test_resume_refuses_while_its_own_leftovers_run(faults):
    out = faults["refused"]
    assert out.returncode == 2, _explain(out)
    assert "process(es) of an earlier attempt of this run are still running" in out.stderr
    assert "--kill-leftovers" in out.stderr
    _check_named(out.stderr, faults)
    assert faults["results_after_refusal"] == faults["results_at_kill"]


def test_resume_with_kill_leftovers_completes_without_loss_or_duplicates(faults):
    out = faults["resumed"]
    assert "leftover process(es) of crashed runs (--kill-leftovers)" in out.stderr, _explain(out)
    _check_named(out.stderr, faults)
    assert "skipped 4 finished case(s)" in out.stdout
    data = (faults["dir"] / "results.jsonl").read_bytes()
    assert data.startswith(faults["results_at_kill"])  # finished rows kept, byte for byte
    ids = [json.loads(x)["case_id"] for x in data.decode().splitlines()]
    assert ids == [CASE.format(v) for v in ("exit3", "killed", "clash", "xid", "hang")]
    manifest = json.loads((faults["dir"] / "manifest.json").read_text())
    assert len(manifest["resumes"]) == 1  # the refused attempt changed nothing
    # The killed attempt's log is kept aside (and was redacted: see the secrets test).
    hang_dir = faults["dir"] / "cases" / CASE.format("hang").replace("/", "__")
    assert "fault-wrapper: stop" in (hang_dir / "server-attempt1.log").read_text()


def test_no_process_is_left_behind(faults):
    assert faults["left_after_kill"], (
        "the killed run left nothing: the leftover tests prove nothing"
    )
    assert not faults["marked_after"], faults["marked_after"]
    # Nor a file: the killed driver's py_modules staging directory went with the next run.
    assert not list(Path(tempfile.gettempdir()).glob(f"orch-ship-{faults['run1_pid']}-*"))


def test_secrets_are_written_nowhere(faults):
    secrets = (API_KEY.encode(), HF_TOKEN.encode())
    written = [p for d in (faults["dir"], faults["logs"] / MISSING) for p in d.rglob("*")]
    files = [p for p in written if p.is_file()]
    names = {p.name for p in files}
    for expected in ("server.log", "server-attempt1.log", "orchestrator.log", "report.md",
                     "report.html", "report.json", "junit.xml", "results.jsonl", "manifest.json",
                     "audit.json"):  # fmt: skip
        assert expected in names, expected
    leaks = [str(p) for p in files if any(s in p.read_bytes() for s in secrets)]
    assert not leaks
    for key in ("missing", "refused", "resumed", "again"):
        assert not any(s.decode() in faults[key].stdout + faults[key].stderr for s in secrets)
    # The raw logs did hold them (the wrapper printed the token): redaction did the work.
    clash_dir = faults["dir"] / "cases" / CASE.format("clash").replace("/", "__")
    assert "HF_TOKEN=*** " in (clash_dir / "server.log").read_text()
    manifest = json.loads((faults["dir"] / "manifest.json").read_text())
    assert "--api-key=***" in manifest["matrix_text"] and "HF_TOKEN: ***" in manifest["matrix_text"]
