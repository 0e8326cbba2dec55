"""The Trainer's evaluation under CP 2 (each mode): `eval_loss` over an evaluation set whose last batch is short equals
one process's, and `predict` (which returns logits, a rank's covering its shard only) is refused naming the fix
instead of returning shards of rows as rows. A Trainer built to evaluate with `compute_metrics` (run_clm.py
--do_eval) is refused when the plugin attaches, before training, naming `--prediction_loss_only`, under which it
evaluates the loss of one process."""

import os
import tempfile

import pytest
import torch

MODES = {"ring": {}, "zigzag": {"cp_sharding": "zigzag"}, "ulysses": {"cp_mode": "ulysses"}}


def _evaluate(rank: int, world: int) -> dict:
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

    import hf_sparse_cp
    from hf_sparse_cp import SparseCPArguments, attach_to_trainer
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    ids = (torch.arange(3 * 300).view(3, 300) * 7).remainder(97).add(3)
    labels = ids.clone()
    for i in range(3):  # a different number of targets in each row
        labels[i, : 30 * i + 20] = -100
    rows = [{"input_ids": ids[i], "labels": labels[i]} for i in range(3)]
    results = {}
    for name, flags in MODES.items() if world > 1 else [("one", {})]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama"))
        hf_sparse_cp.configure(model)
        with tempfile.TemporaryDirectory() as tmp:
            # 3 rows in batches of 2: the last batch is short
            args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, per_device_eval_batch_size=2)
            trainer = Trainer(model=model, args=args, eval_dataset=rows, data_collator=default_data_collator)
            attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True),
                              ContextParallelConfig(cp_size=world, **flags))
            result = {"eval_loss": trainer.evaluate()["eval_loss"]}
            try:
                result["predictions"] = tuple(trainer.predict(rows).predictions.shape)
            except ValueError as e:
                result["predictions"] = str(e)
            for loss_only in (False, True):
                args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, per_device_eval_batch_size=2,
                                         prediction_loss_only=loss_only)
                trainer = Trainer(model=model, args=args, eval_dataset=rows, data_collator=default_data_collator,
                                  compute_metrics=lambda prediction: {"rows": len(prediction.label_ids)})
                try:
                    attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True),
                                      ContextParallelConfig(cp_size=world, **flags))
                    result[f"metrics_loss_only_{loss_only}"] = trainer.evaluate()["eval_loss"]
                except ValueError as e:
                    result[f"metrics_loss_only_{loss_only}"] = str(e)
        results[name] = result
    return results


@pytest.fixture(scope="module")
def runs():
    from hf_sparse_cp.testing.spawn import run_gloo

    return run_gloo(_evaluate, 1, timeout_s=300)[0]["one"], run_gloo(_evaluate, 2, timeout_s=300)


@pytest.mark.parametrize("mode", MODES)
def test_eval_loss_with_a_short_last_batch_under_cp2_is_that_of_one_process(runs, mode):
    one, ranks = runs
    for rank in ranks:
        assert rank[mode]["eval_loss"] == pytest.approx(one["eval_loss"], rel=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_predict_under_cp2_is_refused_naming_the_fix(runs, mode):
    one, ranks = runs
    assert one["predictions"][:2] == (3, 300)
    for rank in ranks:
        assert "prediction_loss_only" in rank[mode]["predictions"], rank[mode]


@pytest.mark.parametrize("mode", MODES)
def test_evaluation_with_compute_metrics_under_cp2_is_refused_before_training_naming_the_flag(runs, mode):
    one, ranks = runs
    assert isinstance(one["metrics_loss_only_False"], float)  # one process evaluates it
    for rank in ranks:
        assert "--prediction_loss_only" in rank[mode]["metrics_loss_only_False"], rank[mode]
        assert rank[mode]["metrics_loss_only_True"] == pytest.approx(one["eval_loss"], rel=1e-5)
