"""Set-up every test directory needs before any test module is imported.

Without CUDA fusedq's kernels run in Triton's interpreter on CPU tensors. Triton picks the
interpreter when ``@triton.jit`` decorates a function (it reads ``TRITON_INTERPRET`` from the
environment at that moment), so it must be set before anything imports ``fusedq.kernels`` --
and test modules of other directories (tests/benchmarks reads ``fusedq.bench``) are collected
before tests/fusedq's own conftest would run. This root conftest runs first.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
