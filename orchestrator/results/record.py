"""The base of every record results.jsonl, manifest.json and report.json are read into.

Reading is lenient on purpose. Rows were written by every earlier version of this tool (the
committed validation runs, the test fixtures) and by hand (tests): a field missing from an
old row takes its default, and a field this version does not know is kept and written back
as it was (``extra="allow"``), never an error. What a row holds that is of the wrong type is
an error naming the row's line and the field (``orchestrator.results.store`` raises it).
"""

from __future__ import annotations

from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    ModelWrapValidatorHandler,
    PrivateAttr,
    SerializerFunctionWrapHandler,
    model_serializer,
    model_validator,
)

__all__ = ["Record", "none_is_default"]


class Record(BaseModel):
    """A stored record: read leniently, written back with the keys it was read with."""

    # Lenient on purpose (see the module docstring): unknown fields are kept, not refused.
    model_config = ConfigDict(extra="allow")
    # The order the fields came in: a record is written back (results.jsonl, report.json)
    # with its keys in that order, so a row read from an older file reads as it did.
    _keys: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="wrap")
    @classmethod
    def _remember_key_order(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        record = handler(data)
        if isinstance(data, dict):
            record._keys = tuple(data)
        return record

    @model_serializer(mode="wrap")
    def _in_key_order(self, handler: SerializerFunctionWrapHandler) -> Any:
        out = handler(self)
        if not self._keys or not isinstance(out, dict):
            return out
        first = {k: out[k] for k in self._keys if k in out}
        return {**first, **{k: v for k, v in out.items() if k not in first}}


def none_is_default(value: Any, default: Any) -> Any:
    """`default` for a field a row holds as null (an older writer's way of saying empty)."""
    return default if value is None else value
