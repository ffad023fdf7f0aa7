"""Flags the orchestrator owns cannot be slipped past it: not abbreviated (vLLM's parser
takes any unambiguous prefix, and a matrix's args come last, so they win), not through a
`--config` file, and a server bound to every interface is a choice the matrix states."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from security_helpers import (
    ALIAS_BOMB,
    MATRIX,
    REPO,
    assert_refused,
    make_run,
    rewrite_json,
    run_cli,
    write_matrix,
)

from orchestrator.config.errors import MatrixError
from orchestrator.config.load import load_matrix, parse_matrix
from orchestrator.config.owned_flags import ALWAYS_OWNED, PROFILE_OWNED, owned_flag
from orchestrator.engines.vllm.server import serve_argv

# (passthrough args, the owned flag vLLM 0.32's parser reads them as). The first five are
# ones e3a37d8 let through; vLLM 0.32 read each as the owned flag it abbreviates.
ABBREVIATED = [
    (["--hos=0.0.0.0"], "--host"),
    (["--por=1"], "--port"),
    (["--tensor-parallel=2"], "--tensor-parallel-size"),
    (['--speculative-conf={"method":"mtp","num_speculative_tokens":1}'], "--speculative-config"),
    (["--served-model=other"], "--served-model-name"),
    (["--tensor_parallel", "2"], "--tensor-parallel-size"),  # underscores read as dashes
    (["--decode-context=2"], "--decode-context-parallel-size"),
    (["-t", "2"], "-tp"),  # single-dash prefixes resolve too
    (["-sc", '{"method":"mtp"}'], "-sc"),  # vLLM's own alias of --speculative-config
    (["--spec-tokens=2"], "--spec-tokens"),  # vLLM's shorthand speculative flags
    (["--spec-meth", "mtp"], "--spec-method"),
    (["--speculative.method", "mtp"], "--speculative-config"),  # dotted form, abbreviated
    (["--host", "0.0.0.0"], "--host"),
]


def _args_matrix(args: list[str], where: str = "engine") -> str:
    block = json.dumps({"args": args})
    if where == "engine":
        return MATRIX + f"engine: {block}\n"
    return MATRIX.replace("topologies: [{tp: 1}]", f"topologies: [{{tp: 1, args: {args!r}}}]")


@pytest.mark.parametrize("args,flag", ABBREVIATED, ids=[a[0] for a, _ in ABBREVIATED])
def test_abbreviated_owned_flags_are_refused_at_plan_time(args, flag):
    with pytest.raises(MatrixError) as err:
        parse_matrix(_args_matrix(args), "m.yaml")
    msg = str(err.value)
    assert msg.startswith("m.yaml: engine.args"), msg
    assert flag in msg and args[0] in msg, msg


def test_the_field_is_named_wherever_the_args_are(tmp_path):
    with pytest.raises(MatrixError, match=r"^m\.yaml: topologies\[0\]\.args.*--host"):
        parse_matrix(_args_matrix(["--hos=0.0.0.0"], "topologies"), "m.yaml")


def test_plan_cli_refuses_an_abbreviated_flag_matrix_with_exit_2(tmp_path):
    args = ["--hos=0.0.0.0", "--por=1", "--tensor-parallel=2", "--served-model=other"]
    path = write_matrix(tmp_path, f"engine: {{args: {json.dumps(args)}}}\n")
    assert_refused(run_cli("plan", str(path)), path, "engine.args", "--host")


@pytest.mark.parametrize(
    "args",
    [
        ["--max-model-len=2048", "--enforce-eager"],
        ["--attention-backend", "CPU_MLA"],
        ["--diffusion-config", "{}"],
        ["-q", "fp8", "-O3"],
        ["--seed", "-1"],  # a negative number is a value, not a flag
        ["--hf-overrides", '{"num_hidden_layers": 2}'],
    ],
)
def test_flags_that_are_not_owned_pass(args):
    m = parse_matrix(_args_matrix(args), "m.yaml")
    assert m.engine.args == args


def test_serve_argv_resolves_prefixes_too():
    where = {"tp": 1, "dcp": 1, "mtp": 0, "host": "127.0.0.1", "port": 8000, "served_name": "m"}
    for args, flag in ABBREVIATED:
        with pytest.raises(ValueError, match=flag):
            serve_argv("/m", **where, extra_args=args)
    with pytest.raises(ValueError, match="--model"):
        serve_argv("/m", **where, extra_args=["--mode=x"])


# --------------------------------------------------------------------------- --config files

CONFIGS = [
    ("decode-context-parallel-size: 2\n", "--decode-context-parallel-size"),
    ("speculative-config: {method: mtp, num_speculative_tokens: 1}\n", "--speculative-config"),
    ("spec_tokens: 2\n", "--spec-tokens"),
    ("max-model-len: 2048\nhos: 0.0.0.0\n", "--host"),
    ("served-model-name: other\n", "--served-model-name"),
]


@pytest.mark.parametrize("form", ["split", "equals"])
@pytest.mark.parametrize("text,flag", CONFIGS, ids=[f for _, f in CONFIGS])
def test_config_files_cannot_set_owned_flags(tmp_path, text, flag, form):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text(text)
    args = ["--config", str(cfg)] if form == "split" else [f"--config={cfg}"]
    path = write_matrix(tmp_path, f"engine: {{args: {json.dumps(args)}}}\n")
    with pytest.raises(MatrixError) as err:
        load_matrix(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: engine.args"), msg
    assert str(cfg) in msg and flag in msg, msg


def test_config_file_refusal_through_the_cli(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("decode-context-parallel-size: 2\n")
    path = write_matrix(tmp_path, f"engine: {{args: [--config, '{cfg}']}}\n")
    assert_refused(run_cli("plan", str(path)), path, cfg, "--decode-context-parallel-size")


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "no such file"),
        ("- a\n- b\n", "not a YAML mapping"),
        (ALIAS_BOMB + "max-model-len: 2048\n", "expands"),
    ],
    ids=["missing", "list", "alias-bomb"],
)
def test_config_files_that_cannot_be_checked_are_refused(tmp_path, content, message):
    cfg = tmp_path / "cfg.yaml"
    if content is not None:
        cfg.write_text(content)
    path = write_matrix(tmp_path, f"engine: {{args: [--config, '{cfg}']}}\n")
    with pytest.raises(MatrixError, match=message) as err:
        load_matrix(path)
    assert str(cfg) in str(err.value)


def test_a_harmless_config_file_passes(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("max-model-len: 2048\nenforce-eager: true\n")
    path = write_matrix(tmp_path, f"engine: {{args: [--config, '{cfg}']}}\n")
    assert load_matrix(path).engine.args == ["--config", str(cfg)]


def test_plan_does_not_import_vllm(tmp_path):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("max-model-len: 2048\n")
    path = write_matrix(tmp_path, f"engine: {{args: [--config, '{cfg}', '--enforce-eager']}}\n")
    code = (
        "import sys, time; t = time.monotonic()\n"
        "from orchestrator.plan.render import plan_matrix\n"
        f"plan_matrix({str(path)!r})\n"
        "assert 'vllm' not in sys.modules, 'plan imported vllm'\n"
        "print(time.monotonic() - t)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) < 1.0


# --------------------------------------------------------------------------- vLLM's own parser


@pytest.fixture(scope="module")
def vllm_parser():
    """vLLM's `vllm serve` parser, where vLLM is importable (the CPU build in CI). Built with
    no general plugin allowed: building it loads them, and fusedq's would patch vLLM's
    MLAAttention in this test process for every test after this one."""
    pytest.importorskip("vllm")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_PLUGINS", "none-for-the-parser-test")
        return _serve_parser()


def _serve_parser():
    try:
        from vllm.entrypoints.launchers.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:  # another release's layout
        pytest.skip(f"vLLM's serve parser is elsewhere in this release: {exc}")
    parser = make_arg_parser(FlexibleArgumentParser())

    def error(message: str) -> None:
        raise ValueError(message)

    parser.error = error  # type: ignore[method-assign]
    return parser


def _resolved_dest(parser, option: str) -> str | None:
    """The destination vLLM's argparse reads `option` as, or None (unknown, ambiguous)."""
    try:
        found = parser._parse_optional(option)
    except ValueError:
        return None
    if isinstance(found, list):  # Python 3.12+: a list of candidates
        found = found[0] if len(found) == 1 else None
    return found[0].dest if found and found[0] is not None else None


def test_the_prefix_rule_agrees_with_vllms_parser(vllm_parser):
    """Every spelling vLLM reads as an owned flag is refused, and the only real vLLM flag
    refused is -dc (a prefix of -dcp: in a release without --diffusion-config, vLLM reads
    it as DCP)."""
    owned = {**ALWAYS_OWNED, **PROFILE_OWNED}
    actions = vllm_parser._option_string_actions
    owned_dests = {actions[f].dest for f in owned if f in actions}
    assert {"host", "port", "tensor_parallel_size", "speculative_config"} <= owned_dests
    for option, action in actions.items():
        refused = owned_flag(option, owned) is not None
        if action.dest in owned_dests:
            assert refused, option
        elif option != "-dc":
            assert not refused, option
    for option in {o for o in actions if actions[o].dest in owned_dests}:
        for cut in range(2, len(option)):
            prefix = option[:cut]
            if prefix in ("-", "--"):
                continue
            if _resolved_dest(vllm_parser, prefix) in owned_dests:
                assert owned_flag(prefix, owned) is not None, prefix


# --------------------------------------------------------------------------- every interface


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "", "0", "[::]", "0:0:0:0:0:0:0:0"])
def test_binding_every_interface_needs_the_opt_in(host):
    with pytest.raises(MatrixError) as err:
        parse_matrix(MATRIX + f"host: {json.dumps(host)}\n", "m.yaml")
    assert "bind_all_interfaces" in str(err.value) and str(err.value).startswith("m.yaml: host")


def test_the_opt_in_is_warned_about_in_plan(tmp_path):
    path = write_matrix(tmp_path, "host: 0.0.0.0\nbind_all_interfaces: true\n")
    out = run_cli("plan", str(path))
    assert out.returncode == 0, out.stderr
    warnings = [ln for ln in out.stdout.splitlines() if ln.startswith("warning:")]
    assert len(warnings) == 1 and "every interface" in warnings[0], out.stdout


def test_the_opt_in_is_warned_about_when_a_run_starts(tmp_path):
    path = write_matrix(tmp_path, "host: 0.0.0.0\nbind_all_interfaces: true\n")
    out = run_cli("run", str(path), "--only", "no-such-case", "--logs-dir", str(tmp_path))
    assert out.returncode == 2  # refused before anything started
    assert any(
        ln.startswith("orchestrator: warning:") and "every interface" in ln
        for ln in out.stderr.splitlines()
    ), out.stderr


def test_the_opt_in_is_warned_about_in_the_report(tmp_path):
    root = make_run(tmp_path)
    manifest = json.loads((root / "manifest.json").read_text())
    matrix = {**manifest["matrix"], "host": "0.0.0.0", "bind_all_interfaces": True}
    rewrite_json(root / "manifest.json", {"matrix": matrix})
    out = run_cli("report", str(root))
    assert out.returncode == 0, out.stderr
    md = (root / "report.md").read_text()
    assert "every interface" in md and "0.0.0.0" in md
    assert "every interface" in (root / "report.html").read_text()


def test_loopback_and_node_need_no_opt_in():
    for host in ("127.0.0.1", "localhost", "::1", "node"):
        parse_matrix(MATRIX + f"host: {json.dumps(host)}\n", "m.yaml")
