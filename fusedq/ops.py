"""``torch.library`` custom ops for both paths, with fake twins that only mutate ``out``.

Going through custom ops keeps ``torch.compile(fullgraph=True)`` from tracing into Triton
or the backend choice, and makes the call one opaque node that CUDA graphs capture as is.
The real implementations run eagerly with real tensors, so the checks that need addresses
(``out`` overlapping an input) and the backend choice live here.
"""

import torch

from fusedq.capability import explain
from fusedq.kernels import triton_mla_query as kernel
from fusedq.reference import staged_into

BACKENDS = ("auto", "triton", "staged")


def _byte_span(t: torch.Tensor) -> tuple[int, int]:
    start = t.data_ptr()
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride(), strict=True)) + 1
    return start, start + extent * t.element_size()


def check_no_overlap(out: torch.Tensor, inputs: dict[str, torch.Tensor | None]) -> None:
    """Raise ``ValueError`` naming the input whose memory ``out`` overlaps."""
    if out.numel() == 0:
        return
    o_lo, o_hi = _byte_span(out)
    for name, t in inputs.items():
        if t is None or t.numel() == 0 or t.device != out.device:
            continue
        lo, hi = _byte_span(t)
        if lo < o_hi and o_lo < hi:
            raise ValueError(f"out: overlaps the memory of {name}; it must not alias an input")


def _run(
    q_nope: torch.Tensor,
    w_values: torch.Tensor,
    w_scales: torch.Tensor | None,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    q_scale: torch.Tensor | None,
    backend: str,
) -> None:
    check_no_overlap(
        out,
        {"q_nope": q_nope, "q_pe": q_pe, "weight": w_values, "weight scales": w_scales,
         "q_scale": q_scale},
    )  # fmt: skip
    if backend != "staged":
        m, num_heads, _ = q_nope.shape
        why = explain(
            num_heads,
            m,
            weight_format="bf16" if w_scales is None else "mxfp8",
            out_dtype=out.dtype,
            device=q_nope.device,
        )
        if why is None:
            kernel.launch(q_nope, w_values, w_scales, q_pe, out, q_scale)
            return
        if backend == "triton":
            raise ValueError(f"backend='triton' cannot run this call: {why}")
    staged_into(q_nope, w_values, w_scales, q_pe, out, q_scale)


@torch.library.custom_op("fusedq::mla_query_projection", mutates_args=("out",))
def mla_query_projection_op(
    q_nope: torch.Tensor,
    w_values: torch.Tensor,
    w_scales: torch.Tensor | None,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    q_scale: torch.Tensor | None,
    backend: str,
) -> None:
    """Fused (or, per ``backend``, staged) query projection into ``out``."""
    _run(q_nope, w_values, w_scales, q_pe, out, q_scale, backend)


@mla_query_projection_op.register_fake
def _mla_query_projection_fake(q_nope, w_values, w_scales, q_pe, out, q_scale, backend) -> None:
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
    _run(q_nope, w_values, w_scales, q_pe, out, q_scale, "staged")


@staged_mla_query_op.register_fake
def _staged_mla_query_fake(q_nope, w_values, w_scales, q_pe, out, q_scale) -> None:
    return None
