"""A vLLM load format for stand-ins in a checkpoint MXFP8 format: vLLM's dummy weights, then
valid E8M0 scales.

A stand-in has no checkpoint: it is served with vLLM's dummy loader (random weights). A config
whose ``quantization_config`` names ModelOpt's MXFP8 format makes vLLM build each quantised
linear layer with E4M3 values and ``uint8`` E8M0 scales, and the dummy loader fills only
floating-point tensors: the scales keep whatever bytes ``torch.empty`` left (0xFF is NaN).
``fusedq_dummy`` is the dummy loader plus one step before vLLM post-processes the weights:
every E8M0 scale tensor (named ``*weight_scale``) becomes 127 (``E8M0_BIAS``), the scale 2^0, so each weight
dequantises to its dummy E4M3 value. The fused query's MXFP8 watch then snapshots real
checkpoint-layout values and scales, as it would on a real checkpoint.

vLLM calls ``register`` (entry point ``vllm.general_plugins: fusedq_standin``) in every process
it starts, whatever ``FUSEDQ_MLA_QUERY`` says: a staged server loads the same stand-in. It adds
the load format only where ``FUSEDQ_STANDIN_LOADER=1`` (the orchestrator sets it for these
stand-ins), so every other server imports nothing more; nothing is patched.
"""

from __future__ import annotations

import os

import torch

from fusedq.mxfp8 import E8M0_BIAS

# The --load-format name (orchestrator.models.standins serves checkpoint-MXFP8 stand-ins with it)
# and the variable that has register() add it.
LOAD_FORMAT = "fusedq_dummy"
ENABLE_ENV = "FUSEDQ_STANDIN_LOADER"
# The names vLLM gives MXFP8 scale tensors: a linear layer's weight_scale, an MoE's
# w13_weight_scale / w2_weight_scale.
SCALE_SUFFIX = "weight_scale"


@torch.no_grad()
def fill_e8m0_scales(model: torch.nn.Module) -> int:
    """Set every E8M0 scale tensor of ``model`` to 2^0 (the byte E8M0_BIAS); returns how many
    were set."""
    from fusedq.vllm.layer_plan import E8M0_DTYPES

    filled = 0
    for name, tensor in model.state_dict(keep_vars=True).items():
        if name.endswith(SCALE_SUFFIX) and tensor.dtype in E8M0_DTYPES:
            tensor.data.view(torch.uint8).fill_(E8M0_BIAS)
            filled += 1
    return filled


def register() -> None:
    """vLLM's general-plugin entry point: add the ``fusedq_dummy`` load format (once), where
    ``FUSEDQ_STANDIN_LOADER=1``."""
    if os.environ.get(ENABLE_ENV) != "1":
        return
    try:
        from vllm.model_executor.model_loader import (
            _LOAD_FORMAT_TO_MODEL_LOADER,
            register_model_loader,
        )
        from vllm.model_executor.model_loader.dummy_loader import DummyModelLoader
    except ImportError:  # a vLLM without custom load formats: the format is simply unknown
        return
    if LOAD_FORMAT in _LOAD_FORMAT_TO_MODEL_LOADER:
        return

    class FusedqDummyLoader(DummyModelLoader):
        """vLLM's dummy weights, then every E8M0 scale set to 2^0 (before vLLM's
        ``process_weights_after_loading``, which BaseModelLoader.load_model runs next)."""

        def load_weights(self, model: torch.nn.Module, model_config) -> None:
            super().load_weights(model, model_config)
            fill_e8m0_scales(model)

    register_model_loader(LOAD_FORMAT)(FusedqDummyLoader)
