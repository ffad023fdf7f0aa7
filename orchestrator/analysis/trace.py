"""Torch-profiler chrome traces (``*.pt.trace.json[.gz]``), read as a stream.

A trace of a real model is hundreds of MB of JSON, almost all of it CPU ops; it is never
loaded whole. ``ijson`` walks ``traceEvents`` one event at a time, and only what the figures
need is kept: the device work (kernel events, or on a CPU build the CPU ops), the runtime and
driver calls' names and correlation ids, and vLLM's step annotations.

What one trace (one rank) gives (``read_trace`` -> ``results.TraceFigures``):

- kernel events; the device work's span (first start to last end) and busy time (the union of
  its intervals, so overlapping streams count once); the top kernels by total time;
- runtime/driver call counts by name and in the groups the seeds compare (``CALL_GROUPS``:
  stream waits, event records, graph launches, synchronizing calls);
- the model steps vLLM annotated (``execute_context_N(..)_generation_M(..)`` with tokens);
- the decode query step of every layer (``QueryRule``, below);
- each model step's device work (kernels, copies, memsets) by kernel family, the query step's
  events as their own family (orchestrator.analysis.step_work, kernel_names).

A trace without kernel events (vLLM's CPU build) has CPU ops as its device work: the same
figures are computed over ``cpu_op`` events, and ``domain`` says which it was.

The query-step rule. A decode layer runs, on one stream (or CPU thread), its projections, the
query step, then the decode attention. The attention kernel is the anchor: between one
attention and the next lies one layer's work. In that window the query step is

- fused: the fusedq kernel (names from fusedq/contract.py: its Triton kernels, its custom op);
- staged, when no fused event is in the window: the last GEMM before the attention (W_UK_T's
  ``bmm``; the projections' GEMMs come earlier) plus the concat events after it (``cat``, or
  the concat-quant kernel for an FP8 query). A backend that takes the query as a (nope, pe)
  pair launches no concat, and the step is the GEMM alone.

Names are matched as classes (GEMM, concat, attention: orchestrator.analysis.kernel_names), not
one spelling: cuBLAS's nvjet and xmma GEMMs, CUTLASS and ``aten::bmm``; ``CatArrayBatchedCopy``, inductor's ``fused_cat``,
``aten::cat``; FlashAttention, FlashMLA, Triton MLA and the CPU build's ``mla_decode``. It is
proved on traces whose answer is known (tests/orchestrator/test_trace.py: synthetic traces,
and the CPU build's real staged and fused traces, where every layer of every step must be
found once), and in eager GPU traces each counted kernel's launching CPU op is reported
(``QueryStep.launched_by``: ``aten::bmm`` and ``aten::cat`` for staged), the ground truth
the rule is checked against. It is meant for decode-only windows (what the profile phase
records): a prefill attention's window holds a GEMM too, and would be counted as staged.
"""

from __future__ import annotations

import bisect
import gzip
import re
import zlib
from collections import Counter, defaultdict
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orchestrator.analysis.kernel_names import (
    ATTENTION_NAMES,
    CONCAT_NAMES,
    FUSED_NAMES,
    GEMM_NAMES,
    any_of,
)
from orchestrator.analysis.step_work import busy, step_work
from orchestrator.common import safe_io
from orchestrator.common.safe_io import MAX_JSON_DEPTH
from orchestrator.results.profile_figures import KernelTotal, QueryStep, TraceFigures

# One file per worker: dp{d}_pp{p}_tp{t}_dcp{c}_ep{e}_rank{r}.<id>.pt.trace.json.gz (vLLM's
# get_worker_rank_suffix); the API server's own CPU trace (<host>_<pid>.async_llm.<id>...) is
# not a rank's.
RANK_TRACE = re.compile(r"^dp\d+_pp\d+_tp\d+_dcp\d+_ep\d+_rank(\d+)\..*\.pt\.trace\.json(\.gz)?$")
TRACE_SUFFIXES = (".pt.trace.json", ".pt.trace.json.gz", ".json", ".json.gz")
RUNTIME_CATS = frozenset({"cuda_runtime", "cuda_driver", "runtime", "driver"})
WORK_CATS = {"kernel": frozenset({"kernel"}), "cpu_op": frozenset({"cpu_op"})}
# CUPTI's records of device copies and memsets: device work that is no kernel event (a CUDA
# graph's memcpy node may run as either: orchestrator.analysis.step_work).
COPY_CATS = frozenset({"gpu_memcpy", "gpu_memset"})
# The calls the seeds compare between staged and fused: a change to the decode query must not
# add hot-path synchronisation. Runtime and driver spellings both count.
CALL_GROUPS: dict[str, frozenset[str]] = {
    "stream_wait_event": frozenset({"cudaStreamWaitEvent", "cuStreamWaitEvent"}),
    "event_record": frozenset(
        {"cudaEventRecord", "cudaEventRecordWithFlags", "cuEventRecord", "cuEventRecordWithFlags"}
    ),
    "graph_launch": frozenset({"cudaGraphLaunch", "cuGraphLaunch", "cuGraphLaunch_ptsz"}),
    "synchronize": frozenset(
        {
            "cudaDeviceSynchronize",
            "cudaStreamSynchronize",
            "cudaEventSynchronize",
            "cudaStreamQuery",
            "cudaMemcpy",
            "cudaMemcpy2D",
            "cuCtxSynchronize",
            "cuStreamSynchronize",
            "cuEventSynchronize",
            "cuMemcpyDtoH_v2",
            "cuMemcpyHtoD_v2",
        }
    ),
}
# vLLM's per-step annotation (gpu_model_runner): context and generation requests and tokens.
STEP_ANNOTATION = re.compile(r"^execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)$")
TOP_KERNELS = 10
# How many CPU ops back from a launch the search for its enclosing op goes (see _launcher).
LAUNCH_WALK = 256

GEMM, CONCAT, ATTENTION, FUSED, OTHER = "gemm", "concat", "attention", "fused", "other"


@dataclass(frozen=True)
class QueryRule:
    """Name classes of the query-step rule (see the module docstring). Checked in this order:
    an attention kernel built on CUTLASS (``cutlass::device_kernel<flash::...>``) is attention
    before it is a GEMM, and vLLM's KV-cache write (``concat_and_cache_mla``) is no concat."""

    fused: re.Pattern[str] = field(default_factory=lambda: any_of(*FUSED_NAMES))
    attention: re.Pattern[str] = field(default_factory=lambda: any_of(*ATTENTION_NAMES))
    concat: re.Pattern[str] = field(default_factory=lambda: any_of(*CONCAT_NAMES))
    gemm: re.Pattern[str] = field(default_factory=lambda: any_of(*GEMM_NAMES))

    def classify(self, name: str) -> str:
        if self.fused.search(name):
            return FUSED
        if self.attention.search(name):
            return ATTENTION
        if self.concat.search(name):
            return CONCAT
        if self.gemm.search(name):
            return GEMM
        return OTHER


DEFAULT_RULE = QueryRule()


class TraceError(ValueError):
    """A file that is not a readable torch-profiler trace; the message names it and why."""


# --------------------------------------------------------------------------- reading

# What one trace may take, whatever the file holds (docs/security.md). A real rank's trace is
# hundreds of MB of JSON and ~1M events; the caps are several times that.
MAX_TRACE_BYTES = 2 << 30  # decompressed JSON
MAX_TRACE_EVENTS = 5_000_000  # traceEvents items: what the reader keeps grows with them
# JSON read without the parser finishing one value: one value (a string, a number) or
# padding that long is no trace, and the parser would hold all of it.
MAX_JSON_TOKEN_BYTES = 1 << 20
_READ_BYTES = 64 << 10


def iter_events(path: Path) -> Iterator[dict[str, Any]]:
    """The trace's events one at a time (gzip or plain JSON, told by the file's first bytes),
    each with its scalar fields and its ``args``' scalar fields (what the figures read).

    Raises TraceError naming the file for a missing, special, unreadable, truncated or
    non-JSON file, one without a ``traceEvents`` array, and one past a bound above or
    nested deeper than MAX_JSON_DEPTH.
    """
    path = Path(path)
    try:
        raw = safe_io.open_regular(path)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except safe_io.UnsafeFileError as exc:
        raise TraceError(str(exc)) from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    with raw:
        try:
            gz = raw.read(2) == b"\x1f\x8b"
            raw.seek(0)
            source: Any = gzip.GzipFile(fileobj=raw, mode="rb") if gz else raw
            yield from _EventReader(path).events(_tokens(source, path))
        except (EOFError, gzip.BadGzipFile, zlib.error) as exc:
            raise TraceError(f"{path}: truncated or corrupt gzip ({exc})") from None
        except OSError as exc:
            raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None


def _tokens(f: Any, path: Path) -> Iterator[tuple[str, Any]]:
    """ijson's (event, value) stream, fed by hand so that no bound can be passed: bytes read,
    and bytes read without a complete value (ijson holds an unfinished one whole). The push
    parser keeps no path prefix per level, which made memory grow with the square of the
    nesting depth (80 KB of brackets took 3.9 GB)."""
    import ijson

    events = ijson.sendable_list()
    parser = ijson.basic_parse_coro(events, use_float=True)
    total = idle = 0
    try:
        while chunk := f.read(_READ_BYTES):
            total += len(chunk)
            if total > MAX_TRACE_BYTES:
                raise TraceError(f"{path}: more than {safe_io.size_text(MAX_TRACE_BYTES)} of "
                                 "JSON, a trace's bound")  # fmt: skip
            parser.send(chunk)
            if not events:
                idle += len(chunk)
                if idle > MAX_JSON_TOKEN_BYTES:
                    raise TraceError(
                        f"{path}: {safe_io.size_text(MAX_JSON_TOKEN_BYTES)} of JSON without "
                        "one complete value (a value that long is no trace event)"
                    )
                continue
            idle = 0
            yield from events
            del events[:]
        parser.close()
    except ijson.JSONError as exc:
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise TraceError(f"{path}: not a JSON trace ({first_line[:120]})") from None
    yield from events


class _EventReader:
    """Builds each item of the top-level ``traceEvents`` array from the token stream, keeping
    its scalar fields and those of its ``args``; everything else is only walked, its depth
    counted."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.top_map = False  # the document is a JSON object
        self.found = False  # it holds a traceEvents array
        self.count = 0

    def events(self, tokens: Iterable[tuple[str, Any]]) -> Iterator[dict[str, Any]]:
        depth = 0
        in_events = False
        top_key = key = arg_key = None
        event: dict[str, Any] | None = None
        args: dict[str, Any] | None = None
        for kind, value in tokens:
            if kind == "map_key":
                if depth == 1:
                    top_key = value
                elif depth == 3:
                    key = value
                elif depth == 4:
                    arg_key = value
            elif kind == "start_map" or kind == "start_array":
                depth += 1
                if depth > MAX_JSON_DEPTH:
                    raise TraceError(f"{self.path}: nests deeper than {MAX_JSON_DEPTH} levels")
                if depth == 1:
                    self.top_map = kind == "start_map"
                elif depth == 2 and top_key == "traceEvents" and kind == "start_array":
                    in_events = self.found = True
                elif depth == 3 and in_events and kind == "start_map":
                    event = {}
                elif depth == 4 and event is not None and key == "args" and kind == "start_map":
                    args = event["args"] = {}
            elif kind == "end_map" or kind == "end_array":
                depth -= 1
                if depth == 2 and event is not None:
                    self.count += 1
                    if self.count > MAX_TRACE_EVENTS:
                        raise TraceError(
                            f"{self.path}: more than {MAX_TRACE_EVENTS:,} events, a trace's bound"
                        )
                    yield event
                    event = None
                elif depth == 3:
                    args = None
                elif depth == 1:
                    in_events = False
            elif depth == 3 and event is not None:
                event[key] = value  # type: ignore[index]
            elif depth == 4 and args is not None:
                args[arg_key] = value  # type: ignore[index]
        if not self.count:
            what = (
                "an empty traceEvents array"
                if self.found
                else "no traceEvents array"
                if self.top_map
                else "no JSON object"
            )
            raise TraceError(
                f"{self.path}: not a torch-profiler trace (no events: {what}; expected a JSON "
                "object with a traceEvents array, as torch.profiler writes)"
            )


_Launch = tuple[Any, Any, float, str]


@dataclass(order=True)
class _Work:
    ts: float
    end: float
    name: str = field(compare=False)
    key: tuple[Any, Any] = field(compare=False)  # (pid, tid): a device's stream, a CPU thread
    correlation: Any = field(default=None, compare=False)


_OpsIndex = dict[Any, tuple[list[float], list["_Work"]]]


@dataclass
class _Collected:
    trace_events: int = 0
    work: dict[str, list[_Work]] = field(default_factory=lambda: defaultdict(list))
    runtime: Counter[str] = field(default_factory=Counter)
    # correlation id -> the runtime call that launched it: (pid, tid, ts, name)
    launches: dict[Any, _Launch] = field(default_factory=dict)
    steps: int = 0
    copies: list[_Work] = field(default_factory=list)  # COPY_CATS records
    # Every step annotation's start, and whether it ran the model (orchestrator.analysis.step_work).
    marks: list[tuple[float, bool]] = field(default_factory=list)


def _collect(events: Iterable[dict[str, Any]]) -> _Collected:
    out = _Collected()
    for e in events:
        out.trace_events += 1
        if e.get("ph") != "X":
            continue
        cat, name = e.get("cat"), str(e.get("name", ""))
        ts, dur = e.get("ts"), e.get("dur")
        if not isinstance(ts, (int, float)) or not isinstance(dur, (int, float)):
            continue
        args = e.get("args") if isinstance(e.get("args"), dict) else {}
        for domain, cats in WORK_CATS.items():
            if cat in cats:
                key = (e.get("pid"), e.get("tid"))
                corr = args.get("correlation") if domain == "kernel" else None
                out.work[domain].append(_Work(float(ts), float(ts) + float(dur), name, key, corr))
        if cat in COPY_CATS:
            corr = args.get("correlation")
            out.copies.append(_Work(float(ts), float(ts) + float(dur), name, (None, None), corr))
        if cat in RUNTIME_CATS:
            out.runtime[name] += 1
            if "correlation" in args:
                out.launches[args["correlation"]] = (e.get("pid"), e.get("tid"), float(ts), name)
        elif cat == "user_annotation" and (m := STEP_ANNOTATION.match(name)):
            # vLLM's empty closing step (no context, no generation tokens) ran no model.
            model = int(m.group(2)) + int(m.group(4)) > 0
            out.steps += model
            out.marks.append((float(ts), model))
    return out


def rank_of(path: Path) -> int | None:
    m = RANK_TRACE.match(Path(path).name)
    return int(m.group(1)) if m else None


def read_trace(
    path: str | Path, *, rule: QueryRule = DEFAULT_RULE, top: int = TOP_KERNELS
) -> TraceFigures:
    """The figures of one trace file (see the module docstring); TraceError if it is none."""
    path = Path(path)
    got = _collect(iter_events(path))
    domain = "kernel" if got.work.get("kernel") else "cpu_op"
    work = sorted(got.work.get(domain, []))
    totals: dict[str, list[float]] = {}
    for w in work:
        t = totals.setdefault(w.name, [0, 0.0])
        t[0] += 1
        t[1] += w.end - w.ts
    ranked = sorted(totals.items(), key=lambda kv: -kv[1][1])[:top]
    query, counted = _query(work, rule, got.launches, got.work.get("cpu_op", []))
    # Per model step and kernel family: GPU traces only (a CPU trace's ops nest, and their
    # times would be counted once per level).
    steps, outside = (
        step_work(work, got.copies, {id(w) for w in counted}, got.launches, got.marks)
        if domain == "kernel"
        else ([], None)
    )
    return TraceFigures(
        file=str(path),
        rank=rank_of(path),
        domain=domain,
        trace_events=got.trace_events,
        kernel_events=len(got.work.get("kernel", [])),
        work_events=len(work),
        work_us=round(sum(w.end - w.ts for w in work), 3),
        span_us=round(work[-1].end - work[0].ts if domain == "kernel" else _span(work), 3)
        if work
        else None,
        busy_us=round(busy(work), 3) if work else None,
        steps_seen=got.steps or None,
        calls={g: sum(got.runtime[n] for n in names) for g, names in CALL_GROUPS.items()},
        runtime_calls=dict(got.runtime.most_common()),
        top=[KernelTotal(name=n, count=int(c), total_us=round(t, 3)) for n, (c, t) in ranked],
        query=query,
        steps=steps,
        outside=outside,
    )


def _span(work: Sequence[_Work]) -> float:
    return max(w.end for w in work) - work[0].ts


# --------------------------------------------------------------------------- the query step


def query_step(
    work: Sequence[_Work],
    rule: QueryRule = DEFAULT_RULE,
    launches: dict[Any, _Launch] | None = None,
    cpu_ops: Sequence[_Work] = (),
) -> QueryStep:
    """Every layer step's query events (the rule in the module docstring), summed."""
    return _query(work, rule, launches, cpu_ops)[0]


def _query(
    work: Sequence[_Work],
    rule: QueryRule,
    launches: dict[Any, _Launch] | None,
    cpu_ops: Sequence[_Work],
) -> tuple[QueryStep, list[_Work]]:
    """The query step's figures and the events it counted."""
    by_key: dict[Any, list[_Work]] = defaultdict(list)
    for w in work:
        by_key[w.key].append(w)
    q = QueryStep()
    counted: list[_Work] = []
    for events in by_key.values():
        window: list[_Work] = []
        for w in sorted(events):
            if rule.classify(w.name) == ATTENTION:
                found = _query_of(window, rule)
                if found is not None:
                    path, picked = found
                    q.occurrences += 1
                    setattr(q, path, getattr(q, path) + 1)
                    counted += picked
                window = []
            else:
                window.append(w)
    q.events = len(counted)
    q.total_us = round(sum(w.end - w.ts for w in counted), 3)
    q.names = dict(Counter(w.name for w in counted).most_common())
    q.path = (
        None
        if not q.occurrences
        else "fused"
        if not q.staged
        else "staged"
        if not q.fused
        else "mixed"
    )
    if launches and counted:
        ops = _ops_index(cpu_ops)
        q.launched_by = dict(Counter(_launcher(w, launches, ops) for w in counted))
    return q, counted


def _query_of(window: list[_Work], rule: QueryRule) -> tuple[str, list[_Work]] | None:
    classes = [rule.classify(w.name) for w in window]
    fused = [w for w, c in zip(window, classes, strict=True) if c == FUSED]
    if fused:
        return "fused", fused
    gemms = [i for i, c in enumerate(classes) if c == GEMM]
    if not gemms:
        return None
    first = gemms[-1]
    # The concat belongs to the query only after its GEMM; a nested child of the GEMM (a CPU
    # op's own children) lies inside it and is no concat of the query.
    tail = [
        w
        for w, c in zip(window[first + 1 :], classes[first + 1 :], strict=True)
        if c == CONCAT and w.ts >= window[first].end
    ]
    return "staged", [window[first], *tail]


def _launcher(kernel: _Work, launches: dict[Any, _Launch], ops: _OpsIndex) -> str:
    """The innermost CPU op around the runtime call that launched `kernel` (eager mode), the
    call itself where no op surrounds it (a CUDA-graph replay: cudaGraphLaunch), or '?'."""
    launch = launches.get(kernel.correlation) if kernel.correlation is not None else None
    if launch is None:
        return "?"
    pid, tid, ts, call = launch
    starts, spans = ops.get((pid, tid), ([], []))
    # The latest-starting op that still contains the call is the innermost; the walk back is
    # bounded, since siblings that ended before the call lie between (a replay's launch has
    # no op around it, and must not cost a walk over the whole thread).
    last = bisect.bisect_right(starts, ts) - 1
    for i in range(last, max(-1, last - LAUNCH_WALK), -1):
        if spans[i].end >= ts:
            return spans[i].name
    return call


def _ops_index(cpu_ops: Sequence[_Work]) -> _OpsIndex:
    grouped: dict[Any, list[_Work]] = defaultdict(list)
    for op in cpu_ops:
        grouped[op.key].append(op)
    return {k: ([o.ts for o in v], v) for k, v in ((k, sorted(v)) for k, v in grouped.items())}


# --------------------------------------------------------------------------- files and ranks


def find_rank_traces(directory: Path) -> list[Path]:
    """The workers' trace files under `directory` (vLLM's rank-named ones), by rank."""
    found = [p for p in Path(directory).rglob("*") if p.is_file() and RANK_TRACE.match(p.name)]
    return sorted(found, key=lambda p: (rank_of(p) or 0, p.name))


def looks_like_trace(path: Path) -> bool:
    return Path(path).name.endswith(TRACE_SUFFIXES)
