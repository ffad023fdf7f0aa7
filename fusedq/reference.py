"""The staged path vLLM runs: ``bmm``, then ``cat`` (and for E4M3 output the quantisation).

One function, ``staged``, in the two forms vLLM has (``STAGED_FORMS``). It is the fallback of
``backend="auto"``, the oracle the kernel tests compare against, and the baseline
``fusedq-bench`` times the fused kernel against, so it is written for clarity with torch ops
(a caller may pass its own E4M3 concat-and-quantise step). MXFP8 weights are dequantised first
(exact), so the staged result of an MXFP8 weight equals that of its bf16 twin.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fusedq.contract import E4M3_MAX, KV_LORA, QUERY_WIDTH
from fusedq.mxfp8 import dequantize_parts

# The forms of vLLM's staged decode query, each a baseline of fusedq-bench.
STAGED_FORMS = {
    # vLLM 0.32's block: the bmm, then [q_nope @ W | q_pe] as one [M, H, 576] query (the cat
    # its backends do, or for E4M3 output the concat-and-quantise op). The fallback's form.
    "bmm+cat": "vLLM 0.32: bmm, then cat into [M, H, 576] (E4M3: concat + quantise)",
    # vLLM 0.26 with FLASH_ATTN_MLA: the backend takes the (q_nope @ W, q_pe) pair, so the
    # bmm is all the staged block runs.
    "bmm": "vLLM 0.26 FLASH_ATTN_MLA: the bmm alone (the backend takes the nope/pe pair)",
}
# Which form the served vLLM (0.26) runs, per output: FLASH_ATTN_MLA for BF16; it has no FP8
# path, so E4M3 output is served by a backend that takes the quantised [M, H, 576] query.
SERVED_FORM = {torch.bfloat16: "bmm", torch.float8_e4m3fn: "bmm+cat"}

# (weight format, out dtype) -> (atol, rtol) for the 512-wide part against the staged path.
# The RoPE part is compared bit-exactly and is not in this table.
TOLERANCES: dict[tuple[str, torch.dtype], tuple[float, float]] = {
    # Both paths accumulate exact bf16 products in fp32, only in a different order; after the
    # final bf16 rounding they differ by at most one bf16 ulp (<= 2^-7 relative). The atol
    # covers cancellation near zero, where fp32 order effects (~qk_nope * 2^-24 * sum|q*w|,
    # qk_nope <= 192 in every served geometry) are not relative to the result.
    ("bf16", torch.bfloat16): (2**-10, 2**-7),
    # Dequantising E4M3 * 2^k to bf16 is exact, and the staged path runs on the dequantised
    # weight, so MXFP8 is held to exactly the bf16 bound.
    ("mxfp8", torch.bfloat16): (2**-10, 2**-7),
    # A one-ulp bf16 difference can move the quotient across an E4M3 rounding boundary: one
    # E4M3 ulp is <= 2^-3 relative for normals and 2^-9 absolute for subnormals.
    ("bf16", torch.float8_e4m3fn): (2**-9, 2**-3),
    ("mxfp8", torch.float8_e4m3fn): (2**-9, 2**-3),
}

# E4M3's concat and quantisation: (q_nope @ W, q_pe, q_scale, out) -> None, writing out.
ConcatQuant = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def quantize_e4m3(x: torch.Tensor, q_scale: torch.Tensor) -> torch.Tensor:
    """``clamp(x * (1 / q_scale), ±448)`` in E4M3, computed in fp32: vLLM's static FP8 quant.
    Its CUDA op (``static_scaled_fp8_quant``) takes the reciprocal once, correctly rounded,
    and multiplies, as ``QuantFP8.forward_native`` does; that is not always ``x / q_scale``
    rounded once, so the kernels follow vLLM, not the division
    (docs/decisions/0004-e4m3-reciprocal.md)."""
    y = x.float() * q_scale.reshape(()).float().reciprocal()
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)


def concat_quantize_e4m3(
    ql_nope: torch.Tensor, q_pe: torch.Tensor, q_scale: torch.Tensor, out: torch.Tensor
) -> None:
    """``out = quantize_e4m3([ql_nope | q_pe])``, part by part with torch ops."""
    out[..., :KV_LORA].copy_(quantize_e4m3(ql_nope, q_scale))
    out[..., KV_LORA:].copy_(quantize_e4m3(q_pe, q_scale))


def staged(
    q_nope: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    q_pe: torch.Tensor,
    out: torch.Tensor | None,
    q_scale: torch.Tensor | None,
    *,
    form: str = "bmm+cat",
    concat_quant: ConcatQuant = concat_quantize_e4m3,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """The query projection of validated operands, the staged way, in one of ``STAGED_FORMS``.

    ``values`` is the bf16 weight, or the E4M3 values of an MXFP8 weight whose ``scales``
    (uint8 bytes) are given. ``"bmm+cat"`` writes ``out`` (``[M, H, 576]``, allocated when
    ``None``; E4M3 when ``q_scale`` is given, through ``concat_quant``) and returns it;
    ``"bmm"`` returns the pair ``(q_nope @ W, q_pe)`` that vLLM 0.26's FLASH_ATTN_MLA takes.
    """
    w = values if scales is None else dequantize_parts(values, scales)
    # [H, M, qk_nope] @ [H, qk_nope, 512] -> [H, M, 512], rounded to bf16 as cuBLAS/vLLM do
    # (any geometry: qk_nope is the contraction, read from the tensors).
    ql_nope = torch.bmm(q_nope.transpose(0, 1), w).transpose(0, 1)
    if form == "bmm":
        return ql_nope, q_pe
    if form != "bmm+cat":
        raise ValueError(f"form={form!r} must be one of {sorted(STAGED_FORMS)}")
    if out is None:
        m, h, _ = q_nope.shape
        dtype = torch.bfloat16 if q_scale is None else torch.float8_e4m3fn
        out = torch.empty(m, h, QUERY_WIDTH, dtype=dtype, device=q_nope.device)
    if out.dtype == torch.float8_e4m3fn:
        assert q_scale is not None
        concat_quant(ql_nope, q_pe, q_scale, out)
    else:
        torch.cat((ql_nope, q_pe), dim=-1, out=out)
    return out
