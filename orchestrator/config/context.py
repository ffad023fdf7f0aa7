"""How long a request a case's server takes: what vLLM will refuse before it is asked.

vLLM rejects a request whose prompt and output together exceed the server's max_model_len,
so a workload longer than that fails every request of its case, after a server start of
minutes. The bound is known without loading the model in two places, and only there:

- ``--max-model-len`` among the case's args, as vLLM's parser reads it (``=VALUE`` or the
  next argument, underscores for dashes, an unambiguous prefix down to ``--max-model``; the
  value a plain integer or vLLM's human-readable one, ``32k`` = 32,000, ``32K`` = 32,768;
  the last one given wins);
- a built-in model's own config (orchestrator.models): its ``max_position_embeddings``,
  which vLLM takes as max_model_len when no flag says otherwise (no rope scaling there).

Anything else (a checkpoint path, which may be on another host; a hub id; ``-1``/``auto``
on a checkpoint; a ``${VAR}`` not resolved yet; a flag set through ``--config FILE``) is not
guessed at: no bound, no refusal.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

from orchestrator.config.expand import Case
from orchestrator.config.owned_flags import flag_name

FLAG = "--max-model-len"
# The shortest prefix taken as the flag: vLLM has other --max-* flags (--max-num-seqs,
# --max-logprobs, ...), and a prefix they share would be ambiguous to it.
SHORTEST = "--max-model"
# vLLM's human_readable_int: lowercase suffixes are decimal, uppercase binary (whole only).
_SUFFIXED = re.compile(r"(\d+(?:\.\d+)?)([kKmMgGtT])")
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_BINARY = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
# The values that hand the choice back to vLLM: the model's own length.
_AUTO = {"-1", "auto"}


@dataclass(frozen=True)
class ContextBound:
    """A case's longest request in tokens, and what says so (as a refusal names it)."""

    tokens: int
    what: str  # "max-model-len" or "max_position_embeddings"


def _is_flag(arg: str) -> bool:
    name = flag_name(arg)
    return name is not None and FLAG.startswith(name) and len(name) >= len(SHORTEST)


def stated_max_model_len(args: Sequence[str]) -> str | None:
    """The value of the last ``--max-model-len`` in `args`, as written; None without one."""
    value = None
    for i, arg in enumerate(args):
        if not _is_flag(arg):
            continue
        if "=" in arg:
            value = arg.split("=", 1)[1]
        elif i + 1 < len(args):
            value = args[i + 1]
    return value


def parse_tokens(value: str) -> int | None:
    """A --max-model-len value as vLLM reads it; None for one it does not take as a count
    (``auto``, ``-1``, a ``${VAR}``, a typo vLLM itself will refuse)."""
    value = value.strip()
    m = _SUFFIXED.fullmatch(value)
    if m:
        number, suffix = m.groups()
        if suffix in _DECIMAL:
            return int(float(number) * _DECIMAL[suffix])
        return int(number) * _BINARY[suffix] if number.isdigit() else None
    return int(value) if value.isdigit() else None


def context_bound(case: Case) -> ContextBound | None:
    """The longest request `case`'s server takes, where it is known without loading the
    model (the module docstring); None where it is not."""
    stated = stated_max_model_len(case.args)
    if stated is not None and stated.strip() not in _AUTO:
        tokens = parse_tokens(stated)
        return None if tokens is None or tokens < 1 else ContextBound(tokens, "max-model-len")
    own = case.model.context_tokens
    return None if own is None else ContextBound(own, "max_position_embeddings")
