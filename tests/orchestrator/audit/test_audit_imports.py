"""`orchestrator audit` answers fast and runs where torch, ray and vllm are absent: importing
the package loads none of them, nor pydantic."""

from __future__ import annotations

import subprocess
import sys

from audit_cases import REPO


def test_audit_module_imports_no_heavy_packages():
    code = "import sys, orchestrator.audit; print(sorted(m for m in ('torch','ray','vllm','pydantic') if m in sys.modules))"
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    assert out.stdout.strip() == "[]"
