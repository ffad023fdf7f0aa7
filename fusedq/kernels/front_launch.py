"""Compiling and launching the fused decode front (``triton_decode_front``): the key a
compiled variant is known by, the registry that keeps CUDA-graph capture from compiling, and
``prewarm``, as ``triton_launch`` does for the query kernels.

The query part runs a ``triton_launch.LaunchConfig`` of the tl.dot kernel (the selection's
choice, ``fusedq.front_dispatch``); its key is the query kernel's ``KernelKey``, and the front
adds what its own constexprs and pointer types depend on.
"""

from __future__ import annotations

import dataclasses
import threading

import torch
import triton

from fusedq.contract import KV_LORA, QK_ROPE, QUERY_WIDTH
from fusedq.kernels import common, triton_decode_front, triton_launch
from fusedq.kernels.triton_launch import KernelKey, LaunchConfig

E4M3 = torch.float8_e4m3fn


@dataclasses.dataclass(frozen=True)
class FrontKey:
    """Everything that selects a compiled variant of the front kernel."""

    query: KernelKey  # the query part's variant (config, formats, layouts, alignment, K)
    neox: bool
    cache_fp8: bool
    cos_sin_dtype: torch.dtype
    positions_dtype: torch.dtype
    cache_m: int  # tokens per cache program (CACHE_M)


_compiled: set[FrontKey] = set()
_compiled_lock = threading.Lock()


def compiled_keys() -> frozenset[FrontKey]:
    """Keys compiled (or, under the interpreter, registered) in this process."""
    with _compiled_lock:
        return frozenset(_compiled)


def cache_rows(config: LaunchConfig, num_heads: int) -> int:
    """CACHE_M: tokens per cache program, a power of two such that the heads' programs of
    the cache column cover one M block."""
    return triton.next_power_of_2(-(-config.block_m // num_heads))


def check_config(config: LaunchConfig) -> None:
    """The front kernel is the tl.dot kernel's: no register-path, Gluon or PDL variant."""
    if config.fma or config.gluon or config.pdl:
        raise ValueError(
            f"{config}: the decode front runs the tl.dot kernel's configurations only "
            "(fma=False, gluon=False, pdl=False)"
        )


def front_key(
    values: torch.Tensor,
    config: LaunchConfig,
    *,
    weight_format: str,
    out_fp8: bool,
    io_is_aligned: bool,
    neox: bool,
    cache_fp8: bool,
    cos_sin_dtype: torch.dtype,
    positions_dtype: torch.dtype,
) -> FrontKey:
    check_config(config)
    query = triton_launch.kernel_key(
        values, config, weight_format=weight_format, out_fp8=out_fp8, io_is_aligned=io_is_aligned
    )
    return FrontKey(
        query=query,
        neox=bool(neox),
        cache_fp8=bool(cache_fp8),
        cos_sin_dtype=cos_sin_dtype,
        positions_dtype=positions_dtype,
        cache_m=cache_rows(config, values.shape[0]),
    )


def grid_for(config: LaunchConfig, num_heads: int, m: int) -> tuple[int, int, int]:
    """The query kernel's grid with one more column along N: the cache programs."""
    n_tiles, heads, m_tiles = triton_launch.grid_for(config, num_heads, m)
    return n_tiles + 1, heads, m_tiles


def launch(
    q: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    out: torch.Tensor,
    q_scale: torch.Tensor | None,
    k_scale: torch.Tensor | None,
    *,
    config: LaunchConfig,
    neox: bool,
) -> FrontKey:
    """Launch the front on validated operands (``k_pe`` ``[M, 64]``; an fp8 ``kv_cache`` as
    float8_e4m3fn); returns the key it ran under.

    Raises ``RuntimeError`` when called under CUDA-graph capture with a key that was never
    compiled (call ``fusedq.prewarm_decode_front`` before capturing)."""
    m, num_heads, width = q.shape
    qk_nope = width - QK_ROPE
    q_nope, q_pe = q[..., :qk_nope], q[..., qk_nope:]
    cache_fp8 = kv_cache.dtype == E4M3
    key = front_key(
        values,
        config,
        weight_format="mxfp8" if scales is not None else "bf16",
        out_fp8=out.dtype == E4M3,
        io_is_aligned=triton_launch.io_aligned(q_nope, q_pe, out),
        neox=neox,
        cache_fp8=cache_fp8,
        cos_sin_dtype=cos_sin_cache.dtype,
        positions_dtype=positions.dtype,
    )
    with _compiled_lock:
        known = key in _compiled
    if not known and out.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"fusedq: decode-front variant {key} is not compiled and the current stream is "
            "capturing a CUDA graph; compiling now would break the capture. Call "
            "fusedq.prewarm_decode_front(...) for every M the graph uses before capturing."
        )
    if m == 0:
        return key
    config.check_problem(qk_nope, m)
    ints, constexprs = triton_launch.launch_arguments(q_nope, values, scales, q_pe, out, key.query)
    del constexprs["USE_PDL"], constexprs["LOAD_FENCE"]
    constexprs.update(NEOX=key.neox, CACHE_FP8=cache_fp8, CACHE_M=key.cache_m)
    dummy = values  # any valid memory for the pointers a variant never reads
    triton_decode_front._mla_decode_front_kernel[grid_for(config, num_heads, m)](
        q_nope,
        q_pe,
        values,
        scales if scales is not None else dummy,
        out,
        q_scale if q_scale is not None else dummy,
        kv_c,
        k_pe,
        positions,
        cos_sin_cache,
        slot_mapping,
        kv_cache,
        k_scale if k_scale is not None else dummy,
        *ints,
        kv_c.stride(0),
        k_pe.stride(0),
        positions.stride(0),
        cos_sin_cache.stride(0),
        slot_mapping.stride(0),
        kv_cache.stride(0),
        kv_cache.stride(1),
        kv_cache.shape[1],
        **constexprs,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
        # The RoPE products must round as the staged reference's separate ops do: no FMA.
        enable_fp_fusion=False,
    )
    if not known:
        with _compiled_lock:
            _compiled.add(key)
    return key


def register_interpreted(key: FrontKey) -> bool:
    """Record a key without compiling (the interpreter has nothing to compile)."""
    with _compiled_lock:
        new = key not in _compiled
        _compiled.add(key)
    return new


def prewarm(
    values: torch.Tensor,
    scales: torch.Tensor | None,
    m: int,
    out_dtype: torch.dtype,
    config: LaunchConfig,
    *,
    neox: bool,
    cache_fp8: bool,
    cos_sin_dtype: torch.dtype,
    positions_dtype: torch.dtype,
) -> int:
    """Compile the variants a launch of ``config`` with ``m`` tokens on this weight can need
    (rows of q and out aligned or not), on scratch operands; returns how many were new."""
    num_heads, qk_nope, _ = values.shape
    device = values.device
    out_fp8 = out_dtype == E4M3
    weight_format = "bf16" if scales is None else "mxfp8"
    new = 0
    for aligned in (True, False):
        key = front_key(
            values, config, weight_format=weight_format, out_fp8=out_fp8, io_is_aligned=aligned,
            neox=neox, cache_fp8=cache_fp8, cos_sin_dtype=cos_sin_dtype,
            positions_dtype=positions_dtype,
        )  # fmt: skip
        if key in compiled_keys():
            continue
        if common.interpreting():
            new += register_interpreted(key)
            continue
        lead = 0 if aligned else 1  # one element of lead-in misaligns every row
        width = qk_nope + QK_ROPE
        q = torch.zeros(lead + m * num_heads * width, dtype=torch.bfloat16, device=device)
        q = q[lead:].view(m, num_heads, width)
        out = torch.empty(lead + m * num_heads * QUERY_WIDTH, dtype=out_dtype, device=device)
        out = out[lead:].view(m, num_heads, QUERY_WIDTH)
        kv_c = torch.zeros(m, KV_LORA, dtype=torch.bfloat16, device=device)
        k_pe = torch.zeros(m, QK_ROPE, dtype=torch.bfloat16, device=device)
        positions = torch.zeros(m, dtype=positions_dtype, device=device)
        cos_sin = torch.zeros(1, QK_ROPE, dtype=cos_sin_dtype, device=device)
        cache = torch.zeros(1, 1, QUERY_WIDTH, dtype=E4M3 if cache_fp8 else torch.bfloat16,
                            device=device)  # fmt: skip
        # Every slot negative: the scratch cache is never written.
        slots = torch.full((m,), -1, dtype=torch.int64, device=device)
        one = torch.ones(1, dtype=torch.float32, device=device)
        launched = launch(
            q, values, scales, kv_c, k_pe, positions, cos_sin, cache, slots, out,
            one if out_fp8 else None, one if cache_fp8 else None, config=config, neox=neox,
        )  # fmt: skip
        assert launched == key, (launched, key)
        new += 1
    return new
