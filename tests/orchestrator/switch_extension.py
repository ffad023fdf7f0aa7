"""A worker extension for the switch-mode end-to-end test (test_switch_e2e.py): the two
methods fusedq's worker extension promises the orchestrator, served by a CPU vLLM.

vLLM mixes the class into every worker (``--worker-extension-cls``), and its dev endpoint
(``POST /collective_rpc``, open with ``VLLM_SERVER_DEV_MODE=1``) runs a method of it on each
worker. The CPU build runs the fused kernel only in Triton's interpreter (about a second a
call), so this extension does not re-route the decode query: it keeps each worker's path and
counts the loaded model's MLA attention layers, as the fusedq one counts those it re-routes,
so an answer proves the method ran inside a worker that holds the model.
"""

from __future__ import annotations

import time
from typing import Any

PATHS = ("staged", "fused")


class PathSwitchExtension:
    """Mixed into vLLM's worker class: `self` is the worker."""

    def fusedq_set_path(self, path: str) -> dict[str, Any]:
        t0 = time.monotonic()
        if path not in PATHS:
            raise ValueError(f"unknown decode path {path!r}; known: {PATHS}")
        model = self.get_model()  # type: ignore[attr-defined]
        layers = sum(type(m).__name__ == "MLAAttention" for m in model.modules())
        self._switch_test_path = path
        return {
            "path": path,
            "recaptured": False,  # eager CPU server: no CUDA graphs
            "seconds": round(time.monotonic() - t0, 6),
            "layers": layers,
            "rank": self.rank,  # type: ignore[attr-defined]
        }

    def fusedq_state(self) -> dict[str, Any]:
        return {"path": getattr(self, "_switch_test_path", None)}
