"""A server's start-up, phase by phase, read from vLLM's own log lines.

vLLM logs a line at each step of its start-up (the same wording in 0.26 and 0.32):

    Initializing a V1 LLM engine (v0.26.0) with config: ...       the engine core starts
    Starting to load model /path...                                weights begin
    Model loading took 16.2 GiB memory and 4.9 seconds             weights done
    torch.compile took 41.3 s in total                             Dynamo + Inductor done
    Available KV cache memory: 40.1 GiB                            memory profiled
    Graph capturing finished in 12 secs, took 0.4 GiB              CUDA graphs captured
    init engine (profile, create kv cache, warmup model) took 80 s the engine is up

Each line carries its time ("INFO 12-02 10:11:12 [...]", local, to the second). With the
moment the orchestrator started the process and the moment /v1/models answered, the
start-up splits into consecutive phases (``PHASES``); a marker missing from a log (no
torch.compile under --enforce-eager, no graphs on CPU) folds its phase into the next one.
The durations vLLM reports itself ("took X s") are kept beside them, at their own precision,
and whether the compile cache was hit. The longest silences of the log before the server
was ready say where time went that no marker names (the first phases, in particular).

Standard library only; one pass over the log.
"""

from __future__ import annotations

import itertools
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from orchestrator.engines.vllm.logline import HEADER_RE, LABEL_RE, strip_ansi


@dataclass(frozen=True)
class Phase:
    """A phase of start-up: the marker line that ends it, and what happens in it."""

    name: str
    ends_at: str | None  # a regular expression on the message; None: the process/ready edge
    what: str


# In start-up order. A phase runs from the previous phase's end to its own marker.
PHASES = (
    Phase("imports", None, "process start and Python imports, to vLLM's first log line"),
    Phase(
        "api_server",
        r"Initializing a V1 LLM engine",
        "API server: arguments, model config and inspection, engine process start",
    ),
    Phase(
        "engine_init",
        r"Starting to load model",
        "engine and worker processes: imports, device and distributed init, model build",
    ),
    # The CPU runner (0.32) logs no "Model loading took": its loader's line ends the phase.
    Phase("weights", r"Model loading took|Loading weights took", "weights (dummy: drawn by vLLM)"),
    Phase(
        "compile",
        r"torch\.compile (?:and initial profiling/warmup run together )?took"
        r"|Initial profiling/warmup run took",
        "torch.compile: Dynamo and Inductor, or their cache",
    ),
    Phase(
        "profile",
        r"Available KV cache memory|GPU KV cache size",
        "memory profiling and KV cache sizing",
    ),
    Phase("graphs", r"Graph capturing finished", "CUDA graph capture"),
    Phase(
        "engine_ready",
        r"init engine \(profile, create kv cache, warmup model\) took",
        "warm-up, engine ready",
    ),
    Phase("serving", None, "API server up, to /v1/models answering"),
)
PHASE_NAMES = tuple(p.name for p in PHASES)
_MARKERS = [(p.name, re.compile(p.ends_at)) for p in PHASES if p.ends_at]
# Phases that end where another process begins: at the first of its lines, not the last.
_FIRST_LINE = frozenset({"api_server", "engine_init"})

# Durations vLLM states itself, per process (a TP server's ranks each log theirs): summed
# within a process (the target's and the MTP draft's compiles), the slowest process kept.
REPORTED = {
    "weights_s": r"Model loading took \S+ GiB(?: memory)? and (?P<s>[\d.]+) seconds",
    "dynamo_s": r"Dynamo bytecode transform time: (?P<s>[\d.]+) s",
    "inductor_s": r"Compiling a graph for compile range .* takes (?P<s>[\d.]+) s",
    "cache_load_s": r"Directly load the compiled graph\(s\) for compile range .* took (?P<s>[\d.]+) s",
    "torch_compile_s": r"torch\.compile (?:and initial profiling/warmup run together )?took (?P<s>[\d.]+) s",
    "graph_capture_s": r"Graph capturing finished in (?P<s>[\d.]+) secs",
    "engine_init_s": r"init engine \(profile, create kv cache, warmup model\) took (?P<s>[\d.]+) s",
}
_REPORTED = {k: re.compile(v) for k, v in REPORTED.items()}
# The compile cache, as vLLM tells it: loaded (vLLM's piecewise graphs, or its AOT artifact),
# compiled, or found and not loadable (it then compiles again).
_CACHE_LOADED = re.compile(
    r"Directly load the compiled graph\(s\)|Directly load AOT compilation from"
)
_CACHE_COMPILED = re.compile(r"Compiling a graph for compile range|saved AOT compiled function")
_CACHE_FAILED = re.compile(
    r"Compiling model again due to a load failure from .*, reason: (?P<why>.*)"
)
# Silences this long or longer are listed (the few longest).
SILENCE_MIN_S = 5.0
SILENCES = 3
# A log stamp this far before the process started, or after it was ready, is another clock
# (a node in another time zone): the edges anchored on the orchestrator's clock are dropped.
CLOCK_SLACK_S = 2.0
_MESSAGE_CHARS = 160


@dataclass(frozen=True)
class _Line:
    t: float
    process: str
    message: str


def read_startup(
    log_path: Path, *, spawned_at: float | None, ready_at: float | None
) -> dict[str, Any] | None:
    """The start-up record of the server whose log is `log_path`: ``phases`` (name ->
    seconds, in order, the phases found), ``vllm`` (durations it reported), ``compile_cache``
    (hit, miss, partial or None) and ``silences``. `spawned_at` and `ready_at` are epoch
    seconds (None where unknown: a server that never got ready). None: no log."""
    try:
        with Path(log_path).open(encoding="utf-8", errors="replace") as f:
            return startup_record(f, spawned_at=spawned_at, ready_at=ready_at)
    except OSError:
        return None


def startup_record(
    lines: Iterable[str], *, spawned_at: float | None, ready_at: float | None
) -> dict[str, Any]:
    """`read_startup` on the lines of a log (see there)."""
    year = time.localtime(spawned_at if spawned_at is not None else time.time()).tm_year
    stamped = list(_stamped(lines, year, spawned_at, ready_at))
    edges: dict[str, float] = {}
    reported: dict[str, dict[str, float]] = {}
    cache = _CacheEvents()
    for line in stamped:
        cache.see(line.message)
        for name, pattern in _MARKERS:
            if pattern.search(line.message):
                # A phase that begins another process ends at its first line; the others at
                # the last rank's (the server waits for every rank).
                keep = min if name in _FIRST_LINE else max
                edges[name] = keep(edges.get(name, line.t), line.t)
        for key, pattern in _REPORTED.items():
            m = pattern.search(line.message)
            if m:
                per = reported.setdefault(key, {})
                per[line.process] = per.get(line.process, 0.0) + float(m["s"])
    first = stamped[0].t if stamped else None
    clock_ok = (
        first is not None
        and (spawned_at is None or first >= spawned_at - CLOCK_SLACK_S)
        and (ready_at is None or first <= ready_at + CLOCK_SLACK_S)
    )
    bounds: list[tuple[str, float | None]] = [("start", spawned_at if clock_ok else None)]
    bounds.append(("imports", first))
    bounds += [(name, edges.get(name)) for name, _ in _MARKERS]
    bounds.append(("serving", ready_at if clock_ok else None))
    vllm = {k: round(max(v.values()), 3) for k, v in reported.items()}
    return {
        "phases": _phases(bounds),
        "vllm": vllm,
        "compile_cache": cache.state(),
        **({"compile_cache_failure": cache.failure} if cache.failure else {}),
        "silences": _silences(stamped, ready_at),
    }


def _stamped(
    lines: Iterable[str], year: int, spawned_at: float | None, ready_at: float | None
) -> Iterable[_Line]:
    """The log's header lines with their times (epoch), up to the server being ready."""
    for raw in lines:
        text = strip_ansi(raw.rstrip("\n"))
        label = LABEL_RE.match(text)
        process = label["name"] + (label["rank"] or "") if label and label["name"] else ""
        body = text[label.end() :] if label else text
        header = HEADER_RE.match(body)
        if header is None:
            continue
        t = _epoch(header["stamp"], year, spawned_at)
        if ready_at is not None and t > ready_at + CLOCK_SLACK_S:
            return
        yield _Line(t, process, body[header.end() :])


def _epoch(stamp: str, year: int, spawned_at: float | None) -> float:
    """vLLM's "%m-%d %H:%M:%S[.fff]" local stamp as epoch seconds; a stamp that reads as long
    before the process started was logged in the next year (a start across New Year)."""
    date, clock = stamp.split(" ")
    month, day = (int(x) for x in date.split("-"))
    hms, _, frac = clock.partition(".")
    hour, minute, second = (int(x) for x in hms.split(":"))
    t = time.mktime((year, month, day, hour, minute, second, 0, 0, -1))
    if spawned_at is not None and t < spawned_at - 86400:
        t = time.mktime((year + 1, month, day, hour, minute, second, 0, 0, -1))
    return t + (float(f"0.{frac}") if frac else 0.0)


def _phases(bounds: list[tuple[str, float | None]]) -> dict[str, float]:
    """Each found edge's distance from the previous found one, named by the edge."""
    out: dict[str, float] = {}
    previous: float | None = None
    for name, t in bounds:
        if t is None:
            continue
        if previous is not None and name != "start":
            out[name] = round(max(0.0, t - previous), 3)
        previous = t
    return out


class _CacheEvents:
    """What the log says of the compile cache: loaded, compiled, or a load that failed."""

    def __init__(self) -> None:
        self.loaded = self.compiled = False
        self.failure: str | None = None

    def see(self, message: str) -> None:
        failed = _CACHE_FAILED.search(message)
        if failed is not None:
            self.failure = self.failure or failed["why"][:_MESSAGE_CHARS]
        self.loaded |= bool(_CACHE_LOADED.search(message))
        self.compiled |= bool(_CACHE_COMPILED.search(message))

    def state(self) -> str | None:
        """hit, miss, partial (some graphs loaded, some compiled), load-failed (artifacts were
        there and vLLM compiled again: `failure` says why), or None (nothing compiled)."""
        if self.failure is not None and not self.loaded:
            return "load-failed"
        if self.loaded and self.compiled:
            return "partial"
        if self.loaded:
            return "hit"
        return "miss" if self.compiled else None


def _silences(stamped: list[_Line], ready_at: float | None) -> list[dict[str, Any]]:
    """The longest gaps between consecutive log lines before the server was ready."""
    gaps = []
    for before, after in itertools.pairwise(stamped):
        if ready_at is not None and after.t > ready_at:
            break
        gap = after.t - before.t
        if gap >= SILENCE_MIN_S:
            gaps.append(
                {
                    "s": round(gap, 3),
                    "after": before.message[:_MESSAGE_CHARS],
                    "before": after.message[:_MESSAGE_CHARS],
                }
            )
    gaps.sort(key=lambda g: -g["s"])
    return gaps[:SILENCES]
