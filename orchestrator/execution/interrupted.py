"""A run stopped by Ctrl-C or SIGTERM: what the user is told, and what its directory keeps.

The runner unwinds (servers stopped, finished rows kept, reports written), then raises
``RunInterrupted``, which carries what the CLI prints: the run's id, where it is, and the
exact command that continues it. The attempt's figures in overhead.json say it was
interrupted, by what, and which case it cut short (``figures``); every report reads them
from there. The case that was cut short has no result row: its folder gets
``interrupted.json`` saying so (``mark_cut_short``), so a folder without a row is never a
mystery; a resume that runs the case again moves the mark aside with its old log.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from orchestrator.common.layout import INTERRUPTED_MARK

MARK = INTERRUPTED_MARK
DEFAULT_LOGS_DIR = Path("logs")  # the CLI's --logs-dir default: left out of the command


class RunInterrupted(KeyboardInterrupt):
    """The run was interrupted and has unwound; the message is what the user reads."""

    def __init__(
        self,
        how: str,
        run_id: str,
        run_dir: Path | None,
        resume: str,
        finished: int,
        total: int,
    ) -> None:
        super().__init__(how)
        self.how, self.run_id, self.run_dir = how, run_id, run_dir
        self.resume, self.finished, self.total = resume, finished, total

    def lines(self) -> list[str]:
        """What the CLI prints: where the run is, then the command that continues it."""
        if self.run_dir is None:
            return [f"interrupted ({self.how}) before run {self.run_id} started: nothing kept"]
        return [
            f"interrupted ({self.how}): run {self.run_id} keeps {self.finished} of "
            f"{self.total} cases in {self.run_dir}",
            f"continue with: {self.resume}",
        ]


def how(exc: BaseException) -> str:
    """The signal that interrupted the run, as a person names it."""
    name = str(exc.args[0]) if exc.args else ""
    return name if name.startswith("SIG") else "Ctrl-C"


def resume_command(
    matrix_path: str | Path,
    run_id: str,
    *,
    logs_dir: Path,
    sets: Sequence[str] = (),
    only: Sequence[str] = (),
    ray_address: str | None = None,
    quiet: bool = False,
) -> str:
    """The command line that continues `run_id` as it was started (the same matrix and
    overrides: a resume must expand to the same cases, and measure them the same way)."""
    argv = ["orchestrator", "run", str(matrix_path), "--resume", run_id]
    if Path(logs_dir) != DEFAULT_LOGS_DIR:
        argv += ["--logs-dir", str(logs_dir)]
    for s in sets:
        argv += ["--set", s]
    for o in only:
        argv += ["--only", o]
    if ray_address:
        argv += ["--ray-address", ray_address]
    if quiet:
        argv.append("--quiet")
    return shlex.join(argv)


def figures(
    how_: str,
    resume: str,
    cut_short: dict[str, Any] | None,
) -> dict[str, Any]:
    """What an interrupted attempt adds to its overhead figures (overhead.json)."""
    out: dict[str, Any] = {"interrupted": how_, "resume": resume}
    if cut_short:
        out["cut_short"] = cut_short
    return out


def mark_cut_short(case_dir: Path, record: dict[str, Any]) -> Path:
    """Say in the case's folder that it has no result because the run was interrupted."""
    path = case_dir / MARK
    text = json.dumps(
        {
            "result": "none: the run was interrupted during this case; `--resume` runs it "
            "again (its server log so far is kept as server-attempt<N>.log then)",
            **record,  # a run stopped another way says so in its own "result"
        },
        indent=2,
    )
    path.write_text(text + "\n", encoding="utf-8")
    return path


def set_aside_mark(case_dir: Path) -> Path | None:
    """Before a case runs again: its earlier attempt's mark, renamed beside that attempt's
    log (interrupted-attempt1.json), so the folder describes the attempt it holds."""
    path = case_dir / MARK
    if not path.exists():
        return None
    n = 1
    while (dest := case_dir / f"interrupted-attempt{n}.json").exists():
        n += 1
    path.rename(dest)
    return dest
