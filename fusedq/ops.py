"""``torch.library`` custom ops for both paths, with fake twins that only mutate ``out``.

Going through custom ops keeps ``torch.compile(fullgraph=True)`` from tracing into Triton
or the backend choice, and makes the call one opaque node that CUDA graphs capture as is.
The real implementations run eagerly with real tensors through ``dispatch.call``: the plan of
the call's signature (checked once), the address-based overlap check and the launch.
Eager calls of the public API skip the dispatcher and call ``dispatch.call`` directly.
"""

import torch

from fusedq import dispatch

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
