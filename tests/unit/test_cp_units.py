"""Single-process pieces of context parallelism: LSE merge, sharding, input preparation, layout
validation, the ring plan's transfer matching, and the model check."""

import pytest
import torch

from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.merge import merge_attention
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.distributed import (
    ContextParallelConfig,
    NestedSplit,
    ParallelDims,
    RingTopology,
    ShardPlan,
    check_sizes,
    prepare_context_parallel_inputs,
    shard_inputs,
    shift_labels,
)
from hf_sparse_cp.distributed.mesh import check_ring, ring_shape
from hf_sparse_cp.distributed.ring.plan import RingPlan, TransferSets, read_matrix, slot_ops
from hf_sparse_cp.distributed.split.blocks import batch_meta
from hf_sparse_cp.integration.models import check_model_supports_context_parallel
from hf_sparse_cp.simulator.workloads import random_vertical_slash_layout

from oracle import TOLERANCE, rel_rms

SHARDINGS = ("contiguous", "zigzag", "striped")


# --- LSE merge -------------------------------------------------------------------------------


def _attention_parts(scores, v, parts):
    """Exact (out, lse) over each part of the keys, and over all of them."""
    results = []
    for idx in parts:
        s = scores[..., idx]
        lse = torch.logsumexp(s, -1)
        p = torch.exp(s - lse.unsqueeze(-1)).nan_to_num(0.0)
        results.append((p @ v[idx], lse))
    full_lse = torch.logsumexp(scores, -1)
    return results, (torch.softmax(scores, -1) @ v, full_lse)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=str)
@pytest.mark.parametrize("magnitude", [1.0, 300.0], ids=["normal", "huge_logits"])
def test_merge_equals_attention_over_all_keys(dtype, magnitude):
    g = torch.Generator().manual_seed(0)
    scores = (torch.randn(3, 5, 40, generator=g, dtype=torch.float64) * magnitude).to(dtype)
    v = torch.randn(40, 8, generator=g, dtype=torch.float64).to(dtype)
    parts = torch.randperm(40, generator=g).split([7, 20, 13])
    results, (ref_out, ref_lse) = _attention_parts(scores, v, parts)
    out, lse = results[0]
    for part in results[1:]:
        out, lse = merge_attention(out, lse, *part)
    assert out.dtype == dtype and lse.dtype == dtype
    assert torch.isfinite(out).all() and torch.isfinite(lse).all()
    assert rel_rms(out, ref_out) <= TOLERANCE[dtype]
    assert rel_rms(lse, ref_lse) <= TOLERANCE[dtype]


def test_merge_with_parts_that_saw_no_key():
    g = torch.Generator().manual_seed(1)
    out = torch.randn(2, 6, 4, generator=g)
    lse = torch.randn(2, 6, generator=g)
    lse[0, :3] = float("-inf")
    out[0, :3] = 0.0
    empty_out, empty_lse = torch.zeros_like(out), torch.full_like(lse, float("-inf"))
    for a, b in (((out, lse), (empty_out, empty_lse)), ((empty_out, empty_lse), (out, lse))):
        m_out, m_lse = merge_attention(*a, *b)
        assert torch.equal(m_out, out) and torch.equal(m_lse, lse)
    assert not torch.isnan(m_out).any()


def test_merge_computes_in_fp32_for_half_inputs():
    g = torch.Generator().manual_seed(2)
    out, lse = torch.randn(4, 3, generator=g).bfloat16(), torch.randn(4, generator=g)
    m_out, m_lse = merge_attention(out, lse, out, lse)
    assert m_out.dtype == torch.float32 and m_lse.dtype == torch.float32
    assert torch.allclose(m_lse, lse + torch.log(torch.tensor(2.0)))


# --- sharding --------------------------------------------------------------------------------


@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_shards_partition_the_padded_sequence_in_whole_ascending_blocks(sharding, world):
    plan = ShardPlan(sharding, world, 16, 203)
    assert plan.padded_len >= 203 and plan.padded_len % plan.granularity == 0
    assert plan.padded_len - 203 < plan.granularity  # padded, never truncated, never more than needed
    blocks = torch.cat([plan.blocks_of(r) for r in range(world)])
    assert torch.equal(blocks.sort().values, torch.arange(plan.num_blocks))
    for r in range(world):
        mine = plan.blocks_of(r)
        assert bool((mine[1:] > mine[:-1]).all())
        assert torch.equal(plan.block_owner[mine], torch.full_like(mine, r))
        assert torch.equal(plan.block_local_index[mine], torch.arange(mine.numel()))
    x = torch.randn(2, 3, 203, 5)
    shards = [plan.shard(x, r, dim=2, pad_value=7.0) for r in range(world)]
    full = plan.unshard(shards, dim=2)
    assert torch.equal(full[:, :, :203], x) and bool((full[:, :, 203:] == 7.0).all())


@pytest.mark.parametrize("split", ["striped", "zigzag", "contiguous", "nested", "document"])
def test_original_in_shards_finds_every_original_position_in_its_rank_s_shard(split):
    """The inverse that gathers a forward's outputs back into the batch's order (`CPShard.whole_sequence`): every
    original position read from the shard and index it names is the original entry, under every split (a document
    plan re-orders the row's documents and pads between them)."""
    from hf_sparse_cp.distributed.split.documents import DENSE, SPARSE, plan_documents

    if split == "nested":
        plan = NestedSplit(ShardPlan("striped", 2, 16, 203, pieces=2), 2)
    elif split == "document":
        plan = plan_documents([90, 23, 60, 30], [SPARSE, DENSE, DENSE, SPARSE], 2, 16)
        assert not plan.keeps_order
    else:
        plan = ShardPlan(split, 3, 16, 203)
    x = torch.randn(2, 203, 5)
    shards = [plan.shard(x, r) for r in range(plan.cp_size)]
    rank, index = plan.original_in_shards
    assert rank.shape == index.shape == (203,)
    assert torch.equal(torch.stack([shards[r][:, i] for r, i in zip(rank.tolist(), index.tolist())], 1), x)


def test_layouts_assign_the_documented_blocks():
    striped = ShardPlan("striped", 4, 16, 512)
    assert torch.equal(striped.blocks_of(1), torch.tensor([1, 5, 9, 13, 17, 21, 25, 29]))
    zigzag = ShardPlan("zigzag", 4, 16, 512)
    assert torch.equal(zigzag.blocks_of(1), torch.tensor([4, 5, 6, 7, 24, 25, 26, 27]))  # chunks 1 and 6 of 8
    contiguous = ShardPlan("contiguous", 4, 16, 512)
    assert torch.equal(contiguous.blocks_of(3), torch.arange(24, 32))


def test_sharded_inputs_keep_shifted_labels_and_global_positions():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(5, 100, (1, 203), generator=g)
    labels = ids.clone()
    labels[0, :10] = -100
    plan = ShardPlan("striped", 3, 16, 203)
    par = ParallelDims.single()
    local = prepare_context_parallel_inputs(
        {"input_ids": ids, "labels": labels, "attention_mask": torch.ones_like(ids)}, par, block_size=16
    )
    assert "attention_mask" not in local and local["cp_shard"].plan.padded_len == 208
    shards = [shard_inputs({"input_ids": ids, "labels": labels}, plan, r, pad_token_id=0) for r in range(3)]
    shifted = plan.unshard([s["shift_labels"] for s in shards])
    assert torch.equal(shifted[:, :203], shift_labels(labels))  # shifted before sharding: no target lost
    assert bool((shifted[:, 202:] == -100).all())
    assert torch.equal(plan.unshard([s["input_ids"] for s in shards])[:, :203], ids)
    positions = plan.unshard([s["position_ids"] for s in shards])
    assert torch.equal(positions[:, :203], torch.arange(203).unsqueeze(0))
    for r, s in enumerate(shards):  # a rank's position_ids are the global positions of its tokens
        real = plan.token_index(r) < 203
        assert torch.equal(s["position_ids"][0, real], plan.token_index(r)[real])


def test_packed_documents_and_padding_reach_the_token_meta():
    ids = torch.randint(5, 100, (1, 60))
    position_ids = torch.cat([torch.arange(25), torch.arange(35)]).unsqueeze(0)
    local = prepare_context_parallel_inputs({"input_ids": ids, "position_ids": position_ids}, ParallelDims.single(),
                                            block_size=16)
    meta = local["cp_shard"].meta
    assert meta.segment.shape == (1, 64)
    assert torch.equal(meta.segment[0, :60], torch.cat([torch.zeros(25), torch.ones(35)]).int())
    assert bool((meta.segment[0, 60:] == -1).all())
    assert torch.equal(local["position_ids"][0, :60], position_ids[0])  # RoPE keeps per-document positions
    assert local["cp_shard"].packed_by_positions


@pytest.mark.parametrize("rows, packed", [(4, True), (3, False)])
def test_multimodal_rope_position_ids_are_sharded_by_row_and_pack_by_their_text_row(rows, packed):
    """Qwen2-VL's position_ids [R, B, S] (one row per rotary axis): the preparation failed in an expand of them to
    [B, S]. Each row is sharded along the sequence; the documents are those of the text row of [4, B, S] ones (row 0,
    which transformers packs by), none of [3, B, S] ones (it packs none by them); the shard tells the backend that
    they do not come from [B, S] ones, which such a model would not pack by."""
    ids = torch.randint(5, 100, (1, 60))
    text = torch.cat([torch.arange(25), torch.arange(35)])
    position_ids = torch.stack([text + 100 * r for r in range(rows)])[:, None]  # (the RoPE rows restart elsewhere)
    position_ids[:, 0, :25] = text[:25]
    local = prepare_context_parallel_inputs({"input_ids": ids, "position_ids": position_ids}, ParallelDims.single(),
                                            block_size=16)
    shard = local["cp_shard"]
    assert torch.equal(local["position_ids"][..., :60], position_ids) and local["position_ids"].shape == (rows, 1, 64)
    assert torch.equal(shard.meta.segment[0, :60], (torch.arange(60) >= 25).int() if packed else torch.zeros(60).int())
    assert not shard.packed_by_positions


def test_flattened_packing_with_several_rows_is_refused():
    cu = torch.tensor([0, 30, 60], dtype=torch.int32)
    with pytest.raises(ValueError, match="DataCollatorWithFlattening"):
        prepare_context_parallel_inputs({"input_ids": torch.ones(2, 60, dtype=torch.long), "cu_seq_lens_k": cu},
                                        ParallelDims.single(), block_size=16)


@pytest.mark.parametrize("key, shape, fix", [("input_ids", (60,), r"\[batch, sequence\]; got \(60,\) \(one row: add "
                                                                  r"the batch dimension, x\[None\]\)\.$"),
                                             ("input_ids", (1, 1, 60), r"\[batch, sequence\]; got \(1, 1, 60\)\.$"),
                                             ("inputs_embeds", (60, 8), r"\[batch, sequence, hidden\]; got \(60, 8\) "
                                                                        r"\(one row: add the batch dimension"),
                                             ("input_ids", (2, 0), r"input_ids \(2, 0\) hold no token")])
def test_a_batch_not_of_rows_of_tokens_is_refused_naming_its_shape(key, shape, fix):
    """1-D ids failed as 'not enough values to unpack' (an IndexError under CP 2, in the same-batch check); 3-D ids
    were split along their second dimension as embeddings are, 16 'tokens' of a 1-token row."""
    x = torch.ones(shape, dtype=torch.long if key == "input_ids" else torch.float32)
    with pytest.raises(ValueError, match=fix):
        prepare_context_parallel_inputs({key: x}, ParallelDims.single(), block_size=16)


def test_padding_between_the_tokens_of_a_row_is_refused_naming_the_row_and_the_fix():
    """A mask with a hole (left padding after PEFT prompt tuning's virtual tokens) cut its row's document in two:
    under CP 2 the tokens after the hole did not see those before it (loss 4.2385 against sdpa's 4.2502)."""
    mask = torch.ones(2, 60, dtype=torch.long)
    mask[1, 10:30] = 0
    with pytest.raises(ValueError, match=r"pads between the tokens of row 1 .*padding_side.*--cp_size 1"):
        prepare_context_parallel_inputs({"input_ids": torch.ones(2, 60, dtype=torch.long), "attention_mask": mask},
                                        ParallelDims.single(), block_size=16)
    mask[1, 10:30], mask[1, :20] = 1, 0  # left padding, and right padding in row 0, stay
    mask[0, -5:] = 0
    prepare_context_parallel_inputs({"input_ids": torch.ones(2, 60, dtype=torch.long), "attention_mask": mask},
                                    ParallelDims.single(), block_size=16)


def test_padding_between_packed_documents_is_refused_naming_the_packing_fix():
    """Packed documents (restarting position_ids) with a mask of 0s for the padding between them (a collator padding
    each document to blocks): the refusal said to pad on one side, which no packed row can; it names the packing fix
    now, which CP accepts: no mask, the padding a run of its own."""
    ids = torch.arange(3, 63).unsqueeze(0)
    positions = torch.cat([torch.arange(20), torch.arange(12), torch.arange(28)]).unsqueeze(0)
    mask = torch.ones_like(ids)
    mask[0, 20:32] = 0
    masked = {"input_ids": ids, "position_ids": positions, "attention_mask": mask}
    with pytest.raises(ValueError, match=r"row 0, whose position_ids restart .*leave the attention_mask out.*"
                                         r"BlockAlignedFlattening") as refused:
        prepare_context_parallel_inputs(masked, ParallelDims.single(), block_size=16)
    # (8b77454e named --cp_size 1 too, where the masked row trains as it warns: its two documents one segment)
    assert "--cp_size 1" not in str(refused.value)
    assert batch_meta(masked).segment[0, 0] == batch_meta(masked).segment[0, -1]
    fixed = {"input_ids": ids.masked_fill(mask == 0, 0), "position_ids": positions,
             "labels": ids.masked_fill((mask == 0) | (positions == 0), -100)}
    assert prepare_context_parallel_inputs(fixed, ParallelDims.single(), block_size=16)["input_ids"].shape[1] >= 60
    segments = batch_meta(fixed).segment[0]  # the named fix keeps the documents apart
    assert len({int(segments[0]), int(segments[25]), int(segments[-1])}) == 3


def test_the_tokens_per_second_count_takes_padding_between_tokens_which_only_cp_refuses():
    """Without CP such a row trains (its attention calls run dense); the tokens/s counter of every run refused it as
    context parallelism does, naming --cp_size 1 to a run that had it."""
    from hf_sparse_cp.trainer.callbacks import StepMetricsCallback

    mask = torch.ones(2, 60, dtype=torch.long)
    mask[1, 10:30] = 0
    metrics = StepMetricsCallback()
    metrics.count({"input_ids": torch.ones(2, 60, dtype=torch.long), "attention_mask": mask}, cp_size=1)
    assert float(metrics.total) == 120 - 20


def test_the_token_count_replaces_trl_s_after_a_cp_stage_also_in_a_stage_without_cp():
    """TRL's `num_tokens` counts each rank's padded shard under CP; a curriculum's stage at CP 1 after one at CP 2
    logged TRL's count again, which holds the CP stage's shards (here 999), not the tokens trained (60 + 60)."""
    from types import SimpleNamespace

    from transformers import TrainerState

    from hf_sparse_cp.trainer.callbacks import StepMetricsCallback

    metrics = StepMetricsCallback()
    row = {"input_ids": torch.ones(1, 60, dtype=torch.long)}
    metrics.count(row, cp_size=2)  # (each rank of the CP group: its share)
    metrics.count(row, cp_size=2)
    metrics.count(row, cp_size=1)  # the next stage, one rank per row
    logs = {"loss": 1.0, "num_tokens": 999.0}
    metrics.on_log(SimpleNamespace(device=torch.device("cpu")), TrainerState(), None, logs=logs)
    assert logs["num_tokens"] == 60 / 2 * 2 + 60



# --- configuration and sizes -----------------------------------------------------------------


def test_sizes_that_do_not_divide_say_how_to_fix_them():
    check_sizes(8, 4)
    # the sizes that divide it, not a list that reads as a range holding the size refused ([1, 3] for cp_size 2)
    with pytest.raises(ValueError, match=r"cp_size=2 does not divide the world size 3.*divides it \(1 or 3\), "):
        check_sizes(3, 2)
    with pytest.raises(ValueError, match=r"cp_size=3 does not divide the world size 4.*\(1, 2 or 4\).*torchrun "
                                         "--nproc_per_node 6, accelerate launch --num_processes 6, hf-sparse-cp "
                                         "launch --nproc 6"):
        check_sizes(4, 3)


def test_the_data_parallel_degree_of_a_layout_not_yet_built_is_the_layouts_or_the_sizes_refusal():
    """`ParallelDims.dp_size_for`, which the curriculum's stages and the start-up checks read before a layout is
    built: the DP degree a built layout has, or `check_sizes`' refusal where CP does not divide the processes (a
    floor division counted a rank left over as none, or a DP degree of 0)."""
    assert ParallelDims.dp_size_for(8, 2) == 4 and ParallelDims.dp_size_for(1, 1) == ParallelDims.single().dp_size
    with pytest.raises(ValueError, match=r"cp_size=2 does not divide the world size 1"):
        ParallelDims.dp_size_for(1, 2)
    with pytest.raises(ValueError, match=r"cp_size=4 does not divide the world size 6"):
        ParallelDims.dp_size_for(6, 4)


def test_config_validation():
    with pytest.raises(ValueError, match="cp_sharding"):
        ContextParallelConfig(cp_sharding="random")
    with pytest.raises(ValueError, match="cp_size"):
        ContextParallelConfig(cp_size=0)
    with pytest.raises(ValueError, match="torch.distributed"):
        ParallelDims.from_config(ContextParallelConfig(cp_size=2))  # no process group in this test


def test_hfargumentparser_builds_the_config_from_flags():
    from transformers import HfArgumentParser

    (config,) = HfArgumentParser(ContextParallelConfig).parse_args_into_dataclasses(
        ["--cp_size", "4", "--cp_ring", "hierarchical", "--cp_node_size", "2"]
    )
    assert (config.cp_size, config.cp_ring, config.cp_node_size, config.cp_sharding) == (
        4, "hierarchical", 2, "striped")


def test_ring_shape_from_launcher_or_flag():
    hier = ContextParallelConfig(cp_size=8, cp_ring="hierarchical")
    assert ring_shape(8, hier, {"LOCAL_WORLD_SIZE": "4"}) == (2, 4)
    assert ring_shape(8, hier, {"LOCAL_WORLD_SIZE": "8"}) == (1, 8)  # one node: flat
    assert ring_shape(8, ContextParallelConfig(cp_size=8, cp_ring="hierarchical", cp_node_size=2), {}) == (4, 2)
    assert ring_shape(8, ContextParallelConfig(cp_size=8), {"LOCAL_WORLD_SIZE": "4"}) == (1, 8)
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE"):
        ring_shape(8, hier, {})
    with pytest.raises(ValueError, match="multiple of the 3 ranks per node"):
        ring_shape(8, hier, {"LOCAL_WORLD_SIZE": "3"})
    with pytest.raises(ValueError, match="straddle"):
        ring_shape(4, hier, {"LOCAL_WORLD_SIZE": "6"})


@pytest.mark.parametrize("cp_size, ulysses, per_node, refused", [
    (4, 2, 6, "a node holds 6 ranks (LOCAL_WORLD_SIZE=6), which is not a multiple of cp_size=4: some CP groups would "
              "straddle"),
    (8, 2, 6, "cp_size=8 is not a multiple of the 6 ranks per node (LOCAL_WORLD_SIZE=6)"),
])
def test_a_hybrid_rings_node_refusal_counts_the_launchs_ranks_and_cp_size(cp_size, ulysses, per_node, refused):
    """A hybrid's ring holds one rank per head group: its node checks ran in the ring's ranks, and the refusals said
    those (#50: 'a node holds 3 ranks (LOCAL_WORLD_SIZE=6), which is not a multiple of cp_size=2' to --cp_size 4),
    numbers of neither the launch nor the flags; so did the warning of a ring within one node."""
    config = ContextParallelConfig(cp_size=cp_size, cp_mode="hybrid", cp_ulysses_size=ulysses, cp_ring="hierarchical")
    with pytest.raises(ValueError) as error:
        check_ring(config, {"LOCAL_WORLD_SIZE": str(per_node)})
    assert str(error.value).startswith(refused), error.value


def test_a_hybrid_ring_within_one_node_says_the_launchs_ranks(caplog):
    config = ContextParallelConfig(cp_size=4, cp_mode="hybrid", cp_ulysses_size=2, cp_ring="hierarchical")
    with caplog.at_level("WARNING", logger="hf_sparse_cp.distributed.mesh"):
        assert ring_shape(2, config, {"LOCAL_WORLD_SIZE": "4"}, stride=2) == (1, 2)
    assert "the CP group (4 ranks) fits in one node of 4 ranks" in caplog.text, caplog.text


def test_a_hierarchical_ring_that_comes_out_flat_says_why(caplog):
    hier = ContextParallelConfig(cp_size=4, cp_ring="hierarchical")
    with caplog.at_level("WARNING", logger="hf_sparse_cp.distributed.mesh"):
        assert ring_shape(4, hier, {"LOCAL_WORLD_SIZE": "1"}) == (4, 1)  # one rank per node
    assert "one rank per node (LOCAL_WORLD_SIZE=1)" in caplog.text and "the ring is flat, across the 4 nodes" in (
        caplog.text)
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_sparse_cp.distributed.mesh"):  # a hybrid ring: one head group a node
        assert ring_shape(4, hier, {"LOCAL_WORLD_SIZE": "2"}, stride=2) == (4, 1)
    assert "one rank per node (LOCAL_WORLD_SIZE=2, one head group of 2)" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_sparse_cp.distributed.mesh"):
        assert ring_shape(4, hier, {"LOCAL_WORLD_SIZE": "8"}) == (1, 4)
    assert "fits in one node of 8 ranks" in caplog.text and "the ring is flat, within the node" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="hf_sparse_cp.distributed.mesh"):
        assert ring_shape(4, hier, {"LOCAL_WORLD_SIZE": "2"}) == (2, 2)  # a real hierarchical ring: no word
    assert not caplog.text


# --- the ring plan ---------------------------------------------------------------------------


@pytest.mark.parametrize("nodes,per_node", [(1, 4), (2, 2), (4, 1), (2, 3)], ids=["flat4", "2x2", "4x1", "2x3"])
def test_every_rank_visits_every_source_once(nodes, per_node):
    topo = RingTopology(nodes, per_node)
    for p in range(topo.size):
        sources = [topo.source(p, o, i) for o in range(nodes) for i in range(per_node)]
        assert sorted(sources) == list(range(topo.size))
        for o in range(nodes):
            for i in range(per_node):
                s = topo.source(p, o, i)
                assert topo.chain_position(p, s) == (o, i) and topo.holder(s, o, i) == p


def _layouts(plan, seed):
    g = torch.Generator().manual_seed(seed)
    seg = torch.zeros(2, plan.seq_len, dtype=torch.int32)
    seg[0, 70:] = 1
    seg[1, 150:] = 1
    seg[1, 180:] = -1
    meta = TokenMeta.from_segments(seg).pad_to(plan.padded_len)
    return meta, {
        "dense": dense_layout(meta, plan.block_size),
        "window": dense_layout(meta, plan.block_size, sliding_window=40),
        "sparse": random_vertical_slash_layout(2, 4, plan.padded_len, plan.block_size, num_diagonals=2,
                                               num_verticals=6, meta=meta, generator=g),
    }


@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("nodes,per_node", [(1, 3), (2, 2), (2, 3), (4, 1)], ids=["flat3", "2x2", "2x3", "4x1"])
def test_every_send_has_a_matching_receive(sharding, nodes, per_node):
    """Both ends of every transfer post it in the same slot, in the same order, with the same blocks."""
    topo = RingTopology(nodes, per_node)
    plan = ShardPlan(sharding, topo.size, 16, 200)
    _, layouts = _layouts(plan, seed=nodes * 10 + per_node)
    for name, layout in layouts.items():
        sets = TransferSets(read_matrix(layout, plan), plan, topo)
        for backward in (False, True):
            ops = [slot_ops(sets, p, backward=backward) for p in range(topo.size)]
            for p in range(topo.size):
                for slot, mine in ops[p].items():
                    for peer in range(topo.size):
                        sent = [(o.kind, o.source, o.blocks.tolist()) for o in mine if o.send and o.peer == peer]
                        got = [(o.kind, o.source, o.blocks.tolist())
                               for o in ops[peer].get(slot, []) if not o.send and o.peer == p]
                        assert sent == got, (name, backward, slot, p, peer)


@pytest.mark.parametrize("sharding", SHARDINGS)
def test_held_blocks_cover_every_read_and_only_what_downstream_reads(sharding):
    topo = RingTopology(2, 2)
    plan = ShardPlan(sharding, 4, 16, 200)
    meta, layouts = _layouts(plan, seed=4)
    for name, layout in layouts.items():
        sets = TransferSets(read_matrix(layout, plan), plan, topo)
        assert not bool((sets.read & ~sets.held).any()), name
        for p in range(4):
            ring_plan = RingPlan(layout, plan, meta, topo, p)
            for step in ring_plan.steps:
                assert (step.layout is None) == (step.read.numel() == 0)
                if step.layout is not None:
                    step.layout.validate(4 if name == "sparse" else 1, plan.local_len, step.held.numel() * 16,
                                         strict=True)
    if sharding == "contiguous":
        sets = TransferSets(read_matrix(layouts["dense"], plan), plan, RingTopology(1, 4))
        for s in range(4):
            for i in range(1, 4):
                if (s + i) % 4 < s:  # causal: K/V never travel to earlier ranks
                    assert not bool(sets.held[s, 0, i].any())
        # documents: rank 3's tokens (192..255) start after rank 0's (0..63) documents end, so rank 0's
        # K/V stop at rank 2
        assert bool(sets.held[0, 0, 2].any()) and not bool(sets.held[0, 0, 3].any())


# --- model check -----------------------------------------------------------------------------


def test_models_the_ring_cannot_shard_are_refused():
    from transformers import AutoModelForCausalLM

    import hf_sparse_cp
    from hf_sparse_cp.testing.tiny_models import tiny_config

    model = AutoModelForCausalLM.from_config(tiny_config("qwen2"), attn_implementation="sdpa")
    with pytest.raises(ValueError, match="attn_implementation='sdpa'"):
        check_model_supports_context_parallel(model)
    hf_sparse_cp.patch()
    hf_sparse_cp.configure(model)
    check_model_supports_context_parallel(model)
    model.model.layers[1].self_attn.is_causal = False
    with pytest.raises(ValueError, match="bidirectional"):
        check_model_supports_context_parallel(model)


@pytest.mark.parametrize("shape", [(), (2, 80, 4)])
def test_a_prediction_output_that_is_not_per_token_is_refused_naming_ignore_keys(shape):
    """Only per-token outputs ([B, the shard's tokens, ...]) are gathered over the sequence for compute_metrics and
    predict(); a MoE's auxiliary loss (a scalar) or router logits (tokens flattened) are each rank's shard's."""
    from hf_sparse_cp.trainer.whole_rows import whole_sequence_outputs

    ids = torch.randint(3, 100, (2, 40))
    shard = prepare_context_parallel_inputs({"input_ids": ids}, ParallelDims.single(), block_size=16)["cp_shard"]
    with pytest.raises(ValueError, match=r"ignore_keys=\[its name\].*--prediction_loss_only"):
        whole_sequence_outputs((torch.randn(shape), torch.randn(2, 48, 7)), shard)


def test_dropout_under_cp_is_named_with_the_flag_that_turns_it_off():
    """TRL's LoRA drops activations by default: under CP each rank draws its shard's masks, and the start-up
    warning says so, naming the module and --lora_dropout 0; a model without dropout gets none."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.cp_checks import dropout_note

    def lora(dropout):
        model = AutoModelForCausalLM.from_config(tiny_config("llama"))
        return get_peft_model(model, LoraConfig(r=4, lora_dropout=dropout, target_modules=["q_proj", "v_proj"]))

    note = dropout_note(lora(0.05))
    assert "4 dropout modules" in note and "lora_dropout.default (p=0.05)" in note and "--lora_dropout 0" in note
    assert dropout_note(lora(0.0)) is None
    assert dropout_note(AutoModelForCausalLM.from_config(tiny_config("llama"))) is None


def test_dropout_under_cp_names_the_config_field_that_sets_it():
    """A token-classification head drops 0.1 where its config sets no `classifier_dropout` (run_ner.py on a Qwen2 or
    Llama checkpoint, whose config.json has none): the warning names that field, unset, and the value to give it, and
    a config's dropout fields above 0 by name and value; the head with `classifier_dropout` 0 gets none."""
    from transformers import AutoModelForTokenClassification

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.cp_checks import dropout_note

    note = dropout_note(AutoModelForTokenClassification.from_config(tiny_config("qwen2", num_labels=3)))
    assert "dropout (p=0.1)" in note and '"classifier_dropout": 0.0' in note and "unset" in note
    note = dropout_note(AutoModelForTokenClassification.from_config(tiny_config("qwen2", num_labels=3,
                                                                                classifier_dropout=0.2)))
    assert "classifier_dropout=0.2" in note and "unset" not in note
    model = AutoModelForTokenClassification.from_config(tiny_config("qwen2", num_labels=3, classifier_dropout=0.0))
    assert dropout_note(model) is None


@pytest.mark.parametrize("model_type, fields, named", [
    ("phimoe", {"router_jitter_noise": 0.0}, "modeling_phimoe.sparsemixer"),  # samples experts in training
    ("phimoe", {}, "router_jitter_noise=0.01"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise=0.1"),
    ("mixtral", {}, None),
    ("llama", {}, None),
])
def test_random_moe_routing_under_cp_is_named(model_type, fields, named):
    """A MoE whose routing draws random numbers in training (jitter noise, PhiMoE's sampled experts): under CP each
    rank draws for its shard, and the start-up warning names the cause; exact routing gets none."""
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.cp_checks import random_routing_note

    note = random_routing_note(AutoModelForCausalLM.from_config(tiny_config(model_type, **fields)))
    assert (note is None) == (named is None) and (named is None or named in note)


@pytest.mark.parametrize("fields, trl_enabled, warned", [
    ({"output_router_logits": True}, None, True),  # the model adds coef x aux to its loss (stock Trainer)
    ({"output_router_logits": False}, None, False),
    ({"output_router_logits": True, "router_aux_loss_coef": 0.0}, None, False),  # adds 0: exact
    ({"output_router_logits": False}, True, True),  # TRL asks for it (its --router_aux_loss_coef)
    ({"output_router_logits": True}, False, False),  # TRL's --router_aux_loss_coef 0
])
def test_a_moe_router_loss_under_cp_is_named_with_the_flags_that_turn_it_off(fields, trl_enabled, warned):
    """A MoE model's load-balancing loss that CP does not gather (Doge's: its function takes a product-key router's
    `num_keys` and logits of another shape, not `ROUTER_LOSS_PARAMETERS`) is computed per CP shard and is not a sum
    over tokens: the start-up warning says so, naming the function and the settings that turn it off, whenever the
    model or TRL computes it, and only then; a model whose function CP gathers (Mixtral's, PhiMoE's, Jamba's: found
    by the signature, not a list) gets none, nor one whose output_router_logits adds no loss (DeepSeek-V3's)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.cp_checks import router_aux_loss_note

    def trainer(model_type, **more):
        built = SimpleNamespace(model=AutoModelForCausalLM.from_config(tiny_config(model_type, **fields, **more)))
        if trl_enabled is not None:
            built.aux_loss_enabled = trl_enabled
        return built

    for gathered in ("mixtral", "phimoe", "jamba", "deepseek_v3"):
        assert router_aux_loss_note(trainer(gathered)) is None, gathered
    note = router_aux_loss_note(trainer("doge", is_moe=True))
    assert (note is not None) == warned
    if warned:
        assert "router load-balancing loss" in note and "--router_aux_loss_coef 0" in note
        assert "output_router_logits false" in note and "without CP" in note
        assert ("modeling_doge.load_balancing_loss_func(gate_logits, num_experts, num_keys, top_k, attention_mask)"
                in note)
    assert router_aux_loss_note(SimpleNamespace(model=AutoModelForCausalLM.from_config(tiny_config("llama")))) is None


def test_a_remote_code_router_loss_of_the_gathered_form_is_named_outside_transformers(monkeypatch):
    """A model's own modeling module (remote code) with Mixtral's `load_balancing_loss_func`: not a module the plugin
    patches (compat.PATCHES lists the installed transformers' only), so CP's start warns, saying why."""
    import sys
    import types
    from types import SimpleNamespace

    import transformers.models.mixtral.modeling_mixtral as mixtral

    from hf_sparse_cp.trainer.cp_checks import router_aux_loss_note

    def load_balancing_loss_func(gate_logits, num_experts=None, top_k=2, attention_mask=None):
        return mixtral.load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)

    remote = types.ModuleType("transformers_modules.mine.modeling_mine")
    remote.load_balancing_loss_func = load_balancing_loss_func
    load_balancing_loss_func.__module__ = remote.__name__
    monkeypatch.setitem(sys.modules, remote.__name__, remote)
    model = type("MineForCausalLM", (torch.nn.Module,), {"__module__": remote.__name__})()
    model.config = SimpleNamespace(output_router_logits=True, router_aux_loss_coef=0.01)
    note = router_aux_loss_note(SimpleNamespace(model=model))
    assert "modeling_mine.load_balancing_loss_func(gate_logits, num_experts, top_k, attention_mask)" in note
    assert "outside the installed transformers" in note and "--router_aux_loss_coef 0" in note


def test_the_start_of_cp_warns_on_rank_0_only(caplog):
    """`warn_inexact`, which CP's start (fixed degree or cp_schedule) calls: rank 0 logs the MoE router note (Doge's
    loss, which CP computes per shard)."""
    from types import SimpleNamespace

    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.cp_checks import warn_inexact

    model = AutoModelForCausalLM.from_config(tiny_config("doge", is_moe=True, output_router_logits=True))
    for zero in (False, True):
        with caplog.at_level("WARNING", logger="hf_sparse_cp.trainer.cp_checks"):
            warn_inexact(SimpleNamespace(model=model, is_world_process_zero=lambda zero=zero: zero))
        assert ("router load-balancing loss" in caplog.text) == zero
        caplog.clear()


@pytest.mark.parametrize("setting, refusal", [
    ({"compute_loss_func": "mine"}, r"a compute_loss_func \(.*_mine\).*drop compute_loss_func"),
    ({"subclass": True}, r"Weighted under context parallelism \(CP 2\).*its compute_loss"),
    ({"label_smoothing_factor": 0.1}, None),
    ({}, None)])
def test_a_loss_the_trainer_builds_from_the_shards_outputs_is_refused_under_cp(tmp_path, setting, refusal):
    """A compute_loss_func gets each rank's logits and labels, a subclass's compute_loss its outputs: refused, naming
    the setting; the Trainer's own loss is CP's, and so is its label smoothing (`smooth_labels_over_cp_group`)."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.cp_checks import check_loss

    def _mine(outputs, labels, num_items_in_batch=None):
        return outputs.logits.sum()

    class Weighted(Trainer):
        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            return 2 * super().compute_loss(model, inputs, return_outputs, num_items_in_batch)

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[],
                             label_smoothing_factor=setting.get("label_smoothing_factor", 0.0))
    trainer = (Weighted if setting.get("subclass") else Trainer)(
        model=AutoModelForCausalLM.from_config(tiny_config("llama")), args=args,
        compute_loss_func=_mine if setting.get("compute_loss_func") else None)
    if refusal is None:
        check_loss(trainer, 2)
        return
    with pytest.raises(ValueError, match=refusal):
        check_loss(trainer, 2)


@pytest.mark.parametrize("head", ["AutoModelForSequenceClassification", "AutoModelForTokenClassification",
                                  "AutoModelForQuestionAnswering"])
@pytest.mark.parametrize("model_type", ["llama", "qwen2", "gpt2"])
def test_a_head_cp_does_not_train_as_one_process_is_refused_under_cp(tmp_path, head, model_type):
    """Under CP a classification or question-answering head with transformers' generic forward (Llama, Qwen2) trains
    through the Trainer's own loss (test_cp_classification_heads.py), and a sequence-classification head through TRL
    RewardTrainer's; an architecture's own head forward (GPT-2's) and such a head under a trainer whose loss is a
    language model's (TRL SFTTrainer's, DPOTrainer's; another head under RewardTrainer's) are refused at start, naming
    the fix; the causal LM of the same config passes."""
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.cp_checks import check_loss

    args = TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])
    config = tiny_config(model_type, pad_token_id=0)
    trainer = Trainer(model=getattr(transformers, head).from_config(config), args=args)
    if model_type == "gpt2":
        with pytest.raises(ValueError, match=r"For\w+ under context parallelism \(CP 2\) is not supported: it has "
                                             r"neither a language-model head nor .*: GPT2For\w+\.forward is its "
                                             r"architecture's own.*Fix: run without CP \(drop --cp_size"):
            check_loss(trainer, 2)
    else:
        check_loss(trainer, 2)
        for other in (trl.SFTTrainer, trl.DPOTrainer, trl.RewardTrainer):  # (refused before anything else)
            trainer.__class__ = type("Other", (Trainer,), {"compute_loss": other.compute_loss})
            if other is trl.RewardTrainer and head == "AutoModelForSequenceClassification":
                check_loss(trainer, 2)  # (its loss is built from that head's score of each row)
                continue
            with pytest.raises(ValueError, match=r"(classification|answering) head under a (whole-row trainer|"
                                                 r"trainer whose compute_loss is its own).*Fix: train it with "
                                                 r"transformers' Trainer"):
                check_loss(trainer, 2)
    check_loss(Trainer(model=AutoModelForCausalLM.from_config(config), args=args), 2)


@pytest.mark.parametrize("cp", [{"cp_size": 2}, {"cp_schedule": "0:256:1,2:512:2", "max_steps": 4}])
def test_label_smoothing_with_cp_parses(tmp_path, cp):
    from hf_sparse_cp import SparseTrainingArguments

    assert SparseTrainingArguments(str(tmp_path), use_cpu=True, label_smoothing_factor=0.1, **cp).cp_degrees()


@pytest.mark.parametrize("cp", [{"cp_size": 2}, {"cp_schedule": "0:256:1,2:512:2", "max_steps": 4}])
def test_neftune_with_cp_parses_and_starts(tmp_path, cp):
    """--neftune_noise_alpha was refused under CP (its noise was sqrt(CP) times one process's); the noise scale is
    now one process's (`test_trainer_cp.test_neftune_under_cp2_adds_the_noise_of_one_process`)."""
    from transformers import TrainingArguments

    from hf_sparse_cp import SparseTrainingArguments
    from hf_sparse_cp.trainer.cp_checks import check_training_arguments

    assert SparseTrainingArguments(str(tmp_path), use_cpu=True, neftune_noise_alpha=5.0, **cp).cp_degrees()
    check_training_arguments(TrainingArguments(str(tmp_path), use_cpu=True, neftune_noise_alpha=5.0), 2)


def test_batch_rebalance_sampling_with_cp_is_refused_as_the_flags_parse(tmp_path):
    """transformers' BatchRebalanceSampler deals rows over every process: under CP 2 a stock script with
    --train_sampling_strategy batch_rebalance stopped at its first step with the same-batch check's error, which blamed
    the script's data; group_by_length, named as the fix, trains exact."""
    from hf_sparse_cp import SparseTrainingArguments

    with pytest.raises(ValueError, match=r"batch_rebalance under context parallelism \(CP 2\).*group_by_length"):
        SparseTrainingArguments(str(tmp_path), use_cpu=True, train_sampling_strategy="batch_rebalance", cp_size=2)
    SparseTrainingArguments(str(tmp_path), use_cpu=True, train_sampling_strategy="group_by_length", cp_size=2)
    SparseTrainingArguments(str(tmp_path), use_cpu=True, train_sampling_strategy="batch_rebalance")


def test_deepspeed_with_cp_is_refused_naming_fsdp2(tmp_path, monkeypatch):
    """DeepSpeed (--deepspeed, or accelerate launch with a DeepSpeed config, which sets ACCELERATE_USE_DEEPSPEED) is
    refused under CP, naming FSDP2 as the fix: CP is tested under DDP and FSDP2 only (DeepSpeed is not installed
    here; under CP 2 a stock script with --deepspeed stopped on transformers' missing-package error)."""
    from types import SimpleNamespace

    from transformers import TrainingArguments

    from hf_sparse_cp.trainer.cp_checks import check_training_arguments

    args = TrainingArguments(str(tmp_path), use_cpu=True)
    check_training_arguments(args, 2)
    with pytest.raises(ValueError, match=r"DeepSpeed \(--deepspeed ds.json\) under context parallelism \(CP 2\).*"
                                         r"--fsdp 'full_shard auto_wrap'"):
        check_training_arguments(SimpleNamespace(deepspeed="ds.json"), 2)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    with pytest.raises(ValueError, match=r"DeepSpeed \(--deepspeed <the accelerate config>\) under context"):
        check_training_arguments(args, 2)


@pytest.mark.parametrize("key, value", [
    ("labels", torch.zeros(2, 202, dtype=torch.long)),  # one shorter than the ids
    ("labels", torch.zeros(1, 203, dtype=torch.long)),  # one row for two
    ("shift_labels", torch.zeros(2, 204, dtype=torch.long)),
    ("position_ids", torch.arange(200).expand(2, 200)),
    ("position_ids", torch.arange(203).expand(3, 203)),
    ("attention_mask", torch.cat([torch.ones(2, 203), torch.zeros(2, 7)], 1)),  # 7 columns longer
])
def test_a_per_token_tensor_that_does_not_match_the_ids_is_refused_naming_it(key, value):
    """Labels one shorter than the ids were refused under CP only as 'a tensor of shape (2, 299) has 299 positions;
    this plan shards sequences of 300 tokens', naming neither the key nor the fix (one process's loss names the
    labels), and of a longer attention mask the last columns were read (the padding at its end marked the last tokens
    padding); a labels, shift_labels, position_ids or attention_mask tensor that does not hold one entry per token is
    now refused naming it, its shape and the fix, and position_ids broadcast over the batch ([S], [1, S]) still
    shard."""
    ids = torch.randint(5, 100, (2, 203), generator=torch.Generator().manual_seed(0))
    shape = rf"\({value.shape[0]}, {value.shape[1]}\)"
    with pytest.raises(ValueError, match=rf"the batch's {key} has shape {shape}, but its input_ids holds 2 rows of 203 "
                                         r"tokens: .*one entry per token \(\[2, 203\]"):
        prepare_context_parallel_inputs({"input_ids": ids, key: value}, ParallelDims.single(), block_size=16)
    for positions in (torch.arange(203), torch.arange(203).unsqueeze(0)):
        local = prepare_context_parallel_inputs({"input_ids": ids, "labels": ids, "position_ids": positions},
                                                ParallelDims.single(), block_size=16)
        assert torch.equal(local["position_ids"][:, :203], torch.arange(203).expand(2, 203))


def test_a_decoder_whose_forward_computes_its_own_unshifted_loss_is_refused_under_cp_only_by_sft(tmp_path):
    """BartForCausalLM's forward computes its own loss, the mean cross-entropy of its labels unshifted, ignoring the
    loss keywords: under CP 2 with the stock Trainer (BART, zigzag and ulysses, 3 steps) it logged 5.690, 5.418, 5.221
    against one process's 2.846, 2.709, 2.611 (each rank's shard mean, scaled by the processes), then was refused at
    start. The Trainer's own compute_loss now takes it over the CP group (test_cp_seq2seq_decoders.py); TRL
    SFTTrainer's, which does not, is refused naming the cause and the fix, unless it smooths the shifted logits
    instead. BART's functional dropout (its decoder's `dropout` 0.1) is named by the start-up warning."""
    import trl
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    from hf_sparse_cp.testing.tiny_models import tiny_config
    from hf_sparse_cp.trainer.cp_checks import check_loss, dropout_note

    model = AutoModelForCausalLM.from_config(tiny_config("bart", vocab_size=97, max_position_embeddings=256))
    check_loss(Trainer(model=model, args=TrainingArguments(str(tmp_path), use_cpu=True, report_to=[])), 2)
    sft = object.__new__(trl.SFTTrainer)  # (check_loss reads its class, model, smoother and loss function)
    sft.model, sft.label_smoother, sft.compute_loss_func = model, None, None
    with pytest.raises(ValueError, match=r"BartForCausalLM's forward computes its loss itself, the mean cross-entropy "
                                         r"of the labels it is given, unshifted.*\(CP 2\).*SFTTrainer's count.*Fix: "
                                         r"train it with transformers' Trainer, or run without CP"):
        check_loss(sft, 2)
    assert "model.decoder.dropout (p=0.1)" in dropout_note(model)
