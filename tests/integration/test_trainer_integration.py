import importlib.metadata

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig, attach_to_trainer, checkpointing_enabled, enable_sparse_attention
from hf_sparse_cp.examples.passkey import passkey_dataset
from hf_sparse_cp.examples.tokenizer import byte_tokenizer
from hf_sparse_cp.testing.tiny_models import tiny_config
from hf_sparse_cp.trainer.arguments import SparseCPArguments
from hf_sparse_cp.trainer.callbacks import SparsityLoggingCallback


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=1, logging_steps=1,
                report_to="none", save_strategy="no", use_cpu=True)
    base.update(kw)
    return TrainingArguments(**base)


def test_byte_tokenizer_round_trips_and_passkey_data_is_well_formed(tmp_path):
    tok = byte_tokenizer()
    text = "pass key 12345, ünïcode!"
    assert tok.decode(tok(text)["input_ids"]) == text and len(tok) == 259
    ds = passkey_dataset(tok, 3, 512, seed=1, cache_dir=tmp_path)
    for row in ds:
        assert len(row["input_ids"]) == 512 and row["labels"] == row["input_ids"]
        answer = tok.decode(row["input_ids"][row["answer_start"] :]).rstrip(".")
        assert answer.isdigit() and f"The pass key is {answer}." in tok.decode(row["input_ids"][:-12])


def test_sparsity_is_logged_before_the_reporters(tmp_path):
    tok = byte_tokenizer()
    model = AutoModelForCausalLM.from_config(tiny_config("qwen2", vocab_size=len(tok)))
    training = _args(tmp_path)
    sparse = SparseCPArguments(sparse_attention=True, sparse_fused_loss=False)
    pattern = SparseAttentionConfig(block_size=32, min_seq_len=128, vertical_topk=8, slash_topk=8, local_window=32)
    enable_sparse_attention(model, sparse, pattern, training, max_length=512)
    trainer = Trainer(model=model, args=training, train_dataset=passkey_dataset(tok, 4, 512, cache_dir=tmp_path),
                      data_collator=default_data_collator)
    attach_to_trainer(trainer, sparse)
    attach_to_trainer(trainer, sparse)  # once only
    callbacks = trainer.callback_handler.callbacks
    assert isinstance(callbacks[0], SparsityLoggingCallback)
    assert sum(isinstance(c, SparsityLoggingCallback) for c in callbacks) == 1
    trainer.train()
    logged = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logged) == 2
    for log in logged:
        assert 0 < log["sparse/kept_fraction"] < 1
        assert {"sparse/kept_fraction/layer_00", "sparse/kept_fraction/layer_01"} <= set(log)


def test_gradient_checkpointing_turns_on_for_long_sequences(tmp_path):
    model = AutoModelForCausalLM.from_config(tiny_config("llama"))
    sparse = SparseCPArguments(sparse_attention=True, sparse_fused_loss=False,
                               sparse_gradient_checkpointing_min_length=4096)
    short, long = _args(tmp_path), _args(tmp_path)
    enable_sparse_attention(model, sparse, None, short, max_length=2048)
    enable_sparse_attention(model, sparse, None, long, max_length=4096)
    assert not checkpointing_enabled(short) and checkpointing_enabled(long)
    assert long.gradient_checkpointing and getattr(long, "activation_checkpointing", True)


def test_demo_runs_and_the_loss_decreases(tmp_path):
    from hf_sparse_cp.examples.train_long_context import main

    summary = main(["--output_dir", str(tmp_path), "--sparse_max_length", "2048", "--max_steps", "5", "--use_cpu"])
    assert summary["final_loss"] < summary["first_loss"] - 0.5
    assert 0 < summary["mean_kept_fraction"] < 0.9


@pytest.mark.parametrize(
    "flags, strategy, steps",
    [
        ([], "no", None),  # the demo's default: no checkpoints
        (["--save_steps", "3"], "steps", 3),  # any --save_* flag: the Trainer's own checkpointing, as in any script
        (["--save-steps=3"], "steps", 3),
        (["--save_total_limit", "1"], "steps", 500),
        (["--save_strategy", "epoch"], "epoch", None),
        (["--save_final_model"], "no", None),  # the script's own flag (the model at the end) is not one of them
    ],
)
def test_checkpointing_flags_work_as_in_a_trainer_script(flags, strategy, steps):
    from hf_sparse_cp.examples.train_long_context import parse_args

    training = parse_args(flags)[1]
    assert training.save_strategy == strategy
    assert steps is None or training.save_steps == steps


def test_save_steps_saves_checkpoints(tmp_path, capsys, single_thread):
    from hf_sparse_cp.examples.train_long_context import main

    job = ["--sparse_max_length", "256", "--max_steps", "2", "--num_samples", "2", "--tiny_num_layers", "1"]
    main([*job, "--output_dir", str(tmp_path / "saved"), "--save_steps", "1"])
    assert sorted(p.name for p in (tmp_path / "saved").glob("checkpoint-*")) == ["checkpoint-1", "checkpoint-2"]
    assert f"checkpoints in {tmp_path / 'saved'}" in capsys.readouterr().out
    main([*job, "--output_dir", str(tmp_path / "demo")])
    assert not list((tmp_path / "demo").glob("checkpoint-*"))
    said = capsys.readouterr().out
    assert "no checkpoints (the demo's default; --save_steps N saves every N steps)" in said
    assert "final model" not in said
    # the model --save_final_model saves is named: the line said only "no checkpoints (the demo's default; ...)"
    main([*job, "--output_dir", str(tmp_path / "final"), "--save_final_model"])
    assert (tmp_path / "final" / "model.safetensors").is_file()
    assert f"no checkpoints (the demo's default; --save_steps N saves every N steps) | final model in " \
           f"{tmp_path / 'final'}" in capsys.readouterr().out


def test_cli_env(capsys):
    from hf_sparse_cp.cli import main

    assert main(["env"]) == 0
    out = capsys.readouterr().out
    assert "transformers" in out and hf_sparse_cp.__version__ in out and torch.__version__ in out
    rows = dict(line.split(maxsplit=1) for line in out.splitlines())
    for package in ("trl", "peft"):  # (TRL was not listed)
        assert rows[package] == importlib.metadata.version(package), out


def test_a_packed_run_whose_layers_all_run_dense_keeps_one_and_the_done_line_states_real_losses(
        tmp_path, capsys, single_thread):
    """Two documents packed per 256-token row, every layer dense (the issue's run logged 0.5, the document block
    diagonal over the causal triangle): the kept fraction is 1.0 of what a dense run computes, in the log and on
    the card. With a logging interval longer than the run, the done line states the first and last step's loss."""
    from hf_sparse_cp.examples.train_long_context import main

    job = ["--sparse_max_length", "256", "--max_steps", "3", "--num_samples", "6", "--tiny_num_layers", "1",
           "--pack_documents", "2", "--sparse_pattern", "dense", "--logging_steps", "50",
           "--output_dir", str(tmp_path)]
    summary = main(job)
    assert summary["mean_kept_fraction"] == 1.0
    assert summary["first_loss_step"] == 1 and summary["final_loss_step"] == 3
    assert all(v == v for v in (summary["first_loss"], summary["final_loss"]))  # numbers, not nan
    out = capsys.readouterr().out
    assert f"loss {summary['first_loss']:.4f} (step 1) -> {summary['final_loss']:.4f} (step 3)" in out
    assert "| 0 | 1.000 |" in (tmp_path / "README.md").read_text()


def test_the_done_line_of_a_resumed_run_counts_the_steps_it_ran(tmp_path, capsys, single_thread):
    """A run resumed at step 2 and trained to step 4 said 'done: 4 steps', with the first loss and the mean kept
    fraction of the steps before the checkpoint (restored with its log history), and did not log its own first
    step's loss."""
    from hf_sparse_cp.examples.train_long_context import main

    job = ["--sparse_max_length", "256", "--num_samples", "4", "--tiny_num_layers", "1", "--logging_steps", "50",
           "--save_steps", "2", "--output_dir", str(tmp_path)]
    main([*job, "--max_steps", "2"])
    capsys.readouterr()
    summary = main([*job, "--max_steps", "4", "--resume_from_checkpoint", str(tmp_path / "checkpoint-2")])
    done = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("done: "))
    assert done.startswith("done: 2 steps (steps 3-4, resumed from step 2) at 256 tokens"), done
    assert summary["first_loss_step"] == 3 and summary["final_loss_step"] == 4
    assert len(summary["losses"]) == 4  # (the whole run's: the checkpoint's steps 1-2 and this run's 3-4)
    assert summary["steps"] == 2 and summary["resumed_from_step"] == 2
    assert f"loss {summary['first_loss']:.4f} (step 3) -> {summary['final_loss']:.4f} (step 4)" in done, done
    main([*job, "--max_steps", "5", "--resume_from_checkpoint", str(tmp_path / "checkpoint-4")])  # one step: 'step 5'
    done = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("done: "))
    assert done.startswith("done: 1 step (step 5, resumed from step 4) at 256 tokens"), done


@pytest.mark.parametrize("flags, message", [
    (["--sparse_layer_overrides", '{"5-10": {"pattern": "dense"}}'], "reaches past the model's 1 layers"),
    (["--cp_size", "2"], "launch it with `torchrun --nproc_per_node N`"),
])
def test_a_setting_the_model_cannot_run_with_ends_in_one_line(tmp_path, capsys, flags, message):
    """Refusals that depend on the model or the length (not on the flags alone, which argparse checks) end the
    demo with the refusal's one line, naming the fix, and no traceback: as a bad flag ends (exit status 2)."""
    from hf_sparse_cp.examples.train_long_context import main

    job = ["--sparse_max_length", "256", "--max_steps", "1", "--num_samples", "1", "--tiny_num_layers", "1",
           "--output_dir", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        main([*job, *flags])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "train_long_context.py: error: " in err and message in err, err
