"""The Gluon kernel (fusedq.kernels.gluon_mla_query): its wiring and its sm_90 PTX on any
machine (offline compile, no GPU), its results against the staged path on a GPU."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import triton
from fusedq_cases import HEADS, MS, RECIPES, launch_matches_staged

from fusedq.kernels import common, fast_launch, gluon_mla_query, triton_mla_query
from fusedq.kernels import triton_launch as kernel

ROOT = Path(__file__).resolve().parents[2]

needs_gluon = pytest.mark.skipif(
    not gluon_mla_query.AVAILABLE, reason=gluon_mla_query.UNAVAILABLE_REASON or "-"
)


def _ids(v) -> str:
    return str(v).replace("torch.", "")


def test_same_parameters_and_specialisation_as_the_triton_kernel():
    """fast_launch and launch_arguments address the Gluon kernel exactly as the tl.dot one."""
    if not gluon_mla_query.AVAILABLE:
        pytest.skip(gluon_mla_query.UNAVAILABLE_REASON)
    for fn in map(gluon_mla_query.kernel_for_operands, gluon_mla_query.OPERANDS):
        assert fn.arg_names == triton_mla_query._mla_query_kernel.arg_names
        assert list(fn.do_not_specialize) == common.JIT_OPTIONS["do_not_specialize"]
        no_align = common.JIT_OPTIONS["do_not_specialize_on_alignment"]
        assert list(fn.do_not_specialize_on_alignment) == no_align
        ints = tuple(range(13))
        constexprs = {n: 0 for n in fn.arg_names[len(fast_launch.POINTER_PARAMS) + len(ints) :]}
        assert fast_launch.launch_tail(fn, ints, constexprs) == ints + (0,) * len(constexprs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"block_m": 16, "fma": True}, "exclude each other"),
        ({"block_m": 8}, "block_m=8 must be in"),
        ({"block_m": 16, "block_k": 256}, "block_k=256"),
        ({"block_m": 16, "block_n": 256}, "block_n=256"),
    ],
)
def test_bad_gluon_configs_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kernel.LaunchConfig(**{"block_n": 32, **kwargs, "gluon": True})


def test_gluon_operands_need_gluon_and_a_known_path():
    with pytest.raises(ValueError, match=r"gluon_operands='smem' .* needs gluon=True"):
        kernel.LaunchConfig(block_m=16, block_n=32, gluon_operands="smem")
    if gluon_mla_query.AVAILABLE and not common.interpreting():
        with pytest.raises(ValueError, match="gluon_operands='tma' must be one of"):
            kernel.LaunchConfig(block_m=16, block_n=32, gluon=True, gluon_operands="tma")


def test_the_interpreter_refuses_a_gluon_config():
    if not common.interpreting():
        pytest.skip("runs where the CPU suite runs: under TRITON_INTERPRET=1")
    with pytest.raises(ValueError, match="TRITON_INTERPRET"):
        kernel.LaunchConfig(block_m=16, block_n=32, gluon=True)


# (block_m, block_n, warps, pdl, mxfp8, out_fp8, w_layout, w_aligned, io_aligned): both weight
# formats and output dtypes, each weight layout, aligned or not, PDL, both row counts.
PTX_CASES = [
    (16, 32, 4, False, False, False, 1, True, True),
    (16, 32, 4, False, True, False, 1, True, True),
    (16, 32, 4, True, True, True, 1, True, True),
    (32, 64, 8, False, True, True, 2, True, False),
    (32, 32, 8, True, False, True, 0, False, False),
]


# Compiled in a child process: Triton's interpreter (which the CPU suite runs kernels in)
# patches the methods of Triton's tensor class, Gluon's tensors included, so code generation
# in a process that has interpreted a kernel goes wrong. One child compiles every case.
_COMPILE_ALL = """
import json, sys
from fusedq.kernels import gluon_mla_query as g
out = {}
for ops in g.OPERANDS:
    for bm, bn, w, pdl, mx, of, wl, wa, ia in json.loads(sys.argv[1]):
        key = json.dumps([bm, bn, w, pdl, mx, of, wl, wa, ia, ops])
        try:
            out[key] = g.offline_compile(
                block_m=bm, block_n=bn, num_warps=w, pdl=pdl, mxfp8=mx, out_fp8=of, w_layout=wl,
                w_aligned=wa, io_aligned=ia, operands=ops,
            ).asm["ptx"]
        except CompilationError as exc:
            out[key] = {"error": str(exc)[-600:]}
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def offline_ptx() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_ALL, json.dumps(PTX_CASES)],
        env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


@needs_gluon
@pytest.mark.parametrize("operands", gluon_mla_query.OPERANDS)
@pytest.mark.parametrize("case", PTX_CASES, ids=lambda c: "-".join(map(str, c)))
def test_ptx_issues_every_global_load_before_the_first_wait(case, operands, offline_ptx):
    """The one-round-trip property, read off the sm_90 PTX: no ld.global after the first
    shared-memory store or barrier (the layout conversions), and the MMAs are there; the
    shared-memory path has a single barrier, the direct path none and no shared memory."""
    bm, bn, warps, pdl = case[:4]
    ptx = offline_ptx[json.dumps([*case, operands])]
    if isinstance(ptx, dict):
        if triton.__version__.startswith(gluon_mla_query.COMPILED_WITH):
            pytest.fail(f"a Triton the kernel is written against fails: {ptx['error']}")
        pytest.skip(f"Triton {triton.__version__}'s Gluon cannot compile the kernel: {ptx}"[:400])
    order = gluon_mla_query.ptx_memory_order(ptx)
    assert order["ld_global"] > 0 and order["ld_global_after_first_sync"] == 0, order
    barriers = {"convert": order["bar_sync"] > 1, "smem": order["bar_sync"] == 1}
    assert barriers.get(operands, order["bar_sync"] == order["st_shared"] == 0), order
    # 192 / 16 = 12 K steps for each [16, 8] accumulator tile a warp holds (a warp holds at
    # least one: where warps outnumber tiles they repeat one).
    assert order["mma_sync"] == 12 * max(1, (bm // 16) * (bn // 8) // warps), order
    assert ("griddepcontrol.wait" in ptx) == pdl
    if pdl:  # the weights are read before the wait, q after it
        wait = ptx.index("griddepcontrol.wait")
        assert "ld.global" in ptx[:wait] and "ld.global" in ptx[wait:]


def _gluon(m: int, block_n: int = 32, num_warps: int = 4, *, pdl: bool = False, operands: str):
    return kernel.LaunchConfig(
        block_m=16 if m <= 16 else 32, block_n=block_n, num_warps=num_warps, pdl=pdl,
        gluon=True, gluon_operands=operands,
    )  # fmt: skip


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("operands", gluon_mla_query.OPERANDS)
@pytest.mark.parametrize("pdl", [False, True], ids=["nopdl", "pdl"])
@pytest.mark.parametrize("fmt,out_dtype", RECIPES, ids=_ids)
@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize("h", HEADS)
def test_gluon_matches_staged(h, m, fmt, out_dtype, pdl, operands, device):
    """The shape grid of test_api (vLLM's strided W_UK_T, sliced q), pitched out for odd M."""
    config = _gluon(m, pdl=pdl, operands=operands)
    launch_matches_staged(config, fmt, out_dtype, h, m, device, 1000 * h + m, pitched=m % 2 == 1)


# Compiles dominate these tests' GPU time, so layouts and tiles are crossed with the recipes
# separately rather than all together.
@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("operands", gluon_mla_query.OPERANDS)
@pytest.mark.parametrize("layout", ["vllm", "unit_k", "generic", "contiguous"])
@pytest.mark.parametrize("fmt,out_dtype", RECIPES, ids=_ids)
def test_gluon_weight_layouts(fmt, out_dtype, layout, operands, device):
    """Every weight layout (unit N, unit K, generic), MXFP8 values strided like the bf16
    weight."""
    config = _gluon(5, operands=operands)
    launch_matches_staged(config, fmt, out_dtype, 11, 5, device, 5, pitched=True, layout=layout)


@pytest.mark.gpu
@needs_gluon
@pytest.mark.parametrize("operands", gluon_mla_query.OPERANDS)
@pytest.mark.parametrize("block_n,num_warps", [(32, 8), (64, 4), (64, 8), (128, 8)])
@pytest.mark.parametrize("fmt,out_dtype", [RECIPES[0], RECIPES[3]], ids=_ids)
@pytest.mark.parametrize("layout", ["vllm", "unit_k"])
def test_gluon_tiles(layout, fmt, out_dtype, block_n, num_warps, operands, device):
    """The other N tiles and warp counts (the grid test runs 32:4), both unit-stride axes,
    M = 17 (32-row tile, padding rows)."""
    config = _gluon(17, block_n, num_warps, operands=operands)
    launch_matches_staged(
        config, fmt, out_dtype, 11, 17, device, block_n, pitched=True, layout=layout
    )
