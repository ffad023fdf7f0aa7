"""docs/matrix.md is the full matrix reference: every key the matrix models accept, every
choice of a key with fixed values, and every built-in model path is named there, and the
shipped matrices it lists are the ones in matrices/."""

from __future__ import annotations

import re
import typing
from pathlib import Path

from pydantic import BaseModel

from orchestrator.config.schema import Matrix
from orchestrator.models import standins, tinymodel

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "matrix.md"


def models(root: type[BaseModel] = Matrix) -> dict[str, type[BaseModel]]:
    """Every pydantic model a matrix is made of, by its path in the YAML (``""`` the top
    level, ``models[]``, ``ab``, ``variants[].expect[]``, ...)."""
    found: dict[str, type[BaseModel]] = {}

    def walk(model: type[BaseModel], where: str) -> None:
        found[where] = model
        for name, field in model.model_fields.items():
            for inner, is_list in _inner_models(field.annotation):
                walk(inner, f"{where}.{name}{'[]' if is_list else ''}".lstrip("."))

    walk(root, "")
    return found


def _inner_models(annotation: object, in_list: bool = False) -> list[tuple[type, bool]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [(annotation, in_list)]
    is_list = typing.get_origin(annotation) is list
    return [
        found
        for arg in typing.get_args(annotation)
        for found in _inner_models(arg, in_list or is_list)
    ]


def literal_choices(annotation: object) -> list[str]:
    if typing.get_origin(annotation) is typing.Literal:
        return [str(v) for v in typing.get_args(annotation)]
    return [c for arg in typing.get_args(annotation) for c in literal_choices(arg)]


def mentioned(text: str, word: str) -> bool:
    """`word` as inline code, alone or as the start of a code span (`host: node`)."""
    return re.search(rf"`{re.escape(word)}(?:[`:=\s\[]|$)", text) is not None


def test_the_walk_finds_every_block():
    found = models()
    for where in ("", "models[]", "engine", "topologies[]", "workloads[]", "variants[]",
                  "variants[].expect[]", "timeouts", "audit", "audit.expect[]", "profile",
                  "ab", "ray", "resources"):  # fmt: skip
        assert where in found, where


def test_every_matrix_key_is_in_the_reference():
    text = REFERENCE.read_text(encoding="utf-8")
    missing = [
        f"{where or '<top level>'}: {name}"
        for where, model in models().items()
        for name in model.model_fields
        if not mentioned(text, name)
    ]
    assert missing == [], "add these keys to docs/matrix.md"


def test_every_choice_of_a_fixed_value_key_is_in_the_reference():
    text = REFERENCE.read_text(encoding="utf-8")
    missing = [
        f"{where}.{name}: {choice}".lstrip(".")
        for where, model in models().items()
        for name, field in model.model_fields.items()
        for choice in literal_choices(field.annotation)
        if not mentioned(text, choice)
    ]
    assert missing == []


def test_every_builtin_model_is_in_the_reference():
    text = REFERENCE.read_text(encoding="utf-8")
    names = [*tinymodel.BUILTINS, *standins.STANDINS]
    assert [n for n in names if f"builtin:{n}" not in text] == []


def test_the_shipped_matrices_are_listed():
    text = REFERENCE.read_text(encoding="utf-8")
    shipped = sorted(p.name for p in (REPO / "matrices").glob("*.yaml"))
    assert [n for n in shipped if n not in text] == []


def test_a_missing_key_is_caught():
    assert not mentioned("`compile_caches` and `ab`", "compile_cache")
    assert mentioned("`host: node` binds", "host")
    assert mentioned("`ab`", "ab") and not mentioned("`abba`", "ab")
