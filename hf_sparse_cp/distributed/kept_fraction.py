"""The kept fraction of an attention call under context parallelism: what the logs report, from a ring's global
layout (`reported_kept_fraction`) and from the heads of a head group (`over_head_group`).

`SparseLayout.kept_fraction(meta)` counts a layout's computed blocks over the blocks a dense computation
of the same tokens visits (1.0 for a dense call). A block sharding (striped, zigzag, contiguous) keeps the
sequence's order and pads only at the end, so its global layout is the one-process layout padded: it
computes what one process computes on the same row, and counts the same.

The document planner computes something else on a packed row whose documents do not start on block
boundaries: it starts every sparse document on one, so each document's result is the one it has alone, and
the layers after the first see those hidden states. Its count is that aligned computation's own, with every
document of the row in blocks of its own (`aligned_order`): the count one process logs on the same documents
packed with `BlockAlignedFlattening` (`--align_documents`), which pads after every document to the next block
boundary, at every layer. (A padding run that packing adds, pad tokens without targets, is padding to the
planner and not counted, as padding is not (`documents.idle_documents_as_padding`); a batch without the labels to
tell has it a document of its own, counted in a block of its own.) In a batch whose rows hold different
documents, the planner's runs are the stretches that no row's document crosses (`documents.row_runs`), and every
run, not every document, is in blocks of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..attention.estimate import Estimate, KeptEntries, estimation_segments, layout_from_kept, long_documents
from ..attention.tokens import PAD_SEGMENT, TokenMeta
from ..config import SparseAttentionConfig
from .comm import all_reduce
from .split.documents import PAD

if TYPE_CHECKING:
    from .mesh import ParallelDims
    from .shard import CPShard


def aligned_order(lengths: tuple[int, ...], kinds: tuple[str, ...], block_size: int) -> tuple[torch.Tensor, int]:
    """Where each token of a row (runs of `lengths` tokens and `kinds`, in their order: a document plan's) goes when
    every run starts on a block boundary and the padding runs are dropped: (positions [sum(lengths)], -1 for
    padding; the aligned length, a multiple of `block_size`)."""
    position = torch.full((sum(lengths),), -1, dtype=torch.long)
    lo = used = 0
    for n, kind in zip(lengths, kinds):
        if kind != PAD:
            position[lo:lo + n] = torch.arange(used, used + n)
            used += -(-n // block_size) * block_size
        lo += n
    return position, used


def _to_positions(x: torch.Tensor, source: torch.Tensor, length: int, fill) -> torch.Tensor:
    """`x` [..., N] with element i moved to `source[i]` of [..., length] (`fill` elsewhere; -1 drops it)."""
    kept = (source >= 0).nonzero().flatten().to(x.device)
    out = x.new_full((*x.shape[:-1], length), fill)
    out[..., source.to(x.device)[kept]] = x[..., kept]
    return out


def reported_kept_fraction(estimate: Estimate, shard: CPShard, cfg: SparseAttentionConfig,
                           sliding_window: int | None = None) -> torch.Tensor:
    """The kept fraction logged for the call whose CP estimate is `estimate` (a 0-d float64 tensor on the
    layout's device, no host synchronization for a block sharding): one process's on the same row for a block
    sharding, the block-aligned documents' for the document planner (see the module docstring).

    Args:
        estimate: `estimation.estimate_cp`'s result for this call; shard: this rank's `CPShard`.
        cfg, sliding_window: the layer's pattern settings and window, as given to the estimate.
    """
    plan = shard.plan
    if estimate.kept is None:  # a dense call: every block a dense run computes
        return torch.ones((), dtype=torch.float64, device=estimate.layout.block_cnt.device)
    if plan.keeps_order:
        return estimate.layout.kept_fraction(shard.meta, sliding_window)
    aligned, length = aligned_order(plan.lengths, plan.kinds, cfg.block_size)
    source = torch.where(plan.source >= 0, aligned[plan.source.clamp_min(0)], -1)  # split order -> aligned order
    meta = TokenMeta.from_segments(_to_positions(shard.meta.segment, source, length, PAD_SEGMENT))
    # (each document is contiguous in every order, so its offsets, kept at its own positions, move with it)
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
