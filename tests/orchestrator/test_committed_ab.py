"""Every committed A/B verdict, recomputed from its run's results.jsonl without the analysis
code: the paired interval over rounds, the acceptance adjustment, the roles and Holm's
correction, the power figure; and the verdicts of the day (docs/validation/ab-first-verdicts.
jsonl) recomputed with the method of the day (Fieller's interval over unpaired blocks), so
neither the reports nor the record of what they first said can drift from the data. The
table of changed verdicts in docs/statistics.md is generated from both
(benchmarks/scripts/ab_verdicts.py; tests/benchmarks/test_results.py keeps it current).

Student's t is taken from closed forms (1 and 2 df) and printed tables (3 and 5 df), not
from orchestrator.analysis.stats.
"""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
from pathlib import Path

import pytest

from orchestrator.analysis.stats import MeanEstimate, ratio_interval

REPO = Path(__file__).resolve().parents[2]
VALIDATION = REPO / "docs" / "validation"
# Two-sided 95 % (0.975) and 80 % power (0.8) quantiles: tan(pi (p - 1/2)) at 1 df,
# (2p - 1) sqrt(2 / (4p(1 - p))) at 2 df, the printed tables at 3 and 5 df (six rounds).
T975 = {
    1: math.tan(0.475 * math.pi),
    2: 0.95 * math.sqrt(2 / 0.0975),
    3: 3.182446305,
    5: 2.570581836,
}
T80 = {1: math.tan(0.3 * math.pi), 2: 0.6 * math.sqrt(2 / 0.64), 3: 0.978472312, 5: 0.919543780}
OF_BLOCK = {
    "output_tok_s": lambda r: r.get("aggregate_tok_s"),
    "tpot_p50_ms": lambda r: (r.get("tpot_ms") or {}).get("p50"),
    "tpot_mean_ms": lambda r: (r.get("tpot_ms") or {}).get("mean"),
    "ttft_p50_ms": lambda r: (r.get("ttft_ms") or {}).get("p50"),
}


def _two_sided_p(t: float, df: int) -> float:
    """P(|T| > |t|) in closed form for 1, 2, 3 and 5 df."""
    t = abs(t)
    if df == 1:
        return 1 - 2 / math.pi * math.atan(t)
    if df == 2:
        return 1 - t / math.sqrt(2 + t * t)
    # Odd df: with u = t / sqrt(df), theta + sin(theta) cos(theta) (1 + 2/3 cos^2 ... ).
    assert df in (3, 5), df
    u = t / math.sqrt(df)
    c2 = 1 / (1 + u * u)
    series = 1.0 if df == 3 else 1 + 2 / 3 * c2
    return 1 - 2 / math.pi * (math.atan(u) + u * c2 * series)


def _load_verdicts():
    path = REPO / "benchmarks" / "scripts" / "ab_verdicts.py"
    spec = importlib.util.spec_from_file_location("bench_ab_verdicts_test", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


verdicts = _load_verdicts()
REPORTS = verdicts.ab_reports()


def _case_rows(run: str) -> dict[str, dict]:
    """case id -> the run's row (the latest line of each case)."""
    rows = {}
    for line in (VALIDATION / run / "results.jsonl").read_text().splitlines():
        row = json.loads(line)
        rows[row["case_id"]] = row
    return rows


def _rows(run: str) -> dict[tuple[str, str], dict]:
    """(topology, variant) -> the run's row (the latest line of each case)."""
    return {(r["topology_id"], r["variant"]): r for r in _case_rows(run).values()}


def _blocks(row: dict, workload: str, metric: str) -> list[float | None]:
    if row.get("status") != "passed" or workload not in row["workloads"]:
        return []
    return [OF_BLOCK[metric](b) for b in row["workloads"][workload]["repeats"]]


def _kind(interval: list[float] | None, higher_is_better: bool) -> str:
    if interval is None:
        return "too few"
    if interval[0] > 0 or interval[1] < 0:
        return "faster" if (interval[0] > 0) == higher_is_better else "slower"
    return "no change"


def _elasticities(base: dict, cand: dict, metric: str, rounds: list[int]) -> list[float]:
    if metric == "ttft_p50_ms":  # the first token comes before any draft is verified
        return [0.0] * len(rounds)
    if metric != "output_tok_s":
        return [-1.0] * len(rounds)

    def share(block: dict) -> float:
        return 1 - block["ttft_ms"]["mean"] / block["e2el_ms"]["mean"]

    return [(share(base["repeats"][k]) + share(cand["repeats"][k])) / 2 for k in rounds]


def _recompute(run: str, res: dict) -> dict:
    """The figure `res` of report.json, from results.jsonl alone."""
    rows = _rows(run)
    base = rows[(res["topology_id"], res["baseline"]["variant"])]
    cand = rows[(res["topology_id"], res["candidate"]["variant"])]
    w, m = res["workload"], res["metric"]
    b_blocks, c_blocks = _blocks(base, w, m), _blocks(cand, w, m)
    pairs = [
        (k, b, c)
        for k, (b, c) in enumerate(zip(b_blocks, c_blocks, strict=False))
        if None not in (b, c)
    ]
    out = {
        "baseline": [v for v in b_blocks if v is not None],
        "candidate": [v for v in c_blocks if v is not None],
        "pairs": [[b, c] for _, b, c in pairs] or None,
    }
    if len(pairs) < 2:
        return out | {"interval": None}
    d = [math.log(c / b) for _, b, c in pairs]
    spec_b = base["workloads"][w].get("spec_decode") or {}
    spec_c = cand["workloads"][w].get("spec_decode") or {}
    if spec_b.get("configured_rates") and spec_c.get("configured_rates"):
        k_mtp = base["mtp"]
        x = [
            math.log(
                (1 + k_mtp * spec_c["block_rates"][k]) / (1 + k_mtp * spec_b["block_rates"][k])
            )
            for k, _, _ in pairs
        ]
        e = _elasticities(base["workloads"][w], cand["workloads"][w], m, [k for k, _, _ in pairs])
        out["plain"] = d
        d = [di - ei * xi for di, ei, xi in zip(d, e, x, strict=True)]
    n = len(d)
    mean, se = statistics.fmean(d), statistics.stdev(d) / math.sqrt(n)
    half = T975[n - 1] * se
    low, high = 100 * math.expm1(mean - half), 100 * math.expm1(mean + half)
    return out | {
        "change": 100 * math.expm1(mean),
        "interval": [low, high],
        "p": _two_sided_p(mean / se, n - 1) if se else (0.0 if mean else 1.0),
        "detectable": (T975[n - 1] + T80[n - 1]) / T975[n - 1] * (high - low) / 2,
    }


# A server start's figure (restarts): its workload's mean output tok/s over its repeats, or
# its TPOT or TTFT over all its requests.
OF_SERVER = {
    "output_tok_s": lambda w: w["mean"]["aggregate_tok_s"],
    "tpot_p50_ms": lambda w: (w["latency"].get("tpot_ms") or {}).get("p50"),
    "tpot_mean_ms": lambda w: (w["latency"].get("tpot_ms") or {}).get("mean"),
    "ttft_p50_ms": lambda w: (w["latency"].get("ttft_ms") or {}).get("p50"),
}


def _recompute_starts(run: str, res: dict) -> dict:
    """A restarts run's figure `res`, from results.jsonl: one value per passed server start
    of each variant, Fieller's interval of the ratio of their means."""
    rows = _case_rows(run)
    w, m = res["workload"], res["metric"]

    def starts(variant: str) -> list[float]:
        values = (
            OF_SERVER[m](r["workloads"][w])
            for r in rows.values()
            if r["topology_id"] == res["topology_id"] and r["variant"] == variant
            and r.get("ab_server") is not None and r["status"] == "passed"
            and w in r["workloads"]
        )  # fmt: skip
        return [v for v in values if v is not None]

    base, cand = starts(res["baseline"]["variant"]), starts(res["candidate"]["variant"])
    out = {"baseline": base, "candidate": cand, "pairs": None}
    if min(len(base), len(cand)) < 2:
        return out | {"interval": None}
    iv = ratio_interval(MeanEstimate.of(base), MeanEstimate.of(cand))
    return out | {
        "change": 100 * (statistics.fmean(cand) / statistics.fmean(base) - 1),
        "interval": None if iv is None else [iv.low, iv.high],
        "p": iv.p_value,
        "detectable": res["detectable_pct"],  # the power figure is the analysis's own here
    }


def _holm(ps: list[float]) -> list[float]:
    order = sorted(range(len(ps)), key=ps.__getitem__)
    out, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def _born_paired(run: str) -> bool:
    """A run first judged with the paired method: measured on 2026-12-06 or later."""
    return min(r["started_at"] for r in _rows(run).values()) >= "2026-12-06"


def test_the_committed_ab_runs_are_found():
    # Eleven runs re-judged on 2026-12-06, eleven judged paired from the start, and two
    # restarts runs (server starts: no pairs) measured since.
    assert len(REPORTS) == 25
    modes = {run: r["ab"]["matrix"]["mode"] for run, r in REPORTS.items()}
    assert sorted(run for run, mode in modes.items() if mode != "switch") == [
        "h100-2026-12-07/front-restarts",
        "h100-2026-12-07/glm5-front-restarts",
    ]
    assert {modes[run] for run in modes if "restarts" in run} == {"restarts"}
    assert sum(_born_paired(run) for run, mode in modes.items() if mode == "switch") == 12


@pytest.mark.parametrize("run", sorted(REPORTS))
def test_every_committed_ab_figure_is_its_results_recomputed(run):
    report = REPORTS[run]["ab"]
    primary = (report["primary"]["workload"], report["primary"]["metric"])
    assert primary == ("ctx0", "output_tok_s")  # no committed matrix names another
    family: dict[tuple[str, str], list[tuple[dict, dict]]] = {}
    for res in report["results"]:
        where = f"{run} {res['topology_id']} {res['workload']} {res['metric']}"
        restarts = REPORTS[run]["ab"]["matrix"]["mode"] == "restarts"
        assert res["unit"] == ("server starts" if restarts else "rounds"), where
        got = (_recompute_starts if restarts else _recompute)(run, res)
        assert res["baseline"]["values"] == got["baseline"], where
        assert res["candidate"]["values"] == got["candidate"], where
        assert res["pairs"] == got["pairs"], where
        assert res["role"] == (
            "primary" if (res["workload"], res["metric"]) == primary else "secondary"
        )
        if got["interval"] is None:
            assert res["interval_pct"] is None and res["verdict"].startswith("too few"), where
            continue
        assert res["change_pct"] == pytest.approx(got["change"], abs=1e-9), where
        assert res["interval_pct"] == pytest.approx(got["interval"], abs=1e-6), where
        assert res["ratio"] == pytest.approx(1 + got["change"] / 100, rel=1e-12), where
        assert res["p_value"] == pytest.approx(got["p"], abs=1e-6), where
        assert res["detectable_pct"] == pytest.approx(got["detectable"], abs=1e-6), where
        adjusted = (res.get("acceptance") or {}).get("interval_pct") is not None
        assert adjusted == ("plain" in got), where
        family.setdefault((res["topology_id"], res["candidate"]["variant"]), []).append((res, got))
    for figures in family.values():
        secondary = [(res, got) for res, got in figures if res["role"] == "secondary"]
        holm = _holm([got["p"] for _, got in secondary])
        for (res, _), adjusted_p in zip(secondary, holm, strict=True):
            assert res["holm_p"] == pytest.approx(adjusted_p, abs=1e-6)
        for res, got in figures:
            kind = _kind(got["interval"], res["higher_is_better"])
            if res["role"] == "secondary" and kind != "no change" and res["holm_p"] >= 0.05:
                kind = "no change"
            assert verdicts.kind(res["verdict"]) == kind, (run, res["workload"], res["metric"])


def test_the_first_verdicts_are_the_unpaired_method_of_the_day():
    """Each recorded verdict is Fieller's interval over the two variants' blocks, taken as
    independent units, and the interval rule of the day (no Holm, no pairing)."""
    first = verdicts.first_verdicts()
    rejudged = {run for run in REPORTS if not _born_paired(run)}
    assert {old["run"] for old in first} == rejudged
    # Every figure judged then has its first verdict (TTFT p50 was judged from 2026-12-07 on).
    judged_then = {old["metric"] for old in first}
    assert "ttft_p50_ms" not in judged_then
    assert len(first) == sum(
        1 for run in rejudged for r in REPORTS[run]["ab"]["results"] if r["metric"] in judged_then
    )
    for old in first:
        rows = _rows(old["run"])
        sides = [
            [
                v
                for v in _blocks(
                    rows[(old["topology_id"], variant)], old["workload"], old["metric"]
                )
                if v is not None
            ]
            for variant in ("staged", "fused")
        ]
        where = f"{old['run']} {old['topology_id']} {old['workload']} {old['metric']}"
        if min(len(s) for s in sides) < 2:
            assert old["interval_pct"] is None and old["verdict"].startswith("too few"), where
            continue
        iv = ratio_interval(MeanEstimate.of(sides[0]), MeanEstimate.of(sides[1]))
        assert old["interval_pct"] == pytest.approx([iv.low, iv.high], abs=1e-9), where
        assert old["ratio"] == pytest.approx(
            statistics.fmean(sides[1]) / statistics.fmean(sides[0])
        )
        kind = _kind([iv.low, iv.high], old["metric"] == "output_tok_s")
        assert verdicts.kind(old["verdict"]) == kind, where


def test_the_changed_verdicts_are_listed_from_the_data():
    changed = verdicts.rejudged()
    assert changed and all(
        verdicts.kind(p["old"]["verdict"]) != verdicts.kind(p["new"]["verdict"]) for p in changed
    )
    # TP6's ctx0 "faster" at +0.02 … +0.45 % does not survive the pairing.
    tp6 = [
        p for p in changed if p["old"]["topology_id"] == "glm5-tp6/tp1-dcp1-mtp0"
        and p["old"]["workload"] == "ctx0" and p["old"]["metric"] == "output_tok_s"
    ]  # fmt: skip
    assert [(p["old"]["verdict"], verdicts.kind(p["new"]["verdict"])) for p in tp6] == [
        ("faster", "no change")
    ]
    table = verdicts.table(REPO / "docs" / "statistics.md")
    assert table.count("\n") == len(changed) + 1  # header, rule, a line per change
