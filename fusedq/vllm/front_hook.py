"""The decode front in vLLM (``FUSEDQ_MLA_FRONT=1``): ``fusedq.mla_decode_front`` runs RoPE
of q_pe and k_pe, the absorbed query and the KV-cache write of the rows a step sends through
the absorbed (MQA) path in one launch, where vLLM runs its rotary embedding, ``torch.bmm`` +
concat and the cache write. Those rows are ``forward_impl``'s, by its own rule
(``absorbed_rows``): the decode tokens, and for a sparse (DSA) layer every actual token of a
step whose prefill rows take the absorbed path too.

This module holds what the patched vLLM methods (``fusedq.vllm.front_patch``, which rewrites
them) call: per layer, whether the front serves it (``plan_front``, from ``setup_front``) and
the lines that say so; per step, the wrapper's call in place of its RoPE
(``front_positions``), the front's step before vLLM's cache write (``decode_front`` in the
direct-call branch, the custom op ``fusedq::vllm_mla_front_update`` in the custom-op branch)
and the query it hands to ``forward_impl``'s query hook (``take_query``).

Under torch.compile the wrapper's RoPE leaves the traced graph and the custom op takes its
place (decision 0020): opaque to the compiler, among vLLM's splitting ops, so it runs eagerly
in piecewise-compiled steps (mixed batches, whose split between decode and prefill rows it
reads from the step's metadata) and is captured whole in the full CUDA graphs of pure decode
steps. The path switch therefore acts inside the op: on ``staged`` (and for an M above the
front's measured range) the op runs vLLM's own path, RoPE + cache write in vLLM's CUDA fusion
``concat_and_cache_mla_rope_fused`` where vLLM has it (its best two-launch front with the
bmm), else RoPE + vLLM's cache write.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import torch

from fusedq.vllm import releases
from fusedq.vllm.report import logger

FRONT_ENV = "FUSEDQ_MLA_FRONT"
ENABLED_LINE = "fusedq: MLA decode front enabled"
DISABLED_LINE = "fusedq: MLA decode front disabled"
RAN_LINE = "fusedq: MLA decode front ran"

FRONT_ATTR = "_fusedq_front"  # on an MLAAttention: its FrontPlan, or None
QUERY_ATTR = "_fusedq_front_query"  # on an MLAAttention: this step's decode query
ROTARY_ATTR = "_fusedq_rotary_emb"  # on an MLAAttention: its wrapper's rotary_emb
WRAPPER_ATTR = "_fusedq_wrapper_facts"  # on an MLAAttention: what its wrapper runs

# Rotary embeddings whose forward is the plain cos/sin rotation the front computes (its
# DeepSeek scaling is baked into cos_sin_cache); any other class keeps vLLM's RoPE.
ROTARY_CLASSES = ("RotaryEmbedding", "DeepseekScalingRotaryEmbedding")

# The custom op the custom-op branch calls in place of vLLM's cache-update op; the plugin adds
# it to vLLM's splitting ops (``front_patch.install``).
FRONT_OP = "fusedq::vllm_mla_front_update"


def front_max_m(num_heads: int, weight_format: str = "bf16") -> int:
    """The largest decode M the front serves; above it the step runs vLLM's RoPE + cache-write
    fusion and the fused query. Measured (``fusedq-bench --front``, H100, 2026-12-06, 61f44ea:
    ``benchmarks/results/raw/h100/2026-12-06-{glm5,deepseek-v3}-front-61f44ea.json``) against
    that alternative (vLLM's fusion + bmm, less the fused query's saving): BF16 wins to M 16 at
    8-64 heads and loses at M 32 everywhere (1.28-1.65x vLLM's fusion + bmm); MXFP8 loses from
    M 16 above 16 heads (and at DeepSeek-V3's 16 heads narrowly) and wins at M 4."""
    if weight_format != "mxfp8":
        return 16
    return 8 if num_heads <= 16 else 4


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
    compiled: bool = False  # vLLM traces the model: its RoPE is Inductor's (fp32, one rounding)
    max_m: int = 16  # front_max_m of the layer's heads and weight format
    # vLLM's CUDA RoPE + cache-write fusion where the staged path runs it (compiled, on CUDA,
    # vLLM's build has it), found once at set-up; None: vLLM's RoPE, then its cache write.
    vllm_rope_cache: object = None


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
    sparse = facts.get("is_sparse") or getattr(layer.impl, "is_sparse", False)
    if sparse and not getattr(releases.installed.get("front"), "sparse_rule", False):
        # A sparse layer's forward_impl may send prefill rows through the absorbed path too
        # (absorbed_rows); the front follows that split only where the guard found the rule.
        return None, (
            "sparse MLA backend: this vLLM's forward_impl does not split absorbed rows by the "
            "rule the front reads"
        )
    # DCP > 1 is served: each rank's slot mapping gives the tokens another rank stores slot
    # -1 (vLLM's _compute_slot_mapping_kernel), for which the front writes nothing, as vLLM's
    # write does not; the query is this rank's heads, all-gathered after the hook by vLLM (0.26:
    # get_dcp_group().all_gather; 0.32: dcp_manager.query_gather), as for the fused query.
    # vLLM 0.32's query replication instead runs its own bmm over every head's q (the query
    # hook declines it), which would then read a q_pe the front left un-rotated.
    if facts.get("dcp_q_replicate"):
        return None, "DCP query replication (vLLM's own bmm over every head's q)"
    if getattr(layer, "use_pcp", False):
        return None, "prefill context parallel (the cache write gathers rows)"
    if getattr(layer, "hisparse_cache", None) is not None:
        return None, "hisparse cache (its own write target)"
    if getattr(layer, "calculate_kv_scales", False):
        return None, "kv scales calculated from the rotated q and k_pe"
    config = getattr(layer, "_vllm_config", None)
    compilation = getattr(config, "compilation_config", None)
    refusal = compile_refusal(compilation)
    if refusal:
        return None, refusal
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
        compiled=_name(getattr(compilation, "mode", None)) not in ("", "NONE"),
        max_m=front_max_m(query_plan.num_heads, query_plan.weight_format),
    )
    if plan.compiled and layer.W_UK_T.is_cuda:
        plan = dataclasses.replace(plan, vllm_rope_cache=_vllm_rope_cache_op())
    return plan, ""


def _name(value) -> str:
    return "" if value is None else str(getattr(value, "name", value))


def compile_refusal(compilation) -> str:
    """Why the front cannot serve under this compilation config, or ``""``. The op reads
    which rows decode from the step's metadata, so no CUDA graph of a mixed batch may
    capture it: piecewise graphs must split at it, and mixed batches must not run as full
    graphs."""
    if compilation is None:
        return ""
    graphs = getattr(compilation, "cudagraph_mode", None)
    mixed = graphs.mixed_mode() if hasattr(graphs, "mixed_mode") else graphs
    if _name(mixed) == "FULL":
        return (
            "full CUDA graphs of mixed batches (cudagraph_mode FULL) would fix the front's "
            "split between decode and prefill rows at capture"
        )
    piecewise = _name(mixed) == "PIECEWISE"
    if (
        piecewise and _name(getattr(compilation, "mode", None)) == "VLLM_COMPILE"
        and FRONT_OP not in (getattr(compilation, "splitting_ops", None) or [])
    ):  # fmt: skip
        return (
            f"piecewise CUDA graphs without {FRONT_OP} among the splitting ops (a "
            "--compilation-config with its own splitting_ops must list it)"
        )
    return ""


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
        self.ran: set[str] = set()  # layers whose front has run
        self.all_ran = False  # every layer served has run it (logged once)
        self.first_vllm = False  # the first step this process ran on vLLM's path

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
    if plan is not None:
        try:
            prewarm_front(layer, plan)
        except Exception as exc:
            plan, why = None, f"prewarm failed: {type(exc).__name__}: {exc}"
    layer.__dict__[FRONT_ATTR] = plan
    with front_report.lock:
        front_report.layers[name] = plan is not None
        fresh = plan is None and why not in front_report.seen
        front_report.seen.add(why)
    if fresh:
        logger.warning("%s for layer %s: %s", DISABLED_LINE, name, why)


def prewarm_front(layer, plan: FrontPlan) -> list[int]:
    """Compile the front for the CUDA-graph sizes it serves (up to ``plan.max_m``) before
    vLLM captures them; returns those sizes (none without CUDA graphs)."""
    from fusedq import prewarm_decode_front
    from fusedq.vllm.layer_plan import capture_sizes

    sizes, _ = capture_sizes(layer)
    ms = sorted({m for m in sizes or [] if m <= plan.max_m})
    if ms:
        q_dtype = layer.W_UK_T.dtype
        prewarm_decode_front(
            plan.weight, ms, is_neox=plan.is_neox, kv_cache_dtype=layer.kv_cache_dtype,
            out_dtype=plan.out_dtype,
            cos_sin_dtype=q_dtype if hasattr(plan.rotary, "_match_cos_sin_cache_dtype")
            else plan.rotary.cos_sin_cache.dtype,
        )  # fmt: skip
    return ms


def _served() -> list[str]:
    """The layers the front serves, by name."""
    return [n for n, ok in sorted(front_report.layers.items()) if ok]


def summary_line() -> str:
    served = _served()
    if not served:
        return disabled_line("no MLA layer of this process can take it (see the lines above)")
    others = len(front_report.layers) - len(served)
    return f"{ENABLED_LINE} for {len(served)} layers: {', '.join(served)}" + (
        f" ({others} others keep vLLM's RoPE and cache write)" if others else ""
    )


# --- per step: the hooks the patched methods call ---------------------------------------------


def _log_summary() -> None:
    """The summary of the layers served, once, at the first step (every layer is set up)."""
    if front_report.summary is None and front_report.layers:
        with front_report.lock:
            if front_report.summary is None:
                front_report.summary = summary_line()
                logger.info(front_report.summary)


def front_positions(wrapper, positions, llama_4_scaling):
    """The patched wrapper's call in place of its RoPE: the positions to hand to the
    attention layer (which then runs RoPE itself, by the front or as vLLM does), or ``None``
    to rotate as vLLM does. Traced by torch.compile: it reads only what set-up fixed."""
    attn = getattr(wrapper, "mla_attn", None)
    plan = None if attn is None else getattr(attn, FRONT_ATTR, None)
    # llama_4_scaling multiplies the rotated q: deferring RoPE past it would change rounding.
    if plan is None or llama_4_scaling is not None or positions.dim() != 1:
        return None
    if not torch.compiler.is_compiling() and wrapper.rotary_emb is not plan.rotary:
        return None  # the rotary embedding was swapped after set-up
    return positions


def _cos_sin(rotary, q: torch.Tensor) -> torch.Tensor:
    """The rotary embedding's cos/sin cache as its forward reads it (cast to q's dtype)."""
    match = getattr(rotary, "_match_cos_sin_cache_dtype", None)
    return match(q) if match is not None else rotary.cos_sin_cache


def _rope_rows(layer, plan, positions, q, k_pe, start: int) -> None:
    """vLLM's RoPE of rows ``start:`` of q's rope part and of k_pe, in place: under
    torch.compile Inductor's numerics (fp32, rounded once: ``front_reference.rope``, as the
    front computes), in eager runs the rotary embedding's own forward."""
    if start >= q.shape[0]:
        return
    nope = q.shape[-1] - k_pe.shape[-1]
    rotary = plan.rotary if plan is not None else layer.__dict__[ROTARY_ATTR]
    if plan is not None and plan.compiled:
        from fusedq import front_reference

        cache = _cos_sin(rotary, q)
        q[start:, :, nope:] = front_reference.rope(q[start:, :, nope:], positions[start:], cache,
                                                   plan.is_neox)  # fmt: skip
        k_pe[start:] = front_reference.rope(k_pe[start:], positions[start:], cache, plan.is_neox)
        return
    q_pe, k_rot = rotary(positions[start:], q[start:, :, nope:], k_pe[start:])
    q[start:, :, nope:] = q_pe
    k_pe[start:] = k_rot


def _vllm_rope_cache_op():
    """vLLM's CUDA RoPE + cache-write fusion (``concat_and_cache_mla_rope_fused``), or None."""
    try:
        from vllm import _custom_ops

        torch.ops._C_cache_ops.concat_and_cache_mla_rope_fused  # noqa: B018 (raises if absent)
    except Exception:
        return None
    return _custom_ops.concat_and_cache_mla_rope_fused


def _vllm_rows(layer, plan, q, kv_c_normed, k_pe, positions, kv_cache, slot_mapping) -> int:
    """vLLM's path for every row of the step: its RoPE + cache-write fusion where the plan
    found it (it writes every row: returns M), else its RoPE in place (returns 0: vLLM's
    cache write follows)."""
    op = plan.vllm_rope_cache
    if not front_report.first_vllm:
        # Which of vLLM's paths a staged step runs: what a switch's baseline measured.
        front_report.first_vllm = True
        logger.info(
            "fusedq: MLA decode front: vLLM's path in layer %s (M=%d): %s",
            layer.layer_name, q.shape[0],
            "RoPE + cache write in vLLM's concat_and_cache_mla_rope_fused, then its query block"
            if op is not None else "vLLM's RoPE, its cache write, then its query block",
        )  # fmt: skip
    if op is None:
        _rope_rows(layer, plan, positions, q, k_pe, 0)
        return 0
    nope = q.shape[-1] - k_pe.shape[-1]
    op(
        positions, q[..., nope:], k_pe.squeeze(1), kv_c_normed,
        _cos_sin(plan.rotary, q), plan.is_neox, slot_mapping, kv_cache,
        layer.kv_cache_dtype, layer._k_scale,
    )  # fmt: skip
    return q.shape[0]


def absorbed_rows(layer, attn_metadata) -> int:
    """How many leading rows of this step ``MLAAttention.forward_impl`` sends through the
    absorbed (MQA) path, by its own rule (``front_patch.SPARSE_MQA_RULE`` and
    ``SPARSE_MQA_RULE_CALL``, which the guard finds in its source): the decode tokens; for a
    sparse layer with prefill rows, every actual token unless its prefill takes the MHA path.
    The front's query must have exactly these rows: the query hook hands it on for them."""
    n = int(attn_metadata.num_decode_tokens or 0)
    if not getattr(layer.impl, "is_sparse", False):  # forward_impl reads self.impl.is_sparse
        return n
    total = int(attn_metadata.num_actual_tokens)  # forward_impl's q.size(0): q[:num_actual]
    if total - n <= 0:
        return n
    decide = getattr(layer, "_use_sparse_mha", None)
    if decide is not None:
        # vLLM 0.32 asks the layer (a subclass may override it): the same call, same answer.
        use_mha = decide(attn_metadata)
    else:
        # vLLM 0.26 decides inline, in this order.
        use_mha = (
            layer.prefill_backend is not None
            and attn_metadata.prefill_max_seq_len <= attn_metadata.topk_tokens
            and not layer._vllm_config.attention_config.sparse_mla_force_mqa
        )
    return n if use_mha else total


def front_rows(layer, q, kv_c_normed, k_pe, positions, kv_cache, slot_mapping, attn_metadata):
    """One step of a layer whose wrapper handed its positions on: the front for the rows
    ``forward_impl`` absorbs (``absorbed_rows``: the decode rows, or every actual row of a
    sparse layer whose prefill takes the absorbed path too), vLLM's RoPE for the rest, q's rope
    part and k_pe rotated in place for those rows. Returns how many leading rows' cache
    entries are written (vLLM's cache write does the rest)."""
    _log_summary()
    plan = layer.__dict__.get(FRONT_ATTR)
    layer.__dict__.pop(QUERY_ATTR, None)
    # The query hook's M is forward_impl's MQA rows (take_query raises on any other count),
    # so the front takes exactly those, not simply num_decode_tokens.
    n = 0 if attn_metadata is None or plan is None else absorbed_rows(layer, attn_metadata)
    if (
        plan is None or n == 0 or slot_mapping is None or not isinstance(kv_cache, torch.Tensor)
        or kv_cache.numel() == 0
    ):  # fmt: skip
        # Profile run, no absorbed rows (a dense prefill-only step), no cache yet: vLLM's RoPE
        # on every row.
        _rope_rows(layer, plan, positions, q, k_pe, 0)
        return 0
    from fusedq.vllm.switch import path_switch

    if path_switch.path != "fused" or n > plan.max_m:
        return _vllm_rows(layer, plan, q, kv_c_normed, k_pe, positions, kv_cache, slot_mapping)
    import fusedq

    try:
        query = fusedq.mla_decode_front(
            q[:n], kv_c_normed[:n], k_pe[:n], positions[:n],
            _cos_sin(plan.rotary, q), plan.weight, kv_cache, slot_mapping[:n],
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
        _rope_rows(layer, plan, positions, q, k_pe, 0)
        return 0
    layer.__dict__[QUERY_ATTR] = query
    _rope_rows(layer, plan, positions, q, k_pe, n)
    if not front_report.first_use:
        front_report.first_use = True
        # What it wrote, so that a run's log shows an FP8 server's E4M3 query and cache.
        logger.info(
            "fusedq: first MLA decode front (layer %s, M=%d of %d tokens, query=%s, cache=%s)",
            layer.layer_name, n, q.shape[0], str(plan.out_dtype).removeprefix("torch."),
            layer.kv_cache_dtype,
        )  # fmt: skip
    if not front_report.all_ran:
        _note_ran(layer.layer_name)
    if n < q.shape[0] and not front_report.first_mixed:
        # Proof in the log that a step split its rows between the front and vLLM.
        front_report.first_mixed = True
        logger.info(
            "fusedq: first MLA decode front beside other rows (layer %s, M=%d of %d tokens)",
            layer.layer_name, n, q.shape[0],
        )  # fmt: skip
    return n


def _note_ran(name: str) -> None:
    """Record that the front ran in this layer; once it has run in every layer it serves (a
    speculative decoding server's draft layers too, which run in the drafter's own steps),
    say so, once per process."""
    if name in front_report.ran:
        return  # the common case until every layer has run: no lock, no sort
    with front_report.lock:
        front_report.ran.add(name)
        served = _served()
        if front_report.all_ran or not served or not set(served) <= front_report.ran:
            return
        front_report.all_ran = True
    logger.info("%s in every layer it serves (%d): %s", RAN_LINE, len(served), ", ".join(served))


def decode_front(layer, q, kv_c_normed, k_pe, positions, kv_cache, slot_mapping, attn_metadata):
    """The patched ``MLAAttention.forward``'s call before its cache write (direct-call
    branch): ``front_rows``, then the slot mapping vLLM's cache write runs with (the rows
    already written at ``-1``: vLLM's write skips negative slots)."""
    done = front_rows(layer, q, kv_c_normed, k_pe, positions, kv_cache, slot_mapping,
                      attn_metadata)  # fmt: skip
    if done == 0:
        return slot_mapping
    rest = slot_mapping.clone()
    rest[:done] = -1
    return rest


def front_update(q, kv_c_normed, k_pe, positions, layer_name: str) -> torch.Tensor:
    """The custom-op branch's step in place of vLLM's ``unified_mla_kv_cache_update``:
    ``front_rows``, then vLLM's cache write of the rows left; returns that op's dummy (the
    attention op's ordering dependency)."""
    from vllm.model_executor.layers.attention.attention import get_attention_context

    attn_metadata, layer, kv_cache, slots = get_attention_context(layer_name)
    done = front_rows(layer, q, kv_c_normed, k_pe, positions, kv_cache, slots, attn_metadata)
    if slots is not None and done < q.shape[0]:
        layer.impl.do_kv_cache_update(
            kv_c_normed[done:], k_pe[done:], kv_cache, slots[done:], layer.kv_cache_dtype,
            layer._k_scale,
        )  # fmt: skip
    return torch.empty(0, device=kv_c_normed.device, dtype=kv_c_normed.dtype)


@torch.library.custom_op(FRONT_OP, mutates_args=("q", "k_pe"))
def front_update_op(
    q: torch.Tensor,
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    layer_name: str,
) -> torch.Tensor:
    """``front_update`` as one node torch.compile does not trace into (the KV cache it
    writes is the layer's, found by name, as in vLLM's own cache-update op)."""
    return front_update(q, kv_c_normed, k_pe, positions, layer_name)


@front_update_op.register_fake
def _front_update_fake(q, kv_c_normed, k_pe, positions, layer_name):
    return torch.empty(0, device=kv_c_normed.device, dtype=kv_c_normed.dtype)


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
