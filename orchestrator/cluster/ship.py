"""What travels to every Ray worker, and the check that it arrived.

fusedq (and the orchestrator, which holds the server actor's code) travel through the Ray
runtime environment (`py_modules`): the driver stages a metadata-only dist-info beside them so
vLLM finds fusedq's plugin entry points on a node without fusedq installed, and fingerprints
each package's source. On the node, the server actor probes what a server process there will
import (`probe_server_view`); the driver holds that fingerprint against its own.

A staging directory is named with the driver's pid, so a later run removes what a SIGKILLed
one left behind (`remove_stale_stages`).
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from orchestrator.common import processes

_STAGE_PREFIX = "orch-ship-"


def package_dir(name: str) -> Path | None:
    """Directory of an importable package, found without importing it (fusedq imports torch);
    None when it is not importable."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def write_dist_info(stage: Path, name: str) -> Path | None:
    """A metadata-only ``<name>-<version>.dist-info`` carrying the package's entry points.

    Ray's ``py_modules`` makes a package importable on the workers but not *installed*: vLLM
    finds plugins through ``importlib.metadata`` entry points, so the shipped fusedq would be
    invisible to it on a node without fusedq installed. This directory, shipped as one more
    ``py_modules`` entry, puts the driver's entry points (and version) on the workers' path.
    """
    try:
        dist = md.distribution(name)
    except md.PackageNotFoundError:
        return None
    version = dist.version
    info = stage / f"{name}-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    eps = dist.read_text("entry_points.txt") or ""
    (info / "entry_points.txt").write_text(eps)
    (info / "INSTALLER").write_text("orchestrator (ray py_modules)\n")
    return info


def _dist_location(name: str) -> str | None:
    """Where importlib.metadata finds a distribution (the shipped dist-info wins on PYTHONPATH)."""
    try:
        return str(md.distribution(name).locate_file(""))
    except md.PackageNotFoundError:
        return None


def tree_fingerprint(root: Path) -> str:
    """sha256 over the package's .py files (path and bytes): equal fingerprints, equal code."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        if "__pycache__" in path.parts:
            continue
        h.update(str(path.relative_to(root)).encode())
        h.update(b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()[:16]


def new_stage() -> Path:
    """A new staging directory for the dist-info shipped beside the packages; those of
    orchestrators that no longer run are removed on the way."""
    # Named with the pid, so a later run can remove what a SIGKILLed one left behind.
    stage = Path(tempfile.mkdtemp(prefix=f"{_STAGE_PREFIX}{os.getpid()}-"))
    remove_stale_stages(stage.parent)
    return stage


def remove_stale_stages(tmp: Path) -> None:
    """Remove staging directories whose orchestrator no longer runs (a SIGKILL skips
    __exit__); a live pid's directory is kept, even if the pid was recycled."""
    for stage in tmp.glob(f"{_STAGE_PREFIX}*-*"):
        pid = stage.name[len(_STAGE_PREFIX) :].split("-", 1)[0]
        # A live pid's directory is kept, another user's included (pid_alive holds for it).
        if pid.isdigit() and not processes.pid_alive(int(pid)):
            shutil.rmtree(stage, ignore_errors=True)


_PROBE = """
import importlib.metadata as md, importlib.util, json
from pathlib import Path
from orchestrator.cluster.ship import _dist_location, tree_fingerprint
spec = importlib.util.find_spec("fusedq")
d = Path(next(iter(spec.submodule_search_locations))) if spec else None
print(json.dumps({
    "fusedq_path": str(d) if d else None,
    "fusedq_fingerprint": tree_fingerprint(d) if d else None,
    "fusedq_metadata_from": _dist_location("fusedq"),
    "vllm_plugins": sorted(
        f"{e.name}={e.value}" for e in md.entry_points(group="vllm.general_plugins")
    ),
}))
"""


def probe_server_view() -> dict[str, Any]:
    """What a server process the calling actor starts will import: probed in a child with
    the same interpreter and environment, from a neutral directory (the actor's own sys.path
    may hold the driver's working directory, which the server's does not)."""
    out = subprocess.run(
        [sys.executable, "-c", _PROBE],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tempfile.gettempdir(),
        env=dict(os.environ),
    )
    if out.returncode != 0:
        return {"probe_error": out.stderr.strip()[-2000:]}
    return json.loads(out.stdout.strip().splitlines()[-1])
