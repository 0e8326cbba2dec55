"""`mode='sparse_update'`: sparse fine-tuning of a pretrained model. Every weight keeps its value; a rotating set of
blocks, chosen at random at first, is updated, and the blocks whose updates moved them least since they became
active are pruned."""

from __future__ import annotations

import torch

from ..masks import BlockGrid, block_l1
from .base import SMETMode


class SparseUpdateMode(SMETMode):
    name = "sparse_update"
    help = ("fine-tune a pretrained model, all weights keep their values and only a rotating active set of blocks is "
            "updated")
    regrowth = "gradient"
    slot_state = {"update_magnitude": torch.float32}  # L1 norm of the updates a block took since active

    def initial_scores(self, grid: BlockGrid, weights: torch.Tensor) -> None:
        return None

    def prune_scores(self, grid: BlockGrid, weights: torch.Tensor, state: dict[str, torch.Tensor]) -> torch.Tensor:
        return state["update_magnitude"]

    def record_update(self, state: dict[str, torch.Tensor], old: torch.Tensor, new: torch.Tensor) -> None:
        state["update_magnitude"].add_(block_l1(new - old))


SPARSE_UPDATE = SparseUpdateMode()
