"""Synthetic layouts and queries/keys with planted structure, for tests and benchmarks (the random
vertical-slash layouts the simulator predicts are `hf_sparse_cp.simulator.workloads`')."""

from __future__ import annotations

import torch

from ..attention.layout import SparseLayout, compact_sorted


def random_layout(
    batch: int,
    heads: int,
    q_len: int,
    k_len: int,
    block_size: int,
    block_density: float,
    col_density: float = 0.05,
    *,
    causal: bool = True,
    generator: torch.Generator | None = None,
) -> SparseLayout:
    """Arbitrary per-query-block key blocks and columns (no structure), each kept with the given density;
    columns by default, as the estimated layouts have them (`col_density=0` for a block-only layout).

    With `causal`, only key blocks up to the query block's own index are drawn, the diagonal block
    is always listed, and columns lie before the query block.
    """
    nqb, nkb = -(-q_len // block_size), -(-k_len // block_size)
    qb = torch.arange(nqb).view(1, 1, -1, 1)
    kb = torch.arange(nkb).view(1, 1, 1, -1)
    keep = torch.rand(batch, heads, nqb, nkb, generator=generator) < block_density
    if causal:
        keep = (keep & (kb <= qb)) | (kb == qb)
    block_idx, block_cnt = compact_sorted(kb.expand_as(keep), keep)
    tok = torch.arange(k_len).view(1, 1, 1, -1)
    cols = torch.rand(batch, heads, nqb, k_len, generator=generator) < col_density
    in_listed_block = torch.gather(keep, 3, (tok // block_size).expand_as(cols))
    cols &= ~in_listed_block
    if causal:
        cols &= tok < qb * block_size
    col_idx, col_cnt = compact_sorted(tok.expand_as(cols), cols)
    return SparseLayout(block_idx, block_cnt, col_idx, col_cnt, block_size)


PLANTED_LOGIT = 8.0


def planted_qk(
    num_q_heads: int,
    num_kv_heads: int,
    seq_len: int,
    head_dim: int,
    verticals: list[list[int]],
    offsets: list[list[int]],
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, Hq, S, D], k [1, Hkv, S, D] whose attention concentrates on planted columns and diagonals.

    Query head h attends strongly to key columns `verticals[h]` (a shared "sink" direction in the
    keys) and to offsets `offsets[h]` (q and k carry matching random codes, k shifted by the offset).
    Heads of one GQA group share their key head, so their plants must be compatible: the key side
    is the union of the group's plants, each query head reads only its own. A planted pair's
    scaled score (q.k / sqrt(D)) is about `PLANTED_LOGIT`; unrelated pairs score about 0.
    """
    g = num_q_heads // num_kv_heads
    amp = (PLANTED_LOGIT * head_dim**0.5) ** 0.5
    d_half = head_dim // 2
    noise = 0.1
    q = noise * torch.randn(1, num_q_heads, seq_len, head_dim, generator=generator)
    k = noise * torch.randn(1, num_kv_heads, seq_len, head_dim, generator=generator)
    for h in range(num_q_heads):
        kv = h // g
        if verticals[h]:
            direction = torch.randn(d_half, generator=generator)
            direction /= direction.norm()
            q[0, h, :, :d_half] += amp * direction
            k[0, kv, verticals[h], :d_half] += amp * direction
        for off in offsets[h]:
            codes = torch.randn(seq_len, head_dim - d_half, generator=generator)
            codes /= codes.norm(dim=-1, keepdim=True)
            q[0, h, :, d_half:] += amp * codes
            k[0, kv, : seq_len - off, d_half:] += amp * codes[off:]
    return q, k


def local_qk(
    num_q_heads: int,
    num_kv_heads: int,
    seq_len: int,
    head_dim: int,
    span: float,
    *,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [1, Hq, S, D], k [1, Hkv, S, D] whose attention decays with distance, as in local heads.

    The scaled score of query i and key j is about PLANTED_LOGIT x exp(-(i - j)^2 / (2 span^2)) (random
    Fourier features: each key head's D / 2 frequencies drawn from N(0, 1 / span^2), read by the query heads
    of its GQA group), plus small noise. Unlike i.i.d. random q and k, whose mass is spread evenly so that a
    top-k budget keeps columns and diagonals scattered over every block, the highest-scoring diagonals
    are the nearest ones and the highest-scoring columns those just before the scoring queries: a top-k
    budget keeps a few contiguous blocks per row.
    """
    g = num_q_heads // num_kv_heads
    freqs = torch.randn(num_kv_heads, 1, head_dim // 2, generator=generator) / span
    angles = torch.arange(seq_len, dtype=torch.float64).view(1, -1, 1) * freqs.double()
    features = torch.cat([angles.cos(), angles.sin()], dim=-1).float() / (head_dim // 2) ** 0.5
    amp = (PLANTED_LOGIT * head_dim**0.5) ** 0.5
    noise = 0.1
    k = amp * features.unsqueeze(0) + noise * torch.randn(1, num_kv_heads, seq_len, head_dim, generator=generator)
    q = amp * features.repeat_interleave(g, dim=0).unsqueeze(0)
    q = q + noise * torch.randn(1, num_q_heads, seq_len, head_dim, generator=generator)
    return q, k
