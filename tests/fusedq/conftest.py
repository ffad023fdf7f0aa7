"""Shared set-up for the fusedq tests.

Without CUDA the kernels run in Triton's interpreter on CPU tensors. Triton picks the
interpreter when ``@triton.jit`` decorates a function (it reads ``TRITON_INTERPRET`` from the
environment at that moment, through ``triton.knobs``), so it must be set before ``fusedq`` is
imported — conftest runs before the test modules are.
"""

import os

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")


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
