"""SMET under FSDP2 (fully_shard) in 2 gloo processes, compared with one process.

The ranks follow the Trainer's FSDP2 order: the optimizer is built on the unsharded model, the
parameters are then swapped for their shards (as accelerate does) and SMET attaches afterwards.
Checkpoints go through accelerate's `save_fsdp_*` / `load_fsdp_*` (the Trainer's FSDP2 path) with
sharded and full state dicts. Everything runs in float64 so sharded and single-process runs agree to
rounding and choose the same blocks. An MoE's fused experts ([experts, ., .], sharded by whole experts) train
sparse as the Llama's linear weights do.
"""

import dataclasses
import math
import os
from types import SimpleNamespace

import torch
import torch.distributed as dist

from hf_sparse_cp.smet import SMETConfig, create_smet_optimizer
from hf_sparse_cp.smet.masks import active_mask
from hf_sparse_cp.testing.spawn import run_gloo

from smet_common import fsdp2_smet, lm_loss, markov_tokens, tiny_llama, tiny_moe

WORLD = 2
STEPS, SAVE_AT = 10, 5
LR = 5e-3
# Odd vocabulary and an intermediate size of 99 (block size 1) give uneven FSDP2 shards (33/32, 50/49 rows).
SCENARIOS = {
    "sparse_weights-gradient": (
        SMETConfig(density=0.5, block_size=1, update_interval=3, regrowth="gradient", regrow_warmup_steps=3,
                   prune_decay_steps=STEPS),
        dict(vocab_size=65, intermediate_size=99),
    ),
    "sparse_update-random": (
        SMETConfig(mode="sparse_update", density=0.25, block_size=8, update_interval=2, regrowth="random",
                   prune_rate=0.5),
        dict(),
    ),
}
# Three experts: uneven shards by whole experts (2/1), in both layouts ([experts, out, in]: Mixtral; [experts, in,
# out]: GPT-OSS, Llama 4); intermediate size 48 (block size 8): experts of 12 or 6 blocks a row, every 2-D weight of 8.
EXPERT_SCENARIOS = {
    "mixtral-sparse_weights-gradient": (
        dataclasses.replace(SCENARIOS["sparse_weights-gradient"][0], block_size=8),
        dict(arch="mixtral", num_local_experts=3, intermediate_size=48, vocab_size=65),
    ),
    "gpt_oss-sparse_update-random": (
        SCENARIOS["sparse_update-random"][0], dict(arch="gpt_oss", num_local_experts=3, intermediate_size=48),
    ),
    # Llama 4's ([experts, in, out], its layout read off its shapes) and JetMoE's parallel experts ([experts, out, in],
    # modules of their own in the MLP and the attention: their layout read off their input_size / output_size)
    "llama4_text-sparse_weights-gradient": (
        dataclasses.replace(SCENARIOS["sparse_weights-gradient"][0], block_size=8),
        dict(arch="llama4_text", num_local_experts=3, intermediate_size=48, intermediate_size_mlp=64, vocab_size=65),
    ),
    "jetmoe-sparse_update-random": (
        dataclasses.replace(SCENARIOS["sparse_update-random"][0], target_modules=["input_linear", "output_linear"]),
        dict(arch="jetmoe", num_local_experts=3, intermediate_size=48),
    ),
    # one expert: rank 1 holds none of it
    "mixtral-one-expert": (
        dataclasses.replace(SCENARIOS["sparse_weights-gradient"][0], block_size=8),
        dict(arch="mixtral", num_local_experts=1, num_experts_per_tok=1, intermediate_size=48),
    ),
}


def _model(model_kw: dict, seed: int = 0):
    kw = dict(model_kw)
    arch = kw.pop("arch", None)
    return tiny_llama(seed, torch.float64, **kw) if arch is None else tiny_moe(arch, seed, torch.float64, **kw)


def _batches(vocab: int) -> list[torch.Tensor]:
    return [markov_tokens(4, 16, seed=s, vocab=vocab) for s in range(STEPS)]


def _single_process(config: SMETConfig, model_kw: dict):
    """Reference: one process, full batches. Returns losses, final weights and the state after SAVE_AT."""
    model = _model(model_kw)
    opt = create_smet_optimizer(model, torch.optim.AdamW, config, lr=LR)
    losses, snapshot = [], None
    for step, tokens in enumerate(_batches(model.config.vocab_size), start=1):
        loss = lm_loss(model, tokens)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if step == SAVE_AT:
            snapshot = {n: {k: v.clone() for k, v in opt.state[p].items()} for n, p in model.named_parameters()}
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}, snapshot


def _sharded_model_and_optimizer(config, model_kw, seed, attach=True):
    model = _model(model_kw, seed)
    return model, fsdp2_smet(model, config, WORLD, lr=LR, attach=attach)


def _train(model, opt, batches, rank):
    losses = []
    for tokens in batches:
        loss = lm_loss(model, tokens[rank::WORLD])
        loss.backward()
        for group in opt.param_groups:
            for param in group["params"] if group["smet"] else ():
                # The hooks masked the local gradient shards before clipping (FSDP2 runs them).
                index = opt.state[param]["block_index"]
                if param.dim() == 2:
                    grad = param.grad.to_local().view(index.shape[0], -1, opt.config.block_size)
                    assert grad[~active_mask(index, grad.shape[1])].abs().sum() == 0
                else:  # (an expert stack, [experts, out, in] or [experts, in, out]: its grid says which)
                    grid = opt._grid(param)
                    assert grid.blocks(param.grad.to_local()).masked_select(grid.inactive(index)).abs().sum() == 0
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / WORLD)
    return losses


def _fsdp_plugin(kind: str):
    from accelerate.utils import FullyShardedDataParallelPlugin

    return FullyShardedDataParallelPlugin(fsdp_version=2, state_dict_type=kind)


def _worker(rank, world, out_dir, names):
    from accelerate import PartialState
    from accelerate.utils.fsdp_utils import (
        load_fsdp_model,
        load_fsdp_optimizer,
        save_fsdp_model,
        save_fsdp_optimizer,
    )
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
    )
    from torch.distributed.tensor import DTensor

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    PartialState(cpu=True)  # accelerate's checkpoint helpers log through it
    accelerator = SimpleNamespace(process_index=rank, num_processes=WORLD, is_fsdp2=True,
                                  is_main_process=rank == 0, wait_for_everyone=dist.barrier)
    results = {}
    for name in names:
        config, model_kw = {**SCENARIOS, **EXPERT_SCENARIOS}[name]
        sharded = _fsdp_plugin("SHARDED_STATE_DICT")
        ckpt = os.path.join(out_dir, name)
        model, opt = _sharded_model_and_optimizer(config, model_kw, seed=0)
        batches = _batches(model.config.vocab_size)
        head = _train(model, opt, batches[:SAVE_AT], rank)
        save_fsdp_model(sharded, accelerator, model, ckpt)
        save_fsdp_optimizer(sharded, accelerator, opt, model, ckpt)
        full_state = get_optimizer_state_dict(model, opt, options=StateDictOptions(full_state_dict=True))
        tail = _train(model, opt, batches[SAVE_AT:], rank)
        final = {n: p.full_tensor() for n, p in model.named_parameters()}
        local_rows = {n: opt.state[p]["block_index"].shape[0] for n, p in model.named_parameters()
                      if "block_index" in opt.state[p]}

        # Resume from the sharded checkpoint into a differently initialised model.
        model2, opt2 = _sharded_model_and_optimizer(config, model_kw, seed=1, attach=False)
        load_fsdp_model(sharded, accelerator, model2, ckpt)
        load_fsdp_optimizer(sharded, accelerator, opt2, model2, ckpt)
        opt2.attach()
        resumed = _train(model2, opt2, batches[SAVE_AT:], rank)
        resumed_final = {n: p.full_tensor() for n, p in model2.named_parameters()}

        # Full state dict through accelerate (gathered to rank 0, broadcast on load) restores every shard.
        full = _fsdp_plugin("FULL_STATE_DICT")
        save_fsdp_optimizer(full, accelerator, opt2, model2, ckpt + "-full")
        opt3 = create_smet_optimizer(model2, torch.optim.AdamW, config, lr=LR, attach=False)
        load_fsdp_optimizer(full, accelerator, opt3, model2, ckpt + "-full")
        for param in model2.parameters():
            for key, value in opt2.state[param].items():
                assert torch.equal(opt3.state[param][key], value), key

        # The full (gathered) optimizer state dict holds every row once, as plain tensors.
        full_index = {
            k.split(".block_index")[0]: v for k, v in _flatten(full_state["state"]).items()
            if k.endswith("block_index")
        }
        assert all(not isinstance(v, DTensor) for v in full_index.values())
        results[name] = dict(head=head, tail=tail, resumed=resumed, final=final, resumed_final=resumed_final,
                             local_rows=local_rows, full_index=full_index)
    if names != list(SCENARIOS):
        return results if rank == 0 else None

    # A full checkpoint of another density is refused by name. Saved with one active block per row
    # (4-block attention rows at density 0.25), its states would broadcast into the two slots of
    # density 0.5 without an error from torch (every row's two slots holding the same block).
    sparser = SMETConfig(density=0.25, block_size=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    model, opt = _sharded_model_and_optimizer(sparser, {}, seed=0)
    full = _fsdp_plugin("FULL_STATE_DICT")
    save_fsdp_optimizer(full, accelerator, opt, model, os.path.join(out_dir, "sparser"))
    denser = create_smet_optimizer(model, torch.optim.AdamW, dataclasses.replace(sparser, density=0.5), lr=LR,
                                   attach=False)
    try:
        load_fsdp_optimizer(full, accelerator, denser, model, os.path.join(out_dir, "sparser"))
    except ValueError as error:
        results["other_density"] = str(error)
    return results if rank == 0 else None


def _flatten(state):
    return {f"{param}.{key}": value for param, entries in state.items() for key, value in entries.items()}


def _check(results, scenarios):
    for name, (config, model_kw) in scenarios.items():
        got = results[name]
        losses, weights, snapshot = _single_process(config, model_kw)
        # Sharded training (masks chosen per shard, no mask communication) equals one process, to fp64 rounding
        # compounded over the steps (sums in another order; the norms in float64: smet_common). The weights' bound
        # allows for Adam's lr / eps (5e5) on gradients near eps.
        torch.testing.assert_close(got["head"] + got["tail"], losses, rtol=1e-12, atol=0)
        for param, value in weights.items():
            torch.testing.assert_close(got["final"][param], value, rtol=1e-9, atol=1e-12, msg=f"{name} {param}")
        # Shards really were uneven and local: rank 0 held only its rows of each sparse matrix (an expert stack's:
        # of its first experts, every row of an expert after the other).
        for param, rows in got["local_rows"].items():
            slices, total = weights[param].shape[0], snapshot[param]["block_index"].shape[0]
            assert rows == math.ceil(slices / 2) * (total // slices), f"{name} {param}"
        # The gathered full state dict holds the single-process masks after SAVE_AT steps (an expert stack's saved
        # [experts, rows of an expert, ...]).
        for param, index in got["full_index"].items():
            expected = snapshot[param]["block_index"].long()
            assert torch.equal(index.long().reshape(expected.shape), expected), f"{name} {param}"
        # Resuming from the sharded checkpoint continues exactly as if uninterrupted.
        assert got["resumed"] == got["tail"], name
        for param, value in got["final"].items():
            assert torch.equal(got["resumed_final"][param], value), f"{name} {param}"


def test_fsdp2_matches_one_process_and_resumes_from_sharded_checkpoints(tmp_path):
    results = run_gloo(_worker, WORLD, str(tmp_path), list(SCENARIOS), timeout_s=600)[0]
    _check(results, SCENARIOS)
    assert "density=0.25 (this run: 0.5)" in results.get("other_density", "loaded without an error")


def test_fsdp2_trains_fused_experts_sparse_as_one_process_does(tmp_path):
    """The experts' stacks (Shard(0): whole experts a rank) were trained dense; sparse, sharded training and its
    resumes equal one process as for linear weights."""
    results = run_gloo(_worker, WORLD, str(tmp_path), list(EXPERT_SCENARIOS), timeout_s=600)[0]
    for name in EXPERT_SCENARIOS:  # (every stack of experts sparse: the MLP's two, and JetMoE's attention's two)
        stacks = {n for n, value in results[name]["final"].items() if value.dim() == 3}
        assert len(stacks) == (4 if name.startswith("jetmoe") else 2) and stacks <= set(results[name]["full_index"])
    _check(results, EXPERT_SCENARIOS)
