"""The synthetic rows the simulator predicts (and the tests and benchmarks use): random vertical-slash
layouts (`random_vertical_slash_layout`, MTraining's forced parts and a random rest) and packed rows of
documents: length mixes, the row's `TokenMeta`, and per-document patterns in any split's order.

Mixes (lengths drawn with a fixed seed): long-tail (lognormal, median 8K, sigma 1.5, clipped to
[128, row]), uniform (1 to 64K tokens), one (a single document filling the row).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F

from ..attention.build import build_layout, dense_layout
from ..attention.estimate import layout_from_scores, long_documents
from ..attention.layout import SparseLayout
from ..attention.tokens import TokenMeta
from ..config import SparseAttentionConfig
from ..distributed.split.blocks import BlockSplit, ShardPlan

MIXES = ("long-tail", "uniform", "one")


def random_vertical_slash_layout(
    batch: int,
    heads: int,
    seq_len: int,
    block_size: int,
    *,
    num_diagonals: int,
    num_verticals: int,
    sink_tokens: int = 0,
    diagonal_spread: float = 1.0,
    meta: TokenMeta | None = None,
    padded_len: int | None = None,
    generator: torch.Generator | None = None,
) -> SparseLayout:
    """A vertical-slash layout per (row, head) with MTraining's forced parts and a random rest.

    Always kept: the diagonal block (the local window) and the first `sink_tokens` key
    columns. Drawn on top: `num_diagonals` block diagonals among the nearest `diagonal_spread`
    fraction of them, and `num_verticals` key columns among the `seq_len` real tokens.

    meta: the tokens' documents (default: one document per row, padded to `padded_len` tokens,
    which default to `seq_len`); the layout covers `meta`'s length.
    """
    meta = TokenMeta.contiguous(batch, seq_len).pad_to(padded_len or seq_len) if meta is None else meta
    total = meta.index.shape[-1]
    nb = -(-total // block_size)
    reach = max(1, min(nb, round(diagonal_spread * nb)))
    diagonals = torch.zeros(batch, heads, nb, dtype=torch.bool)
    diagonals[..., 0] = True
    picks = torch.rand(batch, heads, reach, generator=generator).argsort(-1)[..., :num_diagonals]
    diagonals.scatter_(-1, picks, True)
    verticals = torch.zeros(batch, heads, total, dtype=torch.bool)
    verticals[..., :sink_tokens] = True
    picks = torch.rand(batch, heads, seq_len, generator=generator).argsort(-1)[..., :num_verticals]
    verticals.scatter_(-1, picks, True)
    return build_layout(meta, block_size, diagonals=diagonals, verticals=verticals)


def row_layouts(seq: int, block_size: int,
                build: Callable[[str, BlockSplit, int | None], SparseLayout]) -> Callable[..., SparseLayout]:
    """`layout(kind, plan, window=None)` of a row of `seq` tokens for any split of it: `build(kind, plan, window)`
    once per kind and window over the row's own blocks (a `ShardPlan` of one rank: no split's padding), then padded
    to each order-keeping split's grid (`padded_to`), so that every CP size and sharding reads one drawing; a split
    that reorders the row gets `build` over its own plan."""
    own, cache = ShardPlan("contiguous", 1, block_size, seq), {}

    def layout(kind: str, plan: BlockSplit, window: int | None = None) -> SparseLayout:
        if not plan.keeps_order:
            return build(kind, plan, window)
        if (kind, window) not in cache:
            cache[kind, window] = build(kind, own, window)
        return padded_to(cache[kind, window], plan)

    return layout


def padded_to(layout: SparseLayout, plan: BlockSplit) -> SparseLayout:
    """`layout`, over a row's own blocks in its order, as the global layout of `plan`, an order-keeping split that
    may pad the row to its grid: the split's padding blocks appended as query blocks that list nothing, as training's
    layout over the padded sequence has them (its estimation lists no padding key, and the split's padding queries
    see nothing: `CPShard.padding_queries`). The same object where the split adds no block."""
    extra = plan.num_blocks - layout.num_q_blocks
    if extra < 0 or not plan.keeps_order or layout.block_size != plan.block_size:
        raise ValueError(f"a layout of {layout.num_q_blocks} blocks of {layout.block_size} tokens is no row of the "
                         f"split's {plan.num_blocks} blocks of {plan.block_size} in order: build it over the row.")
    if not extra:
        return layout

    def pad(t: torch.Tensor, value: int) -> torch.Tensor:  # [B, H, NQB] or [B, H, NQB, slots]
        return F.pad(t, (0, 0, 0, extra) if t.dim() == 4 else (0, extra), value=value)

    return SparseLayout(pad(layout.block_idx, -1), pad(layout.block_cnt, 0), pad(layout.col_idx, -1),
                        pad(layout.col_cnt, 0), layout.block_size)


def mix_lengths(mix: str, row: int, seed: int) -> list[int]:
    """Document lengths filling one row of `row` tokens (the last one cut to fit)."""
    rng = np.random.default_rng(seed)
    if mix == "one":
        return [row]
    lengths: list[int] = []
    while sum(lengths) < row:
        if mix == "long-tail":
            n = float(np.exp(np.log(8192) + 1.5 * rng.standard_normal()))
            lengths.append(int(min(max(n, 128), row)))
        else:
            lengths.append(int(rng.integers(1, 65536, endpoint=True)))
    lengths[-1] -= sum(lengths) - row
    return [n for n in lengths if n > 0]


def row_meta(lengths: list[int]) -> TokenMeta:
    """The `TokenMeta` [1, S] of one row packing documents of these lengths."""
    seg = torch.repeat_interleave(torch.arange(len(lengths), dtype=torch.int32), torch.tensor(lengths))
    return TokenMeta.from_segments(seg.unsqueeze(0))


def packed_layout(plan, meta: TokenMeta, cfg: SparseAttentionConfig, scores: torch.Tensor):
    """The row's per-document pattern in a split's global order.

    Args:
        plan: the split (a `BlockSplit`); meta: the row [1, S] in its original order; cfg: the
            pattern settings (documents shorter than `min_seq_len` stay dense); scores: vertical and
            slash scores [2, S] in the original order (`document_scores`).

    Returns:
        (the global layout over `plan.padded_len`, the row's `TokenMeta` in global order).
    """
    gmeta = plan.global_meta(meta)
    docs = long_documents(gmeta, cfg)
    if not any(docs):
        return dense_layout(gmeta, cfg.block_size), gmeta
    src = plan.source
    placed = torch.where(src >= 0, scores[:, src.clamp_min(0)], torch.zeros(()))  # [2, padded_len]
    return layout_from_scores(gmeta, cfg, docs, [(placed[0:1], placed[1:2])]), gmeta


def document_scores(lengths: list[int], seed: int) -> torch.Tensor:
    """Random vertical and slash scores [2, S], fixed per document (token-level pattern independent of
    where the document sits)."""
    out = []
    for i, n in enumerate(lengths):
        g = torch.Generator().manual_seed(seed * 100003 + i)
        out.append(torch.rand(2, n, generator=g))
    return torch.cat(out, 1)
