"""Speculative-decoding counters from a /metrics exposition, and the acceptance a workload saw
between two reads (as `vllm bench serve` computes it)."""

from __future__ import annotations

import http.server
import threading
from collections.abc import Iterator

import pytest

from orchestrator.engines.spec_decode import (
    SpecDecodeCounters,
    acceptance,
    difference,
    summarize,
    total,
)
from orchestrator.engines.vllm.server_metrics import parse_spec_decode, read_spec_decode


def exposition(drafts: float, tokens: float, accepted: float, per_pos: list[float]) -> str:
    """What vLLM's prometheus_client counters print (two engines' worth for the totals)."""
    labels = 'engine="0",model_name="m"'
    out = [
        "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
        "# TYPE vllm:spec_decode_num_drafts_total counter",
        f"vllm:spec_decode_num_drafts_total{{{labels}}} {drafts}",
        f"vllm:spec_decode_num_drafts_created{{{labels}}} 1.7649e+09",
        f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {tokens}",
        f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {accepted}",
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
    ]
    for i, v in enumerate(per_pos):
        out.append(
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{i}"}} {v}'
        )
    return "\n".join(out) + "\n"


def test_parse_sums_the_counters_and_skips_the_rest() -> None:
    c = parse_spec_decode(exposition(10, 20, 11, [7, 4]))
    assert c is not None
    assert (c.drafts, c.draft_tokens, c.accepted_tokens) == (10, 20, 11)
    assert c.accepted_per_position == {0: 7, 1: 4}


def test_a_server_without_speculative_decoding_has_none() -> None:
    assert parse_spec_decode('vllm:num_requests_running{engine="0"} 1.0\n') is None


def test_acceptance_is_the_change_between_reads() -> None:
    before = parse_spec_decode(exposition(10, 20, 11, [7, 4]))
    after = parse_spec_decode(exposition(110, 220, 151, [77, 74]))
    seen = acceptance(before, after, configured=[0.7, 0.49])
    assert seen == {
        "drafts": 100,
        "draft_tokens": 200,
        "accepted_tokens": 140,
        "acceptance_rate": 0.7,
        "acceptance_length": 2.4,
        "per_position": [0.7, 0.7],
        "configured_rates": [0.7, 0.49],
        "expected_rate": 0.595,
    }


def test_no_acceptance_without_two_reads_or_drafts() -> None:
    c = parse_spec_decode(exposition(10, 20, 11, [7]))
    assert acceptance(None, c) is None
    assert acceptance(c, None) is None
    assert acceptance(c, c) is None  # no draft token in between


def test_blocks_sum_to_one_acceptance() -> None:
    """A switch-mode variant's blocks: their moves add up, the rate is the pooled one (not
    the mean of the blocks' rates), and a block not read leaves the variant without one."""
    reads = [parse_spec_decode(exposition(*x)) for x in [
        (0, 0, 0, [0]), (100, 100, 80, [80]),  # a block: 80/100
        (150, 150, 80, [80]),  # the other path's block, between them
        (450, 450, 230, [230]),  # a block: 150/300
    ]]  # fmt: skip
    moves = [difference(reads[0], reads[1]), difference(reads[2], reads[3])]
    assert moves[1] == SpecDecodeCounters(300, 300, 150, {0: 150})
    seen = summarize(total(moves), configured=[0.7])
    assert seen is not None
    assert (seen["drafts"], seen["accepted_tokens"], seen["acceptance_rate"]) == (400, 230, 0.575)
    assert seen["per_position"] == [0.575] and seen["expected_rate"] == 0.7
    assert total([moves[0], None]) is None and total([]) is None
    assert difference(None, reads[0]) is None


class _Metrics(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:
        code = 200 if self.path == "/metrics" else 404
        self.send_response(code)
        self.end_headers()
        self.wfile.write(self.body if code == 200 else b"")

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def server() -> Iterator[str]:
    _Metrics.body = exposition(3, 3, 2, [2]).encode()
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def test_read_from_a_live_endpoint(server: str) -> None:
    c = read_spec_decode(server)
    assert c is not None and c.accepted_tokens == 2


def test_a_server_that_does_not_answer_reads_as_none() -> None:
    assert read_spec_decode("http://127.0.0.1:9", timeout_s=0.5) is None
