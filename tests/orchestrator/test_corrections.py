"""corrections.json: figures of a run found wrong after it was written are marked superseded in
every report rendered from the run directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from orchestrator.reports import write_reports
from orchestrator.results.corrections import CorrectionsError, load
from orchestrator.results.store import RunStore

REPO = Path(__file__).resolve().parents[2]
VALIDATION = REPO / "docs" / "validation"
# The runs whose query-step figure later READMEs corrected by hand.
SUPERSEDED = {
    "h200-2026-11-30/h200-profile-2": "fused 2.776, -21.15 % against staged 3.520",
    "h200-2026-11-30/h200-mtp1-1": (
        "fused 2.771, i.e. -21.38 % against staged 3.525 (staged +27.20 % against fused)"
    ),
    "h200-2026-12-01/h200-profile-3": "fused 2.570, -20.97 % against staged 3.252",
    "h200-2026-12-01/h200-fp8kv-1": "fused 2.880, -38.48 % against staged 4.681",
}


@pytest.mark.parametrize("run", sorted(SUPERSEDED))
def test_hand_corrected_runs_say_so_in_every_report(tmp_path: Path, run: str):
    committed = VALIDATION / run
    run_dir = tmp_path / committed.name
    shutil.copytree(committed, run_dir)
    write_reports(RunStore.read(run_dir))
    corrected = SUPERSEDED[run]
    md = (run_dir / "report.md").read_text()
    assert "## Superseded figures" in md and f"**{corrected}** corrected" in md
    # The superseded figure itself is still shown, below the notice that replaces it.
    assert md.index("## Superseded figures") < md.index("Query step per layer (us)")
    assert corrected in (run_dir / "report.html").read_text()
    report = json.loads((run_dir / "report.json").read_text())
    assert any(c["corrected"] == corrected for c in report["corrections"])
    # The committed reports are the re-rendered ones: they carry the notice too.
    assert f"**{corrected}** corrected" in (committed / "report.md").read_text()


def test_every_committed_gpu_run_names_the_commit_that_ran():
    for manifest in sorted(VALIDATION.glob("*/*/manifest.json")):
        if not (manifest.parent / "results.jsonl").is_file():
            continue  # not re-renderable; its README names the tree
        recorded = json.loads(manifest.read_text())
        provenance = recorded.get("provenance") or {}
        if provenance.get("commit") and provenance.get("source") in ("git", "stamp"):
            continue  # written since runs record their code's provenance: nothing to correct
        commit = [c for c in load(manifest.parent) if c.figure == "commit of the code that ran"]
        assert commit, f"{manifest.parent}: no commit correction"
        assert str(recorded["fusedq_fingerprint"]) in commit[0].corrected


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("{", r"corrections\.json: not JSON"),
        ('{"corrections": [{"figure": "x"}]}', r"corrections\.json: corrections\.0\.as_written"),
        ('{"corrections": [], "extra": 1}', r"corrections\.json: extra: Extra inputs"),
    ],
)
def test_a_bad_corrections_file_is_named(tmp_path: Path, text: str, match: str):
    (tmp_path / "corrections.json").write_text(text)
    with pytest.raises(CorrectionsError, match=match):
        load(tmp_path)


def test_no_corrections_file_means_no_section(tmp_path: Path):
    assert load(tmp_path) == []
