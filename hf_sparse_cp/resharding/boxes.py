"""Move sharded training state between two shard layouts without a checkpoint (slice intersection).

Every state tensor (a weight, an Adam moment, a SMET per-row state) lives in one logical coordinate
space: its global shape, as if no dimension were parallel. A layout maps each rank to the box of
that space it holds (`Box`; `shard_boxes` derives it from a device mesh and DTensor placements, e.g.
FSDP2's `Shard(0)` over dp_shard x cp, or HSDP's `(Replicate(), Shard(0))`). Moving from layout A to
layout B is the intersection of the two maps (`plan_transfers`): for every rank of B, which rank of
A sends it which box. Replicated source boxes are sent by the receiving rank itself when it holds a
copy, else by one holder chosen round robin so that no holder sends everything.

`move_state` first checks that every rank moves the same tensors between the same layouts (one
all-gather of a digest; plans that disagree would cross messages), then moves the state dict bucket
by bucket (consecutive tensors up to a byte budget, the same buckets on every rank): a shard whose
box does not change stays as it is (no copy); the rest of a bucket's destinations are allocated just
before receiving. Pieces of at least `DIRECT_BYTES` travel straight from the source shard into their
place (dim-0 boxes are contiguous; others go through a staging copy); the smaller pieces a rank
sends one peer in a bucket are packed into one message per dtype, since a message costs more than
copying a small piece twice. A bucket's receives and sends are posted as one batch (`comm.P2PComm`,
`batch_isend_irecv`; both ends of a pair cut and order their messages alike, from the same plans):
NCCL runs it as one group, so two ranks exchanging shards cannot block each other, and no rank waits
before all of its transfers are in flight. The next bucket is planned and posted while the last one
travels (two in flight at most). Each source leaves the dict before its bucket moves and is released
after it, so the memory held beyond the state stays near two buckets; `MemoryMeter` counts what the
move allocates and releases. `TensorMove` (one tensor's plan, source and destination on this rank)
is shared with `checkpoint.py`, whose loader fills destinations from files.
"""

from __future__ import annotations

import functools
import hashlib
import math
from collections.abc import Callable, Mapping, MutableMapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard

from ..distributed.comm import P2PComm, Pending, all_gather_rows, group_device
from ..distributed.comm import Transfer as CommTransfer


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


@dataclass
class TensorMove:
    """One tensor on this rank: its plan (at least the transfers to and from this rank), the box it
    holds before (`source_box`, `local`) and after (`target_box`), and the result `out`; shared by
    `move_state` and the sharded checkpoint's loader."""

    name: str
    plan: list[Transfer]
    layout: TargetLayout
    local: torch.Tensor | None
    source_box: Box | None
    target_box: Box | None
    shape: torch.Size
    stride: tuple[int, ...]
    dtype: torch.dtype
    out: torch.Tensor | None = None

    def allocate(self, rank: int, meter: MemoryMeter, device: torch.device | str = "cpu") -> None:
        """Set `out`: the source shard itself when its box does not change (no copy), else a new tensor
        of the target box (counted by `meter`) on the source shard's device, or on `device` where this
        rank held none; nothing on a rank that receives none of the tensor."""
        if self.target_box is None:
            return
        mine = [t for t in self.plan if t.dst == rank]
        if len(mine) == 1 and mine[0].src == rank and self.source_box == self.target_box:
            self.out = self.local
            return
        self.out = torch.empty(self.target_box.shape, dtype=self.dtype,
                               device=self.local.device if self.local is not None else device)
        meter.add(_nbytes(self.out))

    def result(self) -> torch.Tensor:
        """`out` as the target wants it: a DTensor on the target's mesh, or the plain tensor."""
        if self.layout.mesh is None:
            return self.out
        return DTensor.from_local(self.out, self.layout.mesh, self.layout.placements, run_check=False,
                                  shape=self.shape, stride=self.stride)


# A piece at least this large travels as its own message, straight from the source shard into its place;
# smaller ones to the same peer are packed into one message per bucket and dtype (one copy each way).
DIRECT_BYTES = 64 << 10


@dataclass
class _Message:
    """One message between this rank and `peer`: its pieces (views of the shards), in plan order."""

    peer: int
    dtype: torch.dtype
    pieces: list[torch.Tensor]
    buffer: torch.Tensor | None = None

    @property
    def packed(self) -> bool:
        """Whether the message travels in a staging buffer of its own rather than as its one piece."""
        return self.buffer is not self.pieces[0]

    def packed_views(self) -> list[torch.Tensor]:
        """The staging buffer cut into one view per piece, in order, each of its piece's shape."""
        return [part.view(piece.shape)
                for part, piece in zip(self.buffer.split([p.numel() for p in self.pieces]), self.pieces)]


def _messages(pieces: dict[tuple[int, torch.dtype], list[torch.Tensor]], direct_bytes: int) -> list[_Message]:
    """Each (peer, dtype) group's pieces as messages: large ones alone, the rest together. Both ends of a
    pair see the same group in the same order (the same plans), so they cut the same messages."""
    out = []
    for (peer, dtype), group in pieces.items():
        small = [p for p in group if p.numel() * p.element_size() < direct_bytes]
        out += [_Message(peer, dtype, [p]) for p in group if p.numel() * p.element_size() >= direct_bytes]
        if small:
            out.append(_Message(peer, dtype, small))
    return out


@dataclass
class _Bucket:
    """A bucket in flight: its moves, its messages, and the transfers posted for them."""

    moves: list[TensorMove]
    receives: list[_Message]
    sends: list[_Message]
    pending: Pending


def _staging(msg: _Message, meter: MemoryMeter) -> torch.Tensor:
    """The message's one piece itself when it is contiguous, else a new buffer for all of its pieces
    (gloo and NCCL send and receive contiguous memory)."""
    piece = msg.pieces[0]
    if len(msg.pieces) == 1 and piece.is_contiguous():
        return piece
    buffer = torch.empty(sum(p.numel() for p in msg.pieces), dtype=msg.dtype, device=piece.device)
    meter.add(_nbytes(buffer))
    return buffer


def _post_bucket(moves: list[TensorMove], rank: int, meter: MemoryMeter, direct_bytes: int, comm: P2PComm,
                 tags: dict[tuple[bool, int], int], device: torch.device) -> _Bucket:
    """Start a bucket: destinations allocated, local pieces copied, every message posted in one batch.
    `tags` numbers each pair's messages in each direction over the whole move (gloo matches by tag),
    so that two buckets in flight never share one."""
    incoming: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    outgoing: dict[tuple[int, torch.dtype], list[torch.Tensor]] = {}
    for m in moves:
        m.allocate(rank, meter, device)
        for t in m.plan:
            if t.dst == rank and t.src == rank:
                if m.out is not m.local:
                    m.out[t.box.within(m.target_box)].copy_(m.local[t.box.within(m.source_box)])
            elif t.dst == rank:
                incoming.setdefault((t.src, m.dtype), []).append(m.out[t.box.within(m.target_box)])
            elif t.src == rank:
                outgoing.setdefault((t.dst, m.dtype), []).append(m.local[t.box.within(m.source_box)])
    receives, sends = _messages(incoming, direct_bytes), _messages(outgoing, direct_bytes)
    transfers = []
    for messages, send in ((receives, False), (sends, True)):
        for msg in messages:
            msg.buffer = _staging(msg, meter)
            if send and msg.packed:
                for view, piece in zip(msg.packed_views(), msg.pieces):
                    view.copy_(piece)
            tag = tags[send, msg.peer] = tags.get((send, msg.peer), -1) + 1
            transfers.append(CommTransfer(msg.peer, msg.buffer, send, tag))
    # One batch (torch.distributed.batch_isend_irecv): NCCL launches it as one group, so two ranks that
    # exchange with each other cannot each block on a receive queued before their send; gloo runs every
    # message at once on its own threads.
    return _Bucket(moves, receives, sends, comm.post(transfers))


def _collect(bucket: _Bucket, meter: MemoryMeter, moved: dict[str, torch.Tensor]) -> None:
    """Finish a bucket: wait for its messages, unpack the packed ones, release the staging buffers and
    the sources, put its results into `moved`."""
    bucket.pending.wait()
    for msg in bucket.receives:
        if msg.packed:
            for view, piece in zip(msg.packed_views(), msg.pieces):
                piece.copy_(view)
    for msg in bucket.receives + bucket.sends:
        if msg.packed:
            meter.release(_nbytes(msg.buffer))
        msg.buffer = None
    for m in bucket.moves:
        if m.local is not None and m.out is not m.local:
            meter.release(_nbytes(m.local))
        if m.out is not None:
            moved[m.name] = m.result()


@torch.no_grad()  # (also: DTensor.to_local without an autograd node per tensor)
def move_state(
    state: MutableMapping[str, torch.Tensor],
    target: Callable[[str, torch.Tensor], TargetLayout],
    *,
    meter: MemoryMeter | None = None,
    budget_bytes: int | None = None,
    direct_bytes: int = DIRECT_BYTES,
) -> dict[str, torch.Tensor]:
    """Move every tensor of `state` to its target layout; call on every rank of the default group with
    the same keys in the same order.

    Args:
        state: {name: DTensor, or a plain tensor every rank of the default group holds whole}. Emptied
            as it goes: each bucket's sources leave the dict before it moves, so their memory is
            released once moved (when nothing else holds them).
        target: (name, source tensor) -> its `TargetLayout`; called for every tensor before anything
            moves. Every rank must name the same layouts: a rank whose tensors (names, order, shapes,
            dtypes) or layouts (source or target) differ from rank 0's makes every rank raise ValueError
            before anything moves (plans that disagree would cross messages), as does a layout that
            cannot be planned (e.g. a `Partial` placement); the state is then left whole.
        meter: counts destinations and staging copies added, sources released.
        budget_bytes: a bucket holds consecutive tensors up to this many bytes per rank (global bytes /
            world size, so every rank cuts the same buckets); a larger tensor is a bucket of its own.
            Two buckets are in flight at a time (the next one is planned and posted while the last
            one's messages travel). Default: an eighth of the state per rank, at most 32 MiB, so that
            both buckets' destinations and packing copies stay within one shard of the state.
        direct_bytes: pieces of at least this many bytes travel as their own message, unpacked.

    Returns:
        {name: the moved tensor} on the ranks of each target: a DTensor on `layout.mesh`, or a plain
        tensor when the target has no mesh. A rank outside a target's mesh gets no entry for it.
    """
    meter = meter if meter is not None else MemoryMeter()
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    comm, device = P2PComm(None), group_device() if dist.is_initialized() else torch.device("cpu")
    # Before anything moves: each tensor's target and its kind (shape, dtype, source mesh and placements,
    # target), numbered in order of first appearance; the ranks' agreement; then one plan per kind (a
    # weight and its optimizer moments are usually one kind), keeping the transfers of this rank only (a
    # rank walks its own, not the world's). A layout the plan refuses thus raises on every rank with the
    # state whole. A kind pins its mesh and layout, so no id in a key is reused.
    layouts, keys, kinds, total = {}, {}, {}, 0
    for name, tensor in state.items():
        layout = layouts[name] = target(name, tensor)
        mesh = tensor.device_mesh if isinstance(tensor, DTensor) else None
        placements = tuple(tensor.placements) if mesh is not None else None
        key = keys[name] = (tuple(tensor.shape), tensor.dtype, mesh, placements, id(layout))
        if key not in kinds:
            kinds[key] = (len(kinds), mesh, layout, name)
        total += _nbytes(tensor)
    if budget_bytes is None:
        budget_bytes = min(32 << 20, total // world // 8)
    if world > 1:
        _check_same_move(keys, kinds, world, device)
    plans = {}
    for key, (_, _, layout, name) in kinds.items():
        tensor = state[name]
        source, goal = dtensor_boxes(tensor), layout.boxes(tensor.shape)
        mine = [t for t in plan_transfers(tensor.shape, source, goal) if rank in (t.src, t.dst)]
        plans[key] = (mine, source.get(rank), goal.get(rank))
    moved, bucket, bucket_bytes, in_flight, tags = {}, [], 0, None, {}
    names = list(state)
    for i, name in enumerate(names):
        tensor, layout = state.pop(name), layouts.pop(name)
        plan, source_box, target_box = plans[keys[name]]
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        bucket.append(TensorMove(name, plan, layout, local if source_box is not None else None, source_box,
                                 target_box, tensor.shape, tensor.stride(), tensor.dtype))
        bucket_bytes += _nbytes(tensor) // world  # a DTensor's nbytes are its global size
        del tensor, local
        if bucket_bytes < budget_bytes and i + 1 < len(names):
            continue
        posted = _post_bucket(bucket, rank, meter, direct_bytes, comm, tags, device)
        if in_flight is not None:
            _collect(in_flight, meter, moved)
        in_flight, bucket, bucket_bytes = posted, [], 0
    if in_flight is not None:
        _collect(in_flight, meter, moved)
    return moved


def _check_same_move(keys: Mapping[str, tuple], kinds: Mapping[tuple, tuple], world: int, device: torch.device) -> None:
    """Raise on every rank unless all ranks move the same tensors between the same layouts: one all-gather
    of a digest of every name with the number of its kind, and of every kind (shape, dtype, source mesh
    ranks and placements, target mesh ranks and placements). It is also the default group's first
    collective of the move, which NCCL needs before a batch that leaves ranks out."""
    digest = hashlib.blake2b(digest_size=8)
    for name, key in keys.items():
        digest.update(repr((name, kinds[key][0])).encode())
    for (shape, dtype, _, placements, _), (_, mesh, layout, _) in kinds.items():
        source = mesh.mesh.tolist() if mesh is not None else "whole"
        digest.update(repr((shape, dtype, source, placements, layout.mesh_ranks.tolist(), layout.placements)).encode())
    mine = torch.tensor([int.from_bytes(digest.digest(), "little", signed=True)], device=device)
    every = torch.empty(world, dtype=torch.int64, device=device)
    all_gather_rows(every, mine, None)
    values = every.tolist()
    differ = [r for r, value in enumerate(values) if value != values[0]]
    if differ:
        raise ValueError(f"move_state: ranks {differ} move other tensors (names, order, shapes or dtypes) or other "
                         "layouts than rank 0: call it on every rank with the same state keys in the same order and "
                         "targets built from the same device meshes.")
