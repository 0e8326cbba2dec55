"""Stock Trainer features under CP 2 (ring, document sharding, ulysses) train as one process does, in float64: gradient
checkpointing (reentrant or not), clipping (the logged grad_norm, here always above --max_grad_norm), batches of 2
rows padded right (grouped by length, accumulated) or left, the input token count, the kept fraction logged, evaluation
during training (metrics batch by batch, or moved off every batch), and a run resumed from its checkpoint, which
continues as the uninterrupted one."""

import os

import pytest
import torch
from padding import pad_collate

from oracle import rel_rms

# each configuration: TrainingArguments fields beyond the common ones
FEATURES = {
    "padded batch 2": {"per_device_train_batch_size": 2, "train_sampling_strategy": "group_by_length",
                       "torch_empty_cache_steps": 1, "include_num_input_tokens_seen": "non_padding",
                       "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": True}},
    # left padding, evaluated before and after training with a token accuracy computed batch by batch
    "left padded": {"per_device_train_batch_size": 2, "padding_side": "left", "eval_strategy": "steps", "eval_steps": 2,
                    "eval_on_start": True, "batch_eval_metrics": True, "gradient_checkpointing": True,
                    "gradient_checkpointing_kwargs": {"use_reentrant": False}},
    # four steps, evaluated (metrics moved off every batch) and saved every two; "resumed" trains steps 3-4 again
    # from the checkpoint of step 2
    "accumulated, evaluated, saved": {
        "max_steps": 4, "per_device_train_batch_size": 2, "gradient_accumulation_steps": 2,
        "include_num_input_tokens_seen": "all", "eval_strategy": "steps", "eval_steps": 2, "eval_accumulation_steps": 1,
        "save_strategy": "steps", "save_steps": 2, "lr_scheduler_type": "linear"},
}
MODES = {"ring": {}, "document": {"cp_sharding": "document"}, "ulysses": {"cp_mode": "ulysses"}}


def _rows(count: int) -> list[dict]:
    """`count` rows of 97 to 203 tokens, each with a different number of targets."""
    g = torch.Generator().manual_seed(0)
    rows = []
    for i in range(count):
        ids = torch.randint(3, 259, (int(torch.randint(97, 204, (), generator=g)),), generator=g)
        labels = ids.clone()
        labels[: 13 * (i % 8) + 5] = -100
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def _accuracy(prediction, compute_result: bool, seen: dict) -> dict:
    """The share of targets whose next token is the argmax (`batch_eval_metrics`: summed over the batches in `seen`)."""
    predicted, labels = torch.as_tensor(prediction.predictions)[:, :-1], torch.as_tensor(prediction.label_ids)[:, 1:]
    seen["right"] = seen.get("right", 0) + int((predicted == labels)[labels != -100].sum())
    seen["all"] = seen.get("all", 0) + int((labels != -100).sum())
    if not compute_result:
        return {}
    right, total = seen.pop("right"), seen.pop("all")
    return {"accuracy": right / total, "targets": total}


def _trained(world: int, cp_flags: dict, features: dict, out: str, resume: str | None = None) -> dict:
    """Train a float64 tiny Llama with `features` under CP `world` (`cp_flags`), resuming from `resume` if given:
    what it logged (a resumed run: its checkpoint's logs first), the steps it trained, its input token count, whether
    it checkpointed and the weights."""
    from transformers import AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    import hf_sparse_cp
    from hf_sparse_cp import SparseAttentionConfig, SparseCPArguments, attach_to_trainer, detach_from_trainer
    from hf_sparse_cp.distributed import ContextParallelConfig
    from hf_sparse_cp.testing.tiny_models import tiny_config

    hf_sparse_cp.patch()
    features = dict(features)
    side = features.pop("padding_side", "right")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama")).double()
    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=16, min_seq_len=64, vertical_topk=2, slash_topk=2,
                                                        local_window=16, sink_tokens=4, last_q=16))
    args = TrainingArguments(**{
        "output_dir": out, "report_to": "none", "use_cpu": True, "max_steps": 2, "learning_rate": 0.5, "optim": "sgd",
        "max_grad_norm": 0.5, "logging_steps": 1, "save_strategy": "no", "train_sampling_strategy": "sequential",
        "per_device_train_batch_size": 1, "per_device_eval_batch_size": 3, "seed": 0, **features})
    rows, seen, trained = _rows(20), {}, []

    class CountSteps(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            trained.append(state.global_step)

    trainer = Trainer(
        model=model, args=args, train_dataset=rows[:16], eval_dataset=rows[16:], callbacks=[CountSteps()],
        data_collator=lambda batch: pad_collate(batch, side),
        compute_metrics=lambda prediction, compute_result=True: _accuracy(prediction, compute_result, seen),
        preprocess_logits_for_metrics=lambda logits, labels: logits.argmax(-1))
    attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True),
                      ContextParallelConfig(cp_size=world, **cp_flags))
    trainer.train(resume_from_checkpoint=resume)
    history = trainer.state.log_history
    result = {"loss": [log["loss"] for log in history if "loss" in log],
              "grad_norm": [log["grad_norm"] for log in history if "loss" in log],
              "kept": [log["sparse/kept_fraction"] for log in history if "loss" in log],
              "eval": [log[key] for log in history if "eval_loss" in log
                       for key in ("eval_loss", "eval_accuracy", "eval_targets")],
              "trained": trained, "tokens": trainer.state.num_input_tokens_seen,
              "checkpointing": model.is_gradient_checkpointing,
              "weights": torch.cat([p.detach().flatten() for p in model.parameters()])}
    detach_from_trainer(trainer)
    return result


def _train(rank: int, world: int, modes: dict, out: str) -> dict:
    """Every configuration of FEATURES under each of `modes` ({name: ContextParallelConfig fields}), and the resume,
    each saving under its folder of `out` (the same on every rank: rank 0 saves, every rank resumes)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    results = {}
    for mode, flags in modes.items():
        for i, (name, features) in enumerate(FEATURES.items()):
            folder = os.path.join(out, f"{mode}{i}")
            results[mode, name] = _trained(world, flags, features, folder)
            if "save_steps" in features:
                results[mode, "resumed"] = _trained(world, flags, features, folder,
                                                    os.path.join(folder, "checkpoint-2"))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    from hf_sparse_cp.testing.spawn import run_gloo

    return (run_gloo(_train, 1, {"one": {}}, str(tmp_path_factory.mktemp("one")), timeout_s=600)[0],
            run_gloo(_train, 2, MODES, str(tmp_path_factory.mktemp("cp2")), timeout_s=900))


@pytest.mark.parametrize("name", [*FEATURES, "resumed"])
@pytest.mark.parametrize("mode", MODES)
def test_a_trainer_feature_under_cp2_trains_as_one_process(runs, mode, name):
    one, ranks = runs
    want = one["one", name]
    assert all(norm > 0.5 for norm in want["grad_norm"])  # clipped
    assert want["checkpointing"] == FEATURES.get(name, {}).get("gradient_checkpointing", False)
    for rank in ranks:
        got = rank[mode, name]
        for key in ("loss", "grad_norm", "kept", "eval"):
            assert got[key] == pytest.approx(want[key], rel=1e-6), key
        for key in ("trained", "tokens", "checkpointing"):
            assert got[key] == want[key], key
        assert rel_rms(got["weights"], want["weights"]) < 1e-9


def test_a_resumed_run_continues_as_the_uninterrupted_one(runs):
    one, ranks = runs
    for run in (one, *ranks):
        for (mode, name), resumed in run.items():
            if name == "resumed":
                full = run[mode, "accumulated, evaluated, saved"]
                assert (full["trained"], resumed["trained"]) == ([1, 2, 3, 4], [3, 4])
                for key in ("loss", "grad_norm", "kept", "eval"):
                    assert resumed[key] == pytest.approx(full[key], rel=1e-12), key
                assert resumed["tokens"] == full["tokens"] and rel_rms(resumed["weights"], full["weights"]) < 1e-12
