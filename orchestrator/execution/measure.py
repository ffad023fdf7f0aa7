"""What a ready server measures: its workloads, its speculative-decoding counters, the
profile phase and its traces, and the same-tokens check of a row against its baseline.

Each step is a function of the server's ``CaseRun`` (orchestrator.execution.case_run), which
keeps their time and state. ``EveryWorkloadOnce`` is a restart unit's measuring (a case on a
server of its own: every workload once, then the profile phase); a switch unit's is
orchestrator.execution.switch's ``SwitchBlocks``, which measures with the same steps.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from orchestrator.client import tokens
from orchestrator.client.workload import (
    WorkloadAborted,
    WorkloadParams,
    WorkloadResult,
    run_workload,
)
from orchestrator.config.axes import WorkloadSpec
from orchestrator.config.expand import Case
from orchestrator.config.schema import Matrix
from orchestrator.engines import spec_decode
from orchestrator.engines.spec_decode import SpecDecodeCounters
from orchestrator.execution.case_run import PROFILE_DIR, CaseFailed, CaseRun
from orchestrator.plan.units import Unit
from orchestrator.results.profile_figures import ProfileResult
from orchestrator.results.rows import CaseResult, WorkloadSummary
from orchestrator.results.store import RunStore

# A trace file is complete when every rank's is there and no size changed for this long (a
# worker gzips its trace in /stop_profile; a remote node's disk may lag the answer).
TRACE_SETTLE_S = 2.0


class EveryWorkloadOnce:
    """A restart unit's measuring: every workload once on the case's own server, then the
    profile phase; the case's row is the server's."""

    def __init__(self, unit: Unit, matrix: Matrix) -> None:
        self.unit, self.matrix = unit, matrix

    def measure(self, run: CaseRun, model_path: str, vocab: int, key: str | None) -> None:
        """The measurements of a ready server: every workload, then the profile phase."""
        for wl in self.matrix.workloads:
            self._measure(run, wl, vocab, key)
        if self.matrix.profile is not None:
            # After the workloads: the profiler's overhead never touches a measured figure.
            run.enter_profile()
            take_profile(run, model_path, vocab, key)

    def _measure(self, run: CaseRun, wl: WorkloadSpec, vocab: int, key: str | None) -> None:
        before = spec_decode_counters(run, key)
        result = run_measured(run, wl, vocab, key, slug=run.case.slug)
        seen = self._spec_decode_seen(run, before, key)
        summary = WorkloadSummary.model_validate(
            {**result.to_dict(), **({"spec_decode": seen} if seen else {})}
        )
        run.workloads[wl.name] = summary
        run.store.write_records(run.case.slug, wl.name, result.records)
        run.log(
            f"{run.case_id}: {wl.name}: {summary.mean.aggregate_tok_s or 0.0:.2f} tok/s "
            f"aggregate, {summary.mean.per_user_tok_s or 0.0:.2f} per user, "
            f"errors {summary.errors}"
        )

    def _spec_decode_seen(
        self, run: CaseRun, before: SpecDecodeCounters | None, key: str | None
    ) -> dict[str, Any] | None:
        """The acceptance a workload saw: the counters' change since `before` (as `vllm bench
        serve` reports it), with the synthetic rates configured where there are some."""
        if before is None:
            return None
        seen = spec_decode.acceptance(
            before, spec_decode_counters(run, key), configured=configured_acceptance(run)
        )
        if seen is not None:
            run.log(
                f"{run.case_id}: MTP acceptance {seen['acceptance_rate']:.3f} "
                f"({seen['accepted_tokens']}/{seen['draft_tokens']} draft tokens)"
            )
        return seen

    def read_traces(self, run: CaseRun) -> None:
        """Each rank's figures (orchestrator.analysis.trace), from the traces now in the run's
        case directory; a trace that cannot be read fails the case, naming the file."""
        from orchestrator.analysis.trace import find_rank_traces

        profile = run.profile
        assert profile is not None
        if not read_profile_traces(
            run, profile, find_rank_traces(run.dir / PROFILE_DIR), "profile"
        ):
            return
        if len(profile.traces) < run.case.tp:
            profile.error = f"{len(profile.traces)} of {run.case.tp} rank traces came home"
            run.fail(f"profile: {profile.error}")

    def same_tokens(self, run: CaseRun) -> dict[str, dict[str, Any]]:
        """The case's tokens against its baseline variant's (token_checks)."""
        return token_checks(run.case, self.matrix, run.store, run.workloads)

    def rows(self, run: CaseRun, server: CaseResult) -> list[CaseResult]:
        """The case's one row: its server's."""
        return [server]


def run_measured(
    run: CaseRun,
    wl: WorkloadSpec,
    vocab: int,
    key: str | None,
    *,
    slug: str,
    first_repeat: int = 0,
    phase: str | None = None,
    timing: str | None = None,
) -> WorkloadResult:
    """Run one measured workload on `run`'s server (`first_repeat`: the number its repeats
    count from, which picks their prompts); a fault keeps what finished as `slug`'s records
    and raises."""
    matrix = run.matrix
    deadline = run.t0 + matrix.timeouts.case_s
    if time.monotonic() > deadline:
        raise CaseFailed(f"case timeout ({matrix.timeouts.case_s:.0f} s) before {wl.name}")
    phase = phase or wl.name
    run.show(phase)
    # Measured time even when the workload ends in a fault: it was spent measuring.
    with run.timed(timing or f"workload_{wl.name}_s"):
        try:
            return run_workload(
                run.handle.base_url,
                run.case.model.served_name or run.case.model.label,
                _workload_params(wl),
                vocab_size=vocab,
                seed=matrix.seed,
                request_timeout_s=matrix.timeouts.request_s,
                alive=lambda: run.launcher.alive(run.handle),
                progress=lambda p: run.show(phase, p),
                deadline=deadline,
                api_key=key,
                first_repeat=first_repeat,
            )
        except WorkloadAborted as exc:
            # What finished before the fault is evidence; keep it beside the log.
            run.store.write_records(slug, wl.name, exc.records)
            raise


def spec_decode_counters(run: CaseRun, key: str | None) -> SpecDecodeCounters | None:
    """The server's speculative-decoding counters now (MTP cases only)."""
    if run.case.mtp == 0:
        return None
    return run.engine.spec_decode_counters(run.handle.base_url, api_key=key)


def configured_acceptance(run: CaseRun) -> list[float] | None:
    """The synthetic per-position acceptance rates `run`'s server was given by its engine."""
    case = run.case
    if case.mtp_acceptance is None:
        return None
    return run.engine.acceptance_rates(case.mtp, case.mtp_acceptance)


def take_profile(
    run: CaseRun, model_path: str, vocab: int, key: str | None, known: Collection[str] = ()
) -> dict[str, int]:
    """Profile exactly `decode_steps` model steps of one request, alone on the server, and
    wait until every rank's trace is written (orchestrator.analysis.trace reads them after
    the stop, once a remote node's files are home): `run.profile`, and the new trace files
    and their sizes (`known`: an earlier profile's, on a switch-mode server)."""
    matrix = run.matrix
    spec = matrix.profile
    assert spec is not None
    run.show("profile")
    run.profile = ProfileResult(
        decode_steps=spec.decode_steps,
        prompt_tokens=spec.prompt_tokens,
        layers=_query_layers(run.case, model_path),
        dir=PROFILE_DIR,
    )
    timeout = matrix.timeouts.request_s
    base_url = run.handle.base_url
    with run.timed("profile_s"):
        try:
            run.engine.profile_request(base_url, "start", timeout_s=timeout, api_key=key)
            profiled = run_workload(
                base_url,
                run.case.model.served_name or run.case.model.label,
                WorkloadParams(
                    "profile",
                    prompt_tokens=spec.prompt_tokens,
                    output_tokens=spec.decode_steps,
                    requests=1,
                ),
                vocab_size=vocab,
                seed=matrix.seed,
                request_timeout_s=timeout,
                alive=lambda: run.launcher.alive(run.handle),
                deadline=run.t0 + matrix.timeouts.case_s,
                api_key=key,
            )
            run.engine.profile_request(base_url, "stop", timeout_s=timeout, api_key=key)
        except RuntimeError as exc:
            raise CaseFailed(f"profile: {exc}") from None
        summary = profiled.to_dict()
        if summary["errors"]:
            first = (summary.get("error_samples") or ["?"])[0]
            raise CaseFailed(f"profile: the profiled request failed: {first}")
        found = _wait_for_traces(run, spec.wait_s, known)
    run.log(f"{run.case_id}: profile: {len(found)} rank trace(s) written")
    return found


def _wait_for_traces(run: CaseRun, wait_s: float, known: Collection[str] = ()) -> dict[str, int]:
    """The ranks' trace files (other than the `known` ones of an earlier profile of this
    server), once there is one per rank and none has grown for TRACE_SETTLE_S;
    CaseFailed naming what is missing after `wait_s`."""
    from orchestrator.analysis.trace import RANK_TRACE

    tp = run.case.tp
    deadline = time.monotonic() + wait_s
    last: dict[str, int] = {}
    steady_since = time.monotonic()
    while True:
        files = {
            name: size
            for name, size in run.launcher.case_files(run.handle).items()
            if name.startswith(f"{PROFILE_DIR}/")
            and RANK_TRACE.match(Path(name).name)
            and name not in known
        }
        if files != last:
            last, steady_since = files, time.monotonic()
        elif len(files) >= tp and time.monotonic() - steady_since >= TRACE_SETTLE_S:
            return files
        if time.monotonic() > deadline:
            raise CaseFailed(
                f"profile: {len(files)} of {tp} rank traces written "
                f"{wait_s:g} s after /stop_profile ({sorted(files) or 'none'})"
            )
        time.sleep(0.5)


def token_checks(
    case: Case,
    matrix: Matrix,
    store: RunStore,
    workloads: Mapping[str, Any],
    *,
    reseeded: bool = False,
) -> dict[str, dict[str, Any]]:
    """For each measured ``same_tokens`` workload: this case's tokens against those of the
    baseline variant of its topology (``{}`` for the baseline itself), or, for tokens that
    cannot agree by construction (tokens.not_compared), why they were not compared.
    ``reseeded``: a switch server that seeded its workers with each round's seed."""
    first = matrix.baseline_variant if matrix.variants else None
    if first is None or case.variant.name == first.name:
        return {}
    reference = replace(case, variant=first)
    why_not = tokens.not_compared(
        mtp=case.mtp,
        mtp_acceptance=case.mtp_acceptance,
        switch=matrix.switch_mode,
        reseeded=reseeded,
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


def read_profile_traces(
    run: CaseRun, profile: ProfileResult, paths: Iterable[Path], what: str
) -> bool:
    """The figures of the traces at ``paths`` (orchestrator.analysis.trace) into ``profile``,
    each file named relative to the case directory (the run directory may move). A trace that
    cannot be read fails the case, naming the file after ``what``: False then."""
    from orchestrator.analysis.trace import TraceError, read_trace

    with run.timed("trace_read_s"):
        try:
            traces = [read_trace(p) for p in paths]
        except TraceError as exc:
            profile.error = str(exc)
            run.fail(f"{what}: {exc}")
            return False
    for t in traces:
        t.file = str(Path(t.file).relative_to(run.dir))
    profile.traces = traces
    return True
