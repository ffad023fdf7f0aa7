"""Two cases never share a folder: labels that map to one case folder name are refused by
`plan`, naming both cases (the folder name is kept as it is: committed runs are read by it)."""

from __future__ import annotations

import json

import pytest
from security_helpers import MATRIX, assert_refused, run_cli, write_matrix

from orchestrator.config.errors import MatrixError
from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix


def _two_models(a: str, b: str) -> str:
    models = [
        {"label": a, "path": "/m", "num_heads": 8},
        {"label": b, "path": "/m", "num_heads": 8},
    ]
    return MATRIX.replace(
        "models: [{label: tiny, path: /m, num_heads: 8}]", f"models: {json.dumps(models)}"
    )


@pytest.mark.parametrize(
    "a,b",
    [("Luke BF16", "Luke_BF16"), ("Luke/BF16", "Luke__BF16"), ("Luke", "luke"), ("a:b", "a?b")],
)
def test_colliding_labels_are_refused_naming_both(a, b):
    with pytest.raises(MatrixError) as err:
        parse_matrix(_two_models(a, b), "m.yaml")
    msg = str(err.value)
    assert f"{a}/tp1-dcp1-mtp0/default" in msg and f"{b}/tp1-dcp1-mtp0/default" in msg, msg
    assert "\n" not in msg


def test_plan_cli_refuses_them(tmp_path):
    path = tmp_path / "m.yaml"
    path.write_text(_two_models("Luke BF16", "Luke_BF16"))
    assert_refused(run_cli("plan", str(path)), path, "Luke BF16", "Luke_BF16")


def test_distinct_labels_get_distinct_folders():
    cases = expand(parse_matrix(_two_models("Luke BF16", "Luke MXFP8"), "m.yaml"))
    assert len({c.slug for c in cases}) == len(cases) == 2


def test_a_folder_name_too_long_for_the_filesystem_is_refused(tmp_path):
    path = write_matrix(tmp_path, base=MATRIX.replace("label: tiny", "label: " + "x" * 300))
    assert_refused(run_cli("plan", str(path)), path, "255")
