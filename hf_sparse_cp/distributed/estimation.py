"""Vertical-slash pattern estimation of a sequence split over a context-parallel group.

The pattern of a long document comes from its last `last_q` queries scoring all of its keys, or,
with `estimation="causal_chunks"`, that of each chunk from the last queries before it scoring the
keys before it (`hf_sparse_cp.attention.estimate`: one estimation segment per document or chunk).
Under CP those queries and keys are spread over the ranks, so:

1. every rank contributes the scoring queries it holds to one all-reduce (each row is held by
   exactly one rank), after which every rank has all of them (all segments' rows in one buffer);
2. each rank scores its own keys and the softmax normaliser of every query row is combined across
   ranks (all-reduce of the row max, then of the rescaled sums of exp);
3. each rank adds the normalised mass of its keys into vertical scores of those keys and slash
   scores [H, L] (every segment's scored offsets, packed one after another; each segment's keys of
   this rank too). A key's vertical score is then complete on the rank that holds the key; a slash
   sums over every rank's keys, so a reduce-scatter gives each rank the sums of 1/CP of the offsets;
4. per estimation segment and head, each rank offers the best entries it holds (as many as a head
   can keep: `vertical_topk` / `slash_topk`, or the caps in top-p mode) and the mass of all it
   holds, in one all-gather. Every entry the whole row's selection keeps is among its holder's
   best, and for top-p so is every entry ranked above it, so every rank selects from the union
   exactly what `estimate_layout` selects on the whole sequence (up to the summation order of the
   scores, i.e. identical unless two candidates tie to the last bit), and all ranks build the same
   layout.

Five collectives per call, whatever the number of documents or chunks, and no device read per
segment: where each segment's rows and keys lie in a shard is known on the host from the plan.
Per rank, a ring all-reduce of a [2, B, H, V, S] score buffer (V: 1, or the most chunks a document
has after the first) would send it about twice; the reduce-scatter sends the packed slashes once
(L: the sparse documents' tokens, about V x S / 2 with causal chunks), and the all-gather the
candidates: (CP - 1) x 2 x (vertical + slash budget) values per segment and head. Each rank holds
the verticals of its own keys only.
"""

from __future__ import annotations

import itertools
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from ..attention.build import dense_layout
from ..attention.estimate import (
    EstimationSegment,
    Sampling,
    accumulate_vertical_slash,
    block_diagonal_mass,
    budget,
    candidates_per_row,
    column_ratio,
    estimation_segments,
    keep_anchors,
    keep_diagonals,
    layout_from_kept,
    long_documents,
    row_softmax_stats,
    scoring_groups,
    select_entries,
    select_mass,
    top_entries,
    warn_if_costly,
)
from ..attention.layout import SparseLayout
from ..attention.precision import compute_dtype
from ..config import SparseAttentionConfig
from .comm import all_gather_rows, all_reduce, reduce_scatter_rows
from .context import CPShard


def _all_reduce(x: torch.Tensor, op, shard: CPShard) -> None:
    if shard.parallel.cp_size > 1:
        all_reduce(x, shard.parallel.cp_group, "the layout estimation's all-reduce", op=op)


class KeptEntries(NamedTuple):
    """What a sparse layout is built from (`layout_from_kept`): the estimation segments of every batch
    row and the kept columns and offsets ([B, H, V, S] bool each, in the split's global order)."""

    segments: list[list[EstimationSegment]]
    keep_v: torch.Tensor
    keep_s: torch.Tensor


class CPEstimate(NamedTuple):
    """`estimate_cp`'s result: the global layout, and the entries it was built from (None: dense)."""

    layout: SparseLayout
    kept: KeptEntries | None


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
    return estimate_cp(q, k, cfg, shard, scale=scale, sliding_window=sliding_window).layout


def estimate_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    cfg: SparseAttentionConfig,
    shard: CPShard,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> CPEstimate:
    """`estimate_layout_cp`, with the kept entries the layout was built from (for the kept fraction one
    process reports, `kept_fraction.one_process_kept_fraction`)."""
    plan, meta = shard.plan, shard.meta
    if cfg.block_size != plan.block_size:
        raise ValueError(
            f"this layer's block_size ({cfg.block_size}) differs from the block size the sequence was sharded with "
            f"({plan.block_size}); under context parallelism every layer must use the same block_size."
        )
    if cfg.pattern == "dense" or sliding_window is not None:
        return CPEstimate(dense_layout(meta, cfg.block_size, sliding_window), None)
    docs = long_documents(meta, cfg)
    if not any(docs):
        return CPEstimate(dense_layout(meta, cfg.block_size), None)
    b, hq, s_local, d = q.shape
    dev = q.device
    dtype = compute_dtype(q.dtype)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    tok = plan.token_index(shard.rank).to(dev)

    segments = estimation_segments(docs, cfg)
    if not any(segments):
        return CPEstimate(dense_layout(meta, cfg.block_size), None)
    flat = [(row, sg) for row, row_segs in enumerate(segments) for sg in row_segs]
    sampling = Sampling.of(cfg)
    # Scoring pieces: every segment's groups of scoring queries (`scoring_groups`), each scoring the segment's
    # keys before its end.
    pieces = [(i, st) for i, (_, sg) in enumerate(flat) for st in scoring_groups(sg.start, sg.scored_end, sampling)]
    # Host bookkeeping, no device read: each segment's keys [start, scored_end) and each piece's rows
    # [hi - rows, hi) and keys [start, hi) are contiguous runs of this rank's shard (its tokens are in ascending
    # global order).
    marks = torch.tensor([x for _, sg in flat for x in (sg.start, sg.scored_end)]
                         + [x for _, st in pieces for x in (st.hi - st.rows, st.hi)])
    before = plan.tokens_before(marks)  # [positions, cp_size]
    seg_start, seg_end = before[: 2 * len(flat)].view(len(flat), 2, -1).unbind(1)
    row_first, row_end = before[2 * len(flat) :].view(len(pieces), 2, -1).unbind(1)
    keys_held = seg_end - seg_start  # [segments, cp_size]
    key_lo, key_n = seg_start[:, shard.rank].tolist(), keys_held[:, shard.rank].tolist()
    key_base = list(itertools.accumulate(key_n, initial=0))
    slash_base = list(itertools.accumulate((sg.scored_end - sg.start for _, sg in flat), initial=0))
    row_base = list(itertools.accumulate((st.rows for _, st in pieces), initial=0))
    row_lo, row_n = row_first[:, shard.rank].tolist(), (row_end - row_first)[:, shard.rank].tolist()
    piece_keys = (row_end[:, shard.rank] - seg_start[[i for i, _ in pieces], shard.rank]).tolist()

    # 1. every piece's scoring rows, each from the rank that holds it
    q_rows = torch.zeros(hq, row_base[-1], d, dtype=dtype, device=dev)
    for p, (i, st) in enumerate(pieces):
        row = flat[i][0]
        mine = torch.arange(row_lo[p], row_lo[p] + row_n[p], device=dev)
        q_rows[:, row_base[p] + tok[mine] - (st.hi - st.rows)] = q[row][:, mine].to(dtype)
    _all_reduce(q_rows, dist.ReduceOp.SUM, shard)

    # 2. their softmax normalisers over all keys
    work = []
    for p, (i, st) in enumerate(pieces):
        rows = torch.arange(st.hi - st.rows, st.hi, device=dev)
        keys = torch.arange(key_lo[i], key_lo[i] + piece_keys[p], device=dev)
        work.append((flat[i][0], rows, slice(row_base[p], row_base[p + 1]), keys))
    row_max = torch.full((hq, row_base[-1]), float("-inf"), dtype=dtype, device=dev)
    row_sum = torch.zeros(hq, row_base[-1], dtype=dtype, device=dev)
    for row, rows, span, keys in work:
        if keys.numel():
            visible = tok[keys].unsqueeze(0) <= rows.unsqueeze(1)
            row_max[:, span], row_sum[:, span] = row_softmax_stats(
                q_rows[:, span].contiguous(), k[row][:, keys].to(dtype), visible, scale
            )
    top = row_max.clone()
    _all_reduce(top, dist.ReduceOp.MAX, shard)
    row_sum = torch.where(torch.isfinite(row_max), row_sum * torch.exp(row_max - top), torch.zeros_like(row_sum))
    _all_reduce(row_sum, dist.ReduceOp.SUM, shard)

    # 3. the mass this rank's keys receive: verticals of its own keys, segment after segment; slashes of
    # every segment's scored offsets, packed the same way on every rank
    vertical = torch.zeros(hq, key_base[-1], dtype=dtype, device=dev)
    slash = torch.zeros(hq, slash_base[-1], dtype=dtype, device=dev)
    for (i, st), (row, rows, span, keys) in zip(pieces, work):
        if keys.numel():
            accumulate_vertical_slash(
                q_rows[:, span].contiguous(), k[row][:, keys].to(dtype), rows, tok[keys], scale, vertical, slash,
                normalizer=(top[:, span], row_sum[:, span]), slash_base=slash_base[i],
                vertical_index=torch.arange(key_base[i], key_base[i] + keys.numel(), device=dev),
                stratum=st if sampling.weighted else None,
            )
    warn_if_costly(1 + max(sg.set for _, sg in flat), (vertical.numel() + slash.numel()) * vertical.element_size(),
                   cfg)
    if cfg.budget_mode == "mass":  # block diagonals from the partial slashes (linear), summed in their place
        diagonals = [block_diagonal_mass(slash[:, a:b], cfg.block_size) for a, b in zip(slash_base, slash_base[1:])]
        slash, slash_base = torch.cat(diagonals, 1), list(itertools.accumulate((x.shape[1] for x in diagonals),
                                                                              initial=0))
    # 4. the selection from every rank's candidates
    all_keys = torch.cat([torch.arange(key_lo[i], key_lo[i] + key_n[i], device=dev) for i in range(len(flat))])
    keep_v, keep_s = _kept_across_ranks(
        _Scores(vertical, key_base, tok[all_keys], keys_held),
        _Scores(slash, slash_base, None, None), flat, meta.segment.shape, cfg, shard)
    return CPEstimate(layout_from_kept(meta, cfg, segments, keep_v, keep_s), KeptEntries(segments, keep_v, keep_s))


class _Scores(NamedTuple):
    """One kind of score of every segment, packed: segment i at values[:, bases[i]:bases[i + 1]].
    Verticals: this rank's keys, at global `positions`, `held` [segments, cp_size] by each rank; slashes
    (positions and held None): every scored offset, the same layout on every rank, partial sums."""

    values: torch.Tensor
    bases: list[int]
    positions: torch.Tensor | None
    held: torch.Tensor | None


def _candidates(vals: torch.Tensor, pos: torch.Tensor, m: int, pad_pos: int, key=None) -> torch.Tensor:
    """[H, 2m + 1]: the best m of vals [H, n] (ranked by `key` of them, `top_entries`; exact ties: the
    lower position first, vals being in position order), fewer padded with score 0 (never kept), their
    global positions pos [n] (padding: pad_pos) as raw bits of the score dtype, and the row's total mass."""
    h = vals.shape[0]
    idx = top_entries(vals, m, key)
    out_vals = torch.zeros(h, m, dtype=vals.dtype, device=vals.device)
    out_pos = torch.full((h, m), pad_pos, dtype=_BITS[vals.dtype], device=vals.device)
    out_vals[:, : idx.shape[1]] = vals.gather(1, idx)
    out_pos[:, : idx.shape[1]] = pos[idx].to(out_pos.dtype)
    # Positions travel in the score buffer as bit patterns (a copy, never arithmetic): one all-gather.
    return torch.cat([out_vals, out_pos.view(vals.dtype), vals.sum(1, keepdim=True)], 1)


_BITS = {torch.float32: torch.int32, torch.float64: torch.int64}


def _kept_across_ranks(vertical: _Scores, slash: _Scores, flat: list[tuple[int, EstimationSegment]],
                       row_shape: torch.Size, cfg: SparseAttentionConfig, shard: CPShard
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept columns and offsets ([B, H, V, S] bool each, anchors included, the same on every rank)
    of the segments `flat` ((batch row, segment), in the scores' order; row_shape: [B, S]). The
    verticals of this rank's keys are complete here; the slashes are summed by a reduce-scatter, each
    rank getting 1/cp_size of the packed offsets. Each rank sends, per segment and head, the best
    entries it holds (as many as a head can keep) with the mass of all it holds, in one all-gather;
    every rank selects from the union, which holds every entry the whole row's selection can keep
    and, for top-p, the mass of every better one."""
    w, rank, group = shard.parallel.cp_size, shard.rank, shard.parallel.cp_group
    b, s = row_shape
    h, n_sets, dev = vertical.values.shape[0], 1 + max(sg.set for _, sg in flat), vertical.values.device
    span = -(-slash.values.shape[1] // w)
    padded = torch.nn.functional.pad(slash.values, (0, span * w - slash.values.shape[1]))
    if w > 1:
        summed = padded.new_empty(h, span)
        reduce_scatter_rows(summed, padded.unflatten(1, (w, span)).movedim(1, 0).flatten(0, 1), group)
    else:
        summed = padded
    first, last, ranks = torch.tensor(slash.bases[:-1]), torch.tensor(slash.bases[1:]), torch.arange(w)
    slash_held = (torch.minimum(last.unsqueeze(1), (ranks + 1) * span)
                  - torch.maximum(first.unsqueeze(1), ranks * span)).clamp_min(0)
    mass = cfg.budget_mode == "mass"  # the slashes are block diagonals then, every held one a candidate
    widths = {"vertical": torch.minimum(vertical.held.amax(1), torch.tensor(candidates_per_row(cfg, "vertical"))),
              "slash": slash_held.amax(1) if mass else torch.minimum(slash_held.amax(1),
                                                                     torch.tensor(candidates_per_row(cfg, "slash")))}
    widths = {kind: w.tolist() for kind, w in widths.items()}
    pieces = []
    for i, (_, sg) in enumerate(flat):
        mine = slice(vertical.bases[i], vertical.bases[i + 1])
        gain, where = vertical.values[:, mine], vertical.positions[mine]
        ratio = (lambda tile, where=where, sg=sg: column_ratio(tile, where, sg.start, sg.scored_end,
                                                               cfg.block_size, cfg.mass_near_blocks)) if mass else None
        pieces.append(_candidates(gain, where, widths["vertical"][i], s, ratio))
        lo = max(slash.bases[i], rank * span)
        packed = torch.arange(lo, max(lo, min(slash.bases[i + 1], (rank + 1) * span)), device=dev)
        pieces.append(_candidates(summed[:, packed - rank * span], (0 if mass else sg.start) + packed - slash.bases[i],
                                  widths["slash"][i], s))
    local = torch.cat(pieces, 1)
    gathered = local.new_empty(w, *local.shape)
    if w > 1:
        all_gather_rows(gathered.flatten(0, 1), local, group)
    else:
        gathered[0] = local
    keep = {kind: torch.zeros(b, h, n_sets, s + 1, dtype=torch.bool, device=dev) for kind in widths}
    col = 0
    for i, (row, sg) in enumerate(flat):
        offered = {}
        for kind in ("vertical", "slash"):
            m = widths[kind][i]
            part = gathered[:, :, col : col + 2 * m + 1]
            col += 2 * m + 1
            vals = part[..., :m].movedim(0, 1).flatten(1)
            pos = part[..., m : 2 * m].contiguous().view(_BITS[vals.dtype]).movedim(0, 1).flatten(1).long()
            offered[kind] = vals, pos, part[..., 2 * m :].sum(0)
        if mass:
            (v_vals, v_pos, _), (d_vals, d_pos, _) = offered["vertical"], offered["slash"]
            cols, diags = select_mass(v_vals, v_pos, d_vals, d_pos, sg.start, sg.q_hi, cfg, sg.scored_end)
            keep["vertical"][row, :, sg.set].scatter_(1, torch.where(cols, v_pos, s), True)
            keep_diagonals(keep["slash"][row, :, sg.set], diags, d_pos, sg.start, cfg.block_size)
            continue
        for kind, (vals, pos, total) in offered.items():
            kept = select_entries(vals, cfg.budget_mode, *budget(cfg, kind), total=total, positions=pos)
            keep[kind][row, :, sg.set].scatter_(1, torch.where(kept, pos, s), True)
    keep_v, keep_s = keep["vertical"][..., :s], keep["slash"][..., :s]
    for row, sg in flat:
        keep_anchors(keep_v[row, :, sg.set], keep_s[row, :, sg.set], sg.start, sg.q_hi, cfg)
    return keep_v, keep_s
