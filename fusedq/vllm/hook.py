"""The decode-step hook: what the patched ``forward_impl`` calls in place of its query block."""

from __future__ import annotations

import torch

from fusedq.vllm.layer_plan import PLAN_ATTR
from fusedq.vllm.report import logger
from fusedq.vllm.switch import first_use, path_switch


def decode_query_hook(layer, mqa_q_nope, mqa_q_pe, qrep_decode, fp8_attention):
    """Called by the patched forward_impl in place of its query block: the finished query (one
    tensor, or the pair of views into it for a backend that takes only a pair), or ``None``
    to run vLLM's block unchanged."""
    from fusedq.vllm.front_hook import take_query

    # The decode front already wrote this step's query (and left the decode rows' q_pe
    # un-rotated, so vLLM's block must not run): hand it on.
    front = take_query(layer, mqa_q_nope.shape[1])
    if front is not None:
        return front
    plan = layer.__dict__.get(PLAN_ATTR)
    if plan is None or qrep_decode:
        return None
    if path_switch.path != "fused":
        if not first_use.is_set():
            first_use.set()
            # After a switch to staged: proof in the log that the hook now declines.
            logger.info(
                "fusedq: first staged MLA decode query since the switch (layer %s, M=%d): "
                "vLLM's block runs",
                layer.layer_name, mqa_q_nope.shape[1],
            )  # fmt: skip
        return None
    from fusedq.vllm.query import decode_query, split_query

    if fp8_attention and layer.impl.supports_quant_query_input:
        out_dtype, q_scale = torch.float8_e4m3fn, layer._q_scale
    else:
        out_dtype, q_scale = torch.bfloat16, None
    weight = plan.mx_weight if plan.mx_weight is not None else layer.W_UK_T
    try:
        query = decode_query(mqa_q_nope, weight, mqa_q_pe, out_dtype=out_dtype, q_scale=q_scale)
    except Exception as exc:
        if plan.required:
            raise
        # Auto mode never takes the server down: this layer goes back to vLLM's block. The
        # traceback is logged on purpose: a log audit should see that the fused path broke.
        layer.__dict__[PLAN_ATTR] = None
        logger.warning(
            "fusedq: fused MLA query failed in layer %s (%s: %s); the layer uses vLLM's "
            "staged path from now on",
            layer.layer_name, type(exc).__name__, exc, exc_info=True,
        )  # fmt: skip
        return None
    if query is not None and not first_use.is_set():
        first_use.set()
        # Proof in the log that the hot path runs the fused op, not just that it was set up.
        logger.info(
            "fusedq: first fused MLA decode query (layer %s, M=%d, out=%s)",
            layer.layer_name, query.shape[0], str(out_dtype).removeprefix("torch."),
        )  # fmt: skip
    if query is not None and plan.form.split:
        return split_query(query)
    return query
