"""Training-step time under head parallelism (`--cp_mode ulysses`) and its hybrid with the sparse ring.

What a rank runs per layer (`distributed/heads/attention.py`): the linear layers over its piece of the
sequence (S / CP tokens), one all-to-all of q, k and v to the head split (`HeadSplit`: the busiest
rank's query heads and the key/value heads they read, replicated ones included), attention of its heads
over the whole sequence ('ulysses': one process's estimation and kernels, no collective) or over the
ring's shard with the ring across head groups ('hybrid': `step_model.ring_attention_time` and
`estimation_time` on the ring of CP / head_size ranks, with the busiest rank's heads), and one all-to-all
of the output back. Backward runs the twin all-to-alls (dout to the head split, dq, dk, dv back); with
gradient checkpointing the forward's two run again. The all-to-alls are on the critical path: nothing
computes while they run (the ring's transfers hide behind its compute, an all-to-all does not).

An all-to-all of a group of consecutive ranks: every rank sends its chunks to the group's other ranks
at once, those in its node over NVLink and the others over InfiniBand, each kind of link one after the
other, `latency + bytes / bandwidth` per kind (the cluster's links, measured as all-reduce bus bandwidth:
no all-to-all measurement is used).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from ..config import SparseAttentionConfig
from ..distributed.comm import RingTopology
from ..distributed.heads.split import HeadSplit
from ..distributed.split.blocks import head_group_plan
from .shapes import ModelShape
from .simulate import Cluster, RingSetup, Workload, simulate_ring
from .step_model import (
    Hardware,
    dense_ring_counts,
    estimation_time,
    ring_attention_time,
    ring_counts,
    sliding_ring_counts,
)

ACTIVATION_BYTES = 2  # bf16 q, k, v, out and their gradients


def all_to_all_time(nbytes: float, size: int, cluster: Cluster) -> float:
    """Seconds of an all-to-all over `size` consecutive ranks in which a rank sends `nbytes` in all,
    split evenly over the other ranks."""
    if size == 1 or nbytes == 0:
        return 0.0
    per_peer = nbytes / (size - 1)
    inside = min(size, cluster.gpus_per_node) - 1
    across = size - 1 - inside
    intra = cluster.intra.latency + inside * per_peer / cluster.intra.bandwidth if inside else 0.0
    inter = cluster.inter.latency + across * per_peer / cluster.inter.bandwidth if across else 0.0
    return max(intra, inter)


def head_parallel_setup(workload: Workload, cp_size: int, head_size: int, block_size: int, kind: str,
                        sharding: str = "striped") -> RingSetup:
    """The ring a head-parallel layout runs: over cp_size / head_size ranks (one rank, the whole sequence,
    under 'ulysses'), each shard cut into head_size pieces (`ShardPlan(pieces=...)`); kind 'dense' or
    'sparse' picks the workload's layout."""
    if cp_size % head_size:
        raise ValueError(f"head_size={head_size} does not divide cp_size={cp_size}.")
    plan = head_group_plan(sharding, cp_size, head_size, block_size, workload.seq_len)
    return RingSetup(workload.layout(kind, plan), plan, RingTopology(1, plan.cp_size), kind == "sparse")


def exchange_bytes(split: HeadSplit, tokens: int, head_dim: int) -> dict[str, int]:
    """Bytes the busiest rank sends per layer in each all-to-all of a head group whose ranks hold `tokens`
    tokens each: 'to_heads' (q, k, v forward; the output's gradient backward has the same shape as
    'to_sequence'), 'to_sequence' (the output), and their backward twins."""
    def heads(r: int) -> tuple[int, int]:
        (q_lo, q_hi), (kv_lo, kv_hi) = split.q_range(r), split.kv_range(r)
        return q_hi - q_lo, kv_hi - kv_lo

    unit = tokens * head_dim * ACTIVATION_BYTES
    ranks = range(split.size)
    out = {"to_heads": 0, "to_sequence": 0, "to_heads_backward": 0, "to_sequence_backward": 0}
    for me in ranks:
        q_me, kv_me = heads(me)
        others = [heads(r) for r in ranks if r != me]
        mine = {"to_heads": sum(q + 2 * kv for q, kv in others), "to_sequence": q_me * len(others),
                "to_heads_backward": (q_me + 2 * kv_me) * len(others),
                "to_sequence_backward": sum(q for q, _ in others)}
        out = {k: max(out[k], unit * v) for k, v in mine.items()}
    return out


def predict_head_parallel_step(setup: RingSetup, model: ModelShape, hw: Hardware, cluster: Cluster, *,
                               head_size: int, recompute: bool = True,
                               estimation: SparseAttentionConfig | None = None, dense_layers: int = 0,
                               dense: RingSetup | None = None, sliding: RingSetup | None = None) -> dict:
    """Predicted seconds of one training step of `model` over one sequence under head parallelism.

    Args:
        setup: `head_parallel_setup`'s ring (one rank for 'ulysses'); model, hw, cluster: as in
            `step_model.predict_step`.
        head_size: ranks per head group (the CP degree for 'ulysses'); refused, naming the numbers, when
            the model's heads cannot serve it (`HeadSplit`).
        recompute: gradient checkpointing (each layer's forward, all-to-alls included, runs twice).
        estimation: the pattern settings whose estimation is charged (default `SparseAttentionConfig()`).
        dense_layers, dense: as in `predict_step`: the first layers a sparse setup keeps dense run the same
            all-to-alls and the ring (if any) over `dense`, the same split's causal layout, without estimation.
        sliding: as in `predict_step`: the model's sliding-window layers run the same all-to-alls and the ring (if
            any) over `sliding`, the same split's layout of the window, without estimation.

    Returns:
        A dict like `predict_step`'s (step_s, tokens_per_s, per-layer seconds, comm_share, kept) plus the
        all-to-all seconds and bytes per layer (all_to_all_fwd_s, all_to_all_bwd_s, all_to_all_bytes_per_rank:
        the busiest rank's forward sends), the heads of the busiest rank, and kv_replication_bytes: the
        whole group's extra K/V copies (bf16) for the sequence as its split pads it, per layer.
    """
    if setup.plan.block_size != hw.block_size:
        raise ValueError(f"the calibration is for blocks of {hw.block_size} tokens, the plan uses "
                         f"{setup.plan.block_size}: simulate with block_size={hw.block_size}.")
    split = HeadSplit(model.heads, model.kv_heads, head_size)
    kv_local = split.busiest_kv  # the busiest rank's heads
    local = replace(model, heads=split.busiest, kv_heads=kv_local)
    ring_cluster = replace(cluster, gpus_per_node=max(1, cluster.gpus_per_node // head_size))
    work, traffic = ring_counts(setup, local)
    cfg = SparseAttentionConfig() if estimation is None else estimation
    tokens = setup.plan.max_local_blocks * setup.plan.block_size // head_size  # a rank's piece
    per_layer_flops, head_flops = model.linear_flops(recompute=recompute)
    linear = per_layer_flops * tokens / hw.linear_flops_per_s
    lm_head = head_flops * tokens / hw.linear_flops_per_s
    passes = 2 if recompute else 1
    sent = exchange_bytes(split, tokens, model.head_dim)

    dense_layers, dense_counts = dense_ring_counts(setup, dense, dense_layers, local)  # (local: model's layers)
    sliding_layers, sliding_counts = sliding_ring_counts(sliding, local)

    def step(c: Cluster, ring_c: Cluster) -> tuple[float, dict, float, float, float, float]:
        att = ring_attention_time(setup, local, hw, ring_c, work, traffic)
        est = estimation_time(setup, local, hw, ring_c, cfg)
        fwd = all_to_all_time(sent["to_heads"], head_size, c) + all_to_all_time(sent["to_sequence"], head_size, c)
        bwd = (all_to_all_time(sent["to_sequence_backward"], head_size, c)
               + all_to_all_time(sent["to_heads_backward"], head_size, c))
        sparse_attention = passes * (est + att["fwd"].time + fwd) + att["bwd"].time + bwd
        dense_attention, sliding_attention = 0.0, 0.0
        if dense_layers:
            d = ring_attention_time(dense, local, hw, ring_c, *dense_counts)
            dense_attention = passes * (d["fwd"].time + fwd) + d["bwd"].time + bwd
        if sliding_layers:
            w = ring_attention_time(sliding, local, hw, ring_c, *sliding_counts)
            sliding_attention = passes * (w["fwd"].time + fwd) + w["bwd"].time + bwd
        sparse_layers = model.layers - dense_layers - sliding_layers
        attention = dense_layers * dense_attention + sparse_layers * sparse_attention
        total = model.layers * linear + attention + sliding_layers * sliding_attention + lm_head
        return total, att, est, fwd, bwd, dense_layers * dense_attention / attention if attention else 0.0

    total, att, est, a2a_fwd, a2a_bwd, dense_share = step(cluster, ring_cluster)
    ideal = step(cluster.without_network(), ring_cluster.without_network())[0]
    transfer_only = simulate_ring(torch.zeros_like(att["fwd_s"]), traffic, setup.topology, ring_cluster,
                                  backward=False).time
    return {
        "step_s": total, "tokens_per_s": setup.plan.seq_len / total,
        "layer_s": (total - lm_head) / model.layers, "linear_s": linear, "estimation_s": est,
        "attention_fwd_s": att["fwd"].time, "attention_bwd_s": att["bwd"].time, "lm_head_s": lm_head,
        "all_to_all_fwd_s": a2a_fwd, "all_to_all_bwd_s": a2a_bwd,
        "all_to_all_bytes_per_rank": float(sent["to_heads"] + sent["to_sequence"]),
        "ring_forward_bytes_per_rank": float(traffic.total(False).double().mean()),
        "comm_share": 1.0 - ideal / total, "heads_per_rank": split.busiest, "kv_heads_per_rank": kv_local,
        "comm_bound": transfer_only > float(att["fwd"].compute.max()),
        "dense_layers": dense_layers, "dense_layers_attention_share": dense_share, "sliding_layers": sliding_layers,
        "kv_replication_bytes": split.replicated_kv_bytes(setup.plan.padded_len, model.head_dim, ACTIVATION_BYTES),
        "kept": setup.kept_fraction(),
    }
