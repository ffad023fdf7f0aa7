"""The published models the stand-ins are cut from: each one's config values, as its makers
published them, that a stand-in keeps or cuts (orchestrator.models.standins).

- ``glm5``: GLM-5 (zai-org/GLM-5), dense MLA widths 192 / 64 / 256, the DSA indexer.
- ``glm47-flash``: GLM-4.7-Flash (zai-org/GLM-4.7-Flash), GLM-5's MLA widths at 20 heads,
  hidden 2048, 64 experts top-4, one dense layer, one MTP layer.
- ``deepseek-v3``: DeepSeek-V3 (deepseek-ai/DeepSeek-V3), 128 heads of 128 / 64 / 128.
- ``deepseek-v32``: DeepSeek-V3.2 (deepseek-ai/DeepSeek-V3.2-Exp, DeepSeek-V3.2), DeepSeek-V3's
  values plus the DSA lightning indexer: 64 indexer heads of 128, top 2048.
- ``kimi-k2``: Kimi-K2 (moonshotai/Kimi-K2-Instruct), DeepSeek-V3's architecture at 64 heads,
  384 experts, one dense layer, no MTP layer.

Each base's values are checked against a fixture of the published config with its sources,
tests/orchestrator/fixtures/<base>/published_config.json. Pure: no torch, no transformers.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fusedq import contract

# GLM-5 as published (zai-org/GLM-5: transformers' GlmMoeDsaConfig defaults, which cite that
# checkpoint, and the GLM-5 technical report's architecture table).
GLM5: dict[str, Any] = {
    "vocab_size": 154880,
    "hidden_size": 6144,
    "num_hidden_layers": 78,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 2048,
    # The MLA widths: fusedq's geometry row for GLM-5 (the published values, checked by the
    # fixture's test).
    "kv_lora_rank": contract.GLM5.kv_lora,
    "qk_nope_head_dim": contract.GLM5.qk_nope,
    "qk_rope_head_dim": contract.GLM5.qk_rope,
    "v_head_dim": contract.GLM5.v_head,
    "intermediate_size": 12288,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_nextn_predict_layers": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "index_topk": 2048,
    "index_n_heads": 32,
    "index_head_dim": 128,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 202752,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

# GLM-4.7-Flash as published (zai-org/GLM-4.7-Flash: transformers' Glm4MoeLiteConfig defaults
# and the checkpoint's config.json as vLLM's and other engines' tests copy it; the fixture
# names each source): GLM-5's MLA widths at 20 heads and hidden 2048, 64 experts of 1536
# routed top-4, only layer 0 dense, one MTP layer.
GLM47_FLASH: dict[str, Any] = {
    "vocab_size": 154880,
    "hidden_size": 2048,
    "num_hidden_layers": 47,
    "num_attention_heads": 20,
    "num_key_value_heads": 20,
    "q_lora_rank": 768,
    "kv_lora_rank": contract.GLM5.kv_lora,
    "qk_nope_head_dim": contract.GLM5.qk_nope,
    "qk_rope_head_dim": contract.GLM5.qk_rope,
    "v_head_dim": contract.GLM5.v_head,
    "intermediate_size": 10240,
    "moe_intermediate_size": 1536,
    "n_routed_experts": 64,
    "n_shared_experts": 1,
    "num_experts_per_tok": 4,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 1,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 1.8,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-5,
    "max_position_embeddings": 202752,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

# DeepSeek-V3 as published (deepseek-ai/DeepSeek-V3's config.json; its README_WEIGHTS.md for
# the one MTP module).
DEEPSEEK_V3: dict[str, Any] = {
    "vocab_size": 129280,
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": contract.DEEPSEEK_V3.kv_lora,
    "qk_nope_head_dim": contract.DEEPSEEK_V3.qk_nope,
    "qk_rope_head_dim": contract.DEEPSEEK_V3.qk_rope,
    "v_head_dim": contract.DEEPSEEK_V3.v_head,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "num_nextn_predict_layers": 1,
    "n_group": 8,
    "topk_group": 4,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.5,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 163840,
    "tie_word_embeddings": False,
    "attention_bias": False,
}

# DeepSeek-V3.2 as published (deepseek-ai/DeepSeek-V3.2-Exp's reference inference config and
# model.py; transformers' DeepseekV32Config, written from that checkpoint): every DeepSeek-V3
# value unchanged, plus the indexer. A base of its own rather than keys on DEEPSEEK_V3, so the
# dense DeepSeek-V3 stand-in's fit rule never counts an indexer its model does not have.
DEEPSEEK_V32: dict[str, Any] = {
    **DEEPSEEK_V3,
    "index_topk": 2048,
    "index_n_heads": 64,
    "index_head_dim": 128,
}

# Kimi-K2 as published (moonshotai/Kimi-K2-Instruct's config.json): DeepSeek-V3's MLA widths
# at half its heads, 384 experts, one dense layer, and no MTP layer.
KIMI_K2: dict[str, Any] = {
    "vocab_size": 163840,
    "hidden_size": 7168,
    "num_hidden_layers": 61,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "q_lora_rank": 1536,
    "kv_lora_rank": contract.DEEPSEEK_V3.kv_lora,
    "qk_nope_head_dim": contract.DEEPSEEK_V3.qk_nope,
    "qk_rope_head_dim": contract.DEEPSEEK_V3.qk_rope,
    "v_head_dim": contract.DEEPSEEK_V3.v_head,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "num_nextn_predict_layers": 0,
    "n_group": 1,
    "topk_group": 1,
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "hidden_act": "silu",
    "rms_norm_eps": 1e-6,
    "max_position_embeddings": 131072,
    "tie_word_embeddings": False,
    "attention_bias": False,
}


@dataclass(frozen=True)
class Base:
    """A published model a stand-in is cut from."""

    title: str  # how plan, errors and docs name it
    config: dict[str, Any]  # its published values
    # Its rope, as transformers 5 writes it (`rope_parameters`). YaRN's factor does not raise
    # vLLM's length limit (vllm/config/model.py leaves yarn out of the factor it multiplies
    # in), so max_position_embeddings stays the longest request.
    rope: dict[str, Any]
    geometry: contract.Geometry  # fusedq's row for its MLA widths
    # vLLM's `indexer_rope_interleave` (DSA bases only): GLM-5's indexer rope is interleaved;
    # DeepSeek-V3.2's config.json has no such key, so vLLM ropes its indexer NeoX-style
    # (non-interleaved, deepseek_v2.py:1110), as DeepSeek's reference indexer does.
    indexer_rope_interleave: bool = False

    @property
    def heads(self) -> int:
        return int(self.config["num_attention_heads"])

    @property
    def mtp_layers(self) -> int:
        return int(self.config["num_nextn_predict_layers"])

    @property
    def has_dsa(self) -> bool:
        return "index_topk" in self.config


def _yarn(theta: float, factor: float, beta_fast: float, beta_slow: float) -> dict[str, Any]:
    """A YaRN rope of DeepSeek-V3's kind: original length 4096, mscale 1 and 1."""
    return {
        "rope_theta": theta,
        "rope_type": "yarn",
        "factor": factor,
        "original_max_position_embeddings": 4096,
        "beta_fast": beta_fast,
        "beta_slow": beta_slow,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    }


# DeepSeek-V3's YaRN, which DeepSeek-V3.2 keeps unchanged.
_DEEPSEEK_V3_ROPE = _yarn(10000.0, 40.0, 32.0, 1.0)

BASES: dict[str, Base] = {
    "glm5": Base(
        "GLM-5",
        GLM5,
        {"rope_theta": 10000.0, "rope_type": "default"},
        contract.GLM5,
        indexer_rope_interleave=True,
    ),
    "glm47-flash": Base(
        "GLM-4.7-Flash",
        GLM47_FLASH,
        {"rope_theta": 1000000.0, "rope_type": "default"},
        contract.GLM5,
    ),
    "deepseek-v3": Base("DeepSeek-V3", DEEPSEEK_V3, _DEEPSEEK_V3_ROPE, contract.DEEPSEEK_V3),
    "deepseek-v32": Base("DeepSeek-V3.2", DEEPSEEK_V32, _DEEPSEEK_V3_ROPE, contract.DEEPSEEK_V3),
    "kimi-k2": Base("Kimi-K2", KIMI_K2, _yarn(50000.0, 32.0, 1.0, 1.0), contract.DEEPSEEK_V3),
}
