"""The Trainer's evaluation and prediction under CP 2 (each mode) equal one process's: `eval_loss`, the EvalPrediction
that `compute_metrics` receives (run_clm.py's: the argmax of `preprocess_logits_for_metrics`, the accuracy against the
shifted labels; with `include_for_metrics` inputs and losses) and `predict()`'s logits and label_ids, in the same
shapes and order. The rows (5, eval batch size 2: the last batch is short) are not a multiple of the CP split's
length; under the block shardings they are right-padded to each batch's longest, so the Trainer pads the predictions
between batches; document sharding takes packed rows (two documents each, which its plan re-orders). The model runs in
float64, so that the argmax of nearly tied logits cannot differ by rounding (transformers' loss is float32's)."""

import os
import tempfile

import numpy as np
import pytest
import torch

# each mode with the rows it takes
MODES = {
    "ring": ({}, "padded"),
    "zigzag": ({"cp_sharding": "zigzag"}, "padded"),
    "ulysses": ({"cp_mode": "ulysses"}, "padded"),
    "document": ({"cp_sharding": "document"}, "packed"),
}


def _rows(kind: str) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    lengths = [203, 150, 203, 170, 97] if kind == "padded" else [203] * 5
    rows = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, 259, (n,), generator=g)
        labels = ids.clone()
        labels[: 13 * i + 5] = -100  # a different number of targets in each row
        row = {"input_ids": ids, "labels": labels}
        if kind == "packed":
            row["position_ids"] = torch.cat([torch.arange(90), torch.arange(n - 90)])
        rows.append(row)
    return rows


def _collate(rows: list[dict]) -> dict:
    """Right-pads the batch to its longest row (attention_mask, labels -100), as DataCollatorForLanguageModeling."""
    n = max(len(r["input_ids"]) for r in rows)
    out = {}
    for key, pad in (("input_ids", 0), ("labels", -100), ("position_ids", 0)):
        if key in rows[0]:
            out[key] = torch.stack([torch.nn.functional.pad(r[key], (0, n - len(r[key])), value=pad) for r in rows])
    if any(len(r["input_ids"]) < n for r in rows):
        out["attention_mask"] = torch.stack([(torch.arange(n) < len(r["input_ids"])).long() for r in rows])
    return out


def _preprocess_logits_for_metrics(logits, labels):  # run_clm.py's
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def _evaluate(rank: int, world: int) -> dict:
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_sparse_cp
    from hf_sparse_cp import SparseCPArguments, attach_to_trainer
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    runs = MODES.items() if world > 1 else [(kind, ({}, kind)) for kind in ("padded", "packed")]
    results = {}
    for name, (flags, kind) in runs:
        rows = _rows(kind)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama")).double()
        hf_sparse_cp.configure(model)
        seen = {}

        def compute_metrics(prediction, seen=seen):  # run_clm.py's accuracy, keeping what it received
            seen.update(predictions=prediction.predictions, label_ids=prediction.label_ids,
                        inputs=prediction.inputs, losses=prediction.losses)
            preds, labels = prediction.predictions[:, :-1], prediction.label_ids[:, 1:]
            return {"accuracy": float((preds == labels).mean()),
                    "masked_accuracy": float((preds == labels)[labels != -100].mean())}

        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, per_device_eval_batch_size=2,
                                     include_for_metrics=["inputs", "loss"])
            trainer = Trainer(model=model, args=args, eval_dataset=rows, data_collator=_collate,
                              compute_metrics=compute_metrics,
                              preprocess_logits_for_metrics=_preprocess_logits_for_metrics)
            attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True),
                              ContextParallelConfig(cp_size=world, **flags))
            metrics = trainer.evaluate()
            evaluated = dict(seen)
            trainer.preprocess_logits_for_metrics = None
            trainer.compute_metrics = None
            predicted = trainer.predict(rows)
        results[name] = {"metrics": metrics, "evaluated": evaluated, "predictions": predicted.predictions,
                         "label_ids": predicted.label_ids, "predict_loss": predicted.metrics["test_loss"]}
    return results


@pytest.fixture(scope="module")
def runs():
    from hf_sparse_cp.testing.spawn import run_gloo

    return run_gloo(_evaluate, 1, timeout_s=300)[0], run_gloo(_evaluate, 2, timeout_s=300)


@pytest.mark.parametrize("mode", MODES)
def test_evaluate_with_compute_metrics_under_cp2_is_that_of_one_process(runs, mode):
    one, ranks = runs
    reference = one[MODES[mode][1]]
    assert 0 < reference["metrics"]["eval_masked_accuracy"] < 1  # a measure that can differ
    for rank in ranks:
        got = rank[mode]
        assert got["metrics"]["eval_loss"] == pytest.approx(reference["metrics"]["eval_loss"], rel=1e-6)
        for key in ("eval_accuracy", "eval_masked_accuracy"):
            assert got["metrics"][key] == reference["metrics"][key], key
        for key in ("predictions", "label_ids", "inputs"):  # what compute_metrics received, padding included
            assert got["evaluated"][key].shape == reference["evaluated"][key].shape, key
            assert np.array_equal(got["evaluated"][key], reference["evaluated"][key]), key
        np.testing.assert_allclose(got["evaluated"]["losses"], reference["evaluated"]["losses"], rtol=1e-6)


@pytest.mark.parametrize("mode", MODES)
def test_predict_under_cp2_returns_the_logits_and_labels_of_one_process(runs, mode):
    one, ranks = runs
    reference = one[MODES[mode][1]]
    assert reference["predictions"].shape == (5, 203, 259)
    for rank in ranks:
        got = rank[mode]
        assert got["predictions"].shape == reference["predictions"].shape
        np.testing.assert_allclose(got["predictions"], reference["predictions"], rtol=1e-9, atol=1e-9)
        assert np.array_equal(got["label_ids"], reference["label_ids"])
        assert got["predict_loss"] == pytest.approx(reference["predict_loss"], rel=1e-6)
