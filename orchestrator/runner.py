"""`orchestrator run`: the loop that turns a matrix into measured, audited result rows.

For each case in order: place it on Ray -> start `vllm serve` -> wait until ready -> run every
workload one at a time on that one server -> stop it -> audit its logs -> append one result
row. Every arrow is a call into the module that owns that step; this module only sequences
them, keeps time, and makes sure a failure costs one case, not the run.
"""

from __future__ import annotations

import datetime as dt
import getpass
import importlib.metadata as md
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.matrix import Case, Matrix, expand, load_matrix
from orchestrator.redact import redact, redact_argv, secret_values
from orchestrator.store import RunStore, new_run_id, write_json_atomic

REPO_ROOT = Path(__file__).resolve().parent.parent


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


def _dist_version(name: str) -> str | None:
    try:
        return md.version(name)
    except md.PackageNotFoundError:
        return None


def git_commit(root: Path = REPO_ROOT) -> dict[str, Any]:
    """Commit and dirtiness of the checkout the orchestrator (and the fusedq it ships) runs from."""
    try:
        head = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        dirty = subprocess.run(
            ["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return {"commit": None, "dirty": None}
    if head.returncode:
        return {"commit": None, "dirty": None}
    return {"commit": head.stdout.strip(), "dirty": bool(dirty.stdout.strip())}


def gpu_inventory() -> list[str]:
    """`nvidia-smi -L` lines of the driver's host; empty where there is no NVIDIA GPU."""
    exe = shutil.which("nvidia-smi")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "-L"], capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line for line in out.stdout.splitlines() if line.strip()]


def versions() -> dict[str, str | None]:
    from orchestrator.engines.vllm import probe_version

    try:
        vllm_version = probe_version()
    except Exception as exc:  # a missing vLLM is reported, and the first case fails naming it
        vllm_version = f"unavailable: {exc}"
    return {
        "vllm": vllm_version,
        "fusedq": _dist_version("fusedq"),
        "torch": _dist_version("torch"),
        "triton": _dist_version("triton"),
        "ray": _dist_version("ray"),
        "python": platform.python_version(),
    }


@dataclass
class RunOptions:
    logs_dir: Path = REPO_ROOT / "logs"
    run_id: str | None = None
    resume: str | None = None
    retry_failed: bool = False
    ray_address: str | None = None
    sets: Sequence[str] = ()
    only: Sequence[str] = ()  # case-id substrings; empty = all
    progress: bool = True


@dataclass
class RunSummary:
    run_dir: Path
    results: list[dict[str, Any]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    overhead: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> list[dict[str, Any]]:
        return [r for r in self.results if r.get("status") != "passed"]


class _Log:
    """The driver's own log: to the run directory always, to stderr when asked."""

    def __init__(self, path: Path, echo: bool) -> None:
        self.path = path
        self.echo = echo

    def __call__(self, msg: str) -> None:
        line = f"{_now()} {msg}"
        with self.path.open("a", encoding="utf-8") as f:
            f.write(line + "\n")
        if self.echo:
            print(line, file=sys.stderr, flush=True)


def _workload_params(w: Any) -> Any:
    from orchestrator.workload import WorkloadParams

    return WorkloadParams(
        name=w.name,
        prompt_tokens=w.prompt_tokens,
        output_tokens=w.output_tokens,
        concurrency=w.concurrency,
        requests=w.request_count,
        duration_s=w.duration_s,
        repeats=w.repeats,
    )


def _model_path(case: Case, matrix: Matrix, log: Callable[[str], None]) -> str:
    if case.model.is_builtin:
        from orchestrator.tinymodel import build_tiny_model

        t0 = time.monotonic()
        path = build_tiny_model(mtp=case.model.has_mtp)
        log(f"built-in model {case.model.path} at {path} ({time.monotonic() - t0:.1f} s)")
        return str(path)
    return case.model.path


def _vocab_size(model_path: str) -> int:
    from orchestrator.tinymodel import vocab_size

    try:
        return vocab_size(model_path)
    except (OSError, ValueError, KeyError, TypeError):
        # A remote or hub model: ids below 1000 exist in every tokenizer worth serving.
        return 1000


def _line_count(path: Path) -> int:
    try:
        with path.open("rb") as f:
            return sum(chunk.count(b"\n") for chunk in iter(lambda: f.read(1 << 20), b""))
    except OSError:
        return 0


class CaseFailed(Exception):
    """A case that could not be measured; the message is the reason in the report."""


def run_case(
    case: Case,
    matrix: Matrix,
    launcher: Any,
    store: RunStore,
    log: Callable[[str], None],
    progress: Any,
) -> dict[str, Any]:
    """Place, start, measure, stop and audit one case; always return a result row."""
    from orchestrator.audit import Expectation, audit_logs
    from orchestrator.engines.vllm import ServerStartError, serve_argv, serve_env, wait_ready
    from orchestrator.workload import ServerDiedError, run_workload

    cdir = store.case_dir(case.slug)
    server_log = cdir / "server.log"
    started = dt.datetime.now(dt.timezone.utc)
    t_case = time.monotonic()
    timings: dict[str, float] = {}
    row: dict[str, Any] = {**case.to_dict(), "started_at": started.isoformat(timespec="seconds")}
    workloads: dict[str, Any] = {}
    status, reason = "passed", None
    handle = None
    stop_line = 0
    short_tmp: Path | None = None
    try:
        model_path = _model_path(case, matrix, log)
        t = time.monotonic()
        handle = launcher.place(case, matrix.timeouts.placement_s)
        timings["placement_s"] = time.monotonic() - t
        row["server"] = {k: v for k, v in handle.info.items() if k != "pythonpath"}

        def argv_for(port: int) -> list[str]:
            return serve_argv(
                model_path,
                tp=case.tp,
                dcp=case.dcp,
                mtp=case.mtp,
                host=matrix.host,
                port=port,
                served_name=case.model.served_name or case.model.label,
                extra_args=list(case.args),
                vllm_bin=matrix.engine.vllm_bin,
            )

        env = serve_env({}, host=matrix.host, run_dir=cdir, extra=case.env_dict)
        if "TMPDIR" not in case.env_dict and not Path(env["TMPDIR"]).is_relative_to(cdir):
            # serve_env gave this deep case directory a short TMPDIR stand-in (vLLM's IPC
            # socket paths are capped at 107 bytes); it is ours to remove after the case.
            short_tmp = Path(env["TMPDIR"])
        t = time.monotonic()
        launcher.start(handle, argv_for, env, server_log)
        row["server"]["argv"] = redact_argv(handle.info["argv"])
        row["server"]["port"] = handle.info["port"]
        log(f"{case.case_id}: starting on {handle.info['node_ip']} port {handle.info['port']}")
        progress.update(case.case_id, "starting")
        waited = wait_ready(
            handle.base_url,
            timeout_s=matrix.timeouts.ready_s,
            alive=lambda: launcher.alive(handle),
            log_path=server_log,
            returncode=lambda: launcher.exit_code(handle),
        )
        timings["startup_s"] = time.monotonic() - t
        log(f"{case.case_id}: ready after {waited:.1f} s")
        vocab = _vocab_size(model_path)
        for wl in matrix.workloads:
            deadline = t_case + matrix.timeouts.case_s
            if time.monotonic() > deadline:
                raise CaseFailed(f"case timeout ({matrix.timeouts.case_s:.0f} s) before {wl.name}")
            progress.update(case.case_id, f"{wl.name}")
            t = time.monotonic()
            result = run_workload(
                handle.base_url,
                case.model.served_name or case.model.label,
                _workload_params(wl),
                vocab_size=vocab,
                seed=matrix.seed,
                request_timeout_s=matrix.timeouts.request_s,
                alive=lambda: launcher.alive(handle),
                progress=lambda p, _n=wl.name: progress.update(case.case_id, _n, p),
            )
            timings[f"workload_{wl.name}_s"] = time.monotonic() - t
            summary = result.to_dict()
            workloads[wl.name] = summary
            store.write_records(case.slug, wl.name, result.records)
            mean = summary.get("mean", {})
            log(
                f"{case.case_id}: {wl.name}: {mean.get('aggregate_tok_s', 0):.2f} tok/s aggregate, "
                f"{mean.get('per_user_tok_s', 0):.2f} per user, errors {summary.get('errors', 0)}"
            )
    except (ServerStartError, ServerDiedError, CaseFailed) as exc:
        status, reason = "failed", str(exc)
    except (
        Exception
    ) as exc:  # LaunchError and anything unexpected: this case fails, the run goes on
        status, reason = "failed", f"{type(exc).__name__}: {exc}"
    finally:
        if handle is not None:
            stop_line = _line_count(server_log) + 1
            t = time.monotonic()
            code = launcher.stop(handle)
            timings["stop_s"] = time.monotonic() - t
            row.setdefault("server", {})["exit_code"] = code
            try:
                launcher.fetch_log(handle, server_log)
            except Exception as exc:
                log(f"{case.case_id}: could not fetch server log: {exc}")
        if short_tmp is not None:
            shutil.rmtree(short_tmp, ignore_errors=True)
    if status == "failed":
        log(f"{case.case_id}: FAILED: {reason}")

    # The audit runs on every case, failed or not: a fault explains a failure, and a fault in a
    # case that produced numbers must fail it anyway.
    t = time.monotonic()
    expectations = [
        Expectation(pattern=e.pattern, ranks=None, description=e.description or e.pattern)
        for e in [*matrix.audit.expect, *case.variant.expect]
    ]
    audit = audit_logs(
        [server_log] if server_log.exists() else [],
        since=started,
        expectations=expectations,
        include_kernel_log=matrix.audit.kernel_log,
        stopped_at={str(server_log): stop_line} if stop_line else None,
    )
    timings["audit_s"] = time.monotonic() - t
    audit_dict = audit.to_dict()
    write_json_atomic(cdir / "audit.json", audit_dict)
    fatal = [f for f in audit.findings if f.severity in ("fatal", "quarantine-node")]
    if fatal and status == "passed":
        first = audit.root_cause or fatal[0]
        status = "failed"
        reason = (
            f"audit: {first.signature} ({first.severity}) at {first.location()}: {first.text[:200]}"
        )
    errors = sum(int(w.get("errors", 0)) for w in workloads.values())
    timings["total_s"] = time.monotonic() - t_case
    row.update(
        status=status,
        reason=reason,
        ended_at=_now(),
        workloads=workloads,
        errors=errors,
        audit=audit_dict,
        timings={k: round(v, 3) for k, v in timings.items()},
    )
    return row


def _open_for_resume(options: RunOptions, cases: list[Case], matrix_path: str | Path) -> RunStore:
    assert options.resume
    store = RunStore.open(options.logs_dir, options.resume)
    old_ids = {c["case_id"] for c in store.manifest().get("cases", [])}
    extra = sorted({c.case_id for c in cases} - old_ids)
    if extra:
        raise ValueError(
            f"{matrix_path}: case {extra[0]!r} is not in run {store.run_id}; "
            "a resumed run must use the matrix it started with"
        )
    store.lock()
    return store


def _manifest(
    store: RunStore,
    matrix_path: str | Path,
    matrix: Matrix,
    cases: list[Case],
    options: RunOptions,
    launcher: Any,
) -> dict[str, Any]:
    return {
        "run_id": store.run_id,
        "created_at": _now(),
        "matrix_path": str(matrix_path),
        "matrix_text": Path(matrix_path).read_text(encoding="utf-8"),
        "matrix": matrix.model_dump(mode="json"),
        "sets": list(options.sets),
        "only": list(options.only),
        "cases": [c.to_dict() for c in cases],
        "versions": versions(),
        "git": git_commit(),
        "cluster": launcher.cluster,
        "fusedq_fingerprint": launcher.driver_fingerprints.get("fusedq"),
        "gpus": gpu_inventory(),
        "driver": {
            "hostname": socket.gethostname(),
            "user": getpass.getuser(),
            "pid": os.getpid(),
            "python": sys.executable,
            "argv": redact_argv(sys.argv),
            "platform": platform.platform(),
        },
    }


def run_matrix(matrix_path: str | Path, options: RunOptions) -> RunSummary:
    """Run (or resume) a matrix and write its reports.

    Bad input (matrix, run id, resume target, cluster too small) raises MatrixError, StoreError,
    LaunchError or ValueError before any server starts and before a new run directory exists.
    """
    from orchestrator.launch import Launcher
    from orchestrator.progress import ProgressView
    from orchestrator.report import write_reports

    t_run = time.monotonic()
    matrix = load_matrix(matrix_path, sets=options.sets)
    cases = expand(matrix)
    selected = [c for c in cases if not options.only or any(s in c.case_id for s in options.only)]
    if not selected:
        raise ValueError(f"{matrix_path}: --only {list(options.only)} matches no case")
    secrets = secret_values({**os.environ, **matrix.engine.env})
    store = _open_for_resume(options, cases, matrix_path) if options.resume else None

    pending: list[str] = []  # log lines from before the run directory exists
    log_target: list[_Log] = []

    def log(msg: str) -> None:
        if log_target:
            log_target[0](msg)
        else:
            pending.append(msg)

    view = ProgressView(total=len(selected), enabled=options.progress)
    measured = 0.0
    summary: RunSummary | None = None
    # SIGTERM (a job scheduler's stop) must unwind like Ctrl-C: every server stopped, every
    # finished result kept, reports written. Python's default would exit without cleanup.
    previous_term = signal.getsignal(signal.SIGTERM)

    def _on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_term)
    try:
        with Launcher(matrix, ray_address=options.ray_address, log=log) as launcher:
            launcher.check_capacity()
            if store is None:
                run_id = options.run_id or new_run_id(matrix.name)
                store = RunStore.create(options.logs_dir, run_id)
                store.lock()
                store.write_manifest(
                    _manifest(store, matrix_path, matrix, cases, options, launcher), secrets
                )
            else:
                manifest = store.manifest()
                resume = _manifest(store, matrix_path, matrix, cases, options, launcher)
                manifest["resumes"] = [*manifest.get("resumes", []), resume]
                store.write_manifest(manifest, secrets)
            log_target.append(_Log(store.root / "orchestrator.log", echo=False))
            for line in pending:
                log(line)
            done = store.finished_case_ids(include_failed=not options.retry_failed)
            todo = [c for c in selected if c.case_id not in done]
            summary = RunSummary(
                run_dir=store.root, skipped=[c.case_id for c in selected if c.case_id in done]
            )
            log(
                f"run {store.run_id}: {len(cases)} cases, {len(selected)} selected, "
                f"{len(todo)} to run, {len(summary.skipped)} already finished"
            )
            view.done = len(summary.skipped)
            view.start()
            for case in todo:
                view.begin(case.case_id)
                # Redacted before anything reads it: the summary feeds the CLI's FAILED lines.
                row = redact(run_case(case, matrix, launcher, store, log, view), secrets)
                store.append_result(row, secrets)
                summary.results.append(row)
                t = row.get("timings", {})
                measured += t.get("startup_s", 0.0) + sum(
                    v for k, v in t.items() if k.startswith("workload_")
                )
                view.finish(case.case_id, row)
    except KeyboardInterrupt:
        log("interrupted: servers stopped; finished cases kept; continue with --resume")
        raise
    finally:
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, previous_term)
        view.stop()
        if store is not None and summary is not None:
            total = time.monotonic() - t_run
            summary.overhead = {
                "wall_s": round(total, 3),
                "startup_and_measured_s": round(measured, 3),
                "overhead_s": round(total - measured, 3),
                "overhead_pct": round(100.0 * (total - measured) / total, 2) if total else 0.0,
            }
            log(f"run {store.run_id}: wall {total:.1f} s, overhead {summary.overhead}")
            write_reports(store, overhead=summary.overhead)
        if store is not None:
            store.unlock()
    assert summary is not None
    return summary
