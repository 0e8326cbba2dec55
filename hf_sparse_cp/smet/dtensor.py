"""Local-shard view of parameters that may be FSDP2 DTensors.

SMET works on the local shard of every parameter: these helpers give the local tensor, the global
index of its first row, and wrap local optimizer state back into a DTensor laid out like the
parameter (so `torch.distributed.checkpoint` saves and reshards it by rows). FSDP2 hands SMET's hooks
the reduced gradient shard, so sharded rows need no communication; the only collective SMET runs is
for replicated (DDP) parameters, in `optimizer.py`.
"""

from __future__ import annotations

import math

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..dtensors import contiguous_stride


def local(tensor: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (sharing its storage), or the tensor itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def row_offset(param: torch.Tensor) -> int:
    """Global index of the first row of `param`'s local shard (of a 3-D stack of matrices: its first matrix).

    Supports the layouts FSDP2 and HSDP produce: `Shard(0)` on at most one mesh dimension, `Replicate`
    on the others. Shards follow `torch.chunk` (every shard but the last ones has ceil(rows / n) rows).
    """
    if not isinstance(param, DTensor):
        return 0
    offset = 0
    sharded = False
    for mesh_dim, placement in enumerate(param.placements):
        if isinstance(placement, Replicate):
            continue
        if not isinstance(placement, Shard) or placement.dim != 0 or sharded:
            raise ValueError(
                f"SMET supports parameters sharded on dim 0 only (FSDP2's default), got placements "
                f"{param.placements}; drop a custom shard_placement_fn for the sparse matrices."
            )
        sharded = True
        chunk = math.ceil(param.shape[0] / param.device_mesh.size(mesh_dim))
        offset = min(param.device_mesh.get_local_rank(mesh_dim) * chunk, param.shape[0])
    return offset


def like_param(param: torch.Tensor, state: torch.Tensor) -> torch.Tensor:
    """`state` (the local rows of a per-row optimizer state) as a DTensor laid out like `param`.

    The global shape is `[param.shape[0], *state.shape[1:]]`, so a checkpoint
    holds every row once and can be loaded under another sharding. Plain parameters give `state` back.
    """
    if not isinstance(param, DTensor):
        return state
    shape = torch.Size((param.shape[0], *state.shape[1:]))
    return DTensor.from_local(
        state, param.device_mesh, param.placements, run_check=False, shape=shape, stride=contiguous_stride(shape)
    )


def local_rows_of(param: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """The rows of a saved per-row state that belong to `param`'s local shard.

    Accepts a DTensor (already sharded like `param`: its local shard) or a full tensor (sliced)."""
    if isinstance(value, DTensor):
        return value.to_local()
    if not isinstance(param, DTensor):
        return value
    start = row_offset(param)
    return value[start : start + local(param).shape[0]]
