"""The vLLM flags the orchestrator owns, recognised the way vLLM's parser reads them.

A case's server is started as ``vllm serve MODEL --host H --port P --tensor-parallel-size TP
[--decode-context-parallel-size DCP] [--speculative-config JSON] --served-model-name NAME
[--profiler-config JSON] ARGS...``, the matrix's ARGS last. vLLM's parser is argparse with
abbreviations allowed, and a later flag wins, so an ARG naming an owned flag in any spelling
vLLM accepts would silently replace the topology the case is labelled with. The spellings
(vLLM 0.26 and 0.32 alike; the rule below is checked against 0.32's own parser in
tests/orchestrator/security/test_sec_owned_flags.py):

- ``--flag VALUE``, ``--flag=VALUE``, underscores for dashes (``--tensor_parallel_size``);
- any unambiguous prefix (``--hos`` is --host, ``-t`` is -tp);
- the dotted form of a JSON flag (``--speculative-config.method mtp``), abbreviated too;
- ``--config FILE``: a YAML mapping of flag names to values, read into the command line.

The rule needs no vLLM import (`orchestrator plan` answers in milliseconds): a flag that is
an owned flag, or a prefix of one, is refused. A prefix vLLM finds ambiguous would fail in
vLLM anyway; the one real vLLM flag refused is -dc (--diffusion-config), a prefix of -dcp
that a release without --diffusion-config reads as DCP: write the long form instead.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from pathlib import Path

from orchestrator.common import safe_io

# Owned by every case: flag -> why (shown in the refusal). Short forms are vLLM's aliases.
ALWAYS_OWNED: dict[str, str] = {
    "--model": "the model path comes from models[].path",
    "--host": "set from the matrix's host",
    "--port": "chosen per server by the orchestrator",
    "--tensor-parallel-size": "set from the topology's tp",
    "-tp": "set from the topology's tp",
    "--decode-context-parallel-size": "set from the topology's dcp (left out at dcp 1)",
    "-dcp": "set from the topology's dcp (left out at dcp 1)",
    "--speculative-config": "set from the topology's mtp (left out at mtp 0)",
    "-sc": "set from the topology's mtp (left out at mtp 0)",
    # vLLM's shorthands that build a speculative config of their own.
    "--spec-method": "speculative decoding is set from the topology's mtp",
    "--spec-model": "speculative decoding is set from the topology's mtp",
    "--spec-tokens": "speculative decoding is set from the topology's mtp",
    "--served-model-name": "set from the model's served_name (else its label)",
}
# Owned while the matrix has a profile phase.
PROFILE_OWNED: dict[str, str] = {"--profiler-config": "set by the matrix's profile phase"}
CONFIG_FLAG = "--config"

# argparse's own test for a negative number, which is a value, not a flag.
_NEGATIVE_NUMBER = re.compile(r"^-\d+$|^-\d*\.\d+$")


def flag_name(arg: str) -> str | None:
    """The flag an argv element names as vLLM reads it (``--tensor_parallel.x=2`` ->
    ``--tensor-parallel``), or None for a value."""
    if not arg.startswith("-") or arg in ("-", "--") or _NEGATIVE_NUMBER.match(arg):
        return None
    name = arg.split("=", 1)[0].split(".", 1)[0]
    # vLLM turns underscores into dashes between the leading -- and the first dot.
    return "--" + name[2:].replace("_", "-") if name.startswith("--") else name


def owned_flag(arg: str, owned: Mapping[str, str]) -> str | None:
    """The owned flag `arg` sets, spelled out or abbreviated, or None."""
    name = flag_name(arg)
    if name is None:
        return None
    if name in owned:
        return name
    long = name.startswith("--")
    return next((f for f in owned if f.startswith(name) and f.startswith("--") == long), None)


def describe(arg: str, flag: str, owned: Mapping[str, str]) -> str:
    """`arg` and the owned flag it sets, as a refusal says it."""
    name = flag_name(arg)
    how = "" if name == flag else f" (vLLM reads {name} as {flag})"
    return f"{arg!r} sets {flag}{how}, which is set by the orchestrator: {owned[flag]}"


def config_files(args: Sequence[str]) -> list[str]:
    """The files given to ``--config`` (``--config FILE`` or ``--config=FILE``)."""
    out = []
    for i, arg in enumerate(args):
        if arg == CONFIG_FLAG and i + 1 < len(args):
            out.append(args[i + 1])
        elif arg.startswith(CONFIG_FLAG + "="):
            out.append(arg.split("=", 1)[1])
    return out


def config_problem(path: str, owned: Mapping[str, str]) -> str | None:
    """Why the ``--config`` file at `path` cannot be passed to vLLM: unreadable, not a YAML
    mapping, or setting an owned flag; None when it is fine."""
    try:
        data = safe_io.load_yaml(safe_io.read_text(Path(path), safe_io.MAX_YAML_BYTES), path)
    except FileNotFoundError:
        return f"--config {path}: no such file (it is read to check the flags it sets)"
    except safe_io.UnsafeFileError as exc:
        return f"--config {exc}"
    except OSError as exc:
        return f"--config {path}: cannot read it ({exc.strerror})"
    except safe_io.yaml.YAMLError as exc:
        return f"--config {path}: invalid YAML ({str(exc).splitlines()[0]})"
    if not isinstance(data, dict):
        return f"--config {path}: not a YAML mapping of vLLM flags"
    for key in data:
        # vLLM's load_config_file turns each key into "--key" ahead of the command line.
        flag = owned_flag(f"--{key}", owned)
        if flag is not None:
            return f"--config {path}: key {key!r} sets {flag}, which is set by the orchestrator: {owned[flag]}"
    return None


def args_problem(args: Sequence[str], owned: Mapping[str, str]) -> str | None:
    """The first passthrough arg, or ``--config`` key, that sets an owned flag; None if none."""
    for arg in args:
        flag = owned_flag(arg, owned)
        if flag is not None:
            return describe(arg, flag, owned)
    for path in config_files(args):
        if "${" in path:  # an unset ${VAR} `plan` reports; `run` resolves it first
            continue
        problem = config_problem(path, owned)
        if problem is not None:
            return problem
    return None
