"""Vertical-slash pattern estimation of a sequence split over a context-parallel group.

The pattern of a long document comes from its last `last_q` queries scoring all of its keys, or,
with `estimation="causal_chunks"`, that of each chunk from the last queries before it scoring the
keys before it (`hf_sparse_cp.attention.estimate`: one estimation segment per document or chunk).
Under CP those queries and keys are spread over the ranks, so:

1. every rank contributes the scoring queries it holds to one all-reduce (each row is held by
   exactly one rank), after which every rank has all of them (all segments' rows in one buffer);
2. each rank scores its own keys and the softmax normaliser of every query row is combined across
   ranks (all-reduce of the row max, then of the rescaled sums of exp);
3. each rank adds the normalised mass of its keys into vertical / slash tensors [H, S] of the whole
   sequence, which one all-reduce sums;
4. every rank selects and builds the layout from the same reduced scores, so all ranks derive the
   same layout, equal to `estimate_layout` on the whole sequence (up to the summation order of the
   scores, i.e. identical unless two candidates tie to the last bit).

Four collectives per call, whatever the number of documents or chunks; the scores' all-reduce moves
2 x B x H x V x S values (V: 1, or the most chunks a document has after the first).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..attention.build import dense_layout
from ..attention.estimate import (
    accumulate_vertical_slash,
    estimation_segments,
    last_query_rows,
    layout_from_scores,
    long_documents,
    row_softmax_stats,
)
from ..attention.layout import SparseLayout
from ..attention.precision import compute_dtype
from ..config import SparseAttentionConfig
from .context import CPShard


def _all_reduce(x: torch.Tensor, op, shard: CPShard) -> None:
    if shard.parallel.cp_size > 1:
        dist.all_reduce(x, op=op, group=shard.parallel.cp_group)


def estimate_layout_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    cfg: SparseAttentionConfig,
    shard: CPShard,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> SparseLayout:
    """The global layout of a sharded sequence. Collective: every rank of the CP group calls it with
    its own shard.

    Args:
        q: [B, Hq, S_local, D]; k: [B, Hkv, S_local, D]: this rank's shard, after RoPE, in shard order.
        cfg: the layer's pattern settings; shard: this rank's `CPShard`.
        scale, sliding_window: as in `estimate_layout`.

    Returns:
        The layout over the padded sequence [B, Hq, plan.num_blocks, ...], the same on every rank and
        equal to `estimate_layout` on the whole sequence (up to the summation order of the scores).
    """
    plan, meta = shard.plan, shard.meta
    if cfg.block_size != plan.block_size:
        raise ValueError(
            f"this layer's block_size ({cfg.block_size}) differs from the block size the sequence was sharded with "
            f"({plan.block_size}); under context parallelism every layer must use the same block_size."
        )
    if cfg.pattern == "dense" or sliding_window is not None:
        return dense_layout(meta, cfg.block_size, sliding_window)
    docs = long_documents(meta, cfg)
    if not any(docs):
        return dense_layout(meta, cfg.block_size)
    b, hq, s_local, d = q.shape
    dev = q.device
    dtype = compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    tok = plan.token_index(shard.rank).to(dev)
    local_of = torch.full((plan.padded_len,), -1, dtype=torch.long, device=dev)
    local_of[tok] = torch.arange(s_local, device=dev)

    # Scoring rows of every estimation segment: (batch row, segment, global positions, slice in the packed buffer).
    segments = estimation_segments(docs, cfg)
    if not any(segments):
        return dense_layout(meta, cfg.block_size)
    entries, total = [], 0
    for row, row_segs in enumerate(segments):
        for sg in row_segs:
            rows = last_query_rows(sg.start, sg.scored_end, cfg.last_q, dev)
            entries.append((row, sg, rows, slice(total, total + rows.numel())))
            total += rows.numel()

    q_rows = torch.zeros(hq, total, d, dtype=dtype, device=dev)
    for row, _, rows, span in entries:
        lp = local_of[rows]
        mine = (lp >= 0).nonzero().flatten()
        q_rows[:, span.start + mine] = q[row][:, lp[mine]].to(dtype)
    _all_reduce(q_rows, dist.ReduceOp.SUM, shard)

    keys = []
    row_max = torch.full((hq, total), float("-inf"), dtype=dtype, device=dev)
    row_sum = torch.zeros(hq, total, dtype=dtype, device=dev)
    for row, sg, rows, span in entries:
        lk = ((tok >= sg.start) & (tok < sg.scored_end)).nonzero().flatten()
        keys.append(lk)
        if lk.numel():
            visible = tok[lk].unsqueeze(0) <= rows.unsqueeze(1)
            row_max[:, span], row_sum[:, span] = row_softmax_stats(
                q_rows[:, span].contiguous(), k[row][:, lk].to(dtype), visible, scale
            )
    top = row_max.clone()
    _all_reduce(top, dist.ReduceOp.MAX, shard)
    row_sum = torch.where(torch.isfinite(row_max), row_sum * torch.exp(row_max - top), torch.zeros_like(row_sum))
    _all_reduce(row_sum, dist.ReduceOp.SUM, shard)

    n_sets = 1 + max(sg.set for _, sg, _, _ in entries)
    scores = torch.zeros(b, 2, hq, n_sets, plan.padded_len, dtype=dtype, device=dev)
    for (row, sg, rows, span), lk in zip(entries, keys):
        if lk.numel():
            accumulate_vertical_slash(
                q_rows[:, span].contiguous(), k[row][:, lk].to(dtype), rows, tok[lk], scale,
                scores[row, 0, :, sg.set], scores[row, 1, :, sg.set], normalizer=(top[:, span], row_sum[:, span]),
                slash_base=sg.start,
            )
    _all_reduce(scores, dist.ReduceOp.SUM, shard)
    return layout_from_scores(meta, cfg, docs,
                              [(scores[r, 0], scores[r, 1]) if segments[r] else None for r in range(b)])
