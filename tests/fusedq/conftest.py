"""Shared set-up for the fusedq tests. Without CUDA the kernels run in Triton's interpreter on
CPU tensors; tests/conftest.py (the root one, loaded before any test module) sets it."""

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    if HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if HAS_CUDA else "cpu")


# The vLLM plugin's fixtures (test_vllm_plugin.py, test_vllm_worker_ext.py).


@pytest.fixture
def mla():
    """vLLM's mla_attention module, restored to its unpatched state after the test."""
    module = pytest.importorskip("vllm.model_executor.layers.attention.mla_attention")
    from vllm.model_executor.layers import mla as wrapper_module

    from fusedq.vllm import (
        backends,
        front_hook,
        front_patch,
        layer_plan,
        patch,
        releases,
        report,
        switch,
    )

    cls = module.MLAAttention
    wrapper = wrapper_module.MultiHeadLatentAttentionWrapper
    names = ("__init__", "forward", "forward_impl", "process_weights_after_loading")
    saved = {k: cls.__dict__[k] for k in names}
    saved_wrapper = {k: wrapper.__dict__[k] for k in ("__init__", "forward")}
    from vllm.config.compilation import CompilationConfig

    splitting = list(CompilationConfig._attention_ops)  # the front's install appends to it
    yield module
    CompilationConfig._attention_ops[:] = splitting
    for k, v in saved.items():
        setattr(cls, k, v)
    for k, v in saved_wrapper.items():
        setattr(wrapper, k, v)
    for c, mark in ((cls, patch.PATCH_MARK), (cls, front_patch.PATCH_MARK), (wrapper, front_patch.PATCH_MARK)):  # fmt: skip
        if mark in c.__dict__:
            delattr(c, mark)
    module.__dict__.pop(patch.HOOK_NAME, None)
    module.__dict__.pop(front_patch.FRONT_HOOK, None)
    wrapper_module.__dict__.pop(front_patch.POSITIONS_HOOK, None)
    front_hook.front_report.clear()
    releases.installed.clear()
    switch.first_use.clear()
    r = report.worker_report
    r.first = r.refused = r.kernels = None
    r.seen.clear()
    switch.path_switch.path = "fused"
    layer_plan.set_up_layers.clear()
    backends._type_test.cache_clear()


# The recorded real-server runs test_vllm_plugin.py and test_vllm_worker_ext.py both read: each
# server starts once for both (tests/lanes.py keeps the two modules on one lane), is asked
# everything their tests check, and is stopped before they run.


@pytest.fixture(scope="session")
def switch_server(tmp_path_factory):
    """tiny_vllm.record_switch_server: TP1, fused at start, then flipped over the RPC."""
    pytest.importorskip("vllm")
    import tiny_vllm

    return tiny_vllm.record_switch_server(tmp_path_factory.mktemp("switch-server"))


@pytest.fixture(scope="session")
def tp2_server(tmp_path_factory):
    """tiny_vllm.record_tp2_server: TP2, 4 heads per rank, the plugin declining per worker."""
    pytest.importorskip("vllm")
    import tiny_vllm

    return tiny_vllm.record_tp2_server(tmp_path_factory.mktemp("tp2-server"))
