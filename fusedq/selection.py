"""Which kernel runs a problem, with which launch configuration, and why: the one table.

A problem is a geometry (``fusedq.contract.GEOMETRIES``), a recipe (weight format x output
dtype), the heads per rank H, the token count M, the device, PDL, and what is installed (nvidia-cutlass-dsl for the CuTe kernel, Triton's
Gluon). ``select`` answers for one problem with a ``Selection``, and everything that needs the
answer reads it here: the dispatcher binds it, ``prewarm`` compiles it, ``kernel_choice`` and
``kernel_summary`` report it, ``fusedq-bench`` times it. ``capability`` only gates (can the
recipe run on this device at all); the kernel modules run the configuration they are given.

The rules, in the order ``select`` applies them:

1. ``capability.explain`` gives a reason: the staged path.
2. CPU tensors (the Triton interpreter): the Triton kernels, one program per head.
3. On CUDA, the CuTe DSL kernel where ``capability.cute_problem`` has no objection (GLM-5's
   geometry only) and M is at most ``CUTE_MAX_M`` of the weight format. It runs in CUDA
   graphs; eager calls (and operands it cannot take) run its fallback, the Triton-family
   configuration of rule 4.
4. The Triton family, from the geometry's tables (``TABLES``): the register path where
   ``FMA_TUNED`` has the shape, else the Gluon kernel as ``GLUON_TUNED`` says where Gluon
   imports, else the tl.dot kernel as ``TUNED`` says. GLM-5 has all three tables; DeepSeek-V3
   the tl.dot one (``DSV3_TUNED``, to 64 tokens, with its rows per CTA). Above 32 tokens the
   tl.dot kernel tiles M in 64-row blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable

import torch
import triton

from fusedq import capability
from fusedq.contract import DEEPSEEK_V3, GLM5, KV_LORA, QUALIFIED, Geometry
from fusedq.kernels import common, gluon_mla_query, triton_mla_query
from fusedq.kernels.triton_launch import DEFAULT_NUM_WARPS, DEFAULT_PDL, LaunchConfig

# What a problem can run: the CuTe DSL kernel, the Triton family (register, Gluon, tl.dot
# kernels), or the staged ops (no fused kernel).
KERNEL_FAMILIES = ("cute", "triton", "staged")

# The largest M the CuTe kernel runs, per weight format: up to there it measured faster than
# the Triton kernels in CUDA graphs, above it falls behind (its FMAs do not scale with M);
# docs/decisions/0001-cute-for-small-m.md.
CUTE_MAX_M = {"mxfp8": 4, "bf16": 2}

# The register (FMA) path, where it measured as fast as the Gluon kernel or faster:
# (weight format, E4M3 out, block_m) -> {heads: (block_n, num_warps)}. Shapes without an entry
# take the Gluon kernel (GLUON_TUNED), or tl.dot without Gluon;
# docs/decisions/0006-gluon-for-larger-m.md.
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
# wins. 64-wide N tiles from 11 heads, 32-wide at 8 (where the wider tiles leave too few CTAs);
# BF16 out converts its operands, E4M3 out stages them in shared memory; E4M3 from 16 tokens
# stores through shared memory 16 bytes a thread, where the MMA layout's 2-byte stores cost
# more than the round trip; docs/decisions/0006-gluon-for-larger-m.md.
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

# The tl.dot kernel, where Gluon does not import: (weight format, E4M3 out, block_m) ->
# {heads: (block_n, num_warps, block_k)}. BF16 weights: three K chunks (one wide staging tile
# costs more than it saves), wider N tiles for more heads (fewer, fuller CTAs). MXFP8: K in one
# chunk, because Triton re-lays-out each fp8 tile right after its load (three chunks would mean
# three serial waits); docs/decisions/0006-gluon-for-larger-m.md.
_ONE_K = triton_mla_query.SINGLE_BLOCK_K[GLM5.name]
_THREE_K = common.BLOCK_K
_GLM5_HEADS = QUALIFIED[GLM5.name].heads
TUNED: dict[tuple[str, bool, int], dict[int, tuple[int, int, int]]] = {
    ("bf16", False, 16): {8: (32, 8, _THREE_K), 11: (64, 8, _THREE_K), 16: (64, 8, _THREE_K)},
    ("bf16", False, 32): {8: (32, 4, _THREE_K), 11: (64, 4, _THREE_K), 16: (64, 4, _THREE_K)},
    ("bf16", True, 16): {8: (32, 8, _THREE_K), 11: (32, 8, _THREE_K), 16: (32, 8, _THREE_K)},
    ("bf16", True, 32): {8: (32, 8, _ONE_K), 11: (64, 8, _ONE_K), 16: (64, 8, _ONE_K)},
    ("mxfp8", False, 16): {h: (32, 4, _ONE_K) for h in _GLM5_HEADS},
    ("mxfp8", False, 32): {h: (32, 4, _ONE_K) for h in _GLM5_HEADS},
    ("mxfp8", True, 16): {h: (32, 4, _ONE_K) for h in _GLM5_HEADS},
    ("mxfp8", True, 32): {h: (32, 4, _ONE_K) for h in _GLM5_HEADS},
}


# DeepSeek-V3's tl.dot table, the same shape plus the rows per CTA where they differ from the
# padded M: (weight format, E4M3 out, padded M) -> {heads: (block_n, num_warps, block_k,
# block_m)}. From `fusedq-bench --sweep` on an H100 (2026-12-06; 48 variants a shape, the
# fastest summed over the shape's M: benchmarks/results/raw/h100/2026-12-06-deepseek-v3-
# sweep.json): K in one 128-wide chunk nearly everywhere, 64-wide N tiles from 16 heads (half
# the CTAs re-reading q), and MXFP8 in 64-row blocks at every M, where Triton uses Hopper's
# warpgroup MMA (at 32 rows the fp8 tiles took up to 6x longer). E4M3 out takes its weight
# format's entries (not swept: its epilogue differs, its loads and MMAs do not; at the old
# defaults MXFP8 -> E4M3 at 32 tokens ran 1.3-1.6x its staged path, from the 32-row tiles).
_D = DEEPSEEK_V3.qk_nope  # one K chunk (BLOCK_K = K = 128)
_H = common.BLOCK_K  # two 64-wide K chunks
DSV3_TUNED: dict[tuple[str, bool, int], dict[int, tuple[int, ...]]] = {
    ("bf16", False, 16): {8: (32, 4, _H, 16), 16: (64, 8, _D, 16), 32: (64, 8, _D, 16),
                          64: (64, 4, _D, 16), 128: (128, 8, _H, 16)},
    ("bf16", False, 32): {8: (32, 8, _D, 32), 16: (64, 8, _D, 32), 32: (64, 8, _D, 32),
                          64: (128, 4, _D, 32), 128: (64, 8, _D, 32)},
    ("bf16", False, 64): {8: (32, 8, _D, 64), 16: (64, 8, _D, 64), 32: (64, 4, _H, 64),
                          64: (64, 4, _H, 64), 128: (64, 8, _D, 64)},
    **{
        ("mxfp8", False, m): {8: (32, 8, _D, 64), 16: (32, 8, _D, 64), 32: (64, 8, _D, 64),
                              64: (64, 8, _D, 64), 128: (128, 4, _D, 64)}
        for m in (32, 64)
    },
    ("mxfp8", False, 16): {8: (32, 8, _D, 64), 16: (32, 8, _D, 64), 32: (32, 8, _D, 64),
                           64: (64, 4, _D, 64), 128: (128, 4, _D, 64)},
}  # fmt: skip
DSV3_TUNED.update({(fmt, True, m): v for (fmt, _, m), v in list(DSV3_TUNED.items())})


@dataclasses.dataclass(frozen=True)
class GeometryTables:
    """One geometry's measured tables, the rules of rule 4 (the CuTe kernel's rule 3 is gated
    by ``capability.cute_problem``: it is built for GLM-5 only)."""

    fma: dict[tuple[str, bool, int], dict[int, tuple[int, int]]]
    gluon: dict[tuple[str, bool], tuple[tuple[int, int, GluonChoice], ...]]
    # {heads: (block_n, num_warps, block_k[, block_m])}: block_m where not the padded M.
    tuned: dict[tuple[str, bool, int], dict[int, tuple[int, ...]]]


# The selection tables by geometry, as measured. DeepSeek-V3 has no register-path or Gluon
# table: the register and tl.dot kernels are built for it (triton_mla_query.GEOMETRIES), Gluon
# is GLM-5's only.
TABLES: dict[str, GeometryTables] = {
    GLM5.name: GeometryTables(fma=FMA_TUNED, gluon=GLUON_TUNED, tuned=TUNED),
    DEEPSEEK_V3.name: GeometryTables(fma={}, gluon={}, tuned=DSV3_TUNED),
}
# The largest M the Gluon and register-path tables describe (and the largest untiled block);
# above it the tl.dot kernel tiles M in MAX_BLOCK_M-row blocks, with the tl.dot table's
# 64-row entry.
TABLES_MAX_M = 32

# A head count TUNED does not list: 32-wide N tiles give heads*16 CTAs (128 at H=8), enough to
# cover the H200's 132 SMs once.
DEFAULT_BLOCK_N = 32
# The interpreter pays per program, not per element: one program per head keeps CPU CI fast.
INTERPRET_BLOCK_N = KV_LORA


def gluon_choice(
    weight_format: str, out_fp8: bool, num_heads: int, m: int, geometry: Geometry = GLM5
) -> GluonChoice | None:
    """The GLUON_TUNED choice for one shape (None for a recipe or geometry without Gluon
    rules)."""
    for min_heads, min_m, choice in TABLES[geometry.name].gluon.get((weight_format, out_fp8), ()):
        if num_heads >= min_heads and m >= min_m:
            return choice
    return None


def launch_config(
    num_heads: int,
    m: int,
    weight_format: str = "bf16",
    out_fp8: bool = False,
    *,
    allow_fma: bool = True,
    pdl: bool | None = None,
    geometry: Geometry = GLM5,
    allow_gluon: bool = True,
) -> LaunchConfig:
    """The Triton-family configuration for ``m`` tokens of ``num_heads`` heads of ``geometry``
    (rule 4 of the module docstring, or the interpreter's); ``allow_fma=False`` gives the MMA
    kernels' choice, and with ``allow_gluon=False`` too the tl.dot kernel's (the decode
    front, which is built on it). ``pdl=None`` is ``DEFAULT_PDL``."""
    pdl = DEFAULT_PDL if pdl is None else pdl
    tables = TABLES[geometry.name]
    fma_m = triton.next_power_of_2(max(m, 1))
    fma = tables.fma.get((weight_format, out_fp8, fma_m), {}) if allow_fma else {}
    block_m = min(max(triton_mla_query.MIN_BLOCK_M, fma_m), triton_mla_query.MAX_BLOCK_M)
    if common.interpreting():
        if num_heads in fma:  # the GPU takes the register path here: so does the interpreter
            return LaunchConfig(block_m=fma_m, block_n=INTERPRET_BLOCK_N, num_warps=1, fma=True)
        one_k = triton_mla_query.SINGLE_BLOCK_K[geometry.name]
        return LaunchConfig(block_m=block_m, block_n=INTERPRET_BLOCK_N, block_k=one_k)
    if num_heads in fma:
        block_n, num_warps = fma[num_heads]
        return LaunchConfig(fma_m, block_n, num_warps=num_warps, pdl=pdl, fma=True)
    choice = gluon_choice(weight_format, out_fp8, num_heads, m, geometry)
    if choice is not None and allow_gluon and m <= TABLES_MAX_M and gluon_mla_query.AVAILABLE:
        return LaunchConfig(
            block_m, choice.block_n, num_warps=choice.num_warps, pdl=pdl, gluon=True,
            gluon_operands=choice.operands, e4m3_epilogue="wide" if choice.wide_store else "mul",
        )  # fmt: skip
    tuned = tables.tuned.get((weight_format, out_fp8, block_m), {})
    block_n, num_warps, block_k, *rows = tuned.get(
        num_heads, (DEFAULT_BLOCK_N, DEFAULT_NUM_WARPS, common.BLOCK_K)
    )
    block_m = rows[0] if rows else block_m
    return LaunchConfig(block_m, block_n, num_warps=num_warps, block_k=block_k, pdl=pdl)


def triton_kernel_name(config: LaunchConfig) -> str:
    """The Triton-family kernel a configuration runs, as ``kernel_summary`` names it:
    ``"register"``, ``"tl.dot"`` or ``"gluon-<operands>"`` (``-widestore`` for E4M3's
    shared-memory store)."""
    if config.gluon:
        store = "-widestore" if config.e4m3_epilogue == "wide" else ""
        return f"gluon-{config.gluon_operands}{store}"
    return "register" if config.fma else "tl.dot"


@dataclasses.dataclass(frozen=True)
class Selection:
    """One problem's kernel: ``path`` (one of KERNEL_FAMILIES), ``why`` (what decided it) and
    ``config``, the Triton-family launch: what runs under ``"triton"``, and under ``"cute"``
    what eager calls and operands the CuTe kernel cannot take run (``None`` for ``"staged"``)."""

    path: str
    why: str
    config: LaunchConfig | None = None

    @property
    def kernel(self) -> str:
        """The kernel as ``kernel_summary`` names it, e.g. ``"gluon-convert"``,
        ``"cute (graphs; eager: register)"`` or ``"staged"``."""
        if self.config is None:
            return self.path
        name = triton_kernel_name(self.config)
        return f"cute (graphs; eager: {name})" if self.path == "cute" else name


def select(
    num_heads: int,
    m: int,
    *,
    geometry: Geometry | str = GLM5,
    weight_format: str = "bf16",
    out_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    pdl: bool = False,
    qualified: bool = True,
) -> Selection:
    """The kernel ``backend="auto"`` runs for one call's problem (see the module docstring);
    ``qualified=False`` (``backend="triton"``) lets H and M run where the kernels run at all
    (``capability.explain``)."""
    why = capability.explain(
        num_heads, m, geometry=geometry, weight_format=weight_format, out_dtype=out_dtype,
        device=device, qualified=qualified,
    )  # fmt: skip
    if why is not None:
        return Selection("staged", why)
    geometry = capability.served_geometry(geometry)
    out_fp8 = out_dtype == torch.float8_e4m3fn
    config = launch_config(num_heads, m, weight_format, out_fp8, pdl=pdl, geometry=geometry)
    if capability.resolve_device(device).type != "cuda":
        return Selection("triton", "CPU tensors run the Triton kernel in its interpreter", config)
    problem = capability.cute_problem(weight_format, out_dtype, pdl=pdl, geometry=geometry)
    if problem is not None:
        return Selection("triton", problem, config)
    limit = CUTE_MAX_M[weight_format]
    if m > limit:
        return Selection(
            "triton", f"M={m} > {limit}: the Triton kernel measured faster there", config
        )
    out = "E4M3" if out_fp8 else "BF16"
    weights = "MXFP8" if weight_format == "mxfp8" else "BF16"
    why = f"{weights} -> {out} at M <= {limit}: the CuTe DSL kernel measured faster"
    return Selection("cute", why, config)


def kernel_choice(
    num_heads: int,
    m: int,
    *,
    geometry: Geometry | str = GLM5,
    weight_format: str = "bf16",
    out_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    pdl: bool = False,
) -> tuple[str, str]:
    """(path, why) of ``backend="auto"`` for one call's problem: path is ``"cute"``,
    ``"triton"`` or ``"staged"``, and why says what decided it, e.g. MXFP8 falling back to
    the Triton kernel because nvidia-cutlass-dsl is not installed, or an H that ``geometry``
    is not qualified for."""
    chosen = select(
        num_heads, m, geometry=geometry, weight_format=weight_format, out_dtype=out_dtype,
        device=device, pdl=pdl,
    )  # fmt: skip
    return chosen.path, chosen.why


def kernel_summary(
    num_heads: int,
    ms: Iterable[int],
    *,
    geometry: Geometry | str = GLM5,
    weight_format: str = "bf16",
    out_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    pdl: bool = False,
) -> str:
    """Which kernel ``backend="auto"`` runs at each of ``ms``, runs of equal M merged, e.g.
    ``"M=1,2 cute (graphs; eager: register); M=4-16 gluon-convert"`` (E4M3's shared-memory
    store shows as ``gluon-smem-widestore``); and, where the recipe could take the CuTe kernel
    but does not, why (``"... [CuTe: nvidia-cutlass-dsl does not import (...)]"``). What a server
    log shows so a run says which kernels it measured."""
    runs: list[tuple[str, list[int]]] = []
    for m in sorted(set(ms)):
        name = select(
            num_heads, m, geometry=geometry, weight_format=weight_format, out_dtype=out_dtype,
            device=device, pdl=pdl,
        ).kernel  # fmt: skip
        if runs and runs[-1][0] == name:
            runs[-1][1].append(m)
        else:
            runs.append((name, [m]))

    def span(m_run: list[int]) -> str:
        return str(m_run[0]) if len(m_run) == 1 else f"{m_run[0]}-{m_run[-1]}"

    text = "; ".join(f"M={span(m_run)} {name}" for name, m_run in runs) or "no M"
    on_gpu = capability.resolve_device(device).type == "cuda"
    if on_gpu and not any(n.startswith("cute") for n, _ in runs):
        problem = capability.cute_problem(weight_format, out_dtype, pdl=pdl, geometry=geometry)
        if problem is not None:
            text += f" [CuTe: {problem}]"
    return text
