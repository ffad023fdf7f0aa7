"""fusedq: the fused MLA decode query projection for vLLM (BF16 and MXFP8 weights)."""

from fusedq.api import mla_query_projection, prewarm, staged_mla_query
from fusedq.capability import can_implement, explain
from fusedq.mxfp8 import MXFP8Weight, dequantize_mxfp8, quantize_mxfp8
from fusedq.selection import kernel_choice, kernel_summary

__version__ = "0.1.0"

__all__ = [
    "MXFP8Weight",
    "__version__",
    "can_implement",
    "dequantize_mxfp8",
    "explain",
    "kernel_choice",
    "kernel_summary",
    "mla_query_projection",
    "prewarm",
    "quantize_mxfp8",
    "staged_mla_query",
]
