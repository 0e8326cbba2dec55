"""The slice-intersection plan (`hf_sparse_cp.resharding.boxes`): the planning logic on its own
(no processes: transfers applied to in-memory shards), then 4 gloo processes moving an FSDP2 model
and its AdamW state, and SMET's state, between device meshes, compared with the gathered tensors
before the move."""

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard

from hf_sparse_cp.resharding.boxes import Box, MemoryMeter, plan_transfers, shard_boxes


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


def test_memory_meter_tracks_the_peak():
    meter = MemoryMeter()
    meter.add(10)
    meter.release(4)
    meter.add(3)
    assert (meter.current, meter.peak) == (9, 10)


# ---- 4 gloo processes: an FSDP2 model and its AdamW state between meshes ----

SIZES = (7, 13, 5)  # uneven shards over 2, 3 and 4 ranks


def _model(seed: int, mesh) -> torch.nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.Tanh(),
                                torch.nn.Linear(SIZES[1], SIZES[2])).double()
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def _step(model, opt, rank: int, seed: int) -> None:
    torch.manual_seed(seed)
    x = torch.randn(8, SIZES[0], dtype=torch.float64)
    model(x[2 * rank : 2 * rank + 2]).pow(2).mean().backward()  # each rank its rows: the same mean gradient
    opt.step()
    opt.zero_grad()


def _state(model, opt) -> dict:
    """Parameters and optimizer state by name (DTensors; `step` a plain tensor every rank holds)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach()
        for key, value in opt.state[p].items():
            out[f"{name}/{key}"] = value
    return out


def _gathered(state: dict) -> dict:
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).clone() for k, v in state.items()}


def _local_bytes(tensor) -> int:
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    return local.numel() * local.element_size()


def _move_smet_state(rank: int, world: int) -> bool:
    """SMET's state (integer block indices, compact moments, per-block steps; DTensors by rows from
    `state_dict`) after three steps under FSDP2, moved to HSDP 2 x 2 in buckets: gathered, unchanged."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor

    from hf_sparse_cp.resharding.boxes import TargetLayout, move_state
    from hf_sparse_cp.smet import SMETConfig

    from test_smet_common import fsdp2_smet, lm_loss, markov_tokens, tiny_llama

    model = tiny_llama(dtype=torch.float64, vocab_size=65, intermediate_size=99)  # uneven shards
    opt = fsdp2_smet(model, SMETConfig(density=0.5, block_size=1, update_interval=2), world, lr=1e-2)
    for seed in range(3):  # a topology update at step 2
        lm_loss(model, markov_tokens(8, 16, seed=seed, vocab=65)[rank::world]).backward()
        opt.step()
        opt.zero_grad()
    state = {f"{pid}/{key}": value for pid, entries in opt.state_dict()["state"].items()
             for key, value in entries.items() if isinstance(value, DTensor)}
    dtypes = {v.dtype for v in state.values()}
    before = {k: v.full_tensor() for k, v in state.items()}
    grid = torch.arange(world).view(2, world // 2)
    hsdp = DeviceMesh("cpu", grid, mesh_dim_names=("replicate", "shard"))
    moved = move_state(state, lambda *_: TargetLayout(grid, (Replicate(), Shard(0)), hsdp))
    same = moved.keys() == before.keys() and all(torch.equal(moved[k].full_tensor(), v) for k, v in before.items())
    return same and torch.float64 in dtypes and any(not d.is_floating_point for d in dtypes)


def _move_between_meshes(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    from hf_sparse_cp.resharding.boxes import TargetLayout, move_state

    mesh_a = init_device_mesh("cpu", (world,))
    model = _model(0, mesh_a)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for seed in range(2):
        _step(model, opt, rank, seed)
    before = _gathered(_state(model, opt))
    results = {}
    targets = {
        # the same 4 ranks as dp_shard x cp, each mesh dimension splitting the rows again: other boxes
        "dp2-x-cp2-nested": (torch.arange(4).view(2, 2), (Shard(0), Shard(0))),
        "hsdp2x2": (torch.arange(4).view(2, 2), (Replicate(), Shard(0))),
        "fsdp2-of-4": (torch.tensor([0, 1]), (Shard(0),)),  # what resuming on half the processes needs
    }
    for name, (ranks, placements) in targets.items():
        mesh = DeviceMesh("cpu", ranks, mesh_dim_names=("a", "b")[: ranks.dim()])
        member = rank in ranks.flatten().tolist()

        def target(key, tensor, ranks=ranks, placements=placements, mesh=mesh, member=member):
            if "step" in key:  # a scalar every rank keeps
                return TargetLayout(ranks.reshape(-1), (Replicate(),))
            return TargetLayout(ranks, placements, mesh if member else None)

        meter = MemoryMeter()
        state = _state(model, opt)
        # one tensor at a time (budget 0) to the nested mesh; buckets of several tensors, the small pieces packed
        # into one message per peer (HSDP), or every piece a message of its own (half the processes)
        options = {"dp2-x-cp2-nested": dict(budget_bytes=0), "fsdp2-of-4": dict(direct_bytes=0)}.get(name, {})
        moved = move_state(state, target, meter=meter, **options)
        assert not state  # emptied as it went
        gathered = {k: v.full_tensor() for k, v in moved.items() if hasattr(v, "full_tensor")} if member else {}
        results[name] = {"same": all(torch.equal(gathered[k], before[k]) for k in gathered) and (
            not member or len(gathered) == len([k for k in before if "step" not in k])),
            "peak": meter.peak, "net": meter.current,
            "largest": max([_local_bytes(v) for v in moved.values()], default=0)}
        if name == "hsdp2x2":
            hsdp, hsdp_state = mesh, moved
    # the moved state trains on: a model sharded on the new mesh, loaded with it, takes the same step
    model_b = _model(1, hsdp)
    opt_b = torch.optim.AdamW(model_b.parameters(), lr=1e-2)
    for pname, p in model_b.named_parameters():
        with torch.no_grad():
            p.to_local().copy_(hsdp_state[pname].to_local())
        # (the old optimizer trains on below: unshare what the move kept in place, e.g. the replicated step)
        opt_b.state[p] = {key: hsdp_state[f"{pname}/{key}"].clone() for key in ("step", "exp_avg", "exp_avg_sq")}
    _step(model, opt, rank, 5)
    _step(model_b, opt_b, rank, 5)
    results["smet"] = _move_smet_state(rank, world)
    results["trained_on"] = max(float((p.detach().full_tensor() - q.detach().full_tensor()).abs().max())
                                for p, q in zip(model.parameters(), model_b.parameters()))
    return results


@pytest.mark.slow
def test_fsdp2_model_adamw_and_smet_state_move_exactly_between_meshes():
    from hf_sparse_cp.testing.spawn import run_gloo

    results = run_gloo(_move_between_meshes, 4, timeout_s=300)
    for rank, res in enumerate(results):
        for name in ("dp2-x-cp2-nested", "hsdp2x2", "fsdp2-of-4"):
            assert res[name]["same"], (rank, name)
        # tensor by tensor, two buckets in flight: beyond the state's own growth on this rank, at most two new
        # shards at a time
        nested = res["dp2-x-cp2-nested"]
        assert nested["peak"] <= max(nested["net"], 0) + 2 * nested["largest"], (rank, nested)
        assert res["trained_on"] < 1e-12
        assert res["smet"]
    # the same world in other boxes: what one rank gains another loses, nothing is held twice overall
    assert sum(res["dp2-x-cp2-nested"]["net"] for res in results) == 0
    # rank 0's boxes are the same in both layouts (ceil(ceil(n / 2) / 2) = ceil(n / 4) rows from 0): kept in place
    assert [res["dp2-x-cp2-nested"]["peak"] > 0 for res in results] == [False, True, True, True]


def _swap_counting_point_to_point(rank: int, world: int) -> dict:
    """Two ranks swap whole shards (the mesh order reversed), one tensor per bucket; every isend / irecv
    counted, and those posted outside a `batch_isend_irecv` (which NCCL would run one by one, each
    rank's receive queued before its send: a deadlock)."""
    from unittest import mock

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    from hf_sparse_cp.resharding.boxes import TargetLayout, move_state

    counts, in_batch = {"ops": 0, "outside": 0}, [False]

    def counted(fn):
        def op(*args, **kwargs):
            counts["ops"] += 1
            counts["outside"] += not in_batch[0]
            return fn(*args, **kwargs)
        return op

    def batch(ops, real=c10d.batch_isend_irecv):
        in_batch[0] = True
        try:
            return real(ops)
        finally:
            in_batch[0] = False

    patched = dict(isend=counted(c10d.isend), irecv=counted(c10d.irecv), batch_isend_irecv=batch)
    mesh = init_device_mesh("cpu", (world,))
    full = {f"w{i}": torch.randn(8 + i, 5, generator=torch.Generator().manual_seed(i)) for i in range(4)}
    state = {k: distribute_tensor(v, mesh, (Shard(0),)) for k, v in full.items()}
    swapped = TargetLayout(torch.arange(world).flip(0), (Shard(0),))
    with mock.patch.multiple(c10d, **patched), mock.patch.multiple(dist, **patched):
        moved = move_state(state, lambda *_: swapped, budget_bytes=0)
    rows = {k: -(-v.shape[0] // world) for k, v in full.items()}
    other = world - 1 - rank
    same = all(torch.equal(moved[k], v[other * rows[k]:(other + 1) * rows[k]]) for k, v in full.items())
    return dict(counts, same=same)


def test_a_swap_posts_every_message_in_batches():
    from hf_sparse_cp.testing.spawn import run_gloo

    for res in run_gloo(_swap_counting_point_to_point, 2):
        assert res["same"]
        assert res["ops"] >= 8 and res["outside"] == 0, res  # a send and a receive per tensor, all batched


def _disagreeing_moves(rank: int, world: int) -> dict:
    """Rank 1 moves one tensor more, or sends one to another layout, than rank 0; or every rank names a
    target that cannot be laid out (a Partial placement): (the error each rank raised, whether its state
    is still whole) per case."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Partial

    from hf_sparse_cp.resharding.boxes import TargetLayout, move_state

    mesh = init_device_mesh("cpu", (world,))
    sharded = TargetLayout(torch.arange(world), (Shard(0),))
    replicated = TargetLayout(torch.arange(world), (Replicate(),))
    partial = TargetLayout(torch.arange(world), (Partial(),))
    results = {}
    for case in ("extra tensor", "other target", "partial target"):
        # (from local shards: distribute_tensor would scatter, a collective rank 0 does not join for w3)
        state = {f"w{i}": DTensor.from_local(torch.randn(3, 3), mesh, (Shard(0),), run_check=False)
                 for i in range(3 + (case == "extra tensor" and rank == 1))}
        other = replicated if case == "other target" and rank == 1 else partial if case == "partial target" else None
        keys = list(state)
        try:
            move_state(state, lambda name, _, other=other: other if other is not None and name == "w1" else sharded)
            results[case] = (None, list(state) == keys)
        except ValueError as error:
            results[case] = (str(error), list(state) == keys)
    return results


def test_ranks_that_disagree_on_the_move_are_refused_before_anything_moves():
    from hf_sparse_cp.testing.spawn import run_gloo

    for res in run_gloo(_disagreeing_moves, 2):
        for case, (error, whole) in res.items():
            if case == "partial target":
                assert error is not None and "cannot be resharded" in error, error
            else:
                assert error is not None and "ranks [1]" in error and "same state keys" in error, (case, error)
            assert whole, case  # nothing was taken out of the state
