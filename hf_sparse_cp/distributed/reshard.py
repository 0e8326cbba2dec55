"""Move sharded training state between two shard layouts without a checkpoint (slice intersection).

Every state tensor (a weight, an Adam moment, a SMET per-row state) lives in one logical coordinate
space: its global shape, as if no dimension were parallel. A layout maps each rank to the box of
that space it holds (`Box`; `shard_boxes` derives it from a device mesh and DTensor placements, e.g.
FSDP2's `Shard(0)` over dp_shard x cp, or HSDP's `(Replicate(), Shard(0))`). Moving from layout A to
layout B is the intersection of the two maps (`plan_transfers`): for every rank of B, which rank of
A sends it which box. Replicated source boxes are sent by the receiving rank itself when it holds a
copy, else by one holder chosen round robin so that no holder sends everything.

`move_tensor` runs one tensor's plan: every rank posts its non-blocking sends and receives in the
plan's order (the same list on every rank) and then waits, so no rank blocks before all of its
transfers are in flight and no cycle of waits can form. `move_state` moves a whole state dict one
tensor at a time, taking each source out of the dict before moving it and allocating the
destination just before receiving, so that the memory held beyond the state itself stays near one
tensor's shard; `MemoryMeter` counts what the mover allocates and releases.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard


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
    boxes = {}
    for coord in torch.cartesian_prod(*(torch.arange(n) for n in mesh_ranks.shape)).reshape(-1, mesh_ranks.dim()):
        start, stop = [0] * len(shape), [int(s) for s in shape]
        for mesh_dim, p in enumerate(placements):
            if isinstance(p, Shard):
                d, n, i = p.dim, mesh_ranks.shape[mesh_dim], int(coord[mesh_dim])
                size = stop[d] - start[d]
                chunk = -(-size // n)
                start[d], stop[d] = start[d] + min(i * chunk, size), start[d] + min((i + 1) * chunk, size)
        boxes[int(mesh_ranks[tuple(coord.tolist())])] = Box(tuple(start), tuple(stop))
    return boxes


def dtensor_boxes(tensor: torch.Tensor) -> dict[int, Box]:
    """`shard_boxes` of a DTensor; a plain tensor is held whole by every rank of the default group."""
    if isinstance(tensor, DTensor):
        return shard_boxes(tensor.shape, tensor.device_mesh.mesh, tensor.placements)
    world = dist.get_world_size() if dist.is_initialized() else 1
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
    total = math.prod(int(s) for s in shape)
    holders: dict[Box, list[int]] = {}
    for rank, box in sorted(source.items()):
        if box.numel:
            holders.setdefault(box, []).append(rank)
    distinct = sorted(holders, key=lambda b: b.start)
    overlap = any(a.intersect(b) for i, a in enumerate(distinct) for b in distinct[i + 1:])
    if overlap or sum(b.numel for b in distinct) != total:
        raise ValueError(f"the source layout does not tile the tensor of shape {tuple(shape)} (its boxes overlap or "
                         "leave elements out): describe it with shard_boxes / dtensor_boxes.")
    transfers = []
    for dst, want in sorted(target.items()):
        for box in distinct:
            part = box.intersect(want)
            if part is None:
                continue
            ranks = holders[box]
            src = dst if dst in ranks else ranks[dst % len(ranks)]
            transfers.append(Transfer(src, dst, part))
    return sorted(transfers, key=lambda t: (t.src, t.dst))


@dataclass
class MemoryMeter:
    """Bytes a move holds beyond the state it started with: what it allocates (destinations, staging
    copies) minus the sources it has released. `peak` is the largest value seen."""

    current: int = 0
    peak: int = 0

    def add(self, nbytes: int) -> None:
        self.current += nbytes
        self.peak = max(self.peak, self.current)

    def release(self, nbytes: int) -> None:
        self.current -= nbytes


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def move_tensor(
    local: torch.Tensor | None,
    plan: Sequence[Transfer],
    source_box: Box | None,
    target_box: Box | None,
    *,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    meter: MemoryMeter | None = None,
) -> torch.Tensor | None:
    """Run one tensor's plan on this rank; call on every rank of the default group with the same `plan`.

    Args:
        local: this rank's source shard (holding `source_box`), or None when it holds none.
        plan: `plan_transfers` of the tensor.
        source_box, target_box: what this rank holds before and after (None: nothing).
        dtype, device: of the destination shard.
        meter: counts the destination and any staging copy.

    Returns:
        This rank's destination shard [target_box.shape], or None without a target box.
    """
    meter = meter if meter is not None else MemoryMeter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    out = None if target_box is None else torch.empty(target_box.shape, dtype=dtype, device=device)
    if out is not None:
        meter.add(_nbytes(out))
    ops, staged = [], []  # staged: (buffer, where it lands or None, bytes the meter counted for it)
    for t in plan:
        if t.src == rank and t.dst == rank:
            out[t.box.within(target_box)].copy_(local[t.box.within(source_box)])
        elif t.src == rank:
            piece = local[t.box.within(source_box)]
            extra = 0
            if not piece.is_contiguous():  # gloo and NCCL send contiguous memory
                piece = piece.contiguous()
                extra = _nbytes(piece)
                meter.add(extra)
            ops.append(dist.isend(piece, t.dst))
            staged.append((piece, None, extra))
        elif t.dst == rank:
            view = out[t.box.within(target_box)]
            buffer, extra = view, 0
            if not view.is_contiguous():
                buffer = torch.empty(view.shape, dtype=dtype, device=device)
                extra = _nbytes(buffer)
                meter.add(extra)
            ops.append(dist.irecv(buffer, t.src))
            staged.append((buffer, view, extra))
    for op in ops:
        op.wait()
    for buffer, view, extra in staged:
        if view is not None and extra:
            view.copy_(buffer)
        meter.release(extra)
    return out


@dataclass(frozen=True)
class TargetLayout:
    """Where a tensor goes: the mesh's global ranks (`DeviceMesh.mesh`) and placements, and the mesh
    itself on the ranks that belong to it (to wrap the result as a DTensor); mesh None: a plain
    tensor, whole on every rank of `mesh_ranks`."""

    mesh_ranks: torch.Tensor
    placements: tuple
    mesh: object | None = None

    def boxes(self, shape: Sequence[int]) -> dict[int, Box]:
        return shard_boxes(shape, self.mesh_ranks, self.placements)


def move_state(
    state: MutableMapping[str, torch.Tensor],
    target: Callable[[str, torch.Tensor], TargetLayout],
    *,
    meter: MemoryMeter | None = None,
) -> dict[str, torch.Tensor]:
    """Move every tensor of `state` to its target layout, one tensor at a time; call on every rank of
    the default group with the same keys in the same order.

    Args:
        state: {name: DTensor, or a plain tensor every rank holds whole}. Emptied as it goes: each
            source leaves the dict before it is moved, so its memory is released once moved (when
            nothing else holds it).
        target: (name, source tensor) -> its `TargetLayout`.
        meter: counts destinations and staging copies added and sources released.

    Returns:
        {name: the moved tensor} on the ranks of each target: a DTensor on `layout.mesh`, or a plain
        tensor when the target has no mesh. A rank outside a target's mesh gets no entry for it.
    """
    meter = meter if meter is not None else MemoryMeter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    moved = {}
    for name in list(state):
        tensor = state.pop(name)
        layout = target(name, tensor)
        source = dtensor_boxes(tensor)
        goal = layout.boxes(tensor.shape)
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        out = move_tensor(local if rank in source else None, plan_transfers(tensor.shape, source, goal),
                          source.get(rank), goal.get(rank), dtype=tensor.dtype, device=local.device, meter=meter)
        released = _nbytes(local)
        shape, stride = tensor.shape, tensor.stride()
        del tensor, local
        meter.release(released)
        if out is None:
            continue
        if layout.mesh is None:
            moved[name] = out
        else:
            moved[name] = DTensor.from_local(out, layout.mesh, layout.placements, run_check=False, shape=shape,
                                             stride=stride)
    return moved
