"""`orchestrator run` end to end: the smoke matrix against real `vllm serve` (CPU build) placed
through a real local Ray, then resume, then an injected fault. Nothing here is mocked.

The workloads are shrunk with --set (CI time); the topology axes are the smoke matrix's own.
"""

from __future__ import annotations

import json
import os
import re
import stat
import subprocess
from pathlib import Path

import pytest
from orch_cli import REPO, VENV_BIN, run_cli

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


def _orchestrator(*args: str, timeout: float = 1200) -> subprocess.CompletedProcess[str]:
    return run_cli(*args, timeout=timeout)


def _server_processes() -> set[int]:
    """PIDs of any vllm server or Ray daemon on this machine."""
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    pids = set()
    for line in out.splitlines():
        pid, _, args = line.strip().partition(" ")
        if (
            (" serve " in f" {args} " and "vllm" in args)
            or "raylet" in args
            or "gcs_server" in args
        ):
            pids.add(int(pid))
    return pids


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    """One run of the smoke matrix in two steps: the first case alone, then --resume for the
    rest; then a resume with nothing left. The logs directory is given relative, as a user
    types `--logs-dir logs`: every path handed to a server must still be absolute."""
    logs = tmp_path_factory.mktemp("logs")
    rel = os.path.relpath(logs, REPO)  # the CLI runs from the repository root
    before = _server_processes()
    sets = [f"--set={s}" for s in SMALL]
    first = _orchestrator(
        "run", "matrices/smoke.yaml", "--logs-dir", rel, "--run-id", "e2e",
        "--only", "tp1-dcp1-mtp0", "--quiet", *sets,
    )  # fmt: skip
    rest = _orchestrator(
        "run", "matrices/smoke.yaml", "--logs-dir", rel, "--resume", "e2e", "--quiet", *sets
    )
    figures = (logs / "e2e" / "overhead.json").read_bytes()
    again = _orchestrator(
        "run", "matrices/smoke.yaml", "--logs-dir", rel, "--resume", "e2e", "--quiet", *sets
    )
    after = _server_processes()
    return {
        "dir": logs / "e2e",
        "first": first,
        "rest": rest,
        "again": again,
        "figures_before_again": figures,
        "leaked": after - before,
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
        "tiny-mla/tp1-dcp1-mtp0/default",
        "tiny-mla/tp1-dcp1-mtp1/default",
        "tiny-mla/tp2-dcp1-mtp0/default",
        "tiny-mla/tp2-dcp1-mtp1/default",
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
    from orchestrator.reports.run import Run
    from orchestrator.store import case_slug

    run = Run.load(smoke_run["dir"])
    for r in run.ordered:
        log = (run.root / "cases" / case_slug(r.case_id) / "server.log").read_text()
        # 8 heads: TP1's 8 per rank are qualified, TP2's 4 are not. Whether the fused query
        # runs at all on CPU depends on TRITON_INTERPRET in the environment (tests/fusedq's
        # conftest sets it for a whole pytest session).
        enabled = {1: "fusedq: fused MLA query enabled" in log, 2: False}
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
                if enabled[r.tp]:
                    assert t.query.names == {"fusedq::mla_query_projection": n}, t.query
                else:
                    assert t.query.names == {"aten::bmm": n, "aten::cat": n}, t.query
        assert r.timings["profile_s"] > 0
    md = (smoke_run["dir"] / "report.md").read_text()
    assert "## Decode profile" in md and "| tiny-mla/tp2-dcp1-mtp0/default | 2 | staged |" in md


def test_resume_skips_finished_cases_without_duplicates(smoke_run):
    assert "skipped 1 finished case" in smoke_run["rest"].stdout
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
    assert data["overhead"]["cases_run"] == 1
    [resume] = data["overhead_resumes"]
    assert resume["cases_run"] == 3
    for figures in (data["overhead"], resume):
        # Start-up and measurement are most of any attempt that ran cases.
        assert 0 < figures["overhead_s"] < figures["startup_and_measured_s"], figures
    assert "Resume 1, 3 cases run: Wall" in (d / "report.md").read_text()


def test_case_folders_hold_no_copy_of_the_run_path(smoke_run):
    # A relative path resolved by a server inside its case folder lands a second copy of the
    # run path somewhere under the run directory, with a second `cases` folder in it.
    d = smoke_run["dir"]
    assert [p for p in d.rglob("cases") if p != d / "cases"] == []
    for case in (d / "cases").iterdir():
        # Compile caches are shared by configuration (orchestrator.compile_cache), not kept
        # in the case folder; the folder each server was given is absolute and was used.
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
        assert "fusedq=fusedq.vllm_plugin:register" in r["server"]["vllm_plugins"]
        (expectation,) = r["audit"]["searched"]["expectations"]
        assert expectation["occurrences"] >= 1 and not expectation["missing"], expectation


def test_report_has_the_seed_table(smoke_run):
    report = (smoke_run["dir"] / "report.md").read_text()
    assert "| Model | TP | DCP | MTP | ctx0 | ctx64k | Errors | Status |" in report
    assert "| tiny-mla | 2 | 1 | 1 |" in report
    assert "Orchestrator overhead" in report
    data = json.loads((smoke_run["dir"] / "report.json").read_text())
    assert data["cases_finished"] == 4 and data["cases_failed"] == 0


def test_output_ends_with_the_summary_table(smoke_run):
    """The resumed run's stdout closes with every case of the run, its tok/s and latencies."""
    out = smoke_run["rest"].stdout.rstrip("\n").splitlines()
    assert out and set(out[-1]) == {"="}, smoke_run["rest"].stdout[-3000:]
    table = out[max(i for i, line in enumerate(out) if " Run e2e " in line) :]
    assert re.split(r"\s{2,}", table[1])[:3] == ["Case", "Workload", "Output tok/s"]
    rows = [json.loads(x) for x in (smoke_run["dir"] / "results.jsonl").read_text().splitlines()]
    for r in rows:
        for name in ("ctx0", "ctx1k"):
            (line,) = [x for x in table if x.startswith(r["case_id"]) and f" {name} " in x]
            cells = re.split(r"\s{2,}", line)
            assert cells[2] == f"{r['workloads'][name]['mean']['aggregate_tok_s']:.2f}", line
            assert float(cells[3]) > 0 and cells[-2:] == ["0", "passed"], line  # TTFT p50
    assert "4/4 cases finished, 4 passed, 0 failed." in " ".join(table)


def test_no_process_outlives_the_run(smoke_run):
    assert not smoke_run["leaked"]


def test_injected_fault_line_fails_its_case(tmp_path):
    """A server that logs an Xid fails its case even though throughput was measured."""
    wrapper = tmp_path / "vllm-with-xid"
    wrapper.write_text(
        "#!/bin/sh\n"
        "echo 'NVRM: Xid (PCI:0000:1b:00): 31, pid=4242, name=python3, Ch 00000008, "
        "intr 00000000. MMU Fault: ENGINE GRAPHICS GPCCLIENT_T1_0 faulted @ 0x7f_12345000. "
        "Fault is of type FAULT_PDE ACCESS_TYPE_VIRT_READ' >&2\n"
        f'exec "{VENV_BIN / "vllm"}" "$@"\n'
    )
    wrapper.chmod(wrapper.stat().st_mode | stat.S_IEXEC)
    out = _orchestrator(
        "run", "matrices/smoke.yaml", "--logs-dir", str(tmp_path), "--run-id", "fault",
        "--only", "tp1-dcp1-mtp0", "--quiet", f"--set=engine.vllm_bin={wrapper}",
        *[f"--set={s}" for s in SMALL],
    )  # fmt: skip
    assert out.returncode == 1, out.stdout + out.stderr[-3000:]
    row = json.loads((tmp_path / "fault" / "results.jsonl").read_text().splitlines()[0])
    assert row["status"] == "failed"
    assert row["workloads"]["ctx0"]["mean"]["aggregate_tok_s"] > 0  # measured, and still failed
    assert "xid" in row["reason"].lower()
    report = (tmp_path / "fault" / "report.md").read_text()
    assert "**FAILED**" in report and "Xid" in report
