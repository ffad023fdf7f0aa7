"""`orchestrator run`: the loop that turns a matrix into measured, audited result rows.

For each case in order: place it on Ray -> start `vllm serve` -> wait until ready -> run every
workload one at a time on that one server -> stop it -> audit its logs -> append one result
row. Every arrow is a call into the module that owns that step; this module only sequences
them, keeps time, and makes sure a failure costs one case, not the run.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from orchestrator import probes
from orchestrator.leftovers import Leftover, find_leftovers, run_env, stop_leftovers
from orchestrator.matrix import Case, Matrix, expand, load_matrix
from orchestrator.redact import (
    redact,
    redact_argv,
    redact_file,
    redact_text,
    secret_args,
    secret_values,
)
from orchestrator.results import SCHEMA_VERSION, CaseResult
from orchestrator.store import RunStore, new_run_id, write_json_atomic

if TYPE_CHECKING:
    from orchestrator.audit import Finding

# A port the OS called free can be taken before vLLM binds it (seconds later, after its
# imports); that race costs a retry on a new port, not the case. Three lost races in a row
# are not a race, and fail the case.
PORT_ATTEMPTS = 3
# The unmeasured warm-up request (matrix.warmup_requests of them): short, because what it
# absorbs is one-time cost (the workers' first collective), not throughput.
WARMUP_PROMPT_TOKENS = 16
WARMUP_OUTPUT_TOKENS = 8


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")


@dataclass
class RunOptions:
    logs_dir: Path = probes.REPO_ROOT / "logs"
    run_id: str | None = None
    resume: str | None = None
    retry_failed: bool = False
    ray_address: str | None = None
    sets: Sequence[str] = ()
    only: Sequence[str] = ()  # case-id substrings; empty = all
    progress: bool = True
    kill_leftovers: bool = False  # stop processes of crashed runs instead of refusing/warning


@dataclass
class RunSummary:
    """What one `run` (or `--resume`) attempt did, and the stored results it stands on.

    `results` are the rows this attempt wrote; `earlier` the rows earlier attempts wrote
    for the other selected cases (`skipped` names them). A run passes only when both hold
    no failure: a resume that had nothing to re-run still failed if a case failed before.
    """

    run_dir: Path
    results: list[CaseResult] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    earlier: list[CaseResult] = field(default_factory=list)
    overhead: dict[str, float] = field(default_factory=dict)
    nothing_left: bool = False  # a resume found every selected case finished: it ran nothing

    @property
    def failed(self) -> list[CaseResult]:
        return [r for r in self.earlier + self.results if not r.passed]


class _Log:
    """The driver's own log: to the run directory always, to stderr when asked; redacted,
    since its lines quote server log tails and argv."""

    def __init__(self, path: Path, echo: bool, secrets: tuple[str, ...] = ()) -> None:
        self.path = path
        self.echo = echo
        self.secrets = secrets

    def __call__(self, msg: str) -> None:
        line = f"{_now()} {redact_text(msg, self.secrets)}"
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
        record_tokens=w.same_tokens,
    )


def _model_path(case: Case, matrix: Matrix, log: Callable[[str], None]) -> str:
    if case.model.is_builtin:
        from orchestrator.tinymodel import build_tiny_model

        t0 = time.monotonic()
        m = case.model
        path = build_tiny_model(
            mtp=m.has_mtp, name=m.builtin_name, heads=m.num_heads, layers=m.builtin_layers
        )
        log(f"built-in model {case.model.path} at {path} ({time.monotonic() - t0:.1f} s)")
        return str(path)
    path = case.model.path
    if not os.path.isabs(path) and Path(path).exists():
        # The server runs in its case directory, where a path relative to here means nothing.
        return str(Path(path).resolve())
    return path


def _absolute_if_path(exe: str | None) -> str | None:
    """A relative executable path (`scripts/vllm`) made absolute against the driver's working
    directory, where it was written; the server starts in its case folder. A bare name is
    looked up on PATH, as given."""
    if exe is None or os.sep not in exe or os.path.isabs(exe):
        return exe
    return str(Path(exe).absolute())


def _is_local_path(path: str) -> bool:
    """A filesystem path rather than a hub id (`org/name`), as vLLM would be given it."""
    return os.path.isabs(path) or path.startswith(("./", "../"))


def matrix_secrets(matrix: Matrix, environ: Mapping[str, str] = os.environ) -> tuple[str, ...]:
    """Every secret value a run could write: secret-named variables of the driver's
    environment and of every env block of the matrix, and values of secret-named args
    (`--api-key X`), so they are scrubbed even where they appear without their name."""
    blocks = [matrix.engine, *matrix.models, *matrix.topologies, *matrix.variants]
    values = list(secret_values(environ))
    for block in blocks:
        values += secret_values(block.env)
        values += secret_args(block.args)
    return tuple(dict.fromkeys(values))


def _set_aside(server_log: Path, secrets: tuple[str, ...]) -> Path | None:
    """Move an earlier attempt's log (a lost port race, or a run killed mid-case) out of
    the audited name, redacted: a crashed orchestrator never redacted it, and its
    tracebacks belong to that attempt, not to the one about to be audited."""
    if not server_log.exists():
        return None
    n = 1
    while (dest := server_log.with_name(f"server-attempt{n}.log")).exists():
        n += 1
    redact_file(server_log, secrets)
    os.replace(server_log, dest)
    return dest


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


@contextlib.contextmanager
def _timed(timings: dict[str, float], key: str) -> Iterator[None]:
    """Add the block's wall time to `timings[key]`, however the block ends."""
    t0 = time.monotonic()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.monotonic() - t0


class CaseFailed(Exception):
    """A case that could not be measured; the message is the reason in the report."""


# Lines of the server log a failed case's reason ends with: how the server ended. Its root
# cause is usually dozens of lines further up (vLLM's "Engine core initialization failed.
# See root cause above." chain), so the reason leads with the audit's root cause instead.
REASON_TAIL_LINES = 10


def failure_reason(what: str, root_cause: Finding | None = None, tail: str = "") -> str:
    """A failed case's reason: the root cause the audit found (its exception line and where
    it was logged), then what happened to the case, then the last lines of the server log.

    The first line is the one a dashboard or a one-line summary shows: the cause, when known.
    """
    lines = []
    if root_cause is not None:
        where = f"{Path(root_cause.file).name}:{root_cause.line}"
        if root_cause.rank:
            where += f" [{root_cause.rank}]"
        lines.append(f"{root_cause.text} (root cause, {where})")
    lines.append(what)
    tail_lines = tail.splitlines()[-REASON_TAIL_LINES:]
    if tail_lines:
        lines.append(f"--- last {len(tail_lines)} lines of the server log ---")
        lines += tail_lines
    return "\n".join(lines)


def run_case(
    case: Case,
    matrix: Matrix,
    launcher: Any,
    store: RunStore,
    log: Callable[[str], None],
    progress: Any,
    secrets: tuple[str, ...] = (),
) -> dict[str, Any]:
    """Place, start, measure, stop and audit one case; always return a result row.

    `secrets` are scrubbed from the server log once the server has stopped, before the
    audit reads it, and from the audit record.
    """
    from orchestrator.audit import Expectation, audit_logs
    from orchestrator.engines.vllm import (
        ServerStartError,
        api_key,
        describe_exit,
        is_port_clash,
        log_tail,
        serve_argv,
        serve_env,
        wait_ready,
    )
    from orchestrator.workload import (
        ServerDiedError,
        WorkloadAborted,
        WorkloadParams,
        WorkloadTimeoutError,
        run_workload,
    )

    cdir = store.case_dir(case.slug)
    server_log = cdir / "server.log"
    earlier = _set_aside(server_log, secrets)
    if earlier is not None:
        log(f"{case.case_id}: the log of an earlier attempt is kept as {earlier.name}")
    started = dt.datetime.now(dt.timezone.utc)
    t_case = time.monotonic()
    timings: dict[str, float] = {}
    row: dict[str, Any] = {**case.to_dict(), "started_at": started.isoformat(timespec="seconds")}
    workloads: dict[str, Any] = {}
    status, reason = "passed", None
    # The server's last words, for a case whose server ended on its own (None: not shown).
    tail: str | None = None
    handle = None
    exited_early: int | None = None  # the server's exit code if it went before the stop
    stop_line = 0
    short_tmp: Path | None = None
    try:
        model_path = _model_path(case, matrix, log)

        def argv_for(port: int, host: str) -> list[str]:
            return serve_argv(
                model_path,
                tp=case.tp,
                dcp=case.dcp,
                mtp=case.mtp,
                host=host,
                port=port,
                served_name=case.model.served_name or case.model.label,
                extra_args=list(case.args),
                vllm_bin=_absolute_if_path(matrix.engine.vllm_bin),
            )

        env = serve_env({}, host=matrix.host, run_dir=cdir, extra=case.env_dict)
        if "TMPDIR" not in case.env_dict and not Path(env["TMPDIR"]).is_relative_to(cdir):
            # serve_env gave this deep case directory a short TMPDIR stand-in (vLLM's IPC
            # socket paths are capped at 107 bytes); it is ours to remove after the case.
            short_tmp = Path(env["TMPDIR"])
        # The mark a later run finds a leftover of this one by (orchestrator.leftovers).
        env.update(run_env(store.run_id, case.case_id))
        key = api_key(case.args, env)
        clashes: list[int] = []
        for attempt in range(1, PORT_ATTEMPTS + 1):
            with _timed(timings, "placement_s"):
                handle = launcher.place(case, matrix.timeouts.placement_s)
            row["server"] = {k: v for k, v in handle.info.items() if k != "pythonpath"}
            if _is_local_path(model_path) and launcher.missing_paths(handle, [model_path]):
                raise CaseFailed(
                    f"model path {model_path} does not exist on node {handle.info['node_ip']} "
                    f"({handle.info.get('hostname')})"
                )
            try:
                # Start-up time whether the server came up or not: a failed start-up (or a
                # port lost to another process) is the server's time, not the orchestrator's.
                with _timed(timings, "startup_s"):
                    launcher.start(handle, argv_for, env, server_log)
                    row["server"]["argv"] = redact_argv(handle.info["argv"])
                    row["server"]["port"] = handle.info["port"]
                    log(
                        f"{case.case_id}: starting on {handle.info['node_ip']} "
                        f"port {handle.info['port']}"
                    )
                    progress.update(case.case_id, "starting", server_log=server_log)
                    waited = wait_ready(
                        handle.base_url,
                        timeout_s=matrix.timeouts.ready_s,
                        alive=lambda h=handle: launcher.alive(h),
                        log_path=server_log,
                        returncode=lambda h=handle: launcher.exit_code(h),
                        api_key=key,
                    )
            except ServerStartError as exc:
                if attempt == PORT_ATTEMPTS or not is_port_clash(exc.log_tail):
                    raise
                clashes.append(handle.info["port"])
                log(
                    f"{case.case_id}: port {handle.info['port']} was taken by another process "
                    "before the server bound it; starting again on a new port"
                )
                launcher.stop(handle, log_dest=server_log)
                handle = None
                _set_aside(server_log, secrets)
                continue
            break
        if clashes:
            row["server"]["port_clashes"] = clashes
        log(f"{case.case_id}: ready after {waited:.1f} s")
        vocab = _vocab_size(model_path)
        if matrix.warmup_requests:
            # Not measured: on a fresh server the first request pays one-time costs (TP2 on
            # CPU measured 4.6 tok/s on its first ctx0 request against 33 per user after).
            progress.update(case.case_id, "warm-up")
            with _timed(timings, "warmup_s"):
                warm = run_workload(
                    handle.base_url,
                    case.model.served_name or case.model.label,
                    WorkloadParams(
                        "warmup",
                        prompt_tokens=WARMUP_PROMPT_TOKENS,
                        output_tokens=WARMUP_OUTPUT_TOKENS,
                        requests=matrix.warmup_requests,
                    ),
                    vocab_size=vocab,
                    seed=matrix.seed,
                    # The one-time costs it absorbs belong to start-up, so it gets start-up's
                    # patience: a first request on a fresh CI machine outlasted a 15 s request_s.
                    request_timeout_s=max(matrix.timeouts.request_s, matrix.timeouts.ready_s),
                    alive=lambda: launcher.alive(handle),
                    deadline=t_case + matrix.timeouts.case_s,
                    api_key=key,
                )
            row["warmup"] = {"requests": matrix.warmup_requests, "errors": warm.to_dict()["errors"]}
        for wl in matrix.workloads:
            deadline = t_case + matrix.timeouts.case_s
            if time.monotonic() > deadline:
                raise CaseFailed(f"case timeout ({matrix.timeouts.case_s:.0f} s) before {wl.name}")
            progress.update(case.case_id, f"{wl.name}")
            # Measured time even when the workload ends in a fault: it was spent measuring.
            with _timed(timings, f"workload_{wl.name}_s"):
                try:
                    result = run_workload(
                        handle.base_url,
                        case.model.served_name or case.model.label,
                        _workload_params(wl),
                        vocab_size=vocab,
                        seed=matrix.seed,
                        request_timeout_s=matrix.timeouts.request_s,
                        alive=lambda: launcher.alive(handle),
                        progress=lambda p, _n=wl.name: progress.update(case.case_id, _n, p),
                        deadline=deadline,
                        api_key=key,
                    )
                except WorkloadAborted as exc:
                    # What finished before the fault is evidence; keep it beside the log.
                    store.write_records(case.slug, wl.name, exc.records)
                    raise
            summary = result.to_dict()
            workloads[wl.name] = summary
            store.write_records(case.slug, wl.name, result.records)
            mean = summary.get("mean", {})
            log(
                f"{case.case_id}: {wl.name}: {mean.get('aggregate_tok_s', 0):.2f} tok/s aggregate, "
                f"{mean.get('per_user_tok_s', 0):.2f} per user, errors {summary.get('errors', 0)}"
            )
    except ServerDiedError as exc:
        # When the watch saw it go: a test (and a reader) can hold it against the kill time.
        row.setdefault("server", {})["died_noticed_at"] = round(exc.noticed_at, 3)
        status, reason = "failed", f"{exc}: {launcher.describe_end(handle)}"
        tail = ""  # read once the stop has brought the log home
    except WorkloadTimeoutError as exc:
        limits = f"request_s={matrix.timeouts.request_s:g}, case_s={matrix.timeouts.case_s:g}"
        status, reason = "failed", f"{exc} (timeouts: {limits})"
    except ServerStartError as exc:
        # The tail as it was when the server gave up, before the stop added its own lines.
        status, reason, tail = "failed", exc.reason, exc.log_tail
    except CaseFailed as exc:
        status, reason = "failed", str(exc)
    except (
        Exception
    ) as exc:  # LaunchError and anything unexpected: this case fails, the run goes on
        status, reason = "failed", f"{type(exc).__name__}: {exc}"
    finally:
        if handle is not None:
            progress.update(case.case_id, "stopping")
            # A server that exited on its own before the stop crashed during the case, however
            # its workloads ended (one SIGKILLed in CI answered all its requests with errors
            # before its pid polled as gone, and was recorded as passed).
            if status == "passed":
                exited_early = launcher.exit_code(handle)
            stop_line = _line_count(server_log) + 1
            with _timed(timings, "stop_s"):
                code = launcher.stop(handle, log_dest=server_log)
            row.setdefault("server", {})["exit_code"] = code
        if server_log.exists():
            # The server wrote its log itself, secrets included (a wrapper's env dump, a
            # library echoing its token); now that it has stopped, nothing appends to it.
            redact_file(server_log, secrets)
        if short_tmp is not None:
            shutil.rmtree(short_tmp, ignore_errors=True)
    if status == "passed" and exited_early is not None:
        status = "failed"
        reason = f"server process {describe_exit(exited_early)} before the orchestrator stopped it"
        tail = ""
    if tail == "" and server_log.exists():
        tail = log_tail(server_log)

    # The audit runs on every case, failed or not: a fault explains a failure, and a fault in a
    # case that produced numbers must fail it anyway.
    audit_t0 = time.monotonic()
    expectations = [
        Expectation(pattern=e.pattern, ranks=None, description=e.description or e.pattern)
        for e in [*matrix.audit.expect, *case.variant.expect]
    ]
    # The kernel log and GPU state of the node the server ran on, wherever that was.
    node_runner = launcher.node_runner(handle)
    audit = audit_logs(
        [server_log] if server_log.exists() else [],
        since=started,
        expectations=expectations,
        include_kernel_log=matrix.audit.kernel_log,
        stopped_at={str(server_log): stop_line} if stop_line else None,
        kernel_runner=node_runner,
        gpu_runner=node_runner,
    )
    timings["audit_s"] = time.monotonic() - audit_t0
    audit_dict = redact(audit.to_dict(), secrets)
    write_json_atomic(cdir / "audit.json", audit_dict)
    fatal = [f for f in audit.findings if f.severity in ("fatal", "quarantine-node")]
    if status == "failed":
        reason = failure_reason(str(reason), audit.root_cause, tail or "")
    elif fatal:
        first = audit.root_cause or fatal[0]
        status = "failed"
        reason = (
            f"audit: {first.signature} ({first.severity}) at {first.location()}: {first.text[:200]}"
        )
    same_tokens = token_checks(case, matrix, store, workloads)
    if same_tokens:
        row["same_tokens"] = same_tokens
        differs = [c["sentence"] for c in same_tokens.values() if c["verdict"] == "differs"]
        if differs and status == "passed":
            status, reason = "failed", f"same tokens: {differs[0]}"
    if status == "failed":
        log(f"{case.case_id}: FAILED: {reason}")
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


def token_checks(
    case: Case, matrix: Matrix, store: RunStore, workloads: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """For each measured ``same_tokens`` workload: this case's tokens against those of the
    first variant of its topology (``{}`` for that first variant itself)."""
    from dataclasses import replace

    from orchestrator import tokens

    first = matrix.variants[0] if matrix.variants else None
    if first is None or case.variant.name == first.name:
        return {}
    reference = replace(case, variant=first)
    checks: dict[str, dict[str, Any]] = {}
    for wl in matrix.workloads:
        if not wl.same_tokens or wl.name not in workloads:
            continue
        if not store.records_path(reference.slug, wl.name).is_file():
            checks[wl.name] = {
                "reference": reference.case_id,
                "verdict": "no-reference",
                "sentence": f"{case.variant.name} vs {first.name}: the {first.name} case "
                "recorded no tokens (not run, or failed before this workload)",
            }
            continue
        check = tokens.compare(
            store.read_records(reference.slug, wl.name), store.read_records(case.slug, wl.name)
        )
        check["reference"] = reference.case_id
        check["sentence"] = tokens.describe(check, reference=first.name, variant=case.variant.name)
        checks[wl.name] = check
    return checks


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


def _left_to_run(
    store: RunStore, selected: Sequence[Case], retry_failed: bool
) -> tuple[list[Case], list[CaseResult]]:
    """The selected cases still to run, and the stored rows of the others."""
    rows = {r.case_id: r for r in store.results()}
    done = store.finished_case_ids(include_failed=not retry_failed)
    todo = [c for c in selected if c.case_id not in done]
    return todo, [rows[c.case_id] for c in selected if c.case_id in done]


def _manifest(
    store: RunStore,
    matrix_path: str | Path,
    matrix: Matrix,
    cases: list[Case],
    options: RunOptions,
    launcher: Any,
) -> dict[str, Any]:
    driver = probes.driver_info()
    return {
        "run_id": store.run_id,
        "created_at": _now(),
        "matrix_path": str(matrix_path),
        "matrix_text": Path(matrix_path).read_text(encoding="utf-8"),
        "matrix": matrix.model_dump(mode="json"),
        "sets": list(options.sets),
        "only": list(options.only),
        "cases": [c.to_dict() for c in cases],
        "versions": probes.versions(),
        "git": probes.git_commit(),
        "cluster": launcher.cluster,
        "fusedq_fingerprint": launcher.driver_fingerprints.get("fusedq"),
        "gpus": probes.gpu_inventory(),
        "driver": {**driver, "argv": redact_argv(driver["argv"])},
    }


class LeftoverError(ValueError):
    """Processes a crashed attempt of this run left behind still run; nothing was started."""


def _pids(leftovers: Sequence[Leftover]) -> str:
    return " ".join(str(p.pid) for p in leftovers)


def handle_leftovers(
    run_id: str,
    *,
    resuming: bool,
    kill: bool,
    log: Callable[[str], None],
    find: Callable[[], list[Leftover]] = find_leftovers,
    stop: Callable[[list[Leftover]], list[Leftover]] = stop_leftovers,
) -> list[Leftover]:
    """Find processes of runs whose orchestrator is gone (see orchestrator.leftovers), with
    `find` and `stop`: this machine's by default, every node's on a cluster.

    With `kill`, stop them all. Otherwise a resumed run refuses to start while its own
    earlier attempt's processes run (they hold the memory and GPUs its cases need, and
    the user should decide what happens to them), and any run warns about other runs'
    leftovers: on a shared machine they may be another user's business, but this run
    must say why it may be short of memory. Returns what was found.
    """
    found = find()
    if not found:
        return found
    listing = "\n".join(f"  {p.describe()}" for p in found)

    def warn(msg: str) -> None:
        log(msg)
        print(f"orchestrator: {msg}", file=sys.stderr, flush=True)

    if kill:
        stuck = stop(found)
        warn(
            f"stopped {len(found) - len(stuck)} leftover process(es) of crashed runs "
            f"(--kill-leftovers):\n{listing}"
        )
        if stuck:
            raise LeftoverError(f"could not stop leftover process(es) {_pids(stuck)}")
        return found
    own = [p for p in found if resuming and p.run_id == run_id]
    if own:
        raise LeftoverError(
            f"run {run_id}: {len(own)} process(es) of an earlier attempt of this run are "
            f"still running, and the orchestrator that started them is gone:\n{listing}\n"
            f"stop them (kill {_pids(found)}; they may need kill -CONT too) "
            "or resume with --kill-leftovers"
        )
    warn(
        f"warning: {len(found)} process(es) of crashed runs are still running; they may hold "
        f"memory or GPUs this run needs:\n{listing}\n"
        f"stop them (kill {_pids(found)}) or pass --kill-leftovers"
    )
    return found


def run_matrix(matrix_path: str | Path, options: RunOptions) -> RunSummary:
    """Run (or resume) a matrix and write its reports.

    Bad input (matrix, run id, resume target, cluster too small) raises MatrixError, StoreError,
    LaunchError or ValueError before any server starts and before a new run directory exists.
    """
    from orchestrator.estimate import estimate_run
    from orchestrator.launch import Launcher, ray_address_for
    from orchestrator.progress import ProgressView
    from orchestrator.reports import write_reports

    t_run = time.monotonic()
    matrix = load_matrix(matrix_path, sets=options.sets)
    cases = expand(matrix)
    selected = [c for c in cases if not options.only or any(s in c.case_id for s in options.only)]
    if not selected:
        raise ValueError(f"{matrix_path}: --only {list(options.only)} matches no case")
    secrets = matrix_secrets(matrix)
    store = _open_for_resume(options, cases, matrix_path) if options.resume else None
    if store is not None:
        todo, earlier = _left_to_run(store, selected, options.retry_failed)
        if not todo:
            # Nothing to measure: no Ray, no server, and the run directory stays as it was
            # (its manifest, figures and reports describe the attempts that did the work).
            store.unlock()
            return RunSummary(
                run_dir=store.root,
                skipped=[r.case_id for r in earlier],
                earlier=earlier,
                nothing_left=True,
            )
    run_id = store.run_id if store is not None else options.run_id or new_run_id(matrix.name)

    pending: list[str] = []  # log lines from before the run directory exists
    log_target: list[_Log] = []

    def log(msg: str) -> None:
        if log_target:
            log_target[0](msg)
        else:
            pending.append(msg)

    # On a cluster every node is scanned once Ray is joined (below); here, this machine.
    cluster = bool(ray_address_for(matrix, options.ray_address))
    try:
        if not cluster:
            handle_leftovers(
                run_id, resuming=store is not None, kill=options.kill_leftovers, log=log
            )
    except LeftoverError:
        if store is not None:
            store.unlock()
        raise
    # The local Ray's daemons and workers inherit the driver's environment: marked with the
    # run, they are found as leftovers too if this process dies without stopping them.
    marks = run_env(run_id)
    saved_env = {k: os.environ.get(k) for k in marks}
    os.environ.update(marks)

    view = ProgressView(total=len(selected), enabled=options.progress, secrets=secrets)
    measured = 0.0
    summary: RunSummary | None = None
    # SIGTERM (a job scheduler's stop) must unwind like Ctrl-C: every server stopped, every
    # finished result kept, reports written. Python's default would exit without cleanup.
    previous_term = signal.getsignal(signal.SIGTERM)

    def _on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")

    trap = threading.current_thread() is threading.main_thread()
    if trap:
        signal.signal(signal.SIGTERM, _on_term)
    try:
        with Launcher(matrix, ray_address=options.ray_address, log=log) as launcher:
            if trap:
                # ray.init() installs its own SIGTERM handler (abseil's failure handler then
                # kills the process: no server stopped, no report; seen on the H200), so
                # ours goes back on once Ray is up.
                signal.signal(signal.SIGTERM, _on_term)
            if cluster:
                handle_leftovers(
                    run_id,
                    resuming=store is not None,
                    kill=options.kill_leftovers,
                    log=log,
                    find=launcher.nodes.find_leftovers,
                    stop=launcher.nodes.stop_leftovers,
                )
            launcher.check_capacity()
            if store is None:
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
            log_target.append(_Log(store.root / "orchestrator.log", echo=False, secrets=secrets))
            for line in pending:
                log(line)
            todo, earlier = _left_to_run(store, selected, options.retry_failed)
            summary = RunSummary(
                run_dir=store.root, skipped=[r.case_id for r in earlier], earlier=earlier
            )
            log(
                f"run {store.run_id}: {len(cases)} cases, {len(selected)} selected, "
                f"{len(todo)} to run, {len(summary.skipped)} already finished"
            )
            estimates = estimate_run(matrix, todo).per_case()
            view.expect([c.case_id for c in todo], estimates, done=len(summary.skipped))
            view.start()
            for case in todo:
                view.begin(case.case_id)
                # Redacted before anything reads it: the summary feeds the CLI's FAILED lines.
                row = redact(run_case(case, matrix, launcher, store, log, view, secrets), secrets)
                result = CaseResult.model_validate({"schema_version": SCHEMA_VERSION, **row})
                store.append_result(result, secrets)
                summary.results.append(result)
                t = result.timings
                # The warm-up belongs to bringing the server up, not to the orchestrator.
                measured += (
                    t.get("startup_s", 0.0)
                    + t.get("warmup_s", 0.0)
                    + sum(v for k, v in t.items() if k.startswith("workload_"))
                )
                view.finish(case.case_id, result)
    except KeyboardInterrupt:
        log("interrupted: servers stopped; finished cases kept; continue with --resume")
        raise
    finally:
        if trap:
            signal.signal(signal.SIGTERM, previous_term)
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        view.stop()
        if store is not None and summary is not None:
            total = time.monotonic() - t_run
            summary.overhead = {
                "wall_s": round(total, 3),
                "startup_and_measured_s": round(measured, 3),
                "overhead_s": round(total - measured, 3),
                "overhead_pct": round(100.0 * (total - measured) / total, 2) if total else 0.0,
                "cases_run": len(summary.results),
            }
            log(f"run {store.run_id}: wall {total:.1f} s, overhead {summary.overhead}")
            write_reports(store, overhead=summary.overhead, resume=bool(options.resume))
        if store is not None:
            store.unlock()
    assert summary is not None
    return summary
