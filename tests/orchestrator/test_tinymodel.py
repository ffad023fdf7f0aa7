"""The embedded default model: built once, cached, with the geometry vLLM's CPU MLA path needs."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from orchestrator.models import tinymodel

pytest.importorskip("tokenizers")
pytest.importorskip("safetensors")
pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    cache = tmp_path_factory.mktemp("models")
    return cache, tinymodel.build_tiny_model(cache)


def test_files_present(built: tuple[Path, Path]) -> None:
    _, path = built
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (path / name).is_file(), name
    # Nothing half-built is left beside the model.
    assert [p.name for p in path.parent.iterdir()] == [path.name]


def test_config_is_tiny_deepseek_v3_mla(built: tuple[Path, Path]) -> None:
    _, path = built
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["architectures"] == ["DeepseekV3ForCausalLM"]
    assert cfg["model_type"] == "deepseek_v3"
    expect = {
        "hidden_size": 256,
        "num_hidden_layers": 2,
        "num_attention_heads": 8,
        "q_lora_rank": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 192,
        "v_head_dim": 128,
        "vocab_size": 2048,
        "num_nextn_predict_layers": 1,
    }
    assert {k: cfg[k] for k in expect} == expect
    # The CPU MLA backends accept only this latent width.
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == 576
    assert tinymodel.vocab_size(path) == 2048


def test_weights_bf16_with_mtp_layer(built: tuple[Path, Path]) -> None:
    from safetensors import safe_open

    _, path = built
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        dtypes = {str(f.get_slice(k).get_dtype()) for k in keys}
    assert dtypes == {"BF16"}
    mtp = "model.layers.2."
    for suffix in (
        "enorm.weight",
        "hnorm.weight",
        "eh_proj.weight",
        "shared_head.norm.weight",
        "shared_head.head.weight",
        "self_attn.kv_b_proj.weight",
        "mlp.down_proj.weight",
    ):
        assert mtp + suffix in keys, suffix
    assert not any(k.startswith("model.layers.3.") for k in keys)


def test_tokenizer_round_trips(built: tuple[Path, Path]) -> None:
    from tokenizers import Tokenizer

    _, path = built
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = "Hello, tiny model: 42 tokens!"
    assert tok.decode(tok.encode(text).ids) == text
    assert [tok.token_to_id(t) for t in tinymodel.SPECIAL_TOKENS] == [0, 1, 2]


def test_second_call_is_cache_hit(built: tuple[Path, Path]) -> None:
    cache, path = built
    stamp = (path / "model.safetensors").stat().st_mtime_ns
    t0 = time.perf_counter()
    again = tinymodel.build_tiny_model(cache)
    assert again == path
    assert time.perf_counter() - t0 < 0.5
    assert (path / "model.safetensors").stat().st_mtime_ns == stamp


def test_cache_dir_from_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(tinymodel.CACHE_ENV, str(tmp_path))
    assert tinymodel.default_cache_dir() == tmp_path / "models"


def test_variants_get_distinct_dirs() -> None:
    names = {
        tinymodel.model_dir_name(tinymodel.model_spec(mtp=m, seed=s))
        for m in (True, False)
        for s in (0, 1)
    }
    assert len(names) == 4


def test_without_mtp(tmp_path: Path) -> None:
    path = tinymodel.build_tiny_model(tmp_path, mtp=False)
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["num_nextn_predict_layers"] == 0


def test_glm5_geometry_with_heads_and_layers_as_parameters(tmp_path: Path) -> None:
    """tiny-glm5: the (192, 64, 256) head geometry vLLM's GPU MLA prefill accepts, at the
    per-rank head count asked for; dense everywhere, the MTP layer included."""
    from safetensors import safe_open

    path = tinymodel.build_tiny_model(tmp_path, name="tiny-glm5", heads=11, layers=3)
    cfg = json.loads((path / "config.json").read_text())
    got = {k: cfg[k] for k in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")}
    assert got == {"qk_nope_head_dim": 192, "qk_rope_head_dim": 64, "v_head_dim": 256}
    assert (cfg["num_attention_heads"], cfg["num_hidden_layers"], cfg["kv_lora_rank"]) == (
        11,
        3,
        512,
    )
    assert cfg["first_k_dense_replace"] > cfg["num_hidden_layers"], "no MoE layer, MTP's included"
    assert path.name.startswith("tiny-glm5-mla-h11-l3-mtp1-")
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        kv_b = f.get_slice("model.layers.0.self_attn.kv_b_proj.weight").get_shape()
        assert kv_b == [11 * (192 + 256), 512]
        keys = set(f.keys())
    assert "model.layers.3.eh_proj.weight" in keys
    assert not any(k.startswith("model.layers.4.") for k in keys)


def test_default_model_keeps_its_cache_name() -> None:
    """Parameters did not change the embedded default's files or cache key."""
    spec = tinymodel.model_spec()
    assert spec["arch"] == tinymodel.ARCH
    assert tinymodel.model_dir_name(spec) == tinymodel.model_dir_name(
        tinymodel.model_spec(name="tiny-mla", heads=8, layers=2)
    )


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"name": "tiny-gpt"}, "unknown built-in model 'tiny-gpt'"),
        ({"heads": 0}, r"heads=0 is outside 1\.\.128"),
        ({"layers": 500}, r"layers=500 is outside 1\.\.96"),
    ],
)
def test_bad_sizes_are_named(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        tinymodel.arch(**kwargs)
