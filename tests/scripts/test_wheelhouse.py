"""scripts/wheelhouse.py: pins, completeness, chunking and verification (no index, no pip run
except the refusal paths, which stop before pip)."""

from __future__ import annotations

import importlib.util
import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("wheelhouse", REPO / "scripts" / "wheelhouse.py")
wh = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wh)


def test_the_shipped_requirements_are_exact_pins():
    pins = wh.read_pins(wh.DEFAULT_REQUIREMENTS)
    assert pins["vllm"] == "0.26.0" and pins["ray"] == "2.60.0"
    assert len(pins) == 93


@pytest.mark.parametrize(
    ("text", "match"),
    [
        ("vllm>=0.26\n", r"r\.txt:1: 'vllm>=0\.26' is not an exact pin"),
        ("# c\nray==2.60.0\nRay==2.61.0\n", r"r\.txt:3: Ray is pinned twice"),
    ],
)
def test_bad_requirements_are_named(tmp_path, text, match):
    (tmp_path / "r.txt").write_text(text)
    with pytest.raises(wh.WheelhouseError, match=match):
        wh.read_pins(tmp_path / "r.txt")


def test_completeness_names_missing_wrong_and_extra_wheels():
    pins = {"vllm": "0.26.0", "pydantic_core": "2.50.5", "ray": "2.60.0"}
    wheels = [
        Path("vllm-0.26.0-cp38-abi3-manylinux_2_28_x86_64.whl"),
        Path("pydantic_core-2.50.4-cp312-cp312-manylinux_2_17_x86_64.whl"),
        Path("six-1.17.0-py2.py3-none-any.whl"),
    ]
    with pytest.raises(wh.WheelhouseError) as exc:
        wh.check_complete(pins, wheels)
    msg = str(exc.value)
    assert "no wheel for ray==2.60.0" in msg
    assert "pydantic_core ['2.50.4'] (pinned 2.50.5)" in msg
    assert "wheels not pinned: six" in msg
    wh.check_complete({"vllm": "0.26.0"}, wheels[:1])


def _house(tmp_path: Path) -> Path:
    house = tmp_path / "house"
    house.mkdir()
    for name in ("a-1.0-py3-none-any.whl", "b-2.0-py3-none-any.whl"):
        (house / name).write_bytes(name.encode() * 1000)
    sums = "".join(f"{wh.sha256(w)}  {w.name}\n" for w in sorted(house.glob("*.whl")))
    (house / wh.SUMS).write_text(sums)
    (house / wh.META).write_text(json.dumps({"python": "9.9"}))
    return house


def test_chunks_round_trip_and_are_verified(tmp_path):
    house = _house(tmp_path)
    parts = wh.split(house, 4096)
    assert len(parts) > 2 and all(p.stat().st_size <= 4096 for p in parts)
    out = wh.unpack(list(reversed(parts)), tmp_path / "out")  # any order on the command line
    assert [w.name for w in wh.verify(out, "chunks")] == sorted(p.name for p in house.glob("*.whl"))
    with pytest.raises(wh.WheelhouseError, match=r"not a complete \.00\.\. series"):
        wh.unpack(parts[1:], tmp_path / "out2")


def test_an_altered_wheel_stops_the_install_before_pip(tmp_path):
    house = _house(tmp_path)
    (house / "b-2.0-py3-none-any.whl").write_bytes(b"tampered")
    with pytest.raises(
        wh.WheelhouseError, match=r"b-2\.0-py3-none-any\.whl does not match its checksum"
    ):
        wh.verify(house, str(house))
    assert wh.main(["install", str(house)]) == 2


def test_a_wheelhouse_for_another_python_is_refused(tmp_path, capsys):
    house = _house(tmp_path)
    assert wh.main(["install", str(house), "--target", str(tmp_path / "t")]) == 2
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    assert f"built for Python 9.9, this is Python {here}" in capsys.readouterr().err
    assert not (tmp_path / "t").exists()


def test_build_refuses_a_non_empty_directory(tmp_path, capsys):
    (tmp_path / "x").write_text("")
    assert wh.main(["build", "--out", str(tmp_path)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err


def test_the_project_wheel_carries_the_commit_it_was_built_from(tmp_path):
    import zipfile

    from fusedq import provenance

    before = provenance.BUILD_INFO.exists()
    wh.project_wheel(tmp_path)
    assert provenance.BUILD_INFO.exists() == before  # the checkout is left as it was
    (wheel,) = tmp_path.glob("fusedq-*.whl")
    with zipfile.ZipFile(wheel) as z:
        stamp = json.loads(z.read("fusedq/build_info.json"))
    here = provenance.describe()
    assert stamp["product_fingerprint"] == here["product_fingerprint"]
    if here["source"] == "git":
        assert (stamp["commit"], stamp["dirty"]) == (here["commit"], here["dirty"])


def test_the_cute46_list_is_vllm_026s_own_dsl_pin_and_exact():
    pins = wh.read_pins(REPO / "requirements" / "gpu-cute46.txt")
    assert pins["nvidia_cutlass_dsl"] == "4.6.0"
    assert pins["nvidia_cutlass_dsl_libs_cu13"] == pins["nvidia_cutlass_dsl_libs_cu12"] == "4.6.0"
    assert "quack_kernels" in pins and len(pins) == 13
    # On top of the vLLM 0.26 list: nothing pinned twice across the two.
    assert not set(pins) & set(wh.read_pins(wh.DEFAULT_REQUIREMENTS))


def test_the_cute_list_is_the_cute_extra_pinned():
    import tomllib

    extra = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    pins = wh.read_pins(REPO / "requirements" / "gpu-cute.txt")
    assert f"nvidia-cutlass-dsl=={pins['nvidia_cutlass_dsl']}" in extra["cute"]
    major, minor = map(int, pins["cuda_python"].split(".")[:2])
    assert "cuda-python>=12.9,<13" in extra["cute"] and (major, minor) >= (12, 9) and major < 13


# A sitecustomize that makes torch (and Triton) unimportable, as on a build machine with
# Python and pip only: every process started with it on PYTHONPATH (pip's too) has none.
NO_TORCH = """
import sys


class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "triton"):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, _NoTorch())
"""

BUILD_WITHOUT_TORCH = """
import importlib.util, json, sys, zipfile
from pathlib import Path

try:
    import torch  # noqa: F401
except ImportError:
    pass
else:
    sys.exit("torch is importable: the blocker did not take")
spec = importlib.util.spec_from_file_location("wheelhouse", sys.argv[1])
wh = importlib.util.module_from_spec(spec)
spec.loader.exec_module(wh)
out = Path(sys.argv[2])
wh.project_wheel(out)
assert "torch" not in sys.modules and "triton" not in sys.modules, sorted(sys.modules)
(wheel,) = out.glob("fusedq-*.whl")
with zipfile.ZipFile(wheel) as z:
    print(json.loads(z.read("fusedq/build_info.json"))["product_fingerprint"])
"""


def test_the_project_wheel_builds_where_torch_cannot_be_imported(tmp_path):
    import os
    import subprocess

    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "sitecustomize.py").write_text(NO_TORCH)
    out = tmp_path / "house"
    out.mkdir()
    env = {**os.environ, "PYTHONPATH": str(blocker)}
    done = subprocess.run(
        [sys.executable, "-c", BUILD_WITHOUT_TORCH, str(REPO / "scripts" / "wheelhouse.py"),
         str(out)],
        capture_output=True, text=True, env=env, timeout=600, cwd=tmp_path,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    *said, fingerprint = done.stdout.strip().splitlines()
    assert len(said) == 1 and said[0].startswith("built the project wheel fusedq-"), said
    assert fingerprint == wh.load_provenance().describe()["product_fingerprint"]


def test_a_pip_step_is_quiet_unless_it_fails(capsys):
    took = wh.run([sys.executable, "-c", "print('resolving ' * 50)"], "pip quiet")
    assert took >= 0 and capsys.readouterr() == ("", "")
    noisy = "import sys; print('\\n'.join(f'line {i}' for i in range(100))); sys.exit(3)"
    with pytest.raises(wh.WheelhouseError, match=r"^pip loud failed \(pip exit 3; its last"):
        wh.run([sys.executable, "-c", noisy], "pip loud")
    err = capsys.readouterr().err.splitlines()
    assert err == [f"line {i}" for i in range(100 - wh.TAIL_LINES, 100)]


def _wheel(house: Path, name: str = "tinypkg", version: str = "1.0") -> Path:
    """A minimal pure-Python wheel, made by hand: pip installs it with no index."""
    import base64
    import zipfile

    files = {
        f"{name}.py": "VALUE = 1\n",
        f"{name}-{version}.dist-info/METADATA": (
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        ),
        f"{name}-{version}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(__import__("hashlib").sha256(text.encode()).digest())
        record.append(f"{path},sha256={digest.rstrip(b'=').decode()},{len(text.encode())}")
    record.append(f"{name}-{version}.dist-info/RECORD,,")
    wheel = house / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
        z.writestr(f"{name}-{version}.dist-info/RECORD", "\n".join(record) + "\n")
    return wheel


def test_install_says_one_line_and_not_pips_arguments(tmp_path, capsys):
    house = tmp_path / "house"
    house.mkdir()
    wheel = _wheel(house)
    (house / wh.SUMS).write_text(f"{wh.sha256(wheel)}  {wheel.name}\n")
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    (house / wh.META).write_text(json.dumps({"python": here}))
    target = tmp_path / "site"
    assert wh.main(["install", str(house), "--target", str(target)]) == 0
    out, err = capsys.readouterr()
    [line] = out.splitlines()
    assert re.fullmatch(
        rf"installed 1 wheel \(0\.0 MiB\) into {re.escape(str(target))} in [\d.]+ s "
        rf"\(CPython {here}\), no index used",
        line,
    ), line
    assert err == "" and "--no-index" not in out
    assert (target / "tinypkg.py").is_file()
