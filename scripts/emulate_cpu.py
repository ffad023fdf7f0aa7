#!/usr/bin/env python3
"""Make every Python process of a venv see an AVX2-only x86 CPU, to run the suite as an older
machine would from a newer one.

    python scripts/emulate_cpu.py on  [.venv]     # from now on the venv is "AVX2 only"
    python scripts/emulate_cpu.py off [.venv]     # back to the real CPU
    python scripts/emulate_cpu.py status [.venv]

vLLM's CPU build picks other kernels, backends and fallbacks per instruction set: on an
AVX2-only host it loads ``_C_AVX2``, oneDNN cannot build its BF16 matmul ("Failed to create
oneDNN linear, fallback to torch linear") and ATen, Inductor and NumPy (Triton's interpreter)
run AVX2 code. A test sized on an AVX-512 machine can time out there. ``on`` writes a ``.pth``
file into the venv's site-packages, so every Python process started from it (pytest, the
orchestrator, Ray's workers, each ``vllm serve`` and its engine core), whatever environment a
test or matrix hands it, caps each of those libraries at AVX2 and answers vLLM's CPU feature
checks as such a CPU does. What it cannot change is the silicon's speed per instruction: a
real AVX2-only EPYC may be slower still (confine the run to one core for that margin:
``taskset -c 0 make test``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

NAME = "_emulated_cpu"

# Imported by the .pth line at every interpreter start of the venv, before any test, server or
# library code: environment first (oneDNN, ATen and NumPy read it when they load), then the
# feature checks vLLM asks torch and /proc/cpuinfo, patched when their modules are imported.
MODULE = '''"""AVX2-only CPU emulation, installed by scripts/emulate_cpu.py (remove with `off`)."""

import importlib.abc
import importlib.machinery
import os
import sys

os.environ.setdefault("ATEN_CPU_CAPABILITY", "avx2")
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX2")
os.environ.setdefault(
    "NPY_DISABLE_CPU_FEATURES",
    "AVX512F AVX512CD AVX512_KNL AVX512_KNM AVX512_SKX AVX512_CLX AVX512_CNL AVX512_ICL "
    "AVX512_SPR",
)
os.environ["ORCHESTRATOR_EMULATED_CPU"] = "avx2"

_NO = lambda *a, **k: False  # noqa: E731
PATCHES = {
    "torch.cpu": (
        "_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
        "_is_amx_tile_supported", "_is_amx_fp16_supported",
    ),
    # "AuthenticAMD" and "avx512" in /proc/cpuinfo: an AVX2-only EPYC has no avx512 flag.
    "vllm.platforms": ("_is_amd_zen_cpu",),
}


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in PATCHES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module, run=run, names=PATCHES[name]):
            run(module)
            for attr in names:
                setattr(module, attr, _NO)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _PatchAfterImport())
'''


def site_packages(venv: Path) -> Path:
    """The venv's purelib directory (``lib/pythonX.Y/site-packages``)."""
    found = sorted(venv.glob("lib/python3*/site-packages"))
    if not found:
        raise SystemExit(f"emulate_cpu: {venv} has no lib/python3*/site-packages: not a venv")
    return found[0]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("action", choices=["on", "off", "status"])
    ap.add_argument("venv", nargs="?", default=".venv", type=Path)
    args = ap.parse_args(argv)
    site = site_packages(args.venv)
    pth, module = site / f"{NAME}.pth", site / f"{NAME}.py"
    if args.action == "on":
        module.write_text(MODULE)
        pth.write_text(f"import {NAME}\n")
        print(f"emulate_cpu: {args.venv} now sees an AVX2-only CPU ({pth})")
    elif args.action == "off":
        for p in (pth, module):
            p.unlink(missing_ok=True)
        print(f"emulate_cpu: {args.venv} sees the real CPU")
    else:
        on = pth.exists() and module.exists()
        print(f"emulate_cpu: {args.venv}: {'AVX2-only (emulated)' if on else 'the real CPU'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
