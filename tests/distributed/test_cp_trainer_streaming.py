"""A streaming (iterable) training set under CP 2, as `run_clm.py --streaming` builds one: the ranks of the CP group
read the same rows, so the losses equal one process's; a `dispatch_batches` the user set, which would split rank
0's batches over the ranks, is refused naming the fix."""

import os
import tempfile

import pytest
import torch

from hf_sparse_cp.testing.spawn import run_gloo


def _train(rank: int, world: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    ids = torch.randint(3, 259, (6, 256), generator=torch.Generator().manual_seed(0)).tolist()
    stream = Dataset.from_dict({"input_ids": ids, "labels": ids}).to_iterable_dataset()
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, accelerator_config in (("stream", None), ("dispatch", {"dispatch_batches": True})):
            torch.manual_seed(0)
            args = SparseTrainingArguments(
                output_dir=tmp, max_steps=3, per_device_train_batch_size=1, learning_rate=1e-3, logging_steps=1,
                report_to="none", save_strategy="no", use_cpu=True, cp_size=world, sparse_block_size=32,
                sparse_min_seq_len=128, accelerator_config=accelerator_config)
            model = AutoModelForCausalLM.from_config(tiny_config("llama"))
            try:
                trainer = SparseTrainer(model=model, args=args, train_dataset=stream)
                trainer.train()
                result[name] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
            except ValueError as e:
                result[name] = str(e)
            if world == 1:
                break
    return result


@pytest.fixture(scope="module")
def runs():
    return run_gloo(_train, 1, timeout_s=300)[0], run_gloo(_train, 2, timeout_s=300)


def test_a_streaming_training_set_under_cp2_trains_as_one_process(runs):
    one, ranks = runs
    assert len(one["stream"]) == 3
    for rank in ranks:
        assert rank["stream"] == pytest.approx(one["stream"], rel=1e-5), rank


def test_dispatch_batches_under_cp2_is_refused_naming_the_fix(runs):
    for rank in runs[1]:
        assert "dispatch_batches" in rank["dispatch"] and "false" in rank["dispatch"], rank
