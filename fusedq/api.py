"""The public entry points: eager calls through the per-signature plans, traced calls
through the custom ops, and ``prewarm``.

Eager (no ``torch.compile`` tracing): ``dispatch.call`` checks a call's signature once and
then runs its cached plan, without the custom-op dispatcher. While ``torch.compile`` traces,
the same checks run on fake tensors (metadata only) and the call becomes one custom-op node
(``ops``). A bad argument raises ``ValueError`` naming it before anything is written.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from fusedq import dispatch, ops  # noqa: F401 (ops registers the custom ops used below)
from fusedq.kernels import triton_launch
from fusedq.mxfp8 import MXFP8Weight
from fusedq.selection import select

Weight = torch.Tensor | MXFP8Weight


def mla_query_projection(
    q_nope: torch.Tensor,
    weight: Weight,
    q_pe: torch.Tensor,
    *,
    out: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
    q_scale: torch.Tensor | None = None,
    backend: str = "auto",
    pdl: bool | None = None,
) -> torch.Tensor:
    """The MLA decode query: ``[q_nope @ W_UK_T | q_pe]`` in one launch.

    Parameters
    ----------
    q_nope : bf16 ``[M, H, qk_nope]``, any strides with a unit last stride (e.g.
        ``q[..., :qk_nope]``). Its last dim names the MLA geometry (``fusedq.contract``):
        192 GLM-5, 128 DeepSeek-V3/R1/V3.2, Kimi-K2, Mistral Large 3; another is refused.
    weight : bf16 ``[H, qk_nope, 512]`` with any strides (vLLM's ``W_UK_T`` view, heads
        ``qk_nope + v_head`` rows of ``kv_b_proj`` apart), or an ``MXFP8Weight``.
    q_pe : bf16 ``[M, H, 64]``, any strides with a unit last stride (e.g. ``q[..., qk_nope:]``).
    out : optional ``[M, H, 576]`` of the output dtype with a unit last stride; rows and
        heads may be pitched. Written and returned; allocated when ``None``.
    out_dtype : ``torch.bfloat16``, or ``torch.float8_e4m3fn`` to write
        ``clamp(bf16(q_nope @ W) * (1 / q_scale), ±448)`` and ``clamp(q_pe * (1 / q_scale),
        ±448)``, as vLLM's static FP8 quant (one rounded reciprocal, then a multiply).
        ``None`` (the default) takes ``out.dtype`` when ``out`` is given, else BF16; given
        together with ``out``, the two must agree.
    q_scale : one-element fp32 tensor; required for E4M3 output, rejected for bf16.
    backend : ``"auto"`` (fused where ``can_implement``, i.e. at the geometry's qualified H and
        M, else staged; the fused kernel as ``fusedq.kernel_choice`` picks it: the CuTe DSL
        kernel for GLM-5 at the small M where it measured faster, where nvidia-cutlass-dsl is
        installed, else Triton), ``"triton"`` (the Triton kernels at any H in 1..128 and M in
        1..512, qualified or not), ``"cute"`` (that kernel where qualified; either raises
        ``ValueError`` with the reason where it cannot run), ``"staged"`` (the reference
        path).
    pdl : launch the fused kernel with programmatic dependent launch; ``None`` takes the
        process default (``FUSEDQ_PDL=1``, read once at import).

    Returns
    -------
    ``out``, ``[M, H, 576]`` of the output dtype.

    The first call with a signature (every tensor's type, dtype, shape, strides and device,
    and ``out_dtype``, ``backend``, ``pdl``) is checked in full and its plan cached; later
    calls with that signature only check that ``out`` overlaps no input.
    """
    if torch.compiler.is_compiling():
        values, scales, out, pdl = dispatch.prepare_traced(
            q_nope, weight, q_pe, out, out_dtype, q_scale, backend, pdl
        )
        torch.ops.fusedq.mla_query_projection(
            q_nope, values, scales, q_pe, out, q_scale, backend, pdl
        )
        return out
    values, scales = dispatch.split_weight(weight)
    return dispatch.call(q_nope, values, scales, q_pe, out, out_dtype, q_scale, backend, pdl)


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
    if torch.compiler.is_compiling():
        values, scales, out, _ = dispatch.prepare_traced(
            q_nope, weight, q_pe, out, out_dtype, q_scale, "staged", None
        )
        torch.ops.fusedq.staged_mla_query(q_nope, values, scales, q_pe, out, q_scale)
        return out
    values, scales = dispatch.split_weight(weight)
    return dispatch.call(q_nope, values, scales, q_pe, out, out_dtype, q_scale, "staged", None)


def prewarm(
    weight: Weight,
    m_values: Iterable[int],
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    pdl: bool | None = None,
    backend: str = "auto",
) -> int:
    """Compile every kernel variant that calls with these M values (and this weight, and
    ``pdl`` and ``backend`` as the calls pass them) need.

    Run it before capturing CUDA graphs: a fused call whose variant is not compiled raises
    under capture instead of compiling. M values the fused kernel does not serve (they fall
    back to the staged path) need nothing. ``backend="triton"`` calls never bind the CuTe
    kernel, so its variants are not compiled for them. Returns how many variants were
    compiled now.
    """
    if backend not in ("auto", "triton"):
        raise ValueError(f"backend={backend!r}: prewarm takes 'auto' or 'triton'")
    values, scales = dispatch.split_weight(weight)
    geometry = dispatch.check_weight(values, scales)
    weight_format = "bf16" if scales is None else "mxfp8"
    compiled = 0
    resolved_pdl = triton_launch.DEFAULT_PDL if pdl is None else pdl
    for m in sorted({int(m) for m in m_values}):
        # What the calls' plans will bind (dispatch asks the same selection).
        chosen = select(
            values.shape[0], m, geometry=geometry, weight_format=weight_format,
            out_dtype=out_dtype, device=values.device, pdl=resolved_pdl,
        )  # fmt: skip
        if chosen.path == "staged":
            continue
        compiled += triton_launch.prewarm(values, scales, m, out_dtype, chosen.config)
        if (
            chosen.path == "cute" and backend == "auto"
        ):  # the Triton variants stay compiled: the eager/misaligned fallback
            from fusedq.kernels import cute_mla_query

            compiled += cute_mla_query.prewarm(
                values.shape[0], m, values.device,
                out_fp8=out_dtype == torch.float8_e4m3fn, bf16_weights=scales is None,
            )  # fmt: skip
    return compiled
