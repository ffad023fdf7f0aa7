"""The vLLM plugin: the hook function, the MXFP8 cut, the version guard, the patched
``forward_impl`` on a stand-in layer, and (slow, e2e) real ``vllm serve`` runs of the tiny
model on CPU.

Without CUDA the fused kernel runs in Triton's interpreter (conftest sets
``TRITON_INTERPRET=1``), so every fused call here takes about a second: the parameter grids
are picked to cover heads, odd M, pitched output, E4M3 and MXFP8 without repeating work
that ``test_api.py`` already does.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import re
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch
from fusedq_cases import E4M3, Q_SCALE, TOLERANCES, assert_matches, poison, staged_decode_query
from tiny_vllm import (
    CPU_ENGINE_ARGS,
    DISABLED,
    E2E_TIMEOUT_S,
    ENABLED,
    FIRST_USE,
    MAX_TOKENS,
    PROFILE_STEPS,
    assert_greedy_agree,
    greedy,
    greedy_batch,
    greedy_staggered,
    greedy_together,
    log_lines,
    profile_decode,
    text_lines,
    vllm_server,
    worker_pids,
)

import fusedq
from fusedq.vllm import (
    backends,
    hook,
    layer_plan,
    patch,
    plugin,
    query,
    releases,
    report,
    switch,
)
from fusedq.vllm.query import decode_query, mxfp8_w_uk_t

P, R, L, V = 192, 64, 512, 128


def kv_b_proj_weight(h: int, gen: torch.Generator, p: int = P, v: int = V) -> torch.Tensor:
    """A bf16 kv_b_proj weight, [H * (P + V), L] as vLLM's ColumnParallelLinear holds it."""
    return (torch.randn(h * (p + v), L, generator=gen) * 0.05).to(torch.bfloat16)


def vllm_w_uk_t(weight: torch.Tensor, h: int, p: int = P, v: int = V) -> torch.Tensor:
    """W_UK_T exactly as MLAAttention.process_weights_after_loading builds it: a strided view."""
    w_uk, _ = weight.T.view(L, h, p + v).split([p, v], dim=-1)
    return w_uk.permute(1, 2, 0)


def vllm_q(
    m: int, h: int, gen: torch.Generator, device: torch.device | str = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """(mqa_q_nope in vLLM's (N, B, P) transposed layout, mqa_q_pe) sliced from one q."""
    q = torch.randn(m, h, P + R, generator=gen).to(device, torch.bfloat16)
    q_nope, q_pe = q.split([P, R], dim=-1)
    return q_nope.transpose(0, 1), q_pe


def as_query(staged) -> torch.Tensor:
    return torch.cat(staged, dim=-1) if isinstance(staged, tuple) else staged


# --- the hook function -----------------------------------------------------------------------


@pytest.mark.parametrize(
    "h,m,out_dtype,pitched",
    [
        (8, 1, torch.bfloat16, False),
        (11, 3, torch.bfloat16, True),
        (16, 17, torch.bfloat16, False),
        (8, 32, E4M3, False),
        (16, 2, E4M3, True),
    ],
)
def test_decode_query_matches_vllm_staged_path(h, m, out_dtype, pitched, device):
    gen = torch.Generator().manual_seed(h * 100 + m)
    w_uk_t = vllm_w_uk_t(kv_b_proj_weight(h, gen).to(device), h)
    assert not w_uk_t.is_contiguous()
    q_nope, q_pe = vllm_q(m, h, gen, device)
    q_scale = torch.tensor(Q_SCALE, device=device) if out_dtype == E4M3 else None
    out = None
    if pitched:  # a workspace slice: rows and heads pitched wider than [M, H, 576]
        out = poison(torch.empty(m, h + 1, 640, dtype=out_dtype, device=device))[:, :h, : L + R]
    got = decode_query(q_nope, w_uk_t, q_pe, out_dtype=out_dtype, q_scale=q_scale, out=out)
    assert got is not None and got.shape == (m, h, L + R) and got.dtype == out_dtype
    if out is None:
        assert got.is_contiguous()
    else:
        assert got.data_ptr() == out.data_ptr()
    # E4M3 out is compared with the E4M3 rounding of the staged BF16 query (assert_matches);
    # vLLM's own E4M3 query is that rounding.
    vllm_ref = as_query(staged_decode_query(q_nope, w_uk_t, q_pe))
    assert_matches(got, vllm_ref, "bf16", q_scale)
    if q_scale is not None:
        vllm_e4m3 = staged_decode_query(q_nope, w_uk_t, q_pe, q_scale=q_scale)
        assert_matches(vllm_e4m3, vllm_ref, "bf16", q_scale)
    fusedq_ref = fusedq.staged_mla_query(q_nope.transpose(0, 1), w_uk_t, q_pe)
    assert_matches(got, fusedq_ref, "bf16", q_scale)


@pytest.mark.parametrize("h,m", [(4, 1), (8, 33), (12, 2)])
def test_decode_query_declines_what_fusedq_cannot_run(h, m, device):
    gen = torch.Generator().manual_seed(7)
    w_uk_t = vllm_w_uk_t(kv_b_proj_weight(h, gen).to(device), h)
    q_nope, q_pe = vllm_q(m, h, gen, device)
    out = poison(torch.empty(m, h, L + R, dtype=torch.bfloat16, device=device))
    assert decode_query(q_nope, w_uk_t, q_pe, out=out) is None
    assert out.isnan().all(), "a declined call must not write"
    assert not fusedq.can_implement(h, m)


@pytest.mark.parametrize("h,m", [(16, 3), (8, 1)])
def test_split_query_hands_a_pair_of_views_of_the_fused_output(h, m, device):
    """What a backend that takes only a (q_nope, q_rope) pair gets: two views of the fused
    [M, H, 576] buffer (no copy), with unit last strides (FlashAttention 3's check of q and
    q_v), equal to the staged path's pair."""
    gen = torch.Generator().manual_seed(h + m)
    w_uk_t = vllm_w_uk_t(kv_b_proj_weight(h, gen).to(device), h)
    q_nope, q_pe = vllm_q(m, h, gen, device)
    out = decode_query(q_nope, w_uk_t, q_pe)
    ql_nope, q_rope = query.split_query(out)
    assert ql_nope.shape == (m, h, L) and q_rope.shape == (m, h, R)
    assert ql_nope.data_ptr() == out.data_ptr()
    assert q_rope.data_ptr() == out.data_ptr() + L * out.element_size()
    assert ql_nope.stride() == q_rope.stride() == (h * (L + R), L + R, 1)
    staged_nope, staged_pe = staged_decode_query(q_nope, w_uk_t, q_pe)
    assert_matches(
        torch.cat((ql_nope, q_rope), -1), torch.cat((staged_nope, staged_pe), -1), "bf16"
    )
    assert torch.equal(q_rope, q_pe)


def test_prewarm_values_keep_only_fused_capture_sizes(device):
    sizes = [1, 2, 4, 8, 16, 24, 32, 40, 48, 512]
    assert query.prewarm_values(sizes, 8, "bf16", torch.bfloat16, device) == [
        1, 2, 4, 8, 16, 24, 32,
    ]  # fmt: skip
    assert query.prewarm_values(sizes, 4, "bf16", torch.bfloat16, device) == []


@pytest.mark.parametrize("backend", ["triton", "auto"])
def test_hook_prewarm_compiles_the_fused_ms_variants(monkeypatch, device, backend):
    """The hook's prewarm compiles (here: registers, under the interpreter) each M's Triton
    variant for the qualified M only, for either hook backend; the GPU test shows the CuTe
    variants stay out under "triton"."""
    from fusedq.kernels import triton_launch

    h = 8
    gen = torch.Generator().manual_seed(3)
    w = (torch.randn(h, P, L, generator=gen) * 0.05).to(torch.bfloat16).to(device)
    monkeypatch.setattr(query, "BACKEND", backend)
    monkeypatch.setattr(triton_launch, "_compiled", set())
    assert query.prewarm(w, [1, 2, 2, 48], out_dtype=torch.bfloat16) > 0
    rows = {k.config.block_m for k in triton_launch.compiled_keys()}
    assert rows and max(rows) <= 32  # M=48 is past GLM-5's qualified M: staged, none compiled
    assert query.prewarm(w, [1, 2, 48], out_dtype=torch.bfloat16) == 0  # nothing new


def test_plugin_and_hook_import_without_vllm():
    """The GPU tests drive these modules on a machine without vLLM: importing them (and
    reading the hook) must not import vLLM; only register() does."""
    code = (
        "import sys, fusedq.vllm.plugin, fusedq.vllm.worker_ext; "
        "assert not [m for m in sys.modules if m == 'vllm' or m.startswith('vllm.')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


# --- native MXFP8 --------------------------------------------------------------------------


def mxfp8_kv_b_proj(h: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """A checkpoint-layout MXFP8 kv_b_proj: E4M3 [H*(P+V), L], E8M0 bytes [H*(P+V), L/32]."""
    rows = h * (P + V)
    values = (torch.randn(rows, L, generator=gen) * 64).clamp(-448, 448).to(E4M3)
    scales = torch.randint(115, 125, (rows, L // 32), generator=gen, dtype=torch.uint8)
    return values, scales


def dequant_rows(values: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    factors = torch.exp2(scales.float() - 127).repeat_interleave(32, dim=-1)
    return (values.float() * factors).to(torch.bfloat16)


@pytest.mark.parametrize("scale_dtype", ["uint8", "float8_e8m0fnu"])
def test_mxfp8_w_uk_t_is_the_n_blocked_view_of_kv_b_proj(scale_dtype):
    h = 8
    gen = torch.Generator().manual_seed(3)
    values, scales = mxfp8_kv_b_proj(h, gen)
    stored = scales.view(getattr(torch, scale_dtype))
    wq = mxfp8_w_uk_t(values, stored, num_heads=h, v_head_dim=V)
    assert tuple(wq.values.shape) == (h, P, L) and tuple(wq.scales.shape) == (h, P, L // 32)
    # Views, not copies: the MXFP8 bytes are shared with kv_b_proj.
    assert wq.values.untyped_storage().data_ptr() == values.untyped_storage().data_ptr()
    # What vLLM would have built by dequantising kv_b_proj to bf16 first (exact).
    expected = vllm_w_uk_t(dequant_rows(values, scales), h)
    assert torch.equal(fusedq.dequantize_mxfp8(wq), expected)


def test_mxfp8_decode_query_matches_bf16_w_uk_t(device):
    h, m = 8, 5
    gen = torch.Generator().manual_seed(5)
    values, scales = (t.to(device) for t in mxfp8_kv_b_proj(h, gen))
    wq = mxfp8_w_uk_t(values, scales, num_heads=h, v_head_dim=V)
    q_nope, q_pe = vllm_q(m, h, gen, device)
    got = decode_query(q_nope, wq, q_pe)
    bf16_w_uk_t = vllm_w_uk_t(dequant_rows(values, scales), h)
    ref = as_query(staged_decode_query(q_nope, bf16_w_uk_t, q_pe))
    # Dequantisation is exact, so MXFP8 is held to the bf16 bound (see fusedq_cases).
    assert TOLERANCES[("mxfp8", torch.bfloat16)] == TOLERANCES[("bf16", torch.bfloat16)]
    assert_matches(got, ref, "mxfp8")


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda w, s: (w.to(torch.bfloat16), s), "dtype"),  # dequantised at load
        (lambda w, s: (w.t().contiguous().t(), s), "row-major"),  # column-major values
        (lambda w, s: (w, s.reshape(-1)[: s.numel() // 2].reshape(-1, 8)), "unswizzled"),
        (lambda w, s: (w, s.float()), "E8M0"),  # block-FP8 fp32 scales
    ],
)
def test_mxfp8_w_uk_t_rejects_kernel_layouts(mutate, match):
    values, scales = mxfp8_kv_b_proj(8, torch.Generator().manual_seed(1))
    w, s = mutate(values, scales)
    with pytest.raises(ValueError, match=match):
        mxfp8_w_uk_t(w, s, num_heads=8, v_head_dim=V)


# --- the guard and the patched forward_impl (needs vLLM, not a server) ---------------------


def test_guard_accepts_the_installed_vllm(mla):
    found = patch.check_vllm()
    assert found.cls is mla.MLAAttention
    assert mla.MLAAttention.forward_impl is found.forward_impl.__wrapped__, "check only"
    assert patch.HOOK_NAME not in mla.__dict__


def test_guard_rejects_other_versions(mla, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    with pytest.raises(ValueError, match=r"vLLM 0\.40\.1 is outside the supported range"):
        patch.check_vllm()


def test_guard_rejects_a_changed_query_block(mla, monkeypatch):
    span = re.escape(installed_release().span())
    rows = tuple(dataclasses.replace(r, blocks={"x": "0" * 64}) for r in releases.RELEASES)
    monkeypatch.setattr(releases, "RELEASES", rows)
    with pytest.raises(ValueError, match=rf"query block .* differs .* vLLM {span}"):
        patch.check_vllm()


def test_releases_are_rows_that_do_not_overlap():
    spans = sorted(r.versions for r in releases.RELEASES)
    assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), spans
    assert releases.release_for((0, 26, 0)).name == "0.26"
    assert releases.release_for((0, 33, 1)).name == "0.32"
    assert releases.release_for((0, 27, 0)) is None


def installed_release():
    """The RELEASES row of the vLLM installed here (0.32 on CPU CI, 0.26 on the H200)."""
    row = releases.release_for(patch._vllm_version()[1])
    assert row is not None, "these tests run against a supported vLLM"
    return row


def test_guard_picks_the_row_by_version(mla, monkeypatch):
    """The installed source under the other release's row fails on that row's own anchors."""
    import vllm

    other = "0.32.0" if installed_release().name == "0.26" else "0.26.0"
    anchor = {"0.32.0": r"dcp_manager\.query_gather", "0.26.0": r"get_dcp_group\(\)\.all_gather"}
    monkeypatch.setattr(vllm, "__version__", other)
    with pytest.raises(ValueError, match=anchor[other]):
        patch.check_vllm()


# vLLM 0.26.0's forward_impl (tests/fusedq/fixtures/README.md): 0.32's module cannot import
# 0.26's, so its source is recompiled in 0.32's module globals, which hold every name its
# decode path reads.
FORWARD_IMPL_026 = Path(__file__).parent / "fixtures/vllm-0.26.0-mla_attention-forward_impl.py.txt"


def forward_impl_026(mla, *, hooked: bool):
    import textwrap

    source = textwrap.dedent(FORWARD_IMPL_026.read_text())
    release = releases.release_for((0, 26))
    if hooked:
        return patch.compile_patched(source, release, mla.__dict__, filename="<0.26 patched>")
    namespace: dict = {}
    exec(compile(source, "<0.26>", "exec"), mla.__dict__, namespace)
    return namespace["forward_impl"]


def test_release_026_block_is_known_and_gets_the_hook(mla):
    import textwrap

    source = textwrap.dedent(FORWARD_IMPL_026.read_text())
    patched = patch.transform_forward_impl(source, releases.release_for((0, 26)))
    # 0.26 replicates no query for DCP: the hook is told so by a constant, not a local.
    assert f"mqa_q = {patch.HOOK_NAME}(self, mqa_q_nope, mqa_q_pe, False, fp8_attention)" in (
        patched.source
    )
    forward_impl_026(mla, hooked=True)  # hash and locals hold
    with pytest.raises(ValueError, match=r"dcp_manager\.query_gather"):
        patch.transform_forward_impl(source, releases.release_for((0, 32)))


@pytest.mark.parametrize(
    "edit,match",
    [
        (
            lambda s: s.replace("mqa_q = (mqa_ql_nope, mqa_q_pe)", "mqa_q = mqa_ql_nope"),
            "no 'mqa_q",
        ),
        (lambda s: s.replace("mqa_q_nope = mqa_q_nope.transpose(0, 1)", "pass"), "transpose"),
        (lambda s: s.replace("if isinstance(mqa_q, tuple):", "if False:"), "isinstance"),
        (
            lambda s: s + "\n        if self.is_aiter_triton_fp4_bmm_enabled:\n            pass\n",
            "2 lines",
        ),
    ],
)
def test_transform_names_the_missing_expectation(mla, edit, match):
    import inspect
    import textwrap

    source = textwrap.dedent(inspect.getsource(mla.MLAAttention.forward_impl))
    release = installed_release()
    patch.transform_forward_impl(source, release)  # the unedited source transforms
    with pytest.raises(ValueError, match=match):
        patch.transform_forward_impl(edit(source), release)


def test_register_mode_0_touches_nothing(mla, monkeypatch, caplog):
    monkeypatch.setenv(report.MODE_ENV, "0")
    before = mla.MLAAttention.forward_impl
    plugin.register()
    assert mla.MLAAttention.forward_impl is before
    assert "fusedq" not in caplog.text


@pytest.mark.parametrize("value", ["auto", "", "AUTO"])
def test_register_patches_once(mla, monkeypatch, value):
    monkeypatch.setenv(report.MODE_ENV, value)
    original = mla.MLAAttention.forward_impl
    plugin.register()
    patched = mla.MLAAttention.forward_impl
    assert patched is not original and patched.__wrapped__ is original
    assert mla.__dict__[patch.HOOK_NAME] is hook.decode_query_hook
    plugin.register()  # vLLM may call it again in the same process
    assert mla.MLAAttention.forward_impl is patched


def test_register_guard_failure_logs_and_leaves_vllm_untouched(mla, monkeypatch, caplog):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.delenv(report.MODE_ENV, raising=False)
    before = dict(mla.MLAAttention.__dict__)
    plugin.register()
    assert dict(mla.MLAAttention.__dict__) == before
    assert patch.HOOK_NAME not in mla.__dict__
    assert "fusedq: fused MLA query disabled: vLLM 0.99.0 is outside" in caplog.text


def test_register_required_mode_fails_on_guard(mla, monkeypatch):
    import vllm

    monkeypatch.setattr(vllm, "__version__", "0.99.0")
    monkeypatch.setenv(report.MODE_ENV, "1")
    with pytest.raises(report.FusedqRequiredError, match=r"FUSEDQ_MLA_QUERY=1 .* 0\.99\.0"):
        plugin.register()


def test_register_rejects_unknown_mode(mla, monkeypatch, caplog):
    monkeypatch.setenv(report.MODE_ENV, "yes")
    before = mla.MLAAttention.forward_impl
    plugin.register()
    assert mla.MLAAttention.forward_impl is before
    assert "disabled: FUSEDQ_MLA_QUERY='yes' is not one of auto, 0, 1" in caplog.text


@pytest.mark.parametrize(
    ("value", "bound"), [(None, "triton"), ("AUTO", "auto"), (" triton", "triton")]
)
def test_register_binds_the_hooks_backend(mla, monkeypatch, value, bound):
    from fusedq.vllm import query

    monkeypatch.setattr(query, "BACKEND", "unset")
    monkeypatch.delenv(report.MODE_ENV, raising=False)
    if value is None:
        monkeypatch.delenv(report.BACKEND_ENV, raising=False)
    else:
        monkeypatch.setenv(report.BACKEND_ENV, value)
    plugin.register()
    assert bound == query.BACKEND


@pytest.mark.parametrize("required", [False, True])
def test_register_rejects_an_unknown_backend(mla, monkeypatch, caplog, required):
    """FUSEDQ_BACKEND=cute (not a hook backend): auto mode leaves vLLM as shipped and says
    why; required mode fails the start naming the variable."""
    monkeypatch.setenv(report.BACKEND_ENV, "cute")
    monkeypatch.setenv(report.MODE_ENV, "1" if required else "auto")
    before = mla.MLAAttention.forward_impl
    want = "FUSEDQ_BACKEND='cute' is not one of triton, auto"
    if required:
        with pytest.raises(report.FusedqRequiredError, match=f"FUSEDQ_MLA_QUERY=1 but {want}"):
            plugin.register()
    else:
        plugin.register()
        assert f"fusedq: fused MLA query disabled: {want}" in caplog.text
    assert mla.MLAAttention.forward_impl is before


class StandInLayer(types.SimpleNamespace):
    """The MLAAttention attributes forward_impl's decode path and the plugin read."""


def stand_in_impl(cls: type, **attrs) -> object:
    """An instance of a real attention impl class, not initialised (its __init__ wants a GPU
    and a vLLM config): the plan reads its class, forward_impl its attributes."""
    impl = object.__new__(cls)
    impl.__dict__.update(attrs)
    return impl


def stand_in_layer(mla, h: int, *, fp8: bool, gen: torch.Generator, geometry=None) -> StandInLayer:
    """A planned-for MLA layer of P nope and V value dims, or of ``geometry``'s."""
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    p, v = (P, V) if geometry is None else (geometry.qk_nope, geometry.v_head)

    # TRITON_MLA (an ATTENTION_BACKENDS row for 0.26 and 0.32, importable on CPU): its class,
    # with the decode kernel replaced on the instance by a recorder of the query it is handed.
    from vllm.v1.attention.backends.mla.triton_mla import TritonMLAImpl

    seen: list[torch.Tensor] = []

    def forward_mqa(q, kv_cache, attn_metadata, layer):
        seen.append(torch.cat(q, dim=-1) if isinstance(q, tuple) else q)
        return torch.zeros(seen[-1].shape[0], h, L, dtype=torch.bfloat16), None

    impl = stand_in_impl(
        TritonMLAImpl, is_sparse=False, dcp_world_size=1, supports_quant_query_input=True,
        forward_mqa=forward_mqa,
    )  # fmt: skip
    layer = StandInLayer(
        num_heads=h, v_head_dim=v, qk_nope_head_dim=p, qk_rope_head_dim=R, kv_lora_rank=L,
        kv_cache_dtype="fp8" if fp8 else "auto", use_pcp=False, prefill_backend=None,
        q_pad_num_heads=None, is_aiter_triton_fp4_bmm_enabled=False,
        is_aiter_triton_fp8_bmm_enabled=False, is_amx_bmm_enabled=False,
        W_UK_T=vllm_w_uk_t(kv_b_proj_weight(h, gen, p, v), h, p, v), W_UK_T_dcp_qrep=None,
        _q_scale=torch.tensor(Q_SCALE), impl=impl, layer_name=f"model.layers.0.h{h}",
        kv_b_proj=types.SimpleNamespace(weight=None), _vllm_config=None,
        _v_up_proj=lambda attn_out, out: None, seen=seen,
    )  # fmt: skip
    if fp8:
        # vLLM's own op, run natively (compile_native would start inductor on CPU).
        layer._decode_concat_quant_fp8_op = mla._DecodeConcatQuantFP8(
            static=True, group_shape=GroupShape.PER_TENSOR, compile_native=False
        )
    return layer


def run_forward_impl(forward_impl, layer, m: int, gen: torch.Generator) -> torch.Tensor:
    h = layer.num_heads
    q = torch.randn(m, h, layer.qk_nope_head_dim + R, generator=gen).to(torch.bfloat16)
    meta = types.SimpleNamespace(
        num_actual_tokens=m, num_decodes=m, num_prefills=0, num_decode_tokens=m,
        decode=object(), prefill=None,
    )  # fmt: skip
    out = torch.empty(m, h * V, dtype=torch.bfloat16)
    kv_cache = torch.empty(1, 16, L + R, dtype=torch.bfloat16)
    forward_impl(layer, q, torch.empty(m, L), torch.empty(m, 1, R), kv_cache, meta, output=out)
    return layer.seen[-1]


def assert_hands_on_the_staged_query(mla, patched, staged, h, m, fp8, *, amx=True):
    """Run both forward_impls on one planned stand-in layer: the query forward_mqa receives
    from the patched one equals the staged one's; M > 32 takes vLLM's own block (bit-equal)."""
    from vllm.config import VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig()):  # vLLM's CustomOp (the FP8 quant) wants one
        layer = stand_in_layer(mla, h, fp8=fp8, gen=torch.Generator().manual_seed(0))
        if not amx:
            del layer.is_amx_bmm_enabled  # a release without the AMX branch must not need it
        plan, note = layer_plan.plan_layer(layer)
        assert plan is not None, note
        layer.__dict__[layer_plan.PLAN_ATTR] = plan
        got = run_forward_impl(patched, layer, m, torch.Generator().manual_seed(m))
        ref = run_forward_impl(staged, layer, m, torch.Generator().manual_seed(m))
    assert got.dtype == (E4M3 if fp8 else torch.bfloat16) and got.shape == (m, h, L + R)
    if m > 32:
        assert torch.equal(got, ref)
    elif fp8:
        # E4M3: both queries against the E4M3 rounding of the staged BF16 query of the same q
        # (assert_matches): the fused one, and vLLM's own quantisation, which must be that.
        q = torch.randn(m, h, P + R, generator=torch.Generator().manual_seed(m)).bfloat16()
        bf16 = fusedq.staged_mla_query(q[..., :P], layer.W_UK_T, q[..., P:])
        assert got.is_contiguous()
        assert_matches(got, bf16, "bf16", layer._q_scale)
        assert_matches(ref, bf16, "bf16", layer._q_scale)
        assert switch.first_use.is_set()
    else:
        assert got.is_contiguous()
        assert_matches(got, ref, "bf16")
        assert switch.first_use.is_set()


@pytest.mark.parametrize("h,m,fp8", [(8, 2, False), (16, 5, True), (8, 33, False)])
def test_patched_forward_impl_hands_the_backend_the_staged_query(mla, h, m, fp8):
    """The installed vLLM's forward_impl, recompiled with the hook."""
    found = patch.check_vllm()
    patch.apply(found)
    original = found.forward_impl.__wrapped__
    assert_hands_on_the_staged_query(mla, found.forward_impl, original, h, m, fp8)


@pytest.mark.parametrize("h,m,fp8", [(16, 3, False), (8, 1, True), (11, 33, False)])
def test_patched_026_forward_impl_hands_the_backend_the_staged_query(mla, h, m, fp8):
    """vLLM 0.26's forward_impl (its (N, B, L) bmm buffer + transpose), recompiled likewise."""
    patched = forward_impl_026(mla, hooked=True)
    staged = forward_impl_026(mla, hooked=False)
    releases.installed["release"] = releases.release_for((0, 26))
    mla.__dict__[patch.HOOK_NAME] = hook.decode_query_hook  # what apply() installs
    assert_hands_on_the_staged_query(mla, patched, staged, h, m, fp8, amx=False)


def test_setup_layer_logs_one_line_per_process(mla, monkeypatch, caplog):
    import logging

    monkeypatch.delenv(report.MODE_ENV, raising=False)
    patch.apply(patch.check_vllm())
    caplog.set_level(logging.INFO, logger="vllm.fusedq")
    gen = torch.Generator().manual_seed(0)
    for i in range(3):
        layer = stand_in_layer(mla, 8, fp8=False, gen=gen)
        layer.layer_name = f"model.layers.{i}.self_attn.attn"
        layer_plan.setup_layer(layer)
        assert layer.__dict__[layer_plan.PLAN_ATTR] is not None
    lines = [r.getMessage() for r in caplog.records if "fused MLA query enabled" in r.getMessage()]
    assert lines == [
        "fusedq: fused MLA query enabled (heads=8, format=bf16, query=tensor, prewarmed M=none "
        "[no CUDA graphs on cpu], pdl=off)"
    ]
    # Beside it, once, the kernel each decode M runs (here the interpreter's choices).
    kernels = [r.getMessage() for r in caplog.records if "fusedq: kernels" in r.getMessage()]
    assert kernels == [
        "fusedq: kernels (heads=8, format=bf16): "
        + fusedq.kernel_summary(8, layer_plan.DECODE_MS, device=layer.W_UK_T.device)
    ]
    assert kernels[0].endswith("; M=2-32 tl.dot") and "M=1" in kernels[0]


def test_setup_layer_tells_a_differing_layer_once(mla, monkeypatch, caplog):
    """Two qualified layers and two that are not (say, a draft model's): one enabled line,
    one line for the differing outcome, never a second "disabled:" line."""
    import logging

    monkeypatch.delenv(report.MODE_ENV, raising=False)
    patch.apply(patch.check_vllm())
    caplog.set_level(logging.INFO, logger="vllm.fusedq")
    gen = torch.Generator().manual_seed(0)
    for i, heads in enumerate((8, 8, 4, 4)):
        layer = stand_in_layer(mla, 8, fp8=False, gen=gen)
        layer.num_heads, layer.layer_name = heads, f"model.layers.{i}.self_attn.attn"
        layer_plan.setup_layer(layer)
    messages = [r.getMessage() for r in caplog.records if r.name == "vllm.fusedq"]
    assert len([m for m in messages if "fused MLA query enabled" in m]) == 1
    assert not [m for m in messages if "fused MLA query disabled" in m]
    differing = [m for m in messages if "not used for layer" in m]
    assert len(differing) == 1 and "model.layers.2" in differing[0], messages


@pytest.mark.parametrize(
    "attrs,reason",
    [
        ({"num_heads": 4}, "num_heads=4 is not qualified"),
        ({"is_amx_bmm_enabled": True}, "AMX"),
        ({"q_pad_num_heads": 16}, "pads query heads"),
        ({"is_aiter_triton_fp8_bmm_enabled": True}, "aiter"),
    ],
)
def test_setup_layer_falls_back_and_says_why(mla, monkeypatch, caplog, attrs, reason):
    monkeypatch.delenv(report.MODE_ENV, raising=False)
    patch.apply(patch.check_vllm())
    layer = stand_in_layer(mla, 8, fp8=False, gen=torch.Generator().manual_seed(0))
    for k, v in attrs.items():
        setattr(layer, k, v)
    layer_plan.setup_layer(layer)
    assert layer.__dict__[layer_plan.PLAN_ATTR] is None
    assert re.search(
        rf"fusedq: fused MLA query disabled: layer {layer.layer_name}: .*{reason}", caplog.text
    )
    monkeypatch.setenv(report.MODE_ENV, "1")
    with pytest.raises(report.FusedqRequiredError, match=reason):
        layer_plan.setup_layer(layer)


def test_plan_refuses_a_layer_without_the_attributes_it_reads(mla):
    patch.apply(patch.check_vllm())
    layer = stand_in_layer(mla, 8, fp8=False, gen=torch.Generator().manual_seed(0))
    del layer._q_scale
    plan, reason = layer_plan.plan_layer(layer)
    assert plan is None and "lacks the attributes ['_q_scale']" in reason


@pytest.mark.parametrize("required", [False, True], ids=["auto", "required"])
def test_hook_failure_falls_back_in_auto_mode_and_raises_when_required(mla, required):
    h = 8
    gen = torch.Generator().manual_seed(0)
    layer = stand_in_layer(mla, h, fp8=False, gen=gen)
    layer.__dict__[layer_plan.PLAN_ATTR] = layer_plan.LayerPlan(h, "bf16", None, required=required)
    layer.W_UK_T = layer.W_UK_T.float()  # a weight fusedq rejects (ValueError naming it)
    q_nope, q_pe = vllm_q(2, h, gen)
    if required:
        with pytest.raises(ValueError, match="weight"):
            hook.decode_query_hook(layer, q_nope, q_pe, False, False)
    else:
        assert hook.decode_query_hook(layer, q_nope, q_pe, False, False) is None
        assert layer.__dict__[layer_plan.PLAN_ATTR] is None, "the layer stays on vLLM's path"


# --- the backends' query forms (ATTENTION_BACKENDS) and the pair hand-off -------------------

# vLLM 0.26.0's forward_mqa of every 0.26 ATTENTION_BACKENDS row (tests/fusedq/fixtures/README.md).
FORWARD_MQA_026 = Path(__file__).parent / "fixtures/vllm-0.26.0-mla-backends-forward_mqa.py.txt"


def forward_mqa_026() -> dict[str, str]:
    """impl class name -> 0.26.0's forward_mqa source, indented as in its class."""
    parts = re.split(r"^# === (\w+)\.forward_mqa: .*\n", FORWARD_MQA_026.read_text(), flags=re.M)
    assert parts[0] == ""
    return dict(zip(parts[1::2], parts[2::2], strict=True))


def installed_forward_mqa(impl: str) -> str | None:
    """The installed vLLM's forward_mqa of class ``impl``, read as text: most backend modules
    do not import without their GPU kernels."""
    import ast

    import vllm

    for path in sorted((Path(vllm.__file__).parent / "v1/attention/backends/mla").glob("*.py")):
        text = path.read_text()
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef) and node.name == impl:
                for f in node.body:
                    if isinstance(f, ast.FunctionDef) and f.name == "forward_mqa":
                        return ast.get_source_segment(text, f)
    return None


def type_test(source: str) -> str | None:
    """The plan's reading of a forward_mqa: its first line that some query form reads."""
    known = {line for form in backends.QUERY_FORMS.values() for line in form.reads}
    return next((ln.strip() for ln in source.splitlines() if ln.strip() in known), None)


def test_backend_rows_match_0_26_sources():
    sources = forward_mqa_026()
    assert sources.keys() == {b.impl for b in backends.ATTENTION_BACKENDS if "0.26" in b.releases}
    for row in backends.ATTENTION_BACKENDS:
        if "0.26" in row.releases:
            assert type_test(sources[row.impl]) in backends.QUERY_FORMS[row.form].reads, row
    # The one pair-only backend raises on a tensor: the start-up failure seen on the H200.
    pair_only = {b.impl for b in backends.ATTENTION_BACKENDS if backends.QUERY_FORMS[b.form].split}
    assert pair_only == {"FlashAttnMLASparseImpl"}
    assert "expects split (q_nope, q_rope) input" in sources["FlashAttnMLASparseImpl"]


def test_backend_rows_match_the_installed_vllm():
    pytest.importorskip("vllm")
    release = installed_release()
    rows = [b for b in backends.ATTENTION_BACKENDS if release.name in b.releases]
    assert rows
    for row in rows:
        source = installed_forward_mqa(row.impl)
        assert source is not None, f"{row.impl} has no forward_mqa in vLLM {release.name}"
        assert type_test(source) in backends.QUERY_FORMS[row.form].reads, row


def impl_class(name: str, forward_mqa: str, namespace: dict) -> type:
    """A class ``name`` whose forward_mqa is compiled from ``forward_mqa`` (a method's text)
    in ``namespace`` (the names it calls), its source registered with linecache so the plan
    reads it as it reads vLLM's."""
    import linecache

    source = f"class {name}:\n{forward_mqa}"
    filename = f"<test {name} {len(linecache.cache)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)
    return namespace[name]


class FlashAttention3:
    """Stands in for vllm_flash_attn's flash_attn_varlen_func (a CUDA kernel): records what
    the backend hands it and makes FA3's own input checks (hopper/flash_api.cpp: q and q_v
    each with a unit last stride, one shape of q_v per q row and head)."""

    def __init__(self) -> None:
        self.calls: list[dict] = []

    def __call__(self, *, q, k, v, q_v, **kwargs):
        assert q.stride(-1) == 1 and q_v.stride(-1) == 1
        assert q_v.shape[:-1] == q.shape[:-1] and q_v.shape[-1] == L
        self.calls.append({"q": q, "q_v": q_v})
        out = torch.zeros(*q.shape[:-1], L, dtype=q.dtype)
        return (out, None) if kwargs.get("return_softmax_lse") else out


def fa_backend_026(mla, name: str, h: int, m: int) -> tuple[StandInLayer, FlashAttention3]:
    """A planned stand-in layer whose impl is ``name`` (FlashAttnMLAImpl or
    FlashAttnMLASparseImpl) with 0.26.0's forward_mqa, FlashAttention stood in."""
    fa = FlashAttention3()
    namespace = {
        "torch": torch,
        "flash_attn_varlen_func": fa,
        "is_quantized_kv_cache": mla.is_quantized_kv_cache,
        # Sparse: top-k logical -> physical slots (a Triton kernel); any indices will do here.
        "triton_convert_req_index_to_global_index": lambda req, table, topk, **kw: (
            topk, torch.full((topk.shape[0],), topk.shape[1], dtype=torch.int32)
        ),
    }  # fmt: skip
    cls = impl_class(name, forward_mqa_026()[name], namespace)
    sparse = name == "FlashAttnMLASparseImpl"
    layer = stand_in_layer(mla, h, fp8=False, gen=torch.Generator().manual_seed(0))
    layer.impl = stand_in_impl(
        cls, is_sparse=sparse, dcp_world_size=1, dcp_rank=0,
        supports_quant_query_input=not sparse, kv_lora_rank=L, qk_rope_head_dim=R,
        head_size=L + R, scale=0.1, kv_cache_dtype="auto", need_to_return_lse_for_decode=False,
        topk_indices_buffer=torch.zeros(64, 8, dtype=torch.int32),
    )  # fmt: skip
    releases.installed["release"] = releases.release_for((0, 26))
    mla.__dict__[patch.HOOK_NAME] = hook.decode_query_hook  # what apply() installs
    plan, note = layer_plan.plan_layer(layer)
    assert plan is not None, note
    layer.__dict__[layer_plan.PLAN_ATTR] = plan
    return layer, fa


def run_fa_forward_impl(forward_impl, layer, m: int, fa: FlashAttention3) -> dict:
    """0.26.0's forward_impl on one decode step; what FlashAttention was handed."""
    h = layer.num_heads
    q = torch.randn(m, h, P + R, generator=torch.Generator().manual_seed(m)).to(torch.bfloat16)
    decode = types.SimpleNamespace(
        max_query_len=1, query_start_loc=torch.arange(m + 1, dtype=torch.int32), max_seq_len=16,
        seq_lens=torch.full((m,), 16, dtype=torch.int32), block_table=None,
        scheduler_metadata=None, max_num_splits=0, dcp_tot_seq_lens=None,
    )  # fmt: skip
    meta = types.SimpleNamespace(
        num_actual_tokens=m, num_decodes=m, num_prefills=0, num_decode_tokens=m, decode=decode,
        prefill=None, req_id_per_token=torch.arange(m, dtype=torch.int32), block_table=None,
        block_size=16,
    )  # fmt: skip
    out = torch.empty(m, h * V, dtype=torch.bfloat16)
    kv_cache = torch.zeros(1, 16, L + R, dtype=torch.bfloat16)
    forward_impl(layer, q, torch.empty(m, L), torch.empty(m, 1, R), kv_cache, meta, output=out)
    return fa.calls[-1]


@pytest.mark.parametrize(
    "name,h,m,form",
    [("FlashAttnMLASparseImpl", 16, 3, "pair"), ("FlashAttnMLAImpl", 8, 2, "tensor")],
    ids=["FLASH_ATTN_MLA_SPARSE", "FLASH_ATTN_MLA"],
)
def test_fa_backends_get_views_of_the_fused_query(mla, name, h, m, form):
    """0.26.0's forward_impl and forward_mqa (their source text): the sparse backend is handed
    the pair of views, the dense one the tensor, which it splits into the same views; either
    way FlashAttention reads q_rope and q_nope out of the one fused [M, H, 576] buffer, no
    copy between, with the staged path's values."""
    layer, fa = fa_backend_026(mla, name, h, m)
    assert layer.__dict__[layer_plan.PLAN_ATTR].form.name == form
    staged = run_fa_forward_impl(forward_impl_026(mla, hooked=False), layer, m, fa)
    fused = run_fa_forward_impl(forward_impl_026(mla, hooked=True), layer, m, fa)
    q_v, q = fused["q_v"], fused["q"]
    assert q.data_ptr() == q_v.data_ptr() + L * q_v.element_size(), "views of one buffer"
    assert q_v.stride() == q.stride() == (h * (L + R), L + R, 1)
    assert_matches(torch.cat((q_v, q), -1), torch.cat((staged["q_v"], staged["q"]), -1), "bf16")
    assert switch.first_use.is_set()


def test_sparse_backend_handed_a_tensor_fails_as_seen_on_the_h200(mla):
    """Without the pair form (the plugin before ATTENTION_BACKENDS), 0.26's FLASH_ATTN_MLA_SPARSE
    refuses the fused tensor at the first decode step: the H200 start-up failure."""
    layer, fa = fa_backend_026(mla, "FlashAttnMLASparseImpl", 8, 1)
    plan = layer.__dict__[layer_plan.PLAN_ATTR]
    layer.__dict__[layer_plan.PLAN_ATTR] = dataclasses.replace(
        plan, form=backends.QUERY_FORMS["tensor"]
    )
    with pytest.raises(NotImplementedError, match=r"expects split \(q_nope, q_rope\) input"):
        run_fa_forward_impl(forward_impl_026(mla, hooked=True), layer, 1, fa)


def test_plan_refuses_a_backend_it_does_not_know(mla, monkeypatch, caplog):
    monkeypatch.delenv(report.MODE_ENV, raising=False)
    patch.apply(patch.check_vllm())
    layer = stand_in_layer(mla, 8, fp8=False, gen=torch.Generator().manual_seed(0))
    mystery = impl_class(
        "MysteryMLAImpl",
        "    def forward_mqa(self, q, kv_cache, attn_metadata, layer):\n        return q\n",
        {},
    )
    layer.impl = stand_in_impl(mystery, is_sparse=False, dcp_world_size=1)
    layer_plan.setup_layer(layer)
    assert layer.__dict__[layer_plan.PLAN_ATTR] is None
    release = installed_release().name
    assert (
        f"fusedq: fused MLA query disabled: layer {layer.layer_name}: MysteryMLAImpl takes the "
        "decode query as MysteryMLAImpl.forward_mqa reads it, which this plugin does not know "
        f"(no BACKENDS row for MysteryMLAImpl under vLLM {release})"
    ) in caplog.text
    assert "fused MLA query enabled" not in caplog.text


@pytest.mark.parametrize("change", ["type test", "fp8 pair"])
def test_plan_refuses_a_known_backend_whose_query_form_it_does_not_know(mla, change):
    """A row's class whose forward_mqa no longer reads the query as the row says, and a
    pair-only backend with an FP8 query (vLLM would hand it one tensor), are refused."""
    patch.apply(patch.check_vllm())
    layer = stand_in_layer(mla, 8, fp8=False, gen=torch.Generator().manual_seed(0))
    if change == "fp8 pair":
        layer.kv_cache_dtype = "fp8"  # with supports_quant_query_input: an FP8 query
    sparse = forward_mqa_026()["FlashAttnMLASparseImpl"]
    name = "TritonMLAImpl" if change == "type test" else "FlashAttnMLASparseImpl"
    layer.impl = stand_in_impl(
        impl_class(name, sparse, {}), is_sparse=True, dcp_world_size=1,
        supports_quant_query_input=True,
    )  # fmt: skip
    releases.installed["release"] = releases.release_for((0, 26))
    plan, reason = layer_plan.plan_layer(layer)
    assert plan is None
    if change == "type test":
        assert reason == (
            "TRITON_MLA takes the decode query as TritonMLAImpl.forward_mqa reads it now "
            "('if not isinstance(q, tuple):'), which this plugin does not know (its row was "
            "read from 'if type(q) is tuple:' / 'if isinstance(q, tuple):')"
        )
    else:
        assert reason == (
            "FLASH_ATTN_MLA_SPARSE takes only a (q_nope, q_rope) pair with an FP8 query, which "
            "this plugin does not know"
        )


# --- the decode path switch ------------------------------------------------------------------


def test_set_path_switches_what_the_hook_returns(mla, monkeypatch, caplog):
    import logging

    monkeypatch.delenv(report.MODE_ENV, raising=False)
    patch.apply(patch.check_vllm())
    caplog.set_level(logging.INFO, logger="vllm.fusedq")
    gen = torch.Generator().manual_seed(0)
    layers = []
    for i in range(2):
        layer = stand_in_layer(mla, 8, fp8=False, gen=gen)
        layer.layer_name = f"model.layers.{i}.self_attn.attn"
        layer_plan.setup_layer(layer)
        layers.append(layer)
    assert switch.planned_layers() == layers and switch.current_path() == "fused"
    q_nope, q_pe = vllm_q(2, 8, gen)

    def step() -> list:
        return [hook.decode_query_hook(layer, q_nope, q_pe, False, False) for layer in layers]

    def lines(needle: str) -> int:
        return sum(needle in r.getMessage() for r in caplog.records)

    assert all(isinstance(q, torch.Tensor) for q in step())
    assert switch.set_path("staged") is True
    assert step() == [None, None] and step() == [None, None]
    assert lines("fusedq: first staged MLA decode query since the switch (layer ") == 1
    assert lines("fusedq: decode path switched to staged (2 layers)") == 1
    assert switch.set_path("staged") is False
    assert switch.set_path("fused") is True
    assert all(isinstance(q, torch.Tensor) for q in step())
    assert lines("fusedq: first fused MLA decode query") == 2  # once per switch to it
    with pytest.raises(ValueError, match="decode path 'eager' is not one of staged, fused"):
        switch.set_path("eager")


def test_set_path_refuses_where_the_plugin_is_not_active(mla, monkeypatch):
    monkeypatch.delenv(report.MODE_ENV, raising=False)
    with pytest.raises(switch.FusedqInactiveError, match="did not patch vLLM"):
        switch.set_path("staged")
    patch.apply(patch.check_vllm())
    layer = stand_in_layer(mla, 8, fp8=False, gen=torch.Generator().manual_seed(0))
    layer.num_heads = 4
    layer_plan.setup_layer(layer)
    with pytest.raises(switch.FusedqInactiveError, match=r"disabled: layer .*num_heads=4"):
        switch.set_path("staged")
    assert switch.current_path() == "fused"


# --- end to end: real vllm serve on the tiny model (CPU; tiny_vllm.py) ----------------------


@pytest.fixture(scope="module")
def plain_run(tmp_path_factory):
    """Plain vLLM (plugin not loaded): the fixed prompt's greedy run."""
    pytest.importorskip("vllm")
    base = tmp_path_factory.mktemp("vllm-plain")
    with vllm_server(base / "plain", {"VLLM_PLUGINS": ""}) as (port, log):
        return {"plain": (greedy(port), log)}


# The CPU build's engine arguments without --enforce-eager: vLLM traces the model with
# torch.compile (Dynamo, then Inductor) as every GPU server does.
COMPILED_ARGS = tuple(a for a in CPU_ENGINE_ARGS if a != "--enforce-eager")


@pytest.fixture(scope="module")
def runs(plain_run, tmp_path_factory):
    """One launch per configuration this module alone reads: plain vLLM (plugin not loaded)
    and FUSEDQ_MLA_QUERY=0, profiled. The plugin in auto mode with the kernel in Triton's
    interpreter is the shared switch server's start-up path (tests/fusedq/conftest.py)."""
    pytest.importorskip("vllm")
    base = tmp_path_factory.mktemp("vllm-e2e")
    results = {"plain": plain_run["plain"]}
    with vllm_server(base / "off", {"FUSEDQ_MLA_QUERY": "0"}, profile_dir=base / "off" / "profile") as (port, log):  # fmt: skip
        results["off"] = (greedy(port), log)
        profile_decode(port)  # test_e2e_profile_...
    return results


# Prompts of different lengths and output lengths, sent at once: later steps hold some
# requests' decode tokens beside another's prefill (max-num-seqs 4 admits the fifth only when
# one finishes), so the front's split between decode and prefill rows is exercised.
FRONT_PROMPTS = (
    ([5, 17, 99, 123, 7, 300, 42, 8, 1000, 64, 11, 512], 12),
    ([3, 1400, 22], 4),
    ([77, 8, 911, 1500, 6, 250, 31], 8),
    ([640, 2, 19, 1200, 45], 6),
    ([9, 300, 1024, 18, 700, 52, 88, 3, 460], 6),
)

# Speculative decoding of both servers: MTP 1 (the tiny model's MTP layer is the draft, an
# MLA layer the front serves too), the draft held to the target's backend as the
# orchestrator holds it (decision 0008), and vLLM's batch-size schedule of draft tokens: none
# for a request alone, 1 for two to four. CPU_MLA decodes 1-token queries only (its builder's
# QueryLenSupport.SINGLE_ONLY keeps reorder_batch_threshold at 1), so a verify step's 1 + k
# tokens a request, and the drafter's pass over them, take vLLM's prefill path: with MTP on
# every step no row would reach the front on CPU. The schedule keeps decode rows for the lone
# request (the target's layers, then the draft layer in the drafter's pass over them, through
# the front); MTP_PAIR, sent as one request, runs draft and verify steps from its first
# decode on, in both servers, as the batch's requests do while they overlap.
MTP_SCHEDULE = [[1, 1, 0], [2, 4, 1]]
MTP_PAIR = (FRONT_PROMPTS[2][0], FRONT_PROMPTS[3][0])


def mtp_args(engine_args):
    from orchestrator.engines.vllm.server import speculative_config

    spec = speculative_config(1, engine_args)
    spec["num_speculative_tokens_per_batch_size"] = MTP_SCHEDULE
    return (*engine_args, "--speculative-config", json.dumps(spec, separators=(",", ":")))


def served_with_mtp(port: int) -> tuple:
    """Greedy runs (the lone prompt, MTP_PAIR, a staggered pair, the batch) and the
    speculative-decoding counters after them. The staggered pair is the step the front must
    split whatever the timing: the first request's decode token, undrafted (it was alone in
    the step before), beside the second's prefill."""
    from orchestrator.engines.vllm.server_metrics import read_spec_decode

    runs = [
        greedy(port),
        *greedy_together(port, MTP_PAIR),
        *greedy_staggered(port, FRONT_PROMPTS[0], FRONT_PROMPTS[4]),
        *greedy_batch(port, FRONT_PROMPTS),
    ]
    return runs, read_spec_decode(f"http://127.0.0.1:{port}")


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_e2e_decode_front_matches_plain_vllm(tmp_path):
    """FUSEDQ_MLA_QUERY=1 FUSEDQ_MLA_FRONT=1 under torch.compile, with MTP 1 (MTP_SCHEDULE):
    the front serves the tiny model's two layers and its MTP draft layer (RoPE, query and
    cache write of the decode tokens in one call, vLLM's RoPE and cache write for the other
    rows of the same steps, verify and draft steps included, all in the custom op that
    replaces the wrapper's traced RoPE), with plain compiled vLLM's greedy tokens under the
    same speculative config (the front rounds RoPE as Inductor does)."""
    pytest.importorskip("vllm")
    args = mtp_args(COMPILED_ARGS)
    with vllm_server(tmp_path / "plain", {"VLLM_PLUGINS": ""}, engine_args=args) as (port, _):
        want, want_spec = served_with_mtp(port)
    env = {"FUSEDQ_MLA_QUERY": "1", "FUSEDQ_MLA_FRONT": "1", "TRITON_INTERPRET": "1"}
    with vllm_server(tmp_path / "front", env, engine_args=args) as (port, log_path):
        got, spec = served_with_mtp(port)
    log = log_path.read_text(errors="replace")
    assert text_lines(log, "'mode': <CompilationMode.DYNAMO_TRACE_ONCE"), "a compiled server"
    assert text_lines(log, "Resolved architecture: DeepSeekMTPModel"), "the MTP draft"
    # Speculative decoding ran: verified drafts in both servers.
    for counters in (want_spec, spec):
        assert counters is not None and counters.drafts > 0, counters
    layers = ", ".join(f"model.layers.{i}.self_attn.attn" for i in range(3))  # 2 is the draft
    enabled = text_lines(log, "fusedq: MLA decode front enabled for 3 layers: ")
    assert len(enabled) == 1, text_lines(log, "fusedq")
    assert layers in enabled[0]
    assert text_lines(log, "fusedq: first MLA decode front (layer ")
    assert text_lines(log, "fusedq: first MLA decode front beside other rows (layer ")
    ran = text_lines(log, "fusedq: MLA decode front ran in every layer it serves (3): ")
    assert len(ran) == 1 and layers in ran[0], text_lines(log, "fusedq")
    assert not text_lines(log, "fusedq: MLA decode front disabled")
    assert not text_lines(log, "fusedq: MLA decode front failed")
    print(f"drafts: plain {want_spec}, front {spec}")
    # The suite's near-tie rule: on CPUs whose Inductor code contracts the products
    # differently, and for the batch, whose steps two servers compose as its requests arrive
    # (a token computed in a verify step takes vLLM's prefill path, in a decode step the
    # decode path: plain vLLM against itself parts at near-ties there too).
    for one, other in zip(got, want, strict=True):
        assert_greedy_agree(one, other)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_e2e_off_is_plain_vllm(runs):
    (plain_ids, plain_lp), plain_log = runs["plain"]
    (off_ids, off_lp), off_log = runs["off"]
    assert off_ids == plain_ids and off_lp == plain_lp
    assert not log_lines(off_log, "fusedq")
    assert not log_lines(plain_log, "fusedq")


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_e2e_fused_matches_staged(runs, switch_server):
    (staged_ids, staged_lp), _ = runs["plain"]
    fused_ids, fused_lp = switch_server["start"]
    log = switch_server["start_log"]  # as served until its first flip
    enabled = text_lines(log, ENABLED)
    assert len(enabled) == 1, enabled
    assert (
        "heads=8, format=bf16, query=tensor, prewarmed M=none [no CUDA graphs on cpu]" in enabled[0]
    )
    kernels = text_lines(log, "fusedq: kernels (heads=8, format=bf16): M=1")
    assert len(kernels) == 1, kernels  # which kernel each decode M ran, once per worker
    assert len(text_lines(log, FIRST_USE)) == 1, "the fused op never ran in the decode step"
    assert not text_lines(log, DISABLED)
    assert_greedy_agree((fused_ids, fused_lp), (staged_ids, staged_lp))


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_e2e_profile_attributes_the_query_step(runs, switch_server):
    """The trace reader's query-step rule on real traces whose answer is known: the tiny
    model's 2 layers x PROFILE_STEPS steps, each found once, as vLLM's aten::bmm + aten::cat
    in the staged server's trace and as the fused op in the fused server's; the fused trace
    holds no staged query step (the W_UK_T bmm is gone, not added to)."""
    from orchestrator.analysis.trace import find_rank_traces, read_trace
    from orchestrator.reports.profile import ProfilePair
    from orchestrator.results.profile_figures import ProfileResult

    layers = 2
    profile_dir = runs["off"][1].parent / "profile"
    paths = find_rank_traces(profile_dir)
    assert len(paths) == 1, sorted(p.name for p in profile_dir.iterdir())
    got = {"off": read_trace(paths[0]), "fused": read_trace(switch_server["start_trace"])}
    staged, fused = got["off"].query, got["fused"].query
    n = layers * PROFILE_STEPS
    assert got["off"].steps_seen == got["fused"].steps_seen == PROFILE_STEPS
    assert (staged.path, staged.occurrences) == ("staged", n), staged
    assert staged.names == {"aten::bmm": n, "aten::cat": n}
    assert (fused.path, fused.occurrences) == ("fused", n), fused
    assert fused.names == {"fusedq::mla_query_projection": n}
    # W_UK_T's bmm left the decode step: the fused trace keeps only W_UV's.
    bmm = {k: {t.name: t.count for t in got[k].top}.get("aten::bmm") for k in got}
    print(f"staged {staged.per_layer_us:.1f} us/layer, fused {fused.per_layer_us:.1f}; {bmm}")
    pair = ProfilePair(
        "tiny/tp1", "staged", "fused",
        ProfileResult(decode_steps=PROFILE_STEPS, layers=layers, traces=[got["off"]]),
        ProfileResult(decode_steps=PROFILE_STEPS, layers=layers, traces=[got["fused"]]),
    )  # fmt: skip
    rows = {m: (b, c) for m, b, c, _ in pair.table()}
    assert rows["Query step per layer (us)"][0] == f"{staged.per_layer_us:,.3f}"
    assert "CPU trace has no CUDA runtime calls" in pair.sync()


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_e2e_tp2_unsupported_heads_fall_back_per_worker(tp2_server):
    """TP2 on the 8-head model: 4 heads per rank is not qualified. Auto mode serves with the
    staged path and each of the two workers says why, once."""
    ids, _ = tp2_server["served"]
    log = tp2_server["start_log"]  # as served, before the RPCs
    assert len(ids) == MAX_TOKENS
    lines = text_lines(log, DISABLED)
    assert len(lines) == 2 and len(worker_pids(lines)) == 2, lines
    assert all("num_heads=4 is not qualified" in ln for ln in lines)
    assert not text_lines(log, ENABLED) and not text_lines(log, FIRST_USE)


@pytest.mark.slow
@pytest.mark.e2e
@pytest.mark.timeout(E2E_TIMEOUT_S)
def test_e2e_required_mode_refuses_unsupported_heads(tmp_path):
    pytest.importorskip("vllm")
    env = {"TRITON_INTERPRET": "1", "FUSEDQ_MLA_QUERY": "1"}
    with vllm_server(tmp_path / "tp2-required", env, tp=2, expect_ready=False) as (_, log):
        text = log.read_text(errors="replace")
    assert "FusedqRequiredError" in text
    assert re.search(r"FUSEDQ_MLA_QUERY=1 but the fused MLA query cannot run: .*num_heads=4", text)


class FakeLinear:
    """kv_b_proj as vLLM's MXFP8 linear holds it: weight, weight_scale, quant_method."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        self.weight = values
        self.weight_scale = scales
        self.quant_method = types.SimpleNamespace(process_weights_after_loading=self.swizzle)

    @staticmethod
    def swizzle(module) -> None:
        # What a GEMM kernel's post-processing does: values column-major, scales re-tiled.
        module.weight = module.weight.t().contiguous().t()
        module.weight_scale = module.weight_scale.reshape(-1, 128, 4).transpose(1, 2).contiguous()


class Mxfp8OnlineLinearMethod:
    """vLLM's online MXFP8 method as the plan sees it (its class name says the format):
    kv_b_proj is bf16 at construction, quantised inside the method, then repacked by the GEMM
    kernel into a layout that is no longer E4M3 values (Marlin's int32 tiles)."""

    def __init__(self, values: torch.Tensor, scales: torch.Tensor) -> None:
        self.values, self.scales = values, scales

    def process_weights_after_loading(self, module) -> None:
        module.weight = self.values.view(torch.int32)  # (the repack: E4M3 bytes, other tiles)
        module.weight_scale = self.scales


def online_mxfp8_layer(mla, h: int, gen: torch.Generator):
    """A layer served with --quantization=mxfp8: the watch finds bf16 at construction, and
    vLLM's W_UK_T is the dequantised MXFP8 weight (what MLAAttention builds through the
    kernel's GEMM)."""
    values, scales = mxfp8_kv_b_proj(h, gen)
    layer = stand_in_layer(mla, h, fp8=False, gen=gen)
    layer.kv_b_proj = types.SimpleNamespace(
        weight=dequant_rows(values, scales), weight_scale=None,
        quant_method=Mxfp8OnlineLinearMethod(values, scales),
    )  # fmt: skip
    layer_plan.watch_kv_b_proj(layer)  # (installs nothing: the weight is bf16 here)
    layer.kv_b_proj.quant_method.process_weights_after_loading(layer.kv_b_proj)
    layer.W_UK_T = vllm_w_uk_t(dequant_rows(values, scales), h)
    return layer


def test_online_mxfp8_is_served_native_from_vllms_dequantised_w_uk_t(mla):
    """Online MXFP8 leaves no checkpoint-layout snapshot; the plan re-derives the MXFP8
    weight from vLLM's W_UK_T, and its dequantisation is W_UK_T bit for bit."""
    h = 8
    patch.apply(patch.check_vllm())
    layer = online_mxfp8_layer(mla, h, torch.Generator().manual_seed(7))
    plan, note = layer_plan.plan_layer(layer)
    assert plan is not None and plan.weight_format == "mxfp8", note
    assert note == "MXFP8 W_UK re-derived from vLLM's dequantised W_UK_T (bit-exact)"
    back = fusedq.dequantize_mxfp8(plan.mx_weight)
    assert torch.equal(back.view(torch.int16), layer.W_UK_T.view(torch.int16))


def test_online_mxfp8_w_uk_t_that_is_not_exact_stays_bf16_naming_the_blocks(mla):
    """One bf16 value off the MXFP8 grid (a weight that was not MXFP8): the plan keeps the bf16
    W_UK_T and says how many blocks failed the check."""
    h = 8
    patch.apply(patch.check_vllm())
    layer = online_mxfp8_layer(mla, h, torch.Generator().manual_seed(8))
    w = layer.W_UK_T.clone()
    assert w[3, 5, 100] != 0
    # x (1 + 2^-7): seven mantissa bits, still a bf16 value, no longer E4M3's three.
    w[3, 5, 100] = (w[3, 5, 100].float() * (1 + 2**-7)).to(torch.bfloat16)
    layer.W_UK_T = w
    plan, note = layer_plan.plan_layer(layer)
    assert plan is not None and plan.weight_format == "bf16" and plan.mx_weight is None
    total = h * P * (L // 32)
    assert note == (
        f"vLLM's bf16 W_UK_T is not MXFP8-exact in 1 of {total} 32-wide blocks; using bf16 W_UK"
    )


@pytest.mark.parametrize("watched", [True, False], ids=["snapshot", "no-snapshot"])
def test_mxfp8_kv_b_proj_survives_kernel_post_processing(mla, watched):
    """With the watch installed (as the patched __init__ does), the plan gets the
    checkpoint-layout MXFP8 W_UK even after the kernel re-laid kv_b_proj out; without it,
    the plan falls back to bf16 W_UK and says why."""
    h = 8
    gen = torch.Generator().manual_seed(4)
    values, scales = mxfp8_kv_b_proj(h, gen)
    patch.apply(patch.check_vllm())
    layer = stand_in_layer(mla, h, fp8=False, gen=gen)
    layer.kv_b_proj = FakeLinear(values.clone(), scales.clone())
    if watched:
        layer_plan.watch_kv_b_proj(layer)
    layer.kv_b_proj.quant_method.process_weights_after_loading(layer.kv_b_proj)  # vLLM's loop 1
    assert layer.kv_b_proj.weight_scale.shape != scales.shape
    plan, note = layer_plan.plan_layer(layer)
    assert plan is not None
    if watched:
        assert plan.weight_format == "mxfp8" and not note
        expected = vllm_w_uk_t(dequant_rows(values, scales), h)
        assert torch.equal(fusedq.dequantize_mxfp8(plan.mx_weight), expected)
    else:
        assert plan.weight_format == "bf16" and plan.mx_weight is None
        assert "kept in its GEMM kernel's layout" in note
