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
from hf_sparse_cp.testing.spawn import accelerate_cpu_launch, run_gloo
from hf_sparse_cp.testing.tiny_models import tiny_config

FLAGS = ["--max_steps", "3", "--per_device_train_batch_size", "1", "--learning_rate", "1e-3", "--logging_steps", "1",
         "--report_to", "none", "--use_cpu", "--save_strategy", "no", "--train_sampling_strategy", "sequential",
         "--seed", "0"]
PATTERN = ["--sparse_block_size", "32", "--sparse_min_seq_len", "128", "--sparse_vertical_topk", "8",
           "--sparse_slash_topk", "8", "--sparse_local_window", "32", "--sparse_sink_tokens", "4", "--sparse_last_q",
           "16"]


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
    switched = SparseTrainer(model=_model(), args=_args(tmp_path / "switch", "--sparse_pattern", "dense"),
                             train_dataset=_rows())
    switched.train()
    assert switched.model.config._attn_implementation == "sparse_cp" and hf_sparse_cp.is_lean_loss_enabled()
    assert switched.max_length == 256  # from the first sample
    for got, want in zip(_losses(switched), _losses(plain), strict=True):
        assert got == pytest.approx(want, rel=1e-5)
    hf_sparse_cp.disable_lean_loss()


def test_the_flags_carry_every_plugin_setting(tmp_path):
    args = _args(tmp_path, *PATTERN, "--smet", "--smet_density", "0.5", "--sparse_max_length", "512")
    assert args.sparse_attention  # on by default: the class is the switch
    assert args.sparse_attention_config().budget.vertical_topk == 8 and args.sparse_attention_config().block_size == 32
    # (a Trainer in one process, without CP, refuses it: test_bad_inputs.py)
    assert _args(tmp_path, "--cp_sharding", "zigzag").context_parallel_config().cp_sharding == "zigzag"
    assert args.smet_optimizer_config().density == 0.5 and args.sparse_max_length == 512
    with pytest.raises(ValueError, match=r"block_size \(--sparse_block_size\)=48 must be a power of two"):
        _args(tmp_path, "--sparse_block_size", "48")
    trainer = SparseTrainer(model=_model(), args=args, train_dataset=_rows())
    trainer.create_optimizer()
    assert unwrap_smet(trainer.optimizer) is not None
    with pytest.raises(TypeError, match="takes arguments with the plugin's flags"):
        SparseTrainer(model=_model(), args=TrainingArguments(output_dir=str(tmp_path)))


def _start_up_line(caplog, tmp_path, *flags) -> str:
    """What a SparseTrainer built with `flags` logs at WARNING (its start-up line among it)."""
    caplog.clear()
    with caplog.at_level("WARNING"):
        SparseTrainer(model=_model(), args=_args(tmp_path, *flags), train_dataset=_rows())
    return caplog.text


def test_the_start_up_line_says_which_layers_are_sparse_and_warns_when_none_is(tmp_path, caplog):
    # the first layer dense by default
    assert ("sparse_cp: 1 of 2 layers vertical-slash (block 32); layer 0 dense (pattern); fused ops: off (stock "
            "PyTorch around attention); context parallelism: off" in _start_up_line(caplog, tmp_path, *PATTERN))
    assert ("sparse_cp: 2 of 2 layers vertical-slash (block 32); fused ops: off (stock PyTorch around attention); "
            "context parallelism: off" in _start_up_line(caplog, tmp_path, *PATTERN, "--sparse_dense_first_layers",
                                                          "0"))
    # --torch_compile: inductor fuses the work around attention in the model the Trainer compiles whole
    assert ("fused ops: left to torch.compile in the model compiled whole (--torch_compile or accelerate's dynamo "
            "backend; liger-kernel's kernels left out)"
            in _start_up_line(caplog, tmp_path, *PATTERN, "--torch_compile"))
    text = _start_up_line(caplog, tmp_path, "--sparse_dense_first_layers", "1", "--sparse_min_seq_len", "8192")
    assert "layer 0 dense (pattern)" in text
    # the note ends the line, after what the line says of the layers, the fused ops and CP
    assert ("context parallelism: off. At 256 tokens no document reaches min_seq_len=8192: every layer runs dense. "
            "For a trial run that shows sparsity at this length, give --sparse_config trial" in text)
    assert ("sparse_cp: 0 of 2 layers vertical-slash (block 32); layers 0-1 dense (pattern);"
            in _start_up_line(caplog, tmp_path, *PATTERN, "--sparse_dense_first_layers", "2"))


def test_the_start_up_report_of_a_cp_schedule_says_each_stage(tmp_path, caplog):
    """One line per stage: from which step, its length, its CP layout and how the layers attend at that length with
    its pattern (the first stage's alone was described, at the longest stage's length)."""
    text = _start_up_line(caplog, tmp_path, *PATTERN, "--sparse_min_seq_len", "200", "--cp_schedule",
                          "0:128:1,2:256:1:dense_first_layers=0")
    assert ("sparse_cp: cp_schedule 0:128:1,2:256:1:dense_first_layers=0 (FROM:SEQ_LEN:CP_SIZE); fused ops: "
            "off (stock PyTorch around attention); 2 stages:\n"
            "  stage 0 from step 0: 128 tokens, no CP, DP 1; every layer dense (no document reaches "
            "min_seq_len=200).\n"
            "  stage 1 from step 2: 256 tokens, no CP, DP 1; 2 of 2 layers vertical-slash (block 32).") in text


def test_the_automatic_gradient_checkpointing_is_logged(tmp_path, caplog):
    with caplog.at_level("WARNING"):
        trainer = SparseTrainer(model=_model(), args=_args(tmp_path, "--sparse_gradient_checkpointing_min_length",
                                                           "128"), train_dataset=_rows())
    assert trainer.args.gradient_checkpointing
    assert ("Sequence length 256 >= --sparse_gradient_checkpointing_min_length 128: turning gradient checkpointing "
            "on") in caplog.text


@pytest.mark.parametrize("given", [None, "128"], ids=["first-row-shorter", "max-length-shorter"])
def test_rows_longer_than_the_length_set_up_for_name_the_memory_savers_left_off(tmp_path, caplog, given):
    """The run's length (--sparse_max_length, else the first row's) chooses gradient checkpointing and token tiles
    at set-up; rows longer than it trained with them off without a word. The first batch long enough for a saver
    left off is named once, with the length to pass; rows within the length given say nothing."""
    rows = [{"input_ids": r["input_ids"][:128], "labels": r["labels"][:128]} for r in _rows()[:1]] + _rows()[1:]
    flags = ["--sparse_gradient_checkpointing_min_length", "200", "--sparse_token_tiling_min_length", "256",
             "--sparse_token_tile_size", "64"]
    trainer = SparseTrainer(model=_model(), args=_args(tmp_path, *flags, *(["--sparse_max_length", given] if given
                                                                           else [])), train_dataset=rows)
    assert trainer.max_length == 128 and not trainer.args.gradient_checkpointing
    with caplog.at_level("WARNING"):
        trainer.train()
    warned = [r.getMessage() for r in caplog.records if "A training batch holds rows" in r.getMessage()]
    assert warned == ["A training batch holds rows of 256 tokens; the memory savers were set up for rows of 128 tokens "
                      "(--sparse_max_length / max_length), and gradient checkpointing "
                      "(--sparse_gradient_checkpointing_min_length 200) and token tiles "
                      "(--sparse_token_tiling_min_length 256) stay off: pass --sparse_max_length 256 (the longest "
                      "rows), or cut the rows to the length given."]
    caplog.clear()
    trainer = SparseTrainer(model=_model(), args=_args(tmp_path, *flags, "--sparse_max_length", "256"),
                            train_dataset=rows)
    with caplog.at_level("WARNING"):
        trainer.train()
    assert trainer.args.gradient_checkpointing and "A training batch holds rows" not in caplog.text


def _cp2_losses(rank: int, world: int, out: str) -> list[float]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    trainer = SparseTrainer(model=_model(), args=_args(out, *PATTERN, "--cp_size", "2"), train_dataset=_rows(250))
    trainer.train()
    return _losses(trainer)


def test_with_the_switch_cp2_equals_one_process(tmp_path):
    one = SparseTrainer(model=_model(), args=_args(tmp_path / "one", *PATTERN), train_dataset=_rows(250))
    one.train()
    for losses in run_gloo(_cp2_losses, 2, str(tmp_path / "cp2"), timeout_s=300):
        assert losses == pytest.approx(_losses(one), rel=1e-4)


def _model_init_run(out, *flags) -> tuple[SparseTrainer, list]:
    """A SparseTrainer built with `model_init` (the Trainer calls it in __init__ and again at train()), trained;
    and the models it built."""
    built = []

    def model_init():
        built.append(_model())
        return built[-1]

    trainer = SparseTrainer(model_init=model_init, args=_args(out, *PATTERN, *flags), train_dataset=_rows(250))
    trainer.train()
    return trainer, built


def test_model_init_trains_as_the_model_given(tmp_path):
    """Each model `model_init` builds is switched to the sparse backend with the run's pattern, the one train()
    builds included: the run is the one with the model given (a sparse one: the kept fraction below 1). DDP is told
    that every parameter is used, as for the model given (before: the accelerator, built before the first model, kept
    the Trainer's default, a search for unused parameters after every backward)."""
    given = SparseTrainer(model=_model(), args=_args(tmp_path / "given", *PATTERN), train_dataset=_rows(250))
    given.train()
    trainer, built = _model_init_run(tmp_path / "init")
    assert len(built) == 2 and trainer.model is built[1]
    assert all(m.config._attn_implementation == "sparse_cp" for m in built)
    assert trainer.args.ddp_find_unused_parameters is False  # (a dense llama uses every parameter)
    assert trainer.accelerator.ddp_handler.find_unused_parameters is False
    assert _losses(trainer) == _losses(given)
    assert max(log["sparse/kept_fraction"] for log in trainer.state.log_history if "loss" in log) < 1.0


def _cp2_model_init(rank: int, world: int, out: str) -> tuple[list[float], list[float], int, bool, str]:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    trainer, _ = _model_init_run(out, "--cp_size", "2", *NEFTUNE)
    first, group = _losses(trainer), trainer.parallel.cp_group
    created, new_group = [], torch.distributed.new_group
    torch.distributed.new_group = lambda *args, **kwargs: created.append(new_group(*args, **kwargs)) or created[-1]
    try:  # train() again: the rebuilt model's CP set-up reuses the groups of the first
        trainer.train()
    finally:
        torch.distributed.new_group = new_group
    with pytest.raises(ValueError) as refused:  # (a search's trial builds the accelerator anew)
        trainer.call_model_init({"learning_rate": 1e-2})
    return first, _losses(trainer), len(created), trainer.parallel.cp_group is group, str(refused.value)


# (CP draws NEFTune's noise in a hook on the model's embeddings: on the model train() builds, else it trains without)
NEFTUNE = ("--neftune_noise_alpha", "5")


def test_model_init_under_cp2_equals_one_process(tmp_path):
    """train() rebuilds the model: context parallelism is set up again on it, on the process groups of the first
    train() (before: new ones at each train(), never destroyed), and a hyperparameter search's trial under CP is
    refused, naming the fix (one process's model_init draws the noise after building the model, a draw the run with
    the model given does not take)."""
    one, _ = _model_init_run(tmp_path / "one", *NEFTUNE)
    for first, second, created, same_group, refusal in run_gloo(_cp2_model_init, 2, str(tmp_path / "cp2"),
                                                                timeout_s=300):
        assert first == pytest.approx(_losses(one), rel=1e-4) and second == pytest.approx(_losses(one), rel=1e-4)
        assert created == 0 and same_group
        assert "hyperparameter_search under context parallelism" in refusal and "Search without CP" in refusal


SCRIPT = textwrap.dedent("""
    import torch
    from torch.distributed.fsdp import FSDPModule
    from transformers import AutoModelForCausalLM, HfArgumentParser
    from hf_sparse_cp import SparseTrainer, SparseTrainingArguments
    from hf_sparse_cp.testing.tiny_models import tiny_config
    (args,) = HfArgumentParser(SparseTrainingArguments).parse_args_into_dataclasses()
    torch.manual_seed(0)  # the same data and model on every rank
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(3, 259, (4, 256))]
    trainer = SparseTrainer(model=AutoModelForCausalLM.from_config(tiny_config("llama")), args=args,
                            train_dataset=rows)
    trainer.train()
    sharded = sum(isinstance(m, FSDPModule) for m in trainer.model.modules())
    if trainer.is_world_process_zero():
        print("RESULT", trainer.accelerator.num_processes, trainer.parallel.cp_size, trainer.state.global_step,
              sharded)
""")
# What a CPU run of the script is given: no --use_cpu anywhere.
CPU_RUN = ["--report_to", "none", "--max_steps", "1", "--save_strategy", "no", "--cp_size", "2", *PATTERN]


def _launch(tmp_path, launcher: list[str], *flags: str) -> list[str]:
    """Run SCRIPT under `launcher` on 2 CPU processes; what it printed: processes, CP size, steps, FSDP2 modules."""
    script = tmp_path / "train.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("WORLD_SIZE", None)
    run = subprocess.run([*launcher, str(script), "--output_dir", str(tmp_path / "out"), *CPU_RUN, *flags],
                         env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    return next(line.split()[1:] for line in run.stdout.splitlines() if line.startswith("RESULT"))


def test_torchrun_on_cpu_with_cp_and_fsdp2_needs_no_use_cpu(tmp_path):
    """`torchrun --nproc_per_node 2 train.py --cp_size 2 --fsdp ...` on a machine without an accelerator: the
    arguments train on CPU processes joined by gloo (accelerate would otherwise run two single-process jobs),
    one sequence over both ranks, the model sharded by FSDP2."""
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    fsdp = ["--fsdp", "--fsdp_config",
            '{"version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}']
    processes, cp, steps, sharded = _launch(tmp_path, torchrun, *fsdp)
    assert (processes, cp, steps) == ("2", "2", "1") and int(sharded) >= 3  # the model and its 2 decoder layers


def test_accelerate_launch_with_the_cpu_config_needs_no_use_cpu(tmp_path):
    assert _launch(tmp_path, accelerate_cpu_launch()) == ["2", "2", "1", "0"]


def test_fsdp_in_a_process_no_launcher_started_is_refused_naming_the_launch(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(ValueError, match="launch several, e.g. `torchrun --nproc_per_node 2 train.py --fsdp"):
        _args(tmp_path, "--fsdp")


def test_without_an_accelerator_the_arguments_train_on_cpu(tmp_path, monkeypatch):
    from hf_sparse_cp.trainer import sparse_trainer

    monkeypatch.setattr(sparse_trainer, "_has_accelerator", lambda: False)
    assert _args(tmp_path).use_cpu  # FLAGS hold --use_cpu: here the arguments alone set it
    (args,) = HfArgumentParser(SparseTrainingArguments).parse_args_into_dataclasses(["--output_dir", str(tmp_path)])
    assert args.use_cpu
    monkeypatch.setattr(sparse_trainer, "_has_accelerator", lambda: True)
    (args,) = HfArgumentParser(SparseTrainingArguments).parse_args_into_dataclasses(["--output_dir", str(tmp_path)])
    assert not args.use_cpu


def test_a_lone_process_asked_for_cp_says_how_to_launch():
    """accelerate launch with a MULTI_CPU config (no MPI hostfile) starts one process: the error names that."""
    from hf_sparse_cp.distributed import ContextParallelConfig, ParallelDims

    with pytest.raises(ValueError, match="accelerate launch` started a single process. A MULTI_CPU config"):
        ParallelDims.from_config(ContextParallelConfig(cp_size=2), env={"ACCELERATE_MIXED_PRECISION": "no"})
    with pytest.raises(ValueError, match="runs alone: launch it with `torchrun --nproc_per_node N`"):
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


def test_a_saved_sparse_pattern_that_a_run_replaces_is_logged_with_the_fix(tmp_path, caplog):
    """A model saved by a sparse run (SmolLM2 with dense_first_layers 0, a local window of 32), trained on with
    `hf-sparse-cp train --model_name_or_path <folder>`, trained with the default pattern for every field its flags did
    not give (layer 0 dense, a window of 128: 0.98 of the blocks kept where the saved pattern kept 0.55), without a
    word. The run says which fields it replaces and how to keep them; the saved config.json as --sparse_config keeps
    them, and says nothing."""
    from hf_sparse_cp.config import SparseAttentionConfig

    model = _model()
    saved = SparseAttentionConfig(min_seq_len=128, block_size=32, vertical_topk=8, slash_topk=8, local_window=32,
                                  sink_tokens=4, last_q=16, dense_first_layers=0)
    hf_sparse_cp.configure(model, saved, select=False)
    model.save_pretrained(tmp_path / "saved")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    with caplog.at_level("WARNING"):
        SparseTrainer(model=reloaded, args=_args(tmp_path, *PATTERN), train_dataset=_rows())
    assert ("The model's config holds a sparse attention pattern (sparse_attention: saved by an hf-sparse-cp run, or "
            "set by hf_sparse_cp.configure) that this run replaces with the pattern of its flags and --sparse_config, "
            "which differs in dense_first_layers: 0 -> 1. To train with the model's pattern, pass --sparse_config "
            "<the model's folder>/config.json." in caplog.text)
    caplog.clear()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "saved")
    with caplog.at_level("WARNING"):
        trainer = SparseTrainer(model=reloaded, train_dataset=_rows(),
                                args=_args(tmp_path, "--sparse_config", str(tmp_path / "saved" / "config.json")))
    assert SparseAttentionConfig.stored_on(trainer.model.config) == saved and "replaces" not in caplog.text


def test_every_training_log_has_tokens_per_second_and_peak_memory(tmp_path):
    """Issue #52: the speed and memory TRL and axolotl users read, in the Trainer's logs (so in every --report_to):
    real tokens only (the padding of a masked row is not counted), and DDP told that every parameter is used."""
    rows = [{"input_ids": r["input_ids"], "labels": r["labels"],
             "attention_mask": torch.arange(256) < (256 if i % 2 else 192)} for i, r in enumerate(_rows())]
    trainer = SparseTrainer(model=_model(), args=_args(tmp_path, *PATTERN), train_dataset=rows)
    assert trainer.args.ddp_find_unused_parameters is False  # (a dense llama uses every parameter)
    assert trainer.accelerator.ddp_handler.find_unused_parameters is False
    trainer.train()
    logs = [log for log in trainer.state.log_history if "loss" in log]
    assert len(logs) == 3 and all(log["tokens_per_second"] > 0 and log["peak_memory_gib"] > 0 for log in logs)
    metrics = next(cb for cb in trainer.callback_handler.callbacks if type(cb).__name__ == "StepMetricsCallback")
    assert float(metrics.total) == 192 + 256 + 192  # three steps of one row (rows 0, 1, 2): the real tokens


def test_the_first_tokens_per_second_after_a_resume_leaves_out_the_skipped_batches(tmp_path, monkeypatch):
    """A resume skips the batches its checkpoint trained (an iterable dataset's are fetched and dropped): the first
    log's tokens/s counts from the first trained step, not over the skip as well (before: the skipped rows' fetch time
    in the interval, here 2000 s of a clock that the fetch of a skipped row moves by 1000 s)."""
    from hf_sparse_cp.trainer import callbacks

    clock = [0.0]

    def perf_counter():  # (every read a second later: no interval is empty)
        clock[0] += 1.0
        return clock[0]

    monkeypatch.setattr(callbacks, "time", type("Clock", (), {"perf_counter": staticmethod(perf_counter)}))
    slow = []

    class Rows(torch.utils.data.IterableDataset):
        def __iter__(self):
            for i, row in enumerate(_rows()):
                if i in slow:
                    clock[0] += 1000.0
                yield row

    def train(max_steps, resume):
        args = _args(tmp_path, *PATTERN, "--max_steps", str(max_steps), "--save_strategy", "steps", "--save_steps",
                     "2", "--sparse_max_length", "256")
        trainer = SparseTrainer(model=_model(), args=args, train_dataset=Rows())
        trainer.train(resume_from_checkpoint=resume or None)
        return [log for log in trainer.state.log_history if "loss" in log and log["step"] > max_steps - 2]

    train(2, False)
    slow[:] = [0, 1]  # the rows the resume skips
    first, second = train(4, True)
    assert first["step"] == 3 and first["tokens_per_second"] > 256 / 100, first
    assert second["tokens_per_second"] > 256 / 100
