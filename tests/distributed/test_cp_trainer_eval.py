"""The Trainer's evaluation and prediction under CP 2 (each mode) equal one process's; with data parallelism (DP 2 x
CP 2: ring, document) DP 2's, and under CP 4 (hybrid, ulysses) one process's: `eval_loss`, the EvalPrediction
that `compute_metrics` receives (run_clm.py's: the argmax of `preprocess_logits_for_metrics`, the accuracy against the
shifted labels; with `include_for_metrics` inputs and losses) and `predict()`'s logits and label_ids, in the same
shapes and order. The rows (5, eval batch size 2: the last batch is short) are not a multiple of the CP split's
length; under the block shardings they are right-padded to each batch's longest, so the Trainer pads the predictions
between batches; document sharding takes packed rows (two documents each, which its plan re-orders) and the padded
ones (an eval set: its text over the ring, the padding the rows share whole). The model runs in
float64, so that the argmax of nearly tied logits cannot differ by rounding (transformers' loss is float32's), with
blocks of 16 tokens: the rows' long documents run sparse."""

import os
import tempfile

import numpy as np
import pytest
import torch

BLOCK = 16  # the rows' documents (96 to 203 tokens) run sparse
# each CP 2 mode with the rows it takes
MODES = {
    "ring": ({"cp_size": 2}, "padded"),
    "zigzag": ({"cp_size": 2, "cp_sharding": "zigzag"}, "padded"),
    "ulysses": ({"cp_size": 2, "cp_mode": "ulysses"}, "padded"),
    "document": ({"cp_size": 2, "cp_sharding": "document"}, "packed"),
    # an eval set of padded rows of different lengths: refused when attention ran, after the training (#50)
    "document padded": ({"cp_size": 2, "cp_sharding": "document"}, "padded"),
}
# four processes: each layout, with the rows it takes and its reference (DP 2 without CP, or one process)
FOUR = {
    "ring DP 2 x CP 2": ({"cp_size": 2}, "padded", "DP 2"),
    "document DP 2 x CP 2": ({"cp_size": 2, "cp_sharding": "document"}, "packed", "DP 2 packed"),
    "hybrid CP 4": ({"cp_size": 4, "cp_mode": "hybrid", "cp_ulysses_size": 2}, "padded", "padded"),
    "ulysses CP 4": ({"cp_size": 4, "cp_mode": "ulysses"}, "padded", "padded"),
}
# the runs of each world size: name -> (ContextParallelConfig fields, rows)
RUNS = {
    1: {kind: ({}, kind) for kind in ("padded", "packed")},
    2: {**MODES, "DP 2": ({}, "padded"), "DP 2 packed": ({}, "packed")},
    4: {name: (flags, kind) for name, (flags, kind, _) in FOUR.items()},
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
            # two documents, the second on a block boundary: the document planner's pattern is then one process's
            # (an unaligned one differs within the documented bound: docs/context-parallelism.md)
            row["position_ids"] = torch.cat([torch.arange(6 * BLOCK), torch.arange(n - 6 * BLOCK)])
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
    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, attach_to_trainer
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    results = {}
    for name, (flags, kind) in RUNS[world].items():
        rows = _rows(kind)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama")).double()
        hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=BLOCK, min_seq_len=64, vertical_topk=2,
                                                            slash_topk=2, local_window=16, sink_tokens=4, last_q=16))
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
                              ContextParallelConfig(**flags))
            metrics = trainer.evaluate()
            evaluated = dict(seen)
            trainer.preprocess_logits_for_metrics = None
            trainer.compute_metrics = None
            predicted = trainer.predict(rows)
        results[name] = {"metrics": metrics, "evaluated": evaluated, "predictions": predicted.predictions,
                         "label_ids": predicted.label_ids, "predict_loss": predicted.metrics["test_loss"],
                         "predict_metrics": predicted.metrics}
    return results


@pytest.fixture(scope="module")
def runs():
    from hf_sparse_cp.testing.spawn import run_gloo

    return run_gloo(_evaluate, 1, timeout_s=300)[0], run_gloo(_evaluate, 2, timeout_s=300)


def _check_evaluation(got: dict, reference: dict) -> None:
    """`evaluate()`'s metrics and what compute_metrics received (padding included), `predict()`'s logits, label_ids and
    loss: those of the reference run."""
    assert got["metrics"]["eval_loss"] == pytest.approx(reference["metrics"]["eval_loss"], rel=1e-6)
    for key in ("eval_accuracy", "eval_masked_accuracy"):
        assert got["metrics"][key] == reference["metrics"][key], key
    for key in ("predictions", "label_ids", "inputs"):
        assert got["evaluated"][key].shape == reference["evaluated"][key].shape, key
        assert np.array_equal(got["evaluated"][key], reference["evaluated"][key]), key
    np.testing.assert_allclose(got["evaluated"]["losses"], reference["evaluated"]["losses"], rtol=1e-6)
    assert got["predictions"].shape == reference["predictions"].shape
    np.testing.assert_allclose(got["predictions"], reference["predictions"], rtol=1e-9, atol=1e-9)
    assert np.array_equal(got["label_ids"], reference["label_ids"])
    assert got["predict_loss"] == pytest.approx(reference["predict_loss"], rel=1e-6)
    # the steps and samples of the speed metrics: the reference's global batches (3 at 5 rows, 2 a batch, with one
    # data-parallel rank; the Trainer's own count under CP 2 was 2, eval_steps_per_second halved)
    for split, metrics in (("eval", "metrics"), ("test", "predict_metrics")):
        for unit in ("steps", "samples"):
            counts = [run[metrics][f"{split}_{unit}_per_second"] * run[metrics][f"{split}_runtime"]
                      for run in (got, reference)]
            assert counts[0] == pytest.approx(counts[1], rel=1e-2), (split, unit)


@pytest.mark.parametrize("mode", MODES)
def test_evaluate_and_predict_under_cp2_are_those_of_one_process(runs, mode):
    one, ranks = runs
    reference = one[MODES[mode][1]]
    assert 0 < reference["metrics"]["eval_masked_accuracy"] < 1  # a measure that can differ
    assert reference["predictions"].shape == (5, 203, 259)
    for rank in ranks:
        _check_evaluation(rank[mode], reference)


def test_evaluate_and_predict_with_data_parallel_cp_groups_and_cp4_are_those_of_dp2_and_one_process(runs):
    """Four processes: the two CP groups of DP 2 x CP 2 evaluate different batches, every rank of a group holds the
    group's gathered predictions, and the gather over the four processes keeps each group's once, in data-parallel
    order, truncating the short last batch (5 rows, 2 per DP rank) as DP 2 does: what DP 2 without CP gives
    compute_metrics and predict() (its eval losses weigh each rank's rows by the DP ranks' label count, not one
    process's). CP 4 hybrid (Ulysses 2 x ring 2), one replica, gives one process's."""
    from hf_sparse_cp.testing.spawn import run_gloo

    one, two = runs
    references = {**one, **two[0]}
    assert not np.array_equal(two[0]["DP 2"]["evaluated"]["losses"], one["padded"]["evaluated"]["losses"])
    for rank in run_gloo(_evaluate, 4, timeout_s=300):
        for name, (_, _, reference) in FOUR.items():
            _check_evaluation(rank[name], references[reference])
