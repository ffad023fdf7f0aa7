"""The engine interface: what the plan, cluster and execution steps ask of a serving engine.

An engine is one object that implements ``Engine`` (vLLM's: orchestrator.engines.vllm.engine);
``orchestrator.engines.engine_for(kind)`` gives the one a matrix's ``engine.kind`` names. The
interface is what those steps use and no more; what an engine does beyond it (its flags, its
log's format, its metric names) stays in its own package.

One server's life, in the order the steps call its engine:

1. Its command, on the driver (orchestrator.execution.case_run): ``serve_env`` (its
   environment, caches and temp files in the case directory), ``api_key`` (the key its
   clients send), ``shared_compile_cache`` (the cache folders its configuration shares with
   other servers), ``serve_argv`` (built once the launcher has picked the node, host and
   port). A switch-mode server is started with ``switch_server``'s additions
   (orchestrator.plan.units).
2. Started on the node Ray chose (orchestrator.cluster): ``host_env`` and ``run_dir_env``
   (that node's address and folders), ``start`` (the process, in a session of its own, its
   output appended to its log).
3. Ready: ``wait_ready`` returns once it serves, or raises ServerStartError when it died or
   timed out; ``is_port_clash`` tells a port lost to another process (worth a retry on a new
   one) from any other failure.
4. Measured (orchestrator.execution.measure and .switch): ``spec_decode_counters`` around
   each workload (``acceptance_rates``: the synthetic rates an MTP case was given),
   ``profile_request`` around the profiled request, ``set_path`` and ``path_state`` between a
   switch server's blocks (WorkerCallError when the call fails).
5. Stopped: ``stop`` (the process group, however it ends), then ``read_startup`` (the
   start-up phases its log shows).

At any time: ``log_message`` (a log line as the live view quotes it) and ``probe_version``
(the installed engine's version, for the run's manifest).

An engine object holds no state: a copy pickled to a Ray actor is the same engine. Its module
imports nothing heavy (no torch, no vllm, no httpx until a server is called): the CLI's
``plan`` path reaches it to build a switch server's case.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import subprocess

    from orchestrator.config.expand import Case
    from orchestrator.engines.spec_decode import SpecDecodeCounters

_LOG_TAIL_LINES = 25


class ServerStartError(RuntimeError):
    """The server did not become ready; `reason` says why, `log_tail` shows its last lines."""

    def __init__(self, reason: str, log_tail: str = "") -> None:
        self.reason = reason
        self.log_tail = log_tail
        msg = (
            reason
            if not log_tail
            else f"{reason}\n--- last lines of the server log ---\n{log_tail}"
        )
        super().__init__(msg)


class WorkerCallError(RuntimeError):
    """A call to every worker of a server failed or came back unreadable; the message names
    the endpoint, the call and the answer."""


@dataclass(frozen=True)
class WorkerAnswers:
    """Every worker's answer to one call, in rank order; `call` names it as the engine's
    workers know it (messages about the answers quote it)."""

    call: str
    answers: list[Any]


def log_tail(log_path: Path | None, lines: int = _LOG_TAIL_LINES) -> str:
    """The last `lines` lines of a log (read from its last 64 KiB; "" if unreadable)."""
    if log_path is None:
        return ""
    try:
        with Path(log_path).open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 64 * 1024))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


class Engine(Protocol):
    """A serving engine, in the order of a server's life (the module docstring)."""

    # The matrix's `engine.kind` that names this engine (orchestrator.engines.ENGINES).
    kind: str

    # -- 1. the command, on the driver -----------------------------------------------------
    def serve_env(self, *, host: str, run_dir: Path, extra: Mapping[str, str]) -> dict[str, str]:
        """What every server needs (its caches and temp files under `run_dir`, the address
        it advertises for `host`), then `extra` (the case's env), which wins. Pure: nothing
        is created, every path is absolute."""

    def api_key(self, args: Sequence[str], env: Mapping[str, str]) -> str | None:
        """A key a server started with these args and env accepts, or None."""

    def shared_compile_cache(
        self, case: Case, model_path: str, fusedq_fingerprint: str | None
    ) -> tuple[dict[str, str], Path | None]:
        """The cache variables that point `case`'s server at the compile caches its
        configuration shares (made ready to use), and that configuration's folder; none,
        and None, where the case's env keeps its own."""

    def serve_argv(
        self,
        case: Case,
        model_path: str,
        *,
        host: str,
        port: int,
        executable: str | None = None,
        profiler_dir: str | None = None,
    ) -> list[str]:
        """The server's argv for `case` serving `model_path` on `host`:`port` (a list, never
        a shell string). `executable`: the engine's program (None: the installed one);
        `profiler_dir`: an absolute folder of the server's node that turns its profiler on.
        ValueError for a topology it cannot serve or args that clash with its own."""

    def switch_server(
        self, args: Sequence[str], env: Mapping[str, str], extension: str
    ) -> tuple[tuple[str, ...], dict[str, str]]:
        """`args` and `env` plus what a server whose decode path is switched while it runs
        needs: `extension` loaded into every worker, the endpoint `set_path` calls open, and
        no prefix caching (the k-th block of every path sends the same prompts)."""

    # -- 2. started, on the server's node --------------------------------------------------
    def host_env(self, host: str) -> dict[str, str]:
        """The variables that make a server bound to `host` advertise that address to its
        own workers (none where `host` names no single address)."""

    def run_dir_env(self, run_dir: Path) -> dict[str, str]:
        """The variables that keep the server's caches and temp files under `run_dir` (of
        the node it runs on)."""

    def start(
        self, argv: Sequence[str], env: Mapping[str, str], log_path: Path
    ) -> subprocess.Popen:
        """Start the server in a session of its own (its process group is stopped whole),
        its output appended to `log_path`, in the log's folder."""

    # -- 3. ready ----------------------------------------------------------------------------
    def wait_ready(
        self,
        base_url: str,
        *,
        timeout_s: float,
        alive: Callable[[], bool],
        log_path: Path | None = None,
        returncode: Callable[[], int | None] | None = None,
        api_key: str | None = None,
    ) -> float:
        """Block until the server serves; the seconds waited. ServerStartError (with the
        log's tail) as soon as `alive()` turns False, or after `timeout_s`."""

    def is_port_clash(self, log_tail: str) -> bool:
        """Whether a start-up failure with this log tail was a port lost to another
        process."""

    # -- 4. measured -------------------------------------------------------------------------
    def spec_decode_counters(
        self, base_url: str, *, api_key: str | None = None
    ) -> SpecDecodeCounters | None:
        """The server's speculative-decoding counters now; None where it keeps none or
        does not answer."""

    def acceptance_rates(self, mtp: int, acceptance: float) -> list[float]:
        """The per-position synthetic acceptance rates a server with `mtp` draft tokens,
        each accepted with probability `acceptance` given the one before it, is given."""

    def profile_request(
        self, base_url: str, what: str, *, timeout_s: float, api_key: str | None = None
    ) -> float:
        """Start or stop (`what`) the server's profiler; the seconds it took. RuntimeError
        naming the request when the server refuses."""

    def set_path(
        self, base_url: str, path: str, *, timeout_s: float, api_key: str | None = None
    ) -> WorkerAnswers:
        """Ask every worker to take decode path `path`; their answers."""

    def path_state(
        self, base_url: str, *, timeout_s: float, api_key: str | None = None
    ) -> WorkerAnswers:
        """Every worker's decode path now."""

    def seed_workers(
        self, base_url: str, seed: int, *, timeout_s: float, api_key: str | None = None
    ) -> WorkerAnswers:
        """Seed every worker's random streams with `seed` (synthetic MTP acceptance draws from
        them); their answers."""

    # -- 5. stopped --------------------------------------------------------------------------
    def stop(self, proc: subprocess.Popen, grace_s: float = 10.0) -> int | None:
        """Stop the server's process group (SIGTERM, `grace_s`, SIGKILL); its exit code."""

    def read_startup(
        self, log_path: Path, *, spawned_at: float | None, ready_at: float | None
    ) -> dict[str, Any] | None:
        """The server's start-up record from its log (its phases in seconds: the shape of
        orchestrator.results.rows.Startup); None where there is no log. `spawned_at` and
        `ready_at`: epoch seconds, None where unknown."""

    # -- any time ----------------------------------------------------------------------------
    def log_message(self, line: str) -> str | None:
        """A line of the server's log as the live view quotes it: without colour codes or the
        engine's prefixes, a warning or worse keeping its level; None where nothing is left
        to show."""

    def probe_version(self, python: str | None = None) -> str:
        """The installed engine's version, as `python` (default: this interpreter) sees it,
        without importing the engine. RuntimeError when none is installed."""
