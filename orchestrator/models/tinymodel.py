"""Build the built-in models: tiny, randomly initialised DeepSeek-V3-architecture MLA checkpoints.

The matrices need real MLA models that vLLM can serve with no hub access. This module makes
them locally, deterministically: the MLA geometry of the real models (kv_lora_rank 512 +
rope 64 = 576, the only latent width the CPU MLA backends accept; qk_nope 192 as in GLM-5),
shrunk everywhere else, plus one MTP layer so speculative decoding can be exercised.

- ``tiny-mla`` (the embedded default, CPU): v_head 128, 8 heads, 2 layers, ~18 MB in bf16.
- ``tiny-glm5`` (GPU): GLM-5's head geometry, v_head 256. vLLM's GPU MLA prefill backends
  accept only known (qk_nope, rope, v) triples -- (128, 64, 128), (192, 64, 256), (64, 64,
  128) on sm_90 -- and refuse tiny-mla's (192, 64, 128) ("No valid MLA prefill backend
  found"); GLM-5's serves.

Heads and layers are parameters (the matrix's ``num_heads`` and ``layers``), so the per-rank
shapes of real topologies -- 16 heads = TP4 of GLM-5's 64, 11 = TP6 padded, 8 = TP8 -- can
each be served on one GPU.

Heavy imports (torch, transformers, tokenizers, safetensors) stay inside the functions
so importing the orchestrator stays fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fusedq import contract

# Bump when the files written change in a way the config hash does not capture, so old
# caches are not reused.
BUILDER_VERSION = 1

CACHE_ENV = "ORCHESTRATOR_CACHE"
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")  # ids 0, 1, 2 by construction

# The embedded default's shape (tiny-mla). MLA widths follow DESIGN.md; the rest is as small
# as vLLM allows. The other built-ins and parameters are changes to this (see ``arch``).
ARCH: dict[str, Any] = {
    "vocab_size": 2048,
    "hidden_size": 256,
    "intermediate_size": 512,
    "moe_intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 8,
    "num_key_value_heads": 8,
    "q_lora_rank": 128,
    # The fused query's geometry: these models exist to serve it.
    "kv_lora_rank": contract.KV_LORA,
    "qk_rope_head_dim": contract.QK_ROPE,
    "qk_nope_head_dim": contract.GLM5.qk_nope,
    "v_head_dim": 128,
    # Dense MLP in every layer (first_k_dense_replace past the MTP layer's index): the
    # attention path is what the project measures, and dense keeps the CPU build on its
    # best-trodden kernels. The MoE fields must still be ints: vLLM's weight loader builds
    # its expert mapping from n_routed_experts even when no layer is MoE.
    "n_routed_experts": 4,
    "n_shared_experts": 1,
    "num_experts_per_tok": 2,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 4,
    # Long enough for a 64k-token workload plus its output (vLLM sizes max_model_len from it).
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-6,
    "initializer_range": 0.02,
    "tie_word_embeddings": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
}


def cache_root() -> Path:
    """`$ORCHESTRATOR_CACHE`, else `<repo>/.cache`: where built models and shared compile
    caches (orchestrator.engines.vllm.compile_cache) live."""
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(__file__).resolve().parents[2] / ".cache"


def default_cache_dir() -> Path:
    """`$ORCHESTRATOR_CACHE/models`, else `<repo>/.cache/models`."""
    return cache_root() / "models"


# Built-in model name -> what it changes in ARCH (and its directory-name stem).
BUILTINS: dict[str, dict[str, Any]] = {
    "tiny-mla": {"stem": "tiny-dsv3-mla", "v_head_dim": 128},
    "tiny-glm5": {"stem": "tiny-glm5-mla", "v_head_dim": 256},
}
DEFAULT_HEADS = ARCH["num_attention_heads"]
DEFAULT_LAYERS = ARCH["num_hidden_layers"]
# Bounds that keep a "tiny" model tiny (and a typo from building gigabytes): 128 heads is
# GLM-5's count at TP1 twice over; 96 layers is past GLM-5's 78.
MAX_HEADS = 128
MAX_LAYERS = 96


def arch(
    name: str = "tiny-mla", *, heads: int = DEFAULT_HEADS, layers: int = DEFAULT_LAYERS
) -> dict[str, Any]:
    """The config fields of built-in model ``name`` with ``heads`` heads and ``layers`` layers.

    ``ValueError`` naming the bad value for an unknown name or out-of-range sizes.
    """
    if name not in BUILTINS:
        raise ValueError(f"unknown built-in model {name!r}; known: {sorted(BUILTINS)}")
    if not 1 <= heads <= MAX_HEADS:
        raise ValueError(f"heads={heads} is outside 1..{MAX_HEADS} for built-in model {name}")
    if not 1 <= layers <= MAX_LAYERS:
        raise ValueError(f"layers={layers} is outside 1..{MAX_LAYERS} for built-in model {name}")
    return {
        **ARCH,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "num_hidden_layers": layers,
        "v_head_dim": BUILTINS[name]["v_head_dim"],
        # Dense in every layer, the MTP layer (index `layers`) included.
        "first_k_dense_replace": max(ARCH["first_k_dense_replace"], layers + 2),
    }


def model_spec(
    *,
    mtp: bool = True,
    seed: int = 0,
    name: str = "tiny-mla",
    heads: int = DEFAULT_HEADS,
    layers: int = DEFAULT_LAYERS,
) -> dict[str, Any]:
    """Everything that determines the built files; its hash names the cache directory.

    tiny-mla at its default size hashes as it always did, so existing caches stay valid.
    """
    spec: dict[str, Any] = {
        "builder": BUILDER_VERSION,
        "arch": arch(name, heads=heads, layers=layers),
        "mtp": mtp,
        "seed": seed,
    }
    if name != "tiny-mla":
        spec["name"] = name
    return spec


def model_dir_name(spec: dict[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:12]
    a = spec["arch"]
    stem = BUILTINS[spec.get("name", "tiny-mla")]["stem"]
    size = ""
    if (a["num_attention_heads"], a["num_hidden_layers"]) != (DEFAULT_HEADS, DEFAULT_LAYERS):
        size = f"-h{a['num_attention_heads']}-l{a['num_hidden_layers']}"
    return f"{stem}{size}{'-mtp1' if spec['mtp'] else ''}-{digest}"


def build_tiny_model(
    cache_dir: Path | None = None,
    *,
    mtp: bool = True,
    seed: int = 0,
    name: str = "tiny-mla",
    heads: int = DEFAULT_HEADS,
    layers: int = DEFAULT_LAYERS,
) -> Path:
    """Return the directory of built-in model ``name``, building it first if it is not cached.

    The build goes to a temporary directory beside the target and is renamed into place
    at the end, so an interrupted build never leaves a half model that a later call
    would take for a cache hit.
    """
    spec = model_spec(mtp=mtp, seed=seed, name=name, heads=heads, layers=layers)
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()

    def write(tmp: Path) -> None:
        _write_tokenizer(tmp, seed=seed)
        _write_weights_and_config(tmp, spec["arch"], mtp=mtp, seed=seed)
        (tmp / "orchestrator-tinymodel.json").write_text(json.dumps(spec, indent=2) + "\n")

    return build_into(root / model_dir_name(spec), write)


def build_into(target: Path, write: Callable[[Path], None]) -> Path:
    """`target`, made by `write(tmp)` into a temporary directory beside it and renamed into
    place at the end (unless `target/config.json` is there already, a cache hit).

    An interrupted build never leaves a half model that a later call would take for a cache
    hit; a concurrent build of the same target that wins the rename is kept (its files are
    identical).
    """
    if (target / "config.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        write(tmp)
        try:
            tmp.rename(target)
        except OSError:
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def vocab_size(model_path: str | Path) -> int:
    """Token ids a prompt may use: the smaller of the model's and the tokenizer's vocab.

    vLLM rejects prompt ids past the tokenizer's largest id, and real checkpoints pad the
    embedding beyond the tokenizer, so both bounds matter.
    """
    path = Path(model_path)
    cfg = json.loads((path / "config.json").read_text())
    # Multimodal checkpoints keep the language model's vocab under text_config.
    n = int(cfg.get("vocab_size") or cfg.get("text_config", {})["vocab_size"])
    tok = path / "tokenizer.json"
    if tok.is_file():
        data = json.loads(tok.read_text())
        vocab = data.get("model", {}).get("vocab") or {}
        ids = list(vocab.values() if isinstance(vocab, dict) else [])
        ids += [t["id"] for t in data.get("added_tokens", [])]
        if ids:
            n = min(n, max(ids) + 1)
    return n


def _corpus(seed: int, n_words: int = 60_000) -> list[str]:
    """Pseudo-text from random syllables: enough distinct byte pairs to fill 2048 merges."""
    rng = random.Random(seed)
    onsets = ["", "b", "c", "d", "f", "g", "h", "k", "l", "m", "n", "p", "r", "s", "t", "v"]
    onsets += ["br", "ch", "dr", "fl", "gr", "kr", "pl", "qu", "sh", "st", "th", "tr", "w", "z"]
    nuclei = ["a", "e", "i", "o", "u", "ai", "ea", "ou", "y", "oo", "ie"]
    codas = ["", "", "n", "r", "s", "t", "l", "m", "nd", "st", "ng", "ck", "x"]
    lexicon = [
        "".join(
            rng.choice(onsets) + rng.choice(nuclei) + rng.choice(codas)
            for _ in range(rng.randint(1, 3))
        )
        for _ in range(3000)
    ]
    punct = [" ", " ", " ", " ", " ", ", ", ". ", "; ", "! ", "? ", "\n", " 0", " 42 ", " (x) "]
    lines, words = [], []
    for i in range(n_words):
        w = rng.choice(lexicon)
        words.append(w.capitalize() if rng.random() < 0.1 else w)
        words.append(rng.choice(punct))
        if i % 200 == 199:
            lines.append("".join(words))
            words = []
    lines.append("".join(words))
    return lines


def _write_tokenizer(out: Path, *, seed: int) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=ARCH["vocab_size"],
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(seed), trainer=trainer)
    if tok.get_vocab_size() != ARCH["vocab_size"]:
        raise RuntimeError(
            f"tokenizer trained to {tok.get_vocab_size()} tokens, want {ARCH['vocab_size']}: "
            "the generated corpus is too small"
        )
    tok.save(str(out / "tokenizer.json"))
    bos, eos, pad = SPECIAL_TOKENS
    tok_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": pad,
        "add_bos_token": False,
        "model_max_length": ARCH["max_position_embeddings"],
        "clean_up_tokenization_spaces": False,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2) + "\n")
    special_map = {"bos_token": bos, "eos_token": eos, "pad_token": pad}
    (out / "special_tokens_map.json").write_text(json.dumps(special_map, indent=2) + "\n")


def _write_weights_and_config(out: Path, shape: dict[str, Any], *, mtp: bool, seed: int) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    n_layers = shape["num_hidden_layers"]
    config = DeepseekV3Config(
        **shape,
        num_nextn_predict_layers=1 if mtp else 0,
        rope_interleave=True,
        dtype="bfloat16",
        architectures=["DeepseekV3ForCausalLM"],
    )
    # The MTP block's decoder layer is an ordinary DeepSeek-V3 layer at index n_layers, so
    # a model built with one extra layer yields it with the right names and init. The
    # config written keeps n_layers (transformers has no MTP module; vLLM finds the
    # block through num_nextn_predict_layers).
    build_config = DeepseekV3Config(**{**config.to_dict(), "num_hidden_layers": n_layers + 1})
    torch.manual_seed(seed)
    with torch.no_grad():
        model = DeepseekV3ForCausalLM(build_config).float()
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        prefix = f"model.layers.{n_layers}."
        if mtp:
            hidden, std = shape["hidden_size"], shape["initializer_range"]
            state[prefix + "enorm.weight"] = torch.ones(hidden)
            state[prefix + "hnorm.weight"] = torch.ones(hidden)
            state[prefix + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * std
            state[prefix + "shared_head.norm.weight"] = torch.ones(hidden)
            state[prefix + "shared_head.head.weight"] = (
                torch.randn(shape["vocab_size"], hidden) * std
            )
        else:
            state = {k: v for k, v in state.items() if not k.startswith(prefix)}
    tensors = {k: v.to(torch.bfloat16).contiguous() for k, v in state.items()}
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.to_json_file(str(out / "config.json"))
    generation = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
