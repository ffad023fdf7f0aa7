"""The vLLM releases the plugin was read against: one row each, and the row this process runs.

Supporting another release is a new row of ``RELEASES``: the transform, the guard and the plan
(``fusedq.vllm.patch``, ``fusedq.vllm.layer_plan``) read everything release-specific here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from keyword import iskeyword

MLA_MODULE = "vllm.model_executor.layers.attention.mla_attention"
# Where MultiHeadLatentAttentionWrapper lives (it runs RoPE; the decode front moves that).
WRAPPER_MODULE = "vllm.model_executor.layers.mla"
# The query-side block of MLAAttention.forward_impl this plugin nests under its fallback:
# from the first line to the last (inclusive), dedented. Both lines are the same in every
# release read so far; what sits around the block differs (see RELEASES).
BLOCK_FIRST = "if self.is_aiter_triton_fp4_bmm_enabled:"
BLOCK_LAST = "mqa_q = (mqa_ql_nope, mqa_q_pe)"
# Lines that must come before the block in every release: the query split and vLLM's
# (N, B, P) transpose, whose results the hook consumes.
BEFORE_BLOCK = (
    "mqa_q_nope, mqa_q_pe = mqa_q.split(",
    "mqa_q_nope = mqa_q_nope.transpose(0, 1)",
)


@dataclasses.dataclass(frozen=True)
class Release:
    """One vLLM release line whose ``MLAAttention.forward_impl`` this plugin was read against.

    Supporting another release is a new row of this table, not a new branch of code: the
    transform, the guard and the plan read everything release-specific from here.
    """

    name: str
    # [min, below) on (major, minor): the block hash is the real guard; the range keeps a
    # release whose *surroundings* changed (what the query feeds into) from being patched just
    # because the block itself stayed the same.
    versions: tuple[tuple[int, int], tuple[int, int]]
    # vLLM version read -> sha256 of the dedented block; any edit disables the plugin.
    blocks: Mapping[str, str]
    # Consumers after the block, in order: each takes a finished tensor query as well as
    # vLLM's (ql_nope, q_pe) pair, which is how the hook's result is handed on.
    after: tuple[str, ...]
    # The hook's arguments after ``self`` -- q_nope, q_pe, whether this step replicates the
    # query for DCP (the hook then declines), fp8 attention -- as forward_impl expressions.
    hook_args: tuple[str, str, str, str]
    # Instance attributes of this release's MLAAttention that the plan reads besides
    # LAYER_ATTRS (checked per layer: the class-level guard cannot see instance state).
    layer_attrs: tuple[str, ...] = ()
    # The decode front (fusedq.vllm.front_patch): vLLM version read -> sha256 of the dedented
    # source of MultiHeadLatentAttentionWrapper.forward and of MLAAttention.forward. The whole
    # methods are hashed, not a block: the front moves RoPE from one to the other and skips
    # part of the cache write, so any change in either can break what it relies on.
    wrapper_forward: Mapping[str, str] = dataclasses.field(default_factory=dict)
    attn_forward: Mapping[str, str] = dataclasses.field(default_factory=dict)

    @property
    def hook_locals(self) -> tuple[str, ...]:
        """forward_impl locals the inserted call reads or writes."""
        return (*(a for a in self.hook_args if a.isidentifier() and not iskeyword(a)), "mqa_q")

    def span(self) -> str:
        (a, b), (c, d) = self.versions
        return f">={a}.{b},<{c}.{d}"


RELEASES: tuple[Release, ...] = (
    Release(
        name="0.32",
        versions=((0, 32), (0, 34)),
        blocks={"0.32.0": "51306b400d2fc8d04e03d6e2a9c2a8aced015c078c5745064d49c4015cb35e47"},
        after=(
            "if isinstance(mqa_q, tuple):",
            "mqa_q = self.dcp_manager.query_gather(mqa_q)",
            "self.impl.forward_mqa(mqa_q, kv_cache, attn_metadata, self)",
        ),
        hook_args=("mqa_q_nope", "mqa_q_pe", "qrep_decode", "fp8_attention"),
        layer_attrs=("is_amx_bmm_enabled",),
        wrapper_forward={
            "0.32.0": "5a50465cfb8f9cae02cad26f1e29599e607a43fa16ef97d73e369c284dd25bef"
        },
        attn_forward={"0.32.0": "3286ef1841cd7b702c94b3dfce177b103a37fe39d03281237e62e925baecae0a"},
    ),
    # 0.26 (the newest release built for torch 2.11 + CUDA 13, the H200 image's stack): no AMX
    # branch, the bmm writes an (N, B, L) buffer and transposes it, and DCP concatenates a
    # pair and all-gathers after the block instead of a query_gather; there is no DCP query
    # replication, so the hook never has to decline for it.
    Release(
        name="0.26",
        versions=((0, 26), (0, 27)),
        blocks={"0.26.0": "6c3ac941bd5e04f9b777eb7d3d4b6078a2d0992e7917b93a1c936ac87ed5c6c4"},
        after=(
            "if isinstance(mqa_q, tuple):",
            "mqa_q = get_dcp_group().all_gather(mqa_q, dim=1)",
            "self.impl.forward_mqa(mqa_q, kv_cache, attn_metadata, self)",
        ),
        hook_args=("mqa_q_nope", "mqa_q_pe", "False", "fp8_attention"),
        wrapper_forward={
            "0.26.0": "89628187c651bba8dd3d97a14dc35fc133c696d60689c95cf8a2a9ceab7b51f4"
        },
        attn_forward={"0.26.0": "bd093dac0d7f6e2aa478d2da11fdd06731fe4fa339ea0bc4c029799681d43fcb"},
    ),
)


def release_for(version: tuple[int, ...]) -> Release | None:
    """The row whose range holds this vLLM version, or None."""
    return next((r for r in RELEASES if r.versions[0] <= version[:2] < r.versions[1]), None)


# The forward_impl this process installed (a subclass overriding it does not run the hook)
# and the RELEASES row it was built from (``patch.apply`` fills it).
installed: dict[str, object] = {}
