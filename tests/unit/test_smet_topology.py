"""Topology decisions: hashed randomness, initial blocks, pruning, regrowth, schedule, sharding invariance."""

import math

import pytest
import torch

from hf_sparse_cp.smet import SMETConfig
from hf_sparse_cp.smet.masks import active_mask, hash_uniform
from hf_sparse_cp.smet.topology import initial_blocks, prune_rate, prune_slots, regrow


def _block_ids(rows, blocks, row_offset=0):
    return (torch.arange(rows)[:, None] + row_offset) * blocks + torch.arange(blocks)[None, :]


def test_hash_uniform_is_deterministic_uniform_and_key_sensitive():
    ids = torch.arange(200_000)
    u = hash_uniform(ids, 7, 3)
    assert torch.equal(u, hash_uniform(ids, 7, 3))
    assert 0 <= u.min() and u.max() < 1
    histogram = torch.histc(u, bins=10, min=0, max=1) / len(u)
    assert (histogram - 0.1).abs().max() < 0.005
    other = hash_uniform(ids, 7, 4)
    assert (u == other).float().mean() < 1e-3 and abs(torch.corrcoef(torch.stack([u, other]))[0, 1]) < 0.01


def test_initial_blocks_by_magnitude_keep_the_nonzero_blocks_of_a_sparse_matrix():
    rows, blocks, k = 16, 10, 3
    magnitude = torch.rand(rows, blocks)
    index = initial_blocks(_block_ids(rows, blocks), k, seed=0, param_key=1, magnitude=magnitude)
    assert torch.equal(index, magnitude.topk(k, dim=1).indices.sort(1).values)
    # Weights pruned to 2 nonzero blocks per row: those two are always among the k chosen again.
    sparse = magnitude * active_mask(index[:, :2], blocks)
    again = initial_blocks(_block_ids(rows, blocks), k, seed=5, param_key=1, magnitude=sparse)
    assert active_mask(again, blocks)[active_mask(index[:, :2], blocks)].all()
    random = initial_blocks(_block_ids(rows, blocks), k, seed=0, param_key=1)
    assert (random.diff(dim=1) > 0).all() and random.max() < blocks


def test_prune_slots_prunes_the_smallest_with_the_expected_count():
    rows, k, rate = 4000, 5, 0.3
    scores = torch.rand(rows, k, generator=torch.Generator().manual_seed(0))
    pruned = prune_slots(scores, rate, torch.arange(rows), seed=0, param_key=0, step=100)
    counts = pruned.sum(1)
    assert set(counts.tolist()) <= {1, 2}  # floor(1.5 + u)
    assert counts.float().mean().item() == pytest.approx(rate * k, rel=0.03)
    # The pruned slots are the smallest of their row.
    largest_pruned = scores.masked_fill(~pruned, -1).amax(1)
    smallest_kept = scores.masked_fill(pruned, 2).amin(1)
    assert (largest_pruned < smallest_kept).all()


@pytest.mark.parametrize("by_gradient", [False, True], ids=["random", "gradient"])
def test_regrow_refills_pruned_slots_with_inactive_blocks(by_gradient):
    rows, blocks, k = 64, 12, 4
    index = torch.stack([torch.randperm(blocks)[:k] for _ in range(rows)]).to(torch.int16)
    pruned = torch.rand(rows, k) < 0.5
    grad = torch.rand(rows, blocks) if by_gradient else None
    new = regrow(index, pruned, blocks, _block_ids(rows, blocks), 0, 0, 10, grad)
    assert new.dtype == torch.int16 and torch.equal(new[~pruned], index[~pruned])
    # Still k distinct blocks per row, so no refill duplicates a kept block.
    assert (new.long().sort(1).values.diff(dim=1) > 0).all()
    if by_gradient:
        kept = active_mask(index, blocks, keep=~pruned)
        # Each row regrew its best-gradient blocks among those not kept.
        candidates = grad.masked_fill(kept, -1)
        for r in range(rows):
            n = int(pruned[r].sum())
            assert set(new[r][pruned[r]].tolist()) == set(candidates[r].topk(n).indices.tolist())


def test_prune_rate_decays_by_cosine():
    cfg = SMETConfig(prune_rate=0.2, prune_rate_final=0.005)
    assert prune_rate(cfg, 0, 1000) == pytest.approx(0.2)
    assert prune_rate(cfg, 500, 1000) == pytest.approx(0.1025)
    assert prune_rate(cfg, 1000, 1000) == prune_rate(cfg, 5000, 1000) == pytest.approx(0.005)
    assert prune_rate(cfg, 700, None) == 0.2
    assert prune_rate(cfg, 250, 1000) == pytest.approx(0.005 + 0.0975 * (1 + math.cos(math.pi / 4)))


def test_decisions_on_row_shards_equal_the_decisions_on_the_whole_matrix():
    """What makes FSDP2 sharding communication-free: every choice depends only on its row."""
    rows, blocks, k = 30, 16, 5
    magnitude = torch.rand(rows, blocks)
    grad = torch.rand(rows, blocks)

    def decide(lo, hi):
        ids = _block_ids(hi - lo, blocks, row_offset=lo)
        index = initial_blocks(ids, k, 1, 2, magnitude[lo:hi])
        pruned = prune_slots(magnitude[lo:hi].gather(1, index), 0.4, torch.arange(lo, hi), 1, 2, 40)
        random = regrow(index, pruned, blocks, ids, 1, 2, 40, None)
        by_grad = regrow(index, pruned, blocks, ids, 1, 2, 40, grad[lo:hi])
        return index, pruned, random, by_grad

    whole = decide(0, rows)
    shards = [decide(0, 16), decide(16, rows)]  # torch.chunk(30, 2) rows, as FSDP2 shards them
    for full, *parts in zip(whole, *shards):
        assert torch.equal(full, torch.cat(parts))
