"""One server's life: place, start, warm up, measure, stop, audit, its rows.

``CaseRun(unit, measuring, ...).run()`` always returns the unit's rows
(orchestrator.plan.units), failed or not: a fault costs its case, never the run
(orchestrator.execution.runner loops over the units). The server is started as the unit's
server case; what it measures once ready, and which rows it makes of its own, is the unit's
``Measuring`` (orchestrator.execution.measure's for a case of its own,
orchestrator.execution.switch's for a switch server). Each step is a call into the module
that owns it (launch for Ray, the matrix's engine for the server: orchestrator.engines,
workload for the client, audit for the logs); this class sequences them, keeps their time, and turns what went wrong into the
case's reason, leading with the root cause the audit found.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import os
import shutil
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

from orchestrator.audit import Expectation, audit_logs
from orchestrator.client import tokens
from orchestrator.client.workload import (
    ServerDiedError,
    WorkloadParams,
    WorkloadTimeoutError,
    run_workload,
)
from orchestrator.cluster.leftovers import run_env
from orchestrator.common.layout import AUDIT_RECORD, SERVER_LOG
from orchestrator.common.processes import describe_exit
from orchestrator.common.redact import redact, redact_argv, redact_file
from orchestrator.config.expand import Case
from orchestrator.config.schema import (
    WARMUP_OUTPUT_TOKENS,
    WARMUP_PROMPT_TOKENS,
    Matrix,
)
from orchestrator.engines import ServerStartError, engine_for, log_tail
from orchestrator.execution.progress import STOPPING
from orchestrator.plan.units import Unit
from orchestrator.results.profile_figures import ProfileResult
from orchestrator.results.rows import PROFILE_PHASE, SCHEMA_VERSION, CaseResult, WorkloadSummary
from orchestrator.results.store import RunStore, write_json_atomic
from orchestrator.results.stored_audit import AuditSummary

# A port the OS called free can be taken before vLLM binds it (seconds later, after its
# imports); that race costs a retry on a new port, not the case. Three lost races in a row
# are not a race, and fail the case.
PORT_ATTEMPTS = 3
# Lines of the server log a failed case's reason ends with: how the server ended. Its root
# cause is usually dozens of lines further up (vLLM's "Engine core initialization failed.
# See root cause above." chain), so the reason leads with the audit's root cause instead.
REASON_TAIL_LINES = 10
# The profile phase's traces, under the case directory (of the server's node, then the run's).
PROFILE_DIR = "profile"


class CaseFailed(Exception):
    """A case that could not be measured; the message is the reason in the report."""


class Located(Protocol):
    """What a reason needs of a finding (orchestrator.audit's and results' both qualify)."""

    file: str
    line: int | None
    rank: str | None
    text: str


def failure_reason(what: str, root_cause: Located | None = None, tail: str = "") -> str:
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


class Measuring(Protocol):
    """What a unit's server measures once it is ready, and the rows it makes of the server's
    own: orchestrator.execution.measure.EveryWorkloadOnce (a case on a server of its own) or
    orchestrator.execution.switch.SwitchBlocks (every variant on one server)."""

    def measure(self, run: CaseRun, model_path: str, vocab: int, key: str | None) -> None:
        """Measure the ready server; a CaseFailed (or a workload's fault) fails it."""

    def read_traces(self, run: CaseRun) -> None:
        """Read the profile phase's traces, once the stop has brought them home."""

    def same_tokens(self, run: CaseRun) -> dict[str, dict[str, Any]]:
        """The same-tokens checks of the server's own row (a failed one fails it)."""

    def rows(self, run: CaseRun, server: CaseResult) -> list[CaseResult]:
        """The unit's rows, made of the server's own."""


class CaseRun:
    """One unit's server, from placement to the unit's result rows. Use once:
    ``CaseRun(...).run()``.

    `measuring` is what the ready server measures (Measuring). `secrets` are scrubbed from the
    server log once the server has stopped, before the audit reads it, and from the audit
    record. `progress` is the live view (orchestrator.execution.progress.ProgressView:
    update(case_id, phase, ...)), which files the server under the unit's first case.
    The steps `measuring` takes call `show`, `timed`, `fail` and `warm_up`.
    """

    def __init__(
        self,
        unit: Unit,
        measuring: Measuring,
        matrix: Matrix,
        launcher: Any,
        store: RunStore,
        log: Callable[[str], None],
        progress: Any,
        secrets: tuple[str, ...] = (),
    ) -> None:
        self.case, self.shown_as, self.measuring = unit.server, unit.shown_as, measuring
        self.matrix, self.launcher, self.store = matrix, launcher, store
        self.engine = engine_for(matrix.engine.kind)
        self.log, self.progress, self.secrets = log, progress, secrets
        self.dir = store.case_dir(self.case.slug)
        self.server_log = self.dir / SERVER_LOG
        self.timings: dict[str, float] = {}
        self.server: dict[str, Any] | None = None  # node facts, argv, port, exit code
        self.warmup: dict[str, int] | None = None
        self.workloads: dict[str, WorkloadSummary] = {}
        self.profile: ProfileResult | None = None
        self.status, self.reason = "passed", None
        # In the profile phase (set by the measuring once every measurement is taken, until
        # the traces are read): a failure there leaves the measurements standing
        # (CaseResult.failed_in).
        self.profiling = False
        self.failed_in: str | None = None
        self.profile_line = 0  # the first server log line of the profile phase
        # The server's last words, for a case whose server ended on its own (None: not shown).
        self.tail: str | None = None
        self.handle: Any = None
        self.exited_early: int | None = None  # the server's exit code if it went before the stop
        self.stop_line = 0  # the first log line written after the stop began
        self.short_tmp: Path | None = None  # a TMPDIR stand-in of ours to remove afterwards
        # Start-up: when the process was started and the engine said it serves (epoch
        # seconds), and the shared compile-cache folder it was given (Engine.shared_compile_cache).
        self.spawned_at: float | None = None
        self.ready_at: float | None = None
        self.compile_cache_dir: str | None = None
        self.started = dt.datetime.now(dt.timezone.utc)
        self.t0 = time.monotonic()

    @property
    def case_id(self) -> str:
        return self.case.case_id

    def run(self) -> list[CaseResult]:
        """Place, start, measure, stop and audit the server; the unit's rows, failed or not."""
        earlier = _set_aside(self.server_log, self.secrets)
        if earlier is not None:
            self.log(f"{self.case_id}: the log of an earlier attempt is kept as {earlier.name}")
        self.started = dt.datetime.now(dt.timezone.utc)
        self.t0 = time.monotonic()
        try:
            self.measuring.measure(self, *self._bring_up())
        except ServerDiedError as exc:
            # When the watch saw it go: a test (and a reader) can hold it against the kill time.
            self._server()["died_noticed_at"] = round(exc.noticed_at, 3)
            self.fail(f"{exc}: {self.launcher.describe_end(self.handle)}")
            self.tail = ""  # read once the stop has brought the log home
        except WorkloadTimeoutError as exc:
            t = self.matrix.timeouts
            self.fail(f"{exc} (timeouts: request_s={t.request_s:g}, case_s={t.case_s:g})")
        except ServerStartError as exc:
            # The tail as it was when the server gave up, before the stop added its own lines.
            self.fail(exc.reason)
            self.tail = exc.log_tail
        except CaseFailed as exc:
            self.fail(str(exc))
        except Exception as exc:  # LaunchError and anything unexpected: the run goes on
            self.fail(f"{type(exc).__name__}: {exc}")
        finally:
            self._stop()
        startup = self._startup()
        if self.profile is not None and self.status == "passed":
            self.measuring.read_traces(self)
        self.profiling = False
        if self.status == "passed" and self.exited_early is not None:
            how = describe_exit(self.exited_early)
            self.fail(f"server process {how} before the orchestrator stopped it")
            self.tail = ""
        if self.tail == "" and self.server_log.exists():
            self.tail = log_tail(self.server_log)
        # The audit runs on every case, failed or not: a fault explains a failure, and a fault
        # in a case that produced numbers must fail it anyway.
        audit = self._audit()
        if self.failed_in == PROFILE_PHASE and self._fault_before_profile(audit):
            self.failed_in = None  # a fault before the profile: the measurements do not stand
        same_tokens = self.measuring.same_tokens(self)
        differs = [c["sentence"] for c in same_tokens.values() if c["verdict"] == tokens.DIFFERS]
        if differs and self.status == "passed":
            self.fail(f"same tokens: {differs[0]}")
        if self.status == "failed":
            self.log(f"{self.case_id}: FAILED: {self.reason}")
        return self.measuring.rows(self, self.result(audit, same_tokens, startup))

    # -- what the measuring steps call -------------------------------------------------------
    def show(self, phase: str, *args: Any, **kwargs: Any) -> None:
        """The server's phase, in the live view."""
        self.progress.update(self.shown_as, phase, *args, **kwargs)

    def enter_profile(self) -> None:
        """Every measurement is taken; the profile phase begins (a failure from here on leaves
        the measurements standing, unless the audit finds a fault logged before it)."""
        self.profiling = True
        if self.launcher is not None and self.handle is not None:
            # A remote node's log is mirrored by polling: bring the mirror up to date first.
            self.launcher.exit_code(self.handle)
        self.profile_line = _line_count(self.server_log) + 1

    def _fault_before_profile(self, audit: AuditSummary) -> bool:
        """Whether a case-breaking finding came before the profile phase: in the server log
        above its first line, or anywhere else (the kernel log's lines are not the server's)."""
        log = str(self.server_log)
        return any(
            f.file != log or f.line is None or f.line < self.profile_line
            for f in audit.case_breaking
        )

    def fail(self, reason: str) -> None:
        """The server's case fails, for `reason` (the first failure says in which phase)."""
        if self.status == "passed":
            self.failed_in = PROFILE_PHASE if self.profiling else None
        self.status, self.reason = "failed", reason

    @contextlib.contextmanager
    def timed(self, key: str) -> Iterator[None]:
        """Add the block's wall time to `timings[key]`, however the block ends."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.timings[key] = self.timings.get(key, 0.0) + time.monotonic() - t0

    # -- the steps ---------------------------------------------------------------------------
    def _server(self) -> dict[str, Any]:
        if self.server is None:
            self.server = {}
        return self.server

    def _bring_up(self) -> tuple[str, int, str | None]:
        """Place, start and warm up the case's server: (model path, vocabulary size, API key)."""
        model_path = _model_path(self.case, self.log)
        env = self.engine.serve_env(
            host=self.matrix.host, run_dir=self.dir, extra=self.case.env_dict
        )
        if "TMPDIR" not in self.case.env_dict and not Path(env["TMPDIR"]).is_relative_to(self.dir):
            # serve_env gave this deep case directory a short TMPDIR stand-in (vLLM's IPC
            # socket paths are capped at 107 bytes); it is ours to remove after the case.
            self.short_tmp = Path(env["TMPDIR"])
        # The mark a later run finds a leftover of this one by (orchestrator.cluster.leftovers).
        env.update(run_env(self.store.run_id, self.case_id))
        key = self.engine.api_key(self.case.args, env)
        self._start(model_path, env, key, self._shared_cache_env(model_path))
        vocab = _vocab_size(model_path)
        if self.matrix.warmup_requests:
            self.warm_up(vocab, key)
        return model_path, vocab, key

    def _shared_cache_env(self, model_path: str) -> dict[str, str]:
        """The compile-cache variables of this configuration's shared folder (none where the
        matrix keeps caches per case, or sets them itself): Engine.shared_compile_cache."""
        if self.matrix.engine.compile_cache != "shared":
            return {}
        fingerprint = getattr(self.launcher, "driver_fingerprints", {}).get("fusedq")
        shared, folder = self.engine.shared_compile_cache(self.case, model_path, fingerprint)
        if folder is not None:
            self.compile_cache_dir = str(folder)
        return shared

    def _start(
        self, model_path: str, env: dict[str, str], key: str | None, shared: dict[str, str]
    ) -> None:
        """Place the case and start its server until it is ready; a port lost to another
        process before the server bound it costs a retry on a new port (PORT_ATTEMPTS in all).
        `shared` (compile caches) applies on the driver's node only: the folder is the
        driver's, and elsewhere the launcher keeps caches in that node's case directory."""
        case, launcher = self.case, self.launcher

        def argv_for(port: int, host: str) -> list[str]:
            return self.engine.serve_argv(
                case,
                model_path,
                host=host,
                port=port,
                executable=_absolute_if_path(self.matrix.engine.vllm_bin),
                # The case directory of the node the server runs on (launcher.start has
                # placed it before it asks for the argv).
                profiler_dir=str(Path(self.handle.info["case_dir"]) / PROFILE_DIR)
                if self.matrix.profile is not None
                else None,
            )

        clashes: list[int] = []
        for attempt in range(1, PORT_ATTEMPTS + 1):
            with self.timed("placement_s"):
                self.handle = handle = launcher.place(case, self.matrix.timeouts.placement_s)
            self.server = {k: v for k, v in handle.info.items() if k != "pythonpath"}
            if _is_local_path(model_path) and launcher.missing_paths(handle, [model_path]):
                raise CaseFailed(
                    f"model path {model_path} does not exist on node {handle.info['node_ip']} "
                    f"({handle.info.get('hostname')})"
                )
            try:
                # Start-up time whether the server came up or not: a failed start-up (or a
                # port lost to another process) is the server's time, not the orchestrator's.
                with self.timed("startup_s"):
                    node_env = {**env, **shared}
                    if launcher.is_remote(handle):
                        node_env, self.compile_cache_dir = env, None
                    self.spawned_at = time.time()
                    launcher.start(handle, argv_for, node_env, self.server_log)
                    self.server["argv"] = redact_argv(handle.info["argv"])
                    self.server["port"] = handle.info["port"]
                    self.log(
                        f"{self.case_id}: starting on {handle.info['node_ip']} "
                        f"port {handle.info['port']}"
                    )
                    self.show("starting", server_log=self.server_log)
                    waited = self.engine.wait_ready(
                        handle.base_url,
                        timeout_s=self.matrix.timeouts.ready_s,
                        alive=lambda h=handle: launcher.alive(h),
                        log_path=self.server_log,
                        returncode=lambda h=handle: launcher.exit_code(h),
                        api_key=key,
                    )
                    self.ready_at = time.time()
            except ServerStartError as exc:
                if attempt == PORT_ATTEMPTS or not self.engine.is_port_clash(exc.log_tail):
                    raise
                clashes.append(handle.info["port"])
                self.log(
                    f"{self.case_id}: port {handle.info['port']} was taken by another process "
                    "before the server bound it; starting again on a new port"
                )
                launcher.stop(handle, log_dest=self.server_log)
                self.handle = None
                _set_aside(self.server_log, self.secrets)
                continue
            break
        if clashes:
            self.server["port_clashes"] = clashes
        self.log(f"{self.case_id}: ready after {waited:.1f} s")

    def warm_up(self, vocab: int, key: str | None) -> None:
        """The warm-up requests, after start-up and after a switch server's path flips."""
        # Not measured: on a fresh server the first request pays one-time costs (TP2 on
        # CPU measured 4.6 tok/s on its first ctx0 request against 33 per user after).
        self.show("warm-up")
        timeouts = self.matrix.timeouts
        with self.timed("warmup_s"):
            warm = run_workload(
                self.handle.base_url,
                self.case.model.served_name or self.case.model.label,
                WorkloadParams(
                    "warmup",
                    prompt_tokens=WARMUP_PROMPT_TOKENS,
                    output_tokens=WARMUP_OUTPUT_TOKENS,
                    requests=self.matrix.warmup_requests,
                    # Asking logprobs the first time costs a one-time setup (18 s seen at
                    # MTP 1 on CPU): paid here when a workload will ask them, not in its TTFT.
                    record_tokens=any(w.same_tokens for w in self.matrix.workloads),
                ),
                vocab_size=vocab,
                seed=self.matrix.seed,
                # The one-time costs it absorbs belong to start-up, so it gets start-up's
                # patience: a first request on a fresh CI machine outlasted a 15 s request_s.
                request_timeout_s=max(timeouts.request_s, timeouts.ready_s),
                alive=lambda: self.launcher.alive(self.handle),
                deadline=self.t0 + timeouts.case_s,
                api_key=key,
            )
        self.warmup = {"requests": self.matrix.warmup_requests, "errors": warm.to_dict()["errors"]}

    def _startup(self) -> dict[str, Any] | None:
        """The server's start-up phases from its log (Engine.read_startup), once it stopped."""
        if self.spawned_at is None:
            return None
        record = self.engine.read_startup(
            self.server_log, spawned_at=self.spawned_at, ready_at=self.ready_at
        )
        if record is not None and self.compile_cache_dir is not None:
            record["compile_cache_dir"] = self.compile_cache_dir
        return record

    def _stop(self) -> None:
        """Stop the server (if one was placed), redact its log, remove our temp directory."""
        if self.handle is not None:
            self.show(STOPPING)
            # A server that exited on its own before the stop crashed during the case, however
            # its workloads ended (one SIGKILLed in CI answered all its requests with errors
            # before its pid polled as gone, and was recorded as passed).
            if self.status == "passed":
                self.exited_early = self.launcher.exit_code(self.handle)
            self.stop_line = _line_count(self.server_log) + 1
            with self.timed("stop_s"):
                code = self.launcher.stop(self.handle, log_dest=self.server_log)
            self._server()["exit_code"] = code
        if self.server_log.exists():
            # The server wrote its log itself, secrets included (a wrapper's env dump, a
            # library echoing its token); now that it has stopped, nothing appends to it.
            redact_file(self.server_log, self.secrets)
        if self.short_tmp is not None:
            shutil.rmtree(self.short_tmp, ignore_errors=True)

    def _audit(self) -> AuditSummary:
        """Audit the server log and the kernel log of its node; a fatal finding fails the case,
        and a failed case's reason leads with the root cause found."""
        t0 = time.monotonic()
        expectations = [
            Expectation(pattern=e.pattern, ranks=None, description=e.description or e.pattern)
            for e in [*self.matrix.audit.expect, *self.case.variant.expect]
        ]
        # The kernel log and GPU state of the node the server ran on, wherever that was.
        node_runner = self.launcher.node_runner(self.handle)
        result = audit_logs(
            [self.server_log] if self.server_log.exists() else [],
            since=self.started,
            expectations=expectations,
            include_kernel_log=self.matrix.audit.kernel_log,
            stopped_at={str(self.server_log): self.stop_line} if self.stop_line else None,
            kernel_runner=node_runner,
            gpu_runner=node_runner,
        )
        self.timings["audit_s"] = time.monotonic() - t0
        record = redact(result.to_dict(), self.secrets)
        write_json_atomic(self.dir / AUDIT_RECORD, record)
        audit = AuditSummary.model_validate(record)
        root_cause = audit.root_cause
        if self.status == "failed":
            self.reason = failure_reason(str(self.reason), root_cause, self.tail or "")
        elif audit.case_breaking:
            first = root_cause or audit.case_breaking[0]
            self.fail(
                f"audit: {first.signature} ({first.severity}) at {first.location()}: "
                f"{first.text[:200]}"
            )
        return audit

    def result(
        self,
        audit: AuditSummary,
        same_tokens: dict[str, dict[str, Any]],
        startup: dict[str, Any] | None = None,
    ) -> CaseResult:
        """The server's own row: the case's, or the one a switch server's rows are made of."""
        self.timings["total_s"] = time.monotonic() - self.t0
        row: dict[str, Any] = {
            "schema_version": SCHEMA_VERSION,
            **self.case.to_dict(),
            "started_at": self.started.isoformat(timespec="seconds"),
        }
        if self.server is not None:
            row["server"] = self.server
        if self.warmup is not None:
            row["warmup"] = self.warmup
        if same_tokens:
            row["same_tokens"] = same_tokens
        if self.profile is not None:
            row["profile"] = self.profile
        if startup is not None:
            row["startup"] = startup
        row.update(
            status=self.status,
            reason=self.reason,
            failed_in=self.failed_in,  # set only by fail()
            ended_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            workloads=self.workloads,
            errors=sum(w.errors for w in self.workloads.values()),
            audit=audit,
            timings={k: round(v, 3) for k, v in self.timings.items()},
        )
        return CaseResult.model_validate(row)


# --------------------------------------------------------------------------- helpers


def _model_path(case: Case, log: Callable[[str], None]) -> str:
    if case.model.is_builtin:
        from orchestrator.models.standins import build_standin
        from orchestrator.models.tinymodel import build_tiny_model

        t0 = time.monotonic()
        m = case.model
        if m.is_standin:
            path = build_standin(
                name=m.builtin_name,
                standin_tp=m.stands_for_tp,
                layers=m.builtin_layers,
                experts=m.experts,
                mtp=m.has_mtp,
                weight_format=m.weight_format,
            )
        else:
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
    from orchestrator.models.tinymodel import vocab_size

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
