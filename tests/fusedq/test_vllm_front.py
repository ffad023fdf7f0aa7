"""The decode front's vLLM hook (``FUSEDQ_MLA_FRONT=1``): the source transforms and their
guards against vLLM 0.32 (installed) and 0.26 (the wheel's text, tests/fusedq/fixtures), the
per-step split between decode and prefill rows on CPU with vLLM's own rotary embedding, the
query hand-off, and the start-up refusals. The real server run is
``test_vllm_plugin.py::test_e2e_decode_front_matches_plain_vllm``.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import logging
import re
import textwrap
import types
from pathlib import Path

import pytest
import torch

from fusedq.vllm import front_hook, front_patch, hook, layer_plan, patch, plugin, releases, report

FIXTURES = Path(__file__).parent / "fixtures"
WRAPPER_026 = FIXTURES / "vllm-0.26.0-mla-wrapper-forward.py.txt"
ATTN_026 = FIXTURES / "vllm-0.26.0-mla_attention-forward.py.txt"
FORWARD_IMPL_026 = FIXTURES / "vllm-0.26.0-mla_attention-forward_impl.py.txt"
H, P, R, L, V = 8, 192, 64, 512, 128


def installed_release():
    row = releases.release_for(patch._vllm_version()[1])
    assert row is not None, "these tests run against a supported vLLM"
    return row


def sources(mla) -> dict[str, str]:
    from vllm.model_executor.layers import mla as wrapper_module

    wrapper = wrapper_module.MultiHeadLatentAttentionWrapper.forward
    return {
        "wrapper": textwrap.dedent(inspect.getsource(wrapper)),
        "attn": textwrap.dedent(inspect.getsource(mla.MLAAttention.forward)),
    }


# --- the transforms and the guard -------------------------------------------------------------


def test_front_guard_accepts_the_installed_vllm_and_touches_nothing(mla):
    before = mla.MLAAttention.forward
    found = front_patch.check_front(installed_release())
    assert found.attn_forward.__wrapped__ is before
    assert mla.MLAAttention.forward is before, "check only"
    assert front_patch.FRONT_HOOK not in mla.__dict__
    assert found.sparse_rule is True, "0.32's forward_impl asks _use_sparse_mha"
    for fn in (found.wrapper_forward, found.attn_forward):
        assert front_patch.POSITIONS_ARG in fn.__code__.co_varnames
        # vLLM's compile cache hashes the name of a file it cannot read: the text's digest.
        assert re.fullmatch(r"<fusedq-front \S+\.py [0-9a-f]{16}>", fn.__code__.co_filename)


@pytest.mark.parametrize("version", ["0.32", "0.26"])
def test_transforms_move_rope_and_hand_on_the_positions(mla, version):
    if version == "0.26":
        src = {"wrapper": WRAPPER_026.read_text(), "attn": ATTN_026.read_text()}
        src = {k: textwrap.dedent(v) for k, v in src.items()}
    else:
        src = sources(mla)
    row = releases.release_for((0, int(version.split(".")[1])))
    front_patch.guarded("wrapper", src["wrapper"], row.wrapper_forward, row)
    front_patch.guarded("attn", src["attn"], row.attn_forward, row)
    wrapper = front_patch.transform_wrapper_forward(src["wrapper"])
    assert (
        "    fusedq_positions = _fusedq_front_positions(self, positions, llama_4_scaling)\n"
        "    if fusedq_positions is None:\n"
        "        if self.rotary_emb is not None:\n"
        "            q[..., self.qk_nope_head_dim :], k_pe = self.rotary_emb(\n"
    ) in wrapper
    call = wrapper[wrapper.index("attn_out = self.mla_attn(") :]
    assert "        fusedq_positions=fusedq_positions,\n    )\n" in call
    attn = front_patch.transform_attn_forward(src["attn"])
    assert "    fusedq_positions: torch.Tensor | None = None,\n) -> torch.Tensor:" in attn
    at = attn.index("layer_slot_mapping = slot_mapping.get(self.layer_name)")
    after = attn[at:]
    # The front runs before vLLM's cache write reads the slot mapping it returns.
    front = after.index("layer_slot_mapping = _fusedq_decode_front(")
    write = after.index("do_kv_cache_update(" if version == "0.26" else "self.update_kv_cache(")
    assert front < write
    # The custom-op branch: the front's op in place of vLLM's cache-update op.
    assert (
        "        if fusedq_positions is not None:\n"
        "            kv_cache_dummy_dep = torch.ops.fusedq.vllm_mla_front_update(\n"
        "                q, kv_c_normed, k_pe, fusedq_positions, self.layer_name\n"
        "            )\n"
        "        else:\n"
        "            kv_cache_dummy_dep = torch.ops.vllm.unified_mla_kv_cache_update(\n"
    ) in attn
    for name, text in (("wrapper", wrapper), ("attn", attn)):
        namespace: dict = {}
        exec(compile(text, f"<{version} {name}>", "exec"), mla.__dict__, namespace)


def test_guard_rejects_a_changed_method(mla, monkeypatch):
    rows = tuple(dataclasses.replace(r, attn_forward={"x": "0" * 64}) for r in releases.RELEASES)
    monkeypatch.setattr(releases, "RELEASES", rows)
    with pytest.raises(ValueError, match=r"MLAAttention\.forward differs .* decode front"):
        front_patch.check_front(installed_release())


@pytest.mark.parametrize(
    "part,edit,match",
    [
        ("wrapper", lambda s: s.replace("if self.rotary_emb is not None:", "if True:"), "0 lines"),
        ("wrapper", lambda s: s.replace("self.rotary_emb(", "rope("), "does not call"),
        ("wrapper", lambda s: s.replace("attn_out = self.mla_attn(", "x = f("), "0 lines"),
        ("attn", lambda s: s.replace("layer_slot_mapping = slot_mapping.get", "s = g"), "0 lines"),
        (
            "attn",
            lambda s: s.replace(
                "    q_dcp_replicated: torch.Tensor | None = None,\n",
                "    q_dcp_replicated: torch.Tensor | None = None\n",
            ),
            "signature",
        ),
    ],
)
def test_transform_names_the_missing_expectation(mla, part, edit, match):
    transform = {
        "wrapper": front_patch.transform_wrapper_forward,
        "attn": front_patch.transform_attn_forward,
    }[part]
    source = sources(mla)[part]
    transform(source)
    with pytest.raises(ValueError, match=match):
        transform(edit(source))


def forward_impl_sources(mla) -> dict[str, str]:
    """MLAAttention.forward_impl, dedented: 0.26's (the wheel's text) and the installed 0.32's."""
    return {
        "0.26": textwrap.dedent(FORWARD_IMPL_026.read_text()),
        "0.32": textwrap.dedent(inspect.getsource(mla.MLAAttention.forward_impl)),
    }


def forward_impl_from(mla, source: str):
    """A forward_impl compiled from ``source``, its text in linecache (the guard reads it)."""
    import linecache

    filename = f"<test forward_impl {len(linecache.cache)}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    namespace: dict = {}
    exec(compile(source, filename, "exec"), mla.__dict__, namespace)
    return namespace["forward_impl"]


def test_sparse_rule_is_found_in_both_releases_forward_impl(mla):
    # 0.26 decides inline; 0.32 asks the layer's _use_sparse_mha.
    src = forward_impl_sources(mla)
    assert front_patch.sparse_rule_in(src["0.26"]) == "inline"
    assert front_patch.sparse_rule_in(src["0.32"]) == "call"


@pytest.mark.parametrize(
    "version,old,new",
    [
        ("0.26", "<= attn_metadata.topk_tokens", "< attn_metadata.topk_tokens"),
        ("0.26", "    and not self._vllm_config.attention_config.sparse_mla_force_mqa\n", ""),
        ("0.26", "self.prefill_backend is not None\n", "True\n"),
        ("0.32", "use_mha = self._use_sparse_mha(attn_metadata)", "use_mha = False"),
        ("0.32", "num_mqa_tokens = q.size(0)\n", "num_mqa_tokens = q.size(0) - 1\n"),
        ("0.32", "q = q[:num_actual_toks, ...]", "q = q[: num_actual_toks + 1, ...]"),
        ("0.26", "    if num_mha_tokens > 0:\n", "    num_mqa_tokens += 0\n    if num_mha_tokens > 0:\n"),
        ("0.32", "    if num_mha_tokens > 0:\n", "    num_mqa_tokens = 1\n    if num_mha_tokens > 0:\n"),
    ],
    ids=["top-k-bound", "force-mqa", "prefill-backend", "call", "mqa-rows", "actual-rows",
         "026-reassigned", "032-reassigned"],
)  # fmt: skip
def test_sparse_rule_is_not_found_in_a_changed_forward_impl(mla, version, old, new):
    source = forward_impl_sources(mla)[version]
    assert old in source
    assert front_patch.sparse_rule_in(source.replace(old, new, 1)) == ""


def test_front_guard_records_the_rule_and_builds_without_it(mla, monkeypatch):
    release = installed_release()
    # Under the query patch (as at start-up) the guard reads the forward_impl it wraps.
    patch.apply(patch.check_vllm())
    assert front_patch.check_front(release).sparse_rule is True
    # 0.26's inline rule in a class with _use_sparse_mha: absorbed_rows would ask the method,
    # which that forward_impl never calls.
    src26 = forward_impl_sources(mla)["0.26"]
    monkeypatch.setattr(mla.MLAAttention, "forward_impl", forward_impl_from(mla, src26))
    assert front_patch.check_front(release).sparse_rule is False
    monkeypatch.delattr(mla.MLAAttention, front_patch.SPARSE_RULE_METHOD)
    assert front_patch.check_front(release).sparse_rule is True
    # No rule: the front is still built (dense layers are served), without sparse ones.
    changed = src26.replace("<= attn_metadata.topk_tokens", "< attn_metadata.topk_tokens")
    monkeypatch.setattr(mla.MLAAttention, "forward_impl", forward_impl_from(mla, changed))
    found = front_patch.check_front(release)
    assert found.sparse_rule is False and found.attn_forward.__wrapped__ is mla.MLAAttention.forward


# --- the step: decode rows to the front, prefill rows to vLLM ---------------------------------


def rotary():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    # The tiny model's (and DeepSeek-V3's) style: GPT-J pairs, bf16 cache; a default config
    # picks the forward vLLM's CPU build runs.
    with set_current_vllm_config(VllmConfig()):
        return RotaryEmbedding(R, R, 4096, 10000.0, False, torch.bfloat16)


def stand_in(rope, w_uk_t, *, split=False):
    layer = types.SimpleNamespace(
        layer_name="model.layers.0.self_attn.attn",
        kv_cache_dtype="auto",
        _k_scale=torch.ones(1),
        _q_scale=torch.ones(1),
        impl=types.SimpleNamespace(is_sparse=False),
    )
    layer.__dict__[front_hook.FRONT_ATTR] = front_hook.FrontPlan(
        rotary=rope, is_neox=False, weight=w_uk_t, out_dtype=torch.bfloat16, split=split
    )
    layer.__dict__[front_hook.ROTARY_ATTR] = rope
    return layer


def vllm_cache_write(kv_c, k_pe, cache, slots):
    """vLLM 0.32 CPU_MLA's do_kv_cache_update: negative slots write nothing."""
    flat = cache.view(-1, L + R)
    keep = slots >= 0
    flat[slots[keep], :L] = kv_c[keep]
    flat[slots[keep], L:] = k_pe.squeeze(1)[keep]


def step_inputs(n: int, t: int, rows=None):
    """One step of ``t`` tokens (the first ``n`` decoding) at H 8: the rotary embedding,
    W_UK_T, q, kv_c, k_pe, positions, slots and an empty cache. ``rows``: the step's
    ``(positions, slots)``, else a default of scattered positions and slots."""
    gen = torch.Generator().manual_seed(n * 10 + t)
    w_uk_t = (torch.randn(H, P, L, generator=gen) / 16).bfloat16()
    q = torch.randn(t, H, P + R, generator=gen).bfloat16()
    kv_c = torch.randn(t, L, generator=gen).bfloat16()
    k_pe = torch.randn(t, 1, R, generator=gen).bfloat16()
    positions, slots = rows or ([7, 300, 41, 2, 1000, 55][:t], [3, 17, 9, 30, 12, 25][:t])
    cache = torch.zeros(4, 8, L + R, dtype=torch.bfloat16)
    return rotary(), w_uk_t, q, kv_c, k_pe, torch.tensor(positions), torch.tensor(slots), cache


# Steps as (n, t, rows): n decode rows of t, as step_inputs takes them.
STEPS = {
    "mixed": (2, 5, None),
    "decode": (3, 3, None),
    "prefill": (0, 4, None),
    # Speculative decoding (MTP 1), where the backend decodes 1 + k tokens a request: a
    # verify step of two requests, each a decode row at its own position and slot.
    "verify": (4, 4, ([40, 41, 300, 301], [3, 4, 17, 18])),
    # The drafter's step: a request past max_model_len (position clamped to 0, padding slot)
    # among the decode rows, and a padding row after them.
    "draft-padded": (3, 4, ([41, 0, 301, 5], [4, -1, 18, -1])),
    # Decode context parallel (DCP 2, interleave 1), rank 1: vLLM's slot mapping gives the
    # tokens rank 0 stores (even positions) slot -1, so each rank writes only its own entries
    # while every row's query is computed (vLLM all-gathers the heads after the hook).
    "dcp2-rank1": (3, 4, ([40, 41, 300, 7], [-1, 20, -1, 15])),
}


@pytest.mark.parametrize("n,t,rows", STEPS.values(), ids=STEPS.keys())
def test_decode_front_splits_decode_and_prefill_rows(n, t, rows):
    rope, w_uk_t, q, kv_c, k_pe, positions, slots, cache = step_inputs(n, t, rows)
    layer = stand_in(rope, w_uk_t)

    # vLLM's staged path: RoPE of every row, the cache write of every row, the bmm.
    want_q, want_k = rope(positions, q[..., P:].clone(), k_pe.clone())
    want_cache = cache.clone()
    vllm_cache_write(kv_c, want_k, want_cache, slots)
    want_query = torch.cat([torch.bmm(q[:, :, :P].transpose(0, 1), w_uk_t).transpose(0, 1),
                            want_q], dim=-1)  # fmt: skip

    meta = types.SimpleNamespace(num_decode_tokens=n)
    q_in, k_in, slots_in = q.clone(), k_pe.clone(), slots.clone()
    rest = front_hook.decode_front(layer, q_in, kv_c, k_in, positions, cache, slots_in, meta)
    assert torch.equal(slots_in, slots), "the step's shared slot mapping is left as it was"
    assert rest[:n].eq(-1).all() and torch.equal(rest[n:], slots[n:])
    vllm_cache_write(kv_c, k_in, cache, rest)
    # Prefill rows: vLLM's own RoPE, bit for bit, and vLLM's cache write.
    assert torch.equal(q_in[n:, :, P:], want_q[n:]) and torch.equal(k_in[n:], want_k[n:])
    assert torch.equal(q_in[:, :, :P], q[:, :, :P])
    # Decode rows: the front's RoPE is fp32, rounded once (Inductor's numerics); vLLM's CPU
    # rotary may round differently by an ulp.
    torch.testing.assert_close(cache.float(), want_cache.float(), atol=2e-2, rtol=1e-2)
    written = slots >= 0  # a padding slot writes nothing, on the front's rows too
    assert torch.equal(cache.view(-1, L + R)[slots[written], :L], kv_c[written])
    assert int(cache.view(-1, L + R).any(dim=-1).sum()) == int(written.sum())
    query = front_hook.take_query(layer, n)
    if n == 0:
        assert query is None
        return
    torch.testing.assert_close(query.float(), want_query[:n].float(), atol=6e-2, rtol=2e-2)
    assert front_hook.QUERY_ATTR not in layer.__dict__, "handed on once"


def op_step(monkeypatch, *, n, t, compiled, path="fused", max_m=32, sparse=None, rows=None):
    """The custom-op branch's step on CPU: ``torch.ops.fusedq.vllm_mla_front_update`` with
    the step's attention context (metadata, layer, cache, slots) as vLLM's forward context
    would give it, eagerly or inside ``torch.compile(fullgraph=True)``; returns what it wrote
    beside vLLM's own path for the same inputs. ``sparse``: ``step_meta``'s keywords for a
    sparse layer's step (whose q may have padding rows past its actual tokens)."""
    from vllm.model_executor.layers.attention import attention

    from fusedq.vllm import switch

    rope, w_uk_t, q, kv_c, k_pe, positions, slots, cache = step_inputs(n, t, rows)
    layer = stand_in(rope, w_uk_t)
    plan = layer.__dict__[front_hook.FRONT_ATTR]
    layer.__dict__[front_hook.FRONT_ATTR] = dataclasses.replace(
        plan, compiled=compiled, max_m=max_m
    )
    if sparse is not None:
        vars(layer).update(vars(absorbing_layer()))
    layer.impl = types.SimpleNamespace(
        is_sparse=sparse is not None,
        do_kv_cache_update=lambda kv, kp, c, sl, dtype, scale: vllm_cache_write(kv, kp, c, sl),
    )
    meta = types.SimpleNamespace(num_decode_tokens=n)
    if sparse is not None:
        meta = step_meta(n, **sparse)
    context = (meta, layer, cache, slots)
    monkeypatch.setattr(attention, "get_attention_context", lambda name: context)
    monkeypatch.setattr(switch.path_switch, "path", path)

    def step(q, kv_c, k_pe, positions):
        dep = torch.ops.fusedq.vllm_mla_front_update(q, kv_c, k_pe, positions, layer.layer_name)
        return dep, q * 1, k_pe * 1  # later uses must see the op's in-place RoPE

    run = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
    q_in, k_in = q.clone(), k_pe.clone()
    dep, q_out, k_out = run(q_in, kv_c, k_in, positions)
    assert dep.numel() == 0
    # vLLM's path for every row: its RoPE (Inductor's numerics when compiled), cache write.
    if compiled:
        from fusedq import front_reference

        want_q = front_reference.rope(q[..., P:], positions, rope.cos_sin_cache, False)
        want_k = front_reference.rope(k_pe, positions, rope.cos_sin_cache, False)
    else:
        want_q, want_k = rope(positions, q[..., P:].clone(), k_pe.clone())
    want_cache = torch.zeros_like(cache)
    vllm_cache_write(kv_c, want_k, want_cache, slots)
    return {
        "layer": layer, "q": q, "q_out": q_out, "k_out": k_out, "cache": cache,
        "want_q": want_q, "want_k": want_k, "want_cache": want_cache, "w": w_uk_t,
    }  # fmt: skip


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("n,t,rows", STEPS.values(), ids=STEPS.keys())
def test_front_op_runs_the_front_then_vllms_write_of_the_rest(
    mla, monkeypatch, n, t, rows, compiled
):
    got = op_step(monkeypatch, n=n, t=t, compiled=compiled, rows=rows)
    # Rows the front did not take: vLLM's RoPE in place, bit for bit, seen by later uses.
    assert torch.equal(got["q_out"][n:, :, P:], got["want_q"][n:])
    assert torch.equal(got["k_out"][n:], got["want_k"][n:])
    assert torch.equal(got["q_out"][:, :, :P], got["q"][:, :, :P])
    # Every row's cache entry written once: the front's (fp32 RoPE) and vLLM's write.
    cache, want = got["cache"], got["want_cache"]
    if compiled or n == 0:
        assert torch.equal(cache, want)
    else:
        torch.testing.assert_close(cache.float(), want.float(), atol=2e-2, rtol=1e-2)
    query = front_hook.take_query(got["layer"], n)
    assert (query is None) is (n == 0)


@pytest.mark.parametrize("path,max_m", [("staged", 32), ("fused", 2)], ids=["staged", "above-m"])
def test_front_op_runs_vllms_path_when_staged_or_m_is_above_its_range(
    mla, monkeypatch, path, max_m
):
    got = op_step(monkeypatch, n=3, t=4, compiled=True, path=path, max_m=max_m)
    assert torch.equal(got["q_out"][:, :, P:], got["want_q"])
    assert torch.equal(got["k_out"], got["want_k"])
    assert torch.equal(got["cache"], got["want_cache"])
    assert front_hook.take_query(got["layer"], 3) is None, "vLLM's query block runs"


# --- which rows the front takes: forward_impl's absorbed (MQA) rows ----------------------------


def absorbing_layer(*, sparse=True, prefill_backend=True, force_mqa=False):
    """What absorbed_rows and forward_impl's rule read of a layer: vLLM 0.26's form (no
    ``_use_sparse_mha``)."""
    return types.SimpleNamespace(
        # vLLM 0.32's masked-MHA prefill (thresholds per GPU backend) left out.
        impl=types.SimpleNamespace(is_sparse=sparse, masked_mha_available=False),
        prefill_backend=object() if prefill_backend else None,
        hisparse_cache=None,
        _vllm_config=types.SimpleNamespace(
            attention_config=types.SimpleNamespace(
                sparse_mla_force_mqa=force_mqa, hisparse_config=None
            )
        ),
    )


def step_meta(n, actual, *, prefill_len=1024, topk=2048):
    """A step's metadata: ``n`` decode tokens of ``actual``, its prefill's longest sequence
    ``prefill_len`` against the sparse backend's ``topk``."""
    return types.SimpleNamespace(
        num_decode_tokens=n, num_actual_tokens=actual, num_decodes=n,
        num_prefills=int(actual > n), decode=object(), prefill_max_seq_len=prefill_len,
        topk_tokens=topk, prefill=None,
    )  # fmt: skip


def run_split(mla, version, layer, meta, rows):
    """Run vLLM's own forward_impl (0.26's text or the installed 0.32's) on a step of ``rows``
    query rows: how many it sent to forward_mqa (absorbed) and to forward_mha."""
    seen = {"mqa": 0, "mha": 0}

    def forward_mha(q, *args, output, **kwargs):
        seen["mha"] = q.shape[0]

    def forward_mqa(q, kv_cache, attn_metadata, layer):
        seen["mqa"] = (q[0] if isinstance(q, tuple) else q).shape[0]
        return torch.zeros(seen["mqa"], H, L, dtype=torch.bfloat16), None

    impl = layer.impl
    impl.__dict__.update(
        dcp_world_size=1, supports_quant_query_input=False, forward_mha=forward_mha,
        forward_mqa=forward_mqa,
    )  # fmt: skip
    layer.__dict__.update(
        num_heads=H, v_head_dim=V, qk_nope_head_dim=P, qk_rope_head_dim=R, kv_lora_rank=L,
        kv_cache_dtype="auto", use_pcp=False, q_pad_num_heads=None,
        is_aiter_triton_fp4_bmm_enabled=False, is_aiter_triton_fp8_bmm_enabled=False,
        is_amx_bmm_enabled=False, W_UK_T=torch.zeros(H, P, L, dtype=torch.bfloat16),
        W_UK_T_dcp_qrep=None, _k_scale=torch.ones(1), _v_up_proj=lambda attn_out, out: None,
    )  # fmt: skip
    if version == "0.26":
        forward_impl = forward_impl_from(mla, forward_impl_sources(mla)["0.26"])
    else:
        forward_impl = mla.MLAAttention.forward_impl
    q = torch.zeros(rows, H, P + R, dtype=torch.bfloat16)
    out = torch.empty(rows, H * V, dtype=torch.bfloat16)
    kv_cache = torch.zeros(1, 16, L + R, dtype=torch.bfloat16)
    forward_impl(layer, q, torch.zeros(rows, L), torch.zeros(rows, 1, R), kv_cache, meta,
                 output=out)  # fmt: skip
    return seen


@pytest.mark.parametrize("version", ["0.26", "0.32"])
@pytest.mark.parametrize(
    "layer_kw,meta_kw,pad,want",
    [
        ({"sparse": False}, {"n": 2, "actual": 5, "prefill_len": 4096}, 0, 2),
        ({}, {"n": 3, "actual": 3, "prefill_len": 4096}, 0, 3),
        ({}, {"n": 2, "actual": 5}, 0, 2),
        ({}, {"n": 2, "actual": 5, "prefill_len": 2048}, 0, 2),
        ({}, {"n": 2, "actual": 5, "prefill_len": 4096}, 0, 5),
        ({}, {"n": 0, "actual": 4, "prefill_len": 4096}, 0, 4),
        ({"prefill_backend": False}, {"n": 2, "actual": 5}, 0, {"0.26": 5, "0.32": 2}),
        ({"force_mqa": True}, {"n": 2, "actual": 5}, 0, 5),
        ({}, {"n": 2, "actual": 5, "prefill_len": 4096}, 3, 5),
    ],
    ids=["dense-mixed", "sparse-decode", "sparse-mha", "sparse-at-top-k", "sparse-long-prefill",
         "sparse-long-prefill-only", "sparse-no-prefill-backend", "sparse-force-mqa",
         "sparse-padded"],
)  # fmt: skip
def test_absorbed_rows_is_forward_impls_split(mla, version, layer_kw, meta_kw, pad, want):
    """absorbed_rows against vLLM's own forward_impl of each release on the same step: 0.26
    decides inline, 0.32 asks the layer's _use_sparse_mha (vLLM's own method, bound to the
    stand-in) about the prefill's use_dense_mha, set as vLLM's metadata builder sets it."""
    from vllm.model_executor.layers.attention import sparse_mla_attention

    layer = absorbing_layer(**layer_kw)
    meta = step_meta(**meta_kw)
    if version == "0.32":
        layer._use_sparse_mha = types.MethodType(mla.MLAAttention._use_sparse_mha, layer)
        meta.prefill = types.SimpleNamespace(
            use_dense_mha=sparse_mla_attention._use_dense_mha_prefill(
                layer._vllm_config, meta.prefill_max_seq_len, meta.topk_tokens
            ),
            chunked_context=None, max_query_len=meta.num_actual_tokens - meta.num_decode_tokens,
        )  # fmt: skip
    want = want[version] if isinstance(want, dict) else want
    absorbed = front_hook.absorbed_rows(layer, meta)
    assert absorbed == want
    seen = run_split(mla, version, layer, meta, meta.num_actual_tokens + pad)
    assert seen == {"mqa": absorbed, "mha": meta.num_actual_tokens - absorbed}


def test_absorbed_rows_asks_the_layers_use_sparse_mha_where_it_has_one():
    asked = []
    # The inline rule would absorb every row here (no prefill backend, forced MQA).
    layer = absorbing_layer(prefill_backend=False, force_mqa=True)
    layer._use_sparse_mha = lambda meta: asked.append(meta) or True
    meta = step_meta(2, 5, prefill_len=4096)
    assert front_hook.absorbed_rows(layer, meta) == 2 and asked == [meta]
    layer._use_sparse_mha = lambda meta: False
    assert front_hook.absorbed_rows(layer, meta) == 5
    asked.clear()
    layer._use_sparse_mha = lambda meta: asked.append(meta) or True
    assert front_hook.absorbed_rows(layer, step_meta(3, 3)) == 3 and asked == [], "decode only"


LONG_PREFILL = {"actual": 5, "prefill_len": 4096}  # longer than top-k: every row absorbed


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("t", [5, 6], ids=["step", "padded"])
def test_front_takes_every_row_a_sparse_layer_absorbs(mla, monkeypatch, t, compiled):
    got = op_step(monkeypatch, n=2, t=t, compiled=compiled, sparse=LONG_PREFILL)
    a = LONG_PREFILL["actual"]
    # Rows past the actual tokens (CUDA-graph padding): vLLM's RoPE and cache write.
    assert torch.equal(got["q_out"][a:, :, P:], got["want_q"][a:])
    assert torch.equal(got["k_out"][a:], got["want_k"][a:])
    cache, want = got["cache"], got["want_cache"]
    if compiled:
        assert torch.equal(cache, want)
    else:
        torch.testing.assert_close(cache.float(), want.float(), atol=2e-2, rtol=1e-2)
    # The query hook's M is forward_impl's absorbed rows: every actual token, prefill too.
    query = front_hook.take_query(got["layer"], a)
    q = got["q"]
    want_query = torch.cat([torch.bmm(q[:a, :, :P].transpose(0, 1), got["w"]).transpose(0, 1),
                            got["want_q"][:a]], dim=-1)  # fmt: skip
    assert query.shape[0] == a
    torch.testing.assert_close(query.float(), want_query.float(), atol=6e-2, rtol=2e-2)


def test_decode_front_leaves_vllm_no_row_a_sparse_layer_absorbs():
    rope, w_uk_t, q, kv_c, k_pe, positions, slots, cache = step_inputs(2, 6)
    layer = stand_in(rope, w_uk_t)
    vars(layer).update(vars(absorbing_layer()))
    meta = step_meta(2, 5, prefill_len=4096)
    rest = front_hook.decode_front(layer, q.clone(), kv_c, k_pe.clone(), positions, cache,
                                   slots.clone(), meta)  # fmt: skip
    assert rest[:5].eq(-1).all() and torch.equal(rest[5:], slots[5:])
    assert front_hook.take_query(layer, 5).shape[0] == 5


def test_front_runs_vllms_path_when_a_sparse_layer_absorbs_more_than_its_range(mla, monkeypatch):
    got = op_step(monkeypatch, n=2, t=5, compiled=True, max_m=4, sparse=LONG_PREFILL)
    assert torch.equal(got["q_out"][:, :, P:], got["want_q"])
    assert torch.equal(got["k_out"], got["want_k"])
    assert torch.equal(got["cache"], got["want_cache"])
    assert front_hook.take_query(got["layer"], 5) is None, "vLLM's query block runs"


def test_front_max_m_follows_the_measured_table():
    # BF16 to M 16 at every measured head count; MXFP8 shorter, shortest above 16 heads.
    assert [front_hook.front_max_m(h) for h in (8, 16, 32, 64, 128)] == [16] * 5
    assert [front_hook.front_max_m(h, "mxfp8") for h in (8, 16, 32, 64)] == [8, 8, 4, 4]


def test_query_hook_hands_on_the_front_query_first(mla):
    rope = rotary()
    layer = stand_in(rope, torch.zeros(H, P, L, dtype=torch.bfloat16), split=True)
    query = torch.randn(2, H, L + R).bfloat16()
    layer.__dict__[front_hook.QUERY_ATTR] = query
    q_nope, q_pe = torch.zeros(H, 2, P).bfloat16(), torch.zeros(2, H, R).bfloat16()
    ql_nope, pe = hook.decode_query_hook(layer, q_nope, q_pe, False, False)
    assert ql_nope.data_ptr() == query.data_ptr() and torch.equal(pe, query[..., L:])
    layer.__dict__[front_hook.QUERY_ATTR] = query
    with pytest.raises(RuntimeError, match="decode front ran on 2 tokens but forward_impl"):
        hook.decode_query_hook(layer, torch.zeros(H, 3, P).bfloat16(), q_pe, False, False)


# --- start-up: what the front refuses, and its lines ------------------------------------------


def compiled_config(*, graphs="FULL_AND_PIECEWISE", splitting_ops=None, speculative=False):
    """A vLLM config's compilation part as the front reads it: ``VLLM_COMPILE`` with vLLM's
    own CUDA-graph mode enum (its mixed-batch mode decides) and, by default, the splitting
    ops vLLM copies from its list after the front's install added its op; ``speculative``:
    with an MTP speculative config, as the target's and the draft's layers see it."""
    from vllm.config.compilation import CUDAGraphMode

    ops = splitting_ops if splitting_ops is not None else [
        "vllm::unified_mla_attention_with_output", front_hook.FRONT_OP
    ]  # fmt: skip
    spec = types.SimpleNamespace(method="mtp", num_speculative_tokens=1) if speculative else None
    return types.SimpleNamespace(
        speculative_config=spec,
        compilation_config=types.SimpleNamespace(
            mode=types.SimpleNamespace(name="VLLM_COMPILE"),
            cudagraph_mode=CUDAGraphMode[graphs],
            splitting_ops=ops,
        ),
    )


def planned_layer(rope, **attrs):
    impl = types.SimpleNamespace(is_sparse=False, dcp_world_size=1)
    layer = types.SimpleNamespace(
        impl=impl, use_direct_call=True, use_pcp=False, hisparse_cache=None,
        calculate_kv_scales=False, kv_cache_dtype="auto",
        W_UK_T=torch.zeros(H, P, L, dtype=torch.bfloat16), _vllm_config=None,
    )  # fmt: skip
    layer.__dict__[layer_plan.PLAN_ATTR] = layer_plan.LayerPlan(H, "bf16", None)
    layer.__dict__[front_hook.ROTARY_ATTR] = rope
    layer.__dict__[front_hook.WRAPPER_ATTR] = {"is_sparse": False, "dcp_q_replicate": False}
    layer.__dict__.update(attrs)
    return layer


@pytest.mark.parametrize(
    "change,reason",
    [
        ({}, None),
        ({layer_plan.PLAN_ATTR: None}, "fused MLA query does not serve this layer"),
        ({"use_direct_call": False}, None),  # eager custom-op branch: CPU vLLM's
        # Configs built at run time: collection must not need vLLM (the GPU record has none).
        ({"_vllm_config": functools.partial(compiled_config)}, None),  # default splitting ops
        (
            {
                "_vllm_config": functools.partial(
                    compiled_config, splitting_ops=["vllm::unified_attention"]
                )
            },
            "piecewise CUDA graphs without fusedq::vllm_mla_front_update among the splitting",
        ),
        (
            {"_vllm_config": functools.partial(compiled_config, graphs="FULL")},
            "full CUDA graphs of mixed batches",
        ),
        (
            {"impl": types.SimpleNamespace(is_sparse=True, dcp_world_size=1)},
            "sparse MLA backend: this vLLM's forward_impl does not split absorbed rows",
        ),
        # DCP > 1: served (each rank writes the slots its mapping keeps, STEPS' dcp2-rank1);
        # vLLM 0.32's query replication runs its own bmm over every head's q: refused.
        ({"impl": types.SimpleNamespace(is_sparse=False, dcp_world_size=2)}, None),
        (
            {front_hook.WRAPPER_ATTR: {"is_sparse": False, "dcp_q_replicate": True}},
            "DCP query replication",
        ),
        # Speculative decoding (MTP): the target's layers and the draft's are served alike.
        ({"_vllm_config": functools.partial(compiled_config, speculative=True)}, None),
        ({"calculate_kv_scales": True}, "kv scales"),
        ({front_hook.ROTARY_ATTR: torch.nn.Identity()}, "rotary embedding Identity"),
    ],
)
def test_plan_front_refuses_naming_why(monkeypatch, change, reason):
    monkeypatch.setitem(releases.installed, "front", object())
    change = {k: v() if isinstance(v, functools.partial) else v for k, v in change.items()}
    layer = planned_layer(rotary(), **change)
    plan, why = front_hook.plan_front(layer)
    if reason is None:
        assert plan is not None and plan.is_neox is False and why == ""
        assert plan.compiled is (layer._vllm_config is not None) and plan.max_m == 16
    else:
        assert plan is None and reason in why


@pytest.mark.parametrize("where", ["impl", "wrapper"])
@pytest.mark.parametrize(
    "front,served",
    [
        (object(), False),
        (types.SimpleNamespace(sparse_rule=False), False),
        (types.SimpleNamespace(sparse_rule=True), True),
    ],
    ids=["no-record", "rule-not-found", "rule-found"],
)
def test_plan_front_serves_a_sparse_layer_where_the_guard_found_the_rule(
    monkeypatch, where, front, served
):
    monkeypatch.setitem(releases.installed, "front", front)
    layer = planned_layer(rotary())
    if where == "impl":
        layer.impl.is_sparse = True
    else:
        layer.__dict__[front_hook.WRAPPER_ATTR]["is_sparse"] = True
    plan, why = front_hook.plan_front(layer)
    if served:
        assert plan is not None and why == ""
    else:
        assert plan is None and "does not split absorbed rows by the rule the front reads" in why


def test_register_installs_the_front_and_says_which_layers(mla, monkeypatch, caplog):
    from vllm.model_executor.layers import mla as wrapper_module

    monkeypatch.setenv(report.MODE_ENV, "auto")
    monkeypatch.setenv(front_hook.FRONT_ENV, "1")
    plugin.register()
    wrapper = wrapper_module.MultiHeadLatentAttentionWrapper
    assert wrapper.forward is releases.installed["front"].wrapper_forward
    assert mla.MLAAttention.forward is releases.installed["front"].attn_forward
    assert wrapper_module._fusedq_front_positions is front_hook.front_positions
    from vllm.config.compilation import CompilationConfig, CompilationMode

    assert front_hook.FRONT_OP in CompilationConfig._attention_ops
    # A GPU config built after the plugin loaded splits its compiled graph at the front's op.
    gpu = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    gpu.set_splitting_ops_for_v1("allgather_reducescatter")
    assert front_hook.FRONT_OP in gpu.splitting_ops
    rope = rotary()
    front_hook.front_report.layers.update({"a": True, "b": False})
    layer = planned_layer(rope)
    layer.__dict__[front_hook.FRONT_ATTR] = None
    fake = types.SimpleNamespace(mla_attn=layer, rotary_emb=rope)
    assert front_hook.front_positions(fake, torch.arange(3), None) is None
    layer.__dict__[front_hook.FRONT_ATTR] = front_hook.plan_front(layer)[0]
    assert front_hook.front_positions(fake, torch.arange(3), None) is not None
    assert front_hook.front_positions(fake, torch.arange(3), torch.ones(1)) is None
    with caplog.at_level(logging.INFO, logger="vllm.fusedq"):
        q, k_pe = torch.zeros(2, H, P + R).bfloat16(), torch.zeros(2, 1, R).bfloat16()
        # No metadata (a profile run): vLLM's RoPE of every row, no cache entry written.
        assert front_hook.front_rows(layer, q, None, k_pe, torch.arange(2), None, None, None) == 0
    assert "fusedq: MLA decode front enabled for 1 layers: a (1 others keep" in caplog.text


def test_front_says_once_that_it_ran_in_every_layer_it_serves(mla, caplog):
    """A speculative decoding server's draft layer runs in the drafter's own steps, after the
    target's layers: the line comes once the front has run in it too, and only once."""
    rope, w_uk_t, q, kv_c, k_pe, positions, slots, cache = step_inputs(2, 2)
    target, draft = stand_in(rope, w_uk_t), stand_in(rope, w_uk_t)
    draft.layer_name = "model.layers.2.self_attn.attn"  # the tiny model's MTP layer
    front_hook.front_report.layers.update(
        {target.layer_name: True, "model.layers.1.self_attn.attn": False, draft.layer_name: True}
    )
    meta = types.SimpleNamespace(num_decode_tokens=2)

    def step(layer):
        args = (q.clone(), kv_c, k_pe.clone(), positions, cache, slots, meta)
        assert front_hook.front_rows(layer, *args) == 2

    with caplog.at_level(logging.INFO, logger="vllm.fusedq"):
        step(target)
        step(target)
        assert front_hook.RAN_LINE not in caplog.text
        step(draft)
        step(draft)
    first = [m for m in caplog.messages if m.startswith("fusedq: first MLA decode front (")]
    assert first == [
        "fusedq: first MLA decode front (layer model.layers.0.self_attn.attn, M=2 of 2 tokens, "
        "query=bfloat16, cache=auto)"
    ]
    ran = [m for m in caplog.messages if front_hook.RAN_LINE in m]
    assert ran == [
        "fusedq: MLA decode front ran in every layer it serves (2): "
        "model.layers.0.self_attn.attn, model.layers.2.self_attn.attn"
    ]


def test_front_asked_for_without_the_query_plugin_says_why(mla, monkeypatch, caplog):
    monkeypatch.setenv(report.MODE_ENV, "0")
    monkeypatch.setenv(front_hook.FRONT_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="vllm.fusedq"):
        plugin.register()
    assert "fusedq: MLA decode front disabled: FUSEDQ_MLA_QUERY=0" in caplog.text
    assert "front" not in releases.installed
