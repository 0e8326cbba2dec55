"""`save_model` under FSDP2 with a sharded `fsdp_config.state_dict_type`: the Trainer saves a model under FSDP only
with FULL_STATE_DICT, so a run that shards its checkpoints ended with an output folder holding no model (a card that
said to load it); the plugin writes the whole model. Its weights after one step equal one process's, CP 2 and DP 2."""

import os
import tempfile

import pytest
import torch
from test_fsdp2_label_smoothing import _collate, _rows


def _saved(rank: int, world: int, runs: dict) -> dict:
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    rows, results = _rows(), {}
    for name, cp in runs.items():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=97))
        fsdp = {"fsdp": "full_shard", "fsdp_config": {"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"}}
        with tempfile.TemporaryDirectory() as tmp:
            args = SparseTrainingArguments(
                output_dir=tmp, report_to="none", use_cpu=True, max_steps=1, learning_rate=0.1, optim="sgd",
                per_device_train_batch_size=2 * cp // world, save_strategy="no", cp_size=cp, sparse_block_size=16,
                sparse_min_seq_len=64, sparse_vertical_topk=2, sparse_slash_topk=2, sparse_local_window=16,
                sparse_sink_tokens=4, **(fsdp if world > 1 else {}))
            trainer = SparseTrainer(model=model, args=args, train_dataset=rows[:4], data_collator=_collate)
            trainer.train()
            trainer.save_model()
            if rank == 0:
                assert world == 1 or "SHARDED" in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)
                saved = AutoModelForCausalLM.from_pretrained(tmp)
                results[name] = {k: v.clone() for k, v in saved.state_dict().items()}
    return results


@pytest.fixture(scope="module")
def saved():
    from hf_sparse_cp.testing.spawn import run_gloo

    return (run_gloo(_saved, 1, {"one": 1}, timeout_s=300)[0],
            run_gloo(_saved, 2, {"FSDP2 CP 2": 2, "FSDP2 DP 2": 1}, timeout_s=600)[0])


@pytest.mark.parametrize("run", ["FSDP2 CP 2", "FSDP2 DP 2"])
def test_a_sharded_state_dict_run_saves_the_whole_trained_model(saved, run):
    one, ranks = saved
    want, got = one["one"], ranks[run]
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
