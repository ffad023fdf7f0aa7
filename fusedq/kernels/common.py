"""What the Triton and Gluon kernels share with each other and with their host side: the
output modes and weight-layout codes the kernels branch on, K's chunking, the JIT
specialisation options, and whether Triton runs its interpreter.

The kernel modules import this module and ``fusedq.contract``, never each other.
"""

from __future__ import annotations

import os

import triton

# The OUT_FP8 constexpr (``LaunchConfig.e4m3_epilogue`` picks the E4M3 ones): BF16 output;
# E4M3 quantised as vLLM's static FP8 quant does it (``x * (1 / q_scale)``: its CUDA op
# ``static_scaled_fp8_quant`` takes the reciprocal once and multiplies, and so does
# ``QuantFP8.forward_native``; docs/decisions/0004-e4m3-reciprocal.md), "mul", stored from the
# MMA layout; the same stored through shared memory 16 bytes a thread, "wide" (the Gluon kernel
# only). Two more exist only for ``fusedq-bench --sweep --sweep-e4m3`` to time against them: an
# IEEE division per element ("div"), and no scaling at all ("noscale": no q_scale load, which
# separates the scale's cost from the conversion's; its output is wrong).
OUT_BF16 = 0
OUT_E4M3 = 1
OUT_E4M3_DIV = 2
OUT_E4M3_NOSCALE = 3
OUT_E4M3_WIDE = 4
E4M3_EPILOGUES = {
    "mul": OUT_E4M3, "div": OUT_E4M3_DIV, "noscale": OUT_E4M3_NOSCALE, "wide": OUT_E4M3_WIDE,
}  # fmt: skip

# K (qk_nope) in unrolled 64-wide chunks: three cover GLM-5's 192, two DeepSeek-V3's 128
# (neither needs masking; K_CHUNKS is what the kernels unroll).
BLOCK_K = 64
K_CHUNKS = (2, 3)


def k_chunks(qk_nope: int) -> int:
    """How many BLOCK_K chunks cover ``qk_nope``; ``ValueError`` where the kernels unroll no
    such count."""
    chunks, rest = divmod(qk_nope, BLOCK_K)
    if rest or chunks not in K_CHUNKS:
        raise ValueError(
            f"qk_nope={qk_nope} is not {' or '.join(str(c) for c in K_CHUNKS)} chunks of {BLOCK_K}"
        )
    return chunks


# There is no K loop to pipeline (all chunks are unrolled and loaded up front).
DEFAULT_NUM_STAGES = 1
# 16-byte vectors: what tl.multiple_of promises when the host says a tensor is aligned.
ALIGN_BYTES = 16
# Weight layouts the kernels distinguish at compile time (which axis has unit stride).
W_GENERIC, W_UNIT_N, W_UNIT_K = 0, 1, 2

# The kernels leave specialisation to the host (the compiled variant depends only on the
# launch's KernelKey): no integer argument is specialised, no pointer on its alignment. One list
# for every kernel, which all take the same parameters.
JIT_OPTIONS = dict(
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


def out_mode(out_fp8: bool, e4m3_epilogue: str = "mul") -> int:
    """The OUT_FP8 constexpr: OUT_BF16, or the E4M3 epilogue's (E4M3_EPILOGUES)."""
    return E4M3_EPILOGUES[e4m3_epilogue] if out_fp8 else OUT_BF16


def interpreting() -> bool:
    """Whether Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    knobs = getattr(triton, "knobs", None)
    if knobs is not None:
        return bool(knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")
