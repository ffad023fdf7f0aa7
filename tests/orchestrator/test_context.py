"""The context rule of a matrix: a workload (or the profiled request) longer than a case's
server takes is refused at plan time, where the bound is known without loading the model
(--max-model-len in the args, a built-in model's config), and nothing is said elsewhere."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from orchestrator.config.context import parse_tokens, stated_max_model_len
from orchestrator.config.errors import MatrixError
from orchestrator.config.load import parse_matrix
from orchestrator.models import standins, tinymodel

REPO = Path(__file__).resolve().parents[2]


def _doc(*, path: str = "/ckpt", heads: int = 64, args: list[str] | None = None,
         prompt: int = 65536, output: int = 256, **extra: object) -> dict:  # fmt: skip
    model: dict = {"label": "Luke BF16", "path": path, "num_heads": heads}
    doc: dict = {
        "name": "t",
        "models": [model],
        "topologies": [{"tp": 8 if heads == 64 else 1, "mtp": [0]}],
        "workloads": [
            {"name": "ctx0", "prompt_tokens": 1, "output_tokens": 16},
            {"name": "ctx64k", "prompt_tokens": prompt, "output_tokens": output},
        ],
        **extra,
    }
    if args is not None:
        doc["engine"] = {"args": args}
    return doc


def _parse(doc: dict) -> object:
    return parse_matrix(yaml.safe_dump(doc), "matrices/x.yaml", env={})


def _refusal(doc: dict) -> str:
    with pytest.raises(MatrixError) as exc:
        _parse(doc)
    return str(exc.value)


def test_a_workload_past_max_model_len_is_refused_naming_it():
    assert _refusal(_doc(args=["--max-model-len=32768"])) == (
        "matrices/x.yaml: workloads[1] (ctx64k): prompt 65536 + output 256 tokens exceed "
        "max-model-len 32768 of model 'Luke BF16'"
    )


@pytest.mark.parametrize(
    "args",
    [
        ["--max-model-len", "32768"],
        ["--max_model_len=32K"],  # vLLM's binary suffix: 32,768
        ["--max-model=32k"],  # an unambiguous prefix; 32,000
        ["--max-model-len=70000", "--max-model-len=32768"],  # the last one wins
    ],
)
def test_every_spelling_vllm_reads_is_the_bound(args):
    assert "exceed max-model-len 32" in _refusal(_doc(args=args))


def test_a_workload_that_fits_passes():
    _parse(_doc(args=["--max-model-len=70000"]))
    _parse(_doc(args=["--max-model-len=65792"]))  # exactly prompt + output


@pytest.mark.parametrize(
    "args", [None, ["--max-model-len=auto"], ["--max-model-len", "-1"], ["--max-mo=100"]]
)
def test_a_checkpoint_path_says_nothing_it_cannot_know(args):
    """Its config may be on another host: no bound without a stated one (an abbreviation
    vLLM could find ambiguous is not taken as one either)."""
    _parse(_doc(args=args, prompt=1_000_000))


def test_a_builtin_model_is_bound_by_its_own_config():
    tiny = tinymodel.ARCH["max_position_embeddings"]
    doc = _doc(path="builtin:tiny-mla", heads=16, prompt=tiny)
    assert _refusal(doc) == (
        f"matrices/x.yaml: workloads[1] (ctx64k): prompt {tiny} + output 256 tokens exceed "
        f"max_position_embeddings {tiny} of model 'Luke BF16'"
    )
    _parse(_doc(path="builtin:tiny-mla", heads=16, prompt=tiny - 256))
    # A stated --max-model-len is the bound, below or above the config's (vLLM decides the
    # latter at start-up); auto hands it back to the config.
    assert "max-model-len 4096" in _refusal(
        _doc(path="builtin:tiny-mla", heads=16, args=["--max-model-len=4096"])
    )
    doc = _doc(path="builtin:tiny-mla", heads=16, prompt=tiny, args=["--max-model-len=auto"])
    assert f"max_position_embeddings {tiny}" in _refusal(doc)
    glm5 = standins.GLM5["max_position_embeddings"]
    assert f"max_position_embeddings {glm5}" in _refusal(
        _doc(path="builtin:glm5", heads=16, prompt=glm5)
    )


def test_a_bound_only_some_cases_set_names_the_case():
    doc = _doc(
        variants=[
            {"name": "staged"},
            {"name": "fused", "args": ["--max-model-len=32768"]},
        ]
    )
    assert _refusal(doc).endswith(
        "exceed max-model-len 32768 of model 'Luke BF16' (case 'Luke BF16/tp8-dcp1-mtp0/fused')"
    )


def test_the_profiled_request_must_fit_too():
    doc = _doc(args=["--max-model-len=70000"], profile={"prompt_tokens": 69_999, "decode_steps": 4})
    assert _refusal(doc) == (
        "matrices/x.yaml: profile: prompt 69999 + output 4 tokens exceed max-model-len 70000 of "
        "model 'Luke BF16'"
    )


@pytest.mark.parametrize(
    ("value", "tokens"),
    [("4096", 4096), ("32k", 32_000), ("32K", 32_768), ("25.6k", 25_600), ("1M", 2**20),
     ("1.5K", None), ("auto", None), ("${LEN}", None), ("-1", None)],
)  # fmt: skip
def test_values_are_read_as_vllm_reads_them(value, tokens):
    assert parse_tokens(value) == tokens


def test_the_flag_is_found_in_its_spellings():
    assert stated_max_model_len(["--max-num-seqs=8", "--max-model-len", "4k"]) == "4k"
    assert stated_max_model_len(["--max-num-seqs=8"]) is None
    assert stated_max_model_len(["--max-model-len"]) is None  # no value: vLLM refuses it


def test_plan_and_run_exit_2_naming_the_field(tmp_path):
    bad = tmp_path / "x.yaml"
    bad.write_text(yaml.safe_dump(_doc(args=["--max-model-len=32768"])))
    logs = tmp_path / "logs"
    for argv in (["plan", str(bad)], ["run", str(bad), "--logs-dir", str(logs)]):
        out = subprocess.run(
            [sys.executable, "-m", "orchestrator.cli", *argv],
            capture_output=True, text=True, cwd=REPO, timeout=120,
        )  # fmt: skip
        assert out.returncode == 2 and out.stdout == "", argv
        assert out.stderr.strip().splitlines() == [
            f"orchestrator: {bad}: workloads[1] (ctx64k): prompt 65536 + output 256 tokens "
            "exceed max-model-len 32768 of model 'Luke BF16'"
        ], argv
    assert not logs.exists()


def test_every_shipped_matrix_fits_its_contexts():
    for path in sorted((REPO / "matrices").glob("*.yaml")):
        # As `plan` reads a matrix whose ${VAR}s are not set here: left in place.
        parse_matrix(path.read_text(), str(path), env={}, unresolved=[])
