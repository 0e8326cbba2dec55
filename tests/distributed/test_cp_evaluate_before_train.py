"""`trainer.evaluate()` before `trainer.train()` (a baseline evaluation, as scripts run with `--do_eval` first): the
evaluation prepares the model in accelerate's evaluation mode, unwrapped, and marks it prepared, so the training
that follows got no DDP wrapper: each process stepped with its own gradients (under CP 2 a rank's shard's share: the
first step's grad norms 2.16 and 1.98 on the two ranks where one process has 1.53, SmolLM2's gradients up to 190%
from one process's; under data parallelism each rank its own batch's), and the ranks' weights drifted apart. The
plugin prepares such a model again for training (`attach.prepare_for_training_after_evaluation`)."""

import os
import tempfile

import pytest
import torch

from oracle import rel_rms

SEQ = 256


def _rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": (ids := torch.randint(3, 97, (SEQ,), generator=g)), "labels": ids} for _ in range(4)]


def _train(rank: int, world: int, runs: tuple[str, ...]) -> dict:
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    rows, results = _rows(), {}
    for run in runs:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97))
        cp = {"cp_size": world} if run.startswith("cp") else {}
        # one process and CP 2 train the 2 rows in turn; DP 2 trains 2 rows a step
        train = rows[:2] if run != "dp" else rows
        with tempfile.TemporaryDirectory() as tmp:
            args = SparseTrainingArguments(
                output_dir=tmp, report_to="none", use_cpu=True, per_device_train_batch_size=1,
                per_device_eval_batch_size=1, max_steps=2, learning_rate=0.1, optim="sgd", logging_steps=1,
                save_strategy="no", sparse_max_length=SEQ, sparse_block_size=16, sparse_min_seq_len=0,
                sparse_vertical_topk=4, sparse_slash_topk=4, sparse_local_window=16, sparse_sink_tokens=4, **cp)
            trainer = SparseTrainer(model=model, args=args, train_dataset=train, eval_dataset=rows[2:])
            evaluated = trainer.evaluate()["eval_loss"] if run.endswith("evaluated first") else None
            trainer.train()
        logs = [log for log in trainer.state.log_history if "loss" in log]
        results[run] = {"eval_loss": evaluated, "loss": [log["loss"] for log in logs],
                        "grad_norm": [log["grad_norm"] for log in logs],
                        "kept": [log["sparse/kept_fraction"] for log in logs],
                        "weights": torch.cat([p.detach().flatten() for p in model.parameters()])}
    return results


@pytest.fixture(scope="module")
def runs():
    from hf_sparse_cp.testing.spawn import run_gloo

    return (run_gloo(_train, 1, ("one", "one evaluated first"), timeout_s=300)[0],
            run_gloo(_train, 2, ("cp evaluated first", "dp", "dp evaluated first"), timeout_s=600))


def test_cp2_trained_after_an_evaluation_equals_one_process(runs):
    one, ranks = runs
    want, first = one["one"], one["one evaluated first"]
    assert first["loss"] == want["loss"] and torch.equal(first["weights"], want["weights"])
    assert max(want["kept"]) < 1.0  # the layer after the dense first one ran sparse
    for rank in ranks:
        got = rank["cp evaluated first"]
        assert got["eval_loss"] == pytest.approx(first["eval_loss"], rel=1e-6)
        for key in ("loss", "grad_norm", "kept"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
        assert rel_rms(got["weights"], want["weights"]) < 1e-6


def test_data_parallel_ranks_trained_after_an_evaluation_step_together(runs):
    """DP 2 (sparse, no CP): each rank's batch differs, the step's averaged gradient is the same on both ranks."""
    _, ranks = runs
    for run in ("dp", "dp evaluated first"):
        assert torch.equal(ranks[0][run]["weights"], ranks[1][run]["weights"]), run
        assert ranks[0][run]["grad_norm"] == ranks[1][run]["grad_norm"], run
