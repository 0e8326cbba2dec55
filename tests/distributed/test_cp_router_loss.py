"""A MoE model's router load-balancing loss (`output_router_logits`) under CP 2 with the stock Trainer equals one
process, for each architecture whose loss CP gathers (`ROUTER_LOSS_MODEL_TYPES`): the logged losses and the weights
after 2 SGD steps, with `--average_tokens_across_devices` (the model's loss, which holds coef x the router loss,
multiplied by the processes) and without it, on right-padded rows (the router loss reads the attention mask), and
`evaluate()`'s eval_loss. A large coefficient (0.5) makes the term count. Before, each rank computed it from its own
shard: step-1 loss 7.6207 against 6.6157 (Mixtral)."""

import os
import tempfile

import pytest
import torch

from hf_sparse_cp.integration.architectures import ROUTER_LOSS_MODEL_TYPES

# name -> (model type, average_tokens_across_devices): every architecture of ROUTER_LOSS_MODEL_TYPES
RUNS = {"mixtral": ("mixtral", True), "mixtral, own token counts": ("mixtral", False),
        **{model_type: (model_type, True) for model_type in ROUTER_LOSS_MODEL_TYPES if model_type != "mixtral"}}


def _rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, n in enumerate([160, 150, 130, 160]):
        ids = torch.randint(3, 259, (n,), generator=g)
        labels = ids.clone()
        labels[: 13 * i + 5] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _collate(rows: list[dict]) -> dict:
    n = max(len(r["input_ids"]) for r in rows)
    out = {key: torch.stack([torch.nn.functional.pad(r[key], (0, n - len(r[key])), value=pad) for r in rows])
           for key, pad in (("input_ids", 0), ("labels", -100))}
    out["attention_mask"] = torch.stack([(torch.arange(n) < len(r["input_ids"])).long() for r in rows])
    return out


def _train(rank: int, world: int) -> dict:
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, attach_to_trainer
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.testing.tiny_models import tiny_config

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    hf_sparse_cp.patch()
    results = {}
    for name, (model_type, average) in RUNS.items():
        if world == 1 and not average:
            continue  # (one process: the same run)
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(model_type, output_router_logits=True,
                                                             router_aux_loss_coef=0.5))
        hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=64, vertical_topk=2,
                                                            slash_topk=2, local_window=16, sink_tokens=4, last_q=16))
        with tempfile.TemporaryDirectory() as tmp:
            args = TrainingArguments(output_dir=tmp, report_to="none", use_cpu=True, save_strategy="no",
                                     per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=2,
                                     optim="sgd", learning_rate=0.5, lr_scheduler_type="constant", logging_steps=1,
                                     average_tokens_across_devices=average)
            trainer = Trainer(model=model, args=args, train_dataset=_rows(), eval_dataset=_rows(),
                              data_collator=_collate)
            attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True),
                              ContextParallelConfig(cp_size=world) if world > 1 else None)
            trainer.train()
            eval_loss = trainer.evaluate()["eval_loss"]
        results[name] = {"loss": [log["loss"] for log in trainer.state.log_history if "loss" in log],
                         "eval_loss": eval_loss,
                         "weights": {n: p.detach().clone() for n, p in trainer.model.named_parameters()}}
    return results


@pytest.fixture(scope="module")
def runs():
    from hf_sparse_cp.testing.spawn import run_gloo

    return run_gloo(_train, 1, timeout_s=300)[0], run_gloo(_train, 2, timeout_s=400)


@pytest.mark.parametrize("name", list(RUNS))
def test_the_router_loss_under_cp2_trains_as_one_process(runs, name):
    one, ranks = runs
    reference = one[RUNS[name][0]]
    for rank in ranks:
        got = rank[name]
        assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert got["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
        for key, weight in reference["weights"].items():
            torch.testing.assert_close(got["weights"][key], weight, rtol=1e-5, atol=1e-6, msg=key)
