"""The fault catalogue (orchestrator/audit/signatures.yaml, orchestrator.audit.catalogue): it
loads, every fault line and every branch of every pattern holds one of its signature's needles,
and a malformed entry is named with its key."""

from __future__ import annotations

import shutil
import subprocess

import pytest
from audit_cases import FAULT_LINES, PREFILTERS

from orchestrator import audit
from orchestrator.audit import CatalogueError, load_catalogue


def test_catalogue_loads_with_version_and_every_category_listed():
    cat = load_catalogue()
    assert isinstance(cat.version, int) and cat.version >= 1
    assert {s.category for s in cat.signatures} <= set(cat.categories)
    # The seeds' sentence words are all categories the audit searches.
    for word in [
        "traceback",
        "Xid",
        "illegal-memory-access",
        "CUBLAS_STATUS",
        "FAULT_PDE",
        "invalid-layout",
        "engine-initialization",
    ]:
        assert word in cat.categories


@pytest.mark.parametrize("expected,line", FAULT_LINES, ids=[f[0] for f in FAULT_LINES])
def test_every_fault_line_holds_a_needle_and_matches_the_grep_pattern(expected, line):
    cat = load_catalogue()
    assert any(n in line for n in cat.needles), "the prefilter would never look at this line"
    for item in expected.split(","):
        sig = cat.signature(item.split(":")[0])
        assert any(n in line for n in sig.needles), f"{sig.id}: none of {sig.needles} in line"
    if shutil.which("grep"):
        # The same pattern string is valid POSIX ERE and matches the same line in grep.
        proc = subprocess.run(
            ["grep", "-E", "-c", cat.grep_pattern()],
            input=line.encode(),
            capture_output=True,
            check=False,
        )
        assert proc.stdout.strip() == b"1", proc.stderr


def _branch_lines(pattern: str) -> list[str]:
    """Lines drawn from every branch of an ERE pattern: each alternative and optional part
    taken both ways, small character classes ([Ii], [ _-]) member by member, larger ones by
    their first and last member, repeats once and twice (the same draw repeated)."""
    try:
        from re import _constants as c  # Python >= 3.11
        from re import _parser as parser
    except ImportError:  # pragma: no cover - Python 3.10
        import sre_constants as c  # type: ignore[no-redef]
        import sre_parse as parser  # type: ignore[no-redef]

    def members(items) -> list[str]:
        chars: list[str] = []
        for op, av in items:
            if op is c.LITERAL:
                chars.append(chr(av))
            elif op is c.RANGE:
                chars += [chr(av[0]), chr(av[1])]
            elif op is c.NEGATE:
                return ["x"]  # [^ ]: any ordinary character
            else:
                raise AssertionError(f"{pattern!r}: {op} is not POSIX ERE")
        return chars if len(chars) <= 4 else [chars[0], chars[-1]]

    def draw(seq) -> list[str]:
        out = [""]
        for op, av in seq:
            if op is c.LITERAL:
                alts = [chr(av)]
            elif op is c.NOT_LITERAL or op is c.ANY:
                alts = ["x"]
            elif op is c.IN:
                alts = members(av)
            elif op is c.BRANCH:
                alts = [s for branch in av[1] for s in draw(branch)]
            elif op is c.SUBPATTERN:
                alts = draw(av[-1])
            elif op in (c.MAX_REPEAT, c.MIN_REPEAT):
                lo, hi, item = av
                counts = sorted({lo, min(max(lo, 1) + 1, hi)})
                alts = [s * n for s in draw(item) for n in counts]
            else:
                raise AssertionError(f"{pattern!r}: {op} is not POSIX ERE")
            out = [a + b for a in out for b in alts]
        return out

    return draw(parser.parse(pattern))


def test_every_branch_of_every_signature_holds_a_needle_and_passes_both_prefilters(tmp_path):
    # The needles are hand-written beside the patterns; one missing spelling would make the
    # audit blind to that fault. Every branch of every pattern is drawn and must hold one of
    # its signature's needles, and each prefilter must name every such line as a candidate.
    cat = load_catalogue()
    lines: list[str] = []
    for sig in cat.signatures:
        drawn = _branch_lines(sig.pattern)
        assert 0 < len(drawn) < 5000, sig.id
        for text in drawn:
            assert sig.regex.search(text), f"{sig.id}: the draw {text!r} does not match"
            assert any(n in text for n in sig.needles), f"{sig.id}: no needle in {text!r}"
        lines += [f"(Worker_TP1 pid=7) ERROR 11-29 14:03:12 [x.py:1] {t}" for t in drawn]
    block = "".join(f"{line}\n" for line in lines).encode()
    starts = [0]
    for line in lines[:-1]:
        starts.append(starts[-1] + len(line.encode()) + 1)
    for kind in PREFILTERS:
        found = set(audit.make_prefilter(cat, kind).block_finder()(0, block))
        missed = [lines[i] for i, s in enumerate(starts) if s not in found]
        assert not missed, f"prefilter {kind} let {len(missed)} through: {missed[:3]}"


@pytest.mark.parametrize(
    "mutate,message",
    [
        (lambda d: d["signatures"][0].update(severity="bad"), "severity 'bad' is not one of"),
        (lambda d: d["signatures"][0].update(colour="red"), "unknown key 'colour'"),
        (lambda d: d["signatures"][1].update(category="nope"), "category 'nope' is not in"),
        (lambda d: d["signatures"][2].update(pattern="("), "is not a valid regex"),
        (lambda d: d["signatures"][3].update(id="xid"), "signature id 'xid' appears twice"),
        (lambda d: d["signatures"][0].update(needles=[]), "needles must be a non-empty list"),
        (lambda d: d.update(version="one"), "version must be an integer"),
    ],
)
def test_malformed_catalogue_errors_name_entry_and_key(tmp_path, mutate, message):
    import yaml

    data = yaml.safe_load(audit.CATALOGUE_PATH.read_text())
    mutate(data)
    p = tmp_path / "sig.yaml"
    p.write_text(yaml.safe_dump(data))
    with pytest.raises(CatalogueError, match=message) as exc:
        load_catalogue(p)
    assert str(p) in str(exc.value)
