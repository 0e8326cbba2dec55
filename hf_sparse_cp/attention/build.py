"""Layout construction: from kept block diagonals, key columns and dense tokens to a `SparseLayout`.

`build_layout` turns a pattern (per head: kept block diagonals, kept key columns; per token:
whether its whole causal document prefix is kept) into the listed key blocks and token columns of
every query block, on the layout's device and vectorized: the listed key blocks come from counts
of kept block diagonals (no sort, no [NQB, NKB] matrix) and the columns from an order-keeping
compaction of the kept key columns. Blocks that hold no visible pair (other documents, outside
the sliding window, padding only) are never listed. `dense_layout` is the exact dense layout of a
batch (every block with a visible pair); pattern estimation (`estimate.py`) decides what to keep.
"""

from __future__ import annotations

import torch

from ..config import check_block_size
from .chunks import head_chunks
from .layout import FAR, SparseLayout, check_meta, check_window, first_visible_keys
from .tokens import PAD_SEGMENT, TokenMeta

# Elements of one [heads, query blocks, candidates] tile of layout construction (bounds its temporaries).
LAYOUT_ELEMENTS = 1 << 24


def offsets_to_block_diagonals(keep_offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block diagonals d = qb - kb crossed by the kept token diagonals ([..., S] -> [..., ceil(S/bs)]).

    Tokens q, k with q - k = o lie in blocks whose block distance is floor(o/bs) or ceil(o/bs):
    block diagonal d is crossed by an offset in [d*bs, (d+1)*bs) (floor) or in ((d-1)*bs, d*bs] (ceil).
    """
    s = keep_offsets.shape[-1]
    nb = -(-s // block_size)
    pad = nb * block_size - s
    keep = keep_offsets.bool()
    floor_hit = torch.nn.functional.pad(keep, (0, pad)).unflatten(-1, (nb, block_size)).any(-1)
    after = torch.nn.functional.pad(keep[..., 1:], (0, pad + 1))  # after[o] = keep[o + 1]
    ceil_hit = after.unflatten(-1, (nb, block_size)).any(-1)[..., :-1]  # block d - 1 of `after` serves d
    return floor_hit | torch.nn.functional.pad(ceil_hit, (1, 0))


def _compact(values: torch.Tensor, keep: torch.Tensor, width: int) -> torch.Tensor:
    """The kept values of each row in their order, in `width` int32 slots padded with -1.

    values broadcasts to keep's shape [..., N]; every row keeps at most `width` entries.
    """
    slot = torch.where(keep, keep.cumsum(-1, dtype=torch.int32) - 1, width).long()
    out = torch.full((*keep.shape[:-1], width + 1), -1, dtype=torch.int32, device=keep.device)
    out.scatter_(-1, slot, values.to(torch.int32).expand(keep.shape))  # dropped entries all land in the spare slot
    return out[..., :width]


def _one_or_range(x: torch.Tensor, h0: int, h1: int) -> torch.Tensor:
    """Heads h0:h1 of a [H, ...] tensor, or its single shared head."""
    return x if x.shape[0] == 1 else x[h0:h1]


def diagonal_set_of_blocks(meta: TokenMeta, block_size: int, docs: list[list[tuple[int, int]]],
                           spans: list[list[int]]) -> torch.Tensor:
    """int64 [B, NQB]: where each query block's set of kept block diagonals begins along the sets'
    axis (`build_layout`'s `diagonal_start`), -1 for none.

    docs[row]: the (start, end) of the documents with a set; spans[row]: where each one's set
    begins. A query block takes the set of the document of its first valid query: a document that
    starts later inside the block sees only the block itself there (block diagonal 0, always kept).
    """
    bs = block_size
    b, s = meta.segment.shape
    nqb = -(-s // bs)
    valid = torch.nn.functional.pad(meta.segment != PAD_SEGMENT, (0, nqb * bs - s)).view(b, nqb, bs)
    first = torch.arange(nqb, device=valid.device) * bs + valid.int().argmax(-1)
    first = torch.where(valid.any(-1), first, -1)
    out = torch.full((b, nqb), -1, dtype=torch.long, device=valid.device)
    for row, (row_docs, row_spans) in enumerate(zip(docs, spans)):
        for (start, end), base in zip(row_docs, row_spans):
            out[row] = torch.where((first[row] >= start) & (first[row] < end), base, out[row])
    return out


def build_layout(
    meta: TokenMeta,
    block_size: int,
    *,
    diagonals: torch.Tensor | None = None,
    diagonal_start: torch.Tensor | None = None,
    verticals: torch.Tensor | None = None,
    vertical_set: torch.Tensor | None = None,
    dense_tokens: torch.Tensor | None = None,
    sliding_window: int | None = None,
    max_verticals: int | None = None,
) -> SparseLayout:
    """Layout of one full (unsharded) sequence per row.

    Args:
        meta: the tokens [B, S] in global order (documents, padding).
        block_size: the layout's block (power of two >= 16).
        diagonals: bool [B, H, NB], block diagonals kept per head (NB = ceil(S / block_size)); or, with
            `diagonal_start`, bool [B, H, T]: several sets of kept block diagonals side by side (one per
            document: entry `diagonal_start[b, qb] + d` says whether query block qb keeps diagonal d).
        diagonal_start: int64 [B, NQB], where the set of each query block begins along the last axis of
            `diagonals` (-1: the block keeps no diagonal); default: one set per row (every block at 0).
        verticals: bool [B, H, S], key columns kept per head; or, with `vertical_set`, bool [B, H, V, S]:
            V sets of kept key columns (e.g. one per chunk of queries, each estimated from earlier queries).
        vertical_set: int64 [B, NQB], the set of `verticals` each query block reads (-1: none); default:
            the one set of [B, H, S] columns for every block.
        dense_tokens: bool [B, S], queries whose whole causal document prefix is kept.
        sliding_window: keys `sliding_window` or more tokens before a query are invisible.
        max_verticals: a bound on the kept columns of any (row, head), when the caller knows one:
            spares the host synchronization that measures it.

    Returns:
        The `SparseLayout` ([B, H, NQB, ...], H = 1 without per-head inputs). Blocks that hold no
        visible pair (other documents, outside the sliding window, padding only) are never listed.
    """
    check_meta("meta", meta, optional=False)
    check_block_size(block_size, "block_size")  # (0: a ZeroDivisionError; 100: refused only by the attention call)
    check_window(sliding_window)
    bs = block_size
    b, s = meta.segment.shape
    dev = meta.segment.device
    nqb = -(-s // bs)
    s_pad = nqb * bs
    qb = torch.arange(nqb, device=dev)

    # per query block: the first visible key token, the first listable key block, the first dense one
    valid_q, start, lo_tok, lo = first_visible_keys(meta, bs, sliding_window)
    if dense_tokens is None:
        dense_lo = torch.full_like(lo, FAR)
    else:
        dt = torch.nn.functional.pad(dense_tokens, (0, s_pad - s)).view(b, nqb, bs) & valid_q
        dense_lo = torch.where(dt, start // bs, FAR).amin(-1)
    dense_lo = torch.maximum(dense_lo, lo)
    del valid_q, start  # (token-sized)

    # Listed key blocks of (head, query block): {qb - d : d kept, lo <= qb - d < dense_lo} (ascending,
    # i.e. kept diagonals d in (qb - dense_lo, qb - lo] taken in descending order), then the dense
    # range [dense_lo, qb]. The diagonals are a slice of the head's sorted kept list, found by counting.
    n_dense = (qb - dense_lo + 1).clamp_min(0).unsqueeze(1)  # [B, 1, NQB]
    if diagonals is None:
        heads_b, diagonal_list = 1, None
        n_diag = torch.zeros_like(n_dense)
    else:
        heads_b, one_set = diagonals.shape[1], diagonal_start is None
        if one_set:
            diagonal_start = torch.zeros(b, nqb, dtype=torch.long, device=dev)
        diagonal_list = _kept_diagonals(diagonals, diagonal_start, one_set, qb - lo, (qb - dense_lo).clamp(-1, nqb - 1))
        n_diag = diagonal_list[3]
    block_cnt = (n_diag + n_dense).to(torch.int32)  # [B, heads_b, NQB]

    # Columns of (head, query block): kept columns up to the end of the query block, visible from it, outside
    # its listed blocks. A query block can only see the kept columns in [its first visible key, its end): a
    # window of the sorted column list (one document's columns, not the whole row's), found by binary search.
    # The mask over that window is built in head chunks; once its width is known, each chunk's mask is compacted
    # into its slice of col_idx and dropped (only a bool per window slot is held across chunks, no values).
    col_masks, col_widths, heads = [], [], heads_b
    any_vertical = torch.zeros((), dtype=torch.bool, device=dev)
    # With several sets, set j's column c is entry j * S + c of one ascending list, and a query block searches
    # its window inside its own set's part of that list.
    if verticals is not None:
        if vertical_set is None:
            verticals, col_base = verticals.unsqueeze(2), torch.zeros(b, nqb, dtype=torch.long, device=dev)
        else:
            col_base = vertical_set.clamp_min(0) * s
        verticals = (verticals & (meta.segment != PAD_SEGMENT)[:, None, None]).flatten(2)  # nobody sees a padding key
        any_vertical = verticals.any()
        n_all = verticals.shape[-1]
        nv = int(verticals.sum(-1).max()) if max_verticals is None else max_verticals
        v_list = _compact(torch.arange(n_all, device=dev), verticals, min(nv, n_all))  # ascending, then -1
        heads = max(heads_b, verticals.shape[1])
        v_sorted = torch.where(v_list >= 0, v_list.long(), FAR)
        # a partial last block's window ends at S, not inside the next set
        ends = (col_base + ((qb + 1) * bs).clamp_max(s)).unsqueeze(1).expand(b, v_list.shape[1], nqb).contiguous()
        first = torch.searchsorted(v_sorted, (col_base + lo_tok).unsqueeze(1).expand_as(ends).contiguous())
        span = (torch.searchsorted(v_sorted, ends) - first).clamp_min(0)
        del v_sorted, ends
        if vertical_set is not None:
            span = torch.where((vertical_set >= 0).unsqueeze(1), span, 0)
        window = int(span.max()) if span.numel() else 0
        col_chunks = [(row, hs) for row in range(b) for hs in head_chunks(heads, nqb * max(window, 1), LAYOUT_ELEMENTS)]
        for row, hs in col_chunks:
            mask = _column_mask(v_list[row], first[row], span[row], window, col_base[row], diagonals, diagonal_start,
                                row, hs.start, hs.stop, qb, dense_lo[row], bs, sliding_window)
            col_masks.append(mask)
            col_widths.append(mask.sum(-1, dtype=torch.int32).amax() if mask.numel() else torch.zeros((), device=dev))
    sizes = torch.stack([block_cnt.amax() if block_cnt.numel() else torch.zeros((), device=dev, dtype=torch.int32),
                         *(w.to(torch.int32) for w in col_widths), any_vertical.to(torch.int32)]).tolist()
    block_width, col_width, has_columns = sizes[0], max(sizes[1:-1], default=0), bool(sizes[-1])

    block_idx = _list_blocks(block_cnt, diagonal_list, dense_lo, qb, block_width)
    del diagonal_list, n_diag  # (the column pass below is the build's peak with columns: nothing of the blocks' left)
    if not has_columns:
        return SparseLayout.from_blocks(block_idx, block_cnt, bs)

    col_idx = torch.empty(b, heads, nqb, col_width, dtype=torch.int32, device=dev)
    col_cnt = torch.empty(b, heads, nqb, dtype=torch.int32, device=dev)
    col_masks.reverse()
    slot = torch.arange(window, device=dev, dtype=torch.int32)  # col_width <= window
    for row, hs in col_chunks:
        mask = col_masks.pop()  # the last reference: freed with this chunk
        # compact the kept window positions, then gather the columns at them straight into col_idx: no window-wide
        # values are kept from the mask's pass, and this one reads only col_width of them
        at = _compact(slot, mask, col_width)
        cnt = col_cnt[row, hs] = mask.sum(-1, dtype=torch.int32)
        del mask
        out = col_idx[row, hs]
        _window_columns(v_row=v_list[row], first=first[row], at=at.clamp_min_(0), col_base=col_base[row], h0=hs.start,
                        h1=hs.stop, out=out)
        del at
        out.masked_fill_(slot[:col_width] >= cnt.unsqueeze(-1), -1)
    if heads_b != heads:
        block_idx = block_idx.expand(b, heads, nqb, -1).contiguous()
        block_cnt = block_cnt.expand(b, heads, nqb).contiguous()
    return SparseLayout(block_idx, block_cnt, col_idx, col_cnt, bs)


def _kept_diagonals(diagonals: torch.Tensor, diagonal_start: torch.Tensor, one_set: bool, upper: torch.Tensor,
                    lower: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Where each (head, query block) finds its listed kept diagonals (those d with lower < d <= upper, [NQB] each)
    in the sorted lists of `build_layout`'s `diagonals` / `diagonal_start`: (d_list [B, H, T] int64, the kept
    diagonals of each row in order (-1 padded); base and i_hi [B, H, NQB]: the list entries before the block's set
    and before its first diagonal above `upper`; n_diag [B, H, NQB]: how many it lists). Its prefix counts
    ([B, H, T + 1] int64) end here. `one_set`: every block reads the one set of its row (diagonal_start all 0)."""
    b, heads, t = diagonals.shape
    nqb, dev = diagonal_start.shape[1], diagonals.device
    if one_set:  # entry d is diagonal d
        d_value = torch.arange(t, device=dev)
    else:  # the diagonal d each entry stands for: its distance from the start of its set
        d_value = torch.arange(t, device=dev) - torch.zeros(b, t + 1, dtype=torch.long, device=dev).scatter_(
            1, diagonal_start.clamp_min(0), diagonal_start.clamp_min(0)).cummax(-1).values[:, :t].unsqueeze(1)
    has_set = (diagonal_start >= 0).unsqueeze(1)  # [B, 1, NQB]
    start = diagonal_start.clamp_min(0).unsqueeze(1).expand(b, heads, nqb)
    kept_upto = torch.nn.functional.pad(diagonals.cumsum(-1), (1, 0))  # [B, H, T + 1]: #kept entries < x
    base = kept_upto.gather(-1, start)  # kept entries before each block's set

    def kept_at_most(x):  # [B, H, NQB]: kept diagonals d <= x in each query block's set
        at = (start + (x + 1).unsqueeze(1)).clamp(0, t)
        return torch.where(has_set, kept_upto.gather(-1, at) - base, 0)

    i_hi = kept_at_most(upper)
    n_diag = (i_hi - kept_at_most(lower)).clamp_min(0)
    return _compact(d_value, diagonals, t).long(), base, i_hi, n_diag


def _list_blocks(block_cnt: torch.Tensor, diagonal_list: tuple[torch.Tensor, ...] | None, dense_lo: torch.Tensor,
                 qb: torch.Tensor, width: int) -> torch.Tensor:
    """block_idx int32 [B, H, NQB, width]: each (head, query block)'s listed kept diagonals' key blocks (ascending,
    from `_kept_diagonals`), then its dense range from `dense_lo`, -1 padded; built a chunk of heads at a time,
    whose temporaries end with the call."""
    b, heads, nqb = block_cnt.shape
    slot = torch.arange(width, device=block_cnt.device)
    block_idx = torch.empty(b, heads, nqb, width, dtype=torch.int32, device=block_cnt.device)
    for row in range(b):
        for hs in head_chunks(heads, nqb * width, LAYOUT_ELEMENTS):
            n_diag = 0 if diagonal_list is None else diagonal_list[3][row, hs].unsqueeze(-1)
            dense_kb = dense_lo[row].view(1, nqb, 1) + slot - n_diag
            kb = torch.where(slot < block_cnt[row, hs].unsqueeze(-1), dense_kb, -1)
            if diagonal_list is not None:
                d_list, base, i_hi, _ = (x[row, hs] for x in diagonal_list)
                rank = base.unsqueeze(-1) + i_hi.unsqueeze(-1) - 1 - slot
                d = d_list.unsqueeze(1).expand(-1, nqb, -1).gather(-1, rank.clamp(0, d_list.shape[-1] - 1))
                kb = torch.where(slot < n_diag, qb.view(1, nqb, 1) - d, kb)
            block_idx[row, hs] = kb
    return block_idx


def _window_columns(v_row, first, at, col_base, h0, h1, out=None) -> torch.Tensor:
    """int32 [n, NQB, width] (into `out` if given): for heads h0:h1 (n = h1 - h0, or 1 with one shared head
    everywhere), the kept column (v_row [Hv, NV], ascending, -1 padded) at position `at` ([n or 1, NQB, width]) of
    each query block's window that starts at `first` ([Hv, NQB]), less the block's `col_base` (what tells the sets
    apart in v_row)."""
    nqb = first.shape[-1]
    vr = _one_or_range(v_row, h0, h1)
    at = (_one_or_range(first, h0, h1).unsqueeze(-1) + at).clamp_max_(max(vr.shape[-1] - 1, 0))
    if vr.shape[-1]:
        v = torch.gather(vr.unsqueeze(1).expand(at.shape[0], nqb, -1), -1, at, out=out)
    else:
        v = at.int() if out is None else out.copy_(at)
    return v.sub_(col_base.int().view(1, nqb, 1))


def _column_mask(v_row, first, span, window, col_base, diagonals, diagonal_start, row, h0, h1, qb, dense_lo, bs,
                 sliding_window) -> torch.Tensor:
    """bool [h1 - h0, NQB, window]: for each query block of heads h0:h1, which of the kept columns of its window
    (`_window_columns`, `span` entries from `first`) it lists as token columns."""
    nqb, n = qb.shape[0], h1 - h0
    slot = torch.arange(window, device=v_row.device, dtype=torch.int32)
    # int32 from here: these [heads, NQB, window] temporaries are what layout construction spends its time on
    v = _window_columns(v_row, first, slot, col_base, h0, h1)  # [n or 1, NQB, window]
    qbx = qb.int().view(1, nqb, 1)
    keep = slot < _one_or_range(span, h0, h1).unsqueeze(-1)
    if sliding_window is not None:
        keep &= v > qbx * bs - sliding_window  # seen by the first query of the block (the widest window)
    cb = v >> (bs.bit_length() - 1)  # bs is a power of two
    del v
    # The binary search put exactly the columns the block can see in its span, so what is left to drop is those
    # inside a listed block: in the dense range, or on a kept block diagonal (a block before the first visible
    # one can only hold columns that the sliding window drops below).
    keep &= cb < dense_lo.clamp_max(nqb).int().view(1, nqb, 1)  # (FAR: no dense range)
    if diagonals is not None:
        t = diagonals.shape[-1]
        start = diagonal_start[row].view(1, nqb, 1)
        diag = _one_or_range(diagonals[row], h0, h1).unsqueeze(1).expand(n, nqb, -1)
        at = torch.sub(qbx, cb, out=cb).clamp_min_(0).add_(start.clamp_min(0).int()).clamp_max_(t - 1)
        keep = keep & ~(diag.gather(-1, at.long().expand(n, nqb, -1)) & (start >= 0))
    return keep.expand(n, nqb, -1)


def dense_layout(meta: TokenMeta, block_size: int, sliding_window: int | None = None) -> SparseLayout:
    """The exact dense layout of a batch.

    Args:
        meta: the tokens [B, S] (documents, padding); block_size: the layout's block;
        sliding_window: keys `sliding_window` or more tokens before a query are invisible.

    Returns:
        A `SparseLayout` [B, 1, NQB, ...] shared by all heads that lists every block holding a
        visible pair (causal, same document, inside the window), and no columns.
    """
    check_meta("meta", meta, optional=False)
    return build_layout(meta, block_size, dense_tokens=meta.segment != PAD_SEGMENT, sliding_window=sliding_window)


def with_padding_query_blocks(layout: SparseLayout, meta: TokenMeta, q_meta: TokenMeta,
                              anchors: torch.Tensor | None = None) -> SparseLayout:
    """`layout` (built for `meta`'s real tokens) with each query block that holds no real token of `meta` but queries
    that `q_meta` lets see tokens (padding after a row's tokens, `tokens.padding_queries_see_prior_tokens`) given the
    key blocks and columns of the block holding the real token those queries follow (`anchors`, int64 [B, S]: its
    position in the layout's order, -1 for other tokens; by default the last real token before each, in a row in its
    own order): the keys that block's queries attend to (every block of the row's last document where the pattern
    keeps them all), which hold every real token such a padding query sees within the pattern. Any other query block
    keeps its own (the block of a row's last token: its padding queries attend to what its real ones do). Reads nothing
    back to the host."""
    b, s = meta.segment.shape
    bs, nqb = layout.block_size, layout.num_q_blocks
    real_tokens = meta.segment != PAD_SEGMENT
    if anchors is None:
        position = torch.arange(s, device=real_tokens.device).expand(b, s)
        anchors = torch.where(real_tokens, position, -1).cummax(-1).values

    def per_block(x: torch.Tensor, fill) -> torch.Tensor:  # [B, S] -> [B, NQB, bs]
        return torch.nn.functional.pad(x, (0, nqb * bs - s), value=fill).view(b, nqb, bs)

    real = per_block(real_tokens, False).any(-1)
    sees = (q_meta.segment != PAD_SEGMENT) & ~real_tokens
    anchor = per_block(torch.where(sees, anchors.to(sees.device), -1), -1).amax(-1)  # [B, NQB]
    blocks = torch.arange(nqb, device=real.device).expand(b, nqb)
    source = torch.where(~real & (anchor >= 0), anchor // bs, blocks)
    source = source.to(layout.block_cnt.device)[:, None].expand(b, layout.heads, nqb)

    def rows(t: torch.Tensor) -> torch.Tensor:
        index = source if t.dim() == 3 else source[..., None].expand(*source.shape, t.shape[-1])
        return t.expand(b, *t.shape[1:]).gather(2, index)

    return SparseLayout(*(rows(t) for t in layout.tensors()), bs)
