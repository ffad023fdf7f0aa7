"""scripts/pip_step.sh, the install's pip step, against a stand-in pip: one line per step
(what, how many packages, how long), pip's output kept back, and its tail where it fails."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

# A stand-in for the venv's python: `-m pip install --report FILE ...` prints a pip-sized log
# and writes a report of two installed packages (or fails, with PIP_FAIL set); anything else
# is the real Python (the step's own count).
FAKE_PYTHON = f"""#!/usr/bin/env bash
if [[ "$1" == "-m" && "$2" == "pip" ]]; then
    shift 2
    for i in $(seq 1 200); do echo "Collecting noise-$i (from -r requirements)"; done
    if [[ -n "${{PIP_FAIL:-}}" ]]; then echo "ERROR: No matching distribution for torch==9" >&2; exit 1; fi
    while [[ $# -gt 0 ]]; do
        if [[ "$1" == "--report" ]]; then echo '{{"install": [{{}}, {{}}]}}' > "$2"; fi
        shift
    done
    exit 0
fi
exec {sys.executable} "$@"
"""

SCRIPT = """
set -euo pipefail
say() { printf '[install] %s\\n' "$*"; }
die() { printf '[install] ERROR: %s\\n' "$*" >&2; exit 1; }
VPY="$1"
pip_() { "$VPY" -m pip --disable-pip-version-check "$@"; }
source "$2"
pip_step "the CPU torch (torch==2.13.0)" torch==2.13.0 --index-url https://example.invalid/cpu
echo after
"""


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    fake = tmp_path / "python"
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    return subprocess.run(
        ["bash", "-c", SCRIPT, "install", str(fake), str(REPO / "scripts" / "pip_step.sh")],
        capture_output=True, text=True, timeout=60, env={**os.environ, **env},
    )  # fmt: skip


def test_a_step_is_one_line_without_pips_output_or_arguments(tmp_path):
    done = _run(tmp_path)
    assert done.returncode == 0, done.stderr
    first, after = done.stdout.splitlines()
    assert re.fullmatch(
        r"\[install\] the CPU torch \(torch==2\.13\.0\): 2 package\(s\) installed or updated "
        r"in \d+ s",
        first,
    ), first
    assert after == "after" and done.stderr == ""
    assert "noise" not in done.stdout and "example.invalid" not in done.stdout


def test_a_failing_step_shows_pips_last_lines_and_stops(tmp_path):
    done = _run(tmp_path, PIP_FAIL="1")
    assert done.returncode == 1 and "after" not in done.stdout
    err = done.stderr.splitlines()
    assert err[-2] == "ERROR: No matching distribution for torch==9"
    assert err[-1] == (
        "[install] ERROR: the CPU torch (torch==2.13.0): pip install failed (its last lines above)"
    )
    assert len(err) == 30 + 1  # pip's tail, then the one line naming the step
    assert "noise-200" in done.stderr and "noise-150" not in done.stderr
