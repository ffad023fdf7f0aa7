"""The orchestrator's tests: this folder's helpers (orch_cli, abrun) import as top-level
modules in every test below it, the subpackages' folders (audit/, engines/, reports/)
included, whichever test pytest collects first."""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
