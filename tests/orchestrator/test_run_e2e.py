"""`orchestrator run` end to end: the smoke matrix against real `vllm serve` (CPU build) placed
through a real local Ray, then resume. Nothing here is mocked. (An Xid in a server's log that
fails its measured case is one of test_faults.py's variants.)

The workloads are shrunk with --set (CI time); the topology axes and the staged and fused
variants are the smoke matrix's own: the fused servers run fusedq's kernel in Triton's
interpreter, the same-token check holds their greedy tokens against the staged ones, and
`orchestrator audit` of the finished run reaches the run's own verdict.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import uuid
from pathlib import Path

import pytest
from orch_cli import REPO, marked_processes, run_cli

pytestmark = [pytest.mark.slow, pytest.mark.e2e]
PROFILE_STEPS = 3

SMALL = [
    "workloads[0].output_tokens=16",
    "workloads[1].prompt_tokens=256",
    "workloads[1].output_tokens=16",
    # The profile phase rides on the same servers (a few seconds a case): TP2 brings two
    # ranks' traces home.
    f"profile.decode_steps={PROFILE_STEPS}",
]


# Every process the smoke run starts (its local Ray's daemons, each server and its engine
# core) inherits this mark: what outlives the run is counted by it, not by what else runs on
# the machine meanwhile (the suite's other lane starts and stops servers of its own).
MARK_ENV = "SMOKE_TEST_MARK"
MARK = uuid.uuid4().hex


def _orchestrator(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=timeout, env={MARK_ENV: MARK})


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One run of the smoke matrix in two steps: the first case alone, then --resume for the
    rest; then a resume with nothing left. The logs directory is given relative, as a user
    types `--logs-dir logs`: every path handed to a server must still be absolute."""
    logs = tmp_path_factory.mktemp("logs")
    rel = os.path.relpath(logs, REPO)  # the CLI runs from the repository root
    sets = [f"--set={s}" for s in SMALL]
    first = _orchestrator(
        "run", "matrices/smoke.yaml", "--logs-dir", rel, "--run-id", "e2e",
        "--only", "tp1-dcp1-mtp1", "--quiet", *sets,
    )  # fmt: skip
    rest = _orchestrator(
        "run", "matrices/smoke.yaml", "--logs-dir", rel, "--resume", "e2e", "--quiet", *sets
    )
    figures = (logs / "e2e" / "overhead.json").read_bytes()
    again = _orchestrator(
        "run", "matrices/smoke.yaml", "--logs-dir", rel, "--resume", "e2e", "--quiet", *sets
    )
    audit = run_cli("audit", str(logs / "e2e"), "--json", timeout=300)
    return {
        "dir": logs / "e2e",
        "first": first,
        "rest": rest,
        "again": again,
        "figures_before_again": figures,
        "audit": audit,
        "leaked": marked_processes(MARK_ENV, MARK),
    }


def _why_cases_failed(run_dir: Path) -> str:
    """Each failed case's reason and the tail of its server log: what a red CI needs to show."""
    parts = []
    results = run_dir / "results.jsonl"
    for line in results.read_text().splitlines() if results.exists() else []:
        row = json.loads(line)
        if row["status"] == "passed":
            continue
        parts.append(f"{row['case_id']}: {row['status']}: {row.get('reason')}")
        log = run_dir / "cases" / row["case_id"].replace("/", "__") / "server.log"
        if log.exists():
            parts.append("\n".join(log.read_text(errors="replace").splitlines()[-40:]))
    return "\n".join(parts)


def test_every_case_passes_with_throughput(smoke_run):
    for step in ("first", "rest"):
        out = smoke_run[step]
        assert out.returncode == 0, (
            f"{step}:\n{out.stdout}\n{out.stderr[-4000:]}\n{_why_cases_failed(smoke_run['dir'])}"
        )
    rows = [json.loads(x) for x in (smoke_run["dir"] / "results.jsonl").read_text().splitlines()]
    assert [r["case_id"] for r in rows] == [
        "tiny-mla/tp1-dcp1-mtp1/staged",
        "tiny-mla/tp1-dcp1-mtp1/fused",
        "tiny-mla/tp2-dcp1-mtp0/staged",
        "tiny-mla/tp2-dcp1-mtp0/fused",
    ]
    for r in rows:
        assert r["status"] == "passed", r.get("reason")
        assert r["errors"] == 0
        for name in ("ctx0", "ctx1k"):
            mean = r["workloads"][name]["mean"]
            assert mean["aggregate_tok_s"] > 0
            assert mean["per_user_tok_s"] >= mean["aggregate_tok_s"] * 0.5
        assert r["audit"]["verdict"]["status"] == "clean", r["audit"]["verdict"]
        assert r["timings"]["startup_s"] > 0
        # One unmeasured request warmed the server before the workloads (matrix default).
        assert r["warmup"] == {"requests": 1, "errors": 0} and r["timings"]["warmup_s"] > 0


def test_profile_phase_brings_every_rank_trace(smoke_run):
    """Each case profiled its decode after the workloads: one trace per rank in its case
    directory, read into figures; at MTP 0 the query step of every layer of every step is
    found, as vLLM's staged bmm + cat or as the fused op, whichever the server's plugin said
    it runs."""
    from orchestrator.common.layout import case_slug
    from orchestrator.results.recorded_run import Run

    run = Run.load(smoke_run["dir"])
    for r in run.ordered:
        log = (run.root / "cases" / case_slug(r.case_id) / "server.log").read_text()
        # The fused variant runs the kernel (16 heads: 16 per rank at TP1, 8 at TP2, both
        # qualified; TRITON_INTERPRET=1 in its env); the staged one has the plugin off.
        fused = r.variant == "fused"
        assert ("fusedq: fused MLA query enabled" in log) == fused, r.case_id
        p = r.profile
        assert p is not None and p.error is None, r.case_id
        assert p.decode_steps == PROFILE_STEPS and p.layers == 2 + r.mtp, r.case_id
        assert sorted(t.rank for t in p.traces) == list(range(r.tp)), r.case_id
        for t in p.traces:
            assert (run.root / "cases" / case_slug(r.case_id) / t.file).is_file(), t.file
            assert t.domain == "cpu_op" and t.work_events > 0 and t.busy_us > 0
            if r.mtp == 0:
                n = 2 * PROFILE_STEPS  # layers x steps
                assert t.steps_seen == PROFILE_STEPS
                assert t.query.occurrences == n, t.query
                # The path the plugin's decision line in this server's log announced.
                if fused:
                    assert t.query.names == {"fusedq::mla_query_projection": n}, t.query
                else:
                    assert t.query.names == {"aten::bmm": n, "aten::cat": n}, t.query
        assert r.timings["profile_s"] > 0
    md = (smoke_run["dir"] / "report.md").read_text()
    assert "## Decode profile, paired" in md and "### tiny-mla/tp2-dcp1-mtp0: staged vs fused" in md


def test_resume_skips_finished_cases_without_duplicates(smoke_run):
    assert "skipped 2 finished case" in smoke_run["rest"].stdout
    assert smoke_run["again"].returncode == 0, smoke_run["again"].stderr[-2000:]
    assert "skipped 4 finished case" in smoke_run["again"].stdout
    assert "nothing left to run" in smoke_run["again"].stdout
    lines = (smoke_run["dir"] / "results.jsonl").read_text().splitlines()
    assert len(lines) == 4


def test_each_attempt_keeps_its_own_figures(smoke_run):
    d = smoke_run["dir"]
    # The resume with nothing left changed nothing (it started no Ray, so it has no figures).
    assert (d / "overhead.json").read_bytes() == smoke_run["figures_before_again"]
    data = json.loads((d / "report.json").read_text())
    assert data["overhead"]["cases_run"] == 2
    [resume] = data["overhead_resumes"]
    assert resume["cases_run"] == 2
    for figures in (data["overhead"], resume):
        # Start-up and measurement are most of any attempt that ran cases.
        assert 0 < figures["overhead_s"] < figures["startup_and_measured_s"], figures
    assert "Resume 1, 2 cases run: Wall" in (d / "report.md").read_text()


def test_case_folders_hold_no_copy_of_the_run_path(smoke_run):
    # A relative path resolved by a server inside its case folder lands a second copy of the
    # run path somewhere under the run directory, with a second `cases` folder in it.
    d = smoke_run["dir"]
    assert [p for p in d.rglob("cases") if p != d / "cases"] == []
    for case in (d / "cases").iterdir():
        # Compile caches are shared by configuration (orchestrator.engines.vllm.compile_cache), not
        # kept in the case folder; the folder each server was given is absolute and was used.
        assert not (case / "vllm-cache").exists()
    for row in map(json.loads, (d / "results.jsonl").read_text().splitlines()):
        folder = Path(row["startup"]["compile_cache_dir"])
        assert folder.is_absolute() and (folder / "vllm-cache").is_dir()


def test_run_directory_holds_everything(smoke_run):
    d = smoke_run["dir"]
    manifest = json.loads((d / "manifest.json").read_text())
    assert manifest["versions"]["vllm"] and manifest["versions"]["ray"]
    assert manifest["matrix_text"].startswith("# The embedded default")
    assert len(manifest["cases"]) == 4
    assert manifest["fusedq_fingerprint"]
    assert len(manifest["resumes"]) == 1  # the resume with nothing left recorded nothing
    for case in (d / "cases").iterdir():
        assert (case / "server.log").stat().st_size > 0
        assert (case / "audit.json").exists()
        for name in ("ctx0", "ctx1k"):
            records = (case / f"requests-{name}.jsonl").read_text().splitlines()
            assert len(records) == 2
            assert json.loads(records[0])["prompt_tokens"] in (1, 256)
    rows = [json.loads(x) for x in (d / "results.jsonl").read_text().splitlines()]
    for r in rows:
        # The server ran on the node Ray placed it on and ran the driver's fusedq.
        assert r["server"]["fusedq_fingerprint"] == manifest["fusedq_fingerprint"]
        assert r["server"]["node_ip"] == "127.0.0.1"
        # ...and vLLM found the plugin through the dist-info shipped beside it, not the venv.
        assert "py_modules_files" in r["server"]["fusedq_metadata_from"]
        assert "fusedq=fusedq.vllm.plugin:register" in r["server"]["vllm_plugins"]
        # The fused servers' every worker logged the enabled line and a fused decode step.
        expectations = r["audit"]["searched"]["expectations"]
        assert len(expectations) == (2 if r["variant"] == "fused" else 0), expectations
        for e in expectations:
            assert e["occurrences"] >= r["tp"] and not e["missing"], e


def test_report_has_the_seed_table(smoke_run):
    report = (smoke_run["dir"] / "report.md").read_text()
    assert "| Model | TP | DCP | MTP | Variant | ctx0 | ctx1k | Errors | Status |" in report
    assert "| tiny-mla | 2 | 1 | 0 | fused |" in report
    assert "| ctx1k | 256 | 16 | 1 | 2 | - | 1 | ctx64k |" in report  # what it measured
    assert "Orchestrator overhead" in report
    data = json.loads((smoke_run["dir"] / "report.json").read_text())
    assert data["cases_finished"] == 4 and data["cases_failed"] == 0


def test_the_fused_query_is_paired_with_the_staged_one(smoke_run):
    """The product on show: per topology, staged vs fused, their greedy tokens checked
    request by request, and the paired delta with the samples behind it."""
    rows = {
        json.loads(x)["case_id"]: json.loads(x)
        for x in (smoke_run["dir"] / "results.jsonl").read_text().splitlines()
    }
    for topo in ("tiny-mla/tp1-dcp1-mtp1", "tiny-mla/tp2-dcp1-mtp0"):
        check = rows[f"{topo}/fused"]["same_tokens"]["ctx0"]
        assert check["verdict"] in ("identical", "near-tie"), check
        assert check["requests"] == 2
        assert not rows[f"{topo}/staged"].get("same_tokens")
    report = (smoke_run["dir"] / "report.md").read_text()
    assert "## Paired variants: staged vs fused" in report
    assert "| Topology | Workload | Staged | Fused | Delta | Samples each |" in report
    assert re.search(r"\| tiny-mla/tp2-dcp1-mtp0 \| ctx0 \| [\d.]+ \| [\d.]+ \| [+-][\d.]+% "
                     r"\| 2 requests x 1 repeat \|", report), report  # fmt: skip
    assert "## Same tokens (greedy, request by request)" in report
    # Each latency line says its samples; two requests allow a p50, not a p90 or a p99.
    assert re.search(r"\| tiny-mla/tp2-dcp1-mtp0/fused \| ctx0 \| TTFT \| 2 \| [\d.]+ \| "
                     r"[\d.]+ \| - \| - \|", report), report  # fmt: skip


def test_a_standalone_audit_of_the_run_agrees_with_it(smoke_run):
    out = smoke_run["audit"]
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr
    data = json.loads(out.stdout)
    assert len(data["cases"]) == 4 and data["verdict"] == "clean"
    for case in data["cases"]:
        assert case["agrees_with_run"] is True, case["case_id"]
        assert case["stop_basis"] == "recorded by the run", case["case_id"]


def test_output_ends_with_the_summary_table(smoke_run):
    """The resumed run's stdout closes with every case of the run, its tok/s and latencies,
    then what report.md says after its tables: the paired deltas (the smoke matrix pairs its
    variants without `ab:`) and the same-token verdicts."""
    out = smoke_run["rest"].stdout.rstrip("\n").splitlines()
    start = max(i for i, line in enumerate(out) if " Run e2e " in line)
    end = out.index("=" * len(out[start]), start + 1)
    table = out[start : end + 1]
    assert (
        table[1]
        == "Workload ctx0: prompt 1 token, output 16 tokens, concurrency 1, 2 requests x 1 repeat"
    )
    assert table[2].startswith("Workload ctx1k (for ctx64k): prompt 256 tokens, output 16 tokens")
    assert re.split(r"\s{2,}", table[4])[:5] == [
        "Case",
        "Workload",
        "OK",
        "Duration s",
        "Output tok/s",
    ]
    rows = [json.loads(x) for x in (smoke_run["dir"] / "results.jsonl").read_text().splitlines()]
    for r in rows:
        for name in ("ctx0", "ctx1k"):
            (line,) = [x for x in table if x.startswith(r["case_id"]) and f" {name} " in x]
            cells = re.split(r"\s{2,}", line)
            assert cells[2] == "2", line  # successful requests
            assert cells[4] == f"{r['workloads'][name]['mean']['aggregate_tok_s']:.2f}", line
            assert float(cells[6]) > 0 and cells[-2:] == ["0", "passed"], line  # TTFT mean
    assert "4/4 cases finished, 4 passed, 0 failed." in " ".join(table)
    after = out[end + 1 :]
    (title,) = [x for x in after if " Paired variants: staged vs fused, aggregate output" in x]
    paired = after[after.index(title) + 1 :]
    report = (smoke_run["dir"] / "report.md").read_text()
    for topo in ("tiny-mla/tp1-dcp1-mtp1", "tiny-mla/tp2-dcp1-mtp0"):
        for name in ("ctx0", "ctx1k"):
            (line,) = [x for x in paired if x.startswith(f"{topo}  ") and f" {name} " in x]
            cells = re.split(r"\s{2,}", line)
            assert "| " + " | ".join(cells) + " |" in report, line  # report.md's row, cell for cell
        verdict = {r["case_id"]: r for r in rows}[f"{topo}/fused"]["same_tokens"]["ctx0"]
        assert any(x.startswith(f"- {topo} ctx0: {verdict['verdict']} -- ") for x in after)
    assert "Same tokens (greedy, request by request):" in after


def test_no_process_outlives_the_run(smoke_run):
    assert not smoke_run["leaked"]
