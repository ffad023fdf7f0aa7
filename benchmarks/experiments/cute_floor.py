"""A floor for the CuTe kernel's way of loading, beside the CuTe kernel and the read floors.

    python benchmarks/experiments/cute_floor.py [--samples 300] [--heads 8 11 16] [--m 1 2] [--json FILE]

Needs a CUDA GPU (sm_89+) and nvidia-cutlass-dsl. fusedq-bench's "view" floors load the fused
kernel's tiles as the Gluon and Triton kernels do; at MXFP8 M = 1 the CuTe kernel ran below
them (H200, 2026-12-01), so they do not bound it. This kernel loads what the CuTe kernel
loads (fusedq.kernels.cute_mla_query), with its grid (512 / 32 N tiles x H) and thread mapping
(192 threads: ROWS_PER_THREAD weight rows of one W_VEC-weight vector each, their scale bytes),
the head's q and q_pe as 16-byte vectors spread over the CTA (the kernel's way for one token
row; from two it loads each thread's own 4 q values), every load issued before any use (the
same fence the register path has), then XORs the loaded words and stores one word per thread:
no dequantisation, no FMAs, no reduction. `--weights bf16` loads vLLM's bf16 W_UK_T view the
same way (16-byte vectors of 8 weights). It runs in one interleaved set of CUDA-graph replays
with the product's kernel (the CuTe call for MXFP8, `backend="auto"` for BF16) and
fusedq-bench's read floors (fusedq_bench.harness's timing, weights rotated past 2x L2). H200,
2026-12-01, with the kernel's former layout (96 threads of 4 rows x 16 fp8): 1.11-1.17x the
read floor (MXFP8, M 1-2) and 1.08-1.15x (BF16, M 1 and 32), under the targets
(docs/decisions/0014-floors-are-the-yardstick.md).
"""

import argparse
import json
import os
import sys
import time

import torch

from fusedq.contract import KV_LORA, QK_ROPE, SCALE_BLOCKS
from fusedq.kernels import cute_mla_query as cm
from fusedq.kernels.cute_mla_query import QK_NOPE  # the CuTe kernel's geometry (GLM-5's)
from fusedq_bench import cli, harness, options


def threads(bf16: bool) -> int:
    """CTA size, as the CuTe kernel's: ROWS_PER_THREAD weight rows a thread, one vector of
    W_VEC weights of a 32-column tile each (8 bytes of fp8, or 16 of bf16), 192 threads."""
    return QK_NOPE // cm.ROWS_PER_THREAD * (cm.BLOCK_N // cm.W_VEC)


def weight_words(bf16: bool) -> int:
    """32-bit words in one thread's vector of one weight row."""
    return cm.W_VEC * (2 if bf16 else 1) // 4


@__import__("functools").cache
def build(H, MB, bf16=False, swh=None):
    import cutlass
    import cutlass.cute as cute

    THREADS, ROWS = threads(bf16), cm.ROWS_PER_THREAD
    COL_GROUPS = cm.BLOCK_N // cm.W_VEC
    WV = weight_words(bf16)
    KV = QK_NOPE // cm.Q_VEC  # 16-byte q vectors per token row
    RV = QK_ROPE // cm.Q_VEC
    q_loads = -(-MB * KV // THREADS)
    pe_loads = -(-MB * RV // THREADS)
    NW = KV_LORA * (2 if bf16 else 1) // 4  # int32 words per weight row
    # The weight's head stride in words, compiled in (a runtime stride loses the 16-byte loads)
    SWH = swh if swh is not None else QK_NOPE * NW

    @cute.kernel
    def floor_kernel(
        gQ: cute.Tensor,
        gP: cute.Tensor,
        gW: cute.Tensor,
        gS: cute.Tensor,
        gO: cute.Tensor,
        M: cutlass.Int32,
    ):
        tid, _, _ = cute.arch.thread_idx()
        pid_n, h, _ = cute.arch.block_idx()
        cols = tid % COL_GROUPS
        kq = tid // COL_GROUPS
        last = M - 1
        tW = cute.zipped_divide(gW, (1, 1, WV))
        w_raw = []
        for r in cutlass.range_constexpr(ROWS):
            w_raw.append(tW[(None, (h, kq * ROWS + r, pid_n * COL_GROUPS + cols))].load())
        tQ = cute.zipped_divide(gQ, (1, 1, 4))
        q_raw = []
        for i in cutlass.range_constexpr(q_loads):
            v = cutlass.min(tid + THREADS * i, MB * KV - 1)
            q_raw.append(tQ[(None, (cutlass.min(v // KV, last), h, v % KV))].load())
        tP = cute.zipped_divide(gP, (1, 1, 4))
        pe_raw = []
        for i in cutlass.range_constexpr(pe_loads):
            v = cutlass.min(tid + THREADS * i, MB * RV - 1)
            pe_raw.append(tP[(None, (cutlass.min(v // RV, last), h, v % RV))].load())
        s_raw = []
        if cutlass.const_expr(not bf16):
            for r in cutlass.range_constexpr(ROWS):
                s_raw.append(gS[(h, kq * ROWS + r, pid_n)])
        # A fence (as measured for the product kernels): every load issued before any use.
        fenced = cutlass.Float32(1.0) / cutlass.Float32(M) > cutlass.Float32(0.0)
        acc = cutlass.Int32(cutlass.select_(fenced, cutlass.Int32(0), cutlass.Int32(1)))
        for vec in w_raw:
            for j in cutlass.range_constexpr(WV):
                acc = acc ^ vec[j]
        for vec in q_raw + pe_raw:
            for j in cutlass.range_constexpr(4):
                acc = acc ^ vec[j]
        for s in s_raw:
            acc = acc ^ (cutlass.Int32(s) & 0xFF)
        gO[(pid_n * H + h) * THREADS + tid] = acc

    @cute.jit
    def host(
        q_ptr: cute.Pointer,
        pe_ptr: cute.Pointer,
        w_ptr: cute.Pointer,
        s_ptr: cute.Pointer,
        o_ptr: cute.Pointer,
        M: cutlass.Int32,
        sqm: cutlass.Int32,
        sqh: cutlass.Int32,
        spm: cutlass.Int32,
        sph: cutlass.Int32,
        stream,
    ):
        gQ = cute.make_tensor(
            q_ptr,
            cute.make_layout(
                (MB, H, QK_NOPE // 2),
                stride=(cute.assume(sqm, divby=4), cute.assume(sqh, divby=4), 1),
            ),
        )
        gP = cute.make_tensor(
            pe_ptr,
            cute.make_layout(
                (MB, H, QK_ROPE // 2),
                stride=(cute.assume(spm, divby=4), cute.assume(sph, divby=4), 1),
            ),
        )
        gW = cute.make_tensor(w_ptr, cute.make_layout((H, QK_NOPE, NW), stride=(SWH, NW, 1)))
        gS = cute.make_tensor(
            s_ptr,
            cute.make_layout(
                (H, QK_NOPE, SCALE_BLOCKS),
                stride=(QK_NOPE * SCALE_BLOCKS, SCALE_BLOCKS, 1),
            ),
        )
        gO = cute.make_tensor(o_ptr, cute.make_layout(KV_LORA // cm.BLOCK_N * H * THREADS))
        floor_kernel(gQ, gP, gW, gS, gO, M).launch(
            grid=[KV_LORA // cm.BLOCK_N, H, 1], block=[THREADS, 1, 1], stream=stream
        )

    from cuda.bindings import driver as cuda
    from cutlass.cute.runtime import make_ptr

    fake = 1 << 20
    dev = os.environ.get("FLOOR_OFFLINE") != "1"
    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream if dev else 0)
    return cute.compile(
        host,
        *(make_ptr(cutlass.Int32, fake, assumed_align=16) for _ in range(3)),
        make_ptr(cutlass.Uint8, fake, assumed_align=16),
        make_ptr(cutlass.Int32, fake, assumed_align=16),
        *(cutlass.Int32(x) for x in (1, 128 * H, 128, 32 * H, 32)),
        stream,
    )


def launch(fn, q_nope, q_pe, values, scales, out):
    """One floor call: ``values`` is the weight as the fused kernel gets it (MXFP8 values, or
    vLLM's bf16 W_UK_T view); ``scales`` any 16-byte aligned tensor for BF16 (never read)."""
    import cutlass
    from cuda.bindings import driver as cuda
    from cutlass.cute.runtime import make_ptr

    stream = cuda.CUstream(torch.cuda.current_stream().cuda_stream)
    fn(
        make_ptr(cutlass.Int32, q_nope.data_ptr(), assumed_align=16),
        make_ptr(cutlass.Int32, q_pe.data_ptr(), assumed_align=16),
        make_ptr(cutlass.Int32, values.data_ptr(), assumed_align=16),
        make_ptr(cutlass.Uint8, scales.data_ptr(), assumed_align=16),
        make_ptr(cutlass.Int32, out.data_ptr(), assumed_align=16),
        q_nope.shape[0],
        q_nope.stride(0) // 2,
        q_nope.stride(1) // 2,
        q_pe.stride(0) // 2,
        q_pe.stride(1) // 2,
        stream,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--heads", type=int, nargs="+", default=[8, 11, 16])
    p.add_argument("--m", type=int, nargs="+", default=[1, 2], help="tokens (1..32)")
    p.add_argument("--weights", choices=("mxfp8", "bf16"), default="mxfp8")
    p.add_argument("--json", default=None, help="write the figures here")
    a = p.parse_args()
    reason = cm.unavailable_reason()
    if reason is not None:
        p.error(f"the CuTe kernel cannot run here: {reason}")
    samples = a.samples
    opts = options.Options(samples=samples)
    rows = []
    for h in a.heads:
        for m in a.m:
            t0 = time.time()
            bf16 = a.weights == "bf16"
            lay = harness.build_layers(a.weights, h, m, opts)
            n = len(lay.fused_w)
            w0 = lay.fused_w[0] if bf16 else lay.fused_w[0].values
            fn = build(h, cm.m_bucket(m), bf16, w0.stride(0) * w0.element_size() // 4)
            sink = torch.empty(
                KV_LORA // cm.BLOCK_N * h * threads(bf16), dtype=torch.int32, device="cuda"
            )

            def floor(i, lay=lay, fn=fn, sink=sink, bf16=bf16):
                w = lay.fused_w[i]
                values, scales = (w, sink) if bf16 else (w.values, w.scales)
                launch(fn, lay.q_nope, lay.q_pe, values, scales, sink)

            # (BF16: the product's own kernel, "auto"; MXFP8: the CuTe kernel)
            fused = harness.fused_step(lay, backend="auto" if bf16 else "cute")
            steps = {"fused": fused, "cute_floor": floor}
            steps.update(harness.floor_steps(lay))
            graphs = {k: harness.capture(harness.every_layer(lay, s)) for k, s in steps.items()}
            times = harness.time_graphs(graphs, opts.samples, opts.warmup)
            us = {k: harness.median_us(v, n) for k, v in times.items()}
            read = min(v for k, v in us.items() if k.startswith("read_w"))
            row = {
                "H": h,
                "M": m,
                "layers": n,
                **{f"{k}_us": v for k, v in us.items()},
                "read_us": read,
                "fused_over_read": us["fused"] / read,
                "cute_floor_over_read": us["cute_floor"] / read,
                "fused_over_cute_floor": us["fused"] / us["cute_floor"],
            }
            rows.append(row)
            print(
                f"H={h} M={m} ({time.time() - t0:.0f}s): fused {us['fused']:.3f} floor {us['cute_floor']:.3f} read {read:.3f} | fused/read {row['fused_over_read']:.3f} floor/read {row['cute_floor_over_read']:.3f}",
                flush=True,
            )
            del graphs, lay
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                {"rows": rows, "samples": samples, "environment": cli.environment(None)},
                f,
                indent=1,
            )


if __name__ == "__main__":
    if os.environ.get("FLOOR_OFFLINE") == "1":  # compile only, no GPU: H BUCKET [bf16]
        bf16 = sys.argv[3:] == ["bf16"]
        build(int(sys.argv[1]), int(sys.argv[2]), bf16, 448 * 256 if bf16 else None)
        print("compiled")
    else:
        main()
