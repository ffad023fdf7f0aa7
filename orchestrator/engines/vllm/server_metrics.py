"""vLLM's speculative-decoding counters, read from its Prometheus endpoint.

vLLM counts drafts, draft tokens and accepted tokens (``vllm:spec_decode_num_drafts``,
``..._num_draft_tokens``, ``..._num_accepted_tokens``, and ``..._num_accepted_tokens_per_pos``
by ``position``) in ``/metrics``, 0.26 and 0.32 alike (vllm/v1/spec_decode/metrics.py). What
a workload saw of them is engine-neutral arithmetic: orchestrator.engines.spec_decode.

Only httpx (imported when a server is read) and the standard library.
"""

from __future__ import annotations

import re

from orchestrator.engines.spec_decode import SpecDecodeCounters

PREFIX = "vllm:spec_decode_num_"
_SAMPLE = re.compile(
    r"^(?P<name>vllm:spec_decode_num_\w+?)_total(?:\{(?P<labels>[^}]*)\})? (?P<value>\S+)$"
)
_POSITION = re.compile(r'position="(?P<pos>\d+)"')


def parse_spec_decode(text: str) -> SpecDecodeCounters | None:
    """The counters in a Prometheus text exposition; None where it has none (a server
    without speculative decoding)."""
    found = False
    c = SpecDecodeCounters()
    for line in text.splitlines():
        m = _SAMPLE.match(line.strip())
        if m is None:
            continue
        try:
            value = float(m["value"])
        except ValueError:
            continue
        found = True
        name = m["name"][len(PREFIX) :]
        if name == "drafts":
            c.drafts += value
        elif name == "draft_tokens":
            c.draft_tokens += value
        elif name == "accepted_tokens":
            c.accepted_tokens += value
        elif name == "accepted_tokens_per_pos":
            pos = _POSITION.search(m["labels"] or "")
            if pos is not None:
                i = int(pos["pos"])
                c.accepted_per_position[i] = c.accepted_per_position.get(i, 0.0) + value
    return c if found else None


def read_spec_decode(
    base_url: str, *, timeout_s: float = 10.0, headers: dict[str, str] | None = None
) -> SpecDecodeCounters | None:
    """GET /metrics and parse it; None where the server has no such counters or does not
    answer (acceptance is then not reported, and the workload's figures stand)."""
    import httpx  # not at import: the CLI's plan path reaches this engine without a server

    url = base_url.rstrip("/") + "/metrics"
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, headers=headers or {}) as client:
            reply = client.get(url)
    except httpx.HTTPError:
        return None
    if reply.status_code != 200:
        return None
    return parse_spec_decode(reply.text)
