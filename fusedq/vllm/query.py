"""The tensor side of the vLLM integration: what the patched MLA decode step runs.

Nothing here imports vLLM, so the GPU tests drive these functions on the H200 (which has no
vLLM) with the exact tensors vLLM's ``MLAAttention.forward_impl`` holds at that point:

- ``q_nope`` in vLLM's head-major ``(N, B, P)`` layout, a transposed view of a slice of the
  wider ``q`` (``q[..., :192].transpose(0, 1)``);
- ``W_UK_T = W_UK.permute(1, 2, 0)``, a strided view of ``kv_b_proj``'s weight, or an
  ``MXFP8Weight`` cut from an MXFP8 ``kv_b_proj`` by ``mxfp8_w_uk_t``;
- ``q_pe`` (``q[..., 192:]``), token-major.

``decode_query`` returns the finished ``[B, N, 576]`` query (what vLLM's ``bmm`` + concat,
or ``bmm`` + ``_decode_concat_quant_fp8_op`` for FP8 attention, would have produced), or
``None`` when the fused kernel does not serve this step; the caller then runs vLLM's own
staged code unchanged. ``split_query`` turns that query into the ``(ql_nope, q_pe)`` views a
backend that takes only a pair reads.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from fusedq import api, capability, selection
from fusedq.contract import GLM5, KV_LORA, MX_BLOCK, Geometry, geometry_of
from fusedq.mxfp8 import MXFP8Weight
from fusedq.vllm.report import BACKEND_ENV

Weight = torch.Tensor | MXFP8Weight

# The backend the decode step's calls pass, set by the plugin from FUSEDQ_BACKEND
# (report.hook_backend). "triton" by default: where "auto" would take the CuTe kernel (M <= 2
# in CUDA graphs), the hook's calls run that selection's Triton configuration instead (the
# CuTe kernel has not yet been measured inside a vLLM server), and ``kernel_summary`` says so
# in the server log. "auto" binds what fusedq.kernel_choice picks.
BACKEND = "triton"

# can_implement() depends only on its arguments and process-wide facts (Triton importable,
# the device's capability, TRITON_INTERPRET), so its answers are cached: the decode step of
# every layer asks it once per distinct M.
_qualifies: dict[tuple, bool] = {}
_qualifies_lock = threading.Lock()


def weight_format(weight: Weight) -> str:
    """``"mxfp8"`` for an ``MXFP8Weight``, ``"bf16"`` for a tensor."""
    return "mxfp8" if isinstance(weight, MXFP8Weight) else "bf16"


def qualifies(
    num_heads: int,
    m: int,
    fmt: str,
    out_dtype: torch.dtype,
    device,
    geometry: Geometry = GLM5,
) -> bool:
    """``fusedq.can_implement`` for one decode step (qualified shapes only), cached per
    argument tuple."""
    key = (num_heads, m, fmt, out_dtype, geometry.name, torch.device(device))
    hit = _qualifies.get(key)
    if hit is None:
        hit = capability.can_implement(
            num_heads, m, geometry=geometry, weight_format=fmt, out_dtype=out_dtype,
            device=key[-1],
        )  # fmt: skip
        with _qualifies_lock:
            _qualifies[key] = hit
    return hit


def decode_query(
    q_nope: torch.Tensor,
    weight: Weight,
    q_pe: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    q_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """The MLA decode query of one layer and step in one fused launch, or ``None``.

    Parameters
    ----------
    q_nope : bf16 ``(N, B, qk_nope)``, vLLM's ``mqa_q_nope`` after its ``transpose(0, 1)``
        (any strides with a unit last stride); qk_nope names the geometry (192 GLM-5, 128
        DeepSeek-V3).
    weight : vLLM's ``W_UK_T`` (bf16 ``[N, qk_nope, 512]``, any strides) or an
        ``MXFP8Weight``.
    q_pe : bf16 ``(B, N, 64)``, vLLM's ``mqa_q_pe``.
    out_dtype : ``torch.bfloat16``, or ``torch.float8_e4m3fn`` when vLLM would run
        ``_decode_concat_quant_fp8_op`` (FP8 attention with a backend that takes an FP8 query).
    q_scale : the layer's ``_q_scale`` (one fp32 element) for E4M3 output, else ``None``.
    out : optional ``(B, N, 576)`` buffer of ``out_dtype`` (rows may be pitched); a new
        contiguous one is allocated when ``None``.

    Returns
    -------
    ``(B, N, 576)`` of ``out_dtype`` — what vLLM's staged code hands on as ``mqa_q`` — or
    ``None`` when ``fusedq.can_implement`` says no for this geometry, ``(N, B)``, weight
    format and output dtype; nothing is written then.
    """
    num_heads, m, qk_nope = q_nope.shape
    geometry = geometry_of(qk_nope)
    fmt = weight_format(weight)
    if geometry is None or not qualifies(num_heads, m, fmt, out_dtype, q_nope.device, geometry):
        return None
    # Without `out` the op allocates a contiguous token-major [B, N, 576], which backends and
    # DCP's all-gather take as is (and fresh memory needs no per-call overlap check).
    return api.mla_query_projection(
        q_nope.transpose(0, 1),
        weight,
        q_pe,
        out=out,
        out_dtype=out_dtype,
        q_scale=q_scale,
        backend=BACKEND,
    )


def kernel_summary(
    num_heads: int,
    ms: Iterable[int],
    *,
    weight_format: str,
    out_dtype: torch.dtype,
    device,
    pdl: bool,
    geometry: Geometry = GLM5,
) -> str:
    """Which kernel the hook's calls run at each of ``ms``, as ``fusedq.kernel_summary`` words
    it (runs of equal M merged), for ``BACKEND``: where ``backend="auto"`` would take the CuTe
    kernel, the Triton-family kernel of the same selection, with a note saying why."""
    from fusedq.selection import select, triton_kernel_name

    runs: list[tuple[str, list[int]]] = []
    cute = False
    for m in sorted(set(ms)):
        chosen = select(
            num_heads, m, geometry=geometry, weight_format=weight_format, out_dtype=out_dtype,
            device=device, pdl=pdl,
        )  # fmt: skip
        name = chosen.kernel
        if chosen.path == "cute" and BACKEND == "triton":
            cute, name = True, triton_kernel_name(chosen.config)
        if runs and runs[-1][0] == name:
            runs[-1][1].append(m)
        else:
            runs.append((name, [m]))
    if not cute:  # what auto runs is what the hook runs: the package's own wording
        return selection.kernel_summary(
            num_heads, ms, geometry=geometry, weight_format=weight_format, out_dtype=out_dtype,
            device=device, pdl=pdl,
        )  # fmt: skip
    text = "; ".join(
        f"M={m_run[0] if len(m_run) == 1 else f'{m_run[0]}-{m_run[-1]}'} {name}"
        for name, m_run in runs
    )
    return (
        text
        + f" [CuTe: not in vLLM; the hook calls backend={BACKEND!r}; {BACKEND_ENV}=auto binds it]"
    )


def split_query(query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The finished ``[B, N, 576]`` query as the ``(ql_nope, q_pe)`` pair a backend that takes
    only a pair reads: two views of the one buffer, ``query[..., :512]`` and
    ``query[..., 512:]``, no copy.

    Each view keeps a unit last stride and the buffer's row and head strides
    (``N * 576``, ``576``), which is what FlashAttention 3 checks of ``q_v`` and ``q`` (the
    ``q_nope`` / ``q_rope`` it is handed by FLASH_ATTN_MLA_SPARSE), and what FLASH_ATTN_MLA
    makes itself when it splits a tensor query.
    """
    return query[..., :KV_LORA], query[..., KV_LORA:]


def prewarm_values(
    capture_sizes: Iterable[int],
    num_heads: int,
    fmt: str,
    out_dtype: torch.dtype,
    device: torch.device | str,
    geometry: Geometry = GLM5,
) -> list[int]:
    """The CUDA-graph capture sizes the fused kernel will serve (the Ms to prewarm), sorted."""
    return sorted(
        {
            int(m)
            for m in capture_sizes
            if qualifies(num_heads, int(m), fmt, out_dtype, device, geometry)
        }
    )


def prewarm(weight: Weight, ms: Iterable[int], *, out_dtype: torch.dtype) -> int:
    """Compile what the hook's calls will run at ``ms`` (before CUDA-graph capture), for the
    hook's ``BACKEND``: under the default ``"triton"`` not the CuTe kernel's variants, which
    the calls never bind and which would cost seconds of start-up wherever the CUTLASS DSL is
    installed (vLLM 0.26 brings it). Returns how many variants were compiled now."""
    return api.prewarm(weight, ms, out_dtype=out_dtype, backend=BACKEND)


def mxfp8_w_uk_t(
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    *,
    num_heads: int,
    qk_nope_head_dim: int = GLM5.qk_nope,
    v_head_dim: int,
    kv_lora_rank: int = KV_LORA,
) -> MXFP8Weight:
    """``W_UK_T`` of an MXFP8 ``kv_b_proj``, kept in MXFP8 (views, no dequantisation).

    ``kv_b_proj`` maps the latent (``kv_lora_rank`` = 512, its input axis) to
    ``num_heads * (qk_nope + v_head)`` outputs. A checkpoint-native MXFP8 linear stores
    ``weight`` E4M3 ``[out, 512]`` and ``weight_scale`` E8M0 ``[out, 16]``, one scale per 32
    inputs — blocked along the latent axis, which is N of ``W_UK_T``. So the ``W_UK_T`` view
    ``[H, qk_nope, 512]`` of the values and ``[H, qk_nope, 16]`` of the scales (192 rows for
    GLM-5, 128 for DeepSeek-V3) is exactly the N-blocked MXFP8 weight the fused kernel reads.

    Raises ``ValueError`` naming the tensor whose dtype or shape is not that layout (a
    kernel-specific post-processed layout: swizzled scales, transposed or packed values).
    """
    rows = num_heads * (qk_nope_head_dim + v_head_dim)
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"kv_b_proj.weight: dtype {weight.dtype} is not torch.float8_e4m3fn")
    if tuple(weight.shape) != (rows, kv_lora_rank) or weight.stride(-1) != 1:
        raise ValueError(
            f"kv_b_proj.weight: shape {tuple(weight.shape)} strides {weight.stride()} is not a "
            f"row-major [{rows}, {kv_lora_rank}]"
        )
    if weight_scale.dtype not in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)):
        raise ValueError(f"kv_b_proj.weight_scale: dtype {weight_scale.dtype} is not E8M0/uint8")
    blocks = kv_lora_rank // MX_BLOCK
    if tuple(weight_scale.shape) != (rows, blocks) or weight_scale.stride(-1) != 1:
        raise ValueError(
            f"kv_b_proj.weight_scale: shape {tuple(weight_scale.shape)} strides "
            f"{weight_scale.stride()} is not the unswizzled [{rows}, {blocks}]"
        )
    per_head = qk_nope_head_dim + v_head_dim
    values = weight.view(num_heads, per_head, kv_lora_rank)[:, :qk_nope_head_dim, :]
    scales = weight_scale.view(num_heads, per_head, blocks)[:, :qk_nope_head_dim, :]
    return MXFP8Weight(values, scales)
