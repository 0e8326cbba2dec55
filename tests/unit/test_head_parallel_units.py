"""Head parallelism without processes: the head split (GQA, uneven splits, K/V replication), the nested
sequence split of head groups, and the refusals of the CP flags."""

import types

import pytest
import torch

from hf_sparse_cp.distributed import ContextParallelConfig, HeadSplit, NestedSplit, ParallelDims, ShardPlan


@pytest.mark.parametrize("hq, hkv, size", [(4, 2, 2), (6, 2, 3), (8, 2, 3), (12, 3, 4), (14, 2, 8), (32, 8, 16),
                                           (28, 4, 8), (6, 3, 2), (5, 5, 5), (7, 1, 7)])
def test_every_query_head_on_one_rank_with_the_key_head_it_reads(hq, hkv, size):
    split = HeadSplit(hq, hkv, size)
    owners = []
    for r in range(size):
        lo, hi = split.q_range(r)
        kv_lo, kv_hi = split.kv_range(r)
        assert hi > lo  # every rank computes at least one head
        owners += [r] * (hi - lo)
        local_kv = torch.arange(kv_lo, kv_hi)
        reads = split.kv_index(r)
        n_q, n_kv = hi - lo, kv_hi - kv_lo
        # the key/value head each local query head attends with: expanded, or GQA over the local heads
        seen = local_kv[reads] if reads is not None else local_kv.repeat_interleave(n_q // n_kv)
        assert torch.equal(seen, torch.arange(lo, hi) // (hq // hkv)), (r, seen)
    assert owners == sorted(owners) and len(owners) == hq
    assert split.busiest == max(split.q_range(r)[1] - split.q_range(r)[0] for r in range(size))
    assert split.balanced == (hq % size == 0)


def test_kv_heads_are_replicated_when_the_degree_exceeds_them_and_the_bytes_are_counted():
    split = HeadSplit(32, 8, 16)  # Qwen3-8B's heads over 16 ranks: each key head on 2 ranks
    assert [split.kv_range(r) for r in (0, 1, 2)] == [(0, 1), (0, 1), (1, 2)]
    assert split.kv_heads_sent == 16 and all(split.kv_index(r) is None for r in range(16))
    tokens, head_dim = 1 << 20, 128
    assert split.replicated_kv_bytes(tokens, head_dim, 2) == 2 * 8 * tokens * head_dim * 2  # K and V, 8 copies
    assert HeadSplit(32, 8, 8).replicated_kv_bytes(tokens, head_dim, 2) == 0


def test_a_run_of_query_heads_that_straddles_a_group_reads_one_kv_head_per_query_head():
    split = HeadSplit(8, 2, 3)  # ranks: q 0-1, 2-4, 5-7; rank 1 reads key heads 0, 0, 1
    assert split.kv_range(1) == (0, 2) and split.kv_index(1).tolist() == [0, 0, 1]
    assert split.kv_index(0) is None and split.kv_index(2) is None


@pytest.mark.parametrize("hq, hkv, size, match", [
    (4, 2, 8, "a head-parallel degree of 8 needs at least 8 query heads, but the model has 4 .*\\[1, 2, 4\\].*"
               "--cp_ulysses_size among those .* or --cp_mode ring"),
    (6, 4, 2, "6 query heads and 4 key/value heads: the query heads must be a multiple"),
    (4, 2, 0, "a head-parallel degree of 0"),
])
def test_a_degree_the_heads_cannot_serve_is_refused_naming_the_numbers(hq, hkv, size, match):
    with pytest.raises(ValueError, match=match):
        HeadSplit(hq, hkv, size)


@pytest.mark.parametrize("heads, cp", [(2, 3), (3, 4), (14, 64), (6, 8), (5, 6)])
def test_the_degrees_a_head_refusal_suggests_run_at_that_cp_degree(heads, cp):
    """Under ulysses at CP 3 with 2 query heads the refusal suggested a head-parallel degree of 2 with --cp_mode
    hybrid (the heads' divisors), which the CP check refuses next (2 does not divide 3); at CP 64 with 14 heads 7
    and 14. Each degree it suggests now runs under --cp_mode hybrid at that CP degree, and hybrid is not suggested
    where no degree above 1 fits."""
    import ast
    import re

    config = types.SimpleNamespace(num_attention_heads=heads, num_key_value_heads=1)
    with pytest.raises(ValueError, match="needs at least") as refused:
        ContextParallelConfig(cp_size=cp, cp_mode="ulysses").check_model(config)
    named = re.search(r"\[[\d, ]*\]", str(refused.value))  # (the first degrees named; none: ring alone)
    fits = ast.literal_eval(named.group(0)) if named else [1]
    assert fits and max(fits) <= heads and "--cp_mode ring" in str(refused.value)
    for degree in fits:
        ContextParallelConfig(cp_size=cp, cp_mode="hybrid", cp_ulysses_size=degree).check_model(config)
    assert ("--cp_mode hybrid" in str(refused.value)) == (fits != [1])


@pytest.mark.parametrize("sharding", ["striped", "zigzag", "contiguous"])
@pytest.mark.parametrize("ring, pieces, seq", [(2, 2, 250), (1, 4, 250), (3, 2, 97), (2, 3, 1000)])
def test_a_nested_split_cuts_each_ring_shard_into_contiguous_pieces(sharding, ring, pieces, seq):
    outer = ShardPlan(sharding if ring > 1 else "contiguous", ring, 16, seq, pieces=pieces)
    nested = NestedSplit(outer, pieces)
    assert nested.cp_size == ring * pieces and nested.padded_len == outer.padded_len
    for o in range(ring):
        runs = [nested.blocks_of(o * pieces + i) for i in range(pieces)]
        assert len({r.numel() for r in runs}) == 1  # equal pieces: one all-to-all size per rank
        assert torch.equal(torch.cat(runs), outer.blocks_of(o))  # in the ring shard's order
    x = torch.arange(seq).unsqueeze(0) + 1
    assert torch.equal(nested.unshard([nested.shard(x, r) for r in range(nested.cp_size)])[:, :seq], x)


def test_a_nested_split_refuses_shards_that_do_not_cut_evenly():
    with pytest.raises(ValueError, match="build the outer split with pieces=3"):
        NestedSplit(ShardPlan("striped", 2, 16, 64), 3)


@pytest.mark.parametrize("flags, match", [
    (dict(cp_mode="hybrid"), "--cp_mode hybrid needs --cp_ulysses_size"),
    (dict(cp_mode="hybrid", cp_ulysses_size=2, cp_sharding="document"), "not available under --cp_mode hybrid"),
    (dict(cp_mode="ring", cp_ulysses_size=2), "--cp_ulysses_size 2 is the head-group size of --cp_mode hybrid"),
    (dict(cp_mode="ulysses", cp_sharding="zigzag"),
     r"--cp_sharding zigzag would be ignored under --cp_mode ulysses: a sharding balances a ring's causal attention.*"
     r"every rank attends the whole sequence for its share of the heads"),
    (dict(cp_mode="ulysses", cp_ring="hierarchical"), "--cp_ring hierarchical would be ignored"),
    (dict(cp_mode="heads"), "cp_mode"),
    (dict(cp_mode="hybrid", cp_ulysses_size=0), "cp_ulysses_size=0 must be >= 1"),
])
def test_cp_flags_a_mode_would_ignore_or_cannot_run_are_refused(flags, match):
    with pytest.raises(ValueError, match=match):
        ContextParallelConfig(cp_size=4, **flags)


def test_head_groups_must_divide_the_cp_degree():
    with pytest.raises(ValueError, match=r"cp_ulysses_size=4 does not divide cp_size=6.*\[1, 2, 3, 6\]"):
        ContextParallelConfig(cp_size=6, cp_mode="hybrid", cp_ulysses_size=4)  # (as the flags parse)
    config = ContextParallelConfig(cp_mode="hybrid", cp_ulysses_size=4)  # (the CP degree set elsewhere: accelerate's)
    with pytest.raises(ValueError, match=r"cp_ulysses_size=4 does not divide cp_size=6.*\[1, 2, 3, 6\]"):
        config.head_size(6)
    assert ContextParallelConfig(cp_size=6, cp_mode="ulysses").head_size(6) == 6
    assert ContextParallelConfig(cp_size=6).head_size(6) == 1


def test_accelerates_sp_size_under_fsdp2_is_refused_naming_the_cp_size_fix():
    """accelerate's sp_size is DeepSpeed's Ulysses (its only sp_backend); the plugin's head parallelism
    runs over accelerate's CP group instead."""
    from accelerate.parallelism_config import ParallelismConfig

    fake = types.SimpleNamespace(parallelism_config=ParallelismConfig(sp_size=2, dp_shard_size=2))
    with pytest.raises(ValueError, match=r"sp_size=2\) is DeepSpeed's Ulysses.*parallelism_config_cp_size: 2\).*"
                                         r"--cp_mode ulysses"):
        ParallelDims.from_accelerator(fake, ContextParallelConfig(cp_mode="ulysses"))


def test_one_process_has_no_head_groups():
    par = ParallelDims.single()
    assert (par.mode, par.head_size, par.ring_size, par.ring) == (None, 1, 1, None)  # no CP mode: one process


@pytest.mark.parametrize("flags, cp_size, runs", [
    (dict(cp_mode="ring"), 4, ("ring", 1)),
    (dict(cp_mode="ulysses"), 1, ("ring", 1)),  # one rank: nothing to share
    (dict(cp_mode="ulysses"), 4, ("ulysses", 4)),
    (dict(cp_mode="hybrid", cp_ulysses_size=2), 4, ("hybrid", 2)),
    (dict(cp_mode="hybrid", cp_ulysses_size=4), 4, ("ulysses", 4)),  # one head group: no ring across groups
    (dict(cp_mode="hybrid", cp_ulysses_size=4), 1, ("ring", 1)),  # (a cp_schedule stage of one rank)
], ids=["ring", "ulysses-1", "ulysses-4", "hybrid-2x2", "hybrid-one-group", "hybrid-1"])
def test_every_mode_resolves_a_cp_degree_to_one_layout(flags, cp_size, runs):
    """The registered modes decide what a CP degree runs (ParallelDims builds its groups from the head-group size
    alone), so that one layout is described and computed the same way whatever flags led to it."""
    from hf_sparse_cp.distributed import cp_mode_named, cp_modes

    config = ContextParallelConfig(**flags)
    mode, head_size = config.mode.resolve(config, cp_size)
    assert (mode.name, head_size) == runs and mode is cp_mode_named(runs[0])
    assert [m.name for m in cp_modes()] == ["ring", "ulysses", "hybrid"]
    with pytest.raises(ValueError, match=r"cp_mode='bogus' is unknown; use one of 'ring', 'ulysses', 'hybrid'"):
        cp_mode_named("bogus")


@pytest.mark.parametrize("flags, refused", [
    (dict(cp_mode="ring"), True), (dict(cp_mode="hybrid", cp_ulysses_size=2), True), (dict(cp_mode="ulysses"), False),
], ids=["ring", "hybrid", "ulysses"])
def test_layers_of_another_block_size_are_refused_where_a_ring_splits_the_sequence(flags, refused):
    """A layer_overrides block_size under the ring (or hybrid's ring across head groups) passed every check and failed
    at the first forward on every rank ('this layer's block_size (32) differs from the block size the sequence was
    sharded with (64)'): the layout check refuses it, naming the flag and the fixes. Ulysses gives each rank whole
    sequences, which each layer lays out in its own blocks."""
    from hf_sparse_cp.config import SparseAttentionConfig
    from hf_sparse_cp.testing.tiny_models import tiny_config

    config = tiny_config("llama", num_attention_heads=4, num_key_value_heads=2)
    config.sparse_attention = SparseAttentionConfig(block_size=64, layer_overrides={"1": {"block_size": 32}}).to_dict()
    layout = ContextParallelConfig(cp_size=4, **flags)
    if refused:
        mode = flags["cp_mode"]
        with pytest.raises(ValueError, match=rf"set block_size 32 on some layers, and under --cp_mode {mode}.*\(64\)"
                                             r".*Drop block_size from layer_overrides.*--cp_mode ulysses"):
            layout.check_model(config)
    else:
        layout.check_model(config)
    dense = SparseAttentionConfig(block_size=64, layer_overrides={"1": {"pattern": "dense"}})
    config.sparse_attention = dense.to_dict()
    layout.check_model(config)  # (other fields may differ by layer)


def test_a_registered_cp_mode_is_selectable_and_runs_as_itself(monkeypatch):
    """A mode registered with `register_cp_mode` is a valid `cp_mode` (the config's Literal listed the built-in modes
    only), a sequence-split mode of its own is not swapped for the built-in ring, and a registration that would
    replace a mode, or is not a `CPMode`, is refused naming the fix (#50: both were silent)."""
    from hf_sparse_cp.distributed import cp_mode_named, register_cp_mode
    from hf_sparse_cp.distributed.modes import base
    from hf_sparse_cp.distributed.modes.ring import RingMode

    class MyRing(RingMode):
        name, help = "my_ring", "a plug-in ring"

    monkeypatch.setattr(base._MODES, "_entries", dict(base._MODES._entries))
    mine = register_cp_mode(MyRing())
    assert register_cp_mode(mine) is mine  # (the same mode again: nothing changes)
    config = ContextParallelConfig(cp_size=2, cp_mode="my_ring")
    assert config.mode is mine and config.mode.resolve(config, 2) == (mine, 1)
    class Shadow(RingMode):
        name, help = "ring", "a plug-in under a built-in mode's name"

    with pytest.raises(ValueError, match=r"cp_mode 'ring' is already registered .*ring.RingMode\); give .*Shadow "
                                         r"another `name`"):
        register_cp_mode(Shadow())
    with pytest.raises(TypeError, match="instance of a CPMode subclass"):
        register_cp_mode(types.SimpleNamespace(name="fake"))
    with pytest.raises(ValueError, match=r"cp_mode='my_rign' \(str\) is not valid: use one of 'ring', 'ulysses', "
                                         r"'hybrid', 'my_ring' \(a mode of your own: .*register_cp_mode"):
        ContextParallelConfig(cp_mode="my_rign")
    assert cp_mode_named("ring").resolve(config, 2)[0].name == "ring"
    # the start-up line and the model card name a mode of one's own (a ring's subclass read as the built-in ring)
    from hf_sparse_cp.distributed.mesh import ParallelDims

    assert ParallelDims.single(mode=mine).describe().endswith("striped sharding, flat ring (cp_mode 'my_ring')")
    assert ParallelDims.single(mode=cp_mode_named("ring")).describe().endswith("striped sharding, flat ring")
