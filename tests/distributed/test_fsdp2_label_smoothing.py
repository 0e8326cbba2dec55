"""Label smoothing (`--label_smoothing_factor`) under FSDP2, CP 2 and DP 2: the Trainer shifts a causal LM's labels
for its smoother when the model class's name is one of transformers' causal LMs, and FSDP2's `fully_shard` renames the
class (FSDPLlamaForCausalLM), so the smoother scored each position's logits against its own token: here eval_loss
3.13 before training where one process has 4.64, under CP 2 and DP 2 alike. The plugin's smoothers read the class
FSDP2 derived from (`compat.smoother_shifts_labels`)."""

import os
import tempfile

import pytest
import torch

from oracle import rel_rms


def _rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(6):
        ids = torch.randint(3, 97, (96 + 16 * i,), generator=g)
        labels = ids.clone()
        labels[: 7 * i + 3] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _collate(rows: list[dict]) -> dict:
    n = max(len(r["input_ids"]) for r in rows)

    def padded(t, value):
        return torch.nn.functional.pad(t, (0, n - len(t)), value=value)

    return {"input_ids": torch.stack([padded(r["input_ids"], 0) for r in rows]),
            "labels": torch.stack([padded(r["labels"], -100) for r in rows]),
            "attention_mask": torch.stack([padded(torch.ones_like(r["input_ids"]), 0) for r in rows])}


def _train(rank: int, world: int, runs: dict) -> dict:
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
            # each step trains rows 0-1, then 2-3: one process and CP 2 two rows a step, DP 2 one row a rank
            args = SparseTrainingArguments(
                output_dir=tmp, report_to="none", use_cpu=True, max_steps=2, learning_rate=0.1, optim="sgd",
                per_device_train_batch_size=2 * cp // world, per_device_eval_batch_size=2, logging_steps=1,
                save_strategy="no", train_sampling_strategy="sequential", label_smoothing_factor=0.1,
                eval_strategy="steps", eval_steps=2, eval_on_start=True, cp_size=cp, sparse_block_size=16,
                sparse_min_seq_len=64, sparse_vertical_topk=2, sparse_slash_topk=2, sparse_local_window=16,
                sparse_sink_tokens=4, **fsdp)
            trainer = SparseTrainer(model=model, args=args, train_dataset=rows[:4], eval_dataset=rows[4:],
                                    data_collator=_collate)
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
    from hf_sparse_cp.testing.spawn import run_gloo

    return (run_gloo(_train, 1, {"one": 1}, timeout_s=300)[0],
            run_gloo(_train, 2, {"FSDP2 CP 2": 2, "FSDP2 DP 2": 1}, timeout_s=600))


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
