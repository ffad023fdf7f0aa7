"""What the audit's tests share: the fixture logs and fault corpus, an audit of log files with
neither the kernel log nor the GPU state (the tests that want those ask), and a stand-in for
the programs the audit runs (journalctl, dmesg, nvidia-smi)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from fusedq import contract
from orchestrator import audit
from orchestrator.audit import AuditResult, audit_logs

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "audit"
REPO = Path(__file__).resolve().parents[3]
PREFILTERS = ["python", "grep"] if audit.grep_binary() else ["python"]
FUSEDQ = contract.ENABLED_LINE


def _corpus(name: str) -> list[str]:
    lines = (FIXTURES / name).read_text(encoding="utf-8").splitlines()
    return [ln for ln in lines if ln and not ln.startswith("#")]


FAULT_LINES = [tuple(ln.split("\t", 1)) for ln in _corpus("fault_lines.txt")]
NEAR_MISSES = _corpus("near_misses.txt")


def run_audit(paths, **kw) -> AuditResult:
    kw.setdefault("include_kernel_log", False)
    kw.setdefault("include_gpu_state", False)
    return audit_logs([paths] if isinstance(paths, (str, Path)) else paths, **kw)


def write_log(tmp_path: Path, text: str | bytes, name: str = "server.log") -> Path:
    p = tmp_path / name
    if isinstance(text, str):
        text = text.encode()
    p.write_bytes(text)
    return p


def signature_ids(result: AuditResult) -> set[tuple[str, str]]:
    return {(f.signature, f.severity) for f in result.findings}


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
