"""The vertical columns' dk/dv, key-major: a tuning candidate beside the dq kernel's atomics.

By default the dq kernel (`block_sparse_bwd._dq_kernel`, query-major) adds each column step's dk/dv
with fp32 atomics: 2 x BLOCK_C x D atomics per (query tile, column step), every query tile of a
head hitting the same popular column rows. Here one program per (batch, query head, segment of
`Tiles.query_steps` query tiles) walks the sorted union of its layout head's columns
(`indexing.column_union`) in chunks of BLOCK_C tokens: it gathers a chunk's K/V once, accumulates
the chunk's dk/dv in fp32 registers over the segment's query tiles and flushes them with one
atomic add per element: the atomics shrink by about the number of query tiles per segment.

Which chunk tokens a query tile's layout row lists: the row's columns are ascending (the layout
contract, `SparseLayout`), so a cursor per tile (slots consumed so far) gives the row's first slot
that can meet the chunk; BLOCK_C slots from there hold every listed token of the chunk, matched
against the chunk's tokens. Only the tiles whose row's span in the union (`ColumnUnion.span`) meets
the chunk are walked, in order, found from the segment's span vectors. Pairs are masked as the dq
kernel's column steps mask them (membership and token visibility; no visibility mask inside the
row's fully visible columns).
Slots out of use and tokens out of range are never read through (nothing of them is in the union;
the dq kernel turns such rows' dq into NaN).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .configs import FP_FUSION, Tiles
from .indexing import column_union
from .tiles import (
    INT32_MAX,
    full_columns,
    layout_count,
    load_meta,
    load_query_rows,
    query_segments,
    query_tile,
    visible,
)


@triton.jit
def _column_kernel(
    Q, K, V, DOut, Lse2, Delta, ColDK, ColDV,
    ColIdx, ColCnt, ColFull, Union, UnionCnt, Span,
    QIndex, QSegment, KIndex, KSegment,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_db, stride_dh, stride_ds,
    num_q_heads, num_kv_heads, group, layout_heads, q_len, k_len, num_q_blocks, max_cols, n_tiles,
    qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, LAYOUT_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_C: tl.constexpr, STEPS: tl.constexpr,
    HAS_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
):
    pid_bh = tl.program_id(0)
    t_lo = tl.program_id(1) * STEPS
    b, h, kvh, qb, lay, _, _, offs_d, d_ok = query_tile(pid_bh, t_lo, num_q_heads, group, layout_heads,
                                                        num_q_blocks, q_len, BLOCK_M, LAYOUT_BLOCK, HEAD_DIM, BLOCK_D)
    head = lay - qb  # (b, layout head) row of the union, times num_q_blocks
    uh = head // num_q_blocks
    n_union = tl.load(UnionCnt + uh)
    steps = tl.arange(0, STEPS)
    lays = head + (t_lo + steps) * BLOCK_M // LAYOUT_BLOCK
    s_ok = t_lo + steps < n_tiles
    span_lo = tl.load(Span + 2 * lays, mask=s_ok, other=k_len)
    span_hi = tl.load(Span + 2 * lays + 1, mask=s_ok, other=-1)
    cursor = tl.zeros([STEPS], dtype=tl.int32)  # slots of each tile's row consumed by earlier chunks

    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    k_index = KIndex + b * k_len
    k_segment = KSegment + b * k_len
    q_index = QIndex + b * q_len
    q_segment = QSegment + b * q_len
    # the chunks some row of the segment meets (none for a segment without columns)
    for c0 in range(tl.min(span_lo, 0) // BLOCK_C * BLOCK_C, tl.max(span_hi, 0) + 1, BLOCK_C):
        offs_u = c0 + tl.arange(0, BLOCK_C)
        u_ok = offs_u < n_union
        tok = tl.load(Union + uh * k_len + offs_u, mask=u_ok, other=-1)
        last = tl.max(tok, 0)
        kv_mask = u_ok[:, None] & d_ok[None, :]
        rows = tok.to(tl.int64)[:, None]
        k = tl.load(k_base + rows * stride_ks + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_base + rows * stride_vs + offs_d[None, :], mask=kv_mask, other=0.0)
        dk = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_C, BLOCK_D], dtype=tl.float32)
        # Only the steps whose row meets the chunk, in order (steps past the tiles never meet it). The step
        # comes from a reduction rather than a counter, which also keeps LLVM from strength-reducing every
        # address of a step into an induction pointer of its own, live over the loop (spills in sm_90 builds).
        meets = (span_lo < c0 + BLOCK_C) & (span_hi >= c0)
        i = tl.min(tl.where(meets, steps, STEPS), 0)
        while i < STEPS:
            here = steps == i
            tile = t_lo + i
            row_lay = head + tile * BLOCK_M // LAYOUT_BLOCK
            n_cols = layout_count(ColCnt, row_lay, max_cols)[0]
            s0 = tl.sum(tl.where(here, cursor, 0))
            slots = s0 + tl.arange(0, BLOCK_C)
            # the row's next BLOCK_C slots hold all its listed tokens of this chunk (ascending, and every
            # listed token is in the union); an invalid token before them is consumed, never matched
            listed = tl.load(ColIdx + row_lay * max_cols + slots, mask=slots < n_cols, other=INT32_MAX)
            taken = tl.sum((listed <= last).to(tl.int32), 0)
            cursor = tl.where(here, cursor + taken, cursor)
            member = (tl.max((tok[:, None] == listed[None, :]).to(tl.int32), 1) != 0) & u_ok
            if taken > 0:
                offs_m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
                m_ok = offs_m < q_len
                q, do, lse2, delta = load_query_rows(Q, DOut, Lse2, Delta, b, h, offs_m, m_ok, offs_d, d_ok, stride_qb,
                                                     stride_qh, stride_qs, stride_db, stride_dh, stride_ds, num_q_heads,
                                                     q_len, False, False, False)
                p_t = tl.exp2(tl.dot(k, tl.trans(q), input_precision=PRECISION) * qk_scale - lse2[None, :])
                p_t = tl.where(member[:, None], p_t, 0.0)
                # ds before the visibility mask, masked with p inside the branch: a product whose result reaches
                # another product only through a branch is spread over both warpgroups on sm_90; reaching dk's
                # product directly, dp was computed whole by each warpgroup (32 more registers; spilled at D 128)
                ds_t = p_t * (tl.dot(v, tl.trans(do), input_precision=PRECISION) - delta[None, :])
                full_lo, full_hi = full_columns(ColFull, row_lay, n_cols)
                if (s0 < full_lo) | (s0 + taken > full_hi):
                    q_idx, q_seg = load_meta(q_index, q_segment, offs_m, m_ok)
                    k_idx, k_seg = load_meta(k_index, k_segment, tok, u_ok)  # here: not live over the steps
                    vis = visible(q_idx[None, :], query_segments(q_seg)[None, :], k_idx[:, None], k_seg[:, None],
                                  window, HAS_WINDOW)
                    p_t = tl.where(vis, p_t, 0.0)
                    ds_t = tl.where(vis, ds_t, 0.0)
                dv += tl.dot(p_t.to(do.dtype), do, input_precision=PRECISION)
                dk += tl.dot(ds_t.to(q.dtype), q, input_precision=PRECISION)
            i = tl.min(tl.where(meets & (steps > i), steps, STEPS), 0)
        # dk without the softmax scale, like the dq kernel's column sums (the dk/dv kernel applies it)
        dst = ((b * num_kv_heads + kvh) * k_len + rows) * HEAD_DIM + offs_d[None, :]
        tl.atomic_add(ColDK + dst, dk, mask=kv_mask, sem="relaxed")
        tl.atomic_add(ColDV + dst, dv, mask=kv_mask, sem="relaxed")


def column_grads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dout: torch.Tensor, lse2: torch.Tensor, delta: torch.Tensor,
    col_idx: torch.Tensor, col_cnt: torch.Tensor, col_full: torch.Tensor,
    q_index: torch.Tensor, q_segment: torch.Tensor, k_index: torch.Tensor, k_segment: torch.Tensor,
    col_dk: torch.Tensor, col_dv: torch.Tensor, *,
    qk_scale: float, block_size: int, window: int | None, precision: str, tiles: Tiles,
) -> None:
    """Add the columns' dk (without the softmax scale) and dv into col_dk / col_dv (fp32 contiguous
    [B, Hkv, Sk, D]). lse2 and delta as `block_sparse_bwd._preprocess_kernel` leaves them; layout
    and token metadata as for `block_sparse_bwd.backward` (col_idx with at least one slot)."""
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    union = column_union(col_idx, col_cnt, sk)
    n_tiles = triton.cdiv(sq, tiles.block_m)
    _column_kernel[(b * hq, triton.cdiv(n_tiles, tiles.query_steps))](
        q, k, v, dout, lse2, delta, col_dk, col_dv,
        col_idx, col_cnt, col_full, union.tokens, union.count, union.span,
        q_index, q_segment, k_index, k_segment,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        dout.stride(0), dout.stride(1), dout.stride(2),
        hq, hk, hq // hk, col_idx.shape[1], sq, sk, col_idx.shape[2], col_idx.shape[3], n_tiles,
        qk_scale, window or 0,
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(max(d, 16)), LAYOUT_BLOCK=block_size,
        BLOCK_M=tiles.block_m, BLOCK_C=tiles.block_c, STEPS=tiles.query_steps,
        HAS_WINDOW=window is not None, PRECISION=precision,
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, enable_fp_fusion=FP_FUSION,
    )
