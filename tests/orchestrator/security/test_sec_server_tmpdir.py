"""The server's short TMPDIR (vLLM's IPC sockets live there) has a predictable name, so it
is used only when it is this user's own private folder: created 0700 when absent, refused
when it is a link, someone else's, or open to others."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from orchestrator.engines.vllm.server import run_dir_env, start_server


@pytest.fixture
def stand_in(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A case directory deep enough to get a TMPDIR stand-in, and the env naming it."""
    deep = tmp_path / ("d" * 70) / "case"
    env = {"PATH": os.environ["PATH"], **run_dir_env(deep)}
    tmp = Path(env["TMPDIR"])
    assert not tmp.is_relative_to(deep), "expected a stand-in outside the case directory"
    yield tmp, env
    if tmp.is_symlink() or tmp.is_file():
        tmp.unlink()
    elif tmp.is_dir():
        os.chmod(tmp, 0o700)
        for p in tmp.iterdir():
            p.unlink()
        tmp.rmdir()


def _start(env: dict[str, str], tmp_path: Path):
    return start_server(["true"], env, tmp_path / "logs" / "server.log")


def test_created_fresh_and_private(stand_in, tmp_path):
    tmp, env = stand_in
    assert _start(env, tmp_path).wait(timeout=30) == 0
    st = tmp.lstat()
    assert stat.S_ISDIR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o700
    assert st.st_uid == os.getuid()


def test_reused_when_it_is_our_own_private_folder(stand_in, tmp_path):
    tmp, env = stand_in
    tmp.mkdir(mode=0o700)
    assert _start(env, tmp_path).wait(timeout=30) == 0


@pytest.mark.parametrize("how", ["world-writable", "group-readable", "link", "file"])
def test_refused_when_prepared_by_someone(stand_in, tmp_path, how):
    tmp, env = stand_in
    if how == "link":
        (tmp_path / "theirs").mkdir(mode=0o700)
        tmp.symlink_to(tmp_path / "theirs")
    elif how == "file":
        tmp.write_text("")
    else:
        tmp.mkdir()
        os.chmod(tmp, 0o777 if how == "world-writable" else 0o750)
    with pytest.raises(ValueError) as err:
        _start(env, tmp_path)
    msg = str(err.value)
    assert str(tmp) in msg and "TMPDIR" in msg and "\n" not in msg, msg


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to give a folder to another user")
def test_refused_when_owned_by_another_user(stand_in, tmp_path):
    """At e3a37d8 a 0777 folder owned by another user became the server's TMPDIR."""
    tmp, env = stand_in
    tmp.mkdir()
    os.chmod(tmp, 0o700)
    os.chown(tmp, 65534, 65534)
    with pytest.raises(ValueError, match="uid 65534"):
        _start(env, tmp_path)
    os.chown(tmp, 0, 0)


def test_a_matrix_tmpdir_is_the_users_choice(tmp_path):
    # TMPDIR named by the matrix (here a shared 1777 folder) is used as given.
    env = {"PATH": os.environ["PATH"], "TMPDIR": "/tmp"}
    assert _start(env, tmp_path).wait(timeout=30) == 0
