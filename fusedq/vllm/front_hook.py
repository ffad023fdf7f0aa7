"""The decode front in vLLM (``FUSEDQ_MLA_FRONT=1``): ``fusedq.mla_decode_front`` runs RoPE
of q_pe and k_pe, the absorbed query and the KV-cache write of a step's decode tokens in one
launch, where vLLM runs its rotary embedding, ``torch.bmm`` + concat and the cache write.

What is patched (docs/decisions/0020-decode-front-in-vllm.md, decision 2), each method
recompiled from its own source and guarded by the sha256 of that source in the
``releases.RELEASES`` row of the installed vLLM:

- ``MultiHeadLatentAttentionWrapper.forward`` (``vllm.model_executor.layers.mla``): the
  ``if self.rotary_emb is not None:`` block runs only where ``_fusedq_front_positions``
  returns ``None``; otherwise RoPE is left to the attention layer, and the positions are
  handed to it as ``self.mla_attn(..., fusedq_positions=positions)``;
- ``MLAAttention.forward``: a ``fusedq_positions`` parameter, and before vLLM's cache write
  in each of its two branches the front's step: the front for the first ``num_decode_tokens``
  rows (their query kept on the layer for ``forward_impl``'s query hook, their cache entries
  written), vLLM's own ``rotary_emb`` in place for the other rows, and a slot mapping in which
  the decode rows are ``-1`` so vLLM's cache write (which skips negative slots, its padding)
  writes the other rows only. In the direct-call branch ``_fusedq_decode_front`` returns that
  slot mapping after ``layer_slot_mapping = slot_mapping.get(...)``; in the custom-op branch
  the ``torch.ops.vllm.unified_mla_kv_cache_update`` call runs inside
  ``with _fusedq_front_scope(...)``, which puts that slot mapping in the forward context's
  entry for the layer for the op's call (the op reads it there) and restores it after.

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
import functools
import hashlib
import inspect
import linecache
import os
import textwrap
import threading

import torch

from fusedq.vllm import releases
from fusedq.vllm.releases import MLA_MODULE, WRAPPER_MODULE, Release
from fusedq.vllm.report import logger

FRONT_ENV = "FUSEDQ_MLA_FRONT"
ENABLED_LINE = "fusedq: MLA decode front enabled"
DISABLED_LINE = "fusedq: MLA decode front disabled"

POSITIONS_HOOK = "_fusedq_front_positions"  # in the wrapper's module
FRONT_HOOK = "_fusedq_decode_front"  # in MLAAttention's module (direct-call branch)
OP_HOOK = "_fusedq_front_scope"  # in MLAAttention's module (custom-op branch)
POSITIONS_ARG = "fusedq_positions"
PATCH_MARK = "_fusedq_front_patched"

FRONT_ATTR = "_fusedq_front"  # on an MLAAttention: its FrontPlan, or None
QUERY_ATTR = "_fusedq_front_query"  # on an MLAAttention: this step's decode query
ROTARY_ATTR = "_fusedq_rotary_emb"  # on an MLAAttention: its wrapper's rotary_emb
WRAPPER_ATTR = "_fusedq_wrapper_facts"  # on an MLAAttention: what its wrapper runs

# The wrapper's RoPE block, the call that hands on to the attention layer, and the line of
# MLAAttention.forward's direct-call branch after which the front runs.
ROPE_FIRST = "if self.rotary_emb is not None:"
ATTN_CALL = "attn_out = self.mla_attn("
SLOT_LINE = "layer_slot_mapping = slot_mapping.get(self.layer_name)"
OP_CALL = "kv_cache_dummy_dep = torch.ops.vllm.unified_mla_kv_cache_update("
FRONT_LOCALS = ("q", "kv_c_normed", "k_pe", "self_kv_cache", "layer_slot_mapping", "attn_metadata")
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


# --- the source transforms and the guard -------------------------------------------------------


def _digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


def _indent(line: str) -> str:
    return line[: len(line) - len(line.lstrip())]


def transform_wrapper_forward(source: str) -> str:
    """``MultiHeadLatentAttentionWrapper.forward``'s (dedented) source with RoPE made
    conditional and the positions handed to ``self.mla_attn``; ``ValueError`` naming the
    first expectation that does not hold."""
    lines = source.splitlines(keepends=True)
    stripped = [ln.strip() for ln in lines]
    ropes = [i for i, s in enumerate(stripped) if s == ROPE_FIRST]
    if len(ropes) != 1:
        raise ValueError(f"the MLA wrapper's forward has {len(ropes)} lines {ROPE_FIRST!r}")
    first = ropes[0]
    indent = _indent(lines[first])
    last = first
    for i in range(first + 1, len(lines)):
        if stripped[i] and not lines[i].startswith(indent + " "):
            break
        if stripped[i]:
            last = i
    block = lines[first : last + 1]
    if not any("self.rotary_emb(" in ln for ln in block):
        raise ValueError(f"the MLA wrapper's {ROPE_FIRST!r} block does not call self.rotary_emb")
    calls = [i for i, s in enumerate(stripped) if s == ATTN_CALL]
    if len(calls) != 1 or calls[0] < last:
        raise ValueError(
            f"the MLA wrapper's forward has {len(calls)} lines {ATTN_CALL!r} after RoPE"
        )
    call_indent = _indent(lines[calls[0]])
    close = next(
        (i for i in range(calls[0] + 1, len(lines))
         if stripped[i] == ")" and _indent(lines[i]) == call_indent),
        -1,
    )  # fmt: skip
    if close < 0 or not stripped[close - 1].endswith(","):
        raise ValueError(f"the MLA wrapper's {ATTN_CALL!r} call does not end in 'arg,' then ')'")
    hook = (
        f"{indent}{POSITIONS_ARG} = {POSITIONS_HOOK}(self, positions, llama_4_scaling)\n"
        f"{indent}if {POSITIONS_ARG} is None:\n"
    )
    nested = "".join(("    " + ln) if ln.strip() else ln for ln in block)
    arg = f"{call_indent}    {POSITIONS_ARG}={POSITIONS_ARG},\n"
    return (
        "".join(lines[:first]) + hook + nested + "".join(lines[last + 1 : close]) + arg
        + "".join(lines[close:])
    )  # fmt: skip


def transform_attn_forward(source: str) -> str:
    """``MLAAttention.forward``'s (dedented) source with a ``fusedq_positions`` parameter and
    the front's call before the direct-call branch's cache write; ``ValueError`` naming the
    first expectation that does not hold."""
    lines = source.splitlines(keepends=True)
    stripped = [ln.strip() for ln in lines]
    if not stripped or not stripped[0].startswith("def forward("):
        raise ValueError("MLAAttention.forward is not a plain def")
    end = next((i for i, s in enumerate(stripped) if s.startswith(") ->") or s == "):"), -1)
    if end < 1 or not stripped[end - 1].endswith(","):
        raise ValueError("MLAAttention.forward's signature does not end in 'param,' then ')'")
    param = f"{_indent(lines[end - 1])}{POSITIONS_ARG}: torch.Tensor | None = None,\n"
    slots = [i for i, s in enumerate(stripped) if s == SLOT_LINE]
    if len(slots) != 1:
        raise ValueError(f"MLAAttention.forward has {len(slots)} lines {SLOT_LINE!r}")
    at = slots[0]
    ind = _indent(lines[at])
    call = (
        f"{ind}if {POSITIONS_ARG} is not None:\n"
        f"{ind}    layer_slot_mapping = {FRONT_HOOK}(\n"
        f"{ind}        self, q, kv_c_normed, k_pe, {POSITIONS_ARG}, self_kv_cache,\n"
        f"{ind}        layer_slot_mapping, attn_metadata,\n"
        f"{ind}    )\n"
    )
    ops = [i for i, s in enumerate(stripped) if s.startswith(OP_CALL)]
    if len(ops) != 1 or ops[0] < at:
        raise ValueError(f"MLAAttention.forward has {len(ops)} lines {OP_CALL!r} after the slots")
    op = ops[0]
    op_ind = _indent(lines[op])
    close = next(
        (i for i in range(op + 1, len(lines))
         if stripped[i] == ")" and _indent(lines[i]) == op_ind),
        -1,
    )  # fmt: skip
    if close < 0:
        raise ValueError(f"MLAAttention.forward's {OP_CALL!r} call has no closing ')'")
    scope = f"{op_ind}with {OP_HOOK}(self, q, kv_c_normed, k_pe, {POSITIONS_ARG}):\n"
    nested = "".join(("    " + ln) if ln.strip() else ln for ln in lines[op : close + 1])
    return (
        "".join(lines[:end]) + param + "".join(lines[end : at + 1]) + call
        + "".join(lines[at + 1 : op]) + scope + nested + "".join(lines[close + 1 :])
    )  # fmt: skip


def compile_method(source: str, transform, name: str, module_globals: dict, *, filename: str,
                   first_line: int = 1, flags: int = 0):  # fmt: skip
    """``transform(source)`` compiled in the module's globals; returns the new function."""
    body = "\n" * (first_line - 1) + transform(source)
    linecache.cache[filename] = (len(body), None, body.splitlines(True), filename)
    code = compile(body, filename, "exec", flags=flags, dont_inherit=True)
    namespace: dict = {}
    exec(code, module_globals, namespace)
    return namespace[name]


def guarded(kind: str, source: str, hashes, release: Release) -> None:
    """``ValueError`` unless ``source`` hashes to a value ``release``'s row knows."""
    digest = _digest(source)
    if digest not in hashes.values():
        raise ValueError(
            f"{kind} differs from the one the decode front was written against for vLLM "
            f"{release.span()} (sha256 {digest[:12]}…)"
        )


@dataclasses.dataclass
class FrontPatch:
    """What ``check_front`` found and ``apply_front`` installs."""

    wrapper_module: object
    wrapper_cls: type
    wrapper_forward: object
    wrapper_init: object  # the original __init__
    attn_module: object
    attn_cls: type
    attn_forward: object


def _method(cls: type, name: str, module, hook: str):
    from fusedq.vllm.patch import _module_future_flags

    func = cls.__dict__.get(name)
    if not inspect.isfunction(func):
        raise ValueError(f"{cls.__name__}.{name} is not a plain function")
    if func.__code__.co_freevars:
        raise ValueError(f"{cls.__name__}.{name} has closure variables")
    if hook in module.__dict__:
        raise ValueError(f"{module.__name__} already defines {hook}")
    try:
        source = textwrap.dedent(inspect.getsource(func))
        _, first_line = inspect.getsourcelines(func)
    except (OSError, TypeError) as exc:
        raise ValueError(f"{cls.__name__}.{name} has no readable source ({exc})") from exc
    return func, source, first_line, _module_future_flags(func)


def _finish(new, original):
    new.__defaults__ = original.__defaults__
    new.__kwdefaults__ = original.__kwdefaults__
    new.__qualname__ = original.__qualname__
    new.__module__ = original.__module__
    new.__doc__ = original.__doc__
    new.__wrapped__ = original
    return new


def check_front(release: Release) -> FrontPatch:
    """The front's guard: both methods' sources hash to ``release``'s values and transform;
    touches nothing in vLLM."""
    import importlib

    wmod = importlib.import_module(WRAPPER_MODULE)
    amod = importlib.import_module(MLA_MODULE)
    wcls = getattr(wmod, "MultiHeadLatentAttentionWrapper", None)
    acls = getattr(amod, "MLAAttention", None)
    if not isinstance(wcls, type) or not isinstance(acls, type):
        raise ValueError("MultiHeadLatentAttentionWrapper or MLAAttention is missing")
    if wcls.__dict__.get(PATCH_MARK) or acls.__dict__.get(PATCH_MARK):
        raise ValueError("the decode front is already patched in this process")
    if not inspect.isfunction(wcls.__dict__.get("__init__")):
        raise ValueError("MultiHeadLatentAttentionWrapper.__init__ is not a plain function")
    built = []
    for cls, module, hook, hashes, transform in (
        (wcls, wmod, POSITIONS_HOOK, release.wrapper_forward, transform_wrapper_forward),
        (acls, amod, FRONT_HOOK, release.attn_forward, transform_attn_forward),
    ):
        original, source, first_line, flags = _method(cls, "forward", module, hook)
        guarded(f"{cls.__name__}.forward", source, hashes, release)
        new = compile_method(
            source, transform, "forward", module.__dict__, first_line=first_line, flags=flags,
            filename=f"<fusedq-front {inspect.getsourcefile(original)}>",
        )  # fmt: skip
        built.append(_finish(new, original))
    if OP_HOOK in amod.__dict__:
        raise ValueError(f"{MLA_MODULE} already defines {OP_HOOK}")
    missing = [n for n in FRONT_LOCALS if n not in built[1].__code__.co_varnames]
    if missing:
        raise ValueError(f"MLAAttention.forward has no locals {missing}")
    return FrontPatch(wmod, wcls, built[0], wcls.__dict__["__init__"], amod, acls, built[1])


def apply_front(fp: FrontPatch) -> None:
    """Install both methods, their hooks, and the wrapper ``__init__`` that tells each
    attention layer what its wrapper runs (the front's plan needs the rotary embedding)."""
    original_init = fp.wrapper_init

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        link_wrapper(self)

    setattr(fp.wrapper_module, POSITIONS_HOOK, front_positions)
    setattr(fp.attn_module, FRONT_HOOK, decode_front)
    setattr(fp.attn_module, OP_HOOK, front_scope)
    fp.wrapper_cls.__init__ = __init__
    fp.wrapper_cls.forward = fp.wrapper_forward
    fp.attn_cls.forward = fp.attn_forward
    setattr(fp.wrapper_cls, PATCH_MARK, True)
    setattr(fp.attn_cls, PATCH_MARK, True)
    releases.installed["front"] = fp


def link_wrapper(wrapper) -> None:
    """Store on the wrapper's attention layer (in its ``__dict__``: not a submodule, not in
    the state dict) the rotary embedding and what else of the wrapper the plan reads."""
    attn = getattr(wrapper, "mla_attn", None)
    if attn is None:
        return
    attn.__dict__[ROTARY_ATTR] = getattr(wrapper, "rotary_emb", None)
    attn.__dict__[WRAPPER_ATTR] = {
        "is_sparse": bool(getattr(wrapper, "is_sparse", False)),
        "dcp_q_replicate": bool(getattr(wrapper, "dcp_q_replicate", False)),
    }


def install(release: Release) -> str | None:
    """Patch for the front if ``FUSEDQ_MLA_FRONT=1``; returns the disabled line's reason
    (also logged), or ``None`` when installed or off."""
    try:
        if front_mode() == "0":
            return None
        fp = check_front(release)
    except Exception as exc:
        reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        front_report.refused = reason
        logger.warning(disabled_line(reason))
        return reason
    apply_front(fp)
    return None


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
