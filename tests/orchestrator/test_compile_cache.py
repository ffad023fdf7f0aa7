"""Which compile-cache folder a server gets: one per configuration, shared across variants
with equal settings and across runs, never one the matrix chose itself."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix
from orchestrator.engines.vllm import compile_cache

MATRIX = """
name: t
models:
  - {label: m, path: builtin:tiny-mla, num_heads: 8}
topologies:
  - {tp: 1, mtp: [0, 1]}
workloads:
  - {name: a, prompt_tokens: 1, output_tokens: 4}
variants:
  - {name: a}
  - {name: b}
  - {name: c, env: {FUSEDQ_MLA_QUERY: "1"}}
"""


def cases(text: str = MATRIX) -> dict[str, object]:
    return {c.case_id: c for c in expand(parse_matrix(text))}


def test_equal_settings_share_a_folder_whatever_the_variant_is_called() -> None:
    c = cases()
    key = compile_cache.configuration_key
    a, b = c["m/tp1-dcp1-mtp0/a"], c["m/tp1-dcp1-mtp0/b"]
    assert key(a, "/m", "f1") == key(b, "/m", "f1")
    # Anything that may change what is compiled makes another folder.
    assert key(a, "/m", "f1") != key(c["m/tp1-dcp1-mtp0/c"], "/m", "f1")  # env
    assert key(a, "/m", "f1") != key(c["m/tp1-dcp1-mtp1/a"], "/m", "f1")  # MTP
    assert key(a, "/m", "f1") != key(a, "/other", "f1")  # model
    assert key(a, "/m", "f1") != key(a, "/m", "f2")  # fusedq's code
    assert key(a, "/m", "f1") != key(replace(a, args=("--x",)), "/m", "f1")


def test_shared_env_points_vllms_cache_at_the_configuration_and_inductors_at_all(
    tmp_path: Path,
) -> None:
    all_cases = cases()
    env = compile_cache.shared_env(all_cases["m/tp1-dcp1-mtp0/a"], "/m", "f1", root=tmp_path)
    folder = compile_cache.shared_dir(all_cases["m/tp1-dcp1-mtp0/a"], "/m", "f1", root=tmp_path)
    assert folder.parent == tmp_path
    assert set(env) == {"VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"}
    assert Path(env["VLLM_CACHE_ROOT"]).parent == folder
    # Inductor's folder is every configuration's: another one's server gets the same.
    assert Path(env["TORCHINDUCTOR_CACHE_DIR"]) == tmp_path / f"inductor-{compile_cache.cpu_isa()}"
    other = compile_cache.shared_env(all_cases["m/tp1-dcp1-mtp0/c"], "/m", "f1", root=tmp_path)
    assert other["VLLM_CACHE_ROOT"] != env["VLLM_CACHE_ROOT"]
    assert other["TORCHINDUCTOR_CACHE_DIR"] == env["TORCHINDUCTOR_CACHE_DIR"]
    assert not tmp_path.exists() or not any(tmp_path.iterdir()), "naming creates nothing"


def test_a_cache_the_matrix_sets_itself_is_kept() -> None:
    text = MATRIX.replace("- {name: a}", "- {name: a, env: {VLLM_CACHE_ROOT: /mine}}")
    case = cases(text)["m/tp1-dcp1-mtp0/a"]
    assert set(compile_cache.shared_env(case, "/m", None)) == {"TORCHINDUCTOR_CACHE_DIR"}


def test_default_root_is_the_orchestrators_cache(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv("ORCHESTRATOR_CACHE", str(tmp_path))
    case = cases()["m/tp1-dcp1-mtp0/a"]
    assert compile_cache.shared_dir(case, "/m", None).parent == tmp_path / "compile"


def test_every_configuration_links_one_folder_of_model_inspections(tmp_path: Path) -> None:
    c = cases()
    roots = [
        Path(compile_cache.shared_env(c[k], "/m", "f1", root=tmp_path)["VLLM_CACHE_ROOT"])
        for k in ("m/tp1-dcp1-mtp0/a", "m/tp1-dcp1-mtp1/a", "m/tp1-dcp1-mtp0/c")
    ]
    assert len(set(roots)) == 3, "three configurations, three folders"
    links = [compile_cache.share_model_info(r, root=tmp_path) for r in roots]
    shared = tmp_path / "modelinfos"
    for root, link in zip(roots, links, strict=True):
        assert link == root / "modelinfos" and link.is_symlink()
        assert link.resolve() == shared.resolve()
    # What vLLM writes through one configuration's link, every other one reads.
    (links[0] / "vllm-model_executor-models-deepseek_v2-DeepseekV3ForCausalLM.json").write_text(
        "{}"
    )
    assert [p.name for p in links[2].iterdir()] == [
        "vllm-model_executor-models-deepseek_v2-DeepseekV3ForCausalLM.json"
    ]
    # Again (the next server of a configuration): the same link, nothing else made.
    assert compile_cache.share_model_info(roots[1], root=tmp_path) == links[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["modelinfos", *(r.parent.name for r in roots)]
    )


def test_a_folder_of_inspections_of_its_own_is_kept(tmp_path: Path) -> None:
    """A configuration's cache from before the link: its own inspections stay in use."""
    root = tmp_path / "abc" / "vllm-cache"
    (root / "modelinfos").mkdir(parents=True)
    (root / "modelinfos" / "x.json").write_text("{}")
    assert compile_cache.share_model_info(root, root=tmp_path) is None
    assert not (root / "modelinfos").is_symlink()
    assert (root / "modelinfos" / "x.json").read_text() == "{}"


def test_inductors_folder_is_one_per_instruction_set(tmp_path: Path) -> None:
    """Code Inductor cached for AVX-512 is not what a server capped at AVX2 loads (a TP2
    server's vocabulary-parallel embedding got an id out of range from such a graph)."""
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512dq avx512bw avx512vl\n")
    assert compile_cache.cpu_isa({}, cpuinfo) == "avx512"
    assert compile_cache.cpu_isa({"ATEN_CPU_CAPABILITY": "AVX2"}, cpuinfo) == "avx2"
    cpuinfo.write_text("flags\t\t: fpu sse4_2 avx avx2 fma\n")
    assert compile_cache.cpu_isa({}, cpuinfo) == "avx2"
    assert compile_cache.cpu_isa({}, tmp_path / "none") == "default"
    assert compile_cache.inductor_dir(tmp_path, isa="avx2") != compile_cache.inductor_dir(
        tmp_path, isa="avx512"
    )
