"""Ray placement of servers: one placement group and one server actor per case.

The actor runs on the node Ray chose, inside the bundle's GPUs (Ray sets CUDA_VISIBLE_DEVICES
for it), starts `vllm serve` there as its own process group, and keeps the server's log. fusedq
travels to every worker through the Ray runtime environment (`py_modules`), so the server runs
the driver's fusedq; the actor reports a fingerprint of the copy it sees, and the driver checks
it against its own.

Ray is imported only here, and only when a run starts.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.matrix import Case, Matrix

# Ray's default object store takes 30% of RAM; the orchestrator moves only small dicts through it,
# and every GiB it holds is a GiB a CPU vLLM server cannot have.
LOCAL_OBJECT_STORE_BYTES = 128 * 1024 * 1024
# Process watch: one poll waits this long for the actor's answer...
POLL_TIMEOUT_S = 5.0
# ...and an actor silent this long (a hung or partitioned node) counts as a dead server.
UNREACHABLE_S = 60.0


_STAGE_PREFIX = "orch-ship-"


class LaunchError(RuntimeError):
    """Placement or start-up of a server failed; the message says which case and why."""


def package_dir(name: str) -> Path:
    """Directory of an importable package, found without importing it (fusedq imports torch)."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise LaunchError(f"package {name!r} is not importable from {sys.executable}")
    return Path(next(iter(spec.submodule_search_locations)))


def write_dist_info(stage: Path, name: str) -> Path | None:
    """A metadata-only ``<name>-<version>.dist-info`` carrying the package's entry points.

    Ray's ``py_modules`` makes a package importable on the workers but not *installed*: vLLM
    finds plugins through ``importlib.metadata`` entry points, so the shipped fusedq would be
    invisible to it on a node without fusedq installed. This directory, shipped as one more
    ``py_modules`` entry, puts the driver's entry points (and version) on the workers' path.
    """
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return None
    version = dist.version
    info = stage / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    eps = dist.read_text("entry_points.txt") or ""
    (info / "entry_points.txt").write_text(eps)
    (info / "INSTALLER").write_text("orchestrator (ray py_modules)\n")
    return info


def _dist_location(name: str) -> str | None:
    """Where importlib.metadata finds a distribution (the shipped dist-info wins on PYTHONPATH)."""
    try:
        return str(md.distribution(name).locate_file(""))
    except md.PackageNotFoundError:
        return None


def tree_fingerprint(root: Path) -> str:
    """sha256 over the package's .py files (path and bytes): equal fingerprints, equal code."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(str(path.relative_to(root)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


@dataclass
class ServerHandle:
    """A running (or starting) server of one case."""

    case: Case
    actor: Any
    placement_group: Any
    info: dict[str, Any] = field(default_factory=dict)
    # When the actor last answered a poll: a slow answer is not a death (see Launcher.alive).
    last_answer: float = field(default_factory=time.monotonic)

    @property
    def base_url(self) -> str:
        return f"http://{self.info['connect_host']}:{self.info['port']}"


class _ServerActor:
    """Lives on the chosen node; owns one `vllm serve` process group. (Wrapped by ray.remote.)"""

    def __init__(self) -> None:
        self.proc: Any = None
        self.log_path: Path | None = None

    def node_info(self) -> dict[str, Any]:
        import ray

        return {
            "hostname": socket.gethostname(),
            "node_ip": ray.util.get_node_ip_address(),
            "node_id": ray.get_runtime_context().get_node_id(),
            "pid": os.getpid(),
            "gpu_ids": [str(g) for g in ray.get_gpu_ids()],
            "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "pythonpath": os.environ.get("PYTHONPATH", ""),
            "python": sys.executable,
        }

    def probe(self) -> dict[str, Any]:
        return _probe_server_view()

    def free_port(self, host: str) -> int:
        from orchestrator.engines.vllm import free_port

        return free_port(host)

    def missing_paths(self, paths: list[str]) -> list[str]:
        return [p for p in paths if not os.path.exists(p)]

    def start(self, argv: list[str], env_overrides: dict[str, str], log_path: str) -> int:
        from orchestrator.engines.vllm import start_server

        # The actor's own environment carries what Ray set up (CUDA_VISIBLE_DEVICES for the
        # bundle's GPUs, PYTHONPATH for py_modules); the case adds to it, never replaces those.
        env = {**os.environ, **env_overrides}
        for key in ("CUDA_VISIBLE_DEVICES", "PYTHONPATH"):
            if key in os.environ:
                env[key] = os.environ[key]
        self.log_path = Path(log_path)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = start_server(argv, env, self.log_path)
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def stop(self, grace_s: float) -> int | None:
        from orchestrator.engines.vllm import stop_server

        if self.proc is None:
            return None
        return stop_server(self.proc, grace_s=grace_s)

    def read_log(self, offset: int, max_bytes: int = 1 << 20) -> bytes:
        if self.log_path is None or not self.log_path.exists():
            return b""
        with self.log_path.open("rb") as f:
            f.seek(offset)
            return f.read(max_bytes)


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
        # GPUs a local Ray declares (None: Ray counts them). Declaring some on a machine without
        # any lets placement and CUDA_VISIBLE_DEVICES bookkeeping be tested on CPU.
        self.local_gpus = local_gpus
        self.ray_address = ray_address or matrix.ray.address or os.environ.get("RAY_ADDRESS")
        self.runtime_packages = list(runtime_packages)
        self.log = log
        self.handles: list[ServerHandle] = []
        self.driver_fingerprints: dict[str, str] = {}
        self.cluster: dict[str, Any] = {}
        self._ray: Any = None
        self._actor_cls: Any = None
        self._stage: Path | None = None
        self._probed: dict[str, dict[str, Any]] = {}

    # -- connection --------------------------------------------------------------------------
    def __enter__(self) -> Launcher:
        # Ray's telemetry would try the network at start; nothing here may leave the machine.
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if not self.ray_address:
            # An embedded Ray resolves "the node IP" to the machine's routable address and binds
            # its GCS, raylet and agents there. This switch (read when ray is imported) makes
            # it take the loopback address instead, so a local run listens on 127.0.0.1 only.
            os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
        import ray

        self._ray = ray
        py_modules = []
        # Named with the pid, so a later run can remove what a SIGKILLed one left behind.
        self._stage = Path(tempfile.mkdtemp(prefix=f"{_STAGE_PREFIX}{os.getpid()}-"))
        _remove_stale_stages(self._stage.parent)
        for name in self.runtime_packages:
            pdir = package_dir(name)
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
        self.cluster = self._describe_cluster()
        self.cluster["ray_init_s"] = round(time.monotonic() - t0, 3)
        self._actor_cls = ray.remote(max_restarts=0)(_ServerActor)
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

    def _describe_cluster(self) -> dict[str, Any]:
        ray = self._ray
        nodes = []
        for n in ray.nodes():
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
        return {
            "ray_version": ray.__version__,
            "address": self.ray_address or "local",
            "nodes": nodes,
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
        actor = self._actor_cls.options(**opts).remote()
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

    def start(
        self, handle: ServerHandle, argv_for_port: Any, env: Mapping[str, str], log_path: Path
    ) -> None:
        """Pick a free port on the node, build argv for it, start `vllm serve` there."""
        ray = self._ray
        host = self.matrix.host
        port = ray.get(handle.actor.free_port.remote(host), timeout=30)
        argv = argv_for_port(port)
        handle.info["port"] = port
        handle.info["argv"] = argv
        # A loopback server is reachable only from its own node: the driver must be there too.
        if host in ("127.0.0.1", "localhost", "::1") and not _is_local_ip(handle.info["node_ip"]):
            raise LaunchError(
                f"{handle.case.case_id}: placed on node {handle.info['node_ip']} but binds {host}; "
                "set host: 0.0.0.0 in the matrix, or run the orchestrator on that node"
            )
        handle.info["connect_host"] = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        if host in ("0.0.0.0", "::"):
            handle.info["connect_host"] = handle.info["node_ip"]
        handle.info["server_pid"] = ray.get(
            handle.actor.start.remote(argv, dict(env), str(log_path)), timeout=60
        )

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
            code = self._ray.get(handle.actor.poll.remote(), timeout=POLL_TIMEOUT_S)
        except self._ray.exceptions.GetTimeoutError:
            return time.monotonic() - handle.last_answer < UNREACHABLE_S
        except Exception:  # RayActorError, node died, ...
            return False
        handle.last_answer = time.monotonic()
        return code is None

    def exit_code(self, handle: ServerHandle) -> int | None:
        try:
            return self._ray.get(handle.actor.poll.remote(), timeout=POLL_TIMEOUT_S)
        except Exception:
            return None

    def fetch_log(self, handle: ServerHandle, dest: Path) -> None:
        """Copy a remote node's server log into the run directory (a no-op on the same node)."""
        if dest.exists() and dest.stat().st_size:
            return
        offset = 0
        with dest.open("ab") as f:
            while True:
                chunk = self._ray.get(handle.actor.read_log.remote(offset), timeout=60)
                if not chunk:
                    break
                f.write(chunk)
                offset += len(chunk)

    def stop(
        self, handle: ServerHandle, grace_s: float = 15.0, log_dest: Path | None = None
    ) -> int | None:
        """Stop the server's process group (SIGTERM, then SIGKILL), copy its log to
        `log_dest` while the actor that reads it still lives, and free its placement."""
        code = None
        try:
            code = self._ray.get(handle.actor.stop.remote(grace_s), timeout=grace_s + 30)
            handle.info["stopped"] = True
        except Exception as exc:
            self.log(f"warning: stopping {handle.case.case_id}: {exc}")
        if log_dest is not None and handle.info.get("server_pid"):
            try:
                self.fetch_log(handle, log_dest)
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
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self._ray.kill(handle.actor, no_restart=True)
        with contextlib.suppress(Exception):
            remove_placement_group(handle.placement_group)
        if handle in self.handles:
            self.handles.remove(handle)

    def stop_all(self) -> None:
        for handle in list(self.handles):
            self.stop(handle, grace_s=10.0)


_PROBE = """
import importlib.metadata as md, importlib.util, json
from pathlib import Path
from orchestrator.launch import _dist_location, tree_fingerprint
spec = importlib.util.find_spec("fusedq")
d = Path(next(iter(spec.submodule_search_locations))) if spec else None
print(json.dumps({
    "fusedq_path": str(d) if d else None,
    "fusedq_fingerprint": tree_fingerprint(d) if d else None,
    "fusedq_metadata_from": _dist_location("fusedq"),
    "vllm_plugins": sorted(f"{e.name}={e.value}" for e in md.entry_points(group="vllm.general_plugins")),
}))
"""


def _probe_server_view() -> dict[str, Any]:
    """What a server process started by this actor will import: probed in a child with the
    same interpreter and environment, from a neutral directory (the actor's own sys.path may
    hold the driver's working directory, which the server's does not)."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tempfile.gettempdir(),
        env=dict(os.environ),
    )
    if out.returncode != 0:
        return {"probe_error": out.stderr.strip()[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def _remove_stale_stages(tmp: Path) -> None:
    """Remove staging directories whose orchestrator no longer runs (a SIGKILL skips
    __exit__); a live pid's directory is kept, even if the pid was recycled."""
    for stage in tmp.glob(f"{_STAGE_PREFIX}*-*"):
        pid = stage.name[len(_STAGE_PREFIX) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            shutil.rmtree(stage, ignore_errors=True)
        except PermissionError:  # another user's live process
            pass


def _is_local_ip(ip: str) -> bool:
    if ip.startswith("127.") or ip == "::1":
        return True
    try:
        local = {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        local = set()
    return ip in local
