"""Process control: is a process (or a process group) alive, signal it, stop it for good,
say how it ended.

Servers and the processes of crashed runs are stopped the same way (``stop``): SIGTERM, then
SIGCONT so a stopped process can act on it, a grace period, then SIGKILL and a short wait for
the kernel to tear the processes down. A vanished process is never an error here: whatever we
signal may exit on its own at any moment.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable

# After SIGKILL: how long to wait for the kernel to reap what was killed, so callers that
# count processes right after see none.
KILL_WAIT_S = 5.0

Sender = Callable[[signal.Signals], None]


def _answers(probe: Callable[[int, int], None], target: int) -> bool:
    """Whether signal 0 reaches `target`: it exists (another user's process counts)."""
    try:
        probe(target, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def pid_alive(pid: int) -> bool:
    """Whether `pid` names a process."""
    return _answers(os.kill, pid)


def group_alive(pgid: int) -> bool:
    """Whether any process of process group `pgid` is left."""
    return _answers(os.killpg, pgid)


def signal_pid(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def pgid_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def descendants(pid: int) -> list[int]:
    """Every descendant of `pid` (psutil comes with vLLM; without it, none are found and
    callers rely on the process group alone)."""
    try:
        import psutil
    except ImportError:
        return []
    try:
        return [p.pid for p in psutil.Process(pid).children(recursive=True)]
    except psutil.Error:
        return []


def describe_exit(code: int | None) -> str:
    """`exited with code 3`, `killed by SIGKILL`, or `exited` when the code is unknown."""
    if code is None:
        return "exited"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def wait_until(done: Callable[[], bool], timeout_s: float, poll_s: float) -> bool:
    """Poll `done` until it holds or `timeout_s` passes; whether it held."""
    deadline = time.monotonic() + timeout_s
    while not done():
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)
    return True


def stop(
    send: Sender,
    alive: Callable[[], bool],
    grace_s: float,
    *,
    after_kill: Callable[[], None] | None = None,
) -> bool:
    """The one kill escalation: `send` SIGTERM and SIGCONT, wait up to `grace_s` for `alive`
    to turn False, then SIGKILL (`after_kill` reaps a child of ours) and wait KILL_WAIT_S.
    Returns whether everything is gone."""
    # SIGCONT after SIGTERM: a stopped (SIGSTOPped, hung in a debugger) process would keep
    # the TERM pending and cost the whole grace period before the SIGKILL.
    for sig in (signal.SIGTERM, signal.SIGCONT):
        send(sig)
    if wait_until(lambda: not alive(), grace_s, 0.1):
        return True
    send(signal.SIGKILL)
    if after_kill is not None:
        after_kill()
    return wait_until(lambda: not alive(), KILL_WAIT_S, 0.05)
