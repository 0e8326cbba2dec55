"""Head-parallel attention: from a sequence split to a head split, attention there, and back.

Every rank of a head group holds a contiguous piece of a sequence for all heads (`split.blocks.NestedSplit`).
One all-to-all (`all_to_all.HeadExchange`) gives each rank every piece of its share of the heads
(`split.HeadSplit`); the mode's attention runs there (`--cp_mode ulysses`: the whole sequence, as one process
runs it; `hybrid`: the shard of the ring that runs across the head groups), and a second all-to-all returns the
output to the sequence split. Backward mirrors both all-to-alls. The kept fraction of the call is what one process
logs (`kept_fraction.over_head_group`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from ...attention.layout import check_tensors
from ...attention.precision import autocast_inputs
from ..kept_fraction import over_head_group
from ..shard import CPShard
from .all_to_all import HeadExchange
from .split import HeadSplit

# The attention of a rank's heads on the head split: (q, k, v, the sink logits of those heads or None) -> (out, kept
# fraction over those heads).
HeadAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None],
                         tuple[torch.Tensor, torch.Tensor]]


def head_parallel_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shard: CPShard,
                            attend: HeadAttention, *, sinks: torch.Tensor | None = None, stats=None
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of a sequence split over a head-parallel layout. Collective over the head group.

    Args:
        query: [B, Hq, S_local, D]; key, value: [B, Hkv, S_local, D], after RoPE: this rank's piece
            (`prepare_context_parallel_inputs` under a mode with head groups).
        shard: this rank's `CPShard`.
        attend: the mode's attention on the head split (q, k, v of this rank's heads over every piece of its head
            group, in the split's global order, and the sink logits of its heads) -> (out in the same layout, kept
            fraction over these heads).
        sinks: the layer's learned sink logits [Hq], or None.
        stats: if given, a `RingStats` that accumulates the bytes this rank sends in the all-to-alls.
        Under autocast, q, k, v are cast to the autocast dtype and attention runs with autocast off.

    Returns:
        (out [B, Hq, S_local, D] in q's dtype, differentiable in q, k, v; the kept fraction one process reports
        for the call).
    """
    parallel, plan = shard.parallel, shard.plan
    query, key, value = autocast_inputs(query, key, value)
    check_tensors(query, key, value)
    split = HeadSplit(query.shape[1], key.shape[1], parallel.head_size)
    first = parallel.cp_rank - parallel.head_rank  # the head group's first CP position
    lengths = [plan.local_len_of(first + i) for i in range(parallel.head_size)]
    exchange = HeadExchange(split, lengths, parallel.head_rank, parallel.head_group, stats)
    lo, hi = split.q_range(parallel.head_rank)
    with torch.autocast(query.device.type, enabled=False):
        out, kept = attend(*exchange.to_heads(query, key, value), None if sinks is None else sinks[lo:hi])
        out = exchange.to_sequence(out.to(query.dtype))
    return out, over_head_group(kept, (hi - lo) / split.q_heads, parallel)
