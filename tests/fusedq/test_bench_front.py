"""fusedq-bench --front: its options, rows and table, the ingest of its rows, and its staged
and fused steps run eagerly on CPU against fusedq.staged_decode_front (the fused one through
Triton's interpreter); one real measurement on the GPU."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from fusedq_cases import assert_matches

import fusedq
from fusedq_bench import cli, eager, front, options

REPO = Path(__file__).resolve().parents[2]
# A CPU shape: two layers (the smallest rotation), few heads and tokens for the interpreter.
CPU_OPTS = options.Options(l2_mb=1e-3)
H, M = 8, 3


def test_front_arguments():
    argv = ["--front", "--geometry", "glm5", "--heads", "8", "16", "--m", "1,2", "4"]
    opts, path = cli.parse_args([*argv, "--json", "out.json"])
    assert opts.front and opts.heads == (8, 16) and opts.ms == (1, 2, 4) and path == "out.json"
    assert not cli.parse_args([])[0].front


def test_front_with_eager_times_the_fronts_eager_paths():
    opts, _ = cli.parse_args(["--eager", "--front", "--heads", "16", "--m", "1"])
    assert opts.eager and opts.front


@pytest.mark.parametrize("other", ["--floors", "--chain", "--sweep"])
def test_front_refuses_other_modes(other, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.parse_args(["--front", other])
    assert exc.value.code == 2
    assert "--front" in capsys.readouterr().err


def _times(us: dict[str, float], n: int) -> dict[str, list[float]]:
    """Replay times (ms per graph of ``n`` layers) whose median is ``us`` per layer."""
    return {k: [v * n / 1000.0] * 9 for k, v in us.items()}


FIGURES = {
    "staged_front": 7.5, "fused_front": 3.0, "staged_query": 3.4, "fused_query": 2.5,
    "fused_query_dot": 2.7,
}  # fmt: skip


def _row() -> dict:
    row = front.front_row("bf16", 8, 4, 10, 1234, "glm5", _times(FIGURES, 10))
    row["staged_front_kernel"] = "rope: inductor(vllm forward_native); query: torch.bmm; cache: c"
    row.update({"fused_front_err": 0.0, "fused_front_cache_equal": True})
    return row


def test_front_row_and_table():
    row = _row()
    for name, us in FIGURES.items():
        assert row[f"{name}_us"] == pytest.approx(us)
        assert row[f"{name}_p10_us"] == pytest.approx(us)
    assert row["fused_front_over_staged_front"] == pytest.approx(3.0 / 7.5)
    assert row["fused_query_over_staged_query"] == pytest.approx(2.5 / 3.4)
    assert row["front_us_saved"] == pytest.approx(4.5)
    assert row["query_us_saved"] == pytest.approx(0.9)
    assert (row["format"], row["geometry"], row["H"], row["M"]) == ("bf16", "glm5", 8, 4)
    table = front.format_front_table([row, {"format": "e4m3", "H": 8, "M": 4, "error": "x|y"}])
    lines = table.splitlines()
    assert (
        "| bf16 | 8 | 4 | 7.50 | 3.00 | 0.40 | 3.40 | 2.50 | 0.74 | 2.70 | 4.50 | 0.90 |"
        in (lines[2])
    )
    assert "inductor(vllm forward_native)" in lines[2] and "error: x\\|y" in lines[3]
    assert "fused-front 3.00 µs (0.400)" in front.summary(row, 1.0)


def test_vllm_fused_baseline_where_vllm_has_it():
    """vLLM's own RoPE + cache fusion is the stronger baseline: a row that timed it carries the
    ratio against it and the line says so; where it is not there (here: a CPU) the row says
    why, and no figure stands in for it."""
    op, why = front.vllm_rope_cache_op(torch.device("cpu"))
    assert op is None and "CUDA op" in why
    n = 4
    times = _times({**FIGURES, front.VLLM_FUSED: 6.0}, n)
    row = front.front_row("bf16", 8, 4, n, 1 << 20, "glm5", times)
    row.update(fused_front_err=0.0, fused_front_cache_equal=True)
    assert row[f"fused_front_over_{front.VLLM_FUSED}"] == pytest.approx(3.0 / 6.0)
    assert "vllm-fused-front 6.00 µs (0.500)" in front.summary(row, 1.0)
    assert "vllm-fused-front" not in front.summary(_row(), 1.0)


def _ingest():
    spec = importlib.util.spec_from_file_location(
        "bench_ingest_front", REPO / "benchmarks" / "scripts" / "ingest.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_front_rows_ingest(tmp_path):
    """A --front run's rows convert as the other modes' do: one row a path, each naming the
    kernels it ran, the fused front with its error."""
    row = _row()
    row.update({f"{k}_kernel": f"k-{k}" for k in FIGURES if k != "staged_front"})
    doc = {
        "environment": {"date_utc": "2026-12-06T00:00:00Z", "commit": "abcdef1", "gpu": "G"},
        "options": {"front": True, "samples": 9},
        "rows": [row],
    }
    src = tmp_path / "2026-12-06-front.json"
    src.write_text(json.dumps(doc))
    rows = _ingest().convert(src)
    assert [r["kernel"] for r in rows] == list(FIGURES)
    by = {r["kernel"]: r for r in rows}
    assert all(r["tool"] == "fusedq-bench --front" and r["geometry"] == "glm5" for r in rows)
    assert by["staged_front"]["kernel_name"] == row["staged_front_kernel"]
    assert by["fused_query"]["kernel_name"] == "k-fused_query"
    assert by["fused_front"]["err"] == 0.0 and "err" not in by["staged_front"]
    assert by["fused_front"]["value"] == 3.0 and by["fused_front"]["samples"] == 9


# --- the steps, eagerly on CPU ----------------------------------------------------------------


def _reference(fr: front.Front, q0: torch.Tensor, weight) -> tuple[torch.Tensor, torch.Tensor]:
    """staged_decode_front's query and cache for layer 0, from the unrotated q."""
    cache = torch.zeros_like(fr.caches[0])
    out = fusedq.staged_decode_front(
        q0, fr.kv_c, fr.k_pe, fr.positions, fr.cos_sin, weight, cache, fr.slot_mapping,
        is_neox=False, k_scale=fr.k_scale, out_dtype=fr.lay.out_dtype, q_scale=fr.lay.q_scale,
    )  # fmt: skip
    return out, cache


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


@pytest.mark.parametrize(
    ("fmt", "geometry", "compiled"),
    [
        ("bf16", "glm5", False),
        ("mxfp8", "glm5", False),
        ("bf16", "deepseek-v3", False),
        # inductor's own kernel (C++ on CPU) from vLLM's YaRN module, traced in one graph
        pytest.param("bf16", "deepseek-v3", True, marks=pytest.mark.skipif(
            shutil.which("g++") is None, reason="inductor on CPU needs a C++ compiler")),
    ],
)  # fmt: skip
def test_staged_front_step_is_the_reference(fmt, geometry, compiled):
    """RoPE (vLLM's forward_native where it imports: compiled by inductor, or eager in fp32
    as inductor computes it), the served staged query and the cache write give
    staged_decode_front's query and cache bit for bit; the staged query runs the BF16 weight,
    as the other modes' staged paths do."""
    opts = dataclasses.replace(CPU_OPTS, geometry=geometry)
    fr = front.build_front(fmt, H, M, opts, device="cpu", compiled=compiled)
    assert len(fr.caches) == len(fr.lay.fused_w) == 2
    assert fr.q.stride() == (H * fr.q.shape[2], fr.q.shape[2], 1)  # q_b_proj's [M, H*W]
    assert fr.k_pe.stride() == (576, 1) and fr.cos_sin.dtype == torch.bfloat16
    assert len(set(fr.slot_mapping.tolist())) == M
    q0 = fr.q.clone()
    ref_out, ref_cache = _reference(fr, q0, fr.lay.staged_w[0])
    staged = front.query_of(front.staged_front_step(fr)(0), fr.lay.out)
    assert torch.equal(_bits(staged), _bits(ref_out))
    assert torch.equal(_bits(fr.caches[0]), _bits(ref_cache))
    assert not fr.caches[1].any()  # layer 0's step wrote layer 0's cache only


def test_staged_front_without_vllm(monkeypatch):
    """Where vLLM does not import, the staged RoPE is fusedq.front_reference.rope and the row
    says so; the step still gives the reference's bits."""
    monkeypatch.setattr(front, "vllm_rotary", lambda g, d: (None, "vLLM does not import: x"))
    fr = front.build_front("bf16", H, M, CPU_OPTS, device="cpu", compiled=False)
    assert fr.rope_name.startswith("fusedq.front_reference.rope")
    assert fr.cache_name.startswith("torch index_put")  # (no CUDA op on CPU)
    q0 = fr.q.clone()
    ref_out, ref_cache = _reference(fr, q0, fr.lay.staged_w[0])
    staged = front.query_of(front.staged_front_step(fr)(0), fr.lay.out)
    assert torch.equal(_bits(staged), _bits(ref_out))
    assert torch.equal(_bits(fr.caches[0]), _bits(ref_cache))


def test_fused_front_step_is_the_reference():
    """The fused step (one mla_decode_front launch, the interpreter here) against
    staged_decode_front: the query within the tolerance table, the cache bit for bit; and
    front_errors, the check a GPU run records, agrees."""
    fr = front.build_front("bf16", H, M, CPU_OPTS, device="cpu", compiled=False)
    q0 = fr.q.clone()
    ref_out, ref_cache = _reference(fr, q0, fr.lay.fused_w[1])
    out = front.fused_front_step(fr)(1)
    assert out is fr.lay.out and torch.equal(fr.q, q0)  # q read, not rotated in place
    assert_matches(out, ref_out, "bf16")
    assert torch.equal(_bits(fr.caches[1]), _bits(ref_cache))
    errors = front.front_errors(fr, "bf16")
    assert errors["fused_front_cache_equal"] and errors["fused_front_err"] < 0.05


def test_kernel_names_say_what_ran():
    fr = front.build_front("bf16", H, M, CPU_OPTS, device="cpu", compiled=False)
    names = front.kernel_names(fr, "bf16", front.front_config(fr, "bf16"))
    assert set(names) == set(front.PATHS)
    assert (
        names["staged_front"].startswith("rope: ")
        and "query: torch.bmm;" in (names["staged_front"])
    )
    assert "cache: " in names["staged_front"] and "tl.dot" in names["fused_front"]


class _Replay:
    """A stand-in for a captured graph on CPU: replay() runs the layers' calls."""

    def __init__(self, fn):
        fn()  # as capture's eager warm-up
        self.replay = fn


def test_bench_front_flow_on_cpu(monkeypatch):
    """bench_front end to end with its graphs replayed eagerly and fixed times: every path
    captured and replayed, the row's figures, kernel names and error check."""
    replayed = []

    def fake_times(graphs, samples, warmup):
        for name, graph in graphs.items():
            graph.replay()
            replayed.append(name)
        return {name: [FIGURES[name] * 2 / 1000.0] * 9 for name in graphs}

    monkeypatch.setattr(front, "capture", _Replay)
    monkeypatch.setattr(front, "time_graphs", fake_times)
    row = front.bench_front("bf16", H, M, CPU_OPTS, device="cpu")
    assert replayed == list(front.PATHS)
    assert row["fused_front_us"] == pytest.approx(3.0) and row["layers"] == 2
    assert row["fused_front_cache_equal"] and row["fused_front_err"] < 0.05
    assert row["staged_front_kernel"].startswith("rope: inductor(")
    assert all(f"{p}_kernel" in row for p in front.PATHS)
    assert row["fused_query_kernel"].startswith("mla_query_projection ")


@pytest.mark.gpu
def test_gpu_front_bench_one_shape():
    opts = options.Options(samples=20, warmup=4, l2_mb=4.0, front=True)
    row = front.bench_front("bf16", 8, 4, opts)
    assert row["fused_front_cache_equal"] and row["fused_front_err"] < 0.05
    assert all(row[f"{p}_us"] > 0 for p in front.PATHS)
    assert row["staged_front_kernel"].startswith("rope: inductor(")


# --- --eager --front ---------------------------------------------------------------------------


def test_every_eager_front_path_does_its_work():
    """Each timed closure of --eager --front computes what it is named for (the fused front
    through Triton's interpreter here): the front's query and cache entries from the
    unrotated q, the staged front's too, and the query alone; the row names the kernel
    ``backend="auto"`` chose."""
    fr = front.build_front("bf16", H, M, CPU_OPTS, device="cpu", compiled=False)
    q0, k0 = fr.q.clone(), fr.k_pe.clone()
    ref_out, ref_cache = _reference(fr, q0, fr.lay.fused_w[0])
    paths = eager.front_paths(fr, None)
    assert set(paths) == set(eager.FRONT_PATHS) - {"vllm_front", "rest_vllm"}  # no CUDA op here
    assert_matches(paths["front_public"](), ref_out, "bf16")
    assert torch.equal(_bits(fr.caches[0]), _bits(ref_cache)) and torch.equal(fr.q, q0)
    fr.caches[0].zero_()
    paths["front_custom_op"]()
    assert torch.equal(_bits(fr.caches[0]), _bits(ref_cache))
    query = paths["query_public"]()
    assert query.shape == ref_out.shape
    staged = front.query_of(paths["staged_front"](), fr.lay.out)
    assert torch.equal(_bits(staged), _bits(ref_out))  # (it rotates q in place: last)
    assert eager.auto_front_choice(fr, "bf16").startswith("fused (BLOCK_M ")
    # The hook's rows after the front's, on the unrotated operands again: q's rope part and
    # k_pe rotated in place as the front rotates them, and the front's cache entries.
    fr.q.copy_(q0)
    fr.k_pe.copy_(k0)
    fr.caches[0].zero_()
    paths["rest_reference"]()
    assert torch.equal(_bits(fr.q[..., :-64]), _bits(q0[..., :-64]))
    assert torch.equal(_bits(fr.q[..., -64:]), _bits(ref_out[..., -64:]))
    assert torch.equal(_bits(fr.caches[0]), _bits(ref_cache))


def test_the_eager_front_table_names_the_paths_and_what_auto_ran():
    per_call = {name: [30.0, 20.0] for name in ("front_public", "front_custom_op")}
    per_call |= {"vllm_front": [40.0, 42.0], "query_public": [15.0, 16.0]}
    per_call |= {"rest_reference": [120.0, 110.0], "rest_vllm": [12.0, 11.0]}
    row = eager.eager_row("bf16", 16, 1, per_call) | {
        "front": True,
        "front_choice": "fused (BLOCK_M 16 BLOCK_N 64 4 warps)",
        "front_public_over_vllm_front": 0.5,
    }
    table = eager.format_table([row, {"format": "bf16", "H": 16, "M": 2, "error": "x"}])
    assert "| front_public µs | front_custom_op µs | vllm_front µs |" in table
    assert "| rest_reference µs | rest_vllm µs | front/vLLM |" in table
    assert "| 20.0 | 20.0 | 40.0 | - | 15.0 | 110.0 | 11.0 | 0.50 | fused (BLOCK_M 16" in table
    line = eager.one_line(row)
    assert line.startswith("eager bf16 H=16 M=1 µs/call: front_public=20.0") and "vllm" in line


@pytest.mark.gpu
def test_gpu_eager_front_one_shape():
    opts = options.Options(eager=True, front=True, eager_calls=50, eager_repeats=2, warmup=3)
    row = eager.eager_front_shape("bf16", 16, 1, opts)
    assert all(row[f"{p}_us"] > 0 for p in ("front_public", "front_custom_op", "query_public"))
    assert row["front_choice"].startswith("fused (")
