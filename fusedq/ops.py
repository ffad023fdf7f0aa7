"""``torch.library`` custom ops for both paths of the query and of the decode front, with
fake twins that mutate nothing (the schemas declare what the real ones write: ``out``, and
the front's ``kv_cache``).

Going through custom ops keeps ``torch.compile(fullgraph=True)`` from tracing into Triton
or the backend choice, and makes the call one opaque node that CUDA graphs capture as is.
The real implementations run eagerly with real tensors through ``dispatch.call``: the plan of
the call's signature (checked once), the address-based overlap check and the launch.
Eager calls of the public API skip the dispatcher and call ``dispatch.call`` directly.
"""

import torch

from fusedq import dispatch, front_dispatch

BACKENDS = dispatch.BACKENDS


@torch.library.custom_op("fusedq::mla_query_projection", mutates_args=("out",))
def mla_query_projection_op(
    q_nope: torch.Tensor,
    w_values: torch.Tensor,
    w_scales: torch.Tensor | None,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    q_scale: torch.Tensor | None,
    backend: str,
    pdl: bool,
) -> None:
    """Fused (or, per ``backend``, staged) query projection into ``out``."""
    dispatch.call(q_nope, w_values, w_scales, q_pe, out, None, q_scale, backend, pdl, real=True)


@mla_query_projection_op.register_fake
def _mla_query_projection_fake(
    q_nope, w_values, w_scales, q_pe, out, q_scale, backend, pdl
) -> None:
    return None


@torch.library.custom_op("fusedq::staged_mla_query", mutates_args=("out",))
def staged_mla_query_op(
    q_nope: torch.Tensor,
    w_values: torch.Tensor,
    w_scales: torch.Tensor | None,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    q_scale: torch.Tensor | None,
) -> None:
    """The staged reference (bmm + cat + quant) into ``out``."""
    dispatch.call(q_nope, w_values, w_scales, q_pe, out, None, q_scale, "staged", False, real=True)


@staged_mla_query_op.register_fake
def _staged_mla_query_fake(q_nope, w_values, w_scales, q_pe, out, q_scale) -> None:
    return None


# The decode front (``fusedq.front``, run through ``front_dispatch.call``): the query and the
# KV cache are both written.


@torch.library.custom_op("fusedq::mla_decode_front", mutates_args=("out", "kv_cache"))
def mla_decode_front_op(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    w_values: torch.Tensor,
    w_scales: torch.Tensor | None,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: torch.Tensor,
    k_scale: torch.Tensor | None,
    q_scale: torch.Tensor | None,
    is_neox: bool,
    kv_cache_dtype: str,
    backend: str,
) -> None:
    """The fused (or, per ``backend``, staged) decode front into ``out`` and ``kv_cache``."""
    front_dispatch.call(
        q, kv_c, k_pe, positions, cos_sin_cache, w_values, w_scales, kv_cache, slot_mapping,
        is_neox=is_neox, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, out=out,
        out_dtype=None, q_scale=q_scale, backend=backend, real=True,
    )  # fmt: skip


@mla_decode_front_op.register_fake
def _mla_decode_front_fake(
    q, kv_c, k_pe, positions, cos_sin_cache, w_values, w_scales, kv_cache, slot_mapping, out,
    k_scale, q_scale, is_neox, kv_cache_dtype, backend,
) -> None:  # fmt: skip
    return None


@torch.library.custom_op("fusedq::staged_decode_front", mutates_args=("out", "kv_cache"))
def staged_decode_front_op(
    q: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    w_values: torch.Tensor,
    w_scales: torch.Tensor | None,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: torch.Tensor,
    k_scale: torch.Tensor | None,
    q_scale: torch.Tensor | None,
    is_neox: bool,
    kv_cache_dtype: str,
) -> None:
    """The staged decode front (RoPE, bmm + cat + quant, the cache write) into ``out`` and
    ``kv_cache``."""
    front_dispatch.call(
        q, kv_c, k_pe, positions, cos_sin_cache, w_values, w_scales, kv_cache, slot_mapping,
        is_neox=is_neox, kv_cache_dtype=kv_cache_dtype, k_scale=k_scale, out=out,
        out_dtype=None, q_scale=q_scale, backend="staged", real=True,
    )  # fmt: skip


@staged_decode_front_op.register_fake
def _staged_decode_front_fake(
    q, kv_c, k_pe, positions, cos_sin_cache, w_values, w_scales, kv_cache, slot_mapping, out,
    k_scale, q_scale, is_neox, kv_cache_dtype,
) -> None:  # fmt: skip
    return None
