"""The scanner: candidate lines matched against the catalogue, tracebacks followed.

A candidate line (orchestrator.audit.prefilter) is decoded (invalid UTF-8 replaced), stripped
of ANSI codes, split at carriage returns and tested against the signatures whose needles
it holds (see Scanner._match_signatures for why not one combined alternation). A Python
traceback is followed, per process, to its exception line; lines every worker must log
(expectations) are counted per process label (orchestrator.audit.expectations). How a line
is decoded, labelled and quoted is orchestrator.audit.linetext's.
"""

from __future__ import annotations

import mmap
import re
import subprocess
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

import orchestrator.audit.sources as sources  # read at call time: tests patch its bounds
from orchestrator.audit.catalogue import Catalogue
from orchestrator.audit.expectations import ExpectationTally
from orchestrator.audit.findings import (
    AuditInputError,
    Expectation,
    ExpectationResult,
    FileSearched,
    Finding,
)
from orchestrator.audit.linetext import CONTEXT_BYTES, clean, escape, split_label
from orchestrator.audit.prefilter import (
    C_LOCALE,
    BlockFinder,
    Prefilter,
    count_lines,
    grep_argv,
    start_wc,
)
from orchestrator.audit.severity import Severity
from orchestrator.audit.sources import open_log, read_chunks
from orchestrator.common.safe_io import size_text
from orchestrator.engines.vllm.logline import HEADER_RE

# A "line" longer than this (a binary dump, a runaway progress bar, no newline at all) is
# scanned in pieces of this size, each around a candidate, and never held whole: with the
# block below, what bounds the scanner's memory whatever the input (docs/security.md).
MAX_LINE_BYTES = 1 << 20
# GNU grep holds a whole line in memory: a plain file with a line this long is scanned in
# blocks (sources.BLOCK_BYTES at a time) instead of being handed to grep whole.
GREP_MAX_LINE_BYTES = 16 << 20
CONTEXT_LINES = 2  # before and after each finding: enough to see the failing call
MAX_REPORT_CHARS = 400  # a finding's line, truncated around the match
MAX_CONTEXT_CHARS = 200
# Per file and signature: a dying 8-rank job repeats the same NCCL WARN thousands of
# times; the rest are counted, not stored.
MAX_FINDINGS_PER_SIGNATURE = 20
# Python's unraisable hook prints "Exception ignored in: <obj>" and then the traceback of an
# exception nothing could catch (raised in a __del__ or a weakref callback) and goes on: a
# warning, not a fault. vLLM 0.32's CPU build prints one from a GEMM handle's __del__ on every
# torch.compile start.
UNRAISABLE = "Exception ignored"
# A traceback whose exception line does not appear within this many lines of the same
# process is reported with the header line (a truncated log, an interleaving we lost).
TRACEBACK_MAX_LINES = 2000


_TRACEBACK_CONT_RE = re.compile(
    r"^(?:During handling of the above exception|The above exception was the direct cause)"
)


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

    def __init__(self, scanner: Scanner, st: _FileState, block: bytes, start: int, end: int):
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


class Scanner:
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
        self.expectations = ExpectationTally(expectations)
        self.needles = catalogue.needles

    # -- streams ------------------------------------------------------------------
    def scan_file(self, path: Path) -> FileSearched:
        """Scan one log file: mapped and prefiltered by grep where possible, else streamed."""
        fh, compressed = open_log(path)
        with fh:
            if compressed or self.prefilter.grep is None or path.stat().st_size == 0:
                return self.scan_stream(str(path), fh, compressed)
            with mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
                if not _has_line_over(mm, GREP_MAX_LINE_BYTES):
                    return self._scan_mapped(str(path), path, mm)
            return self.scan_stream(str(path), fh)

    def _scan_mapped(self, name: str, path: Path, mm: mmap.mmap) -> FileSearched:
        """A plain file with GNU grep: Python touches only the pages around candidates.

        grep reports each needle hit with its line number and byte offset (-n -o -b) and
        ``wc -l`` counts the lines, so clean stretches are never read into Python at all.
        """
        st = _FileState(name, FileSearched(path=name, lines=0, bytes=len(mm)))
        assert self.prefilter.grep is not None
        wc = start_wc(path)
        proc = subprocess.Popen(
            [
                *grep_argv(self.prefilter.grep, self.prefilter.needles, numbered=True),
                "--",
                str(path),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=C_LOCALE,
        )
        try:
            self.expectations.count(mm, MAX_LINE_BYTES)
            n = len(mm)
            pos = 0  # everything before pos has been examined
            assert proc.stdout is not None
            for raw in proc.stdout:
                ln, _, rest = raw.partition(b":")
                off, _, _ = rest.partition(b":")
                if not (ln.isdigit() and off.isdigit()) or int(off) < pos:
                    continue
                hit, line_no = int(off), int(ln)
                # Every search is bounded: a line without end must not be walked (or paged
                # in) whole for each hit in it.
                start = mm.rfind(b"\n", max(pos, hit - MAX_LINE_BYTES), hit)
                if start >= 0:
                    pos = start + 1
                elif hit - pos > MAX_LINE_BYTES:  # deep in a monster line: the piece at the hit
                    pos = self._piece(st, mm, hit - MAX_LINE_BYTES // 2, hit, line_no)
                    continue
                while True:  # one line, then every line while a traceback is open
                    end = mm.find(b"\n", pos, pos + MAX_LINE_BYTES + 1)
                    if end < 0 and n - pos > MAX_LINE_BYTES:  # a monster line: its first piece
                        pos = self._piece(st, mm, pos, max(pos, hit), line_no)
                        break
                    end = n if end < 0 else end
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
        st.base = count_lines(wc, mm)
        self._finish(st)
        return st.searched

    def _piece(self, st: _FileState, mm: mmap.mmap, start: int, hit: int, line_no: int) -> int:
        """Scan MAX_LINE_BYTES of a monster line from `start` (its end, if it ends before,
        and never before the hit it is read for); return where the scan stopped."""
        start = max(0, min(start, hit))
        end = mm.find(b"\n", hit, start + MAX_LINE_BYTES)
        end = min(len(mm), start + MAX_LINE_BYTES) if end < 0 else end
        self._line(st, mm, start, end, line_no)  # type: ignore[arg-type]
        return end

    def scan_stream(self, name: str, raw: IO[bytes], compressed: bool = False) -> FileSearched:
        """Scan a byte stream block by block (gzip files, the kernel log, no grep, a file
        with a line longer than GREP_MAX_LINE_BYTES).

        A compressed stream is refused past sources.MAX_GZIP_BYTES of text (AuditInputError
        naming it): a gzip bomb decompresses a thousand times its size."""
        st = _FileState(name, FileSearched(path=name, lines=0, bytes=0, compressed=compressed))
        finder = self.prefilter.block_finder()
        carry = b""
        open_line = False  # the text so far ends inside a line (one scanned in pieces)
        error: BaseException | None = None
        for chunk in read_chunks(raw):
            if isinstance(chunk, BaseException):
                error = chunk  # scan what arrived before a truncated gzip member ended
                break
            st.searched.bytes += len(chunk)
            if compressed and st.searched.bytes > sources.MAX_GZIP_BYTES:
                raise AuditInputError(
                    f"{name}: decompresses to more than {size_text(sources.MAX_GZIP_BYTES)}, "
                    "the audit's bound for a compressed log (decompress it and audit the "
                    "plain file, which has none)"
                )
            buf = carry + chunk if carry else chunk
            cut = buf.rfind(b"\n") + 1
            if cut == 0:
                if len(buf) < MAX_LINE_BYTES:
                    carry = buf
                    continue
                cut = len(buf)  # a monster line: scan this piece, keep its line number
            self._scan_block(st, buf[:cut], finder, st.searched.bytes - len(buf))
            carry = buf[cut:]
            open_line = not buf.endswith(b"\n")
        if carry:
            self._scan_block(st, carry + b"\n", finder, st.searched.bytes - len(carry))
        elif open_line:
            st.base += 1  # a last line without its newline is a line (as wc counts +1)
        self._finish(st)
        if error is not None:
            st.searched.error = f"could not read to the end: {error}"
        return st.searched

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
        self.expectations.count(block, MAX_LINE_BYTES)
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
            for piece in range(pos, max(end, pos + 1), MAX_LINE_BYTES):
                self._line(st, block, piece, min(end, piece + MAX_LINE_BYTES), st.base + nl + 1)
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

    def _fill_pending_after(self, st: _FileState, block: bytes) -> None:
        need = max(k for _, k in st.pending_after)
        lines: list[str] = []
        pos = 0
        while len(lines) < need and pos < len(block):
            end = _line_end(block, pos)
            lines.append(
                escape(clean(block[pos : min(end, pos + CONTEXT_BYTES)]), MAX_CONTEXT_CHARS)
            )
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
            lo = max(0, j - 1 - MAX_LINE_BYTES)
            p = block.rfind(b"\n", lo, j - 1) + 1
            if p == 0 and lo > 0:  # a monster line: its last bytes, and nothing before it
                before.append(block[j - 1 - CONTEXT_BYTES : j - 1])
                break
            before.append(block[p : min(j - 1, p + CONTEXT_BYTES)])
            j = p
        if len(before) < CONTEXT_LINES and j == 0:
            before.extend(reversed(list(st.tail)[-(CONTEXT_LINES - len(before)) :]))
        before_s = [escape(clean(b), MAX_CONTEXT_CHARS) for b in reversed(before)]

        def attach_after(f: Finding) -> None:
            pos = end + 1
            while len(f.context_after) < CONTEXT_LINES and pos < len(block):
                e = _line_end(block, pos)
                text = clean(block[pos : min(e, pos + CONTEXT_BYTES)])
                f.context_after.append(escape(text, MAX_CONTEXT_CHARS))
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
        text = clean(block[start:end])
        ctx: _Context | None = None
        for seg in text.split("\r") if "\r" in text else (text,):
            if not seg.strip():
                continue
            label, body = split_label(seg)
            tb = st.tracebacks.get(label)
            if tb is not None:
                core = HEADER_RE.sub("", body, count=1)
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
            tb.recent.append(escape(core, MAX_CONTEXT_CHARS))
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
                if ctx.before and UNRAISABLE in ctx.before[-1]:
                    severity = Severity.WARNING
                st.tracebacks[label] = _PendingTraceback(
                    header_line=line_no,
                    header_text=escape(body, MAX_REPORT_CHARS, m.start()),
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
                text=escape(body, MAX_REPORT_CHARS, m.start()),
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
            text=escape(exception_line, MAX_REPORT_CHARS),
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

    def expectation_results(self) -> list[ExpectationResult]:
        """Each expectation over every stream scanned so far (orchestrator.audit.expectations)."""
        return self.expectations.results()


def _line_end(block: bytes | mmap.mmap, pos: int) -> int:
    """The end of the line at `pos`, looked for no further than MAX_LINE_BYTES (past that,
    the block's end: the rest of a monster line is nobody's context)."""
    end = block.find(b"\n", pos, pos + MAX_LINE_BYTES + 1)
    return len(block) if end < 0 else end


def _has_line_over(mm: mmap.mmap, limit: int) -> bool:
    """Whether a line may be longer than `limit`: some `limit`-sized window holds no newline.
    One bounded find per window, so a GB file costs a few dozen calls; a line of up to
    2 x limit can pass unseen, which is what GREP_MAX_LINE_BYTES allows for."""
    return any(mm.find(b"\n", i, i + limit) < 0 for i in range(0, len(mm) - limit + 1, limit))
