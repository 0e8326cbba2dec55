"""Stock Trainer options under DP 2 x CP 2 (4 processes) train, resume and predict as one process with the global batch
(per-device batch x 2): split_batches with a loader worker, batches grouped by length with the input token count, a run
resumed mid-epoch, and the predictions of an odd evaluation set (5 rows, batches of 2) gathered whole or batch by
batch. (Options where DP 2 differs from one process as stock DP 2 does, so not tested here: eval_loss over
different batches, a short last batch completed with a first row, padded tokens counted per rank's batch.)"""

import os

import numpy as np
import pytest
import torch
from padding import pad_collate

from hf_sparse_cp.testing.spawn import run_gloo


def _rows(count: int, seed: int) -> list[dict]:
    """`count` rows of 160 to 256 tokens, each with a different number of targets."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(count):
        ids = torch.randint(3, 259, (256 - 32 * int(torch.randint(0, 4, (), generator=g)),), generator=g)
        labels = ids.clone()
        labels[: 17 * (i % 5) + 3] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _runs(rank: int, world: int, out: str) -> dict:
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    dp = max(world // 2, 1)
    train, evals = (Dataset.from_list(_rows(n, seed)).with_format("torch") for n, seed in ((7, 0), (5, 1)))

    def trainer(name: str, **flags) -> SparseTrainer:
        torch.manual_seed(0)
        args = SparseTrainingArguments(**{
            "output_dir": os.path.join(out, str(world), name), "report_to": "none", "use_cpu": True, "max_steps": 3,
            "logging_steps": 1, "learning_rate": 1e-3, "save_strategy": "no", "seed": 0,
            "per_device_train_batch_size": 2 // dp, "per_device_eval_batch_size": 4 // dp,
            "train_sampling_strategy": "sequential", "cp_size": min(world, 2), "sparse_block_size": 32,
            "sparse_min_seq_len": 128, **flags})
        return SparseTrainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")), args=args,
                             train_dataset=train, eval_dataset=evals, data_collator=pad_collate)

    def losses(t: SparseTrainer) -> list[float]:
        return [log["loss"] for log in t.state.log_history if "loss" in log]

    result = {}
    # split_batches: each process's batch is per_device_train_batch_size over the DP ranks
    t = trainer("split", accelerator_config={"split_batches": True}, per_device_train_batch_size=2,
                dataloader_num_workers=1)
    t.train()
    result["split"] = losses(t)
    t = trainer("grouped", train_sampling_strategy="group_by_length", include_num_input_tokens_seen="non_padding")
    t.train()
    result["grouped"] = losses(t), t.state.num_input_tokens_seen
    # saved at step 2, resumed to step 3 by a new Trainer
    t = trainer("saved", save_strategy="steps", save_steps=2)
    t.train()
    result["saved"] = losses(t)
    t = trainer("resumed")
    t.train(resume_from_checkpoint=os.path.join(out, str(world), "saved", "checkpoint-2"))
    result["resumed"] = losses(t)[-1]

    def gathered(p):  # (the rows gathered, and a value of each; batches of padded rows kept apart)
        predictions = [p.predictions] if isinstance(p.predictions, np.ndarray) else p.predictions
        first = np.concatenate([np.asarray(x)[:, :8, :8] for x in predictions])
        return {"rows": float(len(first)), "sum": float(first.astype(np.float64).sum())}

    t = trainer("evaluated", eval_do_concat_batches=False)
    t.compute_metrics = gathered
    result["evaluated"] = t.evaluate()
    seen = {}

    def by_batch(p, compute_result):
        seen["rows"] = seen.get("rows", 0.0) + len(p.predictions)
        seen["sum"] = seen.get("sum", 0.0) + float(torch.as_tensor(p.predictions)[:, :8, :8].double().sum())
        return dict(seen) if compute_result else {}

    t = trainer("by batch", batch_eval_metrics=True)
    t.compute_metrics = by_batch
    result["by batch"] = t.predict(evals).metrics
    if dp > 1:  # 7 training rows and 3 evaluation batches over 2 DP ranks
        t = trainer("uneven", accelerator_config={"even_batches": False})
        for name, run in (("uneven train", t.train), ("uneven evaluate", t.evaluate)):
            try:
                run()
            except ValueError as e:
                result[name] = str(e)
    return result


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("dp_cp_flags"))
    return run_gloo(_runs, 1, out, timeout_s=300)[0], run_gloo(_runs, 4, out, timeout_s=400)


def test_split_batches_with_a_loader_worker_trains_as_one_process(runs):
    one, ranks = runs
    assert len(one["split"]) == 3
    for rank in ranks:
        assert rank["split"] == pytest.approx(one["split"], rel=1e-5), (rank, one)


def test_batches_grouped_by_length_train_and_count_tokens_as_one_process(runs):
    one, ranks = runs
    for rank in ranks:
        assert rank["grouped"][0] == pytest.approx(one["grouped"][0], rel=1e-5), (rank, one)
        assert rank["grouped"][1] == one["grouped"][1]


def test_a_run_resumed_mid_epoch_continues_as_one_uninterrupted_process(runs):
    one, ranks = runs
    for rank in ranks:
        assert rank["saved"] == pytest.approx(one["saved"], rel=1e-5), (rank, one)
        assert rank["resumed"] == pytest.approx(one["saved"][2], rel=1e-5), (rank, one)


@pytest.mark.parametrize("how", ["evaluated", "by batch"])
def test_an_odd_evaluation_set_gathers_each_row_once(runs, how):
    one, ranks = runs
    prefix = "eval" if how == "evaluated" else "test"
    assert one[how][f"{prefix}_rows"] == 5
    for rank in ranks:
        assert rank[how][f"{prefix}_rows"] == 5, (rank, one)
        assert rank[how][f"{prefix}_sum"] == pytest.approx(one[how][f"{prefix}_sum"], rel=1e-5), (rank, one)


@pytest.mark.parametrize("run", ["train", "evaluate"])
def test_even_batches_off_with_batches_the_ranks_cannot_share_is_refused_naming_the_fix(runs, run):
    """Where the DP ranks would take different numbers of batches they waited on each other for ever (training) or
    failed on a mismatched gather (evaluation), as under stock DP 2: refused on every rank, naming the fix."""
    for rank in runs[1]:
        assert "even_batches=False" in rank[f"uneven {run}"] and "Drop it" in rank[f"uneven {run}"], rank


def _start_method(rank: int, world: int) -> str:
    import multiprocessing

    return multiprocessing.get_start_method()


def test_a_rank_starts_its_loader_workers_as_a_process_torchrun_starts():
    """`run_gloo`'s ranks (forked by its fork server) had the server's start method, so the loader worker of
    `dataloader_num_workers` waited for a fork server of the rank's own (a fresh interpreter importing torch: 7 s a
    loader, most of these tests' time); a process torchrun starts has the platform's default, as the ranks have now."""
    import subprocess
    import sys

    fresh = subprocess.run([sys.executable, "-c", "import multiprocessing; print(multiprocessing.get_start_method())"],
                           capture_output=True, text=True, check=True).stdout.strip()
    assert run_gloo(_start_method, 2) == [fresh, fresh]
