"""The decode step by kernel family: the family table against the kernel names of the committed
H200 traces, each trace's model steps (synthetic traces whose answer is known, and the real
ones), the two paths compared with an interval, and what the reports and trace-summary show.

The real traces are the committed runs': glm5-ab-1 (the 78-layer MoE stand-in of GLM-5 at
TP4, one switch-mode server, staged then fused, 4 decode steps each) and h200-profile-1 (the
4-layer tiny-glm5, MTP 0 and MTP 1).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from orch_cli import run_cli
from test_trace import LAYER, decode_trace

from orchestrator.analysis.ab import ab_results
from orchestrator.analysis.evidence import agree, evidence_chain
from orchestrator.analysis.kernel_names import (
    ATTENTION,
    COPIES,
    DEFAULT_FAMILIES,
    FAMILY_PATTERNS,
    GEMM,
    KV_CACHE,
    MOE,
    OTHER,
    QUERY,
    ROPE,
)
from orchestrator.analysis.stats import Interval
from orchestrator.analysis.step_compare import compare_steps, row_steps
from orchestrator.analysis.trace import find_rank_traces, read_trace
from orchestrator.reports import write_reports
from orchestrator.results.recorded_run import Run
from orchestrator.results.store import RunStore

REPO = Path(__file__).resolve().parents[2]
MOE_RUN = REPO / "docs/validation/h200-2026-12-02/glm5-ab-1"
MOE_TRACES = MOE_RUN / "cases/glm5-tp4__tp1-dcp1-mtp0__switch__s1/profile"
STAGED_TRACE = MOE_TRACES / "dp0_pp0_tp0_dcp0_ep0_rank0.1796226439783448656.pt.trace.json.gz"
FUSED_TRACE = MOE_TRACES / "dp0_pp0_tp0_dcp0_ep0_rank0.1796226450134113803.pt.trace.json.gz"
TINY_RUN = REPO / "docs/validation/h200-2026-11-30/h200-profile-1"
# The glm5 stand-in: 78 decoder layers, the first 3 dense, so 75 MoE layers.
LAYERS, MOE_LAYERS, STEPS = 78, 75, 4

# --------------------------------------------------------------------------- the family table

# Kernel names as the committed H200 traces spell them (cut where the name runs on).
REAL_NAMES = [
    ("_mla_query_gluon_kernel", QUERY),
    ("_mla_query_fma_kernel", QUERY),
    ("void cutlass::device_kernel<flash::enable_sm90_or_later<flash::FlashAttnFwdSm90<flash::"
     "CollectiveMainloopFwdSm90<2, cute::tuple<cute::C<1>, cute::C<1>, cute::C<1> >", ATTENTION),
    ("void cutlass::device_kernel<flash::FlashAttnFwdCombine<cute::tuple<cute::C<8>, "
     "cute::C<128> >, 5, 256, 1, false, true, cutlass::bfloat16_t, float", ATTENTION),
    ("void flash::prepare_varlen_num_blocks_kernel<1, false>(int, int, int, int const*)",
     ATTENTION),
    ("void vllm::concat_and_cache_mla_kernel<__nv_bfloat16, __nv_bfloat16, "
     "(vllm::Fp8KVCacheDataType)0>(__nv_bfloat16 const*, __nv_bfloat16 const*", KV_CACHE),
    ("triton_poi_fused_add_copy_index_select_mul_slice_split_stack_sub_unsqueeze_view_4", ROPE),
    ("triton_poi_fused_add_copy_index_select_mul_slice_split_stack_sub_unsqueeze_view_5", ROPE),
    ("nvjet_sm90_tst_64x8_64x16_2x1_v_bz_NNT", GEMM),
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_splitK_TNT", GEMM),
    ("nvjet_sm90_tst_8x64_64x16_4x1_v_badd_TNN", GEMM),
    ("void cublasLt::splitKreduce_kernel<32, 16, int, float, __nv_bfloat16, float>", GEMM),
    ("fused_moe_kernel", MOE),
    ("void vllm::moe::moe_sum_vec_kernel<c10::BFloat16, int, 8, false>(c10::BFloat16*)", MOE),
    ("memcpy32_post", COPIES),
    ("Memcpy DtoD (Device -> Device)", COPIES),
    ("Memcpy HtoD (Pinned -> Device)", COPIES),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda("
     "at::TensorIteratorBase&)::{lambda()#3}", COPIES),
    # Inductor names the norm it fuses around the MoE op after it: no MoE kernel.
    ("triton_red_fused_fused_add_rms_norm_moe_forward_shared_0", OTHER),
    ("triton_red_fused_add_fused_add_rms_norm_mul_1", OTHER),
    ("triton_poi_fused_mul_silu_slice_0", OTHER),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>", OTHER),
    ("Memset (Device)", OTHER),
    ("eagle_prepare_next_token_padded_kernel", OTHER),
]  # fmt: skip


@pytest.mark.parametrize(("name", "family"), REAL_NAMES, ids=[n[:40] for n, _ in REAL_NAMES])
def test_real_kernel_names_fall_in_their_family(name, family):
    assert DEFAULT_FAMILIES.family(name) == family


def test_every_family_entry_says_why_and_matches_a_name():
    for family, pattern, why in FAMILY_PATTERNS:
        assert len(why) > 40, (family, pattern)
    # Each family that a committed trace has is reached by some real name above.
    assert {f for _, f in REAL_NAMES} == {QUERY, ATTENTION, KV_CACHE, ROPE, GEMM, MOE, COPIES,
                                          OTHER}  # fmt: skip


# --------------------------------------------------------------------------- one trace


def test_a_synthetic_decode_step_splits_exactly(tmp_path):
    layers, steps = 3, 4
    t = read_trace(decode_trace(tmp_path, layers=layers, steps=steps))
    assert len(t.steps) == steps and t.outside is None
    durs = {name: dur for name, dur, _ in LAYER}
    for s in t.steps:
        f = s.families
        assert f[QUERY].events == 2 * layers  # W_UK_T's GEMM and the cat
        assert f[QUERY].us == pytest.approx(layers * (durs["W_UK_T"] + durs["QUERY_TAIL"]))
        assert f[ROPE].us == pytest.approx(layers * 1.0)
        assert f[KV_CACHE].us == pytest.approx(layers * 1.2)
        assert f[ATTENTION].events == 2 * layers
        assert f[GEMM].events == 4 * layers  # the projections, W_UV: not the query's GEMM
        assert s.us == pytest.approx(sum(durs.values()) * layers + 3.0)  # + sampling


def test_work_between_two_steps_belongs_to_the_first_and_copies_count(tmp_path):
    """An MTP draft runs after execute_model's annotation closes: it is its step's; a copy
    record is device work of its step; what launches after the closing empty step is not."""

    def x(cat, name, ts, dur, corr, **kw):
        return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur,
                "pid": kw.get("pid", 1), "tid": kw.get("tid", 1), "args": {"correlation": corr}}  # fmt: skip

    events = [
        x("user_annotation", "execute_context_1(1)_generation_0(0)", 0.0, 50.0, None),
        x("cuda_runtime", "cudaGraphLaunch", 10.0, 5.0, 1),
        x("kernel", "nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", 100.0, 4.0, 1, pid=0, tid=7),
        x("cuda_runtime", "cudaMemcpyAsync", 60.0, 2.0, 2),  # after the annotation closed
        x("gpu_memcpy", "Memcpy DtoD (Device -> Device)", 110.0, 1.0, 2, pid=0, tid=7),
        x("user_annotation", "execute_context_0(0)_generation_1(1)", 200.0, 50.0, None),
        x("cuda_runtime", "cudaLaunchKernel", 210.0, 5.0, 3),
        x("kernel", "memcpy32_post", 300.0, 1.0, 3, pid=0, tid=7),
        x("user_annotation", "execute_context_0(0)_generation_0(0)", 400.0, 5.0, None),
        x("cuda_runtime", "cudaLaunchKernel", 410.0, 5.0, 4),
        x("kernel", "fused_moe_kernel", 500.0, 9.0, 4, pid=0, tid=7),
    ]
    path = tmp_path / "dp0_pp0_tp0_dcp0_ep0_rank0.1.pt.trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    t = read_trace(path)
    assert t.steps_seen == 2 and t.kernel_events == 3
    first, second = t.steps
    assert first.families[GEMM].events == 1
    assert (first.families[COPIES].events, first.families[COPIES].kernels) == (1, 0)
    assert (second.families[COPIES].events, second.families[COPIES].kernels) == (1, 1)
    assert first.busy_us == pytest.approx(5.0)
    assert t.outside is not None and t.outside.families[MOE].us == pytest.approx(9.0)


def test_a_cpu_trace_has_no_step_figures(tmp_path):
    op = {"ph": "X", "cat": "cpu_op", "name": "aten::bmm", "ts": 1.0, "dur": 2.0, "pid": 1,
          "tid": 1}  # fmt: skip
    path = tmp_path / "cpu.json"
    path.write_text(json.dumps({"traceEvents": [op]}))
    t = read_trace(path)
    assert t.domain == "cpu_op" and t.steps == [] and t.outside is None


@pytest.mark.parametrize("path", [STAGED_TRACE, FUSED_TRACE], ids=["staged", "fused"])
def test_the_moe_traces_split_into_their_steps(path):
    t = read_trace(path)
    assert len(t.steps) == STEPS and t.outside is None  # every device event in a step
    for s in t.steps:
        assert s.families[QUERY].events == LAYERS
        assert s.families[KV_CACHE].events == s.families[ROPE].events == LAYERS
        assert s.families[ATTENTION].events == 2 * LAYERS + 1  # fwd + combine, the metadata
        assert s.families[MOE].events == 3 * MOE_LAYERS  # two expert GEMMs and moe_sum
    kernels = sum(f.kernels for s in t.steps for f in s.families.values())
    assert kernels == t.kernel_events


def test_the_staged_moe_graph_has_75_more_copy_kernels_a_step_and_no_more_copies():
    """The 300 kernel events the fused trace lacks are one copy per MoE layer and step: a
    memcpy32_post kernel in the staged graph, a Memcpy DtoD record (no kernel) in the fused
    one, the same copies."""
    staged, fused = read_trace(STAGED_TRACE), read_trace(FUSED_TRACE)
    assert staged.kernel_events - fused.kernel_events == MOE_LAYERS * STEPS == 300
    for s, f in zip(staged.steps, fused.steps, strict=True):
        sc, fc = s.families[COPIES], f.families[COPIES]
        assert sc.kernels - fc.kernels == MOE_LAYERS
        assert sc.events == fc.events
        assert sc.us == pytest.approx(fc.us, abs=3.0)  # ~1.05 µs each, either way
        others = {k for k in s.families if k != COPIES}
        assert all(s.families[k].kernels == f.families[k].kernels for k in others)


def test_the_mtp_draft_is_inside_its_step():
    """vLLM 0.26 runs the MTP draft after execute_model's annotation: still its step's."""
    run = Run.load(TINY_RUN)
    for row in run.ordered:
        [steps] = row_steps(row, run.root)
        assert len(steps) == STEPS
        # 4 layers, and the MTP layer's pass where there is one
        assert {s.families[QUERY].events for s in steps} == {4 + row.mtp}
        assert all(s.families[ATTENTION].events >= 2 * (4 + row.mtp) for s in steps)


# --------------------------------------------------------------------------- two paths


def _moe_comparison():
    run = Run.load(MOE_RUN)
    rows = {r.variant: r for r in run.ordered}
    return compare_steps(row_steps(rows["staged"], run.root), row_steps(rows["fused"], run.root))


def test_the_moe_step_by_family():
    c = _moe_comparison()
    assert c is not None and c.steps == STEPS and c.ranks == (1, 1)
    fam = {f.family: f for f in c.families}
    assert fam[QUERY].delta_us == pytest.approx(-58.63, abs=0.01)
    # The query step's change per model step is the stored per-layer figures' x 78.
    assert fam[QUERY].delta_us == pytest.approx((2.794 - 3.545) * LAYERS, abs=0.1)
    assert {f.family for f in c.changed()} == {QUERY, ATTENTION}
    assert fam[MOE].change.low < 0 < fam[MOE].change.high  # random routing: noise
    assert c.total.delta_us == pytest.approx(sum(f.delta_us for f in c.families))
    assert c.total.delta_us == pytest.approx(-81.10, abs=0.01)
    assert c.total.change.high < 0 and c.busy.delta_us == pytest.approx(-82.94, abs=0.01)
    assert fam[COPIES].base_kernels - fam[COPIES].cand_kernels == MOE_LAYERS
    assert fam[COPIES].base_events == fam[COPIES].cand_events
    assert c.recorded_apart() == [
        "copies: 93.5 events per step on both paths, of which 81.0 vs 6.0 kernels"
    ]


def test_a_trace_outside_its_case_directory_is_not_read(tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(MOE_RUN, run_dir)
    elsewhere = tmp_path / "elsewhere.pt.trace.json.gz"
    shutil.copy(STAGED_TRACE, elsewhere)
    run = Run.load(run_dir)
    row = run.ordered[0]
    row.profile.traces[0].file = "../../../elsewhere.pt.trace.json.gz"
    assert row_steps(row, run.root) == [[]]
    row.profile.traces[0].file = str(STAGED_TRACE.relative_to(MOE_TRACES.parent))
    assert len(row_steps(row, run.root)[0]) == STEPS


def test_the_moe_evidence_chain_is_judged_on_the_whole_step():
    run = Run.load(MOE_RUN)
    chain = evidence_chain(run, ab_results(run))
    assert [e.result.workload for e in chain] == ["greedy", "ctx0"]
    for e in chain:
        assert e.query_us == pytest.approx(-58.6, abs=0.1)
        assert e.predicted_us == pytest.approx(-81.10, abs=0.01)
        assert e.judged_on == "whole step" and e.agrees is True
        assert "every kernel family summed: -81.1 µs per model step" in e.sentence()
        assert "changed: query step -58.63 µs, attention -8.09 µs" in e.sentence()


def test_the_reports_show_the_step_by_family(tmp_path):
    run_dir = tmp_path / MOE_RUN.name
    shutil.copytree(MOE_RUN, run_dir)
    write_reports(RunStore(run_dir))
    md = (run_dir / "report.md").read_text()
    assert "One model step by kernel family (docs/profiling.md):" in md
    assert "| query step | 78.0 | 78.0 | 276.53 | 217.90 | -58.63 (-59.73 … -57.52) |" in md
    assert "Recorded apart: copies: 93.5 events per step on both paths" in md
    data = json.loads((run_dir / "report.json").read_text())
    [pair] = data["profile_pairs"]
    assert pair["by_family"]["changed"] == [QUERY, ATTENTION]
    assert data["ab"]["evidence"][0]["judged_on"] == "whole step"
    assert "One model step by kernel family" in (run_dir / "report.html").read_text()


def test_trace_summary_prints_the_families():
    out = run_cli("trace-summary", str(FUSED_TRACE), timeout=120)
    assert out.returncode == 0, out.stderr
    assert "| Family | Events/step | us/step, mean over its 4 model steps (range) |" in out.stdout
    assert "| query step | 78.0 | 217.90 (216.96-218.85) |" in out.stdout


def test_rank_traces_of_the_committed_runs_are_found():
    assert len(find_rank_traces(MOE_TRACES)) == 2


# The dense stand-in (builtin:glm5-dense, 78 layers, no experts; H100, 2026-12-06): its step
# figures are stored in its rows, so the chain is recomputed from them here.
DENSE_RUN = REPO / "docs/validation/h100-2026-12-06/glm5-dense-profile"


def test_the_dense_chain_agrees_on_the_whole_step_where_the_query_step_alone_did_not():
    run = Run.load(DENSE_RUN)
    chain = {e.result.workload: e for e in evidence_chain(run, ab_results(run))}
    assert sorted(chain) == ["ctx0", "greedy"]
    ctx0 = chain["ctx0"]
    assert ctx0.query_us == pytest.approx(-49.3, abs=0.05)
    assert ctx0.predicted_us == pytest.approx(-65.58, abs=0.01)
    # The query step alone lies outside the measured interval (-62.2 ... -56.1 µs); the sum of
    # the families, with attention's -11.6 µs, agrees.
    measured = ctx0.measured_us
    assert measured[1] == pytest.approx(-62.2, abs=0.05)
    assert measured[2] == pytest.approx(-56.1, abs=0.05)
    assert agree(measured, ctx0.query_us, None) is False
    assert ctx0.judged_on == "whole step" and ctx0.agrees is True
    changed = [f.family for f in ctx0.steps.families if f.changed]
    assert changed == ["query", "attention"]
    assert chain["greedy"].agrees is True


def test_the_agreement_rule_weighs_both_intervals():
    # 27.4 µs apart; the measured half-width facing the prediction is 26.9 µs.
    ctx0 = (-53.7, -80.6, -26.8)
    assert agree(ctx0, -81.1, None) is False
    assert agree(ctx0, -81.1, Interval(-81.1, -140.6, -21.6, 0.95, "t, 3 df")) is True
    # A tight profile interval leaves the measured one to decide.
    assert agree(ctx0, -81.1, Interval(-81.1, -82.0, -80.2, 0.95, "t, 3 df")) is False
    assert agree(ctx0, -30.0, None) is True
