"""Which problems the fused kernel can run, as data: the served geometries and where each is
qualified (``fusedq.contract``), and one gate per (weight format, output dtype).

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

from fusedq.contract import (
    GEOMETRIES,
    GLM5,
    KERNEL_MAX_HEADS,
    KERNEL_MAX_M,
    QUALIFIED,
    Geometry,
    describe_geometries,
    geometry_named,
)

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


def served_geometry(geometry: Geometry | str) -> Geometry:
    """The served geometry ``geometry`` names (a ``Geometry`` or its name); ``ValueError``
    naming it and the served ones otherwise."""
    if isinstance(geometry, str):
        return geometry_named(geometry)
    if geometry not in GEOMETRIES:
        raise ValueError(f"geometry {geometry} is not served (served: {describe_geometries()})")
    return geometry


def shape_problem(
    geometry: Geometry, num_heads: int, max_m: int, *, qualified: bool = True
) -> str | None:
    """Why ``num_heads`` x ``max_m`` is outside what ``geometry`` is qualified for (or, with
    ``qualified=False``, what the Triton kernels run at all), or ``None``."""
    if qualified:
        q = QUALIFIED[geometry.name]
        if num_heads not in q.heads:
            return (
                f"num_heads={num_heads} is not qualified for {geometry.name} (qualified: {q.heads})"
            )
        top = q.max_m_for(num_heads)
        if not 1 <= max_m <= top:
            return (
                f"max_m={max_m} is outside {geometry.name}'s qualified range 1..{top} at "
                f"{num_heads} heads"
            )
        return None
    if not 1 <= num_heads <= KERNEL_MAX_HEADS:
        return f"num_heads={num_heads} is outside the kernels' range 1..{KERNEL_MAX_HEADS}"
    if not 1 <= max_m <= KERNEL_MAX_M:
        return f"max_m={max_m} is outside the kernels' range 1..{KERNEL_MAX_M}"
    return None


def explain(
    num_heads: int,
    max_m: int,
    *,
    geometry: Geometry | str = GLM5,
    weight_format: str = "bf16",
    out_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    qualified: bool = True,
) -> str | None:
    """Why the fused kernel cannot run this problem, or ``None`` when it can.

    Parameters
    ----------
    num_heads : heads per rank (H).
    max_m : the largest token count (M) the call or graph will see.
    geometry : a served ``fusedq.contract.Geometry`` or its name (``"glm5"``,
        ``"deepseek-v3"``); a call's tensors name theirs (``dispatch.geometry_of_shapes``).
    weight_format : ``"bf16"`` or ``"mxfp8"``.
    out_dtype : ``torch.bfloat16`` or ``torch.float8_e4m3fn``.
    device : where the tensors live; ``None`` means the current CUDA device, or the CPU
        when there is none or the Triton interpreter is on.
    qualified : hold H and M to the geometry's qualified (measured) shapes
        (``contract.QUALIFIED``), as ``backend="auto"`` and the plugin do; ``False`` asks
        only whether the Triton kernels run them (``backend="triton"``).
    """
    try:
        geometry = served_geometry(geometry)
    except ValueError as exc:
        return str(exc)
    problem = shape_problem(geometry, num_heads, max_m, qualified=qualified)
    if problem is not None:
        return problem
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


def cute_problem(
    weight_format: str,
    out_dtype: torch.dtype,
    *,
    pdl: bool = False,
    geometry: Geometry | str = GLM5,
) -> str | None:
    """Why the CuTe DSL kernel cannot run this recipe here (it is optional: nvidia-cutlass-dsl
    is not a requirement, and every recipe also has the Triton kernel), or ``None``."""
    from fusedq.kernels import cute_mla_query

    geometry = served_geometry(geometry)
    if geometry not in cute_mla_query.GEOMETRIES:
        names = ", ".join(g.name for g in cute_mla_query.GEOMETRIES)
        return f"the CuTe DSL kernel is built for {names}, not {geometry.name}"
    if out_dtype not in OUT_DTYPES:
        return f"out_dtype={out_dtype} runs no fused kernel (out dtypes {OUT_DTYPES})"
    if pdl:
        return "pdl=True runs the Triton kernel (the CuTe kernel has no PDL launch)"
    return cute_mla_query.unavailable_reason()


def can_implement(
    num_heads: int,
    max_m: int,
    *,
    geometry: Geometry | str = GLM5,
    weight_format: str = "bf16",
    out_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str | None = None,
    qualified: bool = True,
) -> bool:
    """Whether the fused kernel runs this problem (see ``explain`` for the reason if not)."""
    why = explain(
        num_heads, max_m, geometry=geometry, weight_format=weight_format, out_dtype=out_dtype,
        device=device, qualified=qualified,
    )  # fmt: skip
    return why is None
