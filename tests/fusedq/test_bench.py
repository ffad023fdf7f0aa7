"""fusedq-bench: its pure logic here; one real measurement of each mode on the GPU."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from fusedq_cases import assert_matches

import fusedq
from fusedq import contract
from fusedq.contract import DEEPSEEK_V3, GLM5
from fusedq_bench import (
    bars,
    cli,
    common,
    eager,
    floors,
    harness,
    options,
    replay,
    sweep,
    tables,
)


def test_abba_order_alternates_direction():
    assert common.abba_order(["a", "b", "c"], 3) == list("abccbaabc")


def test_layers_rotate_past_the_l2():
    opts = options.Options(l2_mb=60.0, l2_factor=2.0)
    n = options.layer_count(8 * 192 * 512 * 2, opts)
    assert n * 8 * 192 * 512 * 2 >= 120e6 and (n - 1) * 8 * 192 * 512 * 2 < 120e6
    assert options.layer_count(10**12, opts) == 2  # never fewer than two layers to rotate


def test_arguments():
    opts, path = cli.parse_args(["--chain", "--heads", "8", "16", "--m", "1", "--json", "x"])
    assert opts.chain and opts.heads == (8, 16) and opts.ms == (1,) and path == "x"
    assert not cli.parse_args([])[0].chain


def test_geometry_arguments(capsys):
    """--geometry picks the geometry the rows name, and its qualified heads unless --heads
    says otherwise; --heads and --m take comma lists too."""
    argv = ["--floors", "--geometry", "deepseek-v3", "--heads", "8,16,32,64,128"]
    opts, _ = cli.parse_args([*argv, "--m", "1,2,4,8,16,32,64"])
    assert opts.geometry == "deepseek-v3" and opts.floors
    assert opts.heads == (8, 16, 32, 64, 128) and opts.ms == (1, 2, 4, 8, 16, 32, 64)
    opts, _ = cli.parse_args(["--geometry", "deepseek-v3"])
    assert opts.heads == contract.QUALIFIED["deepseek-v3"].heads == (8, 16, 32, 64)
    assert opts.ms == (1, 2, 4, 8, 16, 32, 48, 64)  # to its qualified M 64
    assert cli.parse_args([])[0].ms == (1, 2, 4, 8, 16, 32)  # GLM-5's 32
    assert cli.parse_args([])[0].geometry == "glm5" and cli.parse_args([])[0].heads == (8, 11, 16)
    for bad in (["--geometry", "llama"], ["--heads", "8,x"], ["--m", "0"]):
        with pytest.raises(SystemExit) as exc:
            cli.parse_args(bad)
        assert exc.value.code == 2
    assert "invalid choice: 'llama'" in capsys.readouterr().err


def test_sweep_configs_of_deepseek_tile_m_and_skip_gluon(monkeypatch):
    """A DeepSeek-V3 sweep: the product's choice is the tl.dot kernel (64-row M blocks past 32
    tokens), and no Gluon variant (that kernel is GLM-5's only)."""
    opts = options.Options(geometry="deepseek-v3", sweep_gluon=("32:4",))
    configs = sweep.sweep_configs("bf16", 8, 64, opts)
    assert configs["auto"].block_m == 64 and configs["auto"].tiles_m
    assert not any(c.gluon for c in configs.values())
    from fusedq.kernels import triton_launch

    monkeypatch.setattr(triton_launch.LaunchConfig, "_check_gluon", lambda self: None)  # (CPU)
    glm5 = sweep.sweep_configs("bf16", 8, 16, options.Options(sweep_gluon=("32:4",)))
    assert any(c.gluon for c in glm5.values())


def test_sweep_block_m_names_each_block_and_keeps_only_those_that_serve_m(capsys):
    """--sweep-block-m: one variant per block that can serve M (a block under M only where it
    tiles M, the 64-row one), each named by its block; without it, names carry no block."""
    opts, _ = cli.parse_args(["--sweep", "--sweep-block-m", "16", "32", "64", "--m", "32"])
    opts = dataclasses.replace(opts, sweep_block_n=(32,), sweep_warps=(4,), sweep_block_k=(64,))
    configs = sweep.sweep_configs("bf16", 16, 32, opts)
    tl_dot = {n: c.block_m for n, c in configs.items() if n.startswith("bn")}
    assert tl_dot == {"bn32_w4_k64_m32": 32, "bn32_w4_k64_m64": 64}
    plain = sweep.sweep_configs("bf16", 16, 32, dataclasses.replace(opts, sweep_block_m=()))
    assert [n for n in plain if n.startswith("bn")] == ["bn32_w4_k64"]
    with pytest.raises(SystemExit):
        cli.parse_args(["--sweep", "--sweep-block-m", "48"])
    assert "invalid choice: 48" in capsys.readouterr().err


def test_sweep_cute_arguments(capsys):
    assert cli.parse_args(["--sweep", "--sweep-cute"])[0].sweep_cute
    assert not cli.parse_args(["--sweep"])[0].sweep_cute
    with pytest.raises(SystemExit):
        cli.parse_args(["--sweep-cute"])
    assert "pass --sweep too" in capsys.readouterr().err


def test_sweep_e4m3_twins_every_e4m3_variant(capsys):
    """--sweep-e4m3 times each E4M3 variant again with each named epilogue; BF16 output has
    no quantisation to vary, and the flag alone is refused."""
    opts = cli.parse_args(["--sweep", "--sweep-e4m3", "div", "noscale", "--sweep-block-n"])[0]
    assert opts.sweep_e4m3 == ("div", "noscale")
    e4m3 = sweep.sweep_configs("e4m3", 8, 4, opts)
    plain = [n for n in e4m3 if not n.endswith(("_div", "_noscale"))]
    twins = [f"{n}_{e}" for n in plain for e in ("div", "noscale")]
    assert plain and sorted(e4m3) == sorted(plain + twins)
    assert all(e4m3[n].e4m3_epilogue == "mul" for n in plain)
    assert all(e4m3[f"{n}_{e}"].e4m3_epilogue == e for n in plain for e in ("div", "noscale"))
    assert sweep.sweep_configs("bf16", 8, 4, opts).keys() == set(plain)
    with pytest.raises(SystemExit):
        cli.parse_args(["--sweep-e4m3", "div"])
    assert "pass --sweep too" in capsys.readouterr().err


def test_sweep_fence_twins_the_fenced_kernels_with_bf16_out(capsys):
    """--sweep-fence times each register-path (and, on a GPU, Gluon) variant of a BF16-out
    format again with the fence flipped; E4M3 out has no twin (its reciprocal is the fence)."""
    opts = cli.parse_args(["--sweep", "--sweep-fence", "--sweep-block-n"])[0]
    assert opts.sweep_fence
    bf16 = sweep.sweep_configs("bf16", 8, 1, opts)  # H = 8, M = 1: the register path
    twins = [n for n in bf16 if n.endswith("_nofence")]
    assert twins and all(bf16[n].fma and not bf16[n].fence for n in twins)
    assert all(bf16[n.removesuffix("_nofence")].fence for n in twins)
    assert not [n for n in sweep.sweep_configs("e4m3", 8, 1, opts) if n.endswith("fence")]
    with pytest.raises(SystemExit):
        cli.parse_args(["--sweep-fence"])
    assert "pass --sweep too" in capsys.readouterr().err


def test_load_fence_defaults_to_each_kernels_measured_choice():
    from fusedq.kernels import triton_launch as kernel

    with pytest.raises(ValueError, match="load_fence=False chooses a Gluon or register-path"):
        kernel.LaunchConfig(block_m=16, block_n=32, load_fence=False)
    assert kernel.LaunchConfig(block_m=1, block_n=32, fma=True).fence
    assert not kernel.LaunchConfig(block_m=1, block_n=32, fma=True, load_fence=False).fence
    assert not kernel.LaunchConfig(block_m=16, block_n=32).fence  # (tl.dot: no fence to place)


def test_cute_variant_says_why_it_cannot_run(monkeypatch):
    """Both weight formats have a CuTe variant; where the recipe cannot run it (here: the DSL
    missing) the sweep gets the reason instead of a step."""
    from fusedq import capability

    seen = []
    monkeypatch.setattr(
        capability, "cute_problem", lambda fmt, out, **k: seen.append(fmt) or "no DSL here"
    )
    lay = type("Lay", (), {"out_dtype": None, "geometry": GLM5})()
    assert harness.cute_step(lay, "bf16") == (None, "no DSL here")
    assert harness.cute_step(lay, "mxfp8-e4m3") == (None, "no DSL here")
    assert seen == ["bf16", "mxfp8"]


def test_verdict_and_table_state_the_targets():
    """A row written before the bmm-only baseline existed still renders, with "-" there."""
    row = {"format": "bf16", "H": 8, "M": 1, "fused_us": 2.0, "staged_us": 4.0, "copy_us": 2.0,
           "fused_over_staged": 0.5, "fused_over_copy": 1.0}  # fmt: skip
    assert bars.verdict(row) == "MISS <=0.4x staged, ok <=1.3x copy"
    table = tables.format_table([row, {"format": "mxfp8", "H": 8, "M": 1, "error": "a|b"}])
    assert "| bf16 | 8 | 1 | 2.00 | 4.00 | - | 2.00 | 0.50 | - | 1.00 | - |" in table
    assert "error: a\\|b" in table


def test_both_staged_baselines_side_by_side_and_the_served_one_named():
    """fused against vLLM 0.32's bmm + cat (``staged_us``, the key it always had) and vLLM
    0.26's FLASH_ATTN_MLA form, the bmm alone (``bmm_us``); BF16 output is served by the latter,
    E4M3 output (no FP8 in FLASH_ATTN_MLA) by the former."""
    import torch

    rows = []
    for fmt, out_dtype in (("bf16", torch.bfloat16), ("e4m3", torch.float8_e4m3fn)):
        row = {"format": fmt, "H": 16, "M": 4, "fused_us": 2.0, "staged_us": 5.0, "bmm_us": 2.5,
               "copy_us": 2.0, "fused_over_copy": 1.0}  # fmt: skip
        replay.add_baseline_ratios(row, out_dtype)
        rows.append(row)
    bf16, e4m3 = rows
    assert bf16["fused_over_staged"] == 0.4 and bf16["fused_over_bmm"] == 0.8
    assert bf16["served_baseline"] == "bmm" and bf16["fused_over_served"] == 0.8
    assert e4m3["served_baseline"] == "bmm+cat" and e4m3["fused_over_served"] == 0.4
    table = tables.format_table(rows)
    assert "| fused µs | bmm+cat µs | bmm-only µs | copy µs | fused/bmm+cat | fused/bmm-only |" in (
        table
    )
    assert "| bf16 | 16 | 4 | 2.00 | 5.00 | 2.50 | 2.00 | 0.40 | 0.80 | 1.00 | bmm-only |" in table
    assert "| e4m3 | 16 | 4 | 2.00 | 5.00 | 2.50 | 2.00 | 0.40 | 0.80 | 1.00 | bmm+cat |" in table
    assert "FLASH_ATTN_MLA" in tables.SERVED_NOTE


@pytest.mark.gpu
def test_concat_quant_kernel_is_the_reference_quantisation():
    """The E4M3 staged baseline's one-launch concat and quantise (vLLM's op on a GPU) writes
    what the reference's torch ops write, bit for bit. (GPU only: the interpreter's fp8
    conversion does not round to nearest even.)"""
    import torch
    from fusedq_cases import E4M3, Q_SCALE, make_q, make_weight

    from fusedq import reference

    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(12)
    w = make_weight(11, "vllm", device, gen)
    q_nope, q_pe = make_q(5, 11, device, gen)
    q_scale = torch.tensor([Q_SCALE], device=device)
    ref = reference.staged(q_nope, w, None, q_pe, None, q_scale)
    got = reference.staged(
        q_nope, w, None, q_pe, None, q_scale, concat_quant=harness.concat_quant_kernel
    )
    assert got.dtype == E4M3 and torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


def test_floor_bars_judge_each_ratio_against_its_own_bar():
    """The bars: BF16 fused <= 1.15x read, MXFP8 <= 1.25x read, E4M3 output <= 1.10x the
    BF16 output's time of the same weights at the same shape (BF16: "e4m3" / "bf16"; MXFP8:
    "mxfp8-e4m3" / "mxfp8"); a shape missing a row has no verdict for that ratio."""
    rows = [
        {"format": "bf16", "H": 8, "M": 1, "fused_us": 2.3, "read_us": 2.0},  # 1.15: ok
        {"format": "mxfp8", "H": 8, "M": 1, "fused_us": 2.6, "read_us": 2.0},  # 1.30: miss
        {"format": "e4m3", "H": 8, "M": 1, "fused_us": 2.6, "read_us": 2.0},  # 2.6/2.3: miss
        {"format": "mxfp8-e4m3", "H": 8, "M": 1, "fused_us": 2.8, "read_us": 2.0},  # 2.8/2.6: ok
        {"format": "bf16", "H": 16, "M": 4, "fused_us": 2.5, "read_us": 2.0},  # 1.25: miss
        {"format": "e4m3", "H": 16, "M": 4, "fused_us": 2.7, "read_us": 2.0},  # 1.08: ok
        {"format": "mxfp8", "H": 16, "M": 4, "error": "boom"},
        {"format": "mxfp8-e4m3", "H": 16, "M": 4, "fused_us": 2.8, "read_us": 2.0},  # no pair
    ]
    b8, b16 = bars.floor_bars(rows)
    assert (b8["H"], b8["M"], b16["H"], b16["M"]) == (8, 1, 16, 4)
    assert b8["bf16_ok"] is True and b8["mxfp8_ok"] is False and b8["e4m3_ok"] is False
    assert b8["e4m3_over_bf16"] == pytest.approx(2.6 / 2.3)
    assert b8["mxfp8_e4m3_over_mxfp8"] == pytest.approx(2.8 / 2.6) and b8["mxfp8_e4m3_ok"]
    assert b16["bf16_ok"] is False and b16["e4m3_ok"] is True and b16["mxfp8_ok"] is None
    assert b16["mxfp8_e4m3_ok"] is None
    assert b8["bf16_store_over_read"] is None  # a run without the read+store floor
    table = bars.format_floor_bars([b8, b16])
    assert "| 8 | 1 | 1.15 ok | 1.30 MISS | 1.13 MISS | 1.08 ok |" in table
    assert "| 16 | 4 | 1.25 MISS | - | 1.08 ok | - |" in table
    assert table.endswith("bars met: 3 of 6")


def _floor_layers(device, n_bytes: int, layers: int = 2) -> harness.Layers:
    import torch

    srcs = [
        torch.randint(0, 256, (n_bytes,), dtype=torch.uint8, device=device) for _ in range(layers)
    ]
    sink = torch.full(
        (n_bytes // 4 // min(floors.FLOOR_READ_WORDS) + floors.FLOOR_EMPTY_CTAS,),
        -1,
        dtype=torch.int32,
        device=device,
    )
    out_words = torch.full((3 * 8 * 576 * 2 // 4,), -1, dtype=torch.int32, device=device)
    return harness.Layers(
        [], [None] * layers, srcs, [], None, None, None, None, None, n_bytes, GLM5,
        floor_sink=sink, floor_out=out_words,
    )  # fmt: skip


def test_floor_kernels_read_every_byte_and_store_per_cta(device):
    # The read-only floor must really read all the bytes (its CTA sums cover the buffer),
    # and the empty node must store one word per CTA; run here through the interpreter.
    import torch

    n_bytes = 8 * 192 * 528  # the MXFP8 layer size at H=8: not a multiple of any tile
    lay = _floor_layers(device, n_bytes)
    steps = harness.floor_steps(lay)
    assert set(steps) == (
        {f"read_w{w}" for w in floors.FLOOR_READ_WORDS}
        | {f"store_w{w}" for w in floors.FLOOR_STORE_WORDS}
        | {"empty"}
    )
    words = lay.copy_src[1].view(torch.int32).to(torch.int64)
    for w in floors.FLOOR_READ_WORDS:
        lay.floor_sink.fill_(-1)
        steps[f"read_w{w}"](1)
        ctas = -(-words.numel() // w)
        padded = torch.nn.functional.pad(words, (0, ctas * w - words.numel()))
        want = padded.view(ctas, w).sum(1)
        want = ((want + 2**31) % 2**32 - 2**31).to(torch.int32)  # int32 wrap-around, as the kernel
        assert torch.equal(lay.floor_sink[:ctas].cpu(), want.cpu()), w
    # The read+store floor writes every output word, each CTA its share, holding its sum.
    for w in floors.FLOOR_STORE_WORDS:
        lay.floor_out.fill_(-1)
        steps[f"store_w{w}"](1)
        ctas = -(-words.numel() // w)
        padded = torch.nn.functional.pad(words, (0, ctas * w - words.numel()))
        sums = ((padded.view(ctas, w).sum(1) + 2**31) % 2**32 - 2**31).to(torch.int32)
        share = -(-lay.floor_out.numel() // ctas)
        share = max(16, 1 << (share - 1).bit_length())
        want = sums.repeat_interleave(share)[: lay.floor_out.numel()]
        assert torch.equal(lay.floor_out.cpu(), want.cpu()), w
    lay.floor_sink.fill_(-1)
    steps["empty"](0)
    got = lay.floor_sink[: floors.FLOOR_EMPTY_CTAS].cpu()
    assert torch.equal(got, torch.arange(floors.FLOOR_EMPTY_CTAS, dtype=torch.int32))


@pytest.mark.parametrize("g", [GLM5, DEEPSEEK_V3], ids=lambda g: g.name)
def test_grid_split_k_and_view_floors_read_every_byte(device, monkeypatch, g):
    """The "view" floor reads the fused kernel's own tiles of the real weight (values and
    scales), the "grid" floor reads the layer over the fused kernel's CTA count (each CTA's sum
    of its even share lands in the sink), and the "split_k" floor's last CTA of each K group stores
    the group's total in its share of the output and leaves the partials and counters at zero
    for the next replay (here through the interpreter, which runs the CTAs in order)."""
    import torch

    k = g.qk_nope
    n_bytes = 8 * k * 528  # the MXFP8 layer size at H=8
    lay = _floor_layers(device, n_bytes)
    lay.geometry = g
    lay.q_nope = torch.empty(3, 8, k, device=device)
    tiles = -(-n_bytes // (4 * floors.FLOOR_SPLIT_WORDS * floors.FLOOR_SPLIT_K))
    lay.floor_part = torch.zeros(tiles, dtype=torch.int32, device=device)
    lay.floor_count = torch.zeros(tiles, dtype=torch.int32, device=device)
    monkeypatch.setattr(harness, "fused_block_n", lambda fmt, h, m, g: 32)  # 128 CTAs at H=8
    gen = torch.Generator().manual_seed(11)
    w = torch.randn(8, g.head_stride_rows, 512, generator=gen).to(torch.bfloat16).to(device)[:, :k]
    lay.fused_w = [fusedq.quantize_mxfp8(w)] * 2
    steps = harness.grid_floor_steps(lay, "mxfp8")
    tma = floors.tma_floor_kernel()[0] is not None  # a GPU with Gluon's TMA (sm_90+)
    assert set(steps) == {"grid", "split_k", "view"} | ({"view_tma"} if tma else set())
    # "view": CTA (pid_n, h) sums its [k, 32] tile of the weight's bytes and its scales;
    # "view_tma" reads the same tiles by TMA bulk copies and must fold them to the same sums.
    vals = lay.fused_w[1].values.view(torch.uint8).to(torch.int64).cpu()
    scl = lay.fused_w[1].scales.to(torch.int64).cpu()
    want = vals.view(8, k, 16, 32).sum((1, 3)) + scl.sum(1)  # [H, 16 tiles]
    for kind in ("view", "view_tma") if tma else ("view",):
        lay.floor_sink.fill_(-1)
        steps[kind](1)
        assert torch.equal(lay.floor_sink[:128].cpu().view(8, 16).to(torch.int64), want), kind
    words = lay.copy_src[1].view(torch.int32).to(torch.int64)

    def wrapped(x):  # int32 wrap-around, as the kernels sum
        return ((x + 2**31) % 2**32 - 2**31).to(torch.int32)

    lay.floor_sink.fill_(-1)
    steps["grid"](1)
    per_cta = -(-words.numel() // 128 // 16) * 16
    padded = torch.nn.functional.pad(words, (0, 128 * per_cta - words.numel()))
    assert torch.equal(lay.floor_sink[:128].cpu(), wrapped(padded.view(128, per_cta).sum(1)).cpu())
    for _ in range(2):  # a second replay starts from the reset partials and counters
        lay.floor_out.fill_(-1)
        steps["split_k"](1)
        group = floors.FLOOR_SPLIT_WORDS * floors.FLOOR_SPLIT_K
        padded = torch.nn.functional.pad(words, (0, tiles * group - words.numel()))
        sums = wrapped(padded.view(tiles, group).sum(1))
        share = max(16, 1 << (-(-lay.floor_out.numel() // tiles) - 1).bit_length())
        want = sums.repeat_interleave(share)[: lay.floor_out.numel()]
        assert torch.equal(lay.floor_out.cpu(), want.cpu())
        assert not lay.floor_part.any() and not lay.floor_count.any()


@pytest.mark.parametrize(
    ("fmt", "h", "m", "ctas"),
    [("bf16", 8, 1, 8 * 512 // 32), ("bf16", 16, 4, 16 * 512 // 64), ("e4m3", 8, 4, 8 * 16)],
)
def test_fused_grid_ctas_follow_the_launch_config(monkeypatch, fmt, h, m, ctas):
    import torch

    from fusedq import selection
    from fusedq.kernels import common, gluon_mla_query, triton_launch

    monkeypatch.setattr(common, "interpreting", lambda: False)
    monkeypatch.setattr(gluon_mla_query, "AVAILABLE", True)
    monkeypatch.setattr(triton_launch.LaunchConfig, "_check_gluon", lambda self: None)

    def selected(path: str):
        def select(h, m, *, weight_format, out_dtype, **kw):
            config = selection.launch_config(h, m, weight_format, out_dtype != torch.bfloat16)
            return selection.Selection(path, "measured", config)

        return select

    monkeypatch.setattr(selection, "select", selected("triton"))
    assert floors.fused_grid_ctas(fmt, h, m) == ctas
    monkeypatch.setattr(selection, "select", selected("cute"))
    assert floors.fused_grid_ctas("mxfp8", h, m) == h * 512 // 32


def test_floor_ratios_take_the_fastest_read():
    row = {"staged_us": 5.0, "fused_us": 2.5, "empty_us": 1.0}
    row.update({f"read_w{w}_us": 2.2 + w / 1e4 for w in floors.FLOOR_READ_WORDS})
    row["read_w2048_us"] = 2.0
    row["read_w2048_p10_us"] = 0.1  # quantiles are not candidates
    floors.add_floor_ratios(row)
    assert row["read_us"] == 2.0 and row["read_variant"] == "read_w2048"
    assert row["read_over_staged"] == 0.4 and row["empty_over_staged"] == 0.2
    assert row["fused_over_read"] == 1.25
    base = {"format": "bf16", "H": 8, "M": 1, "fused_us": 2.5, "staged_us": 5.0, "copy_us": 2.0,
            "fused_over_staged": 0.5, "fused_over_copy": 1.25}  # fmt: skip
    table = tables.format_table([{**base, **row}, base]).splitlines()
    assert table[0].count("|") == table[1].count("|") == table[2].count("|") == 16
    assert "| 1.00 | 2.00 | 0.40 |" in table[2] and "| - | - | - |" in table[3]
    assert cli.parse_args(["--floors"])[0].floors
    # The grid and split-K floors, as fractions of the read floor, and in the tables.
    row.update({"grid_us": 2.4, "split_k_us": 2.6})
    floors.add_floor_ratios(row)
    assert row["grid_over_read"] == pytest.approx(1.2)
    assert row["split_k_over_read"] == pytest.approx(1.3)
    assert row["fused_over_grid"] == pytest.approx(2.5 / 2.4)
    assert "| 2.40 | 2.60 |" in tables.format_table([{**base, **row}])
    (bar,) = bars.floor_bars([{**base, **row}])
    assert bar["bf16_grid_over_read"] == pytest.approx(1.2) and bar["mxfp8_grid_over_read"] is None
    table = bars.format_floor_bars([bar])
    assert "| BF16 grid/read | MXFP8 grid/read | BF16 split-K/read | MXFP8 split-K/read |" in table
    assert table.splitlines()[2].endswith("| 1.20 | - | 1.30 | - |")


@pytest.mark.gpu
@pytest.mark.parametrize("chain", [False, True])
def test_one_shape_is_measured_and_correct(chain):
    opts = options.Options(samples=20, warmup=2, chain=chain, l2_factor=0.1, floors=True)
    row = replay.bench_shape("bf16", 8, 4, opts)
    assert row["fused_us"] > 0 and row["staged_us"] > 0
    assert row["read_us"] == min(row[f"read_w{w}_us"] for w in floors.FLOOR_READ_WORDS)
    if not chain:  # (chained figures are increments over the predecessors: no sign promised)
        assert row["empty_us"] > 0 and row["read_us"] > 0
        assert row["grid_us"] > 0 and row["split_k_us"] > 0 and row["store_us"] > 0
    assert row["max_abs_err_vs_staged"] < 0.05
    assert ("fused_pdl_us" in row) == chain


def test_sweep_gluon_arguments():
    opts, _ = cli.parse_args(
        ["--sweep", "--sweep-gluon", "32:4", "64:8:32", "--sweep-gluon-operands", "direct"]
    )
    assert opts.sweep_gluon == ("32:4", "64:8:32") and opts.sweep_gluon_operands == ("direct",)
    assert [sweep.parse_gluon_spec(s) for s in opts.sweep_gluon] == [(32, 4), (64, 8, 32)]
    assert cli.parse_args([])[0].sweep_gluon == ()


@pytest.mark.gpu
def test_sweep_times_gluon_variants_beside_triton():
    """Gluon variants join the sweep's graph set and get their output checked; a tile of
    fewer rows than M is left out."""
    opts = options.Options(
        samples=10, warmup=2, l2_factor=0.1, sweep=True, sweep_block_n=(),
        sweep_gluon=("32:4", "64:8:32", "32:4:16"),
    )  # fmt: skip
    rows = {r["variant"]: r for r in sweep.sweep_shape("mxfp8", 8, 17, opts)}
    gluon = [
        f"gluon_{o}_bn{t}_m32" for o in ("convert", "smem", "direct") for t in ("32_w4", "64_w8")
    ]
    assert {*gluon, "dot", "staged"} <= set(rows)
    assert not [name for name in rows if name.endswith("_m16")]
    for name in gluon:
        assert rows[name]["us"] > 0 and rows[name]["max_abs_err_vs_staged"] < 0.05
        assert rows[name]["config"]["gluon"]


# --- --eager ---------------------------------------------------------------------------------


def test_eager_arguments():
    opts, path = cli.parse_args(
        ["--eager", "--calls", "100", "--repeats", "3", "--heads", "16", "--m", "1", "--json", "e"]
    )
    assert opts.eager and opts.eager_calls == 100 and opts.eager_repeats == 3
    assert opts.heads == (16,) and opts.ms == (1,) and path == "e"
    defaults = cli.parse_args([])[0]
    assert not defaults.eager and defaults.eager_calls == 2000 and defaults.eager_repeats == 5


@pytest.mark.parametrize(
    "argv,named",
    [
        (["--eager", "--floors"], "--floors"),
        (["--eager", "--chain"], "--chain"),
        (["--eager", "--calls", "0"], "--calls 0"),
        (["--sweep", "--sweep-gluon", "32"], "--sweep-gluon '32'"),
        (["--sweep", "--sweep-gluon", "32:4:x"], "--sweep-gluon '32:4:x'"),
    ],
)
def test_eager_argument_errors_name_the_option(argv, named, capsys):
    with pytest.raises(SystemExit) as info:
        cli.parse_args(argv)
    assert info.value.code == 2 and named in capsys.readouterr().err


def test_eager_row_takes_the_best_run_and_the_ratios():
    per_call = {name: [30.0, 20.0, 25.0] for name in eager.CALL_PATHS}
    per_call["public"] = [12.0, 11.0, 40.0]
    per_call["hook"] = [14.0, 13.0, 13.5]
    row = eager.eager_row("bf16", 16, 1, per_call)
    assert row["public_us"] == 11.0 and row["public_median_us"] == 12.0
    assert row["staged_032_us"] == 20.0
    assert row["public_over_staged"] == 11.0 / 20.0 and row["hook_over_staged"] == 13.0 / 20.0
    table = eager.format_table(
        [row, {"format": "mxfp8", "H": 8, "M": 4, "error": "boom"}]
    ).splitlines()
    assert table[0].count("|") == table[1].count("|") == table[2].count("|")
    assert table[2].startswith("| bf16 | 16 | 1 | 11.0 | 20.0 | 13.0 |")
    assert table[2].endswith("| 0.55 | 0.65 |")
    assert "error: boom" in table[3]
    assert "eager bf16 H=16 M=1 µs/call: public=11.0" in eager.one_line(row)


def test_eager_refuses_without_cuda(capsys):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for CPU-only machines")
    assert cli.main(["--eager", "--heads", "8", "--m", "1"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "needs a CUDA GPU" in err and "interpreter" in err


def test_the_command_without_a_gpu_exits_2_with_one_line():
    """`fusedq-bench` as a user types it, on a machine without CUDA: the usage exit code
    (nothing was measured) and one line saying why, no traceback."""
    import subprocess
    import sys
    from pathlib import Path

    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the refusal is for CPU-only machines")
    script = Path(sys.executable).with_name("fusedq-bench")
    out = subprocess.run([str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines() == ["fusedq-bench needs a CUDA GPU"], out.stderr


@pytest.mark.gpu
def test_eager_shape_is_measured_and_correct():
    opts = options.Options(eager=True, eager_calls=50, eager_repeats=2, warmup=3)
    row = eager.eager_shape("bf16", 16, 3, opts)
    assert all(row[f"{p}_us"] > 0 for p in eager.CALL_PATHS)
    assert row["max_abs_err_vs_staged"] < 0.05
    assert row["public_over_staged"] > 0


@pytest.mark.parametrize("fmt", common.FORMATS)
def test_every_eager_path_computes_the_query(fmt, device):
    """Each timed closure does the work it is named for (here through the interpreter on
    CPU): the fused paths write the query of the fused weight, the two staged blocks agree
    bit for bit and (but for MXFP8, whose baseline is the unquantised BF16 weight) match it."""
    import torch

    ops = eager.eager_operands(fmt, 8, 1, 0.02, device)
    paths = eager.eager_paths(ops)
    assert set(paths) == set(eager.CALL_PATHS)
    ref = fusedq.staged_mla_query(ops.q_nope, ops.fused_w, ops.q_pe)
    weight_format = common.RECIPES[fmt][0]
    staged = paths["staged_032"]()
    assert torch.equal(paths["staged_026"]().view(torch.uint8), staged.view(torch.uint8))
    if weight_format != "mxfp8":
        assert_matches(staged, ref, weight_format, ops.q_scale)
    for name in ("public", "hook"):
        assert_matches(paths[name](), ref, weight_format, ops.q_scale)
    for name in ("public_out", "custom_op", "bare"):
        ops.out.zero_()
        paths[name]()
        assert_matches(ops.out, ref, weight_format, ops.q_scale)


def test_bench_imports_without_the_orchestrator():
    """GPU machines have torch and Triton but not the orchestrator's pydantic stack: fusedq-bench
    must start there (found on the H200: the Markdown table's old home imported the result
    model), and fusedq imports nothing of the orchestrator at all."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['pydantic'] = None; sys.modules['orchestrator'] = None; "
        "import fusedq_bench.cli, fusedq_bench.eager, fusedq_bench.sass"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_floor_bars_show_the_read_store_floor_where_measured():
    rows = [
        {"format": "bf16", "H": 16, "M": 32, "fused_us": 3.6, "read_us": 2.5, "store_us": 3.0},
        {"format": "mxfp8", "H": 16, "M": 32, "fused_us": 3.4, "read_us": 2.0},
    ]
    (b,) = bars.floor_bars(rows)
    assert b["bf16_store_over_read"] == pytest.approx(1.2) and b["mxfp8_store_over_read"] is None
    table = bars.format_floor_bars([b])
    assert "| H | M | BF16 fused/read (≤1.15) | MXFP8 fused/read (≤1.25) |" in table
    assert "| BF16 read+store/read | MXFP8 read+store/read |" in table
    assert "| 16 | 32 | 1.44 MISS | 1.70 MISS | - | - | 1.20 | - |" in table


def test_tma_weight_rows_address_the_strided_view():
    """vLLM's W_UK_T (kv_b_proj's rows, 192 of every head's 448 taken) as the one 2-D matrix a
    TMA descriptor addresses: head h's row k is the matrix's row h * 448 + k."""
    import torch

    full = torch.arange(8 * 448 * 512, dtype=torch.int32).view(8, 448, 512)
    view = full[:, :192]
    mat, rows_per_head = floors.tma_weight_rows(view)
    assert rows_per_head == 448 and mat.shape == (7 * 448 + 192, 512)
    for h, k in ((0, 0), (3, 191), (7, 5)):
        assert torch.equal(mat[h * 448 + k], view[h, k])
    assert floors.tma_weight_rows(full[:, :192].contiguous())[1] == 192
    with pytest.raises(ValueError, match="not rows of one"):
        floors.tma_weight_rows(full.transpose(1, 2)[:, :192])


def test_tma_floor_is_gpu_only_and_says_why():
    import torch

    kernel, why = floors.tma_floor_kernel()
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the reason is for machines without one")
    assert kernel is None and "CUDA GPU" in why


# The TMA floor kernel compiled for sm_90 without a GPU, in a child process (the interpreter
# patches Triton's tensor class in this one): its PTX must hold the three bulk tensor copies
# and, for MXFP8, the scale loads issued before the wait on the copies' mbarrier; DeepSeek-V3's
# geometry (K = 128, heads 256 rows apart) two copies.
_COMPILE_TMA = """
import json, torch, triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from triton.runtime.jit import mangle_type
from fusedq_bench import floors
kernel = floors._define_tma_floor_kernel()
out = {}
for fmt, dtype, gdtype, scales, rows, k in (
        ("bf16", torch.int16, gl.int16, False, 448, 192),
        ("mxfp8", torch.uint8, gl.uint8, True, 448, 192),
        ("deepseek-mxfp8", torch.uint8, gl.uint8, True, 256, 128)):
    for bn in (32, 64):
        mat, _ = floors.tma_weight_rows(torch.zeros(8, rows, 512, dtype=dtype)[:, :k])
        shared = gl.NVMMASharedLayout.get_default_for([64, bn], gdtype)
        desc = TensorDescriptor.from_tensor(mat, [64, bn], shared)
        sig = {"w_desc": mangle_type(desc), "s_ptr": "*u8", "sink_ptr": "*i32",
               "rows_per_head": "i32", "s_sh": "i32", "s_sk": "i32", "BLOCK_N": "constexpr",
               "CHUNK_K": "constexpr", "SCALES": "constexpr", "SCALE_COLS": "constexpr",
               "MX": "constexpr", "NUM_K": "constexpr"}
        consts = {"BLOCK_N": bn, "CHUNK_K": 64, "SCALES": scales, "SCALE_COLS": max(1, bn // 32),
                  "MX": 32, "NUM_K": k // 64}
        src = GluonASTSource(kernel, sig, constexprs=consts)
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 4 if bn <= 32 else 8})
        out[f"{fmt}-{bn}"] = compiled.asm["ptx"]
print(json.dumps(out))
"""


def test_tma_floor_compiles_to_three_bulk_copies_and_one_wait():
    import json
    import os
    import subprocess
    import sys

    from fusedq.kernels import gluon_mla_query

    if not gluon_mla_query.AVAILABLE:
        pytest.skip(gluon_mla_query.UNAVAILABLE_REASON)
    root = str(Path(__file__).resolve().parents[2])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", _COMPILE_TMA], env=env, capture_output=True, text=True,
        timeout=300, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    ptxs = json.loads(done.stdout.strip().splitlines()[-1])
    assert sorted(ptxs) == [
        "bf16-32", "bf16-64", "deepseek-mxfp8-32", "deepseek-mxfp8-64", "mxfp8-32", "mxfp8-64",
    ]  # fmt: skip
    for case, ptx in ptxs.items():
        lines = [line.strip() for line in ptx.splitlines()]
        copies = [i for i, line in enumerate(lines) if "cp.async.bulk.tensor" in line]
        waits = [i for i, line in enumerate(lines) if "mbarrier.try_wait" in line]
        loads = [i for i, line in enumerate(lines) if "ld.global" in line]
        assert len(copies) == (2 if case.startswith("deepseek") else 3) and waits, case
        assert all(i < min(waits) for i in copies + loads), case
        assert bool(loads) == ("mxfp8" in case), case
