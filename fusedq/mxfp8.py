"""MXFP8 weights: E4M3 values with one E8M0 scale per 32 elements along N (OCP MX).

The checkpoint-native ``W_UK_T`` blocks its scales along N, the 512-wide latent axis (kv_lora,
the same in every served geometry), so a ``[H, qk_nope, 512]`` weight carries
``[H, qk_nope, 16]`` scale bytes: ``[H, 192, 16]`` for GLM-5, ``[H, 128, 16]`` for DeepSeek-V3. Scale bytes are stored as
``uint8`` or ``float8_e8m0fnu``; they are reinterpreted with ``.view``, never converted with
``.to`` (that would turn the byte 127 into the value 127.0).
"""

from __future__ import annotations

import torch

from fusedq.contract import (
    E4M3_MAX,
    GEOMETRIES,
    KV_LORA,
    MX_BLOCK,
    SCALE_BLOCKS,
    describe_geometries,
    geometry_of,
)

# E8M0 encodes 2^(byte - 127); 0xFF is NaN and must never reach a kernel.
E8M0_BIAS = 127
E8M0_NAN = 0xFF


def _scale_bytes(scales: torch.Tensor) -> torch.Tensor:
    if scales.dtype == torch.uint8:
        return scales
    if scales.dtype == getattr(torch, "float8_e8m0fnu", None):
        return scales.view(torch.uint8)
    raise ValueError(f"scales: dtype {scales.dtype} must be uint8 or float8_e8m0fnu")


def _check_shape(name: str, t: torch.Tensor) -> None:
    # [H, qk_nope, 512] of a served geometry (qk_nope is the only dim that differs).
    if t.dim() != 3 or t.shape[2] != KV_LORA or geometry_of(t.shape[1]) is None:
        widths = " or ".join(str(g.qk_nope) for g in GEOMETRIES)
        raise ValueError(
            f"{name}: shape {tuple(t.shape)} must be [H, qk_nope, {KV_LORA}] with qk_nope "
            f"{widths} ({describe_geometries()})"
        )


class MXFP8Weight:
    """An MXFP8 ``W_UK_T``: ``values`` float8_e4m3fn ``[H, qk_nope, 512]`` of a served geometry
    (any strides with a unit stride on one of the last two axes is fastest) and ``scales``
    ``[H, qk_nope, 16]`` uint8 or float8_e8m0fnu, one scale per 32 consecutive values along N.

    Raises ``ValueError`` at construction on a wrong dtype/shape/device or on a NaN scale
    byte (0xFF); the check happens here once so the hot path never scans scales.
    """

    __slots__ = ("scales", "values")

    def __init__(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        if not isinstance(values, torch.Tensor) or values.dtype != torch.float8_e4m3fn:
            got = values.dtype if isinstance(values, torch.Tensor) else type(values).__name__
            raise ValueError(f"values: dtype {got} must be torch.float8_e4m3fn")
        _check_shape("values", values)
        if not isinstance(scales, torch.Tensor):
            raise ValueError(f"scales: {type(scales).__name__} is not a tensor")
        raw = _scale_bytes(scales)
        expected = (*values.shape[:2], SCALE_BLOCKS)
        if tuple(raw.shape) != expected:
            raise ValueError(f"scales: shape {tuple(raw.shape)} must be {list(expected)}")
        if raw.device != values.device:
            raise ValueError(f"scales: device {raw.device} differs from values' {values.device}")
        if bool((raw == E8M0_NAN).any()):
            bad = (raw == E8M0_NAN).nonzero()[0].tolist()
            raise ValueError(f"scales: byte 0xFF (E8M0 NaN) at index {bad}")
        self.values = values
        self.scales = raw

    @property
    def num_heads(self) -> int:
        return self.values.shape[0]

    @property
    def device(self) -> torch.device:
        return self.values.device

    @property
    def nbytes(self) -> int:
        """Bytes the kernel reads: values plus scales."""
        return self.values.numel() + self.scales.numel()

    def __repr__(self) -> str:
        return f"MXFP8Weight(num_heads={self.num_heads}, device={self.device})"


def scale_factors(scales: torch.Tensor) -> torch.Tensor:
    """fp32 ``2^(byte - 127)`` for E8M0 scale bytes (uint8 or float8_e8m0fnu)."""
    raw = _scale_bytes(scales).to(torch.int32)
    return torch.exp2((raw - E8M0_BIAS).to(torch.float32))


def quantize_mxfp8(w_bf16: torch.Tensor) -> MXFP8Weight:
    """Quantise a bf16 ``[H, qk_nope, 512]`` weight to MXFP8 with scales blocked along N.

    Each 32-wide block gets the smallest power-of-two scale that keeps its largest magnitude
    within E4M3's 448 (so nothing saturates); values round to nearest even.
    """
    if not isinstance(w_bf16, torch.Tensor) or w_bf16.dtype != torch.bfloat16:
        raise ValueError("w_bf16: must be a torch.bfloat16 tensor")
    _check_shape("w_bf16", w_bf16)
    h, k = w_bf16.shape[:2]
    blocks = w_bf16.float().reshape(h, k, SCALE_BLOCKS, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1, keepdim=True)
    tiny = torch.finfo(torch.float32).tiny
    exp = torch.ceil(torch.log2(amax.clamp_min(tiny) / E4M3_MAX))
    exp = exp.clamp(-E8M0_BIAS, E8M0_BIAS)
    values = (blocks / torch.exp2(exp)).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    scales = (exp + E8M0_BIAS).to(torch.uint8).squeeze(-1)
    return MXFP8Weight(values.reshape(h, k, KV_LORA), scales)


def dequantize_mxfp8(wq: MXFP8Weight) -> torch.Tensor:
    """The bf16 ``[H, qk_nope, 512]`` weight an MXFP8Weight stands for (exact: every product of an
    E4M3 value and a power of two fits bf16)."""
    if not isinstance(wq, MXFP8Weight):
        raise ValueError(f"wq: {type(wq).__name__} is not an MXFP8Weight")
    return dequantize_parts(wq.values, wq.scales)


def dequantize_parts(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """``dequantize_mxfp8`` on the raw tensors (already validated by an MXFP8Weight)."""
    factors = scale_factors(scales).repeat_interleave(MX_BLOCK, dim=-1)
    return (values.float() * factors).to(torch.bfloat16)
