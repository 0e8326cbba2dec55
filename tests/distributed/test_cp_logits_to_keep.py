"""`logits_to_keep` under context parallelism: its positions count in the whole sequence, which each rank holds a shard
of. A boolean mask (transformers 5.24's form for packed training) gives, over CP 2 and with the ring's and the
document planner's splits, the kept logits, loss and gradients of one process, stock and lean forward alike; the
forms that return a [B, n] block (the last n positions, positions per row) are refused naming the mask (before: an
IndexError for the mask, and the last positions of each rank's shard for an int, silently)."""

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, modeling_utils

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.testing.spawn import run_gloo
from hf_sparse_cp.testing.tiny_models import tiny_config

from oracle import rel_rms

BLOCK, SEQ = 16, 70
# Dense attention (documents this short stay dense): the document planner re-aligns a sparse document's pattern.
PATTERN = SparseAttentionConfig(block_size=BLOCK)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 97, (2, SEQ), generator=g)
    mask = torch.rand(ids.shape, generator=g) > 0.6
    position_ids = torch.cat([torch.arange(30), torch.arange(SEQ - 30)]).expand(2, -1)  # two documents a row
    return ids, mask, position_ids


def _under_cp2(rank: int, world: int) -> dict:
    from hf_sparse_cp.distributed import ContextParallelConfig, ParallelDims, prepare_context_parallel_inputs
    from hf_sparse_cp.distributed.loss import global_num_items, rank_loss
    from hf_sparse_cp.integration.lean_loss import disable_lean_loss, enable_lean_loss

    hf_sparse_cp.patch()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97)).double().train()
    hf_sparse_cp.configure(model, PATTERN)
    params = list(model.parameters())
    ids, mask, position_ids = _batch()
    batch = {"input_ids": ids, "position_ids": position_ids, "logits_to_keep": mask, "labels": ids[mask]}
    refs = {}
    for lean in (False, True):  # stock: the kept positions' logits [N, V], and the loss of their labels
        if lean:
            enable_lean_loss()  # (its cross-entropy, in float32, is not stock's to rounding)
        out = model(**batch)
        refs[lean] = out, torch.autograd.grad(out.loss, params)
        disable_lean_loss()
    results = {}
    for sharding in ("striped", "document"):
        par = ParallelDims.from_config(ContextParallelConfig(cp_size=world, cp_sharding=sharding))
        for lean in (False, True):
            ref, ref_grads = refs[lean]
            if lean:
                enable_lean_loss()
            inputs = prepare_context_parallel_inputs(batch, par, block_size=BLOCK, sparse_config=PATTERN)
            out = model(**inputs, num_items_in_batch=1)  # this rank's sum over its kept targets
            loss = rank_loss(out.loss, global_num_items(inputs["shift_labels"]), 1)
            grads = [g.clone() for g in torch.autograd.grad(loss, params)]
            for g in grads:
                dist.all_reduce(g)
            total = loss.detach().clone()
            dist.all_reduce(total)
            disable_lean_loss()
            error = {"loss": abs(float(total - ref.loss)),
                     "grads": max(rel_rms(g, r) for g, r in zip(grads, ref_grads))}
            if not lean:  # the rank's kept logits are one process's at the same kept positions
                ordinal = torch.full(ids.shape, -1)
                ordinal[mask] = torch.arange(int(mask.sum()))
                plan = inputs["cp_shard"].plan
                mine = plan.shard(ordinal, par.cp_rank, pad_value=-1)[inputs["logits_to_keep"]]
                error["logits"] = rel_rms(out.logits, ref.logits[mine].detach())
                error["kept"] = int(mine.numel())
            results[(sharding, lean)] = error
    refused = {}
    par = ParallelDims.from_config(ContextParallelConfig(cp_size=world))
    positions = torch.stack([torch.arange(40, 48)] * 2)
    for name, keep, labels in (("last", 5, ids[:, -5:]), ("rows", positions, torch.take_along_dim(ids, positions, 1)),
                               ("mask of another length", mask[:, :-1], ids[:, :-1][mask[:, :-1]]),
                               ("labels of every position", mask, ids)):
        try:
            prepare_context_parallel_inputs({"input_ids": ids, "logits_to_keep": keep, "labels": labels}, par,
                                            block_size=BLOCK)
            refused[name] = "accepted"
        except ValueError as e:
            refused[name] = str(e)
    return {"errors": results, "refused": refused}


@pytest.mark.skipif(not hasattr(modeling_utils, "slice_logits_to_keep"),
                    reason="2D logits_to_keep tensors came with transformers' slice_logits_to_keep (5.24)")
def test_a_logits_to_keep_mask_under_cp2_keeps_each_ranks_part_and_other_forms_are_refused():
    ranks = run_gloo(_under_cp2, 2, timeout_s=600)
    ref = ranks[0]
    for (sharding, lean), error in ref["errors"].items():
        # (both losses are float32 values; the lean one sums its float32 chunks in another order)
        assert error["loss"] < 1e-5 and error["grads"] < (1e-6 if lean else 1e-9), (sharding, lean, error)
    for rank in ranks:
        for key, error in rank["errors"].items():
            if "logits" in error:
                assert error["logits"] < 1e-9, (key, error)
    _, mask, _ = _batch()
    assert sum(rank["errors"][("striped", False)]["kept"] for rank in ranks) == int(mask.sum())
    for name, message in ref["refused"].items():
        assert "logits_to_keep" in message or "labels" in message, (name, message)
    assert "boolean mask" in ref["refused"]["last"] and "boolean mask" in ref["refused"]["rows"]
    assert "boolean mask" in ref["refused"]["mask of another length"]
    assert "exactly the kept positions" in ref["refused"]["labels of every position"]
