"""report.md: the seeds' topology tables and everything a release note needs, in Markdown.

Also the one way this project writes a Markdown table (``md_table``): compare and gpu-check
build theirs with it too.
"""

from __future__ import annotations

import re

from orchestrator.mdtable import md_table
from orchestrator.reports.run import (
    LATENCY_NOTE,
    MISSING,
    Run,
    audit_sentence,
    findings,
    fmt_tok,
    paired_deltas,
    plural,
    repeats,
    token_checks,
)
from orchestrator.reports.serving import acceptance_section, startup_section
from orchestrator.reports.summary import latency_table

# Findings listed in report.md; the rest are in each case's audit.json.
MAX_FINDINGS = 50


def topology_table(run: Run, metric: str) -> str:
    """The seeds' table: Model | TP | DCP | MTP | [Variant] | columns | Errors | Status."""
    multi = len(run.variants) > 1
    header = ["Model", "TP", "DCP", "MTP"] + (["Variant"] if multi else [])
    header += [c for _, c in run.columns] + ["Errors", "Status"]
    body = []
    for r in run.ordered:
        line = [r.model, str(r.tp), str(r.dcp), str(r.mtp)]
        if multi:
            line.append(r.variant)
        line += [fmt_tok(r.mean_of(name, metric)) for name, _ in run.columns]
        line += [str(r.errors), "ok" if r.passed else "**FAILED**"]
        body.append(line)
    return md_table(header, body)


def _latency_section(run: Run) -> list[str]:
    header, body = latency_table(run)
    if not body:
        return []
    return ["## Latency per request (ms)", "", LATENCY_NOTE, "", md_table(header, body), ""]


def _paired_section(run: Run) -> list[str]:
    # One table per candidate variant: with three or more variants (staged, fused, fused-pdl)
    # a single table would put every candidate under the first one's column title.
    by_cand: dict[str, list] = {}
    for d in paired_deltas(run):
        by_cand.setdefault(d.candidate, []).append(d)
    lines: list[str] = []
    for cand, deltas in by_cand.items():
        base = deltas[0].baseline
        body = [
            [
                d.topology_id,
                d.column,
                fmt_tok(d.baseline_tok_s),
                fmt_tok(d.candidate_tok_s),
                MISSING if d.delta_pct is None else f"{d.delta_pct:+.2f}%",
            ]
            for d in deltas
        ]
        header = ["Topology", "Workload", base.title(), cand.title(), "Delta"]
        lines += [f"## Paired variants: {base} vs {cand}", "", md_table(header, body), ""]
    return lines


def _profile_section(run: Run) -> list[str]:
    """The decode profile: the seeds' paired table per staged/fused pair (averaged over
    ranks, then rank by rank), or each profiled case's figures where nothing is paired."""
    from orchestrator.reports.profile import case_profile_rows, profile_pairs

    pairs = profile_pairs(run.ordered, run.variants)
    out: list[str] = []
    if pairs:
        out += ["## Decode profile, paired", ""]
        out.append(
            "Torch-profiler traces of the same decode steps on each server, after its measured "
            "workloads; each figure is the mean over ranks, with the range over ranks in "
            "parentheses where they differ (docs/profiling.md)."
        )
        for p in pairs:
            out += ["", f"### {p.topology_id}: {p.baseline} vs {p.candidate}", ""]
            header = ["Metric", p.baseline.title(), p.candidate.title(), "Delta"]
            out += [md_table(header, p.table()), ""]
            out += [f"- {p.identity()}", f"- {p.sync()}", f"- {p.paths()}.", ""]
            out += [md_table(*p.per_rank())]
        return [*out, ""]
    header, body = case_profile_rows(run.ordered)
    if body:
        out += ["## Decode profile", "", md_table(header, body), ""]
    return out


def _failed_case(case_id: str, reason: str) -> list[str]:
    """A bullet with the reason's first line (its root cause, when known); the rest (what
    happened, the log's last lines) as a code block inside the bullet, so log lines keep
    their breaks and nothing in them is read as Markdown."""
    first, _, rest = reason.partition("\n")
    out = [f"- **{case_id}**: {first}"]
    if rest:
        # A fence longer than any run of backticks in the text cannot be closed by it.
        longest = max((len(m) for m in re.findall(r"`+", rest)), default=0)
        fence = "`" * max(3, longest + 1)
        out += [f"  {fence}text", *(f"  {line}" for line in rest.splitlines()), f"  {fence}"]
    return out


def overhead_sentence(o: dict) -> str:
    return (
        f"Wall {o['wall_s']:.1f} s, of which server start-up and measured workloads "
        f"{o['startup_and_measured_s']:.1f} s; overhead {o['overhead_s']:.1f} s "
        f"({o['overhead_pct']:.1f}%)."
    )


def _overhead_section(run: Run) -> list[str]:
    figures = run.overhead
    if not figures.run and not figures.resumes:
        return []
    out = ["", "## Orchestrator overhead", ""]
    if figures.run:
        out.append(overhead_sentence(figures.run))
    else:
        out.append("The first attempt recorded no figures (it was killed before its end).")
    for i, r in enumerate(figures.resumes, 1):
        cases = f", {plural(int(r['cases_run']), 'case')} run" if "cases_run" in r else ""
        out += ["", f"Resume {i}{cases}: {overhead_sentence(r)}"]
    return out


def render_markdown(run: Run) -> str:
    m = run.manifest
    out = [f"# Run {m.run_id}", ""]
    out.append(
        f"Matrix `{m.matrix_path}` ({m.matrix_name}), "
        f"{len(run.results)}/{len(m.cases)} cases finished, {len(run.failed)} failed. "
        f"vLLM {m.version('vllm')}, fusedq {m.version('fusedq')} "
        f"(tree {m.fusedq_fingerprint}), torch {m.version('torch')}, "
        f"Ray {m.version('ray')}, commit {m.commit}."
    )
    out += ["", "## Aggregate output tok/s", ""]
    out.append(
        "Mean over repeats of aggregate output tok/s; every long-context case includes the "
        "prefill-to-decode transition. Servers were measured one at a time."
    )
    out += ["", topology_table(run, "aggregate_tok_s"), ""]
    out += ["## Active per-user output tok/s (time to first token excluded)", ""]
    out += [topology_table(run, "per_user_tok_s"), ""]
    out += _latency_section(run)
    out += acceptance_section(run)
    out += _paired_section(run)
    out += _profile_section(run)
    checks = [f"- {t} {w}: **{v}** -- {s}" for t, w, v, s in token_checks(run)]
    if checks:
        out += ["## Same tokens (greedy, request by request)", "", *checks, ""]
    measured = repeats(run)
    if measured:
        out += ["## Repeats", ""]
        for case_id, name, reps in measured:
            agg = "/".join(f"{x.aggregate_tok_s or 0:.3f}" for x in reps)
            usr = "/".join(f"{x.per_user_tok_s or 0:.3f}" for x in reps)
            out.append(f"- {case_id} {name}: aggregate {agg} tok/s, active per-user {usr} tok/s")
        out.append("")
    failed = [r for r in run.ordered if not r.passed]
    if failed:
        out += ["## Failed cases", ""]
        for r in failed:
            out += _failed_case(r.case_id, str(r.reason))
        out.append("")
    out += startup_section(run)
    out += ["## Log audit", "", audit_sentence(run.results), ""]
    for case_id, f in findings(run)[:MAX_FINDINGS]:
        text = f.text[:160].replace("`", "'")
        out.append(
            f"- {case_id}: `{f.signature}` ({f.severity}) {f.location(basename=True)}: `{text}`"
        )
    out += _overhead_section(run)
    return "\n".join(out).rstrip() + "\n"
