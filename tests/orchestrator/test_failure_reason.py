"""A failed case's reason leads with its root cause, then what happened, then a short tail of
the server log; the same text in the terminal, report.md, report.html and junit.xml.

The log is a real one: vLLM's CPU build (0.32.0) failing start-up on the tiny model with
MTP 1, where the draft layer was given AMX_MLA beside the target's CPU_MLA (AMX detection
forced on an AVX-512 CPU with a sitecustomize, which prints the AMX-PATCH lines). Its root
cause is logged ~165 lines above its end, which is vLLM's "Engine core initialization
failed. See root cause above." chain.
"""

from __future__ import annotations

import importlib.util
import xml.etree.ElementTree as ET
from pathlib import Path

import markupsafe

from orchestrator.audit import Finding, audit_logs, mark_root_cause
from orchestrator.engines import log_tail
from orchestrator.execution.case_run import REASON_TAIL_LINES, failure_reason
from orchestrator.reports.html import render_html
from orchestrator.reports.junit import render_junit
from orchestrator.reports.markdown import render_markdown
from orchestrator.results.recorded_run import Run

LOG = Path(__file__).parent / "fixtures" / "audit" / "vllm_cpu_mtp_draft_amx.log"
CAUSE = "ValueError: No common block size for 128 (CPU_MLA: [16]; AMX_MLA: [MultipleOf(32)])."
WHAT = "server process exited with code 1 after 43.5 s, before it was ready"

_spec = importlib.util.spec_from_file_location(
    "recorded_runs", Path(__file__).parent / "fixtures" / "runs" / "make_fixtures.py"
)
runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runs)


def _audit(path: Path = LOG, **kw):
    return audit_logs([path], include_kernel_log=False, include_gpu_state=False, **kw)


def _reason() -> str:
    return failure_reason(WHAT, _audit().root_cause, log_tail(LOG))


def test_root_cause_of_the_real_startup_failure_is_the_workers_exception():
    rc = _audit().root_cause
    assert rc is not None and rc.text == CAUSE
    assert (rc.line, rc.rank) == (107, "Worker")
    last = LOG.read_text().splitlines()[-REASON_TAIL_LINES:]
    assert not any("No common block size" in line for line in last), "the tail alone hides it"


def test_reason_leads_with_the_root_cause_then_what_happened_then_the_tail():
    lines = _reason().splitlines()
    assert lines[0] == f"{CAUSE} (root cause, {LOG.name}:107 [Worker])"
    assert lines[1] == WHAT
    assert lines[2] == f"--- last {REASON_TAIL_LINES} lines of the server log ---"
    assert lines[3:] == LOG.read_text().splitlines()[-REASON_TAIL_LINES:]
    assert any("Engine core initialization failed" in line for line in lines[3:])


def test_reason_without_a_root_cause_or_tail_is_what_happened():
    assert failure_reason("model path /x does not exist on node 1.2.3.4 (h)") == (
        "model path /x does not exist on node 1.2.3.4 (h)"
    )
    assert failure_reason(WHAT, None, "a\nb").splitlines() == [
        WHAT,
        "--- last 2 lines of the server log ---",
        "a",
        "b",
    ]


def _finding(line: int, severity: str, signature: str = "python-traceback") -> Finding:
    return Finding("server.log", line, None, signature, severity, "traceback", f"E{line}")


def test_one_root_cause_rule_skips_recovered_tracebacks_before_and_after_discounting(tmp_path):
    debug = _finding(1, "warning")
    real = _finding(5, "fatal")
    assert mark_root_cause([_finding(0, "fatal", "xid"), debug, real]) is real
    assert real.root_cause and not debug.root_cause
    # A DEBUG-level traceback left after the stop's own tracebacks are discounted is still
    # no root cause (the second rule used to take it).
    log = tmp_path / "server.log"
    recovered = (LOG.parent / "debug_traceback.log").read_text()  # 5 lines
    log.write_text(
        recovered + "Traceback (most recent call last):\n"
        '  File "y.py", line 2, in run\n'
        "vllm.v1.engine.exceptions.EngineDeadError: EngineCore encountered an issue.\n"
    )
    result = _audit(log, stopped_at={str(log): 6})
    assert result.discounted and result.root_cause is None
    assert not any(f.root_cause for f in result.findings + result.discounted)


def _run_with_reason(tmp_path: Path, reason: str) -> Run:
    run = runs.copy_run(tmp_path, "r", created_at="2026-11-30T13:29:00+00:00")
    case = "Luke BF16/tp8-dcp4-mtp3/fused"

    def edit(r):
        if r["case_id"] == case:
            r.update(status="failed", reason=reason)
        return r

    runs.edit_rows(run, edit)
    return Run.load(run)


def test_every_report_shows_the_root_cause_first_and_the_tail_preformatted(tmp_path):
    reason = _reason() + "\na log line with ``` fences and *stars*"
    store = _run_with_reason(tmp_path, reason)
    first, rest = reason.split("\n", 1)

    md = render_markdown(store)
    section = md.split("## Failed cases", 1)[1].split("\n## ", 1)[0]
    assert f"- **Luke BF16/tp8-dcp4-mtp3/fused**: {first}" in section
    # The rest in a code block inside the bullet, fenced longer than the log's own fences.
    assert "  ````text\n" + "".join(f"  {x}\n" for x in rest.splitlines()) + "  ````" in section

    page = render_html(store)
    # Escaped as the page's template escapes (autoescape: ' and " as &#39; and &#34;).
    assert f'<pre class="excerpt reason">{markupsafe.escape(reason)}</pre>' in page

    root = ET.fromstring(render_junit(store).encode())
    [failure] = [f for f in root.iter("failure") if f.get("type") == "failed"]
    assert failure.get("message") == f"case failed: {first}"[:300]
    assert failure.text == f"case failed: {reason}"
