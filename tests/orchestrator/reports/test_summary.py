"""The closing summary of a run and the latency sections of report.md/.json/.html, from the
recorded run under fixtures/runs (the seeds' TP8 rows) and edited copies of it."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

from orchestrator.reports.html import render_html
from orchestrator.reports.json_report import render_json
from orchestrator.reports.markdown import render_markdown
from orchestrator.reports.summary import fmt_ms, render_summary, summary_rows
from orchestrator.results.recorded_run import Run

_spec = importlib.util.spec_from_file_location(
    "recorded_runs", Path(__file__).parents[1] / "fixtures" / "runs" / "make_fixtures.py"
)
runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runs)

FUSED = "Luke BF16/tp8-dcp2-mtp0/fused"
STAGED = "Luke BF16/tp8-dcp4-mtp3/staged"


def _copy(tmp_path: Path) -> Path:
    return runs.copy_run(tmp_path, "r", created_at="2026-11-28T02:00:00+00:00")


def _cells(text: str, case_id: str, column: str) -> list[str]:
    (line,) = [x for x in text.splitlines() if x.startswith(case_id + " ") and f" {column} " in x]
    return re.split(r"\s{2,}", line)


def test_summary_table_of_a_recorded_run(tmp_path: Path) -> None:
    text = render_summary(Run.load(_copy(tmp_path)))
    lines = text.splitlines()
    assert lines[0].startswith("=") and " Run r " in lines[0]
    # The case table closes with a rule of '='; the paired deltas follow it.
    lines = lines[: lines.index("=" * len(lines[0]), 1) + 1]
    # The workloads first, each by its one name, with what it is.
    assert (
        lines[1]
        == "Workload ctx0: prompt 1 token, output 512 tokens, concurrency 1, 120 s x 2 repeats"
    )
    assert lines[2].startswith("Workload ctx64k: prompt 65,536 tokens, output 512 tokens")
    assert re.split(r"\s{2,}", lines[4]) == [
        "Case", "Workload", "OK", "Duration s", "Output tok/s", "Total tok/s", "TTFT mean",
        "TPOT mean", "ITL mean", "E2EL mean", "Tok/chunk", "Err", "Status",
    ]  # fmt: skip
    # Repeats 71.31 and 71.35: mean 71.33, sample standard deviation 0.028. The seed rows
    # recorded no request counts, durations, E2EL or chunking: '-', not a zero.
    assert _cells(text, FUSED, "ctx64k") == [
        FUSED, "ctx64k", "-", "-", "71.33 ± 0.03", "-", "3900", "13.9", "13.9", "-", "-", "0",
        "passed",
    ]  # fmt: skip
    # One row per case and workload, in matrix order; TP8/DCP1 has no ctx64k figure.
    rule = "-" * len(lines[0])
    body = lines[lines.index(rule) + 2 : len(lines) - 1 - lines[::-1].index(rule)]
    assert len(body) == 18
    assert [x.split("  ")[0] for x in body[:3]] == [
        "Luke BF16/tp8-dcp1-mtp0/staged",
        "Luke BF16/tp8-dcp1-mtp0/fused",
        "Luke BF16/tp8-dcp2-mtp0/staged",
    ]
    assert "10/10 cases finished, 10 passed, 0 failed." in text
    assert all(len(x) <= len(lines[0]) for x in lines)


def test_summary_of_failures_single_repeats_and_older_rows(tmp_path: Path) -> None:
    run = _copy(tmp_path)

    def edit(r):
        if r["case_id"] == STAGED:  # failed at start-up: nothing measured
            r.update(status="failed", reason="server process exited with code 1", workloads={})
        if r["case_id"] == FUSED:
            w = r["workloads"]["ctx0"]
            w["repeats"] = w["repeats"][:1]  # one repeat: no spread to show
            del w["latency"]  # recorded before pooled latencies: the repeats' mean stands in
            w["mean"]["ttft_ms"]["mean"] = 1234.5
            w["errors"] = 2
        return r

    runs.edit_rows(run, edit)
    text = render_summary(Run.load(run))
    assert _cells(text, STAGED, "-") == [STAGED, "-", *["-"] * 9, "0", "FAILED"]
    cells = _cells(text, FUSED, "ctx0")
    assert cells[4] == "73.39" and cells[6] == "1234" and cells[-2:] == ["2", "passed"]
    assert "10/10 cases finished, 9 passed, 1 failed." in text


def _with_counts(run: Path, n: int) -> None:
    """FUSED's ctx64k latencies as a run records them today: with their sample counts."""

    def edit(r):
        if r["case_id"] == FUSED:
            for d in r["workloads"]["ctx64k"]["latency"].values():
                d["n"] = n
        return r

    runs.edit_rows(run, edit)


def test_fmt_ms_keeps_the_digits_that_matter() -> None:
    assert [fmt_ms(v) for v in (None, 0.4321, 12.345, 999.94, 1834.4)] == [
        "-", "0.43", "12.3", "999.9", "1834",
    ]  # fmt: skip


def test_reports_carry_latency_statistics_with_their_samples(tmp_path: Path) -> None:
    """Two requests: a mean and a p50, no p90 or p99 (they would be the maximum)."""
    path = _copy(tmp_path)
    _with_counts(path, 2)
    run = Run.load(path)
    md = render_markdown(run)
    assert "## Latency per request (ms)" in md and "p50 from 2, p90 from 10, p99 from 100" in md
    assert "| Case | Workload | Metric | n | Mean | p50 | p90 | p99 |" in md
    assert f"| {FUSED} | ctx64k | TTFT | 2 | 3900 | 3900 | - | - |" in md
    # A row recorded before counts were kept: n unknown, the figures as recorded.
    assert f"| {FUSED} | ctx0 | ITL | ? | 13.5 | 13.5 | 20.0 | 21.6 |" in md
    data = render_json(run)
    json.dumps(data, allow_nan=False)
    (case,) = [c for c in data["cases"] if c["case_id"] == FUSED]
    w = case["workloads"]["ctx64k"]
    assert w["latency_ms"]["ttft_ms"] == {
        "n": 2, "mean": 3900.0, "p50": 3900.0, "p90": None, "p99": None,
    }  # fmt: skip
    assert round(w["aggregate_tok_s_sd"], 4) == 0.0283
    assert [x["name"] for x in data["workloads"]] == ["ctx0", "ctx64k"]
    page = render_html(run)
    assert "<h2>Latency per request (ms)</h2>" in page
    assert (
        f"<td class=l>{FUSED}</td><td class=l>ctx64k</td><td class=l>TTFT</td><td>2</td>"
        "<td>3900</td><td>3900</td><td>-</td><td>-</td>"
    ) in page
    assert len(summary_rows(run)) == 18


def test_html_latency_table_escapes_names(tmp_path: Path) -> None:
    """Model labels are free text, and case ids carry them into the latency table."""
    run = _copy(tmp_path)
    evil = FUSED.replace("Luke BF16", "Luke <b>BF16</b> & co")
    manifest = json.loads((run / "manifest.json").read_text())
    for c in manifest["cases"]:
        c["case_id"] = evil if c["case_id"] == FUSED else c["case_id"]
    (run / "manifest.json").write_text(json.dumps(manifest))
    runs.edit_rows(run, lambda r: {**r, "case_id": evil} if r["case_id"] == FUSED else r)
    page = render_html(Run.load(run))
    assert "<b>BF16" not in page
    assert "<td class=l>Luke &lt;b&gt;BF16&lt;/b&gt; &amp; co/tp8-dcp2-mtp0/fused</td>" in page
    assert "<td class=l>ctx64k</td><td class=l>TTFT</td><td>?</td><td>3900</td>" in page


def test_paired_deltas_say_their_samples_and_what_a_cpu_fused_variant_ran(tmp_path: Path) -> None:
    run = _copy(tmp_path)
    md = render_markdown(Run.load(run))
    assert "| Topology | Workload | Staged | Fused | Delta | Samples each |" in md
    assert "On CPU" not in md  # a GPU run: nothing interpreted
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["matrix"]["resources"] = {"accelerator": "cpu"}
    for c in manifest["cases"]:
        if c["variant"] == "fused":
            c["env"] = {"TRITON_INTERPRET": "1"}
    (run / "manifest.json").write_text(json.dumps(manifest))
    loaded = Run.load(run)
    md = render_markdown(loaded)
    assert "On CPU the fused variant ran fusedq's kernel in Triton's interpreter" in md
    assert "On CPU the fused variant ran fusedq" in render_html(loaded)


def test_the_closing_summary_pairs_the_variants_and_gives_the_token_verdicts(
    tmp_path: Path,
) -> None:
    """A matrix with variants and no `ab:` (the smoke matrix's shape): under the table, the
    paired deltas report.md shows, and every same-token verdict."""
    run = _copy(tmp_path)
    check = {
        "verdict": "identical",
        "sentence": "fused vs staged: identical token ids in 2/2 requests",
        "reference": "Luke BF16/tp8-dcp2-mtp0/staged",
    }

    def tokens(row: dict) -> dict:
        if row["case_id"] == FUSED:
            row["same_tokens"] = {"ctx0": check}
        return row

    runs.edit_rows(run, tokens)
    loaded = Run.load(run)
    text = render_summary(loaded)
    lines = text.splitlines()
    end = lines.index("=" * len(lines[0]), 1)  # the case table closes here
    after = lines[end + 1 :]
    title = [x for x in after if " Paired variants: staged vs fused, aggregate output tok/s " in x]
    assert len(title) == 1 and title[0].startswith("=")
    at = after.index(title[0])
    assert re.split(r"\s{2,}", after[at + 1]) == [
        "Topology", "Workload", "Staged", "Fused", "Delta", "Samples each",
    ]  # fmt: skip
    # The same figures as report.md's paired table, row for row.
    md = render_markdown(loaded)
    row = "| Luke BF16/tp8-dcp2-mtp0 | ctx64k | 70.26 | 71.33 | +1.52% | 0 requests x 2 repeats |"
    assert row in md
    assert re.split(r"\s{2,}", after[at + 5]) == [
        "Luke BF16/tp8-dcp2-mtp0", "ctx64k", "70.26", "71.33", "+1.52%", "0 requests x 2 repeats",
    ]  # fmt: skip
    assert "Same tokens (greedy, request by request):" in after
    assert (
        "- Luke BF16/tp8-dcp2-mtp0 ctx0: identical -- fused vs staged: identical token ids in "
        "2/2 requests" in text
    )
    assert all(len(x) <= len(lines[0]) for x in lines)


def test_a_run_without_variants_or_token_checks_ends_with_its_table(tmp_path: Path) -> None:
    run = _copy(tmp_path)
    runs.edit_rows(run, lambda row: row if row["variant"] == "staged" else None)
    manifest = json.loads((run / "manifest.json").read_text())
    manifest["cases"] = [c for c in manifest["cases"] if c["variant"] == "staged"]
    manifest["matrix"].pop("variants", None)
    (run / "manifest.json").write_text(json.dumps(manifest))
    text = render_summary(Run.load(run))
    assert "Paired variants" not in text and "Same tokens" not in text
    assert set(text.splitlines()[-1]) == {"="}
