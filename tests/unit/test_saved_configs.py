"""Configs saved by earlier versions load as they ran: every commit that changed what `SparseAttentionConfig`
saves wrote the fixtures in tests/fixtures/saved_configs/ with its own code (`generate.py` there): what it
saved (`to_dict()`, and a `save()`d YAML file) and the config each layer ran with (`for_layer`). Loaded today,
each layer selects with the same budget mode and values, scores with the same queries and keeps the same
shared settings; a saved model's config.json runs the same attention."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention.estimate import estimate_layout
from hf_sparse_cp.config import MODEL_CONFIG_ATTRIBUTE
from hf_sparse_cp.config.flat_keys import BEFORE_ADDED
from hf_sparse_cp.examples.tiny_model import tiny_config

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "saved_configs"
SAVED = {path.stem: json.loads(path.read_text())["configs"] for path in sorted(FIXTURES.glob("*.json"))}
CASES = [(commit, name) for commit, configs in SAVED.items() for name, entry in configs.items() if "saved" in entry]
# What a field that a version did not have ran as: the settings added later, at their behaviour before.
RAN_WITHOUT = {"estimation": "last_queries", "estimation_chunk": 1024, "attention_engine": "auto", "sample_groups": 0,
               "sample_group_size": 16, "mass_near_blocks": 0, **BEFORE_ADDED}
SHARED = ("pattern", "sink_tokens", "local_window", "estimation", "block_size", "min_seq_len", "attention_engine")


def _ran(old: dict, new: SparseAttentionConfig) -> tuple[dict, dict]:
    """(what the old layer config ran, what the new one runs): the shared settings, the budget mode and the
    fields it reads, the scoring queries."""
    budget = new.budget
    keys = [*SHARED, *(["estimation_chunk"] if new.estimation == "causal_chunks" else []),
            *(f.name for f in dataclasses.fields(budget)), "last_q", "sample_groups", "sample_group_size"]
    values = {**dataclasses.asdict(new.scoring), **dataclasses.asdict(budget),
              **{name: getattr(new, name) for name in SHARED + ("estimation_chunk",)}}
    was = {name: old[name] if name in old else RAN_WITHOUT[name] for name in keys}
    return {**was, "mode": old["budget_mode"]}, {**{name: values[name] for name in keys}, "mode": budget.mode}


def test_the_fixtures_cover_every_saved_schema():
    assert len(SAVED) == 9 and len(CASES) >= 40
    assert len({tuple(sorted(c["topk"]["saved"])) for c in SAVED.values()}) >= 6  # the saved fields differ


@pytest.mark.parametrize("commit, name", CASES, ids=lambda x: x)
def test_a_saved_config_loads_as_it_ran(commit, name):
    entry = SAVED[commit][name]
    config = SparseAttentionConfig.from_dict(entry["saved"])
    for layer, old in enumerate(entry["layers_ran_as"]):
        was, now = _ran(old, config.for_layer(layer))
        assert now == was, (layer, {k: (was[k], now[k]) for k in was if was[k] != now[k]})
    assert SparseAttentionConfig.from_dict(config.to_dict()) == config  # and saves today's way


@pytest.mark.parametrize("commit", sorted(SAVED))
def test_a_saved_config_file_loads_as_the_config_it_was_saved_from(commit):
    assert SparseAttentionConfig.from_file(FIXTURES / f"{commit}_topk.yaml") == SparseAttentionConfig.from_dict(
        SAVED[commit]["topk"]["saved"])


def test_a_model_saved_with_an_earlier_config_runs_as_it_ran(tmp_path, single_thread):
    """config.json of a model saved before the tree (flat keys, every field) selects the same pattern as
    the config built today from the same values."""
    hf_sparse_cp.patch()
    saved = SAVED["1a4f583"]["topk"]["saved"]
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", num_hidden_layers=4),
                                             attn_implementation="sparse_cp").eval()
    setattr(model.config, MODEL_CONFIG_ATTRIBUTE, saved)
    model.save_pretrained(tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path, attn_implementation="sparse_cp").eval()
    assert getattr(loaded.config, MODEL_CONFIG_ATTRIBUTE) == saved  # (as saved: flat)
    ids = torch.randint(3, 259, (1, 4096), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        old = loaded(ids).logits
        hf_sparse_cp.configure(loaded, SparseAttentionConfig(**{k: v for k, v in saved.items()
                                                                 if k not in ("vertical_topp", "slash_topp",
                                                                              "vertical_cap", "slash_cap")}))
        new = loaded(ids).logits
    assert torch.equal(old, new)
    # layer 3's pattern is sparse at this length (a saved config that ran dense would prove nothing)
    cfg = SparseAttentionConfig.from_dict(saved).for_layer(3)
    q = torch.randn(1, 4, 4096, 32, generator=torch.Generator().manual_seed(1))
    assert float(estimate_layout(q, q[:, :2], cfg).kept_fraction()) < 0.9
