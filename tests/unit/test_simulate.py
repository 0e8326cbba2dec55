"""The cluster simulator counts what the ring executes and times its schedule as the analytic answers say."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.layout import SparseLayout
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.distributed import RingTopology, ShardPlan
from hf_sparse_cp.distributed.ring.plan import RingPlan, column_reads
from hf_sparse_cp.distributed.split.documents import plan_documents
from hf_sparse_cp.simulator.shapes import MODELS
from hf_sparse_cp.simulator.simulate import (
    CONFIGURATIONS,
    Cluster,
    KernelCosts,
    Link,
    RingSetup,
    Workload,
    plan_work,
    simulate_ring,
)
from hf_sparse_cp.simulator.step_model import (
    BOUND_KERNELS,
    CLUSTERS,
    H100_OURS,
    H100_OURS_FWD_BWD,
    HARDWARE,
    OURS_FORWARD_SHARE,
    OURS_RESULTS,
    SPARSE_KERNELS,
    _units,
    h100,
    layer_time,
    predict_step,
    ring_counts,
    ring_step_seconds,
    with_causal_layout,
)
from hf_sparse_cp.simulator.traffic import COLUMNS, PlanTraffic, column_rows, plan_traffic, ring_cost
from hf_sparse_cp.simulator.workloads import padded_to, random_vertical_slash_layout

S, BS = 2048, 32

RINGS = [("contiguous", (1, 4)), ("zigzag", (1, 4)), ("striped", (1, 4)), ("striped", (2, 2)),
         ("document", (1, 4)), ("document", (2, 2))]
# a packed row for the document planner: whole documents on some ranks, the long ones split (ragged shards)
DOCS = [700, 90, 250, 500, 130, 300, 78]  # (the second sparse document 16 tokens into a block)
KINDS = ["sparse", "dense", "dense", "sparse", "dense", "dense", "dense"]


def _sparse(seed=0, heads=3, meta=None):
    return random_vertical_slash_layout(1, heads, S, BS, num_diagonals=6, num_verticals=40, sink_tokens=8, meta=meta,
                                        generator=torch.Generator().manual_seed(seed))


def _split(sharding, w, seed=0):
    """(plan, global layout, global meta) of a 2048-token row: one sequence, or the packed DOCS for 'document'."""
    if sharding != "document":
        return ShardPlan(sharding, w, BS, S), _sparse(seed), TokenMeta.contiguous(1, S)
    plan = plan_documents(DOCS, KINDS, w, BS, kept_per_row=4)
    assert len({int(b.numel()) for b in plan.rank_blocks}) > 1 and plan.split  # ragged, some documents split
    seg = torch.repeat_interleave(torch.arange(len(DOCS), dtype=torch.int32), torch.tensor(DOCS))
    meta = plan.global_meta(TokenMeta.from_segments(seg.unsqueeze(0)))
    return plan, _sparse(seed, meta=meta), meta


@pytest.mark.parametrize("sharding,shape", RINGS, ids=[f"{s}-{n}x{l}" for s, (n, l) in RINGS])
def test_work_equals_the_ring_plans_step_layouts(sharding, shape):
    topo = RingTopology(*shape)
    _assert_work_is_the_ring_plans(*_split(sharding, topo.size), topo)


BLOCK_RINGS = [r for r in RINGS if r[0] != "document"]


@pytest.mark.parametrize("sharding,shape", BLOCK_RINGS, ids=[f"{s}-{n}x{l}" for s, (n, l) in BLOCK_RINGS])
def test_a_row_off_the_splits_grid_runs_the_ring_plans_of_training_s_padded_shards(sharding, shape):
    """#50: a row of 1800 tokens (57 blocks; each split's grid pads it, to 60 or 64): its layout, drawn over the row and
    padded to the split's grid (`padded_to`, what `simulate` gives each split), gives the work the ring plans of
    training's padded shards run (`RingPlan` over the padded sequence), every rank a shard of the split's local_len,
    and the row's kept fraction (the padding's query blocks left out)."""
    topo, seq = RingTopology(*shape), 1800
    plan = ShardPlan(sharding, topo.size, BS, seq)
    row = random_vertical_slash_layout(1, 3, seq, BS, num_diagonals=6, num_verticals=40, sink_tokens=8,
                                       generator=torch.Generator().manual_seed(0))
    layout, real = padded_to(row, plan), row.num_q_blocks
    assert real == 57 and plan.num_blocks in (60, 64) and layout.num_q_blocks == plan.num_blocks
    assert not layout.block_cnt[:, :, real:].any() and not layout.col_cnt[:, :, real:].any()
    assert all(torch.equal(a[:, :, :real], b) for a, b in zip(layout.tensors(), row.tensors(), strict=True))
    _assert_work_is_the_ring_plans(plan, layout, TokenMeta.contiguous(1, seq).pad_to(plan.padded_len), topo)
    setup = RingSetup(layout, plan, topo, True)
    assert [b.numel() * BS for b in plan.rank_blocks] == [plan.local_len] * topo.size
    assert setup.kept_fraction() == float(row.kept_fraction()) != float(layout.kept_fraction())


def _assert_work_is_the_ring_plans(plan, layout, meta, topo):
    work = plan_work(layout, plan, topo)
    for p in range(topo.size):
        ring_plan = RingPlan(layout, plan, meta, topo, p)
        for t, step in enumerate(ring_plan.steps):
            if step.layout is None:
                assert work.calls[p, t] == 0 and work.blocks[p, t] == 0
                continue
            assert work.calls[p, t] == 1
            assert work.blocks[p, t] == float(step.layout.num_computed_blocks().sum())
            assert work.rows[p, t] == float((step.layout.block_cnt > 0).sum())
            assert work.padded[p, t] == step.layout.block_idx.shape[-1] * step.layout.block_cnt.numel()
        bar = ring_plan.bar.layout
        assert work.calls[p, -1] == float(ring_plan.bar_work)
        assert work.blocks[p, -1] == pytest.approx(float(bar.col_cnt.sum()) / BS)
        assert work.rows[p, -1] == float((bar.col_cnt > 0).sum())
        assert work.padded[p, -1] == pytest.approx(int(bar.col_cnt.max()) * bar.col_cnt.numel() / BS)


@pytest.mark.parametrize("sharding,shape", RINGS, ids=[f"{s}-{n}x{l}" for s, (n, l) in RINGS])
def test_work_and_bytes_equal_what_cp_balance_counts(sharding, shape):
    topo = RingTopology(*shape)
    plan, layout, _ = _split(sharding, topo.size, seed=1)
    cost = ring_cost(layout, plan, topo, kv_heads=2, head_dim=16)
    assert torch.equal(plan_work(layout, plan, topo).blocks, cost.work)
    traffic = plan_traffic(layout, plan, topo, kv_heads=2, head_dim=16)
    assert torch.equal(traffic.total(False), cost.forward_bytes)
    assert torch.equal(traffic.total(True), cost.backward_bytes)


@pytest.mark.parametrize("sharding,shape", RINGS, ids=[f"{s}-{n}x{l}" for s, (n, l) in RINGS])
def test_column_transfers_agree_at_both_ends_and_with_the_simulator(sharding, shape):
    """Every rank plans the key columns' transfers alone, from the global layout: what a holder sends a reader is
    what the reader expects from it (the same tokens, in the same order), the columns that reader's queries list
    and the holder holds, and what the simulator counts."""
    topo = RingTopology(*shape)
    plan, layout, meta = _split(sharding, topo.size)
    bars = [RingPlan(layout, plan, meta, topo, p).bar for p in range(topo.size)]
    listed = column_reads(layout, plan)
    rows = column_rows(layout, plan)
    assert rows.sum() > 0
    for holder, h in enumerate(bars):
        for reader, r in enumerate(bars):
            if reader == holder:
                assert holder not in h.send and holder not in h.recv
                continue
            sent = h.send.get(reader, torch.zeros(0, dtype=torch.long))
            tokens = plan.blocks_of(holder)[sent // BS] * BS + sent % BS
            received = r.tokens[r.recv.get(holder, torch.zeros(0, dtype=torch.long))]
            assert torch.equal(tokens, received)
            want = (listed[reader] & (plan.block_owner.repeat_interleave(BS) == holder)).nonzero().flatten()
            assert torch.equal(received, want) and received.numel() == rows[reader, holder]


def _full_layout(nb: int) -> SparseLayout:
    """Every query block reads every key block: every ring slot carries a whole shard."""
    idx = torch.arange(nb, dtype=torch.int32).expand(1, 1, nb, nb).contiguous()
    return SparseLayout.from_blocks(idx, torch.full((1, 1, nb), nb, dtype=torch.int32), BS)


W = 4
LINK = Link(bandwidth=1e9, latency=1e-5)


def _toy(overlap=True):
    nb = S // BS
    plan = ShardPlan("striped", W, BS, S)
    topo = RingTopology(1, W)
    traffic = plan_traffic(_full_layout(nb), plan, topo, kv_heads=1, head_dim=16)
    shard = plan.local_len * 16 * 2 * 2  # K and V, bf16
    return traffic, topo, Cluster("toy", W, LINK, LINK, overlap), LINK.latency + shard / LINK.bandwidth


def _steps(c: float) -> torch.Tensor:
    t = torch.full((W, W + 1), c, dtype=torch.float64)
    t[:, -1] = 0.0  # no column step
    return t


def test_hidden_communication_costs_nothing():
    traffic, topo, cluster, transfer = _toy()
    c = 3 * transfer
    assert simulate_ring(_steps(c), traffic, topo, cluster, backward=False).time == pytest.approx(W * c)


def test_communication_bound_ring_takes_the_transfers():
    traffic, topo, cluster, transfer = _toy()
    assert simulate_ring(_steps(0.0), traffic, topo, cluster, backward=False).time == pytest.approx((W - 1) * transfer)
    c = transfer / 4  # each of the W - 1 transfers outlasts its step; the last step has none
    line = simulate_ring(_steps(c), traffic, topo, cluster, backward=False)
    assert line.time == pytest.approx((W - 1) * transfer + c)


def test_without_overlap_compute_and_transfers_add_up():
    traffic, topo, cluster, transfer = _toy(overlap=False)
    c = 3 * transfer
    assert simulate_ring(_steps(c), traffic, topo, cluster, backward=False).time == pytest.approx(
        W * c + (W - 1) * transfer)


def test_the_slowest_rank_decides():
    traffic, topo, cluster, transfer = _toy()
    c = 3 * transfer
    steps = _steps(c)
    steps[0, 0] = 3 * c
    line = simulate_ring(steps, traffic, topo, cluster, backward=False)
    assert line.time == pytest.approx((W + 2) * c)
    # its ring neighbours wait for it at the next slot (without it they would end at W c)
    assert float(line.end[1]) > W * c + transfer and float(line.end[W - 1]) > W * c + transfer


def test_a_rank_entering_the_ring_late_holds_up_its_neighbours():
    traffic, topo, cluster, transfer = _toy()
    c = 3 * transfer
    start = torch.zeros(W, dtype=torch.float64)
    start[0] = 2 * c
    line = simulate_ring(_steps(c), traffic, topo, cluster, backward=False, start=start)
    assert float(line.end[0]) == pytest.approx((W + 2) * c)
    assert float(line.end[1]) > W * c + transfer  # it waits for rank 0 at the first slot
    exchange_nothing = simulate_ring(_steps(c), PlanTraffic([{}] * W, [{}] * W, 1), topo, cluster, backward=False,
                                     start=start)
    assert torch.allclose(exchange_nothing.end, start + W * c)


def test_layer_time_charges_each_rank_its_own_linear_work():
    """From the estimation's collectives each rank runs its ring, then its own linear layers: linear work that
    complements the ring's per-rank ends costs no more than the ranks' largest sum (a document split trades one
    rank's tokens for another's attention), where charging the busiest rank's linear work plus the ring's time
    would add the two maxima. The backward ring is entered when each rank gets there."""
    plan, layout, _ = _split("document", W)
    setup = RingSetup(layout, plan, RingTopology(1, W), True)
    model, hw = MODELS["qwen2.5-3b"], HARDWARE["8xH100-IB400"]()
    free = CLUSTERS["8xH100-IB400"].without_network()
    work, traffic = ring_counts(setup, model)
    fwd_s, bwd_s = ring_step_seconds(setup, model, hw, work)
    ends = simulate_ring(fwd_s, traffic, setup.topology, free, backward=False).end
    assert float(ends.max()) > 1.2 * float(ends.min())  # the ranks leave the ring at different times
    linear = 1.5 * ends.max() - ends
    forward, backward, rings = layer_time(setup, model, hw, free, work, traffic, linear, 0.25, recompute=True)
    assert forward == pytest.approx(0.25 + 1.5 * float(ends.max()))
    assert forward < 0.25 + float(ends.max() + linear.max()) - 0.1 * float(ends.max())
    before = model.qkv_params / model.layer_params
    assert torch.allclose(rings["bwd_start"], ends + (1 - before) * 3 * linear)  # recompute, then the MLP's backward
    bwd = simulate_ring(bwd_s, traffic, setup.topology, free, backward=True, start=rings["bwd_start"])
    assert float((bwd.end - rings["bwd_start"]).min()) > 0 and torch.allclose(rings["bwd"].end, bwd.end)
    assert backward == pytest.approx(0.25 + float((bwd.end + 3 * before * linear).max()))
    _, no_recompute, rings = layer_time(setup, model, hw, free, work, traffic, linear, 0.25, recompute=False)
    assert torch.allclose(rings["bwd_start"], (1 - before) * 2 * linear)
    assert no_recompute == pytest.approx(float((rings["bwd"].end + 2 * before * linear).max()))


def test_column_transfers_hide_behind_the_ring_or_not():
    layout = _sparse(heads=1)
    plan = ShardPlan("striped", W, BS, S)
    topo = RingTopology(1, W)
    traffic = plan_traffic(layout, plan, topo, kv_heads=1, head_dim=16)
    per_rank = [sum(n for _, n in sends.get(COLUMNS, ())) for sends in traffic.forward]
    assert min(per_rank) > 0
    slow = Link(bandwidth=1e3, latency=0.0)  # a rank's column sends (one after the other) outlast anything else
    free = Link(float("inf"), 0.0)
    steps = _steps(1e-3)
    steps[:, -1] = 2e-3
    line = simulate_ring(steps, traffic, topo, Cluster("one node", W, slow, slow), backward=False)
    assert line.time >= max(per_rank) / slow.bandwidth + 2e-3
    line = simulate_ring(steps, traffic, topo, Cluster("free", W, free, free), backward=False)
    assert line.time == pytest.approx(W * 1e-3 + 2e-3)


def test_kernel_costs_scale_with_the_models_heads():
    layout = _sparse(heads=2)
    plan = ShardPlan("striped", W, BS, S)
    work = plan_work(layout, plan, RingTopology(1, W))
    costs = KernelCosts(call=1.0, row=0.0, block=2.0, slot=0.0)
    assert torch.allclose(costs.time(work, heads=8), work.calls + 2.0 * 4 * work.blocks)


def test_our_kernels_are_priced_from_the_committed_measurements():
    """The rows `ours` is fitted to are those of the committed H100 run (S, computed pairs over the causal pairs of
    its 16 heads, fwd+bwd ms), its forward share the H200 tiles stage's (forward against the launched backward)."""
    root = Path(__file__).resolve().parents[2]
    attention, tiles = (json.loads((root / path).read_text()) for path in OURS_RESULTS)
    assert attention["device"].startswith("NVIDIA H100") and tiles["device"] == "NVIDIA H200"
    heads, bs = attention["settings"]["num_q_heads"], attention["settings"]["block_size"]
    causal = {s: bs * bs * (s // bs) * (s // bs + 1) / 2 for s in attention["settings"]["seq_lens"]}
    measured = [(r["seq_len"], round(r["pairs"] / heads / causal[r["seq_len"]], 4), round(r["fwd_bwd_ms"], 2))
                for r in attention["results"] if r["variant"] == "ours"]
    assert measured == H100_OURS_FWD_BWD
    launched = {r["kernel"]: r["ms"] for r in tiles["results"]
                if r["current"] and r["kernel"] in ("forward", "columns")}
    assert OURS_FORWARD_SHARE == pytest.approx(launched["forward"] / (launched["forward"] + launched["columns"]),
                                               abs=1e-3)


@pytest.mark.parametrize("kernel", list(SPARSE_KERNELS))
def test_each_sparse_kernel_reproduces_its_measurements_within_the_error_its_source_states(kernel):
    rows, _ = SPARSE_KERNELS[kernel]
    hw = h100(sparse_kernel=kernel)
    worst = float(re.search(r"worst error (\d+)%", hw.sources["sparse attention"]).group(1)) / 100 + 0.005
    for s, density, fwd_ms, total_ms in rows:
        units, blocks = _units(s, density)
        per_head = [c.row * units + c.block * blocks for c in (hw.sparse_fwd, hw.sparse_bwd)]
        predicted = 16 * 1e3 * sum(per_head)
        if kernel in BOUND_KERNELS:  # (the per-block cost alone: under every measurement)
            assert hw.sparse_fwd.row == hw.sparse_bwd.row == 0.0 and predicted < total_ms
        else:
            assert abs(predicted / total_ms - 1) <= worst
            assert 16 * 1e3 * per_head[0] == pytest.approx(fwd_ms, rel=worst)
    assert [r[2] / r[3] for r in H100_OURS] == pytest.approx([OURS_FORWARD_SHARE] * len(H100_OURS))
    with pytest.raises(ValueError, match="use one of"):
        h100(sparse_kernel="cudnn")


def test_the_simulator_prices_sparse_rings_with_our_kernels_unless_told(capsys):
    from hf_sparse_cp.simulator import simulate_cli

    def kernels(*flags):
        return simulate_cli.parse_args(["--seq", "32768", "--cp", "8", *flags]).sparse_kernels

    assert kernels() == ("ours",) and kernels("--all") == tuple(SPARSE_KERNELS)
    assert kernels("--sparse-kernels", "flex", "ours", "flex") == ("flex", "ours")
    with pytest.raises(SystemExit):
        kernels("--sparse-kernels", "fa2")
    assert "invalid choice: 'fa2'" in capsys.readouterr().err


def test_predicted_step_is_consistent():
    """128K tokens on the H100 preset: sparse beats dense, more GPUs means a shorter step."""
    s = 131072
    layouts = {"sparse": random_vertical_slash_layout(1, 2, s, 128, num_diagonals=6, num_verticals=64, sink_tokens=32,
                                                      generator=torch.Generator().manual_seed(0)),
               "dense": dense_layout(TokenMeta.contiguous(1, s), 128)}
    workload = Workload((s,), ("sparse",), lambda kind, plan: layouts[kind])
    model, hw, cluster = MODELS["qwen2.5-3b"], HARDWARE["8xH100-IB400"](), CLUSTERS["8xH100-IB400"]
    out = {(name, cp): predict_step(CONFIGURATIONS[name](workload, cp, 128, 8), model, hw, cluster)
           for name in ("dense ring", "striped sparse", "planner sparse") for cp in (4, 16)}
    for name in ("dense ring", "striped sparse"):
        assert out[(name, 16)]["step_s"] < out[(name, 4)]["step_s"]
    assert out[("striped sparse", 4)]["step_s"] < out[("dense ring", 4)]["step_s"]
    r = out[("striped sparse", 16)]
    assert 0.0 <= r["comm_share"] < 1.0
    assert r["tokens_per_s"] == pytest.approx(s / r["step_s"])
    # one sequence: the planner splits it striped, and the simulator predicts the same step
    for cp in (4, 16):
        assert out[("planner sparse", cp)]["step_s"] == pytest.approx(out[("striped sparse", cp)]["step_s"])
    # causal-chunk estimation: 127 sets of 1024-token chunks, each scoring about half the keys, its packed
    # slashes about half the offsets, its candidates and small all-reduces whole: every cost but the index
    # build and the collectives' latencies grows 63.5x to 127x; the attention itself is the same
    # (top-k with the last queries: the index build is charged once, unweighted)
    setup = CONFIGURATIONS["striped sparse"](workload, 16, 128, 8)
    topk = SparseAttentionConfig(budget_mode="topk")
    r = predict_step(setup, model, hw, cluster, estimation=topk)
    causal = predict_step(setup, model, hw, cluster, estimation_chunk=1024, estimation=topk)
    assert causal["attention_fwd_s"] == r["attention_fwd_s"] and causal["linear_s"] == r["linear_s"]
    assert 30 < (causal["estimation_s"] - hw.index_build_s) / (r["estimation_s"] - hw.index_build_s) < 127
    half = predict_step(setup, model, hw, cluster, estimation_chunk=2048, estimation=topk)  # 63 sets: about half
    assert 1.5 < (causal["estimation_s"] - r["estimation_s"]) / (half["estimation_s"] - r["estimation_s"]) < 2.1
    assert causal["step_s"] - r["step_s"] == pytest.approx(2 * model.layers * (causal["estimation_s"]
                                                                               - r["estimation_s"]), rel=1e-6)
    # the default 'mass' estimation: the same halving (each set gathers its own block diagonals)
    r, causal, half = (predict_step(setup, model, hw, cluster, estimation_chunk=c) for c in (None, 1024, 2048))
    assert 1.5 < (causal["estimation_s"] - r["estimation_s"]) / (half["estimation_s"] - r["estimation_s"]) < 2.1
    small = Workload((S,), ("sparse",), lambda kind, plan: _sparse())
    with pytest.raises(ValueError, match="block_size=128"):
        predict_step(CONFIGURATIONS["striped sparse"](small, 4, BS, 8), model, hw, cluster)


def test_sliding_window_layers_run_their_windows_layout_without_estimation():
    """Issue #50: simulate charged every layer as a global one. A sliding-window layer (`ModelShape.windows`) runs the
    same ring without estimation over its window's layout, in every configuration: with a window as long as the
    sequence it costs what a dense first layer costs; a short window shortens the dense ring's step; each such layer
    adds the same; the first dense layers count only the global ones."""
    s, cp = 131072, 8
    meta = TokenMeta.contiguous(1, s)
    drawn = random_vertical_slash_layout(1, 2, s, 128, num_diagonals=6, num_verticals=64, sink_tokens=32,
                                         generator=torch.Generator().manual_seed(0))
    layouts = {("sparse", None): drawn,
               ("dense", None): dense_layout(meta, 128), ("dense", s): dense_layout(meta, 128, s),
               ("dense", 4096): dense_layout(meta, 128, 4096)}
    workload = Workload((s,), ("sparse",), lambda kind, plan, window=None: layouts[kind, window])
    base, hw, cluster = MODELS["qwen2.5-3b"], HARDWARE["8xH100-IB400"](), CLUSTERS["8xH100-IB400"]
    n = base.layers

    def step(name: str, windows: tuple, window: int | None, **kwargs) -> dict:
        setup = CONFIGURATIONS[name](workload, cp, 128, 8)
        sliding = with_causal_layout(setup, layouts["dense", window]) if window else None
        return predict_step(setup, dataclasses.replace(base, windows=windows), hw, cluster, sliding=sliding, **kwargs)

    sparse = CONFIGURATIONS["striped sparse"](workload, cp, 128, 8)
    causal = predict_step(sparse, base, hw, cluster, dense_layers=n, dense=with_causal_layout(sparse,
                                                                                             layouts["dense", None]))
    whole = step("striped sparse", (s,) * n, s)
    assert whole["sliding_layers"] == n and whole["step_s"] == pytest.approx(causal["step_s"], rel=1e-12)
    dense = [step("dense ring", w, 4096) for w in ((), (4096, None) * (n // 2), (4096,) * n)]
    assert dense[2]["step_s"] < dense[1]["step_s"] < dense[0]["step_s"]
    assert dense[1]["step_s"] == pytest.approx((dense[0]["step_s"] + dense[2]["step_s"]) / 2, rel=1e-9)
    assert step("striped sparse", (4096, None) * (n // 2), 4096, dense_layers=2,
                dense=with_causal_layout(sparse, layouts["dense", None]))["dense_layers"] == 1
    with pytest.raises(ValueError, match="36 sliding-window layers need `sliding`"):
        predict_step(sparse, dataclasses.replace(base, windows=(4096,) * n), hw, cluster)


def test_predicted_estimation_charges_sampled_queries_and_mass_mode():
    """Sampled groups add g / 2 x group size scoring rows (each group scores the keys before its cut), every
    scoring query travels in the small all-reduces, weighted estimation ('mass' mode or sampled groups) costs
    WEIGHTED_ESTIMATION_RATIO times the local work (measured per call on a CPU), and 'mass' mode
    reduce-scatters block diagonals, not slashes."""
    from hf_sparse_cp.simulator import step_model

    s = 131072
    layout = random_vertical_slash_layout(1, 2, s, 128, num_diagonals=6, num_verticals=64, sink_tokens=32,
                                          generator=torch.Generator().manual_seed(0))
    workload = Workload((s,), ("sparse",), lambda kind, plan: layout)
    model, hw, cluster = MODELS["qwen2.5-3b"], HARDWARE["8xH100-IB400"](), CLUSTERS["8xH100-IB400"]
    setup = CONFIGURATIONS["striped sparse"](workload, 16, 128, 8)
    topk = SparseAttentionConfig(budget_mode="topk", last_q=64)
    mass = topk.replace(budget_mode="mass", vertical_cap=512)
    ratio = step_model.WEIGHTED_ESTIMATION_RATIO
    assert ratio > 1

    def est(cfg, c=cluster):
        return step_model.estimation_time(setup, model, hw, c, cfg)

    free = cluster.without_network()
    local = est(topk, free)  # scoring and index build
    assert local > hw.index_build_s
    assert est(mass, free) == pytest.approx(ratio * local)
    # 32 last queries and 4 groups of 16 score like 64 last queries; 4 more groups of 16 over 64 add half
    assert est(mass.replace(last_q=32, sample_groups=4, sample_group_size=16), free) == pytest.approx(est(mass, free))
    grouped = topk.replace(sample_groups=4, sample_group_size=16)
    assert est(grouped, free) == pytest.approx(ratio * (1.5 * (local - hw.index_build_s) + hw.index_build_s))
    assert est(grouped) - est(grouped, free) > est(topk) - est(topk, free)  # the sampled queries travel too
    # with the network: 'mass' mode's reduce-scatter carries S / 128 block diagonals instead of S offsets
    assert est(mass) - est(mass, free) < est(topk) - est(topk, free)
    base = predict_step(setup, model, hw, cluster, estimation=topk)
    sampled = predict_step(setup, model, hw, cluster, estimation=grouped)
    assert sampled["attention_fwd_s"] == base["attention_fwd_s"]
    assert sampled["step_s"] - base["step_s"] == pytest.approx(
        2 * model.layers * (sampled["estimation_s"] - base["estimation_s"]), rel=1e-6)
    assert predict_step(setup, model, hw, cluster, last_q=64, estimation=topk)["step_s"] == base["step_s"]
    with pytest.raises(ValueError, match="mass_near_blocks=4 scores in PyTorch on CUDA"):  # no kernel, no GPU timing
        predict_step(setup, model, hw, cluster, estimation=mass.replace(mass_near_blocks=4))


def test_a_length_whose_layouts_exceed_the_machines_memory_is_refused_naming_the_limit(capsys, monkeypatch):
    """`simulate --seq 1099511627776` would try to allocate terabytes for its layouts (every pair of blocks):
    refused before anything is built, naming the memory it needs, the machine's and the longest length that fits;
    lengths that fit (the defaults, up to 1M) parse."""
    from hf_sparse_cp.simulator import simulate_cli

    monkeypatch.setattr(simulate_cli, "_machine_memory", lambda: 64 * 10**9)
    assert simulate_cli.parse_args(["--seq", "1048576", "--layout-heads", "4"]).seq == [1048576]
    with pytest.raises(SystemExit):
        simulate_cli.parse_args(["--seq", "131072", "1099511627776"])
    err = capsys.readouterr().err
    assert "--seq 1099511627776: simulating it holds its layouts of (1099511627776 / 128)^2 block pairs" in err
    longest = int(err.split("is about ")[1].split(" tokens")[0].replace(",", ""))
    assert "this machine has 64 GB" in err and "give --seq at most that" in err
    assert simulate_cli.peak_bytes(longest, 4) <= 64e9 < simulate_cli.peak_bytes(longest + 128, 4)
    with pytest.raises(SystemExit):  # more layout heads hold more: the limit falls with them
        simulate_cli.parse_args(["--seq", "2097152", "--layout-heads", "64"])
    assert "(--layout-heads 64)" in capsys.readouterr().err


def test_more_head_parallel_ranks_than_query_heads_are_refused_before_simulating(capsys):
    """`--cp 64 --cp_mode ulysses` on a model of 14 query heads: a clear refusal naming the degrees it takes, not a
    traceback after the first rows of the table."""
    from hf_sparse_cp.simulator import simulate_cli

    with pytest.raises(SystemExit) as refused:
        simulate_cli.main(["--model", "qwen2.5-0.5b", "--seq", "65536", "--cp", "64", "--cp_mode", "ulysses"])
    out, err = capsys.readouterr()
    assert refused.value.code == 2  # as argparse refuses a flag
    assert "error: --cp 64 --cp_mode ulysses: a head-parallel degree of 64 needs at least 64 query heads" in err
    assert "at most 14 that divides 64 ([1, 2, 4, 8]; balanced over the heads: [1, 2])" in err
    assert "configuration" not in out  # (no row simulated)


@pytest.mark.parametrize("command", ["simulate", "memory"])
def test_a_cp_mode_at_cp_1_is_refused_by_simulate_and_memory_alike(capsys, command):
    """`simulate --cp 1 --cp_mode ulysses` answered (printing 'CP 1 runs ring') where `memory --cp 1 --cp_mode
    ulysses` refused: both refuse it, as training refuses --cp_mode ulysses with --cp_size 1; a mode read at another
    CP size of the sweep, and the default mode, pass."""
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.simulator import memory_cli, simulate_cli

    main = simulate_cli.main if command == "simulate" else memory_cli.main
    argv = ["--model", "qwen2.5-0.5b", "--seq" if command == "simulate" else "--seq-len", "4096"]
    with pytest.raises(SystemExit) as refused:
        main([*argv, "--cp", "1", "--cp_mode", "ulysses"])
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and not out
    assert ("error: --cp_mode ulysses says how a CP group shares its sequences; with --cp 1 (no context "
            "parallelism) it would be ignored: drop it, or give --cp N (N > 1).") in err
    assert ContextParallelConfig(cp_size=1, cp_mode="ulysses").group_settings() == ["--cp_mode ulysses"]  # training's
    if command == "simulate":  # (its flags alone: its run starts a process)
        simulate_cli.parse_args([*argv, "--cp", "1", "2", "--cp_mode", "ulysses"])
        simulate_cli.parse_args([*argv, "--cp", "1", "--cp_mode", "ring"])
    else:
        main([*argv, "--cp", "1", "--cp_mode", "ring"])  # (no SystemExit: answered)


@pytest.mark.parametrize("mix", [None, "long-tail"])
def test_every_split_of_an_off_grid_length_reads_the_rows_layouts_padded_to_its_grid(mix, monkeypatch):
    """#50: `simulate` refused a length off its splits' grid (one layout per length for every split). Now every split
    (each block sharding at CP 2, 3 and 8, the head groups of hybrid and ulysses) reads the row's layouts built once
    over its own blocks and padded to the split's grid: the causal and packed ones equal to what training builds over
    its padded sequence, the sparse one drawn once for all of them, each split's kept fraction the row's."""
    from hf_sparse_cp.distributed.split.blocks import SHARDINGS, head_group_plan
    from hf_sparse_cp.simulator import simulate_cli
    from hf_sparse_cp.simulator.workloads import document_scores, mix_lengths, packed_layout, row_meta

    seq, block = 20000, simulate_cli.BLOCK
    drawn, draw = [], simulate_cli.random_vertical_slash_layout
    monkeypatch.setattr(simulate_cli, "random_vertical_slash_layout",
                        lambda *a, **kw: drawn.append(a[2]) or draw(*a, **kw))
    args = simulate_cli.parse_args(["--seq", str(seq), "--cp", "2", "3", "8", "--layout-heads", "2"]
                                   + (["--mix", mix] if mix else []))
    workload = simulate_cli.workload_for(args, seq, MODELS["qwen2.5-0.5b"])
    lengths = mix_lengths(mix, seq, args.seed) if mix else [seq]
    meta, cfg = row_meta(lengths), SparseAttentionConfig(block_size=block)
    plans = [ShardPlan(sh, cp, block, seq) for sh in SHARDINGS for cp in (2, 3, 8)] + [
        head_group_plan("striped", 8, size, block, seq) for size in (2, 8)]
    own = ShardPlan("contiguous", 1, block, seq)  # (the row's own blocks: no split's padding)
    assert len({p.padded_len for p in plans}) == 4 and all(p.num_blocks > own.num_blocks for p in plans)
    row = workload.layout("sparse", own)
    for plan in plans:
        for kind, window in (("dense", None), ("dense", 1000), ("sparse", None)):
            layout = workload.layout(kind, plan, window)
            if kind == "dense" or mix:  # (what training builds over the padded sequence)
                want = dense_layout(plan.global_meta(meta), block, window) if kind == "dense" else \
                    packed_layout(plan, meta, cfg, document_scores(lengths, args.seed))[0]
            else:  # (the row's one drawing, then the padding's query blocks, which list nothing)
                n = own.num_blocks
                assert not layout.block_cnt[:, :, n:].any() and not layout.col_cnt[:, :, n:].any()
                layout, want = layout.select(torch.arange(n)), row
            assert all(torch.equal(a, b) for a, b in zip(layout.tensors(), want.tensors(), strict=True)), (plan, kind)
        setup = RingSetup(workload.layout("sparse", plan), plan, RingTopology(1, plan.cp_size), True)
        assert setup.kept_fraction() == float(row.kept_fraction())
    assert drawn == ([] if mix else [seq])


def test_every_argument_is_checked_before_anything_prints_and_refused_as_argparse_refuses(capsys, tmp_path):
    """`simulate --seq 1000 --cp 2` printed the header rows, then its refusal without `error:`, exit status 1 (#50:
    such a length is answered now, padded as training pads it): every argument the command can check is checked
    first, and refused as argparse refuses a flag (prog: error: MESSAGE, exit status 2), nothing printed to stdout."""
    from hf_sparse_cp import cli
    from hf_sparse_cp.simulator import simulate_cli

    (tmp_path / "bad.json").write_text("{}")
    (tmp_path / "a_file").write_text("")
    (tmp_path / "bert.json").write_text('{"model_type": "bert", "hidden_size": 64}')
    (tmp_path / "gpt2.json").write_text('{"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4, "n_inner": '
                                        '128, "n_positions": 4096, "vocab_size": 300}')
    for argv, message in [
        # an output path that cannot be written: refused before minutes of simulation, not a traceback after them
        (["--seq", "8192", "--cp", "2", "--png", str(tmp_path / "a_file" / "x.png")],
         f"--png {tmp_path / 'a_file' / 'x.png'}: {tmp_path / 'a_file'} is a file, not a folder"),
        (["--seq", "8192", "--cp", "2", "--json", str(tmp_path)], f"--json {tmp_path} is a folder; give the path of a "
                                                                  "file"),
        (["--model", "qwen2.5-0.5b", "--seq", "65536", "--cp", "64", "--cp_mode", "ulysses"],
         "--cp 64 --cp_mode ulysses: a head-parallel degree of 64 needs at least 64 query heads"),
        # more dense first layers than the model has: a traceback after the first rows of the table, before
        (["--model", "qwen2.5-0.5b", "--seq", "8192", "--cp", "2", "--dense-first-layers", "1000"],
         "--dense-first-layers 1000: qwen2.5-0.5b has 24 layers; give at most 24 (all of them dense)."),
        (["--seq", "8192", "--cp", "2", "--kept-curve", str(tmp_path / "missing.json")],
         f"--kept-curve {tmp_path / 'missing.json'}: "),
        (["--seq", "8192", "--cp", "2", "--config", str(tmp_path / "bad.json")],
         f"--config {tmp_path / 'bad.json'}: no model_type"),
        (["--seq", "8192", "--cp", "2", "--config", str(tmp_path / "bert.json")],  # (one reader: memory's, simulate's)
         f"--config {tmp_path / 'bert.json'}: model_type 'bert' is an encoder"),
        # a length past a learned position table, which the model's forward refuses (GPT-2's: 1,024 positions)
        (["--seq", "4096", "8192", "--cp", "2", "--config", str(tmp_path / "gpt2.json")],
         f"--seq 8192: {tmp_path.name} takes at most 4,096 tokens (its learned position embeddings); give lengths up "
         "to that"),
    ]:
        with pytest.raises(SystemExit) as refused:
            simulate_cli.main([*argv, "--no-mtraining"], prog="hf-sparse-cp simulate")
        out, err = capsys.readouterr()
        assert refused.value.code == 2 and out == "", argv
        assert f"hf-sparse-cp simulate: error: {message}" in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as refused:  # the command line's path
        cli.main(["simulate", "--model", "qwen2.5-0.5b", "--seq", "1000", "--cp", "2", "--dense-first-layers", "25"])
    out, err = capsys.readouterr()
    assert refused.value.code == 2 and out == ""
    assert "usage: hf-sparse-cp simulate" in err and "hf-sparse-cp simulate: error: --dense-first-layers 25" in err


@pytest.mark.parametrize("command", ["memory", "simulate"])
def test_every_flag_is_taken_in_both_spellings_and_help_shows_the_documented_one(command, capsys):
    """`memory` took `--gpu-memory` but refused `--cp-mode` (its flag is training's `--cp_mode`): every long flag of
    `memory` and `simulate` is taken with dashes or underscores between its words (a prefix too, as argparse takes
    one); --help lists the documented spelling only."""
    from hf_sparse_cp import cli
    from hf_sparse_cp.simulator import memory_cli, simulate_cli

    parser = {"memory": memory_cli, "simulate": simulate_cli}[command].build_parser()
    flags = [flag for action in parser._actions for flag in action.option_strings if flag.startswith("--")]
    others = {other for flag in flags for other in (flag.replace("_", "-"), "--" + flag[2:].replace("-", "_"))}
    for flag in flags:
        for other in (flag.replace("_", "-"), "--" + flag[2:].replace("-", "_")):
            assert parser._documented(other) == flag and parser._documented(f"{other}=1") == f"{flag}=1", other
    assert parser._documented("--cp-mod") == "--cp_mod"  # (a prefix, which argparse completes)
    listed = set(re.findall(r"[\[ ](--[\w-]+)", parser.format_help()))  # (the usage and the flag list)
    assert "--cp_mode" in listed and set(flags) <= listed and not (others - set(flags)) & listed
    if command == "memory":
        assert {"--gpu-memory", "--no-master-weights"} <= listed and "--gpu_memory" not in listed
        answers = []
        for argv in (["--cp_mode", "ulysses", "--gpu-memory", "40GB", "--no-master-weights", "--seq-len", "8192"],
                     ["--cp-mode", "ulysses", "--gpu_memory", "40GB", "--no_master_weights", "--seq_len", "8192"]):
            cli.main(["memory", "--model", "qwen2.5-0.5b", "--cp", "2", *argv, "--quiet"])
            answers.append(capsys.readouterr().out)
        assert answers[0] == answers[1] and int(answers[0]) > 0
    spelt = [["--model", "qwen2.5-0.5b", f"--cp{sep}mode", "ulysses", f"--cp{sep}ulysses{sep}size=2"] for sep in "-_"]
    assert parser.parse_args(spelt[0]) == parser.parse_args(spelt[1])


@pytest.mark.parametrize("command", ["memory", "simulate"])
def test_training_s_cp_size_is_taken_and_a_mistyped_flag_names_the_close_one(command, capsys):
    """A user who gave `memory` training's `--cp_mode` typed training's `--cp_size` next (and `memory`'s `--seq-len`
    to `simulate`, whose flag was `--seq`): both were 'unrecognized arguments' with no hint. They are taken now, and an
    unknown flag names the flags close to it, as training's parser does."""
    from hf_sparse_cp.simulator import memory_cli, simulate_cli

    parser = {"memory": memory_cli, "simulate": simulate_cli}[command].build_parser()
    length = "--seq-len" if command == "memory" else "--seq"
    model = ["--model", "qwen2.5-0.5b"]
    assert (parser.parse_args([*model, "--cp_size", "4", "--seq-len", "8192"])
            == parser.parse_args([*model, "--cp", "4", length, "8192"]))
    with pytest.raises(SystemExit) as refused:
        parser.parse_args([*model, "--cp_mdoe", "ulysses"])
    assert refused.value.code == 2
    assert "unrecognized arguments: --cp_mdoe ulysses; did you mean --cp_mode for --cp_mdoe?" in capsys.readouterr().err



def test_the_fits_least_squares_equals_lapacks_in_python_floats():
    """The simulator's fits (our kernels' per-row and per-block costs, the linear layers' rate) gave their last digits
    differently from one `simulate` run to the next (torch.linalg.lstsq), so two runs of one command wrote different
    JSON: `step_model.least_squares` solves them in Python floats, the same bits every run, equal to LAPACK's to
    1e-12 on the fits' own shapes (columns of block rows and pairs; S and S^2 from 32K to 256K) and exact on a
    consistent system."""
    from hf_sparse_cp.simulator.step_model import H100_LIGER, least_squares

    generator = torch.Generator().manual_seed(0)
    s = [float(n) for n, _ in H100_LIGER["qwen2.5-0.5b"]]
    shapes = [[[n, n * n] for n in s], [[n / 128, 0.05 * (n / 128) ** 2 / 2] for n in s], [[n] for n in s]]
    for x in shapes:
        y = (torch.rand(len(x), dtype=torch.float64, generator=generator) + 0.5).tolist()
        ours = least_squares(x, y)
        x64, y64, ours64 = (torch.tensor(v, dtype=torch.float64) for v in (x, y, ours))
        lapack = torch.linalg.lstsq(x64, y64[:, None]).solution.flatten()
        assert torch.allclose(ours64, lapack, rtol=1e-12, atol=0), (ours, lapack)
    assert least_squares([[1.0, 2.0], [3.0, 1.0], [0.0, 1.0]], [5.0, 5.0, 2.0]) == pytest.approx([1.0, 2.0], abs=1e-15)
