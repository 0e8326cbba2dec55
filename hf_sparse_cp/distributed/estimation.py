"""Vertical-slash pattern estimation of a sequence split over a context-parallel group.

The pattern of a long document comes from its last `last_q` queries scoring all of its keys, or,
with `estimation="causal_chunks"`, that of each chunk from the last queries before it scoring the
keys before it (`hf_sparse_cp.attention.estimate`: one estimation segment per document or chunk).
Under CP those queries and keys are spread over the ranks, so:

1. every rank contributes the scoring queries it holds to one all-reduce (each row is held by
   exactly one rank), after which every rank has all of them (all segments' rows in one buffer);
2. each rank scores its own keys and the softmax normaliser of every query row is combined across
   ranks (all-reduce of the row max, then of the rescaled sums of exp);
3. each rank adds the normalised mass of its keys into vertical scores [H, S] of the whole sequence
   and slash scores [H, L] (every segment's scored offsets, packed one after another). A key's
   vertical score is then complete on the rank that holds the key; a slash sums over every rank's
   keys, so a reduce-scatter gives each rank the sums of 1/CP of the packed offsets;
4. per estimation segment and head, each rank offers the best entries it holds (as many as a head
   can keep: `vertical_topk` / `slash_topk`, or the caps in top-p mode) and the mass of all it
   holds, in one all-gather. Every entry the whole row's selection keeps is among its holder's
   best, and for top-p so is every entry ranked above it, so every rank selects from the union
   exactly what `estimate_layout` selects on the whole sequence (up to the summation order of the
   scores, i.e. identical unless two candidates tie to the last bit), and all ranks build the same
   layout.

Five collectives per call, whatever the number of documents or chunks. Per rank, a ring all-reduce
of a [2, B, H, V, S] score buffer (V: 1, or the most chunks a document has after the first) would
send it about twice; the reduce-scatter sends the packed slashes once (L: the sparse documents'
tokens, about V x S / 2 with causal chunks), and the all-gather the candidates: (CP - 1) x 2 x
(vertical + slash budget) values per segment and head.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..attention.build import dense_layout
from ..attention.estimate import (
    EstimationSegment,
    accumulate_vertical_slash,
    budget,
    candidates_per_row,
    estimation_segments,
    keep_anchors,
    last_query_rows,
    layout_from_kept,
    long_documents,
    row_softmax_stats,
    select_entries,
    warn_if_costly,
)
from ..attention.layout import SparseLayout
from ..attention.precision import compute_dtype
from ..config import SparseAttentionConfig
from .comm import all_gather_rows, reduce_scatter_rows
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

    # Verticals over the whole row; slashes packed: each segment's offsets [0, scored_end - start) one
    # after another (no room for unscored positions, and only these are summed across ranks).
    n_sets = 1 + max(sg.set for _, sg, _, _ in entries)
    vertical = torch.zeros(b, hq, n_sets, plan.padded_len, dtype=dtype, device=dev)
    bases = [0]
    for _, sg, _, _ in entries:
        bases.append(bases[-1] + sg.scored_end - sg.start)
    slash = torch.zeros(hq, bases[-1], dtype=dtype, device=dev)
    for (row, sg, rows, span), lk, base in zip(entries, keys, bases):
        if lk.numel():
            accumulate_vertical_slash(
                q_rows[:, span].contiguous(), k[row][:, lk].to(dtype), rows, tok[lk], scale,
                vertical[row, :, sg.set], slash, normalizer=(top[:, span], row_sum[:, span]), slash_base=base,
            )
    warn_if_costly(n_sets, (vertical.numel() + slash.numel()) * vertical.element_size(), cfg)
    keep_v, keep_s = _kept_across_ranks(vertical, slash, [(row, sg) for row, sg, _, _ in entries], bases, cfg, shard,
                                        tok)
    return layout_from_kept(meta, cfg, segments, keep_v, keep_s)


def _tokens_before(plan, x: torch.Tensor) -> torch.Tensor:
    """[n, cp_size]: how many of each rank's tokens lie before the global positions x [n] (host)."""
    bs, nb, w = plan.block_size, plan.num_blocks, plan.cp_size
    owner = torch.nn.functional.one_hot(plan.block_owner, w)
    whole = torch.nn.functional.pad(owner.cumsum(0), (0, 0, 1, 0))  # [nb + 1, w]: blocks before each block
    blk = x // bs
    partial = owner[blk.clamp(max=nb - 1)] * ((x % bs) * (blk < nb)).unsqueeze(1)
    return whole[blk] * bs + partial


def _candidates(vals: torch.Tensor, pos: torch.Tensor, m: int, pad_pos: int) -> torch.Tensor:
    """[H, 2m + 1]: the best m of vals [H, n] (fewer padded with score 0, never kept), their global
    positions pos [n] (padding: pad_pos) as raw bits of the score dtype, and the row's total mass."""
    h = vals.shape[0]
    top, idx = vals.topk(min(m, vals.shape[1]), dim=1)
    out_vals = torch.zeros(h, m, dtype=vals.dtype, device=vals.device)
    out_pos = torch.full((h, m), pad_pos, dtype=_BITS[vals.dtype], device=vals.device)
    out_vals[:, : top.shape[1]] = top
    out_pos[:, : top.shape[1]] = pos[idx].to(out_pos.dtype)
    # Positions travel in the score buffer as bit patterns (a copy, never arithmetic): one all-gather.
    return torch.cat([out_vals, out_pos.view(vals.dtype), vals.sum(1, keepdim=True)], 1)


_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}


def _kept_across_ranks(vertical: torch.Tensor, slash: torch.Tensor, flat: list[tuple[int, EstimationSegment]],
                       bases: list[int], cfg: SparseAttentionConfig, shard: CPShard, tok: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept columns and offsets ([B, H, V, S] bool each, anchors included, the same on every rank)
    of the segments `flat` ((batch row, segment), in the order of `bases`) from this rank's partial
    scores: vertical [B, H, V, S], complete for the keys this rank holds, and slash [H, L], segment i's
    offsets at bases[i]:bases[i + 1], which a reduce-scatter sums, each rank getting 1/cp_size of L.
    Each rank sends, per segment and head, the best entries it holds (as many as a head can keep) with
    the mass of all it holds, in one all-gather; every rank selects from the union, which holds every
    entry the whole row's selection can keep and, for top-p, the mass of every better one."""
    plan, w, rank, group = shard.plan, shard.parallel.cp_size, shard.rank, shard.parallel.cp_group
    b, h, v, s = vertical.shape
    span = -(-slash.shape[1] // w)
    padded = torch.nn.functional.pad(slash, (0, span * w - slash.shape[1]))
    if w > 1:
        mine = slash.new_empty(h, span)
        reduce_scatter_rows(mine, padded.unflatten(1, (w, span)).movedim(1, 0).flatten(0, 1), group)
    else:
        mine = padded
    lo, hi = (torch.tensor([getattr(sg, f) for _, sg in flat]) for f in ("start", "q_hi"))
    before_lo = _tokens_before(plan, lo)
    owned_v = _tokens_before(plan, hi) - before_lo  # [segments, w]
    first, last, ranks = torch.tensor(bases[:-1]), torch.tensor(bases[1:]), torch.arange(w)
    owned_s = (torch.minimum(last.unsqueeze(1), (ranks + 1) * span)
               - torch.maximum(first.unsqueeze(1), ranks * span)).clamp_min(0)
    widths = {kind: torch.minimum(owned.amax(1), torch.tensor(candidates_per_row(cfg, kind))).tolist()
              for kind, owned in (("vertical", owned_v), ("slash", owned_s))}
    first_v, n_v = before_lo[:, rank].tolist(), owned_v[:, rank].tolist()
    pieces = []
    for i, (row, sg) in enumerate(flat):
        keys = tok[first_v[i] : first_v[i] + n_v[i]]
        pieces.append(_candidates(vertical[row, :, sg.set, keys], keys, widths["vertical"][i], s))
        lo_s = max(bases[i], rank * span)
        packed = torch.arange(lo_s, max(lo_s, min(bases[i + 1], (rank + 1) * span)), device=slash.device)
        pieces.append(_candidates(mine[:, packed - rank * span], sg.start + packed - bases[i], widths["slash"][i], s))
    local = torch.cat(pieces, 1)
    gathered = local.new_empty(w, *local.shape)
    if w > 1:
        all_gather_rows(gathered.flatten(0, 1), local, group)
    else:
        gathered[0] = local
    keep = {kind: torch.zeros(b, h, v, s + 1, dtype=torch.bool, device=vertical.device) for kind in widths}
    col = 0
    for i, (row, sg) in enumerate(flat):
        for kind in ("vertical", "slash"):
            m = widths[kind][i]
            part = gathered[:, :, col : col + 2 * m + 1]
            col += 2 * m + 1
            vals = part[..., :m].movedim(0, 1).flatten(1)
            pos = part[..., m : 2 * m].contiguous().view(_BITS[vertical.dtype]).movedim(0, 1).flatten(1).long()
            kept = select_entries(vals, cfg.budget_mode, *budget(cfg, kind), total=part[..., 2 * m :].sum(0))
            keep[kind][row, :, sg.set].scatter_(1, torch.where(kept, pos, s), True)
    keep_v, keep_s = keep["vertical"][..., :s], keep["slash"][..., :s]
    for row, sg in flat:
        keep_anchors(keep_v[row, :, sg.set], keep_s[row, :, sg.set], sg.start, sg.q_hi, cfg)
    return keep_v, keep_s
