"""orchestrator.switch without vLLM: the block schedule, the switch server's argv and env,
what one server measures (and re-measures on a resume), and the path flip over real HTTP
against a small local stand-in of vLLM's /collective_rpc (the real one is exercised by
test_switch_e2e.py)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from orchestrator.matrix import expand, parse_matrix
from orchestrator.results import CaseResult
from orchestrator.runner import _left_to_run
from orchestrator.store import RunStore
from orchestrator.switch import (
    SET_PATH,
    STATE,
    SwitchError,
    collective_rpc,
    flip,
    measured_units,
    schedule,
    server_case,
)

MATRIX = """\
name: sw
models: [{label: m, path: /models/m, num_heads: 16}]
topologies: [{tp: 2, mtp: [0, 1]}]
workloads: [{name: ctx0, prompt_tokens: 1, output_tokens: 64, requests: 4}]
variants:
  - {name: staged, env: {FUSEDQ_MLA_QUERY: "0"}}
  - {name: fused, env: {FUSEDQ_MLA_QUERY: "1"}, args: [--max-num-seqs=4]}
"""


def _matrix(ab: str):
    return parse_matrix(MATRIX + f"ab: {ab}\n", "sw.yaml")


@pytest.mark.parametrize(
    ("order", "first", "expected"),
    [
        ("abba", "baseline", "A B B A A B"),
        ("alternate", "baseline", "A B A B A B"),
        ("abba", "candidate", "B A A B B A"),
        ("alternate", "candidate", "B A B A B A"),
    ],
)
def test_schedule_is_balanced(order, first, expected):
    assert " ".join(schedule(["A", "B"], 3, order, first)) == expected


def test_schedule_of_three_variants_gives_each_its_blocks():
    plan = schedule(["A", "B", "C"], 4, "abba", "baseline")
    assert plan == list("ABCCBAABCCBA")
    assert all(plan.count(v) == 4 for v in "ABC")


def test_the_switch_server_loads_the_extension_and_opens_the_dev_endpoint():
    m = _matrix("{mode: switch, blocks: 4}")
    cases = expand(m)
    unit = [c for c in cases if c.mtp == 0]
    server = server_case(unit, m)
    # The candidate's args and env (its plugin on), plus what flipping needs.
    assert server.case_id == "m/tp2-dcp1-mtp0/switch/s1"
    assert server.args == (
        "--max-num-seqs=4",
        "--worker-extension-cls",
        "fusedq.vllm_worker_ext.FusedqWorkerExtension",
        "--no-enable-prefix-caching",
    )
    assert server.env_dict == {"FUSEDQ_MLA_QUERY": "1", "VLLM_SERVER_DEV_MODE": "1"}
    staged = server_case(unit, _matrix("{mode: switch, serve_as: staged, extension: a.B}"))
    assert staged.env_dict["FUSEDQ_MLA_QUERY"] == "0" and "a.B" in staged.args


def test_one_server_measures_every_variant_of_its_topology_and_start():
    m = _matrix("{mode: switch, servers: 2}")
    cases = expand(m)
    units = measured_units(m, cases, cases)
    assert [[c.case_id for c in u] for u in units] == [
        [f"m/tp2-dcp1-mtp{k}/{v}/s{s}" for v in ("staged", "fused")] for k in (0, 1) for s in (1, 2)
    ]
    restarts = _matrix("{servers: 2}")
    assert measured_units(restarts, expand(restarts), expand(restarts)) == [
        [c] for c in expand(restarts)
    ]


def _store_with(tmp_path, m, done: dict[str, str]) -> RunStore:
    store = RunStore.create(tmp_path, "r")
    for c in expand(m):
        if c.case_id in done:
            row = {**c.to_dict(), "status": done[c.case_id]}
            store.append_result(CaseResult.model_validate(row))
    return store


def test_resume_of_half_done_restarts_continues_the_rounds(tmp_path):
    m = _matrix("{servers: 3}")
    cases = expand(m)
    done = {
        "m/tp2-dcp1-mtp0/staged/s1": "passed",
        "m/tp2-dcp1-mtp0/fused/s1": "passed",
        "m/tp2-dcp1-mtp0/staged/s2": "failed",
    }
    store = _store_with(tmp_path, m, done)
    todo, earlier = _left_to_run(store, cases, retry_failed=False)
    assert [c.case_id for c in todo][:4] == [
        "m/tp2-dcp1-mtp0/fused/s2",
        "m/tp2-dcp1-mtp0/staged/s3",
        "m/tp2-dcp1-mtp0/fused/s3",
        "m/tp2-dcp1-mtp1/staged/s1",
    ]
    assert len(earlier) == 3
    again, _ = _left_to_run(store, cases, retry_failed=True)
    assert again[0].case_id == "m/tp2-dcp1-mtp0/staged/s2"


def test_resume_of_a_half_written_switch_server_measures_the_pair_again(tmp_path):
    # The run stopped after the staged row of the first server was written: its blocks pair
    # with the fused blocks of that server only, so the whole server runs again.
    m = _matrix("{mode: switch}")
    cases = expand(m)
    store = _store_with(tmp_path, m, {"m/tp2-dcp1-mtp0/staged/s1": "passed"})
    todo, _ = _left_to_run(store, cases, retry_failed=False)
    units = measured_units(m, todo, cases)
    assert [[c.case_id for c in u] for u in units] == [
        ["m/tp2-dcp1-mtp0/staged/s1", "m/tp2-dcp1-mtp0/fused/s1"],
        ["m/tp2-dcp1-mtp1/staged/s1", "m/tp2-dcp1-mtp1/fused/s1"],
    ]


# --------------------------------------------------------------------------- the RPC


class _Rpc(BaseHTTPRequestHandler):
    """vLLM's dev endpoint as the orchestrator sees it: one answer per worker."""

    def do_POST(self) -> None:
        state = self.server.state  # type: ignore[attr-defined]
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        state["calls"].append((self.path, body, self.headers.get("Authorization")))
        mode = state["mode"]
        if self.path != "/collective_rpc" or mode == "no-dev-mode":
            return self._send(404, {"detail": "Not Found"})
        if mode == "no-extension":
            return self._send(500, {"detail": "Internal Server Error"})
        if body["method"] == SET_PATH:
            state["path"] = body["args"][0]
        answer = {"path": state["path"], "recaptured": True, "seconds": 1.9, "layers": 78}
        if mode == "lies" and body["method"] == STATE:
            answer = {"path": "staged"}
        workers = state["workers"] - (1 if mode == "short" else 0)
        self._send(200, {"results": [dict(answer) for _ in range(workers)]})

    def _send(self, code: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def rpc() -> Iterator[tuple[str, dict]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Rpc)
    server.state = {"calls": [], "mode": "ok", "path": None, "workers": 2}  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_port}", server.state  # type: ignore[attr-defined]
    finally:
        server.shutdown()
        server.server_close()


def test_a_flip_asks_every_worker_and_confirms_the_state(rpc):
    url, state = rpc
    done = flip(url, "fused", workers=2, block=3, timeout_s=5, api_key="k3y")
    assert done.path == "fused" and done.block == 3 and done.seconds >= 0
    assert done.workers == [{"path": "fused", "recaptured": True, "seconds": 1.9, "layers": 78}] * 2
    assert done.worker_seconds == 1.9
    assert [(p, b) for p, b, _ in state["calls"]] == [
        ("/collective_rpc", {"method": SET_PATH, "args": ["fused"]}),
        ("/collective_rpc", {"method": STATE, "args": []}),
    ]
    assert {auth for _, _, auth in state["calls"]} == {"Bearer k3y"}


@pytest.mark.parametrize(
    ("mode", "message"),
    [
        ("lies", r"fusedq_state\('fused'\): worker 0 reported \{'path': 'staged'\}"),
        ("short", r"fusedq_set_path: 1 worker\(s\) answered; the server has 2"),
        ("no-dev-mode", r"HTTP 404 \(no dev endpoint: the server needs VLLM_SERVER_DEV_MODE=1\)"),
        ("no-extension", r"HTTP 500 \(the server log says why"),
    ],
)
def test_a_flip_not_confirmed_by_every_worker_fails(rpc, mode, message):
    url, state = rpc
    state["mode"] = mode
    with pytest.raises(SwitchError, match=message):
        flip(url, "fused", workers=2, block=1, timeout_s=5, api_key=None)


def test_an_unreachable_server_is_named():
    with pytest.raises(SwitchError, match=r"POST http://127.0.0.1:9/collective_rpc fusedq_state"):
        collective_rpc("http://127.0.0.1:9", STATE, timeout_s=2)
