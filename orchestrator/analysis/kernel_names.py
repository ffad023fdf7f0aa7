"""Kernel names read as data: the name classes the query-step rule matches, the kernel family
each device event of a decode step is attributed to, and a name short enough for a table cell.

The families (``FAMILY_PATTERNS``) split a decode step's GPU time into what a reader of a
trace asks about: the query step, attention, the KV-cache write, RoPE, GEMMs, MoE, copies,
and the rest. Each entry is one name pattern with the reason it belongs where it does; the
first entry that matches a name decides its family, so an entry that must win over a broader
one (FlashAttention's CUTLASS-built kernels over ``cutlass``) comes first. The query family is
the events the query-step rule counts (orchestrator.analysis.trace), found by their place in a
layer, since W_UK_T's GEMM has a GEMM's name; by name alone, only fusedq's kernels are. Every pattern is
checked against the names of the committed H200 traces (tests/orchestrator/test_step_work.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fusedq import contract

# --------------------------------------------------------------------------- query-step rule

# fusedq's kernels and its op, named in fusedq/contract.py (which imports no torch). Not \b:
# the CuTe symbol has the name between underscores (kernel_cutlass__mla_query_cute_kernel_...).
# The decode front (fusedq/front.py): its one kernel (kernels/triton_decode_front.py) and its
# ops, the kernel API's and the vLLM hook's. Its launch is the layer's query step, RoPE and
# cache write included: the rule below must count it, or the last GEMM before attention
# stands in for it.
FRONT_KERNEL_NAMES = ("_mla_decode_front_kernel",)
FRONT_OP_NAMES = ("fusedq::mla_decode_front", "fusedq::vllm_mla_front_update")
FUSED_NAMES = (
    *(
        rf"(?<![A-Za-z0-9]){re.escape(n)}(?![A-Za-z0-9])"
        for n in (*contract.KERNEL_NAMES, *FRONT_KERNEL_NAMES)
    ),
    *(re.escape(n) for n in (contract.OP_NAME, *FRONT_OP_NAMES)),
)

# Decode attention: FlashAttention (FA2 flash_fwd*, FA3 FlashAttnFwdSm90 and its combine),
# FlashMLA, CUTLASS MLA (fmha), Triton MLA, the CPU build's _C::mla_decode_kvcache.
ATTENTION_NAMES = (
    r"flash_?fwd", r"flashattn", r"flash_attn", r"flashmla", r"flash_mla", r"fmha",
    r"mla_decode", r"_fwd_grouped_kernel", r"_fwd_kernel_stage", r"decode_attention",
    r"paged_attention", r"sparse_mla",
)  # fmt: skip
# The query's concat: aten::cat's kernel (CatArrayBatchedCopy), inductor's fused cat (the
# concat-quant under torch.compile), vLLM's concat-quant op; not concat_and_cache_mla.
CONCAT_NAMES = (r"^aten::cat$", r"catarray", r"fused_cat", r"_cat_", r"concat(?!_and_cache)")
# W_UK_T's bmm: cuBLAS (nvjet, xmma, *gemm*), CUTLASS, aten's GEMM ops, oneDNN on CPU.
GEMM_NAMES = (
    r"^aten::(bmm|mm|matmul|addmm|baddbmm)$", r"gemm", r"nvjet", r"xmma", r"cutlass",
    r"cublas", r"s16816", r"onednn_mm", r"splitkreduce",
)  # fmt: skip


def any_of(*patterns: str) -> re.Pattern[str]:
    """One case-insensitive pattern matching any of `patterns`."""
    return re.compile("|".join(f"(?:{p})" for p in patterns), re.IGNORECASE)


# --------------------------------------------------------------------------- families

QUERY, ATTENTION, KV_CACHE, ROPE, GEMM, MOE, COPIES, OTHER = (
    "query", "attention", "kv_cache", "rope", "gemm", "moe", "copies", "other",
)  # fmt: skip
# The order the reports list them in: the query step first, the rest last.
FAMILIES = (QUERY, ATTENTION, KV_CACHE, ROPE, GEMM, MOE, COPIES, OTHER)
FAMILY_LABELS = {
    QUERY: "query step",
    ATTENTION: "attention",
    KV_CACHE: "KV-cache write",
    ROPE: "RoPE",
    GEMM: "GEMMs",
    MOE: "MoE",
    COPIES: "copies",
    OTHER: "other",
}

# (family, pattern, why), first match wins; matched case-insensitively against the whole
# name (a C++ template instance included). A name no entry matches is OTHER.
FAMILY_PATTERNS: tuple[tuple[str, str, str], ...] = (
    # -- the query step: the rule's events come first (step_work); by name, only fusedq's.
    (QUERY, "|".join(FUSED_NAMES), "fusedq's kernels are the query step wherever they run, "
     "also where no attention follows them in the window the rule reads"),
    # -- attention, before GEMMs: FA3's kernels are CUTLASS template instances.
    (ATTENTION, r"\bflash::", "FlashAttention 3's namespace: FlashAttnFwdSm90 (the decode "
     "attention), FlashAttnFwdCombine (its split-KV combine) and prepare_varlen_num_blocks "
     "(its scheduler's metadata), all inside cutlass::device_kernel<...>"),
    (ATTENTION, r"flash_?fwd|flash_attn|flashattn", "FlashAttention 2's flash_fwd_splitkv "
     "kernels and their combine, as vllm-flash-attn names them"),
    (ATTENTION, r"flash_?mla|sparse_mla", "FlashMLA's decode kernels (dense and sparse), "
     "the backend for an FP8 KV cache"),
    (ATTENTION, r"fmha|_fwd_grouped_kernel|_fwd_kernel_stage|decode_attention|paged_attention",
     "CUTLASS MLA (fmha), Triton MLA's two decode stages, and paged attention"),
    # -- the KV-cache write.
    (KV_CACHE, r"(concat|reshape)_and_cache", "vLLM's cache write: concat_and_cache_mla "
     "stores the step's latent and rope key in the paged cache (reshape_and_cache for MHA)"),
    (KV_CACHE, r"indexer_k\w*cache", "the DSA indexer's key cache write (sparse MLA)"),
    # -- RoPE.
    (ROPE, r"rotary|(?<![a-z])rope(?![a-z])", "vLLM's CUDA rotary_embedding kernel (eager, or "
     "a custom op kept out of torch.compile) and kernels named after RoPE"),
    (ROPE, r"^triton_\w*index_select\w*mul|^triton_\w*mul\w*index_select", "inductor names a "
     "fused kernel after the aten ops in it; RoPE's are the cos/sin cache lookup "
     "(index_select by position) and the rotation's mul, with add/sub and the interleave's "
     "split/stack: triton_poi_fused_add_copy_index_select_mul_slice_split_stack_..."),
    # -- MoE, before GEMMs: a grouped expert GEMM is the MoE's work.
    (MOE, r"fused_moe", "vLLM's Triton expert GEMM (fused_moe_kernel)"),
    (MOE, r"\bmoe::|moe_sum|moe_align|topk_?softmax|topkgating|grouped_topk",
     "vLLM's MoE ops: moe_sum (the top-k reduction), moe_align_block_size, the router's "
     "top-k kernels; not a bare 'moe', which inductor puts in the names of the norms it "
     "fuses around the MoE op (triton_red_fused_fused_add_rms_norm_moe_forward_shared_0)"),
    # -- GEMMs.
    (GEMM, r"nvjet|xmma|gemm|cublas|s16816|splitkreduce|cutlass",
     "cuBLAS(Lt)'s nvjet/xmma GEMMs and their split-K reduction kernel "
     "(cublasLt::splitKreduce_kernel, part of a split-K GEMM), CUTLASS GEMMs"),
    # -- copies.
    (COPIES, r"^memcpy\d+_", "a CUDA graph's memcpy node run on the SMs: the driver's "
     "memcpy32_post kernel (the same copy may be recorded as a Memcpy DtoD instead)"),
    (COPIES, r"^memcpy \w+", "CUPTI's copy records (gpu_memcpy: Memcpy DtoD, "
     "HtoD, DtoH), not kernels: a trace's kernel count leaves them out"),
    (COPIES, r"direct_copy_kernel|copy_kernel|catarraybatchedcopy", "aten's copy_/to() "
     "kernels and a cat outside the query step"),
)  # fmt: skip


@dataclass(frozen=True)
class FamilyTable:
    """The compiled family patterns: ``family(name)``."""

    entries: tuple[tuple[str, re.Pattern[str]], ...]

    @classmethod
    def of(cls, patterns: tuple[tuple[str, str, str], ...] = FAMILY_PATTERNS) -> FamilyTable:
        return cls(tuple((fam, re.compile(p, re.IGNORECASE)) for fam, p, _ in patterns))

    def family(self, name: str) -> str:
        """The family of a device event that the query-step rule did not count."""
        for fam, pattern in self.entries:
            if pattern.search(name):
                return fam
        return OTHER


DEFAULT_FAMILIES = FamilyTable.of()


# --------------------------------------------------------------------------- table cells

# A table cell's width for a kernel name: CUTLASS and FlashAttention kernels are C++ template
# instances whose demangled names run past 1,000 characters.
NAME_CELL_CHARS = 100


def short_name(name: str, limit: int = NAME_CELL_CHARS) -> str:
    """A kernel name that fits a table cell: the parameter list dropped, then the deepest
    template arguments folded to ``…`` until it fits, then the middle cut. Names within
    `limit` are returned as they are; the full name stays in the JSON figures."""
    if len(name) <= limit:
        return name
    out = _drop_parameters(name)
    while len(out) > limit:
        folded = _fold_deepest_template(out)
        if folded == out:
            break
        out = folded
    if len(out) > limit:
        head = (limit - 1) * 2 // 3
        out = out[:head] + "…" + out[len(out) - (limit - 1 - head) :]
    return out


def _drop_parameters(name: str) -> str:
    """``void k<T>(T const*, int)`` -> ``void k<T>``: the parameter list at depth 0."""
    depth = 0
    for i, ch in enumerate(name):
        if ch == "<":
            depth += 1
        elif ch == ">":
            depth = max(depth - 1, 0)
        elif ch == "(" and depth == 0 and i > 0:
            return name[:i].rstrip()
    return name


_FOLDED = "<…>"


def _fold_deepest_template(name: str) -> str:
    """Every template argument list at the deepest nesting level not folded yet replaced by
    ``…`` (a folded ``<…>`` counts as a plain word, so each call folds one level more)."""
    marker = "\x00"
    name = name.replace(_FOLDED, marker)
    depth = deepest = 0
    for ch in name:
        depth += ch == "<"
        depth -= ch == ">"
        deepest = max(deepest, depth)
    if deepest == 0:
        return name.replace(marker, _FOLDED)
    out: list[str] = []
    depth = 0
    for ch in name:
        if ch == "<":
            depth += 1
            if depth == deepest:
                out.append("<…")
                continue
        elif ch == ">":
            if depth == deepest:
                depth -= 1
                out.append(">")
                continue
            depth -= 1
        if depth < deepest:
            out.append(ch)
    return "".join(out).replace(marker, _FOLDED)
