"""The scanner (orchestrator.audit.scan): each fault line yields exactly its findings, near
misses none; whole logs (ranks, tracebacks, the root cause); awkward text; expected lines
counted per worker."""

from __future__ import annotations

import pytest
from audit_cases import (
    FAULT_LINES,
    FIXTURES,
    FUSEDQ,
    NEAR_MISSES,
    PREFILTERS,
    run_audit,
    signature_ids,
    write_log,
)

from orchestrator import audit
from orchestrator.audit import AuditInputError, Expectation


@pytest.mark.parametrize("prefilter", PREFILTERS)
@pytest.mark.parametrize("expected,line", FAULT_LINES, ids=[f[0] for f in FAULT_LINES])
def test_fault_line_yields_exactly_its_findings(tmp_path, prefilter, expected, line):
    want = {tuple(item.split(":")) for item in expected.split(",")}
    result = run_audit(
        write_log(tmp_path, f"INFO starting\n{line}\nINFO after\n"), prefilter=prefilter
    )
    # A bare traceback header has no exception line here; fixture lines are single events.
    assert signature_ids(result) == want
    assert all(f.line == 2 for f in result.findings)
    assert result.verdict.status == "findings"


@pytest.mark.parametrize("prefilter", PREFILTERS)
@pytest.mark.parametrize("line", NEAR_MISSES)
def test_near_miss_is_not_a_finding(tmp_path, prefilter, line):
    result = run_audit(write_log(tmp_path, line + "\n"), prefilter=prefilter)
    assert result.findings == []
    assert result.verdict.clean


def test_xid_fields_and_meaning(tmp_path):
    line = "NVRM: Xid (PCI:0000:1b:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
    (f,) = run_audit(write_log(tmp_path, line + "\n")).findings
    assert f.fields == {"pci": "0000:1b:00", "xid": "79"}
    assert "fallen off the bus" in f.meaning
    assert f.severity == "quarantine-node"


def test_clean_vllm_log_is_clean_with_its_near_misses():
    result = run_audit(FIXTURES / "vllm_tp4_clean.log")
    assert result.findings == []
    assert result.verdict.clean and result.verdict.worst_severity is None
    assert result.searched.lines == 20
    sentence = result.summary_sentence()
    assert sentence.startswith(
        "The final log audit of 1 log (20 lines) found no traceback, Xid, SXid, illegal-memory-access,"
    )
    assert "or host-OOM-kill failure." in sentence


def test_crash_log_attributes_ranks_and_names_the_root_cause():
    result = run_audit(FIXTURES / "vllm_tp4_crash.log")
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
    result = run_audit(FIXTURES / "engine_init_failed.log")
    rc = result.root_cause
    assert rc.rank == "EngineCore_DP0"
    assert rc.text.startswith("ValueError: Total number of attention heads (64)")
    assert "vllm-engine-init-failed" in {f.signature for f in result.findings}


def test_debug_level_traceback_is_a_warning_not_a_root_cause():
    result = run_audit(FIXTURES / "debug_traceback.log")
    (f,) = result.findings
    assert (f.signature, f.severity) == ("python-traceback", "warning")
    assert f.text == "ModuleNotFoundError: No module named 'pynvml'"
    assert result.root_cause is None
    assert result.verdict.worst_severity == "warning"


def test_unterminated_traceback_is_reported_at_its_header(tmp_path):
    p = write_log(
        tmp_path, 'Traceback (most recent call last):\n  File "x.py", line 1, in <module>\n'
    )
    (f,) = run_audit(p).findings
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
    ignored, failed = run_audit(write_log(tmp_path, text)).findings
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
    (f,) = run_audit(write_log(tmp_path, text)).findings
    assert (f.line, f.rank, f.text) == (5, "Worker_TP1", "KeyError: 'w_uk_t'")


def test_invalid_utf8_is_replaced_not_fatal(tmp_path):
    raw = b"\xff\xfe\x00garbage\nRuntimeError: CUDA error: an illegal memory access was encountered \xc3\x28\n"
    (f,) = run_audit(write_log(tmp_path, raw)).findings
    assert f.line == 2 and "\ufffd" in f.text


def test_ansi_colour_codes_are_stripped_before_matching_and_attribution(tmp_path):
    raw = (
        "\x1b[36m(Worker_TP3 pid=1234)\x1b[0m \x1b[31mERROR\x1b[0m 11-29 14:00:00 [x.py:1] "
        "RuntimeError: CUDA error: \x1b[1mdevice-side assert triggered\x1b[0m\n"
    )
    (f,) = run_audit(write_log(tmp_path, raw)).findings
    assert (f.signature, f.rank) == ("cuda-device-side-assert", "Worker_TP3")
    assert "\x1b" not in f.text


def test_carriage_return_progress_bar_segments(tmp_path):
    bar = "".join(f"Loading weights: {i:3d}%|####| {i}/100\r" for i in range(0, 100, 5))
    raw = f"INFO start\n{bar}(Worker_TP1 pid=9) CUBLAS_STATUS_ALLOC_FAILED\rLoading weights: 100%\nINFO end\n"
    (f,) = run_audit(write_log(tmp_path, raw)).findings
    assert (f.signature, f.line, f.rank) == ("cublas-status", 2, "Worker_TP1")
    assert f.text == "CUBLAS_STATUS_ALLOC_FAILED"


def test_very_long_line_is_scanned_and_reported_truncated(tmp_path):
    long = (
        "x" * 3_000_000
        + " torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2 GiB "
        + "y" * 1000
    )
    (f,) = run_audit(write_log(tmp_path, f"INFO a\n{long}\nINFO b\n")).findings
    assert (f.signature, f.line) == ("cuda-oom", 2)
    assert len(f.text) <= audit.MAX_REPORT_CHARS + 2
    assert "CUDA out of memory" in f.text
    assert f.context_after == ["INFO b"]


def test_control_characters_are_escaped(tmp_path):
    (f,) = run_audit(write_log(tmp_path, "Segmentation fault\x07\x00 here\n")).findings
    assert f.text == "Segmentation fault\\x07\\x00 here"


def test_no_trailing_newline_counts_the_last_line(tmp_path):
    result = run_audit(write_log(tmp_path, "INFO a\nAborted (core dumped)"))
    assert result.searched.lines == 2
    assert [f.line for f in result.findings] == [2]


def test_crlf_lines_and_ray_prefix_with_ip(tmp_path):
    raw = b"INFO a\r\n(RayWorkerWrapper pid=4009, ip=10.0.0.3) [rank1]:[E ProcessGroupNCCL.cpp:1] NCCL error: unhandled system error\r\n"
    (f,) = run_audit(write_log(tmp_path, raw)).findings
    assert (f.signature, f.rank, f.line) == ("nccl-unhandled-error", "RayWorkerWrapper", 2)


def test_repeated_findings_are_capped_and_counted(tmp_path):
    lines = "".join(f"node:1:2 [0] NCCL WARN NET/IB : retry {i}\n" for i in range(30))
    result = run_audit(write_log(tmp_path, lines))
    assert len(result.findings) == audit.MAX_FINDINGS_PER_SIGNATURE
    assert result.searched.files[0].suppressed == {"nccl-warn": 10}


def test_expectation_met_on_every_worker():
    result = run_audit(
        FIXTURES / "vllm_tp4_clean.log",
        expectations=[Expectation(FUSEDQ, None, "fused-query warmup")],
    )
    (er,) = result.searched.expectations
    assert er.met and er.expected == ["Worker_TP0", "Worker_TP1", "Worker_TP2", "Worker_TP3"]
    assert result.verdict.clean
    assert "All workers logged fused-query warmup." in result.summary_sentence()


def test_expectation_missing_on_one_rank_is_a_finding():
    result = run_audit(
        FIXTURES / "vllm_tp4_crash.log",
        expectations=[Expectation(FUSEDQ, ["TP0", "TP1", "TP2", "TP3"], "fused-query warmup")],
    )
    missing = [f for f in result.findings if f.signature == "expectation-missing"]
    assert len(missing) == 1 and missing[0].rank == "TP2" and missing[0].severity == "fatal"
    assert "TP2 did not log fused-query warmup." in result.summary_sentence()


def test_expectation_with_no_worker_prefixes_needs_one_occurrence(tmp_path):
    p = write_log(tmp_path, "INFO nothing here\n")
    result = run_audit(p, expectations=[Expectation(FUSEDQ, None, "fused-query warmup")])
    (f,) = result.findings
    assert f.signature == "expectation-missing" and "no process logged" in f.text
    ok = run_audit(
        write_log(tmp_path, f"INFO {FUSEDQ}\n", "b.log"),
        expectations=[Expectation(FUSEDQ, None, "fused-query warmup")],
    )
    assert ok.verdict.clean


def test_expectation_rank_aliases(tmp_path):
    p = write_log(tmp_path, f"(VllmWorker rank=2 pid=7) INFO {FUSEDQ}\n")
    for alias in ["VllmWorker rank=2", "rank=2", "rank2", "2"]:
        assert run_audit(p, expectations=[Expectation(FUSEDQ, [alias])]).verdict.clean, alias


def test_bad_expectation_regex_is_an_input_error(tmp_path):
    with pytest.raises(AuditInputError, match="not a valid regex"):
        run_audit(write_log(tmp_path, "x\n"), expectations=[Expectation("(", None, "broken")])


def test_expectation_workers_from_a_long_tp8_log(tmp_path):
    lines = [f"(Worker_TP{i % 8} pid={100 + i % 8}) INFO step {i}\n" for i in range(80_000)]
    lines += [f"(Worker_TP{r} pid={100 + r}) INFO {FUSEDQ}\n" for r in range(8) if r != 5]
    p = write_log(tmp_path, "".join(lines))
    for kind in PREFILTERS:
        result = run_audit(
            p, prefilter=kind, expectations=[Expectation(FUSEDQ, None, "fused-query warmup")]
        )
        (er,) = result.searched.expectations
        assert er.expected == [f"Worker_TP{r}" for r in range(8)]
        assert er.missing == ["Worker_TP5"]
