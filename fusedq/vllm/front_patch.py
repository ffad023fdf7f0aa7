"""The decode front's patch of vLLM (``FUSEDQ_MLA_FRONT=1``; the step it serves is
``fusedq.vllm.front_hook``'s), as ``fusedq.vllm.patch`` is the query hook's.

What is patched (docs/decisions/0020-decode-front-in-vllm.md, decision 2), each method
recompiled from its own source and guarded by the sha256 of that source in the
``releases.RELEASES`` row of the installed vLLM:

- ``MultiHeadLatentAttentionWrapper.forward`` (``vllm.model_executor.layers.mla``): the
  ``if self.rotary_emb is not None:`` block runs only where ``_fusedq_front_positions``
  returns ``None``; otherwise RoPE is left to the attention layer, and the positions are
  handed to it as ``self.mla_attn(..., fusedq_positions=positions)``;
- ``MLAAttention.forward``: a ``fusedq_positions`` parameter, and where positions are handed
  on, the front's step in place of vLLM's RoPE and before or in place of its cache write: the
  front for the rows ``forward_impl`` sends through the absorbed path
  (``front_hook.absorbed_rows``; their query kept on the layer for ``forward_impl``'s query
  hook, their cache entries written), vLLM's RoPE in place for the other rows (and for every
  row on the staged path). In the direct-call branch (eager only)
  ``_fusedq_decode_front`` returns, after ``layer_slot_mapping = slot_mapping.get(...)``, a
  slot mapping with the rows already written at ``-1`` (vLLM's cache write skips negative
  slots, its padding). In the custom-op branch (every torch.compile run) the
  ``torch.ops.vllm.unified_mla_kv_cache_update`` call becomes, where positions are handed on,
  ``torch.ops.fusedq.vllm_mla_front_update``, which does the same and then vLLM's cache write
  of the rows left, and whose dummy output orders the attention op after it. ``install`` adds
  that op to vLLM's splitting ops (``CompilationConfig._attention_ops``, the list vLLM's
  default ``splitting_ops`` copies) before vLLM builds its config.

The wrapper's ``__init__`` is wrapped to store its rotary embedding on its attention layer.

Which rows take the absorbed path is decided in ``MLAAttention.forward_impl``, outside the
methods hashed here: the decode tokens, and for a sparse (DSA) layer with prefill rows every
actual token unless the prefill takes the MHA path. ``check_front`` looks for that rule's
lines in the unpatched ``forward_impl`` (``SPARSE_MQA_RULE``, vLLM 0.26's inline form, or
``SPARSE_MQA_RULE_CALL``, vLLM 0.32's call of ``MLAAttention._use_sparse_mha``) and records
whether it found one (``FrontPatch.sparse_rule``): without it the front still serves dense
layers, and refuses sparse ones.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import inspect
import linecache
import textwrap

from fusedq.vllm import releases
from fusedq.vllm.front_hook import (
    FRONT_OP,
    ROTARY_ATTR,
    WRAPPER_ATTR,
    decode_front,
    disabled_line,
    front_mode,
    front_positions,
    front_report,
)
from fusedq.vllm.patch import _module_future_flags
from fusedq.vllm.releases import MLA_MODULE, WRAPPER_MODULE, Release
from fusedq.vllm.report import logger

POSITIONS_HOOK = "_fusedq_front_positions"  # in the wrapper's module
FRONT_HOOK = "_fusedq_decode_front"  # in MLAAttention's module (direct-call branch)
POSITIONS_ARG = "fusedq_positions"
PATCH_MARK = "_fusedq_front_patched"

# The wrapper's RoPE block, the call that hands on to the attention layer, and the line of
# MLAAttention.forward's direct-call branch after which the front runs.
ROPE_FIRST = "if self.rotary_emb is not None:"
ATTN_CALL = "attn_out = self.mla_attn("
SLOT_LINE = "layer_slot_mapping = slot_mapping.get(self.layer_name)"
OP_CALL = "kv_cache_dummy_dep = torch.ops.vllm.unified_mla_kv_cache_update("
FRONT_LOCALS = ("q", "kv_c_normed", "k_pe", "self_kv_cache", "layer_slot_mapping", "attn_metadata")

# MLAAttention.forward_impl's split between absorbed (MQA) and MHA rows, which
# front_hook.absorbed_rows computes before forward_impl runs: each form as its run of code
# lines (stripped, comments dropped), found once and contiguous in the unpatched source,
# after ROWS_BEFORE_RULE (q is cut to the step's actual tokens: q.size(0) is
# num_actual_tokens), and with no other assignment of num_mqa_tokens.
ROWS_BEFORE_RULE = (
    "num_actual_toks = attn_metadata.num_actual_tokens",
    "q = q[:num_actual_toks, ...]",
)
# vLLM 0.26: decided inline.
SPARSE_MQA_RULE = (
    "num_mqa_tokens = attn_metadata.num_decode_tokens",
    "num_mha_tokens = q.size(0) - num_mqa_tokens",
    "if self.impl.is_sparse and num_mha_tokens > 0:",
    "prefill_max_seq_len = attn_metadata.prefill_max_seq_len",
    "use_mha = (",
    "self.prefill_backend is not None",
    "and prefill_max_seq_len <= attn_metadata.topk_tokens",
    "and not self._vllm_config.attention_config.sparse_mla_force_mqa",
    ")",
    "if not use_mha:",
    "num_mqa_tokens = q.size(0)",
    "num_mha_tokens = 0",
)
# vLLM 0.32: decided by the layer's _use_sparse_mha, which absorbed_rows calls in turn.
SPARSE_MQA_RULE_CALL = (
    "num_mqa_tokens = attn_metadata.num_decode_tokens",
    "num_mha_tokens = q.size(0) - num_mqa_tokens",
    "use_mha = True",
    "if self.impl.is_sparse and num_mha_tokens > 0:",
    "use_mha = self._use_sparse_mha(attn_metadata)",
    "if not use_mha:",
    "num_mqa_tokens = q.size(0)",
    "num_mha_tokens = 0",
)
SPARSE_RULE_METHOD = "_use_sparse_mha"


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
    front_op = FRONT_OP.replace("::", ".")
    scope = (
        f"{op_ind}if {POSITIONS_ARG} is not None:\n"
        f"{op_ind}    kv_cache_dummy_dep = torch.ops.{front_op}(\n"
        f"{op_ind}        q, kv_c_normed, k_pe, {POSITIONS_ARG}, self.layer_name\n"
        f"{op_ind}    )\n"
        f"{op_ind}else:\n"
    )
    nested = "".join(("    " + ln) if ln.strip() else ln for ln in lines[op : close + 1])
    return (
        "".join(lines[:end]) + param + "".join(lines[end : at + 1]) + call
        + "".join(lines[at + 1 : op]) + scope + nested + "".join(lines[close + 1 :])
    )  # fmt: skip


def compile_method(source: str, transform, name: str, module_globals: dict, *, filename: str,
                   first_line: int = 1, flags: int = 0):  # fmt: skip
    """``transform(source)`` compiled in the module's globals; returns the new function."""
    body = "\n" * (first_line - 1) + transform(source)
    # vLLM's compile cache hashes each traced file's name and text; this one it cannot open
    # (it warns "Failed to read file"), so the name carries the text's digest: a changed
    # transform is a new cache key, never a stale graph.
    filename = f"{filename[:-1]} {_digest(body)[:16]}>" if filename.endswith(">") else filename
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
    # forward_impl splits absorbed rows by a rule front_hook.absorbed_rows follows: the
    # front may serve sparse layers.
    sparse_rule: bool = False


def _method(cls: type, name: str, module, hook: str):
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


def _code_lines(source: str) -> list[str]:
    return [s for s in (ln.split("#", 1)[0].strip() for ln in source.splitlines()) if s]


def sparse_rule_in(source: str) -> str:
    """Which form of the absorbed-rows rule ``forward_impl``'s (dedented) source holds:
    ``"inline"`` (``SPARSE_MQA_RULE``), ``"call"`` (``SPARSE_MQA_RULE_CALL``) or ``""``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    # Every binding of num_mqa_tokens (=, +=, unpacking, ...): only the rule's may set it.
    stores = sum(
        isinstance(node, ast.Name) and node.id == "num_mqa_tokens"
        and isinstance(node.ctx, ast.Store)
        for node in ast.walk(tree)
    )  # fmt: skip
    lines = _code_lines(source)
    for form, rule in (("inline", SPARSE_MQA_RULE), ("call", SPARSE_MQA_RULE_CALL)):
        at = [i for i in range(len(lines)) if tuple(lines[i : i + len(rule)]) == rule]
        if len(at) != 1 or stores != sum(s.startswith("num_mqa_tokens =") for s in rule):
            continue
        if all(ln in lines[: at[0]] for ln in ROWS_BEFORE_RULE):
            return form
    return ""


def sparse_rule_found(acls: type) -> bool:
    """Whether ``MLAAttention.forward_impl`` as vLLM ships it (under the query patch, the
    function it wraps) splits absorbed rows by a rule ``front_hook.absorbed_rows`` follows,
    which takes the form from whether the layer has ``_use_sparse_mha``: the inline rule where
    the class has no such method, the call where it has."""
    func = inspect.unwrap(acls.__dict__.get("forward_impl"))
    try:
        form = sparse_rule_in(textwrap.dedent(inspect.getsource(func)))
    except (OSError, TypeError):
        return False
    method = callable(getattr(acls, SPARSE_RULE_METHOD, None))
    return form == ("call" if method else "inline")


def check_front(release: Release) -> FrontPatch:
    """The front's guard: both methods' sources hash to ``release``'s values and transform;
    touches nothing in vLLM. Whether ``forward_impl`` holds the absorbed-rows rule is
    recorded, not required (only sparse layers need it)."""
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
    missing = [n for n in FRONT_LOCALS if n not in built[1].__code__.co_varnames]
    if missing:
        raise ValueError(f"MLAAttention.forward has no locals {missing}")
    return FrontPatch(
        wmod, wcls, built[0], wcls.__dict__["__init__"], amod, acls, built[1],
        sparse_rule=sparse_rule_found(acls),
    )  # fmt: skip


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
        add_splitting_op()
    except Exception as exc:
        reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        front_report.refused = reason
        logger.warning(disabled_line(reason))
        return reason
    apply_front(fp)
    return None


def add_splitting_op() -> None:
    """Put the front's op among the ops vLLM splits its compiled graph at (the list its
    default ``splitting_ops`` copies when it builds the config): piecewise CUDA graphs of
    mixed batches then leave it out and it runs eagerly, reading the step's split."""
    from vllm.config.compilation import CompilationConfig

    ops = CompilationConfig.__dict__.get("_attention_ops")
    if not isinstance(ops, list):
        raise ValueError("vLLM's CompilationConfig has no _attention_ops list")
    if FRONT_OP not in ops:
        ops.append(FRONT_OP)
