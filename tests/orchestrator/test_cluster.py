"""`orchestrator run` on a multi-node Ray cluster simulated on this machine: real `vllm serve`
(CPU build) on nodes that are not the driver's, a node killed mid-case, the driver killed
mid-case, and what the next runs find. Nothing of vLLM or Ray is mocked.

The cluster is `ray.cluster_utils.Cluster`: a head node (the driver's; no CPUs or GPUs, so no
server lands there) and two worker nodes with two declared GPUs each (placement bookkeeping, as
gpu-check's local test does; the servers run on CPU). Each node has its own address on loopback
(127.0.0.2, 127.0.0.3: Ray takes any address the host can bind) and its own temp directory
(TMPDIR of its raylet, inherited by its workers), so a server on a node binds and writes where a
remote node's would. What one machine cannot show is in docs/cluster.md.

One matrix, one scenario (CI time is vLLM start-ups): run `cluster` places case `lost` on one
node and that node goes down (every process of it killed, then removed from Ray) while its first
request streams; case `served` lands on the other node and passes; the driver is SIGKILLed while
case `orphaned` starts there, once that server's engine core runs. Around it: a topology too big
for any node, gpu-check's bundles side by side on both nodes, a resume refused for the orphan
(found on its node), and a loopback-bound run that stops the orphan (--kill-leftovers) and is
refused the remote node.

Neither fault can be overtaken by its case finishing: the test SIGSTOPs the driver (the only
process that sends requests, records results and stops servers) at a state it observes, does
the damage, and only then lets the driver go on or kills it (see `scenario`). A case of a
stopped driver cannot end on its own. The one thing left to this machine's speed, that the
driver is stopped before it has sent `lost`'s last requests, is checked there, not assumed.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil
import pytest
from orch_cli import REPO, VENV_BIN, marked_processes, run_cli, user_environ, wait_for

from orchestrator.cluster.gpucheck_worker import MARKER
from orchestrator.common.redact import redact_text

pytestmark = [pytest.mark.slow, pytest.mark.e2e]

MARK_ENV = "CLUSTER_TEST_MARK"
MARK = uuid.uuid4().hex
NODES = ("127.0.0.2", "127.0.0.3")
CASE = "tiny-mla/tp1-dcp1-mtp0/{}"
OBJECT_STORE = 80 * 1024 * 1024  # Ray's floor is ~75 MiB; servers need the memory
# ctx0's requests, one at a time (the driver sends the next when one has ended). Eight, not
# four: on a loaded 2-core machine the driver once saw the first request's log line only
# after all four had been served, and the node was then not lost mid-case.
REQUESTS = 8
# vLLM's engine core says so once it has its front-end's addresses; from then on it outlives
# its API server (Ray takes that along with the dead driver's actor) and is what is left over.
ENGINE_CORE = re.compile(r"\(EngineCore pid=(\d+)\) .*Initializing a V1 LLM engine")

# Stand-in for `vllm`: notes where it runs (in its working directory, which must come back
# with the log; the test finds a server's directory on its node by its port), then execs the
# real vllm (same pid: the orchestrator watches the real server).
WRAPPER = """#!{python}
import json, os, sys
args = sys.argv[1:]
with open("where.json", "w") as f:
    json.dump({{"cwd": os.getcwd(), "tmpdir": os.environ.get("TMPDIR"),
               "host": args[args.index("--host") + 1],
               "port": int(args[args.index("--port") + 1]), "pid": os.getpid(),
               "node": os.environ.get("ORCHESTRATOR_NODE")}}, f)
os.execv({real!r}, [{real!r}, *args])
"""

MATRIX = """
name: cluster
models: [{{label: tiny-mla, path: "builtin:tiny-mla", num_heads: 8}}]
engine:
  vllm_bin: {wrapper}
  args: [--enforce-eager, --attention-backend=CPU_MLA, --max-model-len=4096, --max-num-seqs=8]
  env: {{VLLM_CPU_KVCACHE_SPACE: "2"}}
resources: {{accelerator: gpu}}
topologies: [{{tp: 1}}]
# Short (a few seconds): no fault needs it to be long, the driver is stopped for each.
workloads: [{{name: ctx0, prompt_tokens: 1, output_tokens: 256, requests: {requests}}}]
variants: [{{name: lost}}, {{name: served}}, {{name: orphaned}}]
host: node
warmup_requests: 0
timeouts: {{placement_s: 120, ready_s: 600, request_s: 120, case_s: 900}}
"""


def _marked() -> dict[int, dict[str, str]]:
    return marked_processes(MARK_ENV, MARK)


def _case_pids(case: str) -> list[int]:
    return [p for p, v in _marked().items() if v.get("ORCHESTRATOR_CASE") == CASE.format(case)]


def _read(path: Path) -> str:
    return path.read_text(errors="replace") if path.exists() else ""


def _server_on_node(node_tmp: Path, port: int) -> dict | None:
    """What the wrapper noted of the server on `port`, read in that node's own case directory
    (where its log is written first): None until the server has started."""
    for where in node_tmp.glob("orch-case-*/where.json"):
        try:
            noted = json.loads(where.read_text())
        except (OSError, ValueError):  # being written
            continue
        if noted["port"] == port:
            return noted
    return None


def _power_off(cluster, node, also: list[int]) -> None:
    """Take `node` down as a lost machine goes: every process of it at once, its server too.

    `Cluster.remove_node` alone kills Ray's processes of the node but not the server its
    worker started, nor, for some seconds, that worker: the server went on answering the
    driver's requests (two of four, once) until the watch saw the worker go. Here the
    raylet and everything under it (workers, agents, the server and its engine core), with
    `also` (the case's marked processes, should one have left that tree), are stopped first,
    so none can fork past the snapshot, then killed; then Ray removes the node.
    """
    from ray._private import ray_constants

    raylet = node.all_processes[ray_constants.PROCESS_TYPE_RAYLET][0].process.pid
    held: dict[int, psutil.Process] = {}
    todo = [raylet, *also]
    while todo:
        for pid in todo:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc = psutil.Process(pid)
                proc.suspend()
                held[pid] = proc
        todo = []
        for proc in list(held.values()):
            with contextlib.suppress(psutil.NoSuchProcess):
                todo += [c.pid for c in proc.children(recursive=True) if c.pid not in held]
    for pid, proc in held.items():
        if pid != raylet:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
    cluster.remove_node(node, allow_graceful=False)  # the raylet, the node's daemons, Ray's books


def _start_cluster(node_tmp: dict[str, Path]):
    """Head on 127.0.0.1 (the driver's node), a worker node on each of NODES."""
    saved = {
        k: os.environ.get(k)
        for k in ("TMPDIR", MARK_ENV, "RAY_USAGE_STATS_ENABLED", "TRITON_INTERPRET")
    }
    os.environ[MARK_ENV] = MARK  # inherited by every raylet, worker and server
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    # The nodes' processes get a user's environment, as the orchestrator's do (orch_cli): not
    # the test run's TRITON_INTERPRET, which put every server's decode query in Triton's
    # interpreter (2-core AVX2 host, 2026-12-03: 256 tokens outlasted the 120 s request timeout).
    os.environ.pop("TRITON_INTERPRET", None)
    try:
        from ray.cluster_utils import Cluster

        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "node_ip_address": "127.0.0.1",
                "num_cpus": 0,
                "num_gpus": 0,
                "include_dashboard": False,
                "object_store_memory": OBJECT_STORE,
            },
        )
        nodes = {}
        for ip in NODES:
            os.environ["TMPDIR"] = str(node_tmp[ip])  # this node's own /tmp
            nodes[ip] = cluster.add_node(
                node_ip_address=ip, num_cpus=2, num_gpus=2, object_store_memory=OBJECT_STORE
            )
        cluster.wait_for_nodes()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return cluster, nodes


@pytest.fixture(scope="module")
def scenario(tmp_path_factory):
    t0 = time.monotonic()
    tmp = tmp_path_factory.mktemp("cluster")
    logs = tmp / "logs"
    wrapper = tmp / "vllm-where"
    wrapper.write_text(WRAPPER.format(python=sys.executable, real=str(VENV_BIN / "vllm")))
    wrapper.chmod(0o755)
    matrix = tmp / "cluster.yaml"
    matrix.write_text(MATRIX.format(wrapper=wrapper, requests=REQUESTS))
    # Short, as a node's /tmp is: a server's case directory (and its TMPDIR) fit under it.
    node_tmp = {ip: Path(tempfile.mkdtemp(prefix="orch-test-node-", dir="/tmp")) for ip in NODES}
    cluster, nodes = _start_cluster(node_tmp)
    out: dict = {"node_tmp": node_tmp, "dir": logs / "cluster", "logs": logs, "matrix": matrix}
    out["address"] = cluster.address
    env = {MARK_ENV: MARK}

    def orchestrator(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
        base = ["run", str(matrix), "--ray-address", cluster.address, "--logs-dir", str(logs)]
        return run_cli(*base, "--quiet", *args, timeout=timeout, env=env)

    try:
        out["cluster_s"] = time.monotonic() - t0
        t = time.monotonic()
        out["big"] = orchestrator("--run-id", "big", "--set", "topologies[0].tp=4")
        out["big_s"] = time.monotonic() - t
        out["gpucheck_dir"] = tmp / "gpu-check"
        out["gpucheck"] = run_cli(
            "gpu-check", "--ray-address", cluster.address, "--tp", "1,2", "--allow-cpu",
            "--out", str(out["gpucheck_dir"]), timeout=600, env=env,
        )  # fmt: skip

        run_dir = out["dir"]
        with (tmp / "run.out").open("w") as o, (tmp / "run.err").open("w") as e:
            run = subprocess.Popen(
                [str(VENV_BIN / "orchestrator"), "run", str(matrix), "--ray-address",
                 cluster.address, "--logs-dir", str(logs), "--run-id", "cluster", "--quiet"],
                stdout=o, stderr=e, cwd=REPO, env={**user_environ(), **env},
            )  # fmt: skip
            try:
                log = run_dir / "orchestrator.log"
                starting = re.compile(r"/(\w+): starting on (\S+) port (\d+)")

                def started(case: str) -> tuple[str, int] | None:
                    found = {c: (ip, int(p)) for c, ip, p in starting.findall(_read(log))}
                    return found.get(case)

                placed, port = wait_for(lambda: started("lost"), 900, "case lost to start", run)
                noted = wait_for(
                    lambda: _server_on_node(node_tmp[placed], port), 300,
                    "case lost's server to start", run,
                )  # fmt: skip
                lost_log = Path(noted["cwd"]) / "server.log"
                # Mid-measurement: the first completion is being streamed. Read in the node's
                # own log, where the server writes it, polled tightly: the copy in the run
                # directory lags by its copy interval, and on a fast machine all eight
                # requests had been served before the copy showed the first.
                wait_for(
                    lambda: "POST /v1/completions" in _read(lost_log), 900,
                    "case lost's first request", run, interval=0.005,
                )  # fmt: skip
                # Why the node is lost mid-case, however slow this machine is: the driver is
                # stopped while fewer than REQUESTS - 1 requests are logged (the one it may
                # have sent last may not be logged yet), so at least one is never sent before
                # the node, its server with it, is gone; it runs again only then, and finds
                # nothing on that node to answer. (Before, the node was removed while the
                # driver ran on, and the server, which outlives Ray's removal of its node for
                # seconds, could serve the rest of the workload first.)
                os.kill(run.pid, signal.SIGSTOP)
                try:
                    sent = _read(lost_log).count("POST /v1/completions")
                    assert sent <= REQUESTS - 2, (
                        f"case lost: {sent} of {REQUESTS} requests logged before the driver "
                        "could be stopped; the node would not be lost mid-case"
                    )
                    out["killed_at"] = time.time()
                    _power_off(cluster, nodes[placed], _case_pids("lost"))
                    out["victim"] = placed
                    out["lost_node_log"] = _read(lost_log)  # all the node ever wrote of it
                finally:
                    os.kill(run.pid, signal.SIGCONT)
                ip, port = wait_for(
                    lambda: started("orphaned"), 900, "case orphaned to start", run
                )  # fmt: skip
                # Why the driver is killed mid-case: it is stopped as soon as it says the
                # server is starting (before it waits for it to be ready, so before any result
                # of this case can be written) and stays stopped until it is killed. The
                # server starts up meanwhile on its own, until its engine core runs: the
                # process Ray does not take along with the dead driver (it takes its
                # workers' direct children, the API server), so the leftover outlives the
                # kill. (Before, the driver was killed as soon as the server had a second
                # process, often vLLM's short-lived model-registry subprocess: when that had
                # ended before the resume looked, nothing was left and the resume ran the
                # case through.)
                os.kill(run.pid, signal.SIGSTOP)
                out["results_at_kill"] = (run_dir / "results.jsonl").read_bytes()
                noted = wait_for(
                    lambda: _server_on_node(node_tmp[ip], port), 300,
                    "case orphaned's server to start", run,
                )  # fmt: skip
                server_log = Path(noted["cwd"]) / "server.log"

                def engine_core() -> int | None:
                    if found := ENGINE_CORE.search(_read(server_log)):
                        return int(found[1])
                    if not psutil.pid_exists(noted["pid"]):
                        raise AssertionError(f"case orphaned's server exited:\n{_read(server_log)}")
                    return None

                engine = wait_for(engine_core, 600, "case orphaned's engine core", run)
                # The server and its engine core, with the case's processes this test can
                # see (the engine core's title can hide its environment from /proc).
                out["orphans"] = sorted({noted["pid"], engine, *_case_pids("orphaned")})
                os.kill(run.pid, signal.SIGKILL)
                run.wait(timeout=30)
            finally:
                if run.poll() is None:
                    run.kill()
        out["run_code"] = run.returncode
        out["run_err"] = _read(tmp / "run.err") + _read(run_dir / "orchestrator.log")
        time.sleep(2)  # Ray ends the dead driver's actors; the engine core outlives them

        out["refused"] = orchestrator("--resume", "cluster")
        out["results_after_refusal"] = (run_dir / "results.jsonl").read_bytes()
        out["loopback"] = orchestrator(
            "--run-id", "loopback", "--only", "served", "--set", "host=127.0.0.1",
            "--kill-leftovers",
        )  # fmt: skip
        out["marked_after"] = _marked()
    finally:
        cluster.shutdown()
        for d in node_tmp.values():  # what a lost node and a killed driver left there
            shutil.rmtree(d, ignore_errors=True)
    out["wall_s"] = time.monotonic() - t0
    print(f"\ncluster scenario wall time: {out['wall_s']:.0f} s", file=sys.stderr)
    lost = _rows(out["dir"]).get(CASE.format("lost"), {}).get("server", {})
    if "died_noticed_at" in lost:
        noticed = lost["died_noticed_at"] - out["killed_at"]
        print(f"node loss noticed {noticed:.1f} s after the node was removed", file=sys.stderr)
    return out


def _explain(out: subprocess.CompletedProcess[str]) -> str:
    return f"rc={out.returncode}\nstdout:\n{out.stdout[-3000:]}\nstderr:\n{out.stderr[-5000:]}"


def _rows(run_dir: Path) -> dict[str, dict]:
    rows = [json.loads(x) for x in (run_dir / "results.jsonl").read_text().splitlines()]
    return {r["case_id"]: r for r in rows}


def _case_dir(scenario: dict, case: str) -> Path:
    return scenario["dir"] / "cases" / f"tiny-mla__tp1-dcp1-mtp0__{case}"


def test_a_topology_no_node_can_hold_is_refused_before_anything_starts(scenario):
    out = scenario["big"]
    assert out.returncode == 2, _explain(out)
    # Four GPUs in the cluster, but two per node: a TP4 bundle has nowhere to go.
    assert out.stderr.strip().splitlines()[-1] == (
        f"orchestrator: {scenario['matrix']}: topologies[0].tp=4 needs 4 GPUS on one node; "
        "the largest node of this "
        f"Ray cluster ({scenario['address']}) has 2"
    )
    assert not (scenario["logs"] / "big").exists()
    assert scenario["big_s"] < 60


def test_cases_ran_on_two_nodes_other_than_the_drivers(scenario):
    assert scenario["run_code"] == -signal.SIGKILL, scenario["run_err"][-3000:]
    rows = _rows(scenario["dir"])
    assert sorted(rows) == [CASE.format("lost"), CASE.format("served")], scenario["run_err"]
    lost, served = rows[CASE.format("lost")]["server"], rows[CASE.format("served")]["server"]
    assert lost["node_ip"] == scenario["victim"]
    assert {lost["node_ip"], served["node_ip"]} == set(NODES)
    manifest = json.loads((scenario["dir"] / "manifest.json").read_text())
    assert sorted((n["node_ip"], n["gpus"]) for n in manifest["cluster"]["nodes"]) == [
        ("127.0.0.1", 0),
        *((ip, 2) for ip in NODES),
    ]


def test_a_server_on_another_node_binds_and_is_reached_on_its_address(scenario):
    row = _rows(scenario["dir"])[CASE.format("served")]
    assert row["status"] == "passed", row["reason"]
    node = row["server"]["node_ip"]
    argv = row["server"]["argv"]
    assert argv[argv.index("--host") + 1] == node
    assert row["workloads"]["ctx0"]["mean"]["aggregate_tok_s"] > 0 and row["errors"] == 0


def test_logs_audit_and_files_come_back_from_the_node(scenario):
    row = _rows(scenario["dir"])[CASE.format("served")]
    case_dir = _case_dir(scenario, "served")
    # The server ran in a case directory of its node's own (under that node's TMPDIR, its
    # temp files too), which was removed once its files had come back.
    where = json.loads((case_dir / "where.json").read_text())
    own = Path(where["cwd"])
    assert own.parent == scenario["node_tmp"][row["server"]["node_ip"]]
    assert Path(where["tmpdir"]) == own / "tmp" and where["node"] == row["server"]["node_id"]
    assert not own.exists()
    log = (case_dir / "server.log").read_text()
    assert "fusedq: fused MLA query" in log and "POST /v1/completions" in log
    assert json.loads((case_dir / "audit.json").read_text())["verdict"]["status"] == "clean"
    assert row["audit"]["searched"]["files"][0]["bytes"] == (case_dir / "server.log").stat().st_size
    assert (case_dir / "requests-ctx0.jsonl").read_text().count("\n") == REQUESTS


def test_a_node_lost_mid_case_fails_that_case_by_name_and_keeps_what_came_before(scenario):
    row = _rows(scenario["dir"])[CASE.format("lost")]
    victim = scenario["victim"]
    assert row["status"] == "failed"
    named = rf"^server died during workload 'ctx0' \(.*\): node {re.escape(victim)} \(\S+\) "
    assert re.match(named + "(stopped answering|left the Ray cluster)", row["reason"]), row
    assert 0 <= row["server"]["died_noticed_at"] - scenario["killed_at"] < 15
    case_dir = _case_dir(scenario, "lost")
    # The log as far as it had come from the node before the node went, audited: what the
    # node wrote, from its start, redacted as every log is, nothing else changed or lost in
    # between. (How far it got is the mirror's poll against the driver's stop: the first
    # request's line may be on the node only.)
    log = (case_dir / "server.log").read_text()
    node = scenario["lost_node_log"]
    redacted = "".join(redact_text(line) for line in node.splitlines(keepends=True))
    assert "fusedq: fused MLA query" in log and redacted.startswith(log)
    assert "POST /v1/completions" in node
    audit = json.loads((case_dir / "audit.json").read_text())
    assert audit["searched"]["files"][0]["bytes"] == (case_dir / "server.log").stat().st_size
    # The node's kernel log could not be read any more; the audit says so instead of reading
    # the driver's.
    assert "was lost during the case" in audit["searched"]["kernel_log"]["reason"]
    assert (case_dir / "requests-ctx0.jsonl").exists()
    # The run went on: the next case ran on the other node and passed.
    assert _rows(scenario["dir"])[CASE.format("served")]["status"] == "passed"


def test_a_resume_is_refused_while_its_leftover_runs_on_a_node(scenario):
    out = scenario["refused"]
    assert out.returncode == 2, _explain(out)
    assert "process(es) of an earlier attempt of this run are still running" in out.stderr
    node = next(ip for ip in NODES if ip != scenario["victim"])
    named = re.findall(r"pid (\d+) on (\S+) \[run cluster, case ([^]]*)\]", out.stderr)
    assert {int(p) for p, n, c in named if n == node and c == CASE.format("orphaned")} & set(
        scenario["orphans"]
    ), out.stderr
    assert scenario["results_after_refusal"] == scenario["results_at_kill"]


def test_kill_leftovers_stops_them_on_their_node_and_loopback_is_refused_there(scenario):
    out = scenario["loopback"]
    assert out.returncode == 1, _explain(out)
    assert "leftover process(es) of crashed runs (--kill-leftovers)" in out.stderr
    assert re.search(r"pid \d+ on 127\.0\.0\.\d \[run cluster, case [^]]*orphaned\]", out.stderr)
    node = next(ip for ip in NODES if ip != scenario["victim"])
    row = _rows(scenario["logs"] / "loopback")[CASE.format("served")]
    assert row["reason"] == (
        f"LaunchError: {CASE.format('served')}: placed on node {node} but binds 127.0.0.1; set "
        "host: node (that node's cluster address) or host: 0.0.0.0 in the matrix, or run the "
        "orchestrator on that node"
    )
    # No server of any case is left, on any node.
    assert not [p for p, v in scenario["marked_after"].items() if v.get("ORCHESTRATOR_CASE")]


def test_gpu_check_places_bundles_side_by_side_on_every_node(scenario):
    out = scenario["gpucheck"]
    assert out.returncode == 0, _explain(out)
    assert "not copied" not in out.stderr  # each bundle's log from its own directory
    result = json.loads((scenario["gpucheck_dir"] / "gpu-check.json").read_text())
    by_tp = {r["tp"]: r["bundles"] for r in result["rounds"]}
    # Two 1-GPU bundles on each node, each with its own GPU; then one 2-GPU bundle per node,
    # whose two ranks gather the fused query over gloo.
    tp1 = sorted((b["node_ip"], b["cuda_visible_devices"]) for b in by_tp[1])
    assert tp1 == [(ip, gpu) for ip in NODES for gpu in ("0", "1")]
    assert sorted(b["node_ip"] for b in by_tp[2]) == list(NODES)
    assert all(b["dcp"]["ok"] and b["dcp"]["world"] == 2 for b in by_tp[2])
    for tp, bundles in by_tp.items():
        for b in bundles:
            log = scenario["gpucheck_dir"] / f"tp{tp}-{b['bundle']}.log"
            assert MARKER in log.read_text(), log
