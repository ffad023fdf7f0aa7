"""fusedq: the fused MLA decode query projection for vLLM (BF16 and MXFP8 weights), and the
fused decode front (RoPE, the query projection and the KV-cache write in one launch).

The public names load on first use (PEP 562): ``import fusedq.contract`` or
``fusedq.provenance`` then costs no torch or Triton, which the orchestrator's planning and
the scripts rely on; ``fusedq.mla_query_projection`` imports the kernels as before.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# Each public name and the module that owns it.
_EXPORTS = {
    "MXFP8Weight": "fusedq.mxfp8",
    "can_implement": "fusedq.capability",
    "dequantize_mxfp8": "fusedq.mxfp8",
    "explain": "fusedq.capability",
    "kernel_choice": "fusedq.selection",
    "kernel_summary": "fusedq.selection",
    "mla_decode_front": "fusedq.front",
    "mla_query_projection": "fusedq.api",
    "prewarm": "fusedq.api",
    "prewarm_decode_front": "fusedq.front",
    "quantize_mxfp8": "fusedq.mxfp8",
    "staged_decode_front": "fusedq.front",
    "staged_mla_query": "fusedq.api",
}

__all__ = [
    "MXFP8Weight",
    "__version__",
    "can_implement",
    "dequantize_mxfp8",
    "explain",
    "kernel_choice",
    "kernel_summary",
    "mla_decode_front",
    "mla_query_projection",
    "prewarm",
    "prewarm_decode_front",
    "quantize_mxfp8",
    "staged_decode_front",
    "staged_mla_query",
]

if TYPE_CHECKING:
    from fusedq.api import mla_query_projection, prewarm, staged_mla_query
    from fusedq.capability import can_implement, explain
    from fusedq.front import mla_decode_front, prewarm_decode_front, staged_decode_front
    from fusedq.mxfp8 import MXFP8Weight, dequantize_mxfp8, quantize_mxfp8
    from fusedq.selection import kernel_choice, kernel_summary


def __getattr__(name: str) -> Any:
    owner = _EXPORTS.get(name)
    if owner is not None:
        value = getattr(importlib.import_module(owner), name)
    elif not name.startswith("_") and importlib.util.find_spec(f"{__name__}.{name}"):
        # A submodule read as an attribute (``fusedq.reference.TOLERANCES``), as an eager
        # __init__ that had imported it would have allowed.
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module 'fusedq' has no attribute {name!r}")
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
