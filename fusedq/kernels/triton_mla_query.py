"""Triton kernel for the fused MLA decode query projection.

One launch computes, for every token ``m`` and head ``h``::

    out[m, h, :512]    = q_nope[m, h, :192] @ W[h, :192, :512]   (BF16 or E4M3 out)
    out[m, h, 512:576] = q_pe[m, h, :64]

The work is latency bound (a few MB of weights, ~2 µs budget), so the grid spreads the
weight read over ``heads x N-tiles`` CTAs, every CTA issues all of its loads before its
first ``tl.dot``, and the RoPE copy rides along in the first N-tile CTA of each head.

Specialisation is under host control: every integer argument is ``do_not_specialize`` and
no pointer is specialised on alignment, so the compiled variant depends only on
``KernelKey`` (constexprs + dtypes). Alignment comes back as ``tl.multiple_of`` hints
behind constexpr flags that the host computes. ``prewarm`` walks those keys; a launch
under CUDA-graph capture whose key was never compiled raises instead of compiling.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import torch
import triton
import triton.language as tl

from fusedq import limits

try:  # programmatic dependent launch (griddepcontrol); Triton >= 3.3
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    HAS_PDL = True
except ImportError:  # pragma: no cover - older Triton
    gdc_launch_dependents = gdc_wait = None
    HAS_PDL = False

# The problem's axes in the kernel's terms (fusedq.limits holds the facts): K is qk_nope,
# N is kv_lora_rank, then the RoPE part; E4M3_MAX and MX_BLOCK as there.
HEAD_K = limits.QK_NOPE
HEAD_N = limits.KV_LORA
ROPE = limits.QK_ROPE
OUT_WIDTH = limits.QUERY_WIDTH
E4M3_MAX = limits.E4M3_MAX
MX_BLOCK = limits.MX_BLOCK

# The OUT_FP8 constexpr (``LaunchConfig.e4m3_epilogue`` picks the E4M3 ones): BF16 output;
# E4M3 quantised as vLLM's static FP8 quant does it (``x * (1 / q_scale)``: its CUDA op
# ``static_scaled_fp8_quant`` takes the reciprocal once and multiplies, and so does
# ``QuantFP8.forward_native``), "mul", stored from the MMA layout; the same stored through
# shared memory 16 bytes a thread, "wide" (the Gluon kernel only). Two more exist only for
# ``fusedq-bench --sweep --sweep-e4m3`` to time against them: an IEEE division per element
# ("div", the epilogue before 2026-12-01), and no scaling at all ("noscale": no q_scale load,
# which separates the scale's cost from the conversion's; its output is wrong).
OUT_BF16 = 0
OUT_E4M3 = 1
OUT_E4M3_DIV = 2
OUT_E4M3_NOSCALE = 3
OUT_E4M3_WIDE = 4
E4M3_EPILOGUES = {
    "mul": OUT_E4M3, "div": OUT_E4M3_DIV, "noscale": OUT_E4M3_NOSCALE, "wide": OUT_E4M3_WIDE,
}  # fmt: skip
# The modes the kernels compare OUT_FP8 against (a kernel reads module globals as constexprs).
_OUT_E4M3 = tl.constexpr(OUT_E4M3)
_OUT_E4M3_DIV = tl.constexpr(OUT_E4M3_DIV)
_OUT_E4M3_NOSCALE = tl.constexpr(OUT_E4M3_NOSCALE)

# K=192 is not a power of two; three unrolled 64-wide chunks cover it exactly.
BLOCK_K = 64
# ...or one 256-wide chunk masked down to 192: one shared-memory staging instead of three.
SINGLE_BLOCK_K = 256
# tl.dot needs at least 16 rows, so small M is padded with masks to 16 (one MMA tile).
MIN_BLOCK_M = 16
# 32-wide N tiles give heads*16 CTAs (128 at H=8): enough to cover the H200's 132 SMs once.
DEFAULT_BLOCK_N = 32
# Four warps map a [16|32, 32] accumulator onto mma.sync without idle warps at M<=16.
DEFAULT_NUM_WARPS = 4
# There is no K loop to pipeline (all chunks are unrolled and loaded up front).
DEFAULT_NUM_STAGES = 1
# The interpreter pays per program, not per element: one program per head keeps CPU CI fast.
INTERPRET_BLOCK_N = 512
# The register (FMA) path: no tl.dot, so no shared-memory staging of the MMA operands and no
# padding of M to 16. Rows are unrolled (BLOCK_M in FMA_BLOCK_MS), so it serves small M only.
FMA_BLOCK_MS = (1, 2, 4, 8)
# 16-byte vectors: what tl.multiple_of promises when the host says a tensor is aligned.
ALIGN_BYTES = 16

# FUSEDQ_PDL=1 launches with programmatic dependent launch (see LaunchConfig.pdl). Off by
# default: it only pays where the previous kernel lets dependents start early. Read once, at
# import: a decode step must not read the environment per call (callers pass ``pdl=``).
PDL_ENV = "FUSEDQ_PDL"
DEFAULT_PDL = HAS_PDL and os.environ.get(PDL_ENV, "0") == "1"

# Weight layouts the kernel distinguishes at compile time (which axis has unit stride).
W_GENERIC, W_UNIT_N, W_UNIT_K = 0, 1, 2


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


# Measured on one H200 (fusedq-bench --sweep, CUDA-graph replay, weights past L2):
# (weight format, E4M3 out, block_m) -> {heads: (block_n, num_warps, block_k)}.
# BF16: 3 K chunks win (one 256-wide staging tile costs more than it saves); more heads want
# wider N tiles (fewer, fuller CTAs). MXFP8: one 256-wide chunk, because Triton re-lays-out
# each fp8 tile right after its load (three chunks would mean three serial waits).
TUNED: dict[tuple[str, bool, int], dict[int, tuple[int, int, int]]] = {
    ("bf16", False, 16): {8: (32, 8, 64), 11: (64, 8, 64), 16: (64, 8, 64)},
    ("bf16", False, 32): {8: (32, 4, 64), 11: (64, 4, 64), 16: (64, 4, 64)},
    ("bf16", True, 16): {8: (32, 8, 64), 11: (32, 8, 64), 16: (32, 8, 64)},
    ("bf16", True, 32): {8: (32, 8, 256), 11: (64, 8, 256), 16: (64, 8, 256)},
    ("mxfp8", False, 16): {h: (32, 4, 256) for h in (8, 11, 16)},
    ("mxfp8", False, 32): {h: (32, 4, 256) for h in (8, 11, 16)},
    ("mxfp8", True, 16): {h: (32, 4, 256) for h in (8, 11, 16)},
    ("mxfp8", True, 32): {h: (32, 4, 256) for h in (8, 11, 16)},
}


# Register (FMA) path, where it measured as fast as the Gluon kernel or faster (fusedq-bench
# --sweep --sweep-fma): (weight format, E4M3 out, block_m) -> {heads: (block_n, num_warps)}.
# Shapes without an entry take the Gluon kernel (GLUON_TUNED), or tl.dot without Gluon.
# Retuned on the H200 on 2026-12-01 (150 samples, H 8/11/16 x M 1/2/4/16/32, every output
# checked; docs/bench/h200-sweep-tune-2026-12-01.json): an entry stays where it is within
# 0.02 us of the best Gluon variant (MXFP8 -> BF16 at H=8 M=1 it wins: 2.66 vs 2.74 us) and
# goes where Gluon's 64-wide tiles won: H=11/16 at M=1 by 0.07-0.14 us, every M=2 entry by
# 0.25-0.57 us (e.g. MXFP8 -> BF16 H=16 M=2: 3.54 vs 2.97).
FMA_TUNED: dict[tuple[str, bool, int], dict[int, tuple[int, int]]] = {
    ("bf16", False, 1): {8: (32, 4)},
    ("mxfp8", False, 1): {8: (32, 4)},
    ("bf16", True, 1): {8: (32, 4), 16: (32, 4)},
    ("mxfp8", True, 1): {8: (32, 4), 16: (32, 4)},
}


@dataclasses.dataclass(frozen=True)
class GluonChoice:
    """How the Gluon kernel runs one shape: its operand path (gluon_mla_query.OPERANDS),
    BLOCK_N and warps, and for E4M3 out whether the result is stored 16 bytes a thread
    through shared memory (the "wide" epilogue) rather than from the MMA layout."""

    operands: str
    block_n: int
    num_warps: int
    wide_store: bool = False


# The Gluon kernel replaces the tl.dot kernel everywhere it runs (it measured faster at every
# shape): (weight format, E4M3 out) -> rules (min heads, min M, choice), the first that holds
# wins. Retuned on the H200 on 2026-12-01 with E4M3's reciprocal multiply (fusedq-bench
# --sweep, 150-200 samples, every output checked; docs/bench/h200-sweep-tune-2026-12-01.json
# and h200-sweep-why-2026-12-01.json):
# - 64-wide N tiles from 11 heads (88 CTAs at H=11, 128 at 16), 32-wide at 8 (128 CTAs): at
#   H=11 the 64-wide tiles are 3-10 % faster for every recipe (BF16 M=32: 3.33 vs 3.51 us),
#   at H=8 they lose at M >= 16 (BF16 M=32: 3.17 vs 2.95).
# - BF16 out: "convert". E4M3 out: "smem" (BF16 weights: 3.96 vs convert's 4.22 us at H=16
#   M=32); MXFP8 -> E4M3 with 64-wide tiles wants 8 warps (H=16 M=1-4: 3.11-3.15 us against
#   3.32-3.35 with 4).
# - E4M3 from 16 tokens: the wide store. Two-byte stores from the MMA layout cost E4M3 up to
#   0.4 us over BF16 output at M=32 (H=16: 3.97 vs 3.54 us); through shared memory to 16-byte
#   stores it is 3.60. At M <= 4 the round trip costs more than it saves (H=16 M=4: 3.36 vs
#   3.32). With it, MXFP8 -> E4M3 at 11-16 heads is fastest on "convert" (H=16 M=16: 3.23 vs
#   smem's 3.37; M=32: 3.49 vs 3.40, the one shape it loses).
GLUON_TUNED: dict[tuple[str, bool], tuple[tuple[int, int, GluonChoice], ...]] = {
    ("bf16", False): ((11, 1, GluonChoice("convert", 64, 4)), (1, 1, GluonChoice("convert", 32, 4))),
    ("mxfp8", False): ((11, 1, GluonChoice("convert", 64, 4)), (1, 1, GluonChoice("convert", 32, 4))),
    ("bf16", True): (
        (11, 16, GluonChoice("smem", 64, 4, wide_store=True)),
        (11, 1, GluonChoice("smem", 64, 4)),
        (1, 16, GluonChoice("smem", 32, 4, wide_store=True)),
        (1, 1, GluonChoice("smem", 32, 4)),
    ),
    ("mxfp8", True): (
        (11, 16, GluonChoice("convert", 64, 4, wide_store=True)),
        (11, 1, GluonChoice("smem", 64, 8)),
        (1, 16, GluonChoice("smem", 32, 4, wide_store=True)),
        (1, 1, GluonChoice("smem", 32, 4)),
    ),
}  # fmt: skip


def gluon_choice(weight_format: str, out_fp8: bool, num_heads: int, m: int) -> GluonChoice | None:
    """The GLUON_TUNED choice for one shape (None for a recipe without Gluon rules)."""
    for min_heads, min_m, choice in GLUON_TUNED.get((weight_format, out_fp8), ()):
        if num_heads >= min_heads and m >= min_m:
            return choice
    return None


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
    # Register path (no tl.dot): block_m rows unrolled, K in three 64-wide chunks.
    fma: bool = False
    # The Gluon kernel (fusedq.kernels.gluon_mla_query: explicit layouts, every load issued
    # before the first layout conversion): block_m 16|32, K in three 64-wide chunks.
    # for_problem picks it per GLUON_TUNED; never under the interpreter.
    gluon: bool = False
    # With gluon: how the operand tiles reach the MMA layouts, one of
    # gluon_mla_query.OPERANDS ("convert" | "smem" | "direct"; the reasons are there).
    gluon_operands: str = "convert"
    # E4M3 out only: "mul" or "wide" (vLLM's quantisation, stored two ways); "div" and
    # "noscale" are measurement aids (see OUT_E4M3_DIV) that for_problem never picks.
    e4m3_epilogue: str = "mul"
    # Gluon and register path, BF16 out: a scheduling fence after the loads (LOAD_FENCE in
    # the kernels), or None for each kernel's measured choice (``fence``): on for the register
    # path, whose RoPE load ptxas otherwise issues after q's first use (3.10 against 2.69 us,
    # H200, H 8, M 1), off for Gluon, where it cost 0.15-0.24 us with BF16 weights and up to
    # 0.16 with MXFP8 (whose SASS still waits for a weight load before the last q loads).
    load_fence: bool | None = None

    @classmethod
    def for_problem(
        cls,
        num_heads: int,
        m: int,
        weight_format: str = "bf16",
        out_fp8: bool = False,
        *,
        allow_fma: bool = True,
        pdl: bool | None = None,
    ) -> LaunchConfig:
        """The heuristic choice for ``m`` tokens of ``num_heads`` heads (see ``TUNED`` and
        ``FMA_TUNED``); ``allow_fma=False`` gives the tl.dot path's choice. ``pdl=None`` is
        ``DEFAULT_PDL``."""
        pdl = DEFAULT_PDL if pdl is None else pdl
        fma_m = triton.next_power_of_2(max(m, 1))
        fma = FMA_TUNED.get((weight_format, out_fp8, fma_m), {}) if allow_fma else {}
        if interpreting():
            if num_heads in fma:  # the GPU takes the register path here: so does the interpreter
                return cls(block_m=fma_m, block_n=INTERPRET_BLOCK_N, num_warps=1, fma=True)
            block_m = max(MIN_BLOCK_M, fma_m)
            return cls(block_m=block_m, block_n=INTERPRET_BLOCK_N, block_k=SINGLE_BLOCK_K)
        if num_heads in fma:
            block_n, num_warps = fma[num_heads]
            return cls(fma_m, block_n, num_warps=num_warps, pdl=pdl, fma=True)
        block_m = max(MIN_BLOCK_M, fma_m)
        choice = gluon_choice(weight_format, out_fp8, num_heads, m)
        if choice is not None and _gluon_available():
            return cls(
                block_m, choice.block_n, num_warps=choice.num_warps, pdl=pdl, gluon=True,
                gluon_operands=choice.operands,
                e4m3_epilogue="wide" if choice.wide_store else "mul",
            )  # fmt: skip
        tuned = TUNED.get((weight_format, out_fp8, block_m), {})
        block_n, num_warps, block_k = tuned.get(
            num_heads, (DEFAULT_BLOCK_N, DEFAULT_NUM_WARPS, BLOCK_K)
        )
        return cls(block_m, block_n, num_warps=num_warps, block_k=block_k, pdl=pdl)

    @property
    def fence(self) -> bool:
        """The LOAD_FENCE constexpr: ``load_fence``, or the kernel's measured choice."""
        return self.fma if self.load_fence is None else self.load_fence

    def __post_init__(self) -> None:
        if self.block_n not in (16, 32, 64, 128, 256, 512):
            raise ValueError(f"block_n={self.block_n} must be a power of two in [16, 512]")
        if self.pdl and not HAS_PDL:
            raise ValueError("pdl=True needs Triton's griddepcontrol support (Triton >= 3.3)")
        if self.block_k not in (BLOCK_K, SINGLE_BLOCK_K):
            raise ValueError(f"block_k={self.block_k} must be {BLOCK_K} or {SINGLE_BLOCK_K}")
        if self.e4m3_epilogue not in E4M3_EPILOGUES:
            raise ValueError(
                f"e4m3_epilogue={self.e4m3_epilogue!r} must be one of {sorted(E4M3_EPILOGUES)}"
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
            if self.block_m not in FMA_BLOCK_MS or self.block_k != BLOCK_K:
                raise ValueError(
                    f"fma: block_m={self.block_m} must be in {FMA_BLOCK_MS} and "
                    f"block_k={self.block_k} must be {BLOCK_K}"
                )
        elif self.block_m < MIN_BLOCK_M or self.block_m & (self.block_m - 1):
            raise ValueError(f"block_m={self.block_m} must be a power of two >= {MIN_BLOCK_M}")

    def _check_gluon(self) -> None:
        from fusedq.kernels import gluon_mla_query

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
        if interpreting():
            raise ValueError(
                "gluon=True: Gluon kernels do not run under TRITON_INTERPRET=1 (they are "
                "compiled for the GPU only); use the Triton kernels there"
            )


def _gluon_available() -> bool:
    from fusedq.kernels import gluon_mla_query

    return gluon_mla_query.AVAILABLE


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
    """(layout, strides aligned) of a [H, 192, 512] weight: the part of ``weight_traits``
    that does not depend on the address."""
    _, s_k, s_n = values.stride()
    layout = _weight_layout(s_k, s_n)
    non_unit = tuple(s for s in values.stride() if s != 1)
    # Only the unit-stride axis can be vectorised, and only when all other strides keep
    # every row on a 16-byte boundary.
    return layout, layout != W_GENERIC and _strides_aligned(values, non_unit)


def weight_traits(values: torch.Tensor) -> tuple[int, bool]:
    """(layout, aligned) of a [H, 192, 512] weight tensor, as the kernel key needs them."""
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


@triton.jit
def _round_mantissa(x, DROP: tl.constexpr):
    # Round fp32 to nearest even at 2^DROP ulps (integer ops, so the interpreter agrees with
    # the GPU, whose conversions round to nearest even while the interpreter truncates).
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + ((1 << (DROP - 1)) - 1) + ((bits >> DROP) & 1)
    return ((bits >> DROP) << DROP).to(tl.float32, bitcast=True)


@triton.jit
def _to_bf16(x, INTERPRET: tl.constexpr):
    if INTERPRET:
        x = _round_mantissa(x, 16)
    return x.to(tl.bfloat16, fp_downcast_rounding="rtne")


@triton.jit
def _e4m3_factor(qs_ptr, OUT_FP8: tl.constexpr):
    # What _to_e4m3 applies: 1 / q_scale, rounded once (as vLLM's CUDA op computes it), or
    # q_scale itself for the dividing measurement variant, or 1 (no load) for "noscale".
    if OUT_FP8 == _OUT_E4M3_NOSCALE:
        q_scale = tl.full([], 1.0, tl.float32)
    else:
        q_scale = tl.load(qs_ptr)
        if OUT_FP8 == _OUT_E4M3:
            q_scale = tl.math.div_rn(tl.full([], 1.0, tl.float32), q_scale)
    return q_scale


@triton.jit
def _to_e4m3(x, factor, out_ty: tl.constexpr, INTERPRET: tl.constexpr, OUT_FP8: tl.constexpr):
    if OUT_FP8 == _OUT_E4M3_DIV:  # noqa: SIM108 (a constexpr branch)
        y = tl.math.div_rn(x, factor)
    else:
        y = x * factor
    y = tl.minimum(tl.maximum(y, -448.0), 448.0)
    if INTERPRET:
        # Normal E4M3 keeps 3 of fp32's 23 mantissa bits; below 2^-6 the grid is 2^-9
        # (subnormals), where adding and removing 2^14 rounds to nearest even.
        sub = (tl.abs(y) + 16384.0) - 16384.0
        sub = tl.where(y < 0, -sub, sub)
        y = tl.where(tl.abs(y) < 0.015625, sub, _round_mantissa(y, 20))
    return y.to(out_ty, fp_downcast_rounding="rtne")


@triton.jit
def _load_w(
    w_ptr, offs_k, offs_n, k_mask, stride_wk, stride_wn,
    W_LAYOUT: tl.constexpr, W_ALIGNED: tl.constexpr, K_MASKED: tl.constexpr,
):  # fmt: skip
    if W_LAYOUT == 1:
        ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :]
    elif W_LAYOUT == 2:
        ptrs = w_ptr + offs_k[:, None] + offs_n[None, :] * stride_wn
    else:
        ptrs = w_ptr + offs_k[:, None] * stride_wk + offs_n[None, :] * stride_wn
    if W_ALIGNED:
        ptrs = tl.multiple_of(ptrs, [16, 16])
    if K_MASKED:  # noqa: SIM108
        w = tl.load(ptrs, mask=k_mask[:, None], other=0.0)
    else:
        w = tl.load(ptrs)
    return w


@triton.jit
def _load_scales(
    ws_ptr, offs_k, offs_n, k_mask, pid_n, stride_sk, stride_sn,
    BLOCK_N: tl.constexpr, K_MASKED: tl.constexpr,
):  # fmt: skip
    if BLOCK_N <= 32:
        # One scale per K row for the whole tile: a [BLOCK_K] load, broadcast along N.
        ptrs = ws_ptr + offs_k * stride_sk + ((pid_n * BLOCK_N) // 32) * stride_sn
        if K_MASKED:  # noqa: SIM108 (constexpr branches read clearer than IfExp in Triton)
            s = tl.load(ptrs, mask=k_mask, other=127)
        else:
            s = tl.load(ptrs)
        s = s.to(tl.int32)[:, None]
    else:
        ptrs = ws_ptr + offs_k[:, None] * stride_sk + (offs_n[None, :] // 32) * stride_sn
        if K_MASKED:  # noqa: SIM108
            s = tl.load(ptrs, mask=k_mask[:, None], other=127)
        else:
            s = tl.load(ptrs)
        s = s.to(tl.int32)
    return s


@triton.jit
def _dequant(raw, s, INTERPRET: tl.constexpr):
    # 2^(s-127) built from the exponent bits (exact); byte 0 is the subnormal 2^-127.
    scale = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
    # e4m3 * 2^k has at most 4 significant bits, so this bf16 rounding is exact.
    return _to_bf16(raw.to(tl.float32) * scale, INTERPRET)


@triton.jit
def _load_q(q_rows, m_mask, k_mask, BLOCK_K: tl.constexpr, SINGLE: tl.constexpr):
    if SINGLE:
        q0 = tl.load(q_rows, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        q1 = q0
        q2 = q0
    else:
        q0 = tl.load(q_rows, mask=m_mask[:, None], other=0.0)
        q1 = tl.load(q_rows + BLOCK_K, mask=m_mask[:, None], other=0.0)
        q2 = tl.load(q_rows + 2 * BLOCK_K, mask=m_mask[:, None], other=0.0)
    return q0, q1, q2


# Both kernels (MMA and FMA) take the same arguments and leave specialisation to the host
# (see the module docstring): one list for the two.
_JIT_OPTIONS = dict(
    do_not_specialize=[
        "M",
        "stride_qm",
        "stride_qh",
        "stride_pm",
        "stride_ph",
        "stride_wh",
        "stride_wk",
        "stride_wn",
        "stride_sh",
        "stride_sk",
        "stride_sn",
        "stride_om",
        "stride_oh",
    ],
    do_not_specialize_on_alignment=["q_ptr", "qpe_ptr", "w_ptr", "ws_ptr", "out_ptr", "qs_ptr"],
)


@triton.jit
def _dot(q, w, acc, INTERPRET: tl.constexpr):
    if INTERPRET:
        # The interpreter multiplies raw bf16 bit patterns in some versions: go through fp32.
        acc = tl.dot(q.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    else:
        acc = tl.dot(q, w, acc)
    return acc


@triton.jit(**_JIT_OPTIONS)
def _mla_query_kernel(
    q_ptr,
    qpe_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    qs_ptr,
    M,
    stride_qm,
    stride_qh,
    stride_pm,
    stride_ph,
    stride_wh,
    stride_wk,
    stride_wn,
    stride_sh,
    stride_sk,
    stride_sn,
    stride_om,
    stride_oh,
    K: tl.constexpr,
    N: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_LAYOUT: tl.constexpr,
    W_ALIGNED: tl.constexpr,
    IO_ALIGNED: tl.constexpr,
    MXFP8: tl.constexpr,
    OUT_FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,
    LOAD_FENCE: tl.constexpr,  # (unused here: the three kernels share one parameter list)
):
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    k_mask = offs_k < K
    # BLOCK_K == K / 3: three exact chunks. BLOCK_K >= K: one chunk padded with masks
    # (fewer layout round trips through shared memory, 25% idle MMA work).
    SINGLE: tl.constexpr = BLOCK_K >= K

    # Every global load is issued before the first use of any loaded value, so the CTA pays
    # one memory round trip. Triton converts the layout of fp8 tiles right after their load,
    # which waits for the data: so the small L2-resident loads go first and the weight last
    # (and MXFP8 wants the single-chunk variant, whose one weight load is the last load).
    w_head = w_ptr + h.to(tl.int64) * stride_wh
    ws_head = ws_ptr + h.to(tl.int64) * stride_sh
    q_rows = q_ptr + offs_m[:, None].to(tl.int64) * stride_qm + h * stride_qh + offs_k[None, :]
    if IO_ALIGNED:
        q_rows = tl.multiple_of(q_rows, [16, 16])
    if not USE_PDL:
        q0, q1, q2 = _load_q(q_rows, m_mask, k_mask, BLOCK_K, SINGLE)
    if SINGLE:
        if MXFP8:
            s0 = _load_scales(
                ws_head, offs_k, offs_n, k_mask, pid_n, stride_sk, stride_sn, BLOCK_N, True
            )
        w0 = _load_w(
            w_head, offs_k, offs_n, k_mask, stride_wk, stride_wn, W_LAYOUT, W_ALIGNED, True
        )
    else:
        if MXFP8:
            s0 = _load_scales(
                ws_head, offs_k, offs_n, k_mask, pid_n, stride_sk, stride_sn, BLOCK_N, False
            )
            s1 = _load_scales(
                ws_head + BLOCK_K * stride_sk, offs_k, offs_n, k_mask, pid_n, stride_sk,
                stride_sn, BLOCK_N, False,
            )  # fmt: skip
            s2 = _load_scales(
                ws_head + 2 * BLOCK_K * stride_sk, offs_k, offs_n, k_mask, pid_n, stride_sk,
                stride_sn, BLOCK_N, False,
            )  # fmt: skip
        w1_head = w_head + BLOCK_K * stride_wk
        w2_head = w_head + 2 * BLOCK_K * stride_wk
        w0 = _load_w(
            w_head, offs_k, offs_n, k_mask, stride_wk, stride_wn, W_LAYOUT, W_ALIGNED, False
        )
        w1 = _load_w(
            w1_head, offs_k, offs_n, k_mask, stride_wk, stride_wn, W_LAYOUT, W_ALIGNED, False
        )
        w2 = _load_w(
            w2_head, offs_k, offs_n, k_mask, stride_wk, stride_wn, W_LAYOUT, W_ALIGNED, False
        )
    if USE_PDL:
        # Weights depend on no earlier kernel; q, q_pe, q_scale and out may (RAW and WAR).
        gdc_wait()
        gdc_launch_dependents()
        q0, q1, q2 = _load_q(q_rows, m_mask, k_mask, BLOCK_K, SINGLE)
    if OUT_FP8:
        q_scale = _e4m3_factor(qs_ptr, OUT_FP8)

    if pid_n == 0:
        # The RoPE half is a plain copy (quantised for E4M3); one CTA per head does it.
        offs_r = tl.arange(0, R)
        pe_ptrs = qpe_ptr + offs_m[:, None].to(tl.int64) * stride_pm + h * stride_ph
        pe_ptrs = pe_ptrs + offs_r[None, :]
        pe_out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + h * stride_oh
        pe_out = pe_out + N + offs_r[None, :]
        if IO_ALIGNED:
            pe_ptrs = tl.multiple_of(pe_ptrs, [16, 16])
            pe_out = tl.multiple_of(pe_out, [16, 16])
        if OUT_FP8:
            # Padding rows load 1, not 0: dividing 0 (OUT_E4M3_DIV) takes div.rn's slow path.
            pe = tl.load(pe_ptrs, mask=m_mask[:, None], other=1.0)
            pe = _to_e4m3(pe.to(tl.float32), q_scale, out_ptr.dtype.element_ty, INTERPRET, OUT_FP8)
        else:
            pe = tl.load(pe_ptrs, mask=m_mask[:, None], other=0.0)
        tl.store(pe_out, pe, mask=m_mask[:, None])

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if SINGLE:
        if MXFP8:
            w0 = _dequant(w0, s0, INTERPRET)
        acc = _dot(q0, w0, acc, INTERPRET)
    else:
        if MXFP8:
            w0 = _dequant(w0, s0, INTERPRET)
            w1 = _dequant(w1, s1, INTERPRET)
            w2 = _dequant(w2, s2, INTERPRET)
        acc = _dot(q0, w0, acc, INTERPRET)
        acc = _dot(q1, w1, acc, INTERPRET)
        acc = _dot(q2, w2, acc, INTERPRET)

    o_ptrs = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + h * stride_oh
    o_ptrs = o_ptrs + offs_n[None, :]
    if IO_ALIGNED:
        o_ptrs = tl.multiple_of(o_ptrs, [16, 16])
    if OUT_FP8:
        # vLLM's staged path rounds the bmm result to bf16 before quantising: so do we.
        y = _to_bf16(acc, INTERPRET).to(tl.float32)
        if OUT_FP8 == _OUT_E4M3_DIV:
            # Padding rows divide 1, not 0 (div.rn's slow path); they are not stored anyway.
            y = tl.where(m_mask[:, None], y, 1.0)
        y = _to_e4m3(y, q_scale, out_ptr.dtype.element_ty, INTERPRET, OUT_FP8)
        tl.store(o_ptrs, y, mask=m_mask[:, None])
    else:
        tl.store(o_ptrs, _to_bf16(acc, INTERPRET), mask=m_mask[:, None])


@triton.jit
def _fma_weight(raw, s, MXFP8: tl.constexpr):
    # The weight chunk in fp32, in the layout it was loaded in (no conversion).
    if MXFP8:
        # 2^(s-127) from the exponent bits (byte 0 is the subnormal 2^-127); e4m3 x 2^k is
        # exact in fp32, so this equals the staged path's dequantised bf16 weight.
        scale = tl.where(s == 0, 0x00400000, s << 23).to(tl.float32, bitcast=True)
        w = raw.to(tl.float32) * scale
    else:
        w = raw.to(tl.float32)
    return w


@triton.jit
def _fma_load_q(q_head, m, M, stride_qm, offs_k, BLOCK_K: tl.constexpr, IO_ALIGNED: tl.constexpr):
    # Row m of q_nope as three [BLOCK_K, 1] chunks (zeros past M): K along dim 0, as in the
    # weight tile, so that the product broadcasts along N.
    row = q_head + m * stride_qm.to(tl.int64) + offs_k[:, None]
    if IO_ALIGNED:
        row = tl.multiple_of(row, [16, 1])
    valid = offs_k[:, None] * 0 + m < M  # a tensor mask (the interpreter rejects a bool)
    q0 = tl.load(row, mask=valid, other=0.0)
    q1 = tl.load(row + BLOCK_K, mask=valid, other=0.0)
    q2 = tl.load(row + 2 * BLOCK_K, mask=valid, other=0.0)
    return q0, q1, q2


@triton.jit
def _fma_f32(q0, q1, q2):
    return q0.to(tl.float32), q1.to(tl.float32), q2.to(tl.float32)


@triton.jit
def _fma_row(q0, q1, q2, w0, w1, w2, acc, m, offs_m):
    # acc[m, n] = sum_k q[m, k] w[k, n]: exact bf16 x bf16 (or dequantised e4m3) products,
    # fp32 sums, as the MMA computes them.
    p = q0 * w0
    p += q1 * w1
    p += q2 * w2
    row = tl.sum(p, axis=0)
    return tl.where(offs_m[:, None] == m, row[None, :], acc)


@triton.jit(**_JIT_OPTIONS)
def _mla_query_fma_kernel(
    q_ptr,
    qpe_ptr,
    w_ptr,
    ws_ptr,
    out_ptr,
    qs_ptr,
    M,
    stride_qm,
    stride_qh,
    stride_pm,
    stride_ph,
    stride_wh,
    stride_wk,
    stride_wn,
    stride_sh,
    stride_sk,
    stride_sn,
    stride_om,
    stride_oh,
    K: tl.constexpr,
    N: tl.constexpr,
    R: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    W_LAYOUT: tl.constexpr,
    W_ALIGNED: tl.constexpr,
    IO_ALIGNED: tl.constexpr,
    MXFP8: tl.constexpr,
    OUT_FP8: tl.constexpr,
    INTERPRET: tl.constexpr,
    USE_PDL: tl.constexpr,
    LOAD_FENCE: tl.constexpr,
):
    # The register path: the weight tile stays in the registers it is loaded into (threads
    # along its unit-stride axis), each of the BLOCK_M (<= 8) rows is a broadcast multiply and
    # a reduction over K. No tl.dot, so no shared-memory staging and no padding of M to 16.
    # The epilogues (RoPE copy, output store) repeat the tl.dot kernel's rather than share a
    # helper: written once as helpers they cost some variants 4-12 % on the H200 (Triton 3.6
    # compiled the moved address arithmetic differently), and the BF16 code here is kept
    # token for token as it was measured.
    pid_n = tl.program_id(0)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    k_mask = offs_k < K
    w_head = w_ptr + h.to(tl.int64) * stride_wh
    ws_head = ws_ptr + h.to(tl.int64) * stride_sh
    q_head = q_ptr + h.to(tl.int64) * stride_qh
    out_head = out_ptr + h.to(tl.int64) * stride_oh

    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M

    # Every load is issued before any loaded value is used: q rows, scales, weights.
    if not USE_PDL:
        qa0, qa1, qa2 = _fma_load_q(q_head, 0, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
        if BLOCK_M > 1:
            qb0, qb1, qb2 = _fma_load_q(q_head, 1, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
        if BLOCK_M > 2:
            qc0, qc1, qc2 = _fma_load_q(q_head, 2, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
            qd0, qd1, qd2 = _fma_load_q(q_head, 3, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
        if BLOCK_M > 4:
            qe0, qe1, qe2 = _fma_load_q(q_head, 4, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
            qf0, qf1, qf2 = _fma_load_q(q_head, 5, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
            qg0, qg1, qg2 = _fma_load_q(q_head, 6, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
            qh0, qh1, qh2 = _fma_load_q(q_head, 7, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
    if MXFP8:
        s0 = _load_scales(
            ws_head, offs_k, offs_n, k_mask, pid_n, stride_sk, stride_sn, BLOCK_N, False
        )
        s1 = _load_scales(
            ws_head + BLOCK_K * stride_sk, offs_k, offs_n, k_mask, pid_n, stride_sk, stride_sn,
            BLOCK_N, False,
        )  # fmt: skip
        s2 = _load_scales(
            ws_head + 2 * BLOCK_K * stride_sk, offs_k, offs_n, k_mask, pid_n, stride_sk,
            stride_sn, BLOCK_N, False,
        )  # fmt: skip
    else:
        s0 = 0
        s1 = 0
        s2 = 0
    r0 = _load_w(w_head, offs_k, offs_n, k_mask, stride_wk, stride_wn, W_LAYOUT, W_ALIGNED, False)
    r1 = _load_w(
        w_head + BLOCK_K * stride_wk, offs_k, offs_n, k_mask, stride_wk, stride_wn, W_LAYOUT,
        W_ALIGNED, False,
    )  # fmt: skip
    r2 = _load_w(
        w_head + 2 * BLOCK_K * stride_wk, offs_k, offs_n, k_mask, stride_wk, stride_wn, W_LAYOUT,
        W_ALIGNED, False,
    )  # fmt: skip
    if USE_PDL:
        # Weights depend on no earlier kernel; q, q_pe and out may (RAW and WAR).
        gdc_wait()
        gdc_launch_dependents()
        qa0, qa1, qa2 = _fma_load_q(q_head, 0, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
        if BLOCK_M > 1:
            qb0, qb1, qb2 = _fma_load_q(q_head, 1, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
        if BLOCK_M > 2:
            qc0, qc1, qc2 = _fma_load_q(q_head, 2, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
            qd0, qd1, qd2 = _fma_load_q(q_head, 3, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
        if BLOCK_M > 4:
            qe0, qe1, qe2 = _fma_load_q(q_head, 4, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
            qf0, qf1, qf2 = _fma_load_q(q_head, 5, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
            qg0, qg1, qg2 = _fma_load_q(q_head, 6, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
            qh0, qh1, qh2 = _fma_load_q(q_head, 7, M, stride_qm, offs_k, BLOCK_K, IO_ALIGNED)
    # The RoPE half, by the first N tile of each head (quantised for E4M3): its load is
    # predicated, not branched, and for E4M3 issued before q_scale's reciprocal. ptxas
    # schedules nothing across that reciprocal's slow-path call, and a load in a branch of its
    # own came after the q loads' first use: either way the load was issued only after an
    # earlier one had arrived, a second round trip (sm_90 SASS, 2026-12-01; test_sass.py).
    offs_r = tl.arange(0, R)
    pe_ptrs = qpe_ptr + offs_m[:, None].to(tl.int64) * stride_pm + h * stride_ph
    pe_ptrs = pe_ptrs + offs_r[None, :]
    pe_out = out_head + offs_m[:, None].to(tl.int64) * stride_om + N + offs_r[None, :]
    if IO_ALIGNED:
        pe_ptrs = tl.multiple_of(pe_ptrs, [16, 16])
        pe_out = tl.multiple_of(pe_out, [16, 16])
    # All M rows in the first N tile, none in the others.
    pe_mask = offs_m[:, None] < tl.where(pid_n == 0, M, 0)
    if OUT_FP8:
        # Padding rows load 1, not 0: dividing 0 (OUT_E4M3_DIV) takes div.rn's slow path.
        pe = tl.load(pe_ptrs, mask=pe_mask, other=1.0)
        q_scale = _e4m3_factor(qs_ptr, OUT_FP8)
        pe = _to_e4m3(pe.to(tl.float32), q_scale, out_ptr.dtype.element_ty, INTERPRET, OUT_FP8)
    else:
        pe = tl.load(pe_ptrs, mask=pe_mask, other=0.0)
        if LOAD_FENCE and not INTERPRET:
            # BF16 out has no reciprocal: the same fence, from a division that cannot change
            # the mask (M >= 1). Without it ptxas converted q before issuing this load.
            fence = tl.math.div_rn(tl.full([], 1.0, tl.float32), M.to(tl.float32))
            pe_mask = pe_mask & (fence > 0.0)
    tl.store(pe_out, pe, mask=pe_mask)

    # q in fp32, all rows, before the first use of the weights.
    qa0, qa1, qa2 = _fma_f32(qa0, qa1, qa2)
    if BLOCK_M > 1:
        qb0, qb1, qb2 = _fma_f32(qb0, qb1, qb2)
    if BLOCK_M > 2:
        qc0, qc1, qc2 = _fma_f32(qc0, qc1, qc2)
        qd0, qd1, qd2 = _fma_f32(qd0, qd1, qd2)
    if BLOCK_M > 4:
        qe0, qe1, qe2 = _fma_f32(qe0, qe1, qe2)
        qf0, qf1, qf2 = _fma_f32(qf0, qf1, qf2)
        qg0, qg1, qg2 = _fma_f32(qg0, qg1, qg2)
        qh0, qh1, qh2 = _fma_f32(qh0, qh1, qh2)
    w0 = _fma_weight(r0, s0, MXFP8)
    w1 = _fma_weight(r1, s1, MXFP8)
    w2 = _fma_weight(r2, s2, MXFP8)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc = _fma_row(qa0, qa1, qa2, w0, w1, w2, acc, 0, offs_m)
    if BLOCK_M > 1:
        acc = _fma_row(qb0, qb1, qb2, w0, w1, w2, acc, 1, offs_m)
    if BLOCK_M > 2:
        acc = _fma_row(qc0, qc1, qc2, w0, w1, w2, acc, 2, offs_m)
        acc = _fma_row(qd0, qd1, qd2, w0, w1, w2, acc, 3, offs_m)
    if BLOCK_M > 4:
        acc = _fma_row(qe0, qe1, qe2, w0, w1, w2, acc, 4, offs_m)
        acc = _fma_row(qf0, qf1, qf2, w0, w1, w2, acc, 5, offs_m)
        acc = _fma_row(qg0, qg1, qg2, w0, w1, w2, acc, 6, offs_m)
        acc = _fma_row(qh0, qh1, qh2, w0, w1, w2, acc, 7, offs_m)
    # One store of all rows (one layout conversion of the result, not one per row).
    o_ptrs = out_head + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    if IO_ALIGNED:
        o_ptrs = tl.multiple_of(o_ptrs, [16, 16])
    if OUT_FP8:
        # As the tl.dot kernel: bf16 rounding first (vLLM's staged path).
        y = _to_bf16(acc, INTERPRET).to(tl.float32)
        if OUT_FP8 == _OUT_E4M3_DIV:
            y = tl.where(m_mask[:, None], y, 1.0)
        y = _to_e4m3(y, q_scale, out_ptr.dtype.element_ty, INTERPRET, OUT_FP8)
        tl.store(o_ptrs, y, mask=m_mask[:, None])
    else:
        tl.store(o_ptrs, _to_bf16(acc, INTERPRET), mask=m_mask[:, None])


def kernel_key(
    values: torch.Tensor,
    m: int,
    *,
    weight_format: str,
    out_fp8: bool,
    io_is_aligned: bool,
    config: LaunchConfig | None = None,
) -> KernelKey:
    """The key a launch with these operands compiles under."""
    num_heads = values.shape[0]
    layout, w_is_aligned = weight_traits(values)
    return KernelKey(
        config=config or LaunchConfig.for_problem(num_heads, m, weight_format, out_fp8),
        weight_format=weight_format,
        out_fp8=out_fp8,
        w_layout=layout,
        w_aligned=w_is_aligned,
        io_aligned=io_is_aligned,
        device_index=values.device.index if values.device.type == "cuda" else -1,
    )


def grid_for(config: LaunchConfig, num_heads: int) -> tuple[int, int]:
    """(N tiles, heads): the launch grid of ``config``."""
    return HEAD_N // config.block_n, num_heads


def kernel_for(config: LaunchConfig):
    """The jit kernel ``config`` runs (Gluon, register path or tl.dot); all three take the
    same parameters."""
    if config.gluon:
        from fusedq.kernels import gluon_mla_query

        return gluon_mla_query.kernel_for_operands(config.gluon_operands)
    return _mla_query_fma_kernel if config.fma else _mla_query_kernel


def out_mode(out_fp8: bool, e4m3_epilogue: str = "mul") -> int:
    """The OUT_FP8 constexpr: OUT_BF16, or the E4M3 epilogue's (E4M3_EPILOGUES)."""
    return E4M3_EPILOGUES[e4m3_epilogue] if out_fp8 else OUT_BF16


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
        "K": HEAD_K,
        "N": HEAD_N,
        "R": ROPE,
        "BLOCK_M": cfg.block_m,
        "BLOCK_N": cfg.block_n,
        "BLOCK_K": cfg.block_k,
        "W_LAYOUT": key.w_layout,
        "W_ALIGNED": key.w_aligned,
        "IO_ALIGNED": key.io_aligned,
        "MXFP8": scales is not None,
        "OUT_FP8": out_mode(key.out_fp8, cfg.e4m3_epilogue),
        "INTERPRET": interpreting(),
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
    config: LaunchConfig | None = None,
) -> KernelKey:
    """Launch the kernel on validated operands; returns the key it ran under.

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
    config: LaunchConfig | None = None,
):
    """``launch``, also returning Triton's compiled kernel (``None`` under the interpreter or
    for M = 0), whose launcher ``fast_launch`` calls directly afterwards."""
    m, num_heads, _ = q_nope.shape
    out_fp8 = out.dtype == torch.float8_e4m3fn
    key = kernel_key(
        values,
        m,
        weight_format="mxfp8" if scales is not None else "bf16",
        out_fp8=out_fp8,
        io_is_aligned=io_aligned(q_nope, q_pe, out),
        config=config,
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
    ints, constexprs = launch_arguments(q_nope, values, scales, q_pe, out, key)
    compiled = kernel_for(cfg)[grid_for(cfg, num_heads)](
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
    return key, None if interpreting() else compiled


def register_interpreted(key: KernelKey) -> bool:
    """Record a key without compiling (the interpreter has nothing to compile)."""
    with _compiled_lock:
        new = key not in _compiled
        _compiled.add(key)
    return new


def _operands(m: int, num_heads: int, device: torch.device, out_dtype, aligned: bool):
    # One element of lead-in misaligns every row start: the io_aligned=False variant.
    lead = 0 if aligned else 1
    q = torch.zeros(lead + m * num_heads * (HEAD_K + ROPE), dtype=torch.bfloat16, device=device)
    q = q[lead:].view(m, num_heads, HEAD_K + ROPE)
    out = torch.empty(lead + m * num_heads * OUT_WIDTH, dtype=out_dtype, device=device)
    return q[..., :HEAD_K], q[..., HEAD_K:], out[lead:].view(m, num_heads, OUT_WIDTH)


def prewarm(
    values: torch.Tensor,
    scales: torch.Tensor | None,
    m: int,
    out_dtype: torch.dtype,
    *,
    pdl: bool | None = None,
) -> int:
    """Compile the variants a launch with ``m`` tokens on this weight can need (rows of q and
    out aligned or not; ``pdl`` as the calls will pass it); returns how many were new."""
    num_heads = values.shape[0]
    out_fp8 = out_dtype == torch.float8_e4m3fn
    weight_format = "bf16" if scales is None else "mxfp8"
    config = LaunchConfig.for_problem(num_heads, m, weight_format, out_fp8, pdl=pdl)
    q_scale = torch.ones(1, dtype=torch.float32, device=values.device) if out_fp8 else None
    new = 0
    for aligned in (True, False):
        key = kernel_key(
            values,
            m,
            weight_format=weight_format,
            out_fp8=out_fp8,
            io_is_aligned=aligned,
            config=config,
        )
        if key in compiled_keys():
            continue
        if interpreting():
            new += register_interpreted(key)
            continue
        q_nope, q_pe, out = _operands(m, num_heads, values.device, out_dtype, aligned)
        launched = launch(q_nope, values, scales, q_pe, out, q_scale, config=config)
        assert launched == key, (launched, key)
        new += 1
    return new
