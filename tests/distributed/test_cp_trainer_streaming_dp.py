"""A streaming (iterable) evaluation set under DP 2 x CP 2 evaluates as one process. Each data-parallel rank's shard
(accelerate's `IterableDatasetShard`) completes the last, short, global batch with copies of the first rows, and the
loader has no length, so nothing dropped them: eval_loss counted them, and a rank's batch that mixed its last rows
with copies had its loss taken over both (3 rows, batch 2: 5.58539 against one process's 5.58559). A stream of several
files (a 🤗 datasets IterableDataset of at least as many shards as DP ranks) was read file by file, each rank its
own, in different numbers of rows: the evaluation hung, and training took other rows into a step than one process."""

import os
import tempfile

import numpy as np
import pytest
import torch

from hf_sparse_cp.testing.spawn import run_gloo


def _evaluate(rank: int, world: int) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    ids = torch.randint(3, 259, (5, 256), generator=torch.Generator().manual_seed(0)).tolist()

    def stream(rows: int, files: int = 1):
        return Dataset.from_dict({"input_ids": ids[:rows], "labels": ids[:rows]}).to_iterable_dataset(files)

    def predictions(p):  # (the rows gathered, and a value of each)
        return {"rows": float(len(p.predictions)), "mean": float(np.mean(p.predictions[:, :, :8]))}

    result = {}
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        args = SparseTrainingArguments(
            output_dir=tmp, report_to="none", use_cpu=True, cp_size=min(world, 2), per_device_eval_batch_size=2,
            sparse_block_size=32, sparse_min_seq_len=128)
        trainer = SparseTrainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")), args=args)
        result[3] = trainer.evaluate(stream(3))["eval_loss"]  # batches of 2: one global batch (2, 1 + a copy)
        trainer.compute_metrics = predictions
        result[5] = trainer.evaluate(stream(5))  # (2, 2), then (1 + a copy, 2 copies)
        trainer.compute_metrics = None
        result["files"] = trainer.evaluate(stream(5, files=2))["eval_loss"]  # (files of 3 and 2 rows)
        # training on a stream of 2 files: a step holds one process's 2 rows of a batch, whatever file holds them (2
        # steps: the third would be short, which data parallelism completes with a copy of a first row, as stock DP)
        torch.manual_seed(0)
        args = SparseTrainingArguments(
            output_dir=tmp, report_to="none", use_cpu=True, cp_size=min(world, 2), max_steps=2, logging_steps=1,
            per_device_train_batch_size=2 if world == 1 else 1, learning_rate=1e-3, save_strategy="no",
            sparse_block_size=32, sparse_min_seq_len=128)
        trainer = SparseTrainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")), args=args,
                                train_dataset=stream(5, files=2))
        trainer.train()
        result["train"] = [log["loss"] for log in trainer.state.log_history if "loss" in log]
    return result


@pytest.fixture(scope="module")
def runs():
    return run_gloo(_evaluate, 1, timeout_s=300)[0], run_gloo(_evaluate, 4, timeout_s=300)


def test_a_streaming_evaluation_set_under_dp2_cp2_evaluates_as_one_process(runs):
    one, ranks = runs
    for rank in ranks:
        assert rank[3] == pytest.approx(one[3], rel=1e-6), (rank, one)
        assert rank[5]["eval_loss"] == pytest.approx(one[5]["eval_loss"], rel=1e-6), (rank, one)


def test_its_predictions_are_the_streams_rows_once(runs):
    one, ranks = runs
    assert one[5]["eval_rows"] == 5
    for rank in ranks:
        assert rank[5]["eval_rows"] == 5 and rank[5]["eval_mean"] == pytest.approx(one[5]["eval_mean"], rel=1e-5)


def test_a_stream_of_several_files_under_dp2_cp2_evaluates_and_trains_as_one_process(runs):
    one, ranks = runs
    assert len(one["train"]) == 2
    for rank in ranks:
        assert rank["files"] == pytest.approx(one["files"], rel=1e-6), (rank, one)
        assert rank["train"] == pytest.approx(one["train"], rel=1e-5), (rank, one)
