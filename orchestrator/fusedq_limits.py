"""fusedq's fixed facts (``fusedq/limits.py``) for the orchestrator, read without importing fusedq.

``import fusedq.limits`` would run ``fusedq/__init__``, which imports torch and Triton: seconds
that ``orchestrator plan`` and the matrix validation must not pay (and a driver without torch
could not pay at all). The file has no imports of its own, so it is executed here on its own,
found where ``import fusedq`` would find it; where fusedq is imported already (a gpu-check
worker), that module is used.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def _load() -> ModuleType:
    if "fusedq" in sys.modules:
        from fusedq import limits as imported

        return imported
    spec = importlib.util.find_spec("fusedq")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("fusedq is not importable: the orchestrator needs its limits.py")
    path = Path(next(iter(spec.submodule_search_locations))) / "limits.py"
    file_spec = importlib.util.spec_from_file_location("orchestrator._fusedq_limits", path)
    assert file_spec is not None and file_spec.loader is not None
    module = importlib.util.module_from_spec(file_spec)
    file_spec.loader.exec_module(module)
    return module


limits = _load()
