"""Compile caches shared by the servers of one configuration, in one run and across runs.

vLLM compiles the model with torch.compile (Dynamo, then Inductor) at every start; the
artifacts are cached under ``VLLM_CACHE_ROOT`` and ``TORCHINDUCTOR_CACHE_DIR``, beside what
else vLLM derives once (its model-class inspection, a Python subprocess per architecture;
DeepGEMM's JIT kernels). A server whose cache holds its configuration's artifacts loads them
("Directly load AOT compilation from path ...") instead of compiling. Each case directory of
its own makes every start a cold one; this module points the servers of one configuration at
one folder under ``<cache root>/compile/<key>`` instead.

The key is a hash of what the server is: the model path, the topology (TP, DCP, MTP and its
acceptance), the passthrough args and the matrix's env (the variant's included), and the
fusedq tree's fingerprint. It groups, it does not guard: vLLM keys its own cache inside the
folder by its config, version and the source of every traced file, and Inductor by torch's
version and the graph, so a folder reused by a changed server recompiles rather than lies.
A matrix can keep each server's caches in its case directory instead (`engine.compile_cache:
case`); one that sets VLLM_CACHE_ROOT or TORCHINDUCTOR_CACHE_DIR itself keeps its choice.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from orchestrator.engines.vllm import compile_cache_env
from orchestrator.matrix import Case
from orchestrator.tinymodel import cache_root

SUBDIR = "compile"


def configuration_key(case: Case, model_path: str, fusedq_fingerprint: str | None) -> str:
    """16 hex digits naming the server configuration of `case` (not its variant's name, not
    the run): two servers with equal keys compile the same graphs."""
    what = {
        "model": model_path,
        "tp": case.tp,
        "dcp": case.dcp,
        "mtp": case.mtp,
        "mtp_acceptance": case.mtp_acceptance,
        "args": list(case.args),
        "env": dict(case.env),
        "fusedq": fusedq_fingerprint,
    }
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


def shared_dir(
    case: Case, model_path: str, fusedq_fingerprint: str | None, root: Path | None = None
) -> Path:
    """The configuration's cache folder: `<cache root>/compile/<key>`."""
    base = Path(root) if root is not None else cache_root() / SUBDIR
    return base / configuration_key(case, model_path, fusedq_fingerprint)


def shared_env(
    case: Case, model_path: str, fusedq_fingerprint: str | None, root: Path | None = None
) -> dict[str, str]:
    """The cache variables for `case`'s server, pointed at its configuration's folder; none
    that the matrix's env sets itself."""
    env = compile_cache_env(shared_dir(case, model_path, fusedq_fingerprint, root))
    return {k: v for k, v in env.items() if k not in case.env_dict}
