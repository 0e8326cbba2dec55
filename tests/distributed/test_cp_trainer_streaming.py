"""A streaming (iterable) training set under CP 2, as `run_clm.py --streaming` builds one: the ranks of the CP group
read the same rows, so the losses equal one process's, and so does the loss of a streaming evaluation set whose last
batch is short; a `dispatch_batches` the user set, which would split rank 0's batches over the ranks, is refused
naming the fix."""

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
    evaluation = Dataset.from_dict({"input_ids": ids[:3], "labels": ids[:3]}).to_iterable_dataset()  # (batches 2, 1)
    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, accelerator_config in (("stream", None), ("dispatch", {"dispatch_batches": True})):
            torch.manual_seed(0)
            args = SparseTrainingArguments(
                output_dir=tmp, max_steps=3, per_device_train_batch_size=1, learning_rate=1e-3, logging_steps=1,
                report_to="none", save_strategy="no", use_cpu=True, cp_size=world, sparse_block_size=32,
                per_device_eval_batch_size=2,
                sparse_min_seq_len=128, accelerator_config=accelerator_config)
            model = AutoModelForCausalLM.from_config(tiny_config("llama"))
            try:
                trainer = SparseTrainer(model=model, args=args, train_dataset=stream)
                trainer.train()
                result[name] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
                result["eval_loss"] = trainer.evaluate(evaluation)["eval_loss"]
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


def test_a_streaming_evaluation_set_with_a_short_last_batch_under_cp2_evaluates_as_one_process(runs):
    """Its loader has no length, so accelerate knows no remainder; the evaluation loop repeats each batch's loss
    per_device_eval_batch_size times, and the last batch's one row counted twice (it was, under CP 2)."""
    one, ranks = runs
    for rank in ranks:
        assert rank["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-6, abs=1e-6), (rank, one)


def test_dispatch_batches_under_cp2_is_refused_naming_the_fix(runs):
    for rank in runs[1]:
        assert "dispatch_batches" in rank["dispatch"] and "false" in rank["dispatch"], rank
