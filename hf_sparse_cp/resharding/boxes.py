"""Where each rank holds which slice of a sharded tensor, and what moves from one layout to another.

Every state tensor (a weight, an Adam moment, a SMET per-row state) lives in one logical coordinate
space: its global shape, as if no dimension were parallel. A layout maps each rank to the box of
that space it holds (`Box`; `shard_boxes` derives it from a device mesh and DTensor placements, e.g.
FSDP2's `Shard(0)` over dp_shard x cp, or HSDP's `(Replicate(), Shard(0))`). Going from layout A to
layout B is the intersection of the two maps (`plan_transfers`): for every rank of B, which rank of
A gives it which box. Replicated source boxes are given by the receiving rank itself when it holds a
copy, else by one holder chosen round robin so that no holder gives everything. The sharded
checkpoint's loader (`checkpoint.py`) reads exactly these boxes from the files the saved ranks wrote.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..distributed.comm import rank_and_world


@dataclass(frozen=True)
class Box:
    """A box of a tensor's global index space: `start[d] <= index[d] < stop[d]` on every dimension d."""

    start: tuple[int, ...]
    stop: tuple[int, ...]

    @classmethod
    def whole(cls, shape: Sequence[int]) -> Box:
        return cls(tuple(0 for _ in shape), tuple(int(s) for s in shape))

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(b - a for a, b in zip(self.start, self.stop))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def intersect(self, other: Box) -> Box | None:
        """The common box, or None when they share no element."""
        start = tuple(max(a, b) for a, b in zip(self.start, other.start))
        stop = tuple(min(a, b) for a, b in zip(self.stop, other.stop))
        return Box(start, stop) if all(a < b for a, b in zip(start, stop)) else None

    def within(self, outer: Box) -> tuple[slice, ...]:
        """Index of this box inside a tensor that holds `outer` (which contains it)."""
        return tuple(slice(a - o, b - o) for a, b, o in zip(self.start, self.stop, outer.start))


def shard_boxes(shape: Sequence[int], mesh_ranks: torch.Tensor, placements: Sequence) -> dict[int, Box]:
    """The box each rank of a device mesh holds of a tensor of global `shape`, as DTensor lays it out.

    Args:
        shape: the global shape.
        mesh_ranks: the mesh's global ranks, one tensor dimension per mesh dimension
            (`DeviceMesh.mesh`).
        placements: one per mesh dimension, `Shard(d)` or `Replicate()`. Shards follow `torch.chunk`
            (ceil-sized, the last ones shorter or empty); several `Shard` of one tensor dimension
            split it again, in mesh-dimension order.

    Returns:
        {global rank: Box}; a rank whose shard is empty gets a box with a zero extent.
    """
    if mesh_ranks.dim() != len(placements):
        raise ValueError(f"{len(placements)} placements for a {mesh_ranks.dim()}-dimensional mesh.")
    for p in placements:
        if type(p) not in (Shard, Replicate):
            raise ValueError(f"placement {p} cannot be resharded: only Shard(dim) and Replicate() are laid out in "
                             "one coordinate space (reduce a Partial first, e.g. with DTensor.redistribute).")
        if isinstance(p, Shard) and not -len(shape) <= p.dim < len(shape):  # (an IndexError inside)
            raise ValueError(f"placement {p} shards dimension {p.dim} of a tensor of shape {tuple(shape)}, which has "
                             f"{len(shape)}: shard one of its dimensions, or Replicate() it.")
    return _shard_boxes(tuple(int(s) for s in shape), tuple(mesh_ranks.reshape(-1).tolist()),
                        tuple(mesh_ranks.shape), tuple(placements))


@functools.lru_cache(maxsize=4096)  # a model repeats a few shapes on a few meshes
def _shard_boxes(shape: tuple[int, ...], ranks: tuple[int, ...], mesh_shape: tuple[int, ...],
                 placements: tuple) -> dict[int, Box]:
    boxes = {}
    for flat, rank in enumerate(ranks):
        coord = [flat // math.prod(mesh_shape[d + 1:]) % mesh_shape[d] for d in range(len(mesh_shape))]
        start, stop = [0] * len(shape), list(shape)
        for mesh_dim, p in enumerate(placements):
            if isinstance(p, Shard):
                d, n, i = p.dim, mesh_shape[mesh_dim], coord[mesh_dim]
                size = stop[d] - start[d]
                chunk = -(-size // n)
                start[d], stop[d] = start[d] + min(i * chunk, size), start[d] + min((i + 1) * chunk, size)
        boxes[rank] = Box(tuple(start), tuple(stop))
    return boxes


def dtensor_boxes(tensor: torch.Tensor) -> dict[int, Box]:
    """`shard_boxes` of a DTensor; a plain tensor is held whole by every rank of the default group."""
    if isinstance(tensor, DTensor):
        return shard_boxes(tensor.shape, tensor.device_mesh.mesh, tensor.placements)
    _, world = rank_and_world()
    return dict.fromkeys(range(world), Box.whole(tensor.shape))


@dataclass(frozen=True)
class Transfer:
    """Rank `src` gives rank `dst` the elements of `box` (global coordinates); src == dst is a local copy."""

    src: int
    dst: int
    box: Box


def plan_transfers(shape: Sequence[int], source: Mapping[int, Box], target: Mapping[int, Box]) -> list[Transfer]:
    """The slice-intersection plan from layout `source` to layout `target` of a tensor of `shape`.

    Args:
        shape: the global shape.
        source, target: {global rank: Box held}. The source's distinct boxes must tile the tensor (every
            element held, copies only of whole boxes); the target may leave ranks out (they receive nothing).

    Returns:
        The transfers, ordered by (src, dst): every element each target rank holds arrives exactly once.
    """
    return list(_plan(tuple(int(s) for s in shape), tuple(sorted(source.items())), tuple(sorted(target.items()))))


@functools.lru_cache(maxsize=4096)
def _plan(shape: tuple[int, ...], source: tuple[tuple[int, Box], ...],
          target: tuple[tuple[int, Box], ...]) -> tuple[Transfer, ...]:
    total = math.prod(shape)
    holders: dict[Box, list[int]] = {}
    for rank, box in source:
        if box.numel:
            holders.setdefault(box, []).append(rank)
    distinct = sorted(holders, key=lambda b: b.start)
    overlap = any(a.intersect(b) for i, a in enumerate(distinct) for b in distinct[i + 1:])
    if overlap or sum(b.numel for b in distinct) != total:
        raise ValueError(f"the source layout does not tile the tensor of shape {shape} (its boxes overlap or "
                         "leave elements out): describe it with shard_boxes / dtensor_boxes.")
    transfers = []
    for dst, want in target:
        for box in distinct:
            part = box.intersect(want)
            if part is None:
                continue
            ranks = holders[box]
            src = dst if dst in ranks else ranks[dst % len(ranks)]
            transfers.append(Transfer(src, dst, part))
    return tuple(sorted(transfers, key=lambda t: (t.src, t.dst)))


@dataclass(frozen=True)
class TargetLayout:
    """Where a tensor goes: the mesh's global ranks (`DeviceMesh.mesh`) and placements, and the mesh
    itself on the ranks that belong to it (to wrap the result as a DTensor); mesh None: a plain
    tensor on the ranks of `mesh_ranks`."""

    mesh_ranks: torch.Tensor
    placements: tuple
    mesh: object | None = None

    def boxes(self, shape: Sequence[int]) -> dict[int, Box]:
        return shard_boxes(shape, self.mesh_ranks, self.placements)

    def wrap(self, local: torch.Tensor, shape: torch.Size, stride: tuple[int, ...]) -> torch.Tensor:
        """This rank's piece `local` as the target wants it: a DTensor of global `shape` and `stride` on
        the target's mesh, or the plain tensor without a mesh."""
        if self.mesh is None:
            return local
        return DTensor.from_local(local, self.mesh, self.placements, run_check=False, shape=shape, stride=stride)
