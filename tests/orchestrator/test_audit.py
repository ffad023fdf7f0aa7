"""Tests for orchestrator.audit: catalogue, scanner, kernel log, GPU state, verdicts, CLI."""

from __future__ import annotations

import gzip
import json
import os
import re
import shutil
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from orchestrator import audit
from orchestrator.audit import (
    AuditInputError,
    CatalogueError,
    Expectation,
    audit_logs,
    load_catalogue,
    parse_since,
    read_gpu_state,
    read_kernel_log,
)
from orchestrator.audit.sources import _filter_since
from orchestrator.reports.run import audit_sentence
from orchestrator.results import AuditSummary, CaseResult

FIXTURES = Path(__file__).parent / "fixtures" / "audit"
REPO = Path(__file__).resolve().parents[2]
PREFILTERS = ["python", "grep"] if audit.grep_binary() else ["python"]


def _corpus(name: str) -> list[str]:
    lines = (FIXTURES / name).read_text(encoding="utf-8").splitlines()
    return [ln for ln in lines if ln and not ln.startswith("#")]


FAULT_LINES = [tuple(ln.split("\t", 1)) for ln in _corpus("fault_lines.txt")]
NEAR_MISSES = _corpus("near_misses.txt")


def _audit(paths, **kw):
    kw.setdefault("include_kernel_log", False)
    kw.setdefault("include_gpu_state", False)
    return audit_logs([paths] if isinstance(paths, (str, Path)) else paths, **kw)


def _write(tmp_path: Path, text: str | bytes, name: str = "server.log") -> Path:
    p = tmp_path / name
    if isinstance(text, str):
        text = text.encode()
    p.write_bytes(text)
    return p


def _ids(result) -> set[tuple[str, str]]:
    return {(f.signature, f.severity) for f in result.findings}


# ----------------------------------------------------------------------- catalogue


def test_catalogue_loads_with_version_and_every_category_listed():
    cat = load_catalogue()
    assert isinstance(cat.version, int) and cat.version >= 1
    assert {s.category for s in cat.signatures} <= set(cat.categories)
    # The seeds' sentence words are all categories the audit searches.
    for word in [
        "traceback",
        "Xid",
        "illegal-memory-access",
        "CUBLAS_STATUS",
        "FAULT_PDE",
        "invalid-layout",
        "engine-initialization",
    ]:
        assert word in cat.categories


@pytest.mark.parametrize("expected,line", FAULT_LINES, ids=[f[0] for f in FAULT_LINES])
def test_every_fault_line_holds_a_needle_and_matches_the_grep_pattern(expected, line):
    cat = load_catalogue()
    assert any(n in line for n in cat.needles), "the prefilter would never look at this line"
    for item in expected.split(","):
        sig = cat.signature(item.split(":")[0])
        assert any(n in line for n in sig.needles), f"{sig.id}: none of {sig.needles} in line"
    if shutil.which("grep"):
        # The same pattern string is valid POSIX ERE and matches the same line in grep.
        proc = subprocess.run(
            ["grep", "-E", "-c", cat.grep_pattern()],
            input=line.encode(),
            capture_output=True,
            check=False,
        )
        assert proc.stdout.strip() == b"1", proc.stderr


def _branch_lines(pattern: str) -> list[str]:
    """Lines drawn from every branch of an ERE pattern: each alternative and optional part
    taken both ways, small character classes ([Ii], [ _-]) member by member, larger ones by
    their first and last member, repeats once and twice (the same draw repeated)."""
    try:
        from re import _constants as c  # Python >= 3.11
        from re import _parser as parser
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_constants as c  # type: ignore[no-redef]
        import sre_parse as parser  # type: ignore[no-redef]

    def members(items) -> list[str]:
        chars: list[str] = []
        for op, av in items:
            if op is c.LITERAL:
                chars.append(chr(av))
            elif op is c.RANGE:
                chars += [chr(av[0]), chr(av[1])]
            elif op is c.NEGATE:
                return ["x"]  # [^ ]: any ordinary character
            else:
                raise AssertionError(f"{pattern!r}: {op} is not POSIX ERE")
        return chars if len(chars) <= 4 else [chars[0], chars[-1]]

    def draw(seq) -> list[str]:
        out = [""]
        for op, av in seq:
            if op is c.LITERAL:
                alts = [chr(av)]
            elif op is c.NOT_LITERAL or op is c.ANY:
                alts = ["x"]
            elif op is c.IN:
                alts = members(av)
            elif op is c.BRANCH:
                alts = [s for branch in av[1] for s in draw(branch)]
            elif op is c.SUBPATTERN:
                alts = draw(av[-1])
            elif op in (c.MAX_REPEAT, c.MIN_REPEAT):
                lo, hi, item = av
                counts = sorted({lo, min(max(lo, 1) + 1, hi)})
                alts = [s * n for s in draw(item) for n in counts]
            else:
                raise AssertionError(f"{pattern!r}: {op} is not POSIX ERE")
            out = [a + b for a in out for b in alts]
        return out

    return draw(parser.parse(pattern))


def test_every_branch_of_every_signature_holds_a_needle_and_passes_both_prefilters(tmp_path):
    # The needles are hand-written beside the patterns; one missing spelling would make the
    # audit blind to that fault. Every branch of every pattern is drawn and must hold one of
    # its signature's needles, and each prefilter must name every such line as a candidate.
    cat = load_catalogue()
    lines: list[str] = []
    for sig in cat.signatures:
        drawn = _branch_lines(sig.pattern)
        assert 0 < len(drawn) < 5000, sig.id
        for text in drawn:
            assert sig.regex.search(text), f"{sig.id}: the draw {text!r} does not match"
            assert any(n in text for n in sig.needles), f"{sig.id}: no needle in {text!r}"
        lines += [f"(Worker_TP1 pid=7) ERROR 11-29 14:03:12 [x.py:1] {t}" for t in drawn]
    block = "".join(f"{line}\n" for line in lines).encode()
    starts = [0]
    for line in lines[:-1]:
        starts.append(starts[-1] + len(line.encode()) + 1)
    for kind in PREFILTERS:
        found = set(audit.make_prefilter(cat, kind).block_finder()(0, block))
        missed = [lines[i] for i, s in enumerate(starts) if s not in found]
        assert not missed, f"prefilter {kind} let {len(missed)} through: {missed[:3]}"


def test_real_vllm_lines_are_rarely_candidates():
    # What makes the audit as fast as grep on a healthy server's log: its lines hold no
    # needle. Short needles ("fault" of "default", "ayout" of "KV cache layout") once made
    # 5.5 % of these lines candidates, each a trip through Python.
    cat = load_catalogue()
    pattern = re.compile(cat.grep_pattern())
    lines = [
        ln
        for path in [
            *sorted(FIXTURES.glob("vllm_*.log")),
            *REPO.glob("docs/validation/**/server.log"),
        ]
        for ln in path.read_text(encoding="utf-8", errors="replace").splitlines()
        if ln.strip() and not pattern.search(ln)
    ]
    candidates = [ln for ln in lines if any(n in ln for n in cat.needles)]
    assert len(lines) > 1000
    assert len(candidates) <= len(lines) // 200, candidates[:5]


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d["signatures"][0].update(severity="bad"), "severity 'bad' is not one of"),
        (lambda d: d["signatures"][0].update(colour="red"), "unknown key 'colour'"),
        (lambda d: d["signatures"][1].update(category="nope"), "category 'nope' is not in"),
        (lambda d: d["signatures"][2].update(pattern="("), "is not a valid regex"),
        (lambda d: d["signatures"][3].update(id="xid"), "signature id 'xid' appears twice"),
        (lambda d: d["signatures"][0].update(needles=[]), "needles must be a non-empty list"),
        (lambda d: d.update(version="one"), "version must be an integer"),
    ],
)
def test_malformed_catalogue_errors_name_entry_and_key(tmp_path, mutate, message):
    import yaml

    data = yaml.safe_load(audit.CATALOGUE_PATH.read_text())
    mutate(data)
    p = tmp_path / "sig.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(CatalogueError, match=message) as exc:
        load_catalogue(p)
    assert str(p) in str(exc.value)


# ----------------------------------------------------------------------- corpus


@pytest.mark.parametrize("prefilter", PREFILTERS)
@pytest.mark.parametrize("expected,line", FAULT_LINES, ids=[f[0] for f in FAULT_LINES])
def test_fault_line_yields_exactly_its_findings(tmp_path, prefilter, expected, line):
    want = {tuple(item.split(":")) for item in expected.split(",")}
    result = _audit(_write(tmp_path, f"INFO starting\n{line}\nINFO after\n"), prefilter=prefilter)
    # A bare traceback header has no exception line here; fixture lines are single events.
    assert _ids(result) == want
    assert all(f.line == 2 for f in result.findings)
    assert result.verdict.status == "findings"


@pytest.mark.parametrize("prefilter", PREFILTERS)
@pytest.mark.parametrize("line", NEAR_MISSES)
def test_near_miss_is_not_a_finding(tmp_path, prefilter, line):
    result = _audit(_write(tmp_path, line + "\n"), prefilter=prefilter)
    assert result.findings == []
    assert result.verdict.clean


def test_xid_fields_and_meaning(tmp_path):
    line = "NVRM: Xid (PCI:0000:1b:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
    (f,) = _audit(_write(tmp_path, line + "\n")).findings
    assert f.fields == {"pci": "0000:1b:00", "xid": "79"}
    assert "fallen off the bus" in f.meaning
    assert f.severity == "quarantine-node"


# ----------------------------------------------------------------------- whole logs


def test_clean_vllm_log_is_clean_with_its_near_misses():
    result = _audit(FIXTURES / "vllm_tp4_clean.log")
    assert result.findings == []
    assert result.verdict.clean and result.verdict.worst_severity is None
    assert result.searched.lines == 20
    sentence = result.summary_sentence()
    assert sentence.startswith(
        "The final log audit of 1 log (20 lines) found no traceback, Xid, SXid, illegal-memory-access,"
    )
    assert "or host-OOM-kill failure." in sentence


def test_crash_log_attributes_ranks_and_names_the_root_cause():
    result = _audit(FIXTURES / "vllm_tp4_crash.log")
    rc = result.root_cause
    assert rc is not None and rc.rank == "Worker_TP2" and rc.line == 13
    assert rc.text == "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"
    assert rc.fields["traceback_line"] == "6"
    # The last frame is the context before the exception line.
    assert "raise RuntimeError" in rc.context_before[0]
    ima = [f for f in result.findings if f.signature == "cuda-illegal-memory-access"]
    # The quoted `raise RuntimeError("CUDA error: …")` source line inside the traceback is
    # code, not an event: only the exception line is a finding.
    assert [(f.line, f.rank) for f in ima] == [(13, "Worker_TP2")]
    dead = [f for f in result.findings if f.signature == "vllm-engine-dead"]
    assert {f.rank for f in dead} == {"APIServer"}
    assert result.verdict.worst_severity == "fatal"
    assert "Root cause (first traceback) at" in result.summary_sentence()


def test_engine_init_failure_root_cause_is_the_engine_core_exception():
    result = _audit(FIXTURES / "engine_init_failed.log")
    rc = result.root_cause
    assert rc.rank == "EngineCore_DP0"
    assert rc.text.startswith("ValueError: Total number of attention heads (64)")
    assert "vllm-engine-init-failed" in {f.signature for f in result.findings}


def test_debug_level_traceback_is_a_warning_not_a_root_cause():
    result = _audit(FIXTURES / "debug_traceback.log")
    (f,) = result.findings
    assert (f.signature, f.severity) == ("python-traceback", "warning")
    assert f.text == "ModuleNotFoundError: No module named 'pynvml'"
    assert result.root_cause is None
    assert result.verdict.worst_severity == "warning"


def test_unterminated_traceback_is_reported_at_its_header(tmp_path):
    p = _write(tmp_path, 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n')
    (f,) = _audit(p).findings
    assert f.line == 1 and "log ended inside the traceback" in f.text


def test_traceback_python_ignored_is_a_warning(tmp_path):
    """Python's unraisable hook: an exception in a __del__ printed and dropped (vLLM 0.32's CPU
    build, under torch.compile, on every start); the process went on."""
    text = (
        "Exception ignored in: <function CPUDNNLGEMMHandler.__del__ at 0x7fbe081d8900>\n"
        "Traceback (most recent call last):\n"
        '  File "/v/_custom_ops.py", line 3728, in __del__\n'
        "AssertionError: Please convert all Tensors to FakeTensors first\n"
        "Traceback (most recent call last):\n"
        '  File "/v/core.py", line 9, in run\n'
        "RuntimeError: the engine really failed\n"
    )
    ignored, failed = _audit(_write(tmp_path, text)).findings
    assert (ignored.severity, ignored.line) == ("warning", 4)
    assert (failed.severity, failed.text) == ("fatal", "RuntimeError: the engine really failed")


def test_traceback_interleaved_with_other_processes(tmp_path):
    text = (
        "(Worker_TP1 pid=2) Traceback (most recent call last):\n"
        "(Worker_TP0 pid=1) INFO 11-29 14:00:00 [x.py:1] still serving\n"
        '(Worker_TP1 pid=2)   File "a.py", line 3, in f\n'
        "(Worker_TP0 pid=1) INFO 11-29 14:00:00 [x.py:1] still serving\n"
        "(Worker_TP1 pid=2) KeyError: 'w_uk_t'\n"
    )
    (f,) = _audit(_write(tmp_path, text)).findings
    assert (f.line, f.rank, f.text) == (5, "Worker_TP1", "KeyError: 'w_uk_t'")


# ----------------------------------------------------------------------- formats


def test_gzip_and_rotated_logs_in_a_directory(tmp_path):
    d = tmp_path / "case"
    d.mkdir()
    line = b"RuntimeError: CUDA error: misaligned address\n"
    (d / "server.log").write_bytes(b"INFO ok\n")
    (d / "server.log.1").write_bytes(b"INFO a\n" + line)
    with gzip.open(d / "server.log.2.gz", "wb") as fh:
        fh.write(b"INFO b\nINFO c\n" + line)
    (d / "results.json").write_bytes(line)  # not a log: never walked
    result = _audit(d)
    names = [Path(f.path).name for f in result.searched.files]
    assert names == ["server.log", "server.log.1", "server.log.2.gz"]
    assert [f.compressed for f in result.searched.files] == [False, False, True]
    assert {(Path(f.file).name, f.line) for f in result.findings} == {
        ("server.log.1", 2),
        ("server.log.2.gz", 3),
    }


def test_gzip_is_detected_by_content_not_name(tmp_path):
    p = tmp_path / "worker.log.1"
    p.write_bytes(gzip.compress(b"INFO x\nFatal Python error: Segmentation fault\n"))
    (f,) = _audit(p).findings
    assert (f.signature, f.line) == ("segfault", 2)


def test_invalid_utf8_is_replaced_not_fatal(tmp_path):
    raw = b"\xff\xfe\x00garbage\nRuntimeError: CUDA error: an illegal memory access was encountered \xc3\x28\n"
    (f,) = _audit(_write(tmp_path, raw)).findings
    assert f.line == 2 and "\ufffd" in f.text


def test_ansi_colour_codes_are_stripped_before_matching_and_attribution(tmp_path):
    raw = (
        "\x1b[36m(Worker_TP3 pid=1234)\x1b[0m \x1b[31mERROR\x1b[0m 11-29 14:00:00 [x.py:1] "
        "RuntimeError: CUDA error: \x1b[1mdevice-side assert triggered\x1b[0m\n"
    )
    (f,) = _audit(_write(tmp_path, raw)).findings
    assert (f.signature, f.rank) == ("cuda-device-side-assert", "Worker_TP3")
    assert "\x1b" not in f.text


def test_carriage_return_progress_bar_segments(tmp_path):
    bar = "".join(f"Loading weights: {i:3d}%|####| {i}/100\r" for i in range(0, 100, 5))
    raw = f"INFO start\n{bar}(Worker_TP1 pid=9) CUBLAS_STATUS_ALLOC_FAILED\rLoading weights: 100%\nINFO end\n"
    (f,) = _audit(_write(tmp_path, raw)).findings
    assert (f.signature, f.line, f.rank) == ("cublas-status", 2, "Worker_TP1")
    assert f.text == "CUBLAS_STATUS_ALLOC_FAILED"


def test_very_long_line_is_scanned_and_reported_truncated(tmp_path):
    long = (
        "x" * 3_000_000
        + " torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB "
        + "y" * 1000
    )
    (f,) = _audit(_write(tmp_path, f"INFO a\n{long}\nINFO b\n")).findings
    assert (f.signature, f.line) == ("cuda-oom", 2)
    assert len(f.text) <= audit.MAX_REPORT_CHARS + 2
    assert "CUDA out of memory" in f.text
    assert f.context_after == ["INFO b"]


def test_control_characters_are_escaped(tmp_path):
    (f,) = _audit(_write(tmp_path, "Segmentation fault\x07\x00 here\n")).findings
    assert f.text == "Segmentation fault\\x07\\x00 here"


def test_no_trailing_newline_counts_the_last_line(tmp_path):
    result = _audit(_write(tmp_path, "INFO a\nAborted (core dumped)"))
    assert result.searched.lines == 2
    assert [f.line for f in result.findings] == [2]


@pytest.mark.parametrize("prefilter", PREFILTERS)
def test_tiny_blocks_give_the_same_findings_and_context(tmp_path, monkeypatch, prefilter):
    """Block boundaries (context, tracebacks, monster lines) must not change any finding."""
    text = (
        (FIXTURES / "vllm_tp4_crash.log").read_bytes() + b"z" * 600 + b" SIGSEGV\n" + b"INFO tail\n"
    )
    p = _write(tmp_path, text)
    big = [f.to_dict() for f in _audit(p, prefilter=prefilter).findings]
    monkeypatch.setattr(audit.sources, "BLOCK_BYTES", 97)
    monkeypatch.setattr(audit.scan, "MAX_LINE_BYTES", 250)  # the 600-byte line is cut in pieces
    small = [f.to_dict() for f in _audit(p, prefilter=prefilter).findings]
    # The piece of the monster line before the cut is context the big scan sees as one line.
    for d in big + small:
        if d["signature"] == "segfault":
            d["context_before"] = d["context_after"] = d["text"] = None
    assert small == big
    assert _audit(p, prefilter=prefilter).searched.lines == text.count(b"\n")


def test_repeated_findings_are_capped_and_counted(tmp_path):
    lines = "".join(f"node:1:2 [0] NCCL WARN NET/IB : retry {i}\n" for i in range(30))
    result = _audit(_write(tmp_path, lines))
    assert len(result.findings) == audit.MAX_FINDINGS_PER_SIGNATURE
    assert result.searched.files[0].suppressed == {"nccl-warn": 10}


def test_prefilters_agree_on_the_whole_corpus(tmp_path):
    if len(PREFILTERS) < 2:
        pytest.skip("GNU grep not available")
    text = "\n".join(line for _, line in FAULT_LINES) + "\n" + "\n".join(NEAR_MISSES) + "\n"
    p = _write(tmp_path, text)
    a, b = (_audit(p, prefilter=k) for k in PREFILTERS)
    assert [f.to_dict() for f in a.findings] == [f.to_dict() for f in b.findings]
    assert a.searched.prefilter == "python" and b.searched.prefilter == "grep"


# ----------------------------------------------------------------------- expectations

FUSEDQ = "fusedq: fused MLA query enabled"


def test_expectation_met_on_every_worker():
    result = _audit(
        FIXTURES / "vllm_tp4_clean.log",
        expectations=[Expectation(FUSEDQ, None, "fused-query warmup")],
    )
    (er,) = result.searched.expectations
    assert er.met and er.expected == ["Worker_TP0", "Worker_TP1", "Worker_TP2", "Worker_TP3"]
    assert result.verdict.clean
    assert "All workers logged fused-query warmup." in result.summary_sentence()


def test_expectation_missing_on_one_rank_is_a_finding():
    result = _audit(
        FIXTURES / "vllm_tp4_crash.log",
        expectations=[Expectation(FUSEDQ, ["TP0", "TP1", "TP2", "TP3"], "fused-query warmup")],
    )
    missing = [f for f in result.findings if f.signature == "expectation-missing"]
    assert len(missing) == 1 and missing[0].rank == "TP2" and missing[0].severity == "fatal"
    assert "TP2 did not log fused-query warmup." in result.summary_sentence()


def test_expectation_with_no_worker_prefixes_needs_one_occurrence(tmp_path):
    p = _write(tmp_path, "INFO nothing here\n")
    result = _audit(p, expectations=[Expectation(FUSEDQ, None, "fused-query warmup")])
    (f,) = result.findings
    assert f.signature == "expectation-missing" and "no process logged" in f.text
    ok = _audit(
        _write(tmp_path, f"INFO {FUSEDQ}\n", "b.log"),
        expectations=[Expectation(FUSEDQ, None, "fused-query warmup")],
    )
    assert ok.verdict.clean


def test_expectation_rank_aliases(tmp_path):
    p = _write(tmp_path, f"(VllmWorker rank=2 pid=7) INFO {FUSEDQ}\n")
    for alias in ["VllmWorker rank=2", "rank=2", "rank2", "2"]:
        assert _audit(p, expectations=[Expectation(FUSEDQ, [alias])]).verdict.clean, alias


def test_bad_expectation_regex_is_an_input_error(tmp_path):
    with pytest.raises(AuditInputError, match="not a valid regex"):
        _audit(_write(tmp_path, "x\n"), expectations=[Expectation("(", None, "broken")])


# ----------------------------------------------------------------------- kernel log


class FakeRunner:
    """Answers subprocess calls by program name; a missing entry means 'not installed'."""

    def __init__(self, **answers):
        self.answers = answers
        self.calls: list[list[str]] = []

    def __call__(self, argv):
        self.calls.append(argv)
        if argv[0] not in self.answers:
            raise FileNotFoundError(argv[0])
        rc, out, err = self.answers[argv[0]]
        return subprocess.CompletedProcess(argv, rc, out, err)


NO_JOURNAL = (0, "-- No entries --\n", "No journal files were found.\n")
DMESG_EPERM = (1, "", "dmesg: read kernel buffer failed: Operation not permitted\n")
SINCE = datetime(2026, 11, 29, 14, 0, tzinfo=timezone.utc)


def test_kernel_log_unreadable_is_never_a_silent_pass(tmp_path):
    runner = FakeRunner(journalctl=NO_JOURNAL, dmesg=DMESG_EPERM)
    result = _audit(
        FIXTURES / "vllm_tp4_clean.log", since=SINCE, include_kernel_log=True, kernel_runner=runner
    )
    assert not result.searched.kernel_log.audited
    caveat = result.verdict.caveats[0]
    assert caveat.startswith("kernel log not audited: journalctl: no journal files were found")
    assert "dmesg: read kernel buffer failed: Operation not permitted" in caveat
    assert "kernel log not audited" in str(result.verdict)
    assert (
        "The kernel log was not audited (journalctl: no journal files" in result.summary_sentence()
    )


def test_kernel_log_from_dmesg_since_a_time_finds_the_silent_mtp_xid():
    dmesg = (0, (FIXTURES / "dmesg_xid31_mtp.txt").read_text(), "")
    runner = FakeRunner(dmesg=dmesg)  # journalctl not installed
    result = _audit(
        FIXTURES / "vllm_tp4_clean.log", since=SINCE, include_kernel_log=True, kernel_runner=runner
    )
    ks = result.searched.kernel_log
    assert (
        ks.audited and ks.source == "dmesg" and ks.lines == 3
    )  # the 13:55 Xid 79 is before --since
    assert _ids(result) == {("xid", "fatal"), ("mmu-fault", "fatal")}
    assert {f.file for f in result.findings} == {"kernel log (dmesg)"}
    assert result.findings[0].fields == {"pci": "0000:65:00", "xid": "31"}
    assert "and the kernel log (dmesg, 3 lines)" in result.summary_sentence()


def test_kernel_log_prefers_journalctl_and_passes_since_in_utc():
    line = "2026-11-29T14:02:11+0000 node-3 kernel: NVRM: Xid (PCI:0000:1b:00): 79, pid=1, GPU has fallen off the bus.\n"
    runner = FakeRunner(journalctl=(0, line, ""))
    klog = read_kernel_log(SINCE, runner=runner)
    assert klog.status.source == "journalctl -k" and klog.lines == [line.strip()]
    assert runner.calls[0][-2:] == ["--since", "2026-11-29 14:00:00 UTC"]


def test_kernel_log_nothing_installed():
    klog = read_kernel_log(None, runner=FakeRunner())
    assert not klog.status.audited
    assert klog.status.reason == "journalctl: not installed; dmesg: not installed"


def test_kernel_log_on_this_machine_reports_what_happened():
    """The real tools: here journalctl has no journal files, and dmesg needs privileges."""
    klog = read_kernel_log(datetime.now(timezone.utc))
    if klog.status.audited:
        assert klog.status.source in ("dmesg", "journalctl -k")
    else:
        assert klog.status.reason and "dmesg" in klog.status.reason


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="needs root + setpriv")
def test_kernel_log_unreadable_for_an_unprivileged_user_on_this_machine():
    """Drop to nobody: dmesg_restrict refuses the ring buffer, so the verdict must say so."""
    code = (
        "from orchestrator.audit import read_kernel_log;"
        "s = read_kernel_log(None).status; print(s.audited); print(s.reason)"
    )
    proc = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    if "Permission denied" in proc.stderr:
        pytest.skip(f"nobody cannot run the venv python here: {proc.stderr[-200:]}")
    audited, reason = proc.stdout.splitlines()[:2]
    if Path("/proc/sys/kernel/dmesg_restrict").read_text().strip() == "1":
        assert audited == "False"
        assert "dmesg" in reason and "not permitted" in reason


def test_dmesg_since_filter_keeps_continuation_lines():
    lines = [
        "2026-11-29T13:59:59,999999+00:00 old",
        "2026-11-29T14:00:00,000001+00:00 new",
        "  continuation of new",
    ]
    assert _filter_since(lines, SINCE) == lines[1:]


# ----------------------------------------------------------------------- GPU state


def _smi(name: str) -> FakeRunner:
    return FakeRunner(**{"nvidia-smi": (0, (FIXTURES / name).read_text(), "")})


def test_gpu_state_clean_h200_output():
    findings, status = read_gpu_state(runner=_smi("nvidia_smi_h200_clean.txt"))
    assert findings == [] and status.audited and status.lines == 1


def test_gpu_state_pending_remap_and_uncorrectable_ecc():
    findings, _ = read_gpu_state(runner=_smi("nvidia_smi_h200_pending_remap.txt"))
    got = {(f.signature, f.fields["key"], f.severity) for f in findings}
    assert got == {
        (
            "gpu-ecc-volatile-uncorrectable",
            "ECC Errors/Volatile/DRAM Uncorrectable",
            "quarantine-node",
        ),
        ("gpu-row-remap-pending", "Remapped Rows/Pending", "quarantine-node"),
    }
    assert {f.rank for f in findings} == {"GPU 00000000:00:06.0"}


def test_gpu_state_without_nvidia_smi_says_not_checked():
    result = _audit(
        FIXTURES / "vllm_tp4_clean.log", include_gpu_state=True, gpu_runner=FakeRunner()
    )
    assert result.verdict.clean
    assert "GPU ECC state not checked: nvidia-smi not found" in result.verdict.caveats
    assert "GPU ECC state was not checked (nvidia-smi not found)." in result.summary_sentence()


def test_gpu_state_nvidia_smi_failure_is_a_reason():
    runner = FakeRunner(
        **{
            "nvidia-smi": (
                9,
                "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver.\n",
                "",
            )
        }
    )
    _, status = read_gpu_state(runner=runner)
    assert not status.audited and "couldn't communicate" in status.reason


# ----------------------------------------------------------------------- results


def test_to_dict_is_json_and_carries_verdict_summary_and_coverage():
    result = _audit(FIXTURES / "vllm_tp4_crash.log")
    d = json.loads(json.dumps(result.to_dict()))
    assert d["verdict"]["status"] == "findings" and d["verdict"]["worst_severity"] == "fatal"
    assert d["searched"]["lines"] == 21 and d["searched"]["catalogue_version"] >= 1
    assert d["summary"] == result.summary_sentence()
    assert {
        "file",
        "line",
        "rank",
        "signature",
        "severity",
        "category",
        "text",
        "context_before",
        "context_after",
    } <= set(d["findings"][0])


def test_run_sentence_over_cases():
    """The run-level sentence the reports print, over these audits as a run stores them."""

    def case(case_id, result):
        return CaseResult(case_id=case_id, audit=AuditSummary.model_validate(result.to_dict()))

    clean = _audit(FIXTURES / "vllm_tp4_clean.log")
    bad = _audit(FIXTURES / "vllm_tp4_crash.log")
    s = audit_sentence([case("tp4-ctx0", clean), case("tp4-64k", bad)])
    assert s.startswith(
        "The final log audit of 2 logs (41 lines) across 2 cases found problems in 1 case: tp4-64k."
    )
    assert "The kernel log was not audited for any case (not requested)." in s
    assert audit_sentence([case("a", clean)]).endswith(
        "or host-OOM-kill failure. The kernel log was not audited for any case (not requested)."
    )


def test_the_stored_audit_is_the_audits_own_record_read_back(tmp_path):
    """One declaration: every field the audit records is a field of its stored form (read
    typed, with its behaviour), and audit.json reads back and is written back unchanged."""
    stop = 'Traceback (most recent call last):\n  File "y.py", line 2, in run\n'
    stop += "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
    log = _write(tmp_path, (FIXTURES / "vllm_tp4_crash.log").read_text() + stop)
    result = _audit(
        log,
        stopped_at={str(log): len(log.read_text().splitlines()) - 2},
        expectations=[Expectation(FUSEDQ, ["TP0", "TP1", "TP2", "TP3"], "fused-query warmup")],
    )
    assert result.discounted and result.case_breaking and result.searched.expectations
    written = json.dumps(result.to_dict())
    stored = AuditSummary.model_validate(json.loads(written))
    assert json.dumps(stored.model_dump(mode="json", exclude_unset=True)) == written
    # Kept as written without a field of their own: only what to_dict derives.
    assert set(stored.model_extra) == {"summary"}
    assert set(stored.verdict.model_extra) == {"text"}
    assert set(stored.searched.model_extra) == {"lines"}
    parts = [*stored.findings, *stored.discounted, stored.searched.kernel_log]
    parts += [*stored.searched.files, *stored.searched.expectations]
    assert not any(p.model_extra for p in parts)
    assert stored.root_cause.location() == result.root_cause.location()
    assert [f.location() for f in stored.case_breaking] == [
        f.location() for f in result.case_breaking
    ]
    assert stored.searched.lines == result.searched.lines
    assert str(stored.verdict) == str(result.verdict) and not stored.clean


def test_missing_path_is_an_input_error(tmp_path):
    with pytest.raises(AuditInputError, match=r"nope\.log: no such file or directory"):
        _audit(tmp_path / "nope.log")


@pytest.mark.parametrize(
    "text,expected",
    [
        ("2026-11-29T14:00:00Z", datetime(2026, 11, 29, 14, tzinfo=timezone.utc)),
        ("2026-11-29T15:00:00+01:00", datetime(2026, 11, 29, 14, tzinfo=timezone.utc)),
        ("2026-11-29 14:00", None),  # naive: local time
    ],
)
def test_parse_since(text, expected):
    dt = parse_since(text)
    assert dt.tzinfo is not None
    if expected is not None:
        assert dt == expected


# ----------------------------------------------------------------------- CLI


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", "audit", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
        check=False,
    )


def test_cli_clean_exit_0():
    proc = _cli(str(FIXTURES / "vllm_tp4_clean.log"))
    assert proc.returncode == 0, proc.stderr
    assert "verdict: clean" in proc.stdout
    assert "kernel log not audited: no --since given" in proc.stdout


def test_cli_findings_exit_1_and_json():
    proc = _cli(str(FIXTURES / "vllm_tp4_crash.log"), "--json")
    assert proc.returncode == 1, proc.stderr
    d = json.loads(proc.stdout)
    assert d["verdict"]["status"] == "findings"
    assert any(f["root_cause"] and f["rank"] == "Worker_TP2" for f in d["findings"])


def test_cli_missing_path_exit_2_names_it(tmp_path):
    proc = _cli(str(FIXTURES / "vllm_tp4_clean.log"), str(tmp_path / "missing.log"))
    assert proc.returncode == 2
    assert (
        proc.stderr.strip()
        == f"orchestrator audit: {tmp_path / 'missing.log'}: no such file or directory"
    )


def test_cli_bad_since_exit_2_names_it():
    proc = _cli(str(FIXTURES / "vllm_tp4_clean.log"), "--since", "yesterday-ish")
    assert proc.returncode == 2
    assert "--since 'yesterday-ish' is not an ISO 8601 time" in proc.stderr


def test_cli_empty_directory_exit_2(tmp_path):
    proc = _cli(str(tmp_path))
    assert proc.returncode == 2 and "holds no log files" in proc.stderr


def test_cli_since_audits_the_kernel_log_or_says_why_not(tmp_path):
    proc = _cli(str(FIXTURES / "vllm_tp4_clean.log"), "--since", "2099-01-01T00:00:00Z", "--json")
    d = json.loads(proc.stdout)
    kl = d["searched"]["kernel_log"]
    if kl["audited"]:
        assert proc.returncode == 0 and kl["lines"] == 0  # nothing logged after 2099
    else:
        assert "kernel log not audited" in d["verdict"]["text"]


def test_cli_via_typer_runner():
    from typer.testing import CliRunner

    from orchestrator.cli import app

    res = CliRunner().invoke(app, ["audit", str(FIXTURES / "vllm_tp4_clean.log")])
    assert res.exit_code == 0, res.output


def test_audit_module_imports_no_heavy_packages():
    code = "import sys, orchestrator.audit; print(sorted(m for m in ('torch','ray','vllm','pydantic') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert out.stdout.strip() == "[]"


def test_crlf_lines_and_ray_prefix_with_ip(tmp_path):
    raw = b"INFO a\r\n(RayWorkerWrapper pid=4009, ip=10.0.0.3) [rank1]:[E ProcessGroupNCCL.cpp:1] NCCL error: unhandled system error\r\n"
    (f,) = _audit(_write(tmp_path, raw)).findings
    assert (f.signature, f.rank, f.line) == ("nccl-unhandled-error", "RayWorkerWrapper", 2)


def test_rotations_sort_naturally(tmp_path):
    for n in (10, 2, 1):
        (tmp_path / f"server.log.{n}").write_text("INFO\n")
    (tmp_path / "server.log").write_text("INFO\n")
    names = [p.name for p in audit.collect_log_files([tmp_path])]
    assert names == ["server.log", "server.log.1", "server.log.2", "server.log.10"]


def test_truncated_gzip_keeps_what_it_held_and_says_so(tmp_path):
    data = gzip.compress(
        b"INFO a\nRuntimeError: CUDA error: misaligned address\n" + b"INFO pad\n" * 50000
    )
    p = tmp_path / "server.log.2.gz"
    p.write_bytes(data[: len(data) // 2])
    result = _audit(p)
    sigs = [f.signature for f in result.findings]
    assert sigs == ["cuda-misaligned-address", "unreadable-log"]
    assert "could not read to the end" in result.findings[-1].text


def test_expectation_workers_from_a_long_tp8_log(tmp_path):
    lines = [f"(Worker_TP{i % 8} pid={100 + i % 8}) INFO step {i}\n" for i in range(80_000)]
    lines += [f"(Worker_TP{r} pid={100 + r}) INFO {FUSEDQ}\n" for r in range(8) if r != 5]
    p = _write(tmp_path, "".join(lines))
    for kind in PREFILTERS:
        result = _audit(
            p, prefilter=kind, expectations=[Expectation(FUSEDQ, None, "fused-query warmup")]
        )
        (er,) = result.searched.expectations
        assert er.expected == [f"Worker_TP{r}" for r in range(8)]
        assert er.missing == ["Worker_TP5"]
