"""``--chain``: each call where vLLM has it, behind the ``q_b_proj`` GEMM that writes ``q`` and
a KV-cache row write; every figure is then the increment over those predecessors alone."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fusedq.contract import (
    QK_ROPE,
    QUERY_WIDTH,
)
from fusedq_bench.harness import Layers, every_layer

# --chain: vLLM's q_lora_rank (DeepSeek-V3 / GLM-5): q_b_proj maps 1536 -> H * (qk_nope + 64).
Q_LORA_RANK = 1536


@dataclasses.dataclass
class Producers:
    """The predecessors' operands, shared by every chained graph of one shape.

    Held by ``bench_shape`` until its graphs are gone: a graph records raw addresses, and a
    tensor freed after capture would hand its memory to the next allocation.
    """

    q2d: object
    q_c: object
    w_qb: object
    kv_new: object
    kv_row: object


def producers(lay: Layers) -> Producers:
    import torch

    m, h = lay.q_nope.shape[0], lay.q_nope.shape[1]
    dev = lay.q_nope.device
    q = lay.q_nope._base if lay.q_nope._base is not None else lay.q_nope
    width = lay.geometry.qk_nope + QK_ROPE
    return Producers(
        q2d=q.view(m, h * width),
        q_c=torch.randn(m, Q_LORA_RANK, device=dev, dtype=torch.bfloat16),
        w_qb=torch.randn(Q_LORA_RANK, h * width, device=dev, dtype=torch.bfloat16) * 0.02,
        kv_new=torch.randn(m, QUERY_WIDTH, device=dev, dtype=torch.bfloat16),
        kv_row=torch.empty(m, QUERY_WIDTH, device=dev, dtype=torch.bfloat16),
    )


def chained(lay: Layers, prod: Producers, step: Callable[[int], None] | None) -> Callable[[], None]:
    """Per layer: the q_b_proj GEMM writing q, a KV-cache row write, then `step(layer)`."""
    import torch

    def chained(i: int) -> None:
        torch.mm(prod.q_c, prod.w_qb, out=prod.q2d)
        prod.kv_row.copy_(prod.kv_new)
        if step is not None:
            step(i)

    return every_layer(lay, chained)
