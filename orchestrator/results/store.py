"""The run directory: manifest, per-case logs and records, append-only results, resume.

Layout of ``logs/<run-id>/``::

    manifest.json          matrix as given and expanded, versions, hosts, GPUs, commit
    orchestrator.log       the driver's own log
    results.jsonl          one JSON line per finished case (orchestrator.results.rows.CaseResult),
                           appended atomically
    cases/<slug>/server.log, requests-<workload>.jsonl, audit.json
    report.md, report.json

Nothing is lost: a result line is written with one ``write`` on an O_APPEND descriptor and
fsync'd before the next case starts. A torn last line (power loss, a full disk) is skipped on
read and reported (``torn_tail``); a resume first moves it to results.jsonl.partial, so the
next row is not glued to it.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import fcntl
import json
import os
import re
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from orchestrator.common import safe_io
from orchestrator.common.layout import MANIFEST, RESULTS
from orchestrator.common.layout import case_slug as case_slug  # its readers import it from here
from orchestrator.common.redact import redact
from orchestrator.results.rows import SCHEMA_VERSION, CaseResult

# Where an incomplete last line of results.jsonl is kept when a resume must append after it.
PARTIAL = "results.jsonl.partial"
LOCK = ".lock"


class StoreError(RuntimeError):
    """A run directory that cannot be created, opened or resumed."""


@contextlib.contextmanager
def _refusals() -> Iterator[None]:
    """safe_io's refusals (a link, a FIFO, a bound passed) as StoreError: one line, the file."""
    try:
        yield
    except safe_io.UnsafeFileError as exc:
        raise StoreError(str(exc)) from None


def new_run_id(matrix_name: str, now: dt.datetime | None = None) -> str:
    now = now or dt.datetime.now(dt.timezone.utc)
    return f"{matrix_name}-{now.strftime('%Y%m%d-%H%M%S')}"


def write_text_atomic(path: Path, text: str) -> None:
    """Write via a temp file in the same directory and rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: Path, data: Any) -> None:
    write_text_atomic(path, json.dumps(data, indent=2, default=str) + "\n")


def append_jsonl(path: Path, row: dict[str, Any]) -> None:
    """Append one JSON line with a single write(2) on O_APPEND, then fsync; never through a
    link in the file's place (StoreError)."""
    line = (json.dumps(row, default=str, separators=(",", ":")) + "\n").encode()
    with _refusals():
        safe_io.append_bytes(path, line, sync=True)


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Read complete JSON lines; a torn final line (no newline, or bad JSON) is skipped."""
    return [row for _, row in read_jsonl_numbered(path)]


def read_jsonl_numbered(path: Path) -> list[tuple[int, Any]]:
    """(line number, value) of each complete JSON line; see read_jsonl. A file that is no
    regular file, a line or file past its bound, or a value nested too deep is a StoreError
    (safe_io states the bounds)."""
    if not os.path.lexists(path):
        return []
    try:
        with _refusals():
            return list(safe_io.iter_json_lines(path))
    except OSError as exc:
        raise StoreError(f"{path}: cannot read it ({exc.strerror})") from None


def new_run_root(logs_dir: Path, run_id: str) -> Path:
    """The directory a new run `run_id` gets, absolute; StoreError when the id is not a
    valid name or a run (or anything) is there already. Checked before a run starts
    anything (orchestrator.execution.preflight), and again when the directory is made."""
    if not re.fullmatch(r"[A-Za-z0-9_.-]+", run_id) or run_id in (".", ".."):
        raise StoreError(f"run id {run_id!r} may hold only letters, digits, '.', '_' and '-'")
    # Absolute: every path handed to a server is built from this root, and a server runs
    # in its case directory, where a relative path would name a folder inside itself.
    root = (logs_dir / run_id).absolute()
    if root.exists():
        raise StoreError(_taken(root, run_id))
    return root


def _taken(root: Path, run_id: str) -> str:
    return f"{root} exists already; pass --resume {run_id} to continue it"


class RunStore:
    """One run directory. Create it for a new run, or open it to resume or report."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._lock_fd: int | None = None

    # -- lifecycle ---------------------------------------------------------------------------
    @classmethod
    def create(cls, logs_dir: Path, run_id: str) -> RunStore:
        root = new_run_root(logs_dir, run_id)
        try:
            root.mkdir(parents=True, exist_ok=False)
        except FileExistsError:
            raise StoreError(_taken(root, run_id)) from None
        (root / "cases").mkdir()
        return cls(root)

    @classmethod
    def open(cls, logs_dir: Path, run_id: str) -> RunStore:
        """The run `run_id` names (in `logs_dir`, or a path) to resume."""
        root = (Path(run_id) if os.sep in run_id else logs_dir / run_id).absolute()
        if not (root / MANIFEST).is_file():
            raise StoreError(f"{root}: no run to resume (missing {MANIFEST})")
        with _refusals():  # a folder someone prepared must not redirect what the run writes
            safe_io.check_run_dir(root)
        return cls(root)

    @classmethod
    def read(cls, path: str | Path) -> RunStore:
        """A run directory to read (report, compare), or StoreError naming the path and
        what is wrong with it: missing, no manifest, an unreadable or incomplete one."""
        root = Path(path)
        if not root.is_dir():
            raise StoreError(f"{root}: not a run directory (does not exist)")
        manifest_path = root / MANIFEST
        if not os.path.lexists(manifest_path):  # anything else in its place is read, refused
            raise StoreError(f"{root}: not a run directory (missing {MANIFEST})")
        try:
            manifest = safe_io.read_json(manifest_path)
        except safe_io.UnsafeFileError as exc:
            raise StoreError(f"{exc.path}: unreadable manifest ({exc.reason})") from None
        except OSError as exc:
            raise StoreError(f"{manifest_path}: unreadable manifest ({exc})") from None
        if not isinstance(manifest, dict):
            raise StoreError(f"{manifest_path}: manifest is not a JSON object")
        for key in ("run_id", "cases", "matrix"):
            if key not in manifest:
                raise StoreError(f"{manifest_path}: manifest has no {key!r}")
        # No results.jsonl is a run that stopped before its first case finished: it has no rows.
        return cls(root)

    def lock(self) -> None:
        """Hold an exclusive lock so two orchestrators never write one run directory."""
        with _refusals():
            fd = safe_io.open_for_writing(self.root / LOCK, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            holder = (self.root / LOCK).read_text().strip() or "another process"
            raise StoreError(f"{self.root} is in use by {holder}") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"pid {os.getpid()}\n".encode())
        self._lock_fd = fd

    def unlock(self) -> None:
        """Let the run directory go; the lock file goes with it (a finished run leaves no
        `.lock` naming a pid that is gone). Removed while still held: an orchestrator that
        opened the old file meanwhile was refused (LOCK_NB), one that comes later makes a
        new file."""
        if self._lock_fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.root / LOCK)
            os.close(self._lock_fd)
            self._lock_fd = None

    # -- contents ----------------------------------------------------------------------------
    @property
    def run_id(self) -> str:
        return self.root.name

    @property
    def results_path(self) -> Path:
        return self.root / RESULTS

    def case_dir(self, slug: str) -> Path:
        d = self.root / "cases" / slug
        d.mkdir(parents=True, exist_ok=True)
        with _refusals():  # a link put there while the run went on
            safe_io.check_not_linked(d)
        return d

    def write_manifest(self, manifest: dict[str, Any], secrets: tuple[str, ...] = ()) -> None:
        write_json_atomic(self.root / MANIFEST, redact(manifest, secrets))

    def manifest(self) -> dict[str, Any]:
        with _refusals():
            return safe_io.read_json(self.root / MANIFEST)

    def append_result(self, result: CaseResult, secrets: tuple[str, ...] = ()) -> None:
        """One line more in results.jsonl: the row as written, stamped with the schema
        version it follows (a row read back from an older run keeps the one it had)."""
        row = result.to_record()
        row.setdefault("schema_version", SCHEMA_VERSION)
        append_jsonl(self.results_path, redact(row, secrets))

    def results(self) -> list[CaseResult]:
        """Rows in the order they were last written; when a case was re-run
        (--retry-failed), its last row wins. StoreError names a row that is not a result."""
        latest: dict[str, CaseResult] = {}
        for number, row in read_jsonl_numbered(self.results_path):
            try:
                result = CaseResult.model_validate(row)
            except ValidationError as exc:
                err = exc.errors()[0]
                field = ".".join(str(p) for p in err["loc"]) or "row"
                raise StoreError(f"{self.results_path}:{number}: {field}: {err['msg']}") from None
            latest.pop(result.case_id, None)
            latest[result.case_id] = result
        return list(latest.values())

    def torn_tail(self) -> int:
        """Bytes after the last newline of results.jsonl: an incomplete last row (a power
        loss mid-write, a disk that filled), which readers skip; 0 when there is none."""
        try:
            with _refusals(), safe_io.open_regular(self.results_path) as f:
                size = f.seek(0, os.SEEK_END)
                block = 1 << 16
                pos = size
                while pos > 0:
                    start = max(pos - block, 0)
                    f.seek(start)
                    chunk = f.read(pos - start)
                    newline = chunk.rfind(b"\n")
                    if newline >= 0:
                        return size - (start + newline + 1)
                    pos = start
                return size
        except FileNotFoundError:
            return 0

    def set_aside_torn_tail(self) -> str | None:
        """Move an incomplete last line of results.jsonl to results.jsonl.partial (appended
        there), so the next row starts a line of its own instead of being glued to it and
        lost; a sentence saying so, or None when the file ends cleanly. Call with the lock
        held."""
        torn = self.torn_tail()
        if not torn:
            return None
        with self.results_path.open("r+b") as f:
            f.seek(-torn, os.SEEK_END)
            tail = f.read()
            with _refusals():  # never through a link someone left in the run folder
                safe_io.append_bytes(self.root / PARTIAL, tail + b"\n", sync=True)
            f.truncate(f.seek(-torn, os.SEEK_END))
            f.flush()
            os.fsync(f.fileno())
        return (
            f"{self.results_path}: its last line was incomplete ({torn} bytes, no newline): "
            f"kept in {PARTIAL}; that case has no result and runs again"
        )

    def finished_case_ids(self, *, include_failed: bool = True) -> set[str]:
        return {r.case_id for r in self.results() if include_failed or r.passed}

    def records_path(self, slug: str, workload: str) -> Path:
        """Where a case's per-request records of one workload are (reading creates nothing)."""
        return self.root / "cases" / slug / f"requests-{workload}.jsonl"

    def read_records(self, slug: str, workload: str) -> list[dict[str, Any]]:
        """A workload's request records, or [] when none were written (older runs, a case that
        failed before the workload)."""
        return read_jsonl(self.records_path(slug, workload))

    def write_records(self, slug: str, workload: str, records: Iterable[dict[str, Any]]) -> Path:
        self.case_dir(slug)
        path = self.records_path(slug, workload)
        lines = "".join(json.dumps(r, default=str, separators=(",", ":")) + "\n" for r in records)
        write_text_atomic(path, lines)
        return path
