"""Reports of a run: the seeds' topology table in Markdown, and a JSON summary.

Input is only the run directory (manifest + results.jsonl), so `orchestrator report RUN` can
rebuild the reports of any run, finished, interrupted or resumed.
"""

from __future__ import annotations

import json
import re
from collections import OrderedDict
from typing import Any

from orchestrator.store import RunStore, write_json_atomic, write_text_atomic

MISSING = "-"
OVERHEAD = "overhead.json"  # each attempt's wall and overhead figures (see write_reports)


def _tok(row: dict[str, Any], workload: str, metric: str = "aggregate_tok_s") -> float | None:
    w = row.get("workloads", {}).get(workload)
    if not w:
        return None
    value = w.get("mean", {}).get(metric)
    return float(value) if value is not None else None


def _fmt(v: float | None) -> str:
    return MISSING if v is None else f"{v:.2f}"


def _columns(manifest: dict[str, Any]) -> list[tuple[str, str]]:
    """(workload name, report column) in matrix order."""
    return [(w["name"], w.get("column") or w["name"]) for w in manifest["matrix"]["workloads"]]


def _variants(manifest: dict[str, Any]) -> list[str]:
    return [v["name"] for v in manifest["matrix"].get("variants", [])] or ["default"]


def _ordered_rows(manifest: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by_id = {r["case_id"]: r for r in rows}
    return [by_id[c["case_id"]] for c in manifest["cases"] if c["case_id"] in by_id]


def _md_table(header: list[str], body: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in body]
    return "\n".join(lines)


def topology_table(manifest: dict[str, Any], rows: list[dict[str, Any]], metric: str) -> str:
    cols = _columns(manifest)
    multi = len(_variants(manifest)) > 1
    header = ["Model", "TP", "DCP", "MTP"] + (["Variant"] if multi else [])
    header += [c for _, c in cols] + ["Errors", "Status"]
    body = []
    for r in _ordered_rows(manifest, rows):
        line = [r["model"], str(r["tp"]), str(r["dcp"]), str(r["mtp"])]
        if multi:
            line.append(r["variant"])
        line += [_fmt(_tok(r, name, metric)) for name, _ in cols]
        line += [str(r.get("errors", 0)), "ok" if r.get("status") == "passed" else "**FAILED**"]
        body.append(line)
    return _md_table(header, body)


def paired_deltas(manifest: dict[str, Any], rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per topology and column: the first variant as baseline against each other variant."""
    variants = _variants(manifest)
    if len(variants) < 2:
        return []
    base = variants[0]
    by_topo: OrderedDict[str, dict[str, dict[str, Any]]] = OrderedDict()
    for r in _ordered_rows(manifest, rows):
        by_topo.setdefault(r["topology_id"], {})[r["variant"]] = r
    out = []
    for topo, vs in by_topo.items():
        for cand in variants[1:]:
            if base not in vs or cand not in vs:
                continue
            for name, col in _columns(manifest):
                b, c = _tok(vs[base], name), _tok(vs[cand], name)
                delta = None if b in (None, 0.0) or c is None else 100.0 * (c - b) / b
                out.append(
                    {
                        "topology_id": topo,
                        "column": col,
                        "baseline": base,
                        "candidate": cand,
                        "baseline_tok_s": b,
                        "candidate_tok_s": c,
                        "delta_pct": delta,
                    }
                )
    return out


def _plural(n: int, word: str) -> str:
    return f"{n:,} {word}{'' if n == 1 else 's'}"


def audit_sentence(rows: list[dict[str, Any]]) -> str:
    """One run-level sentence built from what the per-case audits actually searched."""
    audits = [(r["case_id"], r.get("audit") or {}) for r in rows]
    audits = [(cid, a) for cid, a in audits if a.get("searched")]
    if not audits:
        return "No case was audited."
    files = sum(len(a["searched"].get("files", [])) for _, a in audits)
    lines = sum(int(a["searched"].get("lines", 0)) for _, a in audits)
    cats = list(audits[0][1]["searched"].get("categories", []))
    head = (
        f"The final log audit of {_plural(files, 'log')} ({_plural(lines, 'line')}) "
        f"across {_plural(len(audits), 'case')}"
    )
    bad = [cid for cid, a in audits if a.get("verdict", {}).get("status") != "clean"]
    if bad:
        out = f"{head} found problems in {_plural(len(bad), 'case')}: {', '.join(bad)}."
    else:
        listed = ", ".join(cats[:-1]) + (f", or {cats[-1]}" if len(cats) > 1 else "".join(cats))
        out = f"{head} found no {listed} failure."
    unaudited = [
        (cid, a) for cid, a in audits if not a["searched"].get("kernel_log", {}).get("audited")
    ]
    if unaudited:
        reason = unaudited[0][1]["searched"]["kernel_log"].get("reason")
        which = "any case" if len(unaudited) == len(audits) else ", ".join(c for c, _ in unaudited)
        out += f" The kernel log was not audited for {which} ({reason})."
    expectations: dict[str, list[bool]] = {}
    for _, a in audits:
        for er in a["searched"].get("expectations", []):
            met = not er.get("missing") and er.get("occurrences", 0) > 0
            expectations.setdefault(er["description"], []).append(met)
    for desc, met in expectations.items():
        out += f" All workers logged {desc}." if all(met) else f" Not every worker logged {desc}."
    return out


def token_check_lines(rows: list[dict[str, Any]]) -> list[str]:
    """One bullet per same_tokens check (orchestrator/tokens.py) of the rows, in case order."""
    return [
        f"- {r['topology_id']} {workload}: **{c['verdict']}** -- {c['sentence']}"
        for r in rows
        for workload, c in (r.get("same_tokens") or {}).items()
    ]


LATENCY_NOTE = (
    "Time to first token, time per output token after the first, and the gap between "
    "streamed chunks (one value per gap; with MTP a chunk may carry several tokens), over "
    "every successful request of the workload's repeats."
)


def _latency_section(manifest: dict[str, Any], rows: list[dict[str, Any]]) -> list[str]:
    # Imported here: orchestrator.summary builds on this module's helpers.
    from orchestrator.summary import latency_table

    header, body = latency_table(manifest, rows)
    if not body:
        return []
    return ["## Latency per request (ms)", "", LATENCY_NOTE, "", _md_table(header, body), ""]


def _failed_case_md(case_id: str, reason: str) -> list[str]:
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


def render_markdown(store: RunStore, overhead: dict[str, Any] | None = None) -> str:
    manifest = store.manifest()
    rows = store.results()
    versions = manifest.get("versions", {})
    out = [f"# Run {manifest['run_id']}", ""]
    out.append(
        f"Matrix `{manifest['matrix_path']}` ({manifest['matrix']['name']}), "
        f"{len(rows)}/{len(manifest['cases'])} cases finished, "
        f"{sum(r.get('status') != 'passed' for r in rows)} failed. "
        f"vLLM {versions.get('vllm')}, fusedq {versions.get('fusedq')} "
        f"(tree {manifest.get('fusedq_fingerprint')}), torch {versions.get('torch')}, "
        f"Ray {versions.get('ray')}, commit {(manifest.get('git') or {}).get('commit')}."
    )
    out += ["", "## Aggregate output tok/s", ""]
    out.append(
        "Mean over repeats of aggregate output tok/s; every long-context case includes the "
        "prefill-to-decode transition. Servers were measured one at a time."
    )
    out += ["", topology_table(manifest, rows, "aggregate_tok_s"), ""]
    out += ["## Active per-user output tok/s (time to first token excluded)", ""]
    out += [topology_table(manifest, rows, "per_user_tok_s"), ""]
    out += _latency_section(manifest, rows)
    deltas = paired_deltas(manifest, rows)
    if deltas:
        base, cand = deltas[0]["baseline"], deltas[0]["candidate"]
        out += [f"## Paired variants: {base} vs {cand}", ""]
        body = [
            [
                d["topology_id"],
                d["column"],
                _fmt(d["baseline_tok_s"]),
                _fmt(d["candidate_tok_s"]),
                MISSING if d["delta_pct"] is None else f"{d['delta_pct']:+.2f}%",
            ]
            for d in deltas
        ]
        out += [_md_table(["Topology", "Workload", base.title(), cand.title(), "Delta"], body), ""]
    checks = token_check_lines(_ordered_rows(manifest, rows))
    if checks:
        out += ["## Same tokens (greedy, request by request)", "", *checks, ""]
    repeats = [
        (r["case_id"], name, w.get("repeats", []))
        for r in _ordered_rows(manifest, rows)
        for name, w in r.get("workloads", {}).items()
        if len(w.get("repeats", [])) > 1
    ]
    if repeats:
        out += ["## Repeats", ""]
        for case_id, name, reps in repeats:
            agg = "/".join(f"{x.get('aggregate_tok_s', 0):.3f}" for x in reps)
            usr = "/".join(f"{x.get('per_user_tok_s', 0):.3f}" for x in reps)
            out.append(f"- {case_id} {name}: aggregate {agg} tok/s, active per-user {usr} tok/s")
        out.append("")
    failed = [r for r in _ordered_rows(manifest, rows) if r.get("status") != "passed"]
    if failed:
        out += ["## Failed cases", ""]
        for r in failed:
            out += _failed_case_md(r["case_id"], str(r.get("reason")))
        out.append("")
    out += ["## Log audit", "", audit_sentence(rows), ""]
    findings = [
        (r["case_id"], f)
        for r in _ordered_rows(manifest, rows)
        for f in r.get("audit", {}).get("findings", [])
    ]
    for case_id, f in findings[:50]:
        text = str(f.get("text", ""))[:160].replace("`", "'")
        rank = f" [{f['rank']}]" if f.get("rank") else ""
        out.append(
            f"- {case_id}: `{f.get('signature')}` ({f.get('severity')}) "
            f"{str(f.get('file', '')).split('/')[-1]}:{f.get('line')}{rank}: `{text}`"
        )
    figures = _overhead_record(overhead)
    if figures["run"] or figures["resumes"]:
        out += ["", "## Orchestrator overhead", ""]
        if figures["run"]:
            out.append(_overhead_sentence(figures["run"]))
        else:
            out.append("The first attempt recorded no figures (it was killed before its end).")
        for i, r in enumerate(figures["resumes"], 1):
            cases = f", {_plural(int(r['cases_run']), 'case')} run" if "cases_run" in r else ""
            out += ["", f"Resume {i}{cases}: {_overhead_sentence(r)}"]
    return "\n".join(out).rstrip() + "\n"


def _workload_json(w: dict[str, Any]) -> dict[str, Any]:
    from orchestrator.summary import latency_of, throughput_of

    return {
        "aggregate_tok_s": w.get("mean", {}).get("aggregate_tok_s"),
        "aggregate_tok_s_sd": throughput_of(w)[1],
        "per_user_tok_s": w.get("mean", {}).get("per_user_tok_s"),
        "latency_ms": latency_of(w),
        "repeats": [
            {
                "aggregate_tok_s": x.get("aggregate_tok_s"),
                "per_user_tok_s": x.get("per_user_tok_s"),
            }
            for x in w.get("repeats", [])
        ],
    }


def _overhead_sentence(o: dict[str, Any]) -> str:
    return (
        f"Wall {o['wall_s']:.1f} s, of which server start-up and measured workloads "
        f"{o['startup_and_measured_s']:.1f} s; overhead {o['overhead_s']:.1f} s "
        f"({o['overhead_pct']:.1f}%)."
    )


def _overhead_record(saved: Any) -> dict[str, Any]:
    """Overhead figures per attempt: {"run": the original run's or None, "resumes": [...]}.
    A bare figures dict (what runs before resumes were kept apart wrote) is the run's."""
    if not saved:
        return {"run": None, "resumes": []}
    if "wall_s" in saved:
        return {"run": dict(saved), "resumes": []}
    return {"run": saved.get("run"), "resumes": list(saved.get("resumes", []))}


def render_json(store: RunStore, overhead: dict[str, Any] | None = None) -> dict[str, Any]:
    figures = _overhead_record(overhead)
    manifest = store.manifest()
    rows = _ordered_rows(manifest, store.results())
    return {
        "run_id": manifest["run_id"],
        "matrix": manifest["matrix"]["name"],
        "versions": manifest.get("versions"),
        "git": manifest.get("git"),
        "cases_total": len(manifest["cases"]),
        "cases_finished": len(rows),
        "cases_failed": sum(r.get("status") != "passed" for r in rows),
        "overhead": figures["run"],
        "overhead_resumes": figures["resumes"],
        "cases": [
            {
                "case_id": r["case_id"],
                "model": r["model"],
                "tp": r["tp"],
                "dcp": r["dcp"],
                "mtp": r["mtp"],
                "variant": r["variant"],
                "status": r.get("status"),
                "reason": r.get("reason"),
                "errors": r.get("errors", 0),
                "audit_verdict": (r.get("audit") or {}).get("verdict", {}).get("status"),
                "same_tokens": r.get("same_tokens") or {},
                "workloads": {
                    name: _workload_json(w) for name, w in r.get("workloads", {}).items()
                },
            }
            for r in rows
        ],
        "paired": paired_deltas(manifest, rows),
        "audit_summary": audit_sentence(rows),
    }


def write_reports(
    store: RunStore, overhead: dict[str, float] | None = None, *, resume: bool = False
) -> None:
    """(Re)write the reports of a run directory.

    `overhead`, when given, is this attempt's figures: the run's own, or with `resume` one
    more resume's, kept beside the original run's and never in its place (overhead.json).
    Without it the saved figures are shown as they are.
    """
    saved = store.root / OVERHEAD
    figures = _overhead_record(json.loads(saved.read_text()) if saved.exists() else None)
    if overhead is not None:
        if resume:
            figures["resumes"].append(overhead)
        else:
            figures = {"run": overhead, "resumes": []}
        write_json_atomic(saved, figures)
    write_text_atomic(store.root / "report.md", render_markdown(store, figures))
    write_json_atomic(store.root / "report.json", render_json(store, figures))
    # Imported here: both modules build on this one's tables, a top-level import would cycle.
    from orchestrator.html_report import write_html
    from orchestrator.junit import write_junit

    write_html(store)
    write_junit(store)
