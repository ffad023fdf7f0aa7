"""mla_query_projection against the staged reference, and its argument checking."""

from __future__ import annotations

import functools

import pytest
import torch
from fusedq_cases import (
    E4M3,
    HEADS,
    MS,
    Q_SCALE,
    RECIPES,
    TIE_SCALE,
    TOLERANCES,
    assert_matches,
    launch_matches_staged,
    make_out,
    make_q,
    make_weight,
    poison,
    split_values,
    weight_for,
    weight_in_layout,
)

import fusedq

# The interpreter needs ~1 s per call, so on CPU two recipes that between them cover both
# weight formats and both output dtypes run the whole H x M grid and the other two a
# subset (one M per block-M bucket plus the largest); on a GPU every recipe runs it all.
FULL_GRID_ON_CPU = {("bf16", torch.bfloat16), ("mxfp8", E4M3)}
CPU_SUBSET_MS = (1, 17, 32)


def _grid():
    for fmt, out_dtype in RECIPES:
        full = torch.cuda.is_available() or (fmt, out_dtype) in FULL_GRID_ON_CPU
        for h in HEADS:
            for m in MS if full else CPU_SUBSET_MS:
                name = str(out_dtype).replace("torch.", "")
                yield pytest.param(h, m, fmt, out_dtype, id=f"H{h}-M{m}-{fmt}-{name}")


def _run_both(q_nope, weight, q_pe, out, out_dtype, device):
    q_scale = torch.tensor([Q_SCALE], device=device) if out_dtype == E4M3 else None
    got = fusedq.mla_query_projection(
        q_nope, weight, q_pe, out=out, out_dtype=out_dtype, q_scale=q_scale, backend="triton"
    )
    # The staged BF16 output: the reference of both output dtypes (assert_matches).
    return got, fusedq.staged_mla_query(q_nope, weight, q_pe), q_scale


@pytest.mark.parametrize("h,m,fmt,out_dtype", list(_grid()))
def test_matches_staged(h, m, fmt, out_dtype, device):
    gen = torch.Generator().manual_seed(1000 * h + m)
    w = make_weight(h, "vllm", device, gen)
    q_nope, q_pe = make_q(m, h, device, gen)
    # Alternate plain and pitched outputs across the grid: both are covered at every H.
    out, buf = make_out(m, h, out_dtype, device, pitched=m % 2 == 1)
    got, ref, q_scale = _run_both(q_nope, weight_for(fmt, w), q_pe, out, out_dtype, device)
    assert got.data_ptr() == out.data_ptr()
    assert_matches(out, ref, fmt, q_scale)
    if buf.shape != out.shape:
        # The pitch padding of the workspace is never written.
        pad = torch.cat([buf[:, h:].flatten(), buf[:, :h, 576:].flatten()]).float()
        assert torch.isnan(pad).all()


@pytest.mark.parametrize("layout", ["vllm", "unit_k", "generic", "contiguous"])
@pytest.mark.parametrize("fmt,out_dtype", RECIPES[:3], ids=lambda v: str(v).replace("torch.", ""))
def test_weight_layouts(layout, fmt, out_dtype, device):
    gen = torch.Generator().manual_seed(7)
    h, m = 11, 5
    weight = weight_in_layout(fmt, layout, h, device, gen)
    q_nope, q_pe = make_q(m, h, device, gen)
    out, _ = make_out(m, h, out_dtype, device, pitched=True)
    _, ref, q_scale = _run_both(q_nope, weight, q_pe, out, out_dtype, device)
    assert_matches(out, ref, fmt, q_scale)


def test_separate_q_tensors_and_allocated_out(device):
    gen = torch.Generator().manual_seed(3)
    h, m = 8, 4
    w = make_weight(h, "contiguous", device, gen)
    q_nope = torch.randn(m, h, 192, generator=gen).bfloat16().to(device)
    # q_pe with a head-major layout: unit last stride, nothing else contiguous.
    q_pe = torch.randn(h, m, 64, generator=gen).bfloat16().to(device).transpose(0, 1)
    got = fusedq.mla_query_projection(q_nope, w, q_pe, backend="triton")
    ref = fusedq.staged_mla_query(q_nope, w, q_pe)
    assert got.shape == (m, h, 576) and got.dtype == torch.bfloat16
    assert_matches(got, ref, "bf16")


def test_auto_falls_back_to_staged_for_unqualified_heads(device):
    gen = torch.Generator().manual_seed(4)
    h, m = 4, 2
    w = make_weight(h, "vllm", device, gen)
    q_nope, q_pe = make_q(m, h, device, gen)
    assert not fusedq.can_implement(h, m, device=device)
    got = fusedq.mla_query_projection(q_nope, w, q_pe)
    ref = fusedq.staged_mla_query(q_nope, w, q_pe)
    assert torch.equal(got, ref)
    assert "num_heads=4 is not qualified for glm5" in fusedq.explain(h, m, device=device)
    # backend="triton" runs the Triton kernel wherever it runs, qualified or not.
    assert_matches(fusedq.mla_query_projection(q_nope, w, q_pe, backend="triton"), ref, "bf16")


def test_auto_falls_back_for_large_m(device):
    gen = torch.Generator().manual_seed(5)
    h, m = 8, 33
    w = make_weight(h, "vllm", device, gen)
    q_nope, q_pe = make_q(m, h, device, gen)
    got = fusedq.mla_query_projection(q_nope, w, q_pe)
    ref = fusedq.staged_mla_query(q_nope, w, q_pe)
    assert torch.equal(got, ref)
    assert_matches(fusedq.mla_query_projection(q_nope, w, q_pe, backend="triton"), ref, "bf16")
    q_nope, q_pe = make_q(513, h, device, gen)  # past what the kernels run at all
    with pytest.raises(ValueError, match=r"max_m=513 is outside the kernels' range 1\.\.512"):
        fusedq.mla_query_projection(q_nope, w, q_pe, backend="triton")


def test_staged_backend_is_the_reference(device):
    gen = torch.Generator().manual_seed(6)
    w = make_weight(8, "vllm", device, gen)
    q_nope, q_pe = make_q(3, 8, device, gen)
    got = fusedq.mla_query_projection(q_nope, w, q_pe, backend="staged")
    assert torch.equal(got, fusedq.staged_mla_query(q_nope, w, q_pe))


# ---------------------------------------------------------------------------------------
# Bad input: ValueError naming the argument, and `out` untouched.


def _good(device, out_dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(11)
    h, m = 8, 3
    q = torch.randn(m, h, 256, generator=gen).bfloat16().to(device)
    kwargs = {"out_dtype": out_dtype, "backend": "auto"}
    if out_dtype == E4M3:
        kwargs["q_scale"] = torch.tensor([Q_SCALE], device=device)
    kwargs["out"] = poison(torch.empty(m, h, 576, dtype=out_dtype, device=device))
    args = [q[..., :192], make_weight(h, "vllm", device, gen), q[..., 192:]]
    return args, kwargs


def _mutations(device):
    """(case id, argument name the error must mention, mutate(args, kwargs))."""

    def set_arg(i, fn):
        def mutate(args, kwargs):
            args[i] = fn(args[i])

        return mutate

    def set_kw(name, fn):
        def mutate(args, kwargs):
            kwargs[name] = fn(kwargs.get(name))

        return mutate

    def overlap_q(args, kwargs):
        buf = torch.empty(3, 8, 576 + 256, dtype=torch.bfloat16, device=device)
        kwargs["out"] = poison(buf[..., :576])
        args[0] = buf[..., 576 : 576 + 192]
        args[0].copy_(torch.randn(3, 8, 192))

    def overlap_w(args, kwargs):
        buf = torch.zeros(8 * 192 * 512 + 3 * 8 * 576, dtype=torch.bfloat16, device=device)
        args[1] = buf[: 8 * 192 * 512].view(8, 192, 512)
        kwargs["out"] = poison(buf[8 * 192 * 512 - 576 :][: 3 * 8 * 576].view(3, 8, 576))

    return [
        ("q_nope_dtype", "q_nope", set_arg(0, lambda t: t.float())),
        ("q_nope_shape", "q_nope", set_arg(0, lambda t: t[..., :128])),
        ("q_nope_2d", "q_nope", set_arg(0, lambda t: t[:, 0])),
        (
            "q_nope_stride",
            "q_nope",
            set_arg(0, lambda t: t.transpose(0, 2).contiguous().transpose(0, 2)),
        ),
        ("q_nope_type", "q_nope", set_arg(0, lambda t: t.tolist())),
        ("q_pe_dtype", "q_pe", set_arg(2, lambda t: t.half())),
        ("q_pe_shape", "q_pe", set_arg(2, lambda t: t[:2])),
        (
            "q_pe_stride",
            "q_pe",
            set_arg(2, lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)),
        ),
        ("weight_dtype", "weight", set_arg(1, lambda t: t.half())),
        ("weight_shape", "weight", set_arg(1, lambda t: t[:, :128])),
        ("weight_heads", "weight", set_arg(1, lambda t: t[:4])),
        ("weight_type", "weight", set_arg(1, lambda t: "W_UK_T")),
        ("out_dtype_arg", "out_dtype", set_kw("out_dtype", lambda _: torch.float16)),
        ("out_dtype_mismatch", "out", set_kw("out", lambda t: t.float())),
        ("out_shape", "out", set_kw("out", lambda t: t[..., :512])),
        (
            "out_stride",
            "out",
            set_kw("out", lambda t: t.transpose(0, 2).contiguous().transpose(0, 2)),
        ),
        (
            "q_scale_superfluous",
            "q_scale",
            set_kw("q_scale", lambda _: torch.ones(1, device=device)),
        ),
        ("backend", "backend", set_kw("backend", lambda _: "cutlass")),
        ("out_overlaps_q", "q_nope", overlap_q),
        ("out_overlaps_weight", "weight", overlap_w),
    ]


BAD_CASES = [name for name, _, _ in _mutations(torch.device("cpu"))]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16)


@pytest.mark.parametrize("case", BAD_CASES)
def test_bad_input_raises_and_leaves_out_untouched(case, device):
    arg, mutate = {name: (arg, fn) for name, arg, fn in _mutations(device)}[case]
    args, kwargs = _good(device)
    mutate(args, kwargs)
    out = kwargs["out"]
    before = out.clone()
    with pytest.raises(ValueError, match=arg):
        fusedq.mla_query_projection(*args, **kwargs)
    if out.element_size() <= 2:
        assert torch.equal(_bits(out), _bits(before))
    else:
        assert torch.equal(out.isnan(), before.isnan())


@pytest.mark.parametrize(
    "q_scale,match",
    [
        (None, "required"),
        ("float64", "float32"),
        ("two", "one-element"),
        ("list", "not a tensor"),
    ],
)
def test_e4m3_q_scale_checked(q_scale, match, device):
    args, kwargs = _good(device, E4M3)
    kwargs["q_scale"] = {
        None: None,
        "float64": torch.ones(1, dtype=torch.float64, device=device),
        "two": torch.ones(2, device=device),
        "list": [1.0],
    }[q_scale]
    out = kwargs["out"]
    before = out.view(torch.uint8).clone()
    with pytest.raises(ValueError, match="q_scale") as info:
        fusedq.mla_query_projection(*args, **kwargs)
    assert match in str(info.value)
    assert torch.equal(out.view(torch.uint8), before)


def test_wrong_device_named():
    if not torch.cuda.is_available():
        pytest.skip("needs a second device type (CUDA) to mismatch against")
    args, kwargs = _good(torch.device("cuda"))
    args[2] = args[2].cpu()
    with pytest.raises(ValueError, match="q_pe: device"):
        fusedq.mla_query_projection(*args, **kwargs)
    args, kwargs = _good(torch.device("cuda"))
    kwargs["out"] = kwargs["out"].cpu()
    with pytest.raises(ValueError, match="out: device"):
        fusedq.mla_query_projection(*args, **kwargs)


@pytest.mark.parametrize("pdl", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("block_k", [64, 256])
@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("fmt,out_dtype", RECIPES, ids=lambda v: str(v).replace("torch.", ""))
def test_launch_configs(pdl, block_k, block_n, fmt, out_dtype, device):
    """Every K chunking and N tile the heuristic may pick, whatever this machine picks."""
    from fusedq.kernels import triton_launch as kernel

    config = kernel.LaunchConfig(block_m=16, block_n=block_n, block_k=block_k, pdl=pdl)
    # One head is enough here (the launcher has no head gate) and keeps the interpreter fast.
    launch_matches_staged(config, fmt, out_dtype, 1, 3, device, block_k + block_n, pitched=False)


@pytest.mark.parametrize("pdl", [False, pytest.param(True, marks=pytest.mark.gpu)])
@pytest.mark.parametrize("block_m,m", [(1, 1), (2, 2), (4, 3), (8, 7)])
@pytest.mark.parametrize("fmt,out_dtype", RECIPES, ids=lambda v: str(v).replace("torch.", ""))
def test_register_path_configs(pdl, block_m, m, fmt, out_dtype, device):
    """The register (no tl.dot) path for every row count it unrolls and every recipe, E4M3
    output included, on a pitched out with padding rows (m < block_m) masked."""
    from fusedq.kernels import triton_launch as kernel

    # BLOCK_N 16 with one warp on the GPU (the interpreter's layouts do not depend on it).
    config = kernel.LaunchConfig(block_m=block_m, block_n=16, num_warps=1, pdl=pdl, fma=True)
    # Two heads: the per-head offsets of q, q_pe and out are exercised.
    launch_matches_staged(config, fmt, out_dtype, 2, m, device, 100 + block_m, pitched=True)


# ---------------------------------------------------------------------------------------
# The output dtype comes from `out` when out_dtype is None.

OUT_CHOICES = {"none": None, "bf16": torch.bfloat16, "e4m3": E4M3}


@pytest.mark.parametrize("with_scale", [False, True], ids=["no_scale", "scale"])
@pytest.mark.parametrize("out_dtype", list(OUT_CHOICES), ids=lambda v: f"out_dtype_{v}")
@pytest.mark.parametrize("out_kind", list(OUT_CHOICES), ids=lambda v: f"out_{v}")
def test_output_dtype_from_out(out_kind, out_dtype, with_scale, device):
    """Every combination of out (none, bf16, E4M3), out_dtype (None, bf16, E4M3) and q_scale:
    the output dtype is out_dtype, else out's, else BF16; a mismatch names both dtypes."""
    gen = torch.Generator().manual_seed(31)
    h, m = 8, 1
    w = make_weight(h, "vllm", device, gen)
    q_nope, q_pe = make_q(m, h, device, gen)
    out_t = OUT_CHOICES[out_kind]
    out = None if out_t is None else poison(torch.empty(m, h, 576, dtype=out_t, device=device))
    q_scale = torch.tensor([Q_SCALE], device=device) if with_scale else None
    dtype = OUT_CHOICES[out_dtype]
    call = functools.partial(
        fusedq.mla_query_projection, q_nope, w, q_pe, out=out, out_dtype=dtype, q_scale=q_scale
    )
    want = dtype or out_t or torch.bfloat16
    if dtype is not None and out_t is not None and dtype != out_t:
        with pytest.raises(ValueError, match=f"out: dtype {out_t} differs from out_dtype={dtype}"):
            call()
        return
    if (want == E4M3) != with_scale:
        with pytest.raises(ValueError, match="q_scale"):
            call()
        return
    got = call(backend="triton")
    assert got.dtype == want and (out is None or got.data_ptr() == out.data_ptr())
    assert_matches(got, fusedq.staged_mla_query(q_nope, w, q_pe), "bf16", q_scale)


def test_output_dtype_from_out_names_an_unsupported_dtype(device):
    args, kwargs = _good(device)
    kwargs["out"] = kwargs["out"].half()
    del kwargs["out_dtype"]
    with pytest.raises(ValueError, match=r"out: dtype torch.float16 must be .*taken from out"):
        fusedq.mla_query_projection(*args, **kwargs)


# ---------------------------------------------------------------------------------------
# E4M3 rounding: vLLM's static FP8 quant multiplies by a rounded reciprocal of q_scale, which
# is not always the once-rounded quotient. At q_scale = 28 sixty bf16 values round to another
# E4M3 value one way than the other; the kernels must give vLLM's.


# (LaunchConfig fields, M, E4M3 epilogue): the register path, tl.dot, and each Gluon operand
# path (GPU only: a Gluon LaunchConfig cannot even be built under the interpreter), each with
# vLLM's multiply and the dividing measurement variant; Gluon also with its wide store.
def _e4m3_cases():
    for fields, m, name, gpu in [
        (dict(block_m=1, block_n=16, num_warps=1, fma=True), 1, "register", False),
        (dict(block_m=16, block_n=32), 3, "dot", False),
        *(
            (dict(block_m=16, block_n=32, gluon=True, gluon_operands=o), 3, f"gluon-{o}", True)
            for o in ("convert", "smem", "direct")
        ),
    ]:
        for epilogue in ("mul", "div", "wide") if gpu else ("mul", "div"):
            marks = [pytest.mark.gpu] if gpu else []
            yield pytest.param(fields, m, epilogue, id=f"{name}-{epilogue}", marks=marks)


@pytest.mark.parametrize("fields,m,epilogue", list(_e4m3_cases()))
def test_e4m3_rounds_as_vllm(fields, m, epilogue, device):
    """Both halves of the output hold the split values (the 512 part through a one-hot q_nope,
    so the bf16 product is the weight value itself); the kernels must round them as vLLM does,
    and the "div" measurement variant as the division does."""
    from fusedq.kernels import triton_launch as kernel

    x = split_values()
    assert len(x) >= 32, "no discriminating values: the test would pass either way"
    h = 2
    row = x.repeat(-(-512 // len(x)))[:512]
    values = torch.randn(h, 192, 512).to(torch.bfloat16)
    values[:, 5] = row
    q_nope = torch.zeros(m, h, 192, dtype=torch.bfloat16)
    q_nope[:, :, 5] = 1.0
    q_pe = x[:64].repeat(-(-64 // len(x)))[:64].expand(m, h, 64).contiguous()
    values, q_nope, q_pe = (t.to(device) for t in (values, q_nope, q_pe))
    out = torch.empty(m, h, 576, dtype=E4M3, device=device)
    s = torch.tensor([TIE_SCALE], device=device)
    cfg = kernel.LaunchConfig(**fields, e4m3_epilogue=epilogue)
    kernel.launch(q_nope, values, None, q_pe, out, s, config=cfg)
    want = torch.cat([values[:, 5].expand(m, h, 512), q_pe], dim=-1).float()
    want = want / s if epilogue == "div" else want * s.reciprocal()
    want = want.clamp(-448, 448).to(E4M3)
    assert torch.equal(out.view(torch.uint8).cpu(), want.view(torch.uint8).cpu())


# ---------------------------------------------------------------------------------------
# The E4M3 comparison (fusedq_cases.assert_e4m3_matches) catches a 1 % accumulator error:
# the interpreter kernel's accumulation is scaled by 1.01 or 0.99 (the test's own wrappers of
# the kernel's _dot and _fma_row, patched into the module for this test only), and the output
# must fail the comparison, while the unpatched kernel passes it and the RoPE half, which does
# not go through the accumulator, stays bit-exact.


def _scaled_accumulation(kernel, factor: float):
    real_dot, real_fma_row = kernel._dot, kernel._fma_row

    def dot(q, w, acc, INTERPRET):
        return acc + (real_dot(q, w, acc, INTERPRET) - acc) * factor

    def fma_row(q0, q1, q2, w0, w1, w2, acc, m, offs_m, NUM_K):
        new = real_fma_row(q0, q1, q2, w0, w1, w2, acc, m, offs_m, NUM_K)
        return acc + (new - acc) * factor

    return dot, fma_row


@pytest.mark.skipif(
    torch.cuda.is_available(), reason="patches the interpreter's kernel (CPU); compiled on GPU"
)
@pytest.mark.parametrize(
    "fields,m",
    [(dict(block_m=1, block_n=16, num_warps=1, fma=True), 1), (dict(block_m=16, block_n=32), 3)],
    ids=["register", "dot"],
)
@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_e4m3_comparison_catches_one_percent(fields, m, fmt, monkeypatch):
    from fusedq.kernels import triton_launch
    from fusedq.kernels import triton_mla_query as kernel
    from fusedq.reference import quantize_e4m3

    h = 8
    gen = torch.Generator().manual_seed(29 + m)
    weight = weight_for(fmt, make_weight(h, "vllm", "cpu", gen))
    values, scales = (weight.values, weight.scales) if fmt == "mxfp8" else (weight, None)
    q_nope, q_pe = make_q(m, h, "cpu", gen)
    q_scale = torch.tensor([Q_SCALE])
    ref = fusedq.staged_mla_query(q_nope, weight, q_pe)
    config = triton_launch.LaunchConfig(**fields)

    def run() -> torch.Tensor:
        out = poison(torch.empty(m, h, 576, dtype=E4M3))
        triton_launch.launch(q_nope, values, scales, q_pe, out, q_scale, config=config)
        return out

    assert_matches(run(), ref, fmt, q_scale)  # the kernel as shipped passes
    rope = quantize_e4m3(ref[..., 512:], q_scale).view(torch.uint8)
    old_atol, old_rtol = TOLERANCES[(fmt, E4M3)]
    for factor in (1.01, 0.99):
        with monkeypatch.context() as mp:
            dot, fma_row = _scaled_accumulation(kernel, factor)
            mp.setattr(kernel, "_dot", dot)
            mp.setattr(kernel, "_fma_row", fma_row)
            out = run()
        assert torch.equal(out[..., 512:].view(torch.uint8), rope)  # only the 512 part moved
        with pytest.raises(AssertionError, match="codes outside the E4M3 roundings"):
            assert_matches(out, ref, fmt, q_scale)
        # What the E4M3 entries of the tolerance table (2^-3 relative on the E4M3 values)
        # would have said: the same output passes them.
        torch.testing.assert_close(
            out[..., :512].float(),
            quantize_e4m3(ref[..., :512], q_scale).float(),
            atol=old_atol,
            rtol=old_rtol,
        )
