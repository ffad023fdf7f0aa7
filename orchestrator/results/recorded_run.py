"""A recorded run, read: the run directory as the reports, compare, A/B and nightly see it.

``Run.load`` reads the manifest (``RunManifest``), the latest result of each case
(``CaseResult`` rows), the saved overhead figures and any corrections once. ``WorkloadDef``
is a workload as the run's matrix defined it, in the words every reader states it with.

Here, outside orchestrator.reports, because the figures that judge a run (orchestrator.analysis.ab,
orchestrator.analysis.evidence, orchestrator.analysis.compare) read it too, and the reports render
those.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from orchestrator.common import safe_io
from orchestrator.common.layout import MANIFEST, OVERHEAD
from orchestrator.results import corrections
from orchestrator.results.manifest import RunManifest
from orchestrator.results.rows import CaseResult
from orchestrator.results.store import RunStore, StoreError

# What every attempt's figures hold (runner._Attempt._finish writes them).
OVERHEAD_FIGURES = ("wall_s", "startup_and_measured_s", "overhead_s", "overhead_pct")


@dataclass
class Overhead:
    """Overhead figures per attempt: the original run's (None when it was killed before its
    end) and each resume's, kept apart so a resume never stands in for the run."""

    run: dict[str, Any] | None = None
    resumes: list[dict[str, Any]] = field(default_factory=list)

    @classmethod
    def of(cls, saved: Any) -> Overhead:
        """From overhead.json; a bare figures dict (what runs before resumes were kept apart
        wrote) is the run's. ValueError says what a malformed one lacks."""
        if not saved:
            return cls()
        if not isinstance(saved, dict):
            raise ValueError(f"not a JSON object but {type(saved).__name__}")
        if "wall_s" in saved:
            return cls(_figures(saved, "the run"))
        run, resumes = saved.get("run"), saved.get("resumes", [])
        if not isinstance(resumes, list):
            raise ValueError("resumes is not a list")
        return cls(
            None if run is None else _figures(run, "run"),
            [_figures(r, f"resumes[{i}]") for i, r in enumerate(resumes)],
        )

    @classmethod
    def load(cls, path: Path) -> Overhead:
        """overhead.json, or no figures where there is none; StoreError naming it when it is
        no such file (a link to a device, a FIFO, past its bound, not JSON, malformed)."""
        if not path.exists() and not path.is_symlink():
            return cls()
        try:
            return cls.of(safe_io.read_json(path))
        except safe_io.UnsafeFileError as exc:
            raise StoreError(str(exc)) from None
        except (OSError, ValueError) as exc:
            raise StoreError(f"{path}: malformed overhead figures ({exc})") from None

    def to_dict(self) -> dict[str, Any]:
        return {"run": self.run, "resumes": self.resumes}


def _figures(value: Any, what: str) -> dict[str, Any]:
    """One attempt's figures, every one a finite number (the reports format them); an attempt
    interrupted before its first case finished has none (its cases_run is 0)."""
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not a JSON object")
    for key in OVERHEAD_FIGURES:
        figure = value.get(key)
        if figure is None and value.get("cases_run") == 0:
            continue
        if isinstance(figure, bool) or not isinstance(figure, (int, float)):
            raise ValueError(f"{what}.{key} is {figure!r}, not a number")
        if not math.isfinite(figure):
            raise ValueError(f"{what}.{key} is {figure!r}")
    return dict(value)


@dataclass
class Run:
    """A run directory, read: manifest, latest result per case, overhead figures."""

    store: RunStore
    manifest: RunManifest
    # The latest row of each case, in the order rows were last written.
    results: list[CaseResult]
    overhead: Overhead = field(default_factory=Overhead)
    # Figures found wrong after the run was written (orchestrator.results.corrections).
    corrections: list[corrections.Correction] = field(default_factory=list)

    @classmethod
    def load(cls, where: RunStore | str | Path) -> Run:
        """Read a run directory; StoreError names the file (and field) that is malformed."""
        store = where if isinstance(where, RunStore) else RunStore(Path(where))
        overhead = Overhead.load(store.root / OVERHEAD)
        try:
            manifest = RunManifest.model_validate(store.manifest())
        except ValidationError as exc:
            err = exc.errors()[0]
            field = ".".join(str(p) for p in err["loc"]) or "manifest"
            raise StoreError(f"{store.root / MANIFEST}: {field}: {err['msg']}") from None
        return cls(store, manifest, store.results(), overhead, corrections.load(store.root))

    @property
    def root(self) -> Path:
        return self.store.root

    @property
    def run_id(self) -> str:
        return self.manifest.run_id or self.store.run_id

    @property
    def ordered(self) -> list[CaseResult]:
        """Results of the manifest's cases, in matrix order (rows of other cases left out)."""
        by_id = {r.case_id: r for r in self.results}
        return [by_id[c] for c in self.manifest.case_ids if c in by_id]

    @property
    def failed(self) -> list[CaseResult]:
        return [r for r in self.results if not r.passed]

    @property
    def columns(self) -> list[tuple[str, str]]:
        return self.manifest.columns()

    @property
    def variants(self) -> list[str]:
        return self.manifest.variants()

    @property
    def interrupted(self) -> dict[str, Any] | None:
        """The latest attempt's figures when it was interrupted (Ctrl-C, SIGTERM): what
        stopped it, the case it cut short, the command that continues it."""
        recorded = [a for a in (self.overhead.run, *self.overhead.resumes) if a]
        last = recorded[-1] if recorded else None
        return last if last and last.get("interrupted") else None


# --------------------------------------------------------------------------- workloads


@dataclass(frozen=True)
class WorkloadDef:
    """A workload as the matrix defined it, by its one name (a report column it stands in
    for, ``ctx1k`` for ``ctx64k``, is said beside the name, never instead of it): its prompt
    and output lengths, concurrency, requests per repeat or duration, repeats."""

    name: str
    column: str
    prompt_tokens: int
    output_tokens: int
    concurrency: int
    requests: int | None  # per repeat; None in duration mode
    duration_s: float | None
    repeats: int

    @classmethod
    def of(cls, spec: dict[str, Any]) -> WorkloadDef:
        """From a workload of the matrix as manifest.json holds it."""
        duration = spec.get("duration_s")
        requests = spec.get("requests")
        concurrency = int(spec.get("concurrency") or 1)
        return cls(
            name=spec["name"],
            column=spec.get("column") or spec["name"],
            prompt_tokens=int(spec.get("prompt_tokens") or 0),
            output_tokens=int(spec.get("output_tokens") or 0),
            concurrency=concurrency,
            requests=None if duration is not None else int(requests or concurrency),
            duration_s=None if duration is None else float(duration),
            repeats=int(spec.get("repeats") or 1),
        )

    @property
    def title(self) -> str:
        """``ctx1k``, or ``ctx1k (for ctx64k)`` where it fills another report column."""
        return self.name if self.column == self.name else f"{self.name} (for {self.column})"

    def describe(self) -> str:
        """``prompt 1,024 tokens, output 16 tokens, concurrency 1, 2 requests x 1 repeat``."""
        size = (
            f"{self.duration_s:g} s"
            if self.duration_s is not None
            else _n(self.requests or 0, "request")
        )
        return (
            f"prompt {_n(self.prompt_tokens, 'token')}, output {_n(self.output_tokens, 'token')}, "
            f"concurrency {self.concurrency}, {size} x {_n(self.repeats, 'repeat')}"
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _n(n: float, word: str) -> str:
    return f"{n:,g} {word}{'' if n == 1 else 's'}"


def workload_defs(run: Run) -> list[WorkloadDef]:
    return [WorkloadDef.of(w) for w in run.manifest.matrix.get("workloads", [])]


def legend(run: Run) -> list[str]:
    """``ctx0: prompt 1 token, output 32 tokens, concurrency 1, 2 requests x 1 repeat``, one
    line per workload of the matrix."""
    return [f"{w.title}: {w.describe()}" for w in workload_defs(run)]
