"""The one switch: `SparseTrainingArguments` + `SparseTrainer` in a stock Trainer script."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, Trainer, TrainingArguments

import hf_sparse_cp
from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
from hf_sparse_cp.smet import unwrap_smet
from hf_sparse_cp.testing.models import tiny_config
from hf_sparse_cp.testing.spawn import run_gloo

FLAGS = ["--max_steps", "3", "--per_device_train_batch_size", "1", "--learning_rate", "1e-3", "--logging_steps", "1",
         "--report_to", "none", "--use_cpu", "--save_strategy", "no", "--train_sampling_strategy", "sequential",
         "--seed", "0"]
PATTERN = ["--block_size", "32", "--min_seq_len", "128", "--vertical_topk", "8", "--slash_topk", "8",
           "--local_window", "32", "--sink_tokens", "4", "--last_q", "16"]


def _rows(seq=256, n=4):
    ids = torch.randint(3, 259, (n, seq), generator=torch.Generator().manual_seed(0))
    return [{"input_ids": r, "labels": r} for r in ids]


def _args(out, *flags):
    (args,) = HfArgumentParser(SparseTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(out), *FLAGS, *flags])
    return args


def _model():
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(tiny_config("llama"))


def _losses(trainer):
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


def test_the_switch_trains_like_a_plain_trainer_on_the_dense_pattern(tmp_path):
    """Same script, two class names changed: on the dense pattern the losses are the stock run's."""
    (plain_args,) = HfArgumentParser(TrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path / "plain"), *FLAGS])
    plain = Trainer(model=_model(), args=plain_args, train_dataset=_rows())
    plain.train()
    switched = SparseTrainer(model=_model(), args=_args(tmp_path / "switch", "--pattern", "dense"),
                             train_dataset=_rows())
    switched.train()
    assert switched.model.config._attn_implementation == "sparse_cp" and hf_sparse_cp.is_lean_loss_enabled()
    assert switched.max_length == 256  # from the first sample
    for got, want in zip(_losses(switched), _losses(plain), strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    hf_sparse_cp.disable_lean_loss()


def test_the_flags_carry_every_plugin_setting(tmp_path):
    args = _args(tmp_path, *PATTERN, "--cp_sharding", "zigzag", "--smet", "--smet_density", "0.5", "--max_length",
                 "512")
    assert args.sparse_attention  # on by default: the class is the switch
    assert args.sparse_attention_config().vertical_topk == 8 and args.sparse_attention_config().block_size == 32
    assert args.context_parallel_config().cp_sharding == "zigzag"
    assert args.smet_optimizer_config().density == 0.5 and args.max_length == 512
    with pytest.raises(ValueError, match="block_size=48 must be a power of two"):
        _args(tmp_path, "--block_size", "48")
    trainer = SparseTrainer(model=_model(), args=args, train_dataset=_rows())
    trainer.create_optimizer()
    assert unwrap_smet(trainer.optimizer) is not None
    with pytest.raises(TypeError, match="takes SparseTrainingArguments"):
        SparseTrainer(model=_model(), args=TrainingArguments(output_dir=str(tmp_path)))


def test_the_start_up_line_says_which_layers_are_sparse_and_warns_when_none_is(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        SparseTrainer(model=_model(), args=_args(tmp_path, *PATTERN), train_dataset=_rows())
    # the first layer dense by default
    assert ("sparse_cp: 1 of 2 layers vertical-slash (block 32); layers 0 dense (pattern); context parallelism: off"
            in caplog.text)
    caplog.clear()
    with caplog.at_level("WARNING"):
        SparseTrainer(model=_model(), args=_args(tmp_path, *PATTERN, "--dense_first_layers", "0"),
                      train_dataset=_rows())
    assert "sparse_cp: 2 of 2 layers vertical-slash (block 32); context parallelism: off" in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING"):
        SparseTrainer(model=_model(), args=_args(tmp_path, "--dense_first_layers", "1", "--min_seq_len", "8192"),
                      train_dataset=_rows())
    assert "layers 0 dense (pattern)" in caplog.text
    assert "At 256 tokens no document reaches min_seq_len=8192: every layer runs dense" in caplog.text


def test_the_automatic_gradient_checkpointing_is_logged(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        trainer = SparseTrainer(model=_model(), args=_args(tmp_path, "--gradient_checkpointing_min_length", "128"),
                                train_dataset=_rows())
    assert trainer.args.gradient_checkpointing
    assert "Sequence length 256 >= --gradient_checkpointing_min_length 128: turning gradient checkpointing on" in (
        caplog.text)


def _cp2_losses(rank: int, world: int, out: str) -> list[float]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    trainer = SparseTrainer(model=_model(), args=_args(out, *PATTERN, "--cp_size", "2"), train_dataset=_rows(250))
    trainer.train()
    return _losses(trainer)


@pytest.mark.slow
def test_with_the_switch_cp2_equals_one_process(tmp_path):
    one = SparseTrainer(model=_model(), args=_args(tmp_path / "one", *PATTERN), train_dataset=_rows(250))
    one.train()
    for losses in run_gloo(_cp2_losses, 2, str(tmp_path / "cp2"), timeout_s=300):
        assert losses == pytest.approx(_losses(one), rel=1e-4)


SCRIPT = textwrap.dedent("""
    import torch
    from transformers import AutoModelForCausalLM, HfArgumentParser
    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.models import tiny_config
    (args,) = HfArgumentParser(SparseTrainingArguments).parse_args_into_dataclasses()
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(3, 259, (4, 128))]
    SparseTrainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")), args=args, train_dataset=rows)
""")


@pytest.mark.slow
def test_a_cpu_run_launched_without_use_cpu_is_refused(tmp_path):
    """torchrun starts 2 processes, but without --use_cpu accelerate would run each as its own job."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("WORLD_SIZE", None)
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                          str(script), "--output_dir", str(tmp_path / "out"), "--report_to", "none"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "2 processes were launched but the Trainer sees 1" in run.stderr and "--use_cpu" in run.stderr


def test_a_lone_process_asked_for_cp_says_how_to_launch():
    """accelerate launch with a MULTI_CPU config (no MPI hostfile) starts one process: the error names that."""
    from hf_sparse_cp.distributed import ContextParallelConfig, ParallelDims

    with pytest.raises(ValueError, match="accelerate launch` started a single process. A MULTI_CPU config"):
        ParallelDims.from_config(ContextParallelConfig(cp_size=2), env={"ACCELERATE_MIXED_PRECISION": "no"})
    with pytest.raises(ValueError, match="runs alone: launch it with torchrun"):
        ParallelDims.from_config(ContextParallelConfig(cp_size=2), env={})


def test_a_saved_sparse_pattern_that_a_run_ignores_is_logged(tmp_path, caplog):
    """Issue #31: a model saved with sparse attention and trained without it ran sdpa with its
    `sparse_attention` settings still in the config, without a word."""
    model = _model()
    hf_sparse_cp.configure(model, hf_sparse_cp.SparseAttentionConfig(vertical_topk=8), select=False)  # as saved
    with caplog.at_level("WARNING"):
        SparseTrainer(model=model, args=_args(tmp_path, "--sparse_attention", "false"), train_dataset=_rows())
    assert ("The model's config holds sparse attention settings (sparse_attention: saved by an hf-sparse-cp run), "
            "which this run ignores: --sparse_attention is off" in caplog.text)
    caplog.clear()
    with caplog.at_level("WARNING"):
        SparseTrainer(model=_model(), args=_args(tmp_path, "--sparse_attention", "false"), train_dataset=_rows())
    assert "ignores" not in caplog.text  # nothing ignored, nothing said
