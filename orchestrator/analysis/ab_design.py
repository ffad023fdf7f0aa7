"""How an A/B's units were taken and judged, in words for the reports: the sampling unit, the
order a switch-mode server ran and how far it was from drift-balanced, the interval's method,
the primary figure and the correction of the secondary ones (orchestrator.analysis.ab), and a
stopping rule's looks, recomputed from the stored rounds (orchestrator.analysis.sequential)."""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from orchestrator.analysis.ab import (
    AB_METRICS,
    PRIMARY,
    ab_results,
    paired_units,
    primary_of,
    server_groups,
)
from orchestrator.analysis.paired import drift_offset, order_text
from orchestrator.analysis.sequential import Look, StoppingRule
from orchestrator.analysis.stats import POWER
from orchestrator.results.recorded_run import Run


def design(run: Run) -> str:
    """How the units were taken and judged, as sentences for the reports (empty outside an
    A/B)."""
    ab = run.manifest.ab
    if ab is None:
        return ""
    return " ".join(x for x in (_design(run, ab), _after_failure(run)) if x)


def _after_failure(run: Run) -> str:
    """The servers that failed in their profile phase, after their measurements: their
    figures are judged, and the case stays failed."""
    servers: dict[str, str] = {}
    for r in run.ordered:
        if r.ab_server is not None and not r.passed and r.measured:
            server = r.switch.server_case if r.switch is not None else r.case_id
            servers.setdefault(server, (r.reason or "no reason recorded").splitlines()[0])
    return " ".join(
        f"{server} failed in its profile phase, after its measurements ({reason}): the "
        "figures measured before it are judged; the case stays failed."
        for server, reason in servers.items()
    )


def _design(run: Run, ab: dict[str, Any]) -> str:
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
    text = f"{_switch_units(run)} {_switch_order(run)} {_judging(run)}"
    stopping = _stopping(run)
    return f"{text} {stopping}" if stopping else text


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
    rule = StoppingRule.of(ab)
    count = ab.get("blocks") if rule is None else f"{rule.first} to {rule.cap}"
    return (
        f"Sampling unit: {unit}: {count} rounds of one block per variant on each "
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


@dataclass(frozen=True)
class ServerStop:
    """Where a switch server's rounds stopped under the stopping rule: the rounds it ran, the
    looks it took (recomputed from its rows) and why it stopped."""

    topology_id: str
    rounds: int
    looks: list[Look]
    why: str

    def to_dict(self) -> dict[str, Any]:
        return {
            "topology_id": self.topology_id,
            "rounds": self.rounds,
            "looks": [look.to_dict() for look in self.looks],
            "stopped": self.why,
        }


def server_stops(run: Run) -> list[ServerStop]:
    """Each topology's switch server under the run's stopping rule (none without one): the
    looks of the primary figure, from the pairs its rows hold."""
    rule = StoppingRule.of(run.manifest.ab)
    workload, key = primary_of(run)
    if rule is None or workload is None or len(run.variants) < 2:
        return []
    metric = next(m for m in AB_METRICS if m.key == key)
    groups = server_groups(run.ordered)
    base = run.variants[0]
    out = []
    for topo in dict.fromkeys(t for t, _ in groups):
        b_rows = groups.get((topo, base))
        if not b_rows or b_rows[0].switch is None:
            continue
        pairs = {
            c: paired_units(b_rows, groups[(topo, c)], workload, metric)[1]
            for c in run.variants[1:]
            if (topo, c) in groups
        }
        rounds = len(b_rows[0].switch.blocks)
        looks = rule.history(rounds, pairs)
        out.append(ServerStop(topo, rounds, looks, rule.why_stopped(looks, rounds)))
    return out


def _stopping(run: Run) -> str:
    """The stopping rule, and per topology the looks taken, why the rounds stopped, how many
    ran and the primary figure's interval there ("" without a rule)."""
    rule = StoppingRule.of(run.manifest.ab)
    stops = server_stops(run)
    if rule is None or not stops:
        return ""
    looks = ", ".join(str(n) for n in rule.looks)
    text = [
        f"Stopping rule: looks after {looks} rounds, stopping once the primary figure's "
        f"interval is within ±{rule.target_pct:g}% for every candidate, else at {rule.cap} "
        f"rounds; every interval is {rule.method}, so the one read where the rounds stopped "
        "is a 95% interval whatever look that was (docs/statistics.md)."
    ]
    primary = {
        (r.topology_id, r.candidate.variant): r for r in ab_results(run) if r.role == PRIMARY
    }
    for stop in stops:
        taken = "; ".join(
            f"{look.rounds} rounds: "
            + ", ".join(f"{c} {_width(h)}" for c, h in look.half_widths.items())
            for look in stop.looks
        )
        finals = [
            f"{c} {iv.bounds()}"
            for (topo, c), r in primary.items()
            if topo == stop.topology_id and (iv := r.judged) is not None
        ]
        text.append(
            f"{stop.topology_id}: {len(stop.looks)} look(s) ({taken or 'none'}); stopped after "
            f"{stop.rounds} rounds, {stop.why}"
            + (f"; adjusted interval {', '.join(finals)}." if finals else ".")
        )
    return " ".join(text)


def _width(half_width: float | None) -> str:
    return "unbounded" if half_width is None else f"±{half_width:.2f}%"
