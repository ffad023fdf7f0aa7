"""Loading a matrix: YAML text -> --set overrides -> ${ENV} interpolation -> pydantic ->
the rules (`rules`). Everything in the config package is pure (no torch, ray or vllm), so
`orchestrator plan` answers instantly and every rule is unit-testable.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from orchestrator.common import safe_io
from orchestrator.config.errors import MatrixError, first_error
from orchestrator.config.rules import check_matrix
from orchestrator.config.schema import Matrix

_ENV_REF = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)(?::-([^}]*))?\}")


def _interpolate(
    node: Any, path: str, env: Mapping[str, str], source: str, unresolved: list[str] | None
) -> Any:
    """Replace ${VAR} / ${VAR:-default}; an unset VAR is an error, or kept as text for `plan`."""
    if isinstance(node, dict):
        return {
            k: _interpolate(v, f"{path}.{k}" if path else str(k), env, source, unresolved)
            for k, v in node.items()
        }
    if isinstance(node, list):
        return [
            _interpolate(v, f"{path}[{i}]", env, source, unresolved) for i, v in enumerate(node)
        ]
    if isinstance(node, str):

        def sub(m: re.Match[str]) -> str:
            name, default = m.group(1), m.group(2)
            if name in env:
                return env[name]
            if default is not None:
                return default
            if unresolved is not None:
                unresolved.append(f"{path}: ${{{name}}} is not set")
                return m.group(0)
            raise MatrixError(source, path, f"environment variable ${{{name}}} is not set")

        return _ENV_REF.sub(sub, node)
    return node


def _apply_set(raw: dict[str, Any], assignment: str, source: str) -> None:
    """Apply one ``--set a.b[0].c=value`` (value parsed as a YAML scalar) to the raw document."""
    if "=" not in assignment:
        raise MatrixError(source, "--set", f"{assignment!r} is not key=value")
    key, value_text = assignment.split("=", 1)
    tokens = re.findall(r"[^.\[\]]+|\[\d+\]", key)
    if not tokens:
        raise MatrixError(source, "--set", f"{assignment!r} names no key")
    node: Any = raw
    walked = ""
    for i, tok in enumerate(tokens):
        last = i == len(tokens) - 1
        index: int | str = int(tok.strip("[]")) if tok.startswith("[") or tok.isdigit() else tok
        walked += (
            f"[{index}]" if isinstance(index, int) else (f".{index}" if walked else str(index))
        )
        if isinstance(index, int):
            if not isinstance(node, list) or index >= len(node):
                raise MatrixError(source, f"--set {key}", f"{walked} does not exist")
        elif not isinstance(node, dict):
            raise MatrixError(source, f"--set {key}", f"{walked} is not a mapping")
        if last:
            try:
                value = yaml.safe_load(value_text) if value_text else ""
            except yaml.YAMLError:
                value = value_text
            node[index] = value
        else:
            if isinstance(index, str) and index not in node:
                node[index] = {}
            node = node[index]


def parse_matrix(
    text: str,
    source: str = "<matrix>",
    *,
    sets: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    unresolved: list[str] | None = None,
) -> Matrix:
    """Parse and validate matrix YAML text; raise `MatrixError` naming source, field and value.

    With `unresolved` given (a list), unset ${VAR}s are left in place and described there
    instead of raising: `plan` shows a matrix whose model paths the user has not supplied yet.
    """
    env = os.environ if env is None else env
    try:
        raw = safe_io.load_yaml(text, source)
    except safe_io.UnsafeFileError as exc:
        raise MatrixError(source, "", exc.reason) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "YAML"
        problem = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        raise MatrixError(source, "", f"invalid YAML at {where}: {problem}") from None
    if raw is None:
        lines = [ln.strip() for ln in text.splitlines()]
        content = [ln for ln in lines if ln and not ln.startswith("#")]
        detail = (
            f" (its YAML is null: {content[0][:40]!r})"
            if content
            else " (only comments)"
            if any(lines)
            else ""
        )
        raise MatrixError(
            source, "", f"the file is empty{detail}; a matrix is a YAML mapping (see matrices/)"
        )
    if not isinstance(raw, dict):
        raise MatrixError(source, "", f"a matrix is a YAML mapping, got {type(raw).__name__}")
    for assignment in sets:
        _apply_set(raw, assignment, source)
    raw = _interpolate(raw, "", env, source, unresolved)
    try:
        matrix = Matrix.model_validate(raw)
    except ValidationError as exc:
        raise MatrixError(source, *first_error(exc.errors(), raw)) from None
    check_matrix(matrix, source)
    return matrix


def load_matrix(
    path: str | Path,
    *,
    sets: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    unresolved: list[str] | None = None,
) -> Matrix:
    """Read, parse and validate a matrix file."""
    try:
        text = safe_io.read_text(Path(path), safe_io.MAX_YAML_BYTES)
    except FileNotFoundError:
        raise MatrixError(str(path), "", "no such file") from None
    except safe_io.UnsafeFileError as exc:
        raise MatrixError(str(path), "", exc.reason) from None
    except OSError as exc:
        raise MatrixError(str(path), "", f"cannot read: {exc}") from None
    return parse_matrix(text, str(path), sets=sets, env=env, unresolved=unresolved)
