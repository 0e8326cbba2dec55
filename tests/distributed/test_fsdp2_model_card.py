"""The model card and the saved config under FSDP2, CP 2 and DP 2, against one process. The Trainer's card infers its
task from the model class's name, which FSDP2's `fully_shard` renames (FSDPLlamaForCausalLM): the card of a run
under FSDP2 had no task and, with it, dropped the model-index results (task, dataset, metrics) one process's card
holds. The plugin's card writer gives it the task of the class FSDP2 derived from (`fsdp_class_names.card_tasks`).
The saved config.json names the architecture as one process's does (transformers strips FSDP2's prefix itself)."""

import json
import os

import pytest
import yaml
from fsdp2_runs import fsdp2_trainer, one_process_and_fsdp2


def _card(rank: int, world: int, runs: dict) -> dict:
    results = {}
    for name, cp in runs.items():
        with fsdp2_trainer(rank, world, cp, max_steps=1) as trainer:
            trainer.compute_metrics = lambda _: {"accuracy": 0.5}
            trainer.train()
            trainer.evaluate()
            trainer.save_model()
            trainer.create_model_card(dataset_tags="wikitext", dataset="wikitext")
            if rank == 0:
                tmp = trainer.args.output_dir
                card = open(os.path.join(tmp, "README.md"), encoding="utf-8").read()
                with open(os.path.join(tmp, "config.json"), encoding="utf-8") as f:
                    architectures = json.load(f)["architectures"]
                results[name] = {"class": type(trainer.model).__name__, "architectures": architectures,
                                 "results": yaml.safe_load(card.split("---\n")[1])["model-index"][0]["results"]}
    return results


@pytest.fixture(scope="module")
def cards():
    one, ranks = one_process_and_fsdp2(_card)
    return one, ranks[0]


@pytest.mark.parametrize("run", ["FSDP2 CP 2", "FSDP2 DP 2"])
def test_model_card_and_config_under_fsdp2_equal_one_process(cards, run):
    one, ranks = cards
    want, got = one["one"], ranks[run]
    assert got["class"] == "FSDPLlamaForCausalLM"  # (the rename the card must look past)
    assert want["results"][0]["task"] == {"name": "Causal Language Modeling", "type": "text-generation"}
    assert got["results"] == want["results"]
    assert got["architectures"] == want["architectures"] == ["LlamaForCausalLM"]
