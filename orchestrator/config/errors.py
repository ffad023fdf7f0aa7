"""How a matrix's problems are told: `MatrixError` names the file, the field and the
value (``matrices/tp8.yaml: topologies[2].dcp=3 does not divide tp=8``), and pydantic's
validation errors become its field path and message, a misspelt key with the key it
resembles."""

from __future__ import annotations

import difflib
import re
from collections.abc import Iterable, Sequence
from typing import Any, get_args

from pydantic import BaseModel

from orchestrator.config.schema import Matrix


class MatrixError(ValueError):
    """A matrix that cannot run; the message names file, field and value."""

    def __init__(self, source: str, field_path: str, message: str) -> None:
        self.source = source
        self.field_path = field_path
        self.detail = message
        # "topologies[2].dcp=3 does not divide tp=8" reads as a sentence; "x.y: unknown key"
        # as a label.
        sep = " " if "=" in field_path else ": "
        where = f"{source}: {field_path}{sep}" if field_path else f"{source}: "
        super().__init__(where + message)


def _is_union_tag(part: Any) -> bool:
    # pydantic adds union-member tags ("list[int]", "literal['divisors']") to the location.
    return isinstance(part, str) and bool(
        re.match(r"^(list|dict|literal|function-\w+|str|int)\b|.*\[", part)
    )


def _loc_to_path(loc: Iterable[Any]) -> str:
    out = ""
    for part in loc:
        if _is_union_tag(part):
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += f".{part}" if out else str(part)
    return out


def _model_of(annotation: Any) -> type[BaseModel] | None:
    """The model inside a field's annotation: ``list[WorkloadSpec]`` -> WorkloadSpec."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        found = _model_of(arg)
        if found is not None:
            return found
    return None


def _mapping_at(raw: Any, loc: Sequence[Any]) -> tuple[type[BaseModel] | None, Any]:
    """The model that validates the mapping at `loc` (a location under Matrix) and the
    mapping the user wrote there."""
    model: type[BaseModel] | None = Matrix
    node = raw
    for part in loc:
        if _is_union_tag(part):
            continue
        if isinstance(part, int):
            node = node[part] if isinstance(node, list) and part < len(node) else None
            continue
        field = model.model_fields.get(part) if model is not None else None
        model = _model_of(field.annotation) if field is not None else None
        node = node.get(part) if isinstance(node, dict) else None
    return model, node


def _unknown_key_message(raw: Any, loc: Sequence[Any]) -> tuple[str, str | None]:
    """``unknown key; did you mean output_tokens?`` for a key no model field is called, and
    the suggested key (a known key of that mapping spelled alike and not given already)."""
    model, mapping = _mapping_at(raw, loc[:-1])
    key = str(loc[-1])
    given = set(mapping) if isinstance(mapping, dict) else set()
    known = [f for f in model.model_fields if f not in given] if model is not None else []
    # 0.6 is difflib's default: it pairs dpc/dcp, topologys/topologies and output_tokne/
    # output_tokens and leaves colour/models unpaired.
    close = difflib.get_close_matches(key.lower(), known, n=1, cutoff=0.6)
    if not close:
        return "unknown key", None
    return f"unknown key; did you mean {close[0]}?", close[0]


def first_error(errors: list[Any], raw: Any) -> tuple[str, str]:
    """The error to report, as (field path, message). A required key reported missing
    because it was misspelled is reported as the misspelling, once: the misspelled key's
    error names both."""
    suggested: dict[tuple[Any, ...], tuple[str, str]] = {}
    for err in errors:
        if err["type"] == "extra_forbidden":
            message, key = _unknown_key_message(raw, err["loc"])
            if key is not None:
                suggested[(*err["loc"][:-1], key)] = (_loc_to_path(err["loc"]), message)
    err = errors[0]
    path = _loc_to_path(err["loc"])
    if err["type"] == "missing" and tuple(err["loc"]) in suggested:
        return suggested[tuple(err["loc"])]
    if err["type"] == "extra_forbidden":
        return path, _unknown_key_message(raw, err["loc"])[0]
    if err["type"] == "missing":
        return path, "is required"
    value = err.get("input")
    msg = err["msg"].removeprefix("Value error, ")
    msg = msg[:1].lower() + msg[1:]
    if isinstance(value, (dict, list)) or value is None:
        return path, msg
    return f"{path}={value!r}:", msg
