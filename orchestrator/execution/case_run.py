"""One case's life: place, start, warm up, measure, stop, audit, result.

``CaseRun(...).run()`` always returns a ``CaseResult``, failed or not: a fault costs its case,
never the run (orchestrator.execution.runner loops over the cases). Each step is a call into the
module that owns it (launch for Ray, engines.vllm for the server, workload for the client, audit for
the logs); this class sequences them, keeps their time, and turns what went wrong into the
case's reason, leading with the root cause the audit found.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import shutil
import time
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Protocol

from orchestrator.audit import Expectation, audit_logs
from orchestrator.client import tokens
from orchestrator.client.workload import (
    ServerDiedError,
    WorkloadAborted,
    WorkloadParams,
    WorkloadResult,
    WorkloadTimeoutError,
    run_workload,
)
from orchestrator.cluster.leftovers import run_env
from orchestrator.common.redact import redact, redact_argv, redact_file
from orchestrator.config.expand import Case
from orchestrator.config.schema import (
    WARMUP_OUTPUT_TOKENS,
    WARMUP_PROMPT_TOKENS,
    Matrix,
    WorkloadSpec,
)
from orchestrator.engines.vllm import compile_cache, server_metrics
from orchestrator.engines.vllm.server import (
    ServerStartError,
    api_key,
    auth_headers,
    describe_exit,
    is_port_clash,
    log_tail,
    profile_request,
    serve_argv,
    serve_env,
    synthetic_acceptance_rates,
    wait_ready,
)
from orchestrator.engines.vllm.startup import read_startup
from orchestrator.execution.progress import STOPPING
from orchestrator.results.profile_figures import ProfileResult
from orchestrator.results.rows import SCHEMA_VERSION, CaseResult, WorkloadSummary
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
# A trace file is complete when every rank's is there and no size changed for this long (a
# worker gzips its trace in /stop_profile; a remote node's disk may lag the answer).
TRACE_SETTLE_S = 2.0


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


class CaseRun:
    """One case, from placement to its result row. Use once: ``CaseRun(...).run()``.

    `secrets` are scrubbed from the server log once the server has stopped, before the
    audit reads it, and from the audit record. `progress` is the live view
    (orchestrator.execution.progress.ProgressView: update(case_id, phase, ...)).
    """

    def __init__(
        self,
        case: Case,
        matrix: Matrix,
        launcher: Any,
        store: RunStore,
        log: Callable[[str], None],
        progress: Any,
        secrets: tuple[str, ...] = (),
    ) -> None:
        self.case, self.matrix, self.launcher, self.store = case, matrix, launcher, store
        self.log, self.progress, self.secrets = log, progress, secrets
        self.dir = store.case_dir(case.slug)
        self.server_log = self.dir / "server.log"
        self.timings: dict[str, float] = {}
        self.server: dict[str, Any] | None = None  # node facts, argv, port, exit code
        self.warmup: dict[str, int] | None = None
        self.workloads: dict[str, WorkloadSummary] = {}
        self.profile: ProfileResult | None = None
        self.status, self.reason = "passed", None
        # The server's last words, for a case whose server ended on its own (None: not shown).
        self.tail: str | None = None
        self.handle: Any = None
        self.exited_early: int | None = None  # the server's exit code if it went before the stop
        self.stop_line = 0  # the first log line written after the stop began
        self.short_tmp: Path | None = None  # a TMPDIR stand-in of ours to remove afterwards
        # Start-up: when the process was started and /v1/models answered (epoch seconds),
        # and the shared compile-cache folder it was given
        # (orchestrator.engines.vllm.compile_cache).
        self.spawned_at: float | None = None
        self.ready_at: float | None = None
        self.compile_cache_dir: str | None = None
        self.started = dt.datetime.now(dt.timezone.utc)
        self.t0 = time.monotonic()

    @property
    def case_id(self) -> str:
        return self.case.case_id

    def run(self) -> CaseResult:
        """Place, start, measure, stop and audit the case; always a result, failed or not."""
        earlier = _set_aside(self.server_log, self.secrets)
        if earlier is not None:
            self.log(f"{self.case_id}: the log of an earlier attempt is kept as {earlier.name}")
        self.started = dt.datetime.now(dt.timezone.utc)
        self.t0 = time.monotonic()
        try:
            self._serve_and_measure()
        except ServerDiedError as exc:
            # When the watch saw it go: a test (and a reader) can hold it against the kill time.
            self._server()["died_noticed_at"] = round(exc.noticed_at, 3)
            self._fail(f"{exc}: {self.launcher.describe_end(self.handle)}")
            self.tail = ""  # read once the stop has brought the log home
        except WorkloadTimeoutError as exc:
            t = self.matrix.timeouts
            self._fail(f"{exc} (timeouts: request_s={t.request_s:g}, case_s={t.case_s:g})")
        except ServerStartError as exc:
            # The tail as it was when the server gave up, before the stop added its own lines.
            self._fail(exc.reason)
            self.tail = exc.log_tail
        except CaseFailed as exc:
            self._fail(str(exc))
        except Exception as exc:  # LaunchError and anything unexpected: the run goes on
            self._fail(f"{type(exc).__name__}: {exc}")
        finally:
            self._stop()
        startup = self._startup()
        if self.profile is not None and self.status == "passed":
            self._read_traces()
        if self.status == "passed" and self.exited_early is not None:
            how = describe_exit(self.exited_early)
            self._fail(f"server process {how} before the orchestrator stopped it")
            self.tail = ""
        if self.tail == "" and self.server_log.exists():
            self.tail = log_tail(self.server_log)
        # The audit runs on every case, failed or not: a fault explains a failure, and a fault
        # in a case that produced numbers must fail it anyway.
        audit = self._audit()
        same_tokens = token_checks(self.case, self.matrix, self.store, self.workloads)
        differs = [c["sentence"] for c in same_tokens.values() if c["verdict"] == tokens.DIFFERS]
        if differs and self.status == "passed":
            self._fail(f"same tokens: {differs[0]}")
        if self.status == "failed":
            self.log(f"{self.case_id}: FAILED: {self.reason}")
        return self._result(audit, same_tokens, startup)

    # -- the steps ---------------------------------------------------------------------------
    def _fail(self, reason: str) -> None:
        self.status, self.reason = "failed", reason

    def _server(self) -> dict[str, Any]:
        if self.server is None:
            self.server = {}
        return self.server

    @contextlib.contextmanager
    def _timed(self, key: str) -> Iterator[None]:
        """Add the block's wall time to `timings[key]`, however the block ends."""
        t0 = time.monotonic()
        try:
            yield
        finally:
            self.timings[key] = self.timings.get(key, 0.0) + time.monotonic() - t0

    def _serve_and_measure(self) -> None:
        self._measure_all(*self._bring_up())

    def _measure_all(self, model_path: str, vocab: int, key: str | None) -> None:
        """The measurements of a ready server: every workload, then the profile phase."""
        for wl in self.matrix.workloads:
            self._measure(wl, vocab, key)
        if self.matrix.profile is not None:
            # After the workloads: the profiler's overhead never touches a measured figure.
            self._profile(model_path, vocab, key)

    def _bring_up(self) -> tuple[str, int, str | None]:
        """Place, start and warm up the case's server: (model path, vocabulary size, API key)."""
        model_path = _model_path(self.case, self.log)
        env = serve_env({}, host=self.matrix.host, run_dir=self.dir, extra=self.case.env_dict)
        if "TMPDIR" not in self.case.env_dict and not Path(env["TMPDIR"]).is_relative_to(self.dir):
            # serve_env gave this deep case directory a short TMPDIR stand-in (vLLM's IPC
            # socket paths are capped at 107 bytes); it is ours to remove after the case.
            self.short_tmp = Path(env["TMPDIR"])
        # The mark a later run finds a leftover of this one by (orchestrator.cluster.leftovers).
        env.update(run_env(self.store.run_id, self.case_id))
        key = api_key(self.case.args, env)
        self._start(model_path, env, key, self._shared_cache_env(model_path))
        vocab = _vocab_size(model_path)
        if self.matrix.warmup_requests:
            self._warm_up(vocab, key)
        return model_path, vocab, key

    def _shared_cache_env(self, model_path: str) -> dict[str, str]:
        """The compile-cache variables of this configuration's shared folder (none where the
        matrix keeps caches per case, or sets them itself), its model-class inspections
        linked to those of every configuration: orchestrator.engines.vllm.compile_cache."""
        if self.matrix.engine.compile_cache != "shared":
            return {}
        fingerprint = getattr(self.launcher, "driver_fingerprints", {}).get("fusedq")
        shared = compile_cache.shared_env(self.case, model_path, fingerprint)
        if shared:
            self.compile_cache_dir = str(
                compile_cache.shared_dir(self.case, model_path, fingerprint)
            )
        if "VLLM_CACHE_ROOT" in shared:
            compile_cache.share_model_info(Path(shared["VLLM_CACHE_ROOT"]))
        return shared

    def _start(
        self, model_path: str, env: dict[str, str], key: str | None, shared: dict[str, str]
    ) -> None:
        """Place the case and start its server until it is ready; a port lost to another
        process before vLLM bound it costs a retry on a new port (PORT_ATTEMPTS in all).
        `shared` (compile caches) applies on the driver's node only: the folder is the
        driver's, and elsewhere the launcher keeps caches in that node's case directory."""
        case, launcher = self.case, self.launcher

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
                vllm_bin=_absolute_if_path(self.matrix.engine.vllm_bin),
                # The case directory of the node the server runs on (launcher.start has
                # placed it before it asks for the argv).
                profiler_dir=str(Path(self.handle.info["case_dir"]) / PROFILE_DIR)
                if self.matrix.profile is not None
                else None,
                mtp_acceptance=case.mtp_acceptance,
            )

        clashes: list[int] = []
        for attempt in range(1, PORT_ATTEMPTS + 1):
            with self._timed("placement_s"):
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
                with self._timed("startup_s"):
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
                    self.progress.update(self.case_id, "starting", server_log=self.server_log)
                    waited = wait_ready(
                        handle.base_url,
                        timeout_s=self.matrix.timeouts.ready_s,
                        alive=lambda h=handle: launcher.alive(h),
                        log_path=self.server_log,
                        returncode=lambda h=handle: launcher.exit_code(h),
                        api_key=key,
                    )
                    self.ready_at = time.time()
            except ServerStartError as exc:
                if attempt == PORT_ATTEMPTS or not is_port_clash(exc.log_tail):
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

    def _warm_up(self, vocab: int, key: str | None) -> None:
        # Not measured: on a fresh server the first request pays one-time costs (TP2 on
        # CPU measured 4.6 tok/s on its first ctx0 request against 33 per user after).
        self.progress.update(self.case_id, "warm-up")
        timeouts = self.matrix.timeouts
        with self._timed("warmup_s"):
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

    def _measure(self, wl: WorkloadSpec, vocab: int, key: str | None) -> None:
        before = self._spec_decode_counters(key)
        result = self._run_measured(wl, vocab, key, slug=self.case.slug)
        seen = self._spec_decode_seen(before, key)
        summary = WorkloadSummary.model_validate(
            {**result.to_dict(), **({"spec_decode": seen} if seen else {})}
        )
        self.workloads[wl.name] = summary
        self.store.write_records(self.case.slug, wl.name, result.records)
        self.log(
            f"{self.case_id}: {wl.name}: {summary.mean.aggregate_tok_s or 0.0:.2f} tok/s "
            f"aggregate, {summary.mean.per_user_tok_s or 0.0:.2f} per user, "
            f"errors {summary.errors}"
        )

    def _run_measured(
        self,
        wl: WorkloadSpec,
        vocab: int,
        key: str | None,
        *,
        slug: str,
        first_repeat: int = 0,
        phase: str | None = None,
        timing: str | None = None,
    ) -> WorkloadResult:
        """Run one measured workload (`first_repeat`: the number its repeats count from, which
        picks their prompts); a fault keeps what finished as `slug`'s records and raises."""
        deadline = self.t0 + self.matrix.timeouts.case_s
        if time.monotonic() > deadline:
            raise CaseFailed(f"case timeout ({self.matrix.timeouts.case_s:.0f} s) before {wl.name}")
        phase = phase or wl.name
        self.progress.update(self.case_id, phase)
        # Measured time even when the workload ends in a fault: it was spent measuring.
        with self._timed(timing or f"workload_{wl.name}_s"):
            try:
                return run_workload(
                    self.handle.base_url,
                    self.case.model.served_name or self.case.model.label,
                    _workload_params(wl),
                    vocab_size=vocab,
                    seed=self.matrix.seed,
                    request_timeout_s=self.matrix.timeouts.request_s,
                    alive=lambda: self.launcher.alive(self.handle),
                    progress=lambda p: self.progress.update(self.case_id, phase, p),
                    deadline=deadline,
                    api_key=key,
                    first_repeat=first_repeat,
                )
            except WorkloadAborted as exc:
                # What finished before the fault is evidence; keep it beside the log.
                self.store.write_records(slug, wl.name, exc.records)
                raise

    def _spec_decode_counters(self, key: str | None) -> server_metrics.SpecDecodeCounters | None:
        """The server's speculative-decoding counters now (MTP cases only)."""
        if self.case.mtp == 0:
            return None
        return server_metrics.read_spec_decode(self.handle.base_url, headers=auth_headers(key))

    def _spec_decode_seen(
        self, before: server_metrics.SpecDecodeCounters | None, key: str | None
    ) -> dict[str, Any] | None:
        """The acceptance a workload saw: the counters' change since `before` (as `vllm bench
        serve` reports it), with the synthetic rates configured where there are some."""
        if before is None:
            return None
        seen = server_metrics.acceptance(
            before, self._spec_decode_counters(key), configured=self._configured_acceptance()
        )
        if seen is not None:
            self.log(
                f"{self.case_id}: MTP acceptance {seen['acceptance_rate']:.3f} "
                f"({seen['accepted_tokens']}/{seen['draft_tokens']} draft tokens)"
            )
        return seen

    def _configured_acceptance(self) -> list[float] | None:
        """vLLM's synthetic per-position acceptance rates this case's server was given."""
        if self.case.mtp_acceptance is None:
            return None
        return synthetic_acceptance_rates(self.case.mtp, self.case.mtp_acceptance)

    def _startup(self) -> dict[str, Any] | None:
        """The server's start-up phases from its log (orchestrator.engines.vllm.startup), once it
        stopped."""
        if self.spawned_at is None:
            return None
        record = read_startup(self.server_log, spawned_at=self.spawned_at, ready_at=self.ready_at)
        if record is not None and self.compile_cache_dir is not None:
            record["compile_cache_dir"] = self.compile_cache_dir
        return record

    def _profile(
        self, model_path: str, vocab: int, key: str | None, known: Collection[str] = ()
    ) -> dict[str, int]:
        """Profile exactly `decode_steps` model steps of one request, alone on the server, and
        wait until every rank's trace is written (orchestrator.analysis.trace reads them after the
        stop, once a remote node's files are home); the new trace files and their sizes
        (`known`: an earlier profile's, on a switch-mode server)."""
        spec = self.matrix.profile
        assert spec is not None
        self.progress.update(self.case_id, "profile")
        self.profile = ProfileResult(
            decode_steps=spec.decode_steps,
            prompt_tokens=spec.prompt_tokens,
            layers=_query_layers(self.case, model_path),
            dir=PROFILE_DIR,
        )
        timeout = self.matrix.timeouts.request_s
        with self._timed("profile_s"):
            try:
                profile_request(self.handle.base_url, "start", timeout_s=timeout, api_key=key)
                run = run_workload(
                    self.handle.base_url,
                    self.case.model.served_name or self.case.model.label,
                    WorkloadParams(
                        "profile",
                        prompt_tokens=spec.prompt_tokens,
                        output_tokens=spec.decode_steps,
                        requests=1,
                    ),
                    vocab_size=vocab,
                    seed=self.matrix.seed,
                    request_timeout_s=timeout,
                    alive=lambda: self.launcher.alive(self.handle),
                    deadline=self.t0 + self.matrix.timeouts.case_s,
                    api_key=key,
                )
                profile_request(self.handle.base_url, "stop", timeout_s=timeout, api_key=key)
            except RuntimeError as exc:
                raise CaseFailed(f"profile: {exc}") from None
            summary = run.to_dict()
            if summary["errors"]:
                first = (summary.get("error_samples") or ["?"])[0]
                raise CaseFailed(f"profile: the profiled request failed: {first}")
            found = self._wait_for_traces(spec.wait_s, known)
        self.log(f"{self.case_id}: profile: {len(found)} rank trace(s) written")
        return found

    def _wait_for_traces(self, wait_s: float, known: Collection[str] = ()) -> dict[str, int]:
        """The ranks' trace files (other than the `known` ones of an earlier profile of this
        server), once there is one per rank and none has grown for TRACE_SETTLE_S;
        CaseFailed naming what is missing after `wait_s`."""
        from orchestrator.analysis.trace import RANK_TRACE

        deadline = time.monotonic() + wait_s
        last: dict[str, int] = {}
        steady_since = time.monotonic()
        while True:
            files = {
                name: size
                for name, size in self.launcher.case_files(self.handle).items()
                if name.startswith(f"{PROFILE_DIR}/")
                and RANK_TRACE.match(Path(name).name)
                and name not in known
            }
            if files != last:
                last, steady_since = files, time.monotonic()
            elif len(files) >= self.case.tp and time.monotonic() - steady_since >= TRACE_SETTLE_S:
                return files
            if time.monotonic() > deadline:
                raise CaseFailed(
                    f"profile: {len(files)} of {self.case.tp} rank traces written "
                    f"{wait_s:g} s after /stop_profile ({sorted(files) or 'none'})"
                )
            time.sleep(0.5)

    def _read_traces(self) -> None:
        """Each rank's figures (orchestrator.analysis.trace), from the traces now in the run's case
        directory; a trace that cannot be read fails the case, naming the file."""
        from orchestrator.analysis.trace import TraceError, find_rank_traces, read_trace

        assert self.profile is not None
        with self._timed("trace_read_s"):
            try:
                traces = [read_trace(p) for p in find_rank_traces(self.dir / PROFILE_DIR)]
            except TraceError as exc:
                self.profile.error = str(exc)
                self._fail(f"profile: {exc}")
                return
        for t in traces:
            # Relative to the case directory: the run directory may move.
            t.file = str(Path(t.file).relative_to(self.dir))
        self.profile.traces = traces
        if len(traces) < self.case.tp:
            self.profile.error = f"{len(traces)} of {self.case.tp} rank traces came home"
            self._fail(f"profile: {self.profile.error}")

    def _stop(self) -> None:
        """Stop the server (if one was placed), redact its log, remove our temp directory."""
        if self.handle is not None:
            self.progress.update(self.case_id, STOPPING)
            # A server that exited on its own before the stop crashed during the case, however
            # its workloads ended (one SIGKILLed in CI answered all its requests with errors
            # before its pid polled as gone, and was recorded as passed).
            if self.status == "passed":
                self.exited_early = self.launcher.exit_code(self.handle)
            self.stop_line = _line_count(self.server_log) + 1
            with self._timed("stop_s"):
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
        write_json_atomic(self.dir / "audit.json", record)
        audit = AuditSummary.model_validate(record)
        root_cause = audit.root_cause
        if self.status == "failed":
            self.reason = failure_reason(str(self.reason), root_cause, self.tail or "")
        elif audit.case_breaking:
            first = root_cause or audit.case_breaking[0]
            self._fail(
                f"audit: {first.signature} ({first.severity}) at {first.location()}: "
                f"{first.text[:200]}"
            )
        return audit

    def _result(
        self,
        audit: AuditSummary,
        same_tokens: dict[str, dict[str, Any]],
        startup: dict[str, Any] | None = None,
    ) -> CaseResult:
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
            ended_at=dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            workloads=self.workloads,
            errors=sum(w.errors for w in self.workloads.values()),
            audit=audit,
            timings={k: round(v, 3) for k, v in self.timings.items()},
        )
        return CaseResult.model_validate(row)


def token_checks(
    case: Case, matrix: Matrix, store: RunStore, workloads: Mapping[str, Any]
) -> dict[str, dict[str, Any]]:
    """For each measured ``same_tokens`` workload: this case's tokens against those of the
    baseline variant of its topology (``{}`` for the baseline itself), or, for tokens that
    cannot agree by construction (tokens.not_compared), why they were not compared."""
    first = matrix.baseline_variant if matrix.variants else None
    if first is None or case.variant.name == first.name:
        return {}
    reference = replace(case, variant=first)
    why_not = tokens.not_compared(
        mtp=case.mtp,
        mtp_acceptance=case.mtp_acceptance,
        switch=matrix.switch_mode,
    )
    checks: dict[str, dict[str, Any]] = {}
    for wl in matrix.workloads:
        if not wl.same_tokens or wl.name not in workloads:
            continue
        if why_not is not None:
            checks[wl.name] = {
                "reference": reference.case_id,
                "verdict": tokens.NOT_COMPARED,
                "why": why_not,
                "sentence": f"{case.variant.name} vs {first.name}: not compared: {why_not}",
            }
            continue
        if not store.records_path(reference.slug, wl.name).is_file():
            checks[wl.name] = {
                "reference": reference.case_id,
                "verdict": tokens.NO_REFERENCE,
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


# --------------------------------------------------------------------------- helpers


def _workload_params(w: WorkloadSpec) -> WorkloadParams:
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


def _query_layers(case: Case, model_path: str) -> int | None:
    """Query steps one model step runs: the decoder layers, plus one MTP draft pass per
    speculative token (each runs the MTP layer's attention); None where the model's config
    cannot be read (a hub id)."""
    try:
        cfg = json.loads((Path(model_path) / "config.json").read_text())
        layers = int(cfg.get("num_hidden_layers") or cfg["text_config"]["num_hidden_layers"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return layers + case.mtp


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
