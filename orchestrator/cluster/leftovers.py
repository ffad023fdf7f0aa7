"""Start-up hygiene: processes of a crashed run are found, reported and, when asked, stopped.

Every process a run starts carries three environment variables, inherited by its children:
``ORCHESTRATOR_RUN_ID``, ``ORCHESTRATOR_CASE`` (servers only) and ``ORCHESTRATOR_DRIVER``
(``host:pid:start-time`` of the orchestrator that started it). A process whose driver is
gone is a leftover: a `vllm serve` orphaned by a SIGKILLed or crashed orchestrator, or the
local Ray daemons it started. Leftovers hold memory and GPUs the next run needs, so a run
reports them before it starts anything (see ``runner.run_matrix`` for what it then does).

The scan reads ``/proc/<pid>/environ`` (Linux); processes of other users are unreadable and
skipped. It reads the machine it runs on: on a Ray cluster, ``orchestrator.cluster.nodes`` runs it
on every node (servers there also carry ``ORCHESTRATOR_NODE``, the Ray node that started them).
The start time in the driver tag makes a recycled pid not pass for a live driver.
"""

from __future__ import annotations

import os
import signal
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from orchestrator.common import processes

RUN_ENV = "ORCHESTRATOR_RUN_ID"
CASE_ENV = "ORCHESTRATOR_CASE"
DRIVER_ENV = "ORCHESTRATOR_DRIVER"
NODE_ENV = "ORCHESTRATOR_NODE"
PROC = Path("/proc")


@dataclass(frozen=True)
class Leftover:
    """One process of a run whose orchestrator is gone."""

    pid: int
    run_id: str
    case: str | None
    driver: str
    cmdline: str
    # Where it was found: the Ray node's address on a cluster; None on the driver's machine.
    node: str | None = None
    # The Ray node that started it (servers only), from its NODE_ENV mark.
    started_by: str | None = None

    def describe(self, width: int = 160) -> str:
        where = f"case {self.case}" if self.case else "no case (Ray or driver helper)"
        cmd = self.cmdline if len(self.cmdline) <= width else self.cmdline[: width - 3] + "..."
        on = f" on {self.node}" if self.node else ""
        return f"pid {self.pid}{on} [run {self.run_id}, {where}] {cmd}"


def _start_time(pid: int, proc: Path = PROC) -> str | None:
    """Field 22 of /proc/<pid>/stat (start time in clock ticks since boot), None if gone."""
    try:
        stat = (proc / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces and ')'.
    fields = stat.rsplit(")", 1)[-1].split()
    return fields[19] if len(fields) > 19 else None


def driver_tag(pid: int | None = None) -> str:
    """``host:pid:start-time`` naming the running orchestrator (or `pid`)."""
    pid = os.getpid() if pid is None else pid
    return f"{socket.gethostname()}:{pid}:{_start_time(pid) or '?'}"


def run_env(run_id: str, case: str | None = None) -> dict[str, str]:
    """The variables that mark a process as started by this orchestrator for `run_id`."""
    env = {RUN_ENV: run_id, DRIVER_ENV: driver_tag()}
    if case is not None:
        env[CASE_ENV] = case
    return env


def driver_alive(tag: str, proc: Path = PROC) -> bool | None:
    """Whether the orchestrator named by `tag` still runs; None when it ran on another host."""
    host, _, rest = tag.partition(":")
    pid_s, _, start = rest.partition(":")
    if host != socket.gethostname():
        return None
    try:
        pid = int(pid_s)
    except ValueError:
        return False
    now = _start_time(pid, proc)
    return now is not None and (start == "?" or now == start)


def _environ(pid: int, proc: Path) -> dict[str, str] | None:
    try:
        raw = (proc / str(pid) / "environ").read_bytes()
    except OSError:  # gone, or another user's process
        return None
    env = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.partition(b"=")
        if sep and key.startswith(b"ORCHESTRATOR_"):
            env[key.decode(errors="replace")] = value.decode(errors="replace")
    return env


def _cmdline(pid: int, proc: Path) -> str:
    try:
        raw = (proc / str(pid) / "cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a) or "?"


def marked_processes(proc: Path = PROC, node: str | None = None) -> list[Leftover]:
    """Every readable process carrying a run id, whether its orchestrator runs or not
    (`node` names where the scan ran)."""
    if not proc.is_dir():
        return []
    found = []
    me = os.getpid()
    for entry in proc.iterdir():
        if not entry.name.isdigit() or int(entry.name) == me:
            continue
        pid = int(entry.name)
        env = _environ(pid, proc)
        if not env or RUN_ENV not in env:
            continue
        found.append(
            Leftover(
                pid=pid,
                run_id=env[RUN_ENV],
                case=env.get(CASE_ENV),
                driver=env.get(DRIVER_ENV, ""),
                cmdline=_cmdline(pid, proc),
                node=node,
                started_by=env.get(NODE_ENV),
            )
        )
    return sorted(found, key=lambda p: p.pid)


def find_leftovers(proc: Path = PROC) -> list[Leftover]:
    """Every readable process carrying a run id whose orchestrator is no longer running
    (one that ran on another host is not ours to judge, and is left out)."""
    return [p for p in marked_processes(proc) if driver_alive(p.driver, proc) is False]


def machine_id(proc: Path = PROC) -> str:
    """Which process table this machine's scans read: the boot id and the pid namespace.

    Several Ray nodes can share one (raylets started side by side on one host, as the tests'
    simulated cluster does); containers on one host share the boot id but not the namespace.
    """
    try:
        boot = (proc / "sys" / "kernel" / "random" / "boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        ns = os.readlink(proc / "self" / "ns" / "pid")
    except OSError:
        ns = "?"
    return f"{boot}/{ns}"


def _still_it(p: Leftover, proc: Path) -> bool:
    """The pid still names the same leftover (not a recycled pid)."""
    env = _environ(p.pid, proc)
    return bool(env) and env.get(RUN_ENV) == p.run_id and env.get(DRIVER_ENV) == p.driver


def stop_leftovers(
    leftovers: Iterable[Leftover], grace_s: float = 10.0, proc: Path = PROC
) -> list[Leftover]:
    """SIGTERM (and SIGCONT, so a stopped process can act on it), then SIGKILL after
    `grace_s`; returns those that could not be stopped. Each signal goes only to a pid that
    still names its leftover (a pid recycled meanwhile is left alone)."""
    targets = [p for p in leftovers if _still_it(p, proc)]

    def send(sig: signal.Signals) -> None:
        for p in targets:
            if _still_it(p, proc):
                processes.signal_pid(p.pid, sig)

    processes.stop(send, lambda: any(_still_it(p, proc) for p in targets), grace_s)
    return [p for p in targets if _still_it(p, proc)]
