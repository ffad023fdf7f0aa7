"""Append measured figures to a machine kind's results file: one JSON row per
commit x recipe x shape x kernel (the floors included), so that every table of figures in
the docs is generated from data (benchmarks/scripts/tables.py), never typed.

Sources, each the unchanged output of the tool that measured:

- ``fusedq-bench --json`` (plain, ``--floors``, ``--chain``, ``--sweep``, ``--front``,
  ``--eager``);
- ``benchmarks/experiments/cute_ab.py`` and ``cute_floor.py`` output, also files that gather
  several of their runs (a ``runs`` list or named parts);
- an ``orchestrator run`` directory whose matrix had a profile phase (``report.json`` beside
  ``manifest.json``): the decode query step per layer inside a GPU vLLM.

Usage (from the repository root)::

    python benchmarks/scripts/ingest.py SOURCE... [--results benchmarks/results/h200.jsonl]
                                        [--commit SHA --note WHY]
    python benchmarks/scripts/ingest.py --check [--results ...]

The file is append-only: a source already in it is refused. ``--commit`` (with ``--note``
saying why) records the commit that ran where the source names none or a wrong one (a
device copy's stale git HEAD); otherwise the source's own commit is kept, ``unknown`` where
it has none. ``--check`` converts every source again and fails when its rows differ.

Row fields, in this order (``[...]`` only where known)::

    date, commit, [commit_note], machine, tool, source, [part], [geometry], recipe, H, M,
    kernel, [kernel_name], metric, value, [median], [samples], [err, mismatch_bytes]

``geometry`` is the MLA geometry a fusedq-bench row names (``glm5``, ``deepseek-v3``); rows
of sources that predate it have none and are GLM-5's.

``recipe`` is fusedq-bench's format name: ``bf16`` (bf16 weights, BF16 out), ``mxfp8``,
``e4m3`` (bf16 weights, E4M3 out), ``mxfp8-e4m3``. ``kernel`` is what was timed: ``fused``
(backend="auto"), ``staged`` (vLLM's path), a forced backend, ``--front``'s paths
(``staged_front``, ``fused_front``, ``staged_query``, ``fused_query``, ``fused_query_dot``,
``vllm_fused_front``),
a floor (``read``, ``store``, ``empty``, ``grid``, ``view``, ...), a sweep or A/B variant,
or a server's variant;
``kernel_name`` what ran where the source says (the fused kernel, the read floor's best
tile). Values are rounded to 0.1 ns; the spreads (p10/p90), a sweep variant's launch config
and the environment stay in the source, which every row names.
``metric``: ``gpu_us_per_layer`` (median of CUDA-graph replays, weights rotated past L2),
``host_us_per_call`` (eager calls, best of the repeats), ``vllm_query_us_per_layer`` (the
profile's decode query step per layer).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
DEFAULT_RESULTS = REPO / "benchmarks" / "results" / "h200.jsonl"
GPU_US = "gpu_us_per_layer"
HOST_US = "host_us_per_call"
VLLM_US = "vllm_query_us_per_layer"
# Derived columns of fusedq-bench rows: the best read/store tile, which a read_w*/store_w*
# row already holds under its own name.
DERIVED = {"read", "store"}
# A bench row's key holding a figure: <kernel>_us, with <kernel>_p10_us / _p90_us beside it.
SPREAD = ("_p10_us", "_p90_us", "_median_us")
# The read/store floors are timed at several tile sizes; a row keeps the fastest.
TILE = re.compile(r"(read|store)_w\d+")
ROW_KEYS = (
    "date",
    "commit",
    "commit_note",
    "machine",
    "tool",
    "source",
    "part",
    "geometry",
    "recipe",
    "H",
    "M",
    "kernel",
    "kernel_name",
    "metric",
    "value",
    "median",
    "samples",
    "err",
    "mismatch_bytes",
)


class SourceError(ValueError):
    """A source this converter cannot read; the message names the file and what is wrong."""


def _rel(path: Path) -> str:
    try:
        return str(path.resolve().relative_to(REPO))
    except ValueError:
        return str(path)


def _commit(text: str | None) -> tuple[str, str | None]:
    """The short commit a source records, or ``unknown`` (with a note quoting what it says)."""
    if not text or text == "unknown":
        return "unknown", None
    m = re.fullmatch(r"([0-9a-f]{7,40})(\+dirty)?", text)
    if m is None:
        return "unknown", f"the source's commit field reads {text!r}"
    return m[1][:7] + (m[2] or ""), None


def _machine(env: dict[str, Any] | None, fallback: str | None) -> str:
    if not env:
        return fallback or "unknown"
    parts = [env.get("gpu", "unknown GPU")]
    driver = (env.get("nvidia_smi") or {}).get("driver_version")
    if driver:
        parts.append(f"driver {driver}")
    parts += [f"{k} {env[k]}" for k in ("torch", "triton") if env.get(k)]
    return ", ".join(parts)


def _date_from_name(path: Path) -> str | None:
    m = re.search(r"\d{4}-\d{2}-\d{2}", str(path))
    return m[0] if m else None


def _row(**fields: Any) -> dict[str, Any]:
    if isinstance(fields.get("value"), float):
        fields["value"] = round(fields["value"], 4)
    return {k: fields[k] for k in ROW_KEYS if fields.get(k) is not None}


def _tiles(figures: dict[str, float]) -> dict[str, tuple[float, str]]:
    """The read and store floors of one shape: the fastest of their timed tiles (read_w512 ...),
    as fusedq-bench itself takes it, with that tile's name."""
    best: dict[str, tuple[float, str]] = {}
    for name, value in figures.items():
        m = TILE.fullmatch(name)
        if m and (m[1] not in best or value < best[m[1]][0]):
            best[m[1]] = (value, name)
    return best


# -- fusedq-bench ------------------------------------------------------------------------------
def _bench_tool(doc: dict[str, Any]) -> str:
    opts = doc.get("options") or {}
    rows = doc.get("rows") or []
    flags = []
    if opts.get("sweep") or "sweep" in doc:
        flags.append("--sweep")
    if opts.get("chain"):
        flags.append("--chain")
    if opts.get("floors") or any("empty_us" in r for r in rows):
        flags.append("--floors")
    if opts.get("front"):
        flags.append("--front")
    if "eager" in doc:
        flags.append("--eager")
    return " ".join(["fusedq-bench", *flags])


def _bench_rows(
    doc: dict[str, Any], base: dict[str, Any], labels: dict[str, str]
) -> Iterator[dict]:
    samples = (doc.get("options") or {}).get("samples")
    for r in doc.get("rows", []):
        shape = {"geometry": r.get("geometry"), "recipe": r["format"], "H": r["H"], "M": r["M"]}
        figures = {
            k[:-3]: v
            for k, v in r.items()
            if k.endswith("_us") and not k.endswith(SPREAD) and k[:-3] not in DERIVED
        }
        for kernel, value in figures.items():
            if TILE.fullmatch(kernel):
                continue
            # fusedq-bench rows may name the kernel auto ran ("fused_kernel"); older runs
            # have it, where known, in a <source>.kernels.json beside them. --front rows
            # name every path's kernels ("<kernel>_kernel") and its fused front's error
            # ("<kernel>_err").
            label = r.get("fused_kernel") or labels.get(f"{r['format']}/{r['H']}/{r['M']}")
            name = label if kernel == "fused" else r.get(f"{kernel}_kernel")
            yield _row(
                **base,
                **shape,
                kernel=kernel,
                kernel_name=name,
                metric=GPU_US,
                value=value,
                samples=samples,
                err=(
                    r.get("max_abs_err_vs_staged") if kernel == "fused" else r.get(f"{kernel}_err")
                ),
            )
        for kernel, (value, tile) in _tiles(figures).items():
            yield _row(
                **base,
                **shape,
                kernel=kernel,
                kernel_name=tile,
                metric=GPU_US,
                value=value,
                samples=samples,
            )
    for r in doc.get("sweep", []):
        yield _row(
            **base,
            geometry=r.get("geometry"),
            recipe=r["format"],
            H=r["H"],
            M=r["M"],
            kernel=r["variant"],
            metric=GPU_US,
            value=r["us"],
            samples=samples,
            err=r.get("max_abs_err_vs_staged"),
        )
    for r in doc.get("eager", []):
        for key, value in r.items():
            if key.endswith("_us") and not key.endswith(SPREAD):
                kernel = key[:-3]
                yield _row(
                    **base,
                    recipe=r["format"],
                    H=r["H"],
                    M=r["M"],
                    kernel=kernel,
                    metric=HOST_US,
                    value=value,
                    median=r.get(f"{kernel}_median_us"),
                    samples=r.get("calls"),
                    err=r.get("max_abs_err_vs_staged") if kernel == "public" else None,
                )


# -- cute_ab.py / cute_floor.py ------------------------------------------------------------------
def _parts(doc: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, dict[str, Any]]]:
    """(name, part) for every block of rows: the file itself, its ``runs``, its named parts."""
    if "rows" in doc:
        yield prefix, doc
    for i, run in enumerate(doc.get("runs") or []):
        yield f"{prefix}{run.get('run') or f'runs[{i}]'}", run
    for key, value in doc.items():
        if isinstance(value, dict) and key not in ("environment", "options"):
            yield from _parts(value, f"{prefix}{key}.")


def _weights(part: str, doc: dict[str, Any]) -> str:
    if "bf16" in part:
        return "bf16"
    if "mxfp8" in part:
        return "mxfp8"
    return "bf16" if "--weights bf16" in str(doc.get("what", "")) else "mxfp8"


def _recipe(weights: str, out: str) -> str:
    if out == "bf16":
        return weights
    return "e4m3" if weights == "bf16" else "mxfp8-e4m3"


def _experiment_rows(doc: dict[str, Any], base: dict[str, Any], path: Path) -> Iterator[dict]:
    top_env = doc.get("environment")
    for name, part in _parts(doc):
        part_name = name.rstrip(".") or None
        env = part.get("environment") or top_env
        commit, note = _commit((env or {}).get("commit") or part.get("commit") or doc.get("commit"))
        meta = {
            **base,
            "date": (env or {}).get("date_utc") or base["date"],
            "machine": _machine(env, doc.get("machine")),
            "part": part_name,
        }
        if "commit" not in base:
            meta |= {"commit": commit, "commit_note": note}
        weights = _weights(part_name or "", doc)
        common = {**meta, "samples": part.get("samples") or doc.get("samples"), "metric": GPU_US}
        for r in part["rows"]:
            if "variant" not in r and "cute_floor_us" not in r:
                raise SourceError(
                    f"{_rel(path)}: {name or 'rows'}: a row of unknown shape {sorted(r)}"
                )
        yield from _cute_ab_rows([r for r in part["rows"] if "variant" in r], weights, common)
        yield from _cute_floor_rows(
            [r for r in part["rows"] if "cute_floor_us" in r], weights, common
        )


def _cute_ab_rows(rows: list[dict], weights: str, common: dict[str, Any]) -> Iterator[dict]:
    """cute_ab.py: variants named <out>_<kernel> beside the read-only floors of one set."""
    floors: dict[tuple[int, int], dict[str, float]] = {}
    for r in rows:
        out, _, kernel = r["variant"].partition("_")
        if out not in ("bf16", "e4m3") or not kernel:
            floors.setdefault((r["H"], r["M"]), {})[r["variant"]] = r["us"]
            continue
        yield _row(
            **common,
            tool="cute_ab.py",
            recipe=_recipe(weights, out),
            H=r["H"],
            M=r["M"],
            kernel=kernel,
            value=r["us"],
            err=r.get("err"),
            mismatch_bytes=r.get("mismatch_bytes"),
        )
    for (h, m), figures in floors.items():
        yield from _floor_rows(figures, "cute_ab.py", weights, h, m, common)


def _cute_floor_rows(rows: list[dict], weights: str, common: dict[str, Any]) -> Iterator[dict]:
    """cute_floor.py: the loads-only kernel, the product's call (BF16 out) and the floors."""
    for r in rows:
        figures = {k[:-3]: v for k, v in r.items() if k.endswith("_us") and k[:-3] not in DERIVED}
        yield from _floor_rows(figures, "cute_floor.py", weights, r["H"], r["M"], common)


def _floor_rows(
    figures: dict[str, float], tool: str, recipe: str, h: int, m: int, common: dict[str, Any]
) -> Iterator[dict]:
    for kernel, value in figures.items():
        if not TILE.fullmatch(kernel):
            yield _row(**common, tool=tool, recipe=recipe, H=h, M=m, kernel=kernel, value=value)
    for kernel, (value, tile) in _tiles(figures).items():
        yield _row(
            **common,
            tool=tool,
            recipe=recipe,
            H=h,
            M=m,
            kernel=kernel,
            kernel_name=tile,
            value=value,
        )


# -- orchestrator runs with a profile phase ---------------------------------------------------------
def _query_us(trace: dict[str, Any]) -> tuple[float, int, str | None]:
    """Per-layer time of one trace's decode query step: the query-step rule's own figure
    where it found the path it expected; where it did not (a rule of its day that did not
    know a fusedq kernel's name and counted another GEMM, ``mixed`` windows), the fusedq
    kernel's own total over its calls from the trace's kernel table."""
    from orchestrator.analysis.trace import FUSED, QueryRule

    query = trace["query"]
    rule = QueryRule()
    fused = [k for k in trace.get("top", []) if rule.classify(k["name"]) == FUSED]
    if query.get("path") == "fused" or not fused:
        # The query step's own kernel where the path is fused: a model with larger kernels
        # (a MoE stand-in) keeps it out of the trace's top table.
        named = fused or query.get("path") == "fused"
        return (
            query["total_us"] / query["occurrences"],
            query["occurrences"],
            (next(iter(query.get("names") or {}), None) if named else None),
        )
    top = max(fused, key=lambda k: k["count"])
    return top["total_us"] / top["count"], top["count"], top["name"]


def _run_rows(run_dir: Path, base: dict[str, Any]) -> Iterator[dict]:
    report = json.loads((run_dir / "report.json").read_text())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    cases = {c["case_id"]: c for c in manifest["cases"]}
    versions = manifest.get("versions") or {}
    gpu = (manifest.get("gpus") or ["unknown GPU"])[0]
    gpu = re.sub(r"^GPU \d+: | \(UUID.*$", "", gpu)
    machine = ", ".join(
        [gpu, *(f"{k} {versions[k]}" for k in ("vllm", "torch", "triton") if k in versions)]
    )
    git = manifest.get("git") or {}
    commit, note = _commit((git.get("commit") or "") + ("+dirty" if git.get("dirty") else ""))
    meta = {
        "commit": commit,
        "commit_note": note,
        **base,
        "machine": machine,
        "part": report["run_id"],
    }
    meta["date"] = manifest["created_at"].replace("+00:00", "Z")
    for case in report["cases"]:
        traces = (case.get("profile") or {}).get("traces") or []
        if not traces:
            continue
        spec = cases[case["case_id"]]
        figures = [_query_us(t) for t in traces]
        e4m3 = any(a.split("=", 1)[0] == "--kv-cache-dtype" and "fp8" in a for a in spec["args"])
        yield _row(
            **meta,
            tool="orchestrator run (profile phase)",
            recipe=_recipe(spec["weight_format"], "e4m3" if e4m3 else "bf16"),
            H=spec["heads_per_rank"],
            M=1 + spec["mtp"],
            kernel=spec["variant"],
            kernel_name=figures[0][2],
            metric=VLLM_US,
            value=round(sum(f[0] for f in figures) / len(figures), 6),
            samples=sum(f[1] for f in figures),
        )


# -- one source ----------------------------------------------------------------------------------
def convert(path: Path, *, commit: str | None = None, note: str | None = None) -> list[dict]:
    """The rows of one source, in a fixed order; ``commit``/``note`` replace its own commit."""
    if not path.exists():
        raise SourceError(f"{_rel(path)}: no such file or directory")
    base: dict[str, Any] = {"source": _rel(path)}
    if commit is not None:
        if not note:
            raise SourceError(f"{_rel(path)}: --commit {commit} needs --note saying why")
        base |= {"commit": commit, "commit_note": note}
    if path.is_dir():
        if not (path / "report.json").exists() or not (path / "manifest.json").exists():
            raise SourceError(f"{_rel(path)}: a run directory needs report.json and manifest.json")
        return list(_run_rows(path, base))
    try:
        doc = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise SourceError(f"{_rel(path)}: not JSON ({exc})") from None
    env = doc.get("environment")
    base["date"] = (env or {}).get("date_utc") or _date_from_name(path)
    if base["date"] is None:
        raise SourceError(f"{_rel(path)}: no environment.date_utc and no date in its name")
    if "options" in doc:  # fusedq-bench
        if commit is None:
            own, own_note = _commit((env or {}).get("commit"))
            base |= {
                "commit": own,
                "commit_note": doc.get("commit_note") or (env or {}).get("commit_note") or own_note,
            }
        labels_file = path.with_suffix(".kernels.json")
        labels = json.loads(labels_file.read_text())["fused"] if labels_file.exists() else {}
        base |= {"machine": _machine(env, None), "tool": _bench_tool(doc)}
        rows = list(_bench_rows(doc, base, labels))
    else:
        rows = list(_experiment_rows(doc, base, path))
    if not rows:
        raise SourceError(
            f"{_rel(path)}: no figures found (not a fusedq-bench, cute_ab.py or cute_floor.py output)"
        )
    return rows


def read_results(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError as exc:
            raise SourceError(f"{_rel(path)}:{n}: not a JSON row ({exc})") from None
    return rows


def _line(row: dict[str, Any]) -> str:
    return json.dumps(row, ensure_ascii=False, separators=(",", ":"))


def append(results: Path, sources: list[Path], *, commit: str | None, note: str | None) -> int:
    """Append each source's rows; nothing is written unless every source converts."""
    known = {r["source"] for r in read_results(results)}
    lines = []
    for src in sources:
        if _rel(src) in known:
            raise SourceError(
                f"{_rel(results)}: {_rel(src)} is already in it (the file is append-only)"
            )
        rows = convert(src, commit=commit, note=note)
        known.add(_rel(src))
        lines += [_line(r) for r in rows]
    results.parent.mkdir(parents=True, exist_ok=True)
    with results.open("a") as f:
        f.writelines(line + "\n" for line in lines)
    return len(lines)


def check(results: Path) -> list[str]:
    """Every source's rows as the converter makes them today, contiguous and unedited."""
    rows = read_results(results)
    problems, order = [], []
    by_source: dict[str, list[dict]] = {}
    for r in rows:
        if r["source"] not in by_source:
            order.append(r["source"])
        elif order[-1] != r["source"]:
            problems.append(f"{r['source']}: its rows are not contiguous")
        by_source.setdefault(r["source"], []).append(r)
    for source in order:
        stored = by_source[source]
        given = stored[0] if all("commit_note" in r for r in stored) else None
        try:
            again = convert(
                REPO / source,
                commit=given["commit"] if given and _overridden(REPO / source, given) else None,
                note=given["commit_note"] if given and _overridden(REPO / source, given) else None,
            )
        except SourceError as exc:
            problems.append(str(exc))
            continue
        if [_line(r) for r in again] != [_line(r) for r in stored]:
            problems.append(
                f"{source}: its {len(stored)} rows differ from the {len(again)} it converts to"
            )
    return problems


def _overridden(path: Path, row: dict[str, Any]) -> bool:
    """Whether a stored row's commit came from --commit rather than from the source itself."""
    own = convert(path)
    return (
        not own
        or own[0].get("commit") != row["commit"]
        or own[0].get("commit_note") != row["commit_note"]
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "sources",
        nargs="*",
        type=Path,
        help="fusedq-bench/cute_ab/cute_floor JSON or a run directory",
    )
    ap.add_argument(
        "--results",
        type=Path,
        default=DEFAULT_RESULTS,
        help="the results file (default %(default)s)",
    )
    ap.add_argument(
        "--commit", help="the commit that ran, where the source names none or a wrong one"
    )
    ap.add_argument("--note", help="why --commit is given (kept in every row)")
    ap.add_argument("--check", action="store_true", help="convert every source again and compare")
    args = ap.parse_args(argv)
    try:
        if args.check:
            problems = check(args.results)
            for p in problems:
                print(f"ingest: {p}", file=sys.stderr)
            print(
                f"{_rel(args.results)}: {'stale' if problems else 'every source reproduces its rows'}"
            )
            return 1 if problems else 0
        if not args.sources:
            ap.error("give SOURCE... or --check")
        n = append(args.results, args.sources, commit=args.commit, note=args.note)
    except SourceError as exc:
        print(f"ingest: {exc}", file=sys.stderr)
        return 2
    print(f"{_rel(args.results)}: {n} rows appended")
    return 0


if __name__ == "__main__":
    sys.exit(main())
