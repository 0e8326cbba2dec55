"""`--cp_mode ring`: the sequence split over the CP group, K/V blocks travel the balanced sparse ring (`ring/`)."""

from __future__ import annotations

import torch

from ...attention.build import with_padding_query_blocks
from ...attention.sinks import with_sinks
from ...config import SparseAttentionConfig
from ..kept_fraction import reported_kept_fraction
from ..ring.attention import ring_sparse_attention
from ..ring.estimation import estimate_cp
from ..split.blocks import ShardPlan
from ..split.document_plan import check_planned_pattern
from ..split.documents import plan_row
from .base import CPAttention, CPMode


class RingMode(CPMode):
    name = "ring"
    help = "the sequence split, K/V blocks travel the sparse ring"

    def head_size(self, config, cp_size: int) -> int:
        return 1

    def check_model(self, model_config, head_size: int) -> None:
        check_one_block_size(model_config, self.name)

    def split(self, parallel, sharding, block_size, meta, *, sparse_config, planner_costs):
        if sharding == "document":
            return plan_row(meta.to("cpu"), sparse_config, parallel.cp_size, planner_costs, parallel.topology)
        return ShardPlan(sharding, parallel.cp_size, block_size, meta.index.shape[1])

    def attention(self, query, key, value, shard, cfg, *, scale, sliding_window, sinks, stats) -> CPAttention:
        """The layer's global layout estimated from every rank's shard (`estimate_cp`), then the ring; the sinks
        join each query's merged result."""
        check_planned_pattern(shard.plan, cfg)
        with torch.no_grad():
            estimate = estimate_cp(query, key, cfg, shard, scale=scale, sliding_window=sliding_window)
            kept = reported_kept_fraction(estimate, shard, cfg, sliding_window)
        layout, padding, q_meta = estimate.layout, shard.padding_queries(), None
        if padding is not None:  # (padding queries a head reads: the keys of their row's last block of tokens)
            q_meta, anchors = padding
            layout = with_padding_query_blocks(layout, shard.meta, q_meta, anchors)
        out, lse = ring_sparse_attention(query, key, value, layout, shard, scale=scale,
                                         sliding_window=sliding_window, stats=stats, check_layout=False,
                                         implementation=cfg.attention_engine, q_meta=q_meta)
        return CPAttention(with_sinks(out, lse, sinks), lse, layout, kept)

    def describe(self, parallel) -> str:
        return f"{parallel.sharding} sharding, {ring_shape(parallel)}"


def check_one_block_size(model_config, mode: str) -> None:
    """Raise ValueError, naming the fix, when the layers of the pattern `model_config` stores differ in block_size:
    the ring's shards are whole blocks of the sequence's split, one block size for every layer (such layers failed
    at their first forward, on every rank)."""
    sparse_config = SparseAttentionConfig.stored_on(model_config)
    if sparse_config is None:
        return
    sizes = sorted({config.block_size for config in sparse_config.layer_configs()} - {sparse_config.block_size})
    if sizes:
        raise ValueError(
            f"layer_overrides (--sparse_layer_overrides, or the --sparse_config file's) set block_size {sizes[0]} on "
            f"some layers, and under --cp_mode {mode} the sequence is split in blocks of the pattern's block_size "
            f"({sparse_config.block_size}), which every layer must use. Drop block_size from layer_overrides "
            "(--sparse_block_size sets it for every layer), or split the heads instead (--cp_mode ulysses), whose "
            "layers may differ.")


def ring_shape(parallel) -> str:
    """The ring of `parallel` in words: flat, or hierarchical with its nodes."""
    if not parallel.hierarchical:
        return "flat ring"
    t = parallel.topology
    return f"hierarchical ring ({t.num_nodes} nodes x {t.node_size} ranks, the outer ring hidden behind the inner one)"


RING = RingMode()
