"""What a matrix may do beyond its topology axes, and what `plan`, `run` and the report say
about it: the address its servers bind, and environment variables with reach.

- Servers bind loopback unless the matrix says otherwise. An address that means every
  interface (0.0.0.0, ::, an empty host) needs ``bind_all_interfaces: true`` beside it, and
  is then warned about in plan, at the start of a run and in the report: the servers answer
  anyone who can reach the machine, with no key unless the matrix passes --api-key.
- A matrix's env is passed to its servers as written, LD_PRELOAD and the like included: a
  matrix is trusted as a script is (it names the programs to run), and preloading an
  allocator is ordinary on vLLM's CPU build. `plan` lists such variables, so that a reader
  sees them.
- CUDA_VISIBLE_DEVICES and PYTHONPATH are the Ray worker's wherever Ray sets them (the GPUs
  of the case's bundle; py_modules, fusedq among them): a matrix value would put the server
  on GPUs another case holds, or hide the deployed fusedq. `plan` warns that it is not used.
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Iterator
from typing import Any

BIND_ALL_KEY = "bind_all_interfaces"
# Variables that make every server process load code the matrix names.
CODE_LOADING_ENV = frozenset(
    {"LD_PRELOAD", "LD_LIBRARY_PATH", "LD_AUDIT", "PYTHONSTARTUP", "PYTHONHOME",
     "PYTHONUSERBASE", "PYTHONSAFEPATH", "BASH_ENV", "ENV"}
)  # fmt: skip
# Variables the server gets from its Ray worker, wherever Ray sets them
# (orchestrator.cluster.server_actor).
RAY_WORKER_ENV = {
    "CUDA_VISIBLE_DEVICES": "the GPUs of the case's Ray bundle",
    "PYTHONPATH": "Ray's py_modules, which carry the deployed fusedq",
}


def binds_every_interface(host: str) -> bool:
    """0.0.0.0, ::, an empty host and their other spellings (``0``, ``[::]``, ``0:0::0``)."""
    name = host.strip().strip("[]")
    if not name:
        return True
    try:
        return ipaddress.ip_address(name).is_unspecified
    except ValueError:
        pass
    try:  # inet_aton's shorthands: "0", "0.0", "0x0"
        return socket.inet_aton(name) == b"\0\0\0\0"
    except OSError:
        return False


def host_problem(host: str, opted_in: bool) -> str | None:
    """Why the matrix's `host` cannot be used as it stands, or None."""
    if binds_every_interface(host) and not opted_in:
        return (
            f"{host!r} binds every interface: servers would answer anyone who can reach "
            f"this machine. Set {BIND_ALL_KEY}: true beside it to mean it, or bind "
            "127.0.0.1 (or `node` on a cluster)"
        )
    return None


def bind_all_warning(host: str) -> str | None:
    """The warning plan, run and the report give for a server bound to every interface."""
    if not binds_every_interface(host):
        return None
    return (
        f"servers bind every interface (host: {host!r}, {BIND_ALL_KEY}: true): anyone who "
        "can reach this machine can use them while the run lasts"
    )


def _env_blocks(matrix: Any) -> Iterator[tuple[str, dict[str, str]]]:
    yield "engine.env", matrix.engine.env
    for kind in ("models", "topologies", "variants"):
        for i, block in enumerate(getattr(matrix, kind)):
            yield f"{kind}[{i}].env", block.env


def env_notes(matrix: Any) -> list[str]:
    """A note per variable of a matrix env that loads code into every server."""
    return [
        f"{where} sets {name}: every server of the cases it covers loads what it names"
        for where, env in _env_blocks(matrix)
        for name in sorted(env)
        if name in CODE_LOADING_ENV
    ]


def matrix_warnings(matrix: Any) -> list[str]:
    """What plan and run warn about: every interface bound, a Ray worker's variable set."""
    out = [w for w in [bind_all_warning(matrix.host)] if w]
    out += [
        f"{where} sets {name}: wherever Ray sets one, the server runs with the Ray "
        f"worker's {name} ({why}) instead"
        for where, env in _env_blocks(matrix)
        for name, why in RAY_WORKER_ENV.items()
        if name in env
    ]
    return out
