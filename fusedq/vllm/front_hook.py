"""The decode front in vLLM (``FUSEDQ_MLA_FRONT=1``): ``fusedq.mla_decode_front`` runs RoPE
of q_pe and k_pe, the absorbed query and the KV-cache write of a step's decode tokens in one
launch, where vLLM runs its rotary embedding, ``torch.bmm`` + concat and the cache write.

This module holds what the patched vLLM methods (``fusedq.vllm.front_patch``, which rewrites
them) call: per layer, whether the front serves it (``plan_front``, from ``setup_front``) and
the lines that say so; per step, the wrapper's call in place of its RoPE
(``front_positions``), the front's step before vLLM's cache write (``decode_front``, or
``front_scope`` around the custom op) and the query it hands to ``forward_impl``'s query hook
(``take_query``).

Served and tested: eager runs. CPU vLLM 0.32 takes the custom-op branch (its platform's
attention op is opaque) under --enforce-eager; a real CPU server runs the front there
(tests/fusedq/test_vllm_plugin.py). The direct-call branch is tested on a stand-in step only.
Not served: torch.compile. Under compilation (vLLM 0.26 on the GPU: piecewise CUDA graphs,
the cache update a splitting op) the front refuses at start-up and the wrapper keeps vLLM's
RoPE; serving it needs the custom op decision 0020 describes, which is not written. The 0.26
transforms are checked against 0.26's source (the wheel's text, tests/fusedq/fixtures) and
compiled, but have never run in a 0.26 server.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading

import torch

from fusedq.vllm import releases
from fusedq.vllm.report import logger

FRONT_ENV = "FUSEDQ_MLA_FRONT"
ENABLED_LINE = "fusedq: MLA decode front enabled"
DISABLED_LINE = "fusedq: MLA decode front disabled"

FRONT_ATTR = "_fusedq_front"  # on an MLAAttention: its FrontPlan, or None
QUERY_ATTR = "_fusedq_front_query"  # on an MLAAttention: this step's decode query
ROTARY_ATTR = "_fusedq_rotary_emb"  # on an MLAAttention: its wrapper's rotary_emb
WRAPPER_ATTR = "_fusedq_wrapper_facts"  # on an MLAAttention: what its wrapper runs

# Rotary embeddings whose forward is the plain cos/sin rotation the front computes (its
# DeepSeek scaling is baked into cos_sin_cache); any other class keeps vLLM's RoPE.
ROTARY_CLASSES = ("RotaryEmbedding", "DeepseekScalingRotaryEmbedding")


def front_mode() -> str:
    """``"1"`` (on) or ``"0"`` (off, the default); ``ValueError`` for anything else."""
    raw = os.environ.get(FRONT_ENV, "0").strip() or "0"
    if raw not in ("0", "1"):
        raise ValueError(f"{FRONT_ENV}={os.environ.get(FRONT_ENV)!r} is not 0 or 1")
    return raw


def disabled_line(reason: str) -> str:
    return f"{DISABLED_LINE}: {reason}"


# --- per layer: the plan ----------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FrontPlan:
    """A layer the front serves: what each call passes besides the step's tensors."""

    rotary: object
    is_neox: bool
    weight: object  # W_UK_T or the query plan's MXFP8Weight
    out_dtype: torch.dtype
    split: bool  # the backend takes the (ql_nope, q_pe) pair of views


def plan_front(layer) -> tuple[FrontPlan | None, str]:
    """Whether the front serves this layer: ``(plan, "")`` or ``(None, why not)``."""
    from fusedq.front import KV_CACHE_DTYPES
    from fusedq.vllm.layer_plan import PLAN_ATTR, _fp8_query

    query_plan = layer.__dict__.get(PLAN_ATTR)
    if query_plan is None:
        return None, "the fused MLA query does not serve this layer"
    if "front" not in releases.installed:
        return None, "MLA wrapper and MLAAttention.forward were not patched for the front"
    if ROTARY_ATTR not in layer.__dict__:
        return None, "not built by a MultiHeadLatentAttentionWrapper (its RoPE is elsewhere)"
    facts = layer.__dict__.get(WRAPPER_ATTR, {})
    if facts.get("is_sparse") or getattr(layer.impl, "is_sparse", False):
        return None, "sparse MLA backend (its indexer and top-k read the rotated q)"
    if facts.get("dcp_q_replicate") or getattr(layer.impl, "dcp_world_size", 1) > 1:
        return None, "decode context parallel (DCP > 1)"
    if getattr(layer, "use_pcp", False):
        return None, "prefill context parallel (the cache write gathers rows)"
    if getattr(layer, "hisparse_cache", None) is not None:
        return None, "hisparse cache (its own write target)"
    if getattr(layer, "calculate_kv_scales", False):
        return None, "kv scales calculated from the rotated q and k_pe"
    config = getattr(layer, "_vllm_config", None)
    compile_mode = getattr(getattr(config, "compilation_config", None), "mode", None)
    if compile_mode is not None and getattr(compile_mode, "name", str(compile_mode)) != "NONE":
        return None, (
            f"torch.compile (compilation mode {getattr(compile_mode, 'name', compile_mode)}): "
            "the front's hooks are not traced yet; it serves eager runs (--enforce-eager)"
        )
    if getattr(config, "speculative_config", None) is not None:
        return None, "speculative decoding (MTP draft and verify steps not validated)"
    if layer.kv_cache_dtype not in KV_CACHE_DTYPES:
        return None, f"kv_cache_dtype {layer.kv_cache_dtype!r}"
    rotary = layer.__dict__[ROTARY_ATTR]
    if rotary is None:
        return None, "no rotary embedding"
    name = type(rotary).__name__
    if name not in ROTARY_CLASSES:
        return None, f"rotary embedding {name} (the front computes {' / '.join(ROTARY_CLASSES)})"
    cache = getattr(rotary, "cos_sin_cache", None)
    if not isinstance(cache, torch.Tensor) or cache.dim() != 2 or cache.shape[-1] != 64:
        return None, "rotary cos_sin_cache is not [max_position, 64]"
    if getattr(rotary, "rotary_dim", None) != 64 or getattr(rotary, "head_size", 64) != 64:
        return None, "partial rotary (rotary_dim != head_size != 64)"
    fp8 = _fp8_query(layer)
    weight = query_plan.mx_weight if query_plan.mx_weight is not None else layer.W_UK_T
    plan = FrontPlan(
        rotary=rotary,
        is_neox=bool(rotary.is_neox_style),
        weight=weight,
        out_dtype=torch.float8_e4m3fn if fp8 else torch.bfloat16,
        split=query_plan.form.split,
    )
    return plan, ""


class FrontReport:
    """The front's lines per process: each distinct refusal once, then the summary of the
    layers served at the first forward (when every layer has been set up)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.layers: dict[str, bool] = {}  # layer name -> served
        self.seen: set[str] = set()
        self.refused: str | None = None  # why the patch was not installed
        self.summary: str | None = None
        self.first_use = False
        self.first_mixed = False

    def clear(self) -> None:
        self.__init__()


front_report = FrontReport()


def setup_front(layer) -> None:
    """After the query plan: decide the front for this layer (never raises)."""
    try:
        if front_mode() == "0":
            return
    except ValueError as exc:
        if exc.args[0] not in front_report.seen:
            front_report.seen.add(exc.args[0])
            logger.warning(disabled_line(str(exc)))
        return
    name = getattr(layer, "layer_name", type(layer).__name__)
    try:
        plan, why = plan_front(layer)
    except Exception as exc:  # never take the server down over the front
        plan, why = None, f"set-up failed: {type(exc).__name__}: {exc}"
    layer.__dict__[FRONT_ATTR] = plan
    with front_report.lock:
        front_report.layers[name] = plan is not None
        fresh = plan is None and why not in front_report.seen
        front_report.seen.add(why)
    if fresh:
        logger.warning("%s for layer %s: %s", DISABLED_LINE, name, why)


def summary_line() -> str:
    served = [n for n, ok in sorted(front_report.layers.items()) if ok]
    if not served:
        return disabled_line("no MLA layer of this process can take it (see the lines above)")
    others = len(front_report.layers) - len(served)
    return f"{ENABLED_LINE} for {len(served)} layers: {', '.join(served)}" + (
        f" ({others} others keep vLLM's RoPE and cache write)" if others else ""
    )


# --- per step: the hooks the patched methods call ---------------------------------------------


def front_positions(wrapper, positions, llama_4_scaling):
    """The patched wrapper's call in place of its RoPE: the positions to hand to the
    attention layer (which then runs RoPE itself), or ``None`` to rotate as vLLM does."""
    if front_report.summary is None and front_report.layers:
        with front_report.lock:
            if front_report.summary is None:
                front_report.summary = summary_line()
                logger.info(front_report.summary)
    attn = getattr(wrapper, "mla_attn", None)
    plan = None if attn is None else attn.__dict__.get(FRONT_ATTR)
    if plan is None or wrapper.rotary_emb is not plan.rotary:
        return None
    from fusedq.vllm.switch import path_switch

    # llama_4_scaling multiplies the rotated q: deferring RoPE past it would change rounding.
    if llama_4_scaling is not None or path_switch.path != "fused" or positions.dim() != 1:
        return None
    if torch.compiler.is_compiling():  # a traced graph keeps vLLM's RoPE (not served yet)
        return None
    return positions


@contextlib.contextmanager
def _swapped_slots(layer, q, kv_c_normed, k_pe, positions):
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.attention.attention import get_attention_context

    name = layer.layer_name
    attn_metadata, _, kv_cache, slots = get_attention_context(name)
    rest = decode_front(layer, q, kv_c_normed, k_pe, positions, kv_cache, slots, attn_metadata)
    if rest is slots:
        yield
        return
    # vLLM's own cache-update op reads the layer's slot mapping from the forward context: for
    # its call, this layer's entry is the one with the front's rows at -1 (the tensor shared
    # by other layers is not touched), and the step's entry is put back after.
    table = get_forward_context().slot_mapping
    table[name] = rest
    try:
        yield
    finally:
        table[name] = slots


def front_scope(layer, q, kv_c_normed, k_pe, positions):
    """The patched ``MLAAttention.forward``'s custom-op branch wraps vLLM's
    ``unified_mla_kv_cache_update`` call in this: with positions handed on, the front (as
    ``decode_front``) runs first and the op writes the other rows only. Eager calls only (CPU
    vLLM 0.32 runs this branch, with --enforce-eager): under torch.compile the wrapper keeps
    vLLM's RoPE and never hands the positions on."""
    if positions is None:
        return contextlib.nullcontext()
    return _swapped_slots(layer, q, kv_c_normed, k_pe, positions)


def _rope_rows(rotary, positions, q, k_pe, start: int) -> None:
    """vLLM's own RoPE of rows ``start:`` of q's rope part and of k_pe, in place."""
    if start >= q.shape[0]:
        return
    nope = q.shape[-1] - k_pe.shape[-1]
    q_pe, k_rot = rotary(positions[start:], q[start:, :, nope:], k_pe[start:])
    q[start:, :, nope:] = q_pe
    k_pe[start:] = k_rot


def decode_front(layer, q, kv_c_normed, k_pe, positions, kv_cache, slot_mapping, attn_metadata):
    """The patched ``MLAAttention.forward``'s call before its cache write (direct-call
    branch): the front for the decode rows, vLLM's RoPE for the rest; returns the slot
    mapping vLLM's cache write then runs with (the decode rows ``-1`` where the front wrote
    them)."""
    plan = layer.__dict__.get(FRONT_ATTR)
    layer.__dict__.pop(QUERY_ATTR, None)
    n = 0 if attn_metadata is None else int(attn_metadata.num_decode_tokens or 0)
    if (
        plan is None or n == 0 or slot_mapping is None or not isinstance(kv_cache, torch.Tensor)
        or kv_cache.numel() == 0
    ):  # fmt: skip
        # Profile run, a prefill-only step, no cache yet: vLLM's RoPE on every row.
        _rope_rows(plan.rotary if plan else layer.__dict__[ROTARY_ATTR], positions, q, k_pe, 0)
        return slot_mapping
    import fusedq

    try:
        query = fusedq.mla_decode_front(
            q[:n], kv_c_normed[:n], k_pe[:n], positions[:n],
            plan.rotary._match_cos_sin_cache_dtype(q)
            if hasattr(plan.rotary, "_match_cos_sin_cache_dtype") else plan.rotary.cos_sin_cache,
            plan.weight, kv_cache, slot_mapping[:n],
            is_neox=plan.is_neox, kv_cache_dtype=layer.kv_cache_dtype, k_scale=layer._k_scale,
            out_dtype=plan.out_dtype,
            q_scale=layer._q_scale if plan.out_dtype == torch.float8_e4m3fn else None,
            backend="auto",
        )  # fmt: skip
    except Exception as exc:
        # Nothing was written (the front checks before it writes): vLLM's path for this step
        # and every later one of this layer.
        layer.__dict__[FRONT_ATTR] = None
        logger.warning(
            "fusedq: MLA decode front failed in layer %s (%s: %s); the layer uses vLLM's RoPE "
            "and cache write from now on",
            layer.layer_name, type(exc).__name__, exc, exc_info=True,
        )  # fmt: skip
        _rope_rows(plan.rotary, positions, q, k_pe, 0)
        return slot_mapping
    layer.__dict__[QUERY_ATTR] = query
    _rope_rows(plan.rotary, positions, q, k_pe, n)
    if not front_report.first_use:
        front_report.first_use = True
        logger.info(
            "fusedq: first MLA decode front (layer %s, M=%d of %d tokens)",
            layer.layer_name, n, q.shape[0],
        )  # fmt: skip
    if n < q.shape[0] and not front_report.first_mixed:
        # Proof in the log that a step split its rows between the front and vLLM.
        front_report.first_mixed = True
        logger.info(
            "fusedq: first MLA decode front beside other rows (layer %s, M=%d of %d tokens)",
            layer.layer_name, n, q.shape[0],
        )  # fmt: skip
    rest = slot_mapping.clone()
    rest[:n] = -1  # vLLM's cache write skips negative slots (its padding)
    return rest


def take_query(layer, m: int):
    """The front's decode query for this step (one tensor, or the pair of views), or
    ``None`` where the front did not run; called by the query hook first."""
    query = layer.__dict__.pop(QUERY_ATTR, None)
    if query is None:
        return None
    if query.shape[0] != m:
        # The decode rows' q_pe was never rotated: vLLM's block must not run on it.
        raise RuntimeError(
            f"fusedq: layer {layer.layer_name}: the decode front ran on {query.shape[0]} "
            f"tokens but forward_impl decodes {m}"
        )
    plan = layer.__dict__.get(FRONT_ATTR)
    if plan is not None and plan.split:
        from fusedq.vllm.query import split_query

        return split_query(query)
    return query
