"""The fault catalogue: signatures.yaml loaded and checked, entry by entry.

Each signature is an ERE pattern with the literal ``needles`` that every line it matches
must hold (the prefilter's fast path), a severity (refined by ``rules`` on fields the
``fields`` regex extracts or on the line), what a match means and what to do. Checked by
hand rather than by pydantic, on purpose: the audit imports nothing heavy (see
orchestrator.audit.findings); every error still names the entry and the key.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from pathlib import Path
from typing import Any, Literal

import yaml

from orchestrator.audit.severity import Severity

CATALOGUE_PATH = Path(__file__).resolve().parent / "signatures.yaml"


class CatalogueError(ValueError):
    """signatures.yaml is malformed; the message names the entry and the key."""


@dataclass(frozen=True)
class SeverityRule:
    """One refinement of a signature's severity; every condition given must hold."""

    severity: Severity
    field: str | None = None
    values: frozenset[str] = frozenset()
    line: re.Pattern[str] | None = None

    def applies(self, fields: Mapping[str, str], text: str) -> bool:
        if self.field is not None and fields.get(self.field) not in self.values:
            return False
        return not (self.line is not None and not self.line.search(text))


@dataclass(frozen=True)
class Signature:
    """A fault signature: an ERE pattern plus what a match means and what to do."""

    id: str
    category: str
    pattern: str
    needles: tuple[str, ...]
    severity: Severity
    meaning: str
    action: str
    family: str | None = None
    fields: re.Pattern[str] | None = None
    ignore: re.Pattern[str] | None = None
    rules: tuple[SeverityRule, ...] = ()
    names: Mapping[str, str] = field(default_factory=dict)

    @cached_property
    def regex(self) -> re.Pattern[str]:
        return re.compile(self.pattern)

    def search(self, text: str) -> re.Match[str] | None:
        """First match in ``text`` that the ``ignore`` regex does not cover."""
        for m in self.regex.finditer(text):
            if self.ignore is None or not self.ignore.match(text, m.start()):
                return m
        return None

    def classify(self, text: str, m: re.Match[str]) -> tuple[Severity, dict[str, str], str]:
        """Severity, extracted fields and meaning of a match on ``text``."""
        fields: dict[str, str] = {}
        if self.fields is not None:
            fm = self.fields.search(text, max(0, m.start() - 8))
            if fm:
                fields = {k: v for k, v in fm.groupdict().items() if v is not None}
        severity = self.severity
        for rule in self.rules:
            if rule.applies(fields, text):
                severity = rule.severity
                break
        meaning = self.meaning
        for value in fields.values():
            if value in self.names:
                meaning = f"{meaning} {self.category} {value}: {self.names[value]}."
                break
        return severity, fields, meaning


@dataclass(frozen=True)
class GpuStateCheck:
    """A check on one ``nvidia-smi -q`` value (ECC counters, row-remapper flags)."""

    id: str
    category: str
    key: re.Pattern[str]
    when: Literal["nonzero", "yes"]
    severity: Severity
    meaning: str
    action: str

    def fires(self, value: str) -> bool:
        value = value.strip()
        if self.when == "yes":
            return value.lower() == "yes"
        return value.isdigit() and int(value) > 0


@dataclass(frozen=True)
class Catalogue:
    """The loaded signature catalogue (``signatures.yaml``)."""

    version: int
    signatures: tuple[Signature, ...]
    categories: tuple[str, ...]
    request_echo: tuple[re.Pattern[str], ...]
    gpu_state: tuple[GpuStateCheck, ...]
    source: str

    @cached_property
    def needles(self) -> tuple[str, ...]:
        """Distinct needles, dropping any that contains a shorter one (it adds no lines)."""
        every = sorted({n for s in self.signatures for n in s.needles}, key=len)
        kept: list[str] = []
        for n in every:
            if not any(k in n for k in kept):
                kept.append(n)
        return tuple(kept)

    @cached_property
    def needle_bytes(self) -> tuple[bytes, ...]:
        return tuple(n.encode() for n in self.needles)

    @cached_property
    def needle_index(self) -> tuple[tuple[str, frozenset[int]], ...]:
        """Each signature needle -> positions of the signatures that list it."""
        index: dict[str, set[int]] = {}
        for i, sig in enumerate(self.signatures):
            for n in sig.needles:
                index.setdefault(n, set()).add(i)
        return tuple((n, frozenset(ix)) for n, ix in index.items())

    def grep_pattern(self) -> str:
        """The same alternation as POSIX ERE, for ``grep -E`` (the benchmark's baseline)."""
        return "|".join(f"({s.pattern})" for s in self.signatures)

    def signature(self, sig_id: str) -> Signature:
        for s in self.signatures:
            if s.id == sig_id:
                return s
        raise KeyError(sig_id)

    def is_request_echo(self, text: str) -> bool:
        return any(r.search(text) for r in self.request_echo)


_SIGNATURE_KEYS = {
    "id",
    "category",
    "pattern",
    "needles",
    "severity",
    "meaning",
    "action",
    "family",
    "fields",
    "ignore",
    "rules",
    "names",
}
_RULE_KEYS = {"field", "values", "line", "severity"}
_GPU_KEYS = {"id", "category", "key", "when", "severity", "meaning", "action"}


def _check_keys(where: str, entry: Any, allowed: set[str], required: set[str]) -> None:
    if not isinstance(entry, dict):
        raise CatalogueError(f"{where}: expected a mapping, got {type(entry).__name__}")
    unknown = sorted(set(entry) - allowed)
    if unknown:
        raise CatalogueError(f"{where}: unknown key {unknown[0]!r} (allowed: {sorted(allowed)})")
    missing = sorted(required - set(entry))
    if missing:
        raise CatalogueError(f"{where}: missing key {missing[0]!r}")


def _severity(where: str, value: Any) -> Severity:
    try:
        return Severity(value)
    except ValueError:
        known = ", ".join(s.value for s in Severity)
        raise CatalogueError(f"{where}: severity {value!r} is not one of {known}") from None


def _regex(where: str, value: Any) -> re.Pattern[str]:
    try:
        return re.compile(str(value))
    except re.error as exc:
        raise CatalogueError(f"{where}: {value!r} is not a valid regex: {exc}") from exc


def _parse_signature(where: str, raw: Any, categories: Sequence[str]) -> Signature:
    _check_keys(where, raw, _SIGNATURE_KEYS, {"id", "category", "pattern", "needles", "severity"})
    where = f"{where} (id={raw['id']})"
    if raw["category"] not in categories:
        raise CatalogueError(f"{where}: category {raw['category']!r} is not in `categories`")
    needles = raw["needles"]
    if (
        not isinstance(needles, list)
        or not needles
        or not all(isinstance(n, str) and n for n in needles)
    ):
        raise CatalogueError(f"{where}: needles must be a non-empty list of strings")
    rules = []
    for j, rr in enumerate(raw.get("rules") or []):
        rwhere = f"{where}.rules[{j}]"
        _check_keys(rwhere, rr, _RULE_KEYS, {"severity"})
        rules.append(
            SeverityRule(
                severity=_severity(rwhere, rr["severity"]),
                field=rr.get("field"),
                values=frozenset(str(v) for v in rr.get("values") or ()),
                line=_regex(rwhere, rr["line"]) if "line" in rr else None,
            )
        )
    sig = Signature(
        id=str(raw["id"]),
        category=str(raw["category"]),
        pattern=str(raw["pattern"]),
        needles=tuple(needles),
        severity=_severity(where, raw["severity"]),
        meaning=str(raw.get("meaning", "")).strip(),
        action=str(raw.get("action", "")).strip(),
        family=raw.get("family"),
        fields=_regex(where, raw["fields"]) if "fields" in raw else None,
        ignore=_regex(where, raw["ignore"]) if "ignore" in raw else None,
        rules=tuple(rules),
        names={str(k): str(v) for k, v in (raw.get("names") or {}).items()},
    )
    _regex(where, sig.pattern)
    return sig


def _parse_catalogue(data: Any, source: str) -> Catalogue:
    _check_keys(
        source,
        data,
        {"version", "categories", "request_echo", "signatures", "gpu_state"},
        {"version", "categories", "signatures"},
    )
    if not isinstance(data["version"], int):
        raise CatalogueError(f"{source}: version must be an integer, got {data['version']!r}")
    categories = tuple(str(c) for c in data["categories"])
    signatures = tuple(
        _parse_signature(f"{source}: signatures[{i}]", raw, categories)
        for i, raw in enumerate(data["signatures"])
    )
    ids = [s.id for s in signatures]
    dupes = sorted({i for i in ids if ids.count(i) > 1})
    if dupes:
        raise CatalogueError(f"{source}: signature id {dupes[0]!r} appears twice")
    gpu_checks = []
    for i, raw in enumerate(data.get("gpu_state") or []):
        where = f"{source}: gpu_state[{i}]"
        _check_keys(where, raw, _GPU_KEYS, _GPU_KEYS - {"meaning", "action"})
        if raw["when"] not in ("nonzero", "yes"):
            raise CatalogueError(f"{where}: when {raw['when']!r} is not one of nonzero, yes")
        gpu_checks.append(
            GpuStateCheck(
                id=str(raw["id"]),
                category=str(raw["category"]),
                key=_regex(where, raw["key"]),
                when=raw["when"],
                severity=_severity(where, raw["severity"]),
                meaning=str(raw.get("meaning", "")),
                action=str(raw.get("action", "")),
            )
        )
    return Catalogue(
        version=data["version"],
        signatures=signatures,
        categories=categories,
        request_echo=tuple(
            _regex(f"{source}: request_echo", p) for p in data.get("request_echo") or ()
        ),
        gpu_state=tuple(gpu_checks),
        source=source,
    )


def load_catalogue(path: Path | str | None = None) -> Catalogue:
    """Load and validate the signature catalogue (the packaged one by default)."""
    if path is None:
        return _default_catalogue()
    return _load(Path(path))


@lru_cache(maxsize=1)
def _default_catalogue() -> Catalogue:
    return _load(CATALOGUE_PATH)


def _load(path: Path) -> Catalogue:
    try:
        # The C loader when PyYAML has it: the pure-Python one costs ~0.3 s per CLI call.
        loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=loader)
    except OSError as exc:
        raise CatalogueError(f"{path}: cannot read the catalogue: {exc}") from exc
    except yaml.YAMLError as exc:
        raise CatalogueError(f"{path}: not valid YAML: {exc}") from exc
    return _parse_catalogue(data, str(path))
