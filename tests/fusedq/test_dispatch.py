"""The per-signature plans (checked once, then run) and the direct launch of the eager path."""

from __future__ import annotations

import re

import pytest
import torch
from fusedq_cases import E4M3, Q_SCALE, assert_matches, make_out, make_q, make_weight, poison

import fusedq
from fusedq import dispatch
from fusedq.kernels import fast_launch, triton_mla_query
from fusedq.kernels import triton_launch as kernel
from fusedq.selection import launch_config


@pytest.fixture(autouse=True)
def no_plans():
    dispatch.clear_plans()
    yield
    dispatch.clear_plans()


@pytest.fixture
def counted(monkeypatch):
    """Counts of dispatch.validate and dispatch.select calls (the per-signature checks)."""
    counts = {"validate": 0, "select": 0}
    for name in counts:
        real = getattr(dispatch, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(dispatch, name, counting)
    return counts


def _wider_q(m: int, h: int, width: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """q_nope and q_pe sliced from a q whose rows are `width` wide: other strides than make_q."""
    q = torch.randn(m, h, width, generator=gen).bfloat16().to(device)
    return q[..., :192], q[..., 192:256]


def test_second_call_of_a_signature_is_not_checked_again(device, counted):
    gen = torch.Generator().manual_seed(1)
    h, m = 8, 1
    w = make_weight(h, "vllm", device, gen)
    q_nope, q_pe = make_q(m, h, device, gen)
    fusedq.mla_query_projection(q_nope, w, q_pe)
    assert counted == {"validate": 1, "select": 1}
    # New data, same signature: the plan runs, nothing is checked again.
    q_nope2, q_pe2 = make_q(m, h, device, gen)
    got = fusedq.mla_query_projection(q_nope2, w, q_pe2)
    assert counted == {"validate": 1, "select": 1}
    assert_matches(got, fusedq.staged_mla_query(q_nope2, w, q_pe2), "bf16")
    # Another row stride of q: a new signature, checked in full.
    q_nope3, q_pe3 = _wider_q(m, h, 320, device, gen)
    got = fusedq.mla_query_projection(q_nope3, w, q_pe3)
    assert counted["validate"] == 3  # (the staged reference call above was a signature too)
    assert_matches(got, fusedq.staged_mla_query(q_nope3, w, q_pe3), "bf16")
    before = dict(counted)
    fusedq.mla_query_projection(q_nope, w, q_pe)
    assert counted == before


@pytest.mark.parametrize(
    "change",
    ["out_dtype", "backend", "pdl", "weight_layout", "q_scale_dtype", "out_stride"],
)
def test_every_part_of_the_signature_is_in_the_key(change, device, counted):
    gen = torch.Generator().manual_seed(2)
    h, m = 8, 1
    w = make_weight(h, "vllm", device, gen)
    q_nope, q_pe = make_q(m, h, device, gen)
    q_scale = torch.tensor([Q_SCALE], device=device)
    out = torch.empty(m, h, 576, dtype=E4M3, device=device)
    kwargs = {"out": out, "q_scale": q_scale, "backend": "staged"}
    fusedq.mla_query_projection(q_nope, w, q_pe, **kwargs)
    assert counted["validate"] == 1
    if change == "out_dtype":
        kwargs["out_dtype"] = E4M3
    elif change == "backend":
        kwargs["backend"] = "auto"
    elif change == "pdl":
        kwargs["pdl"] = False
    elif change == "weight_layout":
        w = w.contiguous()
    elif change == "q_scale_dtype":
        kwargs["q_scale"] = q_scale.double()
    elif change == "out_stride":
        kwargs["out"] = make_out(m, h, E4M3, device, pitched=True)[0]
    if change == "q_scale_dtype":
        with pytest.raises(ValueError, match=r"q_scale: dtype torch\.float64"):
            fusedq.mla_query_projection(q_nope, w, q_pe, **kwargs)
    else:
        fusedq.mla_query_projection(q_nope, w, q_pe, **kwargs)
    assert counted["validate"] == 2


def test_bad_input_after_a_good_call_still_gets_its_error(device):
    gen = torch.Generator().manual_seed(3)
    h, m = 8, 1
    w = make_weight(h, "vllm", device, gen)
    q_nope, q_pe = make_q(m, h, device, gen)
    out = torch.empty(m, h, 576, dtype=torch.bfloat16, device=device)
    fusedq.mla_query_projection(q_nope, w, q_pe, out=out)
    with pytest.raises(ValueError, match=r"q_nope: dtype torch\.float32"):
        fusedq.mla_query_projection(q_nope.float(), w, q_pe, out=out)
    with pytest.raises(ValueError, match="out: last-dim stride"):
        bad = out.transpose(0, 2).contiguous().transpose(0, 2)
        fusedq.mla_query_projection(q_nope, w, q_pe, out=bad)
    with pytest.raises(ValueError, match="weight: list"):
        fusedq.mla_query_projection(q_nope, [w], q_pe, out=out)
    with pytest.raises(ValueError, match="backend"):
        fusedq.mla_query_projection(q_nope, w, q_pe, out=out, backend=["auto"])
    with pytest.raises(ValueError, match="pdl: 'yes'"):
        fusedq.mla_query_projection(q_nope, w, q_pe, out=out, pdl="yes")


def test_overlap_is_checked_on_every_call_of_a_cached_signature(device):
    """Addresses are not in the signature: the same shapes and strides with an `out` that
    overlaps q_nope must be refused by the cached plan, and `out` left untouched."""
    gen = torch.Generator().manual_seed(4)
    h, m = 8, 1
    w = make_weight(h, "vllm", device, gen)
    a = torch.randn(m, h, 832, generator=gen).bfloat16().to(device)
    b = poison(torch.empty(m, h, 832, dtype=torch.bfloat16, device=device))
    q_nope, q_pe = a[..., 576:768], a[..., 768:]
    fusedq.mla_query_projection(q_nope, w, q_pe, out=b[..., :576], backend="staged")
    assert dispatch.plan_count() == 1
    before = a.clone()
    with pytest.raises(ValueError, match="overlaps the memory of q_nope"):
        fusedq.mla_query_projection(q_nope, w, q_pe, out=a[..., :576], backend="staged")
    assert dispatch.plan_count() == 1 and torch.equal(a, before)


@pytest.mark.parametrize("h", [8, 11, 16])
@pytest.mark.parametrize("m", [1, 7])
def test_cached_path_on_the_real_shapes(h, m, device):
    """vLLM's strided W_UK_T and sliced q at every qualified H: the first call builds the
    plan, the next ones (new data; then a misaligned q and out, same strides) run it."""
    gen = torch.Generator().manual_seed(100 * h + m)
    w = make_weight(h, "vllm", device, gen)
    for step in range(3):
        if step < 2:
            q_nope, q_pe = make_q(m, h, device, gen)
            out, _ = make_out(m, h, torch.bfloat16, device, pitched=False)
        else:  # one element of lead-in: every row start off its 16-byte boundary
            q = torch.randn(1 + m * h * 256, generator=gen).bfloat16().to(device)
            q = q[1:].view(m, h, 256)
            q_nope, q_pe = q[..., :192], q[..., 192:]
            out = poison(torch.empty(1 + m * h * 576, dtype=torch.bfloat16, device=device))
            out = out[1:].view(m, h, 576)
        got = fusedq.mla_query_projection(q_nope, w, q_pe, out=out, backend="triton")
        assert_matches(got, fusedq.staged_mla_query(q_nope, w, q_pe), "bf16")
    plans = [p for p in dispatch._plans.values() if p.fused]
    assert len(plans) == 1


def test_mxfp8_and_e4m3_through_the_cached_path(device):
    gen = torch.Generator().manual_seed(6)
    h, m = 16, 3
    weight = fusedq.quantize_mxfp8(make_weight(h, "contiguous", device, gen))
    q_scale = torch.tensor([Q_SCALE], device=device)
    for _ in range(2):
        q_nope, q_pe = make_q(m, h, device, gen)
        got = fusedq.mla_query_projection(
            q_nope, weight, q_pe, out_dtype=E4M3, q_scale=q_scale, backend="triton"
        )
        assert_matches(got, fusedq.staged_mla_query(q_nope, weight, q_pe), "mxfp8", q_scale)


def test_plans_are_bounded(device, monkeypatch):
    monkeypatch.setattr(dispatch, "MAX_PLANS", 2)
    gen = torch.Generator().manual_seed(7)
    w = make_weight(8, "vllm", device, gen)
    for m in (1, 2, 3):
        q_nope, q_pe = make_q(m, 8, device, gen)
        fusedq.mla_query_projection(q_nope, w, q_pe, backend="staged")
        assert dispatch.plan_count() <= 2


def test_fake_tensors_go_through_the_custom_op(device):
    """A tracing mode without torch.compile (fake tensors, no addresses): the call is planned
    as the custom op, whose fake twin runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    gen = torch.Generator().manual_seed(8)
    w = make_weight(8, "vllm", device, gen)
    q_nope, q_pe = make_q(2, 8, device, gen)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fake = [mode.from_tensor(t) for t in (q_nope, w, q_pe)]
        out = fusedq.mla_query_projection(*fake, out_dtype=E4M3, q_scale=torch.ones(1))
    assert out.shape == (2, 8, 576) and out.dtype == E4M3
    assert any(isinstance(p, dispatch._OpPlan) for p in dispatch._plans.values())


def test_a_profiled_call_is_named_in_the_trace_once(device):
    # The trace reader (orchestrator/analysis/trace.py) finds the fused step by this op name where a
    # trace has no kernel events (vLLM's CPU build), and the fast path skips the dispatcher
    # that used to record it. Found by the profile phase's CPU e2e test.
    from torch.profiler import ProfilerActivity, profile

    from fusedq.contract import OP_NAME

    gen = torch.Generator().manual_seed(11)
    w = make_weight(8, "vllm", device, gen)
    q_nope, q_pe = make_q(2, 8, device, gen)
    fusedq.mla_query_projection(q_nope, w, q_pe)  # planned before the profiler starts
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        got = fusedq.mla_query_projection(q_nope, w, q_pe)
        fusedq.mla_query_projection(q_nope, w, q_pe, out=torch.empty_like(got))
    names = [e.name for e in prof.events()]
    assert names.count(OP_NAME) == 2, names
    assert_matches(got, fusedq.staged_mla_query(q_nope, w, q_pe), "bf16")


class _VllmLikeParameter(torch.nn.Parameter):
    """vLLM's weights are Parameter subclasses (ModelWeightParameter and friends)."""


@pytest.mark.parametrize("wrap", [torch.nn.Parameter, _VllmLikeParameter])
def test_parameters_are_launched_on_not_sent_through_the_custom_op(wrap, device):
    # Found by vLLM's CPU e2e test: a Parameter weight was planned as a subclass, the custom
    # op's real implementation planned it the same way, and the two called each other until
    # the recursion limit.
    gen = torch.Generator().manual_seed(9)
    w = make_weight(8, "contiguous", device, gen)
    weight = wrap(w, requires_grad=False)
    q_nope, q_pe = make_q(3, 8, device, gen)
    with torch.inference_mode():
        got = fusedq.mla_query_projection(q_nope, weight, q_pe)
    assert_matches(got, fusedq.staged_mla_query(q_nope, w, q_pe), "bf16")
    assert all(isinstance(p, dispatch.Plan) for p in dispatch._plans.values())


def test_the_custom_ops_real_implementation_never_hands_back_to_the_op(device):
    # Whatever the tensors' types, the op's real implementation launches: planning it as the
    # custom op again would recurse.
    class Tagged(torch.Tensor):
        pass

    gen = torch.Generator().manual_seed(10)
    w = make_weight(8, "vllm", device, gen)
    q_nope, q_pe = make_q(2, 8, device, gen)
    out = torch.empty(2, 8, 576, dtype=torch.bfloat16, device=device)
    tagged = q_nope.as_subclass(Tagged)
    dispatch.call(tagged, w, None, q_pe, out, None, None, "auto", False, real=True)
    assert_matches(out, fusedq.staged_mla_query(q_nope, w, q_pe), "bf16")


@pytest.mark.parametrize("fma", [False, True])
def test_launch_tail_follows_the_kernel_parameters(fma, device):
    gen = torch.Generator().manual_seed(9)
    h, m = 11, 2
    w = make_weight(h, "vllm", device, gen)
    q_nope, q_pe = make_q(m, h, device, gen)
    out = torch.empty(m, h, 576, dtype=torch.bfloat16, device=device)
    config = kernel.LaunchConfig(block_m=2 if fma else 16, block_n=32, fma=fma)
    key = kernel.kernel_key(w, config, weight_format="bf16", out_fp8=False, io_is_aligned=True)
    ints, constexprs = kernel.launch_arguments(q_nope, w, None, q_pe, out, key)
    fn = kernel.kernel_for(config)
    tail = fast_launch.launch_tail(fn, ints, constexprs)
    names = list(fn.arg_names)
    assert len(fast_launch.POINTER_PARAMS) + len(tail) == len(names)
    by_name = dict(zip(names[len(fast_launch.POINTER_PARAMS) :], tail, strict=True))
    assert by_name["M"] == m and by_name["stride_wk"] == w.stride(1)
    assert by_name["stride_om"] == 576 * h and by_name["BLOCK_N"] == 32
    assert by_name["IO_ALIGNED"] is True and by_name["MXFP8"] is False
    with pytest.raises(RuntimeError, match="parameters"):
        fast_launch.launch_tail(fn, ints[:-1], constexprs)


@pytest.mark.parametrize("q_lead,w_lead", [(0, 0), (1, 0), (0, 8), (1, 8)])
def test_variant_follows_the_addresses_as_the_kernel_key_does(q_lead, w_lead, device):
    """The direct launch picks its alignment variant from the addresses alone (the strides
    were checked once); it must agree with the key the normal launch computes."""
    gen = torch.Generator().manual_seed(10)
    h, m = 8, 3
    base = make_weight(h, "contiguous", device, gen).flatten()
    w = (
        torch.cat([base[:w_lead], base])[w_lead:].view(h, 192, 512)
        if w_lead
        else base.view(h, 192, 512)
    )
    q = torch.randn(q_lead + m * h * 256, generator=gen).bfloat16().to(device)[q_lead:]
    q = q.view(m, h, 256)
    out = torch.empty(m, h, 576, dtype=torch.bfloat16, device=device)
    config = launch_config(h, m)
    bound = fast_launch.BoundLaunch(q[..., :192], w, None, q[..., 192:], out, config)
    key = kernel.kernel_key(
        w, config, weight_format="bf16", out_fp8=False,
        io_is_aligned=kernel.io_aligned(q[..., :192], q[..., 192:], out),
    )  # fmt: skip
    got = bound.variant(q.data_ptr(), q[..., 192:].data_ptr(), w.data_ptr(), out.data_ptr())
    assert got == fast_launch.variant_index(key.io_aligned, key.w_aligned)
    assert key.io_aligned == (q_lead == 0)


# --- GPU: the direct launch (skipped without CUDA) --------------------------------------------


def _fused_plan() -> dispatch.Plan:
    (plan,) = [p for p in dispatch._plans.values() if getattr(p, "fused", False)]
    return plan


@pytest.mark.gpu
@pytest.mark.parametrize("h", [8, 11, 16])
@pytest.mark.parametrize("m", [1, 7, 32])
@pytest.mark.parametrize("recipe", ["bf16", "mxfp8", "e4m3"])
def test_direct_launch_matches_staged(h, m, recipe):
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(h * 1000 + m)
    w = make_weight(h, "vllm", device, gen)
    weight = fusedq.quantize_mxfp8(w) if recipe == "mxfp8" else w
    out_dtype = E4M3 if recipe == "e4m3" else torch.bfloat16
    q_scale = torch.tensor([Q_SCALE], device=device) if recipe == "e4m3" else None
    fmt = "mxfp8" if recipe == "mxfp8" else "bf16"
    for _ in range(3):  # the first call binds the variant, the later ones launch directly
        q_nope, q_pe = make_q(m, h, device, gen)
        out, _ = make_out(m, h, out_dtype, device, pitched=m % 2 == 1)
        fusedq.mla_query_projection(
            q_nope, weight, q_pe, out=out, q_scale=q_scale, backend="triton"
        )
        assert_matches(out, fusedq.staged_mla_query(q_nope, weight, q_pe), fmt, q_scale)
    assert _fused_plan().launch.direct
    assert any(v is not None for v in _fused_plan().launch._variants)


@pytest.mark.gpu
@pytest.mark.parametrize("pdl", [False, True])
def test_direct_launch_captures_in_a_graph(pdl):
    """Eager calls bind the direct launch; a graph captured on a side stream then holds the
    direct launches (allocating out from the graph's pool), and its replays see new inputs."""
    if pdl and not triton_mla_query.HAS_PDL:
        pytest.skip("this Triton has no griddepcontrol")
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(11)
    h, m = 16, 4
    w = make_weight(h, "vllm", device, gen)
    q_nope, q_pe = make_q(m, h, device, gen)
    out = torch.empty(m, h, 576, dtype=torch.bfloat16, device=device)
    fusedq.prewarm(w, [m], pdl=pdl)
    for _ in range(2):
        fusedq.mla_query_projection(q_nope, w, q_pe, out=out, pdl=pdl)
        fusedq.mla_query_projection(q_nope, w, q_pe, pdl=pdl)
    torch.cuda.synchronize()
    bound = [p.launch for p in dispatch._plans.values() if p.fused]
    assert len(bound) == 2 and all(b.direct and any(b._variants) for b in bound)
    assert all(b.config.pdl == pdl for b in bound)

    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
        fusedq.mla_query_projection(q_nope, w, q_pe, out=out, pdl=pdl)
        allocated = fusedq.mla_query_projection(q_nope, w, q_pe, pdl=pdl)
    for _ in range(3):
        q_nope.copy_(torch.randn(m, h, 192, generator=gen).bfloat16())
        q_pe.copy_(torch.randn(m, h, 64, generator=gen).bfloat16())
        graph.replay()
        torch.cuda.synchronize()
        ref = fusedq.staged_mla_query(q_nope, w, q_pe)
        assert_matches(out, ref, "bf16")
        assert_matches(allocated, ref, "bf16")


@pytest.mark.gpu
def test_launch_hooks_take_the_normal_path():
    """With a Triton launch hook set (a profiler), launches go through Triton's own path,
    which calls the hook with the kernel's name."""
    import triton

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(12)
    w = make_weight(8, "vllm", device, gen)
    q_nope, q_pe = make_q(2, 8, device, gen)
    fusedq.mla_query_projection(q_nope, w, q_pe)
    fusedq.mla_query_projection(q_nope, w, q_pe)
    names = []
    hook = triton.knobs.runtime.launch_enter_hook

    def record(metadata):
        names.append(metadata.get()["name"])

    hook.add(record)
    try:
        got = fusedq.mla_query_projection(q_nope, w, q_pe)
    finally:
        hook.remove(record)
    torch.cuda.synchronize()
    assert names and "mla_query" in names[0]
    assert_matches(got, fusedq.staged_mla_query(q_nope, w, q_pe), "bf16")


@pytest.mark.parametrize("fmt", ["bf16", "mxfp8"])
def test_backend_cute_names_why_it_cannot_run(fmt, device):
    """backend="cute" is that kernel or a ValueError with the reason, never a silent other
    path: on CPU (the interpreter) the CuTe kernel cannot run (no DSL, or no CUDA device)."""
    if device.type == "cuda":
        pytest.skip("on a GPU the CuTe kernel may run: test_cute_mla_query covers it")
    from fusedq.kernels import cute_mla_query

    why = re.escape(cute_mla_query.unavailable_reason())
    gen = torch.Generator().manual_seed(3)
    w = make_weight(8, "vllm", device, gen)
    q_nope, q_pe = make_q(1, 8, device, gen)
    weight = fusedq.quantize_mxfp8(w) if fmt == "mxfp8" else w
    with pytest.raises(ValueError, match=rf"backend='cute' cannot run this call: .*{why}"):
        fusedq.mla_query_projection(q_nope, weight, q_pe, backend="cute")
    with pytest.raises(ValueError, match="must be one of \\('auto', 'triton', 'cute', 'staged'\\)"):
        fusedq.mla_query_projection(q_nope, weight, q_pe, backend="cutlass")


def test_auto_binds_the_cute_launch_when_the_selection_picks_it(monkeypatch):
    """The plan's launch is the CuTe one when the selection says "cute" and the operands
    qualify, with the selected Triton launch as its fallback; else that Triton launch itself.
    (Found on the H200: the chosen path's reason string was read as a refusal.)"""
    from fusedq.kernels import cute_mla_query
    from fusedq.selection import Selection

    cpu = torch.device("cpu")
    gen = torch.Generator().manual_seed(5)
    wq = fusedq.quantize_mxfp8(make_weight(8, "vllm", cpu, gen))
    q_nope, q_pe = make_q(1, 8, cpu, gen)
    monkeypatch.setattr(cute_mla_query, "unsupported_reason", lambda *a: None)
    compiled = []
    monkeypatch.setattr(cute_mla_query, "prewarm", lambda *a, **k: compiled.append(a) or 1)
    config = launch_config(8, 1, "mxfp8")

    def bound_for(path: str):
        chosen = Selection(path, "measured faster", config)
        monkeypatch.setattr(dispatch, "select", lambda *a, **k: chosen)
        args = (q_nope, wq.values, wq.scales, q_pe, None, None, None, "auto", False)
        return dispatch._new_plan(*args, real=True).launch

    bound = bound_for("cute")
    assert isinstance(bound, cute_mla_query.BoundCute)
    assert isinstance(bound.fallback, fast_launch.BoundLaunch) and bound.fallback.config == config
    # Bound outside a capture, the variant is compiled then (eager calls never run it).
    assert compiled == [(8, 1, cpu)] and bound.key == (8, 1, 0)
    assert isinstance(bound_for("triton"), fast_launch.BoundLaunch)
    monkeypatch.setattr(cute_mla_query, "unsupported_reason", lambda *a: "out: not aligned")
    assert isinstance(bound_for("cute"), fast_launch.BoundLaunch)


def test_bound_cute_runs_the_fallback_eagerly_and_in_a_capture_it_cannot_serve(monkeypatch):
    """backend="auto"'s CuTe launch: eager calls take the Triton fallback; under capture the
    CuTe kernel runs if its variant was compiled, else the fallback does and one warning says
    why (found on the H200: the usual eager warm-up then capture raised, since the eager call
    ran Triton and never compiled the CuTe variant). Without a fallback every call is CuTe."""
    import warnings

    from fusedq.kernels import cute_mla_query as cute

    calls = []
    monkeypatch.setattr(cute, "prewarm", lambda *a, **k: 0)
    monkeypatch.setattr(cute, "launch_unchecked", lambda *a: calls.append("cute"))
    monkeypatch.setattr(cute, "_compiled", {})
    monkeypatch.setattr(cute, "_warned", set())
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    bound = cute.BoundCute(lambda *a: calls.append("triton"), 16, 2, torch.device("cpu"))
    ops = [torch.empty(16, dtype=torch.uint8)] * 5 + [None]  # aligned addresses
    bound(*ops)
    capturing[0] = True
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bound(*ops)
        bound(*ops)
    assert calls == ["triton"] * 3
    (w,) = caught
    assert "heads=16 M-bucket=2" in str(w.message) and "runs the Triton kernel" in str(w.message)
    cute._compiled[(16, 2, 0)] = object()
    bound(*ops)
    assert calls[-1] == "cute"
    forced = cute.BoundCute(None, 16, 2, torch.device("cpu"))
    capturing[0] = False
    forced(*ops)
    assert calls[-1] == "cute" and len(calls) == 5
