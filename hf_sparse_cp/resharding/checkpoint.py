"""A sharded checkpoint of training state that resumes with another world size through the slice-intersection plan.

`save_sharded_state` writes what each rank holds, as it holds it: one safetensors file per rank with
its local shard of every tensor, and `layout.json` with every tensor's global shape, dtype and the
box (`boxes.Box`) each saved rank holds. `load_sharded_state` lays the same tensors out for the
processes that load them, which may be more or fewer: for each tensor it plans the transfers from the
saved boxes to the new layout with `boxes.plan_transfers` (the saved ranks as sources, the new ranks
as targets) and fills its destination by reading from each saved rank's file only the slice that
intersects its new box; no process reads a whole file and none communicates.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..distributed.comm import rank_and_world
from ..dtensors import contiguous_stride
from .boxes import Box, TargetLayout, dtensor_boxes, plan_transfers

LAYOUT_FILE = "layout.json"


def shard_file(rank: int, world: int) -> str:
    return f"shard-{rank:05d}-of-{world:05d}.safetensors"


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{LAYOUT_FILE} names dtype {name!r}, which this torch does not have.")
    return dtype


def save_sharded_state(state: Mapping[str, torch.Tensor], folder: str | os.PathLike, *,
                       writes_layout: bool | None = None) -> None:
    """Write `state` as this rank holds it; call on every rank of the default group with the same keys.

    Args:
        state: {name: DTensor (FSDP2 parameters, their AdamW moments, SMET's per-row state), or a
            plain tensor every rank holds whole (written by every rank, e.g. AdamW's `step`: a folder
            that only its own ranks wrote, on storage other nodes do not share, holds it)}.
            Layouts are those `boxes.shard_boxes` describes: `Shard(d)` and `Replicate()`.
        folder: created if needed; gets one `shard-RANK-of-WORLD.safetensors` per rank that holds a
            non-empty piece, and `layout.json` once every rank has written.
        writes_layout: whether this rank writes `layout.json` (default: rank 0). The Trainer's first
            process of every node with `save_on_each_node` (`TrainingArguments.should_save`), so that a
            node without shared storage resumes from its own folder with the same processes.

    Raises TypeError, naming the key, for a key that is not a string or a value that is not a tensor (a step
    counter as an int: `torch.tensor(step)`), before any file is written.
    """
    from safetensors.torch import save_file

    _check_state(state)
    rank, world = rank_and_world()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    layout, pieces = {}, {}
    for name, tensor in state.items():
        boxes = dtensor_boxes(tensor)  # (a plain tensor: whole on every rank)
        held = {r: b for r, b in boxes.items() if b.numel}
        layout[name] = {"shape": list(tensor.shape), "dtype": str(tensor.dtype).removeprefix("torch."),
                        "boxes": {str(r): [list(b.start), list(b.stop)] for r, b in held.items()}}
        if rank in held:
            local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
            pieces[name] = local.detach().contiguous()
    if pieces:
        save_file(pieces, str(folder / shard_file(rank, world)))
    if dist.is_initialized():
        dist.barrier()  # every file is complete before the layout says the checkpoint is
    if writes_layout is None:
        writes_layout = rank == 0
    if writes_layout:
        tmp = folder / f"{LAYOUT_FILE}.{rank}.tmp"  # (several writers share a folder on shared storage)
        tmp.write_text(json.dumps({"world_size": world, "tensors": layout}))
        os.replace(tmp, folder / LAYOUT_FILE)


def _check_state(state: Mapping[str, torch.Tensor]) -> None:
    """Raise TypeError, naming the key and the fix, unless `state` maps names to tensors (a file holds only those;
    anything else ended in an AttributeError at its `.shape`, or safetensors' error naming no key)."""
    if not isinstance(state, Mapping):
        raise TypeError(f"save_sharded_state takes a mapping of names to tensors, not {type(state).__name__}.")
    for name, value in state.items():
        if not isinstance(name, str):
            raise TypeError(f"save_sharded_state: key {name!r} ({type(name).__name__}) must be a string (the tensor's "
                            f"name in the files), e.g. {str(name)!r}.")
        if not isinstance(value, torch.Tensor):
            fix = (f"store it as a tensor, e.g. torch.tensor({value!r})" if isinstance(value, (bool, int, float)) else
                   "keep only tensors in the sharded state (DTensors, or plain tensors every rank holds whole) and "
                   "save the rest another way")
            raise TypeError(f"save_sharded_state: {name!r} is {'None' if value is None else type(value).__name__}, not "
                            f"a tensor: {fix}.")


@dataclass(frozen=True)
class SavedTensor:
    """What `layout.json` says of one tensor: global shape, dtype, and the box each saved rank holds."""

    shape: torch.Size
    dtype: torch.dtype
    boxes: dict[int, Box]


def read_layout(folder: str | os.PathLike) -> tuple[int, dict[str, SavedTensor]]:
    """(saved world size, {name: SavedTensor}) of a folder `save_sharded_state` wrote."""
    path = Path(folder) / LAYOUT_FILE
    if not path.is_file():
        raise ValueError(f"{str(folder)!r} holds no {LAYOUT_FILE}: it is not a complete sharded state (written by "
                         "save_sharded_state, whose rank 0 writes the layout last; with save_on_each_node, every "
                         "node's first process).")
    try:  # (a damaged file ended in a JSONDecodeError or KeyError that named neither it nor the checkpoint)
        content = json.loads(path.read_text())
        tensors = {name: SavedTensor(torch.Size(t["shape"]), _dtype(t["dtype"]),
                                     {int(r): Box(tuple(a), tuple(b)) for r, (a, b) in t["boxes"].items()})
                   for name, t in content["tensors"].items()}
        return int(content["world_size"]), tensors
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise ValueError(f"{str(path)!r} is damaged ({type(e).__name__}: {e}), so the sharded state it describes "
                         "cannot be read: resume from another checkpoint.") from None


@dataclass
class ReadCounter:
    """Bytes and slices `load_sharded_state` read from the saved files."""

    bytes: int = 0
    slices: int = 0


def load_sharded_state(
    folder: str | os.PathLike,
    target: Callable[[str, torch.Tensor], TargetLayout],
    *,
    counter: ReadCounter | None = None,
) -> dict[str, torch.Tensor]:
    """Lay out the state saved in `folder` (by any number of processes) for the processes loading it.

    Args:
        folder: written by `save_sharded_state`.
        target: (name, a meta tensor of the saved global shape and dtype) -> its `TargetLayout` in this
            run (e.g. the layout of the parameter it belongs to).
        counter: counts the bytes and slices read.

    Returns:
        {name: tensor} for every saved tensor this rank holds a piece of in its target: a DTensor on the
        target's mesh, or a plain tensor when the target has no mesh. Raises ValueError, naming the
        fix, when a saved file is missing or a target names a rank this run does not have.
    """
    from safetensors import safe_open

    counter = counter if counter is not None else ReadCounter()
    rank, world = rank_and_world()
    saved_world, tensors = read_layout(folder)
    files: dict[int, object] = {}

    def source(saved_rank: int):
        if saved_rank not in files:
            path = Path(folder) / shard_file(saved_rank, saved_world)
            if not path.is_file():
                raise ValueError(f"{str(folder)!r} lacks {path.name}, which {LAYOUT_FILE} lists: the sharded state is "
                                 "incomplete, or saved on nodes without shared storage (save_on_each_node), where each "
                                 "node's folder holds its own processes' files, and a resume on other processes reads "
                                 "any of them: copy every node's shard-* files into one folder, or resume from another "
                                 "checkpoint.")
            files[saved_rank] = safe_open(str(path), framework="pt")
        return files[saved_rank]

    loaded = {}
    for name, saved in tensors.items():
        layout = target(name, torch.empty(saved.shape, dtype=saved.dtype, device="meta"))
        if not isinstance(layout, TargetLayout):  # (it ended in an AttributeError at `.boxes`)
            raise TypeError(f"load_sharded_state: target({name!r}, ...) returned {type(layout).__name__}, not a "
                            "TargetLayout: return one for every saved tensor, e.g. TargetLayout(mesh.mesh, "
                            "param.placements, mesh) of the parameter it belongs to, or TargetLayout(torch.arange("
                            "world), (Replicate(),)) for a tensor whole on every rank.")
        goal = layout.boxes(saved.shape)
        outside = sorted(r for r in goal if not 0 <= r < world)
        if outside:
            raise ValueError(f"the target layout of {name!r} names ranks {outside}, but this run has {world} "
                             "processes: build the target from this run's device mesh.")
        mine = goal.get(rank)
        if mine is None:
            continue  # this rank holds none of the tensor
        out = torch.empty(mine.shape, dtype=saved.dtype)
        for t in plan_transfers(saved.shape, saved.boxes, goal):
            if t.dst != rank:
                continue
            piece = source(t.src).get_slice(name)
            within = t.box.within(saved.boxes[t.src])
            value = piece[within] if within else source(t.src).get_tensor(name)  # (a 0-dim tensor has no slices)
            out[t.box.within(mine)] = value
            counter.bytes += value.numel() * value.element_size()
            counter.slices += 1
        loaded[name] = layout.wrap(out, saved.shape, contiguous_stride(saved.shape))
    return loaded

