"""Running the `orchestrator` console script as a user would, shared by the e2e tests."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def run_cli(
    *args: str, timeout: float, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`orchestrator ARGS...` from the repository root, output captured, unbuffered."""
    return subprocess.run(
        [str(VENV_BIN / "orchestrator"), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=timeout,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
