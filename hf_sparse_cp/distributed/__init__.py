"""Sparse context parallelism: sharding, balanced sparse ring attention, hierarchical ring, CP estimation.

Entry points:
* `ContextParallelConfig`, `ParallelLayout`: sizes, groups and ring topology (from accelerate or `--cp_size`);
* `prepare_context_parallel_inputs`: shard one batch (inputs, shifted labels, global position_ids) and
  attach the `CPShard` that the attention backend receives as `cp_shard`;
* `context_parallel_attention`: what the attention backend calls under CP (estimation + ring);
* `ring_sparse_attention`, `estimate_layout_cp`: the two halves, over a given layout / shard;
* `global_num_items`, `rank_loss`, `global_mean_loss`: token-count-correct loss across CP x DP.
"""

from ..merge import merge_attention
from .comm import RingTopology
from .context import (
    CP_SHARD_KWARG,
    CPShard,
    check_model_supports_context_parallel,
    check_same_batch,
    context_parallel_attention,
    prepare_context_parallel_inputs,
)
from .estimation import estimate_layout_cp
from .loss import global_mean_loss, global_num_items, rank_loss
from .parallel import ContextParallelConfig, ParallelLayout, check_sizes, quiesce_process_groups
from .ring_attention import RingStats, ring_sparse_attention
from .sharding import SHARDINGS, ShardPlan, shard_inputs, shift_labels

__all__ = [
    "CP_SHARD_KWARG",
    "SHARDINGS",
    "CPShard",
    "ContextParallelConfig",
    "ParallelLayout",
    "RingStats",
    "RingTopology",
    "ShardPlan",
    "check_model_supports_context_parallel",
    "check_same_batch",
    "check_sizes",
    "context_parallel_attention",
    "quiesce_process_groups",
    "estimate_layout_cp",
    "global_mean_loss",
    "global_num_items",
    "merge_attention",
    "prepare_context_parallel_inputs",
    "rank_loss",
    "ring_sparse_attention",
    "shard_inputs",
    "shift_labels",
]
