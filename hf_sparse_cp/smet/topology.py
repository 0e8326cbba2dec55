"""Topology decisions of dynamic sparse training: which blocks start active, which are pruned and
which are regrown. Pure functions of tensors (no optimizer state), applied row by row."""

from __future__ import annotations

import math

import torch

from .config import SMETConfig
from .masks import active_mask, hash_uniform, top_blocks

# Salts that keep the hashed random streams of the different decisions apart.
_SALT_INIT = 1
_SALT_PRUNE_COUNT = 2
_SALT_PRUNE_TIE = 3
_SALT_REGROW = 4


def prune_rate(config: SMETConfig, step: int, horizon: int | None) -> float:
    """Fraction of active blocks replaced at `step`: cosine decay from `prune_rate` to
    `prune_rate_final` over `horizon` steps (constant `prune_rate` without a horizon)."""
    if not horizon:
        return config.prune_rate
    progress = min(step / horizon, 1.0)
    return config.prune_rate_final + 0.5 * (config.prune_rate - config.prune_rate_final) * (
        1.0 + math.cos(math.pi * progress)
    )


def initial_blocks(
    block_ids: torch.Tensor, k: int, seed: int, param_key: int, magnitude: torch.Tensor | None = None
) -> torch.Tensor:
    """The first active set: per row the `k` blocks of largest `magnitude` (the mode's `initial_scores`:
    sparse_weights' block L1 norms), or `k` random blocks when `magnitude` is None (sparse_update). Returns int64
    `[rows, k]`, sorted.

    Choosing by magnitude makes the choice idempotent: weights that are already block-sparse with at
    most `k` nonzero blocks per row (a checkpoint) keep exactly their nonzero blocks.
    """
    noise = hash_uniform(block_ids, seed, param_key, _SALT_INIT)
    scores = noise if magnitude is None else magnitude
    return top_blocks(scores, noise, k).sort(dim=1).values


def prune_slots(
    scores: torch.Tensor, rate: float, row_ids: torch.Tensor, seed: int, param_key: int, step: int
) -> torch.Tensor:
    """Boolean `[rows, k]` mask of the active slots to prune: in every row the smallest-scoring ones.

    A row prunes `floor(rate * k + u)` slots with `u` uniform in [0, 1) hashed from the row, so the
    expected count is `rate * k` even when `k` is small, and the choice is independent of sharding.
    """
    rows, k = scores.shape
    u = hash_uniform(row_ids, seed, param_key, step, _SALT_PRUNE_COUNT)
    count = torch.floor(rate * k + u).clamp_(max=k).to(torch.int64)
    slot_ids = row_ids[:, None] * k + torch.arange(k, device=scores.device)
    tie = hash_uniform(slot_ids, seed, param_key, step, _SALT_PRUNE_TIE)
    # Rank the slots from the smallest score up (ties broken by the hash) and prune the first `count`.
    smallest_first = top_blocks(-scores, tie, k)
    ranks = torch.empty_like(smallest_first).scatter_(
        1, smallest_first, torch.arange(k, device=scores.device).expand(rows, k)
    )
    return ranks < count[:, None]


def regrow(
    index: torch.Tensor,
    pruned: torch.Tensor,
    blocks_per_row: int,
    block_ids: torch.Tensor,
    seed: int,
    param_key: int,
    step: int,
    gradient_score: torch.Tensor | None,
) -> torch.Tensor:
    """New `[rows, k]` index with every pruned slot refilled by a block that is inactive after pruning
    (a just-pruned block may come back, as in RigL): the largest `gradient_score` blocks (RigL) or
    uniformly random ones (SET) when `gradient_score` is None. Rows keep their number of active blocks."""
    k = index.shape[1]
    noise = hash_uniform(block_ids, seed, param_key, step, _SALT_REGROW)
    scores = noise if gradient_score is None else gradient_score.to(torch.float32)
    scores = scores.masked_fill(active_mask(index, blocks_per_row, keep=~pruned), float("-inf"))
    # Candidates best-first; pruned slots first within each row; pair them up in that order.
    best = top_blocks(scores, noise, k)
    slots = torch.argsort(pruned.to(torch.uint8), dim=1, descending=True, stable=True)
    n_new = pruned.sum(1, keepdim=True)
    take_new = torch.arange(k, device=index.device)[None, :] < n_new
    refill = torch.where(take_new, best, index.long().gather(1, slots))
    return index.long().scatter(1, slots, refill).to(index.dtype)
