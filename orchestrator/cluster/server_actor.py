"""The server actor: lives on the node Ray chose and owns one server's process group.

Wrapped by `ray.remote` in `orchestrator.cluster.launch.Launcher`, which places it inside a
case's bundle (Ray sets CUDA_VISIBLE_DEVICES for it). Ray loads the class by reference on
every worker, from the orchestrator shipped through `py_modules` (orchestrator.cluster.ship).

On another node than the driver's it keeps the server in a case directory of that node's own
and hands its log and files back in chunks.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from orchestrator.cluster.ship import probe_server_view
from orchestrator.common import safe_io
from orchestrator.common.net import free_port
from orchestrator.config.policy import RAY_WORKER_ENV
from orchestrator.engines import Engine

# One read of a log or file from a node's actor.
_CHUNK = 1 << 20


class ServerActor:
    """Lives on the chosen node; owns one server's process group, which `engine` (a pickled
    copy of the run's, orchestrator.engines) starts and stops. (Wrapped by ray.remote.)"""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.proc: Any = None
        self.log_path: Path | None = None
        self.own_dir: Path | None = None
        self.stand_ins: list[Path] = []  # a short TMPDIR beside it (Engine.run_dir_env)

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
        return probe_server_view()

    def free_port(self, host: str) -> int:
        return free_port(host)

    def missing_paths(self, paths: list[str]) -> list[str]:
        return [p for p in paths if not os.path.exists(p)]

    def case_dir(self, name: str) -> str:
        """A case directory of this node's own, under its temp directory."""
        self.own_dir = Path(tempfile.gettempdir()) / name
        # A predictable name in a shared /tmp: only ever this user's own 0700 folder.
        safe_io.private_dir(self.own_dir, "the case folder on this node")
        return str(self.own_dir)

    def start(
        self,
        argv: list[str],
        env_overrides: dict[str, str],
        log_path: str,
        rebase: list[str] | None = None,
    ) -> int:
        # The actor's own environment carries what Ray set up (CUDA_VISIBLE_DEVICES for the
        # bundle's GPUs, PYTHONPATH for py_modules); the case adds to it, never replaces those.
        env = {**os.environ, **env_overrides}
        for key in RAY_WORKER_ENV:
            if key in os.environ:
                env[key] = os.environ[key]
        if env_overrides.get("PYTHONPATH") and "PYTHONPATH" in os.environ:
            # A matrix's own PYTHONPATH (a worker extension's module, say) comes after Ray's:
            # the shipped fusedq must still win.
            env["PYTHONPATH"] = os.pathsep.join(
                [os.environ["PYTHONPATH"], env_overrides["PYTHONPATH"]]
            )
        self.log_path = Path(log_path)
        if rebase:
            # Caches and temp files in this node's case directory, as the driver's would be in
            # its own (worked out here: a short TMPDIR stand-in depends on this node's /tmp).
            own = self.engine.run_dir_env(self.log_path.parent)
            env.update({key: own[key] for key in rebase})
            self.stand_ins = [
                Path(own[k])
                for k in rebase
                if not Path(own[k]).is_relative_to(self.log_path.parent)
            ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.proc = self.engine.start(argv, env, self.log_path)
        return self.proc.pid

    def poll(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def poll_log(self, offset: int) -> tuple[int | None, bytes]:
        """The exit code, then the log from `offset`: read after the poll, so a log read
        with an exit code is complete."""
        code = self.poll()
        return code, self.read_log(offset)

    def files(self) -> list[str]:
        """Files the server left in its case directory here (a profiler's traces, say), as
        paths relative to it: not its log, and nothing of its caches and temp directory."""
        if self.log_path is None or not self.log_path.parent.is_dir():
            return []
        root = self.log_path.parent
        skip = {Path(d) for d in self.engine.run_dir_env(root).values()}
        found = []
        for dirpath, dirnames, filenames in os.walk(root):
            here = Path(dirpath)
            dirnames[:] = [d for d in dirnames if here / d not in skip]
            for name in filenames:
                path = here / name
                if path != self.log_path and path.is_file() and not path.is_symlink():
                    found.append(path.relative_to(root).as_posix())
        return sorted(found)

    def file_sizes(self) -> dict[str, int]:
        """`files()` with their sizes now (a writer still at work shows growing sizes)."""
        root = None if self.log_path is None else self.log_path.parent
        sizes = {}
        for name in self.files():
            with contextlib.suppress(OSError):  # gone between the listing and the stat
                sizes[name] = (root / name).stat().st_size  # type: ignore[operator]
        return sizes

    def read_file(self, name: str, offset: int, max_bytes: int = _CHUNK) -> bytes:
        root = None if self.log_path is None else self.log_path.parent
        path = None if root is None else (root / name).resolve()
        if root is None or path is None or not path.is_relative_to(root.resolve()):
            raise ValueError(f"not a file of the case directory: {name!r}")
        with path.open("rb") as f:
            f.seek(offset)
            return f.read(max_bytes)

    def remove_case_dir(self) -> None:
        for d in [*self.stand_ins, self.own_dir]:
            if d is not None:
                shutil.rmtree(d, ignore_errors=True)

    def stop(self, grace_s: float) -> int | None:
        if self.proc is None:
            return None
        return self.engine.stop(self.proc, grace_s=grace_s)

    def read_log(self, offset: int, max_bytes: int = _CHUNK) -> bytes:
        if self.log_path is None or not self.log_path.exists():
            return b""
        with self.log_path.open("rb") as f:
            f.seek(offset)
            return f.read(max_bytes)
