"""Live progress of a run: where it is, how long each part has taken, and how long is left.

What it shows: cases done / failed of the total, the run's elapsed time and ETA
(orchestrator.plan.estimate.Eta: the plan's estimate, corrected by measured cases), the current
case and its phase with their elapsed times, during a workload its repeat, requests done of
the total, errors and output tok/s so far, and while a server starts (a minute on CPU, many
on a big GPU node) the last line its log printed, so start-up is not a silent wait.

On a terminal it is a rich live block that redraws in place four times a second. Anywhere
else (CI, nohup, a pipe) it is plain lines without control codes: one per event (a case
begins, a phase begins, a case ends) and, while a phase runs, one every PLAIN_EVERY_S,
growing to PLAIN_MAX_EVERY_S in long phases, so a ten-hour night writes hundreds of lines,
not hundreds of thousands. Everything goes to stderr: stdout is for results.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TextIO

from orchestrator.common.redact import redact_text
from orchestrator.engines import Engine
from orchestrator.plan.estimate import Eta, human_s
from orchestrator.results.rows import CaseResult

log = logging.getLogger(__name__)

PLAIN_EVERY_S = 10.0
PLAIN_MAX_EVERY_S = 60.0
_TICK_S = 1.0
_LOG_TAIL_BYTES = 16384
_LOG_LINE_CHARS = 120
STOPPING = (
    "stopping"  # the phase in which a case's server is stopped (orchestrator.execution.case_run)
)


def last_log_line(path: Path, engine: Engine, secrets: tuple[str, ...] = ()) -> str | None:
    """The last non-empty line of a server log, as `engine` quotes it (Engine.log_message:
    vLLM's without its prefix, a WARNING or ERROR keeping its level), redacted and shortened;
    None when there is none yet.

    Only the tail is read, so calling it four times a second on a log of any size is cheap.
    The log is raw while the server runs (it is redacted once the server stops), hence the
    redaction here."""
    try:
        with path.open("rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(size - _LOG_TAIL_BYTES, 0))
            tail = f.read().decode("utf-8", "replace")
    except OSError:
        return None
    # tqdm bars redraw with \r: the last segment of a line is what a terminal would show.
    for raw in reversed(tail.splitlines()):
        shown = [seg for seg in raw.split("\r") if seg.strip()]
        line = engine.log_message(shown[-1]) if shown else None
        if line is None:
            continue
        line = redact_text(line, secrets)
        return line if len(line) <= _LOG_LINE_CHARS else line[: _LOG_LINE_CHARS - 1] + "…"
    return None


class ProgressView:
    """The run's live status; the runner calls begin/update/finish, nothing here blocks it.

    The run's clock starts when the view is made (before Ray starts, which is part of the
    run). `engine` quotes the lines of a starting server's log (last_log_line). `stream`
    (default stderr), `tty` (default: whether the stream is one) and `clock` (default
    time.monotonic) are there for tests; `secrets` are scrubbed from quoted log lines.
    """

    def __init__(
        self,
        total: int,
        done: int = 0,
        *,
        engine: Engine,
        enabled: bool = True,
        stream: TextIO | None = None,
        tty: bool | None = None,
        clock: Callable[[], float] = time.monotonic,
        secrets: tuple[str, ...] = (),
    ) -> None:
        self.total = total
        self.done = done
        self.failed = 0
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.clock = clock
        self.secrets = secrets
        self.engine = engine
        self.eta: Eta | None = None
        self.current: str | None = None
        self.phase = ""
        # The current case's last phase before its stop began: what an interrupt cut short
        # (the stop itself follows any interrupt).
        self.working_phase = ""
        self.info: dict[str, Any] = {}
        self.server_log: Path | None = None
        self._t_run = clock()
        self._t_case = self._t_phase = self._last_line = self._t_run
        self._lock = threading.RLock()
        self._live: Any = None
        self._ticker: threading.Thread | None = None
        self._stopped = threading.Event()

    # ------------------------------------------------------------------ runner's calls

    def expect(self, todo: Sequence[str], estimates: Mapping[str, float], done: int) -> None:
        """The cases this run will measure, in order, and the plan's estimate of each."""
        with self._lock:
            self.done = done
            self.eta = Eta(estimates, todo)

    def start(self) -> None:
        if not self.enabled:
            return
        if self.tty:
            from rich.console import Console
            from rich.live import Live

            console = Console(file=self.stream, force_terminal=True)
            # transient: the block goes when the run ends, leaving the case lines and the
            # closing summary, not a frozen status.
            self._live = Live(self, console=console, refresh_per_second=4, transient=True)
            self._live.start()
        else:
            self._ticker = threading.Thread(target=self._tick_loop, name="progress", daemon=True)
            self._ticker.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._ticker is not None:
            self._ticker.join(timeout=2 * _TICK_S)
            self._ticker = None
        if self._live is not None:
            self._live.stop()
            self._live = None

    def note(self, line: str) -> None:
        """A line of its own in the progress (the run's id and directory, when it starts)."""
        self._event(line)

    def begin(self, case_id: str) -> None:
        with self._lock:
            self.current = case_id
            self._t_case = self.clock()
            self.server_log = None
            self._set_phase("placing")
        n = self.done + 1
        self._event(f"case {n}/{self.total} {case_id}: placing")

    def update(
        self,
        case_id: str,
        phase: str,
        info: dict[str, Any] | None = None,
        *,
        server_log: Path | None = None,
    ) -> None:
        """A phase begins (info None), or a workload reports progress (info from
        orchestrator.client.workload: repeat, repeats, done, total, errors, elapsed_s, tok_s)."""
        lines = []
        with self._lock:
            plain = self._live is None  # a terminal's live block shows all this already
            new_phase = info is None or phase != self.phase
            if new_phase and self.info and plain:
                # The workload that just ended, as it ended: a short one leaves no other line
                # with its request count.
                lines.append(self.status_line())
            self.current = case_id
            if server_log is not None:
                self.server_log = server_log
            if new_phase:
                self._set_phase(phase)
            if info is not None:
                self.info = dict(info)
            if new_phase and plain:
                lines.append(self.status_line())
        for line in lines:
            self._event(line)

    def finish(self, case_id: str, row: CaseResult) -> None:
        passed = row.passed
        with self._lock:
            took = self.clock() - self._t_case
            self.done += 1
            self.failed += not passed
            self.current, self.phase, self.info, self.server_log = None, "", {}, None
            if self.eta is not None:
                self.eta.finished(case_id, took, passed)
        cols = ", ".join(
            f"{name} {w.mean.aggregate_tok_s or 0:.2f} tok/s" for name, w in row.workloads.items()
        )
        msg = f"{'PASSED' if passed else 'FAILED'} {case_id} in {human_s(took)}"
        msg += f": {cols}" if cols else ""
        if row.reason:
            # Its first line, the root cause when known; the whole reason (what happened, the
            # log's last lines) is printed when the run ends.
            msg += f" ({row.reason.partition(chr(10))[0]})"
        self._event(f"{msg} | {self._run_part()}")

    # ------------------------------------------------------------------ rendering

    def _set_phase(self, phase: str) -> None:
        if phase != STOPPING:
            self.working_phase = phase
        self.phase = phase
        self.info = {}
        self._t_phase = self.clock()

    def _run_part(self) -> str:
        now = self.clock()
        head = f"{self.done}/{self.total} done"
        head += f", {self.failed} failed" if self.failed else ""
        head += f" | run {human_s(now - self._t_run)}"
        if self.eta is not None and (self.current or self.eta.left):
            left = self.eta.remaining_s(self.current, now - self._t_case if self.current else 0)
            head += f" | ETA {human_s(left)}"
        return head

    def _case_part(self) -> str:
        if not self.current:
            return ""
        now = self.clock()
        i = self.info
        out = f"{self.current}: {self.phase}"
        if i:
            if i.get("repeats", 1) > 1:
                out += f" repeat {i.get('repeat')}/{i['repeats']}"
            if i.get("total"):
                out += f", {i.get('done', 0)}/{i['total']} requests"
            else:
                out += f", {i.get('done', 0)} requests"
                if i.get("duration_s"):
                    out += f", {i.get('elapsed_s', 0):.0f} of {i['duration_s']:g} s"
            if i.get("errors"):
                out += f", {i['errors']} error{'s' if i['errors'] != 1 else ''}"
            out += f", {i.get('tok_s') or 0:.1f} tok/s"
        out += f", {human_s(now - self._t_phase)} (case {human_s(now - self._t_case)})"
        return out

    def _log_part(self) -> str:
        if self.phase != "starting" or self.server_log is None:
            return ""
        line = last_log_line(self.server_log, self.engine, self.secrets)
        return f"server: {line}" if line else ""

    def status_line(self) -> str:
        """The whole status as one line: what a plain log gets."""
        with self._lock:
            head, case, log_line = f"[{self._run_part()}]", self._case_part(), self._log_part()
        return " ".join(p for p in (head, case) if p) + (f" | {log_line}" if log_line else "")

    def __rich__(self) -> Any:
        """The terminal block; rich's Live calls this at every refresh."""
        from rich.text import Text

        with self._lock:
            text = Text()
            text.append(self._run_part(), style="bold")
            case, log = self._case_part(), self._log_part()
        if case:
            text.append("\n" + case)
        if log:
            text.append("\n" + log, style="dim")
        return text

    # ------------------------------------------------------------------ output

    def _event(self, line: str) -> None:
        if not self.enabled:
            return
        with self._lock:
            self._last_line = self.clock()
            if self._live is not None:
                self._live.console.print(line, markup=False, highlight=False)
            else:
                print(line, file=self.stream, flush=True)

    def plain_interval_s(self) -> float:
        """Seconds between plain lines during the current phase: a sixth of its age, within
        PLAIN_EVERY_S..PLAIN_MAX_EVERY_S."""
        age = self.clock() - self._t_phase
        return min(PLAIN_MAX_EVERY_S, max(PLAIN_EVERY_S, age / 6))

    def tick(self) -> None:
        """Write a plain status line if the current phase has been quiet long enough."""
        if not self.enabled or self._live is not None or not self.current:
            return
        with self._lock:
            due = self.clock() - self._last_line >= self.plain_interval_s()
        if due:
            self._event(self.status_line())

    def _tick_loop(self) -> None:
        while not self._stopped.wait(_TICK_S):
            try:
                self.tick()
            except Exception:  # a progress line must never cost the run
                log.exception("progress line failed")
