"""Files someone else may have prepared: a run directory resumed or reported, a matrix, a
log or a trace named on the command line.

- Writes into a run directory never follow a symbolic link (``O_NOFOLLOW``) and never block
  on a FIFO; resuming a run whose folder holds a link is refused before anything starts.
- Reads take regular files only (a FIFO or /dev/zero, linked or not, is refused without
  blocking) and never more than a stated number of bytes.
- JSON is held to a nesting depth, and a lone UTF-16 surrogate (valid JSON, unwritable
  UTF-8) becomes U+FFFD; YAML is held to a nesting depth and an expansion budget (aliases
  followed), so a 625-byte "billion laughs" is refused in milliseconds.

Every refusal is an `UnsafeFileError`: one line naming the file and what is wrong with it.
The bounds are documented in docs/security.md. Standard library and PyYAML only: the audit
imports this module and must stay light.
"""

from __future__ import annotations

import errno
import itertools
import json
import os
import re
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import yaml

MIB = 1 << 20
# Nesting depth of any JSON or YAML the orchestrator reads (its own files nest ≤ 8 deep).
MAX_JSON_DEPTH = 64
# A JSON file of a run directory (manifest.json, overhead.json, audit.json).
MAX_JSON_FILE_BYTES = 64 * MIB
# One line of a JSON-lines file (results.jsonl, requests-*.jsonl), and the whole file.
MAX_JSONL_LINE_BYTES = 64 * MIB
MAX_JSONL_BYTES = 1 << 30
# A matrix or a vLLM --config file, as text and as the tree it expands to (aliases followed).
MAX_YAML_BYTES = 1 * MIB
MAX_YAML_NODES = 100_000

_LINK_ADVICE = "a run directory's files are written only in place, never through a link"
_SURROGATE = re.compile("[\ud800-\udfff]")


class UnsafeFileError(ValueError):
    """A file refused: ``str()`` is one line, the path and the reason."""

    def __init__(self, path: str | Path, reason: str) -> None:
        self.path = str(path)
        self.reason = reason
        super().__init__(f"{path}: {reason}")


def size_text(n: int) -> str:
    """``64 MiB``, ``2 GiB``: how the bounds are stated to users."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale} {unit}"
    return f"{n} bytes"


# --------------------------------------------------------------------------- writing


def open_for_writing(path: Path, flags: int, mode: int = 0o644) -> int:
    """``os.open`` for a file of a run directory: a link in its place is refused (the one
    line says so), and so is anything but a regular file (a FIFO would block the run)."""
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    except OSError as exc:
        refusal = _refusal(path, exc)
        if refusal is exc:
            raise
        raise refusal from None
    _regular_or_close(fd, path)
    os.set_blocking(fd, True)
    return fd


def append_bytes(path: Path, data: bytes, *, sync: bool = False) -> None:
    """Append `data` with one write(2) per pass on an O_APPEND descriptor (see open_for_writing)."""
    fd = open_for_writing(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if sync:
            os.fsync(fd)
    finally:
        os.close(fd)


def check_not_linked(path: Path) -> None:
    """Refuse `path` if it is a symbolic link (a file about to be replaced or read whole)."""
    if os.path.islink(path):
        raise UnsafeFileError(path, f"is a symbolic link; {_LINK_ADVICE} (remove it)")


def check_run_dir(root: Path) -> None:
    """No symbolic link among what a run writes: the run folder's entries, those of its
    cases/ folder and of each case folder (caches inside them are vLLM's, not read)."""
    cases = root / "cases"
    folders = [root, cases]
    if cases.is_dir() and not cases.is_symlink():
        with os.scandir(cases) as entries:
            folders += [Path(e.path) for e in entries if e.is_dir(follow_symlinks=False)]
    for folder in folders:
        if not folder.is_dir():
            continue
        with os.scandir(folder) as entries:
            for entry in entries:
                if entry.is_symlink():
                    check_not_linked(Path(entry.path))


def private_dir(path: Path, what: str, fix: str = "remove it") -> None:
    """Make `path` a folder only this user can enter (0700), or accept it if it already is
    one; refuse a link, another user's folder, or one others may read or write (the refusal
    names `what` it is and ends with `fix`). For folders with predictable names in a shared
    /tmp (vLLM's IPC sockets go in the server's TMPDIR)."""
    try:
        os.mkdir(path, 0o700)
        return
    except FileExistsError:
        pass
    except OSError as exc:
        raise UnsafeFileError(path, f"{what}: cannot create it ({exc.strerror})") from None
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeFileError(path, f"{what} is a symbolic link; {fix}")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeFileError(path, f"{what} exists and is not a folder; {fix}")
    if st.st_uid != os.getuid():
        raise UnsafeFileError(
            path, f"{what} belongs to uid {st.st_uid}, not to this user (uid {os.getuid()}); {fix}"
        )
    if st.st_mode & 0o077:
        mode = oct(stat.S_IMODE(st.st_mode))
        raise UnsafeFileError(path, f"{what} has mode {mode}, open to others (0700 needed); {fix}")


# --------------------------------------------------------------------------- reading


def open_regular(path: Path) -> IO[bytes]:
    """A regular file opened for reading (links followed); anything else is refused without
    blocking: a FIFO would hang the reader, /dev/zero would fill its memory. A file that
    cannot be opened raises OSError, as open() does."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    _regular_or_close(fd, path)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_bytes(path: Path, limit: int) -> bytes:
    """A regular file's bytes, refused past `limit`."""
    with open_regular(path) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise UnsafeFileError(path, f"larger than {size_text(limit)}, this file's bound")
    return data


def read_text(path: Path, limit: int) -> str:
    """A regular file's UTF-8 text, refused past `limit` bytes."""
    try:
        return read_bytes(path, limit).decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UnsafeFileError(path, f"not UTF-8 text ({exc.reason} at byte {exc.start})") from None


def read_json(path: Path, limit: int = MAX_JSON_FILE_BYTES) -> Any:
    """A JSON file's value, checked (see `checked_json`)."""
    text = read_text(path, limit)
    try:
        return checked_json(json.loads(text), path)
    except json.JSONDecodeError as exc:
        raise UnsafeFileError(path, f"not JSON ({exc.msg} at line {exc.lineno})") from None
    except RecursionError:
        raise UnsafeFileError(path, f"nests deeper than {MAX_JSON_DEPTH} levels") from None


def iter_json_lines(
    path: Path, line_limit: int = MAX_JSONL_LINE_BYTES, limit: int = MAX_JSONL_BYTES
) -> Iterator[tuple[int, Any]]:
    """(line number, value) of each complete JSON line. A line that is not JSON is skipped,
    and a last line without its newline (torn by a crash) ends the file; a line or a file
    past its bound, or a value nested too deep, is refused."""
    total = 0
    with open_regular(path) as f:
        for number in itertools.count(1):
            raw = f.readline(line_limit + 1)
            total += len(raw)
            if len(raw) > line_limit:
                raise UnsafeFileError(
                    path, f"line {number} is longer than {size_text(line_limit)}, a row's bound"
                )
            if total > limit:
                raise UnsafeFileError(path, f"larger than {size_text(limit)}, this file's bound")
            if not raw.endswith(b"\n"):
                return
            try:
                value = json.loads(raw)
            except json.JSONDecodeError:
                continue
            except RecursionError:
                raise UnsafeFileError(
                    path, f"line {number} nests deeper than {MAX_JSON_DEPTH} levels"
                ) from None
            yield number, checked_json(value, path, f"line {number} ")


def checked_json(value: Any, path: str | Path, where: str = "") -> Any:
    """`value` with every lone surrogate replaced by U+FFFD; refused when it nests deeper
    than MAX_JSON_DEPTH (a report renders it, recursively)."""
    root = [value]
    stack: list[tuple[Any, Any, int]] = [(root, 0, 0)]
    while stack:
        parent, key, depth = stack.pop()
        node = parent[key]
        if isinstance(node, str):
            if _SURROGATE.search(node):
                parent[key] = _SURROGATE.sub("\ufffd", node)
            continue
        if not isinstance(node, (dict, list)):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise UnsafeFileError(path, f"{where}nests deeper than {MAX_JSON_DEPTH} levels")
        if isinstance(node, dict):
            if any(isinstance(k, str) and _SURROGATE.search(k) for k in node):
                fixed = {_SURROGATE.sub("\ufffd", k): v for k, v in node.items()}
                node.clear()
                node.update(fixed)
            stack.extend((node, k, depth + 1) for k in node)
        else:
            stack.extend((node, i, depth + 1) for i in range(len(node)))
    return root[0]


def load_yaml(text: str, source: str | Path) -> Any:
    """`yaml.safe_load`, held to MAX_YAML_NODES once expanded and MAX_JSON_DEPTH levels.

    PyYAML builds an alias as a second reference to one object, so the document loads small
    however it expands; whatever walks it later (interpolation, validation) meets every copy.
    The walk here counts them, and stops at the budget. yaml.YAMLError passes through.
    """
    try:
        data = yaml.safe_load(text)
    except RecursionError:
        raise UnsafeFileError(source, f"nests deeper than {MAX_JSON_DEPTH} levels") from None
    stack: list[tuple[Any, int]] = [(data, 0)]
    nodes = 0
    while stack:
        node, depth = stack.pop()
        nodes += 1
        if nodes > MAX_YAML_NODES:
            raise UnsafeFileError(
                source,
                f"expands to more than {MAX_YAML_NODES:,} values (YAML aliases followed); "
                "a matrix that large is a mistake or an attack",
            )
        if isinstance(node, (dict, list)):
            if depth >= MAX_JSON_DEPTH:
                raise UnsafeFileError(source, f"nests deeper than {MAX_JSON_DEPTH} levels")
            children = [*node.keys(), *node.values()] if isinstance(node, dict) else node
            stack.extend((c, depth + 1) for c in children)
    return data


# --------------------------------------------------------------------------- helpers


def _regular_or_close(fd: int, path: Path) -> None:
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise UnsafeFileError(path, f"not a regular file ({_kind(mode)})")


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISSOCK, "a socket"),
    ):
        if test(mode):
            return name
    return "a special file"


def _refusal(path: Path, exc: OSError) -> OSError:
    """The refusal an open for writing met, or the OSError itself (permissions, a missing
    folder: what open() would raise)."""
    if exc.errno == errno.ELOOP:
        return UnsafeFileError(path, f"is a symbolic link; {_LINK_ADVICE} (remove it)")
    if exc.errno == errno.ENXIO:  # a FIFO with no reader, opened to write without blocking
        return UnsafeFileError(path, "not a regular file (a FIFO)")
    if exc.errno == errno.EISDIR:
        return UnsafeFileError(path, "not a regular file (a directory)")
    return exc
