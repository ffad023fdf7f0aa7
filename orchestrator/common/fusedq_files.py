"""fusedq's standalone files for the orchestrator, read without importing the fusedq package.

``import fusedq.limits`` would run ``fusedq/__init__``, which imports torch and Triton: seconds
that ``orchestrator plan`` and the matrix validation must not pay (and a driver without torch
could not pay at all). ``fusedq/limits.py`` (the geometry and qualified shapes) and
``fusedq/provenance.py`` (which code produced a figure) import nothing from either package, so
each is executed here on its own, found where ``import fusedq`` would find it; where fusedq is
imported already (a gpu-check worker), that module is used.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def _load(name: str) -> ModuleType:
    if "fusedq" in sys.modules:
        return importlib.import_module(f"fusedq.{name}")
    spec = importlib.util.find_spec("fusedq")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(f"fusedq is not importable: the orchestrator needs its {name}.py")
    path = Path(next(iter(spec.submodule_search_locations))) / f"{name}.py"
    alias = f"orchestrator._fusedq_{name}"
    if alias in sys.modules:
        return sys.modules[alias]
    file_spec = importlib.util.spec_from_file_location(alias, path)
    assert file_spec is not None and file_spec.loader is not None
    module = importlib.util.module_from_spec(file_spec)
    # Registered before it runs: dataclasses and pickling look a module up by its name.
    sys.modules[alias] = module
    file_spec.loader.exec_module(module)
    return module


limits = _load("limits")
provenance = _load("provenance")
