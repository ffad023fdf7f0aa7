"""Workload client: streams `/v1/completions` with exact-length token-id prompts and measures.

Prompts are random token ids (orchestrator.client.prompts); each request is streamed and its
timeline recorded (orchestrator.client.stream), and the metrics are computed from those
records alone (orchestrator.client.metrics, where each figure is defined).

Modes: `requests` sends that many in total at the given concurrency; `duration_s` runs
`concurrency` users that each issue requests back to back until the duration is over.
Requests still in flight when the duration ends run to completion and count, so wall
time can exceed `duration_s` by up to one request's latency; the rate stays unbiased
because every counted token is inside the measured wall time.

Only httpx and the standard library are imported.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
import time
from collections.abc import Callable, Coroutine
from dataclasses import asdict, dataclass
from typing import Any, ParamSpec, TypeVar

import httpx

from orchestrator.client.metrics import chunking, latency_metrics, mean_of_repeats, repeat_metrics
from orchestrator.client.prompts import make_prompt
from orchestrator.client.stream import RequestRecord, run_request

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

_MONITOR_S = 0.25  # how often alive() is asked and progress is reported
_DEATH_GRACE_S = 3.0  # after failed requests: how long to watch for the server's death
_PROGRESS_EVERY_S = 1.0
_ERROR_BACKOFF_S = 0.5  # a duration-mode user that failed waits, so errors cannot spin


class WorkloadAborted(RuntimeError):
    """A workload stopped before it finished; `records` holds what finished before and
    `noticed_at` (epoch seconds) when the client gave up."""

    def __init__(self, message: str, records: list[dict[str, Any]] | None = None) -> None:
        super().__init__(message)
        self.records = records or []
        self.noticed_at = time.time()


class ServerDiedError(WorkloadAborted):
    """The server process stopped during a workload (the process watch saw it go)."""


class WorkloadTimeoutError(WorkloadAborted):
    """A request ran past the request timeout, or the case past its deadline.

    One timed-out request ends the workload: a server that does not answer within the
    limit is hung or broken, and waiting the limit again for every remaining request
    would cost the night, not the case.
    """


@dataclass(frozen=True)
class WorkloadParams:
    """One workload of a matrix. Exactly one of `requests` and `duration_s` may be set;
    with neither, each of the `concurrency` users sends one request."""

    name: str
    prompt_tokens: int
    output_tokens: int
    concurrency: int = 1
    requests: int | None = None
    duration_s: float | None = None
    repeats: int = 1
    # Keep each request's output token ids and top logprobs (for orchestrator.client.tokens).
    record_tokens: bool = False

    def __post_init__(self) -> None:
        bad = [
            f"{k}={v}"
            for k, v in (
                ("prompt_tokens", self.prompt_tokens),
                ("output_tokens", self.output_tokens),
                ("concurrency", self.concurrency),
                ("repeats", self.repeats),
            )
            if v < 1
        ]
        if self.requests is not None and self.requests < 1:
            bad.append(f"requests={self.requests}")
        if self.duration_s is not None and not self.duration_s > 0:
            bad.append(f"duration_s={self.duration_s}")
        if bad:
            raise ValueError(f"workload {self.name!r}: {', '.join(bad)} must be positive")
        if self.requests is not None and self.duration_s is not None:
            raise ValueError(f"workload {self.name!r}: set requests or duration_s, not both")

    @property
    def total_requests(self) -> int | None:
        """Requests per repeat, or None in duration mode."""
        if self.duration_s is not None:
            return None
        return self.requests if self.requests is not None else self.concurrency


@dataclass
class WorkloadResult:
    params: WorkloadParams
    repeats: list[dict[str, Any]]
    records: list[dict[str, Any]]

    def to_dict(self) -> dict[str, Any]:
        """JSON-safe summary: each repeat's metrics, their mean, totals, first errors.

        Undefined figures (a percentile of no values) are None, not NaN, so strict JSON
        readers accept the summary."""
        errors = [r["error"] for r in self.records if r["error"]]
        return _nan_to_none(
            {
                "name": self.params.name,
                "params": asdict(self.params),
                "repeats": self.repeats,
                "mean": mean_of_repeats(self.repeats),
                # Pooled over every repeat's requests: the figures the summary and reports show.
                "latency": {**latency_metrics(self.records), "chunking": chunking(self.records)},
                "requests": len(self.records),
                "errors": len(errors),
                "error_samples": errors[:5],
            }
        )


def _nan_to_none(obj: Any) -> Any:
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_nan_to_none(v) for v in obj]
    return obj


class _Repeat:
    """One repeat of a workload: `concurrency` users sending requests, and a monitor that
    watches the server and the case deadline and reports progress."""

    def __init__(
        self,
        client: httpx.AsyncClient,
        model: str,
        params: WorkloadParams,
        repeat: int,
        *,
        vocab_size: int,
        seed: int,
        timeout_s: float,
        alive: Callable[[], bool] | None,
        progress: Callable[[dict[str, Any]], None] | None,
        deadline: float | None,
    ) -> None:
        self.client, self.model, self.params, self.repeat = client, model, params, repeat
        self.vocab_size, self.seed, self.timeout_s = vocab_size, seed, timeout_s
        self.alive, self.progress, self.deadline = alive, progress, deadline
        self.records: list[RequestRecord] = []
        self.total = params.total_requests
        self.t0 = time.monotonic()
        self.end_at = self.t0 + params.duration_s if params.duration_s is not None else math.inf
        self.next_index = 0
        self.tokens = 0

    def count(self, n: int) -> None:
        self.tokens += n

    def report(self) -> None:
        if self.progress is None:
            return
        params, records = self.params, self.records
        done = sum(1 for r in records if r.end_s is not None)
        elapsed = time.monotonic() - self.t0
        info = {
            "workload": params.name,
            "repeat": self.repeat + 1,
            "repeats": params.repeats,
            "done": done,
            "total": self.total,
            "errors": sum(1 for r in records if r.error),
            "elapsed_s": round(elapsed, 2),
            "tok_s": round(self.tokens / elapsed, 2) if elapsed > 0 else 0.0,
        }
        if params.duration_s is not None:
            info["duration_s"] = params.duration_s
        try:
            self.progress(info)
        except Exception:  # a broken live view must not cost a measurement
            log.exception("progress callback failed")

    def where(self) -> str:
        done = sum(1 for r in self.records if r.end_s is not None and r.error is None)
        return f"workload {self.params.name!r} (repeat {self.repeat + 1}, {done} requests done)"

    def _next_request(self, u: int) -> tuple[list[int], RequestRecord] | None:
        """The next request's prompt and record for user `u`, or None when the repeat has
        sent enough. The prompt is made before the clock starts: it is not server time."""
        if self.total is not None and self.next_index >= self.total:
            return None
        if time.monotonic() >= self.end_at:
            return None
        i = self.next_index
        self.next_index += 1
        params = self.params
        prompt = make_prompt(
            params.prompt_tokens,
            vocab_size=self.vocab_size,
            seed=self.seed,
            key=f"{params.name}/{self.repeat}/{i}",
        )
        rec = RequestRecord(
            repeat=self.repeat,
            index=i,
            user=u,
            started_at=time.time(),
            start_s=time.monotonic() - self.t0,
            requested_prompt_tokens=params.prompt_tokens,
            requested_output_tokens=params.output_tokens,
            token_ids=[] if params.record_tokens else None,
            top_logprobs=[] if params.record_tokens else None,
        )
        self.records.append(rec)
        return prompt, rec

    async def user(self, u: int) -> None:
        params = self.params
        while (request := self._next_request(u)) is not None:
            prompt, rec = request
            timed_out = await run_request(
                self.client, self.model, prompt, rec, self.t0, self.timeout_s, self.count
            )
            self.report()
            if timed_out:
                raise WorkloadTimeoutError(
                    f"request {rec.index} of workload {params.name!r} (repeat {self.repeat + 1})"
                    f" got no complete answer within the request timeout ({self.timeout_s:.0f} s)"
                )
            if rec.error and params.duration_s is not None:
                await asyncio.sleep(_ERROR_BACKOFF_S)

    async def monitor(self) -> None:
        last = time.monotonic()
        while True:
            await asyncio.sleep(_MONITOR_S)
            if self.alive is not None and not await asyncio.to_thread(self.alive):
                raise ServerDiedError(f"server died during {self.where()}")
            if self.deadline is not None and time.monotonic() > self.deadline:
                raise WorkloadTimeoutError(f"case deadline passed during {self.where()}")
            if time.monotonic() - last >= _PROGRESS_EVERY_S:
                last = time.monotonic()
                self.report()

    async def run(self) -> list[RequestRecord]:
        users = [asyncio.ensure_future(self.user(u)) for u in range(self.params.concurrency)]
        watch = asyncio.ensure_future(self.monitor())
        try:
            pending: set[asyncio.Future[None]] = {*users, watch}
            while not all(u.done() for u in users):
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    # The monitor only ends by raising; a user ends by raising on a timeout.
                    exc = task.exception()
                    if exc is None:
                        continue
                    if isinstance(exc, WorkloadAborted):
                        exc.records = [asdict(r) for r in self.records]
                    raise exc
        finally:
            # Every other user stops too: its numbers would describe a broken server.
            for task in (*users, watch):
                task.cancel()
            await asyncio.gather(*users, watch, return_exceptions=True)
        if self.alive is not None and await _gone(self.alive, self.records):
            # Requests fail faster than the watch polls (a killed server's connections reset
            # and new ones are refused at once): errors from a dead server are not a
            # measurement.
            raise ServerDiedError(
                f"server died during {self.where()}", [asdict(r) for r in self.records]
            )
        self.report()
        return self.records


async def _gone(alive: Callable[[], bool], records: list[RequestRecord]) -> bool:
    """Whether the server is gone once the users are done. When a request failed, keep asking
    for _DEATH_GRACE_S: a SIGKILLed process is not reaped until the kernel has torn it down,
    and on a loaded CI machine its refused connections came back first (all three requests
    failed 0.1 s after the kill while the pid still polled as running)."""
    end = time.monotonic() + (_DEATH_GRACE_S if any(r.error for r in records) else 0.0)
    while True:
        if not await asyncio.to_thread(alive):
            return True
        if time.monotonic() >= end:
            return False
        await asyncio.sleep(0.1)


async def arun_workload(
    base_url: str,
    model: str,
    params: WorkloadParams,
    *,
    vocab_size: int,
    seed: int = 0,
    request_timeout_s: float = 600.0,
    alive: Callable[[], bool] | None = None,
    progress: Callable[[dict[str, Any]], None] | None = None,
    deadline: float | None = None,
    api_key: str | None = None,
    first_repeat: int = 0,
) -> WorkloadResult:
    """`run_workload` for callers that already run an event loop."""
    # One connection per user; trust_env=False keeps proxy variables from routing
    # loopback traffic elsewhere.
    limits = httpx.Limits(max_connections=params.concurrency + 1, max_keepalive_connections=None)
    timeout = httpx.Timeout(request_timeout_s, connect=30.0)
    repeats: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(
        base_url=base_url.rstrip("/"),
        limits=limits,
        timeout=timeout,
        trust_env=False,
        headers=headers,
    ) as client:
        for r in range(first_repeat, first_repeat + params.repeats):
            repeat = _Repeat(
                client,
                model,
                params,
                r,
                vocab_size=vocab_size,
                seed=seed,
                timeout_s=request_timeout_s,
                alive=alive,
                progress=progress,
                deadline=deadline,
            )
            recs = [asdict(x) for x in await repeat.run()]
            records += recs
            repeats.append({"repeat": r + 1, **repeat_metrics(recs)})
    return WorkloadResult(params=params, repeats=repeats, records=records)


def _blocking(fn: Callable[P, Coroutine[Any, Any, R]], name: str, doc: str) -> Callable[P, R]:
    """The blocking form of a coroutine function: the same arguments, run in a new event loop."""

    @functools.wraps(fn)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        return asyncio.run(fn(*args, **kwargs))

    run.__name__ = run.__qualname__ = name
    run.__doc__ = doc
    return run


run_workload = _blocking(
    arun_workload,
    "run_workload",
    """Run `params` against a ready server; each repeat is measured separately.

Raises ServerDiedError within about a second of `alive()` turning False, and
WorkloadTimeoutError when a request runs past `request_timeout_s` or the clock passes
`deadline` (time.monotonic()). `api_key` is sent as a bearer token. Repeats are numbered
from `first_repeat` (0-based in the records, 1-based in the summary), and a repeat's number
picks its prompts: a block of a switch-mode server sends its own. `arun_workload` is the
same for callers that already run an event loop.
""",
)
