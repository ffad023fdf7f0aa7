"""The engine seam: the registry a matrix's `engine.kind` is looked up in, and the vLLM row
implementing the interface (orchestrator.engines.base.Engine) method for method, signature
for signature; the engine's own mapping of a case onto `vllm serve`; its copy in a Ray actor;
and its import staying light for the CLI's `plan` path."""

from __future__ import annotations

import inspect
import pickle
import subprocess
import sys
import typing
from pathlib import Path

import pytest

from orchestrator.config.axes import EngineSpec
from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix
from orchestrator.engines import ENGINES, Engine, engine_for
from orchestrator.engines.vllm.engine import VllmEngine

MATRIX = """\
name: e
models: [{label: m, path: /models/m, num_heads: 16, served_name: served}]
topologies: [{tp: 2, mtp: [1], mtp_acceptance: 0.5}]
workloads: [{name: ctx0, prompt_tokens: 1, output_tokens: 8, requests: 1}]
variants: [{name: v, args: [--max-num-seqs=4]}]
"""


def _interface() -> dict[str, inspect.Signature]:
    """Engine's methods (those its class body defines; not what Protocol adds, whose names
    start with _) and their signatures without self."""
    out = {}
    for name, member in vars(Engine).items():
        if inspect.isfunction(member) and not name.startswith("_"):
            sig = inspect.signature(member)
            out[name] = sig.replace(parameters=list(sig.parameters.values())[1:])
    return out


def interface_gaps(engine: object) -> list[str]:
    """What `engine` lacks of the interface: a method missing or not callable, a parameter
    named, passed or defaulted otherwise than Engine's (more may follow, if optional), or no
    `kind`."""
    gaps = [] if isinstance(getattr(engine, "kind", None), str) else ["kind"]
    for name, wanted in _interface().items():
        got = getattr(engine, name, None)
        if not callable(got):
            gaps.append(f"{name}: missing")
            continue
        params = list(inspect.signature(got).parameters.values())
        have = [(p.name, p.kind, p.default) for p in params]
        want = [(p.name, p.kind, p.default) for p in wanted.parameters.values()]
        extra = params[len(want) :]
        if have[: len(want)] != want or any(p.default is p.empty for p in extra):
            gaps.append(f"{name}: {have} != {want}")
    return gaps


def test_an_unknown_kind_names_itself_and_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"^unknown engine kind 'sglang' \(known kinds: vllm\)$"):
        engine_for("sglang")


def test_every_kind_a_matrix_may_name_has_a_row() -> None:
    kinds = typing.get_args(EngineSpec.model_fields["kind"].annotation)
    assert set(kinds) == set(ENGINES)
    assert all(engine_for(kind).kind == kind for kind in kinds)


def test_the_vllm_row_implements_every_method_of_the_interface() -> None:
    assert len(_interface()) >= 19  # the walk found the Protocol's methods
    engine = engine_for("vllm")
    assert isinstance(engine, VllmEngine) and engine is engine_for("vllm")
    assert interface_gaps(engine) == []


def test_the_interface_check_finds_what_an_engine_lacks() -> None:
    class Partial(VllmEngine):
        stop = None  # type: ignore[assignment]

        def wait_ready(self, base_url: str, *, timeout_s: float) -> float:  # type: ignore[override]
            return 0.0

    gaps = interface_gaps(Partial())
    assert {gap.split(":")[0] for gap in gaps} == {"stop", "wait_ready"}
    assert "stop: missing" in gaps


def test_a_case_becomes_its_vllm_serve_argv(tmp_path: Path) -> None:
    (case,) = expand(parse_matrix(MATRIX, "e.yaml"))
    argv = engine_for("vllm").serve_argv(
        case, "/models/m", host="127.0.0.1", port=8001, executable="/opt/vllm"
    )
    assert argv[:3] == ["/opt/vllm", "serve", "/models/m"]
    joined = " ".join(argv)
    assert "--tensor-parallel-size 2" in joined and "--port 8001" in joined
    assert "--served-model-name served" in joined and argv[-1] == "--max-num-seqs=4"
    spec = argv[argv.index("--speculative-config") + 1]
    assert '"num_speculative_tokens":1' in spec and '"synthetic_acceptance_rates":[0.5]' in spec
    assert engine_for("vllm").acceptance_rates(2, 0.5) == [0.5, 0.25]


def test_the_engine_a_ray_actor_gets_is_the_same_engine(tmp_path: Path) -> None:
    engine = engine_for("vllm")
    copy = pickle.loads(pickle.dumps(engine))
    assert type(copy) is VllmEngine and interface_gaps(copy) == []
    assert copy.run_dir_env(tmp_path) == engine.run_dir_env(tmp_path)


def test_finding_an_engine_imports_nothing_heavy() -> None:
    # `orchestrator plan` builds a switch server's case through the engine.
    code = (
        "import sys\n"
        "from orchestrator.engines import engine_for\n"
        "engine_for('vllm').switch_server((), {}, 'x.Y')\n"
        "heavy = [m for m in ('httpx', 'torch', 'vllm', 'transformers', 'ray') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
