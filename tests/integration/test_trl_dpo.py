"""TRL's DPOTrainer with the plugin's class (`sparse_trainer_class(DPOTrainer)`)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_sparse_cp.examples.tokenizer import byte_tokenizer
from hf_sparse_cp.testing.tiny_models import tiny_config

trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")

# (SGD: the update is the gradient's, where Adam's normalization would hide a wrong scale and amplify the rounding of
# near-zero gradients)
DPO = dict(max_length=256, max_steps=2, per_device_train_batch_size=2, optim="sgd", learning_rate=0.05, logging_steps=1,
           report_to="none", save_strategy="no", bf16=False, gradient_checkpointing=False, seed=0, data_seed=0,
           dataset_num_proc=None, beta=0.5)
# a pattern sparse at these lengths: rows of 64 tokens or more get vertical-slash attention
PATTERN = dict(sparse_block_size=32, sparse_min_seq_len=64, sparse_vertical_topk=8, sparse_slash_topk=8,
               sparse_local_window=32, sparse_sink_tokens=4, sparse_last_q=16)


def _words(n: int, seed: int, low: int, high: int) -> list[str]:
    g = torch.Generator().manual_seed(seed)
    words = ["sparse", "attention", "ring", "packed", "document", "token", "block", "query", "key", "value"]
    return [" ".join(words[i] for i in torch.randint(0, len(words), (k,), generator=g).tolist())
            for k in torch.randint(low, high, (n,), generator=g).tolist()]


def _pairs(n: int = 8) -> dict[str, list[str]]:
    """Prompts of 60 to 170 bytes, completions of different lengths: rows of about 100 to 250 tokens."""
    return {"prompt": _words(n, 0, 10, 25), "chosen": _words(n, 1, 2, 12), "rejected": _words(n, 2, 2, 12)}


def test_the_switched_dpo_trainer_takes_its_arguments_and_reference_by_name(tmp_path):
    """DPOTrainer's second parameter is `ref_model`: the plugin's class handed it the arguments there (a TypeError
    beside ref_model=...; without one, the arguments became the reference model)."""
    from trl import DPOConfig, DPOTrainer

    from hf_sparse_cp import sparse_arguments_class, sparse_trainer_class

    tokenizer = byte_tokenizer()
    AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=len(tokenizer))).save_pretrained(tmp_path / "m")
    args = sparse_arguments_class(DPOConfig)(output_dir=str(tmp_path), **DPO, **PATTERN)
    data = datasets.Dataset.from_dict(_pairs(2))
    ref_model = AutoModelForCausalLM.from_pretrained(tmp_path / "m")
    for reference in ({"ref_model": ref_model}, {}):  # (without one, TRL loads it from the model's folder)
        trainer = sparse_trainer_class(DPOTrainer)(model=str(tmp_path / "m"), args=args, train_dataset=data,
                                                   processing_class=tokenizer, **reference)
        assert trainer.args is args and trainer.beta == DPO["beta"]
        assert isinstance(trainer.ref_model, type(ref_model)) and (not reference or trainer.ref_model is ref_model)
