"""Block-sparse flash-attention forward: the Triton kernel and its launcher.

One program computes one tile of `block_m` query rows of one (batch row, query head): it streams
the key blocks its layout row lists (in `block_n`-row steps) and then the vertical key columns
(gathered by index, `block_c` at a time), keeping an online softmax in fp32 registers. Query
heads of a GQA group read their shared key/value head directly (no replication). Programs of
the same query tile and consecutive heads run next to each other (with `Tiles.tile_major`, a tuning
candidate, consecutive query tiles of one head: `tiles.program_tile`); query tiles run last-first,
which puts the longest causal rows first.

The kernel can start from an existing (out, lse) pair instead of from nothing ("merge" mode): the
previous result is folded in after the loops as one more online-softmax term (max = its lse, sum =
1, accumulator = its output), so a ring step merges into the running result in the same pass that
computes it; reading it only after the loops keeps its registers free during them. A tile whose
layout row lists nothing returns at once in that mode, leaving the running result untouched (no
load, no store, no rounding).

With `Tiles.kv_descriptors` (off in the launched tiles until timed on a GPU) the key-block loop
loads its K/V tiles through TMA tensor descriptors (one bulk copy per tile on sm_90) where the
tensors allow it (`descriptors_fit`); the columns keep their gathers. With `Tiles.lean_index` (a tuning candidate)
the key-block pointer loads take their rows as FlexAttention's statically shaped kernel does (`lean_rows`).

A layout row's full key blocks (every pair visible) run before its partial ones, and column steps
inside the row's run of fully visible columns skip the mask too (`indexing.LayoutSplit`, computed
once per layout by the caller): such steps run no mask and load no token metadata. A layout
entry out of range (a block past the keys or negative, a column outside the keys, a count outside
the row's slots) is never read through: block 0 stands in and column gathers are masked, and the
row's queries come out NaN (out and lse), a loud result without a host synchronization.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from .configs import FP_FUSION, column_check_chunk, compiled, forward_tiles
from .indexing import INT32_MAX
from .tiles import (
    LN2,
    LOG2E,
    column_step_masked,
    column_step_meta,
    columns_out_of_range,
    full_columns,
    layout_count,
    load_block_step,
    load_column_step,
    load_meta,
    program_tile,
    query_segments,
    query_tile,
    visible,
)


@triton.jit
def _scores(q, k, qk_scale, PRECISION: tl.constexpr):
    """Base-2 scores [M, N] of a query tile against a key tile; an infinite score becomes NaN.

    Only non-finite q or k give an infinite score, and masking uses -inf: a row whose visible
    scores were all -inf would end with l = 0 and come out as a row that saw nothing (out = 0),
    hiding the divergence. As NaN it reaches l and the output (a masked key's score is still
    replaced by -inf afterwards). s * 0 is +-0 for finite s (leaving the scaled score exact) and NaN
    for +-inf: one fused multiply-add per score, where a compare and select would take two
    (IEEE arithmetic, which Triton keeps: no fast-math folding of x * 0).
    """
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION)
    return tl.fma(s, 0.0, s * qk_scale)


@triton.jit
def _online_softmax_step(s, v, m_i, l_i, acc, PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores `s` [M, N] with values `v` [N, D] into (m, l, acc)."""
    m_new = tl.maximum(m_i, tl.max(s, 1))
    # a row that has seen nothing keeps m = -inf; subtracting 0 instead keeps exp2 free of NaN
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_use)
    p = tl.exp2(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_new, l_i, acc


@triton.jit
def _forward_kernel(
    Q, K, V, KDesc, VDesc, Out, Lse,
    BlockIdx, BlockCnt, FullCnt, ColIdx, ColCnt, ColFull,
    QIndex, QSegment, KIndex, KSegment,
    stride_qb, stride_qh, stride_qs,
    stride_kb, stride_kh, stride_ks,
    stride_vb, stride_vh, stride_vs,
    stride_ob, stride_oh, stride_os,
    num_q_heads, group, layout_heads, q_len, k_len, num_q_blocks, num_k_blocks, max_blocks, max_cols,
    qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, LAYOUT_BLOCK: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_C: tl.constexpr,
    HAS_WINDOW: tl.constexpr, MERGE: tl.constexpr, PRECISION: tl.constexpr, KV_DESCRIPTORS: tl.constexpr,
    TILE_MAJOR: tl.constexpr, CHECK_CHUNK: tl.constexpr, META_RELOAD: tl.constexpr, ROWS_I32: tl.constexpr,
    WHOLE_ROWS: tl.constexpr,
):
    pid_bh, tile, n_tiles = program_tile(TILE_MAJOR)
    b, h, kvh, qb, lay, offs_m, m_ok, offs_d, d_ok = query_tile(
        pid_bh, tile, num_q_heads, group, layout_heads, num_q_blocks, q_len, BLOCK_M, LAYOUT_BLOCK, HEAD_DIM, BLOCK_D
    )
    n_blocks, blocks_bad = layout_count(BlockCnt, lay, max_blocks)
    n_cols, cols_bad = layout_count(ColCnt, lay, max_cols)
    # an invalid layout row (a count outside its slots, an index out of range): its queries come out NaN
    bad = blocks_bad | cols_bad | columns_out_of_range(ColIdx, lay, max_cols, n_cols, k_len, CHECK_CHUNK)
    if MERGE:
        if (n_blocks + n_cols == 0) & ~bad:
            return  # nothing to add (a ring step without work here): the running result stays as it is, bit for bit
    q_rows = Q + b * stride_qb + h * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qs
    q = tl.load(q_rows + offs_d[None, :], mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    q_idx, q_seg = load_meta(QIndex + b * q_len, QSegment + b * q_len, offs_m, m_ok)
    q_seg = query_segments(q_seg)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    k_base = K + b * stride_kb + kvh * stride_kh
    v_base = V + b * stride_vb + kvh * stride_vh
    k_index = KIndex + b * k_len
    k_segment = KSegment + b * k_len

    # listed key blocks, `SUB` steps of BLOCK_N rows each: first the full ones (every pair visible),
    # then the partial ones (`indexing.split_full_blocks` ordered them so); full steps run no mask and
    # load no token metadata. One loop with a branch on the step: two loops (full, partial) lost their
    # multi-stage pipelining on sm_90 (Triton 3.9, benchmarks/results/README.md).
    SUB: tl.constexpr = LAYOUT_BLOCK // BLOCK_N
    n_full = tl.minimum(tl.maximum(tl.load(FullCnt + lay), 0), n_blocks) * SUB
    for i in range(n_blocks * SUB):
        kb_bad, offs_n, n_ok, k, v = load_block_step(BlockIdx, lay, max_blocks, i, k_base, v_base, stride_ks, stride_vs,
                                                     KDesc, VDesc, b.to(tl.int32), kvh.to(tl.int32), k_len,
                                                     num_k_blocks, offs_d, d_ok, SUB, LAYOUT_BLOCK, BLOCK_N, BLOCK_D,
                                                     KV_DESCRIPTORS, ROWS_I32, WHOLE_ROWS)
        bad = bad | kb_bad
        s = _scores(q, k, qk_scale, PRECISION)
        if i >= n_full:
            k_idx, k_seg = load_meta(k_index, k_segment, offs_n, n_ok)
            vis = visible(q_idx[:, None], q_seg[:, None], k_idx[None, :], k_seg[None, :], window, HAS_WINDOW)
            s = tl.where(vis, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, PRECISION)

    # vertical columns, gathered by token index; steps inside the row's run of fully visible columns
    # run no mask and load no token metadata
    full_lo, full_hi = full_columns(ColFull, lay, n_cols)
    for c0 in range(0, n_cols, BLOCK_C):
        _, c_ok, col, _, k, v = load_column_step(ColIdx, lay, max_cols, n_cols, c0, k_base, v_base,
                                                 stride_ks, stride_vs, k_len, offs_d, d_ok, BLOCK_C)
        s = _scores(q, k, qk_scale, PRECISION)
        if column_step_masked(c0, full_lo, full_hi, BLOCK_C):
            k_idx, k_seg = column_step_meta(ColIdx, lay, max_cols, n_cols, c0, col, c_ok, k_len, k_index, k_segment,
                                            BLOCK_C, META_RELOAD)
            vis = visible(q_idx[:, None], q_seg[:, None], k_idx[None, :], k_seg[None, :], window, HAS_WINDOW)
            s = tl.where(vis, s, float("-inf"))
        m_i, l_i, acc = _online_softmax_step(s, v, m_i, l_i, acc, PRECISION)

    # Output pointers are built only here, after the loops: a [BLOCK_M, BLOCK_D] pointer tensor live
    # across them would cost two registers per element (the merge reads the previous result here too).
    o_ptr = Out + b * stride_ob + h * stride_oh + offs_m.to(tl.int64)[:, None] * stride_os + offs_d[None, :]
    lse_ptr = Lse + (b * num_q_heads + h) * q_len + offs_m
    o_mask = m_ok[:, None] & d_ok[None, :]
    if MERGE:
        # the previous result is one more softmax term: running max lse_prev (base 2), sum 1, output o_prev
        m_prev = tl.load(lse_ptr, mask=m_ok, other=float("-inf")) * LOG2E
        m_new = tl.maximum(m_i, m_prev)
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_use)
        w_prev = tl.exp2(m_prev - m_use)
        o_prev = tl.load(o_ptr, mask=o_mask, other=0.0).to(tl.float32)
        acc = acc * alpha[:, None] + o_prev * w_prev[:, None]
        l_i = l_i * alpha + w_prev
        m_i = m_new
    l_i += tl.where(bad, float("nan"), 0.0)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    out = acc / l_safe[:, None]
    lse = tl.where(empty, float("-inf"), (m_i + tl.log2(l_safe)) * LN2)
    tl.store(o_ptr, out.to(Out.dtype.element_ty), mask=o_mask)
    tl.store(lse_ptr, lse, mask=m_ok)


def result_buffer(x: torch.Tensor, in_input_dtype: bool) -> torch.Tensor:
    """A result buffer for x [B, H, S, D] (the output of queries x, the gradient of x): fp32 contiguous, or x's dtype in
    [B, S, H, D] memory (what transformers' attention functions return, so no cast or transpose copy follows). The
    launches and the custom ops' fake implementations both take it, so their layouts agree."""
    b, h, s, d = x.shape
    if in_input_dtype:
        return torch.empty(b, s, h, d, dtype=x.dtype, device=x.device).transpose(1, 2)
    return torch.empty(b, h, s, d, dtype=torch.float32, device=x.device)


def placeholder_if_empty(t: torch.Tensor) -> torch.Tensor:
    """Kernels take a real pointer even for a layout without columns or blocks (its counts are all 0)."""
    return t if t.numel() else torch.full((1,), -1, dtype=t.dtype, device=t.device)


def launch_grid(heads: int, n_tiles: int, tiles) -> tuple[int, int]:
    """The grid of a launch over (batch rows x heads, tiles): (B x H, tiles), or with `Tiles.tile_major` (tiles,
    B x H), the tiles of one head next to each other (the query-major kernels read it with
    `tiles.program_tile`)."""
    return (n_tiles, heads) if tiles.tile_major else (heads, n_tiles)


def dot_precision(dtype: torch.dtype) -> str:
    """fp32 inputs get exact fp32 products (the reference's precision), not tf32."""
    return "ieee" if dtype == torch.float32 else "tf32"


def forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_idx: torch.Tensor,
    block_cnt: torch.Tensor,
    full_cnt: torch.Tensor,
    col_idx: torch.Tensor,
    col_cnt: torch.Tensor,
    col_full: torch.Tensor,
    q_index: torch.Tensor,
    q_segment: torch.Tensor,
    k_index: torch.Tensor,
    k_segment: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    scale: float,
    block_size: int,
    window: int | None,
    merge: bool,
) -> None:
    """Launch the forward kernel, writing (or, with `merge`, merging into) `out` and `lse` in place.

    q [B, Hq, Sq, D], k/v [B, Hkv, Sk, D] with unit stride along D; layout tensors contiguous int32
    [B, Hl, NQB, ...], the blocks and the fully visible columns as `indexing.split_layout` gives them
    (block_idx reordered, full_cnt, col_full); q_index/q_segment [B, Sq] and k_index/k_segment [B, Sk]
    contiguous; out
    [B, Hq, Sq, D] (unit stride along D; fp32 when merging), lse contiguous fp32 [B, Hq, Sq].
    """
    b, hq, sq, d = q.shape
    hk, sk = k.shape[1], k.shape[2]
    if sq == 0 or b == 0:
        return
    tiles = forward_tiles(block_size, d, compiled(q.device), q.dtype)
    grid = launch_grid(b * hq, triton.cdiv(sq, tiles.block_m), tiles)
    block_d = triton.next_power_of_2(max(d, 16))
    k_desc, v_desc = kv_descriptors(k, v, tiles.block_n, block_d) if tiles.kv_descriptors else (k, v)
    _forward_kernel[grid](
        q, k, v, k_desc, v_desc, out, lse,
        placeholder_if_empty(block_idx), block_cnt, full_cnt, placeholder_if_empty(col_idx), col_cnt, col_full,
        q_index, q_segment, k_index, k_segment,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        out.stride(0), out.stride(1), out.stride(2),
        hq, hq // hk, block_idx.shape[1], sq, sk, block_idx.shape[2], triton.cdiv(sk, block_size),
        block_idx.shape[3], col_idx.shape[3],
        scale * LOG2E.value, window or 0,
        HEAD_DIM=d, BLOCK_D=block_d, LAYOUT_BLOCK=block_size,
        BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, BLOCK_C=tiles.block_c,
        HAS_WINDOW=window is not None, MERGE=merge, PRECISION=dot_precision(q.dtype),
        KV_DESCRIPTORS=k_desc is not k, TILE_MAJOR=tiles.tile_major,
        CHECK_CHUNK=column_check_chunk(compiled(q.device), tiles.block_c), META_RELOAD=tiles.column_meta_reload,
        **lean_rows(tiles.lean_index and k_desc is k, sk, block_size, d, block_d, k, v),
        num_warps=tiles.num_warps, num_stages=tiles.num_stages, enable_fp_fusion=FP_FUSION,
    )


def lean_rows(lean: bool, length: int, block_size: int, head_dim: int, block_d: int, *tensors: torch.Tensor) -> dict:
    """The row addressing of a `Tiles.lean_index` launch whose steps load `block_size`-row blocks of `tensors`
    ([B, H, S, D] with S = `length`): ROWS_I32, rows offset in int32 from the (batch row, head)'s base, where every
    row's offset fits; WHOLE_ROWS, loads without masks, where the rows fill whole blocks and the head fills the
    tile's lanes. Both False without `lean` (the launchers' addressing)."""
    return {"ROWS_I32": lean and all(length * x.stride(2) + head_dim <= INT32_MAX for x in tensors),
            "WHOLE_ROWS": lean and length % block_size == 0 and head_dim == block_d}


def kv_descriptors(k: torch.Tensor, v: torch.Tensor, block_n: int, block_d: int) -> tuple:
    """TMA tensor descriptors of k and v [B, Hkv, Sk, D] for [1, 1, block_n, block_d] tiles, or k and v
    themselves where descriptors cannot address them (the kernels then load through pointers)."""
    if not descriptors_fit(k, v):
        return k, v
    return tuple(TensorDescriptor.from_tensor(x, [1, 1, block_n, block_d]) for x in (k, v))


def descriptors_fit(*tensors: torch.Tensor) -> bool:
    """Whether TMA tensor descriptors can address these [B, H, S, D] tensors: a 16-byte aligned base,
    16-byte multiples as strides but the last (which is 1), no empty dimension."""
    return all(x.numel() > 0 and x.stride(-1) == 1 and x.data_ptr() % 16 == 0
               and all(st * x.element_size() % 16 == 0 for st in x.stride()[:-1]) for x in tensors)
