"""The kept fraction of an attention call under context parallelism, as one process reports it on the
same batch.

`SparseLayout.kept_fraction(meta)` counts a layout's computed blocks over the blocks a dense computation
of the same tokens visits (1.0 for a dense call). A block sharding (striped, zigzag, contiguous) keeps the
sequence's order and pads only at the end, so its global layout is the one-process layout padded, and
counts the same. The document planner re-orders a packed row and starts documents on block boundaries:
the same kept columns and diagonals then fall into other blocks, so the split's layout counts other
blocks than one process does. For such a split the kept entries are put back in the original order and
the one-process layout is built from them.
"""

from __future__ import annotations

import torch

from ..attention.estimate import Estimate, KeptEntries, estimation_segments, layout_from_kept, long_documents
from ..attention.tokens import PAD_SEGMENT, TokenMeta
from ..config import SparseAttentionConfig
from .shard import CPShard
from .split.blocks import BlockSplit


def to_original_order(plan: BlockSplit, x: torch.Tensor, fill) -> torch.Tensor:
    """`x` [..., plan.padded_len] in the split's global order, as [..., plan.seq_len] in the original
    order (the split's padding dropped; `fill` where the original has no token of the split)."""
    real = (plan.source >= 0).nonzero().flatten()
    out = x.new_full((*x.shape[:-1], plan.seq_len), fill)
    out[..., plan.source[real].to(x.device)] = x[..., real.to(x.device)]
    return out


def one_process_kept_fraction(estimate: Estimate, shard: CPShard, cfg: SparseAttentionConfig,
                              sliding_window: int | None = None) -> torch.Tensor:
    """The kept fraction one process logs for the call whose CP estimate is `estimate` (a 0-d float64
    tensor on the layout's device, no host synchronization for a block sharding).

    Args:
        estimate: `estimation.estimate_cp`'s result for this call; shard: this rank's `CPShard`.
        cfg, sliding_window: the layer's pattern settings and window, as given to the estimate.
    """
    plan = shard.plan
    if estimate.kept is None:  # a dense call: every block a dense run computes
        return torch.ones((), dtype=torch.float64, device=estimate.layout.block_cnt.device)
    if plan.keeps_order:
        return estimate.layout.kept_fraction(shard.meta, sliding_window)
    meta = TokenMeta.from_segments(to_original_order(plan, shard.meta.segment, PAD_SEGMENT))
    # (each document is contiguous in both orders, so its offsets, kept at its own positions, map with it)
    kept = KeptEntries(estimation_segments(long_documents(meta, cfg), cfg),
                       *(to_original_order(plan, x, False) for x in (estimate.kept.keep_v, estimate.kept.keep_s)))
    return layout_from_kept(meta, cfg, *kept).kept_fraction(meta, sliding_window)
