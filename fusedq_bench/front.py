"""``--front``: the whole MLA decode front per layer, fused against what vLLM runs.

vLLM runs the front of each decode layer as three graph nodes, each paying the node's cost
before it works; ``fusedq.mla_decode_front`` is one. Per shape, in the same ABBA set:

- ``staged_front``: (1) RoPE of q_pe (in place, in q's rope slice) and k_pe: vLLM's own
  rotary embedding's ``forward_native`` under ``torch.compile``, the inductor kernel vLLM
  serves (``fusedq.front_reference.rope`` compiled the same way where vLLM does not
  import); (2) the staged query in the form the served vLLM runs (``reference.SERVED_FORM``:
  the bmm alone for BF16 out, bmm + one concat-and-quantise launch for E4M3); (3) the
  KV-cache write, vLLM's ``concat_and_cache_mla`` CUDA op (torch indexing where it is not
  built). Each row names what ran (``staged_front_kernel``).
- ``fused_front``: ``mla_decode_front(..., backend="triton")``, one launch.
- ``staged_query`` / ``fused_query``: the query step alone (the served staged form; the
  product's ``mla_query_projection``), so a row shows the front's saving beside the query's;
  ``fused_query_dot``: the query alone with the front's own tl.dot launch config, so
  ``fused_front - fused_query_dot`` is what RoPE and the cache write add inside the kernel.

The weights (``W_UK_T`` as vLLM's strided view, MXFP8 for the fused paths where the format
says) and the KV caches rotate per layer past L2 as ``harness.build_layers`` lays them out.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable

from fusedq.contract import KV_LORA, QK_ROPE, QUERY_WIDTH
from fusedq_bench.common import md_table
from fusedq_bench.harness import (
    Layers,
    build_layers,
    capture,
    every_layer,
    fused_step,
    median_us,
    staged_step,
    time_graphs,
)
from fusedq_bench.options import Options

# positions are drawn below this; the cos_sin_cache has at least as many rows.
MAX_POSITION = 4096
# vLLM's KV-cache block size for MLA.
BLOCK_SIZE = 16
# Blocks of each layer's cache (more where M needs them): its slots are drawn without repeats.
MIN_BLOCKS = 64
# The rotary embedding each geometry's model builds (get_rope's rope_parameters) and the
# factor on its max_position: DeepSeek-V3 serves YaRN (DeepseekScalingRotaryEmbedding),
# GLM-5 plain RoPE; both GPT-J style (is_neox_style=False).
VLLM_ROPE: dict[str, tuple[dict, int]] = {
    "glm5": ({"rope_type": "default", "rope_theta": 10000.0}, 1),
    "deepseek-v3": (
        {"rope_type": "deepseek_yarn", "rope_theta": 10000.0, "factor": 40.0,
         "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
         "mscale": 1.0, "mscale_all_dim": 1.0},
        40,
    ),
}  # fmt: skip
IS_NEOX = False
# Row keys of the timed paths (each "<path>_us", "<path>_kernel"), in table order.
PATHS = ("staged_front", "fused_front", "staged_query", "fused_query", "fused_query_dot")
# Timed where vLLM's CUDA build has it: vLLM's own RoPE + cache-write fusion
# (concat_and_cache_mla_rope_fused, what its fuse_rope_kvcache_cat_mla pass puts in) followed by
# the served staged query, two launches: the stronger baseline (decision 0020).
VLLM_FUSED = "vllm_fused_front"

# (positions, q [M, H, W], k_pe [M, 64], k_rot [M, 64]) -> None: rotates q's rope slice in
# place and writes the rotated k_pe into k_rot.
Rope = Callable[[object, object, object, object], None]
# (kv_c, k_pe, kv_cache, slot_mapping, k_scale) -> None, as vLLM's concat_and_cache_mla.
CacheWrite = Callable[[object, object, object, object, object], None]


@dataclasses.dataclass
class Front:
    """One shape's operands: the harness's layers (weights, q views, out, q_scale) and the
    front's own (kv_a's slices, positions, the rotary cache, one KV cache per layer), with the
    staged path's RoPE and cache write and what each is."""

    lay: Layers
    q: object  # [M, H, qk_nope + 64], a view of q_b_proj's [M, H * (qk_nope + 64)] output
    kv_a: object  # [M, 576]: kv_c | k_pe, kv_a_proj's output
    kv_c: object
    k_pe: object  # [M, 64], a strided slice of kv_a
    k_rot: object  # the staged RoPE's rotated k_pe, the cache write's input
    positions: object
    cos_sin: object  # bf16 [max_position, 64]
    caches: list  # bf16 [blocks, BLOCK_SIZE, 576] per layer
    slot_mapping: object
    k_scale: object
    rope: Rope
    rope_name: str
    cache_write: CacheWrite
    cache_name: str


# --- the staged path's parts ------------------------------------------------------------------


def vllm_rotary(geometry: str, device):
    """vLLM's rotary embedding for ``geometry`` on ``device`` (bf16 cache, as vLLM builds it
    under the model dtype), or (None, why not)."""
    import torch

    try:
        from vllm.config import VllmConfig, set_current_vllm_config
        from vllm.model_executor.layers.rotary_embedding import get_rope
    except Exception as exc:  # not installed, or a build that does not import here
        return None, f"vLLM does not import: {type(exc).__name__}: {exc}"
    params, scale = VLLM_ROPE.get(geometry, VLLM_ROPE["glm5"])
    try:
        with set_current_vllm_config(VllmConfig()):  # vLLM's CustomOps want one
            rotary = get_rope(
                QK_ROPE, max_position=MAX_POSITION * scale, is_neox_style=IS_NEOX,
                rope_parameters=params, dtype=torch.bfloat16,
            ).to(device)  # fmt: skip
    except Exception as exc:  # a release whose get_rope takes other arguments
        return None, f"vLLM's get_rope: {type(exc).__name__}: {exc}"
    # get_rope caches its modules, and forward_native on fp32 input stores the cache in fp32:
    # what vLLM serves is bf16 (its values were bf16, so this is exact).
    if rotary.cos_sin_cache.dtype != torch.bfloat16:
        rotary.cos_sin_cache = rotary.cos_sin_cache.to(torch.bfloat16)
    return rotary, None


def rope_fn(forward, qk_nope: int, *, upcast: bool = False, restore=None) -> Rope:
    """The staged RoPE step around ``forward(positions, q_pe, k_pe) -> (q_pe', k_pe')``:
    q's rope slice rotated in place (``q[..., qk_nope:] = ...``, as vLLM's MLA layer does) and
    k_pe's rotation written to ``k_rot``. ``upcast`` feeds fp32 copies, which is what
    inductor computes from the bf16 operands: eager calls then give the compiled kernel's
    bits. ``restore()`` runs after each call (vLLM's module keeps an fp32 cache after an fp32
    call)."""

    def rope(positions, q, k_pe, k_rot) -> None:
        # k_pe as vLLM's MLA layer passes it, [M, 1, 64]: DeepSeek's YaRN broadcasts cos
        # [M, 1, 64] against it, which a [M, 64] key would turn into [M, M, 64].
        q_pe, k_pe = q[..., qk_nope:], k_pe.unsqueeze(1)
        if upcast:
            q_rot, k_out = forward(positions, q_pe.float(), k_pe.float())
        else:
            q_rot, k_out = forward(positions, q_pe, k_pe)
        q_pe.copy_(q_rot)
        k_rot.copy_(k_out.reshape(k_rot.shape))
        if restore is not None:
            restore()

    return rope


def staged_rope(geometry, device, *, compiled: bool = True, why_not_vllm: str | None = None):
    """(rope step, cos_sin_cache, what it is): vLLM's rotary embedding's ``forward_native``
    where vLLM imports (and ``why_not_vllm`` is None), else ``fusedq.front_reference.rope``; under
    ``torch.compile`` (the inductor kernel vLLM serves) or, ``compiled=False``, eager in fp32
    (the same bits on CPU)."""
    import torch

    from fusedq import front_reference

    rotary, why = (None, why_not_vllm) if why_not_vllm else vllm_rotary(geometry.name, device)
    if rotary is not None:
        cos_sin = rotary.cos_sin_cache
        forward, source = rotary.forward_native, "vllm forward_native"

        def restore() -> None:
            if rotary.cos_sin_cache is not cos_sin:
                rotary.cos_sin_cache = cos_sin

    else:
        gen = torch.Generator().manual_seed(11)
        angle = torch.rand(MAX_POSITION, QK_ROPE // 2, generator=gen) * 6.3
        cos_sin = torch.cat([angle.cos(), angle.sin()], -1).to(torch.bfloat16).to(device)
        source, restore = f"fusedq.front_reference.rope; {why}", None

        def forward(positions, q_pe, k_pe):
            return (
                front_reference.rope(q_pe, positions, cos_sin, IS_NEOX),
                front_reference.rope(k_pe, positions, cos_sin, IS_NEOX),
            )

    if not compiled:
        return rope_fn(forward, geometry.qk_nope, upcast=True, restore=restore), cos_sin, source
    # fullgraph: a graph break would time eager torch ops, not the kernel vLLM serves;
    # dynamic=False: one kernel per shape, as the sizes vLLM captures are compiled.
    fn = torch.compile(rope_fn(forward, geometry.qk_nope), fullgraph=True, dynamic=False)
    return fn, cos_sin, f"inductor({source})"


def vllm_cache_write(device) -> tuple[CacheWrite | None, str | None]:
    """vLLM's ``concat_and_cache_mla`` CUDA op with ``"auto"`` (what vLLM's MLA layer calls),
    or (None, why not)."""
    if device.type != "cuda":
        return None, "vLLM's concat_and_cache_mla is a CUDA op"
    try:
        import torch
        from vllm import _custom_ops as ops
        from vllm.platforms import current_platform

        current_platform.import_kernels()
        torch.ops._C_cache_ops.concat_and_cache_mla  # noqa: B018 (raises where not built)
    except Exception as exc:
        return None, f"vLLM's concat_and_cache_mla: {type(exc).__name__}: {exc}"

    def write(kv_c, k_pe, kv_cache, slot_mapping, k_scale) -> None:
        ops.concat_and_cache_mla(kv_c, k_pe, kv_cache, slot_mapping, "auto", k_scale)

    return write, None


def index_cache_write(kv_c, k_pe, kv_cache, slot_mapping, k_scale) -> None:
    """``fusedq.front_reference.write_cache`` for slots that are all real: its filter of negative slots
    indexes by a mask, which waits on the host and cannot be captured in a graph."""
    import torch

    block = kv_cache.shape[1]
    entries = torch.cat((kv_c, k_pe), dim=-1)
    kv_cache[slot_mapping // block, slot_mapping % block] = entries


def vllm_rope_cache_op(device):
    """vLLM's ``concat_and_cache_mla_rope_fused`` (RoPE of q_pe and k_pe in place, then the cache
    write, one launch), or ``None`` and why it is not there."""
    if device.type != "cuda":
        return None, "vLLM's concat_and_cache_mla_rope_fused is a CUDA op"
    try:
        import torch
        from vllm import _custom_ops as ops

        torch.ops._C_cache_ops.concat_and_cache_mla_rope_fused  # noqa: B018 (raises if absent)
    except Exception as exc:  # any import or registry failure: that path is not timed
        return None, f"vLLM's concat_and_cache_mla_rope_fused: {type(exc).__name__}: {exc}"
    return ops.concat_and_cache_mla_rope_fused, None


def staged_cache_write(device) -> tuple[CacheWrite, str]:
    write, why = vllm_cache_write(device)
    if write is not None:
        return write, "vllm concat_and_cache_mla"
    return index_cache_write, f"torch index_put (fusedq.front_reference.write_cache's); {why}"


# --- one shape's operands and steps -----------------------------------------------------------


def build_front(
    fmt: str, h: int, m: int, opts: Options, *, device: str = "cuda", compiled: bool = True,
    why_not_vllm: str | None = None,
) -> Front:  # fmt: skip
    """One shape's operands; ``why_not_vllm`` set: the staged RoPE is fusedq's, saying why."""
    import torch

    lay = build_layers(fmt, h, m, opts, device=device)
    dev = torch.device(device)
    # build_layers' q is contiguous [M, H, W]: q_b_proj's [M, H * W] output viewed per head.
    q = lay.q_nope._base
    assert q is not None and q.is_contiguous()
    kv_a = torch.randn(m, KV_LORA + QK_ROPE, device=dev, dtype=torch.bfloat16)
    rope, cos_sin, rope_name = staged_rope(
        lay.geometry, dev, compiled=compiled, why_not_vllm=why_not_vllm
    )
    positions = torch.randint(0, MAX_POSITION, (m,), device=dev, dtype=torch.int64)
    blocks = max(MIN_BLOCKS, -(-2 * m // BLOCK_SIZE))
    caches = [
        torch.zeros(blocks, BLOCK_SIZE, QUERY_WIDTH, device=dev, dtype=torch.bfloat16)
        for _ in lay.fused_w
    ]
    slots = torch.randperm(blocks * BLOCK_SIZE)[:m].to(dev)  # distinct slots, one a token
    write, cache_name = staged_cache_write(dev)
    return Front(
        lay, q, kv_a, kv_a[:, :KV_LORA], kv_a[:, KV_LORA:],
        torch.empty(m, QK_ROPE, device=dev, dtype=torch.bfloat16), positions, cos_sin, caches,
        slots, torch.ones(1, device=dev, dtype=torch.float32), rope, rope_name, write,
        cache_name,
    )  # fmt: skip


def served_form(fr: Front) -> str:
    from fusedq.reference import SERVED_FORM

    return SERVED_FORM[fr.lay.out_dtype]


def staged_front_step(fr: Front) -> Callable[[int], object]:
    """Layer i's front as vLLM runs it: RoPE, the served staged query, the cache write. Returns
    the query (the (q_nope @ W, q_pe) pair for BF16 out, ``out`` for E4M3)."""
    query = staged_step(fr.lay, served_form(fr))

    def step(i: int):
        fr.rope(fr.positions, fr.q, fr.k_pe, fr.k_rot)
        result = query(i)
        fr.cache_write(fr.kv_c, fr.k_rot, fr.caches[i], fr.slot_mapping, fr.k_scale)
        return result

    return step


def vllm_fused_front_step(fr: Front, op) -> Callable[[int], object]:
    """Layer i's front with vLLM's own fusion: ``op`` (concat_and_cache_mla_rope_fused) rotates
    q's rope slice and k_pe in place and writes the cache, then the served staged query."""
    query = staged_step(fr.lay, served_form(fr))
    qk_nope = fr.lay.geometry.qk_nope

    def step(i: int):
        op(
            fr.positions, fr.q[..., qk_nope:], fr.k_pe, fr.kv_c, fr.cos_sin, IS_NEOX,
            fr.slot_mapping, fr.caches[i], "auto", fr.k_scale,
        )  # fmt: skip
        return query(i)

    return step


def fused_front_step(fr: Front, backend: str = "triton") -> Callable[[int], object]:
    """Layer i's front in one ``mla_decode_front`` launch (q is read unrotated)."""
    import fusedq

    lay = fr.lay

    def step(i: int):
        return fusedq.mla_decode_front(
            fr.q, fr.kv_c, fr.k_pe, fr.positions, fr.cos_sin, lay.fused_w[i], fr.caches[i],
            fr.slot_mapping, is_neox=IS_NEOX, kv_cache_dtype="auto", k_scale=fr.k_scale,
            out=lay.out, out_dtype=lay.out_dtype, q_scale=lay.q_scale, backend=backend,
        )  # fmt: skip

    return step


def front_config(fr: Front, fmt: str):
    """The fused front's launch config at this shape (``backend="triton"``), or ValueError."""
    from fusedq import front_dispatch
    from fusedq_bench.common import RECIPES

    lay = fr.lay
    m, h = lay.q_nope.shape[0], lay.q_nope.shape[1]
    config, why = front_dispatch.choice(
        h, m, geometry=lay.geometry, weight_format=RECIPES[fmt][0], out_dtype=lay.out_dtype,
        cache_fp8=False, device=lay.q_nope.device, qualified=False,
    )  # fmt: skip
    if config is None:
        raise ValueError(f"{fmt} H={h} M={m}: the fused front cannot run here: {why}")
    return config


def kernel_names(fr: Front, fmt: str, config) -> dict[str, str]:
    """What each path launches, for the row (``<path>_kernel``)."""
    from fusedq.selection import select
    from fusedq_bench.common import RECIPES

    lay = fr.lay
    m, h = lay.q_nope.shape[0], lay.q_nope.shape[1]
    query = "torch.bmm" if served_form(fr) == "bmm" else "torch.bmm + concat-quant (triton)"
    if lay.fused_backend == "auto":
        fused_query = select(
            h, m, geometry=lay.geometry, weight_format=RECIPES[fmt][0],
            out_dtype=lay.out_dtype, device=lay.q_nope.device,
        ).kernel  # fmt: skip
    else:
        fused_query = "triton (forced: past the qualified shapes)"
    dot = f"tl.dot BLOCK_M {config.block_m} BLOCK_N {config.block_n} {config.num_warps} warps"
    return {
        "staged_front": f"rope: {fr.rope_name}; query: {query}; cache: {fr.cache_name}",
        "fused_front": f"mla_decode_front triton ({dot})",
        "staged_query": query,
        "fused_query": f"mla_query_projection {fused_query}",
        "fused_query_dot": f"mla_query triton ({dot})",
    }


def front_steps(fr: Front, fmt: str, vllm_op=None) -> dict[str, Callable[[int], object]]:
    steps = {
        "staged_front": staged_front_step(fr),
        "fused_front": fused_front_step(fr),
        "staged_query": staged_step(fr.lay, served_form(fr)),
        "fused_query": fused_step(fr.lay),
        "fused_query_dot": fused_step(fr.lay, front_config(fr, fmt)),
    }
    if vllm_op is not None:
        steps[VLLM_FUSED] = vllm_fused_front_step(fr, vllm_op)
    return steps


def query_of(result, out) -> object:
    """A step's query as ``[M, H, 576]``: the staged BF16 form's pair concatenated, else
    ``out``."""
    import torch

    if isinstance(result, tuple):
        return torch.cat(result, dim=-1)
    return out if result is None else result


def front_errors(fr: Front, fmt: str) -> dict:
    """Layer 0's fused front against its staged front, eagerly from the same q: the query's
    max |difference| and whether the caches are bit-identical."""
    import torch

    q0 = fr.q.clone()
    cache = fr.caches[0]
    cache.zero_()
    staged = query_of(staged_front_step(fr)(0), fr.lay.out).float().clone()
    staged_cache = cache.clone()
    fr.q.copy_(q0)  # the staged RoPE rotated q in place
    cache.zero_()
    fused = fused_front_step(fr)(0).float()
    return {
        "fused_front_err": float((fused - staged).abs().max()),
        "fused_front_cache_equal": bool(torch.equal(cache.view(torch.int16),
                                                    staged_cache.view(torch.int16))),
    }  # fmt: skip


# --- one shape's row, the table ---------------------------------------------------------------


def bench_front(fmt: str, h: int, m: int, opts: Options, device: str = "cuda") -> dict:
    """One shape's row (``device`` "cpu" only where the CPU tests stand in for the graphs)."""
    import torch

    import fusedq

    torch._dynamo.reset()  # each shape compiles its own RoPE kernel, never a stale guard's
    fr = build_front(fmt, h, m, opts, device=device)
    config = front_config(fr, fmt)
    fusedq.prewarm_decode_front(
        fr.lay.fused_w[0], [m], is_neox=IS_NEOX, out_dtype=fr.lay.out_dtype,
        cos_sin_dtype=fr.cos_sin.dtype, positions_dtype=fr.positions.dtype,
    )  # fmt: skip
    try:
        errors = front_errors(fr, fmt)  # (also compiles the RoPE before capture)
    except Exception as exc:
        if not fr.rope_name.startswith("inductor(vllm"):
            raise
        # A vLLM whose rotary embedding does not trace here: time the reference's RoPE, the
        # same computation, rather than no staged front at all; the row says so.
        why = f"vLLM's forward_native does not compile: {type(exc).__name__}: {exc}"
        print(f"front {fmt} H={h} M={m}: {why}", flush=True)
        del fr
        torch._dynamo.reset()
        fr = build_front(fmt, h, m, opts, device=device, why_not_vllm=why.splitlines()[0][:300])
        errors = front_errors(fr, fmt)
    lay = fr.lay
    vllm_op, why_no_vllm_op = vllm_rope_cache_op(torch.device(device))
    steps = front_steps(fr, fmt, vllm_op)
    graphs = {name: capture(every_layer(lay, step)) for name, step in steps.items()}
    times = time_graphs(graphs, opts.samples, opts.warmup)
    n = len(lay.fused_w)
    row = front_row(fmt, h, m, n, lay.weight_bytes, lay.geometry.name, times)
    row.update({f"{k}_kernel": v for k, v in kernel_names(fr, fmt, config).items()})
    if vllm_op is not None:
        query = row["staged_query_kernel"]
        row[f"{VLLM_FUSED}_kernel"] = f"vllm concat_and_cache_mla_rope_fused; query: {query}"
    else:
        row[f"{VLLM_FUSED}_missing"] = why_no_vllm_op
    if lay.fused_backend != "auto":
        row["fused_backend"] = lay.fused_backend
    row.update(errors)
    del graphs, steps, fr, lay
    if device == "cuda":
        torch.cuda.empty_cache()
    return row


def front_row(
    fmt: str, h: int, m: int, n: int, weight_bytes: int, geometry: str,
    times: dict[str, list[float]],
) -> dict:  # fmt: skip
    """A shape's row in fusedq-bench's row format (``<path>_us`` with its p10/p90 spread, per
    layer), with the two savings side by side."""
    row = {
        "format": fmt, "geometry": geometry, "H": h, "M": m, "layers": n,
        "weight_bytes": weight_bytes, "front": True,
    }  # fmt: skip
    for name, ms in times.items():
        row[f"{name}_us"] = median_us(ms, n)
        row[f"{name}_p10_us"] = statistics.quantiles(ms, n=10)[0] * 1000.0 / n
        row[f"{name}_p90_us"] = statistics.quantiles(ms, n=10)[-1] * 1000.0 / n
    row["fused_front_over_staged_front"] = row["fused_front_us"] / row["staged_front_us"]
    row["fused_query_over_staged_query"] = row["fused_query_us"] / row["staged_query_us"]
    if f"{VLLM_FUSED}_us" in row:  # the stronger baseline, where vLLM has its fusion
        row[f"fused_front_over_{VLLM_FUSED}"] = row["fused_front_us"] / row[f"{VLLM_FUSED}_us"]
    # (µs per layer; not "*_us" keys, which name timed paths to the results' ingest)
    row["front_us_saved"] = row["staged_front_us"] - row["fused_front_us"]
    row["query_us_saved"] = row["staged_query_us"] - row["fused_query_us"]
    return row


def summary(row: dict, seconds: float) -> str:
    """The line printed as each shape is measured."""
    if "error" in row:
        return f"front {row['format']} H={row['H']} M={row['M']}: FAILED {row['error']}"
    return (
        f"front {row['format']} H={row['H']} M={row['M']} L={row['layers']}: "
        f"staged-front {row['staged_front_us']:.2f} µs, fused-front {row['fused_front_us']:.2f} "
        f"µs ({row['fused_front_over_staged_front']:.3f}); staged-query "
        f"{row['staged_query_us']:.2f} µs, fused-query {row['fused_query_us']:.2f} µs "
        f"({row['fused_query_over_staged_query']:.3f}); fused-query-dot "
        f"{row['fused_query_dot_us']:.2f} µs; "
        + (
            f"vllm-fused-front {row[f'{VLLM_FUSED}_us']:.2f} µs "
            f"({row[f'fused_front_over_{VLLM_FUSED}']:.3f}); "
            if f"{VLLM_FUSED}_us" in row
            else ""
        )
        + f"err {row['fused_front_err']:.3g}, cache "
        f"{'equal' if row['fused_front_cache_equal'] else 'DIFFERS'} ({seconds:.1f} s)"
    )


def format_front_table(rows: list[dict]) -> str:
    """One line a shape: µs per layer of each path, the fused/staged ratios of the front and of
    the query alone, what each saves, and what the staged front ran."""
    header = ["format", "H", "M", "staged-front µs", "fused-front µs", "front ratio"]
    header += ["staged-query µs", "fused-query µs", "query ratio", "fused-query-dot µs"]
    header += ["front saves µs", "query saves µs", "staged front ran"]
    body = []
    for r in rows:
        if "error" in r:
            body.append([r["format"], r["H"], r["M"], f"error: {r['error']}"])
            continue
        keys = ("staged_front_us", "fused_front_us", "fused_front_over_staged_front")
        keys += ("staged_query_us", "fused_query_us", "fused_query_over_staged_query")
        keys += ("fused_query_dot_us", "front_us_saved", "query_us_saved")
        cells = [r["format"], r["H"], r["M"], *(f"{r[k]:.2f}" for k in keys)]
        body.append([*cells, r["staged_front_kernel"]])
    return md_table(header, body)


def run_front(fmt: str, h: int, m: int, opts: Options) -> list[dict]:
    """One shape's row, printed as it is measured."""
    t0 = time.time()
    row = bench_front(fmt, h, m, opts)
    print(summary(row, time.time() - t0), flush=True)
    return [row]
