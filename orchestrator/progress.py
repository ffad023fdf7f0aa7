"""Live progress of a run: cases done / running / left and the current tok/s.

On a terminal it is a one-line rich status that redraws in place; in a log (CI, nohup) it is a
line per event, throttled, so a long run shows life without flooding the log.
"""

from __future__ import annotations

import sys
import time
from typing import Any


class ProgressView:
    def __init__(self, total: int, done: int = 0, *, enabled: bool = True) -> None:
        self.total = total
        self.done = done
        self.failed = 0
        self.enabled = enabled
        self.current: str | None = None
        self.phase = ""
        self.detail = ""
        self._live: Any = None
        self._last_line = 0.0
        self._tty = sys.stderr.isatty()

    def start(self) -> None:
        if self.enabled and self._tty:
            from rich.console import Console
            from rich.live import Live

            self._live = Live(self._render(), console=Console(stderr=True), refresh_per_second=4)
            self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def _text(self) -> str:
        left = self.total - self.done - (1 if self.current else 0)
        head = f"[{self.done}/{self.total} done, {1 if self.current else 0} running, {left} left"
        head += f", {self.failed} failed]" if self.failed else "]"
        if self.current:
            head += f" {self.current}: {self.phase}"
            if self.detail:
                head += f" {self.detail}"
        return head

    def _render(self) -> Any:
        from rich.text import Text

        return Text(self._text())

    def _emit(self, force: bool = False) -> None:
        if not self.enabled:
            return
        if self._live is not None:
            self._live.update(self._render())
            return
        now = time.monotonic()
        if force or now - self._last_line >= 10.0:
            self._last_line = now
            print(self._text(), file=sys.stderr, flush=True)

    def begin(self, case_id: str) -> None:
        self.current, self.phase, self.detail = case_id, "placing", ""
        self._emit(force=True)

    def update(self, case_id: str, phase: str, info: dict[str, Any] | None = None) -> None:
        self.current, self.phase = case_id, phase
        if info:
            parts = []
            if "done" in info and "total" in info and info["total"]:
                parts.append(f"{info['done']}/{info['total']} requests")
            elif "done" in info:
                parts.append(f"{info['done']} requests")
            if info.get("tok_s") is not None:
                parts.append(f"{info['tok_s']:.1f} tok/s")
            if info.get("repeat") is not None:
                parts.append(f"repeat {info['repeat']}")
            self.detail = ", ".join(parts)
        else:
            self.detail = ""
        self._emit(force=info is None)

    def finish(self, case_id: str, row: dict[str, Any]) -> None:
        self.done += 1
        if row.get("status") != "passed":
            self.failed += 1
        self.current = None
        if self.enabled:
            status = row.get("status", "?").upper()
            cols = ", ".join(
                f"{name} {w.get('mean', {}).get('aggregate_tok_s', 0):.2f} tok/s"
                for name, w in row.get("workloads", {}).items()
            )
            msg = f"{status} {case_id}" + (f": {cols}" if cols else "")
            if row.get("reason"):
                msg += f" ({row['reason']})"
            if self._live is not None:
                self._live.console.print(msg)
            else:
                print(msg, file=sys.stderr, flush=True)
        self._emit(force=True)
