"""`CPShard.whole_sequence` is differentiable: every rank of a CP group computes the same loss from the whole
sequence gathered from the shards (TRL DPO's per-sequence sums of per-token log-probabilities), and each rank's
gradient is the sum over the group of the gradients at its own positions, so that the gradients averaged over the
ranks (DDP, FSDP2) are one process's. Checked under every split: striped, zigzag, a head-parallel nested split and a
document plan that re-orders a packed row's documents and pads between them."""

import torch

from hf_sparse_cp.distributed import ContextParallelConfig, ParallelDims, prepare_context_parallel_inputs
from hf_sparse_cp.testing.spawn import run_gloo
from hf_sparse_cp.trainer.whole_rows import whole_sequence_outputs

LENGTH, BLOCK = 203, 16
LAYOUTS = {"striped": {}, "zigzag": {"cp_sharding": "zigzag"}, "ulysses": {"cp_mode": "ulysses"},
           "document": {"cp_sharding": "document"}}


def _grads(rank: int, world: int) -> dict:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, LENGTH, 3, generator=g, dtype=torch.float64)
    weight = torch.randn(2, LENGTH, 3, generator=g, dtype=torch.float64)
    ids = torch.randint(5, 100, (2, LENGTH), generator=g)
    # two documents per row (restarting positions), which the document plan re-orders
    position_ids = torch.cat([torch.arange(90), torch.arange(LENGTH - 90)]).expand(2, -1)
    out = {}
    for name, flags in LAYOUTS.items():
        parallel = ParallelDims.from_config(ContextParallelConfig(cp_size=world, **flags))
        shard = prepare_context_parallel_inputs({"input_ids": ids, "position_ids": position_ids}, parallel,
                                                block_size=BLOCK)["cp_shard"]
        mine = shard.plan.shard(x, shard.rank).requires_grad_()
        whole = shard.whole_sequence(mine)
        loss = (whole * weight).sum() ** 2 / 1e3  # (not linear: the gradient depends on every rank's positions)
        loss.backward()
        top1 = ids % 3 == 0  # per-token outputs that are not floats (TRL's `is_top1`, `label_mask`) gather too
        out[name] = {"whole": whole.detach(), "loss": loss.detach(), "grad": mine.grad,
                     "bool": shard.whole_sequence(shard.plan.shard(top1, shard.rank)),
                     "int": shard.whole_sequence(shard.plan.shard(ids, shard.rank)),
                     "index": shard.plan.token_index(shard.rank), "source": shard.plan.source}
    # An output whose shape does not follow the rank's shard (a MoE's router statistics) may match one rank's shard
    # length alone under a document plan's unequal shards (three documents: 112 and 96 tokens): every rank refuses
    # it, none waits in the gather.
    assert parallel.sharding == "document"
    three = torch.cat([torch.arange(30), torch.arange(30), torch.arange(LENGTH - 60)]).expand(2, -1)
    shard = prepare_context_parallel_inputs({"input_ids": ids, "position_ids": three}, parallel,
                                            block_size=BLOCK)["cp_shard"]
    lengths = [shard.plan.local_len_of(r) for r in range(world)]
    try:
        whole_sequence_outputs({"per_row": torch.zeros(2, lengths[0])}, shard)
        refused = False
    except ValueError:
        refused = True
    out["unequal"] = {"lengths": lengths, "refused": refused}
    return out


def test_whole_sequence_gradient_is_one_process_s_under_every_split():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, LENGTH, 3, generator=g, dtype=torch.float64).requires_grad_()
    weight = torch.randn(2, LENGTH, 3, generator=g, dtype=torch.float64)
    ids = torch.randint(5, 100, (2, LENGTH), generator=g)
    loss = (x * weight).sum() ** 2 / 1e3
    loss.backward()
    ranks = run_gloo(_grads, 2, timeout_s=120)
    for name in LAYOUTS:
        averaged = torch.zeros_like(x)  # DDP's mean of the ranks' gradients, placed at the original positions
        for rank in ranks:
            got = rank[name]
            assert torch.equal(got["whole"], x.detach()), name
            assert torch.equal(got["bool"], ids % 3 == 0) and torch.equal(got["int"], ids), name
            assert torch.allclose(got["loss"], loss.detach(), rtol=1e-12), name
            source = got["source"][got["index"]]
            real = source >= 0
            assert not got["grad"][:, ~real].any(), name  # the split's padding gets no gradient
            averaged[:, source[real]] += got["grad"][:, real] / len(ranks)
        assert torch.allclose(averaged, x.grad, rtol=1e-12, atol=1e-12), name
    for rank in ranks:
        assert len(set(rank["unequal"]["lengths"])) > 1 and rank["unequal"]["refused"], rank["unequal"]
