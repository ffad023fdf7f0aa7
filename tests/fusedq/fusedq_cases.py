"""Operand builders and comparisons shared by the fusedq tests."""

from __future__ import annotations

import functools

import torch

import fusedq

K, N, R = 192, 512, 64
E4M3 = torch.float8_e4m3fn
# Picks q_scale so that the largest outputs (|x| ~ 3) exceed 448 and exercise the clamp.
Q_SCALE = 0.005
# Weights of magnitude ~0.05 keep the outputs O(1), like a trained W_UK_T.
W_SCALE = 0.05

HEADS = (8, 11, 16)
MS = (1, 2, 3, 7, 16, 17, 31, 32)
RECIPES = [("bf16", torch.bfloat16), ("mxfp8", torch.bfloat16), ("bf16", E4M3), ("mxfp8", E4M3)]

# The tolerance table (fusedq.reference.TOLERANCES) is shared with `orchestrator gpu-check`'s
# DCP comparison, so it lives in the package; each entry's justification is there.
TOLERANCES = fusedq.reference.TOLERANCES
# E4M3 output is held to the BF16 bound *before* its rounding (the table's E4M3 entries, 2^-3
# relative on the E4M3 values, are gpu-check's coarse comparison; they let a +3 % accumulator
# error through). Every kernel rounds its fp32 accumulator to bf16 and then quantises it as
# the staged path quantises its bf16 bmm result, so the only legitimate difference before the
# E4M3 rounding is the BF16 bound (summation order moving a bf16 rounding). Hence: the
# kernel's E4M3 code must be the E4M3 rounding of some value within that bound of the staged
# BF16 result. Where the staged value lies within the bound of an E4M3 rounding midpoint
# either neighbouring code passes (a tie may go either way); everywhere else the code must
# equal the staged path's. A +-1 % accumulator error moves values 1 % (> 2^-7), so it
# changes codes outside those windows and fails (test_e4m3_comparison_catches_one_percent).
E4M3_WINDOW = {fmt: TOLERANCES[(fmt, torch.bfloat16)] for fmt in ("bf16", "mxfp8")}


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill with NaN (0x7F in E4M3, 0x7FC0 in bf16) so unwritten elements fail comparison."""
    if t.dtype == E4M3:
        t.view(torch.uint8).fill_(0x7F)
    else:
        t.fill_(float("nan"))
    return t


def make_weight(h: int, layout: str, device, gen: torch.Generator) -> torch.Tensor:
    """A bf16 [h, 192, 512] weight in one of the layouts vLLM and friends produce."""

    def rnd(*shape):
        return (torch.randn(*shape, generator=gen) * W_SCALE).to(torch.bfloat16).to(device)

    if layout == "vllm":
        # kv_b_proj.weight.T viewed (L, H, P+V) then W_UK.permute(1, 2, 0): unit stride on N,
        # head stride spans the V rows too.
        return rnd(h, K + 256, N)[:, :K, :]
    if layout == "unit_k":
        # W_UK [L, H, P].permute(1, 2, 0): unit stride along the 192 axis.
        return rnd(N, h, K).permute(1, 2, 0)
    if layout == "generic":
        # No unit stride at all.
        return rnd(h, K, 2 * N)[..., ::2]
    if layout == "contiguous":
        return rnd(h, K, N)
    raise ValueError(layout)


def make_q(m: int, h: int, device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """q_nope and q_pe as slices of one [m, h, 256] q, as vLLM hands them over."""
    q = torch.randn(m, h, K + R, generator=gen).to(torch.bfloat16).to(device)
    return q[..., :K], q[..., K:]


def make_out(m: int, h: int, dtype, device, pitched: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, backing buffer): pitched outputs sit inside a wider, poisoned workspace."""
    width, heads = (640, h + 1) if pitched else (N + R, h)
    buf = poison(torch.empty(m, heads, width, dtype=dtype, device=device))
    return buf[:, :h, : N + R], buf


def weight_for(fmt: str, w: torch.Tensor):
    return fusedq.quantize_mxfp8(w) if fmt == "mxfp8" else w


def weight_in_layout(fmt: str, layout: str, h: int, device, gen: torch.Generator):
    """A weight of format ``fmt`` in ``layout`` (see make_weight); MXFP8 values get the same
    strides as the bf16 weight would have."""
    w = make_weight(h, layout, device, gen)
    weight = weight_for(fmt, w)
    if fmt == "mxfp8" and layout != "contiguous":
        values = torch.empty_strided(w.shape, w.stride(), dtype=E4M3, device=device)
        values.copy_(weight.values)
        weight = fusedq.MXFP8Weight(values, weight.scales)
    return weight


def assert_matches(
    out: torch.Tensor, ref: torch.Tensor, fmt: str, q_scale: torch.Tensor | None = None
) -> None:
    """512-wide part within the tolerance table, RoPE part bit-exact, nothing left unwritten.

    ``ref`` is the staged path's BF16 output for either output dtype: an E4M3 ``out`` is
    compared in the E4M3 domain with the E4M3 rounding of those values at ``q_scale``
    (assert_e4m3_matches)."""
    if out.dtype == E4M3:
        if ref.dtype != torch.bfloat16 or q_scale is None:
            raise TypeError(
                "an E4M3 output is compared with the staged path's BF16 output and q_scale "
                f"(got ref {ref.dtype}, q_scale {q_scale})"
            )
        assert_e4m3_matches(out, ref, fmt, q_scale)
        return
    atol, rtol = TOLERANCES[(fmt, out.dtype)]
    torch.testing.assert_close(
        out[..., :N].float(), ref[..., :N].float(), atol=atol, rtol=rtol, equal_nan=False
    )
    bits = torch.uint8 if out.dtype == E4M3 else torch.int16
    assert torch.equal(out[..., N:].contiguous().view(bits), ref[..., N:].contiguous().view(bits))


def assert_e4m3_matches(
    out: torch.Tensor, ref: torch.Tensor, fmt: str, q_scale: torch.Tensor
) -> None:
    """E4M3 ``out`` against the staged BF16 ``ref`` at ``q_scale`` (see E4M3_WINDOW): each code
    of the 512-wide part within the E4M3 roundings of ``ref`` -/+ the BF16 bound, the RoPE
    part equal to the reference's rounding bit for bit."""
    from fusedq.reference import quantize_e4m3

    atol, rtol = E4M3_WINDOW[fmt]
    x = ref[..., :N].float()
    slack = atol + rtol * x.abs()
    lo = quantize_e4m3(x - slack, q_scale).float()
    hi = quantize_e4m3(x + slack, q_scale).float()
    got = out[..., :N].float()
    bad = ~((got >= lo) & (got <= hi))  # NaN (unwritten) is outside every window
    if bad.any():
        want = quantize_e4m3(x, q_scale).float()
        first = [tuple(i) for i in bad.nonzero()[:5].tolist()]
        shown = ", ".join(
            f"{i}: got {got[i].item():g}, staged {want[i].item():g} "
            f"(from {x[i].item():g}, window {lo[i].item():g}..{hi[i].item():g})"
            for i in first
        )
        raise AssertionError(
            f"E4M3 output: {int(bad.sum())} of {bad.numel()} codes outside the E4M3 roundings of "
            f"the staged BF16 result +- (atol {atol:g} + rtol {rtol:g} |x|); first {shown}"
        )
    rope = quantize_e4m3(ref[..., N:], q_scale)
    assert torch.equal(
        out[..., N:].contiguous().view(torch.uint8), rope.contiguous().view(torch.uint8)
    ), "E4M3 output: the RoPE part is not the staged path's rounding bit for bit"


def staged_decode_query(
    q_nope: torch.Tensor,
    w_uk_t: torch.Tensor,
    q_pe: torch.Tensor,
    *,
    q_scale: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """vLLM 0.32's staged decode query, transcribed: the oracle of the hook tests (kept here,
    not in the product: nothing but the tests runs it).

    ``torch.bmm`` into a token-major buffer, then either the pair ``(ql_nope, q_pe)`` that
    backends concatenate, or — with ``q_scale`` — concat + static per-tensor E4M3 quant as
    ``_decode_concat_quant_fp8_op`` does (``x * (1 / scale)``, clamped to ±448).
    """
    n, b, _ = q_nope.shape
    ql_nope = q_nope.new_empty((b, n, w_uk_t.shape[-1]))
    torch.bmm(q_nope, w_uk_t, out=ql_nope.transpose(0, 1))
    if q_scale is None:
        return ql_nope, q_pe
    cat = torch.cat((ql_nope, q_pe), dim=-1).float() * q_scale.reshape(()).float().reciprocal()
    e4m3_max = torch.finfo(torch.float8_e4m3fn).max
    return cat.clamp(-e4m3_max, e4m3_max).to(torch.float8_e4m3fn)


def launch_matches_staged(
    config, fmt, out_dtype, h, m, device, seed, *, pitched, layout: str = "vllm"
) -> None:
    """kernel.launch with `config` on fresh operands (sliced q, a weight in `layout`), against
    the staged path; a pitched out's padding must stay unwritten."""
    from fusedq.kernels import triton_launch as kernel

    gen = torch.Generator().manual_seed(seed)
    weight = weight_in_layout(fmt, layout, h, device, gen)
    values, scales = (weight.values, weight.scales) if fmt == "mxfp8" else (weight, None)
    q_nope, q_pe = make_q(m, h, device, gen)
    out, buf = make_out(m, h, out_dtype, device, pitched=pitched)
    q_scale = torch.tensor([Q_SCALE], device=device) if out_dtype == E4M3 else None
    kernel.launch(q_nope, values, scales, q_pe, out, q_scale, config=config)
    assert_matches(out, fusedq.staged_mla_query(q_nope, weight, q_pe), fmt, q_scale)
    if buf.shape != out.shape:
        pad = torch.cat([buf[:, h:].flatten(), buf[:, :h, N + R :].flatten()])
        assert pad.float().isnan().all()  # the poison (NaN in both dtypes) is untouched


# A scale at which vLLM's quantisation, x * (1 / s), and the once-rounded x / s give different
# E4M3 values for some bf16 x (sixty of them; found by building scales that put quotients on
# E4M3 rounding midpoints, where random scales found none).
TIE_SCALE = 28.0


@functools.cache
def split_values() -> torch.Tensor:
    """The bf16 values whose E4M3 quantisation at TIE_SCALE differs between ``x * (1/s)``
    and ``x / s`` (searched over every finite bf16, so a test using them cannot pass
    vacuously)."""
    finite = torch.arange(0, 0x7F80, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = torch.cat([finite, -finite]).float()
    s = torch.tensor([TIE_SCALE])
    mul = (x * s.reciprocal()).clamp(-448, 448).to(E4M3).view(torch.uint8)
    div = (x / s).clamp(-448, 448).to(E4M3).view(torch.uint8)
    return x[mul != div].to(torch.bfloat16)
