"""Text generation in and around a Trainer run under CP 2 (ring), against one process (float64, greedy decoding):
transformers' Seq2SeqTrainer with a decoder-only model and `predict_with_generate` (evaluate() and predict(): the
generated tokens, labels and metrics), a callback generating on the main process alone at each step's end (training
goes on as one process's, without a hang), and the model's `generate` after `train()`, with and without a cache, on a
prompt longer than the pattern's `min_seq_len` (its prefill sparse) and a short one."""

import os
import tempfile

import numpy as np
import pytest
import torch

from hf_sparse_cp.testing.spawn import run_gloo

LENGTHS = (203, 150, 203, 170)


def _rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids.clone()} for ids in (torch.randint(3, 97, (n,), generator=g)
                                                                  for n in LENGTHS)]


def _collate(rows: list[dict]) -> dict:
    """Left-pads the batch to its longest row (attention_mask, labels -100), as generation takes it."""
    n = max(len(r["input_ids"]) for r in rows)
    pad = torch.nn.functional.pad
    return {"input_ids": torch.stack([pad(r["input_ids"], (n - len(r["input_ids"]), 0)) for r in rows]),
            "labels": torch.stack([pad(r["labels"], (n - len(r["labels"]), 0), value=-100) for r in rows]),
            "attention_mask": torch.stack([(torch.arange(n) >= n - len(r["input_ids"])).long() for r in rows])}


def _run(rank: int, world: int) -> dict:
    """2 SGD steps of Seq2SeqTrainer (a callback generating on the main process at each step's end), then its
    predict() and evaluate() with generation, and the model's own generate."""
    from transformers import AutoModelForCausalLM, Seq2SeqTrainer, Seq2SeqTrainingArguments, TrainerCallback

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, attach_to_trainer
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", vocab_size=97)).double()
    model.generation_config.pad_token_id = 0
    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=64, vertical_topk=2, slash_topk=2,
                                                        local_window=16, sink_tokens=4, last_q=16))
    long, short = _rows()[0]["input_ids"][None, :120], _rows()[1]["input_ids"][None, :20]
    seen = {"callback": [], "metrics": []}

    class Generating(TrainerCallback):
        def on_step_end(self, args, state, control, model=None, **kwargs):
            if state.is_world_process_zero:
                model.eval()
                with torch.no_grad():
                    seen["callback"].append(model.generate(long, max_new_tokens=4, do_sample=False))
                model.train()

    def metrics(prediction):
        seen["metrics"].append((prediction.predictions.shape, prediction.label_ids.shape))
        return {"rows": float(len(prediction.predictions))}

    with tempfile.TemporaryDirectory() as tmp:
        args = Seq2SeqTrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, per_device_train_batch_size=2,
                                        per_device_eval_batch_size=2, max_steps=2, logging_steps=1, save_strategy="no",
                                        optim="sgd", learning_rate=0.5, train_sampling_strategy="sequential",
                                        predict_with_generate=True)
        trainer = Seq2SeqTrainer(model=model, args=args, train_dataset=_rows(), data_collator=_collate,
                                 compute_metrics=metrics, callbacks=[Generating()])
        attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True), ContextParallelConfig(cp_size=world))
        trainer.train()
        losses = [log["loss"] for log in trainer.state.log_history if "loss" in log]
        predicted = trainer.predict(_rows()[:3], max_new_tokens=5)
        evaluated = trainer.evaluate(_rows()[:3], max_new_tokens=5)
        trainer.args.predict_with_generate = False  # (its gather alike: the logits)
        logits = trainer.predict(_rows()[:3]).predictions
        generated = [model.generate(prompt, max_new_tokens=6, do_sample=False, use_cache=cache)
                     for prompt in (long, short) for cache in (True, False)]
    return {**seen, "losses": losses, "predictions": predicted.predictions, "label_ids": predicted.label_ids,
            "test_rows": predicted.metrics["test_rows"], "eval_rows": evaluated["eval_rows"],
            "eval_loss": evaluated["eval_loss"], "predicted_logits": logits, "generated": generated,
            "logits": model(long).logits}


def test_generation_under_cp2_gives_one_process_tokens():
    """Seq2SeqTrainer's evaluate() and predict() gather with accelerate's `gather`, untruncated: under CP 2 each row
    came back once per rank (predict() on 3 rows: predictions [6, 208] and label_ids [6, 203], compute_metrics saw 6
    rows; without `predict_with_generate` its logits alike: [6, 203, 97]); now each CP group's once, one process's
    tokens and logits."""
    one = run_gloo(_run, 1, timeout_s=300)[0]
    assert one["predictions"].shape == (3, 208) and len(one["callback"]) == 2
    for rank, got in enumerate(run_gloo(_run, 2, timeout_s=300)):
        assert np.array_equal(got["predictions"], one["predictions"])
        assert np.array_equal(got["label_ids"], one["label_ids"])
        assert got["losses"] == pytest.approx(one["losses"], rel=1e-6) and len(got["losses"]) == 2
        assert got["predicted_logits"].shape == one["predicted_logits"].shape == (3, 203, 97)
        assert np.allclose(got["predicted_logits"], one["predicted_logits"], rtol=0, atol=1e-9)
        assert got["metrics"] == one["metrics"] and got["test_rows"] == got["eval_rows"] == 3
        assert abs(got["eval_loss"] - one["eval_loss"]) < 1e-6 * one["eval_loss"]
        assert len(got["callback"]) == (0 if rank else 2)  # (the callback generates on the main process alone)
        assert all(torch.equal(a, b) for a, b in zip(got["callback"], one["callback"]))
        assert all(torch.equal(a, b) for a, b in zip(got["generated"], one["generated"], strict=True))
        assert torch.allclose(got["logits"], one["logits"], rtol=0, atol=1e-12)
