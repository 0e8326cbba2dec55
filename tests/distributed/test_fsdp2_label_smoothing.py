"""Label smoothing (`--label_smoothing_factor`) under FSDP2, CP 2 and DP 2: the Trainer shifts a causal LM's labels
for its smoother when the model class's name is one of transformers' causal LMs, and FSDP2's `fully_shard` renames the
class (FSDPLlamaForCausalLM), so the smoother scored each position's logits against its own token: here eval_loss
3.13 before training where one process has 4.64, under CP 2 and DP 2 alike. The plugin's smoothers read the class
FSDP2 derived from (`fsdp_class_names.smoother_shifts_labels`)."""

import pytest
import torch
from fsdp2_runs import fsdp2_trainer, one_process_and_fsdp2

from oracle import rel_rms


def _train(rank: int, world: int, runs: dict) -> dict:
    results = {}
    for name, cp in runs.items():
        # each step trains rows 0-1, then 2-3: one process and CP 2 two rows a step, DP 2 one row a rank
        with fsdp2_trainer(rank, world, cp, max_steps=2, logging_steps=1, train_sampling_strategy="sequential",
                           label_smoothing_factor=0.1, eval_strategy="steps", eval_steps=2,
                           eval_on_start=True) as trainer:
            trainer.train()
            weights = torch.cat([getattr(p, "full_tensor", lambda p=p: p)().detach().flatten()
                                 for p in trainer.model.parameters()])
        history = trainer.state.log_history
        results[name] = {"loss": [log["loss"] for log in history if "loss" in log],
                         "grad_norm": [log["grad_norm"] for log in history if "loss" in log],
                         "eval_loss": [log["eval_loss"] for log in history if "eval_loss" in log], "weights": weights}
    return results


@pytest.fixture(scope="module")
def runs():
    return one_process_and_fsdp2(_train)


@pytest.mark.parametrize("run", ["FSDP2 CP 2", "FSDP2 DP 2"])
def test_label_smoothing_under_fsdp2_equals_one_process(runs, run):
    one, ranks = runs
    want = one["one"]
    assert len(want["eval_loss"]) == 2 and len(want["loss"]) == 2
    for rank in ranks:
        got = rank[run]
        for key in ("eval_loss", "loss", "grad_norm"):
            assert got[key] == pytest.approx(want[key], rel=1e-5), key
        assert rel_rms(got["weights"], want["weights"]) < 1e-5
