"""The CPU-testable parts of benchmarks/bench_attention.py: its layouts, the FlexAttention block mask
built from them, the work it counts, the estimation timing and the report (table, estimation shares,
the issue's targets); the benchmark itself refuses to run without a GPU."""

import pytest
import torch
from benchmark_loader import load_benchmark
from oracle import TOLERANCE, rel_rms

from hf_sparse_cp.pattern import dense_layout
from hf_sparse_cp.reference import reference_forward
from hf_sparse_cp.tokens import TokenMeta


@pytest.fixture(scope="module")
def bench():
    with load_benchmark("bench_attention") as module:
        yield module


def _listed_blocks(layout, nkb):
    valid = torch.arange(layout.block_idx.shape[-1]) < layout.block_cnt.unsqueeze(-1)
    dense = torch.zeros(*layout.block_cnt.shape, nkb + 1, dtype=torch.bool)
    return dense.scatter_(-1, torch.where(valid, layout.block_idx.long(), nkb), True)[..., :nkb]


@pytest.mark.parametrize("density", [0.05, 0.10, 0.20], ids=["5pct", "10pct", "20pct"])
def test_density_layouts_hit_their_target(bench, density):
    layout = bench.density_layout(8192, 4, 64, density, 64, seed=0, device="cpu")
    layout.validate(4, 8192, 8192, strict=True)
    assert abs(float(layout.kept_fraction()) - density) < 0.01
    assert int(layout.col_cnt.sum()) > 0  # the vertical columns are there too


def test_flex_block_mask_lists_exactly_the_layout_blocks(bench):
    s, bs = 2048, 64
    layout = bench.density_layout(s, 4, bs, 0.2, 32, seed=1, device="cpu")
    mask = bench.flex_block_mask(layout, 4, s)
    assert torch.equal(mask.to_dense().bool(), _listed_blocks(layout, s // bs))


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_on_the_block_mask_equals_the_reference_without_columns(bench):
    """Same function for both: FlexAttention (eager, CPU) on the mask vs our reference on the layout
    with its columns removed."""
    from torch.nn.attention.flex_attention import flex_attention

    s, bs = 512, 64
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, h, s, 32, generator=g) for h in (4, 2, 2))
    layout = bench.columns_removed(bench.density_layout(s, 4, bs, 0.3, 16, seed=3, device="cpu"))
    meta = TokenMeta.contiguous(1, s)
    ref, _ = reference_forward(q, k, v, layout, scale=32**-0.5, q_meta=meta, k_meta=meta)
    out = flex_attention(q, k, v, block_mask=bench.flex_block_mask(layout, 4, s), enable_gqa=True)
    assert rel_rms(out, ref) <= TOLERANCE[torch.float32]


def test_computed_pairs_of_a_dense_layout(bench):
    s, bs, h = 1000, 64, 3
    layout = dense_layout(TokenMeta.contiguous(1, s), bs)
    nb = -(-s // bs)
    assert bench.computed_pairs(layout, h) == h * nb * (nb + 1) / 2 * bs * bs


def test_estimated_layout_keeps_planted_structure(bench):
    q, k = bench.planted_inputs(4096, 4, 2, 64, seed=4)
    layout = bench.estimated_layout(q, k, 64, 16, 64)
    assert 0.0 < float(layout.kept_fraction()) < 0.5
    assert int(layout.col_cnt.sum()) > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")
def test_benchmark_refuses_without_gpu(bench):
    with pytest.raises(SystemExit, match="GPU benchmark"):
        bench.main(["--seq_lens", "1024"])


def test_table_reports_speedups_and_the_estimation_share(bench):
    """The table's ratios come from the rows: ours vs flex on the same layout, vs cuDNN dense, and
    estimation time as a percentage of our forward+backward on the estimated layout."""
    common = {"seq_len": 131072, "density": 0.05, "column_share": 0.1, "pairs": 1.0, "status": "ok",
              "fwd_tflops": 1.0, "fwd_bwd_tflops": 1.0, "estimation_ms": None}
    rows = [
        {**common, "layout": "est v1/s2", "variant": "ours", "fwd_ms": 1.0, "fwd_bwd_ms": 4.0, "estimation_ms": 0.2},
        {**common, "layout": "est v1/s2", "variant": "flex", "fwd_ms": 2.0, "fwd_bwd_ms": 8.0},
        {**common, "layout": "dense", "variant": "sdpa_cudnn", "fwd_ms": 15.0, "fwd_bwd_ms": 60.0},
    ]
    ours = bench.format_table(rows).splitlines()[2].split()
    assert ours[-3:] == ["2.00", "15.00", "5.0"]  # x flex, x cudnn, est %


def test_time_estimation_runs_on_cpu_and_times_every_stage(bench):
    q, k = bench.planted_inputs(2048, 4, 2, 64, seed=5)
    cfg = bench.estimation_config(32, 8, 64)
    timing = bench.time_estimation(q, k, cfg, TokenMeta.contiguous(1, 2048), warmup=1, repeats=2)
    assert set(timing) == {"total_ms", "documents_ms", "scoring_ms", "layout_ms"}
    assert all(v > 0 for v in timing.values())  # (no ordering of the times: stages and total are noisy medians)


def _rows(seq_len=131072):
    def row(layout, variant, fwd_bwd, density=0.05):
        return {"seq_len": seq_len, "layout": layout, "variant": variant, "density": density, "column_share": 0.1,
                "pairs": 1.0, "status": "ok", "fwd_ms": fwd_bwd / 4, "fwd_bwd_ms": fwd_bwd, "fwd_tflops": 1.0,
                "fwd_bwd_tflops": 1.0, "estimation_ms": None}

    return [
        row("vs@5%", "ours", 30.0), row("vs@5%", "flex", 54.0),
        row("vs@10%", "ours", 60.0, 0.1), row("vs@10%", "flex", 75.0, 0.1),
        row("est v1000/s64", "ours", 20.0, 0.04), row("est v1000/s64", "flex", 50.0, 0.04),
        row("dense", "ours", 700.0, 1.0), row("dense", "flex", 650.0, 1.0), row("dense", "sdpa_cudnn", 465.0, 1.0),
    ]


def test_estimation_report_and_the_issue_targets(bench):
    rows = _rows()
    estimation = [{"seq_len": 131072, "layout": "est v1000/s64", "total_ms": 1.5, "documents_ms": 0.1,
                   "scoring_ms": 0.6, "layout_ms": 0.8}]
    (report,) = bench.estimation_report(rows, estimation)
    assert report["share_of_fwd_bwd"] == pytest.approx(1.5 / 20.0) and report["kept_fraction"] == 0.04
    assert report["share_of_fwd"] == pytest.approx(1.5 / 5.0)
    assert "7.5" in bench.format_estimation([report])

    targets = bench.issue_targets(rows, estimation)
    flex5, cudnn5, flex10, dense, est = targets
    assert "vs@5%" in flex5["target"] and "Flex" in flex5["target"] and "cuDNN" in cudnn5["target"]
    assert flex5["measured"] == pytest.approx(54 / 30) and flex5["pass"] is True
    assert cudnn5["measured"] == pytest.approx(465 / 30) and cudnn5["pass"] is True
    assert "vs@10%" in flex10["target"] and flex10["measured"] == pytest.approx(1.25) and flex10["pass"] is False
    assert dense["measured"] == pytest.approx(650 / 700) and dense["pass"] is True
    assert est["measured"] == pytest.approx(0.075) and est["pass"] is True
    text = bench.format_targets(targets)
    assert text.count("PASS") == 4 and text.count("MISS") == 1


def test_targets_not_measured_are_reported_as_such(bench):
    """A run without 128K (or without a baseline) says so instead of passing or failing."""
    targets = bench.issue_targets(_rows(seq_len=32768), [])
    assert all(t["measured"] is None and t["pass"] is None for t in targets)
    assert bench.format_targets(targets).count("not measured") == len(targets)


def test_sweep_orchestration_runs_on_cpu(bench):
    """`Bench.run` end to end with our variant only (the PyTorch reference on CPU) at one small S: every
    row measured, the estimated layout timed and joined to our time on it."""
    args = bench.BenchAttentionArguments(seq_lens=[512], densities=[0.2], num_verticals=8, estimated_budgets=["16:4"],
                                         variants=["ours"], num_q_heads=4, num_kv_heads=2, head_dim=32, block_size=64,
                                         warmup=0, repeats=1, check=False, profile_seq_lens=[512])
    sweep = bench.Bench(args, device="cpu")
    sweep.run()
    assert [(r["layout"], r["status"]) for r in sweep.rows] == [("vs@20%", "ok"), ("est v16/s4", "ok"),
                                                                ("dense", "ok")]
    assert all(r["fwd_ms"] > 0 and r["fwd_bwd_ms"] > 0 and r["fwd_bwd_tflops"] > 0 for r in sweep.rows)
    for r in sweep.rows:  # every case profiled at S=512: operators by own time, largest first, shares of 1
        times = [k["ms"] for k in r["kernels"]]
        assert times[:-1] == sorted(times[:-1], reverse=True) and min(times) > 0
        assert sum(k["share"] for k in r["kernels"]) == pytest.approx(1.0)
    (est,) = bench.estimation_report(sweep.rows, sweep.estimation)
    assert est["layout"] == "est v16/s4" and est["share_of_fwd_bwd"] > 0
    assert sweep.rows[1]["estimation_ms"] == est["total_ms"]
    assert "est v16/s4" in bench.format_table(sweep.rows)
