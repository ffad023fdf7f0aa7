"""The facts fusedq shares with its vLLM plugin, its bench, the orchestrator and the scripts.

One home for every name and number more than one of them needs: the MLA geometries fusedq
serves, the head counts and decode batches each is qualified for, the
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
# The geometries fusedq serves; a layer of any other is refused, naming its geometry
# (fusedq.capability, the plugin's layer plan). Each kernel module declares which of these it
# is built for (its GEOMETRIES); the Triton kernels take qk_nope as a constexpr.
GEOMETRIES = (GLM5, DEEPSEEK_V3)


def _common(field: str) -> int:
    values = {getattr(g, field) for g in GEOMETRIES}
    if len(values) != 1:  # the kernels' N and R are compiled for one width each
        raise ValueError(f"served geometries differ in {field}: {sorted(values)}")
    return values.pop()


# What every served geometry shares (and the kernels compile in as N and R): the 512-wide
# latent, the 64 RoPE dims, so the 576-wide query row. qk_nope and v_head differ (GLM-5's
# 192/256, DeepSeek-V3's 128/128): they are read from the geometry in hand.
KV_LORA = _common("kv_lora")
QK_ROPE = _common("qk_rope")
QUERY_WIDTH = KV_LORA + QK_ROPE


def geometry_named(name: str) -> Geometry:
    """The served geometry called ``name``; ``ValueError`` naming the known ones."""
    for g in GEOMETRIES:
        if g.name == name:
            return g
    known = ", ".join(g.name for g in GEOMETRIES)
    raise ValueError(f"geometry {name!r} is not served (known: {known})")


def geometry_of(qk_nope: int, qk_rope: int = QK_ROPE, kv_lora: int = KV_LORA) -> Geometry | None:
    """The served geometry with these query-side dims (what a query's tensors show), or None.
    No two served geometries share them, so the shapes name the geometry."""
    for g in GEOMETRIES:
        if (g.qk_nope, g.qk_rope, g.kv_lora) == (qk_nope, qk_rope, kv_lora):
            return g
    return None


def describe_geometries() -> str:
    """The served geometries as messages name them, e.g. ``glm5 (qk_nope 192, ...)``."""
    return "; ".join(
        f"{g.name} (qk_nope {g.qk_nope}, rope {g.qk_rope}, kv_lora {g.kv_lora}, v_head {g.v_head})"
        for g in GEOMETRIES
    )


@dataclass(frozen=True)
class Qualification:
    """Where the fused query is qualified (measured) for one geometry: the heads per rank and
    the largest decode batch M. The Triton kernels run more (KERNEL_MAX_HEADS, KERNEL_MAX_M);
    ``backend="auto"`` and the plugin take the fused path only where it is qualified."""

    heads: tuple[int, ...]
    max_m: int
    # Head counts whose largest qualified M differs from ``max_m`` (measured per head count),
    # as ((heads, max M), ...).
    m_by_heads: tuple[tuple[int, int], ...] = ()

    def max_m_for(self, num_heads: int) -> int:
        """The largest M qualified at ``num_heads`` (0 where the head count is not)."""
        if num_heads not in self.heads:
            return 0
        return dict(self.m_by_heads).get(num_heads, self.max_m)

    def describe(self) -> str:
        """E.g. ``8, 16, 128 heads, M <= 64 (128 heads: M <= 16)``."""
        other = "; ".join(f"{h} heads: M <= {m}" for h, m in self.m_by_heads)
        return f"{', '.join(map(str, self.heads))} heads, M <= {self.max_m}" + (
            f" ({other})" if other else ""
        )


QUALIFIED = {
    # GLM-5 at TP8 (8 heads), padded TP6 (11), TP4 (16); M up to 32 (docs/decisions/). Past
    # 32 the tl.dot kernel (M tiled, at its defaults: no GLM-5 table above 32) lost to vLLM
    # 0.26's bmm with BF16 weights, 1.02-1.33x at M 48 / 64 / 128 on an H100 (2026-12-06,
    # benchmarks/results/h100.jsonl): staged there.
    GLM5.name: Qualification(heads=(8, 11, 16), max_m=32),
    # DeepSeek-V3's widths at TP16 / TP8 / TP4 / TP2 ranks (8 / 16 / 32 / 64 heads; Kimi-K2's
    # TP8 / TP4 / TP2 / TP1), M up to 64: with selection.DSV3_TUNED the fused kernel beat the
    # bmm vLLM 0.26 serves at every one of those shapes, BF16 by 2-14 % and MXFP8 by 5-14 %, in
    # one sweep on an H100 (2026-12-06, benchmarks/results/h100.jsonl), and the floors bench
    # of that tree agreed in all four recipes (docs/fusedq.md). 128 heads (TP1, DP
    # attention) is not: BF16 won by 1-2 % to M 16 and lost above (1.02-1.04x the bmm). Past
    # M 64 BF16 tied at M 128 and 16 heads and lost elsewhere (1.13-1.85x at M 128 / 256).
    DEEPSEEK_V3.name: Qualification(heads=(8, 16, 32, 64), max_m=64),
}
# What the Triton kernels run at all (``backend="triton"``, tests, the bench): heads per rank
# (one grid row each) and tokens (the grid tiles M above the largest block).
KERNEL_MAX_HEADS = 128
KERNEL_MAX_M = 512

# The decode batches (tokens per rank per step, MTP included) a server's CUDA graphs are
# prewarmed and described for, in the buckets the CuTe kernel compiles (every geometry's
# qualified max_m is one of them).
DECODE_M_BUCKETS = (1, 2, 4, 8, 16, 32)

# E4M3 (OCP, "fn") largest finite value; an E4M3 output is clamped to it.
E4M3_MAX = 448.0
# MX block size along N (OCP MX spec: one E8M0 scale per 32 elements), and the scales a
# weight row of KV_LORA values carries (the same for every served geometry: N is kv_lora).
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
