"""fusedq_dummy, the load format of checkpoint-MXFP8 stand-ins: vLLM's dummy weights, then
every E8M0 scale set to 2^0 (fusedq/vllm/standin_loader.py)."""

from __future__ import annotations

import types

import pytest
import torch

from fusedq.vllm import standin_loader
from orchestrator.models import standins


class MXLinear(torch.nn.Module):
    """A linear layer as vLLM's ModelOpt MXFP8 method builds it: E4M3 values, uint8 scales."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(
            torch.zeros(64, 64, dtype=torch.float8_e4m3fn), requires_grad=False
        )
        self.weight_scale = torch.nn.Parameter(
            torch.full((64, 2), 0xFF, dtype=torch.uint8), requires_grad=False
        )


class Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = MXLinear()
        self.norm = torch.nn.Parameter(torch.ones(64), requires_grad=False)
        self.experts = torch.nn.Module()
        self.experts.w13_weight_scale = torch.nn.Parameter(
            torch.full((2, 8, 2), 0xFF, dtype=torch.uint8), requires_grad=False
        )
        self.token_ids = torch.nn.Parameter(  # uint8, but no scale: left as it is
            torch.full((4,), 7, dtype=torch.uint8), requires_grad=False
        )


def test_every_e8m0_scale_becomes_two_to_the_zero():
    model = Model()
    assert standin_loader.fill_e8m0_scales(model) == 2
    assert torch.all(model.proj.weight_scale == 127)
    assert torch.all(model.experts.w13_weight_scale == 127)
    assert torch.all(model.token_ids == 7) and torch.all(model.norm == 1)
    if hasattr(torch, "float8_e8m0fnu"):  # the scale dtype some kernels keep
        model.proj.weight_scale.data = torch.zeros(64, 2, dtype=torch.float8_e8m0fnu)
        assert standin_loader.fill_e8m0_scales(model) == 2
        assert torch.all(model.proj.weight_scale.data.view(torch.uint8) == 127)


def test_the_load_format_is_added_only_where_asked(monkeypatch):
    loaders = pytest.importorskip("vllm.model_executor.model_loader")
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader

    monkeypatch.delitem(loaders._LOAD_FORMAT_TO_MODEL_LOADER, "fusedq_dummy", raising=False)
    monkeypatch.delenv(standin_loader.ENABLE_ENV, raising=False)
    standin_loader.register()
    assert "fusedq_dummy" not in loaders._LOAD_FORMAT_TO_MODEL_LOADER
    monkeypatch.setenv(standin_loader.ENABLE_ENV, "1")
    standin_loader.register()
    first = loaders._LOAD_FORMAT_TO_MODEL_LOADER["fusedq_dummy"]
    standin_loader.register()  # every vLLM process calls it, some more than once
    assert loaders._LOAD_FORMAT_TO_MODEL_LOADER["fusedq_dummy"] is first
    loader = loaders.get_model_loader(LoadConfig(load_format="fusedq_dummy"))
    assert isinstance(loader, DummyModelLoader)
    # Its load_weights: vLLM's dummy values first, then the scales.
    model = Model()
    loader.load_weights(model, types.SimpleNamespace(seed=0))
    assert torch.all(model.proj.weight_scale == 127)
    assert not torch.all(model.norm == 1)  # dummy values, as vLLM's loader gives them


def test_the_orchestrator_serves_checkpoint_stand_ins_with_it():
    assert standins.CHECKPOINT_LOAD_FORMAT == standin_loader.LOAD_FORMAT
    assert standins.CHECKPOINT_LOADER_ENV == standin_loader.ENABLE_ENV
    args, env = standins.serve_defaults("mxfp8-checkpoint")
    assert args == ["--load-format=fusedq_dummy"] and env[standin_loader.ENABLE_ENV] == "1"
    assert standins.serve_defaults("mxfp8")[0] == ["--load-format=dummy", "--quantization=mxfp8"]
    assert standin_loader.ENABLE_ENV not in standins.serve_defaults("bf16")[1]
