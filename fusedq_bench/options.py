"""What one ``fusedq-bench`` run measures: its options, and how many layers a shape rotates
over."""

from __future__ import annotations

import dataclasses
import math

from fusedq.contract import DECODE_M_BUCKETS, GLM5, QUALIFIED
from fusedq.kernels.common import BLOCK_K
from fusedq.kernels.triton_mla_query import SINGLE_BLOCK_K
from fusedq_bench.common import (
    FORMATS,
)

# H200 L2 is 60 MB; rotating over 2x that keeps every layer's weight out of L2.
DEFAULT_L2_MB = 60.0


@dataclasses.dataclass(frozen=True)
class Options:
    heads: tuple[int, ...] = QUALIFIED[GLM5.name].heads
    ms: tuple[int, ...] = DECODE_M_BUCKETS
    # The MLA geometry timed (a fusedq.contract.GEOMETRIES name); its rows name it.
    geometry: str = GLM5.name
    formats: tuple[str, ...] = FORMATS
    samples: int = 1000
    warmup: int = 20
    l2_mb: float = DEFAULT_L2_MB
    l2_factor: float = 2.0
    q_scale: float = 0.02
    chain: bool = False
    sweep: bool = False
    sweep_block_n: tuple[int, ...] = (16, 32, 64)
    sweep_warps: tuple[int, ...] = (4, 8)
    sweep_block_k: tuple[int, ...] = (BLOCK_K, SINGLE_BLOCK_K[GLM5.name])
    sweep_pdl: tuple[int, ...] = (0,)
    # tl.dot variants' BLOCK_M (16 | 32 | 64; 64 tiles M over the grid). Empty: the path's own,
    # M padded to a power of two from 16 up to 64.
    sweep_block_m: tuple[int, ...] = ()
    # Register-path (no tl.dot) variants "BLOCK_N:WARPS", for M <= 8, any output; and those
    # of them to time with PDL as well.
    sweep_fma: tuple[str, ...] = ()
    sweep_fma_pdl: tuple[str, ...] = ()
    # The CuTe DSL MXFP8 kernel (cute_mla_query) as one more sweep variant, "cute".
    sweep_cute: bool = False
    # Gluon-kernel variants "BLOCK_N:WARPS[:BLOCK_M]" (BLOCK_M defaults to the tl.dot path's
    # padded row count, 16 or 32), any M <= 32, any output.
    sweep_gluon: tuple[str, ...] = ()
    # Each of those with each of these operand paths (gluon_mla_query.OPERANDS).
    sweep_gluon_operands: tuple[str, ...] = ("convert", "smem", "direct")
    # E4M3 formats: each variant again as "<name>_<epilogue>" for each of these epilogues
    # (LaunchConfig.e4m3_epilogue): "mul" and "wide" (the product's two stores), "div" (an IEEE
    # division per element, before 2026-12-01), "noscale" (no q_scale: wrong output by design).
    sweep_e4m3: tuple[str, ...] = ()
    # BF16 formats: each Gluon and register-path variant again with its scheduling fence after
    # the loads flipped (LaunchConfig.load_fence), as "<name>_fence" or "<name>_nofence".
    sweep_fence: bool = False
    floors: bool = False
    # --front: the decode front (RoPE, query, KV-cache write) fused against vLLM's three
    # launches, and the query alone beside it (the front module).
    front: bool = False
    # --eager: host time per call outside graphs (the eager module), calls per run, runs per
    # path.
    eager: bool = False
    eager_calls: int = 2000
    eager_repeats: int = 5
    commit: str | None = None


def layer_count(bytes_per_layer: int, opts: Options) -> int:
    return max(2, math.ceil(opts.l2_factor * opts.l2_mb * 1e6 / bytes_per_layer))
