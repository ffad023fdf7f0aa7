"""The performance tables of README.md and docs/, generated from the results file.

A document marks a table's place with ``<!-- generated:NAME -->`` ... ``<!-- /generated -->``;
this script renders NAME from ``benchmarks/results/h200.jsonl`` and puts it between the two
markers. Nothing between them is typed by hand: add a run with ``ingest.py``, then ::

    python benchmarks/scripts/tables.py --write     # rewrite every marked region
    python benchmarks/scripts/tables.py --check     # exit 1 naming each region that differs

"Now" tables take the latest run of their kind in the file's (append, i.e. time) order.
``ab-runs`` reads the run folders instead: every ``docs/validation/*/*/report.json`` with
end-to-end A/B results, the matrix as run from the report or its ``manifest.json``;
``ab-rejudged`` those reports beside the verdicts they first gave
(``docs/validation/ab-first-verdicts.jsonl``, ab_verdicts.py).
Exit 2 names a file and line with an unknown table or an unclosed region.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "benchmarks" / "results" / "h200.jsonl"
START = re.compile(r"<!-- generated:([a-z0-9-]+) -->")
END = "<!-- /generated -->"
GPU_US, HOST_US, VLLM_US = "gpu_us_per_layer", "host_us_per_call", "vllm_query_us_per_layer"
RECIPES = ("bf16", "mxfp8", "e4m3", "mxfp8-e4m3")
TITLES = {"bf16": "BF16", "mxfp8": "MXFP8", "e4m3": "BF16→E4M3", "mxfp8-e4m3": "MXFP8→E4M3"}
# The weights each recipe reads, whose BF16-out twin and read floor it is measured against.
WEIGHTS = {"bf16": "bf16", "mxfp8": "mxfp8", "e4m3": "bf16", "mxfp8-e4m3": "mxfp8"}
FLOORS = ("store", "grid", "split_k", "view", "view_tma")

Row = dict[str, Any]


class TableError(ValueError):
    """A document or a results file this script cannot render; the message says where."""


def _targets() -> tuple[dict[str, float], float]:
    # fusedq-bench judges its --floors runs by these; the tables mark the same shapes.
    from fusedq_bench.bars import E4M3_OVER_BF16_BAR, FLOOR_BARS

    return FLOOR_BARS, E4M3_OVER_BF16_BAR


def load(path: Path = RESULTS, geometry: str = "glm5") -> list[Row]:
    """The results file's rows of one geometry: GLM-5's for every table but the geometry
    tables (a row without a geometry predates the field and is GLM-5's)."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TableError(f"{path}:{n}: not a JSON row ({exc})") from None
        if row.get("geometry", "glm5") == geometry:
            rows.append(row)
    return rows


def _sources(rows: Iterable[Row], keep: Callable[[Row], bool]) -> dict[str, list[Row]]:
    """Rows grouped by source, sources in the file's order, only those with a kept row."""
    out: dict[str, list[Row]] = {}
    for r in rows:
        if keep(r):
            out.setdefault(r["source"], []).append(r)
    return out


def _floors_run(rows: list[Row]) -> list[Row]:
    """The latest fusedq-bench --floors run (not --chain) with a fused figure for every recipe."""
    runs = _sources(rows, lambda r: r["tool"] == "fusedq-bench --floors")
    for run in reversed(runs.values()):
        if {r["recipe"] for r in run if r["kernel"] == "fused"} >= set(RECIPES):
            return run
    raise TableError("no fusedq-bench --floors run with all four recipes in the results")


def _by(run: list[Row]) -> dict[tuple[str, int, int, str], Row]:
    return {(r["recipe"], r["H"], r["M"], r["kernel"]): r for r in run}


def _link(target: str, doc: Path, text: str | None = None) -> str:
    rel = os.path.relpath(REPO / target, doc.parent)
    return f"[{text or Path(target).name}]({rel})"


def _table(header: list[str], lines: Iterable[list[str]]) -> str:
    rows = [header, ["---"] * len(header), *lines]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in rows)


def _span(values: Iterable[float]) -> str:
    v = sorted(values)
    return (
        "–"
        if not v
        else f"{v[0]:.2f}"
        if f"{v[0]:.2f}" == f"{v[-1]:.2f}"
        else f"{v[0]:.2f}–{v[-1]:.2f}"
    )


def _shapes(run: list[Row]) -> list[tuple[int, int]]:
    return sorted({(r["H"], r["M"]) for r in run})


def _about(run: list[Row], doc: Path, what: str, results: Path = RESULTS) -> str:
    r = run[0]
    return (
        f"{what}, commit {r['commit']}, {r['date'][:10]}, {r['machine']}; "
        f"data: {_link(_rel(results), doc)} "
        f"(source {_link(r['source'], doc)})."
    )


def _ratios(fig: dict, h: int, m: int) -> dict[str, float | None]:
    """fused/read per weight format and E4M3/BF16 out per weight format, as fusedq-bench's bars."""
    out: dict[str, float | None] = {}
    for recipe in RECIPES:
        fused = fig.get((recipe, h, m, "fused"))
        if recipe in ("bf16", "mxfp8"):
            read = fig.get((recipe, h, m, "read"))
            out[recipe] = fused["value"] / read["value"] if fused and read else None
        else:
            twin = fig.get((WEIGHTS[recipe], h, m, "fused"))
            out[recipe] = fused["value"] / twin["value"] if fused and twin else None
    return out


def _met(ratio: float | None, recipe: str) -> bool | None:
    bars, e4m3 = _targets()
    if ratio is None:
        return None
    return ratio <= bars.get(recipe, e4m3)


# -- the tables --------------------------------------------------------------------------------
def kernel_now(rows: list[Row], doc: Path) -> str:
    """fused µs per recipe and shape, the kernel that ran, and each against its target."""
    run = _floors_run(rows)
    fig = _by(run)
    bars, e4m3_bar = _targets()
    header = ["H", "M"]
    for recipe in RECIPES:
        header += [TITLES[recipe], "µs", "/read" if recipe in bars else "×BF16 out"]
    lines, met, judged = [], 0, 0
    for h, m in _shapes(run):
        ratios = _ratios(fig, h, m)
        cells = [str(h), str(m)]
        for recipe in RECIPES:
            fused = fig.get((recipe, h, m, "fused"))
            ok = _met(ratios[recipe], recipe)
            judged += ok is not None
            met += bool(ok)
            cells += [
                (fused or {}).get("kernel_name", "fused") if fused else "–",
                f"{fused['value']:.2f}" if fused else "–",
                "–" if ratios[recipe] is None else f"{ratios[recipe]:.2f}" + ("" if ok else " ✗"),
            ]
        lines.append(cells)
    staged = {
        recipe: _span(
            fig[(recipe, h, m, "fused")]["value"] / fig[(recipe, h, m, "staged")]["value"]
            for h, m in _shapes(run)
            if (recipe, h, m, "staged") in fig and (recipe, h, m, "fused") in fig
        )
        for recipe in RECIPES
    }
    samples = run[0].get("samples")
    return "\n".join(
        [
            _about(run, doc, f"`fusedq-bench --floors --samples {samples}`")
            + " µs per layer in CUDA-graph replay, weights rotated past L2; `/read` = fused ÷ "
            "the read-only floor of the same weights in the same run; `×BF16 out` = E4M3 output "
            "÷ BF16 output of the same weights; ✗ = over its target (fused/read ≤ "
            f"{bars['bf16']:.2f} BF16, ≤ {bars['mxfp8']:.2f} MXFP8; E4M3 ≤ {e4m3_bar:.2f}× BF16 out).",
            "",
            _table(header, lines),
            "",
            f"Targets met: **{met} of {judged}**. Fused ÷ staged: "
            + ", ".join(f"{TITLES[r]} {staged[r]}" for r in RECIPES)
            + ".",
        ]
    )


def floors_now(rows: list[Row], doc: Path) -> str:
    """The floors of the kernel-now run: what one launch costs at least, per shape."""
    run = _floors_run(rows)
    fig = _by(run)
    header = ["H", "M", "read µs BF16 / MXFP8", "empty µs"]
    header += [f"{k.replace('_', '-')} / read" for k in FLOORS] + ["fused / view"]
    lines = []
    for h, m in _shapes(run):
        cell = {}
        for w in ("bf16", "mxfp8"):
            read = fig.get((w, h, m, "read"))
            cell[w] = {
                k: fig[(w, h, m, k)]["value"] / read["value"]
                for k in (*FLOORS, "fused")
                if read and (w, h, m, k) in fig
            }
        reads = " / ".join(
            f"{fig[(w, h, m, 'read')]['value']:.2f}" if (w, h, m, "read") in fig else "–"
            for w in ("bf16", "mxfp8")
        )
        empty = fig.get(("bf16", h, m, "empty"))
        line = [str(h), str(m), reads, f"{empty['value']:.2f}" if empty else "–"]
        for k in FLOORS:
            line.append(
                " / ".join(f"{cell[w][k]:.2f}" if k in cell[w] else "–" for w in ("bf16", "mxfp8"))
            )
        line.append(
            " / ".join(
                f"{cell[w]['fused'] / cell[w]['view']:.2f}"
                if "view" in cell[w] and "fused" in cell[w]
                else "–"
                for w in ("bf16", "mxfp8")
            )
        )
        lines.append(line)
    return "\n".join(
        [
            _about(run, doc, "The floors of the same `fusedq-bench --floors` run")
            + " Ratios are BF16 / MXFP8 weights, over the read floor of the same weights.",
            "",
            _table(header, lines),
        ]
    )


def trend(rows: list[Row], doc: Path) -> str:
    """Every fusedq-bench --floors run: how far the fused kernels sat from their floors."""
    runs = _sources(rows, lambda r: r["tool"] == "fusedq-bench --floors")
    header = ["date", "commit", "BF16 fused/read", "MXFP8 fused/read", "BF16→E4M3 ×BF16"]
    header += ["MXFP8→E4M3 ×MXFP8", "BF16 fused/staged", "targets met", "source"]
    lines = []
    for source, run in runs.items():
        fig = _by(run)
        spans: dict[str, list[float]] = {r: [] for r in RECIPES}
        met = judged = 0
        for h, m in _shapes(run):
            for recipe, ratio in _ratios(fig, h, m).items():
                if ratio is not None:
                    spans[recipe].append(ratio)
                    judged += 1
                    met += bool(_met(ratio, recipe))
        staged = [
            fig[("bf16", h, m, "fused")]["value"] / fig[("bf16", h, m, "staged")]["value"]
            for h, m in _shapes(run)
            if ("bf16", h, m, "fused") in fig and ("bf16", h, m, "staged") in fig
        ]
        lines.append(
            [
                run[0]["date"][:10],
                run[0]["commit"],
                *(_span(spans[r]) for r in RECIPES),
                _span(staged),
                f"{met} of {judged}",
                _link(source, doc),
            ]
        )
    return "\n".join(
        [
            "Each `fusedq-bench --floors` run in the results, oldest first (ratios as in the "
            "table above; a recipe the run did not time shows –).",
            "",
            _table(header, lines),
        ]
    )


EAGER = {
    "public": "public",
    "hook": "vLLM hook",
    "custom_op": "custom op",
    "bare": "bare launch",
    "staged_032": "staged 0.32",
    "staged_026": "staged 0.26",
}


def eager_now(rows: list[Row], doc: Path) -> str:
    """Host µs per eager call, each shape from the latest run that timed it."""
    latest: dict[tuple[str, int, int], dict[str, Row]] = {}
    for r in rows:
        # The query's paths only: `--eager --front` rows (the front's paths) are another table.
        if r["metric"] == HOST_US and r["kernel"] in EAGER:
            key = (r["recipe"], r["H"], r["M"])
            if latest.get(key) and next(iter(latest[key].values()))["source"] != r["source"]:
                latest[key] = {}
            latest.setdefault(key, {})[r["kernel"]] = r
    header = ["recipe", "H", "M", *(f"{title} µs" for title in EAGER.values())]
    header += ["public / staged", "run"]
    lines = []
    for (recipe, h, m), fig in sorted(
        latest.items(), key=lambda kv: (RECIPES.index(kv[0][0]), kv[0][1:])
    ):
        first = next(iter(fig.values()))
        ratio = fig["public"]["value"] / fig["staged_032"]["value"]
        lines.append(
            [TITLES[recipe], str(h), str(m)]
            + [f"{fig[k]['value']:.1f}" if k in fig else "–" for k in EAGER]
            + [
                f"{ratio:.2f}",
                f"{first['date'][:10]} {_link(first['source'], doc, first['commit'])}",
            ]
        )
    return "\n".join(
        [
            "`fusedq-bench --eager`: host µs per call outside CUDA graphs, best of the repeats, "
            "every path checked against staged first; staged = vLLM's block as 0.32 and 0.26 "
            "write it (E4M3: followed by a torch-native quantisation, a stand-in for vLLM's "
            f"one-kernel QuantFP8). Machine: {next(iter(next(iter(latest.values())).values()))['machine']}.",
            "",
            _table(header, lines),
        ]
    )


def _vllm_lines(run: list[Row]) -> list[list[str]]:
    staged = {(r["recipe"], r["H"], r["M"]): r for r in run if r["kernel"] == "staged"}
    lines = []
    for r in run:
        base = staged.get((r["recipe"], r["H"], r["M"]))
        if r["kernel"] == "staged" or base is None:
            continue
        delta = 100 * (r["value"] / base["value"] - 1)
        lines.append(
            [
                f"`{r['part']}`",
                r["date"][:10],
                r["commit"],
                "E4M3" if "e4m3" in r["recipe"] else "BF16",
                f"{r['M'] - 1} ({r['M']})",
                r["kernel"],
                f"`{r.get('kernel_name', '?')}`",
                f"{base['value']:.3f}",
                f"{r['value']:.3f}",
                f"{delta:+.1f} %".replace("-", "−"),
            ]
        )
    return lines


VLLM_HEADER = ["run", "date", "commit", "query out", "MTP (M)", "variant", "fused kernel"]
VLLM_HEADER += ["staged µs", "fused µs", "Δ"]


def vllm_now(rows: list[Row], doc: Path) -> str:
    """The decode query step per layer in a GPU vLLM, the latest day's runs."""
    runs = _sources(rows, lambda r: r["metric"] == VLLM_US)
    if not runs:
        raise TableError("no GPU vLLM profile runs in the results")
    day = list(runs.values())[-1][0]["date"][:10]
    today = [run for run in runs.values() if run[0]["date"][:10] == day]
    first = today[0][0]
    return "\n".join(
        [
            "Decode query step per layer from the paired decode profile "
            "(`orchestrator run` with a `profile:` phase; TP1, GLM-5's attention geometry "
            f"at {first['H']} heads, FULL decode CUDA graphs), {first['machine']}; "
            f"runs of {day}, data: {_link('benchmarks/results/h200.jsonl', doc)} "
            f"(sources: {', '.join(_link(run[0]['source'], doc, run[0]['part']) for run in today)}).",
            "",
            _table(VLLM_HEADER, [line for run in today for line in _vllm_lines(run)]),
        ]
    )


def vllm_all(rows: list[Row], doc: Path) -> str:
    """Every GPU vLLM profile pair in the results, oldest first."""
    runs = _sources(rows, lambda r: r["metric"] == VLLM_US)
    lines = [line for run in runs.values() for line in _vllm_lines(run)]
    return "\n".join(
        [
            "Every paired decode profile in the results (query step per layer, staged → the "
            "variant), oldest first; each run's folder is under `docs/validation/`.",
            "",
            _table(VLLM_HEADER, lines),
        ]
    )


# -- end-to-end A/B runs (docs/validation/<machine-date>/<run-id>/report.json) -----------------
VALIDATION = REPO / "docs" / "validation"
NO_MTP_READ = "not read"
REASON_CHARS = 60


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise TableError(f"{_rel(path)}: not JSON ({exc})") from None


def _run_matrix(report: Row, folder: Path) -> Row:
    """The matrix as run: the report's own where it carries one, else its manifest's."""
    if isinstance(report.get("matrix"), dict):
        return report["matrix"]
    manifest = folder / "manifest.json"
    if manifest.is_file():
        matrix = _read_json(manifest).get("matrix")
        if isinstance(matrix, dict):
            return matrix
    return {}


def _run_stamp(report: Row, folder: Path) -> str:
    """The run's timestamp: the report's, its manifest's, else the date in its parent's name."""
    stamp = report.get("created_at")
    manifest = folder / "manifest.json"
    if not stamp and manifest.is_file():
        stamp = _read_json(manifest).get("created_at")
    if stamp:
        return str(stamp)
    day = re.search(r"\d{4}-\d{2}-\d{2}", folder.parent.name)
    return day[0] if day else ""


def _token_workloads(report: Row, matrix: Row) -> set[str]:
    """The workloads that check greedy token ids (same_tokens: true) rather than speed."""
    for workloads in (matrix.get("workloads"), report.get("workloads")):
        if workloads and all("same_tokens" in w for w in workloads):
            return {w["name"] for w in workloads if w["same_tokens"]}
    return {w for case in report.get("cases") or [] for w in case.get("same_tokens") or {}}


def ab_runs_found(root: Path | None = None) -> list[tuple[Path, Row]]:
    """Run folders whose report.json has A/B results, by date of run, then run id."""
    found = []
    for path in (root or VALIDATION).glob("*/*/report.json"):
        report = _read_json(path)
        if (report.get("ab") or {}).get("results"):
            found.append((path.parent, report))
    return sorted(
        found, key=lambda fr: (_run_stamp(fr[1], fr[0])[:10], fr[1].get("run_id") or fr[0].name)
    )


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


def _minus(text: str) -> str:
    return text.replace("-", "−")


def _mean(side: Row) -> float | None:
    return side.get("mean") if side.get("n") else None


def _pair(res: Row | None, digits: int) -> str:
    if res is None:
        return "–"
    a, b = _mean(res["baseline"]), _mean(res["candidate"])
    return " → ".join("–" if v is None else f"{v:.{digits}f}" for v in (a, b))


def _ratio(res: Row | None) -> str:
    if res is None or res.get("ratio") is None:
        return "–"
    text = f"{res['ratio']:.4f}"
    if res.get("interval_pct"):
        lo, hi = res["interval_pct"]
        text += _minus(f", {lo:+.2f} % … {hi:+.2f} %")
    return text


def _units(res: Row | None) -> str:
    if res is None:
        return "–"
    ns = [res["baseline"].get("n") or 0, res["candidate"].get("n") or 0]
    text = str(ns[0]) if ns[0] == ns[1] else f"{ns[0]} / {ns[1]}"
    return f"{text} servers" if res.get("unit") == "servers" else text


def _acceptance(cases: list[Row], workload: str) -> str | None:
    rates = [
        sd["acceptance_rate"]
        for case in cases
        if (sd := ((case.get("workloads") or {}).get(workload) or {}).get("spec_decode"))
        and sd.get("acceptance_rate") is not None
    ]
    return f"{sum(rates) / len(rates):.2f}" if rates else None


def _tokens(cases: list[Row], token_workloads: set[str]) -> str:
    if not token_workloads:
        return "–"
    verdicts = [
        ((case.get("same_tokens") or {}).get(w) or {}).get("verdict") or "not-compared"
        for case in cases
        for w in sorted(token_workloads)
    ] or ["not-compared"]
    return ", ".join(dict.fromkeys(v.replace("-", " ") for v in verdicts))


def _mtp(cases: list[Row], topology: str) -> int | None:
    """A topology's MTP: its cases' own, else the ``mtpN`` of its id; None where neither says."""
    mtp = next((c["mtp"] for c in cases if c.get("mtp") is not None), None)
    if mtp is None:
        found = re.search(r"mtp(\d+)", topology)
        mtp = int(found[1]) if found else None
    return mtp


def _ab_lines(folder: Path, report: Row, doc: Path) -> list[list[str]]:
    matrix = _run_matrix(report, folder)
    heads = {m.get("label"): m.get("num_heads") for m in matrix.get("models") or []}
    token_workloads = _token_workloads(report, matrix)
    # Provenance first: on a machine the tree was copied to, git's HEAD is stale and the
    # build-info stamp names what ran (the report's header says the same).
    source = report.get("provenance") or report.get("git") or {}
    commit, dirty = source.get("commit"), source.get("dirty")
    commit_cell = f"{commit[:7]}{' (dirty)' if dirty else ''}" if commit else "unknown"
    target = folder / "report.md"
    run = _link(
        str(target if target.is_file() else folder / "report.json"),
        doc,
        folder.name,
    )
    by: dict[tuple[str, str], dict[str, Row]] = {}
    for res in report["ab"]["results"]:
        by.setdefault((res["topology_id"], res["workload"]), {})[res["metric"]] = res
    lines = []
    for (topology, workload), metrics in by.items():
        if workload in token_workloads:
            continue
        out, tpot = metrics.get("output_tok_s"), metrics.get("tpot_mean_ms")
        first = out or tpot or next(iter(metrics.values()))
        base, cand = first["baseline"]["variant"], first["candidate"]["variant"]
        cases = [c for c in report.get("cases") or [] if c["case_id"].startswith(topology + "/")]
        of = {v: [c for c in cases if c.get("variant") == v] for v in (base, cand)}
        mtp = _mtp(cases, topology)
        failed = [
            f"{c.get('variant')} case {c.get('status') or 'not run'}"
            + (f": {_short(c['reason'])}" if c.get("reason") else "")
            for c in cases
            if c.get("status") != "passed"
        ]
        verdict = "; ".join(
            failed
            + ([out["verdict"]] if out and (out.get("ratio") is not None or not failed) else [])
        )
        seen = [_acceptance(of[v], workload) for v in (base, cand)]
        model = topology.split("/")[0]
        lines.append(
            [
                run,
                commit_cell,
                f"`{topology}`",
                str(heads.get(model) or "–"),
                "–" if mtp is None else str(mtp),
                workload,
                _units(out),
                _pair(out, 2),
                _ratio(out),
                _cell(verdict) or "–",
                _with_verdict(_pair(tpot, 3), tpot),
                " / ".join(s or "–" for s in seen) if any(seen) else (NO_MTP_READ if mtp else "–"),
                _tokens(of[cand], token_workloads),
            ]
        )
    return lines


def _with_verdict(text: str, res: Row | None) -> str:
    if res is None or res.get("ratio") is None or not res.get("verdict"):
        return text
    return f"{text} ({_cell(res['verdict'])})"


def _short(reason: str) -> str:
    text = " ".join(reason.split())
    return text if len(text) <= REASON_CHARS else text[:REASON_CHARS].rstrip() + "…"


AB_HEADER = ["run", "commit", "topology", "heads", "MTP", "workload", "blocks per path"]
AB_HEADER += ["output tok/s, staged → fused", "fused/staged, 95 % interval", "verdict"]
AB_HEADER += ["TPOT mean ms, staged → fused", "MTP acceptance, staged / fused", "tokens"]


def ab_runs(rows: list[Row], doc: Path, root: Path | None = None) -> str:
    """Every end-to-end A/B in the run folders, one row per run, topology and workload."""
    root = root or VALIDATION
    runs = ab_runs_found(root)
    if not runs:
        raise TableError(f"no report.json with A/B results under {_rel(root)}")
    lines = [line for folder, report in runs for line in _ab_lines(folder, report, doc)]
    index = root / "README.md" if (root / "README.md").is_file() else root
    return "\n".join(
        [
            f"Every end-to-end A/B run in {_link(_rel(index), doc, '`docs/validation/`')}, "
            "oldest first: one row per run, topology and workload, from each run folder's "
            "`report.json` (models and workloads as run from its `manifest.json`). fused/staged: "
            "the report's output tok/s ratio with its 95 % interval (over server starts the ratio "
            "of their means; over a switch server's rounds the geometric mean of the rounds' "
            "ratios, at equal MTP acceptance where it was synthetic: docs/statistics.md); the "
            "TPOT verdict is a secondary figure's, Holm-corrected; the same-token workload is the "
            "token check (tokens column), not a speed row; (dirty): the run's tree had "
            "uncommitted changes.",
            "",
            _table(AB_HEADER, lines),
        ]
    )


H100_RESULTS = REPO / "benchmarks" / "results" / "h100.jsonl"
# What vLLM 0.26 serves staged, per recipe (fusedq-bench's note): BF16 out goes to
# FLASH_ATTN_MLA, which takes the (nope, pe) pair, so the bmm alone; E4M3 out runs bmm +
# concat-quantise (the bench's "staged"); MXFP8 weights against the bench's staged path.
SERVED_STAGED = {"bf16": "bmm", "e4m3": "staged", "mxfp8": "staged", "mxfp8-e4m3": "staged"}


def geometry_qualification(rows: list[Row], doc: Path, geometry: str = "deepseek-v3") -> str:
    """A geometry's floors run (the newest in the H100 results): fused against the staged
    path vLLM serves, per recipe, H and M, beside what fusedq.contract qualifies."""
    from fusedq import contract

    own = load(H100_RESULTS, geometry)
    if not own:
        raise TableError(f"no {geometry} rows in {_rel(H100_RESULTS)}")
    run = _floors_run(own)
    by = _by(run)
    q = contract.QUALIFIED[geometry]
    lines = []
    for h, m in _shapes(run):
        cells = [str(h), str(m)]
        for recipe in RECIPES:
            fused = by.get((recipe, h, m, "fused"))
            base = by.get((recipe, h, m, SERVED_STAGED[recipe]))
            ratio = fused["value"] / base["value"] if fused and base else None
            cells.append("–" if ratio is None else f"{ratio:.2f}")
        cells.append("yes" if m <= q.max_m_for(h) else "no")
        lines.append(cells)
    header = ["H", "M", *(f"{TITLES[r]} fused/served staged" for r in RECIPES), "qualified"]
    return "\n".join(
        [
            _about(run, doc, f"fusedq-bench --floors --geometry {geometry}", H100_RESULTS),
            "",
            "Fused ÷ the staged path vLLM 0.26 serves (BF16 out: the bmm alone, FLASH_ATTN_MLA "
            "taking the (nope, pe) pair; E4M3 out and MXFP8 weights: the bench's staged path), "
            "CUDA-graph medians; below 1 the fused query is faster. Qualified: "
            f"`fusedq.contract.QUALIFIED` ({q.describe().replace('<=', '≤')}).",
            "",
            _table(header, lines),
        ]
    )


# What e2e_now's stand-in cell leaves unsaid: the bf16 weights, the fused query and the
# model's own KV cache dtype.
NOT_NAMED = ("bf16", "candidate `fused`", "")


def _named(parts: Iterable[str]) -> str:
    """' (a, b)': what a stand-in cell names beside the stand-in, or '' for nothing."""
    named = ", ".join(parts)
    return f" ({named})" if named else ""


def _kv_cache(matrix: Row, model: Row) -> str:
    """The KV cache the servers ran with where the engine or model args set one ("fp8 KV
    cache"), else "": an FP8 cache changes the decode step, so its run is not the BF16
    cache run's successor."""
    from orchestrator.engines.vllm.server import flag_value

    args = [*((matrix.get("engine") or {}).get("args") or []), *(model.get("args") or [])]
    dtype = flag_value(args, "--kv-cache-dtype")
    return f"{dtype} KV cache" if dtype and dtype != "auto" else ""


def _over(res: Row) -> str:
    """What a primary figure's interval is over: one switch server's rounds, or the starts of
    a server per variant (restarts)."""
    base, cand, unit = res["baseline"]["n"], res["candidate"]["n"], res.get("unit") or "units"
    if unit == "rounds":
        return f"{base} rounds, one server"
    if unit == "blocks":
        return f"{base} + {cand} blocks, one server"
    return f"{base} + {cand} {unit}"


def e2e_now(rows: list[Row], doc: Path, root: Path | None = None) -> str:
    """The primary figure of the newest A/B run of each stand-in (and weight format), head
    count and MTP."""
    # Keyed by the weight format and the candidate too: an MXFP8 run is not the bf16 run's
    # successor, nor a run of another candidate (the decode front) the fused query's.
    # And by the sampling unit: server starts (restarts) measure against another baseline
    # server than a switch server's rounds, so neither run replaces the other.
    newest: dict[tuple[str, str, str, str, int, int, str], tuple[Path, Row]] = {}
    for folder, report in ab_runs_found(root or VALIDATION):
        matrix = _run_matrix(report, folder)
        models = {
            m.get("label"): (
                m.get("path"),
                m.get("weight_format") or "bf16",
                _kv_cache(matrix, m),
                m.get("num_heads"),
            )
            for m in matrix.get("models") or []
        }
        for res in report["ab"]["results"]:
            if res.get("role") != "primary":
                continue
            topology = res["topology_id"]
            path, fmt, kv, heads = models.get(topology.split("/")[0], ("?", "bf16", "", 0))
            cases = [
                c for c in report.get("cases") or [] if c["case_id"].startswith(topology + "/")
            ]
            cand = (res.get("candidate") or {}).get("variant") or "fused"
            key = (path, fmt, kv, cand, heads, _mtp(cases, topology) or 0, res.get("unit") or "")
            newest[key] = (folder, res)
    lines = [
        [
            f"`{path}`" + _named(x for x in (fmt, kv, f"candidate `{cand}`") if x not in NOT_NAMED),
            str(heads),
            str(mtp),
            _ratio(res) + f": {_cell(res['verdict'])}",
            _over(res),
            f"{_link(_rel(folder / 'report.md'), doc, folder.name)} ({folder.parent.name})",
        ]
        for (path, fmt, kv, cand, heads, mtp, _), (folder, res) in sorted(newest.items())
    ]
    if not lines:
        raise TableError("no committed A/B run has a primary figure")
    return "\n".join(
        [
            "The primary figure, ctx0 output tok/s fused/staged with its 95 % interval (over "
            "a switch-mode server's paired rounds, at equal synthetic acceptance under MTP, or "
            "over server starts), of the newest committed A/B run of each stand-in (and weight "
            "format, KV cache, and candidate where it is not the fused query), head count, MTP "
            "and "
            f"sampling unit; every run and figure: {_link('docs/standins.md', doc)}, generated "
            "from each run's `report.json`.",
            "",
            _table(["stand-in", "heads", "MTP", "fused/staged, 95 %", "over", "run"], lines),
        ]
    )


EVIDENCE_HEADER = [
    "run",
    "topology",
    "workload",
    "traced steps",
    "query step µs/step",
    "other families changed (µs/step)",
    "whole step µs/step (95 %)",
    "TPOT µs/token (95 %)",
    "agree",
]


def _us(value: float, interval: list[float] | None = None) -> str:
    text = _minus(f"{value:+.1f}")
    if interval:
        lo, hi = (_minus(f"{v:+.1f}") for v in interval)
        text += f" ({lo} … {hi})"
    return text


def evidence_runs(rows: list[Row], doc: Path, root: Path | None = None) -> str:
    """The evidence chain of every committed A/B run whose report has the whole step by
    kernel family: the profile's prediction beside the measured TPOT change."""
    lines = []
    for folder, report in ab_runs_found(root or VALIDATION):
        for ev in report["ab"].get("evidence") or []:
            steps = ev.get("steps")
            if not steps:
                continue
            fams = {f["family"]: f for f in steps["families"]}
            others = [
                f"{f['family']} {_us(f['change_us'])}"
                for f in steps["families"]
                if f["changed"] and f["family"] != "query"
            ]
            total = steps["total"]
            lines.append(
                [
                    _link(_rel(folder / "report.md"), doc, folder.name),
                    f"`{ev['topology_id']}`",
                    ev["workload"],
                    str(steps["steps"]),
                    _us(fams["query"]["change_us"], fams["query"]["interval_us"]),
                    ", ".join(others) or "none",
                    _us(total["change_us"], total["interval_us"]),
                    _us(ev["measured_us_per_token"], ev["measured_interval_us"]),
                    "yes" if ev["agrees"] else "no",
                ]
            )
    if not lines:
        raise TableError("no committed A/B report has the whole step by kernel family")
    return "\n".join(
        [
            "Every committed A/B run whose report has the whole step by kernel family, from its "
            "`report.json` (`ab.evidence`): the families' changes per model step over the traced "
            "steps with Student's t interval, beside the TPOT mean's change with its interval "
            "over rounds; they agree when their difference lies within the two half-widths "
            "facing each other, added in quadrature (docs/statistics.md).",
            "",
            _table(EVIDENCE_HEADER, lines),
        ]
    )


def ab_rejudged(rows: list[Row], doc: Path) -> str:
    """The committed A/B verdicts that changed with the paired analysis, old -> new
    (benchmarks/scripts/ab_verdicts.py, a sibling script)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_ab_verdicts", Path(__file__).with_name("ab_verdicts.py")
    )
    assert spec is not None and spec.loader is not None
    verdicts = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(verdicts)
    return f"{verdicts.summary()}\n\n{verdicts.table(doc)}"


TABLES: dict[str, Callable[[list[Row], Path], str]] = {
    "kernel-now": kernel_now,
    "floors-now": floors_now,
    "floors-trend": trend,
    "eager-now": eager_now,
    "vllm-now": vllm_now,
    "vllm-all": vllm_all,
    "ab-runs": ab_runs,
    "ab-rejudged": ab_rejudged,
    "evidence-runs": evidence_runs,
    "e2e-now": e2e_now,
    "deepseek-v3-qualification": geometry_qualification,
}


# -- documents ---------------------------------------------------------------------------------
def documents() -> list[Path]:
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def render(text: str, doc: Path, rows: list[Row]) -> tuple[str, list[str]]:
    """The document with every region regenerated, and the names of those that changed."""
    out, changed, pos = [], [], 0
    for m in START.finditer(text):
        if m.start() < pos:
            continue
        line = text.count("\n", 0, m.start()) + 1
        name = m[1]
        if name not in TABLES:
            raise TableError(
                f"{_rel(doc)}:{line}: unknown table {name!r} (known: {', '.join(TABLES)})"
            )
        end = text.find(END, m.end())
        if end < 0:
            raise TableError(f"{_rel(doc)}:{line}: generated:{name} has no {END}")
        body = "\n" + TABLES[name](rows, doc) + "\n"
        if text[m.end() : end] != body:
            changed.append(f"{_rel(doc)}:{line}: generated:{name}")
        out += [text[pos : m.end()], body]
        pos = end
    out.append(text[pos:])
    return "".join(out), changed


def _rel(path: Path) -> str:
    try:
        return str(path.relative_to(REPO))
    except ValueError:
        return str(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="rewrite every marked region")
    mode.add_argument("--check", action="store_true", help="exit 1 when a region differs")
    ap.add_argument("--results", type=Path, default=RESULTS)
    ap.add_argument(
        "files", nargs="*", type=Path, help="documents (default: README.md, docs/**/*.md)"
    )
    args = ap.parse_args(argv)
    try:
        rows = load(args.results)
        stale = []
        for doc in [p.resolve() for p in args.files] or documents():
            text = doc.read_text()
            new, changed = render(text, doc, rows)
            stale += changed
            if args.write and new != text:
                doc.write_text(new)
    except (TableError, OSError) as exc:
        print(f"tables: {exc}", file=sys.stderr)
        return 2
    for region in stale:
        print(f"{region}: {'rewritten' if args.write else 'differs from the results'}")
    if args.check and stale:
        print("tables: run python benchmarks/scripts/tables.py --write", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
