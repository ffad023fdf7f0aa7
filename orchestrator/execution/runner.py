"""`orchestrator run`: the loop that turns a matrix into measured, audited result rows.

The run's plan is its units (orchestrator.plan.units): each one server, a case's own or a
switch server measuring every variant of a topology. A unit's life (place it on Ray, start
`vllm serve`, warm it up, measure it, stop it, audit its logs) is one ``CaseRun``
(orchestrator.execution.case_run) with the unit's measuring, and its rows are appended to
results.jsonl before the next unit starts. This module owns what is around the units: the
matrix and the cases selected, the Ray connection, the run directory (its manifest:
orchestrator.execution.manifest; a resume: orchestrator.execution.resume), leftovers of
crashed runs (orchestrator.execution.leftover_check), signals (SIGTERM unwinds like Ctrl-C),
the live view, and the reports when the attempt ends.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from orchestrator.common import probes, safe_io
from orchestrator.common.layout import RUN_LOG, SERVER_LOG
from orchestrator.common.redact import redact, redact_text, secret_args, secret_values
from orchestrator.config.expand import Case, expand
from orchestrator.config.policy import matrix_warnings
from orchestrator.config.schema import Matrix
from orchestrator.execution import interrupted, preflight
from orchestrator.execution.interrupted import RunInterrupted
from orchestrator.execution.leftover_check import LeftoverError, handle_leftovers, marked_environ
from orchestrator.execution.manifest import manifest, now
from orchestrator.execution.resume import left_to_run, open_for_resume
from orchestrator.plan.units import RESTART, SWITCH, run_units
from orchestrator.results.rows import CaseResult
from orchestrator.results.store import RunStore, new_run_id


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
        line = f"{now()} {redact_text(msg, self.secrets)}"
        # Never through a link in the log's place (safe_io.UnsafeFileError, one line).
        safe_io.append_bytes(self.path, (line + "\n").encode("utf-8", "backslashreplace"))
        if self.echo:
            print(line, file=sys.stderr, flush=True)


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


class RunAborted(RuntimeError):
    """A case was measured but its result row could not be made (an orchestrator error, not
    the server's): the run stops with its servers stopped and finished cases kept, and the
    message names the case, the error, where its request records are and how to continue."""


def checked_inputs(
    matrix_path: str | Path, options: RunOptions
) -> tuple[Matrix, list[Case], list[Case], list[str]]:
    """(matrix, its cases, the selected ones, its warnings) once every input check has
    passed, in orchestrator.execution.preflight's order; nothing is started or written before they
    have. The matrix's warnings are printed as soon as it loads, so a run refused later
    still shows them."""
    from orchestrator.cluster.launch import ray_address_for

    preflight.check_flags(
        resume=options.resume, run_id=options.run_id, retry_failed=options.retry_failed
    )
    matrix = preflight.load_for_run(matrix_path, options.sets)
    warnings = _warn(matrix)
    cases = expand(matrix)
    selected = preflight.select(cases, options.only, matrix_path)
    cluster = bool(ray_address_for(matrix, options.ray_address))
    preflight.check_machine(matrix, matrix_path, cluster=cluster)
    if options.resume is None:
        preflight.check_new_run(options.logs_dir, options.run_id)
    return matrix, cases, selected, warnings


def run_matrix(matrix_path: str | Path, options: RunOptions) -> RunSummary:
    """Run (or resume) a matrix and write its reports.

    Bad input (matrix, run id, resume target, cluster too small) raises MatrixError, StoreError,
    LaunchError or ValueError before any server starts and before a new run directory exists.
    """
    t_run = time.monotonic()
    matrix, cases, selected, warnings = checked_inputs(matrix_path, options)
    store = None
    if options.resume:
        store = open_for_resume(options.logs_dir, options.resume, cases, matrix_path)
    torn = store.set_aside_torn_tail() if store is not None else None
    if torn:
        print(f"orchestrator: warning: {torn}", file=sys.stderr, flush=True)
    if store is not None:
        todo, earlier = left_to_run(store, selected, options.retry_failed)
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
    attempt = _Attempt(matrix_path, matrix, cases, selected, options, store, t_run)
    for warning in warnings:
        attempt.log(f"warning: {warning}")
    if torn:
        attempt.log(f"warning: {torn}")
    return attempt.run()


def _warn(matrix: Matrix) -> list[str]:
    """What the matrix does that a reader of the run must know (orchestrator.config.policy:
    servers bound to every interface, env a Ray worker replaces), said before anything
    starts; the run's log gets the same lines."""
    warnings = matrix_warnings(matrix)
    for warning in warnings:
        print(f"orchestrator: warning: {warning}", file=sys.stderr, flush=True)
    return warnings


class _Attempt:
    """One `run` or `--resume` of a matrix, from its leftovers check to its reports."""

    def __init__(
        self,
        matrix_path: str | Path,
        matrix: Matrix,
        cases: list[Case],
        selected: list[Case],
        options: RunOptions,
        store: RunStore | None,
        t_run: float,
    ) -> None:
        self.matrix_path = matrix_path
        self.matrix = matrix
        self.cases = cases
        self.selected = selected
        self.options = options
        self.store = store  # None until a new run's directory is created (_open)
        self.t_run = t_run
        self.run_id = store.run_id if store else options.run_id or new_run_id(matrix.name)
        self.secrets = matrix_secrets(matrix)
        self.summary: RunSummary | None = None
        self.measured = 0.0  # start-up, warm-up and workload seconds: the servers' own time
        self.t_last_case: float | None = None  # when the last finished case's row was written
        self.interrupted: str | None = None  # "SIGTERM", "Ctrl-C": what stopped this attempt
        self.cut_short: dict[str, Any] | None = None  # the case it stopped in the middle of
        self.aborted: dict[str, str] | None = None  # the case whose row could not be made
        self._pending: list[str] = []  # log lines from before the run directory exists
        self._log: _Log | None = None

    def log(self, msg: str) -> None:
        if self._log is not None:
            self._log(msg)
        else:
            self._pending.append(msg)

    def leftovers(self, **where: Any) -> None:
        """handle_leftovers for this attempt (`where`: a cluster's find and stop)."""
        handle_leftovers(
            self.run_id,
            resuming=self.options.resume is not None,
            kill=self.options.kill_leftovers,
            log=self.log,
            **where,
        )

    def run(self) -> RunSummary:
        """Run the attempt; RunInterrupted (a KeyboardInterrupt) once an interrupted run has
        unwound, its reports written."""
        try:
            return self._run()
        except KeyboardInterrupt as exc:
            raise self._interrupted(exc) from None

    def _interrupted(self, exc: KeyboardInterrupt) -> RunInterrupted:
        store = self.store
        done = len(store.finished_case_ids()) if store is not None else 0
        return RunInterrupted(
            self.interrupted or interrupted.how(exc),
            self.run_id,
            store.root if store is not None else None,
            self._resume_command(),
            done,
            len(self.cases),
        )

    def _resume_command(self) -> str:
        o = self.options
        return interrupted.resume_command(
            self.matrix_path,
            self.run_id,
            logs_dir=o.logs_dir,
            sets=o.sets,
            only=o.only,
            ray_address=o.ray_address,
            quiet=not o.progress,
        )

    def _run(self) -> RunSummary:
        from orchestrator.cluster.launch import Launcher, ray_address_for
        from orchestrator.engines import engine_for
        from orchestrator.execution.progress import ProgressView

        # On a cluster every node is scanned once Ray is joined (below); here, this machine.
        cluster = bool(ray_address_for(self.matrix, self.options.ray_address))
        try:
            if not cluster:
                self.leftovers()
        except LeftoverError:
            if self.store is not None:
                self.store.unlock()
            raise
        view = ProgressView(
            total=len(self.selected),
            engine=engine_for(self.matrix.engine.kind),
            enabled=self.options.progress,
            secrets=self.secrets,
        )
        try:
            with (
                marked_environ(self.run_id),
                _explicit_ray_auth(local=not cluster),
                _sigterm_unwinds() as rearm,
            ):
                try:
                    with Launcher(
                        self.matrix, ray_address=self.options.ray_address, log=self.log
                    ) as launcher:
                        rearm()
                        if cluster:
                            nodes = launcher.nodes
                            self.leftovers(find=nodes.find_leftovers, stop=nodes.stop_leftovers)
                        _check_capacity(launcher, self.matrix_path)
                        self._open(launcher)
                        self._run_cases(launcher, view)
                except KeyboardInterrupt as exc:
                    self.interrupted = interrupted.how(exc)
                    self.log(
                        f"interrupted ({self.interrupted}): servers stopped; finished cases kept; "
                        f"continue with: {self._resume_command()}"
                    )
                    raise
        finally:
            view.stop()
            self._finish()
        assert self.summary is not None
        return self.summary

    def _open(self, launcher: Any) -> None:
        """Create the run directory with its manifest, or record this resume in it."""

        def this_attempt() -> dict[str, Any]:
            o = self.options
            args = (self.run_id, self.matrix_path, self.matrix, self.cases)
            return manifest(*args, sets=o.sets, only=o.only, launcher=launcher)

        if self.store is None:
            self.store = RunStore.create(self.options.logs_dir, self.run_id)
            self.store.lock()
            self.store.write_manifest(this_attempt(), self.secrets)
        else:
            saved = self.store.manifest()
            saved["resumes"] = [*saved.get("resumes", []), this_attempt()]
            self.store.write_manifest(saved, self.secrets)
        self._log = _Log(self.store.root / RUN_LOG, echo=False, secrets=self.secrets)
        for line in self._pending:
            self.log(line)

    def _run_cases(self, launcher: Any, view: Any) -> None:
        from orchestrator.execution.case_run import CaseRun
        from orchestrator.execution.measure import EveryWorkloadOnce
        from orchestrator.execution.switch import SwitchBlocks
        from orchestrator.plan.estimate import estimate_run

        # What a unit's server measures, by the unit's kind (orchestrator.plan.units).
        measuring = {RESTART: EveryWorkloadOnce, SWITCH: SwitchBlocks}

        assert self.store is not None
        store = self.store
        todo, earlier = left_to_run(store, self.selected, self.options.retry_failed)
        self.summary = summary = RunSummary(
            run_dir=store.root, skipped=[r.case_id for r in earlier], earlier=earlier
        )
        self.log(
            f"run {store.run_id}: {len(self.cases)} cases, {len(self.selected)} selected, "
            f"{len(todo)} to run, {len(summary.skipped)} already finished"
        )
        estimates = estimate_run(self.matrix, todo).per_case()
        view.expect([c.case_id for c in todo], estimates, done=len(summary.skipped))
        view.start()
        # Where the run is, on screen from its start (an interrupted run repeats it).
        view.note(f"run {store.run_id}: {store.root}")
        for unit in run_units(self.matrix, todo, self.cases):
            view.begin(unit.shown_as)
            for case in unit.cases:
                interrupted.set_aside_mark(store.case_dir(case.slug))
            t_case = time.monotonic()
            how = measuring[unit.kind](unit, self.matrix)
            runner = CaseRun(unit, how, self.matrix, launcher, store, self.log, view, self.secrets)
            try:
                rows = runner.run()
                # Redacted before anything reads it: the summary feeds the CLI's FAILED lines.
                results = [
                    CaseResult.model_validate(redact(r.to_record(), self.secrets)) for r in rows
                ]
            except ValidationError as exc:
                raise self._aborted(unit.cases, exc) from exc
            except KeyboardInterrupt:
                # The server was stopped on the way out; the line its stop began at lets a
                # later `orchestrator audit` discount what that stop made vLLM log.
                stop = runner.stop_line or None
                self._mark_cut_short(
                    runner.case, view.working_phase, time.monotonic() - t_case, stop
                )
                raise
            for result in results:
                store.append_result(result, self.secrets)
                summary.results.append(result)
                t = result.timings
                # The warm-up belongs to bringing the server up, not to the orchestrator.
                self.measured += (
                    t.get("startup_s", 0.0)
                    + t.get("warmup_s", 0.0)
                    + sum(v for k, v in t.items() if k.startswith("workload_"))
                )
                view.finish(result.case_id, result)
            self.t_last_case = time.monotonic()

    def _aborted(self, unit: Sequence[Case], exc: ValidationError) -> RunAborted:
        """The run's stop when `unit` was measured but its row is invalid: said in the log,
        the overhead figures and the case folders (whose request records stay)."""
        assert self.store is not None
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ())) or "?"
        what = f"{where}: {first.get('msg', exc)} (got {first.get('input')!r})"
        folders = ", ".join(str(self.store.case_dir(c.slug)) for c in unit)
        self.aborted = {"case_id": unit[0].case_id, "error": what}
        message = (
            f"{unit[0].case_id}: measured, but its result row is invalid, an orchestrator "
            f"error: {what}. Its server is stopped and its request records are kept in "
            f"{folders}; no row was written. After a fix, continue with: "
            f"{self._resume_command()}"
        )
        for case in unit:
            interrupted.mark_cut_short(
                self.store.case_dir(case.slug),
                {
                    "case_id": case.case_id,
                    "phase": "recording",
                    "error": what,
                    "result": "none: measured, but its row could not be made (an orchestrator "
                    "error); `--resume` runs it again",
                },
            )
        self.log(f"run {self.store.run_id}: stopped: {message}")
        return RunAborted(message)

    def _mark_cut_short(
        self, case: Case, phase: str, seconds: float, stop_line: int | None
    ) -> None:
        """The case an interrupt stopped in the middle: recorded for the reports (overhead
        figures) and in its folder, which holds its logs so far but will have no row."""
        assert self.store is not None
        self.cut_short = {
            "case_id": case.case_id,
            "phase": phase or "placing",
            "s": round(seconds, 3),
        }
        mark = {**self.cut_short, "stopped_at": {SERVER_LOG: stop_line} if stop_line else {}}
        interrupted.mark_cut_short(self.store.case_dir(case.slug), mark)

    def _overhead(self, cases_run: int) -> dict[str, Any]:
        """This attempt's wall time and what of it the servers used (start-up, warm-up,
        workloads). An interrupted attempt is measured up to its last finished case: the
        case it cut short and the unwinding are no case's time, and counted as overhead
        they read as the orchestrator's (34.8 % once, for a case stopped mid-start-up)."""
        end = time.monotonic()
        if self.interrupted or self.aborted:
            end = self.t_last_case if self.t_last_case is not None else self.t_run
        total, measured = end - self.t_run, self.measured
        out: dict[str, Any] = {}
        if cases_run:
            out = {
                "wall_s": round(total, 3),
                "startup_and_measured_s": round(measured, 3),
                "overhead_s": round(total - measured, 3),
                "overhead_pct": round(100.0 * (total - measured) / total, 2) if total else 0.0,
            }
        out["cases_run"] = cases_run
        if self.interrupted:
            out |= interrupted.figures(self.interrupted, self._resume_command(), self.cut_short)
        if self.aborted:
            out |= {"aborted": self.aborted, "resume": self._resume_command()}
        return out

    def _finish(self) -> None:
        """Overhead figures and reports of whatever ran, then the run directory is let go."""
        from orchestrator.reports import write_reports
        from orchestrator.reports.markdown import overhead_sentence

        store, summary = self.store, self.summary
        if store is not None and summary is not None:
            summary.overhead = self._overhead(len(summary.results))
            self.log(f"run {store.run_id}: {overhead_sentence(summary.overhead)}")
            write_reports(store, overhead=summary.overhead, resume=bool(self.options.resume))
        if store is not None:
            store.unlock()


def _check_capacity(launcher: Any, matrix_path: str | Path) -> None:
    """The cluster's nodes against the matrix's topologies, the error naming the matrix."""
    from orchestrator.cluster.launch import LaunchError

    try:
        launcher.check_capacity()
    except LaunchError as exc:
        raise LaunchError(f"{matrix_path}: {exc}") from None


# Ray's switch for token authentication. A new local Ray turns it on when the switch is unset,
# and says so on stderr at every start ("Token authentication is enabled for this Ray
# cluster..."): set, the same mode is taken without the warning.
RAY_AUTH_MODE = "RAY_AUTH_MODE"


@contextlib.contextmanager
def _explicit_ray_auth(*, local: bool) -> Iterator[None]:
    """A local Ray with token authentication on, as Ray chooses by default, said explicitly
    so its start-up warning does not print on every run. A cluster's mode is the cluster's."""
    if not local or RAY_AUTH_MODE in os.environ:
        yield
        return
    os.environ[RAY_AUTH_MODE] = "token"
    try:
        yield
    finally:
        os.environ.pop(RAY_AUTH_MODE, None)


@contextlib.contextmanager
def _sigterm_unwinds() -> Iterator[Callable[[], None]]:
    """SIGTERM (a job scheduler's stop) unwinds like Ctrl-C while the block runs: every server
    stopped, every finished result kept, reports written; Python's default would exit without
    any of it. Yields `rearm`, to call once Ray is up: ray.init() installs its own SIGTERM
    handler (abseil's failure handler then kills the process: no server stopped, no report;
    seen on the H200). Outside the main thread there is no signal to trap."""

    def on_term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt(signal.Signals(signum).name)

    def rearm() -> None:
        if trap:
            signal.signal(signal.SIGTERM, on_term)

    trap = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM)
    rearm()
    try:
        yield rearm
    finally:
        if trap:
            signal.signal(signal.SIGTERM, previous)
