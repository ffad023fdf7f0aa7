"""The version guard and the patch: ``MLAAttention.forward_impl`` recompiled from its own
source with the hook call inserted before its query block, which then runs only where the
hook returns ``None``; ``__init__`` and ``process_weights_after_loading`` wrapped."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import inspect
import linecache
import textwrap

import torch

from fusedq.vllm import releases
from fusedq.vllm.front_hook import setup_front
from fusedq.vllm.hook import decode_query_hook
from fusedq.vllm.layer_plan import setup_layer, watch_kv_b_proj
from fusedq.vllm.releases import BEFORE_BLOCK, BLOCK_FIRST, BLOCK_LAST, MLA_MODULE, Release

HOOK_NAME = "_fusedq_decode_query"
PATCH_MARK = "_fusedq_patched"


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
    release = releases.release_for(version)
    if release is None:
        spans = "; ".join(r.span() for r in sorted(releases.RELEASES, key=lambda r: r.versions))
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
        setup_front(self)  # after the query plan: the front serves only where it does
        return result

    original_init = patch.init

    @functools.wraps(original_init)
    def __init__(self, *args, **kwargs):
        original_init(self, *args, **kwargs)
        watch_kv_b_proj(self)

    releases.installed["forward_impl"] = patch.forward_impl
    releases.installed["release"] = patch.release
    setattr(patch.module, HOOK_NAME, decode_query_hook)
    patch.cls.__init__ = __init__
    patch.cls.process_weights_after_loading = process_weights_after_loading
    patch.cls.forward_impl = patch.forward_impl
    setattr(patch.cls, PATCH_MARK, True)
