"""manifest.json as its readers read it back (``RunManifest``), as leniently as a row."""

from __future__ import annotations

from typing import Any

from pydantic import Field, model_validator

from fusedq import provenance as _provenance
from orchestrator.results.record import Record

__all__ = ["RunManifest"]


class RunManifest(Record):
    """manifest.json as its readers need it: the run, its matrix (as expanded, a JSON dump of
    orchestrator.config.schema.Matrix), its cases in run order, versions and commit. The rest (the
    cluster, the driver, resumes) is kept as it was written."""

    run_id: str | None = None
    created_at: str | None = None
    matrix_path: str | None = None
    matrix: dict[str, Any] = Field(default_factory=dict)
    cases: list[dict[str, Any]] = Field(default_factory=list)
    versions: dict[str, Any] | None = None
    git: dict[str, Any] | None = None
    fusedq_fingerprint: str | None = None
    # fusedq.provenance.describe() of the code that ran (absent before 2026-12-02).
    provenance: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _readable(self) -> RunManifest:
        """What the readers index: each case's id, each workload's and variant's name (a
        manifest someone else wrote is refused here, naming the field, not in a report)."""
        for i, case in enumerate(self.cases):
            if not isinstance(case.get("case_id"), str):
                raise ValueError(f"cases[{i}].case_id is not a string")
        for kind in ("workloads", "variants"):
            specs = self.matrix.get(kind) or []
            if not isinstance(specs, list):
                raise ValueError(f"matrix.{kind} is not a list")
            for i, spec in enumerate(specs):
                if not isinstance(spec, dict) or not isinstance(spec.get("name"), str):
                    raise ValueError(f"matrix.{kind}[{i}] has no name")
        return self

    @property
    def matrix_name(self) -> str | None:
        return self.matrix.get("name")

    @property
    def commit(self) -> str | None:
        """The code's commit: the provenance record's (``+dirty`` where the tree differed from
        it), else git's HEAD as recorded before provenance existed."""
        if self.provenance is not None:
            return _provenance.commit_label(self.provenance)
        return (self.git or {}).get("commit")

    @property
    def product_fingerprint(self) -> str | None:
        return (self.provenance or {}).get("product_fingerprint")

    def version(self, name: str) -> Any:
        return (self.versions or {}).get(name)

    @property
    def case_ids(self) -> list[str]:
        return [c["case_id"] for c in self.cases]

    def columns(self) -> list[tuple[str, str]]:
        """(workload name, report column) in matrix order (``ctx1k`` may fill ``ctx64k``)."""
        return [(w["name"], w.get("column") or w["name"]) for w in self.matrix.get("workloads", [])]

    def variants(self) -> list[str]:
        """Variant names in matrix order, the baseline moved first (the reports compare the
        others against ``variants()[0]``); ``default`` for a matrix without variants."""
        specs = self.matrix.get("variants") or []
        names = [v["name"] for v in specs if v.get("baseline")]
        return names + [v["name"] for v in specs if not v.get("baseline")] or ["default"]

    @property
    def ab(self) -> dict[str, Any] | None:
        """The matrix's ``ab`` block as run (orchestrator.config.schema.ABSpec), or None."""
        return self.matrix.get("ab") or None

    def concurrency(self, workload: str) -> int:
        for w in self.matrix.get("workloads", []):
            if w.get("name") == workload:
                return max(1, int(w.get("concurrency") or 1))
        return 1
