"""Row-wise block masks of a weight matrix and the compact (active-blocks-only) views of it.

A sparse matrix `[rows, cols]` is cut into `blocks_per_row = cols / block_size` blocks per row; every
row keeps `k` active blocks (`rounding.py`), listed in an index `[rows, k]` (int16 when it fits). The compact views
`[rows, k, block_size]` of weights, gradients and Adam moments are gathered/scattered through it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .dtensor import local, row_offset
from .rounding import kept_blocks

_MASK32 = 0xFFFFFFFF
# Odd multipliers below 2**31, so a 32-bit value times one of them fits in int64 without overflow.
_MIX1 = 0x7FEB352D
_MIX2 = 0x2C1B3C6D


@dataclass(frozen=True)
class BlockGrid:
    """How the local shard of one sparse weight is cut into blocks."""

    rows: int  # local rows
    blocks_per_row: int
    block_size: int
    k: int  # active blocks per row
    row_offset: int  # global index of the first local row
    global_rows: int

    @classmethod
    def of(cls, param: torch.Tensor, density: float, block_size: int, name: str = "parameter") -> BlockGrid:
        if param.dim() != 2:
            raise ValueError(
                f"{name} has shape {tuple(param.shape)}; SMET makes only 2-D (linear) weights sparse. Remove its "
                "module from target_modules."
            )
        cols = param.shape[1]
        if param.numel() == 0:  # (no block to keep: a division by zero when its density is counted)
            raise ValueError(f"{name} has shape {tuple(param.shape)}: an empty weight has no blocks to train "
                             "sparsely. Remove its module from target_modules.")
        if cols % block_size:
            raise ValueError(
                f"{name} has {cols} input columns, not a multiple of block_size={block_size}; pick a block size "
                f"that divides {cols} (e.g. {_largest_divisor(cols, block_size)})."
            )
        blocks_per_row = cols // block_size
        return cls(local(param).shape[0], blocks_per_row, block_size, kept_blocks(blocks_per_row, density),
                   row_offset(param), param.shape[0])

    @property
    def density(self) -> float:
        return self.k / self.blocks_per_row

    @property
    def index_dtype(self) -> torch.dtype:
        return torch.int16 if self.blocks_per_row <= torch.iinfo(torch.int16).max else torch.int32

    def blocks(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[rows, blocks_per_row, block_size]` view of a local weight-shaped tensor."""
        if not tensor.is_contiguous():
            raise ValueError("SMET needs contiguous weights and gradients to view them as blocks.")
        return tensor.view(self.rows, self.blocks_per_row, self.block_size)

    def global_block_ids(self, device: torch.device) -> torch.Tensor:
        """`[rows, blocks_per_row]` int64 ids of the local blocks in the whole (unsharded) matrix."""
        rows = torch.arange(self.rows, device=device, dtype=torch.int64) + self.row_offset
        cols = torch.arange(self.blocks_per_row, device=device, dtype=torch.int64)
        return rows[:, None] * self.blocks_per_row + cols[None, :]

    def global_row_ids(self, device: torch.device) -> torch.Tensor:
        return torch.arange(self.rows, device=device, dtype=torch.int64) + self.row_offset


def hash_uniform(ids: torch.Tensor, *keys: int) -> torch.Tensor:
    """Uniform [0, 1) float32 numbers, a pure function of the integer `ids` (a tensor) and `keys`.

    Replaces a stateful RNG: the same (seed, parameter, step, block) gives the same number on any
    device and under any sharding, and nothing needs to be checkpointed.
    """
    x = ids.to(torch.int64) & _MASK32
    for key in keys:
        x = _mix32(x ^ (int(key) & _MASK32))
    x = _mix32(x)
    return x.to(torch.float64).div_(2.0**32).to(torch.float32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MIX1) & _MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX2) & _MASK32
    return x ^ (x >> 16)


def top_blocks(scores: torch.Tensor, tie_break: torch.Tensor, k: int) -> torch.Tensor:
    """Per row, the `k` blocks of largest score (ties broken by `tie_break`), as int64 `[rows, k]`."""
    order = torch.argsort(tie_break, dim=1, descending=True)
    by_score = torch.argsort(scores.gather(1, order), dim=1, descending=True, stable=True)
    return order.gather(1, by_score[:, :k])


def active_mask(index: torch.Tensor, blocks_per_row: int, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean `[rows, blocks_per_row]` mask of the blocks listed in `index` `[rows, k]` (only the
    slots where `keep` `[rows, k]` is True, when given)."""
    mask = torch.zeros(index.shape[0], blocks_per_row, dtype=torch.bool, device=index.device)
    return mask.scatter_(1, index.long(), True if keep is None else keep)


def expand_index(index: torch.Tensor, block_size: int) -> torch.Tensor:
    """`[rows, k]` block index -> int64 `[rows, k, block_size]` index for gather/scatter on block views."""
    return index.long().unsqueeze(-1).expand(-1, -1, block_size)


def block_l1(blocks: torch.Tensor) -> torch.Tensor:
    """L1 norm of every block of a `[..., block_size]` tensor, in float32."""
    return blocks.abs().sum(-1, dtype=torch.float32)


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)
