"""The trace reader on traces whose answer is known: synthetic torch-profiler traces of a decode
(staged and fused, CUDA-graph replays and eager launches, several ranks, gzip and plain), the
paired table built from them, the report sections, and trace-summary's output and errors.

Each synthetic trace is written the way Kineto writes one: ``traceEvents`` of ``X`` events,
kernels on (device, stream) with ``args.correlation`` naming the runtime call that launched
them, CPU ops on the worker thread, vLLM's step annotations, metadata events around them.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

import pytest
from orch_cli import run_cli

from orchestrator.analysis.trace import DEFAULT_RULE, TraceError, find_rank_traces, read_trace
from orchestrator.config.errors import MatrixError
from orchestrator.config.expand import expand
from orchestrator.config.load import parse_matrix
from orchestrator.reports.markdown import render_markdown
from orchestrator.reports.profile import ProfilePair, Spread, profile_pairs
from orchestrator.results.profile_figures import ProfileResult
from orchestrator.results.recorded_run import Run
from orchestrator.results.rows import CaseResult
from orchestrator.results.store import RunStore

# Kernel durations (us) of one decode layer; the query step is W_UK_T's GEMM + the cat
# (staged) or the fused kernel, so its time per layer is known exactly.
UK_GEMM, CAT, FUSED = 3.0, 1.0, 2.5
LAYER = [
    ("nvjet_sm90_tst_128x64_64x4_2x1_v_bz_TNT", 6.0, "aten::mm"),  # q_a / kv_a projection
    ("void vllm::rms_norm_kernel<c10::BFloat16>", 1.5, "_C::rms_norm"),
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNN", 4.0, "aten::mm"),  # q_b projection
    ("void vllm::rotary_embedding_kernel<c10::BFloat16>", 1.0, "_C::rotary_embedding"),
    ("void vllm::concat_and_cache_mla_kernel<bf16>", 1.2, "_C::concat_and_cache_mla"),
    ("W_UK_T", UK_GEMM, "aten::bmm"),
    ("QUERY_TAIL", CAT, "aten::cat"),
    ("void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>", 8.0, "_flash_attn_forward"),
    ("void flash::FlashAttnFwdCombine<...>", 1.1, "_flash_attn_forward"),
    ("nvjet_sm90_tss_64x8_64x16_2x1_v_bz_TNN", 2.0, "aten::bmm"),  # W_UV
    ("nvjet_sm90_tst_128x64_64x4_2x1_v_bz_NNT", 5.0, "aten::mm"),  # o_proj
]
UK_NAME = "nvjet_sm90_tss_64x8_64x16_4x1_v_bz_TNN"
CAT_NAME = "void at::native::(anonymous namespace)::CatArrayBatchedCopy<...>"
FUSED_NAME = "_mla_query_kernel"
FRONT_NAME = "_mla_decode_front_kernel"
# The layer's RoPE and KV-cache write, which the decode front's one launch takes over.
ABSORBED = ("rotary_embedding", "concat_and_cache")


def decode_trace(
    path: Path,
    *,
    layers: int = 3,
    steps: int = 4,
    fused: bool = False,
    graphs: bool = True,
    rank: int = 0,
    slow: float = 0.0,
    front: bool = False,
) -> Path:
    """A decode trace: `steps` steps of `layers` layers (`front`: the fused query step is the
    decode front's kernel, and the layer's RoPE and KV-cache write kernels are gone). Graph mode: each step is one
    cudaGraphLaunch (its kernels share that call's correlation) beside 3 stream waits and 2
    event records; eager mode: each kernel launched by cudaLaunchKernel inside its CPU op.
    `slow` lengthens every kernel (a slower rank)."""
    events: list[dict] = [
        {"ph": "M", "name": "process_name", "pid": 0, "tid": 0, "args": {"name": "GPU 0"}},
        {"ph": "i", "s": "g", "name": "Iteration Start", "pid": "", "tid": "", "ts": 0},
    ]
    cpu_t, gpu_t, corr = 1000.0, 1000.0, 0

    def x(cat, name, ts, dur, **kw):
        events.append({"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, **kw})

    for step in range(steps):
        x("user_annotation", f"execute_context_0(0)_generation_1({step + 1})", cpu_t, 500.0,
          pid=1, tid=1)  # fmt: skip
        if graphs:
            corr += 1
            x("cuda_runtime", "cudaGraphLaunch", cpu_t + 1, 5.0, pid=1, tid=1,
              args={"correlation": corr})  # fmt: skip
            for i in range(3):
                x("cuda_runtime", "cudaStreamWaitEvent", cpu_t + 7 + i, 0.5, pid=1, tid=1)
            for i in range(2):
                x("cuda_runtime", "cudaEventRecord", cpu_t + 11 + i, 0.5, pid=1, tid=1)
        for _ in range(layers):
            for name, dur, op in LAYER:
                if front and any(a in name for a in ABSORBED):
                    continue
                if name == "W_UK_T":
                    if front:
                        name, dur, op = FRONT_NAME, FUSED, "fusedq::vllm_mla_front_update"
                    elif fused:
                        name, dur, op = FUSED_NAME, FUSED, "fusedq::mla_query_projection"
                    else:
                        name = UK_NAME
                elif name == "QUERY_TAIL":
                    if fused or front:
                        continue
                    name = CAT_NAME
                if not graphs:
                    corr += 1
                    x("cpu_op", op, cpu_t, 4.0, pid=1, tid=1)
                    x("cuda_runtime", "cudaLaunchKernel", cpu_t + 1, 2.0, pid=1, tid=1,
                      args={"correlation": corr})  # fmt: skip
                    cpu_t += 5.0
                x("kernel", name, gpu_t, dur + slow, pid=0, tid=7,
                  args={"correlation": corr, "device": 0, "stream": 7})  # fmt: skip
                gpu_t += dur + slow + 0.5
        # Sampling on a second stream, overlapping the last kernel by 1 us: busy < span.
        x("kernel", "void at::native::sampling_kernel", gpu_t - 1.5, 3.0, pid=0, tid=13,
          args={"correlation": corr})  # fmt: skip
        gpu_t += 10.0
        cpu_t = max(cpu_t + 600.0, gpu_t)
    x("cuda_runtime", "cudaStreamSynchronize", cpu_t, 1.0, pid=1, tid=1)
    name = f"dp0_pp0_tp{rank}_dcp0_ep0_rank{rank}.12345.pt.trace.json"
    text = json.dumps({"schemaVersion": 1, "traceEvents": events, "traceName": "t"})
    target = path / name
    if path.suffix != ".plain":
        target = target.with_name(name + ".gz")
        with gzip.open(target, "wt") as f:
            f.write(text)
    else:
        target.write_text(text)
    return target


@pytest.mark.parametrize("graphs", [True, False], ids=["graph-replay", "eager"])
@pytest.mark.parametrize("fused", [False, True], ids=["staged", "fused"])
def test_query_step_and_counts_are_exact(tmp_path, fused, graphs):
    layers, steps = 3, 4
    t = read_trace(decode_trace(tmp_path, layers=layers, steps=steps, fused=fused, graphs=graphs))
    per_layer = len(LAYER) - (1 if fused else 0)
    assert t.domain == "kernel" and t.rank == 0
    assert t.kernel_events == t.work_events == steps * (layers * per_layer + 1)
    assert t.steps_seen == steps
    q = t.query
    assert q.occurrences == layers * steps and q.path == ("fused" if fused else "staged")
    assert q.per_layer_us == pytest.approx(FUSED if fused else UK_GEMM + CAT)
    assert q.names == ({FUSED_NAME: 12} if fused else {UK_NAME: 12, CAT_NAME: 12})
    if graphs:
        assert t.calls == {
            "stream_wait_event": 3 * steps,
            "event_record": 2 * steps,
            "graph_launch": steps,
            "synchronize": 1,
        }
        assert q.launched_by == {"cudaGraphLaunch": q.events}
    else:
        # The ground truth an eager trace carries: the CPU op around each launch.
        expect = (
            {"fusedq::mla_query_projection": 12} if fused else {"aten::bmm": 12, "aten::cat": 12}
        )
        assert q.launched_by == expect
        assert t.calls["graph_launch"] == 0


def test_span_and_busy_time(tmp_path):
    t = read_trace(decode_trace(tmp_path, layers=1, steps=1))
    durs = [d for _, d, _ in LAYER]
    gaps = 0.5 * len(LAYER)
    end_of_layer = 1000.0 + sum(durs) + gaps
    # The sampling kernel starts 1.5 us before the layer's end (after its last 0.5 us gap)
    # and runs 3 us: the span ends 1.5 us past the layer, and 1 us of it overlaps.
    assert t.span_us == pytest.approx(end_of_layer + 1.5 - 1000.0)
    assert t.busy_us == pytest.approx(sum(durs) + 3.0 - 1.0)
    assert t.work_us == pytest.approx(sum(durs) + 3.0)
    assert t.top[0].name.startswith("void cutlass::device_kernel<flash::")


def test_plain_json_and_rank_files(tmp_path):
    plain = tmp_path / "x.plain"
    plain.mkdir()
    a = read_trace(decode_trace(plain, rank=3))
    b = read_trace(decode_trace(tmp_path, rank=3))
    assert a.rank == b.rank == 3
    assert a.model_dump(exclude={"file"}) == b.model_dump(exclude={"file"})
    (tmp_path / "host_1.async_llm.99.pt.trace.json.gz").write_bytes(b"")  # the API server's
    decode_trace(tmp_path, rank=1)
    assert [p.name[:24] for p in find_rank_traces(tmp_path)] == [
        "dp0_pp0_tp1_dcp0_ep0_ran",
        "dp0_pp0_tp3_dcp0_ep0_ran",  # the gzip one and the plain one below, by name
        "dp0_pp0_tp3_dcp0_ep0_ran",
    ]


def test_cpu_build_trace_counts_cpu_ops(tmp_path):
    """No kernel events: the CPU ops are the work; the query step is aten::bmm + aten::cat
    (nested children of the bmm are not concats of the query), or the fused op."""

    def op(name, ts, dur):
        return {"ph": "X", "cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}

    events = []
    t = 0.0
    for _ in range(2):  # layers
        events += [
            op("vllm::unified_mla_attention_with_output", t, 100.0),
            op("aten::bmm", t + 1, 30.0),
            op("aten::contiguous", t + 2, 5.0),  # a child of the bmm
            op("aten::cat", t + 40, 4.0),
            op("_C::mla_decode_kvcache", t + 50, 10.0),
            op("aten::bmm", t + 70, 20.0),  # W_UV: after the attention
        ]
        t += 200
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events}))
    got = read_trace(path)
    assert got.domain == "cpu_op" and got.kernel_events == 0 and got.work_events == 12
    assert got.query.occurrences == 2 and got.query.per_layer_us == pytest.approx(34.0)
    assert got.query.names == {"aten::bmm": 2, "aten::cat": 2}


def test_rule_classes():
    c = DEFAULT_RULE.classify
    assert c("void cutlass::device_kernel<flash::FlashAttnFwdSm90<...>>") == "attention"
    assert c("void vllm::concat_and_cache_mla_kernel<bf16>") == "other"
    assert c("triton_poi_fused_cat_clamp_div_0") == "concat"
    assert c("_mla_query_fma_kernel") == "fused" and c("fusedq::mla_query_projection") == "fused"
    # The Gluon kernels and the CuTe DSL kernel's symbol (a real one, H200 2026-12-01)
    assert c("_mla_query_gluon_kernel") == "fused" == c("_mla_query_gluon_smem_kernel")
    cute = "kernel_cutlass__mla_query_cute_kernel_tensorptrbf16_generic_align16_o_116192div8_0"
    assert c(cute) == "fused"
    assert c("my_mla_query_kernel2") == "other"
    assert c("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm" and c("aten::bmm") == "gemm"


def test_fusedq_names_are_the_real_ones():
    """The names the rule matches are those of the kernels and op fusedq really has."""
    pytest.importorskip("triton")
    import fusedq.ops  # noqa: F401  (registers the custom ops)
    from fusedq import contract
    from fusedq.kernels import gluon_mla_query as g
    from fusedq.kernels import triton_mla_query as k

    names = {k._mla_query_kernel.fn.__name__, k._mla_query_fma_kernel.fn.__name__}
    if g.AVAILABLE:
        names |= {g.kernel_for_operands(op).fn.__name__ for op in g.OPERANDS}
    else:  # (a Triton without Gluon: the names stay in the list for traces from elsewhere)
        names |= {n for n in contract.KERNEL_NAMES if "gluon" in n}
    # The CuTe DSL kernel (nvidia-cutlass-dsl is optional): its @cute.kernel function
    source = Path(k.__file__).with_name("cute_mla_query.py").read_text()
    cute = re.findall(r"@cute\.kernel\s+def (\w+)\(", source)
    assert len(cute) == 1
    names.add(cute[0])
    assert names == set(contract.KERNEL_NAMES)
    import torch

    ns, name = contract.OP_NAME.split("::")
    assert hasattr(getattr(torch.ops, ns), name)


@pytest.mark.parametrize(
    "content,message",
    [
        (None, "no such file"),
        (b"\x1f\x8b\x08\x00garbage", "truncated or corrupt gzip"),
        (b"hello", "not a JSON trace"),
        (b'{"foo": 1}', "not a torch-profiler trace"),
        (b'{"traceEvents": []}', "an empty traceEvents array"),
    ],
)
def test_bad_files_are_named(tmp_path, content, message):
    path = tmp_path / "bad.pt.trace.json.gz"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(TraceError, match=message) as err:
        read_trace(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_truncated_gzip_trace(tmp_path):
    good = decode_trace(tmp_path)
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(good.read_bytes()[:-200])
    with pytest.raises(TraceError, match="truncated or corrupt gzip"):
        read_trace(cut)


# --------------------------------------------------------------------------- the paired table


def _profile(
    tmp_path: Path, name: str, *, fused: bool, ranks: int, layers: int = 3, front: bool = False
):
    d = tmp_path / name
    d.mkdir()
    traces = [
        read_trace(decode_trace(d, layers=layers, fused=fused, rank=r, slow=0.1 * r, front=front))
        for r in range(ranks)
    ]
    return ProfileResult(decode_steps=4, layers=layers, traces=traces)


def test_paired_table_identity_and_sync(tmp_path):
    pair = ProfilePair(
        "m/tp2-dcp1-mtp0",
        "staged",
        "fused",
        _profile(tmp_path, "s", fused=False, ranks=2),
        _profile(tmp_path, "f", fused=True, ranks=2),
    )
    rows = {m: (b, c, d) for m, b, c, d in pair.table()}
    # Two ranks, the second 0.1 us slower per kernel: the mean and the range over ranks.
    assert rows["Query step per layer (us)"] == ("4.100 (4.000-4.200)", "2.550 (2.500-2.600)",
                                                "-37.80%")  # fmt: skip
    assert rows["CUDA kernel events, 4 steps"] == ("136", "124", "-12")
    assert "removed events" not in rows
    assert pair.identity() == (
        "Removed events: 12.0 per rank (mean over ranks); the query step's own 24 -> 12, 1 a "
        "layer and step over layers x steps = 3 x 4 = 12: 12 expected, the identity holds."
    )
    assert pair.sync() == (
        "No extra synchronisation: both traces contain 12 cudaStreamWaitEvent, 8 event "
        "records, 4 graph launches, 1 synchronizing calls per rank."
    )
    _, body = pair.per_rank()
    assert [r[0] for r in body] == ["0", "1"] and body[1][1] == "4.200"
    # A candidate that also lost a launch outside the query step breaks the identity.
    lost = [t.model_copy(update={"work_events": t.work_events - 1}) for t in pair.cand.traces]
    wrong = ProfilePair("t", "a", "b", pair.base, pair.cand.model_copy(update={"traces": lost}))
    assert "13.0 per rank" in wrong.identity() and "the identity does not hold" in wrong.identity()
    # One kernel replaced by one (the bmm alone against the fused kernel): 0 expected.
    same = ProfilePair("t", "a", "b", pair.base, pair.base)
    assert "0 expected, the identity holds" in same.identity()


def test_the_decode_front_is_the_query_step_and_takes_rope_and_the_cache_write(tmp_path):
    """The front's one kernel per layer is counted as the query step (not the last GEMM before
    attention), and the identity expects the RoPE and cache-write launches gone as well."""
    assert DEFAULT_RULE.classify(FRONT_NAME) == "fused"
    assert DEFAULT_RULE.classify("fusedq::vllm_mla_front_update") == "fused"
    pair = ProfilePair(
        "m/tp1-dcp1-mtp0",
        "staged",
        "front",
        _profile(tmp_path, "s", fused=False, ranks=1),
        _profile(tmp_path, "f", fused=False, front=True, ranks=1),
    )
    front = pair.cand.traces[0].query
    assert front.path == "fused" and front.names == {FRONT_NAME: 12}
    assert front.per_layer_us == pytest.approx(FUSED)
    assert pair.identity() == (
        "Removed events: 36.0 per rank (mean over ranks); the query step's own 24 -> 12, 1 a "
        "layer and step over layers x steps = 3 x 4 = 12; the decode front also takes the RoPE "
        "and KV-cache writes, 24 -> 0: 36 expected, the identity holds."
    )


def test_the_front_kernel_name_is_the_real_one():
    from orchestrator.analysis.kernel_names import FRONT_KERNEL_NAMES, FRONT_OP_NAMES

    source = Path(__file__).parents[2] / "fusedq" / "kernels" / "triton_decode_front.py"
    assert re.findall(r"^def (_mla_decode_front_kernel)\(", source.read_text(), re.M) == list(
        FRONT_KERNEL_NAMES
    )
    pytest.importorskip("vllm")
    import importlib

    import torch

    for module in ("fusedq.ops", "fusedq.vllm.front_hook"):  # importing registers the ops
        importlib.import_module(module)
    for op in FRONT_OP_NAMES:
        ns, name = op.split("::")
        assert hasattr(getattr(torch.ops, ns), name), op


def test_spread_text():
    assert Spread.of([None]) is None
    assert Spread.of([2.0]).text(1) == "2.0"
    assert Spread.of([1.0, 3.0]).text(1) == "2.0 (1.0-3.0)"


MATRIX = """
name: p
models: [{label: tiny, path: /m, num_heads: 16}]
topologies: [{tp: 2, mtp: [0]}]
workloads: [{name: ctx0, prompt_tokens: 1, output_tokens: 8}]
variants: [{name: staged, env: {FUSEDQ_MLA_QUERY: "0"}}, {name: fused}]
profile: {decode_steps: 4}
"""


def test_reports_show_the_paired_profile(tmp_path):
    m = parse_matrix(MATRIX, "p.yaml")
    cases = expand(m)
    store = RunStore.create(tmp_path, "run")
    store.write_manifest(
        {
            "run_id": "run",
            "matrix_path": "p.yaml",
            "matrix": m.model_dump(mode="json"),
            "cases": [c.to_dict() for c in cases],
        }
    )
    for case, fused in zip(cases, (False, True), strict=True):
        prof = _profile(tmp_path, case.variant.name, fused=fused, ranks=2)
        row = {**case.to_dict(), "status": "passed", "profile": prof.model_dump(mode="json")}
        store.append_result(CaseResult.model_validate(row))
    run = Run.load(store)
    assert len(profile_pairs(run.ordered, run.variants)) == 1
    md = render_markdown(run)
    assert "### tiny/tp2-dcp1-mtp0: staged vs fused" in md
    assert (
        "| Query step per layer (us) | 4.100 (4.000-4.200) | 2.550 (2.500-2.600) | -37.80% |" in md
    )
    assert "the identity holds" in md
    from orchestrator.reports import write_reports

    write_reports(store)
    report = json.loads((store.root / "report.json").read_text())
    assert report["profile_pairs"][0]["identity"].endswith("the identity holds.")
    assert len(report["cases"][0]["profile"]["traces"]) == 2
    html = (store.root / "report.html").read_text()
    assert "Decode profile, paired" in html and "4.100 (4.000-4.200)" in html
    # Read back from results.jsonl: the typed rows keep every rank's figures.
    again = Run.load(store).ordered[1].profile
    assert again is not None and again.traces[1].query.path == "fused"


def test_report_rereads_the_traces_a_run_kept(tmp_path):
    """`report --reread-traces`: a row stored by a version that did not know the front's
    kernel (its query step the last GEMM before attention) gets figures read anew from the
    trace its case directory kept; the other rows' lines stay byte for byte. A trace that is
    gone is named, and results.jsonl is left as it was."""
    m = parse_matrix(MATRIX, "p.yaml")
    cases = expand(m)
    store = RunStore.create(tmp_path, "run")
    store.write_manifest(
        {"run_id": "run", "matrix_path": "p.yaml", "matrix": m.model_dump(mode="json"),
         "cases": [c.to_dict() for c in cases]}
    )  # fmt: skip
    staged, front = cases
    store.append_result(CaseResult.model_validate({**staged.to_dict(), "status": "passed"}))
    case_dir = store.case_dir("front-case")
    trace = decode_trace(case_dir, front=True)
    old = read_trace(trace)
    # What the run stored before the front's name was known: a GEMM as its query step.
    stale = old.model_copy(
        update={"file": trace.name, "query": old.query.model_copy(update={"names": {"x": 1}})}
    )
    row = {**front.to_dict(), "case_id": "front-case", "status": "passed",
           "profile": {"decode_steps": 4, "layers": 3, "traces": [stale.model_dump(mode="json")]}}  # fmt: skip
    store.append_result(CaseResult.model_validate(row))
    before = store.results_path.read_text().splitlines()
    done = run_cli("report", "--reread-traces", str(store.root), timeout=120)
    assert done.returncode == 0, done.stderr
    assert "re-read the traces: 1 profiled rows changed" in done.stderr
    after = store.results_path.read_text().splitlines()
    assert after[0] == before[0] and after[1] != before[1]
    fresh = json.loads(after[1])["profile"]["traces"][0]
    assert fresh["query"]["names"] == {FRONT_NAME: 12} and fresh["file"] == trace.name
    trace.unlink()
    text = store.results_path.read_bytes()
    gone = run_cli("report", "--reread-traces", str(store.root), timeout=120)
    assert gone.returncode != 0 and f"trace {trace.name} is not in" in gone.stderr
    assert store.results_path.read_bytes() == text


def test_matrix_profile_key():
    m = parse_matrix(MATRIX, "p.yaml")
    assert m.profile is not None and m.profile.prompt_tokens == 1
    with pytest.raises(MatrixError, match=r"profile\.decode_step: unknown key"):
        parse_matrix(MATRIX.replace("decode_steps", "decode_step"), "p.yaml")
    with pytest.raises(MatrixError, match="passes --profiler-config itself"):
        parse_matrix(MATRIX + "engine: {args: ['--profiler-config={}']}\n", "p.yaml")


# --------------------------------------------------------------------------- trace-summary


def test_trace_summary_cli(tmp_path):
    a = decode_trace(tmp_path, rank=0)
    b = decode_trace(tmp_path, rank=1, slow=1.0)
    out = run_cli("trace-summary", str(a), str(b), "--steps", "4", timeout=60)
    assert out.returncode == 0, out.stderr
    assert "| kernel events | 136 |" in out.stdout
    assert "| per step (4 steps, given) | 34.0 |" in out.stdout
    assert "| cudaGraphLaunch | 4 |" in out.stdout
    assert "## Mean over 2 traces (range)" in out.stdout
    js = run_cli("trace-summary", str(a), "--json", timeout=60)
    data = json.loads(js.stdout)
    assert data["traces"][0]["query"]["occurrences"] == 12


@pytest.mark.parametrize("bad", ["missing.json.gz", "notrace.json"])
def test_trace_summary_errors(tmp_path, bad):
    path = tmp_path / bad
    if bad == "notrace.json":
        path.write_text('{"schemaVersion": 1}')
    out = run_cli("trace-summary", str(path), timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith(f"orchestrator: {path}: ") and out.stdout == ""


# A CUTLASS FlashAttention instance as the H200 traces name it (1,362 characters there).
LONG_NAME = (
    "void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<"
    "flash::CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >, "
    + ", ".join(f"cute::tuple<cute::C<{n}>, cute::C<64> >" for n in range(40))
    + ", cutlass::bfloat16_t, float, cutlass::arch::Sm90, false>, flash::X<3> > > >"
    "(flash::Params<cutlass::bfloat16_t>::Arguments)"
)


def test_short_name_folds_templates_to_fit_a_cell():
    from orchestrator.analysis.kernel_names import NAME_CELL_CHARS, short_name

    assert len(LONG_NAME) > 1000
    short = short_name(LONG_NAME)
    assert len(short) <= NAME_CELL_CHARS
    assert short.startswith("void cutlass::device_kernel<flash::enable_sm90_or_later<")
    assert "<…>" in short and "(" not in short  # arguments folded, parameters dropped
    assert short_name(UK_NAME) == UK_NAME  # a name that fits is left alone
    assert len(short_name("k_" + "x" * 500)) == NAME_CELL_CHARS  # no template: the middle cut


def test_trace_summary_cells_are_short_and_json_keeps_the_name(tmp_path):
    events = [
        {"ph": "X", "cat": "kernel", "name": LONG_NAME, "ts": 10.0 * i, "dur": 5.0, "pid": 0,
         "tid": 7, "args": {"correlation": i, "device": 0, "stream": 7}}
        for i in range(3)
    ]  # fmt: skip
    path = tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json"
    path.write_text(json.dumps({"schemaVersion": 1, "traceEvents": events}))
    out = run_cli("trace-summary", str(path), timeout=60)
    assert out.returncode == 0, out.stderr
    assert LONG_NAME not in out.stdout
    assert max(len(line) for line in out.stdout.splitlines()) < 200
    js = json.loads(run_cli("trace-summary", str(path), "--json", timeout=60).stdout)
    assert js["traces"][0]["top"][0]["name"] == LONG_NAME
