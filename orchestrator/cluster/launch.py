"""Ray placement of servers: one placement group and one server actor per case.

The actor (orchestrator.cluster.server_actor) runs on the node Ray chose, inside the bundle's
GPUs (Ray sets CUDA_VISIBLE_DEVICES for it), starts the server there as its own process
group (through the matrix's engine, orchestrator.engines: `vllm serve`), and keeps the
server's log. fusedq travels to every worker through the Ray runtime
environment (`py_modules`, orchestrator.cluster.ship), so the server runs the driver's fusedq;
the actor reports a fingerprint of the copy it sees, and the driver checks it against its own.

On the driver's node a server writes into the run directory itself. On any other node it runs
in a case directory of that node's own (the driver's paths mean nothing there); its log is
copied to the run directory as it grows (each process-watch poll brings the new bytes), and
what else it left in its directory comes back when it stops. A server there is reached on the
node's address: ``host: node`` binds exactly that address.

Ray is imported only in this package, and only when a run starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import signal
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.cluster.leftovers import NODE_ENV
from orchestrator.cluster.server_actor import ServerActor
from orchestrator.cluster.ship import new_stage, package_dir, tree_fingerprint, write_dist_info
from orchestrator.common import processes, safe_io
from orchestrator.common.net import is_loopback
from orchestrator.common.processes import describe_exit
from orchestrator.config.expand import Case
from orchestrator.config.schema import Matrix
from orchestrator.engines import engine_for

# Ray's default object store takes 30% of RAM; the orchestrator moves only small dicts through it,
# and every GiB it holds is a GiB a CPU vLLM server cannot have.
LOCAL_OBJECT_STORE_BYTES = 128 * 1024 * 1024
# Process watch: one poll waits this long for the actor's answer...
POLL_TIMEOUT_S = 5.0
# ...and an actor silent this long (a hung or partitioned node) counts as a dead server.
UNREACHABLE_S = 60.0

# The matrix's `host: node`: bind the address Ray knows the server's node by.
NODE_HOST = "node"


class LaunchError(RuntimeError):
    """Placement or start-up of a server failed; the message says which case and why."""


def ray_address_for(matrix: Matrix, explicit: str | None = None) -> str | None:
    """The cluster a run joins: --ray-address, else the matrix's ray.address, else
    $RAY_ADDRESS; None for an embedded local Ray."""
    return explicit or matrix.ray.address or os.environ.get("RAY_ADDRESS") or None


def _loopback_address(address: str) -> bool:
    host = address.rpartition(":")[0] if ":" in address else address
    return is_loopback(host.strip("[]"))


@dataclass
class ServerHandle:
    """A running (or starting) server of one case."""

    case: Case
    actor: Any
    placement_group: Any
    info: dict[str, Any] = field(default_factory=dict)
    # When the actor last answered a poll: a slow answer is not a death (see Launcher.alive).
    last_answer: float = field(default_factory=time.monotonic)
    # On another node than the driver's: the run directory's log file its log is copied to,
    # and how many bytes of it have been copied.
    mirror: Path | None = None
    mirrored: int = 0
    # Why the actor stopped answering, when it did (a lost node).
    lost: str | None = None

    @property
    def base_url(self) -> str:
        return f"http://{self.info['connect_host']}:{self.info['port']}"


class Launcher:
    """Owns the Ray connection, the placement groups and every server of one run.

    Use as a context manager: leaving it (normally, on an exception or a signal) stops every
    server it started and removes every placement group, so no process outlives the run.
    """

    def __init__(
        self,
        matrix: Matrix,
        *,
        ray_address: str | None = None,
        # fusedq is what the servers must run; orchestrator holds the server actor's own code,
        # which Ray loads by reference on every worker.
        runtime_packages: Sequence[str] = ("fusedq", "orchestrator"),
        log: Any = print,
        local_gpus: int | None = None,
    ) -> None:
        self.matrix = matrix
        # What the servers are (orchestrator.engines); each server actor gets a copy.
        self.engine = engine_for(matrix.engine.kind)
        # GPUs a local Ray declares (None: Ray counts them). Declaring some on a machine without
        # any lets placement and CUDA_VISIBLE_DEVICES bookkeeping be tested on CPU.
        self.local_gpus = local_gpus
        self.ray_address = ray_address_for(matrix, ray_address)
        self.runtime_packages = list(runtime_packages)
        self.log = log
        self.handles: list[ServerHandle] = []
        self.driver_fingerprints: dict[str, str] = {}
        self.cluster: dict[str, Any] = {}
        self._ray: Any = None
        self._actor_cls: Any = None
        self._stage: Path | None = None
        self._probed: dict[str, dict[str, Any]] = {}
        self.driver_node_id: str | None = None
        self._nodes: Any = None

    # -- connection --------------------------------------------------------------------------
    def __enter__(self) -> Launcher:
        # Ray's telemetry would try the network at start; nothing here may leave the machine.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if not self.ray_address or _loopback_address(self.ray_address):
            # An embedded Ray resolves "the node IP" to the machine's routable address and binds
            # its GCS, raylet and agents there. This switch (read when ray is imported) makes
            # it take the loopback address instead, so a local run listens on 127.0.0.1 only.
            # A driver joining a cluster on loopback needs it too: Ray otherwise rewrites
            # 127.0.0.1 in the address to the routable one, where no GCS listens.
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray

        self._ray = ray
        py_modules = []
        self._stage = new_stage()
        for name in self.runtime_packages:
            pdir = package_dir(name)
            if pdir is None:
                raise LaunchError(f"package {name!r} is not importable from {sys.executable}")
            self.driver_fingerprints[name] = tree_fingerprint(pdir)
            py_modules.append(str(pdir))
            info = write_dist_info(self._stage, name)
            if info is not None:
                py_modules.append(str(info))
        runtime_env: dict[str, Any] = {"py_modules": py_modules} if py_modules else {}
        kwargs = self.init_kwargs(runtime_env)
        t0 = time.monotonic()
        try:
            ray.init(**kwargs)
        except Exception as exc:  # ray raises ConnectionError, RuntimeError, ValueError...
            where = self.ray_address or "a local Ray"
            raise LaunchError(f"cannot start or join {where}: {exc}") from None
        self.driver_node_id = ray.get_runtime_context().get_node_id()
        self.cluster = self._describe_cluster()
        self.cluster["ray_init_s"] = round(time.monotonic() - t0, 3)
        self._actor_cls = ray.remote(max_restarts=0)(ServerActor)
        return self

    def init_kwargs(self, runtime_env: dict[str, Any]) -> dict[str, Any]:
        """The arguments of `ray.init`: join `ray_address`, or start an embedded local Ray."""
        kwargs: dict[str, Any] = {
            "runtime_env": runtime_env,
            "include_dashboard": False,
            "logging_level": "WARNING",
            "log_to_driver": False,
        }
        if self.ray_address:
            kwargs["address"] = self.ray_address
        else:
            # Embedded local Ray on loopback: nothing listens beyond this machine. "local",
            # because without an address ray.init joins the cluster the last `ray start` on
            # this machine recorded in /tmp/ray/ray_current_cluster, dead or alive (seen
            # 2026-11-30: a stale one failed every local run here, "When connecting to an
            # existing cluster, object_store_memory must not be provided").
            kwargs.update(address="local", object_store_memory=LOCAL_OBJECT_STORE_BYTES)
            if self.local_gpus is not None:
                kwargs["num_gpus"] = self.local_gpus
        return kwargs

    def __exit__(self, *exc: object) -> None:
        self.stop_all()
        if self._ray is not None and self._ray.is_initialized():
            self._ray.shutdown()
        if self._stage is not None:
            shutil.rmtree(self._stage, ignore_errors=True)

    @property
    def nodes(self) -> Any:
        """The per-node agents (orchestrator.cluster.nodes.ClusterNodes), started when first
        asked."""
        if self._nodes is None:
            from orchestrator.cluster.nodes import ClusterNodes

            self._nodes = ClusterNodes(self._ray, log=self.log)
        return self._nodes

    def _alive_nodes(self) -> list[dict[str, Any]]:
        nodes = []
        for n in self._ray.nodes():
            if not n.get("Alive"):
                continue
            res = n.get("Resources", {})
            nodes.append(
                {
                    "node_ip": n.get("NodeManagerAddress"),
                    "hostname": n.get("NodeManagerHostname"),
                    "gpus": int(res.get("GPU", 0)),
                    "cpus": int(res.get("CPU", 0)),
                }
            )
        return nodes

    def _describe_cluster(self) -> dict[str, Any]:
        return {
            "ray_version": self._ray.__version__,
            "address": self.ray_address or "local",
            "nodes": self._alive_nodes(),
        }

    def check_capacity(self) -> None:
        """Every topology must fit on one node: tp GPUs (or tp*cpus_per_rank CPUs) in one bundle."""
        unit = "gpus" if self.matrix.resources.accelerator == "gpu" else "cpus"
        best = max((n[unit] for n in self.cluster["nodes"]), default=0)
        per_rank = 1 if unit == "gpus" else self.matrix.resources.cpus_per_rank
        for ti, topo in enumerate(self.matrix.topologies):
            need = topo.tp * per_rank
            if need > best:
                raise LaunchError(
                    f"topologies[{ti}].tp={topo.tp} needs {need} {unit.upper()} on one node; "
                    f"the largest node of this Ray cluster ({self.cluster['address']}) has {best}"
                )

    # -- servers -----------------------------------------------------------------------------
    def _bundle(self, case: Case) -> dict[str, float]:
        if self.matrix.resources.accelerator == "gpu":
            return {"GPU": float(case.tp), "CPU": 1.0}
        return {"CPU": float(case.tp * self.matrix.resources.cpus_per_rank)}

    def place(self, case: Case, timeout_s: float) -> ServerHandle:
        """Reserve one bundle on one node (STRICT_PACK) and put a server actor in it."""
        ray = self._ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self._bundle(case)
        nodes = self._alive_nodes()
        if not fits_a_node(bundle, nodes):
            # Ray would keep the group pending (for an autoscaler) until placement_s ran out.
            raise LaunchError(
                f"{case.case_id}: no node of the cluster can hold {bundle} now "
                f"(alive: {describe_nodes(nodes)})"
            )
        pg = placement_group([bundle], strategy="STRICT_PACK", name=f"orchestrator:{case.case_id}")
        try:
            ray.get(pg.ready(), timeout=timeout_s)
        except Exception as exc:
            remove_placement_group(pg)
            if isinstance(exc, ray.exceptions.GetTimeoutError):
                raise LaunchError(
                    f"{case.case_id}: no node could hold {bundle} within {timeout_s:.0f} s"
                ) from None
            raise LaunchError(f"{case.case_id}: placement failed: {exc}") from None
        opts: dict[str, Any] = {
            "scheduling_strategy": PlacementGroupSchedulingStrategy(
                placement_group=pg, placement_group_bundle_index=0
            ),
            "num_cpus": bundle.get("CPU", 0.0) if "GPU" not in bundle else 1.0,
            "num_gpus": bundle.get("GPU", 0.0),
        }
        actor = self._actor_cls.options(**opts).remote(self.engine)
        handle = ServerHandle(case=case, actor=actor, placement_group=pg)
        self.handles.append(handle)
        try:
            handle.info = ray.get(actor.node_info.remote(), timeout=timeout_s)
            # What a server there will import (fusedq's path and fingerprint, vLLM's plugins):
            # the same for every actor of this job on one node (same runtime env, same
            # py_modules), so it is probed once per node (~0.8 s a placement saved).
            node = handle.info["node_id"]
            if node not in self._probed:
                self._probed[node] = ray.get(actor.probe.remote(), timeout=timeout_s)
            handle.info.update(self._probed[node])
        except Exception as exc:
            self.release(handle)
            raise LaunchError(f"{case.case_id}: server actor did not start: {exc}") from None
        if "probe_error" in handle.info:
            self.release(handle)
            raise LaunchError(
                f"{case.case_id}: the node cannot import what the server needs: "
                f"{handle.info['probe_error'].splitlines()[-1]}"
            )
        for name, fp in self.driver_fingerprints.items():
            if name == "fusedq" and handle.info.get("fusedq_fingerprint") != fp:
                self.release(handle)
                raise LaunchError(
                    f"{case.case_id}: the node's fusedq ({handle.info.get('fusedq_path')}, "
                    f"{handle.info.get('fusedq_fingerprint')}) is not the driver's ({fp})"
                )
        return handle

    def is_remote(self, handle: ServerHandle) -> bool:
        """Placed on another Ray node than the driver's (on another machine, or a simulated
        node beside it)."""
        return handle.info.get("node_id") != self.driver_node_id

    def bind_host(self, handle: ServerHandle) -> str:
        """The address the server binds: the matrix's host, with `node` resolved."""
        host = self.matrix.host
        if host == NODE_HOST:
            return handle.info["node_ip"]
        # A loopback server is reachable only from its own node: the driver must be there too.
        if is_loopback(host) and self.is_remote(handle):
            raise LaunchError(
                f"{handle.case.case_id}: placed on node {handle.info['node_ip']} but binds {host}; "
                f"set host: {NODE_HOST} (that node's cluster address) or host: 0.0.0.0 in the "
                "matrix, or run the orchestrator on that node"
            )
        return host

    def start(
        self, handle: ServerHandle, argv_for_port: Any, env: Mapping[str, str], log_path: Path
    ) -> None:
        """Pick a free port on the node, build argv for it (`argv_for_port(port, host)`),
        start the server there; on another node, in a case directory of that node's own."""
        ray = self._ray
        host = self.bind_host(handle)
        env = dict(env)
        env[NODE_ENV] = handle.info["node_id"]
        if self.matrix.host == NODE_HOST:
            # What serve_env does for an address named in the matrix (the matrix's env wins).
            env.update({k: v for k, v in self.engine.host_env(host).items() if k not in env})
        rebase = None
        node_log = Path(log_path)
        if self.is_remote(handle):
            run_dir = Path(log_path).parent
            # Named after the log and the node: a retry reuses it; servers side by side on one
            # node (gpu-check's bundles, whose logs share a directory) each get their own.
            digest = hashlib.sha1(f"{log_path}|{handle.info['node_id']}".encode()).hexdigest()
            own = ray.get(handle.actor.case_dir.remote(f"orch-case-{digest[:12]}"), timeout=60)
            node_log = Path(own) / Path(log_path).name
            # The run-directory variables serve_env set (those the matrix set itself stay).
            rebase = [k for k, v in self.engine.run_dir_env(run_dir).items() if env.get(k) == v]
            handle.mirror = Path(log_path)
            handle.mirrored = 0
            handle.info["node_case_dir"] = own
        # Known before the argv is built: a path the server is told (its profiler's trace
        # directory) is a path of the node it runs on.
        handle.info["case_dir"] = str(node_log.parent.absolute())
        port = ray.get(handle.actor.free_port.remote(host), timeout=30)
        argv = argv_for_port(port, host)
        handle.info["port"] = port
        handle.info["argv"] = argv
        unspecified = host in ("0.0.0.0", "::")
        handle.info["connect_host"] = handle.info["node_ip"] if unspecified else host
        handle.info["server_pid"] = ray.get(
            handle.actor.start.remote(argv, env, str(node_log), rebase), timeout=60
        )

    def case_files(self, handle: ServerHandle) -> dict[str, int]:
        """The files the server has written into its case directory so far, on whatever node
        it runs (paths relative to that directory, with their sizes); not its log."""
        return self._ray.get(handle.actor.file_sizes.remote(), timeout=60)

    def missing_paths(self, handle: ServerHandle, paths: Sequence[str]) -> list[str]:
        """Which of `paths` do not exist on the node the server will run on."""
        return self._ray.get(handle.actor.missing_paths.remote(list(paths)), timeout=60)

    def alive(self, handle: ServerHandle) -> bool:
        """Process watch: False as soon as the server process (or its actor) is gone.

        An exit or a dead actor answers at once. A poll that merely times out is not a death:
        on a loaded node (a 2-core CI machine while vLLM imports torch) the actor can take
        seconds to answer, and calling that an exit failed healthy cases. Only an actor that
        has not answered for UNREACHABLE_S counts as gone.
        """
        try:
            code = self._poll(handle)
        except self._ray.exceptions.GetTimeoutError:
            return time.monotonic() - handle.last_answer < UNREACHABLE_S
        except Exception as exc:  # RayActorError, node died, ...
            handle.lost = handle.lost or _first_line(exc)
            return False
        handle.last_answer = time.monotonic()
        return code is None

    def exit_code(self, handle: ServerHandle) -> int | None:
        try:
            return self._poll(handle)
        except Exception:
            return None

    def _poll(self, handle: ServerHandle) -> int | None:
        """The server's exit code (None while it runs); a remote log's new bytes come along."""
        if handle.mirror is None:
            return self._ray.get(handle.actor.poll.remote(), timeout=POLL_TIMEOUT_S)
        code, chunk = self._ray.get(
            handle.actor.poll_log.remote(handle.mirrored), timeout=POLL_TIMEOUT_S
        )
        self._append(handle, chunk)
        return code

    def _append(self, handle: ServerHandle, chunk: bytes) -> None:
        if not chunk or handle.mirror is None:
            return
        safe_io.append_bytes(handle.mirror, chunk)  # never through a link in the run folder
        handle.mirrored += len(chunk)

    def describe_end(self, handle: ServerHandle | None) -> str:
        """How a server that stopped serving ended: its exit, or the loss of its node."""
        if handle is None:
            return "server process exited"
        code = self.exit_code(handle)
        if handle.lost is None or code is not None:
            return f"server process {describe_exit(code)}"
        node = f"{handle.info.get('node_ip')} ({handle.info.get('hostname')})"
        gone = [n for n in self._ray.nodes() if n.get("NodeID") == handle.info.get("node_id")]
        if gone and not gone[0].get("Alive"):
            why = gone[0].get("DeathReasonMessage") or "no reason given"
            return f"node {node} left the Ray cluster ({why}); the server went with it"
        return f"node {node} stopped answering; the server is lost with it ({handle.lost})"

    def fetch_log(self, handle: ServerHandle) -> None:
        """Bring a remote node's server log up to date at the path start() was given, copy
        every other file the server left in its case directory there beside it, and remove
        that directory (a no-op on the driver's node, where the server writes in place)."""
        if handle.mirror is None:
            return
        dest = handle.mirror
        while chunk := self._ray.get(handle.actor.read_log.remote(handle.mirrored), timeout=60):
            self._append(handle, chunk)
        for name in self._ray.get(handle.actor.files.remote(), timeout=60):
            target = dest.parent / name
            target.parent.mkdir(parents=True, exist_ok=True)
            if os.path.lexists(target):  # never over a file (or a link) of the run directory
                self.log(
                    f"warning: {handle.case.case_id}: {name} of the node not copied over {target}"
                )
                continue
            offset = 0
            new = os.O_WRONLY | os.O_CREAT | os.O_EXCL  # a link there is refused too
            with os.fdopen(safe_io.open_for_writing(target, new), "wb") as f:
                while chunk := self._ray.get(
                    handle.actor.read_file.remote(name, offset), timeout=60
                ):
                    f.write(chunk)
                    offset += len(chunk)
        self._ray.get(handle.actor.remove_case_dir.remote(), timeout=60)

    def stop(
        self, handle: ServerHandle, grace_s: float = 15.0, log_dest: Path | None = None
    ) -> int | None:
        """Stop the server's process group (SIGTERM, then SIGKILL), complete its log at
        `log_dest` (the path start() was given) while the actor that reads it still lives,
        and free its placement."""
        code = None
        try:
            code = self._ray.get(handle.actor.stop.remote(grace_s), timeout=grace_s + 30)
            handle.info["stopped"] = True
        except Exception as exc:
            self.log(f"warning: stopping {handle.case.case_id}: {exc}")
        if log_dest is not None and handle.info.get("server_pid"):
            try:
                self.fetch_log(handle)
            except Exception as exc:
                self.log(f"warning: fetching the server log of {handle.case.case_id}: {exc}")
        self.release(handle)
        return code

    def release(self, handle: ServerHandle) -> None:
        """Kill the actor and free the bundle; the server's process group never outlives it."""
        from ray.util.placement_group import remove_placement_group

        if handle.info.get("server_pid") and not handle.info.get("stopped"):
            try:
                self._ray.get(handle.actor.stop.remote(5.0), timeout=40)
                handle.info["stopped"] = True
            except Exception:
                pass
        pid = handle.info.get("server_pid")
        if pid and not handle.info.get("stopped") and _is_local_ip(handle.info.get("node_ip", "")):
            # The actor is gone or hung: the server runs in its own session (pgid == pid).
            processes.signal_group(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self._ray.kill(handle.actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(handle.placement_group)
        if handle in self.handles:
            self.handles.remove(handle)

    def node_runner(self, handle: ServerHandle | None) -> Any:
        """Runs the audit's readers (kernel log, GPU state) on the node `handle`'s server ran
        on; None where that is the driver's own node (or no server was placed): they run
        here."""
        if handle is None or not self.is_remote(handle):
            return None
        node_id = handle.info["node_id"]
        if handle.lost is not None:
            # Its agent would wait for a node Ray may not yet know is gone.
            def unreachable(argv: list[str]) -> Any:
                raise OSError(f"node {node_id[:12]} was lost during the case")

            return unreachable
        return self.nodes.command_runner(node_id)

    def stop_all(self) -> None:
        for handle in list(self.handles):
            self.stop(handle, grace_s=10.0, log_dest=handle.mirror)


def fits_a_node(bundle: Mapping[str, float], nodes: Sequence[Mapping[str, Any]]) -> bool:
    """Whether one of `nodes` (alive, with their total gpus and cpus) could hold `bundle`."""
    return any(
        n["gpus"] >= bundle.get("GPU", 0.0) and n["cpus"] >= bundle.get("CPU", 0.0) for n in nodes
    )


def describe_nodes(nodes: Sequence[Mapping[str, Any]]) -> str:
    """`10.0.0.2 with 8 GPUs, 96 CPUs; ...`, or `no node`."""
    parts = [f"{n['node_ip']} with {n['gpus']} GPUs, {n['cpus']} CPUs" for n in nodes]
    return "; ".join(parts) or "no node"


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:300] if text else ''}"


def _is_local_ip(ip: str) -> bool:
    if is_loopback(ip):
        return True
    try:
        local = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        local = set()
    return ip in local
