"""GPU-fault log auditor: the signature catalogue, the log scanner and the audit verdict.

One case's server, worker and orchestrator logs (plain, rotated or gzip-compressed), the
kernel log since the case started and the GPUs' ECC / row-remapper state are searched for
the fault signatures of ``signatures.yaml``. The result is a list of findings, a verdict
per scope (``clean`` or ``findings`` with the worst severity) that says what could *not*
be searched, and a summary sentence in the style of the validation write-ups.

Imports are stdlib + PyYAML only: ``orchestrator audit`` must answer fast and run on
machines without torch, ray or vllm.

Scanning strategy (docs/audit.md has the measured figures): only lines holding one of the
catalogue's literal ``needles`` are ever decoded and matched. Where GNU grep exists, a plain
file is mmapped and one ``grep -a -o -b -n -E '<needle alternation>'`` (plus ``wc -l``) names
the candidate lines, so clean stretches never enter Python; gzip streams and the kernel log
go through grep block by block on stdin. Without grep, each 8 MiB block is swept once per
needle with ``bytes.find``. A candidate line is decoded (invalid UTF-8 replaced), stripped
of ANSI codes, split at carriage returns and tested against the signatures whose needles
it holds (see _Scanner._match_signatures for why not one combined alternation).
"""

from __future__ import annotations

import gzip
import io
import json
import mmap
import os
import re
import shutil
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from functools import cached_property, lru_cache
from pathlib import Path
from typing import IO, Any, Literal

import yaml

from orchestrator.probes import NvidiaSmiError, Runner, first_line, nvidia_smi, run_command

Severity = Literal["warning", "fatal", "quarantine-node"]
# Ordered mild -> worst; the verdict reports the worst one.
SEVERITIES: tuple[Severity, ...] = ("warning", "fatal", "quarantine-node")
_SEVERITY_RANK = {s: i for i, s in enumerate(SEVERITIES)}

CATALOGUE_PATH = Path(__file__).with_name("signatures.yaml")

# --- tuning constants ---------------------------------------------------------------
# 8 MiB blocks: large enough that per-block Python and grep start-up cost vanish
# (<1 % at 8 MiB on the 2-core sandbox), small enough to keep memory flat on GB logs.
BLOCK_BYTES = 8 << 20
# A "line" without a newline for this long (a binary dump, a runaway progress bar) is
# scanned in pieces of this size instead of being held in memory whole.
MAX_LINE_BYTES = 64 << 20
CONTEXT_LINES = 2  # before and after each finding: enough to see the failing call
MAX_REPORT_CHARS = 400  # a finding's line, truncated around the match
MAX_CONTEXT_CHARS = 200
# Per file and signature: a dying 8-rank job repeats the same NCCL WARN thousands of
# times; the rest are counted, not stored.
MAX_FINDINGS_PER_SIGNATURE = 20
# A traceback whose exception line does not appear within this many lines of the same
# process is reported with the header line (a truncated log, an interleaving we lost).
TRACEBACK_MAX_LINES = 2000

PREFILTER_ENV = "ORCHESTRATOR_AUDIT_PREFILTER"  # "python" or "grep" forces a prefilter

# Log file names a directory walk picks up: *.log, *.out, *.err, *.txt, their rotations
# (.1, .2 …) and gzip forms (.gz, .1.gz). Results (*.json, *.jsonl) are not logs.
_LOG_SUFFIXES = {".log", ".out", ".err", ".txt"}
_ROTATION_RE = re.compile(r"\.\d+$")

# ANSI CSI sequences (colours, cursor moves): vLLM and Ray colour the process prefix.
_ANSI_RE = re.compile(r"\x1b\[[0-9;?]*[ -/]*[@-~]|\x1b[@-Z\\-_]")
# vLLM prefixes every line of a child process: "(Worker_TP3 pid=1234) ",
# "(EngineCore_DP0 pid=…) ", "(VllmWorker rank=2 pid=…) ", "(APIServer pid=…) ",
# Ray adds ", ip=…". torch.distributed's elastic launcher prefixes "[rank3]: ".
_LABEL_RE = re.compile(
    r"^\((?P<name>[A-Za-z][\w.-]*)(?: rank=(?P<rank>\d+))? pid=\d+(?:, ip=[\d.:a-fA-F]+)?\) ?"
    r"|^\[rank(?P<trank>\d+)\]: ?"
)
# vLLM's log header "ERROR 10-15 08:32:29 [core.py:708] " (optionally with milliseconds);
# stripped before deciding whether a traceback line is a frame or the exception.
_LOG_HEADER_RE = re.compile(
    r"^(?:DEBUG|INFO|WARNING|ERROR|CRITICAL) +\d\d-\d\d \d\d:\d\d:\d\d(?:\.\d+)? \[[^\]]*\] ?"
)
_TRACEBACK_CONT_RE = re.compile(
    r"^(?:During handling of the above exception|The above exception was the direct cause)"
)
# Worker process prefixes, for expectations that must hold on every worker.
_WORKER_SUFFIX = rb"(_[A-Za-z0-9_]+| rank=\d+) pid="
_DMESG_TS_RE = re.compile(r"^(\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d)(?:[,.](\d+))?([+-]\d\d:?\d\d|Z)?")
_UNPRINTABLE_RE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


class AuditInputError(ValueError):
    """Bad input to the audit (a missing path, an unparseable time): a usage error."""


class CatalogueError(ValueError):
    """signatures.yaml is malformed; the message names the entry and the key."""


# ======================================================================= catalogue


@dataclass(frozen=True)
class SeverityRule:
    """One refinement of a signature's severity; every condition given must hold."""

    severity: Severity
    field: str | None = None
    values: frozenset[str] = frozenset()
    line: re.Pattern[str] | None = None

    def applies(self, fields: Mapping[str, str], text: str) -> bool:
        if self.field is not None and fields.get(self.field) not in self.values:
            return False
        return not (self.line is not None and not self.line.search(text))


@dataclass(frozen=True)
class Signature:
    """A fault signature: an ERE pattern plus what a match means and what to do."""

    id: str
    category: str
    pattern: str
    needles: tuple[str, ...]
    severity: Severity
    meaning: str
    action: str
    family: str | None = None
    fields: re.Pattern[str] | None = None
    ignore: re.Pattern[str] | None = None
    rules: tuple[SeverityRule, ...] = ()
    names: Mapping[str, str] = field(default_factory=dict)

    @cached_property
    def regex(self) -> re.Pattern[str]:
        return re.compile(self.pattern)

    def search(self, text: str) -> re.Match[str] | None:
        """First match in ``text`` that the ``ignore`` regex does not cover."""
        for m in self.regex.finditer(text):
            if self.ignore is None or not self.ignore.match(text, m.start()):
                return m
        return None

    def classify(self, text: str, m: re.Match[str]) -> tuple[Severity, dict[str, str], str]:
        """Severity, extracted fields and meaning of a match on ``text``."""
        fields: dict[str, str] = {}
        if self.fields is not None:
            fm = self.fields.search(text, max(0, m.start() - 8))
            if fm:
                fields = {k: v for k, v in fm.groupdict().items() if v is not None}
        severity = self.severity
        for rule in self.rules:
            if rule.applies(fields, text):
                severity = rule.severity
                break
        meaning = self.meaning
        for value in fields.values():
            if value in self.names:
                meaning = f"{meaning} {self.category} {value}: {self.names[value]}."
                break
        return severity, fields, meaning


@dataclass(frozen=True)
class GpuStateCheck:
    """A check on one ``nvidia-smi -q`` value (ECC counters, row-remapper flags)."""

    id: str
    category: str
    key: re.Pattern[str]
    when: Literal["nonzero", "yes"]
    severity: Severity
    meaning: str
    action: str

    def fires(self, value: str) -> bool:
        value = value.strip()
        if self.when == "yes":
            return value.lower() == "yes"
        return value.isdigit() and int(value) > 0


@dataclass(frozen=True)
class Catalogue:
    """The loaded signature catalogue (``signatures.yaml``)."""

    version: int
    signatures: tuple[Signature, ...]
    categories: tuple[str, ...]
    request_echo: tuple[re.Pattern[str], ...]
    gpu_state: tuple[GpuStateCheck, ...]
    source: str

    @cached_property
    def needles(self) -> tuple[str, ...]:
        """Distinct needles, dropping any that contains a shorter one (it adds no lines)."""
        every = sorted({n for s in self.signatures for n in s.needles}, key=len)
        kept: list[str] = []
        for n in every:
            if not any(k in n for k in kept):
                kept.append(n)
        return tuple(kept)

    @cached_property
    def needle_bytes(self) -> tuple[bytes, ...]:
        return tuple(n.encode() for n in self.needles)

    @cached_property
    def needle_index(self) -> tuple[tuple[str, frozenset[int]], ...]:
        """Each signature needle -> positions of the signatures that list it."""
        index: dict[str, set[int]] = {}
        for i, sig in enumerate(self.signatures):
            for n in sig.needles:
                index.setdefault(n, set()).add(i)
        return tuple((n, frozenset(ix)) for n, ix in index.items())

    def grep_pattern(self) -> str:
        """The same alternation as POSIX ERE, for ``grep -E`` (the benchmark's baseline)."""
        return "|".join(f"({s.pattern})" for s in self.signatures)

    def signature(self, sig_id: str) -> Signature:
        for s in self.signatures:
            if s.id == sig_id:
                return s
        raise KeyError(sig_id)

    def is_request_echo(self, text: str) -> bool:
        return any(r.search(text) for r in self.request_echo)


_SIGNATURE_KEYS = {
    "id",
    "category",
    "pattern",
    "needles",
    "severity",
    "meaning",
    "action",
    "family",
    "fields",
    "ignore",
    "rules",
    "names",
}
_RULE_KEYS = {"field", "values", "line", "severity"}
_GPU_KEYS = {"id", "category", "key", "when", "severity", "meaning", "action"}


def _check_keys(where: str, entry: Any, allowed: set[str], required: set[str]) -> None:
    if not isinstance(entry, dict):
        raise CatalogueError(f"{where}: expected a mapping, got {type(entry).__name__}")
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise CatalogueError(f"{where}: unknown key {unknown[0]!r} (allowed: {sorted(allowed)})")
    missing = sorted(required - set(entry))
    if missing:
        raise CatalogueError(f"{where}: missing key {missing[0]!r}")


def _severity(where: str, value: Any) -> Severity:
    if value not in _SEVERITY_RANK:
        raise CatalogueError(f"{where}: severity {value!r} is not one of {', '.join(SEVERITIES)}")
    return value  # type: ignore[no-any-return]


def _regex(where: str, value: Any) -> re.Pattern[str]:
    try:
        return re.compile(str(value))
    except re.error as exc:
        raise CatalogueError(f"{where}: {value!r} is not a valid regex: {exc}") from exc


def _parse_signature(where: str, raw: Any, categories: Sequence[str]) -> Signature:
    _check_keys(where, raw, _SIGNATURE_KEYS, {"id", "category", "pattern", "needles", "severity"})
    where = f"{where} (id={raw['id']})"
    if raw["category"] not in categories:
        raise CatalogueError(f"{where}: category {raw['category']!r} is not in `categories`")
    needles = raw["needles"]
    if (
        not isinstance(needles, list)
        or not needles
        or not all(isinstance(n, str) and n for n in needles)
    ):
        raise CatalogueError(f"{where}: needles must be a non-empty list of strings")
    rules = []
    for j, rr in enumerate(raw.get("rules") or []):
        rwhere = f"{where}.rules[{j}]"
        _check_keys(rwhere, rr, _RULE_KEYS, {"severity"})
        rules.append(
            SeverityRule(
                severity=_severity(rwhere, rr["severity"]),
                field=rr.get("field"),
                values=frozenset(str(v) for v in rr.get("values") or ()),
                line=_regex(rwhere, rr["line"]) if "line" in rr else None,
            )
        )
    sig = Signature(
        id=str(raw["id"]),
        category=str(raw["category"]),
        pattern=str(raw["pattern"]),
        needles=tuple(needles),
        severity=_severity(where, raw["severity"]),
        meaning=str(raw.get("meaning", "")).strip(),
        action=str(raw.get("action", "")).strip(),
        family=raw.get("family"),
        fields=_regex(where, raw["fields"]) if "fields" in raw else None,
        ignore=_regex(where, raw["ignore"]) if "ignore" in raw else None,
        rules=tuple(rules),
        names={str(k): str(v) for k, v in (raw.get("names") or {}).items()},
    )
    _regex(where, sig.pattern)
    return sig


def _parse_catalogue(data: Any, source: str) -> Catalogue:
    _check_keys(
        source,
        data,
        {"version", "categories", "request_echo", "signatures", "gpu_state"},
        {"version", "categories", "signatures"},
    )
    if not isinstance(data["version"], int):
        raise CatalogueError(f"{source}: version must be an integer, got {data['version']!r}")
    categories = tuple(str(c) for c in data["categories"])
    signatures = tuple(
        _parse_signature(f"{source}: signatures[{i}]", raw, categories)
        for i, raw in enumerate(data["signatures"])
    )
    ids = [s.id for s in signatures]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise CatalogueError(f"{source}: signature id {dupes[0]!r} appears twice")
    gpu_checks = []
    for i, raw in enumerate(data.get("gpu_state") or []):
        where = f"{source}: gpu_state[{i}]"
        _check_keys(where, raw, _GPU_KEYS, _GPU_KEYS - {"meaning", "action"})
        if raw["when"] not in ("nonzero", "yes"):
            raise CatalogueError(f"{where}: when {raw['when']!r} is not one of nonzero, yes")
        gpu_checks.append(
            GpuStateCheck(
                id=str(raw["id"]),
                category=str(raw["category"]),
                key=_regex(where, raw["key"]),
                when=raw["when"],
                severity=_severity(where, raw["severity"]),
                meaning=str(raw.get("meaning", "")),
                action=str(raw.get("action", "")),
            )
        )
    return Catalogue(
        version=data["version"],
        signatures=signatures,
        categories=categories,
        request_echo=tuple(
            _regex(f"{source}: request_echo", p) for p in data.get("request_echo") or ()
        ),
        gpu_state=tuple(gpu_checks),
        source=source,
    )


def load_catalogue(path: Path | str | None = None) -> Catalogue:
    """Load and validate the signature catalogue (the packaged one by default)."""
    if path is None:
        return _default_catalogue()
    return _load(Path(path))


@lru_cache(maxsize=1)
def _default_catalogue() -> Catalogue:
    return _load(CATALOGUE_PATH)


def _load(path: Path) -> Catalogue:
    try:
        # The C loader when PyYAML has it: the pure-Python one costs ~0.3 s per CLI call.
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=loader)
    except OSError as exc:
        raise CatalogueError(f"{path}: cannot read the catalogue: {exc}") from exc
    except yaml.YAMLError as exc:
        raise CatalogueError(f"{path}: not valid YAML: {exc}") from exc
    return _parse_catalogue(data, str(path))


# ======================================================================= results


@dataclass(frozen=True)
class Expectation:
    """A line every worker (or each of ``ranks``) must log, e.g. a kernel's warm-up line.

    ``ranks`` lists process labels (``Worker_TP3``), their short forms (``TP3``,
    ``rank=2``, ``2``) or ``None`` for "every worker prefix seen in the logs" (and, when
    the logs show no worker prefixes at all, at least one occurrence anywhere).
    """

    pattern: str
    ranks: Sequence[str] | None = None
    description: str = ""

    @property
    def label(self) -> str:
        return self.description or self.pattern


@dataclass
class Finding:
    """One fault seen in one place."""

    file: str
    line: int | None
    rank: str | None
    signature: str
    severity: Severity
    category: str
    text: str
    meaning: str = ""
    action: str = ""
    context_before: list[str] = field(default_factory=list)
    context_after: list[str] = field(default_factory=list)
    fields: dict[str, str] = field(default_factory=dict)
    root_cause: bool = False

    def location(self) -> str:
        where = self.file if self.line is None else f"{self.file}:{self.line}"
        return f"{where} [{self.rank}]" if self.rank else where

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class FileSearched:
    """What the scan of one log covered."""

    path: str
    lines: int
    bytes: int
    compressed: bool = False
    suppressed: dict[str, int] = field(default_factory=dict)  # findings beyond the cap
    error: str | None = None  # why the scan stopped early (a truncated .gz)


@dataclass
class SourceStatus:
    """Whether an out-of-file source (kernel log, GPU state) was searched, and why not."""

    audited: bool
    source: str | None = None
    reason: str | None = None
    lines: int = 0


@dataclass
class ExpectationResult:
    """Which ranks logged an expected line."""

    description: str
    pattern: str
    expected: list[str]
    seen: list[str]
    missing: list[str]
    occurrences: int

    @property
    def met(self) -> bool:
        return not self.missing and self.occurrences > 0


@dataclass
class Searched:
    """Everything the audit looked at: the basis of the summary sentence."""

    files: list[FileSearched] = field(default_factory=list)
    categories: list[str] = field(default_factory=list)
    catalogue_version: int = 0
    prefilter: str = ""
    kernel_log: SourceStatus = field(
        default_factory=lambda: SourceStatus(False, reason="not requested")
    )
    gpu_state: SourceStatus = field(
        default_factory=lambda: SourceStatus(False, reason="not requested")
    )
    expectations: list[ExpectationResult] = field(default_factory=list)

    @property
    def lines(self) -> int:
        return sum(f.lines for f in self.files)

    @property
    def bytes(self) -> int:
        return sum(f.bytes for f in self.files)


@dataclass
class Verdict:
    """The verdict for one scope (a case): clean or not, and what could not be searched."""

    status: Literal["clean", "findings"]
    worst_severity: Severity | None
    counts: dict[str, int] = field(default_factory=dict)  # per severity
    caveats: list[str] = field(default_factory=list)  # "kernel log not audited: …"

    @property
    def clean(self) -> bool:
        return self.status == "clean"

    def __str__(self) -> str:
        head = "clean" if self.clean else f"findings (worst: {self.worst_severity})"
        return head + "".join(f"; {c}" for c in self.caveats)


@dataclass
class AuditResult:
    """Findings, verdict and coverage of one audit scope."""

    findings: list[Finding]
    searched: Searched
    verdict: Verdict
    # Findings logged after the orchestrator began stopping the server that are known
    # consequences of the stop itself (see SHUTDOWN_NOISE); kept and shown, never counted.
    discounted: list[Finding] = field(default_factory=list)

    @property
    def root_cause(self) -> Finding | None:
        """The first non-DEBUG traceback of the scope (its exception line), if any."""
        for f in self.findings:
            if f.root_cause:
                return f
        return None

    def summary_sentence(self) -> str:
        return _summary_sentence(self)

    def to_dict(self) -> dict[str, Any]:
        return {
            "verdict": {**asdict(self.verdict), "text": str(self.verdict)},
            "summary": self.summary_sentence(),
            "findings": [f.to_dict() for f in self.findings],
            "discounted": [f.to_dict() for f in self.discounted],
            "searched": {**asdict(self.searched), "lines": self.searched.lines},
        }


# ======================================================================= scanner


def _escape(text: str, limit: int, around: int | None = None) -> str:
    """Printable, bounded form of a log line: control bytes escaped, long lines cut around the match."""
    text = _UNPRINTABLE_RE.sub(lambda m: f"\\x{ord(m.group()):02x}", text)
    if len(text) <= limit:
        return text
    start = 0 if around is None else max(0, min(around - limit // 4, len(text) - limit))
    cut = text[start : start + limit]
    return ("…" if start else "") + cut + ("…" if start + limit < len(text) else "")


def _clean(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace")
    if "\x1b" in text:
        text = _ANSI_RE.sub("", text)
    return text


def _split_label(text: str) -> tuple[str | None, str]:
    m = _LABEL_RE.match(text)
    if not m:
        return None, text
    if m.group("trank") is not None:
        return f"rank{m.group('trank')}", text[m.end() :]
    name = m.group("name")
    if m.group("rank") is not None:
        name = f"{name} rank={m.group('rank')}"
    return name, text[m.end() :]


def _label_aliases(label: str) -> set[str]:
    """Names a caller may use for a process label: Worker_TP3 -> {Worker_TP3, TP3}."""
    out = {label}
    if "_" in label:
        out.add(label.split("_", 1)[1])
    m = re.search(r"rank=?(\d+)$", label)
    if m:
        out |= {f"rank={m.group(1)}", f"rank{m.group(1)}", m.group(1)}
    return out


def _python_candidates(block: bytes, needles: Sequence[bytes]) -> list[int]:
    """Start offsets of lines holding a needle: one ``bytes.find`` sweep per needle."""
    starts: set[int] = set()
    for n in needles:
        i = block.find(n)
        while i >= 0:
            starts.add(block.rfind(b"\n", 0, i) + 1)
            end = block.find(b"\n", i)
            if end < 0:
                break
            i = block.find(n, end + 1)
    return sorted(starts)


@lru_cache(maxsize=1)
def _grep_binary() -> str | None:
    """GNU grep, if present: it tests every needle in one pass, in C."""
    path = shutil.which("grep")
    if path is None:
        return None
    try:
        out = subprocess.run([path, "--version"], capture_output=True, timeout=10, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return path if b"GNU grep" in out.stdout else None


_ERE_SPECIAL = re.compile(rb"([.\[\]()*+?{}|^$\\])")


def _grep_argv(grep: str, needles: Sequence[bytes], numbered: bool = False) -> list[str]:
    # -o -b: the byte offset of every needle hit, not the line (a candidate line may be
    # megabytes long). -a: logs with NUL or invalid UTF-8 bytes are still text.
    # -E with the needles as one alternation, not -F: GNU grep 3.8 runs the same 26
    # literals ~1.5x faster through its DFA path than through -F (measured, 100 MB).
    alternation = b"|".join(_ERE_SPECIAL.sub(rb"\\\1", n) for n in needles)
    return [grep, "-a", "-o", "-b", *(["-n"] if numbered else []), "-E", "-e", alternation.decode()]


# LC_ALL=C: byte semantics (invalid UTF-8 must not stop a match) and grep's fastest path.
_C_LOCALE = {**os.environ, "LC_ALL": "C"}


def _offsets_to_line_starts(block: bytes, rel_offsets: Iterable[int]) -> list[int]:
    starts: list[int] = []
    for rel in rel_offsets:
        s = block.rfind(b"\n", 0, rel) + 1
        if not starts or starts[-1] != s:
            starts.append(s)
    return starts


def _parse_offset(line: bytes) -> int | None:
    head, sep, _ = line.partition(b":")
    return int(head) if sep and head.isdigit() else None


BlockFinder = Callable[[int, bytes], list[int]]  # (file offset of block, block) -> line starts


def _grep_block(grep: str, needles: Sequence[bytes], block: bytes) -> list[int]:
    """Candidates of one block fed to grep on stdin (gzip streams, the kernel log)."""
    proc = subprocess.Popen(
        _grep_argv(grep, needles),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=_C_LOCALE,
    )

    def feed() -> None:
        assert proc.stdin is not None
        try:
            proc.stdin.write(block)  # one big write: communicate() would loop in 4 KiB steps
        except BrokenPipeError:
            pass
        finally:
            proc.stdin.close()

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    assert proc.stdout is not None and proc.stderr is not None
    out = proc.stdout.read()
    writer.join()
    err = proc.stderr.read()
    if proc.wait() > 1:
        raise RuntimeError(f"grep prefilter failed: {err.decode(errors='replace').strip()}")
    rel = [o for o in map(_parse_offset, out.split(b"\n")) if o is not None]
    return _offsets_to_line_starts(block, rel)


class Prefilter:
    """Finds candidate lines (those holding a needle) for the scanner, stream by stream."""

    def __init__(self, kind: str, needles: Sequence[bytes], grep: str | None = None) -> None:
        self.kind = kind
        self.needles = tuple(needles)
        self.grep = grep

    def block_finder(self) -> BlockFinder:
        """Candidate line starts of one block of a stream (gzip, the kernel log)."""
        needles = self.needles
        if self.grep is None:
            return lambda _off, block: _python_candidates(block, needles)
        grep = self.grep
        return lambda _off, block: _grep_block(grep, needles, block)


def _start_wc(path: Path) -> subprocess.Popen[bytes] | None:
    """``wc -l`` started beside grep: counting newlines in C, on the other core."""
    wc = shutil.which("wc")
    if wc is None:
        return None
    return subprocess.Popen(
        [wc, "-l", "--", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_C_LOCALE,
    )


def _count_lines(wc: subprocess.Popen[bytes] | None, mm: mmap.mmap) -> int:
    """Newlines in the file (+1 for a last line without one)."""
    n = None
    if wc is not None:
        out, _ = wc.communicate()
        head = out.split(b" ", 1)[0].strip()
        n = int(head) if wc.returncode == 0 and head.isdigit() else None
    if n is None:
        n = sum(mm[i : i + BLOCK_BYTES].count(b"\n") for i in range(0, len(mm), BLOCK_BYTES))
    return n + (0 if mm[-1:] == b"\n" else 1)


def make_prefilter(catalogue: Catalogue, kind: str | None = None) -> Prefilter:
    """The candidate-line finder: ``grep`` (GNU grep) when available, else ``python``."""
    kind = kind or os.environ.get(PREFILTER_ENV) or "auto"
    if kind not in ("auto", "python", "grep"):
        raise AuditInputError(f"{PREFILTER_ENV}={kind!r} is not one of auto, python, grep")
    needles = catalogue.needle_bytes
    if kind in ("auto", "grep"):
        grep = _grep_binary()
        if grep is not None:
            return Prefilter("grep", needles, grep)
        if kind == "grep":
            raise AuditInputError("prefilter 'grep' requested but GNU grep is not on PATH")
    return Prefilter("python", needles)


@dataclass
class _PendingTraceback:
    header_line: int
    header_text: str
    severity: Severity
    context_before: list[str]
    recent: deque[str] = field(default_factory=lambda: deque(maxlen=CONTEXT_LINES))
    lines: int = 0  # body lines of this process
    walked: int = 0  # lines of any process since the header


@dataclass
class _ExpectationState:
    spec: Expectation
    regex: re.Pattern[bytes]
    labels: dict[str, int] = field(default_factory=dict)
    unlabelled: int = 0


@dataclass
class _FileState:
    name: str
    searched: FileSearched
    base: int = 0  # newlines before the current block
    tail: deque[bytes] = field(default_factory=lambda: deque(maxlen=CONTEXT_LINES))
    pending_after: list[tuple[Finding, int]] = field(default_factory=list)
    tracebacks: dict[str | None, _PendingTraceback] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)


class _Context:
    """Context lines of one candidate line, computed only once a signature matched."""

    def __init__(self, scanner: _Scanner, st: _FileState, block: bytes, start: int, end: int):
        self._args = (scanner, st, block, start, end)
        self._before: list[str] | None = None
        self._attach: Callable[[Finding], None] | None = None

    def _load(self) -> None:
        scanner, st, block, start, end = self._args
        self._before, self._attach = scanner._context(st, block, start, end)

    @property
    def before(self) -> list[str]:
        if self._before is None:
            self._load()
        return self._before  # type: ignore[return-value]

    def attach_after(self, f: Finding) -> None:
        if self._attach is None:
            self._load()
        self._attach(f)  # type: ignore[misc]


class _Scanner:
    """Scans byte streams block by block; collects findings, expectation hits and labels."""

    def __init__(
        self,
        catalogue: Catalogue,
        prefilter: Prefilter,
        expectations: Sequence[Expectation] = (),
    ) -> None:
        self.cat = catalogue
        self.prefilter = prefilter
        self.findings: list[Finding] = []
        self.expectations = [_ExpectationState(e, _compile_expectation(e)) for e in expectations]
        self.want_workers = any(e.ranks is None for e in expectations)
        self.workers: set[str] = set()
        self._worker_suffixes: set[bytes] = set()
        self.needles = catalogue.needles

    # -- streams ------------------------------------------------------------------
    def scan_file(self, path: Path) -> FileSearched:
        """Scan one log file: mapped and prefiltered by grep where possible, else streamed."""
        fh, compressed = _open_log(path)
        with fh:
            if compressed or self.prefilter.grep is None or path.stat().st_size == 0:
                return self.scan_stream(str(path), fh, compressed)
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                return self._scan_mapped(str(path), path, mm)

    def _scan_mapped(self, name: str, path: Path, mm: mmap.mmap) -> FileSearched:
        """A plain file with GNU grep: Python touches only the pages around candidates.

        grep reports each needle hit with its line number and byte offset (-n -o -b) and
        ``wc -l`` counts the lines, so clean stretches are never read into Python at all.
        """
        st = _FileState(name, FileSearched(path=name, lines=0, bytes=len(mm)))
        assert self.prefilter.grep is not None
        wc = _start_wc(path)
        proc = subprocess.Popen(
            [
                *_grep_argv(self.prefilter.grep, self.prefilter.needles, numbered=True),
                "--",
                str(path),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=_C_LOCALE,
        )
        try:
            self._scan_expectations(st, mm)
            if self.want_workers:
                self._collect_workers(mm)
            n = len(mm)
            pos = 0  # everything before pos has been examined
            assert proc.stdout is not None
            for raw in proc.stdout:
                ln, _, rest = raw.partition(b":")
                off, _, _ = rest.partition(b":")
                if not (ln.isdigit() and off.isdigit()) or int(off) < pos:
                    continue
                hit, line_no = int(off), int(ln)
                pos = max(pos, mm.rfind(b"\n", 0, hit) + 1)
                while True:  # one line, then every line while a traceback is open
                    end = mm.find(b"\n", pos)
                    end = n if end < 0 else end
                    if end - pos > MAX_LINE_BYTES:  # a monster line: only the piece at the hit
                        piece = max(pos, min(hit, end) - MAX_LINE_BYTES // 2)
                        self._line(st, mm, piece, min(end, piece + MAX_LINE_BYTES), line_no)  # type: ignore[arg-type]
                        pos = min(end, piece + MAX_LINE_BYTES)
                        break
                    self._line(st, mm, pos, end, line_no)  # type: ignore[arg-type]
                    pos, line_no = end + 1, line_no + 1
                    if not st.tracebacks or pos >= n:
                        break
        except BaseException:
            if wc is not None:
                wc.kill()
                wc.wait()
            raise
        finally:
            if proc.poll() is None:
                proc.kill()  # stdout is drained (or we failed): its exit status adds nothing
            _, err = proc.communicate()
        if proc.returncode not in (0, 1, -9):
            raise RuntimeError(
                f"grep prefilter failed on {path}: {err.decode(errors='replace').strip()}"
            )
        st.base = _count_lines(wc, mm)
        self._finish(st)
        return st.searched

    def scan_stream(self, name: str, raw: IO[bytes], compressed: bool = False) -> FileSearched:
        """Scan a byte stream block by block (gzip files, the kernel log, no grep)."""
        st = _FileState(name, FileSearched(path=name, lines=0, bytes=0, compressed=compressed))
        finder = self.prefilter.block_finder()
        carry = b""
        error: BaseException | None = None
        for chunk in _read_chunks(raw):
            if isinstance(chunk, BaseException):
                error = chunk  # scan what arrived before a truncated gzip member ended
                break
            st.searched.bytes += len(chunk)
            buf = carry + chunk if carry else chunk
            cut = buf.rfind(b"\n") + 1
            if cut == 0:
                if len(buf) < MAX_LINE_BYTES:
                    carry = buf
                    continue
                cut = len(buf)  # a monster line: scan this piece, keep its line number
            self._scan_block(st, buf[:cut], finder, st.searched.bytes - len(buf))
            carry = buf[cut:]
        if carry:
            self._scan_block(st, carry + b"\n", finder, st.searched.bytes - len(carry))
        self._finish(st)
        if error is not None:
            st.searched.error = f"could not read to the end: {error}"
        return st.searched

    def _collect_workers(self, data: bytes | mmap.mmap) -> None:
        """Distinct worker labels in ``data``.

        Nearly every line of a TP8 log carries a worker prefix: one Python step per match
        would cost seconds per GB, so the regex is rebuilt to skip the labels already
        known and each search runs in C until a new label turns up (≤ one per rank).
        """
        pos = 0
        while True:
            known = sorted(self._worker_suffixes)
            skip = b"(?!(?:" + b"|".join(map(re.escape, known)) + b") pid=)" if known else b""
            m = re.compile(b"Worker" + skip + _WORKER_SUFFIX).search(data, pos)
            if m is None:
                return
            suffix = m.group(1)
            self._worker_suffixes.add(suffix)
            lp = data.rfind(b"(", max(0, m.start() - 32), m.start())
            if lp >= 0:
                self.workers.add(data[lp + 1 : m.end() - 5].decode(errors="replace"))
            pos = m.start()

    def _finish(self, st: _FileState) -> None:
        for label, tb in list(st.tracebacks.items()):
            self._emit_traceback(
                st, label, tb, tb.header_line, tb.header_text + "  (log ended inside the traceback)"
            )
        st.searched.lines = st.base
        st.searched.suppressed = {
            k: v - MAX_FINDINGS_PER_SIGNATURE
            for k, v in st.counts.items()
            if v > MAX_FINDINGS_PER_SIGNATURE
        }

    # -- blocks -------------------------------------------------------------------
    def _scan_block(self, st: _FileState, block: bytes, finder: BlockFinder, offset: int) -> None:
        if st.pending_after:
            self._fill_pending_after(st, block)
        self._scan_expectations(st, block)
        if self.want_workers:
            self._collect_workers(block)
        cands = finder(offset, block)
        ci = 0
        pos = 0  # offset of the next unexamined line
        nl = 0  # newlines in block[:pos]
        n = len(block)
        while pos < n:
            if not st.tracebacks:
                # Jump to the next candidate line; clean lines cost nothing here.
                while ci < len(cands) and cands[ci] < pos:
                    ci += 1
                if ci == len(cands):
                    break
                start = cands[ci]
                nl += block.count(b"\n", pos, start)
                pos = start
            # else: a traceback is open; walk every line until its exception line.
            end = block.find(b"\n", pos)
            if end < 0:
                end = n
            self._line(st, block, pos, end, st.base + nl + 1)
            pos = end + 1
            if end < n:
                nl += 1
        # Keep the block's last lines: the context before a finding early in the next block.
        last: list[bytes] = []
        e = n - 1 if block.endswith(b"\n") else n
        while len(last) < CONTEXT_LINES and e > 0:
            p = block.rfind(b"\n", 0, e) + 1
            last.append(block[p:e])
            e = p - 1
        st.tail.extend(reversed(last))
        # Count each newline once: the jumps above counted block[:pos] already.
        st.base += nl + (block.count(b"\n", pos) if pos < n else 0)

    def _scan_expectations(self, st: _FileState, block: bytes) -> None:
        for ex in self.expectations:
            for m in ex.regex.finditer(block):
                ls = block.rfind(b"\n", 0, m.start()) + 1
                le = block.find(b"\n", m.end())
                label, _ = _split_label(_clean(block[ls : le if le >= 0 else len(block)]))
                if label is None:
                    ex.unlabelled += 1
                else:
                    ex.labels[label] = ex.labels.get(label, 0) + 1

    def _fill_pending_after(self, st: _FileState, block: bytes) -> None:
        need = max(k for _, k in st.pending_after)
        lines: list[str] = []
        pos = 0
        while len(lines) < need and pos < len(block):
            end = block.find(b"\n", pos)
            end = len(block) if end < 0 else end
            lines.append(_escape(_clean(block[pos:end]), MAX_CONTEXT_CHARS))
            pos = end + 1
        for finding, k in st.pending_after:
            finding.context_after.extend(lines[:k])
        st.pending_after = [(f, k - len(lines)) for f, k in st.pending_after if k > len(lines)]

    def _context(
        self, st: _FileState, block: bytes, start: int, end: int
    ) -> tuple[list[str], Callable[[Finding], None]]:
        before: list[bytes] = []
        j = start
        while len(before) < CONTEXT_LINES and j > 0:
            p = block.rfind(b"\n", 0, j - 1) + 1
            before.append(block[p : j - 1])
            j = p
        if len(before) < CONTEXT_LINES:
            before.extend(reversed(list(st.tail)[-(CONTEXT_LINES - len(before)) :]))
        before_s = [_escape(_clean(b), MAX_CONTEXT_CHARS) for b in reversed(before)]

        def attach_after(f: Finding) -> None:
            pos = end + 1
            while len(f.context_after) < CONTEXT_LINES and pos < len(block):
                e = block.find(b"\n", pos)
                e = len(block) if e < 0 else e
                f.context_after.append(_escape(_clean(block[pos:e]), MAX_CONTEXT_CHARS))
                pos = e + 1
            if len(f.context_after) < CONTEXT_LINES:
                st.pending_after.append((f, CONTEXT_LINES - len(f.context_after)))

        return before_s, attach_after

    # -- lines --------------------------------------------------------------------
    def _line(self, st: _FileState, block: bytes, start: int, end: int, line_no: int) -> None:
        for label, tb in list(st.tracebacks.items()):
            tb.walked += 1
            if tb.walked > TRACEBACK_MAX_LINES:  # its process never printed the exception
                self._emit_traceback(
                    st,
                    label,
                    tb,
                    tb.header_line,
                    tb.header_text + f"  (no exception line within {TRACEBACK_MAX_LINES} lines)",
                )
        text = _clean(block[start:end])
        ctx: _Context | None = None
        for seg in text.split("\r") if "\r" in text else (text,):
            if not seg.strip():
                continue
            label, body = _split_label(seg)
            tb = st.tracebacks.get(label)
            if tb is not None:
                core = _LOG_HEADER_RE.sub("", body, count=1)
                if self._traceback_body(tb, core):
                    # Frames and source lines are code, not events: a quoted
                    # `raise RuntimeError("Engine core initialization failed")` is no finding.
                    continue
                if not core.startswith("Traceback (most recent call last)"):
                    if ctx is None:
                        ctx = _Context(self, st, block, start, end)
                    self._emit_traceback(st, label, tb, line_no, core, ctx.attach_after)
                # the exception line may itself carry a signature (CUDA error: …)
            if not any(n in seg for n in self.needles) or self.cat.is_request_echo(seg):
                continue
            if ctx is None:
                ctx = _Context(self, st, block, start, end)
            self._match_signatures(st, label, body, line_no, ctx)

    @staticmethod
    def _traceback_body(tb: _PendingTraceback, core: str) -> bool:
        """True while ``core`` is still part of the traceback (a frame, source or caret line)."""
        if core.startswith((" ", "\t")) or not core.strip() or _TRACEBACK_CONT_RE.match(core):
            tb.recent.append(_escape(core, MAX_CONTEXT_CHARS))
            tb.lines += 1
            return tb.lines < TRACEBACK_MAX_LINES
        return False

    def _match_signatures(
        self,
        st: _FileState,
        label: str | None,
        body: str,
        line_no: int,
        ctx: _Context,
    ) -> None:
        # Needle gate before any regex: Python's re has no multi-pattern matcher, and one
        # alternation of every pattern costs ~350 µs per 200-byte line (measured), while
        # a few substring tests and one or two small regexes cost a few µs.
        hits: set[int] = set()
        for n, idx in self.cat.needle_index:
            if n in body:
                hits |= idx
        families: set[str] = set()
        for i in sorted(hits):
            sig = self.cat.signatures[i]
            if sig.family is not None and sig.family in families:
                continue
            m = sig.search(body)
            if m is None:
                continue
            if sig.family is not None:
                families.add(sig.family)
            severity, fields, meaning = sig.classify(body, m)
            if sig.id == "python-traceback":
                prior = st.tracebacks.pop(label, None)
                if prior is not None:  # a new header before the old one ended
                    self._emit_traceback(st, label, prior, prior.header_line, prior.header_text)
                st.tracebacks[label] = _PendingTraceback(
                    header_line=line_no,
                    header_text=_escape(body, MAX_REPORT_CHARS, m.start()),
                    severity=severity,
                    context_before=ctx.before,
                )
                continue
            f = Finding(
                file=st.name,
                line=line_no,
                rank=label,
                signature=sig.id,
                severity=severity,
                category=sig.category,
                text=_escape(body, MAX_REPORT_CHARS, m.start()),
                meaning=meaning,
                action=sig.action,
                context_before=list(ctx.before),
                fields=fields,
            )
            if self._keep(st, f):
                ctx.attach_after(f)

    def _emit_traceback(
        self,
        st: _FileState,
        label: str | None,
        tb: _PendingTraceback,
        line_no: int,
        exception_line: str,
        attach_after: Callable[[Finding], None] | None = None,
    ) -> None:
        st.tracebacks.pop(label, None)
        sig = self.cat.signature("python-traceback")
        f = Finding(
            file=st.name,
            line=line_no,
            rank=label,
            signature=sig.id,
            severity=tb.severity,
            category=sig.category,
            text=_escape(exception_line, MAX_REPORT_CHARS),
            meaning=sig.meaning,
            action=sig.action,
            context_before=list(tb.recent) if tb.recent else list(tb.context_before),
            fields={"traceback_line": str(tb.header_line)},
        )
        if self._keep(st, f) and attach_after is not None:
            attach_after(f)

    def _keep(self, st: _FileState, f: Finding) -> bool:
        n = st.counts.get(f.signature, 0) + 1
        st.counts[f.signature] = n
        if n > MAX_FINDINGS_PER_SIGNATURE:
            return False
        self.findings.append(f)
        return True

    # -- expectations ---------------------------------------------------------------
    def expectation_results(self) -> list[ExpectationResult]:
        out = []
        for ex in self.expectations:
            seen = sorted(ex.labels)
            occurrences = ex.unlabelled + sum(ex.labels.values())
            # ranks=None: every worker prefix the logs showed (none: one occurrence anywhere).
            expected = sorted(self.workers) if ex.spec.ranks is None else list(ex.spec.ranks)
            aliases = set().union(*(_label_aliases(s) for s in seen)) if seen else set()
            missing = [r for r in expected if r not in aliases]
            out.append(
                ExpectationResult(
                    description=ex.spec.label,
                    pattern=ex.spec.pattern,
                    expected=expected,
                    seen=seen,
                    missing=missing,
                    occurrences=occurrences,
                )
            )
        return out


def _compile_expectation(e: Expectation) -> re.Pattern[bytes]:
    try:
        return re.compile(e.pattern.encode())
    except re.error as exc:
        raise AuditInputError(
            f"expectation {e.label!r}: {e.pattern!r} is not a valid regex: {exc}"
        ) from exc


# ======================================================================= inputs


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


def _read_chunks(raw: IO[bytes]) -> Iterator[bytes | BaseException]:
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


def _open_log(path: Path) -> tuple[IO[bytes], bool]:
    """Open by content, not name: a rotated ``.1`` may be gzip, a ``.gz`` may be plain."""
    fh = open(path, "rb")  # noqa: SIM115 - returned to the caller, closed there
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


# ======================================================================= audit


def audit_logs(
    paths: Iterable[Path | str],
    *,
    since: datetime | None = None,
    expectations: Sequence[Expectation] = (),
    include_kernel_log: bool = True,
    include_gpu_state: bool = True,
    catalogue: Catalogue | None = None,
    prefilter: str | None = None,
    kernel_runner: Runner | None = None,
    gpu_runner: Runner | None = None,
    stopped_at: Mapping[str, int] | None = None,
) -> AuditResult:
    """Audit one scope (a case): its logs, the kernel log since ``since``, the GPU state.

    ``paths`` may name files (any name; gzip detected by content) and directories
    (walked for ``*.log``/``*.out``/``*.err``/``*.txt`` and their rotated / .gz forms).
    ``prefilter`` ("grep", "python") and the runners exist for tests and benchmarks.
    ``stopped_at`` maps a log path to the first line written after the orchestrator began
    stopping that server: findings from there on whose signature is in SHUTDOWN_NOISE are
    moved to ``discounted`` (vLLM logs an EngineDeadError traceback whenever SIGTERM aborts
    its engine); hardware and memory faults are never discounted.
    Raises AuditInputError for a missing path or an invalid expectation pattern.
    """
    cat = catalogue or load_catalogue()
    files = collect_log_files(paths)
    pf = make_prefilter(cat, prefilter)
    scanner = _Scanner(cat, pf, expectations)
    searched = Searched(
        categories=list(cat.categories), catalogue_version=cat.version, prefilter=pf.kind
    )
    for path in files:
        try:
            sf = scanner.scan_file(path)
        except OSError as exc:  # unreadable (permissions, vanished): say so, scan the rest
            sf = FileSearched(path=str(path), lines=0, bytes=0, error=f"could not read: {exc}")
        searched.files.append(sf)
        if sf.error:
            scanner.findings.append(
                Finding(
                    file=str(path),
                    line=None,
                    rank=None,
                    signature="unreadable-log",
                    severity="warning",
                    category="unreadable",
                    text=sf.error,
                    meaning="Part of this log could not be read, so it was not fully audited.",
                    action="Check the file (a truncated .gz from a rotation cut short, permissions).",
                )
            )
    expect_results = scanner.expectation_results()

    if include_kernel_log:
        klog = read_kernel_log(since, runner=kernel_runner)
        searched.kernel_log = klog.status
        if klog.status.audited:
            name = f"kernel log ({klog.status.source})"
            kscan = _Scanner(cat, pf)
            kscan.scan_stream(name, io.BytesIO("\n".join(klog.lines).encode() + b"\n"))
            scanner.findings.extend(kscan.findings)
    if include_gpu_state:
        gfind, searched.gpu_state = read_gpu_state(cat, runner=gpu_runner)
        scanner.findings.extend(gfind)

    findings = scanner.findings
    for er in expect_results:
        if not er.met:
            findings.append(_expectation_finding(er))
    searched.expectations = expect_results
    discounted: list[Finding] = []
    if stopped_at:
        limits = {str(Path(k)): v for k, v in stopped_at.items()}
        kept = []
        for f in findings:
            limit = limits.get(str(Path(f.file)))
            if (
                limit is not None
                and f.line is not None
                and f.line >= limit
                and f.signature in SHUTDOWN_NOISE
            ):
                f.fields["discounted"] = "logged after the orchestrator stopped the server"
                discounted.append(f)
            else:
                kept.append(f)
        findings = kept
    mark_root_cause(findings)
    return AuditResult(findings, searched, _verdict(findings, searched), discounted)


def mark_root_cause(findings: Sequence[Finding]) -> Finding | None:
    """Flag the root cause of a scope, the one rule every reader of `root_cause` relies on:
    the first traceback that is not a recovered (DEBUG-level, hence warning) one. Later
    tracebacks of a case are almost always its consequences (vLLM's "Engine core
    initialization failed. See root cause above." chain). Pass the findings that count,
    after discounting: a traceback of the orchestrator's own stop explains nothing."""
    cause = next(
        (f for f in findings if f.signature == "python-traceback" and f.severity != "warning"),
        None,
    )
    for f in findings:
        f.root_cause = f is cause
    return cause


# What vLLM logs because it was told to stop (SIGTERM aborts the engine: the API server's output
# handler then raises EngineDeadError with a traceback). Only these may be discounted after a stop.
SHUTDOWN_NOISE = frozenset({"python-traceback", "vllm-engine-dead"})


def _expectation_finding(er: ExpectationResult) -> Finding:
    if er.occurrences == 0:
        text = f"no process logged {er.description!r}"
    else:
        text = f"{', '.join(er.missing)} did not log {er.description!r}"
    return Finding(
        file="(expectations)",
        line=None,
        rank=", ".join(er.missing) or None,
        signature="expectation-missing",
        severity="fatal",
        category="expectation",
        text=text,
        meaning=f"Every expected rank must log a line matching {er.pattern!r}.",
        action="Check that the feature was enabled and loaded in every worker process.",
        fields={"pattern": er.pattern, "expected": ", ".join(er.expected)},
    )


def _verdict(findings: Sequence[Finding], searched: Searched) -> Verdict:
    counts: dict[str, int] = {}
    for f in findings:
        counts[f.severity] = counts.get(f.severity, 0) + 1
    worst = max((f.severity for f in findings), key=_SEVERITY_RANK.__getitem__, default=None)
    caveats = []
    if not searched.kernel_log.audited:
        caveats.append(f"kernel log not audited: {searched.kernel_log.reason}")
    if not searched.gpu_state.audited:
        caveats.append(f"GPU ECC state not checked: {searched.gpu_state.reason}")
    return Verdict("findings" if findings else "clean", worst, counts, caveats)


# ======================================================================= sentences


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}" if n == 1 else f"{n:,} {word}s"


def _or_list(items: Sequence[str]) -> str:
    if len(items) <= 2:
        return " or ".join(items)
    return ", ".join(items[:-1]) + ", or " + items[-1]


def _summary_sentence(r: AuditResult) -> str:
    s = r.searched
    scope = f"The final log audit of {_plural(len(s.files), 'log')} ({_plural(s.lines, 'line')})"
    if s.kernel_log.audited:
        scope += (
            f" and the kernel log ({s.kernel_log.source}, {_plural(s.kernel_log.lines, 'line')})"
        )
    log_findings = [f for f in r.findings if f.signature != "expectation-missing"]
    if not log_findings:
        parts = [f"{scope} found no {_or_list(list(s.categories))} failure."]
    else:
        by_cat: dict[str, int] = {}
        for f in log_findings:
            by_cat[f.category] = by_cat.get(f.category, 0) + 1
        listed = ", ".join(f"{n} {c}" for c, n in by_cat.items())
        parts = [
            f"{scope} found {_plural(len(log_findings), 'problem')} (worst: {r.verdict.worst_severity}): {listed}."
        ]
        rc = r.root_cause
        if rc is not None:
            parts.append(f"Root cause (first traceback) at {rc.location()}: {rc.text!r}.")
    if not s.kernel_log.audited:
        parts.append(f"The kernel log was not audited ({s.kernel_log.reason}).")
    if s.gpu_state.audited:
        parts.append(f"GPU ECC state was checked on {_plural(s.gpu_state.lines, 'GPU')}.")
    else:
        parts.append(f"GPU ECC state was not checked ({s.gpu_state.reason}).")
    for er in s.expectations:
        if er.met:
            who = "All workers" if er.expected else "The logs"
            parts.append(f"{who} logged {er.description}.")
        elif er.occurrences == 0:
            parts.append(f"No process logged {er.description}.")
        else:
            parts.append(f"{', '.join(er.missing)} did not log {er.description}.")
    return " ".join(parts)


def summarize_run(results: Mapping[str, AuditResult]) -> str:
    """One sentence for a whole run: {case id: result} -> totals and the failing cases."""
    if not results:
        return "No case was audited."
    files = sum(len(r.searched.files) for r in results.values())
    lines = sum(r.searched.lines for r in results.values())
    bad = [k for k, r in results.items() if not r.verdict.clean]
    cats = next(iter(results.values())).searched.categories
    head = f"The final log audit of {_plural(files, 'log')} ({_plural(lines, 'line')}) across {_plural(len(results), 'case')}"
    if not bad:
        out = f"{head} found no {_or_list(list(cats))} failure."
    else:
        out = f"{head} found problems in {_plural(len(bad), 'case')}: {', '.join(bad)}."
    unaudited = [k for k, r in results.items() if not r.searched.kernel_log.audited]
    if unaudited:
        reason = results[unaudited[0]].searched.kernel_log.reason
        which = "any case" if len(unaudited) == len(results) else ", ".join(unaudited)
        out += f" The kernel log was not audited for {which} ({reason})."
    return out


# ======================================================================= CLI


def _format_text(result: AuditResult) -> str:
    out = []
    for f in result.findings:
        mark = " (root cause)" if f.root_cause else ""
        out.append(f"{f.location()}: {f.severity} {f.signature}{mark}: {f.text}")
        for c in f.context_before:
            out.append(f"    | {c}")
        out.append(f"    > {f.text}")
        for c in f.context_after:
            out.append(f"    | {c}")
        if f.meaning:
            out.append(f"    meaning: {f.meaning}")
        if f.action:
            out.append(f"    action:  {f.action}")
    for sf in result.searched.files:
        for sig, n in sf.suppressed.items():
            out.append(f"{sf.path}: {n} more {sig} findings not shown")
    out.append(f"verdict: {result.verdict}")
    out.append(result.summary_sentence())
    return "\n".join(out)


def cli_audit(paths: list[Path], *, json_out: bool, since: str | None) -> int:
    """``orchestrator audit``: 0 clean, 1 findings, 2 usage error (message on stderr).

    The kernel log is audited only with ``--since`` (the whole ring buffer would report
    every Xid since boot, from other jobs); without it the verdict says so.
    """
    try:
        since_dt = parse_since(since) if since is not None else None
        result = audit_logs(paths, since=since_dt, include_kernel_log=since_dt is not None)
    except (AuditInputError, CatalogueError) as exc:
        print(f"orchestrator audit: {exc}", file=sys.stderr)
        return 2
    if since_dt is None:
        result.searched.kernel_log = SourceStatus(
            False, None, "no --since given; pass --since to audit kernel lines after that time"
        )
        result.verdict = _verdict(result.findings, result.searched)
    if json_out:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(_format_text(result))
    return 0 if result.verdict.clean else 1
