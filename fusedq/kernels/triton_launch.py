"""Compiling and launching the Triton-compiled kernels (the tl.dot and register-path kernels
of ``triton_mla_query``, the Gluon kernels of ``gluon_mla_query``): their launch configuration,
the key a compiled variant is known by, and the registry that keeps CUDA-graph capture from
compiling.

Which configuration runs a problem is ``fusedq.selection``'s choice; here it is checked,
compiled and launched. ``prewarm`` compiles the variants a configuration can need; a launch under
CUDA-graph capture whose key was never compiled raises instead of compiling.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import torch

from fusedq.contract import KV_LORA, QK_ROPE, QUERY_WIDTH
from fusedq.kernels import common, gluon_mla_query, triton_mla_query
from fusedq.kernels.common import (
    ALIGN_BYTES,
    BLOCK_K,
    DEFAULT_NUM_STAGES,
    W_GENERIC,
    W_UNIT_K,
    W_UNIT_N,
    k_chunks,
)

# Four warps map a [16|32, 32] accumulator onto mma.sync without idle warps at M<=16.
DEFAULT_NUM_WARPS = 4

# FUSEDQ_PDL=1 launches with programmatic dependent launch (see LaunchConfig.pdl). Off by
# default: it only pays where the previous kernel lets dependents start early
# (docs/decisions/0003-pdl-off.md). Read once, at import: a decode step must not read the
# environment per call (callers pass ``pdl=``).
PDL_ENV = "FUSEDQ_PDL"
DEFAULT_PDL = triton_mla_query.HAS_PDL and os.environ.get(PDL_ENV, "0") == "1"


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """Block sizes and launch options of one compiled variant."""

    block_m: int
    block_n: int
    num_warps: int = DEFAULT_NUM_WARPS
    num_stages: int = DEFAULT_NUM_STAGES
    block_k: int = BLOCK_K
    # Programmatic dependent launch: the weight loads (which depend on no earlier kernel) are
    # issued before griddepcontrol.wait, so they overlap the previous kernel's tail.
    pdl: bool = False
    # Register path (no tl.dot): block_m rows unrolled, K in 64-wide chunks.
    fma: bool = False
    # The Gluon kernel (fusedq.kernels.gluon_mla_query: explicit layouts, every load issued
    # before the first layout conversion): block_m 16|32, K in three 64-wide chunks. Never
    # under the interpreter.
    gluon: bool = False
    # With gluon: how the operand tiles reach the MMA layouts, one of
    # gluon_mla_query.OPERANDS ("convert" | "smem" | "direct"; the reasons are there).
    gluon_operands: str = "convert"
    # E4M3 out only: "mul" or "wide" (vLLM's quantisation, stored two ways); "div" and
    # "noscale" are measurement aids (see common.OUT_E4M3_DIV) that the selection never picks.
    e4m3_epilogue: str = "mul"
    # Gluon and register path, BF16 out: a scheduling fence after the loads (LOAD_FENCE in
    # the kernels), or None for each kernel's measured choice (``fence``): on for the register
    # path, whose RoPE load ptxas otherwise issues after q's first use, off for Gluon, where it
    # costs more than the wait it removes (docs/decisions/0006-gluon-for-larger-m.md).
    load_fence: bool | None = None

    @property
    def fence(self) -> bool:
        """The LOAD_FENCE constexpr: ``load_fence``, or the kernel's measured choice."""
        return self.fma if self.load_fence is None else self.load_fence

    def __post_init__(self) -> None:
        if not 16 <= self.block_n <= KV_LORA or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n={self.block_n} must be a power of two in [16, {KV_LORA}]")
        if self.pdl and not triton_mla_query.HAS_PDL:
            raise ValueError("pdl=True needs Triton's griddepcontrol support (Triton >= 3.3)")
        single = sorted(set(triton_mla_query.SINGLE_BLOCK_K.values()))
        if self.block_k != BLOCK_K and self.block_k not in single:
            raise ValueError(
                f"block_k={self.block_k} must be {BLOCK_K} (chunks) or one chunk of {single}"
            )
        if self.e4m3_epilogue not in common.E4M3_EPILOGUES:
            raise ValueError(
                f"e4m3_epilogue={self.e4m3_epilogue!r} must be one of {sorted(common.E4M3_EPILOGUES)}"
            )
        if self.e4m3_epilogue == "wide" and not self.gluon:
            raise ValueError("e4m3_epilogue='wide' is a Gluon-kernel variant; pass gluon=True")
        if self.load_fence is not None and not (self.gluon or self.fma):
            raise ValueError(
                f"load_fence={self.load_fence} chooses a Gluon or register-path variant; pass "
                "gluon=True or fma=True (or leave it None)"
            )
        if self.gluon_operands != "convert" and not self.gluon:
            raise ValueError(
                f"gluon_operands={self.gluon_operands!r} selects a Gluon kernel variant: it "
                "needs gluon=True"
            )
        if self.gluon:
            self._check_gluon()
        elif self.fma:
            if self.block_m not in triton_mla_query.FMA_BLOCK_MS or self.block_k != BLOCK_K:
                raise ValueError(
                    f"fma: block_m={self.block_m} must be in {triton_mla_query.FMA_BLOCK_MS} and "
                    f"block_k={self.block_k} must be {BLOCK_K}"
                )
        elif (
            not triton_mla_query.MIN_BLOCK_M <= self.block_m <= triton_mla_query.MAX_BLOCK_M
            or self.block_m & (self.block_m - 1)
        ):
            raise ValueError(
                f"block_m={self.block_m} must be a power of two in "
                f"[{triton_mla_query.MIN_BLOCK_M}, {triton_mla_query.MAX_BLOCK_M}]"
            )

    @property
    def tiles_m(self) -> bool:
        """Whether the variant tiles M over the grid's third axis (the tl.dot kernel's 64-row
        blocks); the others cover M in one CTA row, so M must fit ``block_m``."""
        return not (self.gluon or self.fma) and self.block_m > 32

    def check_problem(self, qk_nope: int, m: int) -> None:
        """``ValueError`` naming why this variant cannot run K = ``qk_nope`` with ``m`` tokens:
        a kernel built for other geometries (its module's GEOMETRIES), K not in its chunks,
        or more tokens than an untiled block holds."""
        module = gluon_mla_query if self.gluon else triton_mla_query
        if qk_nope not in {g.qk_nope for g in module.GEOMETRIES}:
            names = ", ".join(g.name for g in module.GEOMETRIES)
            raise ValueError(
                f"qk_nope={qk_nope}: the {triton_kernel_label(self)} kernel is built for {names}"
            )
        if self.block_k == BLOCK_K:
            k_chunks(qk_nope)
        elif self.block_k < qk_nope:
            raise ValueError(f"block_k={self.block_k} is one chunk narrower than qk_nope={qk_nope}")
        if m > self.block_m and not self.tiles_m:
            raise ValueError(
                f"M={m} exceeds block_m={self.block_m} of a variant that does not tile M"
            )

    def _check_gluon(self) -> None:
        if self.fma:
            raise ValueError("gluon=True and fma=True exclude each other (two different kernels)")
        if self.block_m not in gluon_mla_query.GLUON_BLOCK_MS or self.block_k != BLOCK_K:
            raise ValueError(
                f"gluon: block_m={self.block_m} must be in {gluon_mla_query.GLUON_BLOCK_MS} and "
                f"block_k={self.block_k} must be {BLOCK_K}"
            )
        if self.block_n > gluon_mla_query.GLUON_MAX_BLOCK_N:
            raise ValueError(
                f"gluon: block_n={self.block_n} must be <= {gluon_mla_query.GLUON_MAX_BLOCK_N}"
            )
        if self.gluon_operands not in gluon_mla_query.OPERANDS:
            raise ValueError(
                f"gluon_operands={self.gluon_operands!r} must be one of {gluon_mla_query.OPERANDS}"
            )
        if not gluon_mla_query.AVAILABLE:
            raise ValueError(f"gluon=True: {gluon_mla_query.UNAVAILABLE_REASON}")
        if common.interpreting():
            raise ValueError(
                "gluon=True: Gluon kernels do not run under TRITON_INTERPRET=1 (they are "
                "compiled for the GPU only); use the Triton kernels there"
            )


@dataclasses.dataclass(frozen=True)
class KernelKey:
    """Everything that selects a compiled variant (Triton's own cache key is a function of it)."""

    config: LaunchConfig
    weight_format: str  # "bf16" | "mxfp8"
    out_fp8: bool
    w_layout: int
    w_aligned: bool
    io_aligned: bool
    device_index: int
    qk_nope: int  # K, the geometry's constexpr


_compiled: set[KernelKey] = set()
_compiled_lock = threading.Lock()


def compiled_keys() -> frozenset[KernelKey]:
    """Keys compiled (or, under the interpreter, registered) in this process."""
    with _compiled_lock:
        return frozenset(_compiled)


def _weight_layout(stride_k: int, stride_n: int) -> int:
    if stride_n == 1:
        return W_UNIT_N
    if stride_k == 1:
        return W_UNIT_K
    return W_GENERIC


def _strides_aligned(t: torch.Tensor, strides: tuple[int, ...]) -> bool:
    vec = ALIGN_BYTES // t.element_size()
    return all(s % vec == 0 for s in strides)


def pointer_aligned(ptr: int) -> bool:
    """Whether an address sits on the 16-byte boundary the alignment hints promise."""
    return ptr % ALIGN_BYTES == 0


def weight_stride_traits(values: torch.Tensor) -> tuple[int, bool]:
    """(layout, strides aligned) of a [H, qk_nope, 512] weight: the part of ``weight_traits``
    that does not depend on the address."""
    _, s_k, s_n = values.stride()
    layout = _weight_layout(s_k, s_n)
    non_unit = tuple(s for s in values.stride() if s != 1)
    # Only the unit-stride axis can be vectorised, and only when all other strides keep
    # every row on a 16-byte boundary.
    return layout, layout != W_GENERIC and _strides_aligned(values, non_unit)


def weight_traits(values: torch.Tensor) -> tuple[int, bool]:
    """(layout, aligned) of a [H, qk_nope, 512] weight tensor, as the kernel key needs them."""
    layout, strides_ok = weight_stride_traits(values)
    return layout, strides_ok and pointer_aligned(values.data_ptr())


def io_strides_aligned(q_nope: torch.Tensor, q_pe: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether the row and head strides of q_nope, q_pe and out are 16-byte multiples."""
    return all(_strides_aligned(t, t.stride()[:2]) for t in (q_nope, q_pe, out))


def io_aligned(q_nope: torch.Tensor, q_pe: torch.Tensor, out: torch.Tensor) -> bool:
    """Whether q_nope, q_pe and out rows all start on 16-byte boundaries."""
    return io_strides_aligned(q_nope, q_pe, out) and all(
        pointer_aligned(t.data_ptr()) for t in (q_nope, q_pe, out)
    )


def kernel_key(
    values: torch.Tensor,
    config: LaunchConfig,
    *,
    weight_format: str,
    out_fp8: bool,
    io_is_aligned: bool,
) -> KernelKey:
    """The key a launch of ``config`` with these operands compiles under."""
    layout, w_is_aligned = weight_traits(values)
    config.check_problem(values.shape[1], 1)
    return KernelKey(
        config=config,
        weight_format=weight_format,
        out_fp8=out_fp8,
        w_layout=layout,
        w_aligned=w_is_aligned,
        io_aligned=io_is_aligned,
        device_index=values.device.index if values.device.type == "cuda" else -1,
        qk_nope=values.shape[1],
    )


def grid_for(config: LaunchConfig, num_heads: int, m: int) -> tuple[int, int, int]:
    """(N tiles, heads, M tiles): the launch grid of ``config`` for ``m`` tokens."""
    m_tiles = -(-m // config.block_m) if config.tiles_m else 1
    return KV_LORA // config.block_n, num_heads, max(m_tiles, 1)


def triton_kernel_label(config: LaunchConfig) -> str:
    """The kernel family of a configuration, as messages name it."""
    return "Gluon" if config.gluon else "register" if config.fma else "tl.dot"


def kernel_for(config: LaunchConfig):
    """The jit kernel ``config`` runs (Gluon, register path or tl.dot); all three take the
    same parameters."""
    if config.gluon:
        return gluon_mla_query.kernel_for_operands(config.gluon_operands)
    if config.fma:
        return triton_mla_query._mla_query_fma_kernel
    return triton_mla_query._mla_query_kernel


def launch_arguments(
    q_nope: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    key: KernelKey,
) -> tuple[tuple[int, ...], dict[str, object]]:
    """The integer arguments (M, then the strides, in the kernel's order) and the constexprs
    of a launch under ``key``."""
    cfg = key.config
    # Unused pointer arguments still need a tensor; the weight is always valid memory.
    ws = scales if scales is not None else values
    ints = (
        q_nope.shape[0],
        q_nope.stride(0),
        q_nope.stride(1),
        q_pe.stride(0),
        q_pe.stride(1),
        *values.stride(),
        *ws.stride(),
        out.stride(0),
        out.stride(1),
    )
    constexprs = {
        "K": key.qk_nope,
        "N": KV_LORA,
        "R": QK_ROPE,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "W_LAYOUT": key.w_layout,
        "W_ALIGNED": key.w_aligned,
        "IO_ALIGNED": key.io_aligned,
        "MXFP8": scales is not None,
        "OUT_FP8": common.out_mode(key.out_fp8, cfg.e4m3_epilogue),
        "INTERPRET": common.interpreting(),
        "USE_PDL": cfg.pdl,
        "LOAD_FENCE": cfg.fence,
    }
    return ints, constexprs


def launch(
    q_nope: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    q_scale: torch.Tensor | None,
    *,
    config: LaunchConfig,
) -> KernelKey:
    """Launch ``config``'s kernel on validated operands; returns the key it ran under.

    Raises ``RuntimeError`` when called under CUDA-graph capture with a key that was never
    compiled (call ``fusedq.prewarm`` before capturing).
    """
    return launch_compiled(q_nope, values, scales, q_pe, out, q_scale, config=config)[0]


def launch_compiled(
    q_nope: torch.Tensor,
    values: torch.Tensor,
    scales: torch.Tensor | None,
    q_pe: torch.Tensor,
    out: torch.Tensor,
    q_scale: torch.Tensor | None,
    *,
    config: LaunchConfig,
):
    """``launch``, also returning Triton's compiled kernel (``None`` under the interpreter or
    for M = 0), whose launcher ``fast_launch`` calls directly afterwards."""
    m, num_heads, _ = q_nope.shape
    out_fp8 = out.dtype == torch.float8_e4m3fn
    key = kernel_key(
        values,
        config,
        weight_format="mxfp8" if scales is not None else "bf16",
        out_fp8=out_fp8,
        io_is_aligned=io_aligned(q_nope, q_pe, out),
    )
    with _compiled_lock:
        known = key in _compiled
    if not known and out.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"fusedq: kernel variant {key} is not compiled and the current stream is capturing "
            "a CUDA graph; compiling now would break the capture. Call "
            "fusedq.prewarm(weight, m_values, out_dtype=...) for every M the graph uses "
            "before capturing."
        )
    if m == 0:
        return key, None
    cfg = key.config
    cfg.check_problem(key.qk_nope, m)
    ints, constexprs = launch_arguments(q_nope, values, scales, q_pe, out, key)
    compiled = kernel_for(cfg)[grid_for(cfg, num_heads, m)](
        q_nope,
        q_pe,
        values,
        scales if scales is not None else values,
        out,
        q_scale if q_scale is not None else values,
        *ints,
        **constexprs,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **({"launch_pdl": True} if cfg.pdl else {}),
    )
    if not known:
        with _compiled_lock:
            _compiled.add(key)
    return key, None if common.interpreting() else compiled


def register_interpreted(key: KernelKey) -> bool:
    """Record a key without compiling (the interpreter has nothing to compile)."""
    with _compiled_lock:
        new = key not in _compiled
        _compiled.add(key)
    return new


def _operands(m: int, num_heads: int, qk_nope: int, device: torch.device, out_dtype, aligned: bool):
    # One element of lead-in misaligns every row start: the io_aligned=False variant.
    lead = 0 if aligned else 1
    width = qk_nope + QK_ROPE
    q = torch.zeros(lead + m * num_heads * width, dtype=torch.bfloat16, device=device)
    q = q[lead:].view(m, num_heads, width)
    out = torch.empty(lead + m * num_heads * QUERY_WIDTH, dtype=out_dtype, device=device)
    return q[..., :qk_nope], q[..., qk_nope:], out[lead:].view(m, num_heads, QUERY_WIDTH)


def prewarm(
    values: torch.Tensor,
    scales: torch.Tensor | None,
    m: int,
    out_dtype: torch.dtype,
    config: LaunchConfig,
) -> int:
    """Compile the variants a launch of ``config`` with ``m`` tokens on this weight can need
    (rows of q and out aligned or not); returns how many were new."""
    num_heads = values.shape[0]
    out_fp8 = out_dtype == torch.float8_e4m3fn
    weight_format = "bf16" if scales is None else "mxfp8"
    q_scale = torch.ones(1, dtype=torch.float32, device=values.device) if out_fp8 else None
    new = 0
    for aligned in (True, False):
        key = kernel_key(
            values, config, weight_format=weight_format, out_fp8=out_fp8, io_is_aligned=aligned
        )
        if key in compiled_keys():
            continue
        if common.interpreting():
            new += register_interpreted(key)
            continue
        q_nope, q_pe, out = _operands(
            m, num_heads, values.shape[1], values.device, out_dtype, aligned
        )
        launched = launch(q_nope, values, scales, q_pe, out, q_scale, config=config)
        assert launched == key, (launched, key)
        new += 1
    return new
