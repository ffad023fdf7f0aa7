"""The DeepSeek-V3, DeepSeek-V3.2 and Kimi-K2 stand-ins: each base against its published
config, one rank's cuts at the base's own head count (DeepSeek-V3.2's indexer whole on every
rank), the expert count that fits one H200, the files built, the matrix keys (heads per base,
no MTP on Kimi-K2) and what `plan` says of them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from orchestrator.config.errors import MatrixError
from orchestrator.config.load import parse_matrix
from orchestrator.models import standins, tinymodel
from orchestrator.plan.fused import fused_plan

FIXTURES = Path(__file__).parent / "fixtures"
REPO = Path(__file__).resolve().parents[2]
H200_BYTES = 139 * 2**30  # what one H200 offers, about
NEW = ("deepseek-v3", "deepseek-v32", "kimi-k2")
# The published keys that are not one flat value of the base: the router (standins.ROUTER)
# and the rope (Base.rope, written as rope_parameters).
ROPE_KEYS = ("rope_theta", "rope_scaling")


def published(base: str) -> dict[str, Any]:
    return json.loads((FIXTURES / base / "published_config.json").read_text())


def rope_as_published(rope: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    """transformers 5's rope_parameters as config.json publishes them: rope_theta beside a
    rope_scaling with `type`."""
    scaling = {k: v for k, v in rope.items() if k not in ("rope_theta", "rope_type")}
    if rope["rope_type"] == "default" and not scaling:
        return rope["rope_theta"], None  # an unscaled rope publishes rope_scaling null
    return rope["rope_theta"], {**scaling, "type": rope["rope_type"]}


# The bases whose fixture is checked key by key: GLM-4.7-Flash's as well (GLM-5's widths at 20
# heads, its own architecture; test_standin_glm47_flash.py has the rest of it).
PUBLISHED = (*NEW, "glm47-flash")


@pytest.mark.parametrize("base", PUBLISHED)
def test_base_is_the_published_config(base: str) -> None:
    fixture = published(base)
    values = fixture["config"]
    b = standins.BASES[base]
    flat = {k: v for k, v in values.items() if k not in ROPE_KEYS and k not in standins.ROUTER}
    assert set(flat) <= set(b.config)
    assert {k: b.config[k] for k in flat} == flat
    # The router keys a config publishes are the stand-ins' (GLM-4.7-Flash's has no
    # scoring_func or moe_layer_freq: vLLM hard-codes sigmoid and defaults the frequency to 1).
    router = {k: values[k] for k in standins.ROUTER if k in values}
    assert router == {k: standins.ROUTER[k] for k in router}
    assert rope_as_published(b.rope) == (values["rope_theta"], values["rope_scaling"])
    # The MLA widths are fusedq's geometry row for DeepSeek-V3 (V3.2 and Kimi-K2 share them) or
    # GLM-5 (GLM-4.7-Flash's).
    g = b.geometry
    assert (g.qk_nope, g.qk_rope, g.kv_lora, g.v_head) == (
        values["qk_nope_head_dim"],
        values["qk_rope_head_dim"],
        values["kv_lora_rank"],
        values["v_head_dim"],
    )
    # Every value the fixture holds is stated by a source, with its address.
    sourced = {k for s in fixture["sources"] for k in s["keys"]}
    assert set(values) <= sourced
    assert all(s["address"].startswith("https://") for s in fixture["sources"])


@pytest.mark.parametrize(
    ("base", "config_class"),
    [("deepseek-v3", "DeepseekV3Config"), ("deepseek-v32", "DeepseekV32Config")],
)
def test_transformers_defaults_are_the_published_values(base: str, config_class: str) -> None:
    """transformers' DeepseekV3Config and DeepseekV32Config defaults are the published widths
    (V3.2's written from deepseek-ai/DeepSeek-V3.2-Exp): where installed, they must still be
    the fixture's (a changed default is news to read)."""
    transformers = pytest.importorskip("transformers")
    if not hasattr(transformers, config_class):
        pytest.skip(f"transformers {transformers.__version__} has no {config_class}")
    fixture = published(base)
    keys = next(s["keys"] for s in fixture["sources"] if "transformers" in s["address"])
    defaults = getattr(transformers, config_class)()
    assert {k: getattr(defaults, k) for k in keys} == {k: fixture["config"][k] for k in keys}


@pytest.mark.parametrize("base", PUBLISHED)
def test_one_rank_of_tp1_with_every_expert_is_the_published_model(base: str) -> None:
    fixture = published(base)
    routed = fixture["config"]["n_routed_experts"]
    cfg = standins.config(base, standin_tp=1, experts=routed)
    values = fixture["config"]
    assert {k: cfg[k] for k in values if k not in ROPE_KEYS} == {
        k: v for k, v in values.items() if k not in ROPE_KEYS
    }
    assert rope_as_published(cfg["rope_parameters"]) == (
        values["rope_theta"],
        values["rope_scaling"],
    )
    assert cfg["architectures"] == fixture["architectures"]
    # Kimi-K2's own type (kimi_k2) is no transformers type: the stand-in says deepseek_v3.
    own = {"kimi_k2": "deepseek_v3"}.get(fixture["model_type"], fixture["model_type"])
    assert cfg["model_type"] == own


@pytest.mark.parametrize(
    ("base", "tp", "heads", "dense", "expert", "experts", "mtp"),
    [
        # GLM-4.7-Flash: all 64 experts fit at every TP; 20 heads are 10 / 5 at TP2 / TP4.
        ("glm47-flash", 1, 20, 10240, 1536, 64, 1),
        ("glm47-flash", 2, 10, 5120, 768, 64, 1),
        ("glm47-flash", 4, 5, 2560, 384, 64, 1),
        ("deepseek-v3", 8, 16, 2304, 256, 136, 1),
        ("deepseek-v3", 4, 32, 4608, 512, 64, 1),
        ("deepseek-v3", 6, 22, 3072, 352, 96, 1),
        # The indexer (~1.5 GiB at 61 + 1 layers, whole on every rank) costs a step of 8.
        ("deepseek-v32", 8, 16, 2304, 256, 128, 1),
        ("deepseek-v32", 4, 32, 4608, 512, 64, 1),
        ("kimi-k2", 8, 8, 2304, 256, 136, 0),
        ("kimi-k2", 4, 16, 4608, 512, 64, 0),
    ],
)
def test_one_ranks_share_of_the_base(
    base: str, tp: int, heads: int, dense: int, expert: int, experts: int, mtp: int
) -> None:
    cfg = standins.config(base, standin_tp=tp)
    assert cfg["num_attention_heads"] == cfg["num_key_value_heads"] == heads
    assert (cfg["intermediate_size"], cfg["moe_intermediate_size"]) == (dense, expert)
    assert cfg["n_routed_experts"] == experts
    assert cfg["num_nextn_predict_layers"] == mtp
    b = standins.BASES[base]
    for key in (
        "hidden_size",
        "q_lora_rank",
        "kv_lora_rank",
        "vocab_size",
        "first_k_dense_replace",
    ):
        assert cfg[key] == b.config[key], key
    # vLLM builds the indexer replicated (ReplicatedLinear wq_b, wk_weights_proj with
    # disable_tp, deepseek_v2.py:666-683): a rank holds all of it, so nothing of it is cut.
    assert {k: cfg[k] for k in standins.DSA_KEYS if k in cfg} == {
        k: b.config[k] for k in standins.DSA_KEYS if b.has_dsa
    }
    assert standins.standin_tp_for_heads(heads, base) == tp
    assert standins.heads_per_rank(tp, base) == heads


@pytest.mark.parametrize("base", NEW)
@pytest.mark.parametrize("tp", [8, 4])
def test_experts_are_the_most_that_fit_the_budget(base: str, tp: int) -> None:
    b = standins.BASES[base]
    budget = standins.WEIGHT_BUDGET_GIB * 2**30
    mtp = b.mtp_layers > 0
    e = standins.experts_that_fit(tp, 61, base)

    def size(experts: int) -> int:
        return standins.weight_bytes(
            standin_tp=tp, layers=61, experts=experts, dsa=b.has_dsa, mtp=mtp, base=base
        )

    assert 8 <= e < b.config["n_routed_experts"] and e % 8 == 0
    assert size(e) <= budget < size(e + 8)
    # All the base's experts at one rank's width are past one H200 (the reason for the cut).
    assert size(b.config["n_routed_experts"]) > H200_BYTES


def test_kimi_k2_has_no_mtp_layer_to_keep() -> None:
    assert standins.config("kimi-k2", standin_tp=8, mtp=True)["num_nextn_predict_layers"] == 0
    assert standins.config("deepseek-v3", standin_tp=8, mtp=False)["num_nextn_predict_layers"] == 0
    assert "8 heads, 61 layers, dense MLP" in standins.describe("kimi-k2", standin_tp=8)
    assert "16 heads, 61 layers + 1 MTP, " in standins.describe("deepseek-v3", standin_tp=8)


def test_deepseek_v32_is_what_vllm_builds_a_dsa_model_from() -> None:
    """The V3.2 stand-in's config as vLLM 0.26 reads it: DeepseekV32ForCausalLM (registry.py:93,
    deepseek_v2's DeepseekV3ForCausalLM), model_type deepseek_v32 loaded with transformers'
    DeepseekV3Config (transformers_utils/config.py:88), which must keep index_topk for
    `hasattr(config, "index_topk")` to take the sparse path; per-rank heads, the whole
    indexer, and its rope left NeoX-style as published (no indexer_rope_interleave)."""
    cfg = standins.config("deepseek-v32", standin_tp=8)
    assert (cfg["architectures"], cfg["model_type"]) == (["DeepseekV32ForCausalLM"], "deepseek_v32")
    assert cfg["num_attention_heads"] == cfg["num_key_value_heads"] == 16
    assert {k: cfg[k] for k in standins.DSA_KEYS} == {
        "index_topk": 2048,
        "index_n_heads": 64,
        "index_head_dim": 128,
    }
    assert "indexer_rope_interleave" not in cfg
    assert standins.config("glm5-dsa", standin_tp=8)["indexer_rope_interleave"] is True
    # The dense DeepSeek-V3 stand-in keeps no indexer and its own expert count.
    assert not set(standins.DSA_KEYS) & set(standins.config("deepseek-v3", standin_tp=8))
    transformers = pytest.importorskip("transformers")
    read = transformers.DeepseekV3Config.from_dict(cfg)
    assert (read.index_topk, read.index_n_heads, read.num_attention_heads) == (2048, 64, 16)


def test_bad_sizes_are_refused_against_the_base() -> None:
    with pytest.raises(ValueError, match=r"standin_tp=129 is outside 1..128 \(DeepSeek-V3's"):
        standins.config("deepseek-v3", standin_tp=129)
    with pytest.raises(ValueError, match=r"experts=392 is outside 8..384 \(top-8 of Kimi-K2's"):
        standins.config("kimi-k2", standin_tp=8, experts=392)
    with pytest.raises(ValueError, match="num_heads=14 is not one rank's share of DeepSeek-V3's"):
        standins.standin_tp_for_heads(14, "deepseek-v3")


@pytest.mark.parametrize(("name", "tp", "vocab", "context"), [("kimi-k2", 8, 163840, 131072)])
def test_build_writes_the_bases_vocabulary_and_context(
    tmp_path: Path, name: str, tp: int, vocab: int, context: int
) -> None:
    tokenizers = pytest.importorskip("tokenizers")
    built = standins.build_standin(tmp_path, name=name, standin_tp=tp)
    assert json.loads((built / "config.json").read_text()) == standins.config(name, standin_tp=tp)
    assert tinymodel.vocab_size(built) == vocab
    tok = tokenizers.Tokenizer.from_file(str(built / "tokenizer.json"))
    assert tok.decode([5, vocab - 1]) == f"w5 w{vocab - 1}"
    tok_config = json.loads((built / "tokenizer_config.json").read_text())
    assert tok_config["model_max_length"] == context
    assert built.name.startswith(f"{name}-tp{tp}-l61-e136-")  # no -mtp1: Kimi-K2 has none
    transformers = pytest.importorskip("transformers")
    cfg = transformers.AutoConfig.from_pretrained(built)
    assert (cfg.model_type, cfg.num_attention_heads, cfg.n_routed_experts) == (
        "deepseek_v3",
        8,
        136,
    )
    assert cfg.rope_parameters["rope_type"] == "yarn" and cfg.rope_parameters["factor"] == 32.0


# ------------------------------------------------------------------------- the matrix keys

MATRIX = """
name: t
models:
  - {label: d, path: builtin:deepseek-v3, num_heads: 16}
topologies:
  - {tp: 1, mtp: [0]}
workloads:
  - {name: a, prompt_tokens: 1, output_tokens: 4}
"""


@pytest.mark.parametrize(
    ("path", "heads", "tp", "context"),
    [
        ("deepseek-v3", 16, 8, 163840),
        ("deepseek-v3", 32, 4, 163840),
        ("deepseek-v32", 16, 8, 163840),
        ("kimi-k2", 8, 8, 131072),
        ("kimi-k2", 16, 4, 131072),
    ],
)
def test_matrix_derives_the_tp_from_the_bases_heads(
    path: str, heads: int, tp: int, context: int
) -> None:
    m = parse_matrix(MATRIX.replace("deepseek-v3, num_heads: 16", f"{path}, num_heads: {heads}"))
    model = m.models[0]
    assert (model.stands_for_tp, model.builtin_layers, model.context_tokens) == (tp, 61, context)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            "num_heads: 16, standin_tp: 4}",
            "num_heads=16 does not match standin_tp=4: one rank of DeepSeek-V3 at TP4 holds 32 "
            "of its 128 heads",
        ),
        ("num_heads: 14}", "num_heads=14 is not one rank's share of DeepSeek-V3's 128 heads"),
        ("num_heads: 16, experts: 264}", "experts=264 is outside 8..256"),
    ],
)
def test_matrix_refuses_a_deepseek_stand_in_that_cannot_be(change: str, message: str) -> None:
    with pytest.raises(MatrixError, match=message) as err:
        parse_matrix(MATRIX.replace("num_heads: 16}", change), "m.yaml")
    assert str(err.value).startswith("m.yaml: models[0]")


def test_mtp_on_kimi_k2_is_refused_at_plan_time() -> None:
    kimi = MATRIX.replace("deepseek-v3, num_heads: 16", "kimi-k2, num_heads: 8")
    with pytest.raises(MatrixError, match="Kimi-K2 publishes no MTP layer") as err:
        parse_matrix(kimi.replace("mtp: [0]", "mtp: [0, 1], mtp_acceptance: 0.7"), "m.yaml")
    assert str(err.value).startswith("m.yaml: topologies[0].mtp: MTP > 0 but models[0] (d)")
    with pytest.raises(MatrixError, match="has_mtp=True, but builtin:kimi-k2 has no MTP layer"):
        parse_matrix(kimi.replace("num_heads: 8}", "num_heads: 8, has_mtp: true}"))
    # DeepSeek-V3 has its MTP layer.
    ds = parse_matrix(MATRIX.replace("mtp: [0]", "mtp: [0, 1], mtp_acceptance: 0.7"))
    assert ds.models[0].no_mtp is None


def test_plan_reads_the_served_geometries(monkeypatch: pytest.MonkeyPatch) -> None:
    from fusedq import contract
    from orchestrator.config.expand import expand

    (case,) = expand(parse_matrix(MATRIX))
    # DeepSeek-V3's widths are a served geometry: its TP8 rank's 16 heads qualify.
    assert fused_plan(case, "gpu", environ={"FUSEDQ_MLA_QUERY": "1"}).why == "qualified"
    # A build that serves GLM-5's widths only: the fused variant cannot start.
    monkeypatch.setattr(contract, "GEOMETRIES", (contract.GLM5,))
    plan = fused_plan(case, "gpu", environ={"FUSEDQ_MLA_QUERY": "1"})
    assert not plan.runs
    assert plan.why == (
        "fails: FUSEDQ_MLA_QUERY=1 and deepseek-v3 widths (qk_nope 128) not served by the "
        "fused op yet"
    )
    glm = parse_matrix(MATRIX.replace("deepseek-v3", "glm5"))
    assert fused_plan(expand(glm)[0], "gpu", environ={}).why == "qualified"


@pytest.mark.parametrize(
    ("heads", "why"),
    [
        (32, "qualified"),  # TP4: in DeepSeek-V3's qualified heads, not GLM-5's
        (64, "qualified"),
        (128, "staged: 128 heads per rank (qualified: 8, 16, 32, 64)"),
    ],
)
def test_plan_reads_the_stand_ins_own_qualified_heads(heads: int, why: str) -> None:
    from orchestrator.config.expand import expand

    m = parse_matrix(MATRIX.replace("num_heads: 16", f"num_heads: {heads}"))
    (case,) = expand(m)
    assert fused_plan(case, "gpu", environ={}).why == why
    # The results row says the same (it said GLM-5's heads for every model before).
    assert case.to_dict()["fusedq_qualified_heads"] is (why == "qualified")


def test_plan_of_a_checkpoint_names_every_geometrys_heads(tmp_path) -> None:
    """A checkpoint's widths are read on the worker: any served geometry's count may hold."""
    from orchestrator.config.expand import expand

    (tmp_path / "config.json").write_text("{}")
    m = parse_matrix(
        MATRIX.replace("builtin:deepseek-v3, num_heads: 16", f"{tmp_path}, num_heads: 12")
    )
    (case,) = expand(m)
    assert fused_plan(case, "gpu", environ={}).why == (
        "staged: 12 heads per rank (qualified: glm5 8, 11, 16; deepseek-v3 8, 16, 32, 64)"
    )


@pytest.mark.parametrize(
    ("name", "title", "what"),
    [
        ("h200-deepseek-v3-paired", "DeepSeek-V3", "MLA 128/64/128"),
        ("h200-deepseek-v32-paired", "DeepSeek-V3.2", "FLASH_ATTN_MLA_SPARSE on sm_90"),
    ],
)
def test_plan_of_the_deepseek_matrices_without_torch(name: str, title: str, what: str) -> None:
    """`plan` of the committed DeepSeek matrices, in a fresh interpreter: what the stand-in
    is, its 16 heads qualified for the fused variant, a batch past 32, and nothing heavy
    imported."""
    code = (
        "import json, sys\n"
        "from orchestrator.plan.render import plan_matrix\n"
        f"p = plan_matrix('matrices/{name}.yaml')\n"
        "heavy = [m for m in ('torch', 'transformers', 'tokenizers', 'vllm', 'ray') if m in sys.modules]\n"
        "print(json.dumps({'notes': p['notes'], 'heavy': heavy, 'cases': len(p['cases']),\n"
        "  'fusedq': [c['fusedq'] for c in p['cases']], 'workloads': p['workloads']}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True
    )
    plan = json.loads(out.stdout)
    assert plan["heavy"] == []
    assert any(
        f"one rank of {title} at TP8" in n and "16 heads" in n and what in n for n in plan["notes"]
    )
    assert plan["cases"] == 2
    assert plan["fusedq"] == ["staged: FUSEDQ_MLA_QUERY=0", "qualified"]
    assert max(w["concurrency"] for w in plan["workloads"]) > 32
