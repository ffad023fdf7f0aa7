"""vLLM worker extension: switch a running server's MLA decode query between staged and fused.

    vllm serve MODEL --worker-extension-cls fusedq.vllm.worker_ext.FusedqWorkerExtension
    # with VLLM_SERVER_DEV_MODE=1, vLLM's dev endpoint calls a method on every worker:
    POST /collective_rpc {"method": "fusedq_set_path", "args": ["staged"]}
    POST /collective_rpc {"method": "fusedq_state"}
    POST /collective_rpc {"method": "fusedq_seed", "args": ["3"]}

vLLM mixes this class into its worker class in every worker process; ``collective_rpc`` runs a
method on each worker between engine steps and answers ``{"results": [<one per worker>]}``.
The plugin (``fusedq.vllm.plugin``) must be active: it set the layers up at start-up, and its
process-global switch is what the decode hook reads.

Flipping the switch is all an eager server needs. Where vLLM captured CUDA graphs (0.26's
default: FULL decode graphs for FLASH_ATTN_MLA and FLASH_ATTN_MLA_SPARSE, piecewise graphs
around attention), the graphs hold whatever query path ran at capture, so the switch frees
every captured graph and captures them again, as vLLM's own start-up does after its
graph-memory profiling (clear, then ``capture_model``), with the fused op's sizes prewarmed
first. docs/vllm-plugin.md gives the contract and what was validated where.
"""

from __future__ import annotations

import gc
import os
import time

from fusedq.vllm import layer_plan, report, switch
from fusedq.vllm.report import logger


def graph_note(worker) -> tuple[bool, str]:
    """``(True, cudagraph mode)`` where this worker replays CUDA graphs that the path switch
    must capture again, else ``(False, why there are none)``.

    ``NotImplementedError`` for a model runner whose graphs this module cannot re-capture
    (checked before anything is switched).
    """
    config = worker.vllm_config
    if config.model_config.enforce_eager:
        return False, "no CUDA graphs: enforce-eager"
    device = getattr(worker, "device", None)
    if getattr(device, "type", "cpu") != "cuda":
        return False, f"no CUDA graphs on {getattr(device, 'type', device)}"
    mode = config.compilation_config.cudagraph_mode
    if mode is None or mode.name == "NONE":
        return False, "no CUDA graphs: cudagraph_mode NONE"
    runner = worker.model_runner
    # vLLM's V1 GPU runner: graphs live in CUDAGraphWrapper instances (vllm/compilation/
    # cuda_graph.py) keyed by its cudagraph_dispatcher's batch descriptors. The V2 runner
    # (vllm/v1/worker/gpu/model_runner.py) keeps its own CudaGraphManager, whose capture
    # asserts that no graph of a descriptor exists yet; it is not handled here.
    if not hasattr(runner, "cudagraph_dispatcher") or not callable(
        getattr(runner, "capture_model", None)
    ):
        raise NotImplementedError(
            f"{type(runner).__name__} keeps its CUDA graphs where fusedq cannot re-capture them "
            "(only vLLM's V1 GPU model runner is handled); restart the server with the variant "
            "instead, or serve --enforce-eager"
        )
    return True, mode.name


def _graph_wrappers() -> list[type]:
    """vLLM's graph-holding wrapper classes (each keeps a registry of its instances)."""
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    wrappers: list[type] = [CUDAGraphWrapper]
    try:  # vLLM 0.26 and later; the breakable wrapper holds the whole model when enabled
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphWrapper
    except ImportError:
        pass
    else:
        wrappers.append(BreakableCUDAGraphWrapper)
    return wrappers


def recapture(worker) -> None:
    """Free every CUDA graph this worker captured, then capture them again for the path now
    set (vLLM's ``capture_model``: its capture sizes, its dispatcher's modes, capture enabled
    for the duration only)."""
    import torch

    # The GPU may still run the step before this RPC; its graphs must finish before freeing.
    torch.cuda.synchronize()
    for wrapper in _graph_wrappers():
        wrapper.clear_all_graphs()
    # Wrappers outside those registries (the dual-batch-overlap UBatchWrapper keeps its own
    # graphs) sit on the runner's model or its drafter's.
    runner = worker.model_runner
    for model in (runner.model, getattr(getattr(runner, "drafter", None), "model", None)):
        clear = getattr(type(model), "clear_graphs", None)
        if callable(clear):
            clear(model)
    # Dropping the CUDAGraph objects releases their pool blocks; return them to the driver
    # so the new capture starts from the memory the first one had.
    gc.collect()
    torch.cuda.empty_cache()
    runner.capture_model()


class FusedqWorkerExtension:
    """Mixed into vLLM's worker class (``--worker-extension-cls``); its methods run on every
    worker through ``collective_rpc``. ``self`` is the vLLM worker."""

    def fusedq_set_path(self, path: str) -> dict[str, object]:
        """Switch this worker's MLA decode query to ``path`` (``staged`` or ``fused``) and
        capture the CUDA graphs again where there are any.

        Returns ``{"path": <now active>, "recaptured": bool, "seconds": float,
        "layers": int}``. ``ValueError`` for an unknown path; ``FusedqInactiveError`` where the
        plugin is not active (the reason it gave); ``NotImplementedError`` for a model runner
        whose graphs cannot be re-captured. Setting the path already active changes nothing
        (``recaptured`` false). A failed re-capture switches back and captures the previous
        path's graphs before the error propagates.
        """
        start = time.perf_counter()
        graphs, note = graph_note(self)
        previous = switch.current_path()
        changed = switch.set_path(path)
        recaptured = False
        if changed and graphs:
            try:
                recapture(self)
            except Exception:
                logger.exception("fusedq: CUDA graph re-capture for the %s path failed", path)
                switch.set_path(previous)
                recapture(self)
                raise
            recaptured = True
        seconds = time.perf_counter() - start
        layers = len(switch.planned_layers())
        if changed:
            logger.info(
                "fusedq: decode path %s on this worker (%d layers, %s) in %.2f s",
                path, layers, f"{note} graphs re-captured" if recaptured else note, seconds,
            )  # fmt: skip
        return {
            "path": switch.current_path(),
            "recaptured": recaptured,
            "seconds": round(seconds, 3),
            "layers": layers,
        }

    def fusedq_seed(self, seed: int | str) -> dict[str, object]:
        """Seed this worker's random streams (torch's CPU generator and every CUDA device's)
        with ``seed``: ``{"seed": <int>, "path": <the active path>}``.

        vLLM's synthetic MTP acceptance (``rejection_sample_method: synthetic``) draws its
        uniforms from the device's default generator, so without a seed the two paths of a
        switch-mode A/B round draw at whatever points the stream has reached. The orchestrator
        seeds every worker with the round's seed before each block; the workers of one server
        get the same seed, as vLLM seeds them alike at start-up.
        """
        import torch

        value = int(seed)
        torch.manual_seed(value)  # every device's default generator, CUDA's included
        return {"seed": value, "path": switch.current_path()}

    def fusedq_state(self) -> dict[str, object]:
        """This worker's decode path and what the plugin set up: ``path``, ``active``,
        ``layers`` (served by the fused op), ``query`` (the forms handed to the backends),
        ``graphs``, the enabled/disabled ``line`` and the ``kernels`` line logged at start-up,
        ``reason`` (why inactive, else None) and ``pid``."""
        layers = switch.planned_layers()
        try:
            _, graphs = graph_note(self)
        except NotImplementedError as exc:
            graphs = str(exc)
        forms = sorted({layer.__dict__[layer_plan.PLAN_ATTR].form.name for layer in layers})
        return {
            "path": switch.current_path() if layers else "staged",
            "active": bool(layers),
            "layers": len(layers),
            "query": forms,
            "graphs": graphs,
            "line": report.report_line(),
            "kernels": report.kernels_line(),
            "reason": None if layers else switch.inactive_reason(),
            "pid": os.getpid(),
        }
