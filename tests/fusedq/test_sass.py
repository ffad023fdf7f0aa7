"""The one-round-trip property in sm_90 SASS (fusedq_bench/sass.py says why PTX is
not enough): the scoreboard reader on hand-made SASS, then the product's Gluon and
register-path kernels, compiled offline with the installed Triton and its bundled ptxas (no
GPU), with and without the scheduling fence. The CuTe kernel's variants are checked in
test_cute_mla_query.py (they need nvidia-cutlass-dsl)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fusedq.kernels import gluon_mla_query
from fusedq_bench import sass

ROOT = Path(__file__).resolve().parents[2]


def _line(offset: int, text: str, wb: int = 7, rb: int = 7, wait: tuple[int, ...] = ()) -> str:
    mask = sum(1 << b for b in wait)
    high = (mask << 52) | (rb << 49) | (wb << 46)
    return f"        /*{offset:04x}*/                   {text} ; /* 0x000000000000000000 */\n" + (
        f"                                                    /* 0x{high:016x} */\n"
    )


def test_reader_finds_a_wait_before_the_last_load():
    text = (
        _line(0x00, "LDG.E.128 R4, desc[UR4][R2.64]", wb=2)
        + _line(0x10, "LDG.E R8, desc[UR4][R6.64]", wb=3, rb=1)
        + _line(0x20, "F2FP.F16.E4M3.UNPACK_B R10, R4", wait=(2,))
        + _line(0x30, "@!P0 LDG.E.128 R12, desc[UR4][R14.64]", wb=4)
        + _line(0x40, "FFMA R0, R12, R10, R8", wait=(3, 4))
    )
    ins = sass.parse(text)
    assert [i.offset for i in ins] == [0, 0x10, 0x20, 0x30, 0x40]
    assert ins[3].is_global_load and not ins[2].is_global_load
    found = sass.early_waits(ins)
    assert [(w.at, w.scoreboard, w.load_at) for w in found] == [(0x20, 2, 0x00)]
    assert "SB2, set by the global load at /*0000*/" in str(found[0])


def test_reader_tells_a_read_barrier_wait_from_a_data_wait():
    def program(read_barrier: int) -> str:
        return (
            _line(0x00, "LDG.E R23, desc[UR4][R4.64]", wb=4, rb=read_barrier)
            + _line(0x10, "LEA R4, P2, R0, UR10, 0x1", wait=(read_barrier,))  # reuses R4
            + _line(0x20, "LDG.E.128 R8, desc[UR4][R4.64]", wb=5)
            + _line(0x30, "HADD2.F32 R1, -RZ, R8.H0_H0", wait=(5,))
        )

    # Its own scoreboard: waiting for the address register to be read is short.
    assert sass.early_waits(sass.parse(program(read_barrier=1))) == []
    # The data's scoreboard (ptxas shares them when it runs short): a full round trip.
    found = sass.early_waits(sass.parse(program(read_barrier=4)))
    assert [(w.at, w.scoreboard) for w in found] == [(0x10, 4)]
    assert sass.early_waits(sass.parse(_line(0, "IADD3 R1, R2, R3, RZ", wait=(1,)))) == []


def test_command_line_lists_early_waits_and_exits_by_them(tmp_path: Path, capsys):
    early = tmp_path / "early.sass"
    early.write_text(
        _line(0x00, "LDG.E R4, desc[UR4][R2.64]", wb=2)
        + _line(0x10, "FADD R6, R4, R4", wait=(2,))
        + _line(0x20, "LDG.E R8, desc[UR4][R2.64]", wb=3)
    )
    assert sass.main([str(early)]) == 1
    out = capsys.readouterr().out
    assert "waits on SB2" in out and "3 instructions, 2 global loads, 1 early waits" in out
    clean = tmp_path / "clean.sass"
    clean.write_text(
        _line(0x00, "LDG.E R4, desc[UR4][R2.64]", wb=2) + _line(0x10, "FADD R6, R4, R4", wait=(2,))
    )
    assert sass.main([str(clean)]) == 0
    assert sass.main([str(tmp_path / "missing.sass")]) == 2
    assert "missing.sass" in capsys.readouterr().err


# Compiled in a child process (the interpreter the CPU suite runs in patches Triton's tensor
# classes, which breaks code generation in that process), each cubin written to argv[1].
_COMPILE_PRODUCT = r"""
import json, sys
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fusedq.kernels import common
from fusedq.kernels import gluon_mla_query as g
from fusedq.kernels import triton_mla_query as t
from fusedq.contract import GLM5, KV_LORA, QK_ROPE
from fusedq.selection import launch_config
out, done = Path(sys.argv[1]), {}
fence = json.loads(sys.argv[2])  # None: each variant's own (LaunchConfig.fence)
for wf in ("bf16", "mxfp8"):
    for of in (False, True):
        for h in (8, 11, 16):
            for m in (1, 2, 4, 8, 16, 32):
                cfg = launch_config(h, m, wf, of)
                if cfg.gluon:
                    key = f"gluon-{cfg.gluon_operands}-m{cfg.block_m}-n{cfg.block_n}-w{cfg.num_warps}-{wf}-{'e4m3-' + cfg.e4m3_epilogue if of else 'bf16'}"
                    if key not in done:
                        k = g.offline_compile(
                            block_m=cfg.block_m, block_n=cfg.block_n, num_warps=cfg.num_warps,
                            pdl=False, mxfp8=wf == "mxfp8", out_fp8=of, w_layout=1, w_aligned=True,
                            io_aligned=True, operands=cfg.gluon_operands,
                            e4m3_epilogue=cfg.e4m3_epilogue,
                            load_fence=cfg.fence if fence is None else fence)
                        done[key] = []
                        (out / f"{key}.cubin").write_bytes(k.asm["cubin"])
                elif cfg.fma:
                    key = f"fma-m{cfg.block_m}-n{cfg.block_n}-w{cfg.num_warps}-{wf}-{'e4m3' if of else 'bf16'}"
                    if key not in done:
                        cx = {"K": GLM5.qk_nope, "N": KV_LORA, "R": QK_ROPE, "BLOCK_M": cfg.block_m,
                              "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k, "W_LAYOUT": 1,
                              "W_ALIGNED": True, "IO_ALIGNED": True, "MXFP8": wf == "mxfp8",
                              "OUT_FP8": common.out_mode(of), "INTERPRET": False, "USE_PDL": False,
                              "LOAD_FENCE": cfg.fence if fence is None else fence}
                        ptr = {"q_ptr": "*bf16", "qpe_ptr": "*bf16",
                               "w_ptr": "*fp8e4nv" if wf == "mxfp8" else "*bf16",
                               "ws_ptr": "*u8" if wf == "mxfp8" else "*bf16",
                               "out_ptr": "*fp8e4nv" if of else "*bf16",
                               "qs_ptr": "*fp32" if of else "*bf16"}
                        fn = t._mla_query_fma_kernel
                        sig = {n: ptr.get(n, "constexpr" if n in cx else "i32") for n in fn.arg_names}
                        k = triton.compile(ASTSource(fn, sig, constexprs=cx),
                                           target=GPUTarget("cuda", 90, 32),
                                           options={"num_warps": cfg.num_warps, "num_stages": 1})
                        done[key] = []
                        (out / f"{key}.cubin").write_bytes(k.asm["cubin"])
                else:
                    continue
                done[key].append([wf, of, h, m])
json.dump(done, sys.stdout)
"""


def _compile(tmp: Path, fence: bool | None = None) -> dict[str, list]:
    if not gluon_mla_query.AVAILABLE:
        pytest.skip(gluon_mla_query.UNAVAILABLE_REASON)
    if sass.triton_bin("cuobjdump") is None:
        pytest.skip("Triton bundles no cuobjdump here")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # (Triton 3.9 warns when it is unset)
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_PRODUCT, str(tmp), json.dumps(fence)],
        env=env, capture_output=True, text=True, timeout=900, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)


# The product variants whose SASS waits on a global load before its last one, and why each
# stays. The Gluon MXFP8 -> BF16 kernels wait for a weight load before issuing the last q
# loads (ptxas sinks them below the dequantisation); the scheduling fence that removes the
# wait (LaunchConfig.load_fence) measured slower on the H200, since the q loads it delays hit
# L2 (docs/decisions/0006-gluon-for-larger-m.md). The register
# path's MXFP8 -> E4M3 kernel: ptxas gives q_scale's load one scoreboard for its data and its
# address register and waits on it to reuse that register; that kernel runs only outside CUDA
# graphs (in graphs MXFP8 at M <= 4 runs the CuTe kernel), where host time dominates.
KNOWN_EARLY = {
    "gluon-convert-m16-n32-w4-mxfp8-bf16": "fence measured slower",
    "gluon-convert-m16-n64-w4-mxfp8-bf16": "fence measured slower",
    "gluon-convert-m32-n64-w4-mxfp8-bf16": "fence measured slower",
    "fma-m1-n32-w4-mxfp8-e4m3": "eager only",
}


def _early(tmp: Path, shapes: dict[str, list]) -> dict[str, list[str]]:
    found = {}
    for key, served in shapes.items():
        waits = sass.early_waits(sass.parse(sass.cubin_sass(tmp / f"{key}.cubin")))
        if waits:
            found[key] = [str(w) for w in waits[:2]] + [f"serves {served[:3]}"]
    return found


def test_product_kernels_wait_early_only_where_it_was_measured(tmp_path):
    """Every Gluon and register-path variant the selection picks (4 recipes x H 8/11/16 x M
    1..32): no wait on a global load's data before the last global load is issued, except in
    KNOWN_EARLY. A new early wait fails here; so does a known one that went away (then the
    measured reason for it may be gone too)."""
    shapes = _compile(tmp_path)
    assert any(k.startswith("gluon-") for k in shapes) and any(k.startswith("fma-") for k in shapes)
    early = _early(tmp_path, shapes)
    unexpected = {k: v for k, v in early.items() if k not in KNOWN_EARLY}
    assert not unexpected, json.dumps(unexpected, indent=1)
    assert set(early) == set(KNOWN_EARLY) & set(shapes), sorted(early)


def test_the_fence_orders_the_loads(tmp_path):
    """With the fence on, no BF16-out variant waits early; off, the register path's does
    (ptxas converts q before issuing the RoPE load, measured slower on the H200) and the
    MXFP8 Gluon ones do."""
    on, off = tmp_path / "on", tmp_path / "off"
    on.mkdir()
    off.mkdir()
    early_on = _early(on, _compile(on, fence=True))
    assert not [k for k in early_on if k.endswith("-bf16")], sorted(early_on)
    early_off = _early(off, _compile(off, fence=False))
    assert "fma-m1-n32-w4-bf16-bf16" in early_off, sorted(early_off)
    assert {k for k in early_off if k.startswith("gluon-")} >= {
        k for k in KNOWN_EARLY if k.startswith("gluon-")
    }
