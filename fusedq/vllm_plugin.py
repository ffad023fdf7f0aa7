"""vLLM general plugin: run ``fusedq``'s fused query projection in MLA decode.

vLLM calls ``register()`` (entry point ``vllm.general_plugins: fusedq``) in every process it
starts. ``FUSEDQ_MLA_QUERY`` picks the mode:

- unset / ``auto``: use the fused op where it qualifies, vLLM's staged path elsewhere;
- ``0``: return at once — plain vLLM, nothing patched, nothing logged;
- ``1``: require it — a vLLM this plugin cannot patch, or an MLA layer that cannot use the
  fused op, is a startup error naming the reason.

How it hooks (see docs/vllm-plugin.md): ``MLAAttention.forward_impl`` is recompiled from its
own source with one change — the query-side block (the ROCm-aiter / AMX / padded-heads /
plain ``torch.bmm`` branches, then the concat or ``_decode_concat_quant_fp8_op``) is nested
under ``if mqa_q is None:`` after a call to ``_fusedq_decode_query``, which returns the
finished ``[B, N, 576]`` query or ``None``. ``None`` runs vLLM's block as shipped.
``process_weights_after_loading`` is wrapped to decide per layer, prewarm the CUDA-graph
sizes and log one line per worker process; ``__init__`` is wrapped to snapshot an MXFP8
``kv_b_proj``'s W_UK before vLLM's MXFP8 linear kernel re-lays it out.

The version guard refuses to patch unless the vLLM version falls in one row of ``RELEASES``
(0.26.x; 0.32.x-0.33.x) and the block's text hashes to a value that row knows; it then logs ``fusedq: fused MLA query disabled:
<reason>`` and leaves vLLM untouched.

Per layer, the plan reads the class of the attention ``impl`` the layer got against
``BACKENDS``: a backend that takes one ``[B, N, 576]`` tensor gets the fused output, one that
takes only a ``(q_nope, q_rope)`` pair (FLASH_ATTN_MLA_SPARSE, GLM-5's DSA decode on sm_90)
gets two views of it, and a backend without a row is refused with the reason
(docs/vllm-plugin.md). ``set_path`` switches the process between the fused
and the staged path; ``fusedq.vllm_worker_ext`` calls it on every worker of a running server.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import linecache
import logging
import os
import textwrap
import threading
import weakref
from collections.abc import Mapping
from keyword import iskeyword

import torch

from fusedq.limits import KV_LORA, QK_NOPE, QK_ROPE

ENV = "FUSEDQ_MLA_QUERY"
MODES = ("auto", "0", "1")

MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"
# (qk_nope, qk_rope, kv_lora) a layer must have for the fused op to serve it.
GEOMETRY = (QK_NOPE, QK_ROPE, KV_LORA)
# The query-side block of MLAAttention.forward_impl this plugin nests under its fallback:
# from the first line to the last (inclusive), dedented. Both lines are the same in every
# release read so far; what sits around the block differs (see RELEASES).
BLOCK_FIRST = "if self.is_aiter_triton_fp4_bmm_enabled:"
BLOCK_LAST = "mqa_q = (mqa_ql_nope, mqa_q_pe)"
# Lines that must come before the block in every release: the query split and vLLM's
# (N, B, P) transpose, whose results the hook consumes.
BEFORE_BLOCK = (
    "mqa_q_nope, mqa_q_pe = mqa_q.split(",
    "mqa_q_nope = mqa_q_nope.transpose(0, 1)",
)


@dataclasses.dataclass(frozen=True)
class Release:
    """One vLLM release line whose ``MLAAttention.forward_impl`` this plugin was read against.

    Supporting another release is a new row of this table, not a new branch of code: the
    transform, the guard and the plan read everything release-specific from here.
    """

    name: str
    # [min, below) on (major, minor): the block hash is the real guard; the range keeps a
    # release whose *surroundings* changed (what the query feeds into) from being patched just
    # because the block itself stayed the same.
    versions: tuple[tuple[int, int], tuple[int, int]]
    # vLLM version read -> sha256 of the dedented block; any edit disables the plugin.
    blocks: Mapping[str, str]
    # Consumers after the block, in order: each takes a finished tensor query as well as
    # vLLM's (ql_nope, q_pe) pair, which is how the hook's result is handed on.
    after: tuple[str, ...]
    # The hook's arguments after ``self`` -- q_nope, q_pe, whether this step replicates the
    # query for DCP (the hook then declines), fp8 attention -- as forward_impl expressions.
    hook_args: tuple[str, str, str, str]
    # Instance attributes of this release's MLAAttention that the plan reads besides
    # LAYER_ATTRS (checked per layer: the class-level guard cannot see instance state).
    layer_attrs: tuple[str, ...] = ()

    @property
    def hook_locals(self) -> tuple[str, ...]:
        """forward_impl locals the inserted call reads or writes."""
        return (*(a for a in self.hook_args if a.isidentifier() and not iskeyword(a)), "mqa_q")

    def span(self) -> str:
        (a, b), (c, d) = self.versions
        return f">={a}.{b},<{c}.{d}"


RELEASES: tuple[Release, ...] = (
    Release(
        name="0.32",
        versions=((0, 32), (0, 34)),
        blocks={"0.32.0": "51306b400d2fc8d04e03d6e2a9c2a8aced015c078c5745064d49c4015cb35e47"},
        after=(
            "if isinstance(mqa_q, tuple):",
            "mqa_q = self.dcp_manager.query_gather(mqa_q)",
            "self.impl.forward_mqa(mqa_q, kv_cache, attn_metadata, self)",
        ),
        hook_args=("mqa_q_nope", "mqa_q_pe", "qrep_decode", "fp8_attention"),
        layer_attrs=("is_amx_bmm_enabled",),
    ),
    # 0.26 (the newest release built for torch 2.11 + CUDA 13, the H200 image's stack): no AMX
    # branch, the bmm writes an (N, B, L) buffer and transposes it, and DCP concatenates a
    # pair and all-gathers after the block instead of a query_gather; there is no DCP query
    # replication, so the hook never has to decline for it.
    Release(
        name="0.26",
        versions=((0, 26), (0, 27)),
        blocks={"0.26.0": "6c3ac941bd5e04f9b777eb7d3d4b6078a2d0992e7917b93a1c936ac87ed5c6c4"},
        after=(
            "if isinstance(mqa_q, tuple):",
            "mqa_q = get_dcp_group().all_gather(mqa_q, dim=1)",
            "self.impl.forward_mqa(mqa_q, kv_cache, attn_metadata, self)",
        ),
        hook_args=("mqa_q_nope", "mqa_q_pe", "False", "fp8_attention"),
    ),
)


def release_for(version: tuple[int, ...]) -> Release | None:
    """The row whose range holds this vLLM version, or None."""
    return next((r for r in RELEASES if r.versions[0] <= version[:2] < r.versions[1]), None)


# --- what each attention backend takes as its decode query ----------------------------------


@dataclasses.dataclass(frozen=True)
class QueryForm:
    """A way an MLA backend's ``forward_mqa`` takes the decode query."""

    name: str  # in the enabled line: query=<name>
    text: str  # in a refusal: "<backend> takes <text>"
    # forward_mqa's line (stripped) that branches on the query's type, as read: a backend
    # whose source no longer has its form's line is not known any more.
    reads: tuple[str, ...]
    # Hand the fused [B, N, 576] output on as the (ql_nope, q_pe) views (vllm_hook.split_query)
    # instead of as one tensor.
    split: bool


QUERY_FORMS: dict[str, QueryForm] = {
    # Joins a pair itself (torch.cat, concat_mla_q) or splits a tensor into views: a finished
    # tensor saves the join, or costs nothing.
    "tensor": QueryForm(
        "tensor",
        "one [M, H, 576] query or a (q_nope, q_rope) pair",
        ("if type(q) is tuple:", "if isinstance(q, tuple):"),
        split=False,
    ),
    # Raises on a tensor (FlashAttention 3 reads q_rope as `q` and q_nope as `q_v`).
    "pair": QueryForm(
        "pair", "only a (q_nope, q_rope) pair", ("if not isinstance(q, tuple):",), split=True
    ),
}


@dataclasses.dataclass(frozen=True)
class Backend:
    """One MLA attention backend whose ``forward_mqa`` this plugin was read against.

    Supporting another backend is a new row of this table, not a new branch of code: the plan
    decides per layer from the class of the ``impl`` the layer actually got, and refuses any
    class without a row (docs/vllm-plugin.md).
    """

    name: str  # vLLM's AttentionBackend.get_name()
    impl: str  # the impl class's __name__, matched exactly (a subclass may override forward_mqa)
    form: str  # a QUERY_FORMS key
    releases: tuple[str, ...]  # the RELEASES rows whose source of this forward_mqa was read


BACKENDS: tuple[Backend, ...] = (
    # Dense. FLASH_ATTN_MLA and FLASHMLA (FP8 KV) ran the hook on the H200 (0.26.0).
    Backend("FLASH_ATTN_MLA", "FlashAttnMLAImpl", "tensor", ("0.26", "0.32")),
    Backend("FLASHMLA", "FlashMLAImpl", "tensor", ("0.26", "0.32")),
    Backend("TRITON_MLA", "TritonMLAImpl", "tensor", ("0.26", "0.32")),
    Backend("FLASHINFER_MLA", "FlashInferMLAImpl", "tensor", ("0.26", "0.32")),
    Backend("CUTLASS_MLA", "CutlassMLAImpl", "tensor", ("0.26", "0.32")),
    Backend("TOKENSPEED_MLA", "TokenspeedMLAImpl", "tensor", ("0.26", "0.32")),
    Backend("CPU_MLA", "CPUMLAImpl", "tensor", ("0.32",)),
    # Sparse (DSA: a model config with index_topk). FLASH_ATTN_MLA_SPARSE is sm_90's default.
    Backend("FLASH_ATTN_MLA_SPARSE", "FlashAttnMLASparseImpl", "pair", ("0.26", "0.32")),
    Backend("FLASHMLA_SPARSE", "FlashMLASparseImpl", "tensor", ("0.26", "0.32")),
    Backend("FLASHINFER_MLA_SPARSE", "FlashInferMLASparseImpl", "tensor", ("0.26", "0.32")),
    Backend(
        "FLASHINFER_MLA_SPARSE_SM120", "FlashInferMLASparseSM120Impl", "tensor", ("0.26", "0.32")
    ),
)


def backend_row(impl: str, release: str) -> Backend | None:
    """The BACKENDS row of this impl class read for this RELEASES row, or None."""
    return next((b for b in BACKENDS if b.impl == impl and release in b.releases), None)


@functools.cache
def _type_test(cls: type) -> str | None:
    """The first line of ``cls.forward_mqa`` that some query form reads (stripped), or None;
    ``ValueError`` when its source cannot be read."""
    known = {line for form in QUERY_FORMS.values() for line in form.reads}
    try:
        lines = inspect.getsource(cls.forward_mqa).splitlines()
    except (AttributeError, OSError, TypeError) as exc:
        raise ValueError(f"{cls.__name__}.forward_mqa has no readable source ({exc})") from exc
    return next((ln.strip() for ln in lines if ln.strip() in known), None)


def query_form(layer, release: Release, *, fp8_query: bool) -> tuple[QueryForm | None, str]:
    """How this layer's backend takes the decode query: ``(form, "")``, or ``(None, reason)``
    when this plugin does not know it."""
    cls = type(layer.impl)
    row = backend_row(cls.__name__, release.name)
    backend = _backend_name(layer, row)
    if row is None:
        return None, (
            f"{backend} takes the decode query as {cls.__name__}.forward_mqa reads it, which this "
            f"plugin does not know (no BACKENDS row for {cls.__name__} under vLLM {release.name})"
        )
    form = QUERY_FORMS[row.form]
    try:
        line = _type_test(cls)
    except ValueError as exc:
        return None, f"{backend} takes a query this plugin cannot check: {exc}"
    if line not in form.reads:
        return None, (
            f"{backend} takes the decode query as {cls.__name__}.forward_mqa reads it now "
            f"({line!r}), which this plugin does not know (its row was read from "
            f"{' / '.join(map(repr, form.reads))})"
        )
    if form.split and fp8_query:
        # vLLM itself would hand such a backend one FP8 tensor: no combination to copy.
        why = f"{backend} takes {form.text} with an FP8 query, which this plugin does not know"
        return None, why
    return form, ""


def _backend_name(layer, row: Backend | None) -> str:
    backend = getattr(layer, "attn_backend", None)
    name = getattr(backend, "get_name", None)
    if callable(name):
        try:
            return str(name())
        except Exception:  # a name only labels the message
            pass
    return row.name if row is not None else type(layer.impl).__name__


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
HOOK_NAME = "_fusedq_decode_query"
PATCH_MARK = "_fusedq_patched"
PLAN_ATTR = "_fusedq_plan"
SNAPSHOT_ATTR = "_fusedq_mxfp8_w_uk"
E8M0_DTYPES = tuple({torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)})

logger = logging.getLogger("vllm.fusedq")  # under vLLM's logger: its handler and format

# The forward_impl this process installed (a subclass overriding it does not run the hook)
# and the RELEASES row it was built from.
_installed: dict[str, object] = {}
_first_use = threading.Event()


class FusedqRequiredError(RuntimeError):
    """FUSEDQ_MLA_QUERY=1 and the fused MLA query cannot be used (the message says why)."""


def mode() -> str:
    """The normalised ``FUSEDQ_MLA_QUERY`` value; ``ValueError`` for anything else."""
    raw = os.environ.get(ENV, "auto").strip().lower() or "auto"
    if raw not in MODES:
        raise ValueError(f"{ENV}={os.environ.get(ENV)!r} is not one of {', '.join(MODES)}")
    return raw


# --- the one line per worker ------------------------------------------------------------


class _Report:
    """The per-process state behind "one line per worker process"."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.first: str | None = None  # the line logged, once
        self.seen: set[tuple] = set()  # outcomes already told (later layers repeat them)
        self.refused: str | None = None  # why register() left vLLM untouched
        self.kernels: str | None = None  # the kernels line's text (fusedq.kernel_summary)

    def once(self, line: str, *, warn: bool = False) -> bool:
        with self.lock:
            if self.first is not None:
                return False
            self.first = line
        (logger.warning if warn else logger.info)(line)
        return True

    def new(self, outcome: tuple) -> bool:
        """Whether this outcome is news in this process (and remember it)."""
        with self.lock:
            fresh = outcome not in self.seen
            self.seen.add(outcome)
        return fresh


_report = _Report()


def enabled_line(num_heads: int, fmt: str, prewarmed: str, pdl: bool, query: str) -> str:
    # pdl is the process default the decode hook's calls resolve to (FUSEDQ_PDL, read at
    # import): a run's server log then says which launch mode a measurement ran under. query
    # is the QUERY_FORMS name the backend is handed (a tensor, or the pair of views).
    return (
        f"fusedq: fused MLA query enabled (heads={num_heads}, format={fmt}, query={query}, "
        f"prewarmed M={prewarmed}, pdl={'on' if pdl else 'off'})"
    )


def disabled_line(reason: str) -> str:
    return f"fusedq: fused MLA query disabled: {reason}"


# --- the version guard and the patch -------------------------------------------------------


def _block_digest(block: str) -> str:
    return hashlib.sha256(block.encode()).hexdigest()


@dataclasses.dataclass(frozen=True)
class PatchedSource:
    """forward_impl's source with the hook inserted, and where its block was found."""

    source: str
    block: str
    indent: str


def transform_forward_impl(source: str, release: Release) -> PatchedSource:
    """Insert the hook into forward_impl's (dedented) source, as ``release`` lays it out.

    Raises ``ValueError`` naming the first expectation that does not hold: the anchors
    before the block, the block's first and last line (once each, at the expected nesting),
    the consumers after it.
    """
    lines = source.splitlines(keepends=True)
    stripped = [ln.strip() for ln in lines]

    def find(text: str, start: int) -> int:
        return next((i for i in range(start, len(lines)) if stripped[i] == text), -1)

    pos = 0
    for anchor in BEFORE_BLOCK:
        idx = next((i for i in range(pos, len(lines)) if stripped[i].startswith(anchor)), -1)
        if idx < 0:
            raise ValueError(f"forward_impl has no line {anchor!r} before the query block")
        pos = idx + 1
    firsts = [i for i in range(len(lines)) if stripped[i] == BLOCK_FIRST]
    if len(firsts) != 1 or firsts[0] < pos:
        raise ValueError(
            f"forward_impl has {len(firsts)} lines {BLOCK_FIRST!r} (expected one, after the "
            "query split)"
        )
    first = firsts[0]
    last = find(BLOCK_LAST, first)
    if last < 0:
        raise ValueError(f"forward_impl has no {BLOCK_LAST!r} after {BLOCK_FIRST!r}")
    indent = lines[first][: len(lines[first]) - len(lines[first].lstrip())]
    if not lines[last].startswith(indent + "    ") or lines[last].startswith(indent + "     "):
        raise ValueError(f"{BLOCK_LAST!r} is not nested one level inside the query block")
    pos = last + 1
    for anchor in release.after:
        idx = next((i for i in range(pos, len(lines)) if anchor in stripped[i]), -1)
        if idx < 0:
            raise ValueError(f"forward_impl has no {anchor!r} after the query block")
        pos = idx + 1
    block_lines = lines[first : last + 1]
    block = textwrap.dedent("".join(block_lines))
    hook = (
        f"{indent}mqa_q = {HOOK_NAME}(self, {', '.join(release.hook_args)})\n"
        f"{indent}if mqa_q is None:\n"
    )
    nested = "".join(("    " + ln) if ln.strip() else ln for ln in block_lines)
    patched = "".join(lines[:first]) + hook + nested + "".join(lines[last + 1 :])
    return PatchedSource(source=patched, block=block, indent=indent)


def _vllm_version() -> tuple[str, tuple[int, ...]]:
    import vllm

    text = getattr(vllm, "__version__", None)
    if not isinstance(text, str):
        raise ValueError("vllm.__version__ is missing")
    from packaging.version import InvalidVersion, Version

    try:
        release = Version(text).release
    except InvalidVersion as exc:
        raise ValueError(f"vllm.__version__={text!r} does not parse") from exc
    return text, release


def _module_future_flags(func) -> int:
    import __future__

    flags = 0
    for name in __future__.all_feature_names:
        feature = getattr(__future__, name)
        if func.__globals__.get(name) is feature:
            flags |= feature.compiler_flag
    return flags


@dataclasses.dataclass
class Patch:
    """What ``check_vllm`` found and ``apply`` installs."""

    module: object
    cls: type
    forward_impl: object  # the new function
    process_weights: object  # the original process_weights_after_loading
    init: object  # the original __init__
    release: Release  # the RELEASES row the installed vLLM matched


def compile_patched(
    source: str,
    release: Release,
    module_globals: dict,
    *,
    filename: str,
    first_line: int = 1,
    flags: int = 0,
):
    """forward_impl recompiled from its dedented ``source`` with the hook inserted, in the
    module's globals; ``ValueError`` when the source is not the one ``release`` describes."""
    patched = transform_forward_impl(source, release)
    digest = _block_digest(patched.block)
    if digest not in release.blocks.values():
        raise ValueError(
            f"the query block of MLAAttention.forward_impl differs from the one fusedq was "
            f"written against for vLLM {release.span()} (sha256 {digest[:12]}…)"
        )
    # Keep line numbers close to the file's (the hook adds two) and make tracebacks show
    # the patched source.
    body = "\n" * (first_line - 1) + patched.source
    linecache.cache[filename] = (len(body), None, body.splitlines(True), filename)
    code = compile(body, filename, "exec", flags=flags, dont_inherit=True)
    namespace: dict = {}
    exec(code, module_globals, namespace)
    new = namespace["forward_impl"]
    # A name the hook call passes that forward_impl never assigns would be a global lookup,
    # failing at the first decode step instead of here.
    missing = [n for n in release.hook_locals if n not in new.__code__.co_varnames]
    if missing:
        raise ValueError(f"MLAAttention.forward_impl has no locals {missing}")
    return new


def check_vllm() -> Patch:
    """The version guard: build the patch, or raise ``ValueError`` naming what is unexpected.

    Touches nothing in vLLM.
    """
    text, version = _vllm_version()
    release = release_for(version)
    if release is None:
        spans = "; ".join(r.span() for r in sorted(RELEASES, key=lambda r: r.versions))
        raise ValueError(f"vLLM {text} is outside the supported ranges ({spans})")
    import importlib

    module = importlib.import_module(MLA_MODULE)
    cls = getattr(module, "MLAAttention", None)
    if not isinstance(cls, type):
        raise ValueError(f"{MLA_MODULE}.MLAAttention is missing")
    if cls.__dict__.get(PATCH_MARK):
        raise ValueError("MLAAttention is already patched in this process")
    for name in ("__init__", "forward_impl", "process_weights_after_loading"):
        if not inspect.isfunction(cls.__dict__.get(name)):
            raise ValueError(f"MLAAttention.{name} is not a plain function")
    original = cls.__dict__["forward_impl"]
    if original.__code__.co_freevars:
        raise ValueError(
            f"MLAAttention.forward_impl has closure variables {original.__code__.co_freevars}"
        )
    if HOOK_NAME in module.__dict__:
        raise ValueError(f"{MLA_MODULE} already defines {HOOK_NAME}")
    try:
        source = textwrap.dedent(inspect.getsource(original))
    except (OSError, TypeError) as exc:
        raise ValueError(f"MLAAttention.forward_impl has no readable source ({exc})") from exc
    if not source.startswith("def forward_impl("):
        raise ValueError("MLAAttention.forward_impl is decorated or not a plain def")
    _, first_line = inspect.getsourcelines(original)
    new = compile_patched(
        source,
        release,
        module.__dict__,
        filename=f"<fusedq-patched {inspect.getsourcefile(original)}>",
        first_line=first_line,
        flags=_module_future_flags(original),
    )
    new.__defaults__ = original.__defaults__
    new.__kwdefaults__ = original.__kwdefaults__
    new.__qualname__ = original.__qualname__
    new.__module__ = original.__module__
    new.__doc__ = original.__doc__
    new.__wrapped__ = original
    return Patch(
        module,
        cls,
        new,
        cls.__dict__["process_weights_after_loading"],
        cls.__dict__["__init__"],
        release,
    )


def apply(patch: Patch) -> None:
    """Install the hook, the new forward_impl and the weight-processing wrapper."""
    original = patch.process_weights

    @functools.wraps(original)
    def process_weights_after_loading(self, act_dtype: torch.dtype):
        result = original(self, act_dtype)
        setup_layer(self)
        return result

    original_init = patch.init

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        watch_kv_b_proj(self)

    _installed["forward_impl"] = patch.forward_impl
    _installed["release"] = patch.release
    setattr(patch.module, HOOK_NAME, decode_query_hook)
    patch.cls.__init__ = __init__
    patch.cls.process_weights_after_loading = process_weights_after_loading
    patch.cls.forward_impl = patch.forward_impl
    setattr(patch.cls, PATCH_MARK, True)


# --- per layer: decide, prewarm, report ----------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LayerPlan:
    """A layer the fused op serves. ``mx_weight`` replaces ``W_UK_T`` when set."""

    num_heads: int
    weight_format: str
    mx_weight: object | None
    required: bool = False  # FUSEDQ_MLA_QUERY=1: a failing fused call raises
    form: QueryForm = QUERY_FORMS["tensor"]  # how the layer's backend takes the query


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
    from fusedq.vllm_hook import mxfp8_w_uk_t

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
    from fusedq.vllm_hook import mxfp8_w_uk_t

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


def plan_layer(layer) -> tuple[LayerPlan | None, str]:
    """Whether the fused op serves this layer: ``(plan, note)`` or ``(None, reason)``."""
    import fusedq

    release = _installed.get("release")
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
    installed = _installed.get("forward_impl")
    if getattr(type(layer), "forward_impl", installed) is not installed:
        return None, f"{type(layer).__name__} overrides forward_impl (the hook is not in it)"
    if not isinstance(release, Release):
        return None, "fusedq did not patch MLAAttention in this process"
    dims = (layer.qk_nope_head_dim, layer.qk_rope_head_dim, layer.kv_lora_rank)
    if dims != GEOMETRY:
        return None, f"(qk_nope, qk_rope, kv_lora)={dims}, fused op needs {GEOMETRY}"
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
    fmt = "bf16" if mx_weight is None else "mxfp8"
    why = fusedq.explain(
        layer.num_heads, 1, weight_format=fmt, out_dtype=out_dtype, device=w_uk_t.device
    )
    if why is not None and mx_weight is not None:
        # No MXFP8 recipe here (e.g. sm_80): the bf16 W_UK vLLM built may still qualify.
        note = f"MXFP8 recipe unavailable ({why}); using bf16 W_UK"
        mx_weight, fmt = None, "bf16"
        why = fusedq.explain(
            layer.num_heads, 1, weight_format=fmt, out_dtype=out_dtype, device=w_uk_t.device
        )
    if why is not None:
        return None, why
    return LayerPlan(layer.num_heads, fmt, mx_weight, form=form), note or ""


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


def _prewarm(layer, plan: LayerPlan) -> tuple[str, list[int]]:
    """Prewarm the graph sizes' M values; returns (what the enabled line says, those M)."""
    import fusedq
    from fusedq.vllm_hook import prewarm_values

    sizes, why = capture_sizes(layer)
    if sizes is None:
        return f"none [{why}]", []
    weight = plan.mx_weight if plan.mx_weight is not None else layer.W_UK_T
    out_dtype = torch.float8_e4m3fn if _fp8_query(layer) else torch.bfloat16
    ms = prewarm_values(sizes, plan.num_heads, plan.weight_format, out_dtype, layer.W_UK_T.device)
    fusedq.prewarm(weight, ms, out_dtype=out_dtype)
    if not ms:
        return f"none [no capture size in the fused range; sizes {sizes[:4]}…]", []
    return ",".join(map(str, ms)), list(ms)


# The M values a kernels line describes where nothing was prewarmed (no CUDA graphs).
DECODE_MS = (1, 2, 4, 8, 16, 32)


def _log_kernels(layer, plan: LayerPlan, prewarmed_ms: list[int], pdl: bool) -> None:
    """Beside the enabled line, once per process: which kernel each M runs
    (``vllm_hook.kernel_summary``: the hook's backend), so a server log says what a measurement
    ran. Never fails the start-up: the decision is made, this only describes it."""
    from fusedq import vllm_hook

    try:
        ms = prewarmed_ms or list(DECODE_MS)
        out_dtype = torch.float8_e4m3fn if _fp8_query(layer) else torch.bfloat16
        text = vllm_hook.kernel_summary(
            plan.num_heads, ms, weight_format=plan.weight_format, out_dtype=out_dtype,
            device=layer.W_UK_T.device, pdl=pdl,
        )  # fmt: skip
    except Exception as exc:
        text = f"unknown ({type(exc).__name__}: {exc})"
    _report.kernels = text
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
        prewarmed, prewarmed_ms = _prewarm(layer, plan) if plan is not None else ("", [])
    except Exception as exc:  # a hook must never take the server down in auto mode
        if required:
            raise
        plan, note = None, f"setup of {name} failed: {type(exc).__name__}: {exc}"
    if plan is not None and required:
        plan = dataclasses.replace(plan, required=True)
    layer.__dict__[PLAN_ATTR] = plan
    _switch.layers[name] = layer
    if plan is None:
        reason = f"layer {name}: {note}"
        first = _report.once(disabled_line(reason), warn=True)
        if _report.new(("disabled", note)) and not first:
            # A layer that differs from the first one (e.g. an MTP draft layer) says so.
            logger.warning("fusedq: fused MLA query not used for layer %s: %s", name, note)
        if required:
            raise FusedqRequiredError(f"{ENV}=1 but the fused MLA query cannot run: {reason}")
        return
    if note:
        logger.info("fusedq: layer %s: %s", name, note)
    from fusedq.kernels.triton_launch import DEFAULT_PDL

    first = _report.once(
        enabled_line(plan.num_heads, plan.weight_format, prewarmed, DEFAULT_PDL, plan.form.name)
    )
    if first:
        _log_kernels(layer, plan, prewarmed_ms, DEFAULT_PDL)
    if _report.new(("enabled", plan.num_heads, plan.weight_format, plan.form.name)) and not first:
        logger.info(
            "fusedq: fused MLA query also enabled for layer %s (heads=%d, format=%s, query=%s)",
            name, plan.num_heads, plan.weight_format, plan.form.name,
        )  # fmt: skip


# --- the decode-step hook ------------------------------------------------------------------


def decode_query_hook(layer, mqa_q_nope, mqa_q_pe, qrep_decode, fp8_attention):
    """Called by the patched forward_impl in place of its query block: the finished query (one
    tensor, or the pair of views into it for a backend that takes only a pair), or ``None``
    to run vLLM's block unchanged."""
    plan = layer.__dict__.get(PLAN_ATTR)
    if plan is None or qrep_decode:
        return None
    if _switch.path != "fused":
        if not _first_use.is_set():
            _first_use.set()
            # After a switch to staged: proof in the log that the hook now declines.
            logger.info(
                "fusedq: first staged MLA decode query since the switch (layer %s, M=%d): "
                "vLLM's block runs",
                layer.layer_name, mqa_q_nope.shape[1],
            )  # fmt: skip
        return None
    from fusedq.vllm_hook import decode_query, split_query

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
    if query is not None and not _first_use.is_set():
        _first_use.set()
        # Proof in the log that the hot path runs the fused op, not just that it was set up.
        logger.info(
            "fusedq: first fused MLA decode query (layer %s, M=%d, out=%s)",
            layer.layer_name, query.shape[0], str(out_dtype).removeprefix("torch."),
        )  # fmt: skip
    if query is not None and plan.form.split:
        return split_query(query)
    return query


# --- the decode path switch (fusedq.vllm_worker_ext drives it over vLLM's collective RPC) ----

PATHS = ("staged", "fused")


class FusedqInactiveError(RuntimeError):
    """No MLA layer of this process uses the fused query, so there is no path to switch."""


class _Switch:
    """The process's decode path, read by the hook on every call, and the layers set up.

    A server comes up ``fused``: the plugin sets every qualified layer up as it always did.
    ``staged`` makes the hook return ``None``, so vLLM's block runs as shipped.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.path = "fused"
        # layer name -> layer, every layer setup_layer saw (weak: a model freed is gone).
        self.layers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


_switch = _Switch()


def current_path() -> str:
    """The decode path this process runs: ``staged`` or ``fused``."""
    return _switch.path


def planned_layers() -> list:
    """The layers the fused op serves (a plan at set-up, not dropped since), by name."""
    return [
        layer
        for _, layer in sorted(_switch.layers.items())
        if layer.__dict__.get(PLAN_ATTR) is not None
    ]


def report_line() -> str | None:
    """The one enabled/disabled line this process logged at set-up, if any yet."""
    return _report.first


def kernels_line() -> str | None:
    """The kernels line's text (which kernel each decode M runs), if an enabled line was."""
    return _report.kernels


def inactive_reason() -> str:
    """Why no layer of this process uses the fused query."""
    current = os.environ.get(ENV, "auto")
    if not _installed:
        if _report.refused is not None:
            return f"vLLM was not patched: {_report.refused}"
        return f"the plugin did not patch vLLM in this process ({ENV}={current!r})"
    if _report.first is None:
        return "no MLA layer of this process was set up"
    if _report.first.startswith(disabled_line("")):
        return _report.first
    # Enabled at set-up, then every layer's fused call failed and went back to vLLM's block.
    return "every layer's fused MLA query failed at run time (see the warnings)"


def set_path(path: str) -> bool:
    """Switch this process's decode path; returns whether it changed.

    ``ValueError`` for a path not in ``PATHS``; ``FusedqInactiveError`` (with the reason) where
    no layer uses the fused query. Switching to ``fused`` prewarms every planned layer's
    CUDA-graph sizes first, as set-up does, so a re-capture that follows never compiles. What
    was captured in CUDA graphs keeps running the old path until it is captured again
    (``fusedq.vllm_worker_ext`` does that).
    """
    if path not in PATHS:
        raise ValueError(f"decode path {path!r} is not one of {', '.join(PATHS)}")
    layers = planned_layers()
    if not layers:
        raise FusedqInactiveError(f"the fused MLA query is not active: {inactive_reason()}")
    with _switch.lock:
        changed = path != _switch.path
        if changed and path == "fused":
            for layer in layers:
                _prewarm(layer, layer.__dict__[PLAN_ATTR])
        _switch.path = path
    if changed:
        _first_use.clear()  # the first decode query on the new path is logged again
        logger.info("fusedq: decode path switched to %s (%d layers)", path, len(layers))
    return changed


# --- the entry point -----------------------------------------------------------------------


def register() -> None:
    """vLLM's general-plugin entry point (runs in every vLLM process)."""
    try:
        current = mode()
    except ValueError as exc:
        logger.warning(disabled_line(str(exc)))
        return
    if current == "0":
        return
    if _installed:
        return  # vLLM may load plugins more than once per process
    try:
        patch = check_vllm()
    except Exception as exc:
        reason = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        _report.refused = reason
        if current == "1":
            raise FusedqRequiredError(f"{ENV}=1 but vLLM cannot be patched: {reason}") from exc
        logger.warning(disabled_line(reason))
        return
    apply(patch)
    logger.debug("fusedq: patched %s.MLAAttention (forward_impl, weight processing)", MLA_MODULE)
