"""MXFP8Weight construction checks, quantisation and exact dequantisation."""

from __future__ import annotations

import pytest
import torch

import fusedq
from fusedq.mxfp8 import scale_factors


def _weight(h=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(h, 192, 512, generator=gen) * 0.05).bfloat16()


def test_round_trip_is_close_and_scales_blocked_along_n():
    w = _weight()
    wq = fusedq.quantize_mxfp8(w)
    assert wq.values.dtype == torch.float8_e4m3fn and wq.values.shape == (8, 192, 512)
    assert wq.scales.dtype == torch.uint8 and wq.scales.shape == (8, 192, 16)
    back = fusedq.dequantize_mxfp8(wq)
    assert back.dtype == torch.bfloat16
    # E4M3 keeps 3 mantissa bits: half an ulp is 2^-4 relative to the block maximum at most.
    blockmax = w.float().abs().reshape(8, 192, 16, 32).amax(-1, keepdim=True)
    err = (back.float() - w.float()).abs().reshape(8, 192, 16, 32)
    assert (err <= blockmax * 2**-4 + 1e-30).all()


def test_dequantisation_is_exact():
    w = _weight(11, 1)
    wq = fusedq.quantize_mxfp8(w)
    exact = wq.values.double() * scale_factors(wq.scales).double().repeat_interleave(32, -1)
    assert torch.equal(fusedq.dequantize_mxfp8(wq).double(), exact)


def test_scale_bytes_are_viewed_not_converted():
    wq = fusedq.quantize_mxfp8(_weight())
    as_e8m0 = wq.scales.view(torch.float8_e8m0fnu)
    again = fusedq.MXFP8Weight(wq.values, as_e8m0)
    assert torch.equal(again.scales, wq.scales)
    assert torch.equal(fusedq.dequantize_mxfp8(again), fusedq.dequantize_mxfp8(wq))
    # byte 127 is 2^0, byte 0 is 2^-127 (subnormal in fp32)
    f = scale_factors(torch.tensor([127, 128, 0], dtype=torch.uint8))
    assert f.tolist() == [1.0, 2.0, 2.0**-127]


def test_nan_scale_byte_rejected_at_construction():
    wq = fusedq.quantize_mxfp8(_weight())
    scales = wq.scales.clone()
    scales[3, 17, 5] = 0xFF
    with pytest.raises(ValueError, match=r"scales: byte 0xFF .* \[3, 17, 5\]"):
        fusedq.MXFP8Weight(wq.values, scales)


@pytest.mark.parametrize(
    "values,scales,match",
    [
        ("bf16", "ok", "values: dtype"),
        ("shape", "ok", "values: shape"),
        ("ok", "int8", "scales: dtype"),
        ("ok", "shape", "scales: shape"),
        ("ok", "list", "scales: list"),
    ],
)
def test_construction_checks(values, scales, match):
    wq = fusedq.quantize_mxfp8(_weight())
    v = {"ok": wq.values, "bf16": wq.values.bfloat16(), "shape": wq.values[:, :96]}[values]
    s = {
        "ok": wq.scales,
        "int8": wq.scales.to(torch.int8),
        "shape": wq.scales[..., :8],
        "list": [1],
    }[scales]
    with pytest.raises(ValueError, match=match):
        fusedq.MXFP8Weight(v, s)


def test_quantize_rejects_non_bf16():
    with pytest.raises(ValueError, match="w_bf16"):
        fusedq.quantize_mxfp8(_weight().float())


def test_mxfp8_staged_equals_bf16_staged_of_dequantised():
    wq = fusedq.quantize_mxfp8(_weight())
    q = torch.randn(3, 8, 256).bfloat16()
    a = fusedq.staged_mla_query(q[..., :192], wq, q[..., 192:])
    b = fusedq.staged_mla_query(q[..., :192], fusedq.dequantize_mxfp8(wq), q[..., 192:])
    assert torch.equal(a, b)
