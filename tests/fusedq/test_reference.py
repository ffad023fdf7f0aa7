"""The staged path (fusedq.reference.staged): vLLM's two forms of it, the fallback's output
and the benchmark's baselines from one function."""

from __future__ import annotations

import pytest
import torch
from fusedq_cases import E4M3, Q_SCALE, N, make_out, make_q, make_weight

import fusedq
from fusedq import reference


def _operands(h: int = 8, m: int = 3):
    gen = torch.Generator().manual_seed(h * 100 + m)
    w = make_weight(h, "vllm", torch.device("cpu"), gen)
    q_nope, q_pe = make_q(m, h, torch.device("cpu"), gen)
    return q_nope, w, q_pe


def test_bmm_form_is_the_pair_flash_attn_mla_takes():
    q_nope, w, q_pe = _operands()
    ql_nope, pe = reference.staged(q_nope, w, None, q_pe, None, None, form="bmm")
    assert pe is q_pe
    assert ql_nope.shape == (3, 8, N) and ql_nope.dtype == torch.bfloat16
    expect = torch.einsum("mhk,hkn->mhn", q_nope.float(), w.float())
    torch.testing.assert_close(ql_nope.float(), expect, atol=2**-10, rtol=2**-7)


def test_bmm_cat_form_writes_the_pair_into_one_query_row():
    """BF16: [q_nope @ W | q_pe] into a pitched out, its padding untouched; the bmm half is
    the "bmm" form's, bit for bit."""
    q_nope, w, q_pe = _operands()
    out, buf = make_out(3, 8, torch.bfloat16, torch.device("cpu"), pitched=True)
    got = reference.staged(q_nope, w, None, q_pe, out, None)
    assert got is out
    ql_nope, _ = reference.staged(q_nope, w, None, q_pe, None, None, form="bmm")
    assert torch.equal(out[..., :N], ql_nope) and torch.equal(out[..., N:], q_pe)
    assert buf[:, 8:].isnan().all() and buf[..., out.shape[-1] :].isnan().all()
    fresh = reference.staged(q_nope, w, None, q_pe, None, None)
    assert torch.equal(fresh, out)


def test_e4m3_goes_through_the_callers_concat_and_quantise():
    q_nope, w, q_pe = _operands()
    q_scale = torch.tensor([Q_SCALE])
    default = reference.staged(q_nope, w, None, q_pe, None, q_scale)
    assert default.dtype == E4M3
    ql_nope, _ = reference.staged(q_nope, w, None, q_pe, None, None, form="bmm")
    cat = torch.cat((ql_nope, q_pe), dim=-1)
    assert torch.equal(
        default.view(torch.uint8), reference.quantize_e4m3(cat, q_scale).view(torch.uint8)
    )
    seen = []

    def one_kernel(ql, pe, scale, out):
        seen.append((ql.shape, pe is q_pe, scale is q_scale, out.dtype))
        reference.concat_quantize_e4m3(ql, pe, scale, out)

    reference.staged(q_nope, w, None, q_pe, None, q_scale, concat_quant=one_kernel)
    assert seen == [((3, 8, N), True, True, E4M3)]


def test_an_mxfp8_weight_is_staged_as_its_bf16_twin():
    q_nope, w, q_pe = _operands(11, 2)
    wq = fusedq.quantize_mxfp8(w)
    twin = fusedq.dequantize_mxfp8(wq)
    got = reference.staged(q_nope, wq.values, wq.scales, q_pe, None, None)
    assert torch.equal(got, reference.staged(q_nope, twin, None, q_pe, None, None))


def test_forms_are_named_and_the_served_one_per_output():
    q_nope, w, q_pe = _operands()
    with pytest.raises(ValueError, match=r"form='cat' must be one of \['bmm', 'bmm\+cat'\]"):
        reference.staged(q_nope, w, None, q_pe, None, None, form="cat")
    assert set(reference.SERVED_FORM.values()) <= set(reference.STAGED_FORMS)
    assert reference.SERVED_FORM[torch.bfloat16] == "bmm"  # FLASH_ATTN_MLA takes the pair
    assert reference.SERVED_FORM[E4M3] == "bmm+cat"  # FLASH_ATTN_MLA has no FP8 query
