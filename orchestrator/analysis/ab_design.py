"""How an A/B's units were taken and judged, in words for the reports: the sampling unit, the
order a switch-mode server ran and how far it was from drift-balanced, the interval's method,
the primary figure and the correction of the secondary ones (orchestrator.analysis.ab)."""

from __future__ import annotations

import statistics

from orchestrator.analysis.ab import AB_METRICS, primary_of, server_groups
from orchestrator.analysis.paired import drift_offset, order_text
from orchestrator.analysis.stats import POWER
from orchestrator.results.recorded_run import Run


def design(run: Run) -> str:
    """How the units were taken and judged, as sentences for the reports (empty outside an
    A/B)."""
    ab = run.manifest.ab
    if ab is None:
        return ""
    if ab.get("mode", "restarts") == "restarts":
        servers = {len(rows) for rows in server_groups(run.ordered).values()}
        count = "/".join(str(n) for n in sorted(servers)) or "?"
        order = " ".join([*run.variants, *run.variants, "…"])
        return (
            f"Sampling unit: server starts, {count} per variant and topology, served round by "
            f"round ({order}); a start's output tok/s is the mean over its repeats, its TPOT "
            "over all its requests. 95% interval: Fieller's, of the ratio of the variants' "
            f"means over server starts. {_judging(run)}"
        )
    return f"{_switch_units(run)} {_switch_order(run)} {_judging(run)}"


def _switch_units(run: Run) -> str:
    ab = run.manifest.ab or {}
    rows = [r for r in run.ordered if r.switch is not None]
    flips = [f.seconds for r in rows for f in r.switch.flips if f.seconds is not None]  # type: ignore[union-attr]
    timing = (
        f"; a flip took {statistics.median(flips):.2f} s (median; longest {max(flips):.2f} s)"
        if flips
        else ""
    )
    servers = max((r.ab_server or 1 for r in rows), default=1)
    unit, pair = (
        ("rounds", "round")
        if servers == 1
        else ("server starts, paired (each variant's figure the mean of its blocks)", "server")
    )
    base, cands = run.variants[0], run.variants[1:]
    ratio = f"{cands[0]}/{base}" if len(cands) == 1 else f"each candidate/{base}"
    return (
        f"Sampling unit: {unit}: {ab.get('blocks')} rounds of one block per variant on each "
        f"of {servers} server(s) per topology, which serve every variant and flip the decode "
        f"path between blocks through {ab.get('extension')}; every worker confirmed the path "
        f"before each block{timing}. The change: per {pair}, the log of {ratio}; "
        f"Student's t interval of their mean ({pair}s - 1 df), back-transformed to a ratio."
    )


def _switch_order(run: Run) -> str:
    """The order that ran (the first server's schedule) and its drift balance."""
    rows = [r for r in run.ordered if r.switch is not None and r.switch.schedule]
    if not rows:
        return "Order that ran: not recorded."
    schedule = rows[0].switch.schedule  # type: ignore[union-attr]
    base = run.variants[0]
    text = f"Order that ran: {order_text(schedule, run.variants)}"
    offsets = {c: drift_offset(schedule, base, c) for c in run.variants[1:]}
    off = {c: o for c, o in offsets.items() if o is not None and abs(o) > 1e-9}
    if not off:
        return f"{text}: drift-balanced (every variant's blocks at the same mean position)."
    parts = [
        f"{c}'s blocks sit {abs(o):.2f} of a block {'later' if o > 0 else 'earlier'} on "
        f"average than {base}'s, so a linear drift of the server adds {o:+.2f} × one "
        "block's drift to its change"
        for c, o in off.items()
    ]
    return f"{text}: NOT drift-balanced: {'; '.join(parts)}."


def _judging(run: Run) -> str:
    workload, key = primary_of(run)
    label = next((m.label for m in AB_METRICS if m.key == key), key)
    return (
        f"Primary figure: {workload} {label}, judged at 95%; every other figure is "
        "secondary, judged with Holm's correction over the secondary figures of its topology "
        f"and candidate. '{100 * POWER:g}% power': the change its units would find "
        f"{100 * POWER:g}% of the time (docs/statistics.md)."
    )
