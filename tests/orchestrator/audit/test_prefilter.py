"""The prefilter (orchestrator.audit.prefilter): few real lines reach Python, block boundaries
change no finding, and GNU grep and the pure-Python finder agree."""

from __future__ import annotations

import re

import pytest
from audit_cases import FAULT_LINES, FIXTURES, NEAR_MISSES, PREFILTERS, REPO, run_audit, write_log

from orchestrator import audit
from orchestrator.audit import load_catalogue


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


@pytest.mark.parametrize("prefilter", PREFILTERS)
def test_tiny_blocks_give_the_same_findings_and_context(tmp_path, monkeypatch, prefilter):
    """Block boundaries (context, tracebacks, monster lines) must not change any finding."""
    text = (
        (FIXTURES / "vllm_tp4_crash.log").read_bytes() + b"z" * 600 + b" SIGSEGV\n" + b"INFO tail\n"
    )
    p = write_log(tmp_path, text)
    big = [f.to_dict() for f in run_audit(p, prefilter=prefilter).findings]
    monkeypatch.setattr(audit.sources, "BLOCK_BYTES", 97)
    monkeypatch.setattr(audit.scan, "MAX_LINE_BYTES", 250)  # the 600-byte line is cut in pieces
    small = [f.to_dict() for f in run_audit(p, prefilter=prefilter).findings]
    # The piece of the monster line before the cut is context the big scan sees as one line.
    for d in big + small:
        if d["signature"] == "segfault":
            d["context_before"] = d["context_after"] = d["text"] = None
    assert small == big
    assert run_audit(p, prefilter=prefilter).searched.lines == text.count(b"\n")


def test_prefilters_agree_on_the_whole_corpus(tmp_path):
    if len(PREFILTERS) < 2:
        pytest.skip("GNU grep not available")
    text = "\n".join(line for _, line in FAULT_LINES) + "\n" + "\n".join(NEAR_MISSES) + "\n"
    p = write_log(tmp_path, text)
    a, b = (run_audit(p, prefilter=k) for k in PREFILTERS)
    assert [f.to_dict() for f in a.findings] == [f.to_dict() for f in b.findings]
    assert a.searched.prefilter == "python" and b.searched.prefilter == "grep"
