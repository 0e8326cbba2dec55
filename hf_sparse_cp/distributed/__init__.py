"""Sparse context parallelism, by feature.

At the root, what every feature reads:
* `cp_config.py`: `ContextParallelConfig` (the --cp_* flags) and `PlannerCosts` (the document planner's weights);
* `mesh.py`: `ParallelDims`, the one object owning the parallel layout (sizes, groups, ring topology and head
  groups, from accelerate or the flags), `quiesce_process_groups` and `settle_gloo_workers` (before a
  teardown);
* `shard.py`: `CPShard`, one rank's view of a batch split over its CP group (the backend's `cp_shard`);
* `inputs.py`: `prepare_context_parallel_inputs`: a batch sharded as the layout's mode splits it, with its `CPShard`;
* `comm.py`: `RingTopology` (flat and hierarchical rings), batched point-to-point transfers, collectives that
  name an unresponsive rank;
* `kept_fraction.py`: the kept fraction of a CP call as one process reports it (a ring's and a head group's);
* `loss.py`: token-count-correct loss over batch x CP.

The CP modes, registered by name (`--cp_mode`), in `modes/`: `ring.py`, `ulysses.py`, `hybrid.py` behind one
interface (`base.CPMode`: its checks, head-group size, split, attention, description) and one entry point,
`context_parallel_attention`, with one result type (`CPAttention`).

The features the modes are made of:
* `split/`: how a sequence splits over a CP group: `blocks.py` (`BlockSplit`, `ShardPlan`: striped, zigzag,
  contiguous; `NestedSplit`: pieces for head groups), `documents.py` (the document-aware split of a packed row:
  its planner; its cost model in `document_costs.py`, its placements in `document_placement.py`, its result,
  `DocumentPlan`, in `document_plan.py`, the runs it places in `document_runs.py`);
* `ring/`: the balanced sparse ring: `estimation.py` (the global layout from every rank's shard), `plan.py`
  (`RingPlan`: what each rank computes, sends and receives), `attention.py` (`ring_sparse_attention`);
* `heads/`: head parallelism (Ulysses) and its hybrid with the ring: `split.py` (`HeadSplit`: which heads a
  rank computes), `all_to_all.py` (`HeadExchange`), `attention.py` (`head_parallel_attention`: the all-to-alls
  around a mode's attention on the head split).

What a training step does not run lives elsewhere: the cluster simulator in `hf_sparse_cp.simulator`,
moving sharded state between layouts in `hf_sparse_cp.resharding`.
"""

from .comm import RingTopology
from .cp_config import CP_MODES, ContextParallelConfig
from .heads.split import HeadSplit
from .inputs import check_same_batch, prepare_context_parallel_inputs
from .loss import global_mean_loss, global_num_items, rank_loss
from .mesh import ParallelDims, check_launched, check_ring, check_sizes, quiesce_process_groups, settle_gloo_workers
from .modes import CPAttention, CPMode, context_parallel_attention, cp_mode_named, cp_modes, register_cp_mode
from .ring.attention import RingStats, ring_sparse_attention
from .ring.estimation import estimate_layout_cp
from .shard import CP_SHARD_KWARG, CPShard
from .split.blocks import SHARDINGS, NestedSplit, ShardPlan, shard_inputs, shift_labels

__all__ = [
    "CP_MODES",
    "CP_SHARD_KWARG",
    "SHARDINGS",
    "CPAttention",
    "CPMode",
    "CPShard",
    "ContextParallelConfig",
    "HeadSplit",
    "NestedSplit",
    "ParallelDims",
    "RingStats",
    "RingTopology",
    "ShardPlan",
    "check_launched",
    "check_ring",
    "check_same_batch",
    "check_sizes",
    "context_parallel_attention",
    "cp_mode_named",
    "cp_modes",
    "estimate_layout_cp",
    "global_mean_loss",
    "global_num_items",
    "prepare_context_parallel_inputs",
    "quiesce_process_groups",
    "rank_loss",
    "register_cp_mode",
    "ring_sparse_attention",
    "settle_gloo_workers",
    "shard_inputs",
    "shift_labels",
]
