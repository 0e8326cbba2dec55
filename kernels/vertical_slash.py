"""Vertical-slash pattern scores of one document: the Triton kernels, their launcher, an fp32 reference.

The last R queries of a document of L keys (query r sits at position L - R + r) score every key
of the document: p[r, j] = softmax over the keys j <= L - R + r. The vertical score of key j is
sum_r p[r, j] (the mass the key receives), the slash score of offset o is sum_r p[r, L - R + r - o]
(the mass along that diagonal). Query heads of a GQA group read their shared key head.

Two launches; neither writes the [H, R, L] probabilities to memory:

* `_row_stats_kernel`: per query row and split of the keys, the running max and sum of exp2 of the
  scores (a flash-attention forward without values); the launcher combines the splits into each
  row's log-sum-exp.
* `_scores_kernel`: one program per (query head, key tile of BLOCK keys) recomputes its
  [BLOCK, BLOCK] probability tiles for every row tile. Column sums are the key tile's vertical
  scores. Diagonal sums come from a skew of the tile: `tl.gather` puts p[a, (a - c) mod BLOCK] in
  column c, so that a column sum over a >= c is diagonal a - c = c and one over a < c is
  diagonal c - BLOCK. Key tiles start at an origin chosen so that these diagonals are whole
  BLOCK-wide chunks of offsets; each program stores its chunks, and the launcher adds them up in a
  fixed order.

No atomics anywhere: the scores, hence the selected pattern, are bitwise reproducible from run to
run (they decide which blocks training computes).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .block_sparse_fwd import dot_precision
from .configs import FP_FUSION, compiled, scoring_tiles
from .limits import shared_memory_shortfall
from .tiles import LOG2E

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


@triton.jit
def _row_stats_kernel(
    Q, K, RowMax, RowSum,
    stride_qh, stride_qr, stride_kh, stride_kl,
    rows, keys, group, keys_per_split, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """Base-2 running max and sum of exp2 of one row tile's scores over one split of the keys."""
    h = tl.program_id(0)
    split = tl.program_id(2)
    kvh = h // group
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    m_ok = offs_m < rows
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    q = tl.load(Q + h.to(tl.int64) * stride_qh + offs_m.to(tl.int64)[:, None] * stride_qr + offs_d[None, :],
                mask=m_ok[:, None] & d_ok[None, :], other=0.0)
    pos = keys - rows + offs_m  # the rows' positions among the keys
    k_base = K + kvh.to(tl.int64) * stride_kh
    lo = split * keys_per_split
    hi = tl.minimum(lo + keys_per_split, keys)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in range(lo, hi, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        k = tl.load(k_base + offs_n.to(tl.int64)[:, None] * stride_kl + offs_d[None, :],
                    mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        s = tl.where(n_ok[None, :] & (offs_n[None, :] <= pos[:, None]), s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        l_i = l_i * tl.exp2(m_i - m_use) + tl.sum(tl.exp2(s - m_use[:, None]), 1)
        m_i = m_new
    out = (h * tl.num_programs(2) + split) * rows + offs_m
    tl.store(RowMax + out, m_i, mask=m_ok)
    tl.store(RowSum + out, l_i, mask=m_ok)


@triton.jit
def _scores_kernel(
    Q, K, Lse2, Vertical, Chunks,
    stride_qh, stride_qr, stride_kh, stride_kl,
    rows, keys, group, key_origin, row_tiles, qk_scale,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK: tl.constexpr, PRECISION: tl.constexpr,
):
    """Vertical scores of one key tile and its diagonal chunks (see the module docstring).

    Chunk slot s of program (h, kt) holds offsets [(M0 + s - 1 - kt) * BLOCK, +BLOCK), with
    M0 * BLOCK = keys - rows - key_origin: slot s gathers the upper diagonals of row tile s and the
    lower ones of row tile s - 1.
    """
    h = tl.program_id(0)
    kt = tl.program_id(1)
    kvh = h // group
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    offs_n = key_origin + kt * BLOCK + tl.arange(0, BLOCK)
    n_ok = (offs_n >= 0) & (offs_n < keys)
    k = tl.load(K + kvh.to(tl.int64) * stride_kh + offs_n.to(tl.int64)[:, None] * stride_kl + offs_d[None, :],
                mask=n_ok[:, None] & d_ok[None, :], other=0.0)
    a = tl.arange(0, BLOCK)[:, None]
    c = tl.arange(0, BLOCK)[None, :]
    skew = (a - c + BLOCK) % BLOCK
    lower = a >= c
    vertical = tl.zeros([BLOCK], dtype=tl.float32)
    carry = tl.zeros([BLOCK], dtype=tl.float32)
    chunk_base = Chunks + (h.to(tl.int64) * tl.num_programs(1) + kt) * ((row_tiles + 1) * BLOCK)
    q_base = Q + h.to(tl.int64) * stride_qh
    for i in range(row_tiles):
        offs_m = i * BLOCK + tl.arange(0, BLOCK)
        m_ok = offs_m < rows
        q = tl.load(q_base + offs_m.to(tl.int64)[:, None] * stride_qr + offs_d[None, :],
                    mask=m_ok[:, None] & d_ok[None, :], other=0.0)
        lse2 = tl.load(Lse2 + h * rows + offs_m, mask=m_ok, other=float("inf"))
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * qk_scale
        vis = m_ok[:, None] & n_ok[None, :] & (offs_n[None, :] <= (keys - rows + offs_m)[:, None])
        p = tl.where(vis, tl.exp2(s - lse2[:, None]), 0.0)
        vertical += tl.sum(p, 0)
        g = tl.gather(p, skew, 1)
        tl.store(chunk_base + i * BLOCK + tl.arange(0, BLOCK), carry + tl.sum(tl.where(lower, 0.0, g), 0))
        carry = tl.sum(tl.where(lower, g, 0.0), 0)
    tl.store(chunk_base + row_tiles * BLOCK + tl.arange(0, BLOCK), carry)
    tl.store(Vertical + h * keys + offs_n, vertical, mask=n_ok)


def supports(q_rows: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether the compiled kernels take these inputs (CUDA, one dtype among fp16/bf16/fp32, D <= 256) on their GPU
    (`limits.shared_memory_shortfall`)."""
    return (q_rows.is_cuda and q_rows.dtype in SUPPORTED_DTYPES and k.dtype == q_rows.dtype
            and q_rows.shape[-1] <= MAX_HEAD_DIM and shared_memory_shortfall(q_rows.device, q_rows.shape[-1]) is None)


def vertical_slash_scores(q_rows: torch.Tensor, k: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical and slash scores of one document, fp32 ([Hq, L] each).

    q_rows: [Hq, R, D], the document's last R queries (R <= L); k: [Hkv, L, D], its keys (Hq a
    multiple of Hkv; any strides with unit stride along D). Returns (vertical, slash) with
    vertical[h, j] the softmax mass key j receives from the R queries and slash[h, o] the mass on
    offset o = query position - key position. Runs on CUDA tensors, or on CPU tensors inside
    Triton's interpreter (`hf_sparse_cp.testing.interpreter.interpreter_pool`).
    """
    hq, r, d = q_rows.shape
    hk, l, dk = k.shape
    if dk != d or hq % hk or not 0 < r <= l:
        raise ValueError(f"expected q_rows [Hq, R, D] and k [Hkv, L, D] with Hq a multiple of Hkv and 0 < R <= L; got "
                         f"{tuple(q_rows.shape)} and {tuple(k.shape)}.")
    if k.dtype != q_rows.dtype or q_rows.dtype not in SUPPORTED_DTYPES or d > MAX_HEAD_DIM:
        raise ValueError(f"the scoring kernels take one dtype among {SUPPORTED_DTYPES} and head_dim <= {MAX_HEAD_DIM};"
                         f" got {q_rows.dtype}/{k.dtype}, head_dim {d}.")
    q_rows = q_rows if q_rows.stride(-1) == 1 else q_rows.contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    dev = q_rows.device
    tiles = scoring_tiles(compiled(dev), q_rows.dtype)
    block, per_split = tiles.block, tiles.keys_per_split
    block_d = triton.next_power_of_2(max(d, 16))
    qk_scale = scale * LOG2E.value
    precision = dot_precision(q_rows.dtype)
    strides = (q_rows.stride(0), q_rows.stride(1), k.stride(0), k.stride(1))

    n_splits = triton.cdiv(l, per_split)
    row_max = torch.empty(hq, n_splits, r, dtype=torch.float32, device=dev)
    row_sum = torch.empty_like(row_max)
    _row_stats_kernel[(hq, triton.cdiv(r, tiles.block_m), n_splits)](
        q_rows, k, row_max, row_sum, *strides, r, l, hq // hk, per_split, qk_scale,
        HEAD_DIM=d, BLOCK_D=block_d, BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n, PRECISION=precision,
        num_warps=tiles.num_warps, num_stages=tiles.stats_stages, enable_fp_fusion=FP_FUSION,
    )
    top = row_max.amax(1)  # finite: every row sees the document's first key, which lies in split 0
    lse2 = top + torch.log2((row_sum * torch.exp2(row_max - top.unsqueeze(1))).sum(1))

    # key tiles start at key_origin in (-block, 0], congruent to L - R, so that diagonal chunks align
    key_origin = -((r - l) % block)
    n_key_tiles = triton.cdiv(l - key_origin, block)
    row_tiles = triton.cdiv(r, block)
    vertical = torch.empty(hq, l, dtype=torch.float32, device=dev)
    chunks = torch.empty(hq, n_key_tiles, row_tiles + 1, block, dtype=torch.float32, device=dev)
    _scores_kernel[(hq, n_key_tiles)](
        q_rows, k, lse2.contiguous(), vertical, chunks, *strides, r, l, hq // hk, key_origin, row_tiles,
        qk_scale, HEAD_DIM=d, BLOCK_D=block_d, BLOCK=block, PRECISION=precision,
        num_warps=tiles.num_warps, num_stages=1, enable_fp_fusion=FP_FUSION,
    )
    return vertical, fold_diagonal_chunks(chunks, l - r - key_origin, l)


def fold_diagonal_chunks(chunks: torch.Tensor, first_chunk_offset: int, length: int) -> torch.Tensor:
    """Slash scores [H, length] from the per-program diagonal chunks [H, KT, S, BLOCK] of `_scores_kernel`.

    Slot s of key tile kt covers offsets from (M0 + s - 1 - kt) * BLOCK, where M0 * BLOCK =
    `first_chunk_offset`; chunks at negative offsets hold no visible pair and are dropped. Slots are
    added in a fixed order (deterministic).
    """
    h, n_kt, n_slots, block = chunks.shape
    m0 = first_chunk_offset // block
    # index m + n_kt of `acc` is the chunk of offsets [m * block, (m + 1) * block)
    acc = torch.zeros(h, m0 + n_kt + n_slots - 1, block, dtype=chunks.dtype, device=chunks.device)
    for s in range(n_slots):
        acc[:, m0 + s : m0 + s + n_kt] += chunks[:, :, s].flip(1)
    return acc[:, n_kt:].flatten(1)[:, :length]
