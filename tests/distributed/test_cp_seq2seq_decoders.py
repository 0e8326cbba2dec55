"""The decoder of an encoder-decoder family trained as a causal LM (BartForCausalLM) under the Trainer with CP 2:
zigzag and ulysses log one process's losses. Its forward computes its own loss of unshifted labels, which CP refuses
(`context_parallel.check_loss`); with label smoothing the Trainer smooths the logits, shifted, which CP computes
exactly. The model's layers and positions under every layout: test_cp_models.py."""

import functools
import os
import tempfile

import pytest
import torch

from hf_sparse_cp.testing.spawn import run_gloo


def _rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "labels": ids.clone()}
            for ids in (torch.randint(3, 97, (n,), generator=g) for n in (203, 150, 203, 170))]


def _collate(rows: list[dict]) -> dict:
    """Right-pads the batch to its longest row (attention_mask, labels -100)."""
    n = max(len(r["input_ids"]) for r in rows)
    pad = torch.nn.functional.pad
    return {"input_ids": torch.stack([pad(r["input_ids"], (0, n - len(r["input_ids"]))) for r in rows]),
            "labels": torch.stack([pad(r["labels"], (0, n - len(r["labels"])), value=-100) for r in rows]),
            "attention_mask": torch.stack([(torch.arange(n) < len(r["input_ids"])).long() for r in rows])}


def _train(rank: int, world: int, flags: dict) -> list[float]:
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, attach_to_trainer
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    torch.manual_seed(0)
    config = tiny_config("bart", vocab_size=97, max_position_embeddings=512, dropout=0.0)  # (dropout: per rank)
    model = AutoModelForCausalLM.from_config(config).double()
    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=64, vertical_topk=2, slash_topk=2,
                                                        local_window=16, sink_tokens=4, last_q=16))
    losses = []

    class Losses(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, per_device_train_batch_size=2,
                                 max_steps=3, logging_steps=1, save_strategy="no", learning_rate=1e-3,
                                 label_smoothing_factor=0.1)
        trainer = Trainer(model=model, args=args, train_dataset=_rows(), data_collator=_collate, callbacks=[Losses()])
        attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True), ContextParallelConfig(**flags))
        trainer.train()
    return losses


@functools.cache
def _one_process() -> list[float]:
    return run_gloo(_train, 1, {}, timeout_s=600)[0]


@pytest.mark.parametrize("flags", [{"cp_size": 2, "cp_sharding": "zigzag"}, {"cp_size": 2, "cp_mode": "ulysses"}],
                         ids=["zigzag", "ulysses"])
def test_a_bart_decoder_trains_under_cp2_as_one_process(flags):
    """BartForCausalLM was refused under CP ('bidirectional attention layers (model.decoder.layers.0.encoder_attn,
    ...)'); its learned positions (offset 2) count from its input's length, which a hook moves to the row's."""
    one = _one_process()
    for losses in run_gloo(_train, 2, flags, timeout_s=600):
        assert losses == pytest.approx(one, rel=1e-6) and len(losses) == 3
