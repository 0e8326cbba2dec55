"""The ranks of a CP group must hold the same batch (issue #42): the Trainer checks it at the first step of a run
and of its resume (once each, not at every step), and stops data built differently on each process with an
error that names the fix. A collator drawing random numbers builds the same batch on every rank at every step (#50),
however the ranks drew before it."""

import os

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_sparse_cp.integration.architectures import transformers_release
from hf_sparse_cp.testing.spawn import run_gloo
from hf_sparse_cp.testing.tiny_models import tiny_config
from hf_sparse_cp.trainer.checkpoints import CPU_PROCESSES_RESUME_SINCE


def _rows(seed: int) -> list[dict]:
    ids = torch.randint(3, 259, (8, 256), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": r, "labels": r} for r in ids]


def _train(output_dir: str, data_seed: int, max_steps: int, resume: bool) -> None:
    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    args = SparseTrainingArguments(
        output_dir=output_dir, max_steps=max_steps, per_device_train_batch_size=1, learning_rate=1e-3,
        logging_steps=1, report_to="none", save_strategy="steps", save_steps=2, use_cpu=True, cp_size=2,
        sparse_block_size=32, sparse_min_seq_len=128, train_sampling_strategy="sequential")
    SparseTrainer(model=model, args=args, train_dataset=_rows(data_seed)).train(
        resume_from_checkpoint=resume or None)


def _checked_steps(rank: int, world: int, output_dir: str) -> dict:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    from hf_sparse_cp.distributed import inputs as context

    checked = []
    check = context.check_same_batch

    def counting(inputs, parallel):
        checked.append(inputs["input_ids"][0, :4].tolist())
        check(inputs, parallel)

    context.check_same_batch = counting  # (this spawned process only)
    _train(output_dir, data_seed=0, max_steps=2, resume=False)
    first_run = len(checked)
    if transformers_release() < CPU_PROCESSES_RESUME_SINCE:  # (its Trainer cannot resume 2 CPU processes: refused)
        try:
            _train(output_dir, data_seed=0, max_steps=4, resume=True)
            return {"first_run": first_run, "resume_refused": None}
        except ValueError as e:
            return {"first_run": first_run, "resume_refused": str(e)}
    _train(output_dir, data_seed=0, max_steps=4, resume=True)  # steps 3-4 from checkpoint-2
    resumed = len(checked)
    try:
        _train(output_dir, data_seed=1 + rank, max_steps=6, resume=True)  # each rank built other rows
        refused = None
    except ValueError as e:
        refused = str(e)
    return {"first_run": first_run, "resumed": resumed, "checked": len(checked), "refused": refused}


def test_the_cp_ranks_batches_are_checked_at_the_first_step_of_each_run_and_different_data_is_refused(tmp_path):
    for rank in run_gloo(_checked_steps, 2, str(tmp_path), timeout_s=600):
        assert rank["first_run"] == 1  # two steps, one check
        if "resume_refused" in rank:
            assert "Upgrade transformers to 5.18 or later" in rank["resume_refused"], rank
            continue
        assert rank["resumed"] == 2  # the resumed run's first step: one more
        assert rank["checked"] == 3  # the third run stopped at its first step
        assert "hold different rows of tokens" in rank["refused"]
        assert "build it identically on every process" in rank["refused"] and "seed it" in rank["refused"]


def _refusals_of_rearranged_rows(rank: int, world: int) -> dict:
    """The same tokens in another arrangement on rank 1 (rows swapped, tokens of one position swapped between rows,
    two tokens of a row swapped; embeddings' rows swapped): each is another batch, which splitting over the group
    would mix."""
    from hf_sparse_cp.distributed import ContextParallelConfig, ParallelDims, check_same_batch

    par = ParallelDims.from_config(ContextParallelConfig(cp_size=world))
    ids = torch.randint(3, 259, (2, 64), generator=torch.Generator().manual_seed(0))
    ids[1] = ids[0].flip(0)  # rows of the same tokens: equal sums
    swapped_column = ids.clone()
    swapped_column[:, 5] = swapped_column[:, 5].flip(0)
    swapped_pair = ids.clone()
    swapped_pair[0, [3, 9]] = swapped_pair[0, [9, 3]]
    swapped_pair[1, [3, 9]] = swapped_pair[1, [9, 3]]
    embeds = torch.nn.functional.embedding(ids, torch.randn(259, 8, generator=torch.Generator().manual_seed(1)))
    non_finite = embeds.clone()  # (a NaN, an inf and a -inf in the same batch on both ranks: the same batch)
    non_finite[0, 40, 3], non_finite[1, 2, 0], non_finite[1, 50, 7] = float("nan"), float("inf"), -float("inf")
    huge = embeds.double() * 1e307  # (sums past float64's range)
    cases = {"same": ("input_ids", ids, ids), "rows": ("input_ids", ids, ids.flip(0)),
             "column": ("input_ids", ids, swapped_column), "pairs": ("input_ids", ids, swapped_pair),
             "embeds_same": ("inputs_embeds", embeds, embeds), "embeds_rows": ("inputs_embeds", embeds, embeds.flip(0)),
             "non_finite_same": ("inputs_embeds", non_finite, non_finite),
             "non_finite_rows": ("inputs_embeds", non_finite, non_finite.flip(0)),
             "huge_same": ("inputs_embeds", huge, huge)}
    batches = {name: {key: other if rank == 1 else mine} for name, (key, mine, other) in cases.items()}
    # the same tokens with other targets on rank 1: one target masked (a loop masking per rank), class labels swapped,
    # no labels at all (one of the group's keys absent on a rank: the fingerprint keeps its size, no hang)
    masked = ids.clone()
    masked[1, 7] = -100
    targets = {"labels_same": ("labels", ids, ids), "labels_masked": ("labels", ids, masked),
               "shift_labels_masked": ("shift_labels", ids, masked),
               "class_labels": ("labels", torch.tensor([1, 0]), torch.tensor([0, 1])),
               "labels_absent": ("labels", ids, None)}
    for name, (key, mine, other) in targets.items():
        given = other if rank == 1 else mine
        batches[name] = {"input_ids": ids, **({} if given is None else {key: given})}
    refused = {}
    for name, batch in batches.items():
        try:
            check_same_batch(batch, par)
            refused[name] = False
        except ValueError as e:
            refused[name] = "hold different rows of tokens" in str(e)
    return refused


def test_the_same_tokens_arranged_otherwise_on_one_rank_are_refused_as_another_batch():
    """... and the same embeddings with a NaN or an infinity, or sums past float64's range, are the same batch (#50:
    their fingerprint was NaN, unequal to itself, and CP 2 refused the batch as different rows, where one process
    trains on it, to NaN weights). The same tokens with other targets on a rank (labels masked there alone, class
    labels swapped, labels missing) are another batch too: before, unchecked, the ranks mixed their losses, and the
    document planner, which reads the targets, planned apart."""
    for rank in run_gloo(_refusals_of_rearranged_rows, 2, timeout_s=300):
        assert rank == {"same": False, "rows": True, "column": True, "pairs": True, "embeds_same": False,
                        "embeds_rows": True, "non_finite_same": False, "non_finite_rows": True, "huge_same": False,
                        "labels_same": False, "labels_masked": True, "shift_labels_masked": True,
                        "class_labels": True, "labels_absent": True}


def _random_crop(rows: list[dict]) -> dict:
    """A collator that crops the rows at a random start, drawn from the global RNGs (torch's, Python's, numpy's)."""
    import random

    import numpy as np

    start = int(torch.randint(0, 24, ())) + random.randrange(24) + int(np.random.randint(24))
    ids = torch.stack([r["input_ids"][start:start + 160] for r in rows])
    return {"input_ids": ids, "labels": ids.clone()}


def _cropped_run(rank: int, world: int) -> list[float]:
    """Four steps of CP `world` (or one process) on randomly cropped rows, evaluated on such rows every two, while a
    callback draws random numbers on the main process only (one that samples a generation there) after each step and
    each evaluation batch: the losses and eval_losses logged."""
    import random
    import tempfile

    import numpy as np
    from transformers import TrainerCallback

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))

    class DrawOnMainProcess(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                torch.rand(3), random.random(), np.random.rand()

        on_prediction_step = on_step_end  # (between an evaluation's batches)

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).double()
    with tempfile.TemporaryDirectory() as tmp:
        args = SparseTrainingArguments(
            output_dir=tmp, max_steps=4, per_device_train_batch_size=1, learning_rate=1e-3, logging_steps=1,
            report_to="none", save_strategy="no", use_cpu=True, cp_size=world, sparse_block_size=32,
            sparse_min_seq_len=128, train_sampling_strategy="sequential", remove_unused_columns=False,
            eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=1)
        trainer = SparseTrainer(model=model, args=args, train_dataset=_rows(0), eval_dataset=_rows(1)[:3],
                                data_collator=_random_crop, callbacks=[DrawOnMainProcess()])
        trainer.train()
    return [log[key] for log in trainer.state.log_history for key in ("loss", "eval_loss") if key in log]


def test_a_collator_drawing_random_numbers_crops_as_one_process_after_draws_on_the_main_process_only():
    """A random collator under CP 2 while the main process alone draws random numbers after each step (#50): the
    other rank's generators fell behind rank 0's, so from the third step on the two ranks cropped other rows and
    trained on a mix of the two (5.6068 logged against one process's 5.5984), and evaluated so (eval_loss 5.4571
    against 5.4534), unchecked after the first step. The CP group now starts each step's batches and each evaluation's
    from its first rank's generators, which are one process's; each of an evaluation's batches too (a draw between
    them, in a callback's on_prediction_step, cropped the evaluation's later rows otherwise)."""
    (one,) = run_gloo(_cropped_run, 1, timeout_s=180)
    for losses in run_gloo(_cropped_run, 2, timeout_s=180):
        assert losses == pytest.approx(one, rel=1e-6), (losses, one)
