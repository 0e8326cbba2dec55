"""`save_model` under FSDP2 with a sharded `fsdp_config.state_dict_type`: the Trainer saves a model under FSDP only
with FULL_STATE_DICT, so a run that shards its checkpoints ended with an output folder holding no model (a card that
said to load it); the plugin writes the whole model. Its weights after one step equal one process's, CP 2 and DP 2."""

import pytest
import torch
from fsdp2_runs import fsdp2_trainer, one_process_and_fsdp2


def _saved(rank: int, world: int, runs: dict) -> dict:
    from transformers import AutoModelForCausalLM

    results = {}
    for name, cp in runs.items():
        with fsdp2_trainer(rank, world, cp, {"state_dict_type": "SHARDED_STATE_DICT"}, max_steps=1) as trainer:
            trainer.train()
            trainer.save_model()
            if rank == 0:
                assert world == 1 or "SHARDED" in str(trainer.accelerator.state.fsdp_plugin.state_dict_type)
                saved = AutoModelForCausalLM.from_pretrained(trainer.args.output_dir)
                results[name] = {k: v.clone() for k, v in saved.state_dict().items()}
    return results


@pytest.fixture(scope="module")
def saved():
    one, ranks = one_process_and_fsdp2(_saved)
    return one, ranks[0]


@pytest.mark.parametrize("run", ["FSDP2 CP 2", "FSDP2 DP 2"])
def test_a_sharded_state_dict_run_saves_the_whole_trained_model(saved, run):
    one, ranks = saved
    want, got = one["one"], ranks[run]
    assert got.keys() == want.keys()
    for key, value in want.items():
        torch.testing.assert_close(got[key], value, rtol=1e-5, atol=1e-6, msg=key)
