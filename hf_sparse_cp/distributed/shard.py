"""What a model forward under context parallelism carries: `CPShard`, one rank's view of a batch split over
its CP group, which the `sparse_cp` attention backend receives as the keyword `cp_shard`
(`split.inputs.prepare_context_parallel_inputs` builds it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ..attention.tokens import TokenMeta
from .mesh import ParallelDims
from .split.blocks import BlockSplit, NestedSplit

CP_SHARD_KWARG = "cp_shard"


@dataclass(frozen=True, eq=False)
class CPShard:
    """One rank's view of a batch split over its CP group.

    parallel: the parallel layout (groups, ring topology); plan: how the sequence was split
    (a `ShardPlan`, or a `DocumentPlan` that re-orders the documents of a packed row);
    meta: documents and global order of the *whole* batch [B, plan.padded_len] (padding marked),
    identical on every rank, from which any rank's shard metadata follows.
    """

    parallel: ParallelDims
    plan: BlockSplit
    meta: TokenMeta

    @property
    def rank(self) -> int:
        return self.parallel.cp_rank

    @staticmethod
    def check_no_kv_cache(query: torch.Tensor, key: torch.Tensor) -> None:
        """Raise ValueError unless queries and keys are the same part of the sequence: a KV cache is not sharded."""
        if query.shape[2] != key.shape[2]:
            raise ValueError(
                f"under context parallelism queries and keys must be this rank's same part of the sequence (got "
                f"{query.shape[2]} queries, {key.shape[2]} keys): decoding with a KV cache is not sharded; run "
                "generation without cp_shard.")

    @functools.cached_property
    def ring_shard(self) -> CPShard:
        """Under `--cp_mode hybrid`: the shard of this rank's ring (its view of the layout, the ring's split,
        the same metadata), which its head group's all-to-all assembles from the group's pieces."""
        if self.parallel.ring is None or not isinstance(self.plan, NestedSplit):
            raise ValueError("ring_shard is the ring's shard of a hybrid layout (--cp_mode hybrid), whose inputs "
                             "prepare_context_parallel_inputs splits with a NestedSplit.")
        return CPShard(self.parallel.ring, self.plan.outer, self.meta)
