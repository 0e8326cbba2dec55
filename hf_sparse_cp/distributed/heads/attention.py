"""Head-parallel sparse attention (`--cp_mode ulysses`) and its hybrid with the sparse ring (`hybrid`).

Every rank of a head group holds a contiguous piece of a sequence for all heads (`sharding.NestedSplit`).
One all-to-all (`all_to_all.HeadExchange`) gives each rank every piece of its share of the heads
(`heads.HeadSplit`): under 'ulysses' the whole sequence, on which the layer runs exactly as in one process
(`attention.sequence.sequence_attention`: the pattern estimated from the whole sequence with no exchange
of candidates, the engines and kernels as without CP); under 'hybrid' the shard of the ring that runs
across the head groups (`ring_attention.context_parallel_attention` on `CPShard.ring_shard`). A second
all-to-all returns the output to the sequence split. Backward mirrors both all-to-alls.

The kept fraction of the call is what one process logs: each rank's over its heads, weighted by its
share of the heads and summed over the head group (one all-reduce of a scalar).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from ...attention.layout import check_tensors
from ...attention.precision import autocast_inputs
from ...attention.sequence import sequence_attention
from ...attention.tokens import TokenMeta
from ...config import SparseAttentionConfig
from ..comm import all_reduce
from ..ring.attention import RingStats, context_parallel_attention
from ..shard import CPShard
from .all_to_all import HeadExchange
from .split import HeadSplit


class HeadParallelAttention(NamedTuple):
    """`head_parallel_attention`'s result."""

    out: torch.Tensor  # [B, Hq, S_local, D]
    kept_fraction: torch.Tensor  # 0-d float64: what one process reports for the same call


def head_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shard: CPShard,
    cfg: SparseAttentionConfig,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    stats: RingStats | None = None,
) -> HeadParallelAttention:
    """Sparse attention of a sequence split over a head-parallel layout. Collective over the CP group.

    Args:
        query: [B, Hq, S_local, D]; key, value: [B, Hkv, S_local, D], after RoPE: this rank's piece
            (`prepare_context_parallel_inputs` under --cp_mode ulysses or hybrid).
        shard: this rank's `CPShard`; cfg: the layer's pattern config (and its `attention_engine`).
        scale: softmax scale (default 1 / sqrt(D)); sliding_window: the layer's window, or None.
        stats: if given, accumulates the bytes this rank sends (all-to-alls and, under 'hybrid', the
            ring's transfers) and the ring's steps.
        Under autocast, q, k, v are cast to the autocast dtype and attention runs with autocast off.

    Returns:
        `HeadParallelAttention`: out [B, Hq, S_local, D] in q's dtype, equal to single-process attention
        over the whole sequence sliced to this rank's tokens (zeros for padding), differentiable in q, k,
        v; and the kept fraction one process reports for the call.
    """
    parallel, plan = shard.parallel, shard.plan
    if parallel.head_size == 1:
        raise ValueError(f"{parallel} has no head parallelism: call context_parallel_attention.")
    shard.check_no_kv_cache(query, key)
    query, key, value = autocast_inputs(query, key, value)
    check_tensors(query, key, value)
    split = parallel.head_split(query.shape[1], key.shape[1])
    first = parallel.cp_rank - parallel.head_rank  # the head group's first CP position
    lengths = [plan.local_len_of(first + i) for i in range(parallel.head_size)]
    exchange = HeadExchange(split, lengths, parallel.head_rank, parallel.head_group, stats)
    with torch.autocast(query.device.type, enabled=False):
        q, k, v = exchange.to_heads(query, key, value)
        if parallel.ring is None:  # the whole sequence, padded at its end: one process's call on its tokens
            n = plan.seq_len
            meta = TokenMeta(shard.meta.index[:, :n], shard.meta.segment[:, :n])
            out, kept = sequence_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], meta, cfg, scale=scale,
                                           sliding_window=sliding_window)
            out = F.pad(out.to(query.dtype), (0, 0, 0, plan.padded_len - n))
        else:
            result = context_parallel_attention(q, k, v, shard.ring_shard, cfg, scale=scale,
                                                sliding_window=sliding_window, stats=stats)
            out, kept = result.out, result.kept_fraction
        out = exchange.to_sequence(out)
    return HeadParallelAttention(out, _all_heads_kept_fraction(kept, split, parallel))


def _all_heads_kept_fraction(kept: torch.Tensor, split: HeadSplit, parallel) -> torch.Tensor:
    """The kept fraction over all heads from each rank's over its own (a mean over heads, so weighted by
    each rank's share of them)."""
    lo, hi = split.q_range(parallel.head_rank)
    total = kept.detach().double() * ((hi - lo) / split.q_heads)
    all_reduce(total, parallel.head_group, "the kept fraction's sum over the head group")
    return total
