"""Multi-node pieces that need no cluster: which node's report of a process is kept, an agent's
answer as a subprocess result, the placement check against alive nodes, the bind address on
another node, and a remote server's case directory copied back through its actor's methods
(called in this process: what is tested is how the launcher reads them, not Ray)."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from orchestrator.cluster import leftovers as lo
from orchestrator.cluster.launch import (
    NODE_HOST,
    Launcher,
    LaunchError,
    ServerHandle,
    _loopback_address,
    describe_nodes,
    fits_a_node,
)
from orchestrator.cluster.nodes import NODE_COMMANDS, _NodeAgent, completed, pick_reports
from orchestrator.cluster.server_actor import ServerActor
from orchestrator.config.schema import Matrix
from orchestrator.engines import engine_for
from orchestrator.execution.leftover_check import LeftoverError, handle_leftovers

DEAD_DRIVER = f"{socket.gethostname()}:{os.getpid()}:0"


def _left(pid: int, node: str, started_by: str | None = None, run: str = "r") -> lo.Leftover:
    return lo.Leftover(pid, run, "m/tp1/v", DEAD_DRIVER, "vllm serve", node, started_by)


def test_one_report_per_process_from_the_node_that_started_it() -> None:
    same = "boot/pid:[1]"
    scans = [
        ({"machine": same, "node_id": "A"}, [_left(7, "127.0.0.1", "B"), _left(8, "127.0.0.1")]),
        ({"machine": same, "node_id": "B"}, [_left(7, "127.0.0.2", "B"), _left(8, "127.0.0.2")]),
        ({"machine": "other/pid:[1]", "node_id": "C"}, [_left(7, "10.0.0.3", "C")]),
    ]
    kept = {(m, p.pid): p.node for m, p in pick_reports(scans)}
    # pid 7 of the shared machine is B's (it carries B's id); pid 8 the first scan's; the
    # other machine's pid 7 is another process.
    assert kept == {
        (same, 7): "127.0.0.2",
        (same, 8): "127.0.0.1",
        ("other/pid:[1]", 7): "10.0.0.3",
    }


def test_marked_processes_carry_the_node_that_started_them(tmp_path: Path) -> None:
    env = {**os.environ, lo.RUN_ENV: "r", lo.DRIVER_ENV: DEAD_DRIVER, lo.NODE_ENV: "node-b"}
    env[lo.CASE_ENV] = "m/tp1/v"
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=env)
    try:
        end = time.monotonic() + 10
        while time.monotonic() < end and not lo._environ(p.pid, lo.PROC):
            time.sleep(0.01)
        (mine,) = [x for x in lo.marked_processes(node="10.0.0.2") if x.pid == p.pid]
        assert (mine.node, mine.started_by) == ("10.0.0.2", "node-b")
        assert mine.describe().startswith(f"pid {p.pid} on 10.0.0.2 [run r, case m/tp1/v] ")
        assert p.pid in {x.pid for x in lo.find_leftovers()}
    finally:
        p.kill()
        p.wait()
    assert lo.machine_id() == lo.machine_id() and "/" in lo.machine_id()


def test_agent_answers_become_subprocess_results() -> None:
    agent = _NodeAgent()
    answer = {"returncode": 1, "stdout": "", "stderr": "dmesg: read kernel buffer failed"}
    done = completed(["dmesg"], answer)
    assert (done.args, done.returncode, done.stderr) == (["dmesg"], 1, answer["stderr"])
    real = completed(["dmesg", "--version"], agent.run(["dmesg", "--version"]))
    assert real.returncode == 0 and "dmesg" in real.stdout
    with pytest.raises(FileNotFoundError):
        completed(["nvidia-smi"], {"missing": True})
    # Only the fault-source readers run on a node for the driver.
    assert {"journalctl", "dmesg", "nvidia-smi"} == NODE_COMMANDS
    with pytest.raises(ValueError, match="not a node command"):
        agent.run(["rm", "-rf", "/"])
    assert agent.drivers_alive([lo.driver_tag(), DEAD_DRIVER]) == {
        lo.driver_tag(): True,
        DEAD_DRIVER: False,
    }


def test_leftovers_are_found_and_stopped_through_what_the_run_is_given() -> None:
    found = [_left(11, "10.0.0.2", run="run-a"), _left(12, "10.0.0.3", run="run-b")]
    stopped: list[list[lo.Leftover]] = []
    logged: list[str] = []

    def stop(ps: list[lo.Leftover]) -> list[lo.Leftover]:
        stopped.append(list(ps))
        return []

    with pytest.raises(LeftoverError, match=re.escape("pid 11 on 10.0.0.2 [run run-a")):
        handle_leftovers(
            "run-a", resuming=True, kill=False, log=logged.append, find=lambda: found, stop=stop
        )
    assert not stopped
    got = handle_leftovers(
        "run-a", resuming=True, kill=True, log=logged.append, find=lambda: found, stop=stop
    )
    assert got == found and stopped == [found]
    assert "pid 12 on 10.0.0.3 [run run-b" in logged[-1]


def test_placement_is_checked_against_the_alive_nodes() -> None:
    nodes = [
        {"node_ip": "10.0.0.2", "gpus": 1, "cpus": 8},
        {"node_ip": "10.0.0.3", "gpus": 1, "cpus": 8},
    ]
    assert fits_a_node({"GPU": 1.0, "CPU": 1.0}, nodes)
    # Two GPUs in the cluster, but not on one node: STRICT_PACK cannot place it.
    assert not fits_a_node({"GPU": 2.0, "CPU": 1.0}, nodes)
    assert not fits_a_node({"CPU": 1.0}, [])
    assert describe_nodes(nodes) == "10.0.0.2 with 1 GPUs, 8 CPUs; 10.0.0.3 with 1 GPUs, 8 CPUs"
    assert describe_nodes([]) == "no node"


def test_a_loopback_cluster_address_is_recognised() -> None:
    assert _loopback_address("127.0.0.1:6379") and _loopback_address("localhost:1")
    assert not _loopback_address("10.0.0.1:6379") and not _loopback_address("auto")


def _launcher(host: str) -> tuple[Launcher, ServerHandle]:
    matrix = Matrix.model_validate(
        {
            "name": "m",
            "models": [{"label": "x", "path": "/x", "num_heads": 8}],
            "topologies": [{"tp": 1}],
            "workloads": [{"name": "w", "prompt_tokens": 1, "output_tokens": 1}],
            "host": host,
        }
    )
    lau = Launcher(matrix, log=lambda m: None)
    lau.driver_node_id = "driver"
    case = SimpleNamespace(case_id="x/tp1-dcp1-mtp0/default")
    info = {"node_id": "other", "node_ip": "10.0.0.3"}
    return lau, ServerHandle(case=case, actor=None, placement_group=None, info=info)


def test_bind_address_on_another_node() -> None:
    lau, h = _launcher(NODE_HOST)
    assert lau.is_remote(h) and lau.bind_host(h) == "10.0.0.3"
    lau, h = _launcher("0.0.0.0")
    assert lau.bind_host(h) == "0.0.0.0"
    lau, h = _launcher("127.0.0.1")
    with pytest.raises(LaunchError) as info:
        lau.bind_host(h)
    assert str(info.value) == (
        "x/tp1-dcp1-mtp0/default: placed on node 10.0.0.3 but binds 127.0.0.1; set host: node "
        "(that node's cluster address) or host: 0.0.0.0 in the matrix, or run the "
        "orchestrator on that node"
    )
    h.info["node_id"] = "driver"  # the driver's own node: loopback is fine there
    assert lau.bind_host(h) == "127.0.0.1"


def test_a_lost_nodes_kernel_log_is_not_waited_for() -> None:
    lau, h = _launcher(NODE_HOST)
    h.lost = "ActorUnavailableError: connection refused"
    with pytest.raises(OSError, match="node other was lost during the case"):
        lau.node_runner(h)(["dmesg"])
    h.info["node_id"] = "driver"  # read here, as on one machine
    assert lau.node_runner(h) is None and lau.node_runner(None) is None


def _direct(actor: ServerActor) -> SimpleNamespace:
    """The actor's methods as Ray handles would offer them (`.remote` returns the answer)."""
    return SimpleNamespace(
        **{
            name: SimpleNamespace(remote=getattr(actor, name))
            for name in dir(actor)
            if not name.startswith("_")
        }
    )


def test_a_remote_servers_log_and_files_come_back_and_its_directory_goes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    node_tmp = tmp_path / "node-tmp"  # the other node's /tmp
    node_tmp.mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(node_tmp))
    run_case = tmp_path / "run" / "cases" / "c"
    run_case.mkdir(parents=True)
    lau, h = _launcher(NODE_HOST)
    lau._ray = SimpleNamespace(get=lambda answer, timeout: answer)
    actor = ServerActor(engine_for("vllm"))
    h.actor = _direct(actor)
    h.info.update(node_id="other", node_ip="127.0.0.3")  # bindable here
    server = (
        "import os, sys\n"
        "os.makedirs('profile'); open('profile/trace.json', 'w').write('{}')\n"
        "open(os.path.join(os.environ['VLLM_CACHE_ROOT'], 'kernel.bin'), 'w').write('x')\n"
        "print('tmp', os.environ['TMPDIR'], 'cache', os.environ['VLLM_CACHE_ROOT'], flush=True)\n"
        "print('host', os.environ.get('VLLM_HOST_IP'), 'node', os.environ['ORCHESTRATOR_NODE'])\n"
        "sys.stdout.write('x' * 3_000_000)\n"
    )
    from orchestrator.engines.vllm.server import serve_env

    env = serve_env({}, host=NODE_HOST, run_dir=run_case, extra={"VLLM_TORCH_PROFILER_DIR": "p"})
    seen = []  # the case directory the argv is built with: the node's (a profiler's path)

    def argv_for(port: int, host: str) -> list[str]:
        seen.append(h.info["case_dir"])
        return [sys.executable, "-c", server]

    lau.start(h, argv_for, env, run_case / "server.log")
    own = Path(h.info["node_case_dir"])
    assert own.parent == node_tmp and h.mirror == run_case / "server.log"
    assert seen == [str(own)]
    while lau.exit_code(h) is None:
        time.sleep(0.05)
    # The profile phase watches the traces grow there, before they come home.
    assert lau.case_files(h) == {"profile/trace.json": 2}
    lau.fetch_log(h)
    text = (run_case / "server.log").read_text()
    # Caches and temp files in the node's own case directory, not at the driver's paths; this
    # deep one gets a short TMPDIR stand-in (IPC socket paths), worked out on the node.
    tmp = Path(text.split()[1])
    assert tmp.name.startswith("orch-") and len(str(tmp)) <= 60
    assert tmp != Path(env["TMPDIR"])
    assert f" cache {own}/vllm-cache\n" in text
    assert "host 127.0.0.3 node other" in text
    assert text.endswith("x" * 3_000_000)  # more than one read's worth
    # What it wrote in its directory comes back (its caches and temp files do not).
    assert (run_case / "profile" / "trace.json").read_text() == "{}"
    assert not (run_case / "vllm-cache").exists()
    assert not own.exists() and not tmp.exists()
    with pytest.raises(ValueError, match="not a file of the case directory"):
        actor.read_file("../server.log", 0)


def test_a_matrix_pythonpath_comes_after_the_one_ray_gives_the_actor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker extension's module reaches the server through the matrix's env; the fusedq
    # Ray ships to the actor must still win.
    monkeypatch.setenv("PYTHONPATH", "/ray/py_modules")
    actor = ServerActor(engine_for("vllm"))
    log = tmp_path / "c" / "server.log"
    show = [sys.executable, "-c", "import os; print(os.environ['PYTHONPATH'])"]
    actor.start(show, {"PYTHONPATH": "/ext"}, str(log))
    while actor.poll() is None:
        time.sleep(0.05)
    assert log.read_text().strip() == os.pathsep.join(["/ray/py_modules", "/ext"])
