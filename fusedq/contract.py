"""The facts fusedq shares with its vLLM plugin, its bench, the orchestrator and the scripts.

One home for every name and number more than one of them needs: the MLA geometries the
kernels are built for, the head counts and decode batches they are qualified for, the
plugin's switch variable, the worker extension's RPC methods, the log lines the plugin
writes, and what a profiler trace calls the fused query. Standard library only, and
``fusedq/__init__`` is lazy, so ``import fusedq.contract`` costs no torch: ``orchestrator
plan``, the matrix checks and the scripts read it on hosts without a GPU stack.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Geometry:
    """One MLA head geometry as vLLM's MLA layer holds it: per head, ``qk_nope`` query dims
    absorbed through ``W_UK_T`` into ``kv_lora`` latent dims, ``qk_rope`` RoPE dims appended,
    and ``v_head`` value dims beside the nope rows in ``kv_b_proj``."""

    name: str
    qk_nope: int
    qk_rope: int
    kv_lora: int
    v_head: int

    @property
    def query_width(self) -> int:
        """The attention-ready query row: the latent part, then the RoPE part."""
        return self.kv_lora + self.qk_rope

    @property
    def head_stride_rows(self) -> int:
        """Rows a head holds in ``kv_b_proj``'s weight (its nope rows, then its value rows):
        vLLM's ``W_UK_T`` is a view into it, so this is the head stride the kernels see."""
        return self.qk_nope + self.v_head


# GLM-5 (and GLM-4.7-Flash): 192 nope dims, 64 RoPE, a 512-wide latent, 256 value dims.
GLM5 = Geometry("glm5", qk_nope=192, qk_rope=64, kv_lora=512, v_head=256)
# DeepSeek-V3 / R1 / V3.2, Kimi-K2 and Mistral Large 3 (DeepseekV3ForCausalLM): 128 nope dims,
# 64 RoPE, a 512-wide latent, 128 value dims (transformers' DeepseekV3Config defaults).
DEEPSEEK_V3 = Geometry("deepseek-v3", qk_nope=128, qk_rope=64, kv_lora=512, v_head=128)
# The geometries the kernels are built and qualified for; a layer of any other is refused,
# naming its geometry (fusedq.capability, the plugin's layer plan).
GEOMETRIES = (GLM5,)

# The kernels' compile-time widths: the one geometry they are built for today.
QK_NOPE = GLM5.qk_nope
QK_ROPE = GLM5.qk_rope
KV_LORA = GLM5.kv_lora
V_HEAD = GLM5.v_head
QUERY_WIDTH = GLM5.query_width

# Head counts per rank the kernel is qualified for: GLM-5 at TP8 (8), padded TP6 (11), TP4 (16).
QUALIFIED_HEADS = (8, 11, 16)
# The decode batches (tokens per rank per step, MTP included) a server's CUDA graphs are
# prewarmed and described for, in the buckets the CuTe kernel compiles; the largest is the
# most the kernel is qualified for.
DECODE_M_BUCKETS = (1, 2, 4, 8, 16, 32)
MAX_M = DECODE_M_BUCKETS[-1]

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
# missing here is not seen (tests/orchestrator/test_trace.py checks the list against the
# kernels).
KERNEL_NAMES = (
    "_mla_query_kernel",
    "_mla_query_fma_kernel",
    "_mla_query_gluon_kernel",
    "_mla_query_gluon_smem_kernel",
    "_mla_query_gluon_direct_kernel",
    "_mla_query_cute_kernel",
)
OP_NAME = "fusedq::mla_query_projection"

# The plugin's switch (a server's environment): unset or "auto" uses the fused query where it
# qualifies, "0" leaves vLLM untouched, "1" makes a layer that cannot use it a start-up error.
MODE_ENV = "FUSEDQ_MLA_QUERY"
MODES = ("auto", "0", "1")

# The decode paths a server's workers switch between: vLLM's own block, or the fused op.
DECODE_PATHS = ("staged", "fused")
# The worker extension's methods, called over vLLM's POST /collective_rpc: flip the decode
# path (answers {"path", "recaptured", "seconds", "layers"}), then read it back.
RPC_SET_PATH = "fusedq_set_path"
RPC_STATE = "fusedq_state"

# The starts of the plugin's per-process lines in a server log (fusedq.vllm.report writes
# them; tests and readers of a run's logs look for them).
ENABLED_LINE = "fusedq: fused MLA query enabled"
DISABLED_LINE = "fusedq: fused MLA query disabled"
