"""GLM-5 stand-ins: the geometry against GLM-5's published config, one rank's cuts, the expert
count that fits one H200, the files built (config and tokenizer only), and the matrix keys.
(The DeepSeek-V3 and Kimi-K2 stand-ins: test_standin_bases.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from orchestrator.config.errors import MatrixError
from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix
from orchestrator.models import standins, tinymodel

FIXTURE = Path(__file__).parent / "fixtures" / "glm5" / "published_config.json"
PUBLISHED = json.loads(FIXTURE.read_text())
REPO = Path(__file__).resolve().parents[2]
H200_BYTES = 139 * 2**30  # what one H200 offers, about
GLM5_STANDINS = [n for n in standins.STANDINS if standins.base_name(n) == "glm5"]


def test_geometry_is_glm5s_published_config() -> None:
    published = PUBLISHED["config"]
    assert set(published) <= set(standins.GLM5)
    assert {k: standins.GLM5[k] for k in published} == published
    # Every value the fixture holds is stated by a source, with its address.
    sourced = {k for s in PUBLISHED["sources"] for k in s["keys"]}
    assert set(published) <= sourced
    assert all(s["address"].startswith("https://") for s in PUBLISHED["sources"])


def test_transformers_defaults_are_the_published_values() -> None:
    """transformers' GlmMoeDsaConfig is written from zai-org/GLM-5: where it is installed, its
    defaults must still be the fixture's (a changed default is news to read)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GlmMoeDsaConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no GlmMoeDsaConfig")
    defaults = transformers.GlmMoeDsaConfig()
    keys = PUBLISHED["sources"][0]["keys"]
    assert {k: getattr(defaults, k) for k in keys} == {k: PUBLISHED["config"][k] for k in keys}


def test_one_rank_of_tp1_with_every_expert_is_glm5() -> None:
    cfg = standins.config("glm5-dsa", standin_tp=1, experts=256)
    assert {k: cfg[k] for k in PUBLISHED["config"]} == PUBLISHED["config"]
    assert (cfg["architectures"], cfg["model_type"]) == (
        PUBLISHED["architectures"],
        PUBLISHED["model_type"],
    )


@pytest.mark.parametrize(
    ("tp", "heads", "dense", "expert"),
    [(8, 8, 1536, 256), (6, 11, 2048, 352), (4, 16, 3072, 512), (2, 32, 6144, 1024)],
)
def test_one_ranks_share(tp: int, heads: int, dense: int, expert: int) -> None:
    for name in GLM5_STANDINS:
        cfg = standins.config(name, standin_tp=tp)
        assert cfg["num_attention_heads"] == cfg["num_key_value_heads"] == heads
        assert (cfg["intermediate_size"], cfg["moe_intermediate_size"]) == (dense, expert)
        # What a rank holds whole: GLM-5's.
        for key in ("hidden_size", "q_lora_rank", "kv_lora_rank", "vocab_size", "v_head_dim"):
            assert cfg[key] == standins.GLM5[key], key
        assert cfg["num_experts_per_tok"] == 8 and cfg["n_shared_experts"] == 1
        # The dense stand-in's MLP is dense in every layer, the MTP layer's (index 78) too.
        first_moe = 79 if standins.STANDINS[name]["dense"] else 3
        assert cfg["first_k_dense_replace"] == first_moe and cfg["num_nextn_predict_layers"] == 1
        assert cfg["n_routed_experts"] % 8 == 0
        # Every K dimension a rank multiplies over is a whole number of MXFP8 blocks.
        assert dense % 32 == 0 and expert % 32 == 0
    assert standins.standin_tp_for_heads(heads) == tp


def test_dense_stand_in_has_no_indexer_and_the_dsa_one_has_glm5s() -> None:
    dense = standins.config("glm5", standin_tp=4)
    dsa = standins.config("glm5-dsa", standin_tp=4)
    # vLLM 0.26 takes the sparse path on hasattr(config, "index_topk") (deepseek_v2.py).
    assert not set(standins.DSA_KEYS) & set(dense)
    assert {k: dsa[k] for k in standins.DSA_KEYS} == {
        "index_topk": 2048,
        "index_n_heads": 32,
        "index_head_dim": 128,
    }
    assert dense["architectures"] == ["DeepseekV3ForCausalLM"]
    assert dsa["architectures"] == ["GlmMoeDsaForCausalLM"]
    assert dense["n_routed_experts"] == dsa["n_routed_experts"]


def test_the_dense_dsa_stand_in_is_glm5_dsa_cut_as_glm5_dense() -> None:
    """glm5-dsa-dense: GLM-5's DSA architecture and indexer, with glm5-dense's MLP (one rank's
    dense width in every layer and the MTP layer, no experts)."""
    cfg = standins.config("glm5-dsa-dense", standin_tp=4)
    dsa = standins.config("glm5-dsa", standin_tp=4)
    dense = standins.config("glm5-dense", standin_tp=4)
    assert (cfg["architectures"], cfg["model_type"]) == (["GlmMoeDsaForCausalLM"], "glm_moe_dsa")
    assert {k: cfg[k] for k in standins.DSA_KEYS} == {
        "index_topk": 2048,
        "index_n_heads": 32,
        "index_head_dim": 128,
    }
    assert cfg["indexer_rope_interleave"] is True
    assert (cfg["num_attention_heads"], cfg["num_hidden_layers"]) == (16, 78)
    assert cfg["intermediate_size"] == 12288 // 4
    # vLLM builds a layer's MoE only where its index >= first_k_dense_replace: 79 is past the
    # MTP layer's index (78), so no layer has experts.
    assert cfg["first_k_dense_replace"] == cfg["num_hidden_layers"] + 1 == 79
    assert cfg["num_nextn_predict_layers"] == 1
    # glm5-dsa's config but for the MLP keys; glm5-dense's but for the architecture and DSA.
    mlp = {"first_k_dense_replace", "n_routed_experts"}
    assert {k: v for k, v in cfg.items() if k not in mlp} == {
        k: v for k, v in dsa.items() if k not in mlp
    }
    dsa_only = {"architectures", "model_type", "indexer_rope_interleave", *standins.DSA_KEYS}
    assert {k: v for k, v in cfg.items() if k not in dsa_only} == {
        k: v for k, v in dense.items() if k not in dsa_only
    }
    with pytest.raises(ValueError, match="experts=32 is for MoE stand-ins"):
        standins.config("glm5-dsa-dense", standin_tp=4, experts=32)


@pytest.mark.parametrize("tp", [8, 4])
def test_the_dense_dsa_stand_in_weighs_the_dense_one_and_the_indexer(tp: int) -> None:
    """What `plan` prints it weighs: glm5-dense's bytes plus the indexer's, replicated in every
    layer and the MTP layer (wq_b, and wk fused with the head weights)."""
    g = standins.GLM5
    indexer = g["q_lora_rank"] * g["index_n_heads"] * g["index_head_dim"]
    indexer += g["hidden_size"] * (g["index_head_dim"] + g["index_n_heads"])
    kwargs = {"standin_tp": tp, "layers": 78, "experts": 8, "dense": True}
    dense = standins.weight_bytes(dsa=False, **kwargs)
    ours = standins.weight_bytes(dsa=True, **kwargs)
    assert ours - dense == (78 + 1) * indexer * standins.BF16_BYTES
    note = standins.describe("glm5-dsa-dense", standin_tp=tp)
    assert f"~{ours / 2**30:.0f} GiB bf16 weights" in note
    assert f"dense MLP {12288 // tp} in every layer, no experts" in note
    assert "sparse-MLA path" in note
    # One TP4 rank fits an 80 GB GPU with room for its KV cache.
    assert ours < 26 * 2**30


@pytest.mark.parametrize("tp", [8, 6, 4])
def test_experts_are_the_most_that_fit_the_budget(tp: int) -> None:
    budget = standins.WEIGHT_BUDGET_GIB * 2**30
    e = standins.experts_that_fit(tp, 78)
    assert 8 <= e < 256
    for dsa in (False, True):
        assert standins.weight_bytes(standin_tp=tp, layers=78, experts=e, dsa=dsa) <= budget
    assert standins.weight_bytes(standin_tp=tp, layers=78, experts=e + 8, dsa=True) > budget
    # All 256 experts at one rank's width are past one H200 (the reason for the cut).
    assert standins.weight_bytes(standin_tp=tp, layers=78, experts=256, dsa=False) > H200_BYTES


@pytest.mark.parametrize("name", sorted(standins.STANDINS))
def test_weight_bytes_counts_the_model_transformers_builds(name: str) -> None:
    """The fit rule's byte count against the parameters of the same config built by
    transformers on the meta device (no memory): 3 dense + 2 MoE layers, no MTP layer
    (transformers has no MTP module); the dense stand-in's 5 layers all dense. Every
    stand-in, each counted at its own base's widths."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    kind = standins.STANDINS[name]
    experts = None if kind["dense"] else 16
    cfg = standins.config(name, standin_tp=4, layers=5, experts=experts, mtp=False)
    config_cls = transformers.AutoConfig.for_model(cfg["model_type"]).__class__
    hf = config_cls(**{k: v for k, v in cfg.items() if k != "model_type"})
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(hf)
    params = sum(p.numel() for p in model.parameters())
    ours = standins.weight_bytes(
        standin_tp=4,
        layers=5,
        experts=cfg["n_routed_experts"],
        dsa=kind["dsa"],
        mtp=False,
        dense=kind["dense"],
        base=kind["base"],
    )
    assert ours / standins.BF16_BYTES == pytest.approx(params, rel=1e-3)


def test_bad_sizes_are_refused_with_the_value() -> None:
    with pytest.raises(ValueError, match="standin_tp=65"):
        standins.config("glm5", standin_tp=65)
    with pytest.raises(ValueError, match="experts=4"):
        standins.config("glm5", standin_tp=4, experts=4)
    with pytest.raises(ValueError, match="num_heads=12"):
        standins.standin_tp_for_heads(12)
    with pytest.raises(ValueError, match="unknown stand-in"):
        standins.config("glm6", standin_tp=4)
    with pytest.raises(ValueError, match="experts=32 is for MoE stand-ins"):
        standins.config("glm5-dense", standin_tp=4, experts=32)


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("tokenizers")
    cache = tmp_path_factory.mktemp("models")
    return standins.build_standin(cache, name="glm5-dsa", standin_tp=6)


def test_build_writes_config_and_tokenizer_only(built: Path) -> None:
    names = {p.name for p in built.iterdir()}
    assert names == {
        "config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
        "orchestrator-standin.json",
    }
    assert json.loads((built / "config.json").read_text()) == standins.config(
        "glm5-dsa", standin_tp=6
    )
    # Nothing half-built beside it; a second call is a cache hit on the same directory.
    assert [p.name for p in built.parent.iterdir()] == [built.name]
    assert standins.build_standin(built.parent, name="glm5-dsa", standin_tp=6) == built


def test_tokenizer_has_glm5s_vocabulary(built: Path) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    assert tinymodel.vocab_size(built) == 154880
    tok = tokenizers.Tokenizer.from_file(str(built / "tokenizer.json"))
    assert tok.get_vocab_size() == 154880
    # Any id a random model samples has text.
    assert tok.decode([5, 154879]) == "w5 w154879"


def test_transformers_reads_the_config_vllm_will(built: Path) -> None:
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "GlmMoeDsaConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no GlmMoeDsaConfig")
    cfg = transformers.AutoConfig.from_pretrained(built)
    assert cfg.model_type == "glm_moe_dsa"
    assert (cfg.num_attention_heads, cfg.moe_intermediate_size, cfg.index_topk) == (11, 352, 2048)
    assert cfg.num_nextn_predict_layers == 1


# ------------------------------------------------------------------------- the matrix keys

MATRIX = """
name: t
models:
  - {label: g, path: builtin:glm5, num_heads: 16}
topologies:
  - {tp: 1, mtp: [0, 1], mtp_acceptance: 0.7}
workloads:
  - {name: a, prompt_tokens: 1, output_tokens: 4}
"""


def test_matrix_derives_the_tp_and_adds_what_a_stand_in_is_served_with() -> None:
    m = parse_matrix(MATRIX)
    assert m.models[0].stands_for_tp == 4
    assert m.models[0].builtin_layers == 78
    cases = expand(m)
    assert [c.mtp_acceptance for c in cases] == [None, 0.7]
    for c in cases:
        assert c.args[0] == "--load-format=dummy"
        assert c.env_dict[standins.ROUTING_ENV] == "uniform_random"
    assert cases[1].to_dict()["mtp_acceptance"] == 0.7
    assert "mtp_acceptance" not in cases[0].to_dict()


def test_matrix_env_and_args_win_over_the_stand_ins_own() -> None:
    text = MATRIX.replace(
        "num_heads: 16}",
        "num_heads: 16, weight_format: mxfp8, args: [--load-format=auto],"
        " env: {VLLM_MOE_ROUTING_SIMULATION_STRATEGY: normal_routing}}",
    )
    (case, _) = expand(parse_matrix(text))
    assert case.args == ("--load-format=dummy", "--quantization=mxfp8", "--load-format=auto")
    assert case.env_dict[standins.ROUTING_ENV] == "normal_routing"


def test_a_checkpoint_mxfp8_stand_in_has_modelopts_config_and_fusedqs_load_format(
    tmp_path: Path,
) -> None:
    """mxfp8-checkpoint: ModelOpt's MXFP8 quantization_config in config.json (vLLM then builds
    E4M3 values and uint8 scales as from a checkpoint), served with fusedq_dummy (valid
    scales) and the variable that adds it; its own cache folder, the others' unchanged."""
    cfg = standins.config("glm5-dense", standin_tp=4, weight_format="mxfp8-checkpoint")
    assert cfg["quantization_config"] == {
        "quant_method": "modelopt",
        "quantization": {
            "quant_algo": "MXFP8",
            "kv_cache_quant_algo": None,
            "exclude_modules": ["lm_head"],
        },
    }
    assert "quantization_config" not in standins.config("glm5-dense", standin_tp=4)
    names = {
        f: standins.dir_name(standins.spec("glm5-dense", standin_tp=4, weight_format=f))
        for f in standins.WEIGHT_FORMATS
    }
    assert (
        names["bf16"]
        == names["mxfp8"]
        == standins.dir_name(standins.spec("glm5-dense", standin_tp=4))
    )
    assert names["mxfp8-checkpoint"] != names["bf16"]
    text = MATRIX.replace("num_heads: 16}", "num_heads: 16, weight_format: mxfp8-checkpoint}")
    (case, _) = expand(parse_matrix(text))
    assert case.args[0] == "--load-format=fusedq_dummy"
    assert case.env_dict["FUSEDQ_STANDIN_LOADER"] == "1"
    built = standins.build_standin(
        tmp_path, name="glm5-dense", standin_tp=4, layers=2, weight_format="mxfp8-checkpoint"
    )
    on_disk = json.loads((built / "config.json").read_text())
    assert on_disk["quantization_config"]["quantization"]["quant_algo"] == "MXFP8"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ("num_heads: 16, standin_tp: 8}", "num_heads=16 does not match standin_tp=8"),
        ("num_heads: 12}", "num_heads=12 is not one rank's share"),
        ("num_heads: 16, weight_format: nf3}", "weight_format='nf3' cannot be served"),
        ("num_heads: 16, experts: 300}", "experts=300 is outside 8..256"),
    ],
)
def test_matrix_refuses_a_stand_in_that_cannot_be(change: str, message: str) -> None:
    with pytest.raises(MatrixError, match=message) as err:
        parse_matrix(MATRIX.replace("num_heads: 16}", change), "m.yaml")
    assert str(err.value).startswith("m.yaml: models[0]")


def test_stand_in_keys_on_another_model_are_refused() -> None:
    text = MATRIX.replace(
        "builtin:glm5, num_heads: 16", "builtin:tiny-glm5, num_heads: 16, standin_tp: 4"
    )
    with pytest.raises(MatrixError, match="standin_tp=4 is for stand-ins"):
        parse_matrix(text)


def test_acceptance_without_mtp_is_refused() -> None:
    with pytest.raises(MatrixError, match=r"topologies\[0\].mtp_acceptance=0.7 is for MTP cases"):
        parse_matrix(MATRIX.replace("mtp: [0, 1]", "mtp: [0]"))


def test_acceptance_on_cpu_is_refused_with_vllms_reason() -> None:
    text = MATRIX + "resources: {accelerator: cpu}\n"
    with pytest.raises(MatrixError, match="not possible on CPU: vLLM's CPU sampler refuses"):
        parse_matrix(text.replace("builtin:glm5, num_heads: 16", "builtin:tiny-mla, num_heads: 8"))


@pytest.mark.parametrize(
    ("name", "cases"),
    [
        ("h200-glm5", 12),
        ("h200-glm5-dsa", 12),
        ("h200-glm5-headline", 2),
        ("h200-glm5-dsa-front", 2),
    ],
)
def test_plan_shows_the_stand_ins_without_torch(name: str, cases: int) -> None:
    """`plan` of the committed matrices, in a fresh interpreter: what each stand-in is, and
    nothing heavy imported (plan answers in well under a second)."""
    code = (
        "import json, sys\n"
        "from orchestrator.plan.render import plan_matrix\n"
        f"p = plan_matrix('matrices/{name}.yaml')\n"
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers', 'vllm', 'ray') if m in sys.modules]\n"
        "print(json.dumps({'notes': p['notes'], 'heavy': heavy, 'cases': len(p['cases'])}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    plan = json.loads(out.stdout)
    assert plan["heavy"] == []
    assert any("one rank of GLM-5 at TP4" in n for n in plan["notes"])
    assert plan["cases"] == cases
