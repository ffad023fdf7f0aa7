"""``fusedq-bench``: the fused kernel against vLLM's staged path, in CUDA-graph replay.

For each (format, H, M) four graphs are captured, each holding one call per layer with the
weights rotated over enough layers to exceed ``--l2-factor`` x L2 (so every call reads its
weight from HBM, as in a real forward pass):

- ``fused``: ``mla_query_projection`` (one launch per layer);
- ``staged``: vLLM 0.32's staged block (``reference.staged``, form "bmm+cat"): ``torch.bmm`` on
  the strided ``W_UK_T`` view, then ``torch.cat`` with ``q_pe`` (BF16 out), or ``bmm`` + a
  one-kernel concat-and-quantise, as vLLM's op (E4M3 out);
- ``bmm``: vLLM 0.26's FLASH_ATTN_MLA form (form "bmm"): the ``torch.bmm`` alone, since that
  backend takes the (nope, pe) pair. What the served vLLM runs for BF16 output; each row names
  its ``served_baseline`` (``reference.SERVED_FORM``);
- ``copy``: a device copy of exactly the weight bytes of each layer, the physical anchor.

The staged baselines of MXFP8 are the BF16 staged path's.

Replays are interleaved ABBA-style, each timed with CUDA events; the figure is the median
replay divided by the number of layers.

``--chain`` puts each call where vLLM has it: after the ``q_b_proj`` GEMM that writes ``q``
and an elementwise KV-cache write (``concat_and_cache_mla``'s shape), neither of which lets
dependents start early. A fourth graph holds only those predecessors, and every figure is
the increment over it: what the query step adds to a decode layer. It also times the fused
kernel with programmatic dependent launch (``fused_pdl``), so PDL is judged behind the
kernels it would really follow, not behind itself. ``--sweep`` times launch-config variants of the
fused kernel instead, to pick the heuristic.

``--floors`` adds, in the same ABBA set, what no single-launch version of the operation can
beat in this harness: ``empty`` (a kernel node that stores one word per CTA and loads nothing:
the graph's per-launch cost) and ``read`` (one launch that only reads the layer's weight bytes,
contiguous, 16-byte vectors, every load issued before any use; the fastest of five tile sizes
``read_w{256,...,4096}``, each timed). ``read / staged`` is the lowest fused/staged ratio any
one-launch kernel could show, since the fused kernel must at least read those bytes. Beside
them, kernels that each do less than the fused one must, to say where the rest goes:
``store_w*`` (the reads, then the output bytes written), ``grid`` (the read kernel on the fused
kernel's own CTA count), ``split_k`` (the read floor's grid joined over K by atomics),
``view`` (the fused kernel's own tiles of the real weight view, no math) and, on sm_90+ with
Gluon, ``view_tma`` (those tiles read by TMA bulk copies); see FLOOR_SPLIT_K.

``--front`` times the whole decode front per layer instead (``fusedq_bench.front``):
``staged_front``, vLLM's three launches (its rotary embedding compiled by inductor, the served
staged query, its ``concat_and_cache_mla``), against ``fused_front``, one
``mla_decode_front`` launch, with the query alone of each beside them.

``--eager`` measures something else: host time per call outside graphs (``eager``); with
``--front``, of the decode front's eager paths.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from collections.abc import Sequence

from fusedq import provenance
from fusedq_bench import eager, front
from fusedq_bench.bars import floor_bars, format_floor_bars
from fusedq_bench.common import (
    FORMATS,
    NvidiaSmiError,
    nvidia_smi,
)
from fusedq_bench.options import DEFAULT_L2_MB, Options
from fusedq_bench.replay import bench_shape
from fusedq_bench.sweep import parse_gluon_spec, sweep_shape
from fusedq_bench.tables import SERVED_NOTE, format_table


def environment(commit: str | None) -> dict:
    import platform

    import torch
    import triton

    import fusedq

    code = provenance.describe()
    env = {
        "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "host": platform.node(),
        "gpu": torch.cuda.get_device_name(),
        "capability": list(torch.cuda.get_device_capability()),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "triton": triton.__version__,
        "fusedq": fusedq.__version__,
        "python": platform.python_version(),
        "commit": commit or provenance.commit_label(code),
        # The code that ran, by commit and fingerprint, even from a copied tree whose .git is
        # stale or absent (fusedq.provenance).
        "provenance": code,
        "FUSEDQ_PDL": os.environ.get("FUSEDQ_PDL", "0"),
    }
    query = "name,clocks.sm,clocks.mem,clocks.max.sm,clocks.max.mem,power.limit,driver_version"
    try:
        out = nvidia_smi([f"--query-gpu={query}", "--format=csv,noheader"])
        env["nvidia_smi"] = dict(zip(query.split(","), out.strip().split(", "), strict=False))
    except NvidiaSmiError as exc:
        env["nvidia_smi"] = f"unavailable: {exc}"
    return env


class NoCudaError(SystemExit):
    """No CUDA GPU here: `main` says so in one line and exits 2, the usage code (nothing was
    measured); other callers of `run` exit with the message, as SystemExit does."""


# Exit code of a refusal before anything ran (argparse's for bad arguments).
EXIT_USAGE = 2


def run(opts: Options) -> dict:
    """Run the benchmark (or the sweep) and return every figure."""
    import torch

    if not torch.cuda.is_available():
        raise NoCudaError(eager.NO_CUDA if opts.eager else "fusedq-bench needs a CUDA GPU")
    result = {"environment": environment(opts.commit), "options": dataclasses.asdict(opts)}
    if opts.eager:
        result["eager"] = eager.run(opts)
        return result
    rows: list[dict] = []
    for fmt in opts.formats:
        for h in opts.heads:
            for m in opts.ms:
                t0 = time.time()
                try:
                    new = _one(fmt, h, m, opts, t0)
                except Exception as exc:  # one broken shape must not lose the others
                    print(f"{fmt} H={h} M={m}: FAILED {type(exc).__name__}: {exc}", flush=True)
                    new = [{"format": fmt, "H": h, "M": m, "error": repr(exc)}]
                rows.extend(new)
    result["sweep" if opts.sweep else "rows"] = rows
    return result


def _one(fmt: str, h: int, m: int, opts: Options, t0: float) -> list[dict]:
    if opts.front:
        return front.run_front(fmt, h, m, opts)
    if opts.sweep:
        new = sweep_shape(fmt, h, m, opts)
        baselines = {r["variant"]: r["us"] for r in new if r["variant"] in ("staged", "bmm")}
        best = min((r for r in new if r["variant"] not in baselines), key=lambda r: r["us"])
        print(
            f"sweep {fmt} H={h} M={m}: best {best['variant']} {best['us']:.2f} µs, "
            f"staged {baselines['staged']:.2f} µs, bmm {baselines['bmm']:.2f} µs; "
            + " ".join(
                f"{r['variant']}={r['us']:.2f}"
                + (
                    f"(err {r['max_abs_err_vs_staged']:.2g})"
                    if r["max_abs_err_vs_staged"] is not None
                    else ""
                )
                for r in new
            ),
            flush=True,
        )
    else:
        new = [bench_shape(fmt, h, m, opts)]
        r = new[0]
        print(
            f"{fmt} H={h} M={m} L={r['layers']}: fused {r['fused_us']:.2f} µs, "
            f"bmm+cat {r['staged_us']:.2f} µs, bmm-only {r['bmm_us']:.2f} µs, "
            f"copy {r['copy_us']:.2f} µs, ratio {r['fused_over_staged']:.3f} / "
            f"{r['fused_over_bmm']:.3f} / {r['fused_over_copy']:.3f}, "
            + (
                f"PDL {r['fused_pdl_us']:.2f} µs ({r['fused_pdl_over_staged']:.3f}), "
                if "fused_pdl_us" in r
                else ""
            )
            + (
                f"floors: read {r['read_us']:.2f} µs ({r['read_over_staged']:.3f}), "
                f"empty {r['empty_us']:.2f} µs, "
                if "read_us" in r
                else ""
            )
            + "".join(f"{k} {r[f'{k}_us']:.2f} µs, " for k in ("triton", "cute") if f"{k}_us" in r)
            + f"err {r['max_abs_err_vs_staged']:.3g} ({time.time() - t0:.1f} s)",
            flush=True,
        )
    return new


def _ints(text: str) -> list[int]:
    """One --heads/--m value: an integer or a comma list (``8,16,32``)."""
    try:
        return [int(x) for x in text.split(",") if x]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer or a comma list") from None


def parse_args(argv: Sequence[str] | None) -> tuple[Options, str | None]:
    from fusedq.contract import GEOMETRIES, QUALIFIED

    p = argparse.ArgumentParser(prog="fusedq-bench", description=__doc__.split("\n")[0])
    p.add_argument(
        "--geometry",
        choices=[g.name for g in GEOMETRIES],
        default=Options.geometry,
        help="the MLA geometry to time (its rows name it); --heads defaults to its qualified heads",
    )
    p.add_argument("--heads", type=_ints, nargs="+", default=None, help="e.g. 8,16,32 or 8 16 32")
    p.add_argument(
        "--m",
        type=_ints,
        nargs="+",
        default=None,
        dest="ms",
        help="e.g. 1,16,32; default: the decode buckets 1..32, then every 16 to the "
        "geometry's largest qualified M",
    )
    p.add_argument("--formats", nargs="+", choices=FORMATS, default=list(FORMATS))
    p.add_argument("--samples", type=int, default=Options.samples, help="timed replays per graph")
    p.add_argument("--warmup", type=int, default=Options.warmup)
    p.add_argument("--l2-mb", type=float, default=DEFAULT_L2_MB)
    p.add_argument("--l2-factor", type=float, default=2.0)
    p.add_argument("--chain", action="store_true", help="time each call behind vLLM's predecessors")
    p.add_argument("--sweep", action="store_true", help="time launch-config variants instead")
    p.add_argument(
        "--floors", action="store_true", help="also time an empty and a read-only kernel per layer"
    )
    p.add_argument("--sweep-block-n", type=int, nargs="*", default=list(Options.sweep_block_n))
    p.add_argument("--sweep-warps", type=int, nargs="+", default=list(Options.sweep_warps))
    p.add_argument("--sweep-block-k", type=int, nargs="+", default=list(Options.sweep_block_k))
    p.add_argument("--sweep-pdl", type=int, nargs="+", default=list(Options.sweep_pdl))
    p.add_argument(
        "--sweep-block-m",
        type=int,
        nargs="*",
        default=list(Options.sweep_block_m),
        choices=(16, 32, 64),
        help="tl.dot variants' rows per CTA (64 tiles M); default: M padded to 16/32/64",
    )
    p.add_argument("--sweep-fma", nargs="*", default=[], help="register-path BLOCK_N:WARPS")
    p.add_argument("--sweep-fma-pdl", nargs="*", default=[], help="the same, with PDL")
    p.add_argument(
        "--sweep-cute",
        action="store_true",
        help="--sweep: also time the CuTe DSL MXFP8 kernel (needs nvidia-cutlass-dsl)",
    )
    p.add_argument(
        "--sweep-gluon", nargs="*", default=[], help="Gluon-kernel BLOCK_N:WARPS[:BLOCK_M]"
    )
    p.add_argument(
        "--sweep-gluon-operands",
        nargs="+",
        choices=("convert", "smem", "direct"),
        default=list(Options.sweep_gluon_operands),
        help="the Gluon operand paths to time for each --sweep-gluon spec",
    )
    p.add_argument(
        "--sweep-e4m3",
        nargs="+",
        default=[],
        choices=("mul", "wide", "div", "noscale"),
        help="--sweep, E4M3 formats: time each variant again with these epilogues: mul (vLLM's "
        "quantisation stored from the MMA layout), wide (the same stored 16 bytes a thread "
        "through shared memory; Gluon only), div (an IEEE division by q_scale per element, the "
        "old one), noscale (no scaling; wrong output)",
    )
    p.add_argument(
        "--sweep-fence",
        action="store_true",
        help="--sweep, BF16 formats: time each Gluon and register-path variant again with its "
        "scheduling fence after the loads flipped (on for the register path, off for Gluon)",
    )
    p.add_argument(
        "--front",
        action="store_true",
        help="time the decode front (RoPE, query, KV-cache write): vLLM's three launches "
        "against one mla_decode_front launch, and the query alone of each",
    )
    p.add_argument(
        "--eager",
        action="store_true",
        help="host time per call outside CUDA graphs: public op, custom op, bare launch, "
        "vLLM's staged block (with --front: the decode front's, against vLLM's front)",
    )
    p.add_argument("--calls", type=int, default=Options.eager_calls, help="--eager: calls per run")
    p.add_argument(
        "--repeats",
        type=int,
        default=Options.eager_repeats,
        help="--eager: runs per path (best taken)",
    )
    p.add_argument("--commit", default=None, help="commit to record (default: git rev-parse)")
    p.add_argument("--json", default=None, help="write every figure to this path")
    a = p.parse_args(argv)
    if a.eager:
        # --eager --front: the front's eager paths (fusedq_bench.eager.FRONT_PATHS).
        clash = [f for f in ("chain", "sweep", "floors") if getattr(a, f)]
        if clash:
            p.error(f"--eager times calls outside graphs; it does not combine with --{clash[0]}")
    if a.front:
        clash = [f for f in ("chain", "sweep", "floors") if getattr(a, f)]
        if clash:
            p.error(f"--front times its own set of paths; it does not combine with --{clash[0]}")
    for flag in ("sweep_cute", "sweep_e4m3", "sweep_fence"):
        if getattr(a, flag) and not a.sweep:
            name = "--" + flag.replace("_", "-")
            p.error(f"{name} adds variants to --sweep; pass --sweep too")
    for spec in a.sweep_gluon:
        try:
            parse_gluon_spec(spec)
        except ValueError as exc:
            p.error(str(exc))
    if a.calls < 1 or a.repeats < 1:
        p.error(f"--calls {a.calls} and --repeats {a.repeats} must be at least 1")
    heads = [QUALIFIED[a.geometry].heads] if a.heads is None else a.heads
    if a.ms is None:  # past the buckets, the graph sizes vLLM captures (every 8) every 16
        top = max(QUALIFIED[a.geometry].max_m_for(h) for h in QUALIFIED[a.geometry].heads)
        a.ms = [[*Options.ms, *range(Options.ms[-1] + 16, top + 1, 16)]]
    heads, ms = [h for group in heads for h in group], [m for group in a.ms for m in group]
    if not heads or not ms or min(heads) < 1 or min(ms) < 1:
        p.error(f"--heads {heads} and --m {ms} must be positive integers")
    opts = Options(
        heads=tuple(heads), ms=tuple(ms), geometry=a.geometry, formats=tuple(a.formats),
        samples=a.samples,
        warmup=a.warmup, l2_mb=a.l2_mb, l2_factor=a.l2_factor, chain=a.chain, sweep=a.sweep,
        floors=a.floors, front=a.front, eager=a.eager, eager_calls=a.calls,
        eager_repeats=a.repeats,
        sweep_block_n=tuple(a.sweep_block_n), sweep_warps=tuple(a.sweep_warps),
        sweep_block_k=tuple(a.sweep_block_k), sweep_pdl=tuple(a.sweep_pdl),
        sweep_block_m=tuple(a.sweep_block_m),
        sweep_fma=tuple(a.sweep_fma), sweep_fma_pdl=tuple(a.sweep_fma_pdl),
        sweep_cute=a.sweep_cute, sweep_gluon=tuple(a.sweep_gluon),
        sweep_gluon_operands=tuple(a.sweep_gluon_operands),
        sweep_e4m3=tuple(a.sweep_e4m3), sweep_fence=a.sweep_fence, commit=a.commit,
    )  # fmt: skip
    return opts, a.json


def main(argv: Sequence[str] | None = None) -> int:
    opts, json_path = parse_args(argv)
    try:
        result = run(opts)
    except NoCudaError as exc:
        print(exc, file=sys.stderr)  # one line, naming the tool
        return EXIT_USAGE
    if opts.eager:
        print(eager.format_table(result["eager"]))
    elif opts.front:
        print(front.format_front_table(result["rows"]))
    elif not opts.sweep:
        print(format_table(result["rows"]))
        print(SERVED_NOTE)
        if opts.floors:
            result["floor_bars"] = floor_bars(result["rows"])
            print(format_floor_bars(result["floor_bars"]))
    if json_path:
        with open(json_path, "w") as f:
            json.dump(result, f, indent=1)
        print(f"wrote {json_path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
