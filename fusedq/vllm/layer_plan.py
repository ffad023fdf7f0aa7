"""Per layer: decide whether the fused op serves it, prewarm its CUDA-graph sizes, report."""

from __future__ import annotations

import dataclasses
import weakref

import torch

from fusedq.contract import DECODE_M_BUCKETS, GEOMETRIES, GLM5, MX_BLOCK, Geometry, geometry_of
from fusedq.vllm import releases
from fusedq.vllm.backends import QUERY_FORMS, QueryForm, query_form
from fusedq.vllm.releases import Release
from fusedq.vllm.report import (
    MODE_ENV,
    FusedqRequiredError,
    disabled_line,
    enabled_line,
    logger,
    mode,
    worker_report,
)

# MLAAttention attributes the plan and the hook read (instance attributes: checked per layer).
LAYER_ATTRS = (
    "is_aiter_triton_fp4_bmm_enabled",
    "is_aiter_triton_fp8_bmm_enabled",
    "q_pad_num_heads",
    "num_heads",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "kv_cache_dtype",
    "kv_b_proj",
    "impl",
    "layer_name",
    "_q_scale",
)

# (qk_nope, qk_rope, kv_lora) of the geometries the fused op serves (fusedq.contract: GLM-5's
# and DeepSeek-V3's); whether a layer of one takes the fused path is the selection's to say.
SERVED_GEOMETRIES = tuple((g.qk_nope, g.qk_rope, g.kv_lora) for g in GEOMETRIES)

PLAN_ATTR = "_fusedq_plan"
SNAPSHOT_ATTR = "_fusedq_mxfp8_w_uk"
E8M0_DTYPES = tuple({torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)})

# layer name -> layer, every layer setup_layer saw (weak: a model freed is gone).
set_up_layers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """A layer the fused op serves. ``mx_weight`` replaces ``W_UK_T`` when set."""

    num_heads: int
    weight_format: str
    mx_weight: object | None
    required: bool = False  # FUSEDQ_MLA_QUERY=1: a failing fused call raises
    form: QueryForm = QUERY_FORMS["tensor"]  # how the layer's backend takes the query
    geometry: Geometry = GLM5  # the layer's MLA geometry (one of GEOMETRIES)


def _fp8_query(layer) -> bool:
    """Whether vLLM quantises this layer's decode query (FP8 attention + a backend that
    takes an FP8 query) — the same test forward_impl makes."""
    from vllm.model_executor.layers.attention import mla_attention

    return bool(
        mla_attention.is_quantized_kv_cache(layer.kv_cache_dtype)
        and getattr(layer.impl, "supports_quant_query_input", False)
    )


def _mxfp8_parts(kv_b_proj) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(weight, weight_scale) when kv_b_proj holds E4M3 values with E8M0 scales."""
    weight = getattr(kv_b_proj, "weight", None)
    scale = getattr(kv_b_proj, "weight_scale", None)
    if not isinstance(weight, torch.Tensor) or weight.dtype != torch.float8_e4m3fn:
        return None
    if not isinstance(scale, torch.Tensor) or scale.dtype not in E8M0_DTYPES:
        return None  # block-FP8 (fp32 scales) or unquantised: not MXFP8
    return weight.data, scale.data


def watch_kv_b_proj(layer) -> None:
    """For an MXFP8 kv_b_proj: copy its W_UK part before vLLM's MXFP8 linear kernel
    post-processes it (swizzled scales, transposed or repacked values, bf16 at load).

    vLLM runs every quant method's ``process_weights_after_loading`` before any attention
    layer's, so by the time the plan is made the checkpoint layout is gone; this wraps the
    kv_b_proj's quant-method instance to take the copy just before. The copy is the
    ``[H, 192, 512]`` E4M3 values and ``[H, 192, 16]`` scales (~0.5 of the bf16 W_UK_T).
    """
    kv_b_proj = getattr(layer, "kv_b_proj", None)
    quant_method = getattr(kv_b_proj, "quant_method", None)
    if quant_method is None or _mxfp8_parts(kv_b_proj) is None:
        return
    dims = {
        "num_heads": layer.num_heads,
        "qk_nope_head_dim": layer.qk_nope_head_dim,
        "v_head_dim": layer.v_head_dim,
        "kv_lora_rank": layer.kv_lora_rank,
    }
    target = weakref.ref(kv_b_proj)
    original = quant_method.process_weights_after_loading

    def process_weights_after_loading(module, *args, **kwargs):
        if module is target():
            snapshot_mxfp8_w_uk(module, **dims)
        return original(module, *args, **kwargs)

    quant_method.process_weights_after_loading = process_weights_after_loading


def snapshot_mxfp8_w_uk(kv_b_proj, **dims) -> None:
    """Store a copy of the checkpoint-layout MXFP8 W_UK_T on kv_b_proj (if it has one)."""
    from fusedq.mxfp8 import MXFP8Weight
    from fusedq.vllm.query import mxfp8_w_uk_t

    parts = _mxfp8_parts(kv_b_proj)
    if parts is None:
        return
    try:
        view = mxfp8_w_uk_t(*parts, **dims)
    except ValueError as exc:
        logger.debug("fusedq: no MXFP8 W_UK snapshot: %s", exc)
        return
    kv_b_proj.__dict__[SNAPSHOT_ATTR] = MXFP8Weight(
        view.values.contiguous(), view.scales.contiguous()
    )


def _native_mxfp8(layer):
    """The layer's W_UK_T as an MXFP8Weight when kv_b_proj is MXFP8: the snapshot taken
    before vLLM's kernel post-processed it, else the current tensors if still in checkpoint
    layout; ``(None, note)`` when it is MXFP8 but in neither."""
    from fusedq.vllm.query import mxfp8_w_uk_t

    kv_b_proj = layer.kv_b_proj
    snapshot = kv_b_proj.__dict__.get(SNAPSHOT_ATTR)
    if snapshot is not None:
        return snapshot, None
    parts = _mxfp8_parts(kv_b_proj)
    if parts is None:
        return None, None
    weight, scale = parts
    try:
        return (
            mxfp8_w_uk_t(
                weight.data,
                scale.data,
                num_heads=layer.num_heads,
                qk_nope_head_dim=layer.qk_nope_head_dim,
                v_head_dim=layer.v_head_dim,
                kv_lora_rank=layer.kv_lora_rank,
            ),
            None,
        )
    except ValueError as exc:
        return None, f"MXFP8 kv_b_proj kept in its GEMM kernel's layout ({exc}); using bf16 W_UK"


def _is_mxfp8_method(kv_b_proj) -> bool:
    """Whether kv_b_proj's quant method is an MXFP8 one (vLLM's online ``--quantization=mxfp8``
    method, or a checkpoint MXFP8 method), by its class name: vLLM's names say the format."""
    method = getattr(kv_b_proj, "quant_method", None)
    return method is not None and "mxfp8" in type(method).__name__.lower()


def _rederived_mxfp8(w_uk_t: torch.Tensor):
    """vLLM's bf16 ``W_UK_T`` as the MXFP8 weight it was dequantised from: ``(weight, None)``,
    or ``(None, why not)``.

    An MXFP8 kv_b_proj's GEMM kernel keeps its own layout (Marlin repacks), and vLLM builds
    ``W_UK_T`` by dequantising it (exact: E4M3 times a power of two fits bf16). Quantising that
    bf16 back with N-blocked scales gives the values vLLM quantised, and the bit-for-bit check
    of its dequantisation against ``W_UK_T`` proves it: the fused MXFP8 product then equals the
    bf16 one. Any block that is not exact (the weight was not MXFP8) keeps the bf16 path.
    """
    from fusedq.mxfp8 import dequantize_mxfp8, quantize_mxfp8

    try:
        weight = quantize_mxfp8(w_uk_t)
    except ValueError as exc:
        return None, f"vLLM's bf16 W_UK_T cannot be re-quantised ({exc})"
    back = dequantize_mxfp8(weight)
    same = back.view(torch.int16) == w_uk_t.view(torch.int16)
    exact = same.reshape(*same.shape[:-1], -1, MX_BLOCK).all(dim=-1)  # one per scale block
    inexact = int((~exact).sum())
    if inexact:
        total = exact.numel()
        return None, (
            f"vLLM's bf16 W_UK_T is not MXFP8-exact in {inexact} of {total} 32-wide blocks"
        )
    return weight, None


def plan_layer(layer) -> tuple[LayerPlan | None, str]:
    """Whether the fused op serves this layer: ``(plan, note)`` or ``(None, reason)``."""
    import fusedq

    release = releases.installed.get("release")
    attrs = LAYER_ATTRS + (release.layer_attrs if isinstance(release, Release) else ())
    missing = [a for a in attrs if not hasattr(layer, a)]
    if missing:
        return None, f"{type(layer).__name__} lacks the attributes {missing} the hook reads"
    if getattr(layer, "is_amx_bmm_enabled", False):
        return None, "AMX BMM decode path (its own packed W_UK)"
    if getattr(layer, "is_aiter_triton_fp4_bmm_enabled", False) or getattr(
        layer, "is_aiter_triton_fp8_bmm_enabled", False
    ):
        return None, "ROCm aiter BMM decode path"
    if getattr(layer, "q_pad_num_heads", None) is not None:
        return None, f"backend pads query heads (q_pad_num_heads={layer.q_pad_num_heads})"
    installed = releases.installed.get("forward_impl")
    if getattr(type(layer), "forward_impl", installed) is not installed:
        return None, f"{type(layer).__name__} overrides forward_impl (the hook is not in it)"
    if not isinstance(release, Release):
        return None, "fusedq did not patch MLAAttention in this process"
    dims = (layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.kv_lora_rank)
    if dims not in SERVED_GEOMETRIES:
        served = " or ".join(map(str, SERVED_GEOMETRIES))
        return None, f"(qk_nope, qk_rope, kv_lora)={dims}, fused op needs {served}"
    geometry = geometry_of(*dims)
    w_uk_t = getattr(layer, "W_UK_T", None)
    if not isinstance(w_uk_t, torch.Tensor):
        return None, "layer has no W_UK_T"
    if w_uk_t.dtype != torch.bfloat16:
        return None, f"W_UK_T dtype {w_uk_t.dtype} (fused op takes bf16 or MXFP8)"
    out_dtype = torch.float8_e4m3fn if _fp8_query(layer) else torch.bfloat16
    form, why = query_form(layer, release, fp8_query=out_dtype == torch.float8_e4m3fn)
    if form is None:
        return None, why
    if out_dtype == torch.float8_e4m3fn:
        from vllm.platforms import current_platform

        if current_platform.fp8_dtype() != torch.float8_e4m3fn:
            return None, f"FP8 query dtype {current_platform.fp8_dtype()} is not e4m3fn"
    mx_weight, note = _native_mxfp8(layer)
    if mx_weight is None and _is_mxfp8_method(layer.kv_b_proj):
        # No checkpoint-layout snapshot (online MXFP8 quantises inside vLLM's own method, and
        # its kernel then repacks): re-derive the MXFP8 weight from vLLM's W_UK_T, checked.
        mx_weight, why_not = _rederived_mxfp8(w_uk_t)
        if mx_weight is None:
            kept = (note or "").removesuffix("; using bf16 W_UK")
            note = f"{kept + ', and ' if kept else ''}{why_not}; using bf16 W_UK"
        else:
            note = "MXFP8 W_UK re-derived from vLLM's dequantised W_UK_T (bit-exact)"
    fmt = "bf16" if mx_weight is None else "mxfp8"
    why = fusedq.explain(
        layer.num_heads, 1, geometry=geometry, weight_format=fmt, out_dtype=out_dtype,
        device=w_uk_t.device,
    )  # fmt: skip
    if why is not None and mx_weight is not None:
        # No MXFP8 recipe here (e.g. sm_80): the bf16 W_UK vLLM built may still qualify.
        note = f"MXFP8 recipe unavailable ({why}); using bf16 W_UK"
        mx_weight, fmt = None, "bf16"
        why = fusedq.explain(
            layer.num_heads, 1, geometry=geometry, weight_format=fmt, out_dtype=out_dtype,
            device=w_uk_t.device,
        )  # fmt: skip
    if why is not None:
        return None, why
    plan = LayerPlan(layer.num_heads, fmt, mx_weight, form=form, geometry=geometry)
    return plan, note or ""


def capture_sizes(layer) -> tuple[list[int] | None, str]:
    """The M values CUDA graphs will capture, or ``(None, why there are none)``."""
    config = getattr(layer, "_vllm_config", None)
    comp = getattr(config, "compilation_config", None)
    w_uk_t = layer.W_UK_T
    if w_uk_t.device.type != "cuda":
        return None, f"no CUDA graphs on {w_uk_t.device.type}"
    if getattr(getattr(config, "model_config", None), "enforce_eager", False):
        return None, "no CUDA graphs: enforce-eager"
    graph_mode = getattr(comp, "cudagraph_mode", None)
    if graph_mode is not None and getattr(graph_mode, "name", "") == "NONE":
        return None, "no CUDA graphs: cudagraph_mode NONE"
    return list(getattr(comp, "cudagraph_capture_sizes", None) or []), ""


def prewarm_layer(layer, plan: LayerPlan) -> tuple[str, list[int]]:
    """Prewarm the graph sizes' M values; returns (what the enabled line says, those M)."""
    from fusedq.vllm.query import prewarm, prewarm_values

    sizes, why = capture_sizes(layer)
    if sizes is None:
        return f"none [{why}]", []
    weight = plan.mx_weight if plan.mx_weight is not None else layer.W_UK_T
    out_dtype = torch.float8_e4m3fn if _fp8_query(layer) else torch.bfloat16
    ms = prewarm_values(
        sizes, plan.num_heads, plan.weight_format, out_dtype, layer.W_UK_T.device, plan.geometry
    )
    prewarm(weight, ms, out_dtype=out_dtype)
    if not ms:
        return f"none [no capture size in the fused range; sizes {sizes[:4]}…]", []
    return ",".join(map(str, ms)), list(ms)


# The M values a kernels line describes where nothing was prewarmed (no CUDA graphs).
DECODE_MS = DECODE_M_BUCKETS


def _log_kernels(layer, plan: LayerPlan, prewarmed_ms: list[int], pdl: bool) -> None:
    """Beside the enabled line, once per process: which kernel each M runs
    (``query.kernel_summary``: the hook's backend), so a server log says what a measurement
    ran. Never fails the start-up: the decision is made, this only describes it."""
    from fusedq.vllm import query

    try:
        ms = prewarmed_ms or list(DECODE_MS)
        out_dtype = torch.float8_e4m3fn if _fp8_query(layer) else torch.bfloat16
        text = query.kernel_summary(
            plan.num_heads, ms, weight_format=plan.weight_format, out_dtype=out_dtype,
            device=layer.W_UK_T.device, pdl=pdl, geometry=plan.geometry,
        )  # fmt: skip
    except Exception as exc:
        text = f"unknown ({type(exc).__name__}: {exc})"
    worker_report.kernels = text
    logger.info(
        "fusedq: kernels (heads=%d, format=%s): %s", plan.num_heads, plan.weight_format, text
    )


def setup_layer(layer) -> None:
    """After vLLM processed the layer's weights: plan, prewarm, report (auto mode never
    raises; ``FUSEDQ_MLA_QUERY=1`` raises ``FusedqRequiredError`` with the reason)."""
    name = getattr(layer, "layer_name", type(layer).__name__)
    required = mode() == "1"
    try:
        plan, note = plan_layer(layer)
        prewarmed, prewarmed_ms = prewarm_layer(layer, plan) if plan is not None else ("", [])
    except Exception as exc:  # a hook must never take the server down in auto mode
        if required:
            raise
        plan, note = None, f"setup of {name} failed: {type(exc).__name__}: {exc}"
    if plan is not None and required:
        plan = dataclasses.replace(plan, required=True)
    layer.__dict__[PLAN_ATTR] = plan
    set_up_layers[name] = layer
    if plan is None:
        reason = f"layer {name}: {note}"
        first = worker_report.once(disabled_line(reason), warn=True)
        if worker_report.new(("disabled", note)) and not first:
            # A layer that differs from the first one (e.g. an MTP draft layer) says so.
            logger.warning("fusedq: fused MLA query not used for layer %s: %s", name, note)
        if required:
            raise FusedqRequiredError(f"{MODE_ENV}=1 but the fused MLA query cannot run: {reason}")
        return
    if note and worker_report.new(("note", note)):  # once per distinct note, not per layer
        logger.info("fusedq: layer %s: %s", name, note)
    from fusedq.kernels.triton_launch import DEFAULT_PDL

    first = worker_report.once(
        enabled_line(plan.num_heads, plan.weight_format, prewarmed, DEFAULT_PDL, plan.form.name)
    )
    if first:
        _log_kernels(layer, plan, prewarmed_ms, DEFAULT_PDL)
    if (
        worker_report.new(("enabled", plan.num_heads, plan.weight_format, plan.form.name))
        and not first
    ):
        logger.info(
            "fusedq: fused MLA query also enabled for layer %s (heads=%d, format=%s, query=%s)",
            name, plan.num_heads, plan.weight_format, plan.form.name,
        )  # fmt: skip
