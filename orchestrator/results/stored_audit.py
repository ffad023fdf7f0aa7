"""The audit's records as a stored row holds them: ``AuditSummary`` and its parts.

The audit's records are declared once, in orchestrator.audit (stdlib dataclasses: `orchestrator
audit` loads no pydantic). Their stored form is derived from those declarations here, read as
leniently as every other record (orchestrator.results.record).
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union

from pydantic import Field, create_model, model_validator

from orchestrator.audit import findings as audit_records
from orchestrator.audit.verdict import AuditResult
from orchestrator.results.record import Record

__all__ = [
    "AuditSummary",
    "ExpectationResult",
    "FileSearched",
    "Finding",
    "Searched",
    "SourceStatus",
    "Verdict",
]

_EMPTY = {str: "", int: 0, float: 0.0, bool: False}
_STORED: dict[type, type[Record]] = {}


def _stored_type(tp: Any) -> Any:
    """`tp` with every audit record in it (``list[FileSearched]``) read as its stored form."""
    if isinstance(tp, type) and tp in _STORED:
        return _STORED[tp]
    args = typing.get_args(tp)
    origin = typing.get_origin(tp)
    if not args or origin is Literal:
        return tp
    inner = tuple(_stored_type(a) for a in args)
    return Union[inner] if origin in (Union, types.UnionType) else origin[inner]  # noqa: UP007


def _stored_field(f: dataclasses.Field, tp: Any) -> tuple[Any, Any]:
    """(type, default) of one field as a stored row reads it: the declared default; for a field
    declared without one, its type's empty value ("", 0, [], {}) or None."""
    if f.default is not dataclasses.MISSING:
        return tp, f.default
    if f.default_factory is not dataclasses.MISSING:
        value = f.default_factory()
        if dataclasses.is_dataclass(value):  # a nested record: its stored form
            stored, data = _STORED[type(value)], dataclasses.asdict(value)
            return tp, Field(default_factory=lambda: stored.model_validate(data))
        return tp, Field(default_factory=f.default_factory)
    origin = typing.get_origin(tp) or tp
    if origin in (list, dict):
        return tp, Field(default_factory=origin)
    if tp in _EMPTY:
        return tp, _EMPTY[tp]
    return tp | None, None


def _stored(record: type) -> type[Record]:
    """The stored form of an audit record: its fields, types and defaults as declared (a field
    a row lacks reads as in `_stored_field`), its behaviour (the record's ``…View`` base), read
    as leniently as every other row here."""
    hints = typing.get_type_hints(record)
    fields = {
        f.name: _stored_field(f, _stored_type(hints[f.name])) for f in dataclasses.fields(record)
    }
    views = tuple(b for b in record.__bases__ if b is not object)
    model = create_model(
        record.__name__,
        __base__=(*views, Record),
        __module__=__name__,
        __doc__=record.__doc__,
        **fields,
    )
    _STORED[record] = model
    return model


Finding = _stored(audit_records.Finding)
FileSearched = _stored(audit_records.FileSearched)
SourceStatus = _stored(audit_records.SourceStatus)
ExpectationResult = _stored(audit_records.ExpectationResult)
Searched = _stored(audit_records.Searched)
Verdict = _stored(audit_records.Verdict)


class AuditSummary(_stored(AuditResult)):  # type: ignore[misc]
    """A case's audit as audit.json and results.jsonl hold it (AuditResult.to_dict): besides
    the record's fields, the derived ``summary`` sentence, ``verdict.text`` and
    ``searched.lines`` are kept as written."""

    # A row without an audit reads as one whose verdict says nothing (and whose ``searched``
    # is None: not audited).
    verdict: Verdict = Field(default_factory=Verdict)  # type: ignore[valid-type]

    @model_validator(mode="before")
    @classmethod
    def _empty_parts(cls, data: Any) -> Any:
        if isinstance(data, dict):
            data = dict(data)
            if not data.get("searched"):
                data["searched"] = None
            if data.get("verdict") is None:
                data.pop("verdict", None)
        return data
