"""fusedq-bench: its pure logic here; one real measurement of each mode on the GPU."""

from __future__ import annotations

import pytest

from fusedq import bench


def test_abba_order_alternates_direction():
    assert bench.abba_order(["a", "b", "c"], 3) == list("abccbaabc")


def test_layers_rotate_past_the_l2():
    opts = bench.Options(l2_mb=60.0, l2_factor=2.0)
    n = bench._layers(8 * 192 * 512 * 2, opts)
    assert n * 8 * 192 * 512 * 2 >= 120e6 and (n - 1) * 8 * 192 * 512 * 2 < 120e6
    assert bench._layers(10**12, opts) == 2  # never fewer than two layers to rotate


def test_arguments():
    opts, path = bench.parse_args(["--chain", "--heads", "8", "16", "--m", "1", "--json", "x"])
    assert opts.chain and opts.heads == (8, 16) and opts.ms == (1,) and path == "x"
    assert not bench.parse_args([])[0].chain


def test_verdict_and_table_state_the_targets():
    row = {"format": "bf16", "H": 8, "M": 1, "fused_us": 2.0, "staged_us": 4.0, "copy_us": 2.0,
           "fused_over_staged": 0.5, "fused_over_copy": 1.0}  # fmt: skip
    assert bench.verdict(row) == "MISS <=0.4x staged, ok <=1.3x copy"
    table = bench.format_table([row, {"format": "mxfp8", "H": 8, "M": 1, "error": "boom"}])
    assert "| bf16 | 8 | 1 | 2.00 | 4.00 | 2.00 | 0.50 | 1.00 |" in table
    assert "error: boom" in table


@pytest.mark.gpu
@pytest.mark.parametrize("chain", [False, True])
def test_one_shape_is_measured_and_correct(chain):
    opts = bench.Options(samples=20, warmup=2, chain=chain, l2_factor=0.1)
    row = bench.bench_shape("bf16", 8, 4, opts)
    assert row["fused_us"] > 0 and row["staged_us"] > 0
    assert row["max_abs_err_vs_staged"] < 0.05
    assert ("fused_pdl_us" in row) == chain
