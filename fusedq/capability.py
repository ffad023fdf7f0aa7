"""Which recipes the fused kernel can run, as data: one gate per (weight format, output dtype).

Callers (``backend="auto"``, vLLM integration, tests) ask ``explain``; ``None`` means the
fused kernel runs, a string says why not. ``cute_problem`` is the CuTe DSL kernel's own gate.
Which fused kernel then runs a problem is ``fusedq.selection``'s to say. BF16 weights need only Triton and sm_80+ (no
CUTLASS DSL); anything touching FP8 needs the hardware fp8 conversions of sm_89+. Under
``TRITON_INTERPRET=1`` every recipe runs on CPU tensors, which is how CI tests the kernel.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

from fusedq.contract import MAX_M, QUALIFIED_HEADS

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
    # Imported here: the gates answer (``_triton_problem``) where Triton does not import.
    from fusedq.kernels import common

    return common.interpreting()


def resolve_device(device: torch.device | str | None) -> torch.device:
    """The device a problem's tensors live on: ``None`` is the current CUDA device, or the CPU
    where there is none or the Triton interpreter is on."""
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
    dev = resolve_device(device)
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


def cute_problem(weight_format: str, out_dtype: torch.dtype, *, pdl: bool = False) -> str | None:
    """Why the CuTe DSL kernel cannot run this recipe here (it is optional: nvidia-cutlass-dsl
    is not a requirement, and every recipe also has the Triton kernel), or ``None``."""
    if out_dtype not in OUT_DTYPES:
        return f"out_dtype={out_dtype} runs no fused kernel (out dtypes {OUT_DTYPES})"
    if pdl:
        return "pdl=True runs the Triton kernel (the CuTe kernel has no PDL launch)"
    from fusedq.kernels import cute_mla_query

    return cute_mla_query.unavailable_reason()


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
