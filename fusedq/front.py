"""The fused MLA decode front: RoPE of q_pe and k_pe, the absorbed query projection, the
concat (and E4M3 quantisation) of the query, and the KV-cache write, in one launch.

vLLM runs these per layer and decode step as separate graph nodes: the rotary embedding,
the ``bmm`` with ``W_UK_T`` and the concat (or concat-and-quantise), and
``concat_and_cache_mla``. ``mla_decode_front`` does all of it in one Triton launch
(``kernels/triton_decode_front.py``); ``staged_decode_front`` composes the same steps the way
vLLM does, with torch ops, and is the fallback and the oracle.

The checks and per-signature plans are ``fusedq.front_dispatch``'s, the staged path and the
numerics it follows (with the vLLM sources) ``fusedq.front_reference``'s.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fusedq import dispatch, front_dispatch, ops  # noqa: F401 (ops registers the ops)
from fusedq.front_dispatch import KV_CACHE_DTYPES
from fusedq.kernels import front_launch
from fusedq.mxfp8 import MXFP8Weight

Weight = torch.Tensor | MXFP8Weight


def mla_decode_front(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    weight: Weight,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    is_neox: bool,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    q_scale: torch.Tensor | None = None,
    backend: str = "auto",
) -> torch.Tensor:
    """One MLA decode step's front, in one launch: RoPE of q_pe and k_pe, ``[q_nope @ W_UK_T |
    rope(q_pe)]`` into the query (BF16 or E4M3), ``[kv_c | rope(k_pe)]`` into the KV cache.

    Parameters
    ----------
    q : bf16 ``[M, H, qk_nope + 64]``, q_b_proj's output per head, q_pe not yet rotated; any
        row and head strides, unit last stride. Its width names the geometry.
    kv_c : bf16 ``[M, 512]`` (kv_c_normed), unit last stride.
    k_pe : bf16 ``[M, 64]`` or ``[M, 1, 64]``, not yet rotated, unit last stride (vLLM passes
        a strided slice of kv_a_proj's output).
    positions : int64 or int32 ``[M]``, each below ``cos_sin_cache``'s rows (not checked: that
        would read the device).
    cos_sin_cache : fp32 or bf16 ``[max_position, 64]``, cos then sin (the layer's own, any
        scaling baked in), unit last stride.
    weight : bf16 ``W_UK_T`` ``[H, qk_nope, 512]`` with any strides, or an ``MXFP8Weight``.
    kv_cache : ``[num_blocks, block_size, 576]``, any block and slot strides, unit last
        stride: bf16 for ``kv_cache_dtype="auto"``, uint8 or float8_e4m3fn for ``"fp8"`` /
        ``"fp8_e4m3"``.
    slot_mapping : int64 ``[M]``; a negative slot writes nothing (vLLM's padding).
    is_neox : rotary style: neox (halves) or GPT-J (interleaved pairs, DeepSeek-V3 and GLM-5).
    kv_cache_dtype : vLLM's name of the cache's format.
    k_scale : one-element fp32 tensor; the cache stores ``E4M3(x / k_scale)`` where fp8.
    out, out_dtype, q_scale : the query's output, as ``mla_query_projection``.
    backend : ``"auto"`` (the fused kernel at the geometry's qualified H and M, else
        staged), ``"triton"`` (the fused kernel at any H and M it runs, M up to 512; raises
        ``ValueError`` with the reason where it cannot), ``"staged"`` (the reference).

    Returns the query ``[M, H, 576]``. Bad input raises ``ValueError`` naming the argument
    before anything is written.

    The first call with a signature (every tensor's type, dtype, shape, strides and device,
    and the options) is checked in full and its plan cached; later calls with that signature
    only check that ``out`` and ``kv_cache`` overlap no input. While ``torch.compile``
    traces, the call is the custom op ``fusedq::mla_decode_front`` (``fusedq.ops``).
    """
    values, scales = dispatch.split_weight(weight)
    if torch.compiler.is_compiling():
        out = front_dispatch.prepare_traced(
            q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
            is_neox=is_neox, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, out=out,
            out_dtype=out_dtype, q_scale=q_scale, backend=backend,
        )  # fmt: skip
        torch.ops.fusedq.mla_decode_front(
            q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
            out, k_scale, q_scale, is_neox, kv_cache_dtype, backend,
        )  # fmt: skip
        return out
    return front_dispatch.call(
        q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
        is_neox=is_neox, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, out=out,
        out_dtype=out_dtype, q_scale=q_scale, backend=backend,
    )  # fmt: skip


def staged_decode_front(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    weight: Weight,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    is_neox: bool,
    kv_cache_dtype: str = "auto",
    k_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The staged reference of ``mla_decode_front`` (same arguments and results): RoPE, then
    ``fusedq.reference.staged``, then vLLM's ``concat_and_cache_mla`` with torch ops."""
    if torch.compiler.is_compiling():
        values, scales = dispatch.split_weight(weight)
        out = front_dispatch.prepare_traced(
            q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
            is_neox=is_neox, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, out=out,
            out_dtype=out_dtype, q_scale=q_scale, backend="staged",
        )  # fmt: skip
        torch.ops.fusedq.staged_decode_front(
            q, kv_c, k_pe, positions, cos_sin_cache, values, scales, kv_cache, slot_mapping,
            out, k_scale, q_scale, is_neox, kv_cache_dtype,
        )  # fmt: skip
        return out
    return mla_decode_front(
        q, kv_c, k_pe, positions, cos_sin_cache, weight, kv_cache, slot_mapping,
        is_neox=is_neox, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, out=out,
        out_dtype=out_dtype, q_scale=q_scale, backend="staged",
    )  # fmt: skip


def prewarm_decode_front(
    weight: Weight,
    m_values: Iterable[int],
    *,
    is_neox: bool,
    kv_cache_dtype: str = "auto",
    out_dtype: torch.dtype = torch.bfloat16,
    cos_sin_dtype: torch.dtype = torch.bfloat16,
    positions_dtype: torch.dtype = torch.int64,
) -> int:
    """Compile every front variant that ``backend="auto"`` calls with these M values need
    (before capturing CUDA graphs: an uncompiled variant raises under capture). Returns how
    many variants were compiled now."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype: {kv_cache_dtype!r} must be one of {sorted(KV_CACHE_DTYPES)}"
        )
    values, scales = dispatch.split_weight(weight)
    geometry = dispatch.check_weight(values, scales)
    cache_fp8 = kv_cache_dtype != "auto"
    compiled = 0
    for m in sorted({int(m) for m in m_values}):
        config, _ = front_dispatch.choice(
            values.shape[0], m, geometry=geometry,
            weight_format="bf16" if scales is None else "mxfp8", out_dtype=out_dtype,
            cache_fp8=cache_fp8, device=values.device,
        )  # fmt: skip
        if config is not None:
            compiled += front_launch.prewarm(
                values, scales, m, out_dtype, config, neox=is_neox, cache_fp8=cache_fp8,
                cos_sin_dtype=cos_sin_dtype, positions_dtype=positions_dtype,
            )  # fmt: skip
    return compiled
