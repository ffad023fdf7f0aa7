"""Workload client: streams `/v1/completions` with exact-length token-id prompts and measures.

Prompts are random token ids (seeded, so a rerun sends the same prompts), sent as ids so
the prompt length is exact without a tokenizer; `ignore_eos` plus `min_tokens` pin the
output length. Every request's timeline is recorded (start, first token, each streamed
chunk with its token count, end, usage) and the metrics are computed from those records
alone, so the maths is testable on synthetic records.

Definitions (per repeat; failed requests are excluded from every latency figure):
- aggregate tok/s: output tokens of all successful requests / (last end - first start).
- active per-user tok/s: tokens streamed after each request's first chunk / time after its
  first chunk, summed over the requests (a ratio of sums); it excludes time to first token,
  so a long prefill does not hide decode speed. Not a mean of per-request rates: a starved
  API server (2 busy CPU cores) can flush a whole answer in one burst right after its first
  chunk, and one such request's near-zero time made a mean of rates read 20,324 tok/s.
- TTFT: first token - start. TPOT: (end - first token) / (output_tokens - 1).
- ITL: the gap between consecutive streamed chunks, one value per gap, as `vllm bench
  serve` counts it (with MTP a chunk may carry several tokens).
- E2EL: end-to-end request latency, start to the last chunk (`vllm bench serve`'s E2EL).
- every distribution carries ``n``, the samples behind it (requests, or chunk gaps for ITL);
- chunking: how the tokens reached the client (chunks, tokens per chunk, how many gaps were
  under BURST_GAP_S). An API server short of CPU flushes several chunks at once, so most
  gaps are near zero and one is long: ITL percentiles then describe that flushing, not the
  decode step, and the chunking says so.

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
import itertools
import json
import logging
import math
import random
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, ParamSpec, TypeVar

import httpx

log = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

_MONITOR_S = 0.25  # how often alive() is asked and progress is reported
_DEATH_GRACE_S = 3.0  # after failed requests: how long to watch for the server's death
_PROGRESS_EVERY_S = 1.0
_ERROR_BACKOFF_S = 0.5  # a duration-mode user that failed waits, so errors cannot spin
_PERCENTILES = (50, 90, 99)
# A gap between chunks shorter than this is delivery, not a decode step: no model step on
# any machine here is this fast, so such gaps are chunks the API server flushed together.
BURST_GAP_S = 0.001


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
class RequestRecord:
    """One request's timeline. Times are seconds from the start of its repeat."""

    repeat: int
    index: int
    user: int
    started_at: float  # wall clock (epoch s), to line up with server logs
    start_s: float
    requested_prompt_tokens: int
    requested_output_tokens: int
    first_token_s: float | None = None
    end_s: float | None = None
    chunk_s: list[float] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)
    prompt_tokens: int | None = None  # from usage
    output_tokens: int = 0  # from usage, else counted from chunks
    finish_reason: str | None = None
    error: str | None = None
    # With WorkloadParams.record_tokens: the output token ids, and per position the top
    # TOP_LOGPROBS {token id: logprob} (what tells a near-tie from a real difference).
    token_ids: list[int] | None = None
    top_logprobs: list[dict[int, float]] | None = None

    @property
    def ok(self) -> bool:
        return self.error is None and self.end_s is not None and self.first_token_s is not None


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


# --------------------------------------------------------------------------- prompts


def token_id_range(vocab_size: int) -> tuple[int, int]:
    """[lo, hi) of ids safe for random prompts: tokenizers keep special and control tokens
    at the very start (bos/eos/pad, byte fallbacks) or the very end (chat and tool
    markers, padding rows), so the middle of the vocabulary holds ordinary text tokens."""
    if vocab_size < 64:
        raise ValueError(f"vocab_size={vocab_size} is too small for random prompts")
    return min(vocab_size // 16, 1000), vocab_size * 7 // 8


def make_prompt(n_tokens: int, *, vocab_size: int, seed: int, key: str) -> list[int]:
    """Random ids, the same for the same (seed, key): reruns send identical prompts."""
    lo, hi = token_id_range(vocab_size)
    rng = random.Random(f"{seed}/{key}")
    return [rng.randrange(lo, hi) for _ in range(n_tokens)]


# --------------------------------------------------------------------------- metrics


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default), NaN when empty."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _stats_ms(values_s: Sequence[float]) -> dict[str, float]:
    ms = [v * 1000 for v in values_s]
    out = {f"p{q}": percentile(ms, q) for q in _PERCENTILES}
    out["mean"] = sum(ms) / len(ms) if ms else math.nan
    out["n"] = len(ms)
    return out


def chunking(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """How the successful requests' tokens were streamed: chunks, tokens per chunk (mean and
    largest), chunk gaps, and how many of those were under BURST_GAP_S (see the module
    docstring)."""
    ok = [r for r in records if r["error"] is None]
    sizes = [n for r in ok for n in (r.get("chunk_tokens") or [])]
    gaps = [b - a for r in ok for a, b in itertools.pairwise(r["chunk_s"])]
    return {
        "chunks": len(sizes),
        "tokens_per_chunk_mean": sum(sizes) / len(sizes) if sizes else math.nan,
        "tokens_per_chunk_max": max(sizes, default=0),
        "gaps": len(gaps),
        "gaps_under_1ms": sum(1 for g in gaps if g < BURST_GAP_S),
    }


def _decoding(ok: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Successful requests with a decode phase: more than one token, and time after the first."""
    return [r for r in ok if r["output_tokens"] > 1 and r["end_s"] > r["first_token_s"]]


def latency_metrics(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """TTFT, TPOT and ITL distributions (ms) over the successful requests among `records`.

    Times are differences within one request, so records of several repeats may be pooled:
    a workload's p99 over all its requests is a percentile, a mean of repeats' p99s is not."""
    ok = [r for r in records if r["error"] is None]
    tpot = [(r["end_s"] - r["first_token_s"]) / (r["output_tokens"] - 1) for r in _decoding(ok)]
    return {
        "ttft_ms": _stats_ms([r["first_token_s"] - r["start_s"] for r in ok]),
        "tpot_ms": _stats_ms(tpot),
        "itl_ms": _stats_ms([b - a for r in ok for a, b in itertools.pairwise(r["chunk_s"])]),
        "e2el_ms": _stats_ms([r["end_s"] - r["start_s"] for r in ok]),
    }


def repeat_metrics(records: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The metrics of one repeat from its request records (see the module docstring)."""
    ok = [r for r in records if r["error"] is None]
    out_tokens = sum(r["output_tokens"] for r in ok)
    starts = [r["start_s"] for r in records]
    ends = [r["end_s"] for r in records if r["end_s"] is not None]
    wall = (max(ends) - min(starts)) if starts and ends else 0.0
    decoding = _decoding(ok)
    # Tokens of the first chunk arrived with the first token (older records lack chunk_tokens).
    after_first = sum(r["output_tokens"] - ((r.get("chunk_tokens") or [1])[0]) for r in decoding)
    active_s = sum(r["end_s"] - r["first_token_s"] for r in decoding)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "output_tokens": out_tokens,
        "prompt_tokens": sum(r["prompt_tokens"] or 0 for r in ok),
        "wall_s": wall,
        "aggregate_tok_s": out_tokens / wall if wall > 0 else 0.0,
        "per_user_tok_s": after_first / active_s if active_s > 0 else 0.0,
        **latency_metrics(records),
    }


def mean_of_repeats(repeats: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Field-wise mean of the repeats' metrics (nested percentile dicts too). A
    distribution's sample count ``n`` is summed instead: the samples behind the averaged
    figures, an integer (with MTP, or in duration mode, repeats stream different counts,
    and their mean is fractional)."""
    if not repeats:
        return {}

    def avg(values: list[Any]) -> Any:
        if isinstance(values[0], dict):
            return {k: (total if k == "n" else avg)([v[k] for v in values]) for k in values[0]}
        nums = [float(v) for v in values if not (isinstance(v, float) and math.isnan(v))]
        return sum(nums) / len(nums) if nums else math.nan

    def total(values: list[Any]) -> int | None:
        counts = [int(v) for v in values if v is not None]
        return sum(counts) if counts else None

    keys = [k for k in repeats[0] if k != "repeat"]
    return {k: avg([r[k] for r in repeats]) for k in keys}


# --------------------------------------------------------------------------- client


# Logprobs asked per position when tokens are recorded: the chosen token and its closest
# rivals. Two were too few: random-weight BF16 models tie three ways
# (orchestrator/client/tokens.py).
TOP_LOGPROBS = 5


def request_body(
    model: str, prompt: list[int], output_tokens: int, *, record_tokens: bool = False
) -> dict[str, Any]:
    """The JSON body of one streamed completion with an exact output length."""
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": output_tokens,
        "min_tokens": output_tokens,
        "ignore_eos": True,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
        # Per-chunk token ids (vLLM >= 0.10.2); older servers ignore the field and each
        # chunk then counts as one token, with usage giving the exact total.
        "return_token_ids": True,
    }
    if record_tokens:
        # Top logprobs keyed "token_id:<id>" instead of by text (byte-level BPE pieces are
        # not unique keys).
        body |= {"logprobs": TOP_LOGPROBS, "return_tokens_as_token_ids": True}
    return body


def _token_logprobs(choice: dict[str, Any]) -> list[dict[int, float]]:
    """A streamed choice's top logprobs per position, keyed by token id."""
    tops = (choice.get("logprobs") or {}).get("top_logprobs") or []
    return [
        {int(k.removeprefix("token_id:")): float(v) for k, v in (top or {}).items()} for top in tops
    ]


def _take_chunk(rec: RequestRecord, chunk: dict[str, Any], now: float) -> int:
    """Record one streamed chunk's choices into `rec`; the number of tokens it carried."""
    record = rec.token_ids is not None
    counted = 0
    for choice in chunk.get("choices") or []:
        ids = choice.get("token_ids")
        n = len(ids) if ids is not None else (1 if choice.get("text") else 0)
        if choice.get("finish_reason"):
            rec.finish_reason = choice["finish_reason"]
        if record and ids:
            rec.token_ids.extend(int(i) for i in ids)
            rec.top_logprobs.extend(_token_logprobs(choice))
        if n == 0:
            continue
        if rec.first_token_s is None:
            rec.first_token_s = now
        rec.chunk_s.append(now)
        rec.chunk_tokens.append(n)
        counted += n
    return counted


def _check_answer(rec: RequestRecord, usage: dict[str, Any] | None, counted: int) -> None:
    """Fill `rec`'s token counts from usage (else the streamed count) and hold the answer to
    the exact-length contract: a mismatch means the numbers describe another workload."""
    try:
        rec.output_tokens = int(usage["completion_tokens"]) if usage else counted
        rec.prompt_tokens = int(usage["prompt_tokens"]) if usage else None
    except (KeyError, TypeError, ValueError) as exc:
        rec.error = f"malformed usage {usage!r}: {exc}"[:500]
        return
    problems = []
    if rec.prompt_tokens != rec.requested_prompt_tokens:
        problems.append(f"prompt_tokens {rec.prompt_tokens} != {rec.requested_prompt_tokens}")
    if rec.output_tokens != rec.requested_output_tokens:
        problems.append(f"output_tokens {rec.output_tokens} != {rec.requested_output_tokens}")
    if rec.first_token_s is None:
        problems.append("no token streamed")
    if problems:
        rec.error = "; ".join(problems)


async def _one_request(
    client: httpx.AsyncClient,
    model: str,
    prompt: list[int],
    rec: RequestRecord,
    t0: float,
    timeout_s: float,
    on_tokens: Callable[[int], None],
) -> bool:
    """Run one request into `rec`; True when it ran past `timeout_s`."""
    record = rec.token_ids is not None
    body = request_body(model, prompt, rec.requested_output_tokens, record_tokens=record)
    counted = 0
    usage: dict[str, Any] | None = None

    async def stream() -> None:
        nonlocal counted, usage
        async with client.stream("POST", "/v1/completions", json=body) as resp:
            if resp.status_code != 200:
                text = (await resp.aread()).decode("utf-8", "replace")
                rec.error = f"HTTP {resp.status_code}: {text[:500]}"
                return
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                now = time.monotonic() - t0
                chunk = json.loads(data)
                if chunk.get("usage"):
                    usage = chunk["usage"]
                n = _take_chunk(rec, chunk, now)
                if n:
                    counted += n
                    on_tokens(n)

    timed_out = False
    try:
        await asyncio.wait_for(stream(), timeout_s)
        rec.end_s = time.monotonic() - t0
    except asyncio.TimeoutError:  # not the builtin before Python 3.11
        rec.error = f"request timed out after {timeout_s:.0f} s"
        timed_out = True
    except httpx.TimeoutException as exc:  # httpx's read/connect timeouts may fire first
        rec.error = f"{type(exc).__name__}: no answer within the time limit"
        timed_out = True
    except (httpx.HTTPError, OSError, ValueError, KeyError, TypeError) as exc:
        # ValueError covers malformed JSON; KeyError/TypeError an unexpected chunk shape.
        rec.error = f"{type(exc).__name__}: {exc}"[:500]
    if rec.end_s is None:
        rec.end_s = time.monotonic() - t0
    if rec.error is None:
        _check_answer(rec, usage, counted)
    return timed_out


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
            timed_out = await _one_request(
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
