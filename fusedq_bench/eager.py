"""``fusedq-bench --eager``: host time per call of the query step outside CUDA graphs.

Wherever the query step runs eagerly (``--enforce-eager``, piecewise graphs that leave
attention out, batch sizes past the captured ones, MTP verification), each layer of each
step pays the host time of its launch path; the GPU work is a few µs, so host time is what
counts. Side by side in one run, for each (format, H, M), on vLLM's strided ``W_UK_T`` and a
sliced ``q``:

- ``public``: ``fusedq.mla_query_projection`` allocating ``out`` (as the vLLM hook calls it);
- ``public_out``: the same with a preallocated ``out`` (adds the per-call overlap check);
- ``hook``: ``fusedq.vllm.query.decode_query`` — exactly what replaces vLLM's staged block;
- ``custom_op``: ``torch.ops.fusedq.mla_query_projection`` (the dispatcher + the plan);
- ``bare``: ``kernels.triton_launch.launch`` (no validation, no plan: the config, the key
  and Triton's JIT launch on every call);
- ``staged_032`` / ``staged_026``: vLLM's block, BF16: ``bmm`` into a token-major buffer
  through a transposed view (0.32) or into a head-major buffer then transposed (0.26), then
  the ``torch.cat`` with ``q_pe`` that the backends do. MXFP8's baseline is the BF16 block
  (as in the graph benchmark). For E4M3 output the block is followed by a torch-native
  quantisation (``x * (1 / q_scale)``, clamp, cast), a stand-in for vLLM's one-kernel
  ``QuantFP8`` op that costs more host time than it.

Each path runs ``calls`` times back to back with ``torch.cuda.synchronize`` only before and
after; the figure is the best of ``repeats`` such runs (paths interleaved ABBA between
repeats), in µs per call. With the GPU work far shorter than the host time, the queue never
backs up and the wall time per call is the host time.

With ``--front`` the paths are the decode front's (``FRONT_PATHS``), which vLLM's piecewise
steps run eagerly once per layer (a request's first step under MTP, mixed batches):

- ``front_public``: ``fusedq.mla_decode_front(..., backend="auto")`` allocating the query,
  as the vLLM hook calls it;
- ``front_custom_op``: ``torch.ops.fusedq.mla_decode_front`` into a preallocated query;
- ``vllm_front``: vLLM's best front as its piecewise step runs it, ``concat_and_cache_mla_rope_
  fused`` then the served staged query (where vLLM is importable), else ``staged_front``:
  the staged RoPE, query and cache write of ``fusedq-bench --front``;
- ``query_public``: ``fusedq.mla_query_projection`` on the same q, the query alone;
- ``rest_reference``: what the vLLM hook runs, in a compiled server's mixed step, on the rows
  the front leaves when vLLM's RoPE + cache-write fusion is not used: the reference's RoPE of
  q's rope part and k_pe in place (``fusedq.front_reference.rope``, Inductor's numerics), then
  the cache write; ``rest_vllm``: vLLM's fusion on the same rows, one launch (where vLLM is
  importable).

On a machine without CUDA this mode refuses: under ``TRITON_INTERPRET=1`` the kernel itself
runs in Python, so the host time would measure the interpreter, not the launch path.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable

from fusedq.contract import GLM5, KV_LORA, QK_ROPE, QUERY_WIDTH
from fusedq_bench.common import RECIPES, abba_order, md_table, out_dtype_of

# --eager times host cost per call, which the geometry does not change: GLM-5's shapes.
QK_NOPE = GLM5.qk_nope
V_HEAD = GLM5.v_head

CALL_PATHS = ("public", "public_out", "hook", "custom_op", "bare", "staged_032", "staged_026")
FRONT_PATHS = (
    "front_public", "front_custom_op", "vllm_front", "staged_front", "query_public",
    "rest_reference", "rest_vllm",
)  # fmt: skip
# The fused paths compared with the staged block, and the staged variant each is divided by.
RATIOS = {
    "public_over_staged": ("public", "staged_032"),
    "hook_over_staged": ("hook", "staged_032"),
}
NO_CUDA = (
    "fusedq-bench --eager needs a CUDA GPU: on CPU the Triton interpreter runs the kernel in "
    "Python, so the host time per call would measure the interpreter, not the launch path"
)


@dataclasses.dataclass
class EagerOperands:
    """One (format, H, M): the tensors every path reads, as vLLM holds them."""

    q_nope: object  # [M, H, 192] slice of q
    q_nope_t: object  # vLLM's (N, B, P) transposed view of it
    q_pe: object
    staged_w: object  # bf16 W_UK_T view [H, QK_NOPE, KV_LORA] of [H, QK_NOPE + V_HEAD, KV_LORA]
    fused_w: object  # the same, or its MXFP8 quantisation
    out: object
    out_dtype: object
    q_scale: object


def eager_operands(fmt: str, h: int, m: int, q_scale: float, device=None) -> EagerOperands:
    import torch

    import fusedq

    dev = torch.device(device or "cuda")
    # vLLM's W_UK_T is a strided view into kv_b_proj's [H, qk_nope + v_head, kv_lora] weight,
    # and q_nope / q_pe are slices of one [M, H, qk_nope + rope] q.
    w = torch.randn(h, QK_NOPE + V_HEAD, KV_LORA, device=dev, dtype=torch.bfloat16) * 0.05
    w = w[:, :QK_NOPE, :]
    q = torch.randn(m, h, QK_NOPE + QK_ROPE, device=dev, dtype=torch.bfloat16)
    weight_format, out_fp8 = RECIPES[fmt]
    out_dtype = out_dtype_of(out_fp8)
    return EagerOperands(
        q_nope=q[..., :QK_NOPE],
        q_nope_t=q[..., :QK_NOPE].transpose(0, 1),
        q_pe=q[..., QK_NOPE:],
        staged_w=w,
        fused_w=fusedq.quantize_mxfp8(w) if weight_format == "mxfp8" else w,
        out=torch.empty(m, h, QUERY_WIDTH, device=dev, dtype=out_dtype),
        out_dtype=out_dtype,
        q_scale=torch.tensor([q_scale], device=dev) if out_fp8 else None,
    )


def eager_paths(ops: EagerOperands) -> dict[str, Callable[[], object]]:
    """One call of each path on ``ops``, as zero-argument closures."""
    import torch

    import fusedq
    import fusedq.ops
    from fusedq.dispatch import split_weight
    from fusedq.kernels import triton_launch
    from fusedq.reference import quantize_e4m3
    from fusedq.selection import launch_config
    from fusedq.vllm.query import decode_query

    values, scales = split_weight(ops.fused_w)
    q_nope, q_nope_t, q_pe, w = ops.q_nope, ops.q_nope_t, ops.q_pe, ops.staged_w
    out, out_dtype, q_scale = ops.out, ops.out_dtype, ops.q_scale
    n, b, _ = q_nope_t.shape
    pdl = triton_launch.DEFAULT_PDL
    weight_format = "bf16" if scales is None else "mxfp8"
    out_fp8 = q_scale is not None

    def bare():
        # The configuration chosen per call, as the launch did before plans existed.
        config = launch_config(n, b, weight_format, out_fp8)
        return triton_launch.launch(q_nope, values, scales, q_pe, out, q_scale, config=config)

    custom_op = torch.ops.fusedq.mla_query_projection

    def finish(ql_nope):
        cat = torch.cat((ql_nope, q_pe), dim=-1)
        return cat if q_scale is None else quantize_e4m3(cat, q_scale)

    def staged_032():
        ql_nope = q_nope_t.new_empty((b, n, KV_LORA))
        torch.bmm(q_nope_t, w, out=ql_nope.transpose(0, 1))
        return finish(ql_nope)

    def staged_026():
        ql_nope = q_nope_t.new_empty((n, b, KV_LORA))
        torch.bmm(q_nope_t, w, out=ql_nope)
        return finish(ql_nope.transpose(0, 1))

    return {
        "public": lambda: fusedq.mla_query_projection(
            q_nope, ops.fused_w, q_pe, out_dtype=out_dtype, q_scale=q_scale
        ),
        "public_out": lambda: fusedq.mla_query_projection(
            q_nope, ops.fused_w, q_pe, out=out, q_scale=q_scale
        ),
        "hook": lambda: decode_query(
            q_nope_t, ops.fused_w, q_pe, out_dtype=out_dtype, q_scale=q_scale
        ),
        "custom_op": lambda: custom_op(q_nope, values, scales, q_pe, out, q_scale, "auto", pdl),
        "bare": bare,
        "staged_032": staged_032,
        "staged_026": staged_026,
    }


def time_paths(
    paths: dict[str, Callable[[], object]], calls: int, repeats: int, warmup: int
) -> dict[str, list[float]]:
    """µs per call of every path, one figure per repeat; paths ABBA-interleaved."""
    import torch

    for fn in paths.values():
        for _ in range(warmup):
            fn()
    torch.cuda.synchronize()
    per_call: dict[str, list[float]] = {name: [] for name in paths}
    for name in abba_order(list(paths), repeats):
        fn = paths[name]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
        per_call[name].append((time.perf_counter() - start) / calls * 1e6)
    return per_call


def eager_row(fmt: str, h: int, m: int, per_call: dict[str, list[float]]) -> dict:
    """The figures of one shape: best and median µs per call of each path, and the ratios."""
    import statistics

    row: dict = {"format": fmt, "H": h, "M": m}
    for name, runs in per_call.items():
        row[f"{name}_us"] = min(runs)
        row[f"{name}_median_us"] = statistics.median(runs)
    for ratio, (fused, staged) in RATIOS.items():
        if f"{fused}_us" in row and f"{staged}_us" in row:
            row[ratio] = row[f"{fused}_us"] / row[f"{staged}_us"]
    return row


def eager_shape(fmt: str, h: int, m: int, opts) -> dict:
    """Measure every path at one shape; the fused result is checked against staged too."""
    import torch

    import fusedq

    ops = eager_operands(fmt, h, m, opts.q_scale)
    per_call = time_paths(eager_paths(ops), opts.eager_calls, opts.eager_repeats, opts.warmup)
    row = eager_row(fmt, h, m, per_call)
    got = fusedq.mla_query_projection(
        ops.q_nope, ops.fused_w, ops.q_pe, out_dtype=ops.out_dtype, q_scale=ops.q_scale
    )
    ref = fusedq.staged_mla_query(
        ops.q_nope, ops.fused_w, ops.q_pe, out_dtype=ops.out_dtype, q_scale=ops.q_scale
    )
    row["max_abs_err_vs_staged"] = float((got.float() - ref.float()).abs().max())
    row["calls"], row["repeats"] = opts.eager_calls, opts.eager_repeats
    del ops
    torch.cuda.synchronize()
    return row


def front_paths(fr, vllm_op) -> dict[str, Callable[[], object]]:
    """One eager call of each front path on ``fr`` (``fusedq_bench.front.Front``), as
    zero-argument closures; ``vllm_op``: vLLM's RoPE + cache-write op, or None."""
    import torch

    import fusedq
    import fusedq.ops
    from fusedq import front_reference
    from fusedq.dispatch import split_weight
    from fusedq_bench import front

    lay = fr.lay
    w = lay.fused_w[0]
    values, scales = split_weight(w)
    cache = fr.caches[0]
    out = torch.empty(lay.out.shape, dtype=lay.out_dtype, device=lay.out.device)
    op = torch.ops.fusedq.mla_decode_front
    baseline = (
        ("vllm_front", front.vllm_fused_front_step(fr, vllm_op))
        if vllm_op is not None
        else ("staged_front", front.staged_front_step(fr))
    )

    def front_public():
        return fusedq.mla_decode_front(
            fr.q, fr.kv_c, fr.k_pe, fr.positions, fr.cos_sin, w, cache, fr.slot_mapping,
            is_neox=front.IS_NEOX, kv_cache_dtype="auto", k_scale=fr.k_scale,
            out_dtype=lay.out_dtype, q_scale=lay.q_scale, backend="auto",
        )  # fmt: skip

    def front_custom_op():
        return op(
            fr.q, fr.kv_c, fr.k_pe, fr.positions, fr.cos_sin, values, scales, cache,
            fr.slot_mapping, out, fr.k_scale, lay.q_scale, front.IS_NEOX, "auto", "auto",
        )  # fmt: skip

    q_pe = fr.q[..., lay.geometry.qk_nope :]

    def rest_reference():
        # As the hook's rows after the front's: RoPE in place, then the cache write.
        q_pe.copy_(front_reference.rope(q_pe, fr.positions, fr.cos_sin, front.IS_NEOX))
        fr.k_pe.copy_(front_reference.rope(fr.k_pe, fr.positions, fr.cos_sin, front.IS_NEOX))
        fr.cache_write(fr.kv_c, fr.k_pe, cache, fr.slot_mapping, fr.k_scale)

    paths = {
        "front_public": front_public,
        "front_custom_op": front_custom_op,
        baseline[0]: lambda: baseline[1](0),
        "query_public": lambda: fusedq.mla_query_projection(
            lay.q_nope, w, lay.q_pe, out_dtype=lay.out_dtype, q_scale=lay.q_scale
        ),
        "rest_reference": rest_reference,
    }
    if vllm_op is not None:
        paths["rest_vllm"] = lambda: vllm_op(
            fr.positions, q_pe, fr.k_pe, fr.kv_c, fr.cos_sin, front.IS_NEOX, fr.slot_mapping,
            cache, "auto", fr.k_scale,
        )  # fmt: skip
    return paths


def auto_front_choice(fr, fmt: str) -> str:
    """What ``backend="auto"`` runs at ``fr``'s shape: the fused kernel's tiles, or staged and
    why."""
    from fusedq import front_dispatch

    lay = fr.lay
    m, h = lay.q_nope.shape[0], lay.q_nope.shape[1]
    config, why = front_dispatch.choice(
        h, m, geometry=lay.geometry, weight_format=RECIPES[fmt][0], out_dtype=lay.out_dtype,
        cache_fp8=False, device=lay.q_nope.device,
    )  # fmt: skip
    if config is None:
        return f"staged ({why})"
    return f"fused (BLOCK_M {config.block_m} BLOCK_N {config.block_n} {config.num_warps} warps)"


def eager_front_shape(fmt: str, h: int, m: int, opts) -> dict:
    """The front's eager paths at one shape (``--eager --front``); the row names the kernel
    ``backend="auto"`` chose (or staged) and vLLM's op where it was missing."""
    import torch

    import fusedq
    from fusedq_bench import front

    fr = front.build_front(fmt, h, m, opts)
    fusedq.prewarm_decode_front(
        fr.lay.fused_w[0], [m], is_neox=front.IS_NEOX, out_dtype=fr.lay.out_dtype,
        cos_sin_dtype=fr.cos_sin.dtype, positions_dtype=fr.positions.dtype,
    )  # fmt: skip
    vllm_op, why = front.vllm_rope_cache_op(torch.device("cuda"))
    per_call = time_paths(front_paths(fr, vllm_op), opts.eager_calls, opts.eager_repeats,
                          opts.warmup)  # fmt: skip
    row = eager_row(fmt, h, m, per_call)
    row["front"] = True
    row["front_choice"] = auto_front_choice(fr, fmt)
    if vllm_op is None:
        row["vllm_front_missing"] = why
    base = "vllm_front" if vllm_op is not None else "staged_front"
    for fused in ("front_public", "front_custom_op"):
        row[f"{fused}_over_{base}"] = row[f"{fused}_us"] / row[f"{base}_us"]
    row["calls"], row["repeats"] = opts.eager_calls, opts.eager_repeats
    del fr
    torch.cuda.synchronize()
    return row


def run(opts) -> list[dict]:
    """Every (format, H, M) of ``opts``; refuses without CUDA (see the module docstring)."""
    import torch

    if not torch.cuda.is_available():
        raise SystemExit(NO_CUDA)
    rows = []
    for fmt in opts.formats:
        for h in opts.heads:
            for m in opts.ms:
                try:
                    shape = eager_front_shape if opts.front else eager_shape
                    row = shape(fmt, h, m, opts)
                except Exception as exc:  # one broken shape must not lose the others
                    row = {"format": fmt, "H": h, "M": m, "error": repr(exc)}
                print(one_line(row), flush=True)
                rows.append(row)
    return rows


def one_line(row: dict) -> str:
    if "error" in row:
        return f"eager {row['format']} H={row['H']} M={row['M']}: FAILED {row['error']}"
    names = FRONT_PATHS if row.get("front") else CALL_PATHS
    paths = " ".join(f"{p}={row[f'{p}_us']:.1f}" for p in names if f"{p}_us" in row)
    return f"eager {row['format']} H={row['H']} M={row['M']} µs/call: {paths}"


def format_table(rows: list[dict]) -> str:
    """Markdown table: best µs per call of every path, and fused/staged."""
    if rows and all(r.get("front") or "error" in r for r in rows):
        return format_front_table(rows)
    return _paths_table(
        rows, CALL_PATHS, ["public/staged", "hook/staged"],
        lambda r: [f"{r[k]:.2f}" if k in r else "-" for k in RATIOS],
    )  # fmt: skip


def format_front_table(rows: list[dict]) -> str:
    """Markdown table of ``--eager --front``: best µs per call of every front path, the
    fused front over vLLM's (or the staged) front, and what ``backend="auto"`` ran."""

    def tail(r: dict) -> list[str]:
        ratio = next((v for k, v in r.items() if k.startswith("front_public_over_")), None)
        return ["-" if ratio is None else f"{ratio:.2f}", r.get("front_choice", "-")]

    return _paths_table(rows, FRONT_PATHS, ["front/vLLM", "auto ran"], tail)


def _paths_table(
    rows: list[dict], paths: tuple[str, ...], tail_header: list[str],
    tail: Callable[[dict], list[str]],
) -> str:  # fmt: skip
    """One line a shape: its best µs per call of each of ``paths``, then ``tail(row)``."""
    header = ["format", "H", "M", *(f"{p} µs" for p in paths), *tail_header]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["format"], r["H"], r["M"], f"error: {r['error']}"])
            continue
        cells = [f"{r[f'{p}_us']:.1f}" if f"{p}_us" in r else "-" for p in paths]
        body.append([r["format"], r["H"], r["M"], *cells, *tail(r)])
    return md_table(header, body)
