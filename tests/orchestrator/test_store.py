"""Run directory: atomic appends, torn lines, resume bookkeeping, locking, redaction."""

from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from orchestrator.common.redact import REDACTED, redact, redact_argv, redact_text
from orchestrator.results.rows import CaseResult
from orchestrator.results.store import RunStore, StoreError, append_jsonl, read_jsonl


def _append_many(path: str, worker: int, n: int) -> None:
    from pathlib import Path

    for i in range(n):
        append_jsonl(Path(path), {"case_id": f"w{worker}-{i}", "pad": "x" * 5000})


def test_concurrent_appends_never_interleave(tmp_path):
    path = tmp_path / "r.jsonl"
    procs = [mp.Process(target=_append_many, args=(str(path), w, 50)) for w in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    rows = read_jsonl(path)
    assert len(rows) == 200
    assert len({r["case_id"] for r in rows}) == 200


def test_torn_last_line_is_ignored(tmp_path):
    path = tmp_path / "r.jsonl"
    append_jsonl(path, {"case_id": "a"})
    with path.open("ab") as f:
        f.write(b'{"case_id": "b", "stat')  # killed mid-write
    assert [r["case_id"] for r in read_jsonl(path)] == ["a"]


def test_create_refuses_existing_and_open_needs_manifest(tmp_path):
    store = RunStore.create(tmp_path, "run1")
    with pytest.raises(StoreError, match="--resume run1"):
        RunStore.create(tmp_path, "run1")
    with pytest.raises(StoreError, match=r"missing manifest\.json"):
        RunStore.open(tmp_path, "run1")
    store.write_manifest({"run_id": "run1", "cases": []})
    assert RunStore.open(tmp_path, "run1").manifest()["run_id"] == "run1"
    with pytest.raises(StoreError, match="letters, digits"):
        RunStore.create(tmp_path, "../escape")


def test_finished_cases_and_retry(tmp_path):
    store = RunStore.create(tmp_path, "r")
    store.append_result(CaseResult(case_id="a", status="passed"))
    store.append_result(CaseResult(case_id="b", status="failed"))
    assert store.finished_case_ids() == {"a", "b"}
    assert store.finished_case_ids(include_failed=False) == {"a"}
    store.append_result(CaseResult(case_id="b", status="passed"))  # a retried case: last row wins
    assert [r.status for r in store.results()] == ["passed", "passed"]


def test_lock_is_exclusive(tmp_path):
    store = RunStore.create(tmp_path, "r")
    store.lock()
    other = RunStore(store.root)
    with pytest.raises(StoreError, match="in use by pid"):
        other.lock()
    store.unlock()
    assert not (store.root / ".lock").exists(), "a finished run leaves no lock file behind"
    other.lock()
    other.unlock()
    assert not (store.root / ".lock").exists()


def test_secrets_never_reach_the_manifest(tmp_path):
    store = RunStore.create(tmp_path, "r")
    store.write_manifest(
        {
            "env": {"HF_TOKEN": "hf_abcdefghijklmnopqrstuvwxyz", "VLLM_X": "1"},
            "argv": ["vllm", "serve", "--api-key", "s3cret-value", "--port", "1"],
            "url": "https://user:pa55@example.invalid/x",
            "note": "ran with my-private-token-value",
        },
        secrets=("my-private-token-value",),
    )
    text = (store.root / "manifest.json").read_text()
    for secret in (
        "hf_abcdefghijklmnopqrstuvwxyz",
        "s3cret-value",
        "pa55",
        "my-private-token-value",
    ):
        assert secret not in text
    data = json.loads(text)
    assert data["env"]["VLLM_X"] == "1"
    assert data["argv"][3] == REDACTED


def test_redaction_helpers():
    assert redact_argv(["--hf-token=abc", "--x", "y"]) == [f"--hf-token={REDACTED}", "--x", "y"]
    assert "Bearer ***" in redact_text("Authorization: Bearer abc.def")
    assert redact({"OPENAI_API_KEY": ""}) == {"OPENAI_API_KEY": ""}
