"""The GLM-4.7-Flash stand-in: transformers' defaults against the published values, every
expert fitting, the files vLLM 0.26 reads, the matrix keys at 20 heads and what `plan` says
of head counts fusedq has not qualified at GLM-5's widths."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix
from orchestrator.models import standins, tinymodel
from orchestrator.plan.fused import fused_plan

FIXTURE = Path(__file__).parent / "fixtures" / "glm47-flash" / "published_config.json"
REPO = Path(__file__).resolve().parents[2]
PUBLISHED = json.loads(FIXTURE.read_text())
NAME = "glm47-flash"


def test_transformers_defaults_are_the_published_values() -> None:
    """transformers' Glm4MoeLiteConfig defaults are GLM-4.7-Flash's widths: where installed,
    they must still be the fixture's (a changed default is news to read)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Glm4MoeLiteConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Glm4MoeLiteConfig")
    keys = next(s["keys"] for s in PUBLISHED["sources"] if "transformers" in s["address"])
    defaults = transformers.Glm4MoeLiteConfig()
    assert {k: getattr(defaults, k) for k in keys} == {k: PUBLISHED["config"][k] for k in keys}
    # Its one dense layer, said its own way (first_k_dense_replace 1 in the checkpoint).
    assert defaults.mlp_layer_types == ["dense"] + ["sparse"] * 46


def test_the_geometry_is_glm5s_and_every_expert_fits() -> None:
    base = standins.BASES[NAME]
    assert base.geometry is standins.BASES["glm5"].geometry
    for tp in (1, 2, 4):
        assert standins.experts_that_fit(tp, 47, NAME) == 64
    size = standins.weight_bytes(standin_tp=2, layers=47, experts=64, dsa=False, base=NAME)
    assert 29 * 2**30 < size < 31 * 2**30  # one H100 holds it with room for its KV cache


def test_the_config_is_what_vllm_builds_glm4_moe_lite_from() -> None:
    cfg = standins.config(NAME, standin_tp=2)
    assert (cfg["architectures"], cfg["model_type"]) == (
        ["Glm4MoeLiteForCausalLM"],
        "glm4_moe_lite",
    )
    # glm4_moe_lite.py reads first_k_dense_replace as an attribute (no default) and builds MLA
    # from these; no DSA key, or it would take the sparse path (is_v32).
    assert cfg["first_k_dense_replace"] == 1 and cfg["num_nextn_predict_layers"] == 1
    assert (cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]) == (192, 64, 256)
    assert (cfg["kv_lora_rank"], cfg["q_lora_rank"]) == (512, 768)
    assert not set(standins.DSA_KEYS) & set(cfg)
    assert cfg["rope_parameters"] == {"rope_theta": 1000000.0, "rope_type": "default"}
    assert "10 heads, 47 layers + 1 MTP, " in standins.describe(NAME, standin_tp=2)
    assert "top-4 + 1 shared" in standins.describe(NAME, standin_tp=2)


def test_build_is_read_by_transformers_as_glm4_moe_lite(tmp_path: Path) -> None:
    pytest.importorskip("tokenizers")
    built = standins.build_standin(tmp_path, name=NAME, standin_tp=4)
    assert built.name.startswith(f"{NAME}-tp4-l47-e64-mtp1-")
    assert tinymodel.vocab_size(built) == 154880
    tok_config = json.loads((built / "tokenizer_config.json").read_text())
    assert tok_config["model_max_length"] == 202752
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, "Glm4MoeLiteConfig"):
        pytest.skip(f"transformers {transformers.__version__} has no Glm4MoeLiteConfig")
    cfg = transformers.AutoConfig.from_pretrained(built)
    assert type(cfg).__name__ == "Glm4MoeLiteConfig"
    assert (cfg.num_attention_heads, cfg.moe_intermediate_size, cfg.n_routed_experts) == (
        5,
        384,
        64,
    )
    # The keys vLLM reads beside transformers' own survive the strict config class.
    assert (cfg.first_k_dense_replace, cfg.num_nextn_predict_layers) == (1, 1)
    assert cfg.rope_parameters["rope_theta"] == 1000000.0


MATRIX = """
name: t
models:
  - {label: g, path: builtin:glm47-flash, num_heads: 10}
topologies:
  - {tp: 1, mtp: [0]}
workloads:
  - {name: a, prompt_tokens: 1, output_tokens: 4}
"""


@pytest.mark.parametrize(("heads", "tp"), [(20, 1), (10, 2), (5, 4)])
def test_matrix_derives_the_tp_from_20_heads(heads: int, tp: int) -> None:
    m = parse_matrix(MATRIX.replace("num_heads: 10", f"num_heads: {heads}"))
    model = m.models[0]
    assert (model.stands_for_tp, model.builtin_layers, model.context_tokens) == (tp, 47, 202752)


@pytest.mark.parametrize("heads", [20, 10, 5])
def test_plan_keeps_unqualified_heads_staged_with_the_reason(heads: int) -> None:
    (case,) = expand(parse_matrix(MATRIX.replace("num_heads: 10", f"num_heads: {heads}")))
    plan = fused_plan(case, "gpu", environ={})
    assert not plan.runs
    assert plan.why == f"staged: {heads} heads per rank (qualified: 8, 11, 16)"
    required = fused_plan(case, "gpu", environ={"FUSEDQ_MLA_QUERY": "1"})
    assert required.why == (
        f"fails: FUSEDQ_MLA_QUERY=1 and {heads} heads per rank (qualified: 8, 11, 16)"
    )
    assert case.to_dict()["fusedq_qualified_heads"] is False
