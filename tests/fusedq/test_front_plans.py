"""The decode front's traced path (its custom ops under torch.compile) and its per-signature
plans (checked once, then run), as the query's (test_ops.py, test_dispatch.py)."""

from __future__ import annotations

import pytest
import torch
from fusedq_cases import E4M3, poison
from test_front import _bits, make_case

import fusedq
from fusedq import dispatch, front_dispatch, ops  # noqa: F401 (ops registers the custom ops)
from fusedq.contract import DEEPSEEK_V3, GLM5, KV_LORA, QUERY_WIDTH


@pytest.fixture(autouse=True)
def no_plans():
    dispatch.clear_plans()
    yield
    dispatch.clear_plans()


@pytest.fixture
def counted(monkeypatch):
    """How often the full checks (front_dispatch.check) and the kernel's choice
    (front_dispatch.choice) ran."""
    counts = {"check": 0, "choice": 0}
    for name in counts:
        real = getattr(front_dispatch, name)

        def counting(*args, _real=real, _name=name, **kwargs):
            counts[_name] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(front_dispatch, name, counting)
    return counts


def front_plans() -> list:
    return [p for p in dispatch._plans.values() if isinstance(p, front_dispatch.FrontPlan)]


# --- the custom ops under torch.compile --------------------------------------------------------


def test_ops_are_registered_with_out_and_cache_mutated():
    for name in ("mla_decode_front", "staged_decode_front"):
        schema = getattr(torch.ops.fusedq, name).default._schema
        for arg in ("out", "kv_cache"):
            a = next(a for a in schema.arguments if a.name == arg)
            assert a.alias_info is not None and a.alias_info.is_write, (name, arg)
        written = [a.name for a in schema.arguments if a.alias_info and a.alias_info.is_write]
        assert written == ["kv_cache", "out"], name


def _recording(graphs: list):
    """A torch.compile backend that keeps Dynamo's graph, then runs it as aot_eager does
    (functionalization and the fake twins: inductor would need a compiler on the host)."""
    from torch._dynamo.backends.registry import lookup_backend

    def backend(gm, example_inputs):
        graphs.append(gm)
        return lookup_backend("aot_eager")(gm, example_inputs)

    return backend


def _calls(gm) -> list[str]:
    """The graph's calls: the fusedq op and, where ``out`` is None, its allocation."""
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize(
    "fn,backend,op",
    [
        ("mla_decode_front", "triton", "fusedq.mla_decode_front"),
        ("staged_decode_front", None, "fusedq.staged_decode_front"),
    ],
)
def test_compile_fullgraph_is_one_op_and_matches_eager(fn, backend, op):
    """Under torch.compile(fullgraph=True) the front is one opaque fusedq node, and the
    compiled call writes the query and the whole cache buffer bit for bit as the eager call
    does, on a second step too (new inputs, the same graph)."""
    case = make_case(GLM5, 8, 3, fmt="mxfp8", out_dtype=E4M3, cache="fp8")
    eager = case.with_fresh_cache()
    call = getattr(fusedq, fn)
    kwargs = dict(case.kwargs, **({"backend": backend} if backend else {}))
    if fn == "staged_decode_front":  # a given out, pitched, as vLLM's
        pitched = torch.empty(3, 9, QUERY_WIDTH, dtype=E4M3)
        kwargs["out"] = poison(pitched)[:, :8]
    graphs: list = []

    def step(*args):
        return call(*args, **kwargs)

    compiled = torch.compile(step, backend=_recording(graphs), fullgraph=True)
    for turn in range(2):
        got = compiled(*case.args).clone()
        want = call(*eager.args, **dict(kwargs, out=None))
        assert torch.equal(_bits(got), _bits(want)), f"query, turn {turn}"
        assert torch.equal(_bits(case.cache_buf), _bits(eager.cache_buf)), f"cache, turn {turn}"
        # The next step's inputs: new data in the same tensors (the two cases share them).
        case.args[0].mul_(-0.5)
        case.args[1].add_(0.25)
    (graph,) = graphs
    assert _calls(graph) == ([op] if "out" in kwargs else [str(torch.empty), op])


def test_fake_tensors_go_through_the_custom_op():
    """A tracing mode without torch.compile (fake tensors, no addresses): the call is planned
    as the custom op, whose fake twin runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    case = make_case(DEEPSEEK_V3, 8, 2, cache="fp8")
    with FakeTensorMode() as mode:
        args = [mode.from_tensor(t) for t in case.args]
        kwargs = {k: mode.from_tensor(v) if isinstance(v, torch.Tensor) else v
                  for k, v in case.kwargs.items()}  # fmt: skip
        out = fusedq.mla_decode_front(*args, **kwargs)
    assert out.shape == (2, 8, QUERY_WIDTH) and out.dtype == torch.bfloat16
    assert any(isinstance(p, front_dispatch._FrontOpPlan) for p in dispatch._plans.values())


# --- per-signature plans -----------------------------------------------------------------------


def test_a_signature_is_checked_once_and_a_new_stride_makes_a_new_plan(counted):
    case = make_case(DEEPSEEK_V3, 8, 3, cache="fp8")
    first = case.with_fresh_cache()
    fusedq.mla_decode_front(*first.args, **first.kwargs)
    assert counted == {"check": 1, "choice": 1} and len(front_plans()) == 1
    # New data, the same signature: the plan runs, nothing is checked again.
    for seed in (1, 2):
        again = make_case(DEEPSEEK_V3, 8, 3, cache="fp8", seed=seed)
        ref = again.with_fresh_cache()
        got = fusedq.mla_decode_front(*again.args, **again.kwargs)
        want = fusedq.mla_decode_front(*ref.args, **ref.kwargs, backend="staged")
        assert torch.equal(_bits(got[..., KV_LORA:]), _bits(want[..., KV_LORA:]))
        assert torch.equal(_bits(again.cache_buf), _bits(ref.cache_buf))
    assert counted == {"check": 2, "choice": 1}  # (the staged signature: one more check)
    assert len(front_plans()) == 2
    # q dense instead of a slice of a wider buffer: another stride, another plan.
    dense = case.with_fresh_cache()
    dense.args[0] = dense.args[0].contiguous()
    fusedq.mla_decode_front(*dense.args, **dense.kwargs)
    assert counted == {"check": 3, "choice": 2} and len(front_plans()) == 3
    # An option is part of the signature too.
    fusedq.mla_decode_front(*dense.args, **dict(dense.kwargs, is_neox=True))
    assert counted == {"check": 4, "choice": 3} and len(front_plans()) == 4


def _laid_over(store: torch.Tensor, like: torch.Tensor, offset: int) -> torch.Tensor:
    """A view of ``store`` with ``like``'s shape and strides (its signature), at ``offset``."""
    return store.as_strided(like.shape, like.stride(), offset)


def test_bad_input_on_a_cached_signature_is_still_refused():
    """Addresses are not in the signature: an ``out`` or a cache overlapping an input, with
    the shapes and strides of a call that ran, must be refused by the cached plan before
    anything is written; and ``is_neox=1`` after ``True`` is checked as a new signature."""
    case = make_case(GLM5, 8, 3, neox=True)
    q, kv_c, cache = case.args[0], case.args[1], case.args[6]
    out = poison(torch.empty(3, 9, QUERY_WIDTH, dtype=torch.bfloat16))[:, :8]
    case.kwargs["out"] = out
    fusedq.mla_decode_front(*case.args, **case.kwargs)
    assert len(front_plans()) == 1

    def refused(args, kwargs, match):
        before = [_bits(t).clone() for t in (case.cache_buf, store)]
        with pytest.raises(ValueError, match=match):
            fusedq.mla_decode_front(*args, **kwargs)
        after = [_bits(t) for t in (case.cache_buf, store)]
        assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))

    # q and out in one buffer, each with the strides it had.
    store = torch.randn(4 * out.numel()).bfloat16()
    args = [_laid_over(store, q, 8), *case.args[1:]]
    refused(
        args, dict(case.kwargs, out=_laid_over(store, out, 0)), "^out: overlaps the memory of q;"
    )
    # The cache laid over kv_c's memory.
    store = torch.zeros(case.cache_buf.numel(), dtype=torch.bfloat16)
    args = [*case.args]
    args[1] = _laid_over(store, kv_c, 0)
    args[6] = _laid_over(store, cache, cache.storage_offset())
    refused(args, case.kwargs, "^kv_cache: overlaps the memory of kv_c;")
    assert len(front_plans()) == 1  # (each refused call was the cached signature's)
    refused(case.args, dict(case.kwargs, is_neox=1), "^is_neox: 1 must be True or False")
