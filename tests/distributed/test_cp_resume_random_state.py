"""A run resumed at another CP degree goes on with the random state it saved (#50): the Trainer loads the file of its
own process name (rng_state.pth in one process, rng_state_<rank>.pth in several), which a checkpoint of CP 2 resumed in
one process (or one process's resumed under CP 2) does not hold, so the resume drew NEFTune's noise (a collator's
crops, ...) from the generators as the run's start left them."""

import os

import pytest
import torch
from padding import pad_collate


def _rows() -> list[dict]:
    ids = torch.randint(3, 259, (8, 96), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": r, "labels": r} for r in ids]


def _losses(rank: int, world: int, out: str, resume: bool) -> list[float]:
    """The losses of 4 steps of a float64 tiny Llama with NEFTune under CP `world` saving at step 2 in `out`, or of
    steps 3-4 resumed from that checkpoint."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, attach_to_trainer, detach_from_trainer
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).double()
    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=64, vertical_topk=2, slash_topk=2,
                                                        local_window=16, sink_tokens=4, last_q=16))
    args = TrainingArguments(output_dir=out, report_to="none", use_cpu=True, max_steps=4, learning_rate=0.5,
                             optim="sgd", logging_steps=1, save_strategy="steps", save_steps=2,
                             per_device_train_batch_size=2, seed=0, neftune_noise_alpha=5.0)
    trainer = Trainer(model=model, args=args, train_dataset=_rows(), data_collator=pad_collate)
    attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True), ContextParallelConfig(cp_size=world))
    trainer.train(resume_from_checkpoint=os.path.join(out, "checkpoint-2") if resume else None)
    detach_from_trainer(trainer)
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


@pytest.mark.parametrize(("saved", "resumed"), [(2, 1), (1, 2)], ids=["cp2_in_one_process", "one_process_in_cp2"])
def test_a_resume_at_another_cp_degree_draws_as_the_uninterrupted_run(tmp_path, saved, resumed):
    from hf_sparse_cp.testing.spawn import run_gloo

    full = run_gloo(_losses, saved, str(tmp_path), False, timeout_s=300)[0]
    for losses in run_gloo(_losses, resumed, str(tmp_path), True, timeout_s=300):
        assert losses == pytest.approx(full, rel=1e-6), (losses, full)  # (its checkpoint's logs first)
