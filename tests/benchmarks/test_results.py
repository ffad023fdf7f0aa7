"""benchmarks/results/h200.jsonl and the tables generated from it: every marked table in
README.md and docs/ is what benchmarks/scripts/tables.py makes of the results today, every
source still converts to exactly its rows, and the file only grows."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "benchmarks" / "scripts"
RAW = REPO / "benchmarks" / "results" / "raw" / "h200"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tables = _load("tables")
ingest = _load("ingest")


def test_every_generated_table_in_the_docs_matches_the_results():
    rows = tables.load()
    stale = []
    for doc in tables.documents():
        stale += tables.render(doc.read_text(), doc, rows)[1]
    assert stale == [], "run: python benchmarks/scripts/tables.py --write"


def test_the_readme_shows_the_kernel_and_the_vllm_tables():
    text = (REPO / "README.md").read_text()
    assert "<!-- generated:kernel-now -->" in text
    assert "<!-- generated:vllm-now -->" in text


def test_every_source_converts_to_exactly_its_rows():
    assert ingest.check(ingest.DEFAULT_RESULTS) == []


def test_rows_carry_date_commit_machine_and_source():
    rows = ingest.read_results(ingest.DEFAULT_RESULTS)
    for row in rows:
        assert {
            "date",
            "commit",
            "machine",
            "source",
            "recipe",
            "H",
            "M",
            "kernel",
            "value",
        } <= set(row)
        assert (REPO / row["source"]).exists(), row["source"]
    # A source without a commit says so instead of guessing one.
    chain = [r for r in rows if r["source"].endswith("2026-11-29-chain.json")]
    assert chain and {r["commit"] for r in chain} == {"unknown"}


def test_a_source_is_appended_once(tmp_path: Path):
    results = tmp_path / "h200.jsonl"
    source = RAW / "2026-11-30-sweep-cute-950ba08.json"
    n = ingest.append(results, [source], commit=None, note=None)
    assert n == len(ingest.convert(source)) > 0
    before = results.read_text()
    with pytest.raises(ingest.SourceError, match="already in it"):
        ingest.append(results, [source], commit=None, note=None)
    assert results.read_text() == before


def test_an_edited_row_is_found(tmp_path: Path):
    results = tmp_path / "h200.jsonl"
    ingest.append(results, [RAW / "2026-11-30-sweep-cute-950ba08.json"], commit=None, note=None)
    rows = results.read_text().splitlines()
    row = json.loads(rows[3])
    row["value"] = row["value"] * 0.9
    rows[3] = json.dumps(row)
    results.write_text("\n".join(rows) + "\n")
    assert ingest.check(results) == [
        "benchmarks/results/raw/h200/2026-11-30-sweep-cute-950ba08.json: "
        "its 24 rows differ from the 24 it converts to"
    ]


def test_a_given_commit_needs_a_reason(tmp_path: Path, capsys):
    code = ingest.main(
        [
            str(RAW / "2026-11-30-sweep-cute-950ba08.json"),
            "--results",
            str(tmp_path / "r.jsonl"),
            "--commit",
            "abc1234",
        ]
    )
    assert code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--commit abc1234 needs --note" in err[0]
    assert not (tmp_path / "r.jsonl").exists()


def test_an_unreadable_source_is_named(tmp_path: Path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text('{"rows": [{"H": 8}]')
    assert ingest.main([str(bad), "--results", str(tmp_path / "r.jsonl")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "bad.json: not JSON" in err[0]


def test_regions_are_rewritten_in_place_and_unknown_ones_named(tmp_path: Path):
    rows = tables.load()
    doc = tmp_path / "page.md"
    text = "intro\n<!-- generated:vllm-now -->\nstale\n<!-- /generated -->\nafter\n"
    new, changed = tables.render(text, doc, rows)
    assert changed == [f"{doc}:2: generated:vllm-now"]
    assert new.startswith("intro\n<!-- generated:vllm-now -->\n") and new.endswith(
        "<!-- /generated -->\nafter\n"
    )
    assert tables.render(new, doc, rows) == (new, [])
    with pytest.raises(tables.TableError, match=r"page.md:1: unknown table 'nope'"):
        tables.render("<!-- generated:nope -->\n<!-- /generated -->\n", doc, rows)
    with pytest.raises(tables.TableError, match="has no <!-- /generated -->"):
        tables.render("x\n<!-- generated:vllm-now -->\n", doc, rows)


def test_check_names_a_stale_region_and_write_fixes_it(tmp_path: Path, capsys):
    doc = tmp_path / "page.md"
    doc.write_text("<!-- generated:floors-trend -->\n<!-- /generated -->\n")
    assert tables.main(["--check", str(doc)]) == 1
    assert "generated:floors-trend: differs from the results" in capsys.readouterr().out
    assert tables.main(["--write", str(doc)]) == 0
    assert tables.main(["--check", str(doc)]) == 0


def test_a_new_floors_run_becomes_the_current_table(tmp_path: Path):
    results = tmp_path / "h200.jsonl"
    shutil.copy(ingest.DEFAULT_RESULTS, results)
    rows = tables.load(results)
    older = RAW / "2026-12-01-floors-9905a0b.json"
    # The same figures under a later source: "now" follows the file's order.
    again = [dict(r, source="later.json") for r in rows if r["source"] == ingest._rel(older)]
    table = tables.kernel_now(rows + again, REPO / "README.md")
    assert "commit 9905a0b" in table and "Targets met: **36 of 72**" in table


def test_a_profiled_fused_step_is_named_when_bigger_kernels_fill_the_top_table():
    # The GLM-5 stand-in's MoE and GEMM kernels kept the query kernel out of its trace's
    # top ten; the query path's own names still say which kernel ran.
    rows = ingest.convert(REPO / "docs" / "validation" / "h200-2026-12-02" / "glm5-ab-1")
    named = {r["kernel"]: r.get("kernel_name") for r in rows}
    assert named == {"staged": None, "fused": "_mla_query_gluon_kernel"}
