"""Index structures of the kernels, built on the device with torch (no host synchronization).

* `block_summary`: per block of tokens, the range of global indices and of segments, from which a
  kernel decides with four scalar loads (no in-kernel reductions) that a whole tile is visible.
* `key_block_csr`: the layout transposed, for the dK/dV kernel that owns one key block and visits
  every (query head, query block) that lists it. A CSR (row pointers + entries) from one stable
  sort of the listed (query block, key block) pairs: memory and time grow with the listed blocks,
  never with NQB x NKB, so it stays small at 512K tokens and beyond.
* `column_targets`: where the per-query-tile column gradients of the deterministic mode go,
  sorted by target key row so that each key row is summed by one program in a fixed order.
"""

from __future__ import annotations

import torch

INT32_MAX = 2**31 - 1


def block_summary(index: torch.Tensor, segment: torch.Tensor, block_size: int) -> torch.Tensor:
    """int32 [B, ceil(S / block_size), 4]: (min index, max index, min segment, max segment) per block.

    Indices are clamped to int32 like the kernels' own; the missing tokens of a partial last block
    count as padding (segment -1), which makes every tile of that block take the mask.
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


def key_block_csr(
    block_idx: torch.Tensor, block_cnt: torch.Tensor, num_q_heads: int, num_kv_heads: int, num_k_blocks: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per (batch, key-head group, key block) the (query head in group, query block) pairs that list it.

    block_idx [B, Hl, NQB, MB], block_cnt [B, Hl, NQB] (Hl = query heads, or 1 for a shared layout).
    Returns (row_ptr int64 [B * Hs * NKB + 1], entries int32 [B * Hl * NQB * MB]) with Hs = Hkv for
    per-head layouts and 1 for a shared one; segment (b, g, kb) holds entries[row_ptr[s]:row_ptr[s+1]],
    each `head_in_group * NQB + query_block` (head_in_group = 0 for a shared layout, whose entries
    stand for every head of the group), ascending. Row pointers are int64: the entries of a dense
    layout pass 2**31 at 1M tokens with a batch of 2 and 32 heads. A block index outside [0, NKB) is
    left out (the query-major kernels flag it), so no segment gets another head's or batch row's
    block.
    """
    b, hl, nqb, mb = block_idx.shape
    dev = block_idx.device
    group = num_q_heads // num_kv_heads
    seg_heads = num_kv_heads if hl > 1 else 1
    n_seg = b * seg_heads * num_k_blocks
    lh = torch.arange(hl, device=dev).view(1, hl, 1, 1)
    bb = torch.arange(b, device=dev).view(b, 1, 1, 1)
    qb = torch.arange(nqb, device=dev).view(1, 1, nqb, 1)
    valid = (torch.arange(mb, device=dev) < block_cnt.unsqueeze(-1)) & (block_idx >= 0) & (block_idx < num_k_blocks)
    seg = (bb * seg_heads + lh // group) * num_k_blocks + block_idx
    key = torch.where(valid, seg, n_seg).flatten()
    entry = ((lh % group) * nqb + qb).to(torch.int32).expand(b, hl, nqb, mb).flatten()
    sorted_key, order = torch.sort(key, stable=True)
    bounds = torch.arange(n_seg + 1, device=dev)
    return torch.searchsorted(sorted_key, bounds), entry[order]


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
