"""fusedq.provenance: code fingerprints that ignore prose, and the commit of a tree that
was copied with a stale .git or none (real git repositories in tmp_path)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fusedq import provenance

REPO = Path(__file__).resolve().parents[2]

MODULE = '''"""A kernel module."""

SCALE = 2  # why: a measured choice


def f(x):
    """Doubles."""
    return x * SCALE
'''


def test_code_digest_ignores_comments_docstrings_and_layout():
    base = provenance.code_digest(MODULE)
    prose = MODULE.replace("A kernel module.", "Reworded, at length.").replace(
        "# why: a measured choice", "# another reason"
    )
    layout = MODULE.replace("return x * SCALE", "return (\n        x * SCALE\n    )")
    assert provenance.code_digest(prose) == base
    assert provenance.code_digest(layout) == base
    assert provenance.code_digest(MODULE.replace("SCALE = 2", "SCALE = 3")) != base
    # A string that is not a docstring is code.
    assert provenance.code_digest(MODULE + "NAME = 'x'\n") != base


def _tree(root: Path) -> Path:
    for name in provenance.PRODUCT_PACKAGES:
        pkg = root / name
        (pkg / "kernels").mkdir(parents=True)
        (pkg / "__init__.py").write_text('"""Package."""\n')
        (pkg / "kernels" / "k.py").write_text(MODULE)
    (root / "orchestrator" / "signatures.yaml").write_text("a: 1\n")
    return root


def test_fingerprints_follow_code_and_data_not_prose(tmp_path):
    root = _tree(tmp_path)
    base = provenance.fingerprints(root)
    kernel = root / "fusedq" / "kernels" / "k.py"
    kernel.write_text(MODULE.replace("Doubles.", "Returns twice x."))
    (root / "fusedq" / "__pycache__").mkdir()
    (root / "fusedq" / "__pycache__" / "k.cpython-311.pyc").write_bytes(b"\0")
    (root / "fusedq" / "build_info.json").write_text("{}")  # the stamp is not code
    assert provenance.fingerprints(root) == base
    kernel.write_text(MODULE.replace("x * SCALE", "x + SCALE"))
    changed = provenance.fingerprints(root)
    assert changed["fusedq"] != base["fusedq"] and changed["product"] != base["product"]
    kernel.write_text(MODULE)
    (root / "orchestrator" / "signatures.yaml").write_text("a: 2\n")
    data = provenance.fingerprints(root)
    assert data["fusedq"] == base["fusedq"] and data["product"] != base["product"]


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@t", *args],
        cwd=root, check=True, capture_output=True, text=True,
    )  # fmt: skip
    return done.stdout.strip()


def _repo(tmp_path: Path) -> Path:
    root = _tree(tmp_path / "repo")
    _git(root, "init", "-q")
    _git(root, "add", ".")
    _git(root, "commit", "-qm", "one")
    return root


def _copy(src: Path, dst: Path, git_dir: Path | None = None) -> Path:
    """What a GPU host receives: the working tree, without .git or with an older one."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns(".git"))
    if git_dir is not None:
        shutil.copytree(git_dir, dst / ".git")
    return dst


def test_a_clean_checkout_is_named_by_git(tmp_path):
    root = _repo(tmp_path)
    info = provenance.describe(root, root / "fusedq" / "build_info.json")
    assert info["source"] == "git" and info["commit"] == _git(root, "rev-parse", "HEAD")
    assert info["dirty"] is False and provenance.commit_label(info) == info["commit"]
    assert info["product_fingerprint"] == provenance.fingerprints(root)["product"]


@pytest.mark.parametrize("edit", ["tracked", "untracked"])
def test_a_dirty_checkout_says_so(tmp_path, edit):
    root = _repo(tmp_path)
    if edit == "tracked":
        (root / "fusedq" / "kernels" / "k.py").write_text(MODULE.replace("2", "3"))
    else:
        (root / "fusedq" / "kernels" / "new.py").write_text("X = 1\n")
    info = provenance.describe(root, root / "fusedq" / "build_info.json")
    assert info["source"] == "git" and info["dirty"] is True
    assert provenance.commit_label(info).endswith("+dirty")


def test_a_stamp_names_a_copy_without_git(tmp_path):
    root = _repo(tmp_path)
    head = _git(root, "rev-parse", "HEAD")
    written = provenance.stamp(root, root / "fusedq" / "build_info.json")
    assert written["commit"] == head and written["dirty"] is False
    copy = _copy(root, tmp_path / "copy")
    info = provenance.describe(copy, copy / "fusedq" / "build_info.json")
    assert (info["source"], info["commit"], info["dirty"]) == ("stamp", head, False)
    # A prose edit on the copy keeps the stamp valid; a code edit makes it stale.
    kernel = copy / "fusedq" / "kernels" / "k.py"
    kernel.write_text("# a note\n" + MODULE)
    assert provenance.describe(copy, copy / "fusedq" / "build_info.json")["commit"] == head
    kernel.write_text(MODULE.replace("x * SCALE", "x - SCALE"))
    stale = provenance.describe(copy, copy / "fusedq" / "build_info.json")
    assert (stale["source"], stale["commit"]) == ("none", None)
    assert stale["stale_stamp"]["commit"] == head
    assert provenance.commit_label(stale) == "unknown"


def test_a_stamp_beats_a_stale_git_head(tmp_path):
    root = _repo(tmp_path)
    old_head = _git(root, "rev-parse", "HEAD")
    old_git = tmp_path / "old.git"
    shutil.copytree(root / ".git", old_git)
    (root / "fusedq" / "kernels" / "k.py").write_text(MODULE.replace("2", "4"))
    _git(root, "commit", "-qam", "two")
    new_head = _git(root, "rev-parse", "HEAD")
    (root / "orchestrator" / "kernels" / "k.py").write_text(MODULE.replace("2", "5"))
    written = provenance.stamp(root, root / "fusedq" / "build_info.json")
    assert written["dirty"] is True and written["dirty_files"] == ["orchestrator/kernels/k.py"]
    copy = _copy(root, tmp_path / "copy", git_dir=old_git)
    assert provenance.git_commit(copy)["commit"] == old_head  # what git alone would say
    info = provenance.describe(copy, copy / "fusedq" / "build_info.json")
    assert (info["source"], info["commit"], info["dirty"]) == ("stamp", new_head, True)
    assert info["dirty_files"] == ["orchestrator/kernels/k.py"]
    assert provenance.commit_label(info) == new_head + "+dirty"


def test_stamp_refuses_a_tree_without_git(tmp_path):
    root = _tree(tmp_path / "plain")
    with pytest.raises(provenance.ProvenanceError, match="not a git checkout"):
        provenance.stamp(root, root / "fusedq" / "build_info.json")
    assert not (root / "fusedq" / "build_info.json").exists()


def test_show_prints_this_trees_provenance():
    done = subprocess.run(
        [sys.executable, "-m", "fusedq.provenance", "show"],
        cwd=REPO, capture_output=True, text=True, check=True,
    )  # fmt: skip
    shown = json.loads(done.stdout)
    assert shown["product_fingerprint"] == provenance.fingerprints()["product"]
    assert shown["fusedq_fingerprint"] == provenance.fingerprints()["fusedq"]


def test_the_stamp_is_never_committed():
    if not (REPO / ".git").exists():
        pytest.skip("not a git checkout")
    rel = provenance.BUILD_INFO.relative_to(REPO).as_posix()
    tracked = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "--", rel], capture_output=True, text=True
    ).stdout
    assert tracked == "", f"{rel} is committed: a stamp names the tree it was written in"
