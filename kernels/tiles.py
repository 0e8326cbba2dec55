"""Triton device helpers shared by the forward and backward kernels: token metadata and visibility.

Visibility of a (query, key) pair is decided per token from `TokenMeta` (see
`hf_sparse_cp.attention.tokens`): the key is not after the query in the global order, both tokens are in
the same document, the query is not padding, and (with a sliding window) the key is fewer than
`window` tokens back. Building that mask costs token metadata loads and a few integer operations
per score, so each layout row's key blocks come sorted into full ones (all pairs visible, decided
from per-block summaries: `indexing.split_full_blocks`) and partial ones, with the run of its
columns that every query of the block sees (`indexing.full_column_range`), and the kernels run
those steps without any mask: the large majority, away from the diagonal and from document edges.

Global indices are narrowed to int32 once per vector (not per pair): indices past 2**31 - 1 are
clamped, which only ever affects padding (its segment already hides it).
"""

from __future__ import annotations

import triton
import triton.language as tl

# Scores are kept in base-2 units (x * log2(e)) so the softmax uses exp2, the fast hardware path.
# Kernels may only read module globals that are constexpr.
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
INT32_MAX = tl.constexpr(2147483647)


@triton.jit
def load_meta(index_ptr, segment_ptr, offs, ok):
    """Global index (int32) and segment of the tokens at `offs`; out-of-range tokens are padding (-1)."""
    idx = tl.load(index_ptr + offs, mask=ok, other=0)
    idx = tl.minimum(idx, INT32_MAX).to(tl.int32)
    seg = tl.load(segment_ptr + offs, mask=ok, other=-1).to(tl.int32)
    return idx, seg


@triton.jit
def query_segments(seg):
    """Query segments with padding moved to -2, so that no query matches a padding key (-1)."""
    return tl.where(seg < 0, -2, seg)


@triton.jit
def visible(q_idx, q_seg, k_idx, k_seg, window, HAS_WINDOW: tl.constexpr):
    """Visibility of broadcastable query/key operands (query segments from `query_segments`)."""
    vis = (k_idx <= q_idx) & (k_seg == q_seg)
    if HAS_WINDOW:
        vis = vis & (q_idx - k_idx < window)
    return vis


@triton.jit
def program_tile(TILE_MAJOR: tl.constexpr):
    """A query-major program's (batch row x query head) index, its query tile counted from the launch's last
    one, and the launch's number of query tiles. The grid is (B x Hq, tiles): the heads of one query tile run
    next to each other; or with TILE_MAJOR (tiles, B x Hq): the query tiles of one head run next to each other
    (FlexAttention's order), so that the tiles in flight at once walk the same layout diagonals a few key
    blocks apart and read each other's K/V tiles from L2. Either way the last tiles (the longest causal rows)
    start first."""
    if TILE_MAJOR:
        pid_bh = tl.program_id(1)
        n_tiles = tl.num_programs(0)
        tile = n_tiles - 1 - tl.program_id(0)
    else:
        pid_bh = tl.program_id(0)
        n_tiles = tl.num_programs(1)
        tile = n_tiles - 1 - tl.program_id(1)
    return pid_bh, tile, n_tiles


@triton.jit
def query_tile(pid_bh, tile, num_q_heads, group, layout_heads, num_q_blocks, q_len,
               BLOCK_M: tl.constexpr, LAYOUT_BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    """Where a query-major program works: batch row b and query head h (int64 for addressing),
    the shared key/value head, the query block and its layout row, and the tile's rows and
    head-dim lanes with their bounds masks."""
    b = (pid_bh // num_q_heads).to(tl.int64)
    h = pid_bh % num_q_heads
    kvh = (h // group).to(tl.int64)
    lh = tl.where(layout_heads > 1, h, 0)
    qb = tile * BLOCK_M // LAYOUT_BLOCK
    lay = (b * layout_heads + lh) * num_q_blocks + qb
    offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    return b, h.to(tl.int64), kvh, qb, lay, offs_m, offs_m < q_len, offs_d, offs_d < HEAD_DIM


@triton.jit
def load_query_rows(Q, DOut, Lse2, Delta, b, h, offs_m, m_ok, offs_d, d_ok, stride_qb, stride_qh, stride_qs, stride_db,
                    stride_dh, stride_ds, num_q_heads, q_len, LEAN: tl.constexpr, ROWS_I32: tl.constexpr,
                    WHOLE_ROWS: tl.constexpr):
    """What the backward kernels read of query rows `offs_m` of (batch row b, query head h): their Q and dO tiles
    [M, D], and base-2 lse and delta [M] as `block_sparse_bwd._preprocess_kernel` leaves them. Rows outside the
    queries read q = dO = 0, lse2 = +inf (so p = 0) and delta = 0.

    With LEAN (`Tiles.lean_index`, `block_sparse_fwd.lean_rows`) the rows are addressed from the (batch row, head)'s
    int64 base, offset in int32 where they fit (ROWS_I32), and loaded without masks where every row and lane lies
    inside the tensors (WHOLE_ROWS); without it, in 64-bit offsets from the tensors' start, each load beside its
    address (the launched builds' order)."""
    h64 = h.to(tl.int64)
    if LEAN:
        if ROWS_I32:
            rows = offs_m[:, None]
        else:
            rows = offs_m.to(tl.int64)[:, None]
        q_ptr = Q + (b * stride_qb + h64 * stride_qh) + rows * stride_qs + offs_d[None, :]
        do_ptr = DOut + (b * stride_db + h64 * stride_dh) + rows * stride_ds + offs_d[None, :]
        head_row = (b * num_q_heads + h64) * q_len
        lse_ptr = Lse2 + head_row + offs_m
        delta_ptr = Delta + head_row + offs_m
        if WHOLE_ROWS:
            return tl.load(q_ptr), tl.load(do_ptr), tl.load(lse_ptr), tl.load(delta_ptr)
        q_mask = m_ok[:, None] & d_ok[None, :]
        q = tl.load(q_ptr, mask=q_mask, other=0.0)
        do = tl.load(do_ptr, mask=q_mask, other=0.0)
        return q, do, tl.load(lse_ptr, mask=m_ok, other=float("inf")), tl.load(delta_ptr, mask=m_ok, other=0.0)
    q_mask = m_ok[:, None] & d_ok[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    q = tl.load(Q + b * stride_qb + h64 * stride_qh + rows * stride_qs + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DOut + b * stride_db + h64 * stride_dh + rows * stride_ds + offs_d[None, :], mask=q_mask, other=0.0)
    row = (b * num_q_heads + h64) * q_len + offs_m
    lse2 = tl.load(Lse2 + row, mask=m_ok, other=float("inf"))
    delta = tl.load(Delta + row, mask=m_ok, other=0.0)
    return q, do, lse2, delta


@triton.jit
def layout_count(CountPtr, lay, width):
    """The count of layout row `lay` clamped to [0, width], and whether it lay outside (an invalid
    layout, which the kernels turn into NaN rows instead of reading past the row)."""
    n = tl.load(CountPtr + lay)
    return tl.minimum(tl.maximum(n, 0), width), (n < 0) | (n > width)


@triton.jit
def block_step(BlockIdx, lay, max_blocks, i, num_k_blocks, SUB: tl.constexpr, LAYOUT_BLOCK: tl.constexpr,
               BLOCK_N: tl.constexpr):
    """Step `i` over the key blocks that layout row `lay` lists (`SUB` steps of BLOCK_N keys per
    block): the first key of the step, and whether its block index was out of range. An index
    outside [0, num_k_blocks) is read as block 0 (every address stays inside the tensors) and
    flagged: the caller turns its rows into NaN."""
    kb = tl.load(BlockIdx + lay * max_blocks + i // SUB)
    kb_bad = (kb < 0) | (kb >= num_k_blocks)
    return tl.where(kb_bad, 0, kb) * LAYOUT_BLOCK + (i % SUB) * BLOCK_N, kb_bad


@triton.jit
def load_block_step(BlockIdx, lay, max_blocks, i, k_base, v_base, stride_ks, stride_vs, KDesc, VDesc, b, kvh, k_len,
                    num_k_blocks, offs_d, d_ok, SUB: tl.constexpr, LAYOUT_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_D: tl.constexpr, KV_DESCRIPTORS: tl.constexpr, ROWS_I32: tl.constexpr,
                    WHOLE_ROWS: tl.constexpr):
    """`block_step` with its keys' offsets and bounds, and their K and V tiles: masked pointer loads,
    or with KV_DESCRIPTORS through tensor descriptors of K and V ([B, Hkv, Sk, D], blocks [1, 1,
    BLOCK_N, BLOCK_D]; one TMA copy per tile on sm_90, keys past Sk and lanes past D read as zeros).
    `Tiles.lean_index` launches (`lean_rows`) offset the pointer loads' rows from the head's base in int32 where
    they fit (ROWS_I32) and load without masks where every key block is whole and every lane real (WHOLE_ROWS:
    a step's block index is in range or replaced by block 0, so its keys lie inside the tensors)."""
    n0, kb_bad = block_step(BlockIdx, lay, max_blocks, i, num_k_blocks, SUB, LAYOUT_BLOCK, BLOCK_N)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < k_len
    if KV_DESCRIPTORS:
        k = KDesc.load([b, kvh, n0, 0]).reshape(BLOCK_N, BLOCK_D)
        v = VDesc.load([b, kvh, n0, 0]).reshape(BLOCK_N, BLOCK_D)
    elif ROWS_I32 or WHOLE_ROWS:
        if ROWS_I32:
            rows = offs_n[:, None]
        else:
            rows = offs_n.to(tl.int64)[:, None]
        k_ptr = k_base + rows * stride_ks + offs_d[None, :]
        v_ptr = v_base + rows * stride_vs + offs_d[None, :]
        if WHOLE_ROWS:
            k = tl.load(k_ptr)
            v = tl.load(v_ptr)
        else:
            mask = n_ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr, mask=mask, other=0.0)
            v = tl.load(v_ptr, mask=mask, other=0.0)
    else:
        mask = n_ok[:, None] & d_ok[None, :]
        k = tl.load(k_base + offs_n.to(tl.int64)[:, None] * stride_ks + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(v_base + offs_n.to(tl.int64)[:, None] * stride_vs + offs_d[None, :], mask=mask, other=0.0)
    return kb_bad, offs_n, n_ok, k, v


@triton.jit
def load_column_step(ColIdx, lay, max_cols, n_cols, c0, k_base, v_base, stride_ks, stride_vs, k_len, offs_d, d_ok,
                     BLOCK_C: tl.constexpr):
    """The `BLOCK_C` vertical columns of layout row `lay` from slot `c0` on: their slots, which are
    in use with a token inside [0, k_len) (nothing is read or written for a token out of range;
    `columns_out_of_range` flags it), the key tokens, the K/V mask, the gathered K and V rows."""
    offs_c = c0 + tl.arange(0, BLOCK_C)
    in_use = offs_c < n_cols
    col = tl.load(ColIdx + lay * max_cols + offs_c, mask=in_use, other=0)
    in_range = (col >= 0) & (col < k_len)
    c_ok = in_use & in_range
    mask = c_ok[:, None] & d_ok[None, :]
    k = tl.load(k_base + col.to(tl.int64)[:, None] * stride_ks + offs_d[None, :], mask=mask, other=0.0)
    v = tl.load(v_base + col.to(tl.int64)[:, None] * stride_vs + offs_d[None, :], mask=mask, other=0.0)
    return offs_c, c_ok, col, mask, k, v


@triton.jit
def column_step_meta(ColIdx, lay, max_cols, n_cols, c0, col, c_ok, k_len, k_index, k_segment, BLOCK_C: tl.constexpr,
                     RELOAD: tl.constexpr):
    """Token metadata (`load_meta`) of a masked column step's columns: from the step's tokens `col` and their bounds
    `c_ok` (`load_column_step`), or with RELOAD from the row's slots read again here (`Tiles.column_meta_reload`),
    so that the unmasked steps hold the tokens in the K/V gather's layout alone."""
    if RELOAD:
        offs_c = c0 + tl.arange(0, BLOCK_C)
        in_use = offs_c < n_cols
        col = tl.load(ColIdx + lay * max_cols + offs_c, mask=in_use, other=0)
        c_ok = in_use & (col >= 0) & (col < k_len)
    return load_meta(k_index, k_segment, col, c_ok)


@triton.jit
def full_columns(ColFull, lay, n_cols):
    """The slot range [lo, hi) of layout row `lay`'s fully visible columns (`indexing.full_column_range`),
    kept inside the row's slots in use."""
    hi = tl.minimum(tl.load(ColFull + 2 * lay + 1), n_cols)
    return tl.maximum(tl.load(ColFull + 2 * lay), 0), hi


@triton.jit
def column_step_masked(c0, full_lo, full_hi, BLOCK_C: tl.constexpr):
    """Whether the column step from slot `c0` needs the visibility mask: unless all its slots lie in
    the row's run of fully visible columns."""
    return (c0 < full_lo) | (c0 + BLOCK_C > full_hi)


@triton.jit
def columns_out_of_range(ColIdx, lay, max_cols, n_cols, k_len, CHUNK: tl.constexpr):
    """Whether layout row `lay` lists a column outside [0, k_len): one pass over its column slots, `CHUNK`
    per load (`configs.column_check_chunk`), before the column loop, which keeps the check out of that
    loop's registers. Each chunk's load is waited for before the next is issued, at the program's start
    where nothing else runs: a wide chunk reads a row in one round trip."""
    bad = tl.zeros([CHUNK], dtype=tl.int32)
    for c0 in range(0, n_cols, CHUNK):
        offs_c = c0 + tl.arange(0, CHUNK)
        in_use = offs_c < n_cols
        col = tl.load(ColIdx + lay * max_cols + offs_c, mask=in_use, other=0)
        bad |= (in_use & ((col < 0) | (col >= k_len))).to(tl.int32)
    return tl.max(bad, 0) != 0


@triton.jit
def key_block_steps(RowPtr, seg, per_entry):
    """The first entry (int64) of segment `seg` of the key-block CSR and its number of steps of
    `per_entry` each. Only the count within one segment is int32 (at most heads x query blocks x
    sub-steps); an absolute step number `row_ptr * per_entry` passes 2**31 for a dense shared
    layout at 1M tokens with GQA 16."""
    lo = tl.load(RowPtr + seg)
    hi = tl.load(RowPtr + seg + 1)
    return lo, ((hi - lo) * per_entry).to(tl.int32)


@triton.jit
def key_block_entry(Entries, lo, i, per_entry):
    """Step `i` of a segment starting at entry `lo`: its entry and its sub-step within the entry."""
    return tl.load(Entries + lo + i // per_entry), i % per_entry
