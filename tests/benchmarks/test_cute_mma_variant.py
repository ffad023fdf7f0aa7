"""benchmarks/experiments/cute_mma_variant.py: the tensor-core variant cute_ab.py loads (its
timing and exactness were measured on the H200: docs/decisions/0002-tensor-core-variant-not-adopted.md)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusedq.kernels import cute_mla_query as product

REPO = Path(__file__).resolve().parents[2]
VARIANT = REPO / "benchmarks" / "experiments" / "cute_mma_variant.py"


def _load(name: str):
    # As cute_ab.py loads it: module cute_<NAME>, whose name carries the knobs.
    spec = importlib.util.spec_from_file_location(f"cute_{name}", VARIANT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize(
    "name,kt,probe,shfl",
    [("mma", 2, 0, False), ("mma_kt1", 1, 0, False), ("mma_probe2", 2, 2, False),
     ("x_kt1_probe1_shfl", 1, 1, True), ("mma_wide_probe2", 1, 2, False)],
)  # fmt: skip
def test_knobs_ride_on_the_variant_name(name, kt, probe, shfl):
    mod = _load(name)
    assert (kt, probe, shfl) == (mod.KT_PER_WARP, mod.PROBE, mod.SCALE_SHFL)
    assert ("wide" in name) == mod.WIDE


def test_launch_path_is_the_products_with_its_own_build_and_cache():
    # Imports without the DSL; the product's launch code, resolving _build and _compiled here,
    # so a variant never lands in (or reads from) the product's compile cache.
    mod = _load("mma")
    for fn in ("launch_unchecked", "_compiled_for", "compile_variant"):
        assert getattr(mod, fn).__code__ is getattr(product, fn).__code__
        assert getattr(mod, fn).__globals__ is vars(mod)
    assert mod._compiled is not product._compiled
    assert mod.compile_variant.__kwdefaults__ == product.compile_variant.__kwdefaults__
    # q's factor 2^(e - 127 + B_SHIFT) and the output's 2^(120 - B_SHIFT) undo the weights'
    # 2^-120 exactly.
    assert mod.OUT_FACTOR * 2.0 ** (mod.B_SHIFT - 120) == 1.0


@pytest.mark.parametrize(
    "name,h,bucket,out_fp8,bf16_weights",
    [("mma", 8, 1, 0, 0), ("mma_kt1", 16, 32, 1, 1), ("mma_wide", 11, 8, 1, 0),
     ("mma_wide", 16, 2, 0, 1)],
)  # fmt: skip
def test_offline_trace(name, h, bucket, out_fp8, bf16_weights):
    # CUTE_DSL_DRYRUN traces the kernel to IR without a GPU (skips where the DSL is absent).
    if product._import_reason() is not None:
        pytest.skip(product._import_reason())
    code = (
        "import importlib.util; "
        f"s = importlib.util.spec_from_file_location('cute_{name}', {str(VARIANT)!r}); "
        "m = importlib.util.module_from_spec(s); s.loader.exec_module(m); "
        f"m.compile_variant({h}, {bucket}, out_fp8={bool(out_fp8)}, "
        f"bf16_weights={bool(bf16_weights)}, device=False)"
    )
    env = {**product.dry_run_env(), "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
