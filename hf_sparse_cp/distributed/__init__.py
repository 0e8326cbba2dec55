"""Sparse context parallelism: sharding, balanced sparse ring attention, hierarchical ring, CP estimation.

* `mesh.py`: `ContextParallelConfig`, `ParallelDims` (sizes, groups, ring topology and head groups,
  from accelerate or `--cp_size` / `--cp_mode`), `quiesce_process_groups`;
* `sharding.py`: `BlockSplit`, `ShardPlan` (how one sequence splits over a CP group: striped,
  zigzag, contiguous), `NestedSplit` (pieces for head groups) and the sharding of a batch;
* `document_sharding.py`: `DocumentPlan`, the document-aware split of a packed row (Whole-Doc / Per-Doc);
* `context.py`: `CPShard`, `prepare_context_parallel_inputs` (shard a batch, attach the shard the
  attention backend receives as `cp_shard`);
* `estimation.py`: `estimate_layout_cp`, the global layout from every rank's shard;
* `kept_fraction.py`: the kept fraction of a CP call as one process reports it;
* `ring_plan.py`: `RingPlan`, from the global layout to what each rank computes, sends and receives;
* `comm.py`: `RingTopology` (flat and hierarchical rings), batched point-to-point transfers;
* `ring_attention.py`: `ring_sparse_attention`, `context_parallel_attention`;
* `heads.py`: `HeadSplit`, which heads each rank of a head group computes (GQA, KV replication);
* `all_to_all.py`: `HeadExchange`, the differentiable all-to-alls between the sequence and head splits;
* `head_parallel.py`: `head_parallel_attention` (`--cp_mode ulysses` and `hybrid`);
* `loss.py`: token-count-correct loss over batch x CP.

What a training step does not run lives elsewhere: the cluster simulator in `hf_sparse_cp.simulator`,
moving sharded state between layouts in `hf_sparse_cp.resharding`.
"""

from .comm import RingTopology
from .context import CP_SHARD_KWARG, CPShard, check_same_batch, prepare_context_parallel_inputs
from .estimation import estimate_layout_cp
from .head_parallel import HeadParallelAttention, head_parallel_attention
from .heads import HeadSplit
from .loss import global_mean_loss, global_num_items, rank_loss
from .mesh import CP_MODES, ContextParallelConfig, ParallelDims, check_launched, check_sizes, quiesce_process_groups
from .ring_attention import RingStats, context_parallel_attention, ring_sparse_attention
from .sharding import SHARDINGS, NestedSplit, ShardPlan, shard_inputs, shift_labels

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
