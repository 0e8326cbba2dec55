"""Sparse context parallelism, by feature.

At the root, what every feature reads:
* `cp_config.py`: `ContextParallelConfig` (the --cp_* flags) and `PlannerCosts` (the document planner's weights);
* `mesh.py`: `ParallelDims`, the one object owning the parallel layout (sizes, groups, ring topology and head
  groups, from accelerate or the flags), `quiesce_process_groups`;
* `shard.py`: `CPShard`, one rank's view of a batch split over its CP group (the backend's `cp_shard`);
* `comm.py`: `RingTopology` (flat and hierarchical rings), batched point-to-point transfers, collectives that
  name an unresponsive rank;
* `kept_fraction.py`: the kept fraction of a CP call as one process reports it;
* `loss.py`: token-count-correct loss over batch x CP.

The features:
* `split/`: how a sequence splits over a CP group: `blocks.py` (`BlockSplit`, `ShardPlan`: striped, zigzag,
  contiguous; `NestedSplit`: pieces for head groups), `documents.py` (`DocumentPlan`, the document-aware split
  of a packed row), `inputs.py` (`prepare_context_parallel_inputs`: shard a batch, attach its `CPShard`);
* `ring/`: the balanced sparse ring: `estimation.py` (the global layout from every rank's shard), `plan.py`
  (`RingPlan`: what each rank computes, sends and receives), `attention.py` (`ring_sparse_attention`,
  `context_parallel_attention`);
* `heads/`: head parallelism (Ulysses) and its hybrid with the ring: `split.py` (`HeadSplit`: which heads a
  rank computes), `all_to_all.py` (`HeadExchange`), `attention.py` (`head_parallel_attention`).

What a training step does not run lives elsewhere: the cluster simulator in `hf_sparse_cp.simulator`,
moving sharded state between layouts in `hf_sparse_cp.resharding`.
"""

from .comm import RingTopology
from .cp_config import CP_MODES, ContextParallelConfig
from .heads.attention import HeadParallelAttention, head_parallel_attention
from .heads.split import HeadSplit
from .loss import global_mean_loss, global_num_items, rank_loss
from .mesh import ParallelDims, check_launched, check_sizes, quiesce_process_groups
from .ring.attention import RingStats, context_parallel_attention, ring_sparse_attention
from .ring.estimation import estimate_layout_cp
from .shard import CP_SHARD_KWARG, CPShard
from .split.blocks import SHARDINGS, NestedSplit, ShardPlan, shard_inputs, shift_labels
from .split.inputs import check_same_batch, prepare_context_parallel_inputs

__all__ = [
    "CP_MODES",
    "CP_SHARD_KWARG",
    "SHARDINGS",
    "CPShard",
    "ContextParallelConfig",
    "HeadParallelAttention",
    "HeadSplit",
    "NestedSplit",
    "ParallelDims",
    "RingStats",
    "RingTopology",
    "ShardPlan",
    "check_launched",
    "check_same_batch",
    "check_sizes",
    "context_parallel_attention",
    "estimate_layout_cp",
    "global_mean_loss",
    "global_num_items",
    "head_parallel_attention",
    "prepare_context_parallel_inputs",
    "quiesce_process_groups",
    "rank_loss",
    "ring_sparse_attention",
    "shard_inputs",
    "shift_labels",
]
