"""How the launcher asks Ray for a cluster: an embedded local Ray is a new one, whatever an
earlier `ray start` on the machine left in Ray's temp directory."""

from __future__ import annotations

import pytest

from orchestrator.cluster.launch import Launcher
from orchestrator.config.load import load_matrix


def _launcher(ray_address: str | None) -> Launcher:
    return Launcher(load_matrix("matrices/smoke.yaml"), ray_address=ray_address)


def test_local_ray_ignores_a_stale_cluster_file(tmp_path, monkeypatch):
    services = pytest.importorskip("ray._private.services")
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    # What a `ray start` whose cluster has since gone leaves behind (ray_current_cluster).
    (tmp_path / "ray_current_cluster").write_text("127.0.0.1:42657")
    kwargs = _launcher(None).init_kwargs({})
    assert services.canonicalize_bootstrap_address(kwargs["address"], str(tmp_path)) is None
    # Without an address Ray would join the dead cluster: the case the argument exists for.
    # (Ray resolves 127.0.0.1 to the machine's own address.)
    assert services.canonicalize_bootstrap_address(None, str(tmp_path)).endswith(":42657")


def test_an_address_given_is_joined_as_given(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    kwargs = _launcher("10.0.0.7:6379").init_kwargs({"py_modules": []})
    assert kwargs["address"] == "10.0.0.7:6379" and "object_store_memory" not in kwargs
    assert kwargs["runtime_env"] == {"py_modules": []}
