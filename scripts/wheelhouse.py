#!/usr/bin/env python3
"""Air-gapped install of the GPU stack: build a wheelhouse where an index is reachable, install
from it where none is.

    python scripts/wheelhouse.py build   [--requirements FILE] [--python 3.12] [--out DIR]
                                         [--platform TAG ...] [--split 60M]
    python scripts/wheelhouse.py install DIR|CHUNK... [--target DIR] [--project]

``build`` downloads exactly the pinned wheels of ``requirements/gpu-vllm026.txt`` (no
dependency resolution: the file *is* the closure over the base it names) for the given Python
and platform, checks that every pin got exactly one wheel, adds the project's own wheel
(fusedq + orchestrator, stamped with the commit it was built from: fusedq.provenance),
and writes ``SHA256SUMS`` and ``wheelhouse.json``. It needs no torch (``fusedq.provenance``
imports none), so any Python with pip and an index builds it. ``--split`` also
writes the whole as tar chunks of at most that size (``DIR.tar.part.00``, ...) for carriers
that take one bounded file at a time (e.g. 60 MiB per transfer).

``install`` takes the directory or the chunks, verifies every checksum and the Python version,
and runs ``pip install --no-index --no-deps`` of every wheel (into ``--target`` when given,
else the running environment). Nothing is fetched; a missing or altered wheel stops the install
before pip runs, naming it.

Each pip step prints one line (what it did, how many wheels, how long); pip's own output is
kept back unless it fails, and then its last lines are shown.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import platform
import re
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]
DEFAULT_REQUIREMENTS = REPO / "requirements" / "gpu-vllm026.txt"
# manylinux tags a glibc 2.31+ x86_64 host runs; pip matches each tag exactly, so name them all.
DEFAULT_PLATFORMS = [
    "manylinux_2_17_x86_64", "manylinux_2_24_x86_64", "manylinux_2_26_x86_64",
    "manylinux_2_27_x86_64", "manylinux_2_28_x86_64", "manylinux_2_31_x86_64",
    "manylinux2014_x86_64", "any",
]  # fmt: skip
SUMS = "SHA256SUMS"
META = "wheelhouse.json"
# pip's last lines shown when it fails: its error and what led to it, not the whole log.
TAIL_LINES = 30
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9.+!_-]+)$")


class WheelhouseError(RuntimeError):
    """What is wrong, named; the command exits 2."""


def norm(name: str) -> str:
    """PEP 503 name as wheel file names carry it (dashes become underscores there)."""
    return re.sub(r"[-_.]+", "_", name).lower()


def read_pins(path: Path) -> dict[str, str]:
    """``name==version`` lines (comments and blanks skipped); anything else is an error."""
    if not path.is_file():
        raise WheelhouseError(f"{path}: no such requirements file")
    pins: dict[str, str] = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        m = PIN.match(line)
        if not m:
            raise WheelhouseError(f"{path}:{n}: {line!r} is not an exact pin (name==version)")
        key = norm(m[1])
        if key in pins:
            raise WheelhouseError(f"{path}:{n}: {m[1]} is pinned twice")
        pins[key] = m[2]
    return pins


def wheel_key(filename: str) -> tuple[str, str]:
    """(normalised name, version) from a wheel's file name."""
    parts = filename[: -len(".whl")].split("-")
    if not filename.endswith(".whl") or len(parts) < 5:
        raise WheelhouseError(f"{filename}: not a wheel file name")
    return norm(parts[0]), parts[1]


def check_complete(pins: dict[str, str], wheels: list[Path]) -> None:
    """Every pin has exactly one wheel at its version; nothing else is there."""
    found: dict[str, list[str]] = {}
    for w in wheels:
        name, version = wheel_key(w.name)
        found.setdefault(name, []).append(version)
    missing = [f"{n}=={v}" for n, v in pins.items() if n not in found]
    wrong = [
        f"{n} {found[n]} (pinned {v})" for n, v in pins.items() if n in found and found[n] != [v]
    ]
    extra = sorted(set(found) - set(pins))
    problems = []
    if missing:
        problems.append(f"no wheel for {', '.join(missing)}")
    if wrong:
        problems.append(f"wrong or several versions: {'; '.join(wrong)}")
    if extra:
        problems.append(f"wheels not pinned: {', '.join(extra)}")
    if problems:
        raise WheelhouseError("wheelhouse incomplete: " + " | ".join(problems))


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def parse_size(text: str) -> int:
    m = re.fullmatch(r"(\d+)([KMG]?)", text.strip().upper())
    if not m or int(m[1]) == 0:
        raise WheelhouseError(f"--split {text!r}: want a size like 60M")
    return int(m[1]) * {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}[m[2]]


def run(argv: list[str], what: str) -> float:
    """Run a pip step with its output kept back; the seconds it took. On failure its last
    lines go to stderr and WheelhouseError names the step."""
    start = time.monotonic()
    done = subprocess.run(argv, check=False, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stdout + done.stderr).rstrip().splitlines()[-TAIL_LINES:]
        print("\n".join(tail), file=sys.stderr)
        raise WheelhouseError(f"{what} failed (pip exit {done.returncode}; its last lines above)")
    return time.monotonic() - start


def mib(paths: list[Path]) -> str:
    return f"{sum(p.stat().st_size for p in paths) / 2**20:.1f} MiB"


def wheels_text(n: int) -> str:
    return f"{n} wheel{'' if n == 1 else 's'}"


def build(args: argparse.Namespace) -> None:
    pins = read_pins(Path(args.requirements))
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise WheelhouseError(f"{out}: exists and is not empty (a wheelhouse is built fresh)")
    out.mkdir(parents=True, exist_ok=True)
    abi = "cp" + args.python.replace(".", "")
    download = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                "--python-version", args.python, "--implementation", "cp",
                "--abi", abi, "--abi", "abi3", "--abi", "none", "-d", str(out),
                "-r", str(args.requirements)]  # fmt: skip
    for tag in args.platform or DEFAULT_PLATFORMS:
        download += ["--platform", tag]
    took = run(download, "pip download")
    got = sorted(out.glob("*.whl"))
    print(f"downloaded {wheels_text(len(got))} ({mib(got)}) in {took:.1f} s")
    check_complete(pins, got)
    if not args.no_project:
        project_wheel(out)
    wheels = sorted(out.glob("*.whl"))
    (out / SUMS).write_text("".join(f"{sha256(w)}  {w.name}\n" for w in wheels))
    meta = {"python": args.python, "platforms": args.platform or DEFAULT_PLATFORMS,
            "requirements": str(args.requirements), "wheels": len(wheels),
            "bytes": sum(w.stat().st_size for w in wheels)}  # fmt: skip
    (out / META).write_text(json.dumps(meta, indent=2) + "\n")
    print(
        f"wheelhouse {out}: {len(wheels)} wheels, {meta['bytes'] / 2**20:.0f} MiB, Python {args.python}"
    )
    if args.split:
        for part in split(out, parse_size(args.split)):
            print(f"  {part} ({part.stat().st_size / 2**20:.1f} MiB)")


def load_provenance() -> ModuleType:
    """The checkout's fusedq.provenance. fusedq/__init__ exports lazily, so this imports no
    torch or Triton: the build runs on any Python with pip (tests/scripts/test_wheelhouse.py
    builds the project wheel where torch cannot be imported)."""
    sys.path.insert(0, str(REPO))
    from fusedq import provenance

    return provenance


def project_wheel(out: Path) -> None:
    """The project itself, pure Python (its entry points are what vLLM's plugin loader finds),
    carrying the build-info stamp of the checkout it is built from: a GPU host that installs
    the wheel has no git, and its runs and benchmarks must still name their commit
    (fusedq.provenance). The checkout's own stamp is put back as it was afterwards."""
    provenance = load_provenance()
    before = provenance.BUILD_INFO.read_bytes() if provenance.BUILD_INFO.is_file() else None
    try:
        try:
            info = provenance.stamp()
            dirty = " (dirty: " + ", ".join(info["dirty_files"]) + ")" if info["dirty"] else ""
            stamped = f"stamped {info['commit']}{dirty}"
        except provenance.ProvenanceError as exc:
            # A tree without git (itself a copy) keeps a stamp it came with, if its code fits.
            label = provenance.commit_label(provenance.describe())
            stamped = f"not stamped ({exc}); provenance: {label}"
        before_wheels = set(out.glob("*.whl"))
        took = run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(REPO)],
                   "pip wheel of the project")  # fmt: skip
        built = sorted(set(out.glob("*.whl")) - before_wheels)
        names = ", ".join(w.name for w in built) or "no new wheel"
        print(f"built the project wheel {names} ({mib(built)}) in {took:.1f} s, {stamped}")
    finally:
        if before is None:
            provenance.BUILD_INFO.unlink(missing_ok=True)
        else:
            provenance.BUILD_INFO.write_bytes(before)


def split(out: Path, size: int) -> list[Path]:
    """Tar the wheelhouse and cut it into ``<out>.tar.part.NN`` files of at most ``size`` bytes."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for f in sorted(out.iterdir()):
            tar.add(f, arcname=f.name)
    data = buf.getvalue()
    parts = []
    for i in range(0, len(data), size):
        part = out.parent / f"{out.name}.tar.part.{i // size:02d}"
        part.write_bytes(data[i : i + size])
        parts.append(part)
    return parts


def unpack(chunks: list[Path], into: Path) -> Path:
    """Join ``*.tar.part.NN`` chunks (in name order) and extract them into ``into``."""
    names = sorted(chunks, key=lambda p: p.name)
    expected = [f".{i:02d}" for i in range(len(names))]
    if [p.suffix for p in names] != expected:
        raise WheelhouseError(f"chunks {[p.name for p in names]} are not a complete .00.. series")
    buf = io.BytesIO(b"".join(p.read_bytes() for p in names))
    with tarfile.open(fileobj=buf, mode="r") as tar:
        tar.extractall(into, filter="data")
    return into


def verify(house: Path, label: str) -> list[Path]:
    """The wheels listed in SHA256SUMS, each present and unaltered (``label`` names the source)."""
    sums = house / SUMS
    if not sums.is_file():
        raise WheelhouseError(f"{label}: no {SUMS} (not a wheelhouse built by this script)")
    wheels = []
    for line in sums.read_text().splitlines():
        digest, name = line.split(maxsplit=1)
        path = house / name
        if not path.is_file():
            raise WheelhouseError(f"{label}: {name} is listed in {SUMS} but missing")
        if sha256(path) != digest:
            raise WheelhouseError(f"{label}: {name} does not match its checksum")
        wheels.append(path)
    return wheels


def install(args: argparse.Namespace) -> None:
    sources = [Path(s) for s in args.source]
    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp:
        label = (
            str(sources[0]) if len(sources) == 1 else f"{sources[0]} (+{len(sources) - 1} chunks)"
        )
        if len(sources) == 1 and sources[0].is_dir():
            house = sources[0]
        else:
            missing = [str(s) for s in sources if not s.is_file()]
            if missing:
                raise WheelhouseError(
                    f"no such wheelhouse directory or chunk: {', '.join(missing)}"
                )
            house = unpack(sources, Path(tmp))
        wheels = verify(house, label)
        meta = json.loads((house / META).read_text()) if (house / META).is_file() else {}
        here = f"{sys.version_info.major}.{sys.version_info.minor}"
        if meta.get("python") and meta["python"] != here:
            raise WheelhouseError(
                f"{label}: built for Python {meta['python']}, this is Python {here} ({sys.executable})"
            )
        argv = [sys.executable, "-m", "pip", "install", "--no-index", "--no-deps", "--no-compile",
                "--disable-pip-version-check"]  # fmt: skip
        if args.target:
            argv += ["--target", args.target, "--upgrade"]
        took = run(argv + [str(w) for w in wheels], "pip install")
        size = mib(wheels)  # before a temporary unpacked copy goes
    where = f" into {args.target}" if args.target else ""
    print(f"installed {wheels_text(len(wheels))} ({size}){where} in {took:.1f} s "
          f"({platform.python_implementation()} {here}), no index used")  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser(
        "build", help="download the pinned wheels (+ the project's) into a wheelhouse"
    )
    b.add_argument("--requirements", default=str(DEFAULT_REQUIREMENTS))
    b.add_argument(
        "--python", default="3.12", help="target Python X.Y (default 3.12, the H200 image's)"
    )
    b.add_argument(
        "--platform",
        action="append",
        help="wheel platform tag (repeatable); default: manylinux x86_64",
    )
    b.add_argument("--out", default=str(REPO / ".whl"), help="directory to create (must be empty)")
    b.add_argument("--split", help="also write tar chunks of at most this size (e.g. 60M)")
    b.add_argument("--no-project", action="store_true", help="leave the project's own wheel out")
    i = sub.add_parser("install", help="verify and install a wheelhouse without an index")
    i.add_argument("source", nargs="+", help="the wheelhouse directory, or its .tar.part.NN chunks")
    i.add_argument("--target", help="install into this directory (then put it on PYTHONPATH)")
    args = parser.parse_args(argv)
    try:
        (build if args.command == "build" else install)(args)
    except WheelhouseError as exc:
        print(f"wheelhouse: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
