"""Figures of a run found wrong after it was written, kept beside the run and shown in its
reports.

A run directory may hold ``corrections.json``: the figures its reports state that a later
finding showed to be wrong, each with the value as written, the corrected value, why, and
where the finding is recorded. The run's data stay as recorded (a trace that would let the
figure be recomputed is often gone); every report rendered from the directory says, at its
top, which of its figures are superseded and by what, so a reader of the report itself is
not misled::

    {"corrections": [{"figure": "query step per layer (us), fused",
                      "case": "glm5-h16/tp1-dcp1-mtp1/fused",
                      "as_written": "2.822 (-19.82 %)", "corrected": "2.776 (-21.1 %)",
                      "why": "...", "source": "docs/validation/h200-2026-12-01/README.md"}]}
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from orchestrator.common import safe_io
from orchestrator.common.layout import CORRECTIONS


class CorrectionsError(ValueError):
    """A corrections.json that cannot be read; the message names the file and field."""


class Correction(BaseModel):
    """One superseded figure."""

    model_config = ConfigDict(extra="forbid")

    figure: str
    as_written: str
    corrected: str
    why: str
    source: str
    case: str | None = None

    def sentence(self, strong: str = "") -> str:
        """One line; ``strong`` wraps the corrected value (``**`` in Markdown)."""
        where = f"{self.case}, " if self.case else ""
        return (
            f"{where}{self.figure}: {self.as_written} as written, {strong}{self.corrected}"
            f"{strong} corrected. {self.why} (source: {self.source})"
        )


class Corrections(BaseModel):
    model_config = ConfigDict(extra="forbid")

    corrections: list[Correction]


def load(run_dir: Path) -> list[Correction]:
    """The run's corrections, [] without a corrections.json."""
    path = run_dir / CORRECTIONS
    if not path.is_file():
        return []
    try:
        return Corrections.model_validate(safe_io.read_json(path)).corrections
    except ValueError as exc:  # a hostile file (UnsafeFileError), bad JSON, a wrong field
        if isinstance(exc, ValidationError):
            err = exc.errors()[0]
            where = ".".join(str(p) for p in err["loc"])
            raise CorrectionsError(f"{path}: {where}: {err['msg']}") from None
        if isinstance(exc, safe_io.UnsafeFileError):
            raise CorrectionsError(str(exc)) from None
        raise CorrectionsError(f"{path}: not JSON ({exc})") from None
