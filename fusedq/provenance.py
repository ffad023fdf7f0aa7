"""Which code produced a figure: the commit, and fingerprints of the code itself.

A figure (a run's manifest, a ``fusedq-bench`` JSON, a GPU test record) names its code in two
ways, because a tree copied to a GPU host often carries an old ``.git`` or none:

- **fingerprints** of the product tree (``orchestrator`` + ``fusedq`` + ``fusedq_bench``) and
  of ``fusedq`` alone, computed from the files that run. Python modules count by their syntax
  tree with docstrings removed (comments and layout never reach it), so an edit to prose leaves
  a fingerprint as it was and an edit to code changes it; the orchestrator's data files (fault
  catalogue, report templates) count by their bytes.
- **the commit**: from git where the tree is a clean checkout; otherwise from the build-info
  stamp (``python -m fusedq.provenance stamp``, written by ``scripts/wheelhouse.py
  build`` too), which holds the commit, whether the tree was dirty, and the product
  fingerprint at stamping time. A stamp counts only while the tree still has that fingerprint,
  so a stamp left behind by an older tree never names the wrong commit.

    python -m fusedq.provenance stamp     # before copying a tree to a GPU host
    python -m fusedq.provenance show      # what a run or a bench would record here
    python -m fusedq.provenance clear     # remove the stamp
"""

from __future__ import annotations

import argparse
import ast
import datetime as dt
import hashlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

# Stdlib only and no import from either package: the orchestrator imports it (fusedq's
# __init__ is lazy) and `orchestrator plan` still never imports torch; fusedq's bench imports
# it too -- one home for both, and no import cycle.

PACKAGES_ROOT = Path(__file__).resolve().parent.parent
PRODUCT_PACKAGES = ("orchestrator", "fusedq", "fusedq_bench")
# The kernel tree, the GPU test record's key (scripts/gpu_record.py): the fusedq package but
# its vLLM integration (this subpackage, proved on GPUs by the GPU vLLM runs) and this module
# (which names code, and computes nothing of the query).
NOT_KERNEL_SUBPACKAGES = ("vllm",)
# Inside the fusedq package so that it travels with a copied tree and inside the project's
# wheel (package data); it is not git-ignored for the same reason, and must never
# be committed (a test checks).
BUILD_INFO = Path(__file__).resolve().parent / "build_info.json"
# One git call may not hold a run or a bench for long (a wedged filesystem, a huge tree).
GIT_TIMEOUT_S = 10
# Non-Python files whose bytes decide what the product does (the audit's fault catalogue, the
# report templates).
DATA_SUFFIXES = (".yaml", ".j2")


class ProvenanceError(RuntimeError):
    """A stamp that cannot be written (no git checkout to read the commit from)."""


# --------------------------------------------------------------------------- fingerprints


def _strip_docstrings(tree: ast.AST) -> ast.AST:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
            and isinstance(body[0].value.value, str)
        ):
            node.body = body[1:]
    return tree


def _canonical(node: Any) -> Any:
    """The syntax tree as plain data, leaving out empty and absent fields: Python 3.12 added
    fields (``type_params``) that are empty in this code, so 3.11 and 3.12 agree."""
    if isinstance(node, ast.AST):
        fields = []
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or value == []:
                continue
            fields.append((name, _canonical(value)))
        return (type(node).__name__, fields)
    if isinstance(node, list):
        return [_canonical(v) for v in node]
    return repr(node)


def code_digest(source: str, filename: str = "<source>") -> str:
    """sha256 of a module's code: its syntax tree without docstrings, comments or layout."""
    tree = _strip_docstrings(ast.parse(source, filename=filename))
    return hashlib.sha256(repr(_canonical(tree)).encode()).hexdigest()


def package_fingerprint(
    package_dir: Path, exclude_dirs: tuple[str, ...] = (), exclude_files: tuple[str, ...] = ()
) -> str:
    """16 hex digits over a package's modules (path and code digest) and data files (path and
    bytes): equal for two trees whose code is equal. ``exclude_dirs``: subpackages (``"vllm"``)
    left out, whatever they hold; ``exclude_files``: modules at the package's top left out."""
    h = hashlib.sha256()
    files = sorted(
        p
        for p in package_dir.rglob("*")
        if p.is_file()
        and "__pycache__" not in p.parts
        and (p.suffix == ".py" or p.suffix in DATA_SUFFIXES)
        and p.relative_to(package_dir).parts[0] not in exclude_dirs
        and p.relative_to(package_dir).as_posix() not in exclude_files
    )
    for path in files:
        rel = path.relative_to(package_dir.parent).as_posix()
        if path.suffix == ".py":
            digest = code_digest(path.read_text(encoding="utf-8"), rel)
        else:
            digest = hashlib.sha256(path.read_bytes()).hexdigest()
        h.update(f"{rel}\0{digest}\n".encode())
    return h.hexdigest()[:16]


def fingerprints(root: Path = PACKAGES_ROOT) -> dict[str, str]:
    """``{"product": ..., "fusedq": ...}``: the whole product tree and the kernel package."""
    h = hashlib.sha256()
    for name in PRODUCT_PACKAGES:
        h.update(f"{name}\0{package_fingerprint(root / name)}\n".encode())
    return {"product": h.hexdigest()[:16], "fusedq": package_fingerprint(root / "fusedq")}


def kernel_tree_fingerprint(root: Path = PACKAGES_ROOT) -> str:
    """The fusedq kernel tree's code fingerprint: every module that decides or computes the
    query, without the subpackages of NOT_KERNEL_SUBPACKAGES or this module."""
    return package_fingerprint(
        root / "fusedq",
        exclude_dirs=NOT_KERNEL_SUBPACKAGES,
        exclude_files=(Path(__file__).name,),
    )


# --------------------------------------------------------------------------- commit


def _git(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``git -C root ARGS``; a git that cannot run answers like a failed command."""
    try:
        return subprocess.run(
            ["git", "-C", str(root), *args],
            capture_output=True,
            text=True,
            errors="replace",
            timeout=GIT_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as exc:
        return subprocess.CompletedProcess(["git", *args], 127, "", str(exc))


def git_commit(root: Path = PACKAGES_ROOT) -> dict[str, Any]:
    """``{"commit": HEAD, "dirty": whether tracked files differ}`` of the checkout at ``root``
    (both None outside a git checkout) -- what git alone says; ``describe`` weighs it against
    the build-info stamp."""
    head = _git(root, "rev-parse", "HEAD")
    if head.returncode:
        return {"commit": None, "dirty": None}
    status = _git(root, "status", "--porcelain", "--untracked-files=no")
    return {"commit": head.stdout.strip(), "dirty": bool(status.stdout.strip())}


def _git_state(root: Path) -> dict[str, Any]:
    """git's commit and dirtiness of ``root`` when ``root`` is itself a checkout (an installed
    wheel inside some other repository's venv must not report that repository's HEAD)."""
    if not (root / ".git").exists():
        return {"commit": None, "dirty": None}
    state = git_commit(root)
    if state["commit"] and not state["dirty"] and _untracked_code(root):
        state["dirty"] = True
    return state


def _untracked_code(root: Path) -> list[str]:
    """Product files git does not track: code that runs but that no commit holds."""
    proc = _git(root, "ls-files", "--others", "--exclude-standard", "--", *PRODUCT_PACKAGES)
    return [
        f
        for f in proc.stdout.splitlines()
        if f.endswith((".py", *DATA_SUFFIXES)) and proc.returncode == 0
    ]


def _dirty_files(root: Path) -> list[str]:
    proc = _git(root, "status", "--porcelain", "--untracked-files=no")
    changed = [line[3:] for line in proc.stdout.splitlines() if line.strip()]
    return changed + [f"{f} (untracked)" for f in _untracked_code(root)]


def read_stamp(path: Path = BUILD_INFO) -> dict[str, Any] | None:
    if not path.is_file():
        return None
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def describe(root: Path = PACKAGES_ROOT, stamp_path: Path = BUILD_INFO) -> dict[str, Any]:
    """What a figure records about its code.

    ``commit`` and ``dirty`` come from git when the tree is a clean checkout (``source:
    "git"``), else from a stamp whose product fingerprint equals the tree's (``"stamp"``),
    else from git's HEAD of a dirty tree (``"git"``, ``dirty: true``: the HEAD may be a stale
    copy's), else nothing (``"none"``). ``stamp`` says what a stamp that did not count held.
    """
    prints = fingerprints(root)
    git = _git_state(root)
    stamp = read_stamp(stamp_path)
    out: dict[str, Any] = {
        "commit": None,
        "dirty": None,
        "source": "none",
        "product_fingerprint": prints["product"],
        "fusedq_fingerprint": prints["fusedq"],
    }
    stamp_fits = bool(stamp) and stamp.get("product_fingerprint") == prints["product"]
    if git["commit"] and git["dirty"] is False:
        out.update(commit=git["commit"], dirty=False, source="git")
    elif stamp_fits:
        out.update(commit=stamp.get("commit"), dirty=stamp.get("dirty"), source="stamp")
        if stamp.get("dirty_files"):
            out["dirty_files"] = stamp["dirty_files"]
    elif git["commit"]:
        out.update(commit=git["commit"], dirty=True, source="git")
    if stamp and not stamp_fits:
        out["stale_stamp"] = {
            "commit": stamp.get("commit"),
            "product_fingerprint": stamp.get("product_fingerprint"),
        }
    return out


def commit_label(info: dict[str, Any]) -> str:
    """``<commit>``, ``<commit>+dirty`` or ``unknown``: the one-word form a bench row carries."""
    if not info.get("commit"):
        return "unknown"
    return info["commit"] + ("+dirty" if info.get("dirty") else "")


def stamp(root: Path = PACKAGES_ROOT, path: Path = BUILD_INFO) -> dict[str, Any]:
    """Write the build-info stamp of a git checkout; returns what was written."""
    git = _git_state(root)
    if not git["commit"]:
        raise ProvenanceError(f"{root}: not a git checkout (git rev-parse HEAD failed)")
    prints = fingerprints(root)
    info: dict[str, Any] = {
        "commit": git["commit"],
        "dirty": bool(git["dirty"]),
        "product_fingerprint": prints["product"],
        "fusedq_fingerprint": prints["fusedq"],
        "stamped_at": dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if git["dirty"]:
        info["dirty_files"] = _dirty_files(root)
    path.write_text(json.dumps(info, indent=1) + "\n", encoding="utf-8")
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m fusedq.provenance", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("command", choices=("stamp", "show", "clear"))
    args = parser.parse_args(argv)
    if args.command == "stamp":
        try:
            info = stamp()
        except ProvenanceError as exc:
            print(f"provenance: {exc}", file=sys.stderr)
            return 2
        dirty = f", dirty: {', '.join(info['dirty_files'])}" if info["dirty"] else ""
        print(f"wrote {BUILD_INFO}: {info['commit']}{dirty}, product {info['product_fingerprint']}")
    elif args.command == "show":
        print(json.dumps(describe(), indent=1))
    else:
        BUILD_INFO.unlink(missing_ok=True)
        print(f"removed {BUILD_INFO}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
