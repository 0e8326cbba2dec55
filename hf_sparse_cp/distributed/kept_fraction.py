"""The kept fraction of an attention call under context parallelism: what the logs report, from a ring's global
layout (`reported_kept_fraction`) and from the heads of a head group (`over_head_group`).

`SparseLayout.kept_fraction(meta)` counts a layout's computed blocks over the blocks a dense computation
of the same tokens visits (1.0 for a dense call). A block sharding (striped, zigzag, contiguous) keeps the
sequence's order and pads only at the end, so its global layout is the one-process layout padded: it
computes what one process computes on the same row, and counts the same.

The document planner re-orders a packed row (its runs in an order of its own, padding between them), keeping
every sparse document's offset inside a block (`document_plan.sparse_leads`), so it computes what one process computes
on the row too; its layout's blocks are not the row's, though (a block the row shares between two documents is two
blocks of the plan). Its count is taken on the row: the call's kept tokens moved back to their positions in the
row and laid out there, as one process lays them out (`layout_from_kept`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..attention.estimate import Estimate, KeptEntries, estimation_segments, layout_from_kept, long_documents
from ..attention.tokens import PAD_SEGMENT, TokenMeta
from ..config import SparseAttentionConfig
from .comm import all_reduce

if TYPE_CHECKING:
    from .mesh import ParallelDims
    from .shard import CPShard


def _to_positions(x: torch.Tensor, source: torch.Tensor, length: int, fill) -> torch.Tensor:
    """`x` [..., N] with element i moved to `source[i]` of [..., length] (`fill` elsewhere; -1 drops it)."""
    kept = (source >= 0).nonzero().flatten().to(x.device)
    out = x.new_full((*x.shape[:-1], length), fill)
    out[..., source.to(x.device)[kept]] = x[..., kept]
    return out


def reported_kept_fraction(estimate: Estimate, shard: CPShard, cfg: SparseAttentionConfig,
                           sliding_window: int | None = None) -> torch.Tensor:
    """The kept fraction logged for the call whose CP estimate is `estimate` (a 0-d float64 tensor on the
    layout's device, no host synchronization for a block sharding): one process's on the same row (see the module
    docstring).

    Args:
        estimate: `estimation.estimate_cp`'s result for this call; shard: this rank's `CPShard`.
        cfg, sliding_window: the layer's pattern settings and window, as given to the estimate.
    """
    plan = shard.plan
    if estimate.kept is None:  # a dense call: every block a dense run computes
        return torch.ones((), dtype=torch.float64, device=estimate.layout.block_cnt.device)
    if plan.keeps_order:
        return estimate.layout.kept_fraction(shard.meta, sliding_window)
    source, length = plan.source, plan.seq_len  # split order -> the row's
    meta = TokenMeta.from_segments(_to_positions(shard.meta.segment, source, length, PAD_SEGMENT))
    # (each document is contiguous in both orders, so its offsets, kept at its own positions, move with it)
    kept = KeptEntries(estimation_segments(long_documents(meta, cfg), cfg),
                       *(_to_positions(x, source, length, False) for x in (estimate.kept.keep_v, estimate.kept.keep_s)))
    return layout_from_kept(meta, cfg, *kept).kept_fraction(meta, sliding_window)


def over_head_group(kept: torch.Tensor, share: float, parallel: ParallelDims) -> torch.Tensor:
    """The kept fraction over all heads of a head group (0-d float64, the same on every rank of the group), from
    each rank's over its own heads: a mean over heads, so each rank's weighs its `share` of the query heads.
    `parallel`: the layout (its head group). Collective over the head group."""
    total = kept.detach().double() * share
    all_reduce(total, parallel.head_group, "the kept fraction's sum over the head group")
    return total
