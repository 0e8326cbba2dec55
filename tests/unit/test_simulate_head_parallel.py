"""The simulator's head parallelism: the all-to-alls it charges, and how the step time of ulysses and the
hybrid follows from the ring's pieces, the head split and the network."""

from dataclasses import replace

import pytest
import torch

from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.distributed import HeadSplit
from hf_sparse_cp.simulator.head_parallel import (
    ACTIVATION_BYTES,
    all_to_all_time,
    exchange_bytes,
    head_parallel_setup,
    predict_head_parallel_step,
)
from hf_sparse_cp.simulator.shapes import MODELS
from hf_sparse_cp.simulator.simulate import CONFIGURATIONS, Cluster, Link, Workload
from hf_sparse_cp.simulator.step_model import CLUSTERS, HARDWARE, predict_step, with_causal_layout

S, BS = 16384, 128


def _dense_workload() -> Workload:
    return Workload((S,), ("sparse",), lambda kind, plan: dense_layout(TokenMeta.contiguous(1, S).pad_to(
        plan.padded_len), BS))


def test_all_to_all_time_splits_peers_between_nvlink_and_infiniband():
    cluster = Cluster("c", 4, Link(100.0, 1.0), Link(10.0, 2.0))
    assert all_to_all_time(300.0, 1, cluster) == 0.0
    assert all_to_all_time(300.0, 4, cluster) == pytest.approx(1.0 + 300.0 / 100.0)  # 3 peers in the node
    # 8 ranks over 2 nodes: 3 peers at 100 B/s, 4 at 10 B/s, at once
    assert all_to_all_time(700.0, 8, cluster) == pytest.approx(max(1.0 + 300.0 / 100.0, 2.0 + 400.0 / 10.0))


def test_exchange_bytes_of_a_balanced_split_are_the_ulysses_volumes():
    split, tokens, d = HeadSplit(16, 4, 4), 1000, 128  # 4 query and 1 key/value head per rank
    sent = exchange_bytes(split, tokens, d)
    unit = tokens * d * ACTIVATION_BYTES
    assert sent["to_heads"] == 3 * (4 + 2 * 1) * unit  # q, k, v of the 3 other ranks' heads
    assert sent["to_sequence"] == sent["to_sequence_backward"] == 3 * 4 * unit
    assert sent["to_heads_backward"] == sent["to_heads"]


def test_replicated_kv_heads_are_sent_once_per_copy():
    tokens, d = 1000, 128
    replicated = exchange_bytes(HeadSplit(8, 2, 8), tokens, d)  # every rank reads one of 2 key heads
    assert replicated["to_heads"] == 7 * (1 + 2) * tokens * d * ACTIVATION_BYTES
    assert HeadSplit(8, 2, 8).replicated_kv_bytes(tokens, d, ACTIVATION_BYTES) == 2 * 6 * tokens * d * 2


def test_a_length_off_the_grid_is_charged_as_its_split_pads_it():
    """#50: at a length the head groups' split pads (10000 tokens in 8 pieces of whole blocks: 10240), the all-to-alls
    carry each rank's padded piece and the replicated K/V heads the padded sequence, as training's tensors hold them;
    tokens/s counts the sequence's own tokens."""
    model, hw, cluster, seq = MODELS["qwen2.5-3b"], HARDWARE["8xH100-IB400"](), CLUSTERS["8xH100-IB400"], 10000
    workload = Workload((seq,), ("sparse",), lambda kind, plan: dense_layout(TokenMeta.contiguous(1, seq).pad_to(
        plan.padded_len), BS))
    setup = head_parallel_setup(workload, 8, 8, BS, "dense")
    assert setup.plan.padded_len == 10240
    r = predict_head_parallel_step(setup, model, hw, cluster, head_size=8)
    split = HeadSplit(model.heads, model.kv_heads, 8)
    assert r["kv_replication_bytes"] == split.replicated_kv_bytes(10240, model.head_dim, ACTIVATION_BYTES) > 0
    sent = exchange_bytes(split, 10240 // 8, model.head_dim)
    assert r["all_to_all_bytes_per_rank"] == sent["to_heads"] + sent["to_sequence"]
    assert r["tokens_per_s"] == pytest.approx(seq / r["step_s"])


def test_ulysses_on_one_node_is_the_whole_sequence_of_its_heads_plus_the_all_to_alls():
    model, hw, cluster = MODELS["qwen2.5-3b"], HARDWARE["8xH100-IB400"](), CLUSTERS["8xH100-IB400"]
    workload = _dense_workload()
    setup = head_parallel_setup(workload, 8, 8, BS, "dense")
    assert setup.plan.cp_size == 1 and setup.plan.pieces == 8
    r = predict_head_parallel_step(setup, model, hw, cluster, head_size=8)
    assert r["heads_per_rank"] == 2 and r["kv_heads_per_rank"] == 1 and r["ring_forward_bytes_per_rank"] == 0
    # the same attention in one process over 2 of the 16 heads: a one-rank ring step
    one = predict_step(CONFIGURATIONS["dense ring"](workload, 1, BS, 8), replace(model, heads=2, kv_heads=1), hw,
                       cluster)
    assert r["attention_fwd_s"] == pytest.approx(one["attention_fwd_s"])
    free = predict_head_parallel_step(setup, model, hw, cluster.without_network(), head_size=8)
    assert r["step_s"] - free["step_s"] == pytest.approx(model.layers * (2 * r["all_to_all_fwd_s"]
                                                                         + r["all_to_all_bwd_s"]))
    assert r["comm_share"] == pytest.approx(1 - free["step_s"] / r["step_s"])


def test_more_ranks_than_query_heads_are_refused():
    workload = _dense_workload()
    with pytest.raises(ValueError, match="needs at least 32 query heads, but the model has 16"):
        predict_head_parallel_step(head_parallel_setup(workload, 32, 32, BS, "dense"), MODELS["qwen2.5-3b"],
                                   HARDWARE["8xH100-IB400"](), CLUSTERS["8xH100-IB400"], head_size=32)


def test_the_hybrids_ring_crosses_nodes_when_a_head_group_fills_one():
    """Head groups of 8 on 8-GPU nodes: every hop of the ring over the 4 groups goes over InfiniBand, so a
    slower InfiniBand slows the ring and leaves the all-to-alls as they were."""
    model, hw, cluster = MODELS["qwen2.5-3b"], HARDWARE["8xH100-IB400"](), CLUSTERS["8xH100-IB400"]
    setup = head_parallel_setup(_dense_workload(), 32, 8, BS, "dense", "zigzag")
    assert setup.plan.cp_size == 4
    fast = predict_head_parallel_step(setup, model, hw, cluster, head_size=8)
    slow = predict_head_parallel_step(setup, model, hw, replace(cluster, inter=Link(1e9, 2e-6)), head_size=8)
    assert slow["attention_fwd_s"] > fast["attention_fwd_s"]
    assert slow["all_to_all_fwd_s"] == fast["all_to_all_fwd_s"] and slow["ring_forward_bytes_per_rank"] > 0


def test_an_uneven_split_is_charged_for_its_busiest_rank():
    model, hw, cluster = MODELS["qwen2.5-0.5b"], HARDWARE["8xH100-IB400"](), CLUSTERS["8xH100-IB400"]  # 14 heads
    setup = head_parallel_setup(_dense_workload(), 8, 8, BS, "dense")
    r = predict_head_parallel_step(setup, model, hw, cluster, head_size=8)
    assert r["heads_per_rank"] == 2
    even = predict_head_parallel_step(setup, replace(model, heads=16), hw, cluster, head_size=8)
    assert r["attention_fwd_s"] == pytest.approx(even["attention_fwd_s"], rel=1e-12)
    assert torch.isfinite(torch.tensor(r["step_s"]))


def test_sliding_window_layers_run_the_all_to_alls_and_the_ring_over_their_window():
    """Issue #50: a sliding-window layer under head groups runs the same all-to-alls and ring over its window's
    layout: with a window as long as the sequence, the step of the causal one; a short window, a shorter step."""
    model, hw, cluster = MODELS["qwen2.5-3b"], HARDWARE["8xH100-IB400"](), CLUSTERS["8xH100-IB400"]
    setup = head_parallel_setup(_dense_workload(), 32, 8, BS, "dense", "zigzag")

    def step(window: int | None) -> dict:
        if window is None:
            return predict_head_parallel_step(setup, model, hw, cluster, head_size=8)
        layout = dense_layout(TokenMeta.contiguous(1, S).pad_to(setup.plan.padded_len), BS, window)
        return predict_head_parallel_step(setup, replace(model, windows=(window,) * model.layers), hw, cluster,
                                          head_size=8, sliding=with_causal_layout(setup, layout))

    causal, whole, short = step(None), step(S), step(1024)
    assert whole["sliding_layers"] == model.layers and whole["step_s"] == pytest.approx(causal["step_s"], rel=1e-12)
    assert short["step_s"] < causal["step_s"]


def test_a_head_group_rows_configuration_stays_apart_from_its_kernel():
    """`simulate --cp 16 --cp_mode ulysses` printed 'striped sparse / ulysses h16ours': a configuration with its mode
    and head-group size is wider than its column, and ran into the kernel's; the columns are kept apart by a space."""
    from hf_sparse_cp.simulator.simulate_cli import HEADER, format_row

    row = dict(seq=8192, cp=16, config="hierarchical planner sparse", mode="ulysses", head_size=16, kernel="ours",
               kept=0.79, step_s=0.14, tokens_per_s=58525, speedup_vs_dense_ring=0.35, comm_share=0.076,
               comm_bound=False)
    assert "hierarchical planner sparse / ulysses h16 ours " in format_row(row)
    plain = format_row({**row, "head_size": 1})  # (a row without head groups keeps its column under the header's)
    assert plain.index("ours") == HEADER.index("kernel")
