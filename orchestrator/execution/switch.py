"""The pair on one loaded server: an A/B's switch mode (``ab.mode: switch``).

Instead of a server per variant and start, one `vllm serve` per topology (and ``ab.servers``
start) serves every variant, alternating blocks of the workloads between their decode paths:
no server-to-server noise between the blocks, and one start-up instead of 2N. The server
loads a worker extension (vLLM's ``--worker-extension-cls``, ``ab.extension``: fusedq's
``FusedqWorkerExtension`` by default) and runs with ``VLLM_SERVER_DEV_MODE=1``, which opens
vLLM's dev endpoint ``POST /collective_rpc``. Before each block the orchestrator asks every
worker to run ``fusedq_set_path(path)`` (the worker re-captures its CUDA graphs) and reads
each worker's answer, ``{"path", "recaptured", "seconds", "layers"}``; then
``fusedq_state()``. A block is measured only once every worker has reported the path asked
for; the flip's time is recorded.

The blocks follow ``ab.order``: ABBA (A B B A A B B A ..., which cancels a linear drift of
the server over the run) or alternate (A B A B ...), starting with ``ab.first``. The k-th
block of each variant sends the same prompts (so ``same_tokens`` compares them request by
request), which is why the server runs without prefix caching: the second block of a round
would otherwise find the first's prompts cached.

Each variant gets its own result row (same schema as a server of its own: the blocks are
its repeats, its records in its own case directory), so reports, compare and nightly read a
switch-mode run like any other; the rows share the server's log, audit and start-up, which
live in the server's own case directory. With ``profile:``, each path is profiled on the
same server after the blocks, and each row gets its own traces.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import httpx

from orchestrator.client import tokens
from orchestrator.client.metrics import mean_of_repeats
from orchestrator.client.workload import WorkloadResult
from orchestrator.config.expand import Case
from orchestrator.config.schema import SWITCH_SERVER_VARIANT, Matrix
from orchestrator.engines.vllm import server_metrics
from orchestrator.engines.vllm.server import auth_headers
from orchestrator.execution.case_run import CaseFailed, CaseRun, token_checks
from orchestrator.results.profile_figures import ProfileResult
from orchestrator.results.rows import CaseResult, PathFlip, SwitchRecord
from orchestrator.results.store import RunStore

SET_PATH, STATE = "fusedq_set_path", "fusedq_state"
RPC_PATH = "/collective_rpc"
DEV_MODE_ENV = ("VLLM_SERVER_DEV_MODE", "1")


class SwitchError(CaseFailed):
    """A path flip that failed or was not confirmed by every worker: the case fails."""


def schedule(variants: Sequence[str], blocks: int, order: str, first: str) -> list[str]:
    """The server's blocks in order, by variant (`variants` baseline first): `blocks` rounds
    of one block per variant; ABBA reverses every other round."""
    names = list(variants)
    if first == "candidate":
        names = names[1:] + names[:1]
    out: list[str] = []
    for k in range(blocks):
        out += names if order == "alternate" or k % 2 == 0 else names[::-1]
    return out


def collective_rpc(
    base_url: str,
    method: str,
    args: Sequence[str] = (),
    *,
    timeout_s: float,
    api_key: str | None = None,
) -> list[Any]:
    """POST /collective_rpc: `method` run on every worker; each worker's answer, in rank
    order. SwitchError naming the endpoint and the answer when it is not a list of results."""
    url = base_url.rstrip("/") + RPC_PATH
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, headers=auth_headers(api_key)) as c:
            reply = c.post(url, json={"method": method, "args": list(args)})
    except httpx.HTTPError as exc:
        raise SwitchError(f"POST {url} {method}: {type(exc).__name__}: {exc}") from None
    if reply.status_code != 200:
        hint = {
            404: f" (no dev endpoint: the server needs {DEV_MODE_ENV[0]}=1)",
            500: " (the server log says why: does the worker extension define it?)",
        }.get(reply.status_code, "")
        raise SwitchError(
            f"POST {url} {method}: HTTP {reply.status_code}{hint}: {reply.text[:300]}"
        )
    try:
        results = reply.json()["results"]
    except (ValueError, KeyError, TypeError):
        results = None
    if not isinstance(results, list):
        raise SwitchError(f"POST {url} {method}: not a list of results: {reply.text[:300]}")
    return results


def check_workers(method: str, path: str, results: Sequence[Any], workers: int) -> None:
    """Every one of the server's `workers` must report `path`; SwitchError names the first
    that does not, and what it said."""
    if len(results) != workers:
        raise SwitchError(f"{method}: {len(results)} worker(s) answered; the server has {workers}")
    for rank, answer in enumerate(results):
        if not isinstance(answer, dict) or answer.get("path") != path:
            raise SwitchError(f"{method}({path!r}): worker {rank} reported {answer!r}")


def flip(
    base_url: str, path: str, *, workers: int, block: int, timeout_s: float, api_key: str | None
) -> PathFlip:
    """Set every worker's decode path and confirm it twice: the flip's answers, then the
    workers' state."""
    t0 = time.monotonic()
    answers = collective_rpc(base_url, SET_PATH, [path], timeout_s=timeout_s, api_key=api_key)
    seconds = time.monotonic() - t0
    check_workers(SET_PATH, path, answers, workers)
    state = collective_rpc(base_url, STATE, timeout_s=timeout_s, api_key=api_key)
    check_workers(STATE, path, state, workers)
    return PathFlip(block=block, path=path, seconds=round(seconds, 3), workers=answers)


def block_figures(
    result: WorkloadResult, moved: server_metrics.SpecDecodeCounters | None = None
) -> str:
    """One block's figures for the run log: its repeats' mean output tok/s and TPOT p50, its
    errors, and the MTP acceptance its workload saw (where the counters were read)."""
    mean = mean_of_repeats(result.repeats)
    parts = [f"{mean.get('aggregate_tok_s', math.nan):.2f} tok/s"]
    tpot = (mean.get("tpot_ms") or {}).get("p50")
    if tpot is not None and not math.isnan(tpot):
        parts.append(f"TPOT p50 {tpot:.3f} ms")
    errors = sum(r["error"] is not None for r in result.records)
    if errors:
        parts.append(f"{errors} of {len(result.records)} requests failed")
    rate = moved.acceptance_rate if moved is not None else None
    if rate is not None:
        parts.append(f"MTP acceptance {rate:.3f}")
    return ", ".join(parts)


def server_case(unit: Sequence[Case], matrix: Matrix) -> Case:
    """The one server of `unit` (the variants of one topology and start): the `serve_as`
    variant's args and env, plus the extension, the dev endpoint and no prefix caching."""
    ab = matrix.ab
    assert ab is not None
    by_name = {c.variant.name: c for c in unit}
    baseline = matrix.baseline_variant.name
    name = ab.serve_as or next(n for n in by_name if n != baseline)
    chosen = by_name[name]
    args = (*chosen.args, "--worker-extension-cls", ab.extension, "--no-enable-prefix-caching")
    env = dict(chosen.env)
    env[DEV_MODE_ENV[0]] = DEV_MODE_ENV[1]
    variant = chosen.variant.model_copy(update={"name": SWITCH_SERVER_VARIANT})
    return dataclasses.replace(chosen, variant=variant, args=args, env=tuple(sorted(env.items())))


def measured_units(matrix: Matrix, todo: Sequence[Case], cases: Sequence[Case]) -> list[list[Case]]:
    """What each server measures, in run order: one case each; in switch mode every variant
    of a todo case's topology and start (all of them re-run: blocks of two servers do not
    pair), baseline first."""
    if not matrix.switch_mode:
        return [[c] for c in todo]
    order = [v.name for v in matrix.variants]
    baseline = matrix.baseline_variant.name
    order.sort(key=lambda n: n != baseline)
    units: dict[tuple[str, int | None], list[Case]] = {}
    for c in todo:
        key = (c.topology_id, c.server)
        if key not in units:
            members = [x for x in cases if (x.topology_id, x.server) == key]
            units[key] = sorted(members, key=lambda x: order.index(x.variant.name))
    return list(units.values())


def unit_runner(unit: Sequence[Case], matrix: Matrix, *args: Any) -> CaseRun:
    """The one server of a unit: a case's own (orchestrator.execution.case_run), or a switch server
    measuring every variant. `args`: CaseRun's launcher, store, log, progress, secrets."""
    if matrix.switch_mode:
        return SwitchRun(unit, matrix, *args)
    return CaseRun(unit[0], matrix, *args)


def measure(runner: CaseRun) -> list[CaseResult]:
    """The result rows of a unit's server: one, or a switch server's one per variant."""
    if isinstance(runner, SwitchRun):
        return runner.run_all()
    return [runner.run()]


class _AsCase:
    """A live view (orchestrator.execution.progress.ProgressView) that files every update under one
    case id: the run expects its cases' ids, and a switch server's own is none of them."""

    def __init__(self, view: Any, case_id: str) -> None:
        self.view, self.case_id = view, case_id

    def update(self, _case_id: str, phase: str, *args: Any, **kwargs: Any) -> None:
        self.view.update(self.case_id, phase, *args, **kwargs)


class SwitchRun(CaseRun):
    """One switch-mode server: brought up, audited and stopped as a case (CaseRun), measured
    block by block between path flips, its figures split into one row per variant."""

    def __init__(
        self,
        unit: Sequence[Case],
        matrix: Matrix,
        launcher: Any,
        store: RunStore,
        log: Callable[[str], None],
        progress: Any,
        secrets: tuple[str, ...] = (),
    ) -> None:
        # The live view follows the run's cases: the server shows as the first one it measures.
        view = _AsCase(progress, unit[0].case_id)
        super().__init__(server_case(unit, matrix), matrix, launcher, store, log, view, secrets)
        ab = matrix.ab
        assert ab is not None
        self.ab = ab
        self.unit = {c.variant.name: c for c in unit}
        self.plan = schedule(list(self.unit), ab.blocks, ab.order, ab.first)
        self.results: dict[str, dict[str, list[WorkloadResult]]] = {n: {} for n in self.unit}
        self.flips: dict[str, list[PathFlip]] = {n: [] for n in self.unit}
        self.profiles: dict[str, tuple[ProfileResult, dict[str, int]]] = {}
        # MTP servers: what the spec-decode counters moved in each block, by variant, workload.
        self.spec_decode: dict[str, dict[str, list[server_metrics.SpecDecodeCounters | None]]] = {
            n: {} for n in self.unit
        }

    # -- measuring ---------------------------------------------------------------------------
    def _flip(self, variant: str, block: int, key: str | None) -> None:
        path = self.ab.path_of(variant)
        self.progress.update(self.case_id, f"flip to {path}")
        with self._timed(f"{variant}:flip_s"):
            done = flip(
                self.handle.base_url,
                path,
                workers=self.case.tp,
                block=block,
                timeout_s=self.matrix.timeouts.request_s,
                api_key=key,
            )
        self.flips[variant].append(done)
        self.log(f"{self.case_id}: block {block}: {path} on every worker in {done.seconds:.2f} s")

    def _measure_all(self, model_path: str, vocab: int, key: str | None) -> None:
        rounds: dict[str, int] = dict.fromkeys(self.unit, 0)
        for block, variant in enumerate(self.plan, 1):
            self._flip(variant, block, key)
            if self.matrix.warmup_requests:
                # As after start-up: the first requests on a path just re-captured may pay
                # one-time costs that are not the path's speed.
                self._warm_up(vocab, key)
            for wl in self.matrix.workloads:
                before = self._spec_decode_counters(key)
                result = self._run_measured(
                    wl,
                    vocab,
                    key,
                    slug=self.unit[variant].slug,
                    first_repeat=rounds[variant],
                    phase=f"block {block}/{len(self.plan)} {variant} {wl.name}",
                    timing=f"{variant}:workload_{wl.name}_s",
                )
                self.results[variant].setdefault(wl.name, []).append(result)
                moved = None
                if before is not None:
                    # Read around the workload alone: the warm-up after a flip is not in it.
                    moved = server_metrics.difference(before, self._spec_decode_counters(key))
                    self.spec_decode[variant].setdefault(wl.name, []).append(moved)
                # The rows are made once every block has run: a run stopped before that
                # still has each finished block's figures in its log.
                self.log(
                    f"{self.case_id}: block {block}: {variant} {wl.name}: "
                    f"{block_figures(result, moved)}"
                )
            rounds[variant] += 1
        if self.matrix.profile is not None:
            known: set[str] = set()
            for n, variant in enumerate(self.unit, len(self.plan) + 1):
                self._flip(variant, n, key)
                found = self._profile(model_path, vocab, key, known=known)
                assert self.profile is not None
                self.profiles[variant] = (self.profile, found)
                known |= set(found)

    def _read_traces(self) -> None:
        """Each path's traces into its own row's profile; a trace that cannot be read fails
        the server, naming the file."""
        from orchestrator.analysis.trace import TraceError, read_trace

        for variant, (profile, found) in self.profiles.items():
            self.profile = profile
            with self._timed("trace_read_s"):
                try:
                    traces = [read_trace(self.dir / name) for name in sorted(found)]
                except TraceError as exc:
                    profile.error = str(exc)
                    self._fail(f"profile of {variant}: {exc}")
                    return
            for t in traces:
                t.file = str(Path(t.file).relative_to(self.dir))
            profile.traces = traces

    # -- the rows ----------------------------------------------------------------------------
    def run_all(self) -> list[CaseResult]:
        """Bring the server up, measure, stop and audit it; one row per variant."""
        server = self.run()
        return [self._row(server, i, name) for i, name in enumerate(self.unit)]

    def _workloads(self, variant: str) -> dict[str, Any]:
        out = {}
        for wl in self.matrix.workloads:
            blocks = self.results[variant].get(wl.name)
            if not blocks:
                continue
            repeats = [x for b in blocks for x in b.repeats]
            records = [x for b in blocks for x in b.records]
            params = dataclasses.replace(blocks[0].params, repeats=len(blocks))
            out[wl.name] = WorkloadResult(params, repeats, records).to_dict()
            seen = self._acceptance_seen(variant, wl.name)
            if seen is not None:
                out[wl.name]["spec_decode"] = seen
            self.store.write_records(self.unit[variant].slug, wl.name, records)
        return out

    def _acceptance_seen(self, variant: str, workload: str) -> dict[str, Any] | None:
        """The MTP acceptance a variant's blocks of a workload saw: their counters' moves
        summed (server_metrics.summarize), and each block's own rate."""
        moves = self.spec_decode[variant].get(workload)
        if not moves:
            return None
        seen = server_metrics.summarize(
            server_metrics.total(moves), configured=self._configured_acceptance()
        )
        if seen is None:
            return None
        rates = [m.acceptance_rate if m else None for m in moves]
        seen["block_rates"] = [round(r, 4) if r is not None else None for r in rates]
        self.log(
            f"{self.unit[variant].case_id}: {workload}: MTP acceptance {seen['acceptance_rate']:.3f}"
            f" ({seen['accepted_tokens']}/{seen['draft_tokens']} draft tokens, "
            f"{len(moves)} blocks)"
        )
        return seen

    def _row(self, server: CaseResult, index: int, variant: str) -> CaseResult:
        case = self.unit[variant]
        row = server.to_record()
        row.update(case.to_dict())
        # What the server ran, not the variant's own args: the path was flipped, not served.
        row.update(args=list(self.case.args), env=dict(self.case.env))
        row["workloads"] = self._workloads(variant)
        row["errors"] = sum(w["errors"] for w in row["workloads"].values())
        shared = {k: v for k, v in server.timings.items() if ":" not in k}
        own = {
            k.split(":", 1)[1]: v for k, v in server.timings.items() if k.startswith(f"{variant}:")
        }
        # The server's own time (start-up, stop, audit) counts once, in its first row.
        row["timings"] = {**(shared if index == 0 else {}), **own}
        row["switch"] = SwitchRecord(
            server_case=self.case.case_id,
            path=self.ab.path_of(variant),
            blocks=[i for i, v in enumerate(self.plan, 1) if v == variant],
            schedule=self.plan,
            flips=self.flips[variant],
        ).model_dump(mode="json")
        profile = self.profiles.get(variant)
        if profile is not None:
            row["profile"] = profile[0].model_dump(mode="json")
        else:
            row.pop("profile", None)
        checks = token_checks(case, self.matrix, self.store, row["workloads"])
        row["same_tokens"] = checks
        differs = [c["sentence"] for c in checks.values() if c["verdict"] == tokens.DIFFERS]
        if differs and row["status"] == "passed":
            row.update(status="failed", reason=f"same tokens: {differs[0]}")
        return CaseResult.model_validate(row)
