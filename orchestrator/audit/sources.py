"""What the audit reads: log files (plain, rotated, gzip), the kernel log, GPU state.

Log files are opened by content (a rotated ``.1`` may be gzip) and read in blocks; the kernel
log comes from journalctl, else dmesg, since a time; the GPUs' ECC and row-remapper state
from nvidia-smi (orchestrator.common.probes). The kernel log and nvidia-smi take a ``runner``: on a
cluster, a node agent runs them on the node the server ran on.
"""

from __future__ import annotations

import gzip
import re
import subprocess
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from orchestrator.audit.catalogue import Catalogue, load_catalogue
from orchestrator.audit.findings import AuditInputError, Finding, SourceStatus
from orchestrator.common.probes import NvidiaSmiError, Runner, first_line, nvidia_smi, run_command
from orchestrator.common.safe_io import UnsafeFileError, open_regular

# 8 MiB blocks: large enough that per-block Python and grep start-up cost vanish
# (<1 % at 8 MiB on the 2-core sandbox), small enough to keep memory flat on GB logs.
BLOCK_BYTES = 8 << 20
# Text one compressed log may decompress to. A rotated vLLM log is well under it; a gzip
# bomb (deflate reaches ~1000:1: 37 MB held 8 GiB) is refused past it, in seconds, instead
# of being read for minutes. A larger real log can be decompressed and audited plain.
MAX_GZIP_BYTES = 2 << 30


# Log file names a directory walk picks up: *.log, *.out, *.err, *.txt, their rotations
# (.1, .2 …) and gzip forms (.gz, .1.gz). Results (*.json, *.jsonl) are not logs.
_LOG_SUFFIXES = {".log", ".out", ".err", ".txt"}
_ROTATION_RE = re.compile(r"\.\d+$")
_DMESG_TS_RE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:[,.](\d+))?([+-]\d\d:?\d\d|Z)?")


def _is_log_name(name: str) -> bool:
    if name.endswith(".gz"):
        name = name[:-3]
    name = _ROTATION_RE.sub("", name)
    return Path(name).suffix in _LOG_SUFFIXES


def _natural_key(p: Path) -> list[Any]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", str(p))]


def collect_log_files(paths: Iterable[Path | str]) -> list[Path]:
    """Files to scan: named files as given, directories walked for log-like names."""
    out: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found = sorted(
                (q for q in p.rglob("*") if q.is_file() and _is_log_name(q.name)),
                key=_natural_key,
            )
            if not found:
                raise AuditInputError(
                    f"{p}: directory holds no log files (*.log, *.out, *.err, *.txt, rotated or .gz)"
                )
            out.extend(found)
        elif p.is_file():
            out.append(p)
        elif p.exists():
            raise AuditInputError(f"{p}: not a regular file or directory")
        else:
            raise AuditInputError(f"{p}: no such file or directory")
    unique: dict[Path, Path] = {}
    for p in out:
        unique.setdefault(p.resolve(), p)
    return list(unique.values())


def read_chunks(raw: IO[bytes]) -> Iterator[bytes | BaseException]:
    """~BLOCK_BYTES chunks; a read error is yielded after the data that preceded it.

    ``read1`` (gzip) returns what one decompression step produced, so a truncated ``.gz``
    still hands over everything before the damage; plain ``read`` would raise and lose it.
    """
    read = getattr(raw, "read1", raw.read)
    parts: list[bytes] = []
    size = 0
    while True:
        try:
            piece = read(BLOCK_BYTES - size)
        except (OSError, EOFError) as exc:
            if parts:
                yield b"".join(parts)
            yield exc
            return
        if not piece:
            break
        parts.append(piece)
        size += len(piece)
        if size >= BLOCK_BYTES:
            yield b"".join(parts)
            parts, size = [], 0
    if parts:
        yield b"".join(parts)


def open_log(path: Path) -> tuple[IO[bytes], bool]:
    """Open by content, not name: a rotated ``.1`` may be gzip, a ``.gz`` may be plain.
    A regular file only (AuditInputError): a FIFO would hang the audit, /dev/zero fill it;
    OSError as open() raises it (the caller says the file could not be read)."""
    try:
        fh = open_regular(path)
    except UnsafeFileError as exc:
        raise AuditInputError(str(exc)) from None
    magic = fh.read(2)
    fh.seek(0)
    if magic == b"\x1f\x8b":
        return gzip.open(fh, "rb"), True  # type: ignore[return-value]
    return fh, False


def parse_since(value: str) -> datetime:
    """ISO 8601 time; naive times are local time. Raises AuditInputError naming the value."""
    try:
        dt = datetime.fromisoformat(value.strip().replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError as exc:
        raise AuditInputError(
            f"--since {value!r} is not an ISO 8601 time (for example 2026-11-29T14:00:00Z)"
        ) from exc
    return dt if dt.tzinfo else dt.astimezone()


def _aware(dt: datetime) -> datetime:
    return dt if dt.tzinfo else dt.astimezone()


@dataclass
class KernelLog:
    """Kernel log lines since a time, or why they could not be read."""

    lines: list[str]
    status: SourceStatus


def read_kernel_log(since: datetime | None = None, *, runner: Runner | None = None) -> KernelLog:
    """Read the kernel log since ``since`` via journalctl, else dmesg.

    Never a silent pass: when neither source can be read, ``status.audited`` is False and
    ``status.reason`` says what each tool answered. journalctl exits 0 with no lines when
    the machine keeps no journal (containers, this sandbox), so its "No journal files"
    notice on stderr counts as unreadable and dmesg is tried next.
    """
    run = runner or run_command
    reasons: list[str] = []
    since_utc = _aware(since).astimezone(timezone.utc) if since else None

    argv = ["journalctl", "-k", "-o", "short-iso", "--no-pager"]
    if since_utc is not None:
        argv += ["--since", since_utc.strftime("%Y-%m-%d %H:%M:%S UTC")]
    try:
        proc = run(argv)
    except FileNotFoundError:
        reasons.append("journalctl: not installed")
    except (OSError, subprocess.SubprocessError) as exc:
        reasons.append(f"journalctl: {exc}")
    else:
        if "No journal files were found" in proc.stderr + proc.stdout:
            reasons.append("journalctl: no journal files were found")
        elif proc.returncode != 0:
            reasons.append(f"journalctl: exit {proc.returncode}: {first_line(proc.stderr)}")
        else:
            lines = [ln for ln in proc.stdout.splitlines() if not ln.startswith("-- ")]
            return KernelLog(lines, SourceStatus(True, "journalctl -k", None, len(lines)))

    try:
        proc = run(["dmesg", "--time-format", "iso"])
    except FileNotFoundError:
        reasons.append("dmesg: not installed")
    except (OSError, subprocess.SubprocessError) as exc:
        reasons.append(f"dmesg: {exc}")
    else:
        if proc.returncode != 0:
            err = first_line(proc.stderr) or f"exit {proc.returncode}"
            reasons.append(err if err.startswith("dmesg") else f"dmesg: {err}")
        else:
            lines = _filter_since(proc.stdout.splitlines(), since_utc)
            return KernelLog(lines, SourceStatus(True, "dmesg", None, len(lines)))
    return KernelLog([], SourceStatus(False, None, "; ".join(reasons)))


def _filter_since(lines: list[str], since: datetime | None) -> list[str]:
    if since is None:
        return lines
    out: list[str] = []
    keep = False
    for line in lines:
        m = _DMESG_TS_RE.match(line)
        if m:
            frac = (m.group(2) or "0")[:6].ljust(6, "0")
            tz = m.group(3) or "+00:00"
            tz = "+00:00" if tz == "Z" else tz
            try:
                ts = datetime.fromisoformat(f"{m.group(1)}.{frac}{tz}")
            except ValueError:
                ts = None
            if ts is not None:
                keep = ts >= since
        if keep:  # continuation lines follow their timestamped line
            out.append(line)
    return out


def parse_nvidia_smi_q(text: str) -> dict[str, dict[str, str]]:
    """``nvidia-smi -q`` output -> {GPU bus id: {"Section/Sub/Key": value}}."""
    gpus: dict[str, dict[str, str]] = {}
    current: dict[str, str] | None = None
    stack: list[tuple[int, str]] = []
    for raw in text.splitlines():
        if not raw.strip():
            continue
        indent = len(raw) - len(raw.lstrip(" "))
        line = raw.strip()
        if indent == 0:
            current = None
            if line.startswith("GPU "):
                current = gpus.setdefault(line[4:].strip(), {})
                stack = []
            continue
        if current is None:
            continue
        while stack and stack[-1][0] >= indent:
            stack.pop()
        key, sep, value = line.partition(":")
        if sep and value.strip():
            path = "/".join([s for _, s in stack] + [key.strip()])
            current[path] = value.strip()
        else:
            stack.append((indent, key.strip()))
    return gpus


def read_gpu_state(
    catalogue: Catalogue | None = None, *, runner: Runner | None = None
) -> tuple[list[Finding], SourceStatus]:
    """ECC and row-remapper state from ``nvidia-smi -q -d ECC,ROW_REMAPPER`` as findings."""
    cat = catalogue or load_catalogue()
    try:
        out = nvidia_smi(["-q", "-d", "ECC,ROW_REMAPPER"], runner=runner)
    except NvidiaSmiError as exc:
        return [], SourceStatus(False, None, str(exc))
    gpus = parse_nvidia_smi_q(out)
    if not gpus:
        return [], SourceStatus(False, None, "nvidia-smi listed no GPU")
    findings = []
    for gpu, values in gpus.items():
        for check in cat.gpu_state:
            for key, value in values.items():
                if check.key.search(key) and check.fires(value):
                    findings.append(
                        Finding(
                            file="nvidia-smi -q -d ECC,ROW_REMAPPER",
                            line=None,
                            rank=f"GPU {gpu}",
                            signature=check.id,
                            severity=check.severity,
                            category=check.category,
                            text=f"{key}: {value}",
                            meaning=check.meaning,
                            action=check.action,
                            fields={"gpu": gpu, "key": key, "value": value},
                        )
                    )
    return findings, SourceStatus(True, "nvidia-smi", None, len(gpus))
