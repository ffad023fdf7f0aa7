"""report.html: content, escaping of log text, self-containment, and a real headless Chromium.

The Chromium test renders the page with a planted Xid (markup and '&' in its text), a
regression from a comparison and a three-run trend, checks the console for script errors and
the parsed DOM for injected elements, and saves a screenshot under the test's tmp dir and at
logs/test-artifacts/report-screenshot.png. It is skipped where Debian's `chromium` is absent.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from pathlib import Path

import pytest

from orchestrator.analysis.compare import compare_runs
from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix
from orchestrator.reports import write_reports
from orchestrator.reports.html import render_html, write_html
from orchestrator.results.recorded_run import Run
from orchestrator.results.store import RunStore

REPO = Path(__file__).resolve().parents[3]
ARTIFACT = REPO / "logs" / "test-artifacts" / "report-screenshot.png"
_spec = importlib.util.spec_from_file_location(
    "recorded_runs", Path(__file__).parents[1] / "fixtures" / "runs" / "make_fixtures.py"
)
runs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(runs)

CASE = "Luke BF16/tp8-dcp2-mtp0/fused"
EVIL_REASON = 'server exited: <img src=x onerror="alert(2)"> & </pre></body>'


def _svgs(page: str) -> list[ET.Element]:
    """Every inline chart, parsed as XML: a stray quote or '&' in a label would fail here."""
    return [ET.fromstring(s) for s in re.findall(r"<svg .*?</svg>", page, flags=re.S)]


class _Tags(HTMLParser):
    """Every element and attribute name of a page, as a browser's tokenizer sees them."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()
        self.attrs: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.seen.add(tag)
        self.attrs.update(name for name, _ in attrs)


@pytest.fixture
def nightly_like(tmp_path):
    """Three runs of seed-tp8; the last has a 5% ctx0 regression, an Xid and a failed case."""
    history = [
        runs.copy_run(tmp_path, f"n{i}", created_at=f"2026-11-2{i}T02:00:00+00:00") for i in (5, 6)
    ]
    runs.edit_rows(history[0], lambda r: runs.scale(r, "ctx0", 0.98))
    cur = runs.copy_run(tmp_path, "n7", created_at="2026-11-27T02:00:00+00:00")

    def edit(r):
        if r["case_id"] == CASE:
            return runs.plant(runs.scale(r, "ctx0", 0.95), runs.XID_FINDING)
        if r["case_id"] == "Luke BF16/tp8-dcp4-mtp3/staged":
            r.update(status="failed", reason=EVIL_REASON)
        return r

    runs.edit_rows(cur, edit)
    return Run.load(cur), [Run.load(h) for h in history], compare_runs(history[1], cur)


def test_tables_and_charts(tmp_path):
    page = render_html(
        Run.load(runs.copy_run(tmp_path, "r", created_at="2026-11-28T02:00:00+00:00"))
    )
    assert page.startswith("<!DOCTYPE html>")
    head = "<th class=l>Model</th><th>TP</th><th>DCP</th><th>MTP</th><th>Variant</th>"
    assert head + "<th>ctx0</th><th>ctx64k</th><th>Errors</th><th>Status</th>" in page
    assert "<td class=l>Luke BF16</td><td>8</td><td>1</td><td>0</td><td>fused</td>" in page
    assert "<td>87.63</td><td>-</td>" in page  # TP8/DCP1 has no ctx64k figure, as in the seeds
    assert "ctx0: aggregate output tok/s per topology" in page
    assert "ctx64k: aggregate output tok/s per topology" in page
    assert "fused vs staged: aggregate tok/s delta" in page
    charts = _svgs(page)
    assert len(charts) == 3  # ctx0, ctx64k, variant deltas; no trend without a history
    bars = [r for r in charts[0].iter("{http://www.w3.org/2000/svg}rect")]
    assert len(bars) == 10  # one bar per case
    assert "Trend over" not in page
    # The recorded NCCL WARN and its context lines
    assert "NCCL WARN NET/Socket : peer 10.0.0.7&lt;41234&gt;" in page
    assert "custom_all_reduce.py:203 ok" in page


def test_single_variant_has_no_delta_chart(tmp_path):
    m = parse_matrix(
        "name: one\nmodels: [{label: M, path: /m, num_heads: 8}]\ntopologies: [{tp: 1}]\n"
        "workloads: [{name: ctx0, prompt_tokens: 1, output_tokens: 4}]\n",
        "one.yaml",
    )
    store = RunStore.create(tmp_path, "one")
    store.write_manifest({"run_id": "one", "matrix": m.model_dump(mode="json"),
                          "cases": [c.to_dict() for c in expand(m)]})  # fmt: skip
    page = render_html(Run.load(store))  # no results yet: an interrupted run still renders
    assert "incomplete" in page and "Paired variants" not in page
    assert "No case has finished yet." in page and not _svgs(page)


def test_log_text_is_escaped_and_page_is_self_contained(nightly_like):
    store, history, cmp = nightly_like
    page = render_html(store, history=history, comparison=cmp)
    # Not one tag from a log line or a reason reaches the page as markup.
    assert "<script" not in page and "<img" not in page and "</pre></body>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt; &amp; more" in page
    assert "decode step 812 &lt;ok&gt; &amp; fine" in page  # context lines too
    assert "&lt;img src=x onerror=&#34;alert(2)&#34;&gt; &amp; &lt;/pre&gt;" in page
    # Self-contained: no element that fetches or runs anything, no attribute that points
    # elsewhere, no CSS import (the SVG namespace is a name, not a fetch).
    tags = _Tags()
    tags.feed(page)
    assert not tags.seen & {"script", "link", "img", "iframe", "object", "embed"}, tags.seen
    assert not tags.attrs & {"src", "href", "xlink:href", "srcset", "onerror", "onload"}
    assert "@import" not in page and "url(" not in page
    assert set(re.findall(r"https?://[^\s\"'<]+", page)) == {"http://www.w3.org/2000/svg"}
    assert len(_svgs(page)) == 5  # ctx0, ctx64k, deltas, trend ctx0, trend ctx64k


def test_trend_and_comparison(nightly_like):
    store, history, cmp = nightly_like
    page = render_html(store, history=history, comparison=cmp)
    assert "Trend over 3 runs" in page
    assert "2026-11-25 02:00" in page and "2026-11-27 02:00" in page
    assert "Comparison with n6" in page and "REGRESSION" in page
    assert "ctx0 aggregate tok/s 73.39 → 69.72 (-5.00%" in page
    assert "New findings" in page
    # The current run is added once even when the caller's history already holds it.
    assert "Trend over 3 runs" in render_html(store, history=[*history, store])


def test_write_reports_also_writes_html_and_junit(tmp_path):
    store = RunStore(runs.copy_run(tmp_path, "r", created_at="2026-11-28T02:00:00+00:00"))
    write_reports(store)
    assert (store.root / "report.html").read_text().startswith("<!DOCTYPE html>")
    assert ET.parse(store.root / "junit.xml").getroot().get("tests") == "10"


# --------------------------------------------------------------------------- Chromium


def _chromium() -> str:
    exe = shutil.which("chromium") or shutil.which("chromium-browser")
    if exe is None:
        pytest.skip("chromium is not installed (Debian: apt-get install -y chromium)")
    return exe


def _run_chromium(exe: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    # Flags keep headless Chromium off the network and out of first-run/update work, so the
    # test is offline and deterministic; --no-sandbox because CI containers run as root, and
    # --disable-dev-shm-usage because Docker's 64 MiB /dev/shm crashes its renderer.
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-dev-shm-usage",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
    ]
    return subprocess.run([exe, *flags, *args], capture_output=True, text=True, timeout=120)


# Chromium logs page console messages as `CONSOLE(…)`/`Console` lines; an uncaught exception
# prints "Uncaught". Its own D-Bus and GPU start-up noise is not a page error.
_SCRIPT_ERROR_RE = re.compile(r"Uncaught|CONSOLE\(\d+\)|:CONSOLE:|console\.error", re.I)


def test_chromium_detector_sees_script_errors(tmp_path):
    """The console check below is not blind: a page that throws is caught."""
    exe = _chromium()
    bad = tmp_path / "bad.html"
    bad.write_text("<!DOCTYPE html><p>x</p><script>undefinedFunction()</script>")
    out = _run_chromium(exe, tmp_path / "profile", "--dump-dom", bad.as_uri())
    assert _SCRIPT_ERROR_RE.search(out.stderr), out.stderr[-2000:]


def test_html_opens_in_headless_chromium(tmp_path, nightly_like):
    exe = _chromium()
    store, history, cmp = nightly_like
    page_path = write_html(store, history=history, comparison=cmp)
    shot = tmp_path / "report-screenshot.png"
    out = _run_chromium(
        exe,
        tmp_path / "profile",
        f"--screenshot={shot}",
        "--window-size=1400,2000",
        page_path.as_uri(),
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert not _SCRIPT_ERROR_RE.search(out.stderr), out.stderr[-2000:]
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 20_000
    ARTIFACT.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, ARTIFACT)

    dom = _run_chromium(exe, tmp_path / "profile", "--dump-dom", page_path.as_uri())
    assert dom.returncode == 0, dom.stderr[-2000:]
    assert not _SCRIPT_ERROR_RE.search(dom.stderr), dom.stderr[-2000:]
    # The page parsed whole (the findings at its end are there) and the planted markup stayed
    # text: no <script> or <img> element exists in the DOM Chromium built.
    assert "Log audit" in dom.stdout and dom.stdout.count("<svg") == 5
    assert "<script" not in dom.stdout and "<img" not in dom.stdout
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in dom.stdout
