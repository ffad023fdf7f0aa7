"""The pair on one loaded server: an A/B's switch mode (``ab.mode: switch``).

Instead of a server per variant and start, one `vllm serve` per topology (and ``ab.servers``
start) serves every variant, alternating blocks of the workloads between their decode paths:
no server-to-server noise between the blocks, and one start-up instead of 2N. The server
loads a worker extension (``ab.extension``: fusedq's ``FusedqWorkerExtension`` by default)
through which the engine reaches every worker (Engine.switch_server; vLLM's dev endpoint
``POST /collective_rpc``: orchestrator.engines.vllm.rpc). Before each block the orchestrator
asks every worker to take the block's path (Engine.set_path: the worker re-captures its CUDA
graphs) and reads each worker's answer, ``{"path", "recaptured", "seconds", "layers"}``; then
every worker's state (Engine.path_state). A block is measured only once every worker has
reported the path asked for; the flip's time is recorded.

The blocks follow ``ab.order`` (orchestrator.plan.units.schedule): abba (rounds ABBA BAAB ...,
each variant's blocks at the same mean position, which cancels a linear drift of the server
over the run) or alternate (A B A B ...), starting with ``ab.first``. Under synthetic MTP
acceptance every worker's random streams are seeded with the round's seed before each block
(``fusedq_seed``), so both blocks of a round draw the same acceptance. The k-th
block of each variant sends the same prompts (so ``same_tokens`` compares them request by
request), which is why the server runs without prefix caching: the second block of a round
would otherwise find the first's prompts cached.

Under a stopping rule (``ab.target_half_width_pct``, orchestrator.analysis.sequential) the
unit's schedule is the worst case, ``ab.max_blocks`` rounds; after ``ab.blocks`` rounds and
every two after, the server looks at the primary figure's interval and may stop there, and
the rows record the blocks that ran.

Each variant gets its own result row (same schema as a server of its own: the blocks are
its repeats, its records in its own case directory), so reports, compare and nightly read a
switch-mode run like any other; the rows share the server's log, audit and start-up, which
live in the server's own case directory. With ``profile:``, each path is profiled on the
same server after the blocks, and each row gets its own traces.

The unit (its variants, its server case, its blocks in order) is the run's plan
(orchestrator.plan.units); ``SwitchBlocks`` is what its server measures once
orchestrator.execution.case_run has brought it up, and the rows it makes of the server's.
"""

from __future__ import annotations

import dataclasses
import math
import time
from typing import Any

from orchestrator.analysis.ab import AB_METRICS, round_pairs
from orchestrator.analysis.sequential import CAP, LOOK_STEP, TARGET, StoppingRule
from orchestrator.client import tokens
from orchestrator.client.metrics import mean_of_repeats
from orchestrator.client.workload import WorkloadResult
from orchestrator.config.schema import Matrix, primary_workload
from orchestrator.engines import Engine, WorkerAnswers, WorkerCallError, spec_decode
from orchestrator.engines.spec_decode import SpecDecodeCounters
from orchestrator.execution.case_run import CaseFailed, CaseRun
from orchestrator.execution.measure import (
    configured_acceptance,
    read_profile_traces,
    run_measured,
    spec_decode_counters,
    take_profile,
    token_checks,
)
from orchestrator.plan.units import Unit
from orchestrator.results.profile_figures import ProfileResult
from orchestrator.results.rows import CaseResult, PathFlip, Repeat, SwitchRecord


class SwitchError(CaseFailed):
    """A path flip that failed or was not confirmed by every worker: the case fails."""


def check_workers(done: WorkerAnswers, path: str, workers: int) -> None:
    """Every one of the server's `workers` must report `path`; SwitchError names the first
    that does not, and what it said."""
    call, answers = done.call, done.answers
    if len(answers) != workers:
        raise SwitchError(f"{call}: {len(answers)} worker(s) answered; the server has {workers}")
    for rank, answer in enumerate(answers):
        if not isinstance(answer, dict) or answer.get("path") != path:
            raise SwitchError(f"{call}({path!r}): worker {rank} reported {answer!r}")


def flip(
    engine: Engine,
    base_url: str,
    path: str,
    *,
    workers: int,
    block: int,
    timeout_s: float,
    api_key: str | None,
) -> PathFlip:
    """Set every worker's decode path through `engine` and confirm it twice: the flip's
    answers, then the workers' state. SwitchError when a call fails or a worker says
    otherwise."""
    t0 = time.monotonic()
    try:
        done = engine.set_path(base_url, path, timeout_s=timeout_s, api_key=api_key)
        seconds = time.monotonic() - t0
        check_workers(done, path, workers)
        state = engine.path_state(base_url, timeout_s=timeout_s, api_key=api_key)
        check_workers(state, path, workers)
    except WorkerCallError as exc:
        raise SwitchError(str(exc)) from None
    return PathFlip(block=block, path=path, seconds=round(seconds, 3), workers=done.answers)


def reseed(
    engine: Engine,
    base_url: str,
    seed: int,
    *,
    workers: int,
    timeout_s: float,
    api_key: str | None,
) -> None:
    """Seed every worker's random streams with `seed` through `engine` (vLLM's synthetic
    acceptance draws from them); SwitchError unless each of the server's `workers` answers
    with that seed."""
    try:
        done = engine.seed_workers(base_url, seed, timeout_s=timeout_s, api_key=api_key)
    except WorkerCallError as exc:
        raise SwitchError(str(exc)) from None
    if len(done.answers) != workers or any(
        not isinstance(a, dict) or a.get("seed") != seed for a in done.answers
    ):
        raise SwitchError(
            f"{done.call}({seed}): the server's {workers} worker(s) answered {done.answers!r}"
        )


def block_figures(result: WorkloadResult, moved: SpecDecodeCounters | None = None) -> str:
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


class SwitchBlocks:
    """A switch unit's measuring: its server (brought up, audited and stopped as a case by
    CaseRun) measured block by block between path flips, its figures split into one row per
    variant."""

    def __init__(self, unit: Unit, matrix: Matrix) -> None:
        ab = matrix.ab
        assert ab is not None
        self.unit, self.matrix, self.ab = unit, matrix, ab
        self.by_variant = {c.variant.name: c for c in unit.cases}
        self.blocks = list(unit.blocks)
        self.results: dict[str, dict[str, list[WorkloadResult]]] = {n: {} for n in self.by_variant}
        self.flips: dict[str, list[PathFlip]] = {n: [] for n in self.by_variant}
        self.profiles: dict[str, tuple[ProfileResult, dict[str, int]]] = {}
        # MTP servers: what the spec-decode counters moved in each block, by variant, workload.
        self.spec_decode: dict[str, dict[str, list[SpecDecodeCounters | None]]] = {
            n: {} for n in self.by_variant
        }
        # ab.target_half_width_pct: the server may stop its rounds at a look.
        self.rule = StoppingRule.of(ab.model_dump(mode="json"))
        # Synthetic acceptance: the seed each variant's blocks started from (the round's).
        synthetic = unit.server.mtp_acceptance is not None
        self.seeds: dict[str, list[int]] | None = (
            {n: [] for n in self.by_variant} if synthetic else None
        )

    # -- measuring ---------------------------------------------------------------------------
    def _flip(self, run: CaseRun, variant: str, block: int, key: str | None) -> None:
        path = self.ab.path_of(variant)
        run.show(f"flip to {path}")
        with run.timed(f"{variant}:flip_s"):
            done = flip(
                run.engine,
                run.handle.base_url,
                path,
                workers=run.case.tp,
                block=block,
                timeout_s=self.matrix.timeouts.request_s,
                api_key=key,
            )
        self.flips[variant].append(done)
        run.log(f"{run.case_id}: block {block}: {path} on every worker in {done.seconds:.2f} s")

    def _reseed(self, run: CaseRun, variant: str, seed: int, key: str | None) -> None:
        # After the warm-up, so the measured workloads are what draws from the seed.
        reseed(
            run.engine,
            run.handle.base_url,
            seed,
            workers=run.case.tp,
            timeout_s=self.matrix.timeouts.request_s,
            api_key=key,
        )
        self.seeds[variant].append(seed)  # type: ignore[index]

    def measure(self, run: CaseRun, model_path: str, vocab: int, key: str | None) -> None:
        """Every block in order, each after its flip (and a warm-up), until the schedule ends
        or the stopping rule stops the rounds at a look; then each path's profile."""
        rounds: dict[str, int] = dict.fromkeys(self.by_variant, 0)
        for block, variant in enumerate(list(self.blocks), 1):
            self._block(run, block, variant, rounds[variant], vocab, key)
            rounds[variant] += 1
            if self._stops_after(run, block):
                # The rows record the blocks that ran, not the worst case planned.
                self.blocks = self.blocks[:block]
                break
        if self.matrix.profile is not None:
            run.enter_profile()
            known: set[str] = set()
            for n, variant in enumerate(self.by_variant, len(self.blocks) + 1):
                self._flip(run, variant, n, key)
                found = take_profile(run, model_path, vocab, key, known=known)
                assert run.profile is not None
                self.profiles[variant] = (run.profile, found)
                known |= set(found)

    def _block(
        self, run: CaseRun, block: int, variant: str, round_: int, vocab: int, key: str | None
    ) -> None:
        """One block: the flip to `variant`'s path, a warm-up, the round's seed, the workloads."""
        self._flip(run, variant, block, key)
        if self.matrix.warmup_requests:
            # As after start-up: the first requests on a path just re-captured may pay
            # one-time costs that are not the path's speed.
            run.warm_up(vocab, key)
        if self.seeds is not None:
            self._reseed(run, variant, self.matrix.seed + round_, key)
        for wl in self.matrix.workloads:
            before = spec_decode_counters(run, key)
            result = run_measured(
                run,
                wl,
                vocab,
                key,
                slug=self.by_variant[variant].slug,
                first_repeat=round_,
                phase=f"block {block}/{len(self.blocks)} {variant} {wl.name}",
                timing=f"{variant}:workload_{wl.name}_s",
            )
            self.results[variant].setdefault(wl.name, []).append(result)
            moved = None
            if before is not None:
                # Read around the workload alone: the warm-up after a flip is not in it.
                moved = spec_decode.difference(before, spec_decode_counters(run, key))
                self.spec_decode[variant].setdefault(wl.name, []).append(moved)
            # The rows are made once every block has run: a run stopped before that still
            # has each finished block's figures in its log.
            run.log(
                f"{run.case_id}: block {block}: {variant} {wl.name}: {block_figures(result, moved)}"
            )

    # -- the stopping rule -------------------------------------------------------------------
    def primary_pairs(self) -> dict[str, list[tuple[int, float, float]]]:
        """Each candidate's rounds so far as pairs of the primary figure, read from the blocks
        as their rows will hold them (the reports recompute the looks from those)."""
        names = [w.name for w in self.matrix.workloads]
        workload = primary_workload(self.ab.primary.workload, names)
        metric = next(m for m in AB_METRICS if m.key == self.ab.primary.metric)

        def figures(variant: str) -> list[float | None]:
            blocks = self.results[variant].get(workload or "", [])
            return [
                metric.of_block(Repeat.model_validate(b.to_dict()["repeats"][0])) for b in blocks
            ]

        base, *cands = self.by_variant
        return {c: round_pairs(figures(base), figures(c)) for c in cands}

    def _stops_after(self, run: CaseRun, block: int) -> bool:
        """Whether the rule stops the rounds after `block`: only at a look, once a round
        ends; the look is logged either way."""
        rule, width = self.rule, len(self.by_variant)
        if rule is None or block % width or block // width not in rule.looks:
            return False
        look = rule.look(block // width, self.primary_pairs())
        stop = rule.stops(look)
        widths = ", ".join(
            f"{c} {'unbounded' if h is None else f'±{h:.3f}%'}" for c, h in look.half_widths.items()
        )
        then = (TARGET if look.reached else CAP) if stop else f"{LOOK_STEP} more rounds"
        run.log(
            f"{run.case_id}: look {rule.looks.index(look.rounds) + 1} of {len(rule.looks)} after "
            f"{look.rounds} rounds: {widths} (target ±{rule.target_pct:g}%, {rule.method}): "
            f"{'stop, ' if stop else ''}{then}"
        )
        return stop

    def read_traces(self, run: CaseRun) -> None:
        """Each path's traces into its own row's profile; a trace that cannot be read fails
        the server, naming the file."""
        for variant, (profile, found) in self.profiles.items():
            paths = [run.dir / name for name in sorted(found)]
            if not read_profile_traces(run, profile, paths, f"profile of {variant}"):
                return

    def same_tokens(self, run: CaseRun) -> dict[str, dict[str, Any]]:
        """None of the server's own row, which measured no workload of its own: each
        variant's row holds its tokens against the baseline's (rows)."""
        return {}

    # -- the rows ----------------------------------------------------------------------------
    def rows(self, run: CaseRun, server: CaseResult) -> list[CaseResult]:
        """One row per variant, made of the server's own."""
        return [self._row(run, server, i, name) for i, name in enumerate(self.by_variant)]

    def _workloads(self, run: CaseRun, variant: str) -> dict[str, Any]:
        out = {}
        for wl in self.matrix.workloads:
            blocks = self.results[variant].get(wl.name)
            if not blocks:
                continue
            repeats = [x for b in blocks for x in b.repeats]
            records = [x for b in blocks for x in b.records]
            params = dataclasses.replace(blocks[0].params, repeats=len(blocks))
            out[wl.name] = WorkloadResult(params, repeats, records).to_dict()
            seen = self._acceptance_seen(run, variant, wl.name)
            if seen is not None:
                out[wl.name]["spec_decode"] = seen
            run.store.write_records(self.by_variant[variant].slug, wl.name, records)
        return out

    def _acceptance_seen(self, run: CaseRun, variant: str, workload: str) -> dict[str, Any] | None:
        """The MTP acceptance a variant's blocks of a workload saw: their counters' moves
        summed (spec_decode.summarize), and each block's own rate."""
        moves = self.spec_decode[variant].get(workload)
        if not moves:
            return None
        seen = spec_decode.summarize(
            spec_decode.total(moves), configured=configured_acceptance(run)
        )
        if seen is None:
            return None
        rates = [m.acceptance_rate if m else None for m in moves]
        seen["block_rates"] = [round(r, 4) if r is not None else None for r in rates]
        run.log(
            f"{self.by_variant[variant].case_id}: {workload}: MTP acceptance "
            f"{seen['acceptance_rate']:.3f} ({seen['accepted_tokens']}/{seen['draft_tokens']} "
            f"draft tokens, {len(moves)} blocks)"
        )
        return seen

    def _row(self, run: CaseRun, server: CaseResult, index: int, variant: str) -> CaseResult:
        case, served = self.by_variant[variant], self.unit.server
        row = server.to_record()
        row.update(case.to_dict())
        # What the server ran, not the variant's own args: the path was flipped, not served.
        row.update(args=list(served.args), env=dict(served.env))
        row["workloads"] = self._workloads(run, variant)
        row["errors"] = sum(w["errors"] for w in row["workloads"].values())
        shared = {k: v for k, v in server.timings.items() if ":" not in k}
        own = {
            k.split(":", 1)[1]: v for k, v in server.timings.items() if k.startswith(f"{variant}:")
        }
        # The server's own time (start-up, stop, audit) counts once, in its first row.
        row["timings"] = {**(shared if index == 0 else {}), **own}
        row["switch"] = SwitchRecord(
            server_case=served.case_id,
            path=self.ab.path_of(variant),
            blocks=[i for i, v in enumerate(self.blocks, 1) if v == variant],
            schedule=self.blocks,
            flips=self.flips[variant],
            seeds=self.seeds[variant] if self.seeds is not None else [],
        ).model_dump(mode="json")
        profile = self.profiles.get(variant)
        if profile is not None:
            row["profile"] = profile[0].model_dump(mode="json")
        else:
            row.pop("profile", None)
        checks = token_checks(
            case, self.matrix, run.store, row["workloads"], reseeded=self.seeds is not None
        )
        row["same_tokens"] = checks
        differs = [c["sentence"] for c in checks.values() if c["verdict"] == tokens.DIFFERS]
        if differs and row["status"] == "passed":
            row.update(status="failed", reason=f"same tokens: {differs[0]}")
        return CaseResult.model_validate(row)
