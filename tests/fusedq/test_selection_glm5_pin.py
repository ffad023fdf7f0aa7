"""GLM-5's kernel choices, pinned: every (weight format, out dtype, CuTe DSL and Gluon present or
not, H, M) over the qualified GLM-5 shapes selects what ``glm5_selection.json`` recorded before
the selection was keyed by geometry. Regenerate it only for a measured change of the tables:
``FUSEDQ_PIN_WRITE=1 pytest tests/fusedq/test_selection_glm5_pin.py``."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from test_selection import _fake_gpu

from fusedq import selection

PIN = Path(__file__).parent / "fixtures" / "glm5_selection.json"
HEADS = (8, 11, 16)
MS = range(1, 33)


# The LaunchConfig fields as the choices were recorded (a field added later is not pinned).
FIELDS = (
    "block_m", "block_n", "num_warps", "num_stages", "block_k", "pdl", "fma", "gluon",
    "gluon_operands", "e4m3_epilogue", "load_fence",
)  # fmt: skip


def _describe(chosen: selection.Selection) -> str:
    if chosen.config is None:
        return f"{chosen.path} | {chosen.kernel}"
    fields = dataclasses.asdict(chosen.config)
    config = " ".join(f"{k}={fields[k]}" for k in FIELDS)
    return f"{chosen.path} | {chosen.kernel} | {config}"


def _choices(monkeypatch) -> dict[str, list[str]]:
    """{recipe/environment/H: [the choice at M = 1..32]}."""
    table: dict[str, list[str]] = {}
    for dsl in (True, False):
        for gluon in (True, False):
            device = _fake_gpu(monkeypatch, dsl=dsl, gluon=gluon)
            for fmt in ("bf16", "mxfp8"):
                for out in (torch.bfloat16, torch.float8_e4m3fn):
                    for h in HEADS:
                        key = f"{fmt}/{str(out)[6:]}/dsl={dsl}/gluon={gluon}/H={h}"
                        table[key] = [
                            _describe(
                                selection.select(
                                    h, m, weight_format=fmt, out_dtype=out, device=device
                                )
                            )
                            for m in MS
                        ]
    return table


def test_glm5_choices_are_pinned(monkeypatch):
    got = _choices(monkeypatch)
    if os.environ.get("FUSEDQ_PIN_WRITE") == "1":
        # Distinct choices once, then per key the index of each M's choice: a small file.
        distinct = sorted({c for row in got.values() for c in row})
        rows = {k: [distinct.index(c) for c in row] for k, row in sorted(got.items())}
        lines = ",\n ".join(json.dumps(c) for c in distinct)
        body = ",\n ".join(
            f"{json.dumps(k)}: {json.dumps(r, separators=(',', ':'))}" for k, r in rows.items()
        )
        PIN.write_text(f'{{"choices": [\n {lines}\n], "rows": {{\n {body}\n}}}}\n')
    pinned = json.loads(PIN.read_text())
    want = {k: [pinned["choices"][i] for i in row] for k, row in pinned["rows"].items()}
    assert got.keys() == want.keys()
    changed = [
        (k, m, want[k][i], got[k][i])
        for k in want
        for i, m in enumerate(MS)
        if want[k][i] != got[k][i]
    ]
    assert not changed, f"{len(changed)} GLM-5 choices changed, e.g. {changed[0]}"
