"""The `orchestrator` command line: parse arguments, call one library function, map errors
to exit codes.

Heavy modules (torch, ray, vllm) are imported inside the command that needs them so that
`orchestrator --help` and `orchestrator plan` answer in well under a second.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from orchestrator.common import layout

if TYPE_CHECKING:
    from orchestrator.execution.runner import RunSummary

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    # Plain help: click re-wraps each paragraph to the terminal (rich's panels kept the
    # docstrings' own line breaks, cutting sentences in two) and names no "<bool>" for flags.
    rich_markup_mode=None,
    help="Validate vLLM serving topologies: plan, run, audit, report, compare.",
)

# Exit codes shared by every command.
EXIT_OK = 0
EXIT_FINDINGS = 1  # a check ran and found something (audit findings, regressions, failed cases)
EXIT_USAGE = 2  # bad input: nothing was launched
EXIT_INTERRUPTED = 130  # Ctrl-C or SIGTERM: the shell's code for a SIGINT


def _fail(message: str, code: int = EXIT_USAGE) -> typer.Exit:
    """One clear line on stderr, then the exit code."""
    typer.echo(f"orchestrator: {message}", err=True)
    return typer.Exit(code)


_SET_HELP = "Override a matrix field: --set models[0].path=/ckpt (repeatable)."
# Metavars for the help text: what to type, not a Python type ("<str>", "<list[str]>").
_SET = {"metavar": "KEY=VALUE", "help": _SET_HELP}


def _print_version(value: bool) -> None:
    if value:
        from orchestrator.version import version_line

        typer.echo(version_line())
        raise typer.Exit()


@app.callback()
def _main(
    version: bool = typer.Option(
        False,
        "--version",
        callback=_print_version,
        is_eager=True,
        help="Print the version (and the commit of a git checkout) and exit.",
    ),
) -> None:
    """Validate vLLM serving topologies: plan, run, audit, report, compare."""


@app.command(short_help="Validate a matrix and list its cases; launches nothing.")
def plan(
    matrix: Path = typer.Argument(..., metavar="MATRIX", help="Matrix YAML file."),
    json_out: bool = typer.Option(False, "--json", help="Print the plan as JSON."),
    sets: list[str] = typer.Option([], "--set", **_SET),
) -> None:
    """Validate a matrix and list its cases and their needs; launches nothing."""
    import json

    from orchestrator.config.errors import MatrixError
    from orchestrator.plan.render import plan_matrix, render_plan

    try:
        result = plan_matrix(matrix, sets=sets)
    except MatrixError as exc:
        raise _fail(str(exc)) from None
    typer.echo(json.dumps(result, indent=2) if json_out else render_plan(result))


@app.command(short_help="Run a matrix and write its reports.")
def run(
    matrix: Path = typer.Argument(..., metavar="MATRIX", help="Matrix YAML file."),
    sets: list[str] = typer.Option([], "--set", **_SET),
    resume: str | None = typer.Option(
        None, "--resume", metavar="RUN-ID", help="Continue RUN-ID, skipping finished cases."
    ),
    retry_failed: bool = typer.Option(
        False, "--retry-failed", help="With --resume: re-run failed cases too."
    ),
    run_id: str | None = typer.Option(
        None, "--run-id", metavar="RUN-ID", help="Name of a new run (default: matrix-UTC time)."
    ),
    logs_dir: Path = typer.Option(
        Path("logs"), "--logs-dir", metavar="DIR", help="Where run directories go."
    ),
    ray_address: str | None = typer.Option(
        None,
        "--ray-address",
        metavar="ADDRESS",
        envvar="RAY_ADDRESS",
        help="Join this Ray cluster (default: local Ray).",
    ),
    only: list[str] = typer.Option(
        [], "--only", metavar="TEXT", help="Run only cases whose id contains this (repeatable)."
    ),
    quiet: bool = typer.Option(False, "--quiet", help="No live progress."),
    kill_leftovers: bool = typer.Option(
        False,
        "--kill-leftovers",
        help="Stop processes of crashed runs first (a resumed run otherwise refuses to "
        "start while its own are left).",
    ),
) -> None:
    """Run a matrix: place, start, measure, stop and audit every case; write the reports.

    Exit 0 when every case passed, 1 when a case failed or could not be recorded, 2 on bad
    input or when processes of a crashed attempt of the resumed run still run (nothing
    launched).
    """
    from orchestrator.cluster.launch import LaunchError
    from orchestrator.config.errors import MatrixError
    from orchestrator.execution.runner import RunAborted, RunOptions, run_matrix
    from orchestrator.results.store import StoreError

    options = RunOptions(
        logs_dir=logs_dir,
        run_id=run_id,
        resume=resume,
        retry_failed=retry_failed,
        ray_address=ray_address,
        sets=sets,
        only=only,
        progress=not quiet,
        kill_leftovers=kill_leftovers,
    )
    try:
        summary = run_matrix(matrix, options)
    except RunAborted as exc:
        raise _fail(str(exc), EXIT_FINDINGS) from None
    except (MatrixError, StoreError, LaunchError, ValueError) as exc:
        raise _fail(str(exc)) from None
    except KeyboardInterrupt as exc:
        _print_interrupted(exc)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    _print_outcome(summary)
    if summary.failed:
        raise typer.Exit(EXIT_FINDINGS)


def _print_interrupted(exc: KeyboardInterrupt) -> None:
    """An interrupted run: the closing table of what it kept, then (on stderr) its id, where
    it is and the exact command that continues it."""
    from orchestrator.execution.interrupted import RunInterrupted

    if not isinstance(exc, RunInterrupted):
        typer.echo("orchestrator: interrupted", err=True)
        return
    if exc.run_dir is not None and (exc.run_dir / layout.MANIFEST).is_file():
        _print_summary(exc.run_dir)
    for line in exc.lines():
        typer.echo(f"orchestrator: {line}", err=True)


def _print_outcome(summary: RunSummary) -> None:
    """Where the run went, what it skipped, its closing table, and each failed case's reason."""
    from orchestrator.common.mdtable import plain_text

    report = summary.run_dir / layout.REPORT_MD
    typer.echo(f"run directory: {summary.run_dir}")
    typer.echo(f"report: {report}")
    if summary.skipped:
        typer.echo(f"skipped {len(summary.skipped)} finished case(s) (resume)")
    if summary.nothing_left:
        retry = " (--retry-failed re-runs the failed ones)" if summary.failed else ""
        typer.echo(f"nothing left to run: every selected case has a result{retry}")
    _print_summary(summary.run_dir)
    if summary.failed:
        # Named with the reason even under --quiet: an unattended log must say what failed.
        for rows, when in ((summary.earlier, " (in an earlier attempt)"), (summary.results, "")):
            for row in (r for r in rows if not r.passed):
                # A reason's later lines (what happened, the log's tail) indented under it,
                # without the control characters a log may hold (a terminal obeys them).
                reason = plain_text(row.reason).replace("\n", "\n    ")
                typer.echo(f"FAILED {row.case_id}{when}: {reason}", err=True)
        typer.echo(f"{len(summary.failed)} case(s) failed", err=True)


@app.command(short_help="Run a matrix with each case's decode profiled.")
def profile(
    matrix: Path = typer.Argument(..., metavar="MATRIX", help="Matrix YAML file."),
    decode_steps: int | None = typer.Option(
        None, "--decode-steps", help="Model steps to profile (default: the matrix's, else 4)."
    ),
    sets: list[str] = typer.Option([], "--set", **_SET),
    run_id: str | None = typer.Option(
        None, "--run-id", metavar="RUN-ID", help="Name of the new run."
    ),
    logs_dir: Path = typer.Option(
        Path("logs"), "--logs-dir", metavar="DIR", help="Where run directories go."
    ),
    ray_address: str | None = typer.Option(
        None,
        "--ray-address",
        metavar="ADDRESS",
        envvar="RAY_ADDRESS",
        help="Join this Ray cluster.",
    ),
    only: list[str] = typer.Option(
        [], "--only", metavar="TEXT", help="Run only cases whose id contains this."
    ),
    quiet: bool = typer.Option(False, "--quiet", help="No live progress."),
) -> None:
    """Run a matrix with its profile phase on (`profile:` in the matrix, or --decode-steps):
    every case's decode is profiled after its workloads, and the report gets the paired
    table of each staged/fused pair. Exit codes as `run`."""
    from orchestrator.config.errors import MatrixError
    from orchestrator.config.load import load_matrix

    try:
        given = load_matrix(matrix, sets=sets).profile
    except MatrixError as exc:
        raise _fail(str(exc)) from None
    if decode_steps is not None:
        sets = [*sets, f"profile.decode_steps={decode_steps}"]
    elif given is None:
        sets = [*sets, "profile.decode_steps=4"]
    run(
        matrix=matrix,
        sets=sets,
        resume=None,
        retry_failed=False,
        run_id=run_id,
        logs_dir=logs_dir,
        ray_address=ray_address,
        only=only,
        quiet=quiet,
        kill_leftovers=False,
    )


@app.command("trace-summary", short_help="Figures of torch-profiler traces.")
def trace_summary(
    traces: list[Path] = typer.Argument(..., help="Torch-profiler traces (.pt.trace.json[.gz])."),
    json_out: bool = typer.Option(False, "--json", help="Print the figures as JSON."),
    steps: int | None = typer.Option(
        None, "--steps", min=1, help="Decode steps the traces hold (default: vLLM's annotations)."
    ),
    top: int = typer.Option(10, "--top", min=1, help="Kernels listed by total time."),
) -> None:
    """Kernel events, span, busy time, runtime/driver call counts, the decode query step and
    the top kernels of each trace (a rank), then their mean over the ranks. Exit 2 naming
    the file that is missing or not a trace."""
    import json

    from orchestrator.analysis.kernel_names import short_name
    from orchestrator.analysis.trace import TraceError, read_trace
    from orchestrator.common.mdtable import md_table
    from orchestrator.reports.profile import family_rows, mean_rows, trace_rows

    try:
        figures = [read_trace(p, top=top) for p in traces]
    except TraceError as exc:
        raise _fail(str(exc)) from None
    if json_out:
        out: dict[str, Any] = {"traces": [f.model_dump(mode="json") for f in figures]}
        if len(figures) > 1:
            out["mean_over_ranks"] = dict(mean_rows(figures, steps))
        typer.echo(json.dumps(out, indent=2))
        return
    for f in figures:
        typer.echo(f"## {f.file}\n")
        typer.echo(md_table(["Figure", "Value"], trace_rows(f, steps)) + "\n")
        header, body = family_rows(f, steps)
        if body:
            typer.echo(md_table(header, body) + "\n")
        # Template instances run to 1,000 characters: shortened here, whole in --json.
        body = [[short_name(k.name), f"{k.count:,}", f"{k.total_us:,.3f}"] for k in f.top]
        typer.echo(md_table(["Top kernels" if f.domain == "kernel" else "Top CPU ops",
                             "Count", "Total (us)"], body) + "\n")  # fmt: skip
        calls = [[name, f"{n:,}"] for name, n in f.runtime_calls.items()]
        if calls:
            typer.echo(md_table(["Runtime/driver call", "Count"], calls) + "\n")
    if len(figures) > 1:
        typer.echo(f"## Mean over {len(figures)} traces (range)\n")
        typer.echo(md_table(["Figure", "Mean"], mean_rows(figures, steps)))


def _print_summary(run_dir: Path) -> None:
    """The closing table of a run (every case of it, resumed ones too), after the paths:
    what a person reads first when the run ends. Failed cases' reasons follow on stderr."""
    from orchestrator.reports.summary import render_summary
    from orchestrator.results.recorded_run import Run

    typer.echo("")
    typer.echo(render_summary(Run.load(run_dir)))


@app.command(short_help="Rebuild the reports of a run directory.")
def report(
    run_dir: Path = typer.Argument(..., metavar="RUN-DIR", help="A run directory (logs/<run-id>)."),
    reread_traces: bool = typer.Option(
        False,
        "--reread-traces",
        help="First read every profiled case's traces again with this version's kernel names "
        "and store their figures in results.jsonl (the trace files must still be there).",
    ),
) -> None:
    """Rebuild report.md, report.json, report.html and junit.xml of a run; print the Markdown."""
    from orchestrator.reports import write_reports
    from orchestrator.results.store import RunStore, StoreError

    try:
        store = RunStore.read(run_dir)
        _warn_torn(store)
        if reread_traces:
            from orchestrator.analysis.reread import reread_traces as reread

            changed = reread(store)
            typer.echo(
                f"orchestrator: re-read the traces: {changed} profiled rows changed", err=True
            )
        write_reports(store)
    except StoreError as exc:
        raise _fail(str(exc)) from None
    typer.echo((store.root / layout.REPORT_MD).read_text())


def _warn_torn(store: Any) -> None:
    """A run whose results.jsonl ends in an incomplete line: the readers skip that line, and
    say so rather than drop it silently (a resume moves it to results.jsonl.partial)."""
    torn = store.torn_tail()
    if torn:
        typer.echo(
            f"orchestrator: warning: {store.results_path}: its last line is incomplete "
            f"({torn} bytes, no newline) and is not read; `run --resume` moves it aside",
            err=True,
        )


@app.command(short_help="Compare two runs: regressions and new findings.")
def compare(
    base: Path = typer.Argument(..., metavar="BASE", help="The baseline run directory."),
    cand: Path = typer.Argument(..., metavar="CAND", help="The candidate run directory."),
    threshold_pct: float = typer.Option(
        3.0, "--threshold-pct", help="A drop in aggregate tok/s over this is a regression."
    ),
    json_out: bool = typer.Option(False, "--json", help="Print the comparison as JSON."),
) -> None:
    """Compare CAND with BASE: exit 0 unchanged, 1 regression or new fatal finding, 2 bad input."""
    import json

    from orchestrator.analysis.compare import CompareError, compare_runs
    from orchestrator.reports.compare import comparison_json, comparison_markdown
    from orchestrator.results.store import RunStore

    try:
        result = compare_runs(base, cand, threshold_pct=threshold_pct)
    except CompareError as exc:
        raise _fail(str(exc)) from None
    for run_dir in (base, cand):
        _warn_torn(RunStore(run_dir))
    typer.echo(
        json.dumps(comparison_json(result), indent=2) if json_out else comparison_markdown(result)
    )
    if not result.ok:
        raise typer.Exit(EXIT_FINDINGS)


@app.command(short_help="Run a matrix and compare it with the last good run.")
def nightly(
    matrix: Path = typer.Argument(..., metavar="MATRIX", help="Matrix YAML file."),
    history: Path = typer.Option(
        ..., "--history", help="Directory of earlier runs; the new run goes there too."
    ),
    sets: list[str] = typer.Option([], "--set", **_SET),
    threshold_pct: float = typer.Option(
        3.0, "--threshold-pct", help="A drop in aggregate tok/s over this is a regression."
    ),
    ray_address: str | None = typer.Option(
        None,
        "--ray-address",
        metavar="ADDRESS",
        envvar="RAY_ADDRESS",
        help="Join this Ray cluster.",
    ),
    kill_leftovers: bool = typer.Option(
        False,
        "--kill-leftovers",
        help="Stop processes of crashed runs first (otherwise the night only warns that they "
        "may hold the memory or GPUs its cases need).",
    ),
) -> None:
    """Run a matrix, compare with the last good run in --history, write the reports.

    Exit 0 when every case passed and nothing regressed, 1 on a failed case, a regression or
    a new fatal finding, 2 on bad input (nothing launched).
    """
    from orchestrator.cluster.launch import LaunchError
    from orchestrator.config.errors import MatrixError
    from orchestrator.execution.nightly import run_nightly
    from orchestrator.execution.runner import RunAborted
    from orchestrator.results.store import StoreError

    try:
        result = run_nightly(
            matrix,
            history,
            sets=sets,
            threshold_pct=threshold_pct,
            ray_address=ray_address,
            kill_leftovers=kill_leftovers,
        )
    except RunAborted as exc:
        raise _fail(str(exc), EXIT_FINDINGS) from None
    except (MatrixError, StoreError, LaunchError, ValueError) as exc:
        raise _fail(str(exc)) from None
    except KeyboardInterrupt as exc:
        _print_interrupted(exc)
        raise typer.Exit(EXIT_INTERRUPTED) from None
    for line in result.summary_lines():
        typer.echo(line)
    raise typer.Exit(result.exit_code)


@app.command(short_help="Scan logs or a run directory for GPU faults.")
def audit(
    paths: list[Path] = typer.Argument(
        ...,
        metavar="PATH...",
        help="Log files or directories (gzip and rotated logs too), or run directories.",
    ),
    json_out: bool = typer.Option(False, "--json", help="Print findings as JSON."),
    since: str | None = typer.Option(
        None, "--since", help="Only kernel-log lines after this time (ISO 8601)."
    ),
) -> None:
    """Scan logs for GPU faults: exit 0 clean, 1 findings, 2 usage error.

    A run directory (or a case's server.log inside one) is audited as the run audited it:
    each case's log with the lines its matrix expects and the line its stop began at, so
    what vLLM logs because the orchestrator stopped it is discounted as it was then; the
    run's own verdict is shown beside each case's.

    The kernel log is audited only with --since (the whole ring buffer would report every
    Xid since boot, from other jobs); without it the verdict says so.
    """
    from orchestrator.audit import AuditInputError, CatalogueError
    from orchestrator.audit.render import audit_paths

    try:
        output = audit_paths(paths, since=since, json_out=json_out)
    except (AuditInputError, CatalogueError) as exc:
        typer.echo(f"orchestrator audit: {exc}", err=True)
        raise typer.Exit(EXIT_USAGE) from None
    typer.echo(output.text)
    raise typer.Exit(EXIT_OK if output.clean else EXIT_FINDINGS)


@app.command("gpu-check", short_help="Check GPU placement and fusedq on every rank.")
def gpu_check(
    tp: str = typer.Option("1,2,4,8", "--tp", help="Bundle sizes to place, e.g. 1,2,4,8."),
    out: Path | None = typer.Option(
        None, "--out", help="Output directory (default logs/gpu-check-<UTC time>)."
    ),
    ray_address: str | None = typer.Option(
        None,
        "--ray-address",
        metavar="ADDRESS",
        envvar="RAY_ADDRESS",
        help="Join this Ray cluster.",
    ),
    tests: Path | None = typer.Option(
        None, "--tests", help="Run these fusedq GPU tests in every bundle (tests/fusedq)."
    ),
    bench: bool = typer.Option(True, "--bench/--no-bench", help="Run fusedq-bench per bundle."),
    bench_samples: int = typer.Option(300, "--bench-samples", min=10),
    heads: int = typer.Option(64, "--heads", help="The model's attention heads."),
    local_gpus: int | None = typer.Option(None, "--local-gpus", hidden=True),
    allow_cpu: bool = typer.Option(False, "--allow-cpu", hidden=True),
) -> None:
    """Check GPU placement, fusedq on every rank and the DCP query gather; exit 0 when all hold."""
    from orchestrator.cluster.gpucheck import (
        GpuCheckError,
        GpuCheckOptions,
        default_out_dir,
        parse_tps,
        run_gpu_check,
    )
    from orchestrator.cluster.launch import LaunchError

    try:
        opts = GpuCheckOptions(
            out_dir=out or default_out_dir(),
            tps=parse_tps(tp),
            heads=heads,
            ray_address=ray_address,
            tests=tests,
            bench=bench and not allow_cpu,
            bench_samples=bench_samples,
            local_gpus=local_gpus,
            allow_cpu=allow_cpu,
            log=lambda m: typer.echo(m, err=True),
        )
        result = run_gpu_check(opts)
    except (GpuCheckError, LaunchError) as exc:
        raise _fail(str(exc)) from None
    typer.echo((opts.out_dir / "gpu-check.md").read_text())
    raise typer.Exit(EXIT_OK if result["ok"] else EXIT_FINDINGS)


def main() -> None:
    """Console-script entry point."""
    app(prog_name="orchestrator")


if __name__ == "__main__":
    sys.exit(main())
