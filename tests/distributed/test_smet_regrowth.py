"""SMET's gradient regrowth under DDP takes the decisions one process takes on the whole batch (issue #31).

Two gloo processes train a tiny Llama under DDP, each on its half of every batch in two accumulated
micro-batches, with gradient regrowth at every other step; one process trains the same model on the
whole batch. Regrowth scores blocks by the L1 norm of the step's gradient: each rank's hooks see only
their own micro-batches' gradient, and a sum of norms is not the norm of the sum, so the scores must
come from the reduced gradient. Everything runs in float64, so both choose the same blocks. An MoE's fused experts
(Mixtral's [experts, out, in], GPT-OSS's [experts, in, out]) too, where a rank's micro-batches leave experts
unrouted: their slice of its gradient is zero, the other rank's is not.
"""

import contextlib

import pytest
import torch

from hf_sparse_cp.smet import SMETConfig, create_smet_optimizer
from hf_sparse_cp.testing.spawn import run_gloo

from smet_common import lm_loss, markov_tokens, tiny_llama, tiny_moe

WORLD, MICRO, STEPS, LR = 2, 2, 4, 5e-3
# A topology update every 2 steps that replaces half of the active blocks, regrown by gradient.
CONFIG = SMETConfig(density=0.5, block_size=4, update_interval=2, prune_rate=0.5, prune_decay_steps=100,
                    regrowth="gradient", regrow_warmup_steps=2)
# 8 experts, 2 a token: a micro-batch of 16 tokens leaves some unrouted.
MODELS = {"llama": lambda: tiny_llama(dtype=torch.float64),
          **{arch: lambda arch=arch: tiny_moe(arch, dtype=torch.float64, num_local_experts=8, intermediate_size=32)
             for arch in ("mixtral", "gpt_oss")}}


def _batches() -> list[torch.Tensor]:
    """Per step, WORLD x MICRO rows of 16 tokens."""
    return [markov_tokens(WORLD * MICRO, 16, seed=step) for step in range(STEPS)]


def _masks(opt) -> dict[str, torch.Tensor]:
    return {name: opt.state[param]["block_index"].clone() for group in opt.param_groups if group["smet"]
            for name, param in zip(group["param_names"], group["params"])}


def _one_process(arch: str) -> list[dict[str, torch.Tensor]]:
    model = MODELS[arch]()
    opt = create_smet_optimizer(model, torch.optim.AdamW, CONFIG, lr=LR)
    masks = []
    for tokens in _batches():
        lm_loss(model, tokens).backward()
        opt.step()
        opt.zero_grad()
        masks.append(_masks(opt))
    return masks


def _ddp(rank: int, world: int) -> dict:
    return {arch: _ddp_of(arch, rank, world) for arch in MODELS}


def _ddp_of(arch: str, rank: int, world: int) -> tuple[list[dict[str, torch.Tensor]], int]:
    """The masks after every step, and how many experts a micro-batch of this rank left unrouted."""
    from torch.nn.parallel import DistributedDataParallel

    model = MODELS[arch]()
    # The Trainer's order: the optimizer first, DDP's wrapper next, SMET attached at train begin.
    opt = create_smet_optimizer(model, torch.optim.AdamW, CONFIG, lr=LR, attach=False)
    ddp = DistributedDataParallel(model)
    opt.attach()
    masks, unrouted = [], 0
    for tokens in _batches():
        rows = tokens[rank::world]  # this rank's half of the batch, in MICRO micro-batches
        for m in range(MICRO):
            with ddp.no_sync() if m < MICRO - 1 else contextlib.nullcontext():
                (lm_loss(ddp, rows[m : m + 1]) / MICRO).backward()
            if m == 0:  # (the first micro-batch's own gradient, not synced)
                unrouted += sum(int((p.grad.flatten(1).abs().sum(1) == 0).sum()) for n, p in model.named_parameters()
                                if n.endswith("experts.down_proj"))
        opt.step()
        opt.zero_grad()
        masks.append(_masks(opt))
    return masks, unrouted


@pytest.fixture(scope="module")
def ranks():
    return run_gloo(_ddp, WORLD, timeout_s=300)


@pytest.mark.parametrize("arch", list(MODELS))
def test_gradient_regrowth_under_ddp_chooses_the_blocks_of_one_process(ranks, arch):
    reference = _one_process(arch)
    moved = [not all(torch.equal(reference[s][n], reference[s - 1][n]) for n in reference[s]) for s in range(1, STEPS)]
    assert moved == [True, False, True]  # the topology changed at the updates (steps 2 and 4)
    if arch != "llama":
        assert {n.rsplit(".", 1)[-1] for n in reference[0] if ".experts." in n} == {"gate_up_proj", "down_proj"}
        assert sum(ranks[rank][arch][1] for rank in range(WORLD)) > 0  # (experts a rank's batch never reached)
    for rank, result in enumerate(ranks):
        for step, (got, want) in enumerate(zip(result[arch][0], reference), start=1):
            differ = [n for n in want if not torch.equal(got[n], want[n])]
            assert not differ, f"rank {rank} chose other blocks than one process at step {step}: {differ[:3]}"
