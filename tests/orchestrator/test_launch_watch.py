"""The launcher's process watch: what counts as a dead server (pure logic; Ray's answers are
stood in for, since the point is how each kind of answer is read)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from orchestrator.cluster import launch
from orchestrator.cluster.launch import Launcher, ServerHandle


class _Timeout(Exception):
    pass


class _ActorDied(Exception):
    pass


def _launcher(answer):
    """A Launcher whose Ray answers polls with `answer()` (a value, or an exception raised)."""
    lau = Launcher.__new__(Launcher)

    def get(ref, timeout):
        return ref()

    lau._ray = SimpleNamespace(get=get, exceptions=SimpleNamespace(GetTimeoutError=_Timeout))
    actor = SimpleNamespace(poll=SimpleNamespace(remote=lambda: answer))
    return lau, ServerHandle(case=None, actor=actor, placement_group=None)


def _raise(exc):
    def f():
        raise exc

    return f


def test_running_and_exited():
    lau, h = _launcher(lambda: None)
    assert lau.alive(h)
    lau, h = _launcher(lambda: -9)
    assert not lau.alive(h)
    assert lau.exit_code(h) == -9


def test_dead_actor_is_a_dead_server():
    lau, h = _launcher(_raise(_ActorDied("actor died")))
    assert not lau.alive(h)
    assert lau.exit_code(h) is None


def test_a_slow_answer_is_not_a_death_until_the_actor_is_silent_too_long():
    lau, h = _launcher(_raise(_Timeout()))
    assert lau.alive(h)  # one slow poll on a loaded node
    h.last_answer = time.monotonic() - launch.UNREACHABLE_S - 1
    assert not lau.alive(h)


def test_an_answer_resets_the_silence_clock():
    lau, h = _launcher(lambda: None)
    h.last_answer = time.monotonic() - launch.UNREACHABLE_S - 1
    assert lau.alive(h)
    assert time.monotonic() - h.last_answer < 1


def test_watch_limits_are_sane():
    # A death must still be noticed within 5 s: the poll limit bounds that.
    assert launch.POLL_TIMEOUT_S <= 5 < launch.UNREACHABLE_S
