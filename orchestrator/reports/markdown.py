"""report.md: the seeds' topology tables and everything a release note needs, in Markdown.

Also the one way this project writes a Markdown table (``md_table``): compare and gpu-check
build theirs with it too.
"""

from __future__ import annotations

import re

from orchestrator.common.layout import CORRECTIONS
from orchestrator.common.mdtable import md_code, md_table, md_text, plain_text
from orchestrator.common.wording import plural
from orchestrator.reports.measures import STATS_NOTE, bursty
from orchestrator.reports.run import (
    LATENCY_NOTE,
    MISSING,
    audit_sentence,
    exposure_warning,
    findings,
    fmt_tok,
    interpreted_note,
    interrupted_sentence,
    paired_tables,
    repeats,
    token_checks,
)
from orchestrator.reports.serving import acceptance_section, startup_section
from orchestrator.reports.summary import latency_table, totals_table
from orchestrator.results.corrections import Correction
from orchestrator.results.recorded_run import Run, workload_defs

# Findings listed in report.md; the rest are in each case's audit.json.
MAX_FINDINGS = 50


def topology_table(run: Run, metric: str) -> str:
    """The seeds' table: Model | TP | DCP | MTP | [Variant] | columns | Errors | Status."""
    multi = len(run.variants) > 1
    header = ["Model", "TP", "DCP", "MTP"] + (["Variant"] if multi else [])
    # Each workload by its one name (a column it fills is said in the Workloads section).
    header += [name for name, _ in run.columns] + ["Errors", "Status"]
    body = []
    for r in run.ordered:
        line = [r.model, str(r.tp), str(r.dcp), str(r.mtp)]
        if multi:
            line.append(r.variant)
        line += [fmt_tok(r.mean_of(name, metric)) for name, _ in run.columns]
        line += [str(r.errors), "ok" if r.passed else "**FAILED**"]
        body.append(line)
    return md_table(header, body)


def _workloads_section(run: Run) -> list[str]:
    """What each workload is: the lengths, concurrency and size every figure stands on."""
    defs = workload_defs(run)
    if not defs:
        return []
    header = ["Workload", "Prompt tokens", "Output tokens", "Concurrency",
              "Requests per repeat", "Duration (s)", "Repeats", "Stands in for"]  # fmt: skip
    body = [
        [
            w.name, f"{w.prompt_tokens:,}", f"{w.output_tokens:,}", str(w.concurrency),
            MISSING if w.requests is None else f"{w.requests:,}",
            MISSING if w.duration_s is None else f"{w.duration_s:g}", str(w.repeats),
            w.column if w.column != w.name else MISSING,
        ]
        for w in defs
    ]  # fmt: skip
    return ["## Workloads", "", md_table(header, body), ""]


def _totals_section(run: Run) -> list[str]:
    header, body = totals_table(run)
    if not body:
        return []
    return [
        "## Totals per workload",
        "",
        "As `vllm bench serve` reports them, summed over the workload's repeats; then how "
        "the tokens were streamed (tokens per chunk, and the share of gaps between chunks "
        "under 1 ms).",
        "",
        md_table(header, body),
        "",
    ]


def _latency_section(run: Run) -> list[str]:
    header, body = latency_table(run)
    if not body:
        return []
    out = ["## Latency per request (ms)", "", LATENCY_NOTE, "", STATS_NOTE, ""]
    out += [md_table(header, body), ""]
    out += [f"- {s}" for s in bursty(run)]
    return out + ([""] if out[-1] else [])


def _paired_section(run: Run) -> list[str]:
    lines: list[str] = []
    for t in paired_tables(run):
        lines += [f"## Paired variants: {md_text(t.baseline)} vs {md_text(t.candidate)}", ""]
        lines += [md_table(t.header, t.body), ""]
    note = interpreted_note(run)
    if lines and note:
        lines += [note, ""]
    return lines


def _ab_section(run: Run) -> list[str]:
    """The A/B of the variants over server starts or blocks (orchestrator.analysis.ab), with the
    evidence chain; it replaces the paired table, whose one-server deltas it supersedes."""
    from orchestrator.reports.ab_section import ab_section

    section = ab_section(run)
    if section is None:
        return []
    out: list[str] = []
    for t in section.tables:
        out += [f"## {t.title}", "", md_table(t.header, t.body), ""]
    for t in section.acceptance:
        out += [f"### {t.title}", "", md_table(t.header, t.body), ""]
    out += [section.design, ""]
    if section.evidence:
        out += ["Evidence chain (the paired decode profile against the measured TPOT):", ""]
        out += [f"- {e}" for e in section.evidence]
        out.append("")
    return out


def _profile_section(run: Run) -> list[str]:
    """The decode profile: the seeds' paired table per staged/fused pair (averaged over
    ranks, then rank by rank), or each profiled case's figures where nothing is paired."""
    from orchestrator.reports.profile import case_profile_rows, profile_pairs

    pairs = profile_pairs(run.ordered, run.variants, run.root)
    out: list[str] = []
    if pairs:
        out += ["## Decode profile, paired", ""]
        out.append(
            "Torch-profiler traces of the same decode steps on each server, after its measured "
            "workloads; each figure is the mean over ranks, with the range over ranks in "
            "parentheses where they differ (docs/profiling.md)."
        )
        for p in pairs:
            title = f"{p.topology_id}: {p.baseline} vs {p.candidate}"
            out += ["", f"### {md_text(title)}", ""]
            header = ["Metric", p.baseline.title(), p.candidate.title(), "Delta"]
            out += [md_table(header, p.table()), ""]
            out += [f"- {md_text(line)}" for line in (p.identity(), p.sync(), f"{p.paths()}.")]
            out += [""]
            out += [md_table(*p.per_rank())]
            if p.by_family is not None:
                out += ["", "One model step by kernel family (docs/profiling.md):", ""]
                out += [md_table(*p.family_table()), ""]
                out += [f"- {md_text(line)}" for line in p.family_notes()]
        return [*out, ""]
    header, body = case_profile_rows(run.ordered)
    if body:
        out += ["## Decode profile", "", md_table(header, body), ""]
    return out


def _failed_case(case_id: str, reason: str) -> list[str]:
    """A bullet with the reason's first line (its root cause, when known); the rest (what
    happened, the log's last lines) as a code block inside the bullet, so log lines keep
    their breaks and nothing in them is read as Markdown."""
    first, _, rest = plain_text(reason).partition("\n")
    out = [f"- **{md_text(case_id)}**: {md_text(first)}"]
    if rest:
        # A fence longer than any run of backticks in the text cannot be closed by it.
        longest = max((len(m) for m in re.findall(r"`+", rest)), default=0)
        fence = "`" * max(3, longest + 1)
        out += [f"  {fence}text", *(f"  {line}" for line in rest.splitlines()), f"  {fence}"]
    return out


def overhead_sentence(o: dict) -> str:
    """One attempt's overhead figures; an interrupted attempt's, or one an orchestrator error
    stopped, are over its finished cases only (orchestrator.execution.runner), and one that finished
    none has none."""
    cut, aborted = o.get("cut_short"), o.get("aborted")
    left = ""
    if o.get("interrupted"):
        stop = f"Interrupted ({o['interrupted']})"
        left = f"; the {cut['s']:.1f} s of the case it cut short are left out" if cut else ""
    elif aborted:
        stop = f"Stopped by an orchestrator error recording {aborted['case_id']}"
    else:
        stop = None
    if "wall_s" not in o:
        return f"{stop} before any case finished: no figures." if stop else "No case finished."
    head = f"{stop}{left}. Up to its last finished case: wall" if stop else "Wall"
    return (
        f"{head} {o['wall_s']:.1f} s, of which server start-up and measured workloads "
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


def _interrupted(run: Run) -> str:
    sentence = interrupted_sentence(run)
    if sentence is None:
        return ""
    head, _, rest = sentence.partition(". Continue with: ")
    return f"**{head}.** " + (f"Continue with `{rest}`. " if rest else "")


def render_markdown(run: Run) -> str:
    m = run.manifest
    out = [f"# Run {md_text(m.run_id)}", ""]
    out.append(
        f"Matrix `{md_code(m.matrix_path)}` ({md_text(m.matrix_name)}), "
        f"{len(run.results)}/{len(m.cases)} cases finished, {len(run.failed)} failed. "
        + _interrupted(run)
        + md_text(
            f"vLLM {m.version('vllm')}, fusedq {m.version('fusedq')} "
            f"(tree {m.fusedq_fingerprint}), torch {m.version('torch')}, "
            f"Ray {m.version('ray')}, commit {m.commit}"
            + (f" (product tree {m.product_fingerprint})." if m.product_fingerprint else ".")
        )
    )
    warning = exposure_warning(run)
    if warning:
        out += ["", f"**Warning:** {md_text(warning)}."]
    out += ["", *_superseded_section(run.corrections)]
    out += _workloads_section(run)
    out += ["## Aggregate output tok/s", ""]
    out.append(
        "Mean over repeats of aggregate output tok/s; every long-context case includes the "
        "prefill-to-decode transition. Servers were measured one at a time."
    )
    out += ["", topology_table(run, "aggregate_tok_s"), ""]
    out += ["## Active per-user output tok/s (time to first token excluded)", ""]
    out += [topology_table(run, "per_user_tok_s"), ""]
    out += _totals_section(run)
    out += _latency_section(run)
    out += acceptance_section(run)
    out += _ab_section(run) or _paired_section(run)
    out += _profile_section(run)
    checks = [
        f"- {md_text(t)} {md_text(w)}: **{md_text(v)}** -- {md_text(s)}"
        for t, w, v, s in token_checks(run)
    ]
    if checks:
        out += ["## Same tokens (greedy, request by request)", "", *checks, ""]
    measured = repeats(run)
    if measured:
        out += ["## Repeats", ""]
        for case_id, name, reps in measured:
            agg = "/".join(f"{x.aggregate_tok_s or 0:.3f}" for x in reps)
            usr = "/".join(f"{x.per_user_tok_s or 0:.3f}" for x in reps)
            out.append(
                f"- {md_text(case_id)} {md_text(name)}: aggregate {agg} tok/s, "
                f"active per-user {usr} tok/s"
            )
        out.append("")
    failed = [r for r in run.ordered if not r.passed]
    if failed:
        out += ["## Failed cases", ""]
        for r in failed:
            out += _failed_case(r.case_id, str(r.reason))
        out.append("")
    out += startup_section(run)
    out += ["## Log audit", "", md_text(audit_sentence(run.results)), ""]
    for case_id, f in findings(run)[:MAX_FINDINGS]:
        where = md_text(f"{f.location(basename=True)}")
        out.append(
            f"- {md_text(case_id)}: `{md_code(f.signature)}` ({md_text(f.severity)}) {where}: "
            f"`{md_code(f.text[:160])}`"
        )
    out += _overhead_section(run)
    return "\n".join(out).rstrip() + "\n"


def _superseded_section(corrections: list[Correction]) -> list[str]:
    """The report.md section (nothing when there are none)."""
    if not corrections:
        return []
    out = [
        "## Superseded figures",
        "",
        f"Found wrong after this run was written ({CORRECTIONS}); the corrected values "
        "supersede the ones below in this report:",
        "",
    ]
    return out + [f"- {c.sentence('**')}" for c in corrections] + [""]
