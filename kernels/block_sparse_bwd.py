"""Block-sparse flash-attention backward: the Triton kernels and their launcher.

Given the *final* (out, lse) of the queries (which may cover more keys than this layout, as in a
ring step) and the gradients reaching out and lse, probabilities are recomputed tile by tile as
p = exp(s - lse) and, with delta = rowsum(dout * out) - dlse,

    dv = p^T dout,    ds = p * (dout v^T - delta),    dq = scale * ds k,    dk = scale * ds^T q.

Work is split the FlashAttention-2 way, into two kernels that each own their output rows:

* `_dq_kernel` (query-major, one program per query tile, like the forward) computes dq from the
  listed key blocks and from the vertical columns; it also computes the columns' dk/dv, since a
  column's partner queries are only known from the query side.
* `_dkdv_kernel` (key-major, one program per key tile of one key/value head) computes dk/dv of
  the listed key blocks: it walks the transposed layout (`indexing.key_block_csr`) over every
  query head of its GQA group, accumulating one dk/dv in fp32 registers, so K/V are never
  replicated and no two programs write the same row.

Why not one kernel with atomics (FlashAttention-3 style: key-major with fp32 atomic dq): in Triton
that costs an fp32 atomic per dq element per tile pair (128 x D red.global operations per 128 x
128 tile), which on an H100 competes with the tensor cores for L2 bandwidth, and it would make
every result non-deterministic. Recomputing q k^T and dout v^T in the dq kernel costs 2 extra
matrix products per tile (7 instead of 5) but keeps every block gradient deterministic.

With `Tiles.separate_columns` (a tuning candidate; the launchers keep the columns in the dq loop,
which builds without spilling with the launch's hints) the dq kernel computes the columns' dk/dv
in a second pass over the columns after dq is stored: p and ds are recomputed (2 more products
per column step), but the dq accumulator is no longer live beside the column gradient tiles.

With `Tiles.kv_descriptors` the dq kernel's key-block loop loads its K/V tiles through TMA tensor
descriptors, as the forward's does. With `Tiles.lean_index` (a tuning candidate) the dq kernel's key blocks are
addressed as the forward's are then (`block_sparse_fwd.lean_rows`), and each dk/dv step reads a packed CSR entry
(`indexing.key_block_csr`): its head and query block by a shift and a mask, its rows from the head's base
(`tiles.load_query_rows`).

Both kernels run a layout row's full key blocks (every pair visible) before its partial ones
(`indexing.LayoutSplit`; in the transposed CSR, each key block's full entries first), and the dq
kernel's column steps inside the row's fully visible columns skip the mask too: such steps run no
mask and load no token metadata. A layout entry out of range is never read through
(block 0 stands in, column gathers and atomics are masked) and turns its row's dq into NaN.

Column dk/dv (a column token is listed by many query tiles) are added with fp32 atomics by
default, or (a tuning candidate, `configs.column_tiles`) by a key-major kernel after the dq kernel,
which then leaves them out (`column_bwd`: one atomic flush per chunk of columns and query
segment). `deterministic=True` instead stores each query tile's column gradients in a partial
buffer (query tiles taken in chunks to bound its memory) and sums them per key row in a fixed
order (`_column_sum_kernel`): bitwise reproducible, at the price of the partial traffic. Block
gradients and dq are deterministic in both modes. Accumulation is fp32 throughout; dq, dk, dv
are returned in fp32 (a ring sums them over its steps) or in the inputs' dtype, in transformers'
[B, S, H, D] memory, each written once by its kernel (the columns' fp32 sums seed the dk/dv
kernel's accumulators).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_sparse_fwd import (
    dot_precision,
    kv_descriptors,
    launch_grid,
    lean_rows,
    placeholder_if_empty,
    result_buffer,
)
from .column_bwd import column_grads
from .configs import FP_FUSION, column_check_chunk, column_tiles, compiled, dkdv_tiles, dq_tiles
from .indexing import PACKED_BLOCK_BITS, column_targets, key_block_csr, packed_entries_fit
from .tiles import (
    LOG2E,
    column_step_masked,
    column_step_meta,
    columns_out_of_range,
    full_columns,
    key_block_entry,
    key_block_steps,
    layout_count,
    load_block_step,
    load_column_step,
    load_meta,
    load_query_rows,
    program_tile,
    query_segments,
    query_tile,
    visible,
)

# Partial-buffer memory of the deterministic column gradients (dk and dv together).
DETERMINISTIC_PARTIAL_BYTES = 256 << 20

# How the dq kernel treats the columns' dk/dv.
_NO_COLUMNS, _ATOMIC, _PARTIAL = 0, 1, 2


@triton.jit
def _preprocess_kernel(
    Out, DOut, Lse, DLse, Delta, Lse2,
    stride_ob, stride_oh, stride_os,
    stride_db, stride_dh, stride_ds,
    num_q_heads, q_len,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    """delta = rowsum(dout * out) - dlse, and lse in base-2 units with -inf turned into +inf
    (so that exp2(s - lse2) is 0, never NaN, for queries that saw no key)."""
    pid_bh = tl.program_id(0)
    b = (pid_bh // num_q_heads).to(tl.int64)
    h = (pid_bh % num_q_heads).to(tl.int64)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < q_len
    offs_d = tl.arange(0, BLOCK_D)
    mask = m_ok[:, None] & (offs_d < HEAD_DIM)[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    o = tl.load(Out + b * stride_ob + h * stride_oh + rows * stride_os + offs_d[None, :], mask=mask, other=0.0)
    do = tl.load(DOut + b * stride_db + h * stride_dh + rows * stride_ds + offs_d[None, :], mask=mask, other=0.0)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row = (b * num_q_heads + h) * q_len + offs_m
    if HAS_DLSE:
        delta -= tl.load(DLse + row, mask=m_ok, other=0.0).to(tl.float32)
    lse = tl.load(Lse + row, mask=m_ok, other=float("-inf")).to(tl.float32)
    lse2 = tl.where(lse == float("-inf"), float("inf"), lse * LOG2E)
    tl.store(Delta + row, delta, mask=m_ok)
    tl.store(Lse2 + row, lse2, mask=m_ok)


@triton.jit
def _column_step(q, do, lse2, delta, q_idx, q_seg, ColIdx, lay, max_cols, n_cols, c0, full_lo, full_hi, k_base,
                 v_base, stride_ks, stride_vs, k_len, k_index, k_segment, offs_d, d_ok, qk_scale, window,
                 HAS_WINDOW: tl.constexpr, BLOCK_C: tl.constexpr, PRECISION: tl.constexpr, META_RELOAD: tl.constexpr):
    """One step over a query tile's vertical columns: the columns' slots, tokens, K/V mask (slots in
    use with a token in range) and K tile, and the probabilities p (masked unless the step lies in
    the row's fully visible columns [full_lo, full_hi)) and score gradients ds."""
    offs_c, c_ok, col, kv_mask, k, v = load_column_step(ColIdx, lay, max_cols, n_cols, c0, k_base, v_base,
                                                        stride_ks, stride_vs, k_len, offs_d, d_ok, BLOCK_C)
    p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse2[:, None])
    if column_step_masked(c0, full_lo, full_hi, BLOCK_C):
        k_idx, k_seg = column_step_meta(ColIdx, lay, max_cols, n_cols, c0, col, c_ok, k_len, k_index, k_segment,
                                        BLOCK_C, META_RELOAD)
        vis = visible(q_idx[:, None], q_seg[:, None], k_idx[None, :], k_seg[None, :], window, HAS_WINDOW)
        p = tl.where(vis, p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
    return offs_c, col, kv_mask, k, p, p * (dp - delta[:, None])


@triton.jit
def _add_column_grads(ColDK, ColDV, p, ds, q, do, col, offs_c, offs_d, kv_mask, b, kvh, num_kv_heads, k_len, pid_bh,
                      tile, n_tiles, max_cols, HEAD_DIM: tl.constexpr, COLUMN_GRADS: tl.constexpr,
                      PRECISION: tl.constexpr):
    """One column step's dk/dv, dk without the softmax scale (the dk/dv kernel, which these sums seed,
    applies it once): added atomically to the key rows (`_ATOMIC`), or stored in this query tile's
    partial rows (`_PARTIAL`, `tile` counted from the launch's first tile)."""
    if COLUMN_GRADS == 1:
        dst_rows = (b * num_kv_heads + kvh) * k_len + col.to(tl.int64)
    else:
        dst_rows = (pid_bh.to(tl.int64) * n_tiles + tile) * max_cols + offs_c
    dst = dst_rows[:, None] * HEAD_DIM + offs_d[None, :]
    dv_c = tl.dot(tl.trans(p.to(do.dtype)), do, input_precision=PRECISION)
    dk_c = tl.dot(tl.trans(ds.to(q.dtype)), q, input_precision=PRECISION)
    if COLUMN_GRADS == 1:
        tl.atomic_add(ColDK + dst, dk_c, mask=kv_mask, sem="relaxed")
        tl.atomic_add(ColDV + dst, dv_c, mask=kv_mask, sem="relaxed")
    else:
        tl.store(ColDK + dst, dk_c, mask=kv_mask)
        tl.store(ColDV + dst, dv_c, mask=kv_mask)


@triton.jit
def _dq_kernel(
    Q, K, V, KDesc, VDesc, DOut, Lse2, Delta, DQ, ColDK, ColDV,
    BlockIdx, BlockCnt, FullCnt, ColIdx, ColCnt, ColFull,
    QIndex, QSegment, KIndex, KSegment,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_db, stride_dh, stride_ds,
    stride_gb, stride_gh, stride_gs,
    num_q_heads, num_kv_heads, group, layout_heads, q_len, k_len, num_q_blocks, num_k_blocks, max_blocks, max_cols,
    tile_offset, qk_scale, scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, LAYOUT_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_WINDOW: tl.constexpr, COLUMN_GRADS: tl.constexpr, SEPARATE_COLUMNS: tl.constexpr, PRECISION: tl.constexpr,
    KV_DESCRIPTORS: tl.constexpr, TILE_MAJOR: tl.constexpr, CHECK_CHUNK: tl.constexpr, META_RELOAD: tl.constexpr,
    ROWS_I32: tl.constexpr, WHOLE_ROWS: tl.constexpr,
):
    pid_bh, tile, n_tiles = program_tile(TILE_MAJOR)
    tile += tile_offset
    b, h64, kvh, qb, lay, offs_m, m_ok, offs_d, d_ok = query_tile(
        pid_bh, tile, num_q_heads, group, layout_heads, num_q_blocks, q_len, BLOCK_M, LAYOUT_BLOCK, HEAD_DIM, BLOCK_D
    )
    # `tiles.load_query_rows`, written out: called here, it reorders the fp32 builds' constants (same instructions,
    # another schedule), and q_mask and rows serve the store of dq
    q_mask = m_ok[:, None] & d_ok[None, :]
    rows = offs_m.to(tl.int64)[:, None]
    q = tl.load(Q + b * stride_qb + h64 * stride_qh + rows * stride_qs + offs_d[None, :], mask=q_mask, other=0.0)
    do = tl.load(DOut + b * stride_db + h64 * stride_dh + rows * stride_ds + offs_d[None, :], mask=q_mask, other=0.0)
    row = (b * num_q_heads + h64) * q_len + offs_m
    lse2 = tl.load(Lse2 + row, mask=m_ok, other=float("inf"))
    delta = tl.load(Delta + row, mask=m_ok, other=0.0)
    q_idx, q_seg = load_meta(QIndex + b * q_len, QSegment + b * q_len, offs_m, m_ok)
    q_seg = query_segments(q_seg)

    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    k_index = KIndex + b * k_len
    k_segment = KSegment + b * k_len
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    SUB: tl.constexpr = LAYOUT_BLOCK // BLOCK_N
    n_blocks, blocks_bad = layout_count(BlockCnt, lay, max_blocks)
    n_cols, cols_bad = layout_count(ColCnt, lay, max_cols)
    # an invalid layout row (a count outside its slots, an index out of range): its dq comes out NaN
    bad = blocks_bad | cols_bad | columns_out_of_range(ColIdx, lay, max_cols, n_cols, k_len, CHECK_CHUNK)
    # full key blocks first (no mask, no token metadata), then partial ones (`indexing.split_full_blocks`);
    # one loop with a branch on the step, as in the forward (two loops lost their pipelining)
    n_full = tl.minimum(tl.maximum(tl.load(FullCnt + lay), 0), n_blocks) * SUB
    for i in range(n_blocks * SUB):
        kb_bad, offs_n, n_ok, k, v = load_block_step(BlockIdx, lay, max_blocks, i, k_base, v_base, stride_ks, stride_vs,
                                                     KDesc, VDesc, b.to(tl.int32), kvh.to(tl.int32), k_len,
                                                     num_k_blocks, offs_d, d_ok, SUB, LAYOUT_BLOCK, BLOCK_N, BLOCK_D,
                                                     KV_DESCRIPTORS, ROWS_I32, WHOLE_ROWS)
        bad = bad | kb_bad
        p = tl.exp2(tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale - lse2[:, None])
        if i >= n_full:
            k_idx, k_seg = load_meta(k_index, k_segment, offs_n, n_ok)
            vis = visible(q_idx[:, None], q_seg[:, None], k_idx[None, :], k_seg[None, :], window, HAS_WINDOW)
            p = tl.where(vis, p, 0.0)
        dp = tl.dot(do, tl.trans(v), input_precision=PRECISION)
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)

    full_lo, full_hi = full_columns(ColFull, lay, n_cols)
    for c0 in range(0, n_cols, BLOCK_C):
        offs_c, col, kv_mask, k, p, ds = _column_step(
            q, do, lse2, delta, q_idx, q_seg, ColIdx, lay, max_cols, n_cols, c0, full_lo, full_hi, k_base, v_base,
            stride_ks, stride_vs, k_len, k_index, k_segment, offs_d, d_ok, qk_scale, window, HAS_WINDOW, BLOCK_C,
            PRECISION, META_RELOAD)
        dq += tl.dot(ds.to(k.dtype), k, input_precision=PRECISION)
        if COLUMN_GRADS != 0:
            if not SEPARATE_COLUMNS:
                _add_column_grads(ColDK, ColDV, p, ds, q, do, col, offs_c, offs_d, kv_mask, b, kvh, num_kv_heads, k_len,
                                  pid_bh, tile - tile_offset, n_tiles, max_cols, HEAD_DIM, COLUMN_GRADS,
                                  PRECISION)

    dq_ptr = DQ + b * stride_gb + h64 * stride_gh + rows * stride_gs + offs_d[None, :]
    dq = dq * (scale + tl.where(bad, float("nan"), 0.0))
    tl.store(dq_ptr, dq.to(DQ.dtype.element_ty), mask=q_mask)

    if COLUMN_GRADS != 0:
        if SEPARATE_COLUMNS:
            # a second pass over the columns once dq is stored and its accumulator is dead
            for c0 in range(0, n_cols, BLOCK_C):
                offs_c, col, kv_mask, k, p, ds = _column_step(
                    q, do, lse2, delta, q_idx, q_seg, ColIdx, lay, max_cols, n_cols, c0, full_lo, full_hi, k_base,
                    v_base, stride_ks, stride_vs, k_len, k_index, k_segment, offs_d, d_ok, qk_scale, window,
                    HAS_WINDOW, BLOCK_C, PRECISION, META_RELOAD)
                _add_column_grads(ColDK, ColDV, p, ds, q, do, col, offs_c, offs_d, kv_mask, b, kvh, num_kv_heads, k_len,
                                  pid_bh, tile - tile_offset, n_tiles, max_cols, HEAD_DIM, COLUMN_GRADS,
                                  PRECISION)


@triton.jit
def _dkdv_kernel(
    Q, K, V, DOut, Lse2, Delta, ColDK, ColDV, DK, DV,
    RowPtr, Entries,
    QIndex, QSegment, KIndex, KSegment,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_db, stride_dh, stride_ds,
    stride_gb, stride_gh, stride_gs,
    num_q_heads, num_kv_heads, group, shared_layout, q_len, k_len, num_q_blocks, num_k_blocks,
    qk_scale, scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, LAYOUT_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_COLUMNS: tl.constexpr, PRECISION: tl.constexpr, TILE_MAJOR: tl.constexpr,
    LEAN: tl.constexpr, REP: tl.constexpr, BLOCK_BITS: tl.constexpr, ROWS_I32: tl.constexpr,
    WHOLE_ROWS: tl.constexpr,
):
    if TILE_MAJOR:  # grid (key tiles, B x Hkv): the key tiles of one kv head next to each other
        pid_bk = tl.program_id(1)
        key_tile = tl.program_id(0)
    else:  # grid (B x Hkv, key tiles)
        pid_bk = tl.program_id(0)
        key_tile = tl.program_id(1)
    b = (pid_bk // num_kv_heads).to(tl.int64)
    kvh = pid_bk % num_kv_heads
    offs_n = key_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < k_len
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    kv_mask = n_ok[:, None] & d_ok[None, :]
    kv_rows = offs_n.to(tl.int64)[:, None]
    k = tl.load(K + b * stride_kb + kvh.to(tl.int64) * stride_kh + kv_rows * stride_ks + offs_d[None, :],
                mask=kv_mask, other=0.0)
    v = tl.load(V + b * stride_vb + kvh.to(tl.int64) * stride_vh + kv_rows * stride_vs + offs_d[None, :],
                mask=kv_mask, other=0.0)
    k_idx, k_seg = load_meta(KIndex + b * k_len, KSegment + b * k_len, offs_n, n_ok)
    kb = key_tile * BLOCK_N // LAYOUT_BLOCK

    # a shared layout's entries stand for every head of the group: `rep` heads per entry (with LEAN the constant REP)
    if LEAN:
        rep = REP
    else:
        rep = tl.where(shared_layout != 0, group, 1)
    seg = (b * tl.where(shared_layout != 0, 1, num_kv_heads) + tl.where(shared_layout != 0, 0, kvh)) * num_k_blocks
    seg += kb

    SUB: tl.constexpr = LAYOUT_BLOCK // BLOCK_M
    if HAS_COLUMNS:
        # the columns' share, summed in fp32 by the dq kernel (contiguous [B, Hkv, Sk, D], dk unscaled like
        # this accumulator), seeds the accumulators: read before the loop rather than beside the output
        # tiles after it, where the extra fp32 tiles spilled 144-232 bytes per thread at head_dim 128
        src = ((b * num_kv_heads + kvh) * k_len + kv_rows) * HEAD_DIM + offs_d[None, :]
        dk = tl.load(ColDK + src, mask=kv_mask, other=0.0)
        dv = tl.load(ColDV + src, mask=kv_mask, other=0.0)
    else:
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    q_index = QIndex + b * q_len
    q_segment = QSegment + b * q_len
    per_entry = rep * SUB
    # the segment's full block pairs first (no mask, no token metadata), then its partial ones; one loop
    # with a branch on the step (two loops spilled 88 bytes per thread at head_dim 128 and lost their
    # multi-stage pipelining)
    lo, n_full = key_block_steps(RowPtr, 2 * seg, per_entry)
    _, n_partial = key_block_steps(RowPtr, 2 * seg + 1, per_entry)
    for i in range(n_full + n_partial):
        entry, r = key_block_entry(Entries, lo, i, per_entry)
        if LEAN:  # packed entries (`indexing.key_block_csr`): the head above BLOCK_BITS, the query block below
            h = kvh * group + (entry >> BLOCK_BITS) + r // SUB
            offs_m = (entry & ((1 << BLOCK_BITS) - 1)) * LAYOUT_BLOCK + (r % SUB) * BLOCK_M + tl.arange(0, BLOCK_M)
        else:
            h = (kvh * group + entry // num_q_blocks + r // SUB).to(tl.int64)
            offs_m = (entry % num_q_blocks) * LAYOUT_BLOCK + (r % SUB) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_ok = offs_m < q_len
        q, do, lse2, delta = load_query_rows(Q, DOut, Lse2, Delta, b, h, offs_m, m_ok, offs_d, d_ok, stride_qb,
                                             stride_qh, stride_qs, stride_db, stride_dh, stride_ds, num_q_heads, q_len,
                                             LEAN, ROWS_I32, WHOLE_ROWS)
        p_t = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse2[None, :])
        if i >= n_full:
            q_idx, q_seg = load_meta(q_index, q_segment, offs_m, m_ok)
            vis = visible(q_idx[None, :], query_segments(q_seg)[None, :], k_idx[:, None], k_seg[:, None], window,
                          HAS_WINDOW)
            p_t = tl.where(vis, p_t, 0.0)
        dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
        ds_t = p_t * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :])
        dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)

    dst = b * stride_gb + kvh.to(tl.int64) * stride_gh + kv_rows * stride_gs + offs_d[None, :]
    tl.store(DV + dst, dv.to(DV.dtype.element_ty), mask=kv_mask)
    tl.store(DK + dst, (dk * scale).to(DK.dtype.element_ty), mask=kv_mask)


@triton.jit
def _column_sum_kernel(
    PartDK, PartDV, Order, SortedRow, SegEnd, DK, DV, invalid,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Deterministic column gradients: the first position of each key row's run sums the run's
    partials in sorted order and adds the sum to that row."""
    pos = tl.program_id(0)
    key = tl.load(SortedRow + pos)
    prev = tl.load(SortedRow + pos - 1, mask=pos > 0, other=-1)
    if (key != prev) & (key != invalid):
        offs_d = tl.arange(0, BLOCK_D)
        d_ok = offs_d < HEAD_DIM
        acc_k = tl.zeros([BLOCK_D], dtype=tl.float32)
        acc_v = tl.zeros([BLOCK_D], dtype=tl.float32)
        end = tl.load(SegEnd + pos)
        for e in range(pos, end):
            src = tl.load(Order + e) * HEAD_DIM + offs_d
            acc_k += tl.load(PartDK + src, mask=d_ok, other=0.0)
            acc_v += tl.load(PartDV + src, mask=d_ok, other=0.0)
        dst = key * HEAD_DIM + offs_d
        tl.store(DK + dst, tl.load(DK + dst, mask=d_ok) + acc_k, mask=d_ok)
        tl.store(DV + dst, tl.load(DV + dst, mask=d_ok) + acc_v, mask=d_ok)


def backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    block_idx: torch.Tensor,
    block_cnt: torch.Tensor,
    full_cnt: torch.Tensor,
    partial: torch.Tensor,
    col_idx: torch.Tensor,
    col_cnt: torch.Tensor,
    col_full: torch.Tensor,
    q_index: torch.Tensor,
    q_segment: torch.Tensor,
    k_index: torch.Tensor,
    k_segment: torch.Tensor,
    *,
    scale: float,
    block_size: int,
    window: int | None,
    deterministic: bool,
    grads_in_input_dtype: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the backward kernels; returns (dq, dk, dv) shaped like q, k, v: fp32 and contiguous, or
    with `grads_in_input_dtype` in the inputs' dtype in [B, S, H, D] memory ([B, H, S, D] views),
    as transformers' projections take them back.

    q/k/v/out/dout: unit stride along D; lse (and dlse) contiguous [B, Hq, Sq]; layout and token
    metadata as for `block_sparse_fwd.forward`, with the split's `partial` slots (the dk/dv CSR).
    """
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    dev = q.device
    on_gpu = compiled(dev)
    # every gradient straight in its final form, written once by its kernel; the columns' dk/dv are
    # summed in fp32 first (atomically or in partial sums: `col_dk`, `col_dv`) and seed the dk/dv kernel
    dq, dk, dv = (result_buffer(x, grads_in_input_dtype) for x in (q, k, v))
    if b == 0 or sq == 0 or sk == 0:
        return dq.zero_(), dk.zero_(), dv.zero_()
    has_cols = col_idx.shape[-1] > 0
    if not has_cols:
        col_dk, col_dv = dk, dv  # not read
    elif grads_in_input_dtype:
        col_dk, col_dv = (torch.zeros(b, hk, sk, d, dtype=torch.float32, device=dev) for _ in range(2))
    else:  # fp32 gradients are contiguous [B, Hkv, Sk, D]: the columns' sums start in them
        col_dk, col_dv = dk.zero_(), dv.zero_()

    block_d = triton.next_power_of_2(max(d, 16))
    precision = dot_precision(q.dtype)
    qk_scale = scale * LOG2E.value
    hl, nqb, max_blocks, max_cols = block_idx.shape[1], block_idx.shape[2], block_idx.shape[3], col_idx.shape[3]
    strides = (
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
    )

    nkb = triton.cdiv(sk, block_size)
    block_idx_p, col_idx_p = placeholder_if_empty(block_idx), placeholder_if_empty(col_idx)
    delta = torch.empty(b, hq, sq, dtype=torch.float32, device=dev)
    lse2 = torch.empty_like(delta)
    pre_m = 64 if on_gpu else 32
    _preprocess_kernel[(b * hq, triton.cdiv(sq, pre_m))](
        out, dout, lse, dlse if dlse is not None else lse, delta, lse2,
        out.stride(0), out.stride(1), out.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        hq, sq,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=pre_m, HAS_DLSE=dlse is not None,
    )

    tiles = dq_tiles(block_size, d, on_gpu, q.dtype)
    n_tiles = triton.cdiv(sq, tiles.block_m)

    k_desc, v_desc = kv_descriptors(k, v, tiles.block_n, block_d) if tiles.kv_descriptors else (k, v)

    def launch_dq(first_tile: int, count: int, mode: int, col_dk: torch.Tensor, col_dv: torch.Tensor) -> None:
        _dq_kernel[launch_grid(b * hq, count, tiles)](
            q, k, v, k_desc, v_desc, dout, lse2, delta, dq, col_dk, col_dv,
            block_idx_p, block_cnt, full_cnt, col_idx_p, col_cnt, col_full,
            q_index, q_segment, k_index, k_segment,
            *strides, dq.stride(0), dq.stride(1), dq.stride(2),
            hq, hk, hq // hk, hl, sq, sk, nqb, nkb, max_blocks, max_cols,
            first_tile, qk_scale, scale, window or 0,
            HEAD_DIM=d, BLOCK_D=block_d, LAYOUT_BLOCK=block_size,
            BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_C=tiles.block_c,
            HAS_WINDOW=window is not None, COLUMN_GRADS=mode, SEPARATE_COLUMNS=tiles.separate_columns,
            PRECISION=precision, KV_DESCRIPTORS=k_desc is not k, TILE_MAJOR=tiles.tile_major,
            CHECK_CHUNK=column_check_chunk(on_gpu, tiles.block_c), META_RELOAD=tiles.column_meta_reload,
            **lean_rows(tiles.lean_index and k_desc is k, sk, block_size, d, block_d, k, v),
            num_warps=tiles.num_warps, num_stages=tiles.num_stages, enable_fp_fusion=FP_FUSION,
        )

    if not has_cols:
        launch_dq(0, n_tiles, _NO_COLUMNS, col_dk, col_dv)
    elif not deterministic and (key_major := column_tiles(block_size, d, on_gpu, q.dtype)) is not None:
        launch_dq(0, n_tiles, _NO_COLUMNS, col_dk, col_dv)  # the columns' dq only
        column_grads(q, k, v, dout, lse2, delta, col_idx, col_cnt, col_full, q_index, q_segment, k_index, k_segment,
                     col_dk, col_dv, qk_scale=qk_scale, block_size=block_size, window=window, precision=precision,
                     tiles=key_major)
    elif not deterministic:
        launch_dq(0, n_tiles, _ATOMIC, col_dk, col_dv)
    else:
        per_tile = b * hq * max_cols * d * 4 * 2
        chunk = max(1, min(n_tiles, DETERMINISTIC_PARTIAL_BYTES // per_tile))
        part_dk = torch.empty(b * hq * chunk * max_cols * d, dtype=torch.float32, device=dev)
        part_dv = torch.empty_like(part_dk)
        for t0 in range(0, n_tiles, chunk):
            count = min(chunk, n_tiles - t0)
            launch_dq(t0, count, _PARTIAL, part_dk, part_dv)
            tile_blocks = torch.arange(t0, t0 + count, device=dev) * tiles.block_m // block_size
            sorted_row, order, seg_end, invalid = column_targets(col_idx, col_cnt, tile_blocks, hq, hk, sk)
            _column_sum_kernel[(sorted_row.numel(),)](
                part_dk, part_dv, order, sorted_row, seg_end, col_dk, col_dv, invalid,
                HEAD_DIM=d, BLOCK_D=block_d,
            )

    kv_tiles = dkdv_tiles(block_size, d, on_gpu, q.dtype)
    lean = kv_tiles.lean_index and packed_entries_fit(hq // hk, nqb)
    row_ptr, entries = key_block_csr(block_idx, block_cnt, partial, hq, hk, nkb, packed=lean)
    _dkdv_kernel[launch_grid(b * hk, triton.cdiv(sk, kv_tiles.block_n), kv_tiles)](
        q, k, v, dout, lse2, delta, col_dk, col_dv, dk, dv,
        row_ptr, placeholder_if_empty(entries),
        q_index, q_segment, k_index, k_segment,
        *strides, dk.stride(0), dk.stride(1), dk.stride(2),
        hq, hk, hq // hk, int(hl == 1), sq, sk, nqb, nkb,
        qk_scale, scale, window or 0,
        HEAD_DIM=d, BLOCK_D=block_d, LAYOUT_BLOCK=block_size,
        BLOCK_M=kv_tiles.block_m, BLOCK_N=kv_tiles.block_n,
        HAS_WINDOW=window is not None, HAS_COLUMNS=has_cols, PRECISION=precision, TILE_MAJOR=kv_tiles.tile_major,
        LEAN=lean, REP=hq // hk if lean and hl == 1 else 1, BLOCK_BITS=PACKED_BLOCK_BITS,
        **lean_rows(lean, sq, block_size, d, block_d, q, dout),
        num_warps=kv_tiles.num_warps, num_stages=kv_tiles.num_stages, enable_fp_fusion=FP_FUSION,
    )
    return dq, dk, dv
