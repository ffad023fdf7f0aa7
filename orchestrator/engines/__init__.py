"""Serving engines: how to launch, probe, wait for, measure and stop one engine's server.

Each engine is a package here that implements the interface of `base` (`Engine`, whose
docstring gives a server's life in order); `engine_for(kind)` gives the one a matrix's
`engine.kind` names, and the plan, cluster and execution steps call it and nothing else of
the engine's package. Only vLLM exists today (`orchestrator.engines.vllm`). `spec_decode`
holds the speculative-decoding counters every engine reads into.

A second engine is a package beside `vllm/` whose module offers an `ENGINE`, and one row of
ENGINES. Engines import nothing heavy at module level: the CLI's `plan` path must stay fast.
"""

from __future__ import annotations

import importlib
from functools import cache

from orchestrator.engines.base import (
    Engine,
    ServerStartError,
    WorkerAnswers,
    WorkerCallError,
    log_tail,
)

# The engines by the kind a matrix names (config.axes.EngineSpec.kind): the module whose
# ENGINE implements Engine, imported the first time a run asks for that kind.
ENGINES = {"vllm": "orchestrator.engines.vllm.engine"}

__all__ = [
    "ENGINES",
    "Engine",
    "ServerStartError",
    "WorkerAnswers",
    "WorkerCallError",
    "engine_for",
    "log_tail",
]


@cache
def engine_for(kind: str) -> Engine:
    """The engine of `kind`; ValueError naming it and the kinds there are when none is."""
    module = ENGINES.get(kind)
    if module is None:
        raise ValueError(f"unknown engine kind {kind!r} (known kinds: {', '.join(ENGINES)})")
    return importlib.import_module(module).ENGINE
