"""Row-wise block masks of a weight matrix and the compact (active-blocks-only) views of it.

A sparse matrix `[rows, cols]` is cut into `blocks_per_row = cols / block_size` blocks per row; every
row keeps `k` active blocks (`rounding.py`), listed in an index `[rows, k]` (int16 when it fits). The compact views
`[rows, k, block_size]` of weights, gradients and Adam moments are gathered/scattered through it. A 3-D weight (an
MoE's fused experts) is a stack of such matrices whose rows are numbered one after the other (`BlockGrid`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rounding import kept_blocks

MASK32 = 0xFFFFFFFF  # the random choices hash 32-bit values (`hash_uniform`)

# Odd multipliers below 2**31, so a 32-bit value times one of them fits in int64 without overflow.
_MIX1 = 0x7FEB352D
_MIX2 = 0x2C1B3C6D


@dataclass(frozen=True)
class BlockGrid:
    """How the local shard of one sparse weight is cut into blocks.

    A 2-D weight is one slice `[out, in]` (nn.Linear's layout); a 3-D one (an MoE's fused experts, `[experts, ., .]`)
    is a stack of slices, each its own matrix, stored `[out, in]` or, `transposed`, `[in, out]`. The rows of all local
    slices are numbered one after the other (slice after slice): every per-row state is `[rows, ...]`, and every row,
    whatever its slice, keeps `k` blocks of `block_size` consecutive inputs, as a 2-D weight's rows do.
    """

    rows: int  # local rows, all local slices'
    blocks_per_row: int
    block_size: int
    k: int  # active blocks per row
    row_offset: int  # global index of the first local row
    global_rows: int
    slices: int  # local slices (experts); 1 for a 2-D weight
    slice_rows: int  # rows of a slice (a 2-D weight's: `rows`)
    stacked: bool  # a 3-D weight: its per-row states are saved `[slices, rows per slice, ...]`
    transposed: bool  # slices stored `[in, out]`: the inputs of a row run along dim -2

    @classmethod
    def of(cls, param: torch.Tensor, density: float, block_size: int, name: str = "parameter",
           transposed: bool | None = False) -> BlockGrid:
        """The grid of `param`; `transposed` says how a 3-D one's slices are stored (None: unknown, refused)."""
        # (imported here: `dtensor` imports torch.distributed.tensor, half a second, and the modes, which SMETConfig
        # and so the launcher's flag checks import, read this module)
        from .dtensor import local, row_offset

        if param.dim() not in (2, 3):
            raise ValueError(
                f"{name} has shape {tuple(param.shape)}; SMET makes only 2-D (linear) weights and 3-D stacks of them "
                "(an MoE's fused experts) sparse. Remove its module from target_modules."
            )
        if param.dim() == 3 and transposed is None:
            raise ValueError(
                f"{name} has shape {tuple(param.shape)}, a stack of matrices stored [out, in] or [in, out]: say which "
                "in its parameter group's 'transposed' list (create_smet_optimizer reads it off the experts "
                "module: `factory._stack_layout`), or remove it from target_modules."
            )
        if param.dim() == 2 and transposed:  # (its rows, which FSDP2 shards, would be its inputs)
            raise ValueError(f"{name}: a 2-D sparse weight must be laid out [out, in] as nn.Linear's is, not "
                             "transposed.")
        if not local(param).is_contiguous():  # (else the hooks failed in backward, naming neither it nor the fix)
            raise ValueError(
                f"{name} is not contiguous (strides {tuple(local(param).stride())}, a transposed view?): SMET views a "
                "sparse weight, and its gradient laid out alike, as blocks in place. Make it contiguous before "
                "building the optimizer (param.data = param.data.contiguous()), or remove its module from "
                "target_modules.")
        transposed = bool(transposed)
        out_dim, in_dim = (-1, -2) if transposed else (-2, -1)  # (a 2-D weight: nn.Linear's [out, in])
        cols = param.shape[in_dim]
        if param.numel() == 0:  # (no block to keep: a division by zero when its density is counted)
            raise ValueError(f"{name} has shape {tuple(param.shape)}: an empty weight has no blocks to train "
                             "sparsely. Remove its module from target_modules.")
        if cols % block_size:
            raise ValueError(
                f"{name} has {cols} input columns, not a multiple of block_size={block_size}; pick a block size "
                f"that divides {cols} (e.g. {_largest_divisor(cols, block_size)})."
            )
        blocks_per_row = cols // block_size
        k = kept_blocks(blocks_per_row, density)
        if param.dim() == 2:
            rows = local(param).shape[0]
            return cls(rows, blocks_per_row, block_size, k, row_offset(param), param.shape[0], 1, rows, False, False)
        # FSDP2 shards a stack by whole slices (Shard(0) on the experts): its rows follow slice by slice
        slices, slice_rows = local(param).shape[0], param.shape[out_dim]
        return cls(slices * slice_rows, blocks_per_row, block_size, k, row_offset(param) * slice_rows,
                   param.shape[0] * slice_rows, slices, slice_rows, True, transposed)

    @property
    def density(self) -> float:
        return self.k / self.blocks_per_row

    @property
    def index_dtype(self) -> torch.dtype:
        return torch.int16 if self.blocks_per_row <= torch.iinfo(torch.int16).max else torch.int32

    def blocks(self, tensor: torch.Tensor) -> torch.Tensor:
        """`[slices, rows per slice, blocks_per_row, block_size]` view of a local weight-shaped tensor (strided, not
        contiguous, for a `transposed` one)."""
        if not tensor.is_contiguous():
            raise ValueError("SMET needs contiguous weights and gradients to view them as blocks.")
        if self.transposed:
            return tensor.view(self.slices, self.blocks_per_row, self.block_size, self.slice_rows).permute(0, 3, 1, 2)
        return tensor.view(self.slices, self.slice_rows, self.blocks_per_row, self.block_size)

    def per_slice(self, rows: torch.Tensor) -> torch.Tensor:
        """A per-row `[rows, ...]` tensor as `[slices, rows per slice, ...]` (a view)."""
        return rows.view(self.slices, self.slice_rows, *rows.shape[1:])

    def gather(self, tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
        """The blocks `index` `[rows, k]` lists of a local weight-shaped tensor, as `[rows, k, block_size]`."""
        return self.blocks(tensor).gather(2, self._where(index)).reshape(self.rows, index.shape[1], self.block_size)

    def scatter_(self, tensor: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> None:
        """Write `values` `[rows, k, block_size]` into the blocks `index` lists of a local weight-shaped tensor."""
        self.blocks(tensor).scatter_(2, self._where(index), self.per_slice(values))

    def inactive(self, index: torch.Tensor) -> torch.Tensor:
        """Boolean mask of the blocks `index` does not list, broadcastable to `blocks()`."""
        return ~self.per_slice(active_mask(index, self.blocks_per_row)).unsqueeze(-1)

    def block_l1(self, blocks: torch.Tensor) -> torch.Tensor:
        """`[rows, blocks_per_row]` float32 L1 norms of the blocks of a `blocks()`-shaped tensor."""
        return block_l1(blocks).reshape(self.rows, self.blocks_per_row)

    def _where(self, index: torch.Tensor) -> torch.Tensor:
        return self.per_slice(index.long()).unsqueeze(-1).expand(-1, -1, -1, self.block_size)

    def global_block_ids(self, device: torch.device) -> torch.Tensor:
        """`[rows, blocks_per_row]` int64 ids of the local blocks in the whole (unsharded) weight."""
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
    x = ids.to(torch.int64) & MASK32
    for key in keys:
        x = _mix32(x ^ (int(key) & MASK32))
    x = _mix32(x)
    return x.to(torch.float64).div_(2.0**32).to(torch.float32)


def _mix32(x: torch.Tensor) -> torch.Tensor:
    x = x ^ (x >> 16)
    x = (x * _MIX1) & MASK32
    x = x ^ (x >> 15)
    x = (x * _MIX2) & MASK32
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


def block_l1(blocks: torch.Tensor) -> torch.Tensor:
    """L1 norm of every block of a `[..., block_size]` tensor, in float32."""
    return blocks.abs().sum(-1, dtype=torch.float32)


def _largest_divisor(n: int, at_most: int) -> int:
    return max(d for d in range(1, min(n, at_most) + 1) if n % d == 0)
