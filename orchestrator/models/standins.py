"""Production-geometry stand-ins: a published model (GLM-5, DeepSeek-V3, DeepSeek-V3.2,
Kimi-K2) at its real widths, one rank's share, config only.

A stand-in is a model directory holding ``config.json`` and a tokenizer, nothing else; the
orchestrator serves it with ``--load-format dummy`` (vLLM draws every weight itself, seeded)
and simulated MoE routing. Its decode step does one rank's work of its base model's server
at tensor parallelism ``standin_tp``, so a TP8, TP6 or TP4 topology can be measured on one
GPU. Each stand-in names its base (``STANDINS[name]["base"]``, a key of ``BASES``,
orchestrator.models.standin_bases), whose published values every size here is read from.

- ``glm5``: dense MLA (``DeepseekV3ForCausalLM``, no ``index_topk``): vLLM's ``MLAAttention``
  decode path, the one the fusedq plugin hooks today.
- ``glm5-dense``: ``glm5`` with a dense MLP of one rank's width in every layer (the MTP
  layer's too) and no experts: a decode step with no simulated routing in it, whose time
  moves less from step to step, for attributing a step's time between two paths.
- ``glm5-dsa``: GLM-5's own architecture (``GlmMoeDsaForCausalLM``) with its DSA indexer
  (``index_topk`` 2048, 32 indexer heads of 128): vLLM 0.26 takes its sparse-MLA path
  (``FLASH_ATTN_MLA_SPARSE`` on sm_90) whenever the config has ``index_topk``.
- ``glm5-dsa-dense``: ``glm5-dsa`` cut as ``glm5-dense`` is cut from ``glm5``: the DSA
  indexer and the sparse-MLA path, with a dense MLP of one rank's width in every layer (the
  MTP layer's too) and no experts: the sparse path's decode step without simulated routing,
  small enough (~25 GiB at the TP4 rank) for an 80 GB GPU.
- ``glm47-flash``: GLM-4.7-Flash (GLM-5's MLA widths at 20 heads, hidden 2048, 47 layers
  + 1 MTP layer, 64 experts top-4, one dense layer), as its own architecture
  (``Glm4MoeLiteForCausalLM``), whose attention is vLLM's DeepSeek MLA layer.
- ``deepseek-v3``: DeepSeek-V3 (128 heads, MLA 128/64/128, 61 layers + 1 MTP layer, 256
  experts in 8 groups, YaRN rope).
- ``deepseek-v32``: DeepSeek-V3.2 (``DeepseekV32ForCausalLM``): DeepSeek-V3's model with its
  DSA indexer (64 indexer heads of 128, top 2048, replicated on every rank): vLLM 0.26's
  sparse-MLA path, ``FLASH_ATTN_MLA_SPARSE`` on sm_90 with a BF16 KV cache.
- ``kimi-k2``: Kimi-K2 (64 heads, DeepSeek-V3's MLA widths, 384 experts, one dense layer,
  no MTP layer), served as ``deepseek_v3`` (the reason is at its entry).

The rest of this docstring speaks of GLM-5; the other bases are cut by the same rules
(docs/standins.md gives their shares).

What is GLM-5's, unchanged: hidden 6144, 78 layers (the first 3 dense), q_lora 2048,
kv_lora 512, qk_nope 192, rope 64, v 256, vocabulary 154,880 (the tokenizer has that many
ids), one shared expert, top-8 routing, one MTP layer, the DSA indexer (replicated on every
rank in vLLM, so a rank's share is all of it).

What is one rank's share (``standin_tp`` = t), the way vLLM's tensor parallelism cuts it:
- attention heads ``ceil(64 / t)``: 8 / 16 at TP8 / TP4; 11 at TP6, where a head-padding
  ("virtual TP") engine build pads 64 heads to 66;
- the dense MLP ``12288 / t`` and every expert's and the shared expert's width ``2048 / t``
  (``RowParallel``/``ColumnParallel`` and ``FusedMoE`` shard the intermediate dimension), each
  rounded up to a multiple of 32 where t does not divide it (TP6: 2048 / 6 -> 352; 32 is
  the MXFP8 block, which online MXFP8 needs of every K dimension).

Approximations, and what each does to the decode step (docs/standins.md has the same list):
- Experts are cut from 256 to as many as fit one H200 (``experts_that_fit``: 120 / 80 / 56 at
  TP8 / TP6 / TP4 within a 96 GiB weight budget; the matrix's ``experts`` overrides). Each
  token still runs top-8 experts of full per-rank width plus the shared one, so at one
  sequence a step reads the same expert bytes; with routing drawn uniformly with
  replacement, 8 draws from E experts hit ``E * (1 - (1 - 1/E)**8)`` distinct ones (7.89 of
  256, 7.52 of 56), so the step reads up to ~5 % fewer expert bytes than GLM-5, and with a
  batch the experts a step touches saturate sooner. The fused-MoE kernel's tuned tile table
  is looked up by expert count, so a cut count may run vLLM's default tiles.
- Routing is simulated (``VLLM_MOE_ROUTING_SIMULATION_STRATEGY=uniform_random``, vLLM's
  ``RoutingSimulator``): random weights route every token to the same few experts, which
  would understate the expert reads. The simulated router draws from the global CUDA
  generator, so greedy tokens repeat across servers only where both consumed it alike.
- No collectives: a TP-t server all-reduces after attention and after the MLP in every
  layer (and gathers the logits); one GPU does none of that, so the stand-in's step is
  shorter by that communication.
- The vocabulary is GLM-5's whole 154,880 on the one GPU: a TP-t rank computes 1/t of the
  logits (``ParallelLMHead``), so the stand-in reads ``(1 - 1/t)`` x 1.9 GB more lm_head
  per step (about 0.3 ms at TP4 on an H200) and samples from all of it.
- Weights are random (seeded uniform in +-1e-3): numerics, not timing, differ; a random MTP
  draft accepts almost nothing, so MTP cases use vLLM's synthetic acceptance at the rate
  the matrix sets (``mtp_acceptance``).

Pure: no torch, no transformers; ``tokenizers`` is imported only when a stand-in is built.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
from pathlib import Path
from typing import Any

from orchestrator.models import standin_bases as bases
from orchestrator.models import tinymodel

# Bump when the files written change in a way the spec hash does not capture.
BUILDER_VERSION = 1

# The published models the stand-ins are cut from (orchestrator.models.standin_bases).
GLM5 = bases.GLM5
GLM47_FLASH = bases.GLM47_FLASH
DEEPSEEK_V3 = bases.DEEPSEEK_V3
DEEPSEEK_V32 = bases.DEEPSEEK_V32
KIMI_K2 = bases.KIMI_K2
BASES = bases.BASES
# The DSA indexer's keys: present only in the sparse stand-in (vLLM takes the sparse path on
# `hasattr(config, "index_topk")`, deepseek_v2.py).
DSA_KEYS = ("index_topk", "index_n_heads", "index_head_dim")
# The router of every base (DeepSeek-V3's: sigmoid scores, bias-corrected top-k). With
# routing simulated these only decide which router parameters exist.
ROUTER = {"scoring_func": "sigmoid", "topk_method": "noaux_tc", "moe_layer_freq": 1}

STANDINS: dict[str, dict[str, Any]] = {
    "glm5": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "dsa": False,
        "dense": False,
        "summary": "dense MLA (no DSA indexer): vLLM's MLAAttention decode path",
        "base": "glm5",
    },
    "glm5-dense": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "dsa": False,
        "dense": True,
        "summary": "dense MLA with a dense MLP in every layer (no experts, no routing)",
        "base": "glm5",
    },
    "glm5-dsa": {
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "dsa": True,
        "dense": False,
        "summary": "GLM-5's DSA sparse attention (index_topk 2048): vLLM's sparse-MLA path",
        "base": "glm5",
    },
    "glm5-dsa-dense": {
        # Every layer's MLP dense, the MTP layer's too, by first_k_dense_replace = layers + 1
        # (config() below). vLLM decides it per layer in the decoder layer's constructor:
        # 0.32 (CUDA: vllm/models/deepseek_v32/__init__.py imports nvidia/model.py's
        # DeepseekV32ForCausalLM as GlmMoeDsaForCausalLM) builds DeepseekV2MoE only where
        # `n_routed_experts is not None and layer_idx >= first_k_dense_replace and
        # layer_idx % moe_layer_freq == 0` (deepseek_v32/nvidia/model.py:91-95), else
        # DeepseekV2MLP of intermediate_size (:106-115); its MTP layer is the same decoder
        # layer at index num_hidden_layers (nvidia/mtp.py:94-100, 176-186). 0.26
        # (registry.py:116: deepseek_v2.GlmMoeDsaForCausalLM) has the same test
        # (deepseek_v2.py:1219-1223, the MLP at :1258-1265; the MTP layer deepseek_mtp.py:
        # 112-117 at index num_hidden_layers, :160-173). So no layer allocates experts.
        "architectures": ["GlmMoeDsaForCausalLM"],
        "model_type": "glm_moe_dsa",
        "dsa": True,
        "dense": True,
        "summary": (
            "GLM-5's DSA sparse attention (index_topk 2048) with a dense MLP in every layer "
            "(no experts, no routing): vLLM's sparse-MLA path"
        ),
        "base": "glm5",
    },
    "glm47-flash": {
        # vLLM 0.26 builds it from glm4_moe_lite.py: its attention is DeepseekV2MLAAttention
        # (MultiHeadLatentAttentionWrapper -> MLAAttention, the layer fusedq hooks) and its
        # MoE is GLM-4.5's (sigmoid scores, correction bias, fp32 router), read from these.
        "architectures": ["Glm4MoeLiteForCausalLM"],
        "model_type": "glm4_moe_lite",
        "dsa": False,
        "dense": False,
        "summary": "MLA 192/64/256 at 20 heads: vLLM's MLAAttention decode path",
        "base": "glm47-flash",
    },
    "deepseek-v3": {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "dsa": False,
        "dense": False,
        "summary": "MLA 128/64/128: vLLM's MLAAttention decode path",
        "base": "deepseek-v3",
    },
    "deepseek-v32": {
        # vLLM 0.26 builds DeepseekV32ForCausalLM as deepseek_v2.DeepseekV3ForCausalLM
        # (registry.py:93) and takes the sparse path on index_topk; on sm_90 the first sparse
        # backend that accepts a BF16 KV cache is FLASH_ATTN_MLA_SPARSE (platforms/cuda.py).
        "architectures": ["DeepseekV32ForCausalLM"],
        "model_type": "deepseek_v32",
        "dsa": True,
        "dense": False,
        "summary": (
            "DSA sparse attention (index_topk 2048, 64 indexer heads): "
            "vLLM's sparse-MLA path (FLASH_ATTN_MLA_SPARSE on sm_90)"
        ),
        "base": "deepseek-v32",
    },
    "kimi-k2": {
        # Kimi-K2 publishes model_type kimi_k2 and reads it through its own remote code
        # (configuration_deepseek.DeepseekV3Config); transformers has no kimi_k2 type, and
        # Moonshot's deploy guide says to write deepseek_v3 where a framework does not know
        # it. vLLM builds DeepseekV3ForCausalLM from either.
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "dsa": False,
        "dense": False,
        "summary": "MLA 128/64/128, no MTP layer: vLLM's MLAAttention decode path",
        "base": "kimi-k2",
    },
}
# Weight formats a stand-in can be served in; mxfp8 is quantised by vLLM at load time
# (`--quantization mxfp8`: dummy bf16 weights -> E4M3 values + E8M0 scales per 32);
# mxfp8-checkpoint is a checkpoint's layout (ModelOpt's MXFP8 quantization_config in
# config.json, E4M3 values and uint8 scales built as a checkpoint's), served with fusedq's
# load format: dummy values, then valid scales (fusedq/vllm/standin_loader.py).
MXFP8_CHECKPOINT = "mxfp8-checkpoint"
WEIGHT_FORMATS = ("bf16", "mxfp8", MXFP8_CHECKPOINT)
# fusedq.vllm.standin_loader's LOAD_FORMAT and ENABLE_ENV (a test holds them equal; importing
# it here would import torch into `plan`).
CHECKPOINT_LOAD_FORMAT = "fusedq_dummy"
CHECKPOINT_LOADER_ENV = "FUSEDQ_STANDIN_LOADER"
# What a ModelOpt MXFP8 checkpoint's config.json says (vLLM 0.26: modelopt.py,
# ModelOptMxFp8Config: quant_algo MXFP8, with kv_cache_quant_algo and exclude_modules
# required); the LM head stays bf16, as ModelOpt leaves it.
MXFP8_CHECKPOINT_QUANT = {
    "quant_method": "modelopt",
    "quantization": {
        "quant_algo": "MXFP8",
        "kv_cache_quant_algo": None,
        "exclude_modules": ["lm_head"],
    },
}
# What vLLM's routing simulator draws experts from (vllm/model_executor/layers/fused_moe/
# router/routing_simulator_router.py: "uniform_random" or "normal_routing").
ROUTING_ENV = "VLLM_MOE_ROUTING_SIMULATION_STRATEGY"
ROUTING_STRATEGY = "uniform_random"
# Per-rank widths that t does not divide are rounded up to this: the MXFP8 block (online
# MXFP8 refuses a K dimension it does not divide).
WIDTH_ALIGN = 32
# Weights (bf16) a stand-in may take on one H200 (~139 GiB): the rest holds a 65,536-token
# KV cache (~7.5 GiB with the DSA indexer's), activations and CUDA graphs.
WEIGHT_BUDGET_GIB = 96.0
# Experts are cut in steps of 8 (top-8 needs at least 8).
EXPERT_STEP = 8
BF16_BYTES = 2
TOKENIZER_SPECIALS = ("<bos>", "<eos>", "<pad>", "<unk>")  # ids 0..3
TRANSFORMERS_VERSION = "5.2.0"


def is_standin(name: str) -> bool:
    return name in STANDINS


def base_name(name: str) -> str:
    """The BASES key of the published model stand-in `name` is cut from."""
    return str(STANDINS[name]["base"])


def base_of(name: str) -> bases.Base:
    """The published model stand-in `name` is cut from."""
    return BASES[base_name(name)]


def context_tokens(name: str) -> int:
    """The longest request (prompt + output) vLLM serves stand-in `name`: its base's
    max_position_embeddings (its YaRN rope, if any, does not raise vLLM's limit)."""
    return int(base_of(name).config["max_position_embeddings"])


def heads_per_rank(standin_tp: int, base: str = "glm5") -> int:
    """A base's heads (GLM-5's 64) over `standin_tp` ranks, padded up where it does not
    divide."""
    return math.ceil(BASES[base].heads / standin_tp)


def standin_tp_for_heads(heads: int, base: str = "glm5") -> int:
    """The TP whose rank holds `heads` of a base's heads (GLM-5: 11 -> 6, padded);
    ValueError where no TP does, or several do without dividing evenly."""
    total = BASES[base].heads
    fits = [t for t in range(1, total + 1) if heads_per_rank(t, base) == heads]
    exact = [t for t in fits if total % t == 0]
    if exact:
        return exact[0]
    if len(fits) == 1:
        return fits[0]
    known = sorted({heads_per_rank(t, base) for t in (1, 2, 4, 6, 8, 16)}, reverse=True)
    raise ValueError(
        f"num_heads={heads} is not one rank's share of {BASES[base].title}'s {total} heads "
        f"at any single TP (e.g. {known}); set standin_tp"
    )


def per_rank(width: int, standin_tp: int) -> int:
    """`width / standin_tp`, rounded up to a multiple of WIDTH_ALIGN where it is not whole."""
    if width % standin_tp == 0:
        return width // standin_tp
    return math.ceil(width / standin_tp / WIDTH_ALIGN) * WIDTH_ALIGN


def _attention_params(heads: int, dsa: bool, g: dict[str, Any]) -> int:
    hidden, q_lora, kv_lora = g["hidden_size"], g["q_lora_rank"], g["kv_lora_rank"]
    nope, rope, v = g["qk_nope_head_dim"], g["qk_rope_head_dim"], g["v_head_dim"]
    params = hidden * (q_lora + kv_lora + rope)  # fused q_a + kv_a (replicated)
    params += q_lora * heads * (nope + rope)  # q_b
    params += kv_lora * heads * (nope + v)  # kv_b: W_UK and W_UV
    params += heads * v * hidden  # o_proj
    params += q_lora + kv_lora + 2 * hidden  # norms
    if dsa:
        # The indexer: wq_b, and wk fused with the head weights; replicated on every rank.
        params += q_lora * g["index_n_heads"] * g["index_head_dim"]
        params += hidden * (g["index_head_dim"] + g["index_n_heads"])
    return params


def weight_bytes(
    *,
    standin_tp: int,
    layers: int,
    experts: int,
    dsa: bool,
    mtp: bool = True,
    dense: bool = False,
    base: str = "glm5",
) -> int:
    """Bytes of bf16 weights vLLM allocates for a stand-in of `base` (its MTP layer included
    where `mtp`): what decides whether it fits one GPU. `dense`: every layer's MLP is the
    dense one."""
    g = BASES[base].config
    hidden, vocab = g["hidden_size"], g["vocab_size"]
    heads = heads_per_rank(standin_tp, base)
    dense_mlp = 3 * hidden * per_rank(g["intermediate_size"], standin_tp)
    expert = 3 * hidden * per_rank(g["moe_intermediate_size"], standin_tp)
    moe = hidden * experts + experts + expert * (experts + g["n_shared_experts"])
    attn = _attention_params(heads, dsa, g)
    dense_layers = layers if dense else min(g["first_k_dense_replace"], layers)
    params = 2 * vocab * hidden + hidden  # embedding, lm_head, final norm
    params += layers * attn + dense_layers * dense_mlp + (layers - dense_layers) * moe
    if mtp:
        # vLLM's DeepSeekMTP layer: its own embedding and head, eh_proj, norms, a MoE layer
        # (a dense one in the dense stand-in).
        params += 2 * vocab * hidden + 2 * hidden * hidden + 3 * hidden + attn
        params += dense_mlp if dense else moe
    return params * BF16_BYTES


def experts_that_fit(standin_tp: int, layers: int, base: str = "glm5") -> int:
    """The most routed experts (a multiple of 8, at most the base's: GLM-5's 256) whose
    weights stay in WEIGHT_BUDGET_GIB with the base's MTP layer and, for GLM-5, the DSA
    indexer, so the dense and the DSA stand-in of one TP keep one expert count."""
    b = BASES[base]
    budget = WEIGHT_BUDGET_GIB * 2**30
    best = EXPERT_STEP
    for e in range(EXPERT_STEP, b.config["n_routed_experts"] + 1, EXPERT_STEP):
        size = weight_bytes(
            standin_tp=standin_tp,
            layers=layers,
            experts=e,
            dsa=b.has_dsa,
            mtp=b.mtp_layers > 0,
            base=base,
        )
        if size <= budget:
            best = e
    return best


def config(
    name: str,
    *,
    standin_tp: int,
    layers: int | None = None,
    experts: int | None = None,
    mtp: bool = True,
    weight_format: str = "bf16",
) -> dict[str, Any]:
    """The config.json of stand-in `name` (one rank of its base at TP `standin_tp`). `mtp`
    keeps the base's MTP layer, where it has one (Kimi-K2 has none); `weight_format`
    mxfp8-checkpoint adds ModelOpt's MXFP8 quantization_config.

    ValueError naming the value for an unknown name or sizes out of range.
    """
    if name not in STANDINS:
        raise ValueError(f"unknown stand-in {name!r}; known: {sorted(STANDINS)}")
    base = base_of(name)
    g, total = base.config, base.heads
    if not 1 <= standin_tp <= total:
        raise ValueError(f"standin_tp={standin_tp} is outside 1..{total} ({base.title}'s heads)")
    layers = g["num_hidden_layers"] if layers is None else layers
    if not 1 <= layers <= tinymodel.MAX_LAYERS:
        raise ValueError(f"layers={layers} is outside 1..{tinymodel.MAX_LAYERS}")
    kind = STANDINS[name]
    if kind["dense"] and experts is not None:
        raise ValueError(f"experts={experts} is for MoE stand-ins; {name!r} has no experts")
    if kind["dense"]:
        # No layer builds its experts (first_k_dense_replace below); the key stays because
        # vLLM's DeepSeek model reads it.
        experts = EXPERT_STEP
    if experts is None:
        experts = experts_that_fit(standin_tp, layers, kind["base"])
    top_k, routed = g["num_experts_per_tok"], g["n_routed_experts"]
    if not top_k <= experts <= routed:
        raise ValueError(
            f"experts={experts} is outside {top_k}..{routed} "
            f"(top-{top_k} of {base.title}'s {routed})"
        )
    heads = heads_per_rank(standin_tp, kind["base"])
    keep = {k: v for k, v in g.items() if kind["dsa"] or k not in DSA_KEYS}
    cfg: dict[str, Any] = {
        "architectures": kind["architectures"],
        "model_type": kind["model_type"],
        **keep,
        **ROUTER,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "intermediate_size": per_rank(g["intermediate_size"], standin_tp),
        "moe_intermediate_size": per_rank(g["moe_intermediate_size"], standin_tp),
        "n_routed_experts": experts,
        "num_nextn_predict_layers": base.mtp_layers if mtp else 0,
        "rope_interleave": True,
        "rope_parameters": dict(base.rope),
        "initializer_range": 0.02,
        "bos_token_id": 0,
        "eos_token_id": 1,
        "pad_token_id": 2,
        "dtype": "bfloat16",
        "torch_dtype": "bfloat16",
        # The first transformers that knows glm_moe_dsa. Without a version, transformers 5
        # takes a local config for an old Mistral one and warns of a wrong tokenizer regex.
        "transformers_version": TRANSFORMERS_VERSION,
    }
    if kind["dsa"] and base.indexer_rope_interleave:
        cfg["indexer_rope_interleave"] = True
    if kind["dense"]:
        # Past the MTP layer's index (num_hidden_layers) too: vLLM builds a layer's MLP dense
        # where its index is below first_k_dense_replace (deepseek_v2.py).
        cfg["first_k_dense_replace"] = layers + 1
    if weight_format == MXFP8_CHECKPOINT:
        cfg["quantization_config"] = copy.deepcopy(MXFP8_CHECKPOINT_QUANT)
    return cfg


def spec(
    name: str,
    *,
    standin_tp: int,
    layers: int | None = None,
    experts: int | None = None,
    mtp: bool = True,
    weight_format: str = "bf16",
) -> dict[str, Any]:
    """Everything that determines the files built; its hash names the directory."""
    return {
        "builder": BUILDER_VERSION,
        "name": name,
        "standin_tp": standin_tp,
        "config": config(
            name,
            standin_tp=standin_tp,
            layers=layers,
            experts=experts,
            mtp=mtp,
            weight_format=weight_format,
        ),
    }


def dir_name(s: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(s, sort_keys=True).encode()).hexdigest()[:12]
    c = s["config"]
    mtp = "-mtp1" if c["num_nextn_predict_layers"] else ""
    return (
        f"{s['name']}-tp{s['standin_tp']}-l{c['num_hidden_layers']}-e{c['n_routed_experts']}"
        f"{mtp}-{digest}"
    )


def build_standin(
    cache_dir: Path | None = None,
    *,
    name: str,
    standin_tp: int,
    layers: int | None = None,
    experts: int | None = None,
    mtp: bool = True,
    weight_format: str = "bf16",
) -> Path:
    """The stand-in's directory (config.json + tokenizer), built first if not cached."""
    s = spec(
        name, standin_tp=standin_tp, layers=layers, experts=experts, mtp=mtp,
        weight_format=weight_format,
    )  # fmt: skip
    root = Path(cache_dir) if cache_dir is not None else tinymodel.default_cache_dir()

    def write(tmp: Path) -> None:
        _write_tokenizer(tmp, s["config"]["vocab_size"], context_tokens(name))
        (tmp / "config.json").write_text(json.dumps(s["config"], indent=2) + "\n")
        generation = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
        (tmp / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        (tmp / "orchestrator-standin.json").write_text(json.dumps(s, indent=2) + "\n")

    return tinymodel.build_into(root / dir_name(s), write)


def _write_tokenizer(out: Path, vocab_size: int, max_length: int) -> None:
    """A word-level tokenizer with exactly `vocab_size` ids, so any id a random model samples
    decodes (a smaller tokenizer beside GLM-5's 154,880-row head would leave most of them
    without text); `max_length` is the longest request the model serves."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    names = [*TOKENIZER_SPECIALS, *(f"w{i}" for i in range(len(TOKENIZER_SPECIALS), vocab_size))]
    tok = Tokenizer(models.WordLevel(vocab={n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens(list(TOKENIZER_SPECIALS))
    tok.save(str(out / "tokenizer.json"))
    bos, eos, pad, unk = TOKENIZER_SPECIALS
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "unk_token": unk,
        "add_bos_token": False,
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    special = {"bos_token": bos, "eos_token": eos, "pad_token": pad, "unk_token": unk}
    (out / "special_tokens_map.json").write_text(json.dumps(special, indent=2) + "\n")


def serve_defaults(weight_format: str) -> tuple[list[str], dict[str, str]]:
    """The `vllm serve` args and environment every stand-in needs (the matrix's own, given
    after them, win): dummy weights, simulated routing, online MXFP8 for mxfp8, and fusedq's
    load format (valid E8M0 scales) for mxfp8-checkpoint."""
    if weight_format == MXFP8_CHECKPOINT:
        args = [f"--load-format={CHECKPOINT_LOAD_FORMAT}"]
    else:
        args = ["--load-format=dummy"]
    if weight_format == "mxfp8":
        args.append("--quantization=mxfp8")
    env = {ROUTING_ENV: ROUTING_STRATEGY}
    if weight_format == MXFP8_CHECKPOINT:
        env[CHECKPOINT_LOADER_ENV] = "1"
    return args, env


def describe(
    name: str,
    *,
    standin_tp: int,
    layers: int | None = None,
    experts: int | None = None,
    mtp: bool = True,
    weight_format: str = "bf16",
) -> str:
    """One line for `plan`: what the stand-in is and what it weighs."""
    c = config(
        name, standin_tp=standin_tp, layers=layers, experts=experts, mtp=mtp,
        weight_format=weight_format,
    )  # fmt: skip
    gib = (
        weight_bytes(
            standin_tp=standin_tp,
            layers=c["num_hidden_layers"],
            experts=c["n_routed_experts"],
            dsa=STANDINS[name]["dsa"],
            mtp=c["num_nextn_predict_layers"] > 0,
            dense=STANDINS[name]["dense"],
            base=STANDINS[name]["base"],
        )
        / 2**30
    )
    base = base_of(name)
    padded = " (padded)" if base.heads % standin_tp else ""
    mtp_text = f" + {c['num_nextn_predict_layers']} MTP" if c["num_nextn_predict_layers"] else ""
    if STANDINS[name]["dense"]:
        mlp = f"dense MLP {c['intermediate_size']} in every layer, no experts"
    else:
        mlp = (
            f"dense MLP {c['intermediate_size']}, {c['n_routed_experts']} of "
            f"{base.config['n_routed_experts']} experts x {c['moe_intermediate_size']} (top-"
            f"{c['num_experts_per_tok']} + {c['n_shared_experts']} shared), routing "
            f"{ROUTING_STRATEGY}"
        )
    return (
        f"one rank of {base.title} at TP{standin_tp}, {STANDINS[name]['summary']}: "
        f"{c['num_attention_heads']} heads{padded}, {c['num_hidden_layers']} layers{mtp_text}, "
        f"{mlp}, vocab {c['vocab_size']}, ~{gib:.0f} GiB bf16 weights, served {weight_format} from "
        f"--load-format {CHECKPOINT_LOAD_FORMAT if weight_format == MXFP8_CHECKPOINT else 'dummy'}"
    )
