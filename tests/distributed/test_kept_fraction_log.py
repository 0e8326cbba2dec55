"""The kept fraction a training log shows under several processes is the mean over them (issue #50's hardening):
each process's batches are its own under data parallelism, and the logged value was rank 0's alone."""

from hf_sparse_cp.testing.spawn import run_gloo


def _logged(rank: int, world: int) -> tuple[dict, dict]:
    from types import SimpleNamespace

    import torch
    from transformers import TrainerState

    from hf_sparse_cp.integration.stats import record_kept_fraction
    from hf_sparse_cp.trainer.callbacks import SparsityLoggingCallback

    class Attention(torch.nn.Module):
        def __init__(self, layer_idx: int):
            super().__init__()
            self.layer_idx = layer_idx

    model = torch.nn.ModuleList([Attention(0), Attention(1)])
    args = SimpleNamespace(device=torch.device("cpu"))
    # layer 0: rank 0 two calls (0.2, 0.4), rank 1 one (0.6); layer 1 on rank 1 only
    for value in ([0.2, 0.4] if rank == 0 else [0.6]):
        record_kept_fraction(model[0], torch.tensor(value))
    if rank == 1:
        record_kept_fraction(model[1], torch.tensor(0.8))
    training = {"loss": 1.0}
    SparsityLoggingCallback().on_log(args, TrainerState(), None, logs=training, model=model)
    model.eval()  # (as the Trainer evaluates)
    record_kept_fraction(model[0], torch.tensor(0.1 + rank))  # an evaluation log: each process's own
    evaluation = {"eval_loss": 1.0}
    SparsityLoggingCallback().on_log(args, TrainerState(), None, logs=evaluation, model=model)
    return training, evaluation


def test_a_training_log_shows_the_kept_fraction_of_every_process():
    (train0, eval0), (train1, eval1) = run_gloo(_logged, 2, timeout_s=120)
    assert train0 == train1
    assert abs(train0["sparse/kept_fraction/layer_00"] - 0.45) < 1e-9  # (0.3 + 0.6) / 2
    assert abs(train0["sparse/kept_fraction/layer_01"] - 0.8) < 1e-9  # the one process that ran it
    assert abs(train0["sparse/kept_fraction"] - 0.625) < 1e-9
    assert abs(eval0["sparse/kept_fraction"] - 0.1) < 1e-9 and abs(eval1["sparse/kept_fraction"] - 1.1) < 1e-9


def test_training_and_evaluation_logs_keep_their_own_calls():
    """An evaluation between two training logs (--eval_steps 1, --logging_steps 2) popped the training step before it
    with its own forwards: its log showed (0.2 + 0.9) / 2 = 0.55 where the evaluation kept 0.9, and the next training
    log 0.4 where its steps kept (0.2 + 0.4) / 2."""
    from types import SimpleNamespace

    import torch
    from transformers import TrainerState

    from hf_sparse_cp.integration.stats import record_kept_fraction
    from hf_sparse_cp.trainer.callbacks import SparsityLoggingCallback

    attention = torch.nn.Module()
    attention.layer_idx = 0
    args, callback = SimpleNamespace(device=torch.device("cpu")), SparsityLoggingCallback()
    record_kept_fraction(attention, torch.tensor(0.2))  # training step 1
    attention.eval()
    record_kept_fraction(attention, torch.tensor(0.9))  # the evaluation after it
    evaluation = {"eval_loss": 1.0}
    callback.on_log(args, TrainerState(), None, logs=evaluation, model=attention)
    attention.train()
    record_kept_fraction(attention, torch.tensor(0.4))  # training step 2
    training = {"loss": 1.0}
    callback.on_log(args, TrainerState(), None, logs=training, model=attention)
    assert abs(evaluation["sparse/kept_fraction"] - 0.9) < 1e-9
    assert abs(training["sparse/kept_fraction"] - 0.3) < 1e-9
    # the end of training's log takes the steps after the last training log, as it did
    record_kept_fraction(attention, torch.tensor(0.5))
    summary = {"train_runtime": 1.0, "train_loss": 1.0}
    callback.on_log(args, TrainerState(), None, logs=summary, model=attention)
    assert abs(summary["sparse/kept_fraction"] - 0.5) < 1e-9


def test_forwards_before_training_are_no_part_of_its_logs():
    """A forward before `train()` (checking the loaded model with the dense pattern, generating) left its kept fraction
    on the layers: SmolLM2 trained at 0.55 while its end of training's log said 1.0 for every layer. The start of
    training drops those sums."""
    from types import SimpleNamespace

    import torch
    from transformers import TrainerState

    from hf_sparse_cp.integration.stats import record_kept_fraction
    from hf_sparse_cp.trainer.callbacks import SparsityLoggingCallback

    attention = torch.nn.Module()
    attention.layer_idx = 0
    args, callback = SimpleNamespace(device=torch.device("cpu")), SparsityLoggingCallback()
    attention.eval()
    record_kept_fraction(attention, torch.tensor(1.0))  # the user's check before training, dense
    attention.train()
    record_kept_fraction(attention, torch.tensor(0.7))  # a forward in training mode before train(), too
    callback.on_train_begin(args, TrainerState(), None, model=attention)
    record_kept_fraction(attention, torch.tensor(0.5))  # the one training step
    training = {"loss": 1.0}
    callback.on_log(args, TrainerState(), None, logs=training, model=attention)
    summary = {"train_runtime": 1.0, "train_loss": 1.0}
    callback.on_log(args, TrainerState(), None, logs=summary, model=attention)
    assert abs(training["sparse/kept_fraction"] - 0.5) < 1e-9
    assert "sparse/kept_fraction" not in summary  # no call since the last training log


def test_an_evaluation_logs_its_own_forwards_only(tmp_path):
    """An evaluation-mode forward before `evaluate()` (a user's own check of the model, a generation) was counted in
    that evaluation's logged kept fraction: 0.1 left on each layer showed as 0.7 where the evaluation's two forwards
    kept 1.0 (dense at 16 tokens). The trainer's evaluation loop drops what was left before it."""
    import torch
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    import hf_sparse_cp
    from hf_sparse_cp import SparseCPArguments, attach_to_trainer, detach_from_trainer
    from hf_sparse_cp.integration.stats import record_kept_fraction
    from hf_sparse_cp.testing.tiny_models import tiny_config

    hf_sparse_cp.patch()
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    hf_sparse_cp.configure(model)
    ids = torch.randint(0, 200, (16,), generator=torch.Generator().manual_seed(0))
    args = TrainingArguments(output_dir=str(tmp_path), report_to="none", use_cpu=True, per_device_eval_batch_size=1)
    trainer = Trainer(model=model, args=args, eval_dataset=[{"input_ids": ids, "labels": ids}] * 2)
    attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True))
    try:
        model.eval()
        for module in model.modules():
            if getattr(module, "layer_idx", None) is not None:
                record_kept_fraction(module, torch.tensor(0.1))  # the user's forward before evaluate()
        trainer.evaluate()
    finally:
        detach_from_trainer(trainer)
    assert trainer.state.log_history[-1]["sparse/kept_fraction"] == 1.0
