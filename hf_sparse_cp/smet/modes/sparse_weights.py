"""`mode='sparse_weights'`: dynamic sparse training from scratch. Inactive weights are exactly zero; a weight starts
with its largest blocks, which makes attaching idempotent (weights already block-sparse with at most `k` nonzero
blocks per row, a checkpoint, keep exactly those), and prunes its smallest ones."""

from __future__ import annotations

import torch

from ..masks import BlockGrid, block_l1
from .base import SMETMode


class SparseWeightsMode(SMETMode):
    name = "sparse_weights"
    help = "train from scratch with masked weights (inactive weights are exactly zero)"
    regrowth = "random"
    zeroes_inactive_weights = True

    def initial_scores(self, grid: BlockGrid, weights: torch.Tensor) -> torch.Tensor:
        return grid.block_l1(grid.blocks(weights))

    def prune_scores(self, grid: BlockGrid, weights: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        return block_l1(grid.gather(weights, state["block_index"]))


SPARSE_WEIGHTS = SparseWeightsMode()
