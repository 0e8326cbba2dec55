"""A MoE model's router load-balancing loss (`output_router_logits`) under CP 2 with the stock Trainer equals one
process, for the architectures whose `load_balancing_loss_func` CP gathers (found by its signature,
`architectures.router_loss_modules`): the five first gathered from a hand list, and a sample of those the discovery
added (JetMoE, GraniteMoE, GraniteMoE-Shared, ERNIE-4.5-MoE, FlexOlmo, MiniMax-M2): the logged losses and the weights
after 2 SGD steps, with `--average_tokens_across_devices` (the model's loss, which holds coef x the router loss,
multiplied by the processes) and without it, on right-padded rows (the router loss reads the attention mask), and
`evaluate()`'s eval_loss. A large coefficient (0.5) makes the term count. Before, each rank computed it from its own
shard: step-1 loss 7.6207 against 6.6157 (Mixtral); outside the hand list, 7.6210 against 6.6165 (GraniteMoE), 5.6032
against 5.5832 (JetMoE)."""

import os
import tempfile

import pytest
import torch
from padding import pad_collate

# name -> (model type, average_tokens_across_devices)
RUNS = {"mixtral": ("mixtral", True), "mixtral, own token counts": ("mixtral", False),
        **{model_type: (model_type, True) for model_type in (
            "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "jetmoe", "granitemoe", "granitemoeshared", "ernie4_5_moe",
            "flex_olmo", "minimax_m2")}}
# The transformers release from which a model type records its router logits: 5.17's GraniteMoE(-Shared) records none
# (no recorder of them), so its own forward with output_router_logits fails ('int' object has no attribute 'to'), with
# or without the plugin. Before it the type's case is skipped, saying so.
ROUTER_LOGITS_SINCE = {"granitemoe": (5, 18), "granitemoeshared": (5, 18)}


def _records_router_logits(model_type: str) -> bool:
    from hf_sparse_cp.integration.architectures import transformers_release

    return transformers_release() >= ROUTER_LOGITS_SINCE.get(model_type, ())


def _rows() -> list[dict]:
    g = torch.Generator().manual_seed(0)
    rows = []
    for i, n in enumerate([160, 150, 130, 160]):
        ids = torch.randint(3, 259, (n,), generator=g)
        labels = ids.clone()
        labels[: 13 * i + 5] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


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
        if (world == 1 and not average) or not _records_router_logits(model_type):
            continue  # (one process: the same run; a type that records no router logits here)
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
                              data_collator=pad_collate)
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
def test_the_router_loss_under_cp2_trains_as_one_process(request, name):
    if not _records_router_logits(RUNS[name][0]):
        pytest.skip(f"transformers before {ROUTER_LOGITS_SINCE[RUNS[name][0]]} records no router logits of {name}")
    one, ranks = request.getfixturevalue("runs")
    reference = one[RUNS[name][0]]
    for rank in ranks:
        got = rank[name]
        assert got["loss"] == pytest.approx(reference["loss"], rel=1e-5)
        assert got["eval_loss"] == pytest.approx(reference["eval_loss"], rel=1e-5)
        for key, weight in reference["weights"].items():
            torch.testing.assert_close(got["weights"][key], weight, rtol=1e-5, atol=1e-6, msg=key)


def _router_loss_collectives(rank: int, world: int) -> dict:
    """The CP router loss of three layers' logits of 2 rows of 203 tokens (the second right-padded under the striped
    split; three documents, shards of unequal lengths, under the document plan), with its gradient: the collectives it
    ran, and the per-layer gathers' value and gradient beside it."""
    import transformers.models.mixtral.modeling_mixtral as mixtral

    from hf_sparse_cp.distributed import ContextParallelConfig, ParallelDims, prepare_context_parallel_inputs
    from hf_sparse_cp.distributed import shard as shard_module
    from hf_sparse_cp.integration.call_context import guard_context_parallel
    from hf_sparse_cp.trainer.router_loss import _over_cp_group

    rows, length, experts = 2, 203, 4
    g = torch.Generator().manual_seed(0)
    layers = [torch.randn(rows, length, experts, generator=g) for _ in range(3)]
    ids = torch.randint(5, 100, (rows, length), generator=g)
    mask = (torch.arange(length) < torch.tensor([[length], [150]])).long()
    documents = torch.cat([torch.arange(30), torch.arange(30), torch.arange(length - 60)]).expand(rows, -1)
    inputs = {"striped": {"input_ids": ids, "attention_mask": mask},
              "document": {"input_ids": ids, "position_ids": documents}}
    loss_func = _over_cp_group(mixtral.load_balancing_loss_func)

    class Routed(torch.nn.Module):  # a CP forward (the shard in its keywords), in which the wrapper gathers
        def forward(self, logits, cp_shard=None):
            return loss_func(logits, experts, 2, None)

    routed = Routed()
    guard_context_parallel(routed)
    calls = []
    for name in ("all_gather_rows", "all_reduce"):
        collective = getattr(shard_module, name)
        setattr(shard_module, name, lambda *a, _name=name, _c=collective, **k: (calls.append(_name), _c(*a, **k))[1])
    out = {}
    for sharding, batch in inputs.items():
        parallel = ParallelDims.from_config(ContextParallelConfig(cp_size=world, cp_sharding=sharding))
        shard = prepare_context_parallel_inputs(batch, parallel, block_size=16)["cp_shard"]
        mine = [shard.plan.shard(x, shard.rank).requires_grad_() for x in layers]
        calls.clear()
        loss = routed(tuple(x.flatten(0, 1) for x in mine), cp_shard=shard)
        loss.backward()
        got = {"calls": list(calls), "loss": loss.detach(), "grads": [x.grad for x in mine],
               "lengths": [shard.plan.local_len_of(r) for r in range(world)]}
        for x in mine:
            x.grad = None
        # each layer gathered on its own, as before
        each = tuple(shard.whole_sequence(x).flatten(0, 1) for x in mine)
        loss = mixtral.load_balancing_loss_func(each, experts, 2, shard.attention_mask)
        loss.backward()
        out[sharding] = {"got": got, "each": {"loss": loss.detach(), "grads": [x.grad for x in mine]},
                         "one": float(mixtral.load_balancing_loss_func(
                             tuple(x.flatten(0, 1) for x in layers), experts, 2, batch.get("attention_mask")))}
    return out


def test_the_router_loss_gathers_every_layer_in_one_collective():
    """The CP router loss gathers all the MoE layers' router logits in one all-gather (its backward in one
    all-reduce), not one per layer, under even and uneven shards: its value and gradient are bitwise those of the
    per-layer gathers, and the value one process's."""
    from hf_sparse_cp.testing.spawn import run_gloo

    for rank in run_gloo(_router_loss_collectives, 2, timeout_s=120):
        assert len(set(rank["document"]["got"]["lengths"])) > 1  # (the document plan's shards are unequal)
        for sharding, run in rank.items():
            assert run["got"]["calls"] == ["all_gather_rows", "all_reduce"], (sharding, run["got"]["calls"])
            assert torch.equal(run["got"]["loss"], run["each"]["loss"]), sharding
            assert run["got"]["loss"].item() == pytest.approx(run["one"], rel=1e-6), sharding
            for got, want in zip(run["got"]["grads"], run["each"]["grads"], strict=True):
                assert got is not None and got.abs().sum() > 0 and torch.equal(got, want), sharding
