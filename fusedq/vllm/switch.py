"""The decode path switch: the process's path, which the hook reads on every call
(``fusedq.vllm.worker_ext`` drives it over vLLM's collective RPC)."""

from __future__ import annotations

import os
import threading

from fusedq.contract import DECODE_PATHS
from fusedq.vllm import releases
from fusedq.vllm.layer_plan import PLAN_ATTR, prewarm_layer, set_up_layers
from fusedq.vllm.report import MODE_ENV, disabled_line, logger, worker_report


class FusedqInactiveError(RuntimeError):
    """No MLA layer of this process uses the fused query, so there is no path to switch."""


class PathSwitch:
    """The process's decode path, read by the hook on every call.

    A server comes up ``fused``: the plugin sets every qualified layer up as it always did.
    ``staged`` makes the hook return ``None``, so vLLM's block runs as shipped.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.path = "fused"


path_switch = PathSwitch()
# Set by the first decode query on the current path, cleared by a switch: the log says once
# which path the hot path really runs.
first_use = threading.Event()


def current_path() -> str:
    """The decode path this process runs: ``staged`` or ``fused``."""
    return path_switch.path


def planned_layers() -> list:
    """The layers the fused op serves (a plan at set-up, not dropped since), by name."""
    return [
        layer
        for _, layer in sorted(set_up_layers.items())
        if layer.__dict__.get(PLAN_ATTR) is not None
    ]


def inactive_reason() -> str:
    """Why no layer of this process uses the fused query."""
    current = os.environ.get(MODE_ENV, "auto")
    if not releases.installed:
        if worker_report.refused is not None:
            return f"vLLM was not patched: {worker_report.refused}"
        return f"the plugin did not patch vLLM in this process ({MODE_ENV}={current!r})"
    if worker_report.first is None:
        return "no MLA layer of this process was set up"
    if worker_report.first.startswith(disabled_line("")):
        return worker_report.first
    # Enabled at set-up, then every layer's fused call failed and went back to vLLM's block.
    return "every layer's fused MLA query failed at run time (see the warnings)"


def set_path(path: str) -> bool:
    """Switch this process's decode path; returns whether it changed.

    ``ValueError`` for a path not in ``DECODE_PATHS``; ``FusedqInactiveError`` (with the
    reason) where no layer uses the fused query. Switching to ``fused`` prewarms every planned
    layer's CUDA-graph sizes first, as set-up does, so a re-capture that follows never
    compiles. What was captured in CUDA graphs keeps running the old path until it is captured
    again (``fusedq.vllm.worker_ext`` does that).
    """
    if path not in DECODE_PATHS:
        raise ValueError(f"decode path {path!r} is not one of {', '.join(DECODE_PATHS)}")
    layers = planned_layers()
    if not layers:
        raise FusedqInactiveError(f"the fused MLA query is not active: {inactive_reason()}")
    with path_switch.lock:
        changed = path != path_switch.path
        if changed and path == "fused":
            for layer in layers:
                prewarm_layer(layer, layer.__dict__[PLAN_ATTR])
        path_switch.path = path
    if changed:
        first_use.clear()  # the first decode query on the new path is logged again
        logger.info("fusedq: decode path switched to %s (%d layers)", path, len(layers))
    return changed
