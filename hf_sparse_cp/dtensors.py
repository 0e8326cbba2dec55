"""How torch lays out a DTensor built from local shards, for every layer that builds one (a leaf: torch only): the
SMET optimizer's per-row state (`smet/dtensor.py`) and the sharded checkpoint's loaded tensors
(`resharding/checkpoint.py`)."""

from __future__ import annotations

import torch


def contiguous_stride(shape: torch.Size) -> tuple[int, ...]:
    """The strides of a contiguous tensor of `shape`, as torch lays one out (a size-0 dimension counts as 1): what a
    DTensor built from a local shard with a global `shape` declares."""
    return torch.empty(shape, device="meta").stride()
