"""The committed A/B runs' verdicts, as each run's report of the day gave them and as the
analysis gives them today: the ``ab-rejudged`` table of docs/statistics.md.

Until 2026-12-06 an A/B over a switch-mode server judged its blocks as independent units
(Fieller's interval over blocks). Since then it pairs each round (the mean log ratio over
rounds), judges one primary figure per topology at 95 % and the others with Holm's correction,
and judges MTP figures at equal synthetic acceptance (docs/statistics.md). The committed
reports were re-rendered with it; the verdicts of the day are kept as data in
``docs/validation/ab-first-verdicts.jsonl``, which ``record`` wrote from the reports before
they were re-rendered (tests/orchestrator/test_ab_rejudged.py recomputes every line from its
run's results.jsonl with the method of the day, so the record cannot drift from the data)::

    python benchmarks/scripts/ab_verdicts.py table [--all]   # print old -> new, Markdown
    python benchmarks/scripts/ab_verdicts.py record          # only where no record exists yet
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
VALIDATION = REPO / "docs" / "validation"
FIRST = VALIDATION / "ab-first-verdicts.jsonl"
KEPT = ("topology_id", "workload", "metric", "unit", "ratio", "change_pct", "interval_pct")
HEADER = ["run", "topology", "workload", "metric", "then (blocks unpaired)", "now", "role"]
LABELS = {"output_tok_s": "output tok/s", "tpot_p50_ms": "TPOT p50", "tpot_mean_ms": "TPOT mean"}

Row = dict[str, Any]


def ab_reports(root: Path = VALIDATION) -> dict[str, Row]:
    """Run folder (relative to `root`) -> its report.json, for every run with A/B results."""
    found = {}
    for path in sorted(root.glob("*/*/report.json")):
        report = json.loads(path.read_text())
        if (report.get("ab") or {}).get("results"):
            found[str(path.parent.relative_to(root))] = report
    return found


def record(root: Path = VALIDATION, out: Path = FIRST) -> int:
    """Write the A/B figures of every report.json under `root` to `out`, one line a figure;
    refuses to overwrite a record (it would then hold today's verdicts, not the first)."""
    if out.exists():
        raise FileExistsError(f"{out} exists: the first verdicts are recorded once")
    lines = [
        {"run": run, **{k: r.get(k) for k in KEPT}, "verdict": r["verdict"], "method": r["method"]}
        for run, report in ab_reports(root).items()
        for r in report["ab"]["results"]
    ]
    out.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return len(lines)


def first_verdicts(path: Path = FIRST) -> list[Row]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def kind(verdict: str) -> str:
    """A verdict's kind: faster, slower, no change (whatever the half-width) or too few."""
    if verdict.startswith("no change"):
        return "no change"
    return verdict if verdict in ("faster", "slower") else "too few"


def _figure(res: Row, verdict: str) -> str:
    if res.get("interval_pct") is None:
        return verdict
    low, high = res["interval_pct"]
    text = f"{res['ratio']:.4f} ({low:+.2f} … {high:+.2f} %): {verdict}"
    return text.replace("-", "−")


def rejudged(root: Path = VALIDATION, first: Path = FIRST, *, every: bool = False) -> list[Row]:
    """Each recorded figure beside today's, in the record's order: the figures whose verdict
    changed kind, or (`every`) all of them."""
    now = {
        (run, r["topology_id"], r["workload"], r["metric"]): r
        for run, report in ab_reports(root).items()
        for r in report["ab"]["results"]
    }
    out = []
    for old in first_verdicts(first):
        new = now[(old["run"], old["topology_id"], old["workload"], old["metric"])]
        if every or kind(old["verdict"]) != kind(new["verdict"]):
            out.append({"old": old, "new": new})
    return out


def table(doc: Path, root: Path = VALIDATION, first: Path = FIRST, *, every: bool = False) -> str:
    """The verdicts that changed kind (or all), old -> new, as a Markdown table whose links
    are relative to `doc`."""
    lines = []
    for pair in rejudged(root, first, every=every):
        old, new = pair["old"], pair["new"]
        now = _figure(new, new["verdict"])
        if (new.get("acceptance") or {}).get("interval_pct") is not None:
            now += " (at equal MTP acceptance)"
        link = os.path.relpath(root / old["run"] / "report.md", doc.parent)
        lines.append(
            [
                f"[{Path(old['run']).name}]({Path(link).as_posix()})",
                f"`{old['topology_id']}`",
                old["workload"],
                LABELS.get(old["metric"], old["metric"]),
                _figure(old, old["verdict"]),
                now,
                new["role"],
            ]
        )
    rows = ["| " + " | ".join(HEADER) + " |", "|" + " --- |" * len(HEADER)]
    rows += ["| " + " | ".join(cell.replace("|", "\\|") for cell in line) + " |" for line in lines]
    return "\n".join(rows)


def summary(root: Path = VALIDATION, first: Path = FIRST) -> str:
    """One sentence: how many figures and primary figures changed kind of verdict."""
    every = rejudged(root, first, every=True)
    changed = [p for p in every if kind(p["old"]["verdict"]) != kind(p["new"]["verdict"])]
    primary = [p for p in every if p["new"]["role"] == "primary"]
    primary_changed = [p for p in changed if p["new"]["role"] == "primary"]
    runs = len({p["old"]["run"] for p in every})
    return (
        f"{len(changed)} of the {len(every)} A/B figures of the {runs} committed runs changed "
        f"kind of verdict, {len(primary_changed)} of their {len(primary)} primary figures:"
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    sub.add_parser("record", help="write docs/validation/ab-first-verdicts.jsonl (once)")
    show = sub.add_parser("table", help="print the verdicts old -> new as Markdown")
    show.add_argument("--all", action="store_true", help="every figure, not only the changed")
    args = ap.parse_args(argv)
    try:
        if args.command == "record":
            print(f"{record()} figures recorded in {FIRST.relative_to(REPO)}")
        else:
            print(summary() + "\n")
            print(table(REPO / "docs" / "statistics.md", every=args.all))
    except (OSError, KeyError, ValueError) as exc:
        print(f"ab_verdicts: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
