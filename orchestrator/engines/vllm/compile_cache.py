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

One part of vLLM's cache is no configuration's: the model-class inspections
(``VLLM_CACHE_ROOT/modelinfos``, one JSON file per class, checked by vLLM against a hash of
the class's source). Each costs a subprocess that imports torch and vLLM, ~11 s on a 2-core
CPU and more on a cold GPU host, twice per start with MTP (target and draft). vLLM's own
default shares them among all its servers; a folder per configuration would make every new
configuration pay again, so each configuration's ``modelinfos`` is a link to one folder beside
the configurations' (``share_model_info``).

Inductor's cache is no configuration's either: its FX graph cache keys every entry by the
graph, its inputs and torch's version, a content address any server can share. vLLM compiles
more than the model with Inductor: the sampler's logprobs gather is compiled at a server's
first request for logprobs, even with ``--enforce-eager`` (18.2 s of that request on the
2-core CPU, 2.0 s with the graph cached). So every configuration's ``TORCHINDUCTOR_CACHE_DIR``
is one folder beside theirs (``inductor_dir``): a graph is compiled once per machine. One per
CPU instruction set, though: Inductor's key leaves out the one its C++ code targets, and a
graph a TP2 server had cached on AVX-512, loaded by a server capped at AVX2
(``ATEN_CPU_CAPABILITY``), fed its vocabulary-parallel embedding an id out of range. A cache
root shared by machines of two kinds (a home directory on NFS) keeps their code apart
(docs/decisions/0018-one-inductor-cache-per-isa.md).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from pathlib import Path

from orchestrator.config.expand import Case
from orchestrator.engines.vllm.server import compile_cache_env
from orchestrator.models.tinymodel import cache_root

SUBDIR = "compile"
# Inductor's cache, shared by every configuration on one instruction set (module docstring).
INDUCTOR = "inductor"
# vLLM's folder of model-class inspections under VLLM_CACHE_ROOT (vllm/model_executor/models/
# registry.py, _LazyRegisteredModel._get_cache_dir); shared by every configuration.
MODEL_INFO = "modelinfos"


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


def inductor_dir(root: Path | None = None, isa: str | None = None) -> Path:
    """Inductor's cache folder of every configuration on this instruction set (``cpu_isa``):
    `<cache root>/compile/inductor-<isa>`."""
    base = Path(root) if root is not None else cache_root() / SUBDIR
    return (base / f"{INDUCTOR}-{isa or cpu_isa()}").absolute()


# x86 flags of AVX-512 as torch requires them for its AVX512 kernels (cpuinfo's avx512 check).
_AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq"}


def cpu_isa(environ: dict[str, str] | None = None, cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The instruction set torch's and Inductor's CPU code targets here: ATEN_CPU_CAPABILITY
    where it is set (torch caps both at it), else the widest the CPU's flags offer
    (``avx512``, ``avx2``), else ``default``. Read without importing torch."""
    env = os.environ if environ is None else environ
    if env.get("ATEN_CPU_CAPABILITY"):
        return env["ATEN_CPU_CAPABILITY"].lower()
    try:
        text = cpuinfo.read_text()
    except OSError:
        return "default"
    flags = next(
        (ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []
    )
    if set(flags) >= _AVX512:
        return "avx512"
    return "avx2" if "avx2" in flags else "default"


def shared_env(
    case: Case, model_path: str, fusedq_fingerprint: str | None, root: Path | None = None
) -> dict[str, str]:
    """The cache variables for `case`'s server: vLLM's pointed at its configuration's folder,
    Inductor's at the folder every configuration shares; none that the matrix's env sets
    itself."""
    env = compile_cache_env(shared_dir(case, model_path, fusedq_fingerprint, root))
    env["TORCHINDUCTOR_CACHE_DIR"] = str(inductor_dir(root))
    return {k: v for k, v in env.items() if k not in case.env_dict}


def share_model_info(vllm_cache_root: Path, root: Path | None = None) -> Path | None:
    """Make `vllm_cache_root`'s model-class inspections one folder shared by every
    configuration (`<cache root>/compile/modelinfos`): a link, created before the server
    starts. A real folder already there (a cache from before the link) is left as it is.
    Returns the link, or None where there is none."""
    base = Path(root) if root is not None else cache_root() / SUBDIR
    shared = base / MODEL_INFO
    shared.mkdir(parents=True, exist_ok=True)
    link = Path(vllm_cache_root) / MODEL_INFO
    link.parent.mkdir(parents=True, exist_ok=True)
    if not os.path.lexists(link):
        # FileExistsError: another run on this cache made it meanwhile.
        with contextlib.suppress(FileExistsError):
            link.symlink_to(shared.absolute(), target_is_directory=True)
    return link if link.is_symlink() else None


def prepare_shared(
    case: Case, model_path: str, fusedq_fingerprint: str | None, root: Path | None = None
) -> tuple[dict[str, str], Path | None]:
    """`shared_env` for `case`'s server, its model-class inspections already linked to every
    configuration's (`share_model_info`), and its configuration's folder (None where the
    matrix's env sets every cache variable itself)."""
    shared = shared_env(case, model_path, fusedq_fingerprint, root)
    folder = shared_dir(case, model_path, fusedq_fingerprint, root) if shared else None
    if "VLLM_CACHE_ROOT" in shared:
        share_model_info(Path(shared["VLLM_CACHE_ROOT"]), root)
    return shared, folder
