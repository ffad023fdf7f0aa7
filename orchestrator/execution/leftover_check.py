"""Before a run starts: the processes of crashed runs still running (found and stopped by
orchestrator.cluster.leftovers), refused, warned of or stopped; and the mark this run leaves
on what it starts, by which a later run finds this one's."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator, Sequence

from orchestrator.cluster.leftovers import Leftover, find_leftovers, run_env, stop_leftovers


class LeftoverError(ValueError):
    """Processes a crashed attempt of this run left behind still run; nothing was started."""


def _pids(leftovers: Sequence[Leftover]) -> str:
    return " ".join(str(p.pid) for p in leftovers)


def handle_leftovers(
    run_id: str,
    *,
    resuming: bool,
    kill: bool,
    log: Callable[[str], None],
    find: Callable[[], list[Leftover]] = find_leftovers,
    stop: Callable[[list[Leftover]], list[Leftover]] = stop_leftovers,
) -> list[Leftover]:
    """Find processes of runs whose orchestrator is gone (see orchestrator.cluster.leftovers), with
    `find` and `stop`: this machine's by default, every node's on a cluster.

    With `kill`, stop them all. Otherwise a resumed run refuses to start while its own
    earlier attempt's processes run (they hold the memory and GPUs its cases need, and
    the user should decide what happens to them), and any run warns about other runs'
    leftovers: on a shared machine they may be another user's business, but this run
    must say why it may be short of memory. Returns what was found.
    """
    found = find()
    if not found:
        return found
    listing = "\n".join(f"  {p.describe()}" for p in found)

    def warn(msg: str) -> None:
        log(msg)
        print(f"orchestrator: {msg}", file=sys.stderr, flush=True)

    if kill:
        stuck = stop(found)
        warn(
            f"stopped {len(found) - len(stuck)} leftover process(es) of crashed runs "
            f"(--kill-leftovers):\n{listing}"
        )
        if stuck:
            raise LeftoverError(f"could not stop leftover process(es) {_pids(stuck)}")
        return found
    own = [p for p in found if resuming and p.run_id == run_id]
    if own:
        raise LeftoverError(
            f"run {run_id}: {len(own)} process(es) of an earlier attempt of this run are "
            f"still running, and the orchestrator that started them is gone:\n{listing}\n"
            f"stop them (kill {_pids(found)}; they may need kill -CONT too) "
            "or resume with --kill-leftovers"
        )
    warn(
        f"warning: {len(found)} process(es) of crashed runs are still running; they may hold "
        f"memory or GPUs this run needs:\n{listing}\n"
        f"stop them (kill {_pids(found)}) or pass --kill-leftovers"
    )
    return found


@contextlib.contextmanager
def marked_environ(run_id: str) -> Iterator[None]:
    """The local Ray's daemons and workers inherit the driver's environment: marked with the
    run, they are found as leftovers too if this process dies without stopping them."""
    marks = run_env(run_id)
    saved = {k: os.environ.get(k) for k in marks}
    os.environ.update(marks)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
