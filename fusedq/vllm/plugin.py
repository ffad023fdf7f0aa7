"""vLLM general plugin: run ``fusedq``'s fused query projection in MLA decode.

vLLM calls ``register()`` (entry point ``vllm.general_plugins: fusedq``) in every process it
starts. ``FUSEDQ_MLA_QUERY`` picks the mode:

- unset / ``auto``: use the fused op where it qualifies, vLLM's staged path elsewhere;
- ``0``: return at once — plain vLLM, nothing patched, nothing logged;
- ``1``: require it — a vLLM this plugin cannot patch, or an MLA layer that cannot use the
  fused op, is a startup error naming the reason.

``FUSEDQ_BACKEND`` picks what the decode step's calls may bind: ``triton`` (default) or
``auto`` (``fusedq.kernel_choice``'s pick, the CuTe DSL kernel included).

How it hooks (see docs/vllm-plugin.md): ``MLAAttention.forward_impl`` is recompiled from its
own source with one change — the query-side block (the ROCm-aiter / AMX / padded-heads /
plain ``torch.bmm`` branches, then the concat or ``_decode_concat_quant_fp8_op``) is nested
under ``if mqa_q is None:`` after a call to ``_fusedq_decode_query``, which returns the
finished ``[B, N, 576]`` query or ``None``. ``None`` runs vLLM's block as shipped.
``process_weights_after_loading`` is wrapped to decide per layer, prewarm the CUDA-graph
sizes and log one line per worker process; ``__init__`` is wrapped to snapshot an MXFP8
``kv_b_proj``'s W_UK before vLLM's MXFP8 linear kernel re-lays it out.

The version guard (``fusedq.vllm.patch``) refuses to patch unless the vLLM version falls in
one row of ``releases.RELEASES`` (0.26.x; 0.32.x-0.33.x) and the block's text hashes to a
value that row knows; it then logs ``fusedq: fused MLA query disabled: <reason>`` and leaves
vLLM untouched. Per layer, ``fusedq.vllm.layer_plan`` decides from the attention backend the
layer got (``backends.ATTENTION_BACKENDS``); ``fusedq.vllm.switch.set_path`` switches the
process between the fused and the staged path, and ``fusedq.vllm.worker_ext`` calls it on
every worker of a running server.
"""

from __future__ import annotations

from fusedq.vllm import front_hook, front_patch, releases
from fusedq.vllm.patch import apply, check_vllm
from fusedq.vllm.releases import MLA_MODULE
from fusedq.vllm.report import (
    MODE_ENV,
    FusedqRequiredError,
    disabled_line,
    hook_backend,
    logger,
    mode,
    worker_report,
)


def _front_not_served(reason: str) -> None:
    """Where FUSEDQ_MLA_FRONT=1 asks for the front but the query plugin is not active: say
    why, once per process (the front is off)."""
    try:
        wanted = front_hook.front_mode() == "1"
    except ValueError as exc:
        logger.warning(front_hook.disabled_line(str(exc)))
        return
    if wanted:
        logger.warning(front_hook.disabled_line(reason))


def register() -> None:
    """vLLM's general-plugin entry point (runs in every vLLM process)."""
    try:
        current = mode()
    except ValueError as exc:
        logger.warning(disabled_line(str(exc)))
        return
    if current == "0":
        _front_not_served(f"{MODE_ENV}=0 (the front hands its query to the query plugin)")
        return
    try:
        backend = hook_backend()
    except ValueError as exc:
        if current == "1":
            raise FusedqRequiredError(f"{MODE_ENV}=1 but {exc}") from exc
        logger.warning(disabled_line(str(exc)))
        return
    if releases.installed:
        return  # vLLM may load plugins more than once per process
    try:
        patch = check_vllm()
    except Exception as exc:
        reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        worker_report.refused = reason
        if current == "1":
            raise FusedqRequiredError(f"{MODE_ENV}=1 but vLLM cannot be patched: {reason}") from exc
        logger.warning(disabled_line(reason))
        _front_not_served(f"the fused MLA query is not patched in: {reason}")
        return
    apply(patch)
    front_patch.install(patch.release)
    from fusedq.vllm import query

    query.BACKEND = backend
    logger.debug("fusedq: patched %s.MLAAttention (forward_impl, weight processing)", MLA_MODULE)
