"""SMET's topology decisions agree on every rank: two gloo processes training through the stock Trainer,
under DDP (DP 2, different samples per rank) and under sparse context parallelism (CP 2, one sequence
split over the ranks, gradients averaged by DDP).

Each rank's post-accumulate-grad hook sees only its own gradient (DDP averages after the hooks), so
gradient regrowth must reduce its scores over the ranks or the replicas choose different blocks and
drift apart. All cases run in one spawned job (a module fixture); the tests read its records.
"""

import os

import pytest
import torch
from transformers import Trainer, TrainerCallback, TrainingArguments, default_data_collator

from hf_sparse_cp.integration.architectures import transformers_release
from hf_sparse_cp.smet import SMETConfig
from hf_sparse_cp.testing.spawn import run_gloo
from hf_sparse_cp.trainer.checkpoints import CPU_PROCESSES_RESUME_SINCE

from smet_common import TokenRows, markov_tokens, tiny_llama

WORLD = 2
MODES = ("sparse_weights", "sparse_update")
REGROWTH = ("gradient", "random")
STEPS = 4
# A topology update every 2 steps, replacing half of the active blocks (the cosine decay barely starts).
CONFIG = dict(density=0.5, block_size=8, update_interval=2, prune_rate=0.5, prune_decay_steps=100,
              regrow_warmup_steps=2)
RESUME_STEPS, SAVE_AT = 6, 3



class Record(TrainerCallback):
    """After every optimizer step: the masks of the sparse matrices and all weights of this rank."""

    def __init__(self):
        self.steps = []

    def on_step_end(self, args, state, control, model=None, optimizer=None, **kwargs):
        from hf_sparse_cp.smet import unwrap_smet

        smet = unwrap_smet(optimizer)
        masks = {name: smet.state[param]["block_index"].clone()
                 for group in smet.param_groups if group["smet"]
                 for name, param in zip(group["param_names"], group["params"])}
        weights = {name: param.detach().clone() for name, param in model.named_parameters()}
        self.steps.append((masks, weights, smet.last_replaced_fraction))


def _trainer(out_dir, config: SMETConfig, cp: bool, max_steps: int = STEPS, seed: int = 0, save_steps: int = 0):
    from hf_sparse_cp import (
        SparseAttentionConfig,
        SparseCPArguments,
        attach_to_trainer,
        enable_sparse_attention,
        install_smet,
    )
    from hf_sparse_cp.distributed import ContextParallelConfig

    args = TrainingArguments(
        output_dir=str(out_dir), max_steps=max_steps, per_device_train_batch_size=2,
        # DDP syncs only on the last micro-batch: the hooks score two local micro-batches per step.
        gradient_accumulation_steps=1 if cp else 2,
        learning_rate=5e-3, lr_scheduler_type="constant", logging_steps=1, report_to="none", use_cpu=True, seed=0,
        max_grad_norm=1.0, save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
    )
    model = tiny_llama(seed=seed, max_position_embeddings=128)
    sparse = SparseCPArguments(sparse_attention=True, sparse_fused_loss=False)
    if cp:
        enable_sparse_attention(model, sparse, SparseAttentionConfig(
            block_size=16, min_seq_len=32, vertical_topk=2, slash_topk=2, local_window=16, sink_tokens=2))
    trainer = Trainer(model=model, args=args, train_dataset=TokenRows(markov_tokens(64, 64)),
                      data_collator=default_data_collator)
    cp_size = attach_to_trainer(trainer, sparse, ContextParallelConfig(cp_size=2)).cp_size if cp else 1
    install_smet(trainer, config)
    record = Record()
    trainer.add_callback(record)
    return trainer, record, cp_size


def _losses(trainer) -> list[float]:
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def _worker(rank: int, world: int, out_dir: str) -> dict:
    # accelerate treats the process as one of a 2-process CPU job (the gloo group is already up).
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", OMP_NUM_THREADS="1")
    runs = {}
    for parallel in ("dp", "cp"):
        for mode in MODES:
            for regrowth in REGROWTH:
                config = SMETConfig(mode=mode, regrowth=regrowth, **CONFIG)
                trainer, record, cp_size = _trainer(os.path.join(out_dir, "runs"), config, cp=parallel == "cp")
                trainer.train()
                runs[parallel, mode, regrowth] = dict(steps=record.steps, cp_size=cp_size,
                                                      wrapped=type(trainer.model_wrapped).__name__)

    if transformers_release() < CPU_PROCESSES_RESUME_SINCE:  # (its Trainer cannot resume 2 CPU processes)
        return dict(runs=runs, resume=None)
    # Save after step 3, resume from there into a differently initialised model (DP 2, gradient regrowth).
    config = SMETConfig(mode="sparse_weights", regrowth="gradient", **CONFIG)
    full, record, _ = _trainer(os.path.join(out_dir, "full"), config, cp=False, max_steps=RESUME_STEPS,
                               save_steps=SAVE_AT)
    full.train()
    resumed, _, _ = _trainer(os.path.join(out_dir, "resumed"), config, cp=False, max_steps=RESUME_STEPS, seed=1)
    resumed.train(resume_from_checkpoint=os.path.join(out_dir, "full", f"checkpoint-{SAVE_AT}"))
    resume = dict(
        full=_losses(full), resumed=_losses(resumed), full_masks=record.steps[-1][0],
        full_weights={n: p.detach().clone() for n, p in full.model.named_parameters()},
        resumed_weights={n: p.detach().clone() for n, p in resumed.model.named_parameters()},
    )
    return dict(runs=runs, resume=resume)


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Every rank's records of the one spawned job."""
    return run_gloo(_worker, WORLD, str(tmp_path_factory.mktemp("smet_ranks")), timeout_s=600)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("parallel", ["dp", "cp"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("regrowth", REGROWTH)
def test_masks_and_weights_agree_on_every_rank_after_every_step(ranks, parallel, mode, regrowth):
    runs = [r["runs"][parallel, mode, regrowth] for r in ranks]
    assert all(run["wrapped"] == "DistributedDataParallel" for run in runs)
    assert all(run["cp_size"] == (2 if parallel == "cp" else 1) for run in runs)
    steps = [run["steps"] for run in runs]
    assert all(len(s) == STEPS for s in steps)
    for step in range(STEPS):
        (masks, weights, replaced), *others = [s[step] for s in steps]
        for other_masks, other_weights, other_replaced in others:
            assert _same(masks, other_masks), f"masks differ between ranks after step {step + 1}"
            assert _same(weights, other_weights), f"weights differ between ranks after step {step + 1}"
            assert replaced == other_replaced
    # The topology really moved at the updates (steps 2 and 4), and only there.
    masks = [record[0] for record in steps[0]]
    assert not _same(masks[0], masks[1]) and _same(masks[1], masks[2]) and not _same(masks[2], masks[3])


def test_a_resumed_run_continues_as_if_uninterrupted(ranks):
    if ranks[0]["resume"] is None:
        pytest.skip(f"transformers before {CPU_PROCESSES_RESUME_SINCE} cannot resume a run of several CPU processes")
    for rank in ranks:
        got = rank["resume"]
        assert len(got["full"]) == RESUME_STEPS and got["resumed"] == got["full"]
        assert _same(got["resumed_weights"], got["full_weights"])
    # ... and the ranks still hold one model.
    assert _same(ranks[0]["resume"]["full_weights"], ranks[1]["resume"]["full_weights"])
    assert _same(ranks[0]["resume"]["full_masks"], ranks[1]["resume"]["full_masks"])


class TwoBranches(torch.nn.Module):
    """Two sparse matrices; `use_v` False leaves v_proj out of the forward (an MoE expert no token reached)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.q_proj = torch.nn.Linear(32, 16, bias=False)
        self.v_proj = torch.nn.Linear(32, 16, bias=False)

    def forward(self, x, use_v: bool):
        out = self.q_proj(x).square().sum()
        return out + self.v_proj(x).pow(3).sum() if use_v else out


def _branch_masks(rank: int, world: int) -> dict[str, torch.Tensor]:
    """Two steps (a gradient-regrowth update at the second) of DDP over `TwoBranches`, rank 1 never using v_proj;
    in one process, the mean of both ranks' losses."""
    from torch.nn.parallel import DistributedDataParallel

    from hf_sparse_cp.smet import create_smet_optimizer

    config = SMETConfig(density=0.5, block_size=8, update_interval=2, prune_rate=0.5, regrowth="gradient",
                        target_modules=["q_proj", "v_proj"])
    model = TwoBranches()
    x = torch.randn(2, 4, 32, generator=torch.Generator().manual_seed(1))
    opt = create_smet_optimizer(model, torch.optim.AdamW, config, lr=1e-2)
    opt.attach()
    ddp = DistributedDataParallel(model, find_unused_parameters=True) if world > 1 else None
    for step in range(2):
        opt.zero_grad()
        loss = ddp(x[rank] + step, rank == 0) if ddp else (model(x[0] + step, True) + model(x[1] + step, False)) / 2
        loss.backward()
        opt.step()
    assert opt.topology_updates == 1
    return {name: opt.state[param]["block_index"].clone() for name, param in model.named_parameters()}


def test_gradient_regrowth_under_ddp_with_a_matrix_one_rank_never_used_decides_as_one_process():
    """A rank whose batch never reached a sparse matrix ran no gradient hook: its part of the regrowth scores is
    zeros. It averaged one tensor fewer than the other rank (the collectives paired up wrongly: a hang); now every
    rank chooses the blocks one process chooses on both batches."""
    (one,) = run_gloo(_branch_masks, 1, timeout_s=120)
    for rank in run_gloo(_branch_masks, WORLD, timeout_s=120):
        assert rank.keys() == one.keys()
        assert all(torch.equal(rank[name], one[name]) for name in one)
