"""One streamed `/v1/completions` request and its timeline.

`ignore_eos` plus `min_tokens` pin the output length. Every request's timeline is recorded
(start, first token, each streamed chunk with its token count, end, usage) and its answer is
held to the exact-length contract. Only httpx and the standard library are imported.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

# Logprobs asked per position when tokens are recorded: the chosen token and its closest
# rivals. Two were too few: random-weight BF16 models tie three ways
# (orchestrator/client/tokens.py).
TOP_LOGPROBS = 5


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


async def run_request(
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
