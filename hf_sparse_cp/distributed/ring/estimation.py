"""Vertical-slash pattern estimation of a sequence split over a context-parallel group.

The pattern of a long document comes from its last `last_q` queries scoring all of its keys, or,
with `estimation="causal_chunks"`, that of each chunk from the last queries before it scoring the
keys before it (`hf_sparse_cp.attention.estimate`: one estimation segment per document or chunk).
Under CP those queries and keys are spread over the ranks, so:

1. every rank contributes the scoring queries it holds to one all-reduce (each row is held by
   exactly one rank), after which every rank has all of them (all segments' rows in one buffer);
2. each rank scores its own keys and the softmax normaliser of every query row is combined across
   ranks (all-reduce of the row max, then of the sums of exp(score - max) as fixed-point int64);
3. each rank adds the normalised mass of its keys into vertical scores of those keys and slash
   scores [H, L] (every segment's scored offsets, packed one after another; each segment's keys of
   this rank too), which become the diagonals the budget ranks (`Budget.diagonal_sums`: offsets, or
   block diagonals). A key's vertical score is then complete on the rank that holds the key; a
   diagonal sums over every rank's keys, so a reduce-scatter gives each rank the sums of 1/CP of them;
4. per estimation segment and head, each rank offers the best entries it holds (as many as the
   budget says, `Budget.offered`) and the mass of all it holds, in one all-gather. Every entry the
   whole row's selection keeps is among its holder's best, and for top-p so is every entry ranked
   above it, so every rank selects from the union exactly what `estimate_layout` selects on the whole
   sequence, and all ranks build the same layout.

The scores are the same to the bit as one process's (`hf_sparse_cp.attention.exact`): each query-key
score is exact to its two vectors, each (row, key) mass is rounded once to the segment's fixed point
(`Sampling.encoding`) and every sum (over tiles, rows, ranks) is an exact int64 sum, read as fp64 once
complete. So exact ties from equal inputs (repeated tokens, constant keys) stay ties under any split and
break by position as in one process.

These are the scores stage of the one pipeline (`hf_sparse_cp.attention.estimate.estimate`), whose
documents, segments, budget and layout stages run here as in one process.

Five collectives per call, whatever the number of documents or chunks, and no device read per
segment: where each segment's rows and keys lie in a shard is known on the host from the plan.
Per rank, a ring all-reduce of a [2, B, H, V, S] score buffer (V: 1, or the most chunks a document
has after the first) would send it about twice; the reduce-scatter sends the packed slashes once
(L: the sparse documents' tokens, about V x S / 2 with causal chunks), and the all-gather the
candidates: (CP - 1) x 2 x (vertical + slash budget) fp64 values per segment and head. Each rank holds
the verticals of its own keys only.
"""

from __future__ import annotations

import functools
import itertools
import math
from typing import NamedTuple

import torch
import torch.distributed as dist

from ...attention.budgets import Entries, top_entries
from ...attention.estimate import Estimate, EstimationSegment, estimate, warn_if_costly
from ...attention.exact import FixedPoint
from ...attention.layout import SparseLayout
from ...attention.precision import compute_dtype
from ...attention.scoring import Sampling, accumulate_vertical_slash, row_exp_sums, row_max, scoring_groups
from ...config import SparseAttentionConfig
from ..comm import all_gather_rows, all_reduce, reduce_scatter_rows
from ..shard import CPShard


def _all_reduce(x: torch.Tensor, op, shard: CPShard) -> None:
    if shard.parallel.cp_size > 1:
        all_reduce(x, shard.parallel.cp_group, "the layout estimation's all-reduce", op=op)


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
        equal to `estimate_layout` on the whole sequence (bit-identical scores, see the module docstring).
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
) -> Estimate:
    """`estimate_layout_cp`, with the kept entries the layout was built from (in the split's global order,
    for the kept fraction reported, `kept_fraction.reported_kept_fraction`)."""
    if cfg.block_size != shard.plan.block_size:
        raise ValueError(
            f"this layer's block_size ({cfg.block_size}) differs from the block size the sequence was sharded with "
            f"({shard.plan.block_size}); under context parallelism every layer must use the same block_size."
        )
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    return estimate(cfg, shard.meta, functools.partial(_sharded_scores, q, k, cfg, shard, scale),
                    sliding_window=sliding_window)


def _sharded_scores(q: torch.Tensor, k: torch.Tensor, cfg: SparseAttentionConfig, shard: CPShard, scale: float,
                    segments: list[list[EstimationSegment]]) -> list[tuple[Entries, Entries]]:
    """The scores stage on a rank (steps 1-4 of the module docstring): every segment's candidate columns and
    diagonals, offered by every rank, in `estimate`'s order."""
    plan = shard.plan
    _, hq, _, d = q.shape
    dev, dtype = q.device, compute_dtype(q.dtype)
    tok = plan.token_index(shard.rank).to(dev)
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

    # 2. their softmax normalisers over all keys: the row maxima, then the sums of exp(score - max) in fixed point
    # (exact, so the same on every rank as in one process)
    work = []
    for p, (i, st) in enumerate(pieces):
        rows = torch.arange(st.hi - st.rows, st.hi, device=dev)
        keys = torch.arange(key_lo[i], key_lo[i] + piece_keys[p], device=dev)
        visible = tok[keys].unsqueeze(0) <= rows.unsqueeze(1)
        work.append((flat[i][0], rows, slice(row_base[p], row_base[p + 1]), keys, visible))
    encodings = [sampling.encoding(sg.start, sg.scored_end) for _, sg in flat]
    top = torch.full((hq, row_base[-1]), float("-inf"), dtype=dtype, device=dev)
    for row, _, span, keys, visible in work:
        if keys.numel():
            top[:, span] = row_max(q_rows[:, span].contiguous(), k[row][:, keys], visible, scale)
    _all_reduce(top, dist.ReduceOp.MAX, shard)
    exp_sums = torch.zeros(hq, row_base[-1], dtype=torch.int64, device=dev)
    for (i, _), (row, _, span, keys, visible) in zip(pieces, work):
        if keys.numel():
            exp_sums[:, span] = row_exp_sums(q_rows[:, span].contiguous(), k[row][:, keys], visible, scale,
                                             top[:, span], encodings[i].exp_sums)
    _all_reduce(exp_sums, dist.ReduceOp.SUM, shard)
    row_sum = torch.empty(hq, row_base[-1], dtype=dtype, device=dev)
    for (i, _), (_, _, span, _, _) in zip(pieces, work):
        row_sum[:, span] = encodings[i].exp_sums.decode(exp_sums[:, span], dtype)

    # 3. the mass this rank's keys receive, exact in each segment's fixed point: verticals of its own keys,
    # segment after segment; slashes of every segment's scored offsets, packed the same way on every rank
    vertical = torch.zeros(hq, key_base[-1], dtype=torch.int64, device=dev)
    slash = torch.zeros(hq, slash_base[-1], dtype=torch.int64, device=dev)
    for (i, st), (row, rows, span, keys, _) in zip(pieces, work):
        if keys.numel():
            accumulate_vertical_slash(
                q_rows[:, span].contiguous(), k[row][:, keys], rows, tok[keys], scale, vertical, slash, encodings[i],
                normalizer=(top[:, span], row_sum[:, span]), slash_base=slash_base[i],
                vertical_index=torch.arange(key_base[i], key_base[i] + keys.numel(), device=dev),
                stratum=st if sampling.weighted else None,
            )
    warn_if_costly(1 + max(sg.set for _, sg in flat), (vertical.numel() + slash.numel()) * vertical.element_size(),
                   cfg)
    # the diagonals the budget ranks, from the partial slashes (linear, integer weights), written straight into
    # the reduce-scatter's rank-major buffer: the slashes and that buffer are all a rank holds of them at once
    send, diagonal_base = _diagonals_by_rank(slash, slash_base, cfg, shard.parallel.cp_size)
    del slash
    # 4. every rank's candidates
    all_keys = torch.cat([torch.arange(key_lo[i], key_lo[i] + key_n[i], device=dev) for i in range(len(flat))])
    return _candidates_of_every_rank(_Scores(vertical, key_base, tok[all_keys], keys_held),
                                     _Scores(send, diagonal_base, None, None), flat,
                                     [e.mass for e in encodings], plan.padded_len, cfg, shard)


def _diagonals_by_rank(slash: torch.Tensor, slash_base: list[int], cfg: SparseAttentionConfig,
                       cp_size: int) -> tuple[torch.Tensor, list[int]]:
    """(int64 [cp_size, H, span], bases): every segment's diagonal sums (`Budget.diagonal_sums` of its slashes
    slash[:, slash_base[i]:slash_base[i + 1]]) packed one after another along one axis of span x cp_size entries
    (zero-padded at the end), split into cp_size rank-major chunks (chunk r: what rank r sums), and where each
    segment's diagonals start on that axis. One copy (the built-in budgets' diagonal sums are the slashes
    themselves, or their block sums, far fewer)."""
    diagonals = [cfg.budget.diagonal_sums(slash[:, a:b], cfg.block_size) for a, b in zip(slash_base, slash_base[1:])]
    bases = list(itertools.accumulate((x.shape[1] for x in diagonals), initial=0))
    span = -(-bases[-1] // cp_size)
    send = slash.new_zeros(cp_size, slash.shape[0], span)
    for values, lo, hi in zip(diagonals, bases, bases[1:]):
        for r in range(lo // span, -(-hi // span)) if span else ():
            a, b = max(lo, r * span), min(hi, (r + 1) * span)
            send[r, :, a - r * span : b - r * span] = values[:, a - lo : b - lo]
    return send, bases


class _Scores(NamedTuple):
    """One kind of score of every segment, packed, as fixed-point int64 sums: segment i at
    values[:, bases[i]:bases[i + 1]]. Verticals: this rank's keys, at global `positions`, `held` [segments,
    cp_size] by each rank; diagonals (positions and held None): every one of each segment, the same layout on
    every rank, partial sums, with values [cp_size, H, span] split by the rank that sums them
    (`_diagonals_by_rank`)."""

    values: torch.Tensor
    bases: list[int]
    positions: torch.Tensor | None
    held: torch.Tensor | None


def _offer(sums: torch.Tensor, pos: torch.Tensor, m: int, pad_pos: int, fixed: FixedPoint, divisor_bits: int = 0,
           key=None) -> torch.Tensor:
    """fp64 [H, 2m + 1]: the best m of the fixed-point sums [H, n] read as fp64 (ranked by `key` of them,
    `top_entries`; exact ties: the lower position first, sums being in position order), fewer padded with score
    0 (never kept), their ids pos [n] (padding: pad_pos) and the row's exact total (int64), both as raw bits."""
    vals = fixed.decode(sums, divisor_bits=divisor_bits)
    h = vals.shape[0]
    idx = top_entries(vals, m, None if key is None else functools.partial(key, positions=pos))
    out_vals = torch.zeros(h, m, dtype=vals.dtype, device=vals.device)
    out_pos = torch.full((h, m), pad_pos, dtype=torch.int64, device=vals.device)
    out_vals[:, : idx.shape[1]] = vals.gather(1, idx)
    out_pos[:, : idx.shape[1]] = pos[idx]
    # Positions and totals travel in the score buffer as bit patterns (a copy, never arithmetic): one all-gather.
    return torch.cat([out_vals, out_pos.view(vals.dtype), sums.sum(1, keepdim=True).view(vals.dtype)], 1)


def _candidates_of_every_rank(vertical: _Scores, diagonal: _Scores, flat: list[tuple[int, EstimationSegment]],
                              fixed: list[FixedPoint], pad: int, cfg: SparseAttentionConfig,
                              shard: CPShard) -> list[tuple[Entries, Entries]]:
    """Per segment of `flat` ((batch row, segment), in the scores' order), the (columns, diagonals) entries
    that every rank offers, with each row's total mass, read as fp64 from the segment's fixed point (`fixed`)
    as one process reads its whole rows (`estimate.row_entries`). The verticals of this rank's keys are
    complete here; the diagonals are summed by a reduce-scatter (int64, exact), each rank getting 1/cp_size of
    them. Each rank sends, per segment and head, the best entries it holds (`Budget.offered`) with the mass of
    all it holds, in one all-gather; the union holds every entry the whole row's selection can keep and, for
    top-p, the mass of every better one. `pad`: an id no entry has."""
    w, rank, group, budget = shard.parallel.cp_size, shard.rank, shard.parallel.cp_group, cfg.budget
    dev = vertical.values.device
    step_bits = budget.diagonal_step(cfg.block_size).bit_length() - 1
    span = diagonal.values.shape[-1]
    if w > 1:
        summed = diagonal.values.new_empty(diagonal.values.shape[1:])
        reduce_scatter_rows(summed, diagonal.values.flatten(0, 1), group)
    else:
        summed = diagonal.values[0]
    first, last, ranks = torch.tensor(diagonal.bases[:-1]), torch.tensor(diagonal.bases[1:]), torch.arange(w)
    diagonal_held = (torch.minimum(last.unsqueeze(1), (ranks + 1) * span)
                     - torch.maximum(first.unsqueeze(1), ranks * span)).clamp_min(0)
    widths = [budget.offered("columns", vertical.held.amax(1)).tolist(),
              budget.offered("diagonals", diagonal_held.amax(1)).tolist()]
    offers = []
    for i, (_, sg) in enumerate(flat):
        mine = slice(vertical.bases[i], vertical.bases[i + 1])
        offers.append(_offer(vertical.values[:, mine], vertical.positions[mine], widths[0][i], pad, fixed[i],
                             key=budget.column_key(sg.start, sg.scored_end, cfg.block_size)))
        lo = max(diagonal.bases[i], rank * span)
        packed = torch.arange(lo, max(lo, min(diagonal.bases[i + 1], (rank + 1) * span)), device=dev)
        offers.append(_offer(summed[:, packed - rank * span], packed - diagonal.bases[i], widths[1][i], pad,
                             fixed[i], step_bits))
    local = torch.cat(offers, 1)
    gathered = local.new_empty(w, *local.shape)
    if w > 1:
        all_gather_rows(gathered.flatten(0, 1), local, group)
    else:
        gathered[0] = local
    out, col = [], 0
    for i in range(len(flat)):
        kinds = []
        for m, divisor_bits in ((widths[0][i], 0), (widths[1][i], step_bits)):
            part = gathered[:, :, col : col + 2 * m + 1]
            col += 2 * m + 1
            vals = part[..., :m].movedim(0, 1).flatten(1)
            ids = part[..., m : 2 * m].contiguous().view(torch.int64).movedim(0, 1).flatten(1)
            total = part[..., 2 * m :].contiguous().view(torch.int64).sum(0)
            kinds.append(Entries(vals, ids, fixed[i].decode(total, divisor_bits=divisor_bits)))
        out.append(tuple(kinds))
    return out
