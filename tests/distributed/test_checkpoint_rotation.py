"""`--save_total_limit` deletes an older checkpoint only once the new one is complete on every rank: a rank that
fails while saving (its disk full, its node lost) leaves the run's last complete checkpoint to resume from."""

import errno
import json
import os
import time
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

from hf_sparse_cp.checkpoint_marker import newest_complete_checkpoint
from hf_sparse_cp.testing.spawn import run_gloo
from hf_sparse_cp.testing.tiny_models import tiny_config
from hf_sparse_cp.trainer.checkpoints import MARKER


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = torch.arange(64).add(i).remainder(90).add(3)
        return {"input_ids": ids, "labels": ids}


def _train(rank: int, world: int, out: str, fails: bool) -> None:
    """CP 2 (DDP) saving every step, keeping one checkpoint; with `fails`, rank 1's save of step 2 fails once rank 0
    has written all of its files of that checkpoint (rank 0 then waits for it until the job ends)."""
    import hf_sparse_cp
    from hf_sparse_cp import SparseCPArguments, attach_to_trainer
    from hf_sparse_cp.distributed import ContextParallelConfig

    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1")
    hf_sparse_cp.patch()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97))
    hf_sparse_cp.configure(model)
    args = TrainingArguments(output_dir=out, per_device_train_batch_size=1, max_steps=3, save_strategy="steps",
                             save_steps=1, save_total_limit=1, report_to="none", use_cpu=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(), data_collator=default_data_collator)
    attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True), ContextParallelConfig(cp_size=2))
    save_rng = trainer._save_rng_state

    def rank_1_fails_at_step_2(output_dir):
        if fails and rank == 1 and trainer.state.global_step == 2:
            state = Path(output_dir) / "trainer_state.json"  # (rank 0's last file of the checkpoint)
            while not state.exists():
                time.sleep(0.1)
            time.sleep(2.0)
            raise OSError(errno.ENOSPC, "No space left on device (rank 1)")
        return save_rng(output_dir)

    trainer._save_rng_state = rank_1_fails_at_step_2
    trainer.train()


def test_a_rank_failing_to_save_leaves_the_last_complete_checkpoint_under_save_total_limit(tmp_path):
    out = tmp_path / "run"
    with pytest.raises(Exception, match="No space left on device"):
        run_gloo(_train, 2, str(out), True, timeout_s=120)
    assert not json.loads((out / "checkpoint-2" / MARKER).read_text())["complete"]
    newest, passed = newest_complete_checkpoint([out])
    assert newest == out / "checkpoint-1", sorted(p.name for p in out.iterdir())
    assert passed == [out / "checkpoint-2"]


def test_save_total_limit_keeps_the_newest_checkpoints_with_the_runs_arguments(tmp_path):
    out = tmp_path / "run"
    run_gloo(_train, 2, str(out), False, timeout_s=120)
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3"]
    assert json.loads((out / "checkpoint-3" / MARKER).read_text())["complete"]
    saved = torch.load(out / "checkpoint-3" / "training_args.bin", weights_only=False)
    assert saved.save_total_limit == 1
