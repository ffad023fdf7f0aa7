"""The staged path vLLM runs today: ``bmm`` -> ``cat`` -> optional E4M3 quantisation.

It is both the fallback of ``backend="auto"`` and the oracle the kernel tests compare
against, so it is written for clarity with torch ops only. MXFP8 weights are dequantised
first (exact), so the staged result of an MXFP8 weight equals that of its bf16 twin.
"""

from __future__ import annotations

import torch

from fusedq.kernels.triton_mla_query import E4M3_MAX, HEAD_N
from fusedq.mxfp8 import dequantize_parts

# (weight format, out dtype) -> (atol, rtol) for the 512-wide part against the staged path.
# The RoPE part is compared bit-exactly and is not in this table.
TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    # Both paths accumulate exact bf16 products in fp32, only in a different order; after the
    # final bf16 rounding they differ by at most one bf16 ulp (<= 2^-7 relative). The atol
    # covers cancellation near zero, where fp32 order effects (~192 * 2^-24 * sum|q*w|)
    # are not relative to the result.
    ("bf16", torch.bfloat16): (2**-10, 2**-7),
    # Dequantising E4M3 * 2^k to bf16 is exact, and the staged path runs on the dequantised
    # weight, so MXFP8 is held to exactly the bf16 bound.
    ("mxfp8", torch.bfloat16): (2**-10, 2**-7),
    # A one-ulp bf16 difference can move the quotient across an E4M3 rounding boundary: one
    # E4M3 ulp is <= 2^-3 relative for normals and 2^-9 absolute for subnormals.
    ("bf16", torch.float8_e4m3fn): (2**-9, 2**-3),
    ("mxfp8", torch.float8_e4m3fn): (2**-9, 2**-3),
}


def quantize_e4m3(x: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x * (1 / q_scale), ±448)`` in E4M3, computed in fp32: vLLM's static FP8 quant.
    Its CUDA op (``static_scaled_fp8_quant``) takes the reciprocal once, correctly rounded,
    and multiplies, as ``QuantFP8.forward_native`` does; that is not always ``x / q_scale``
    rounded once, so the kernels follow vLLM, not the division."""
    y = x.float() * q_scale.reshape(()).float().reciprocal()
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
