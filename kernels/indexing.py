"""Index structures of the kernels, built on the device with torch (no host synchronization).

* `block_summary`: per block of tokens, the range of global indices and of segments, from which
  `split_full_blocks` decides that every pair of a (query block, key block) is visible.
* `split_full_blocks`: each layout row's key blocks reordered into full ones (every pair visible)
  first and partial ones after, with the count of full ones, so that the kernels' full-block loop
  carries no mask and no metadata loads.
* `full_column_range`: per layout row, the run of column slots that every query of the block sees,
  so that the column loops skip the mask and the columns' metadata loads there.
* `split_layout`: both, as the kernels take them (`LayoutSplit`); `hf_sparse_cp.attention` computes
  it once per layout and token metadata and keeps it on the layout.
* `key_block_csr`: the layout transposed, for the dK/dV kernel that owns one key block and visits
  every (query head, query block) that lists it. A CSR (row pointers + entries) from one stable
  sort of the listed (query block, key block) pairs: memory and time grow with the listed blocks,
  never with NQB x NKB, so it stays small at 512K tokens and beyond.
* `column_targets`: where the per-query-tile column gradients of the deterministic mode go,
  sorted by target key row so that each key row is summed by one program in a fixed order.
* `column_union`: per (batch, layout head) the sorted union of the listed columns, and each layout
  row's span in it, for the key-major column kernel (`column_bwd`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

INT32_MAX = 2**31 - 1
# A packed key-block CSR entry (`key_block_csr(packed=True)`): the query head in its group above this many bits,
# the query block below them; heads per group up to 2**(31 - bits), query blocks up to 2**bits.
PACKED_BLOCK_BITS = 24
# Elements of one head chunk's [B, heads, NQB, slots] temporaries in `full_column_range`.
_CHUNK_ELEMENTS = 1 << 24


def block_summary(index: torch.Tensor, segment: torch.Tensor, block_size: int) -> torch.Tensor:
    """int32 [B, ceil(S / block_size), 4]: (min index, max index, min segment, max segment) per block.

    Indices are clamped to int32 like the kernels' own; the missing tokens of a partial last block
    count as padding (segment -1), which makes every block pair with that block partial.
    """
    b, s = index.shape
    n = -(-s // block_size)
    pad = n * block_size - s
    idx = index.clamp(max=INT32_MAX).to(torch.int32)
    seg = segment.to(torch.int32)
    if pad:
        idx = torch.nn.functional.pad(idx, (0, pad), value=0)
        seg = torch.nn.functional.pad(seg, (0, pad), value=-1)
    idx, seg = idx.view(b, n, block_size), seg.view(b, n, block_size)
    return torch.stack([idx.amin(-1), idx.amax(-1), seg.amin(-1), seg.amax(-1)], -1).contiguous()


def split_full_blocks(
    block_idx: torch.Tensor,
    block_cnt: torch.Tensor,
    q_summary: torch.Tensor,
    k_summary: torch.Tensor,
    window: int | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each layout row's listed key blocks, full ones first (every (query, key) pair of the block pair
    visible: one document without padding, keys at or before the earliest query, inside the window),
    partial ones after, each part in the layout's order.

    block_idx [B, Hl, NQB, MB], block_cnt [B, Hl, NQB]; summaries from `block_summary` of the
    queries [B, NQB, 4] and keys [B, NKB, 4]. Returns (block_idx reordered, int32 contiguous;
    full_cnt int32 [B, Hl, NQB]; partial bool [B, Hl, NQB, MB] of the reordered slots in use). A
    block index out of range counts as partial (the masked loop flags it). No host synchronization.
    """
    b, hl, nqb, mb = block_idx.shape
    nkb = k_summary.shape[1]
    in_use = torch.arange(mb, device=block_idx.device) < block_cnt.unsqueeze(-1)
    in_range = (block_idx >= 0) & (block_idx < nkb)
    kb = torch.where(in_range, block_idx, 0).long().flatten(1)  # [B, Hl * NQB * MB]
    k_summary = k_summary if nkb else k_summary.new_zeros(b, 1, 4)  # no keys: every index is out of range
    k = torch.gather(k_summary.long(), 1, kb.unsqueeze(-1).expand(-1, -1, 4)).view(b, hl, nqb, mb, 4)
    q = q_summary.long().view(b, 1, nqb, 1, 4)
    q_lo, q_hi, q_seg_lo, q_seg_hi = q.unbind(-1)
    k_lo, k_hi, k_seg_lo, k_seg_hi = k.unbind(-1)
    partial = (q_seg_lo != q_seg_hi) | (k_seg_lo != k_seg_hi) | (k_seg_lo != q_seg_lo) | (q_seg_lo < 0)
    partial = partial | (k_hi > q_lo) | ~in_range
    if window is not None:
        partial = partial | (q_hi - k_lo >= window)
    full = in_use & ~partial
    part = in_use & partial
    full_cnt = full.sum(-1, dtype=torch.int32)
    # a permutation of the slots: full ones, then partial ones, then the unused ones
    pos = torch.where(full, full.cumsum(-1) - 1,
                      torch.where(part, full_cnt.unsqueeze(-1) + part.cumsum(-1) - 1,
                                  in_use.sum(-1, keepdim=True) + (~in_use).cumsum(-1) - 1))
    order = torch.empty_like(pos).scatter_(-1, pos, torch.arange(mb, device=pos.device).expand_as(pos))
    return block_idx.gather(-1, order).contiguous(), full_cnt, part.gather(-1, order)


def full_column_range(
    col_idx: torch.Tensor,
    col_cnt: torch.Tensor,
    q_summary: torch.Tensor,
    k_index: torch.Tensor,
    k_segment: torch.Tensor,
    window: int | None,
) -> torch.Tensor:
    """Per layout row, the first run of column slots whose columns every query of the block sees
    (one document without padding among the queries, the column in it at or before the earliest
    query, inside the window): int32 [B, Hl, NQB, 2] holding [lo, hi), empty as [0, 0).

    col_idx [B, Hl, NQB, MC], col_cnt [B, Hl, NQB]; q_summary from `block_summary` of the queries
    [B, NQB, 4]; k_index / k_segment [B, Sk]. Ascending columns give one run: without documents or a
    window, every column before the block (only those inside the diagonal block stay masked).
    Slots out of use and columns outside [0, Sk) are never in the run. The slots keep their order
    (no copy of the column lists). No host synchronization.
    """
    b, hl, nqb, mc = col_idx.shape
    dev = col_idx.device
    out = torch.zeros(b, hl, nqb, 2, dtype=torch.int32, device=dev)
    sk = k_index.shape[1]
    if mc == 0 or sk == 0 or nqb == 0:
        return out
    k_idx = k_index.clamp(max=INT32_MAX).to(torch.int32)
    k_seg = k_segment.to(torch.int32)
    q_lo, q_hi, q_seg_lo, q_seg_hi = q_summary.view(b, 1, nqb, 1, 4).unbind(-1)
    one_doc = (q_seg_lo == q_seg_hi) & (q_seg_lo >= 0)
    slot = torch.arange(mc, device=dev)
    step = max(1, _CHUNK_ELEMENTS // max(1, b * nqb * mc))
    for h0 in range(0, hl, step):
        col = col_idx[:, h0:h0 + step]
        in_use = (slot < col_cnt[:, h0:h0 + step].unsqueeze(-1)) & (col >= 0) & (col < sk)
        flat = torch.where(in_use, col, 0).long().flatten(1)
        c_idx = torch.gather(k_idx, 1, flat).view(col.shape)
        c_seg = torch.gather(k_seg, 1, flat).view(col.shape)
        full = in_use & one_doc & (c_seg == q_seg_lo) & (c_idx <= q_lo)
        if window is not None:
            full &= q_hi.long() - c_idx.long() < window
        lo = torch.where(full, slot, mc).amin(-1)
        hi = torch.where(~full & (slot > lo.unsqueeze(-1)), slot, mc).amin(-1)
        out[:, h0:h0 + step] = torch.stack([torch.where(lo < mc, lo, 0), torch.where(lo < mc, hi, 0)], -1).to(
            torch.int32)
    return out


class LayoutSplit(NamedTuple):
    """A layout in the form the kernels take it: which of each row's listed keys need the visibility
    mask. From `split_layout`; depends on the layout, the token metadata and the window only.

    block_idx: int32 [B, Hl, NQB, MB], each row's key blocks, full ones first (`split_full_blocks`).
    full_cnt: int32 [B, Hl, NQB], the row's full blocks.
    partial: bool [B, Hl, NQB, MB], the reordered slots in use that are partial (the dk/dv CSR).
    col_full: int32 [B, Hl, NQB, 2], the slot range of fully visible columns (`full_column_range`).
    """

    block_idx: torch.Tensor
    full_cnt: torch.Tensor
    partial: torch.Tensor
    col_full: torch.Tensor


def split_layout(
    block_idx: torch.Tensor,
    block_cnt: torch.Tensor,
    col_idx: torch.Tensor,
    col_cnt: torch.Tensor,
    q_index: torch.Tensor,
    q_segment: torch.Tensor,
    k_index: torch.Tensor,
    k_segment: torch.Tensor,
    block_size: int,
    window: int | None,
) -> LayoutSplit:
    """The full/partial split of a layout (tensors as `block_sparse_fwd.forward` takes them) for these
    queries and keys: what the kernels read to leave the mask out where every pair is visible."""
    q_summary = block_summary(q_index, q_segment, block_size)
    k_summary = block_summary(k_index, k_segment, block_size)
    blocks, full_cnt, partial = split_full_blocks(block_idx, block_cnt, q_summary, k_summary, window)
    return LayoutSplit(blocks, full_cnt, partial,
                       full_column_range(col_idx, col_cnt, q_summary, k_index, k_segment, window))


def key_block_csr(
    block_idx: torch.Tensor,
    block_cnt: torch.Tensor,
    partial: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    num_k_blocks: int,
    packed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (batch, key-head group, key block) the (query head in group, query block) pairs that list
    it, those of full block pairs first.

    block_idx [B, Hl, NQB, MB], block_cnt [B, Hl, NQB] (Hl = query heads, or 1 for a shared layout),
    partial [B, Hl, NQB, MB] (from `split_full_blocks`). Returns (row_ptr int64 [2 * B * Hs * NKB +
    1], entries int32 [B * Hl * NQB * MB]) with Hs = Hkv for per-head layouts and 1 for a shared one;
    segment s = (b, g, kb) holds its full entries in entries[row_ptr[2s]:row_ptr[2s+1]] and its
    partial ones in entries[row_ptr[2s+1]:row_ptr[2s+2]], each `head_in_group * NQB + query_block`
    (head_in_group = 0 for a shared layout, whose entries stand for every head of the group),
    ascending; with `packed`, `head_in_group << PACKED_BLOCK_BITS | query_block` instead (the same order; the
    caller checks that both fit: `packed_entries_fit`). Row pointers are int64: the entries of a dense
    layout pass 2**31 at 1M tokens with a batch of 2 and 32 heads. A block index outside [0, NKB) is
    left out (the query-major kernels flag it), so no segment gets another head's or batch row's
    block.
    """
    b, hl, nqb, mb = block_idx.shape
    dev = block_idx.device
    group = num_q_heads // num_kv_heads
    seg_heads = num_kv_heads if hl > 1 else 1
    n_seg = b * seg_heads * num_k_blocks
    # The sort keys, their sorted copy and the sort's order are a transient of every backward call over the whole
    # layout: int32 keys wherever they fit (2 * n_seg < 2**31: 1M tokens in blocks of 64 with a batch of 32 and
    # 32 key heads), and nothing else held across the sort (int64 keys held 42 bytes per layout slot, 20 now).
    key_dtype = torch.int32 if 2 * n_seg < INT32_MAX else torch.int64
    lh = torch.arange(hl, device=dev).view(1, hl, 1, 1)
    bb = torch.arange(b, device=dev, dtype=key_dtype).view(b, 1, 1, 1)
    qb = torch.arange(nqb, device=dev).view(1, 1, nqb, 1)
    valid = (torch.arange(mb, device=dev) < block_cnt.unsqueeze(-1)) & (block_idx >= 0) & (block_idx < num_k_blocks)
    seg = (bb * seg_heads + (lh // group).to(key_dtype)) * num_k_blocks + block_idx.to(key_dtype)
    key = torch.where(valid, 2 * seg + partial, 2 * n_seg).flatten()
    del seg, valid
    sorted_key, order = torch.sort(key, stable=True)
    del key
    head = (lh % group) << PACKED_BLOCK_BITS if packed else (lh % group) * nqb
    entry = (head + qb).to(torch.int32).expand(b, hl, nqb, mb).reshape(-1)[order]
    del order
    bounds = torch.arange(2 * n_seg + 1, device=dev, dtype=key_dtype)
    return torch.searchsorted(sorted_key, bounds), entry


def packed_entries_fit(group: int, num_q_blocks: int) -> bool:
    """Whether packed key-block CSR entries (`key_block_csr`) can hold `group` heads per key head and
    `num_q_blocks` query blocks in an int32."""
    return group <= 1 << (31 - PACKED_BLOCK_BITS) and num_q_blocks <= 1 << PACKED_BLOCK_BITS


def column_targets(
    col_idx: torch.Tensor,
    col_cnt: torch.Tensor,
    tile_blocks: torch.Tensor,
    num_q_heads: int,
    num_kv_heads: int,
    k_len: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Sorted key rows of the column-gradient partials of some query tiles.

    Partial row ((b * Hq + h) * T + t) * MC + slot holds the gradient that query head h, query tile
    t (of query block `tile_blocks[t]`) sends to its column `slot`. Returns (sorted_row int64: the
    flat key row b * Hkv * Sk + kv_head * Sk + token, or `invalid` for unused slots; order int64:
    the partial row of each sorted position; seg_end int32: one past the last position with the
    same key row; invalid). Slots holding a token outside [0, k_len) count as unused (no write
    outside the gradient rows; the dq kernel flags them).
    """
    b, hl, _, mc = col_idx.shape
    dev = col_idx.device
    heads = torch.arange(num_q_heads, device=dev) if hl > 1 else torch.zeros(num_q_heads, dtype=torch.long, device=dev)
    cols = col_idx[:, heads][:, :, tile_blocks].long()  # [B, Hq, T, MC]
    cnt = col_cnt[:, heads][:, :, tile_blocks]
    valid = (torch.arange(mc, device=dev) < cnt.unsqueeze(-1)) & (cols >= 0) & (cols < k_len)
    kv_head = torch.arange(num_q_heads, device=dev) // (num_q_heads // num_kv_heads)
    base = (torch.arange(b, device=dev).view(b, 1, 1, 1) * num_kv_heads + kv_head.view(1, -1, 1, 1)) * k_len
    invalid = b * num_kv_heads * k_len
    rows = torch.where(valid, base + cols, invalid).flatten()
    sorted_row, order = torch.sort(rows, stable=True)
    seg_end = torch.searchsorted(sorted_row, sorted_row, right=True).to(torch.int32)
    return sorted_row, order, seg_end, invalid


class ColumnUnion(NamedTuple):
    """The columns of each (batch row, layout head) as the key-major column kernel walks them.

    tokens: int32 [B, Hl, Sk], the key tokens some layout row of the head lists, ascending (then
        unused slots); count: int32 [B, Hl], how many.
    span: int32 [B, Hl, NQB, 2], the positions in `tokens` of each row's first and last listed column
        ([Sk, -1] for a row without any).
    """

    tokens: torch.Tensor
    count: torch.Tensor
    span: torch.Tensor


def column_union(col_idx: torch.Tensor, col_cnt: torch.Tensor, k_len: int) -> ColumnUnion:
    """`ColumnUnion` of a layout's columns (col_idx [B, Hl, NQB, MC] with MC > 0, col_cnt [B, Hl, NQB];
    k_len > 0) from a flag per key token: memory and time linear in the layout and Sk (the layout's
    int64 temporaries in head chunks), static shapes, no host synchronization. Slots out of use and
    tokens outside [0, k_len) are left out (the dq kernel flags them)."""
    b, hl, nqb, mc = col_idx.shape
    dev = col_idx.device
    flags = torch.zeros(b, hl, k_len + 1, dtype=torch.bool, device=dev)  # k_len: the spare flag of unused slots
    first = torch.empty(b, hl, nqb, dtype=torch.int32, device=dev)
    last = torch.empty_like(first)
    slot = torch.arange(mc, device=dev)
    step = max(1, _CHUNK_ELEMENTS // (b * nqb * mc))
    for h0 in range(0, hl, step):
        col = col_idx[:, h0:h0 + step]
        valid = (slot < col_cnt[:, h0:h0 + step].unsqueeze(-1)) & (col >= 0) & (col < k_len)
        listed = torch.where(valid, col, k_len)
        flags[:, h0:h0 + step].scatter_(-1, listed.long().flatten(2), True)
        first[:, h0:h0 + step] = listed.amin(-1)
        last[:, h0:h0 + step] = torch.where(valid, col, -1).amax(-1)
    flags[..., k_len] = False
    rank = flags.cumsum(-1, dtype=torch.int32)  # a listed token's position in the union, plus one
    pos = torch.where(flags, rank.long() - 1, k_len)  # tokens not listed land in the spare slot
    tokens = torch.zeros(b, hl, k_len + 1, dtype=torch.int32, device=dev)
    tokens.scatter_(-1, pos, torch.arange(k_len + 1, dtype=torch.int32, device=dev).expand_as(pos))
    any_col = last >= 0
    span = torch.stack([torch.where(any_col, rank.gather(-1, first.long()) - 1, k_len),
                        torch.where(any_col, rank.gather(-1, last.clamp_min(0).long()) - 1, -1)], -1)
    return ColumnUnion(tokens[..., :k_len].contiguous(), rank[..., k_len].contiguous(), span.to(torch.int32))
