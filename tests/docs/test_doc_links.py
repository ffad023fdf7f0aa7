"""The documentation's links and pointers resolve: every relative link of README.md,
CHANGELOG.md and docs/**/*.md names a file (and, with #anchor, a heading) that exists; every
docs/... page named anywhere in the repository exists; the docs index lists every page; the
code pointers of the decision records name files and symbols that exist."""

from __future__ import annotations

import re
import subprocess
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"

# [text](target) and [text]: target; images too. Code spans are removed first, so a link
# quoted as code (`[x](y)`) is not a link.
_INLINE_LINK = re.compile(
    r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)"
)
_REF_LINK = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s|$)", re.M)
_FENCE = re.compile(r"^([ \t]*)(`{3,}|~{3,}).*?^\1\2", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1", re.S)
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.M)
_EXTERNAL = re.compile(r"^[a-z][a-z0-9+.-]*:", re.I)  # https:, mailto:, ...


def documents() -> list[Path]:
    """README.md, CHANGELOG.md and every Markdown file under docs/ (validation runs too)."""
    return [REPO / "README.md", REPO / "CHANGELOG.md", *sorted(DOCS.rglob("*.md"))]


def _strip_code(text: str) -> str:
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> list[str]:
    prose = _strip_code(text)
    return _INLINE_LINK.findall(prose) + _REF_LINK.findall(prose)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: markup dropped, lower case, punctuation but `-` and `_`
    removed, each space a `-`."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


@cache
def anchors(path: Path) -> frozenset[str]:
    """Every heading's anchor in a Markdown file, duplicates numbered as GitHub does."""
    seen: dict[str, int] = {}
    out = set()
    for _, title in _HEADING.findall(_FENCE.sub("", path.read_text(encoding="utf-8"))):
        base = slug(title)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return frozenset(out)


def _shown(path: Path) -> str:
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def broken_links(doc: Path) -> list[str]:
    out = []
    for target in links(doc.read_text(encoding="utf-8")):
        if _EXTERNAL.match(target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (doc.parent / path_part).resolve() if path_part else doc
        where = f"{_shown(doc)}: ({target})"
        if not dest.exists():
            out.append(f"{where}: {path_part} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{where}: no heading #{anchor} in {_shown(dest)}")
    return out


def test_link_finder_and_slugs():
    text = "a [x](b.md) `[not](c.md)` [y](d.md#e-f) ![i](g.png)\n```\n[no](h.md)\n```\n"
    assert links(text) == ["b.md", "d.md#e-f", "g.png"]
    assert slug("`orchestrator nightly MATRIX --history DIR`") == (
        "orchestrator-nightly-matrix---history-dir"
    )
    assert slug("How a failed case's reason reads") == "how-a-failed-cases-reason-reads"
    assert slug("Native MXFP8 `W_UK`") == "native-mxfp8-w_uk"


@pytest.mark.parametrize("doc", documents(), ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(doc: Path):
    assert broken_links(doc) == []


def test_a_broken_link_is_reported(tmp_path: Path):
    page = DOCS / "README.md"
    bad = tmp_path / "page.md"
    bad.write_text(f"[a]({page}#no-such-heading) [b](missing.md) [c]({page}#fusedq)\n")
    found = broken_links(bad)
    assert len(found) == 2, found
    assert "no heading #no-such-heading in docs/README.md" in found[0]
    assert "missing.md does not exist" in found[1]


# --------------------------------------------------------------------------- docs/ named


def tracked_text_files() -> list[Path]:
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True
    ).stdout.split(b"\0")
    suffixes = {".py", ".md", ".yaml", ".yml", ".sh", ".toml", ".txt", ".j2", ".cfg"}
    files = [REPO / n.decode() for n in names if n]
    # Run folders under docs/validation are kept as written, with the paths of their day.
    return [
        f
        for f in files
        if f.suffix in suffixes
        and f.is_file()
        and not f.is_relative_to(DOCS / "validation")
        and f.name != "CHANGELOG.md"  # history names pages that have since moved
    ]


_DOC_PATH = re.compile(r"(?<![\w./-])docs/[\w./-]*?\w\.md\b")


def test_every_docs_page_named_in_the_repository_exists():
    missing = []
    for f in tracked_text_files():
        for name in set(_DOC_PATH.findall(f.read_text(encoding="utf-8", errors="replace"))):
            if not (REPO / name).is_file():
                missing.append(f"{f.relative_to(REPO)}: {name}")
    assert missing == []


def test_the_index_lists_every_page():
    index = DOCS / "README.md"
    listed = {(DOCS / t.partition("#")[0]).resolve() for t in links(index.read_text())}
    pages = [p for p in DOCS.glob("*.md") if p != index]
    pages += [DOCS / "decisions" / "README.md", DOCS / "validation" / "README.md"]
    assert sorted(str(p.relative_to(REPO)) for p in pages if p.resolve() not in listed) == []


def test_the_readme_links_the_index_and_stays_short():
    text = (REPO / "README.md").read_text()
    assert "docs/README.md" in links(text)
    assert len(text.splitlines()) <= 300


# --------------------------------------------------------------------------- decision records

# "Code: `path` (`SYMBOL`, `Class.attr`), `path`." in a record's header.
_CODE_POINTER = re.compile(r"`([\w./-]+\.(?:py|yaml|toml|sh))`(?:\s*\(([^)]*)\))?")


def code_pointers(record: Path) -> list[tuple[str, list[str]]]:
    """(path, symbols) named on the record's `Code:` line (up to the first blank line)."""
    text = record.read_text(encoding="utf-8")
    header = text.split("\n\n", 2)[1] if text.count("\n\n") >= 2 else ""
    if "Code:" not in header:
        return []
    code = header.split("Code:", 1)[1]
    return [
        (path, re.findall(r"`([A-Za-z_][\w.]*)`", symbols or ""))
        for path, symbols in _CODE_POINTER.findall(code)
    ]


def defines(path: Path, symbol: str) -> bool:
    """Whether `path` defines the last part of a dotted `symbol` (def, class, assignment,
    dataclass field; a key of a YAML or TOML file)."""
    name = re.escape(symbol.rsplit(".", 1)[-1])
    if path.suffix in (".yaml", ".toml"):
        pattern = rf"^\s*(?:-\s*)?{name}\s*[:=]"
    else:
        pattern = rf"^\s*(?:def|class)\s+{name}\b|^\s*{name}\s*(?::[^=\n]+)?="
    return re.search(pattern, path.read_text(encoding="utf-8"), re.M) is not None


RECORDS = sorted((DOCS / "decisions").glob("0*.md"))


@pytest.mark.parametrize("record", RECORDS, ids=lambda p: p.name)
def test_decision_records_point_at_code_that_exists(record: Path):
    wrong = []
    for rel, symbols in code_pointers(record):
        path = REPO / rel
        if not path.is_file():
            wrong.append(f"{rel} does not exist")
            continue
        wrong += [f"{rel} defines no {s}" for s in symbols if not defines(path, s)]
    assert wrong == []


def test_every_record_has_code_pointers_read():
    assert sum(bool(code_pointers(r)) for r in RECORDS) >= len(RECORDS) - 2
