"""Two report sections about how the servers ran: their start-up phase by phase (with the
compile cache's state), and the MTP acceptance each workload saw.

Figures come from the result rows (``CaseResult.startup``, ``WorkloadSummary.spec_decode``);
rows without them (older runs, no MTP) leave the sections out.
"""

from __future__ import annotations

from orchestrator.common.mdtable import md_table
from orchestrator.engines.vllm.startup import PHASES
from orchestrator.reports.run import MISSING
from orchestrator.results.recorded_run import Run


def _s(value: float | None) -> str:
    return MISSING if value is None else f"{value:.1f}"


def startup_section(run: Run) -> list[str]:
    """Each server's start-up: total, the phases found in its log, vLLM's own compile and
    graph-capture times, and whether the compile cache was hit."""
    rows = [r for r in run.ordered if r.startup is not None]
    if not rows:
        return []
    names = [p.name for p in PHASES if any(p.name in r.startup.phases for r in rows)]
    header = ["Case", "Start-up s", *names, "compile (vLLM) s", "graphs (vLLM) s", "Cache"]
    body = []
    for r in rows:
        s = r.startup
        body.append(
            [
                r.case_id,
                _s(r.timings.get("startup_s")),
                *(_s(s.phases.get(n)) for n in names),
                _s(s.vllm.get("torch_compile_s")),
                _s(s.vllm.get("graph_capture_s")),
                s.compile_cache or MISSING,
            ]
        )
    what = "; ".join(f"{p.name}: {p.what}" for p in PHASES if p.name in names)
    out = ["## Server start-up (s)", "", f"Phases, each ending at a vLLM log line ({what}).", ""]
    out += [md_table(header, body), ""]
    silences = [
        f"- {r.case_id}: {g['s']:.0f} s after `{g['after'][:80]}`"
        for r in rows
        for g in r.startup.silences[:1]
    ]
    if silences:
        out += ["Longest silence of each server log before it was ready:", "", *silences, ""]
    return out


def acceptance_section(run: Run) -> list[str]:
    """The MTP acceptance each workload saw (the server's /metrics counters around it)."""
    body = []
    for r in run.ordered:
        for name, w in r.workloads.items():
            sd = w.spec_decode
            if sd is None:
                continue
            body.append(
                [
                    r.case_id,
                    name,
                    MISSING if sd.expected_rate is None else f"{sd.expected_rate:.3f}",
                    MISSING if sd.acceptance_rate is None else f"{sd.acceptance_rate:.3f}",
                    MISSING if sd.acceptance_length is None else f"{sd.acceptance_length:.2f}",
                    f"{sd.accepted_tokens:,}/{sd.draft_tokens:,}",
                    ", ".join(MISSING if b is None else f"{b:.3f}" for b in sd.block_rates or [])
                    or MISSING,
                ]
            )
    if not body:
        return []
    header = ["Case", "Workload", "Configured", "Seen", "Tokens per step", "Accepted/drafted"]
    header += ["Per block"]
    return [
        "## MTP acceptance",
        "",
        "Accepted / drafted tokens between the server's /metrics reads before and after each "
        "workload (as `vllm bench serve` counts them); configured: the synthetic rate set; "
        "per block: each switch-mode block's own rate (seen sums them).",
        "",
        md_table(header, body),
        "",
    ]
