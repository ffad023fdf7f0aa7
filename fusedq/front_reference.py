"""The staged decode front vLLM runs, with torch ops: RoPE of q_pe and k_pe, the query
projection's staged path (``fusedq.reference.staged``), and vLLM's ``concat_and_cache_mla``.
It is ``staged_decode_front``'s path (``fusedq.front``), the fallback of ``backend="auto"``
and the oracle of the fused kernel (``kernels/triton_decode_front.py``).

The numerics, step by step, and the vLLM sources they follow:

- RoPE (both q_pe and k_pe): pairs ``(x1, x2)`` are ``(i, i + 32)`` for neox style and
  ``(2i, 2i + 1)`` for GPT-J style (DeepSeek-V3 and GLM-5 serve ``is_neox_style=False``);
  ``cos, sin`` are entries ``i`` and ``32 + i`` of ``cos_sin_cache[position]``, read in the
  cache's dtype; ``o1 = x1 cos - x2 sin``, ``o2 = x2 cos + x1 sin`` computed in fp32 and
  rounded once to bf16. That is what vLLM serves under torch.compile: its rotary embeddings'
  ``forward_native`` (``RotaryEmbedding.forward_static`` through
  ``ApplyRotaryEmb.forward_static``, and ``DeepseekScalingRotaryEmbedding.forward_static``:
  ``x * cos + rotate_gptj(x) * sin``, the same products) is traced by inductor, which loads
  the bf16 operands, computes in fp32 and rounds once on store. The ``cos_sin_cache`` vLLM
  feeds there is bf16: ``RotaryEmbeddingBase.__init__`` stores ``cache.to(dtype)`` (the model
  dtype) unless ``use_flashinfer``, which needs the custom op enabled, and custom ops are off
  under torch.compile; ``RotaryEmbedding.forward_native`` casts it to the query's dtype again
  (``_match_cos_sin_cache_dtype``). An fp32 cache (flashinfer's path,
  ``DeepseekV4ScalingRotaryEmbedding``) is taken as it is. (vLLM 0.26.0 wheel,
  ``vllm/model_executor/layers/rotary_embedding/{base,common,deepseek_scaling_rope}.py``.)
- The query: ``fusedq.reference.staged`` on the rotated q_pe (bmm, then cat or vLLM's static
  E4M3 quantisation ``x * (1 / q_scale)``), as ``mla_query_projection``.
- The cache write, vLLM's ``concat_and_cache_mla`` (``csrc/cache_kernels.cu``,
  ``concat_and_cache_mla_kernel``): a token with ``slot < 0`` writes nothing; otherwise entry
  ``[slot // block_size, slot % block_size]`` gets ``kv_c`` in ``[:512]`` and the rotated
  ``k_pe`` in ``[512:]``, copied for ``"auto"``, and for ``"fp8"``/``"fp8_e4m3"`` each value
  through ``fp8::scaled_convert<uint8_t, bf16, kFp8E4M3>(x, *scale)``, i.e.
  ``scaled_vec_conversion<uint8_t, __nv_bfloat16>``
  (``csrc/quantization/fp8/nvidia/quant_utils.cuh``): ``__nv_cvt_float_to_fp8(
  __bfloat162float(x) / scale, __NV_SATFINITE, __NV_E4M3)``: a correctly rounded fp32
  division (not the query's reciprocal multiply), saturated to ±448, rounded to nearest
  even.
"""

from __future__ import annotations

import torch

from fusedq import reference
from fusedq.contract import E4M3_MAX, QK_ROPE

E4M3 = torch.float8_e4m3fn
HALF = QK_ROPE // 2


def rope(
    x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, is_neox: bool
) -> torch.Tensor:
    """RoPE of bf16 ``x`` (``[M, 64]`` or ``[M, H, 64]``) at ``positions``, in fp32, rounded
    once to bf16 (the module docstring says why)."""
    cos_sin = cos_sin_cache.index_select(0, positions.long()).float()
    cos, sin = cos_sin[:, :HALF], cos_sin[:, HALF:]
    if x.dim() == 3:
        cos, sin = cos[:, None], sin[:, None]
    xf = x.float()
    if is_neox:
        x1, x2 = xf[..., :HALF], xf[..., HALF:]
    else:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    # Each rotated half goes back to the columns its pair came from.
    rotated = torch.cat((o1, o2), -1) if is_neox else torch.stack((o1, o2), -1).flatten(-2)
    return rotated.to(torch.bfloat16)


def quantize_cache_e4m3(x: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """``E4M3(clamp(x / k_scale, ±448))`` in fp32: vLLM's ``scaled_convert`` into an fp8
    cache (a division, saturating; the module docstring cites it)."""
    y = x.float() / k_scale.reshape(()).float()
    return y.clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def write_cache(
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor | None,
) -> None:
    """vLLM's ``concat_and_cache_mla`` with torch ops: ``cache`` (bf16, or E4M3 given
    ``k_scale``) entry ``[slot // block_size, slot % block_size] = [kv_c | k_pe]`` for every
    token whose slot is not negative."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = cache.shape[1]
    entries = torch.cat((kv_c, k_pe), dim=-1)[keep]
    if cache.dtype == E4M3:
        assert k_scale is not None
        entries = quantize_cache_e4m3(entries, k_scale)
    cache[slots // block_size, slots % block_size] = entries


def staged(qk_nope, q, values, scales, kv_c, k_pe, positions, cos_sin_cache, cache,
            slot_mapping, out, q_scale, k_scale, *, neox) -> None:  # fmt: skip
    """The staged path on checked operands (``k_pe`` ``[M, 64]``, an fp8 cache as E4M3 with
    its ``k_scale``, else ``k_scale`` None)."""
    q_pe = rope(q[..., qk_nope:], positions, cos_sin_cache, neox)
    k_pe = rope(k_pe, positions, cos_sin_cache, neox)
    reference.staged(q[..., :qk_nope], values, scales, q_pe, out, q_scale)
    write_cache(kv_c, k_pe, cache, slot_mapping, k_scale)
