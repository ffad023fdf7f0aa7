"""The ab-runs table of benchmarks/scripts/tables.py: one row per run, topology and speed
workload of every run folder whose report.json has end-to-end A/B results, read from small
report.json files written here."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOPOLOGY = "glm5-tp4/tp1-dcp1-mtp0"


def _load():
    path = REPO / "benchmarks" / "scripts" / "tables.py"
    spec = importlib.util.spec_from_file_location("bench_tables_ab", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tables = _load()


def _side(variant: str, mean: float | None, n: int) -> dict:
    return {"variant": variant, "mean": mean, "sd_pct": 0.1, "n": n, "units_run": 3}


def _result(
    workload: str,
    metric: str,
    staged: float,
    fused: float | None,
    *,
    n: int = 3,
    fused_n: int | None = None,
    interval: list[float] | None = None,
    verdict: str = "faster",
    unit: str = "blocks",
    topology: str = TOPOLOGY,
) -> dict:
    fused_n = n if fused_n is None else fused_n
    ratio = fused / staged if fused is not None and fused_n else None
    return {
        "topology_id": topology,
        "workload": workload,
        "column": workload,
        "metric": metric,
        "higher_is_better": metric == "output_tok_s",
        "unit": unit,
        "baseline": _side("staged", staged, n),
        "candidate": _side("fused", fused, fused_n),
        "ratio": ratio,
        "change_pct": None if ratio is None else 100 * (ratio - 1),
        "interval_pct": interval if ratio is not None else None,
        "confidence": 0.95,
        "method": "Fieller",
        "verdict": verdict,
        "why": None,
    }


def _case(variant: str, *, mtp: int = 0, status: str = "passed", reason=None, **extra) -> dict:
    return {
        "case_id": f"{TOPOLOGY.replace('mtp0', f'mtp{mtp}')}/{variant}/s1",
        "model": "glm5-tp4",
        "mtp": mtp,
        "variant": variant,
        "status": status,
        "reason": reason,
        "same_tokens": {},
        "workloads": {},
        **extra,
    }


MATRIX = {
    "name": "h200-glm5",
    "models": [{"label": "glm5-tp4", "num_heads": 16}],
    "workloads": [
        {"name": "greedy", "same_tokens": True},
        {"name": "ctx0", "same_tokens": False},
    ],
}


def _headline() -> dict:
    """A passing MTP 0 run: greedy is the token check, ctx0 the speed workload."""
    return {
        "run_id": "glm5-ab-1",
        "matrix": "h200-glm5",
        "git": {"commit": "e375d9affb5ec77ef34fa1753a2c83ff27d41199", "dirty": False},
        "cases": [
            _case("staged"),
            _case(
                "fused",
                same_tokens={"greedy": {"verdict": "identical", "requests": 12, "identical": 12}},
            ),
        ],
        "ab": {
            "design": "3 blocks per variant on one server",
            "results": [
                _result("greedy", "output_tok_s", 62.59, 67.56, interval=[-14.1, 43.6]),
                _result("greedy", "tpot_mean_ms", 11.972, 11.897, interval=[-0.87, -0.39]),
                _result("ctx0", "output_tok_s", 84.3305, 84.7123, interval=[0.2088, 0.6974]),
                _result("ctx0", "tpot_p50_ms", 11.838514, 11.78478, interval=[-0.68, -0.23]),
                _result("ctx0", "tpot_mean_ms", 11.838514, 11.78478, interval=[-0.68, -0.23]),
            ],
        },
    }


def _write(root: Path, day: str, run: str, report: dict, manifest: dict | None = None) -> Path:
    folder = root / f"h200-{day}" / run
    folder.mkdir(parents=True)
    (folder / "report.json").write_text(json.dumps(report))
    (folder / "report.md").write_text(f"# Run {run}\n")
    if manifest is not None:
        (folder / "manifest.json").write_text(json.dumps(manifest))
    return folder


def _rows(table: str) -> list[list[str]]:
    """The table's body, each row as its cells (header and rule left out)."""
    lines = [line for line in table.splitlines() if line.startswith("| ")]
    return [line[2:-2].split(" | ") for line in lines[2:]]


def _cells(row: list[str]) -> dict[str, str]:
    return dict(zip(tables.AB_HEADER, row, strict=True))


@pytest.fixture
def doc(tmp_path: Path) -> Path:
    return tmp_path / "docs" / "page.md"


def test_a_speed_row_reads_its_ratio_interval_and_verdicts(tmp_path: Path, doc: Path):
    root = tmp_path / "docs" / "validation"
    _write(
        root,
        "2026-12-02",
        "glm5-ab-1",
        _headline(),
        {"created_at": "2026-12-02T15:41:33+00:00", "matrix": MATRIX},
    )
    rows = _rows(tables.ab_runs([], doc, root))
    assert len(rows) == 1
    assert _cells(rows[0]) == {
        "run": "[glm5-ab-1](validation/h200-2026-12-02/glm5-ab-1/report.md)",
        "commit": "e375d9a",
        "topology": f"`{TOPOLOGY}`",
        "heads": "16",
        "MTP": "0",
        "workload": "ctx0",
        "blocks per path": "3",
        "output tok/s, staged → fused": "84.33 → 84.71",
        "fused/staged, 95 % interval": "1.0045, +0.21 % … +0.70 %",
        "verdict": "faster",
        "TPOT mean ms, staged → fused": "11.839 → 11.785 (faster)",
        "MTP acceptance, staged / fused": "–",
        "tokens": "identical",
    }


def test_the_same_token_workload_has_no_speed_row(tmp_path: Path, doc: Path):
    root = tmp_path / "docs" / "validation"
    _write(root, "2026-12-02", "glm5-ab-1", _headline(), {"matrix": MATRIX})
    workloads = [_cells(r)["workload"] for r in _rows(tables.ab_runs([], doc, root))]
    assert workloads == ["ctx0"]
    # Without a matrix, the workloads the cases checked tokens on are the token check.
    report = dict(_headline(), run_id="bare")
    _write(root, "2026-12-03", "bare", report)
    workloads = [_cells(r)["workload"] for r in _rows(tables.ab_runs([], doc, root))]
    assert workloads == ["ctx0", "ctx0"]
    # A run that turned the check off measures greedy for speed, and has no token verdict.
    off = dict(MATRIX, workloads=[{"name": "greedy", "same_tokens": False}])
    _write(root, "2026-12-04", "off", dict(_headline(), run_id="off"), {"matrix": off})
    last = [_cells(r) for r in _rows(tables.ab_runs([], doc, root)) if r[0].startswith("[off]")]
    assert [(r["workload"], r["tokens"]) for r in last] == [("greedy", "–"), ("ctx0", "–")]
    assert last[0]["fused/staged, 95 % interval"] == "1.0794, −14.10 % … +43.60 %"


def test_a_folder_without_ab_results_is_skipped(tmp_path: Path, doc: Path):
    root = tmp_path / "docs" / "validation"
    _write(root, "2026-12-02", "glm5-ab-1", _headline(), {"matrix": MATRIX})
    _write(root, "2026-12-02", "glm5-mtp1-ab", dict(_headline(), run_id="glm5-mtp1-ab", ab=None))
    _write(root, "2026-12-02", "empty", dict(_headline(), run_id="empty", ab={"results": []}))
    (root / "h200-2026-12-02" / "notes").mkdir()
    assert [f.name for f, _ in tables.ab_runs_found(root)] == ["glm5-ab-1"]
    assert "glm5-mtp1-ab" not in tables.ab_runs([], doc, root)
    with pytest.raises(tables.TableError, match=r"no report\.json with A/B results"):
        tables.ab_runs([], doc, tmp_path / "nothing")


def test_a_failed_case_fills_the_verdict_cell(tmp_path: Path, doc: Path):
    root = tmp_path / "docs" / "validation"
    reason = (
        "same tokens: fused vs staged: identical token ids in 0/12 requests; 12 real difference(s)"
    )
    report = {
        "run_id": "glm5-tp4-mtp1",
        "git": {"commit": "ba9411a155406880cef3690487c2ef1e789a3424", "dirty": True},
        "cases": [
            _case("staged", mtp=1),
            _case(
                "fused",
                mtp=1,
                status="failed",
                reason=reason,
                same_tokens={"greedy": {"verdict": "differs"}},
            ),
        ],
        "ab": {
            "results": [
                _result(
                    "ctx0",
                    "output_tok_s",
                    110.4825,
                    None,
                    fused_n=0,
                    topology="glm5-tp4/tp1-dcp1-mtp1",
                    verdict="too few samples to tell fused: 0 blocks measured",
                ),
                _result(
                    "ctx0",
                    "tpot_mean_ms",
                    8.9908,
                    None,
                    fused_n=0,
                    topology="glm5-tp4/tp1-dcp1-mtp1",
                    verdict="too few samples to tell fused: 0 blocks measured",
                ),
            ]
        },
    }
    _write(root, "2026-12-02", "glm5-tp4-mtp1", report, {"matrix": MATRIX})
    (row,) = _rows(tables.ab_runs([], doc, root))
    cells = _cells(row)
    assert cells["verdict"] == f"fused case failed: {reason[:60].rstrip()}…"
    assert len(reason[:60]) == 60 and reason[60:]
    assert cells["commit"] == "ba9411a (dirty)"
    assert cells["MTP"] == "1"
    assert cells["blocks per path"] == "3 / 0"
    assert cells["output tok/s, staged → fused"] == "110.48 → –"
    assert cells["fused/staged, 95 % interval"] == "–"
    assert cells["TPOT mean ms, staged → fused"] == "8.991 → –"
    # MTP 1 and no acceptance recorded: said, not left blank.
    assert cells["MTP acceptance, staged / fused"] == "not read"
    assert cells["tokens"] == "differs"


def test_acceptance_servers_and_the_order_of_runs(tmp_path: Path, doc: Path):
    root = tmp_path / "docs" / "validation"
    spec = {"ctx0": {"spec_decode": {"acceptance_rate": 0.7049, "expected_rate": 0.7}}}
    later = {
        "run_id": "a-later",
        "created_at": "2026-12-03T09:00:00+00:00",
        # A copied tree: git's HEAD is stale and differs; the build-info stamp names the run.
        "git": {"commit": "0123456789", "dirty": True},
        "provenance": {"commit": "abcdef0123", "dirty": False, "source": "stamp"},
        "matrix": dict(MATRIX, workloads=[{"name": "ctx0", "same_tokens": False}]),
        "cases": [
            _case("staged", mtp=1, workloads=spec),
            _case(
                "fused",
                mtp=1,
                workloads={"ctx0": {"spec_decode": {"acceptance_rate": 0.71}}},
            ),
        ],
        "ab": {
            "results": [
                _result(
                    "ctx0",
                    "output_tok_s",
                    100.0,
                    99.0,
                    n=2,
                    unit="servers",
                    interval=[-3.5, 1.5],
                    verdict="no change detectable at ±2.50%",
                    topology="glm5-tp4/tp1-dcp1-mtp1",
                )
            ]
        },
    }
    # The folder's date says 2026-12-01, the report's own timestamp 2026-12-03: the report wins.
    _write(root, "2026-12-01", "a-later", later)
    _write(
        root, "2026-12-02", "z-earlier", dict(_headline(), run_id="z-earlier"), {"matrix": MATRIX}
    )
    _write(
        root, "2026-12-02", "b-earlier", dict(_headline(), run_id="b-earlier"), {"matrix": MATRIX}
    )
    rows = [_cells(r) for r in _rows(tables.ab_runs([], doc, root))]
    assert [r["run"].split("]")[0][1:] for r in rows] == ["b-earlier", "z-earlier", "a-later"]
    last = rows[-1]
    assert last["blocks per path"] == "2 servers"
    assert last["fused/staged, 95 % interval"] == "0.9900, −3.50 % … +1.50 %"
    assert last["verdict"] == "no change detectable at ±2.50%"
    assert last["MTP acceptance, staged / fused"] == "0.70 / 0.71"
    assert last["TPOT mean ms, staged → fused"] == "–"
    assert last["tokens"] == "–"
    assert last["commit"] == "abcdef0"


def test_the_region_is_rendered_from_the_run_folders(tmp_path: Path, monkeypatch):
    root = tmp_path / "docs" / "validation"
    _write(root, "2026-12-02", "glm5-ab-1", _headline(), {"matrix": MATRIX})
    monkeypatch.setattr(tables, "VALIDATION", root)
    doc = tmp_path / "docs" / "page.md"
    text = "## On the H200\n\n<!-- generated:ab-runs -->\nstale\n<!-- /generated -->\n\n- prose\n"
    new, changed = tables.render(text, doc, [])
    assert changed == [f"{doc}:3: generated:ab-runs"]
    assert "| [glm5-ab-1](validation/h200-2026-12-02/glm5-ab-1/report.md) |" in new
    assert new.endswith("<!-- /generated -->\n\n- prose\n")
    assert tables.render(new, doc, []) == (new, [])


def test_the_stand_ins_page_carries_the_table_and_the_readme_does_not():
    assert "<!-- generated:ab-runs -->" in (REPO / "docs" / "standins.md").read_text()
    assert "<!-- generated:ab-runs -->" not in (REPO / "README.md").read_text()


def test_the_readme_shows_the_newest_primary_figure_of_each_stand_in():
    """e2e-now: one row per stand-in, head count and MTP, from its newest committed run (the
    H100 paired run replaces the H200 headline of the same stand-in), each figure the
    report's own."""
    readme = REPO / "README.md"
    text = tables.e2e_now([], readme)
    rows = [line for line in text.splitlines() if line.startswith("| `")]
    # stand-in, heads, MTP and what the interval is over (rounds or server starts)
    keys = [
        (*(cell.strip() for cell in row.split("|")[1:4]), "starts" in row.split("|")[5])
        for row in rows
    ]
    assert len(keys) == len(set(keys)) and len(rows) >= 9
    glm5 = next(r for r in rows if r.startswith("| `builtin:glm5` | 16 | 0 |"))
    assert "[glm5-paired-mtp0]" in glm5 and "glm5-ab-1" not in text
    report = json.loads(
        (REPO / "docs/validation/h100-2026-12-06/glm5-paired-mtp0/report.json").read_text()
    )
    (primary,) = [r for r in report["ab"]["results"] if r["role"] == "primary"]
    assert f"| {tables._ratio(primary)}: {primary['verdict']} |" in glm5
    assert "<!-- generated:e2e-now -->" in readme.read_text()


def test_a_restarts_run_and_a_switch_run_of_one_stand_in_each_keep_their_row(
    tmp_path: Path, monkeypatch
):
    """Server starts measure against other baseline servers than a switch server's rounds: the
    newest run of each sampling unit has its row, and the row says what its interval is over."""
    root = tmp_path / "docs" / "validation"
    matrix = {**MATRIX, "models": [{"label": "glm5-tp4", "path": "builtin:glm5", "num_heads": 16}]}
    for day, run, unit, change in (
        ("2026-12-01", "switch-old", "rounds", 0.5),
        ("2026-12-02", "starts", "server starts", 2.8),
        ("2026-12-03", "switch-new", "rounds", 0.7),
    ):
        report = _headline() | {"run_id": run, "matrix": matrix}
        report["ab"] = {
            "results": [
                {
                    **_result("ctx0", "output_tok_s", 100.0, 100.0 + change, n=6, unit=unit),
                    "role": "primary",
                    "interval_pct": [change - 0.1, change + 0.1],
                }
            ]
        }
        _write(root, day, run, report)
    monkeypatch.setattr(tables, "VALIDATION", root)
    text = tables.e2e_now([], tmp_path / "README.md", root)
    rows = [line for line in text.splitlines() if line.startswith("| `builtin:glm5`")]
    assert len(rows) == 2, text
    assert any("6 rounds, one server" in r and "switch-new" in r for r in rows)
    assert any("6 + 6 server starts" in r and "[starts]" in r and "1.0280" in r for r in rows)
    assert "switch-old" not in text


def test_an_fp8_cache_run_keeps_its_own_row_and_names_its_cache(tmp_path: Path, monkeypatch):
    """An FP8 KV cache changes the decode step: a newer FP8-cache run does not replace the
    BF16-cache run's row, and its cell names the cache (whichever way the arg is spelled)."""
    root = tmp_path / "docs" / "validation"
    model = {"label": "glm5-tp4", "path": "builtin:glm5", "num_heads": 16}
    for day, run, args in (
        ("2026-12-01", "bf16-cache", ["--max-model-len=4096"]),
        ("2026-12-02", "auto-cache", ["--kv-cache-dtype=auto"]),
        ("2026-12-03", "fp8-cache", ["--kv-cache-dtype", "fp8"]),
    ):
        matrix = {**MATRIX, "models": [model], "engine": {"args": args}}
        report = _headline() | {"run_id": run, "matrix": matrix}
        report["ab"] = {
            "results": [
                {
                    **_result("ctx0", "output_tok_s", 100.0, 101.0, n=4, unit="rounds"),
                    "role": "primary",
                    "interval_pct": [0.9, 1.1],
                }
            ]
        }
        _write(root, day, run, report)
    monkeypatch.setattr(tables, "VALIDATION", root)
    text = tables.e2e_now([], tmp_path / "README.md", root)
    rows = [line for line in text.splitlines() if line.startswith("| `builtin:glm5`")]
    assert len(rows) == 2, text
    assert any(
        r.startswith("| `builtin:glm5` (fp8 KV cache) |") and "[fp8-cache]" in r for r in rows
    )
    # "auto" is the model's own cache dtype: the newer auto run replaces the unnamed one.
    assert any(r.startswith("| `builtin:glm5` |") and "[auto-cache]" in r for r in rows)
    assert "bf16-cache" not in text
