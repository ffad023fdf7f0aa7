"""Which recipes the fused kernel can run, as data: one gate per (weight format, output dtype).

Callers (``backend="auto"``, vLLM integration, tests) ask ``explain``; ``None`` means the
fused kernel runs, a string says why not. BF16 weights need only Triton and sm_80+ (no
CUTLASS DSL); anything touching FP8 needs the hardware fp8 conversions of sm_89+. Under
``TRITON_INTERPRET=1`` every recipe runs on CPU tensors, which is how CI tests the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from fusedq.limits import MAX_M, QUALIFIED_HEADS

WEIGHT_FORMATS = ("bf16", "mxfp8")
OUT_DTYPES = (torch.bfloat16, torch.float8_e4m3fn)


@dataclasses.dataclass(frozen=True)
class Recipe:
    weight_format: str
    out_dtype: torch.dtype
    min_capability: tuple[int, int]
    why: str


RECIPES: dict[tuple[str, torch.dtype], Recipe] = {
    (r.weight_format, r.out_dtype): r
    for r in (
        Recipe("bf16", torch.bfloat16, (8, 0), "bf16 tl.dot (mma.sync) exists from sm_80"),
        Recipe("bf16", torch.float8_e4m3fn, (8, 9), "E4M3 stores need sm_89 fp8 conversions"),
        Recipe("mxfp8", torch.bfloat16, (8, 9), "E4M3 weight loads need sm_89 fp8 conversions"),
        Recipe("mxfp8", torch.float8_e4m3fn, (8, 9), "fp8 in and out need sm_89 conversions"),
    )
}


@functools.cache
def _triton_problem() -> str | None:
    try:
        import triton  # noqa: F401
    except Exception as exc:  # a broken triton install raises more than ImportError
        return f"triton is not importable ({type(exc).__name__}: {exc})"
    return None


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _interpreting() -> bool:
    from fusedq.kernels.triton_mla_query import interpreting

    return interpreting()


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is None:
        if torch.cuda.is_available() and not _interpreting():
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def explain(
    num_heads: int,
    max_m: int,
    *,
    weight_format: str = "bf16",
    out_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> str | None:
    """Why the fused kernel cannot run this problem, or ``None`` when it can.

    Parameters
    ----------
    num_heads : heads per rank (H).
    max_m : the largest token count (M) the call or graph will see.
    weight_format : ``"bf16"`` or ``"mxfp8"``.
    out_dtype : ``torch.bfloat16`` or ``torch.float8_e4m3fn``.
    device : where the tensors live; ``None`` means the current CUDA device, or the CPU
        when there is none or the Triton interpreter is on.
    """
    if num_heads not in QUALIFIED_HEADS:
        return f"num_heads={num_heads} is not qualified (qualified: {QUALIFIED_HEADS})"
    if not 1 <= max_m <= MAX_M:
        return f"max_m={max_m} is outside the qualified range 1..{MAX_M}"
    recipe = RECIPES.get((weight_format, out_dtype))
    if recipe is None:
        return (
            f"no fused recipe for weight_format={weight_format!r}, out_dtype={out_dtype} "
            f"(formats {WEIGHT_FORMATS}, out dtypes {OUT_DTYPES})"
        )
    problem = _triton_problem()
    if problem is not None:
        return problem
    dev = _resolve_device(device)
    if dev.type == "cpu":
        if _interpreting():
            return None
        return "CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)"
    if dev.type != "cuda":
        return f"device {dev} is not supported (CUDA, or CPU under TRITON_INTERPRET=1)"
    if _interpreting():
        return "TRITON_INTERPRET=1 is set: the interpreter runs CPU tensors only"
    if torch.version.hip is not None:
        return "ROCm is not qualified"
    cap = _capability(dev.index)
    if cap < recipe.min_capability:
        need = "sm_{}{}".format(*recipe.min_capability)
        return f"{dev} is sm_{cap[0]}{cap[1]}; {weight_format}->{out_dtype} needs {need}+ ({recipe.why})"
    return None


# Which fused kernel ``backend="auto"`` runs. The CuTe DSL kernel (kernels/cute_mla_query.py:
# MXFP8 weights, one memory round trip, SIMT FMAs) measured fastest for BF16 out at M=1 on the
# H200 (2026-11-30: 2.48 us at H=8, 2.80 at H=16, against Triton's register path 2.68/3.13
# and the Gluon kernel 2.79/3.03); at M=32 CuTe is far behind (9.5-10 us: its FMAs do not
# scale with M). In its 192-thread layout (2026-12-01, docs/bench/
# h200-cute-layouts-2026-12-01.json, one run, H 8/11/16) it also leads at M=4: BF16 out
# 2.64/2.83/2.94 us against Triton's 2.79/2.85/3.00, E4M3 out 2.73/2.93/3.09 against
# 2.77/2.93/3.17 (a second run: 2.72/2.93/3.09 against 2.75/2.91/3.12), and trails at M=8
# (3.02-3.62 against 2.78-3.04). M=1-2: BF16 out 2.31/2.38/2.55 and 2.50/2.59/2.75 against
# 2.68/2.84/2.98 and 2.78/2.84/2.97; E4M3 out 2.41/2.51/2.68 and 2.56/2.67/2.88 against
# 2.82/2.92/3.25 and 2.76/2.92/3.13.
# bf16 weights (vLLM's W_UK_T view, the same kernel with 16-byte loads of 8 weights; H200,
# 2026-12-01, docs/bench/h200-cute-bf16-2026-12-01.json, H 8/11/16): BF16 out M=1
# 2.48/2.61/2.89 us against Triton's 2.69/2.87/3.15, M=2 2.63/2.80/3.08 against
# 2.72/2.88/3.13, M=4 2.83/3.11/3.35 against 2.73/2.90/3.15; E4M3 out M=1 2.59/2.73/3.00
# against 2.75/2.97/3.28, M=2 2.70/2.90/3.15 against 2.81/2.97/3.28.
# The largest M the CuTe kernel runs, per weight format.
CUTE_MAX_M = {"mxfp8": 4, "bf16": 2}


def cute_problem(weight_format: str, out_dtype: torch.dtype, *, pdl: bool = False) -> str | None:
    """Why the CuTe DSL kernel cannot run this recipe here (it is optional: nvidia-cutlass-dsl
    is not a requirement, and every recipe also has the Triton kernel), or ``None``."""
    if out_dtype not in OUT_DTYPES:
        return f"out_dtype={out_dtype} runs no fused kernel (out dtypes {OUT_DTYPES})"
    if pdl:
        return "pdl=True runs the Triton kernel (the CuTe kernel has no PDL launch)"
    from fusedq.kernels import cute_mla_query

    return cute_mla_query.unavailable_reason()


def kernel_choice(
    num_heads: int,
    m: int,
    *,
    weight_format: str = "bf16",
    out_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    pdl: bool = False,
) -> tuple[str, str]:
    """(path, why) of ``backend="auto"`` for one call's problem: path is ``"cute"``,
    ``"triton"`` or ``"staged"``, and why says what decided it, e.g. MXFP8 falling back to
    the Triton kernel because nvidia-cutlass-dsl is not installed."""
    why = explain(num_heads, m, weight_format=weight_format, out_dtype=out_dtype, device=device)
    if why is not None:
        return "staged", why
    if _resolve_device(device).type != "cuda":
        return "triton", "CPU tensors run the Triton kernel in its interpreter"
    problem = cute_problem(weight_format, out_dtype, pdl=pdl)
    if problem is not None:
        return "triton", problem
    limit = CUTE_MAX_M[weight_format]
    if m > limit:
        return "triton", f"M={m} > {limit}: the Triton kernel measured faster there"
    out = "E4M3" if out_dtype == torch.float8_e4m3fn else "BF16"
    weights = "MXFP8" if weight_format == "mxfp8" else "BF16"
    return "cute", f"{weights} -> {out} at M <= {limit}: the CuTe DSL kernel measured faster"


def kernel_summary(
    num_heads: int,
    ms,
    *,
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
    from fusedq.kernels.triton_mla_query import LaunchConfig

    def triton_name(m: int) -> str:
        cfg = LaunchConfig.for_problem(
            num_heads, m, weight_format, out_dtype == torch.float8_e4m3fn, pdl=pdl
        )
        if cfg.gluon:
            store = "-widestore" if cfg.e4m3_epilogue == "wide" else ""
            return f"gluon-{cfg.gluon_operands}{store}"
        return "register" if cfg.fma else "tl.dot"

    runs: list[tuple[str, list[int]]] = []
    for m in sorted(set(ms)):
        path, _ = kernel_choice(
            num_heads, m, weight_format=weight_format, out_dtype=out_dtype, device=device, pdl=pdl
        )
        if path == "cute":
            name = f"cute (graphs; eager: {triton_name(m)})"
        else:
            name = triton_name(m) if path == "triton" else path
        if runs and runs[-1][0] == name:
            runs[-1][1].append(m)
        else:
            runs.append((name, [m]))

    def span(m_run: list[int]) -> str:
        return str(m_run[0]) if len(m_run) == 1 else f"{m_run[0]}-{m_run[-1]}"

    text = "; ".join(f"M={span(m_run)} {name}" for name, m_run in runs) or "no M"
    if _resolve_device(device).type == "cuda" and not any(n.startswith("cute") for n, _ in runs):
        problem = cute_problem(weight_format, out_dtype, pdl=pdl)
        if problem is not None:
            text += f" [CuTe: {problem}]"
    return text


def can_implement(
    num_heads: int,
    max_m: int,
    *,
    weight_format: str = "bf16",
    out_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
) -> bool:
    """Whether the fused kernel runs this problem (see ``explain`` for the reason if not)."""
    return (
        explain(num_heads, max_m, weight_format=weight_format, out_dtype=out_dtype, device=device)
        is None
    )
