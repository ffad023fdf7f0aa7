"""The fixed facts of the fused MLA query: its geometry and what it is qualified for.

One home for numbers the kernel, the capability gate, the vLLM hook and plugin, and the
orchestrator (matrix, plan, gpu-check, the built-in models) all need. Plain constants and no
imports at all, so the orchestrator can read this file without importing the ``fusedq``
package (whose ``__init__`` imports torch, which ``orchestrator plan`` must not load).
"""

# GLM-5 / DeepSeek MLA: qk_nope_head_dim, qk_rope_head_dim, kv_lora_rank. The kernel computes
# q_nope[.., 192] @ W_UK_T[192, 512] and appends the 64 RoPE dims: a 576-wide query row.
QK_NOPE = 192
QK_ROPE = 64
KV_LORA = 512
QUERY_WIDTH = KV_LORA + QK_ROPE
# GLM-5's v_head_dim. vLLM's W_UK_T is a view into kv_b_proj's weight, whose heads hold
# QK_NOPE + V_HEAD rows: the head stride the kernels see (and the benchmarks reproduce).
V_HEAD = 256

# Head counts per rank the kernel is qualified for: GLM-5 at TP8 (8), padded TP6 (11), TP4 (16).
QUALIFIED_HEADS = (8, 11, 16)
# Decode batch (tokens per rank per step, MTP included) the kernel is qualified for.
MAX_M = 32

# E4M3 (OCP, "fn") largest finite value; an E4M3 output is clamped to it.
E4M3_MAX = 448.0
# MX block size along N (OCP MX spec: one E8M0 scale per 32 elements), and the scales a
# weight row of KV_LORA values carries.
MX_BLOCK = 32
SCALE_BLOCKS = KV_LORA // MX_BLOCK

# What a profiler trace calls the fused query: the kernels' names (the Triton and Gluon JIT
# functions, as CUDA launches them; the CuTe DSL kernel's function, which its symbol embeds:
# kernel_cutlass__mla_query_cute_kernel_<argument types>) and the custom op's name (what a CPU
# trace records). orchestrator/analysis/trace.py attributes a layer's query step by them; a kernel
# missing here is not seen (before 2026-12-01 the Gluon ones were: tests/orchestrator/
# test_trace.py now checks the list against the kernels).
KERNEL_NAMES = (
    "_mla_query_kernel",
    "_mla_query_fma_kernel",
    "_mla_query_gluon_kernel",
    "_mla_query_gluon_smem_kernel",
    "_mla_query_gluon_direct_kernel",
    "_mla_query_cute_kernel",
)
OP_NAME = "fusedq::mla_query_projection"
