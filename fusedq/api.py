"""The public entry points: argument validation, output allocation, dispatch to the ops.

Every check here uses shapes, strides, dtypes and devices only, so it also runs while
``torch.compile`` traces with fake tensors; the address-based check (``out`` aliasing an
input) runs inside the op. A bad argument raises ``ValueError`` naming it before anything
is written.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fusedq import ops
from fusedq.capability import OUT_DTYPES, explain
from fusedq.kernels import triton_mla_query as kernel
from fusedq.kernels.triton_mla_query import HEAD_K, HEAD_N, OUT_WIDTH, ROPE
from fusedq.mxfp8 import MXFP8Weight

Weight = torch.Tensor | MXFP8Weight


def _weight_parts(weight: Weight) -> tuple[torch.Tensor, torch.Tensor | None]:
    if isinstance(weight, MXFP8Weight):
        return weight.values, weight.scales
    if not isinstance(weight, torch.Tensor):
        raise ValueError(f"weight: {type(weight).__name__} is neither a tensor nor MXFP8Weight")
    if weight.dtype != torch.bfloat16:
        raise ValueError(
            f"weight: dtype {weight.dtype} must be torch.bfloat16 (or pass an MXFP8Weight)"
        )
    if weight.dim() != 3 or tuple(weight.shape[1:]) != (HEAD_K, HEAD_N):
        raise ValueError(f"weight: shape {tuple(weight.shape)} must be [H, {HEAD_K}, {HEAD_N}]")
    return weight, None


def _check_activation(name: str, t: object, width: int, device: torch.device | None) -> None:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name}: {type(t).__name__} is not a tensor")
    if t.dtype != torch.bfloat16:
        raise ValueError(f"{name}: dtype {t.dtype} must be torch.bfloat16")
    if t.dim() != 3 or t.shape[2] != width:
        raise ValueError(f"{name}: shape {tuple(t.shape)} must be [M, H, {width}]")
    if t.stride(2) != 1:
        raise ValueError(f"{name}: last-dim stride {t.stride(2)} must be 1")
    if device is not None and t.device != device:
        raise ValueError(f"{name}: device {t.device} differs from q_nope's {device}")


def _validate(
    q_nope: torch.Tensor,
    weight: Weight,
    q_pe: torch.Tensor,
    out: torch.Tensor | None,
    out_dtype: torch.dtype | None,
    q_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.dtype]:
    """Check every argument; returns the weight's parts and the resolved output dtype."""
    _check_activation("q_nope", q_nope, HEAD_K, None)
    device = q_nope.device
    m, num_heads, _ = q_nope.shape
    _check_activation("q_pe", q_pe, ROPE, device)
    if tuple(q_pe.shape[:2]) != (m, num_heads):
        raise ValueError(f"q_pe: shape {tuple(q_pe.shape)} must be [{m}, {num_heads}, {ROPE}]")
    values, scales = _weight_parts(weight)
    if values.shape[0] != num_heads:
        raise ValueError(f"weight: {values.shape[0]} heads, q_nope has {num_heads}")
    if values.device != device:
        raise ValueError(f"weight: device {values.device} differs from q_nope's {device}")
    if out is not None and not isinstance(out, torch.Tensor):
        raise ValueError(f"out: {type(out).__name__} is not a tensor")
    out_dtype = resolve_out_dtype(out, out_dtype)
    if out_dtype == torch.bfloat16:
        if q_scale is not None:
            raise ValueError("q_scale: must be None for bf16 output (it is for E4M3 only)")
    else:
        if q_scale is None:
            raise ValueError("q_scale: a one-element fp32 tensor is required for E4M3 output")
        if not isinstance(q_scale, torch.Tensor):
            raise ValueError(f"q_scale: {type(q_scale).__name__} is not a tensor")
        if q_scale.dtype != torch.float32 or q_scale.numel() != 1:
            raise ValueError(
                f"q_scale: dtype {q_scale.dtype} with {q_scale.numel()} elements must be a "
                "one-element torch.float32 tensor"
            )
        if q_scale.device != device:
            raise ValueError(f"q_scale: device {q_scale.device} differs from q_nope's {device}")
    if out is not None:
        if tuple(out.shape) != (m, num_heads, OUT_WIDTH):
            raise ValueError(
                f"out: shape {tuple(out.shape)} must be [{m}, {num_heads}, {OUT_WIDTH}]"
            )
        if out.stride(2) != 1:
            raise ValueError(f"out: last-dim stride {out.stride(2)} must be 1")
        if out.device != device:
            raise ValueError(f"out: device {out.device} differs from q_nope's {device}")
    return values, scales, out_dtype


def resolve_out_dtype(out: torch.Tensor | None, out_dtype: torch.dtype | None) -> torch.dtype:
    """``out_dtype``, or when it is ``None`` the dtype of ``out`` (BF16 without ``out``);
    ``ValueError`` naming both dtypes when they disagree or naming the unsupported one."""
    if out_dtype is None:
        if out is None:
            return torch.bfloat16
        if out.dtype not in OUT_DTYPES:
            raise ValueError(
                f"out: dtype {out.dtype} must be torch.bfloat16 or torch.float8_e4m3fn "
                "(the output dtype is taken from out when out_dtype is None)"
            )
        return out.dtype
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"out_dtype: {out_dtype} must be torch.bfloat16 or torch.float8_e4m3fn")
    if out is not None and out.dtype != out_dtype:
        raise ValueError(f"out: dtype {out.dtype} differs from out_dtype={out_dtype}")
    return out_dtype


def _call(op, q_nope, weight, q_pe, out, out_dtype, q_scale, *extra) -> torch.Tensor:
    values, scales, out_dtype = _validate(q_nope, weight, q_pe, out, out_dtype, q_scale)
    if out is None:
        m, num_heads, _ = q_nope.shape
        out = torch.empty((m, num_heads, OUT_WIDTH), dtype=out_dtype, device=q_nope.device)
    op(q_nope, values, scales, q_pe, out, q_scale, *extra)
    return out


def mla_query_projection(
    q_nope: torch.Tensor,
    weight: Weight,
    q_pe: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    q_scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """The MLA decode query: ``[q_nope @ W_UK_T | q_pe]`` in one launch.

    Parameters
    ----------
    q_nope : bf16 ``[M, H, 192]``, any strides with a unit last stride (e.g. ``q[..., :192]``).
    weight : bf16 ``[H, 192, 512]`` with any strides (vLLM's ``W_UK_T`` view), or an
        ``MXFP8Weight``.
    q_pe : bf16 ``[M, H, 64]``, any strides with a unit last stride (e.g. ``q[..., 192:]``).
    out : optional ``[M, H, 576]`` of the output dtype with a unit last stride; rows and
        heads may be pitched. Written and returned; allocated when ``None``.
    out_dtype : ``torch.bfloat16``, or ``torch.float8_e4m3fn`` to write
        ``clamp(bf16(q_nope @ W) / q_scale, ±448)`` and ``clamp(q_pe / q_scale, ±448)``.
        ``None`` (the default) takes ``out.dtype`` when ``out`` is given, else BF16; given
        together with ``out``, the two must agree.
    q_scale : one-element fp32 tensor; required for E4M3 output, rejected for bf16.
    backend : ``"auto"`` (fused where ``can_implement``, else staged), ``"triton"``
        (fused or ``ValueError`` with the reason), ``"staged"`` (the reference path).

    Returns
    -------
    ``out``, ``[M, H, 576]`` of the output dtype.
    """
    if backend not in ops.BACKENDS:
        raise ValueError(f"backend: {backend!r} must be one of {ops.BACKENDS}")
    return _call(
        torch.ops.fusedq.mla_query_projection,
        q_nope, weight, q_pe, out, out_dtype, q_scale, backend,
    )  # fmt: skip


def staged_mla_query(
    q_nope: torch.Tensor,
    weight: Weight,
    q_pe: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The staged reference (``bmm`` -> ``cat`` -> quant), same arguments and result as
    ``mla_query_projection``."""
    return _call(torch.ops.fusedq.staged_mla_query, q_nope, weight, q_pe, out, out_dtype, q_scale)


def prewarm(
    weight: Weight,
    m_values: Iterable[int],
    *,
    out_dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Compile every kernel variant that calls with these M values (and this weight) need.

    Run it before capturing CUDA graphs: a fused call whose variant is not compiled raises
    under capture instead of compiling. M values the fused kernel does not serve (they fall
    back to the staged path) need nothing. Returns how many variants were compiled now.
    """
    values, scales = _weight_parts(weight)
    weight_format = "bf16" if scales is None else "mxfp8"
    compiled = 0
    for m in sorted({int(m) for m in m_values}):
        why = explain(
            values.shape[0], m, weight_format=weight_format, out_dtype=out_dtype,
            device=values.device,
        )  # fmt: skip
        if why is None:
            compiled += kernel.prewarm(values, scales, m, out_dtype)
    return compiled
