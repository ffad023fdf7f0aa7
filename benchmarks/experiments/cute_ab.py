"""Versions of the CuTe DSL kernel side by side (and Triton's kernel beside them).

    git show REV:fusedq/kernels/cute_mla_query.py > /tmp/cute_old.py
    python benchmarks/experiments/cute_ab.py --old /tmp/cute_old.py [--new FILE] [--variant NAME=FILE ...]
        [--floors] [--weights mxfp8|bf16] [--samples 300] [--heads 8 11 16] [--m 1 2]
        [--json FILE]

Needs a CUDA GPU (sm_89+) and nvidia-cutlass-dsl. Each source file is loaded as a module of
its own (its own compile cache; the DSL reads a kernel's source, so each is copied to a file),
``--new`` defaulting to the installed fusedq's; ``--variant`` adds more (each must define
``launch_unchecked`` as the product module does). ``--floors`` adds fusedq-bench's read-only
floors of the weights to the same interleaved set and prints each version over the best of
them (the targets: 1.25 for MXFP8, 1.15 for BF16). For every (H, M): the weights (MXFP8,
or vLLM's bf16 W_UK_T view with ``--weights bf16``), BF16 and E4M3 out, each version's kernel
and Triton's (``backend="triton"``), captured in CUDA graphs over the layers fusedq-bench
rotates past 2x L2 and replayed interleaved (fusedq_bench.harness's timing). Every output is checked:
the max |error| against the staged path, and for E4M3 the number of bytes that differ from it
(one E4M3 step where bf16 rounding differs is within the tests' tolerance). The CuTe A/B
figures in benchmarks/results/raw/h200/*-cute-ab-*.json were taken so; add a run's --json to
benchmarks/results/h200.jsonl with benchmarks/scripts/ingest.py.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

import fusedq
from fusedq.dispatch import split_weight
from fusedq.kernels import cute_mla_query
from fusedq_bench import cli, harness, options


def load(name: str, source: Path, workdir: Path):
    """``source`` as module ``cute_<name>``, from a copy in ``workdir``."""
    path = workdir / f"cute_{name}.py"
    path.write_text(source.read_text())
    spec = importlib.util.spec_from_file_location(f"cute_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--old", type=Path, required=True, help="a cute_mla_query.py to compare")
    p.add_argument(
        "--new", type=Path, default=Path(cute_mla_query.__file__),
        help="another (default: the installed fusedq's)",
    )  # fmt: skip
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--heads", type=int, nargs="+", default=[8, 11, 16])
    p.add_argument("--m", type=int, nargs="+", default=[1, 2], help="tokens (1..32)")
    p.add_argument(
        "--variant", action="append", default=[], metavar="NAME=FILE", help="one more version"
    )
    p.add_argument("--floors", action="store_true", help="the read-only floors beside them")
    p.add_argument(
        "--weights", choices=("mxfp8", "bf16"), default="mxfp8",
        help="MXFP8 weights, or vLLM's bf16 W_UK_T view (versions that take bf16 weights)",
    )  # fmt: skip
    p.add_argument("--json", default=None, help="write the figures here")
    a = p.parse_args()
    sources = {"old": a.old, "new": a.new}
    for spec in a.variant:
        name, sep, file = spec.partition("=")
        if not sep or not name.isidentifier() or name in sources:
            p.error(f"--variant {spec!r}: expected NAME=FILE with a new identifier NAME")
        sources[name] = Path(file)
    for f in sources.values():
        if not f.is_file():
            p.error(f"{f}: no such file")
    reason = cute_mla_query.unavailable_reason()
    if reason is not None:
        p.error(f"the CuTe kernel cannot run here: {reason}")
    opts = options.Options(samples=a.samples)
    bf16_w = a.weights == "bf16"
    workdir = Path(tempfile.mkdtemp(prefix="cute_ab-"))
    mods = {name: load(name, f, workdir) for name, f in sources.items()}
    rows = []
    for h in a.heads:
        for m in a.m:
            t0 = time.time()
            bf = harness.build_layers("bf16" if bf16_w else "mxfp8", h, m, opts)
            e4 = harness.build_layers("e4m3" if bf16_w else "mxfp8-e4m3", h, m, opts)
            n = len(bf.fused_w)
            steps = {
                "bf16_triton": (bf, harness.fused_step(bf, backend="triton")),
                "e4m3_triton": (e4, harness.fused_step(e4, backend="triton")),
            }
            for name, mod in mods.items():
                for tag, lay in (("bf16", bf), ("e4m3", e4)):

                    def step(i, mod=mod, lay=lay):
                        values, scales = split_weight(lay.fused_w[i])
                        mod.launch_unchecked(
                            lay.q_nope, values, scales, lay.q_pe, lay.out, lay.q_scale
                        )

                    steps[f"{tag}_cute_{name}"] = (lay, step)
            if a.floors:
                steps.update({k: (bf, s) for k, s in harness.floor_steps(bf).items()})
            graphs = {
                k: harness.capture(harness.every_layer(lay, s)) for k, (lay, s) in steps.items()
            }
            times = harness.time_graphs(graphs, opts.samples, opts.warmup)
            floors = set(harness.floor_steps(bf)) if a.floors else set()
            errors = {
                k: harness.graph_error(steps[k][0], g) for k, g in graphs.items() if k not in floors
            }
            ref = fusedq.staged_mla_query(
                e4.q_nope, e4.fused_w[-1], e4.q_pe, out_dtype=e4.out_dtype, q_scale=e4.q_scale
            )
            differ = {}
            for k, g in graphs.items():
                if steps[k][0] is e4:
                    e4.out.fill_(0)
                    g.replay()
                    torch.cuda.synchronize()
                    differ[k] = int((e4.out.view(torch.uint8) != ref.view(torch.uint8)).sum())
            line = []
            for k, t in times.items():
                us = harness.median_us(t, n)
                rows.append(
                    {"H": h, "M": m, "variant": k, "us": us, "err": errors.get(k),
                     "mismatch_bytes": differ.get(k)}
                )  # fmt: skip
                line.append(f"{k}={us:.3f}")
            print(f"H={h} M={m} layers={n} ({time.time() - t0:.0f}s):", " ".join(line), flush=True)
            if a.floors:
                us = {r["variant"]: r["us"] for r in rows if r["H"] == h and r["M"] == m}
                read = min(v for k, v in us.items() if k.startswith("read_w"))
                over = {k: round(v / read, 3) for k, v in us.items() if k.startswith("bf16_")}
                print(f"   over the read floor ({read:.3f} us):", over)
            print("   err:", {k: round(v, 4) for k, v in errors.items()}, "differ:", differ)
            del graphs, bf, e4
            torch.cuda.empty_cache()
    if a.json:
        with open(a.json, "w") as f:
            env = cli.environment(None)
            json.dump({"rows": rows, "samples": a.samples, "environment": env}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
