"""The slice-intersection plan (`hf_sparse_cp.resharding.boxes`) on its own, no processes: transfers
applied to in-memory shards. The sharded checkpoint's loader runs it across processes
(test_sharded_checkpoint.py)."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from hf_sparse_cp.resharding.boxes import Box, plan_transfers, shard_boxes


def _simulate(full: torch.Tensor, source: dict, target: dict) -> tuple[dict, list]:
    """Apply the plan to shards cut from `full`; returns the target shards and the plan."""
    held = {r: full[b.within(Box.whole(full.shape))].clone() for r, b in source.items()}
    plan = plan_transfers(full.shape, source, target)
    out = {r: torch.full(b.shape, float("nan"), dtype=full.dtype) for r, b in target.items()}
    hits = {r: torch.zeros(b.shape, dtype=torch.int64) for r, b in target.items()}
    for t in plan:
        assert t.box.intersect(source[t.src]) == t.box and t.box.intersect(target[t.dst]) == t.box
        out[t.dst][t.box.within(target[t.dst])] = held[t.src][t.box.within(source[t.src])]
        hits[t.dst][t.box.within(target[t.dst])] += 1
    for r in target:
        assert bool((hits[r] == 1).all()), f"rank {r} receives an element other than once"
    return out, plan


def test_shard_boxes_follow_torch_chunk_and_nesting():
    # FSDP2: Shard(0) over 4 ranks of 10 rows -> 3, 3, 3, 1; of 5 rows -> 2, 2, 1, 0 (the last shard empty)
    boxes = shard_boxes((10, 3), torch.arange(4), [Shard(0)])
    assert [boxes[r].shape for r in range(4)] == [(3, 3), (3, 3), (3, 3), (1, 3)]
    assert [boxes[r].numel for r in range(4)] == [c.numel() for c in torch.ones(10, 3).chunk(4)]
    assert [shard_boxes((5,), torch.arange(4), [Shard(0)])[r].shape for r in range(4)] == [(2,), (2,), (1,), (0,)]
    # HSDP (replicate x shard) on a 2 x 2 mesh: ranks 0 and 2 hold the same half
    hsdp = shard_boxes((7, 2), torch.arange(4).view(2, 2), [Replicate(), Shard(0)])
    assert hsdp[0] == hsdp[2] == Box((0, 0), (4, 2)) and hsdp[1] == hsdp[3] == Box((4, 0), (7, 2))
    # Shard(0) twice splits the first split again, in mesh-dimension order; a permuted mesh moves boxes
    nested = shard_boxes((9,), torch.tensor([[3, 1], [0, 2]]), [Shard(0), Shard(0)])
    assert [nested[r] for r in (3, 1, 0, 2)] == [Box((0,), (3,)), Box((3,), (5,)), Box((5,), (7,)), Box((7,), (9,))]


LAYOUTS = {
    "fsdp4": (torch.arange(4), [Shard(0)]),
    "fsdp4-permuted": (torch.tensor([2, 0, 3, 1]), [Shard(0)]),
    "hsdp2x2": (torch.arange(4).view(2, 2), [Replicate(), Shard(0)]),
    "fsdp2-of-4": (torch.tensor([0, 1]), [Shard(0)]),
    "fsdp3-on-1-2-3": (torch.tensor([1, 2, 3]), [Shard(0)]),
    "rows-x-cols": (torch.arange(4).view(2, 2), [Shard(0), Shard(1)]),
    "replicated": (torch.arange(4), [Replicate()]),
    "single": (torch.tensor([3]), [Shard(1)]),
}


@pytest.mark.parametrize("shape", [(11, 5), (3, 7), (1, 2)], ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("src", sorted(LAYOUTS))
@pytest.mark.parametrize("dst", sorted(LAYOUTS))
def test_plan_moves_every_element_once(src, dst, shape):
    full = torch.randn(shape, dtype=torch.float64)
    source, target = shard_boxes(shape, *LAYOUTS[src]), shard_boxes(shape, *LAYOUTS[dst])
    out, plan = _simulate(full, source, target)
    for r, box in target.items():
        assert torch.equal(out[r], full[box.within(Box.whole(shape))])
    # a rank that already holds a piece of its target takes it from itself
    for t in plan:
        if t.src != t.dst:
            assert t.dst not in source or t.box.intersect(source[t.dst]) != t.box
    assert plan == sorted(plan, key=lambda t: (t.src, t.dst))


def test_replicated_sources_share_the_sending():
    shape = (8, 2)
    plan = plan_transfers(shape, shard_boxes(shape, torch.arange(4), [Replicate()]),
                          shard_boxes(shape, torch.tensor([4, 5, 6, 7]), [Shard(0)]))
    assert sorted(t.src for t in plan) == [0, 1, 2, 3]  # each new rank from another holder, none sends twice


def test_a_source_that_does_not_tile_the_tensor_is_refused():
    with pytest.raises(ValueError, match="does not tile"):
        plan_transfers((4,), {0: Box((0,), (3,)), 1: Box((2,), (4,))}, {0: Box((0,), (4,))})
    with pytest.raises(ValueError, match="does not tile"):
        plan_transfers((4,), {0: Box((0,), (3,))}, {0: Box((0,), (4,))})
    with pytest.raises(ValueError, match="Partial"):
        from torch.distributed.tensor import Partial

        shard_boxes((4,), torch.arange(2), [Partial()])


def test_a_shard_of_a_dimension_the_tensor_lacks_and_a_damaged_layout_file_are_named(tmp_path):
    """A target layout that shards dimension 5 of a 2-D tensor ended in an IndexError inside the box arithmetic; a
    sharded state whose layout.json is damaged (cut off, or without its tensors) in a JSONDecodeError or a KeyError
    that named neither the file nor what to do. Both are ValueErrors naming them; Shard(-1), as DTensor takes it,
    still lays out the last dimension."""
    from hf_sparse_cp.resharding.checkpoint import LAYOUT_FILE, read_layout

    with pytest.raises(ValueError, match=r"^placement S\(5\) shards dimension 5 of a tensor of shape \(6, 4\), which "
                                         r"has 2: shard one of its dimensions, or Replicate\(\) it\.$"):
        shard_boxes((6, 4), torch.arange(2), [Shard(5)])
    assert shard_boxes((6, 4), torch.arange(2), [Shard(-1)])[1] == Box((0, 2), (6, 4))
    for text, cause in [('{"world_size": 2, "tens', "JSONDecodeError: "), ("{}", "KeyError: 'tensors'"),
                        ('{"world_size": 1, "tensors": {"w": {"shape": [2]}}}', "KeyError: 'dtype'")]:
        (tmp_path / LAYOUT_FILE).write_text(text)
        with pytest.raises(ValueError, match=rf"^'{tmp_path / LAYOUT_FILE}' is damaged \({cause}.*\), so the sharded "
                                             r"state it describes cannot be read: resume from another checkpoint\.$"):
            read_layout(tmp_path)
