"""Matrix parsing, expansion and every validation rule (pure logic, no servers)."""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from orchestrator.config.errors import MatrixError
from orchestrator.config.expand import expand, units_needed
from orchestrator.config.load import load_matrix, parse_matrix

REPO = Path(__file__).resolve().parents[2]

BASE = {
    "name": "t",
    "models": [{"label": "m", "path": "/ckpt", "num_heads": 64}],
    "topologies": [{"tp": 8, "dcp": "divisors", "mtp": [0]}, {"tp": 8, "dcp": [4], "mtp": [3]}],
    "workloads": [
        {"name": "ctx0", "prompt_tokens": 1, "output_tokens": 16},
        {
            "name": "ctx64k",
            "prompt_tokens": 65536,
            "output_tokens": 16,
            "duration_s": 60,
            "repeats": 2,
        },
    ],
}


def _parse(doc: dict | str, **kw) -> object:
    text = doc if isinstance(doc, str) else yaml.safe_dump(doc)
    return parse_matrix(text, "m.yaml", env=kw.pop("env", {}), **kw)


def _with(path: str, value: object) -> dict:
    """BASE with one field replaced (path like 'topologies.0.dcp')."""
    doc = yaml.safe_load(yaml.safe_dump(BASE))
    node = doc
    keys = path.split(".")
    for k in keys[:-1]:
        node = node[int(k)] if k.isdigit() else node[k]
    last = keys[-1]
    if value is _DELETE:
        del node[int(last) if last.isdigit() else last]
    else:
        node[int(last) if last.isdigit() else last] = value
    return doc


_DELETE = object()


def test_expansion_matches_the_seed_rows_for_tp8():
    m = _parse(BASE)
    ids = [c.topology_id for c in expand(m)]
    assert ids == [
        "m/tp8-dcp1-mtp0",
        "m/tp8-dcp2-mtp0",
        "m/tp8-dcp4-mtp0",
        "m/tp8-dcp8-mtp0",
        "m/tp8-dcp4-mtp3",
    ]
    assert units_needed(m) == 8
    assert all(c.heads_per_rank == 8 for c in expand(m))


def test_variants_of_one_topology_are_adjacent_for_pairing():
    doc = _with(
        "variants", [{"name": "staged", "env": {"FUSEDQ_MLA_QUERY": "0"}}, {"name": "fused"}]
    )
    cases = expand(_parse(doc))
    assert [c.variant.name for c in cases[:4]] == ["staged", "fused", "staged", "fused"]
    assert cases[0].topology_id == cases[1].topology_id
    assert dict(cases[0].env)["FUSEDQ_MLA_QUERY"] == "0"


def test_env_and_args_merge_from_every_level():
    doc = _with("engine", {"args": ["--a"], "env": {"X": "engine", "Y": "engine"}})
    doc["topologies"][0]["env"] = {"Y": "topo"}
    doc["topologies"][0]["args"] = ["--b"]
    c = expand(_parse(doc))[0]
    assert c.env_dict == {"X": "engine", "Y": "topo"}
    assert c.args == ("--a", "--b")


def test_tp6_with_padding_declared_has_eleven_heads_per_rank():
    doc = _with("topologies", [{"tp": 6, "dcp": "divisors"}])
    doc["engine"] = {"pads_heads": True}
    cases = expand(_parse(doc))
    assert [c.dcp for c in cases] == [1, 2, 3, 6]
    assert {c.heads_per_rank for c in cases} == {11}


def test_env_interpolation_and_defaults():
    doc = _with("models.0.path", "${CKPT}/glm")
    assert _parse(doc, env={"CKPT": "/data"}).models[0].path == "/data/glm"
    doc = _with("models.0.path", "${CKPT:-/fallback}")
    assert _parse(doc).models[0].path == "/fallback"


def test_unresolved_env_is_reported_not_fatal_for_plan():
    unresolved: list[str] = []
    m = _parse(_with("models.0.path", "${NOPE}"), unresolved=unresolved)
    assert m.models[0].path == "${NOPE}"
    assert unresolved == ["models[0].path: ${NOPE} is not set"]


def test_set_overrides_before_validation():
    sets = ["models[0].path=/other", "topologies.0.mtp=[0, 1]", "host=0.0.0.0"]
    m = _parse(BASE, sets=[*sets, "bind_all_interfaces=true"])
    assert m.models[0].path == "/other"
    assert m.topologies[0].mtp == [0, 1]
    assert m.host == "0.0.0.0"


def test_workload_request_count_defaults_to_concurrency():
    m = _parse(_with("workloads.0.concurrency", 4))
    assert m.workloads[0].request_count == 4
    assert m.workloads[1].request_count is None  # duration mode


_SAME_TOKENS = {"name": "t", "prompt_tokens": 4, "output_tokens": 8, "same_tokens": True}

# At least 20 malformed matrices: each must name the file, the field and (where there is one)
# the value, in one line.
MALFORMED = [
    ("bad yaml", "name: [unclosed\n", "invalid YAML at line"),
    ("not a mapping", "- a\n- b\n", "a matrix is a YAML mapping"),
    ("unknown top key", _with("colour", "blue"), "colour: unknown key"),
    ("unknown nested key", _with("topologies.0.dpc", [1]), "topologies[0].dpc: unknown key"),
    ("missing models", _with("models", _DELETE), "models: is required"),
    ("empty models", _with("models", []), "models: list should have at least 1 item"),
    ("tp string", _with("topologies.0.tp", "eight"), "topologies[0].tp='eight'"),
    ("tp zero", _with("topologies.0.tp", 0), "topologies[0].tp=0"),
    (
        "dcp not dividing",
        _with("topologies.1.dcp", [3]),
        "topologies[1].dcp=3 does not divide tp=8",
    ),
    ("dcp zero", _with("topologies.1.dcp", [0]), "topologies[1].dcp=0 must be >= 1"),
    ("dcp bad word", _with("topologies.0.dcp", "all"), "topologies[0].dcp='all'"),
    (
        "heads not dividing",
        _with("topologies.0.tp", 6),
        "topologies[0].tp=6 does not divide models[0].num_heads=64",
    ),
    (
        "tp over heads",
        _with("models.0.num_heads", 4),
        "topologies[0].tp=8 does not divide models[0].num_heads=4",
    ),
    ("mtp negative", _with("topologies.0.mtp", [-1]), "topologies[0].mtp=-1 must be within 0..8"),
    ("mtp huge", _with("topologies.0.mtp", [99]), "topologies[0].mtp=99 must be within 0..8"),
    ("mtp empty", _with("topologies.0.mtp", []), "topologies[0].mtp: is empty"),
    ("prompt zero", _with("workloads.0.prompt_tokens", 0), "workloads[0].prompt_tokens=0"),
    ("output negative", _with("workloads.0.output_tokens", -5), "workloads[0].output_tokens=-5"),
    ("both modes", _with("workloads.0.duration_s", 5) | {}, None),  # filled below
    ("dup workload", _with("workloads.1.name", "ctx0"), "workloads: duplicate name 'ctx0'"),
    ("bad env name", _with("engine", {"env": {"BAD-NAME": "1"}}), "engine.env"),
    ("owned flag", _with("engine", {"args": ["--port=9000"]}), "is set by the orchestrator"),
    (
        "unknown builtin",
        _with("models.0.path", "builtin:huge"),
        "unknown built-in model 'builtin:huge'",
    ),
    (
        "missing env var",
        _with("models.0.path", "${GLM_PATH}"),
        "models[0].path: environment variable ${GLM_PATH} is not set",
    ),
    (
        "cpu dcp",
        _with("resources", {"accelerator": "cpu"}),
        "topologies[0].dcp=2 is not possible on CPU",
    ),
    (
        "gpus per node",
        _with("resources", {"gpus_per_node": 4}),
        "topologies[0].tp=8 needs 8 GPUs on one node",
    ),
    ("accelerator enum", _with("resources", {"accelerator": "tpu"}), "resources.accelerator='tpu'"),
    (
        "mtp without layers",
        _with("models.0.has_mtp", False),
        "MTP > 0 but models[0] (m) has_mtp: false",
    ),
    (
        "duplicate case",
        _with("topologies.1", {"tp": 8, "dcp": [1]}),
        "case 'm/tp8-dcp1-mtp0/default' appears twice",
    ),
    (
        "two baselines",
        _with("variants", [{"name": "a", "baseline": True}, {"name": "b", "baseline": True}]),
        "variants: more than one baseline: 'a', 'b'",
    ),
    (
        "same tokens, baseline last",
        _with("variants", [{"name": "fused"}, {"name": "staged", "baseline": True}])
        | {"workloads": [_SAME_TOKENS]},
        "workload 't' compares tokens against the baseline 'staged', which must run first",
    ),
]


def _renamed(path: str, new_key: str) -> dict:
    """BASE with the key at `path` (like 'workloads.0.output_tokens') spelt `new_key`."""
    *parents, old_key = path.split(".")
    doc = _with(path, _DELETE)
    node = yaml.safe_load(yaml.safe_dump(BASE))
    for k in parents:
        node = node[int(k)] if k.isdigit() else node[k]
    target = doc
    for k in parents:
        target = target[int(k)] if k.isdigit() else target[k]
    target[new_key] = node[old_key]
    return doc


# Misspelt keys are named as written, with the key they were likely meant to be; an empty
# file says so. `MISSPELT` checks the whole message: one error, not the missing key as well.
MISSPELT = [
    (
        "misspelt required key",
        _renamed("workloads.0.output_tokens", "output_tokne"),
        "m.yaml: workloads[0].output_tokne: unknown key; did you mean output_tokens?",
    ),
    (
        "misspelt top key",
        _renamed("topologies", "topologys"),
        "m.yaml: topologys: unknown key; did you mean topologies?",
    ),
    (
        "misspelt optional key",
        _with("workloads.0.concurency", 2),
        "m.yaml: workloads[0].concurency: unknown key; did you mean concurrency?",
    ),
    (
        "misspelt key of a list item's list",
        _with("variants", [{"name": "v", "expect": [{"patern": "x"}]}]),
        "m.yaml: variants[0].expect[0].patern: unknown key; did you mean pattern?",
    ),
    (
        "two misspelt required keys",  # the first is named, as one error
        (lambda d: (d["models"][0].update(num_head=d["models"][0].pop("num_heads")), d)[1])(
            _renamed("models.0.label", "lable")
        ),
        "m.yaml: models[0].lable: unknown key; did you mean label?",
    ),
    (
        "misspelling of a key that is given too",
        _with("topologies.0.dpc", [1]),  # dcp is there: no suggestion
        "m.yaml: topologies[0].dpc: unknown key",
    ),
    (
        "empty file",
        "",
        "m.yaml: the file is empty; a matrix is a YAML mapping (see matrices/)",
    ),
    (
        "comments only",
        "# name: t\n\n",
        "m.yaml: the file is empty (only comments); a matrix is a YAML mapping (see matrices/)",
    ),
    (
        "null document",
        "---\n~\n",
        "m.yaml: the file is empty (its YAML is null: '---'); a matrix is a YAML mapping "
        "(see matrices/)",
    ),
]
MALFORMED += MISSPELT
MALFORMED[18] = (
    "both modes",
    (lambda d: (d["workloads"][0].update(requests=2, duration_s=5), d)[1])(_with("name", "t")),
    "set either requests or duration_s, not both",
)


@pytest.mark.parametrize(("label", "doc", "expected"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_matrix_names_file_field_and_value(label, doc, expected):
    with pytest.raises(MatrixError) as exc:
        _parse(doc)
    msg = str(exc.value)
    assert msg.startswith("m.yaml: ")
    assert "\n" not in msg
    assert expected in msg, msg


@pytest.mark.parametrize(("label", "doc", "expected"), MISSPELT, ids=[m[0] for m in MISSPELT])
def test_misspelt_key_and_empty_file_give_one_exact_error(label, doc, expected):
    with pytest.raises(MatrixError) as exc:
        _parse(doc)
    assert str(exc.value) == expected


def test_missing_file_is_named():
    with pytest.raises(MatrixError, match=r"nope\.yaml: no such file"):
        load_matrix("nope.yaml")


def test_bad_set_assignment():
    with pytest.raises(MatrixError, match="--set"):
        _parse(BASE, sets=["models[5].path=/x"])
    with pytest.raises(MatrixError, match="is not key=value"):
        _parse(BASE, sets=["models"])


@pytest.mark.parametrize("name", ["smoke", "tp4", "tp6", "tp8"])
def test_shipped_matrices_validate(name):
    env = {"GLM5_BF16_PATH": "/ckpt/bf16", "GLM5_MXFP8_PATH": "/ckpt/mxfp8"}
    m = load_matrix(REPO / "matrices" / f"{name}.yaml", env=env)
    assert expand(m)


def test_shipped_matrices_hold_the_seed_rows():
    env = {"GLM5_BF16_PATH": "/b", "GLM5_MXFP8_PATH": "/m"}
    rows = set()
    for name in ("tp4", "tp6", "tp8"):
        for c in expand(load_matrix(REPO / "matrices" / f"{name}.yaml", env=env)):
            rows.add((c.tp, c.dcp, c.mtp))
    assert rows == {
        (4, 1, 0), (4, 2, 0), (4, 4, 0), (4, 4, 3),
        (6, 1, 0), (6, 2, 0), (6, 3, 0), (6, 6, 0), (6, 3, 3),
        (8, 1, 0), (8, 2, 0), (8, 4, 0), (8, 8, 0), (8, 4, 3),
    }  # fmt: skip


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "orchestrator.cli", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=60,
    )


def test_plan_cli_is_fast_and_names_cases():
    t0 = time.monotonic()
    out = _cli("plan", "matrices/tp8.yaml")
    elapsed = time.monotonic() - t0
    assert out.returncode == 0, out.stderr
    assert "Luke BF16/tp8-dcp4-mtp3/fused" in out.stdout
    assert "GLM5_BF16_PATH" in out.stdout  # unresolved path is shown, not fatal
    # Not a timed assertion of speed: a guard that plan never imports torch/ray/vllm.
    assert elapsed < 30


def test_plan_does_not_import_heavy_modules():
    code = (
        "import sys; from orchestrator.plan.render import plan_matrix;"
        "plan_matrix('matrices/smoke.yaml');"
        "bad = [m for m in ('torch', 'ray', 'vllm', 'transformers') if m in sys.modules];"
        "print(bad); sys.exit(1 if bad else 0)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stdout + out.stderr


def test_plan_cli_bad_matrix_exits_2_with_one_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_with("topologies.1.dcp", [3])))
    out = _cli("plan", str(bad))
    assert out.returncode == 2
    assert out.stderr.strip().splitlines() == [
        f"orchestrator: {bad}: topologies[1].dcp=3 does not divide tp=8"
    ]


def test_a_stopping_rule_without_its_cap_exits_2_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(_ab({"mode": "switch", "target_half_width_pct": 0.25})))
    out = _cli("plan", str(bad))
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.strip().splitlines() == [
        f"orchestrator: {bad}: ab.target_half_width_pct=0.25 needs ab.max_blocks: the most "
        "rounds the stopping rule may run (the looks it pays for in the interval are counted "
        "up to it)"
    ]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("", "the file is empty; a matrix is a YAML mapping (see matrices/)"),
        (
            yaml.safe_dump(_renamed("workloads.0.output_tokens", "output_tokne")),
            "workloads[0].output_tokne: unknown key; did you mean output_tokens?",
        ),
    ],
    ids=["empty", "misspelt"],
)
def test_plan_and_run_cli_name_misspelt_key_and_empty_file(tmp_path, text, expected):
    bad = tmp_path / "bad.yaml"
    bad.write_text(text)
    logs = tmp_path / "logs"
    for argv in (["plan", str(bad)], ["run", str(bad), "--logs-dir", str(logs)]):
        out = _cli(*argv)
        assert out.returncode == 2 and out.stdout == "", argv
        assert out.stderr.strip().splitlines() == [f"orchestrator: {bad}: {expected}"], argv
    assert not logs.exists()  # run launched nothing, created no run directory


def test_plan_json(tmp_path):
    import json

    out = _cli("plan", "matrices/smoke.yaml", "--json")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["servers"] == 4
    assert {c["case_id"] for c in data["cases"]} >= {"tiny-mla/tp2-dcp1-mtp0/fused"}
    assert any("DCP" in n for n in data["notes"])


@pytest.mark.parametrize(
    ("model", "expected"),
    [
        ({"path": "/ckpt", "layers": 4}, "models[0]: layers=4 is for built-in models"),
        ({"path": "builtin:tiny-glm5", "num_heads": 200}, "heads=200 is outside 1..128"),
        ({"path": "builtin:tiny-glm5", "layers": 0}, "models[0].layers=0"),
    ],
)
def test_builtin_model_sizes_are_checked(model, expected):
    doc = _with("models.0", {"label": "m", "num_heads": 64} | model)
    with pytest.raises(MatrixError) as exc:
        _parse(doc)
    assert str(exc.value).startswith("m.yaml: ") and expected in str(exc.value), str(exc.value)


def test_builtin_model_takes_heads_and_layers():
    doc = _with("models.0", {"label": "g", "path": "builtin:tiny-glm5", "num_heads": 64})
    doc["models"][0]["layers"] = 6
    m = _parse(doc)
    model = m.models[0]
    assert (model.builtin_name, model.num_heads, model.builtin_layers) == ("tiny-glm5", 64, 6)


def test_baseline_variant_is_the_marked_one_or_the_first():
    m = _parse(_with("variants", [{"name": "fused"}, {"name": "staged", "baseline": True}]))
    assert m.baseline_variant.name == "staged"
    assert [c.variant.name for c in expand(m)][:2] == ["fused", "staged"]  # run order kept
    assert _parse(_with("variants", [{"name": "a"}, {"name": "b"}])).baseline_variant.name == "a"


# --------------------------------------------------------------------------- A/B


def _ab(ab: dict, **changes) -> dict:
    doc = {**BASE, "topologies": [{"tp": 8, "mtp": [0]}], "workloads": BASE["workloads"][:1]}
    doc |= {"variants": [{"name": "staged"}, {"name": "fused"}], "ab": ab, **changes}
    return doc


def test_restarts_serve_each_variant_round_by_round():
    m = _parse(_ab({"servers": 3}))
    assert [c.case_id for c in expand(m)] == [
        f"m/tp8-dcp1-mtp0/{v}/s{s}" for s in (1, 2, 3) for v in ("staged", "fused")
    ]
    first = expand(m)[0].to_dict()
    assert first["ab_server"] == 1 and first["variant"] == "staged"
    assert "ab_server" not in expand(_parse(BASE))[0].to_dict()
    assert _parse(_ab({})).ab.server_count == 4  # the default: 4 starts per variant
    assert _parse(_ab({"mode": "switch"})).ab.server_count == 1


def test_ab_block_counts_and_the_primary_figure_that_are_accepted():
    # Any even count is balanced under abba; alternate promises no balance, so takes any.
    for blocks in (2, 4, 6, 1000):
        assert _parse(_ab({"mode": "switch", "blocks": blocks})).ab.blocks == blocks
    assert _parse(_ab({"mode": "switch", "blocks": 3, "order": "alternate"})).ab.blocks == 3
    ruled = _parse(
        _ab({"mode": "switch", "blocks": 4, "max_blocks": 4, "target_half_width_pct": 1})
    )
    assert (ruled.ab.worst_case_blocks, _parse(_ab({"mode": "switch"})).ab.worst_case_blocks) == (
        4,
        8,
    )
    primary = _parse(_ab({"primary": {"workload": "ctx0", "metric": "tpot_mean_ms"}})).ab.primary
    assert (primary.workload, primary.metric) == ("ctx0", "tpot_mean_ms")
    default = _parse(_ab({})).ab.primary
    assert (default.workload, default.metric) == (None, "output_tok_s")


@pytest.mark.parametrize(
    ("ab", "changes", "expected"),
    [
        ({}, {"variants": [{"name": "fused"}]}, "ab: needs two or more variants"),
        ({"servers": 1}, {}, "ab.servers=1 restarts mode needs 2 or more server starts"),
        ({"blocks": 4}, {}, "ab.blocks: is for mode: switch"),
        ({"mode": "switch", "serve_as": "fast"}, {}, "ab: names variant 'fast'; the variants"),
        ({"mode": "switch", "paths": {"x": "fused"}}, {}, "ab: names variant 'x'"),
        (
            {"mode": "switch"},
            {"variants": [{"name": "staged"}, {"name": "switch"}]},
            "variants: 'switch' names a switch-mode server's own directory",
        ),
        (
            {"mode": "switch"},
            {"workloads": [{**BASE["workloads"][1], "name": "w"}]},
            "workloads[0].repeats=2 ab.mode switch runs each workload once per block",
        ),
        (
            {"mode": "switch"},
            {"engine": {"args": ["--worker-extension-cls=my.Ext"]}},
            "passes --worker-extension-cls; a switch-mode server gets it from the orchestrator",
        ),
        (
            {"mode": "switch"},
            {"engine": {"args": ["--enable-prefix-caching"]}},
            "passes --enable-prefix-caching",
        ),
        ({"mode": "switch", "extension": "NoModule"}, {}, "ab.extension='NoModule'"),
        ({"mode": "flip"}, {}, "ab.mode='flip'"),
        (
            {"mode": "switch", "blocks": 3},
            {},
            "m.yaml: ab.blocks=3 cannot be drift-balanced with order abba: each variant's blocks "
            "must sit at the same mean position, which needs an even number of blocks per "
            "variant; use 2 or 4 (or order: alternate, which is not drift-balanced)",
        ),
        ({"mode": "switch", "blocks": 7, "order": "abba"}, {}, "ab.blocks=7 cannot be"),
        (
            {"primary": {"workload": "ctx9"}},
            {},
            "m.yaml: ab.primary.workload='ctx9' names no workload of this matrix; the workloads "
            "are ['ctx0']",
        ),
        ({"primary": {"metric": "tok_s"}}, {}, "ab.primary.metric='tok_s'"),
        # The sequential stopping rule (orchestrator.analysis.sequential).
        ({"max_blocks": 8}, {}, "ab.max_blocks: is for mode: switch"),
        ({"target_half_width_pct": 0.3}, {}, "ab.target_half_width_pct: is for mode: switch"),
        (
            {"mode": "switch", "target_half_width_pct": 0.3},
            {},
            "m.yaml: ab.target_half_width_pct=0.3 needs ab.max_blocks: the most rounds",
        ),
        (
            {"mode": "switch", "max_blocks": 8},
            {},
            "m.yaml: ab.max_blocks=8 does nothing without ab.target_half_width_pct",
        ),
        (
            {"mode": "switch", "blocks": 8, "max_blocks": 6, "target_half_width_pct": 0.3},
            {},
            "m.yaml: ab.max_blocks=6 is below ab.blocks=8: the rule first looks after",
        ),
        (
            {"mode": "switch", "blocks": 4, "max_blocks": 9, "target_half_width_pct": 0.3},
            {},
            "m.yaml: ab.max_blocks=9 must be even under the stopping rule: the rule adds rounds "
            "two at a time, a round and its mirror, which keeps the blocks drift-balanced at "
            "every look; use 8 or 10",
        ),
        (
            {
                "mode": "switch",
                "order": "alternate",
                "blocks": 3,
                "max_blocks": 8,
                "target_half_width_pct": 0.3,
            },
            {},
            "m.yaml: ab.blocks=3 must be even under the stopping rule",
        ),
        (
            {"mode": "switch", "servers": 2, "max_blocks": 8, "target_half_width_pct": 0.3},
            {},
            "m.yaml: ab.servers=2 the stopping rule needs one switch server per topology",
        ),
        (
            {"mode": "switch", "max_blocks": 8, "target_half_width_pct": -1},
            {},
            "ab.target_half_width_pct=-1: input should be greater than 0",
        ),
        ({"mode": "switch", "max_blocks": 0, "target_half_width_pct": 1}, {}, "ab.max_blocks=0"),
        ({"primary": {"workload": "ctx0", "rank": 1}}, {}, "ab.primary.rank"),
    ],
)
def test_ab_rules_name_the_field(ab, changes, expected):
    with pytest.raises(MatrixError, match=re.escape(expected)):
        _parse(_ab(ab, **changes))
