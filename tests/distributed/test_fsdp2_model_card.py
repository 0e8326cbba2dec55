"""The model card and the saved config under FSDP2, CP 2 and DP 2, against one process. The Trainer's card infers its
task from the model class's name, which FSDP2's `fully_shard` renames (FSDPLlamaForCausalLM): the card of a run
under FSDP2 had no task and, with it, dropped the model-index results (task, dataset, metrics) one process's card
holds. The plugin's card writer gives it the task of the class FSDP2 derived from (`compat.card_tasks`). The saved
config.json names the architecture as one process's does (transformers strips FSDP2's prefix itself)."""

import json
import os
import tempfile

import pytest
import torch
import yaml
from test_fsdp2_label_smoothing import _collate, _rows


def _card(rank: int, world: int, runs: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    rows, results = _rows(), {}
    for name, cp in runs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97))
        fsdp = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2}} if world > 1 else {}
        with tempfile.TemporaryDirectory() as tmp:
            args = SparseTrainingArguments(
                output_dir=tmp, report_to="none", use_cpu=True, max_steps=1, learning_rate=0.1, optim="sgd",
                per_device_train_batch_size=2 * cp // world, per_device_eval_batch_size=2, save_strategy="no",
                cp_size=cp, sparse_block_size=16, sparse_min_seq_len=64, sparse_vertical_topk=2, sparse_slash_topk=2,
                sparse_local_window=16, sparse_sink_tokens=4, **fsdp)
            trainer = SparseTrainer(model=model, args=args, train_dataset=rows[:4], eval_dataset=rows[4:],
                                    data_collator=_collate, compute_metrics=lambda _: {"accuracy": 0.5})
            trainer.train()
            trainer.evaluate()
            trainer.save_model()
            trainer.create_model_card(dataset_tags="wikitext", dataset="wikitext")
            if rank == 0:
                card = open(os.path.join(tmp, "README.md"), encoding="utf-8").read()
                with open(os.path.join(tmp, "config.json"), encoding="utf-8") as f:
                    architectures = json.load(f)["architectures"]
                results[name] = {"class": type(trainer.model).__name__, "architectures": architectures,
                                 "results": yaml.safe_load(card.split("---\n")[1])["model-index"][0]["results"]}
    return results


@pytest.fixture(scope="module")
def cards():
    from hf_sparse_cp.testing.spawn import run_gloo

    return (run_gloo(_card, 1, {"one": 1}, timeout_s=300)[0],
            run_gloo(_card, 2, {"FSDP2 CP 2": 2, "FSDP2 DP 2": 1}, timeout_s=600)[0])


@pytest.mark.parametrize("run", ["FSDP2 CP 2", "FSDP2 DP 2"])
def test_model_card_and_config_under_fsdp2_equal_one_process(cards, run):
    one, ranks = cards
    want, got = one["one"], ranks[run]
    assert got["class"] == "FSDPLlamaForCausalLM"  # (the rename the card must look past)
    assert want["results"][0]["task"] == {"name": "Causal Language Modeling", "type": "text-generation"}
    assert got["results"] == want["results"]
    assert got["architectures"] == want["architectures"] == ["LlamaForCausalLM"]
