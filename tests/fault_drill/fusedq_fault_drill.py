"""A test-only vLLM general plugin: a real fault in the decode path of a GPU vLLM server.

It exists so that the orchestrator's fault handling is tested against what a GPU really does,
and it is installed only where a drill runs (``tests/fault_drill/pyproject.toml``): the
product carries no fault switch. Each drill is armed by its own variable; with neither set
the plugin does nothing at all.

``FUSEDQ_FAULT_DRILL_OOB_AFTER=N``: every call of fusedq's decode query
(``fusedq.vllm.query.decode_query``, which fusedq's plugin calls in each layer of each MLA
decode step) is followed by a one-thread Triton kernel that counts the calls on the device
and, from the N-th one on, writes an int32 to address 0 -- out of bounds of every
allocation, so the GPU raises an illegal memory access (and the driver logs an Xid 31 MMU
fault). The count lives on the device so that it goes on inside CUDA-graph replays, where no
Python runs; it is zeroed when the worker's warm-up and graph capture end
(``Worker.compile_or_warm_up_model``), so only served decode steps count.

``FUSEDQ_FAULT_DRILL_KILL_AFTER=N``: the worker of global rank ``FUSEDQ_FAULT_DRILL_KILL_RANK``
(default 1) SIGKILLs itself at its N-th model step with scheduled tokens after warm-up: a
tensor-parallel worker dying mid-decode.
"""

from __future__ import annotations

import functools
import logging
import os
import signal
from typing import Any

OOB_ENV = "FUSEDQ_FAULT_DRILL_OOB_AFTER"
KILL_ENV = "FUSEDQ_FAULT_DRILL_KILL_AFTER"
KILL_RANK_ENV = "FUSEDQ_FAULT_DRILL_KILL_RANK"

# A child of vLLM's logger, so its lines land in the server log in vLLM's format.
logger = logging.getLogger("vllm.fusedq_fault_drill")

_state: dict[str, Any] = {"registered": False, "counter": None, "served": False, "steps": 0}


def _positive(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None:
        return None
    value = int(raw)
    if value < 1:
        raise ValueError(f"{name}={raw!r} must be a positive integer")
    return value


@functools.cache
def _count_then_write():
    import triton
    import triton.language as tl

    # Not specialised on the integers, so the launch that compiles it before graph capture
    # (with a count it never reaches) is the variant every later launch uses.
    @triton.jit(do_not_specialize=["after", "offset"])
    def kernel(counter_ptr, after, offset):
        # The count before this call; from `after` on, the store goes `offset` int32s away
        # from the counter: to address 0.
        n = tl.atomic_add(counter_ptr, 1)
        tl.store(counter_ptr + offset, n, mask=n >= after)

    return kernel


def _launch(counter: Any, after: int) -> None:
    # int32 elements: the offset that takes the counter's address to 0.
    _count_then_write()[(1,)](counter, after, -(counter.data_ptr() // 4))


def _wrap_decode_query(after: int) -> None:
    from fusedq.vllm import query as hook_side

    real = hook_side.decode_query

    @functools.wraps(real)
    def decode_query(*args: Any, **kwargs: Any):
        query = real(*args, **kwargs)
        counter = _state["counter"]
        if query is not None and counter is not None and query.is_cuda:
            _launch(counter, after)
        return query

    hook_side.decode_query = decode_query


def _wrap_worker(oob_after: int | None, kill_after: int | None, kill_rank: int) -> None:
    from vllm.v1.worker import gpu_worker

    worker = gpu_worker.Worker
    warm_up = worker.compile_or_warm_up_model
    execute = worker.execute_model

    @functools.wraps(warm_up)
    def compile_or_warm_up_model(self, *args: Any, **kwargs: Any):
        import torch

        if oob_after is not None and torch.cuda.is_available():
            counter = torch.zeros(1, dtype=torch.int32, device=torch.cuda.current_device())
            _launch(counter, 2**30)  # compiled now: a graph capture cannot compile it
            _state["counter"] = counter
        result = warm_up(self, *args, **kwargs)
        if _state["counter"] is not None:
            _state["counter"].zero_()
            torch.cuda.synchronize()
            logger.warning(
                "fault drill: warm-up done; decode query call %d from now on writes out of bounds",
                oob_after,
            )
        _state["served"] = True
        return result

    @functools.wraps(execute)
    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any):
        if (
            kill_after is not None
            and _state["served"]
            and getattr(self, "rank", None) == kill_rank
            and getattr(scheduler_output, "total_num_scheduled_tokens", 0) > 0
        ):
            _state["steps"] += 1
            if _state["steps"] >= kill_after:
                logger.warning(
                    "fault drill: rank %d kills itself (SIGKILL) at model step %d",
                    kill_rank, _state["steps"],
                )  # fmt: skip
                for handler in logging.getLogger("vllm").handlers:
                    handler.flush()
                os.kill(os.getpid(), signal.SIGKILL)
        return execute(self, scheduler_output, *args, **kwargs)

    worker.compile_or_warm_up_model = compile_or_warm_up_model
    worker.execute_model = execute_model


def register() -> None:
    """vLLM's general-plugin entry point (every vLLM process; possibly more than once)."""
    if _state["registered"]:
        return
    oob_after = _positive(OOB_ENV)
    kill_after = _positive(KILL_ENV)
    if oob_after is None and kill_after is None:
        return
    _state["registered"] = True
    kill_rank = int(os.environ.get(KILL_RANK_ENV, "1"))
    _wrap_worker(oob_after, kill_after, kill_rank)
    if oob_after is not None:
        _wrap_decode_query(oob_after)
        logger.warning(
            "fault drill: armed: decode query call %d after warm-up writes out of bounds (%s)",
            oob_after, OOB_ENV,
        )  # fmt: skip
    if kill_after is not None:
        logger.warning(
            "fault drill: armed: rank %d is SIGKILLed at model step %d after warm-up (%s)",
            kill_rank, kill_after, KILL_ENV,
        )  # fmt: skip
