"""Switch mode without vLLM: the block schedule, the switch server's argv and env and what one
server measures (and re-measures on a resume), all orchestrator.plan.units'; the rows
orchestrator.execution.switch makes of the server's, and the path flip over real HTTP against
a small local stand-in of vLLM's /collective_rpc (the real one is exercised by
test_switch_e2e.py)."""

from __future__ import annotations

import itertools
import json
import threading
import types
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from orchestrator.analysis.paired import drift_offset, order_text
from orchestrator.client import tokens
from orchestrator.client.metrics import repeat_metrics
from orchestrator.client.workload import WorkloadParams, WorkloadResult
from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix
from orchestrator.engines import WorkerCallError, engine_for
from orchestrator.engines.spec_decode import SpecDecodeCounters as Moved
from orchestrator.engines.vllm.rpc import SEED, SET_PATH, STATE
from orchestrator.execution.case_run import CaseRun
from orchestrator.execution.resume import left_to_run
from orchestrator.execution.switch import SwitchBlocks, SwitchError, flip, reseed
from orchestrator.plan.render import plan_matrix
from orchestrator.plan.units import RESTART, SWITCH, Unit, run_units, schedule, server_case
from orchestrator.results.rows import CaseResult
from orchestrator.results.store import RunStore
from orchestrator.results.stored_audit import AuditSummary

VLLM = engine_for("vllm")

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


def _position_sums(plan: list[str]) -> dict[str, int]:
    sums: dict[str, int] = {}
    for i, v in enumerate(plan, 1):
        sums[v] = sums.get(v, 0) + i
    return sums


@pytest.mark.parametrize("blocks", range(1, 9))
@pytest.mark.parametrize("first", ["baseline", "candidate"])
def test_abba_balances_every_even_block_count_and_no_order_balances_an_odd_one(blocks, first):
    plan = schedule(["A", "B"], blocks, "abba", first)
    # Rounds: each pair of positions holds one block of each variant.
    assert all(sorted(plan[i : i + 2]) == ["A", "B"] for i in range(0, len(plan), 2))
    sums = _position_sums(plan)
    if blocks % 2 == 0:
        assert sums["A"] == sums["B"]  # equal mean position: a linear drift cancels
    else:
        # No arrangement of b blocks of each variant can balance: checked exhaustively.
        total = blocks * (2 * blocks + 1)
        assert not any(
            2 * sum(c) == total for c in itertools.combinations(range(1, 2 * blocks + 1), blocks)
        )
        assert abs(sums["A"] - sums["B"]) == 1  # the nearest to balance there is


def test_abba_rounds_follow_thue_morse():
    # Round k mirrors when k has an odd number of binary ones: A B, B A, B A, A B, B A, A B,
    # A B, B A. Over four rounds the sums of squared positions agree too (quadratic drift).
    plan = schedule(["A", "B"], 8, "abba", "baseline")
    assert "".join(plan) == "ABBABAABBAABABBA"
    four = schedule(["A", "B"], 4, "abba", "baseline")
    squares = {v: sum(i * i for i, x in enumerate(four, 1) if x == v) for v in "AB"}
    assert squares["A"] == squares["B"]
    assert "".join(schedule(["A", "B"], 4, "abba", "candidate")) == "BAABABBA"


@pytest.mark.parametrize("blocks", range(1, 9))
def test_alternate_is_never_balanced(blocks):
    plan = schedule(["A", "B"], blocks, "alternate", "baseline")
    assert "".join(plan) == "AB" * blocks
    sums = _position_sums(plan)
    assert sums["B"] - sums["A"] == blocks  # B one block later in every round


@pytest.mark.parametrize("blocks", [2, 4, 6, 8])
def test_three_variants_are_balanced_pair_by_pair(blocks):
    plan = schedule(["A", "B", "C"], blocks, "abba", "baseline")
    assert all(plan.count(v) == blocks for v in "ABC")
    assert all(sorted(plan[i : i + 3]) == list("ABC") for i in range(0, len(plan), 3))
    assert len(set(_position_sums(plan).values())) == 1
    if blocks == 4:
        assert plan == list("ABCCBACBAABC")


def test_the_drift_a_recorded_order_leaves_in_the_change():
    # Three ABBA rounds (the committed H200 runs): staged at 1, 4, 5, fused at 2, 3, 6.
    ran = ["staged", "fused", "fused", "staged", "staged", "fused"]
    assert drift_offset(ran, "staged", "fused") == pytest.approx(1 / 3)
    assert drift_offset(ran[:4], "staged", "fused") == 0
    assert drift_offset(ran, "staged", "other") is None
    assert order_text(ran, ["staged", "fused"]) == "ABBA AB (A staged, B fused)"
    assert order_text(ran[2:], ["staged", "fused"]) == "BAAB (A staged, B fused)"


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
        "fusedq.vllm.worker_ext.FusedqWorkerExtension",
        "--no-enable-prefix-caching",
    )
    assert server.env_dict == {"FUSEDQ_MLA_QUERY": "1", "VLLM_SERVER_DEV_MODE": "1"}
    staged = server_case(unit, _matrix("{mode: switch, serve_as: staged, extension: a.B}"))
    assert staged.env_dict["FUSEDQ_MLA_QUERY"] == "0" and "a.B" in staged.args


def test_one_server_measures_every_variant_of_its_topology_and_start():
    m = _matrix("{mode: switch, servers: 2}")
    cases = expand(m)
    units = run_units(m, cases, cases)
    assert [[c.case_id for c in u.cases] for u in units] == [
        [f"m/tp2-dcp1-mtp{k}/{v}/s{s}" for v in ("staged", "fused")] for k in (0, 1) for s in (1, 2)
    ]
    assert {u.kind for u in units} == {SWITCH}
    assert units[0].server == server_case(units[0].cases, m)
    assert units[0].blocks == tuple(schedule(["staged", "fused"], 8, "abba", "baseline"))
    assert units[1].shown_as == "m/tp2-dcp1-mtp0/staged/s2"
    restarts = _matrix("{servers: 2}")
    assert run_units(restarts, expand(restarts), expand(restarts)) == [
        Unit(RESTART, c, (c,)) for c in expand(restarts)
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
    todo, earlier = left_to_run(store, cases, retry_failed=False)
    assert [c.case_id for c in todo][:4] == [
        "m/tp2-dcp1-mtp0/fused/s2",
        "m/tp2-dcp1-mtp0/staged/s3",
        "m/tp2-dcp1-mtp0/fused/s3",
        "m/tp2-dcp1-mtp1/staged/s1",
    ]
    assert len(earlier) == 3
    again, _ = left_to_run(store, cases, retry_failed=True)
    assert again[0].case_id == "m/tp2-dcp1-mtp0/staged/s2"


def test_resume_of_a_half_written_switch_server_measures_the_pair_again(tmp_path):
    # The run stopped after the staged row of the first server was written: its blocks pair
    # with the fused blocks of that server only, so the whole server runs again.
    m = _matrix("{mode: switch}")
    cases = expand(m)
    store = _store_with(tmp_path, m, {"m/tp2-dcp1-mtp0/staged/s1": "passed"})
    todo, _ = left_to_run(store, cases, retry_failed=False)
    units = run_units(m, todo, cases)
    assert [[c.case_id for c in u.cases] for u in units] == [
        ["m/tp2-dcp1-mtp0/staged/s1", "m/tp2-dcp1-mtp0/fused/s1"],
        ["m/tp2-dcp1-mtp1/staged/s1", "m/tp2-dcp1-mtp1/fused/s1"],
    ]


# --------------------------------------------------------------------------- same tokens

SAME_TOKENS = """\
name: sw
models: [{label: m, path: /models/m, num_heads: 16}]
topologies: [{tp: 1, mtp: [0, 1], mtp_acceptance: 0.7}]
workloads: [{name: greedy, prompt_tokens: 8, output_tokens: 3, requests: 2, same_tokens: true}]
variants: [{name: staged}, {name: fused}]
"""


def _greedy(ids: list[int], block: int) -> WorkloadResult:
    """One block's greedy workload: two requests that each answered `ids`."""
    records = [
        {"repeat": block, "index": i, "token_ids": ids, "top_logprobs": [{t: -0.5} for t in ids],
         "start_s": 0.0, "first_token_s": 0.1, "end_s": 0.3, "chunk_s": [0.1, 0.2, 0.3],
         "chunk_tokens": [1, 1, 1], "output_tokens": 3, "prompt_tokens": 8, "error": None}
        for i in range(2)
    ]  # fmt: skip
    params = WorkloadParams("greedy", 8, 3, requests=2, record_tokens=True)
    return WorkloadResult(params, [repeat_metrics(records) | {"repeat": block}], records)


def _switch_rows(
    tmp_path: Path, mtp: int, fused_ids: list[int], *, reseeded: bool = True
) -> dict[str, CaseResult]:
    """The rows a switch server of the MTP `mtp` topology writes when its staged blocks
    answered [1, 2, 3] and its fused blocks `fused_ids` (nothing launched); `reseeded=False`:
    a server that did not seed its workers per round (runs before 2026-12-06)."""
    m = parse_matrix(SAME_TOKENS + "ab: {mode: switch, blocks: 2}\n", "sw.yaml")
    cases = expand(m)
    (unit,) = [u for u in run_units(m, cases, cases) if u.server.mtp == mtp]
    blocks = SwitchBlocks(unit, m)
    if not reseeded:
        blocks.seeds = None
    run = CaseRun(unit, blocks, m, None, RunStore.create(tmp_path, "r"), lambda _: None, None)
    for variant, ids in (("staged", [1, 2, 3]), ("fused", fused_ids)):
        blocks.results[variant]["greedy"] = [_greedy(ids, 0), _greedy(ids, 1)]
    rows = blocks.rows(run, run.result(AuditSummary(), {}))
    return {r.variant: r for r in rows}


def test_a_switch_server_that_did_not_reseed_does_not_compare_tokens(tmp_path):
    """Synthetic acceptance accepts drafts by a random draw, and without a seed per round the
    blocks of a switch server's variants draw at different points of the GPU's stream: their
    tokens differ by construction, so the check is not made, and says why, instead of
    failing the row."""
    rows = _switch_rows(tmp_path, 1, [1, 7, 3], reseeded=False)
    fused = rows["fused"]
    assert fused.status == "passed" and fused.reason is None
    check = fused.same_tokens["greedy"]
    assert check.verdict == tokens.NOT_COMPARED and check.why == tokens.SYNTHETIC_IN_SWITCH
    assert check.sentence == f"fused vs staged: not compared: {tokens.SYNTHETIC_IN_SWITCH}"
    assert check.reference == "m/tp1-dcp1-mtp1/staged/s1"
    assert check.requests is None and check.divergences is None
    assert rows["staged"].same_tokens == {} and rows["staged"].status == "passed"


def test_a_reseeded_switch_server_compares_tokens_under_synthetic_acceptance(tmp_path):
    """Seeded with the round's seed before each block, both paths of a round draw the same
    acceptance: their tokens are held to each other like MTP 0's."""
    fused = _switch_rows(tmp_path, 1, [1, 7, 3])["fused"]
    assert fused.same_tokens["greedy"].verdict == tokens.DIFFERS and fused.status == "failed"
    same = _switch_rows(tmp_path / "again", 1, [1, 2, 3])["fused"]
    assert same.same_tokens["greedy"].verdict == tokens.IDENTICAL and same.status == "passed"


def test_a_switch_server_of_mtp_0_still_fails_on_other_tokens(tmp_path):
    fused = _switch_rows(tmp_path, 0, [1, 7, 3])["fused"]
    check = fused.same_tokens["greedy"]
    assert check.verdict == tokens.DIFFERS and check.why is None
    assert fused.status == "failed"
    assert fused.reason == f"same tokens: {check.sentence}"
    assert "identical token ids in 0/4 requests" in check.sentence
    same = _switch_rows(tmp_path / "again", 0, [1, 2, 3])["fused"]
    assert same.same_tokens["greedy"].verdict == tokens.IDENTICAL and same.status == "passed"


def test_reports_say_why_tokens_were_not_compared(tmp_path):
    """report.md, report.html and report.json carry the check's verdict and reason (the
    committed switch-mode run, its fused row given the check of a synthetic-acceptance
    topology)."""
    from orchestrator.reports.html import render_html
    from orchestrator.reports.json_report import render_json
    from orchestrator.reports.markdown import render_markdown
    from orchestrator.results.recorded_run import Run

    check = _switch_rows(tmp_path, 1, [1, 7, 3], reseeded=False)["fused"].same_tokens["greedy"]
    run = Run.load(Path(__file__).parents[2] / "docs/validation/h200-2026-12-02/glm5-ab-2")
    (fused,) = [r for r in run.results if r.variant == "fused"]
    fused.same_tokens = {"greedy": check}
    md, page = render_markdown(run), render_html(run)
    assert f"**not-compared** -- fused vs staged: not compared: {tokens.SYNTHETIC_IN_SWITCH}" in md
    assert "<b>not-compared</b>" in page and "a switch-mode server&#39;s blocks draw" in page
    assert "identical token ids" not in md + page
    assert "**identical**" not in md and "**differs**" not in md
    assert "<b>identical</b>" not in page and "<b>differs</b>" not in page
    (row,) = [c for c in render_json(run)["cases"] if c["variant"] == "fused"]
    assert row["same_tokens"]["greedy"]["verdict"] == "not-compared"
    assert row["same_tokens"]["greedy"]["why"] == tokens.SYNTHETIC_IN_SWITCH


def test_plan_notes_that_a_switch_server_reseeds_to_compare_tokens(tmp_path):
    path = tmp_path / "sw.yaml"
    path.write_text(SAME_TOKENS + "ab: {mode: switch}\n")
    notes = plan_matrix(path)["notes"]
    said = [n for n in notes if "same tokens" in n]
    assert said == [
        "m/tp1-dcp1-mtp1: same tokens compared under synthetic acceptance: the switch server "
        "reseeds every worker with the round's seed before each block, so both paths of a "
        "round draw the same acceptance"
    ]
    path.write_text(SAME_TOKENS + "ab: {mode: restarts}\n")
    assert not [n for n in plan_matrix(path)["notes"] if "same tokens" in n]
    path.write_text(SAME_TOKENS.replace(", same_tokens: true", "") + "ab: {mode: switch}\n")
    assert not [n for n in plan_matrix(path)["notes"] if "same tokens" in n]


def test_a_switch_variant_reports_the_acceptance_its_blocks_saw(tmp_path):
    """Each variant's row sums what the server's counters moved around its own blocks of a
    workload, and keeps each block's rate."""
    m = parse_matrix(SAME_TOKENS + "ab: {mode: switch, blocks: 2}\n", "sw.yaml")
    cases = expand(m)
    (unit,) = [u for u in run_units(m, cases, cases) if u.server.mtp == 1]
    blocks = SwitchBlocks(unit, m)
    run = CaseRun(unit, blocks, m, None, RunStore.create(tmp_path, "r"), lambda _: None, None)
    for variant in ("staged", "fused"):
        blocks.results[variant]["greedy"] = [_greedy([1, 2, 3], 0), _greedy([1, 2, 3], 1)]
    blocks.spec_decode["staged"]["greedy"] = [Moved(10, 10, 7, {0: 7}), Moved(30, 30, 18, {0: 18})]
    blocks.spec_decode["fused"]["greedy"] = [Moved(20, 20, 14, {0: 14}), None]  # one not read
    staged, fused = blocks.rows(run, run.result(AuditSummary(), {}))
    seen = staged.workloads["greedy"].spec_decode
    assert seen is not None
    assert (seen.drafts, seen.accepted_tokens, seen.acceptance_rate) == (40, 25, 0.625)
    assert seen.block_rates == [0.7, 0.6] and seen.expected_rate == 0.7
    # A sum over part of the blocks would not be the variant's: none rather than a wrong one.
    assert fused.workloads["greedy"].spec_decode is None


def test_each_block_says_its_figures_in_the_log():
    """What a run stopped before its rows keeps: each finished block's line in the run log."""
    from orchestrator.execution.switch import block_figures

    # Two requests of 3 tokens, each from 0 to 0.3 s, first token at 0.1 s: 6 tokens in
    # 0.3 s, and 0.2 s for the 2 tokens after the first.
    block = _greedy([1, 2, 3], 0)
    assert block_figures(block) == "20.00 tok/s, TPOT p50 100.000 ms"
    assert block_figures(block, Moved(10, 10, 7, {0: 7})) == (
        "20.00 tok/s, TPOT p50 100.000 ms, MTP acceptance 0.700"
    )
    block.records[1] = {**block.records[1], "error": "HTTP 500", "end_s": None}
    block.repeats = [repeat_metrics(block.records)]
    assert block_figures(block) == "10.00 tok/s, TPOT p50 100.000 ms, 1 of 2 requests failed"


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
        answers = [dict(answer) for _ in range(workers)]
        if body["method"] == SEED:  # fusedq's extension takes the seed as a string
            answers = [{"seed": int(body["args"][0]), "path": state["path"]}] * workers
            if mode == "lies":
                answers[-1] = {"seed": 0, "path": state["path"]}
        self._send(200, {"results": answers})

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
    done = flip(VLLM, url, "fused", workers=2, block=3, timeout_s=5, api_key="k3y")
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
        flip(VLLM, url, "fused", workers=2, block=1, timeout_s=5, api_key=None)


def test_an_unreachable_server_is_named():
    with pytest.raises(
        WorkerCallError, match=r"POST http://127.0.0.1:9/collective_rpc fusedq_state"
    ):
        VLLM.path_state("http://127.0.0.1:9", timeout_s=2)
    # The flip that meets it fails the server's case, with the engine's words.
    with pytest.raises(
        SwitchError, match=r"POST http://127.0.0.1:9/collective_rpc fusedq_set_path"
    ):
        flip(VLLM, "http://127.0.0.1:9", "fused", workers=1, block=1, timeout_s=2, api_key=None)


def test_a_reseed_asks_every_worker_and_checks_each_answer(rpc):
    url, state = rpc
    reseed(VLLM, url, 7, workers=2, timeout_s=5, api_key=None)
    assert state["calls"][-1][:2] == ("/collective_rpc", {"method": SEED, "args": ["7"]})
    for mode, workers in (("lies", 2), ("short", 2), ("ok", 3)):
        state["mode"] = mode
        with pytest.raises(SwitchError, match=r"fusedq_seed\(7\): the server's \d worker"):
            reseed(VLLM, url, 7, workers=workers, timeout_s=5, api_key=None)


def test_only_a_server_with_synthetic_acceptance_is_reseeded_and_its_rows_say_so(tmp_path, rpc):
    """Synthetic acceptance draws from the workers' random streams: each block starts from its
    round's seed (matrix seed + round), and each row records the seeds of its blocks."""
    url, state = rpc
    m = parse_matrix(SAME_TOKENS + "seed: 40\nab: {mode: switch, blocks: 2}\n", "sw.yaml")
    cases = expand(m)
    units = {u.server.mtp: u for u in run_units(m, cases, cases)}
    assert SwitchBlocks(units[0], m).seeds is None
    blocks = SwitchBlocks(units[1], m)
    assert blocks.seeds == {"staged": [], "fused": []}
    run = CaseRun(units[1], blocks, m, None, RunStore.create(tmp_path, "r"), lambda _: None, None)
    for variant in ("staged", "fused"):
        blocks.results[variant]["greedy"] = [_greedy([1, 2, 3], 0), _greedy([1, 2, 3], 1)]
    # The server as _reseed sees it: its engine, its URL (the endpoint's stand-in) and its
    # two workers.
    server = types.SimpleNamespace(
        engine=VLLM, handle=types.SimpleNamespace(base_url=url), case=types.SimpleNamespace(tp=2)
    )
    for seed in (40, 41):
        for variant in ("staged", "fused"):
            blocks._reseed(server, variant, seed, None)
    assert [b["args"] for _, b, _ in state["calls"]] == [["40"], ["40"], ["41"], ["41"]]
    staged, fused = blocks.rows(run, run.result(AuditSummary(), {}))
    assert staged.switch.seeds == fused.switch.seeds == [40, 41]


def _fatal_at(path: Path, line: int) -> AuditSummary:
    finding = {
        "file": str(path), "line": line, "rank": None, "signature": "CUDA-error",
        "severity": "fatal", "category": "CUDA-error", "text": "CUDA error: invalid argument",
    }  # fmt: skip
    return AuditSummary.model_validate({"findings": [finding]})


def test_a_failure_in_the_profile_phase_leaves_the_rounds_standing(tmp_path):
    """The profile phase begins once every block has run: a failure there marks the rows
    failed_in "profile" (their figures stand, CaseResult.measured); a failure before it, or a
    fault the audit finds logged before the phase began, does not."""
    m = parse_matrix(SAME_TOKENS + "ab: {mode: switch, blocks: 2}\n", "sw.yaml")
    cases = expand(m)
    (unit,) = [u for u in run_units(m, cases, cases) if u.server.mtp == 0]

    def server(fail_in_profile: bool) -> tuple[CaseRun, SwitchBlocks]:
        blocks = SwitchBlocks(unit, m)
        store = RunStore.create(tmp_path / f"p{fail_in_profile}", "r")
        run = CaseRun(unit, blocks, m, None, store, lambda _: None, None)
        for variant in ("staged", "fused"):
            blocks.results[variant]["greedy"] = [_greedy([1, 2, 3], 0), _greedy([1, 2, 3], 1)]
        run.server_log.parent.mkdir(parents=True, exist_ok=True)
        run.server_log.write_text("started\nblock 1\nblock 2\n")
        if fail_in_profile:
            run.enter_profile()
        run.fail("CUDA error: invalid argument")
        run.fail("a later failure does not move the phase")
        return run, blocks

    run, blocks = server(True)
    assert run.profile_line == 4 and run.failed_in == "profile"
    rows = blocks.rows(run, run.result(AuditSummary(), {}))
    assert [(r.status, r.failed_in, r.measured) for r in rows] == [("failed", "profile", True)] * 2
    assert not run._fault_before_profile(_fatal_at(run.server_log, 5))
    assert run._fault_before_profile(_fatal_at(run.server_log, 3))
    assert run._fault_before_profile(_fatal_at(tmp_path / "kern.log", 9))

    run, blocks = server(False)
    rows = blocks.rows(run, run.result(AuditSummary(), {}))
    assert [(r.failed_in, r.measured) for r in rows] == [(None, False)] * 2
