"""The staged path vLLM runs today: ``bmm`` -> ``cat`` -> optional E4M3 quantisation.

It is both the fallback of ``backend="auto"`` and the oracle the kernel tests compare
against, so it is written for clarity with torch ops only. MXFP8 weights are dequantised
first (exact), so the staged result of an MXFP8 weight equals that of its bf16 twin.
"""

from __future__ import annotations

import torch

from fusedq.kernels.triton_mla_query import E4M3_MAX, HEAD_N
from fusedq.mxfp8 import dequantize_parts


def quantize_e4m3(x: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x / q_scale, ±448)`` in E4M3, computed in fp32 (vLLM's static FP8 quant)."""
    y = x.float() / q_scale.reshape(()).float()
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def staged_into(
    q_nope: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    q_scale: torch.Tensor | None,
) -> None:
    """Write the query projection of validated operands into ``out`` the staged way.

    ``values`` is the bf16 weight, or the E4M3 values of an MXFP8 weight whose ``scales``
    (uint8 bytes) are given.
    """
    w = values if scales is None else dequantize_parts(values, scales)
    # [H, M, 192] @ [H, 192, 512] -> [H, M, 512], rounded to bf16 as cuBLAS/vLLM do.
    ql_nope = torch.bmm(q_nope.transpose(0, 1), w).transpose(0, 1)
    if out.dtype == torch.float8_e4m3fn:
        assert q_scale is not None
        out[..., :HEAD_N].copy_(quantize_e4m3(ql_nope, q_scale))
        out[..., HEAD_N:].copy_(quantize_e4m3(q_pe, q_scale))
    else:
        out[..., :HEAD_N].copy_(ql_nope)
        out[..., HEAD_N:].copy_(q_pe)
