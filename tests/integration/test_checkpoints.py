"""Checkpoints of a plugin run say whether they are complete; a resume checks the checkpoint before
loading anything: an incomplete, damaged or mismatched one (other CP degree, other SMET settings, other
global batch) is refused naming the cause, and an intact one continues the run exactly (CP 2 with SMET;
FSDP2 with SMET saved at 4 processes and resumed at 2, then at 4 with CP 2, through the sharded state; a
--cp_schedule with SMET resumed before and between its CP switches)."""

import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments, default_data_collator

import hf_sparse_cp
from hf_sparse_cp import SparseCPArguments, attach_to_trainer, detach_from_trainer
from hf_sparse_cp.integration.architectures import transformers_release
from hf_sparse_cp.testing.spawn import launch_cli, run_cli, run_gloo
from hf_sparse_cp.testing.tiny_models import tiny_config
from hf_sparse_cp.trainer.arguments import is_flag_error
from hf_sparse_cp.trainer.checkpoints import CPU_PROCESSES_RESUME_SINCE, MARKER, CheckpointMarkerCallback


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.arange(64).add(i).remainder(250).add(3)
        return {"input_ids": ids, "labels": ids}


def _trainer(out, model_config: dict | None = None, lora: dict | None = None, **kw) -> Trainer:
    """A plugin Trainer of a tiny Llama; with `lora`, LoRA adapters of those settings (peft's LoraConfig) on it."""
    hf_sparse_cp.patch()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", **(model_config or {})))
    hf_sparse_cp.configure(model)
    if lora is not None:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(lora_dropout=0.0, task_type="CAUSAL_LM", **lora))
    kw = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2, "logging_steps": 1, **kw}
    args = TrainingArguments(output_dir=str(out), per_device_train_batch_size=2, report_to="none",
                             use_cpu=True, seed=0, **kw)
    trainer = Trainer(model=model, args=args, train_dataset=Rows(), data_collator=default_data_collator)
    attach_to_trainer(trainer, SparseCPArguments(sparse_attention=True))
    return trainer


def _losses(trainer):
    return [log["loss"] for log in trainer.state.log_history if "loss" in log]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    out = tmp_path_factory.mktemp("run")
    trainer = _trainer(out)
    trainer.train()
    return out, _losses(trainer)


def test_checkpoints_are_marked_complete_with_their_files(saved):
    out, _ = saved
    for step in (2, 4):
        marker = json.loads((out / f"checkpoint-{step}" / MARKER).read_text())
        assert marker["complete"] and marker["step"] == step
        assert marker["settings"] == {"cp_size": 1, "data_parallel_size": 1, "smet": None, "global_batch_size": 2}
        assert "trainer_state.json" in marker["files"] and "optimizer.pt" in marker["files"]


def test_an_intact_checkpoint_resumes_exactly(saved, tmp_path):
    out, losses = saved
    resumed = _trainer(tmp_path)
    resumed.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert _losses(resumed) == losses


@pytest.mark.parametrize("damage, cause", [
    ("in_progress", "is incomplete: the run ended while it was being saved"),
    ("truncated", "is damaged: model.safetensors is"),
    ("missing", "is damaged: optimizer.pt is missing"),
    ("other_cp", "was saved with cp_size=2, but this run has cp_size=1.*whose state is whole.*this one holds state "
                 "laid out for its processes. Or start a new run from its weights \\(--model_name_or_path "
                 ".*checkpoint-2: the optimizer and the schedule start over"),
    ("other_dp", "data_parallel_size=2, but this run has data_parallel_size=1.*saved with FSDP2"),
    ("other_smet", "was saved with smet=.*but this run has smet=None: .*Resume with --smet --smet_mode sparse_update "
                   "--smet_density 0.5 --smet_block_size 8 \\(flags beat a --smet_config file\\)"),
    ("other_batch", "global batch of 8 sequences per step, but this run has 2.*"
                    "Set --per_device_train_batch_size 8 --gradient_accumulation_steps 1"),
])
def test_a_damaged_or_mismatched_checkpoint_is_refused_before_loading(saved, tmp_path, damage, cause):
    out, _ = saved
    folder = tmp_path / "checkpoint-2"
    subprocess.run(["cp", "-r", str(out / "checkpoint-2"), str(folder)], check=True)
    marker = json.loads((folder / MARKER).read_text())
    if damage == "in_progress":
        (folder / MARKER).write_text(json.dumps({"complete": False, "step": 2}))
    elif damage == "truncated":
        with open(folder / "model.safetensors", "r+b") as f:
            f.truncate(100)
    elif damage == "missing":
        os.remove(folder / "optimizer.pt")
    else:
        key, value = {"other_cp": ("cp_size", 2), "other_dp": ("data_parallel_size", 2),
                      "other_smet": ("smet", {"mode": "sparse_update", "density": 0.5, "block_size": 8}),
                      "other_batch": ("global_batch_size", 8)}[damage]
        marker["settings"][key] = value
        (folder / MARKER).write_text(json.dumps(marker))
        if damage in ("other_cp", "other_dp"):  # (a state laid out for the processes: DeepSpeed's, as it saves it)
            (folder / "global_step2").mkdir()
    trainer = _trainer(tmp_path / "resume")
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError, match=cause):
        trainer.train(resume_from_checkpoint=str(folder))
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # nothing was loaded


def test_a_smet_state_saved_with_other_target_modules_is_refused_as_a_bad_flag(tmp_path):
    """The marker records SMET's mode, density and block size, not its target modules: a resume with other
    --smet_target_modules was refused as the optimizer loaded its state, naming the fix, but as a bug (a traceback
    from every rank and exit status 1 in a launched run, where a checkpoint saved with other SMET settings ends as a
    bad flag does)."""
    from hf_sparse_cp import install_smet
    from hf_sparse_cp.smet import SMETConfig
    from hf_sparse_cp.trainer.arguments import is_flag_error

    def smet_trainer(out, targets):
        trainer = _trainer(out, max_steps=2)
        install_smet(trainer, SMETConfig(density=0.5, block_size=8, update_interval=2, target_modules=targets))
        return trainer

    smet_trainer(tmp_path / "run", ["q_proj", "v_proj", "up_proj"]).train()
    resumed = smet_trainer(tmp_path / "resume", ["q_proj"])
    named = "different parameter grouping.*--smet_target_modules q_proj,up_proj,v_proj"
    with pytest.raises(ValueError, match=named) as refused:
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert is_flag_error(refused.value)


@pytest.mark.parametrize("resumed, differs", [
    ({"target_modules": ["q_proj", "k_proj"]}, "its base_model.model.model.layers.0.self_attn.v_proj.lora_A.weight is "
                                               "not in this run's adapter"),
    ({"target_modules": ["q_proj", "k_proj", "v_proj"]}, "this run's .*layers.0.self_attn.k_proj.lora_A.weight is not "
                                                         "in it"),
    ({"r": 8}, "its .*layers.0.self_attn.q_proj.lora_A.weight is \\[4, 128\\], this run's \\[8, 128\\]"),
], ids=["other_targets", "more_targets", "other_rank"])
def test_a_lora_checkpoint_resumed_with_other_adapter_settings_is_refused_as_a_bad_flag(tmp_path, resumed, differs):
    """A LoRA run resumed with other target modules or rank (TRL's --lora_target_modules, --lora_r) ended with a
    traceback from every rank (the adapter's "size mismatch", or the optimizer's "parameter group that doesn't match"),
    or, with as many target modules as saved, resumed silently with v_proj's optimizer state on k_proj's adapter."""
    saved = {"target_modules": ["q_proj", "v_proj"], "r": 4}
    _trainer(tmp_path / "run", lora=saved, max_steps=2).train()
    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    trainer = _trainer(tmp_path / "resume", lora={**saved, **resumed})
    before = [p.detach().clone() for p in trainer.model.parameters()]
    named = (f"holds a PEFT adapter with other tensors than this run's \\(\\d+ differ; e.g. {differs}\\).*Resume with "
             "the adapter settings it was saved with .*adapter_config.json; TRL: --lora_target_modules q_proj v_proj "
             "--lora_r 4\\), or train from the start in a new --output_dir")
    with pytest.raises(ValueError, match=named) as refused:
        trainer.train(resume_from_checkpoint=checkpoint)
    assert is_flag_error(refused.value)  # (under the launcher: the message once, exit status 2)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # nothing was loaded
    again = _trainer(tmp_path / "again", lora=saved)  # the settings it was saved with resume it
    again.train(resume_from_checkpoint=checkpoint)
    assert again.state.global_step == 4


def test_a_lora_checkpoint_resumed_without_its_modules_to_save_is_refused_as_a_bad_flag(tmp_path):
    """A module to save (a trained copy of lm_head) dropped on resume was not seen: its saved copy bears the base
    model's name, which the tensor check left out as a resized embedding's. The Trainer's loose load then wrote it
    into the frozen lm_head and failed on the optimizer's parameter groups, a traceback from every rank."""
    from hf_sparse_cp.trainer.arguments import is_flag_error

    saved = {"target_modules": ["q_proj", "v_proj"], "r": 4, "modules_to_save": ["lm_head"]}
    _trainer(tmp_path / "run", lora=saved, max_steps=2).train()
    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    trainer = _trainer(tmp_path / "resume", lora={**saved, "modules_to_save": None})
    named = ("its modules_to_save are \\['lm_head'\\], this run's \\[\\].*TRL: --lora_target_modules q_proj v_proj "
             "--lora_r 4 --lora_modules_to_save lm_head\\)")
    with pytest.raises(ValueError, match=named) as refused:
        trainer.train(resume_from_checkpoint=checkpoint)
    assert is_flag_error(refused.value)
    again = _trainer(tmp_path / "again", lora=saved)  # (kept: no false refusal)
    again.train(resume_from_checkpoint=checkpoint)
    assert again.state.global_step == 4


@pytest.mark.parametrize("saved, resumed, holds", [
    (None, {"target_modules": ["q_proj", "v_proj"], "r": 4},
     "holds the whole model's weights \\(model.safetensors\\) and no PEFT adapter: .*Resume it without the adapter, "
     "as it was saved \\(TRL: without --use_peft\\), or train from the start in a new --output_dir: a new LoRA run "
     "may start from its weights \\(--model_name_or_path .*checkpoint-2\\)"),
    ({"target_modules": ["q_proj", "v_proj"], "r": 4}, None,
     "holds a PEFT adapter \\(adapter_model.safetensors\\) and not the whole model's weights: .*Resume it with the "
     "adapter it was saved with \\(.*adapter_config.json; TRL: --use_peft --lora_target_modules q_proj v_proj "
     "--lora_r 4\\), or train from the start in a new --output_dir"),
], ids=["full_then_lora", "lora_then_full"])
def test_a_checkpoint_resumed_with_peft_switched_on_or_off_is_refused_as_a_bad_flag(tmp_path, saved, resumed, holds):
    """A full fine-tune's checkpoint resumed with a LoRA adapter ended with a traceback from every rank (the optimizer's
    "parameter group that doesn't match", after a load that matched no weight), a LoRA run's resumed without one too
    (the Trainer's "Can't find a checkpoint index"). A checkpoint without the plugin's marker is left to the Trainer."""
    from hf_sparse_cp.trainer.checkpoints import check_adapter_fits

    _trainer(tmp_path / "run", lora=saved, max_steps=2).train()
    checkpoint = tmp_path / "run" / "checkpoint-2"
    trainer = _trainer(tmp_path / "resume", lora=resumed)
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError, match=holds) as refused:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert is_flag_error(refused.value)  # (under the launcher: the message once, exit status 2)
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # nothing was loaded
    (checkpoint / MARKER).unlink()  # (a checkpoint the plugin did not write: the Trainer's load, as without it)
    with pytest.raises(ValueError) as left:
        trainer.train(resume_from_checkpoint=str(checkpoint))
    assert not is_flag_error(left.value) and "PEFT" not in str(left.value)
    # (what the Trainer saves under FSDP with a sharded state dict type holds neither: left to it too)
    for name in ("model.safetensors", "adapter_model.safetensors"):
        (checkpoint / name).unlink(missing_ok=True)
    check_adapter_fits(checkpoint, trainer.model)


LORA = {"target_modules": ["q_proj", "v_proj"], "r": 4}


def _fsdp2_sharded_run(rank: int, world: int, out: str, resume: str | None, lora: dict | None) -> tuple:
    """`_trainer` under FSDP2 with a sharded state dict type (checkpoints: the sharded state, no weights file) on 2 CPU
    processes, with LoRA adapters of the settings `lora` or none: (global step,) trained, or (message, is it a flag
    error) refused."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    config = {"fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
              "state_dict_type": "SHARDED_STATE_DICT"}
    trainer = _trainer(Path(out), lora=lora, fsdp="full_shard", fsdp_config=config, max_steps=4 if resume else 2)
    try:
        trainer.train(resume_from_checkpoint=resume)
    except ValueError as e:
        return str(e), is_flag_error(e)
    return (trainer.state.global_step,)


def test_an_fsdp2_sharded_checkpoint_resumed_with_peft_switched_on_or_off_is_refused_as_a_bad_flag(tmp_path):
    """FSDP2 with a sharded state dict type saves no weights file, only the sharded state: a LoRA run's resumed without
    LoRA, or a full fine-tune's with it, failed on every rank with a KeyError (a parameter's name not in it); a LoRA
    run's resumed with another rank, with a size mismatch."""
    for lora in (LORA, None):
        run = tmp_path / f"run_{lora is not None}"
        assert run_gloo(_fsdp2_sharded_run, 2, str(run), None, lora) == [(2,)] * 2
        checkpoint = str(run / "checkpoint-2")
        assert not {"model.safetensors", "adapter_model.safetensors"} & set(os.listdir(checkpoint))
        refused = run_gloo(_fsdp2_sharded_run, 2, str(tmp_path / f"other_{lora is not None}"), checkpoint,
                           None if lora else LORA)
        holds = ("holds a PEFT adapter (its parameters in hf_sparse_cp_sharded_state/) and not the whole model's "
                 "weights" if lora else "holds the whole model's weights (its parameters in "
                 "hf_sparse_cp_sharded_state/) and no PEFT adapter")
        assert all(flag and holds in message for message, flag in refused), refused
    checkpoint = str(tmp_path / "run_True" / "checkpoint-2")
    refused = run_gloo(_fsdp2_sharded_run, 2, str(tmp_path / "other_rank"), checkpoint, {**LORA, "r": 8})
    other = ("holds a PEFT adapter with other tensors than this run's (8 differ; e.g. its base_model.model.model.layers"
             ".0.self_attn.q_proj.lora_A.default.weight is [4, 128], this run's [8, 128])")
    assert all(flag and other in message and "(as its hf_sparse_cp_sharded_state/ shows; TRL: --lora_target_modules "
               "q_proj v_proj --lora_r 4)" in message for message, flag in refused), refused
    # a LoRA run resumed with LoRA, as saved, is not refused
    assert run_gloo(_fsdp2_sharded_run, 2, str(tmp_path / "again"), checkpoint, LORA) == [(4,)] * 2


def test_a_model_only_checkpoint_is_refused_naming_its_weights(tmp_path):
    """--save_only_model keeps no optimizer, scheduler or RNG state; the resume went on silently with a new AdamW and
    a restarted schedule (the CP 2 demo's step 4: loss 4.565 where the run trained 4.335)."""
    trainer = _trainer(tmp_path / "run", save_only_model=True)
    trainer.train()
    assert json.loads((tmp_path / "run" / "checkpoint-2" / MARKER).read_text())["model_only"]
    resumed = _trainer(tmp_path / "resume")
    before = [p.detach().clone() for p in resumed.model.parameters()]
    with pytest.raises(ValueError, match="was saved with --save_only_model: .* not the optimizer, learning-rate "
                                         "schedule and random state.*--model_name_or_path .*checkpoint-2"):
        resumed.train(resume_from_checkpoint=str(tmp_path / "run" / "checkpoint-2"))
    assert all(torch.equal(a, b) for a, b in zip(before, resumed.model.parameters()))  # nothing was loaded


def test_an_output_folder_given_as_the_checkpoint_is_refused_naming_its_newest_checkpoint(saved, tmp_path):
    """--resume_from_checkpoint OUTPUT_DIR (the run's folder, not a checkpoint in it): a warning that it was not
    written by an hf-sparse-cp run, then the Trainer's "Can't find a valid checkpoint" traceback from every rank."""
    out, _ = saved
    trainer = _trainer(tmp_path)
    with pytest.raises(ValueError, match="is a run's output folder, not a checkpoint: it holds checkpoints "
                                         "\\(checkpoint-2, checkpoint-4\\). Resume from one of them, e.g. the newest "
                                         f"complete one: --resume_from_checkpoint {out / 'checkpoint-4'}"):
        trainer.train(resume_from_checkpoint=str(out))


def test_a_checkpoint_that_does_not_exist_is_refused_naming_one_that_does(saved, tmp_path):
    """A mistyped checkpoint: named with the newest of its folder's checkpoints, or how to give one."""
    out, _ = saved
    trainer = _trainer(tmp_path)
    # (a run stopped while saving checkpoint-6: get_last_checkpoint named it, which a resume refuses as incomplete)
    stopped = out / "checkpoint-6"
    stopped.mkdir()
    try:
        (stopped / MARKER).write_text(json.dumps({"complete": False, "step": 6}))
        with pytest.raises(ValueError, match="'.*checkpoint-3' does not exist: resume from one that does, e.g. the "
                                             f"newest there: --resume_from_checkpoint {out / 'checkpoint-4'}"):
            trainer.train(resume_from_checkpoint=str(out / "checkpoint-3"))
    finally:
        shutil.rmtree(stopped)
    with pytest.raises(ValueError, match="does not exist: give a checkpoint-N folder that a run saved in its "
                                         "--output_dir"):
        trainer.train(resume_from_checkpoint=str(tmp_path / "nowhere" / "checkpoint-3"))


def test_a_checkpoint_of_another_model_is_refused_naming_a_weight_and_its_shapes(saved, tmp_path):
    """The Trainer's load_state_dict raised "size mismatch" with a traceback from every rank (torchrun: exit 1)."""
    out, _ = saved
    trainer = _trainer(tmp_path, model_config={"intermediate_size": 96})
    before = [p.detach().clone() for p in trainer.model.parameters()]
    with pytest.raises(ValueError, match="checkpoint-2' was saved by another model: its model.layers.0.mlp.down_proj"
                                         ".weight is \\[128, 256\\], this model's \\[128, 96\\]. Resume with the "
                                         "model it was trained with.*--model_name_or_path"):
        trainer.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.model.parameters()))  # nothing was loaded


def test_resume_true_passes_over_an_incomplete_newest_checkpoint_for_the_newest_complete_one(saved, tmp_path, caplog):
    """A run that ended while saving leaves its newest folder in progress: resume_from_checkpoint=True (a requeued
    job's flag) took it, as the Trainer's choice, and the check refused it at every restart. It now resumes from the
    one before it, exactly, with a warning naming what it passed over; with none complete, an error naming them."""
    out, losses = saved
    subprocess.run(["cp", "-r", str(out), str(tmp_path / "run")], check=True)
    (tmp_path / "run" / "checkpoint-4" / MARKER).write_text(json.dumps({"complete": False, "step": 4}))
    trainer = _trainer(tmp_path / "run")
    with caplog.at_level("WARNING", logger="hf_sparse_cp.trainer.checkpoints"):
        trainer.train(resume_from_checkpoint=True)
    assert re.search("resuming from .*checkpoint-2, the newest complete checkpoint; passed over checkpoint-4 "
                     "\\(incomplete", caplog.text)
    assert _losses(trainer) == losses  # (the log of steps 1-2 comes with the checkpoint) as the uninterrupted run
    assert json.loads((tmp_path / "run" / "checkpoint-4" / MARKER).read_text())["complete"]  # saved anew

    (tmp_path / "run" / "checkpoint-2" / MARKER).write_text("{not json")
    (tmp_path / "run" / "checkpoint-4" / MARKER).write_text(json.dumps({"complete": False, "step": 4}))
    again = _trainer(tmp_path / "run")
    before = [p.detach().clone() for p in again.model.parameters()]
    with pytest.raises(ValueError, match="no complete checkpoint in .*run': checkpoint-4, checkpoint-2 are incomplete "
                                         ".*Delete them to train from the start"):
        again.train(resume_from_checkpoint=True)
    assert all(torch.equal(a, b) for a, b in zip(before, again.model.parameters()))  # nothing was loaded
    # none at all (a requeued job's first start): the Trainer's "No valid checkpoint found", a traceback per rank
    with pytest.raises(ValueError, match=r"holds no checkpoint \(checkpoint-N folder\) to resume from: drop "
                                         "--resume_from_checkpoint to train from the start") as refused:
        _trainer(tmp_path / "empty").train(resume_from_checkpoint=True)
    assert is_flag_error(refused.value)  # (under the launcher: the message once, exit status 2)


def test_resume_from_checkpoint_true_as_a_script_passes_it_takes_the_newest_complete_checkpoint(saved, tmp_path,
                                                                                                monkeypatch):
    """`--resume_from_checkpoint true` (docs/curriculum-and-checkpoints.md: a requeued job's usual flag) reaches
    `train()` as the string a script parsed, which was taken for a path: "Checkpoint 'true' does not exist". It is
    True (and "false" False) unless a folder has that name."""
    out, losses = saved
    subprocess.run(["cp", "-r", str(out), str(tmp_path / "run")], check=True)
    (tmp_path / "run" / "checkpoint-4" / MARKER).write_text(json.dumps({"complete": False, "step": 4}))
    trainer = _trainer(tmp_path / "run", resume_from_checkpoint="true")
    trainer.train(resume_from_checkpoint=trainer.args.resume_from_checkpoint)
    assert trainer.state.global_step == 4 and _losses(trainer) == losses
    fresh = _trainer(tmp_path / "fresh", max_steps=1)
    fresh.train(resume_from_checkpoint="False")  # (no checkpoint read: one step from the start)
    assert fresh.state.global_step == 1
    (tmp_path / "true").mkdir()  # a folder of that name is a path (here one that holds no checkpoint)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="^Can't find a valid checkpoint at true$"):  # (the Trainer's, on a path)
        _trainer(tmp_path / "other").train(resume_from_checkpoint="true")


def test_detach_removes_the_protection(tmp_path):
    trainer = _trainer(tmp_path)
    assert any(isinstance(cb, CheckpointMarkerCallback) for cb in trainer.callback_handler.callbacks)
    assert "train" in trainer.__dict__
    detach_from_trainer(trainer)
    assert not any(isinstance(cb, CheckpointMarkerCallback) for cb in trainer.callback_handler.callbacks)
    assert "train" not in trainer.__dict__


# ---- the CLI under CP 2 with SMET ---------------------------------------------------------------

JOB = ["--sparse_max_length", "256", "--num_samples", "8", "--sparse_min_seq_len", "128", "--sparse_block_size", "32",
       "--sparse_vertical_topk", "8", "--sparse_slash_topk", "8", "--sparse_local_window", "32", "--sparse_sink_tokens",
       "4", "--sparse_last_q", "16", "--smet", "--smet_density", "0.5", "--smet_update_interval", "2",
       "--save_strategy", "steps", "--save_steps", "2"]


def _argv(out, nproc: int, *flags: str) -> list[str]:
    return ["train", "--nproc", str(nproc), *JOB, *flags, "--output_dir", str(out), "--summary_file",
            str(out / "summary.json")]


def _cli(out, nproc: int, *flags: str) -> subprocess.CompletedProcess:
    return launch_cli(_argv(out, nproc, *flags))


def _cli_forked(out, nproc: int, *flags: str) -> subprocess.CompletedProcess:
    """`_cli` without the launch (`run_cli`), for the runs a test does not launch for the launcher's sake."""
    return run_cli(_argv(out, nproc, *flags), nproc)


def _resumes_exactly(tmp_path, checkpoint: str) -> None:
    """Resumed from `checkpoint` (step 2 of the run in tmp_path/full), as launched and under head parallelism, the
    run continues as the full run did, and its model card says so."""
    want = json.loads((tmp_path / "full" / "summary.json").read_text())["losses"]
    # the resume as launched (torchrun): the command line's one real launch here
    resumed = _cli(tmp_path / "resumed", 2, "--cp_size", "2", "--max_steps", "4",
                   "--resume_from_checkpoint", checkpoint)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    # `hf-sparse-cp train` ends with the model card: how the run trained, counting distinct sequences
    card = (tmp_path / "resumed" / "README.md").read_text()
    for stated in ("| sequence length | 256 tokens |", "CP 2 x DP 1", "SMET (sparse_weights, density 0.5",
                   "total_train_batch_size: 1 (distinct sequences", "vertical-slash (MTraining)", "- hf-sparse-cp"):
        assert stated in card, stated
    assert (tmp_path / "resumed" / "sparse_kept_fraction.png").is_file()
    # the Trainer's final loss of a resumed run averages the steps after the resume (said 'mean over the run')
    assert "Final training loss (mean over steps 3-4, trained after resuming from step 2): **" in card
    assert "Final training loss (mean over the run): **" in (tmp_path / "full" / "README.md").read_text()
    got = json.loads((tmp_path / "resumed" / "summary.json").read_text())["losses"]
    assert len(got) == len(want) == 4
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < 1e-6, (got, want)
    # the training state does not depend on how the CP group shares attention: a ring checkpoint resumes
    # under head parallelism
    heads = _cli_forked(tmp_path / "heads", 2, "--cp_size", "2", "--cp_mode", "ulysses", "--max_steps", "4",
                        "--resume_from_checkpoint", checkpoint)
    assert heads.returncode == 0, heads.stderr[-3000:]
    got = json.loads((tmp_path / "heads" / "summary.json").read_text())["losses"]
    assert max(abs(a - b) / abs(b) for a, b in zip(got, want)) < 1e-6, (got, want)


def test_cp2_smet_resume_continues_exactly_and_mismatches_are_refused(tmp_path):
    full = _cli_forked(tmp_path / "full", 2, "--cp_size", "2", "--max_steps", "4")
    assert full.returncode == 0, full.stderr[-3000:]
    checkpoint = str(tmp_path / "full" / "checkpoint-2")
    if transformers_release() >= CPU_PROCESSES_RESUME_SINCE:
        _resumes_exactly(tmp_path, checkpoint)
    else:  # (its Trainer cannot load 2 CPU processes' optimizer state: refused before training, naming the upgrade)
        resumed = _cli_forked(tmp_path / "resumed", 2, "--cp_size", "2", "--max_steps", "4",
                              "--resume_from_checkpoint", checkpoint)
        assert resumed.returncode == 2 and "Upgrade transformers to 5.18 or later" in resumed.stderr, resumed.stderr
    # the state of a run without FSDP is whole: one process (CP 1, the same global batch) continues it alike
    one = _cli_forked(tmp_path / "one", 1, "--max_steps", "4", "--resume_from_checkpoint", checkpoint)
    assert one.returncode == 0, one.stderr[-3000:]
    got, want = (json.loads((tmp_path / run / "summary.json").read_text())["losses"] for run in ("one", "full"))
    assert len(got) == len(want) == 4 and max(abs(a - b) / abs(b) for a, b in zip(got, want)) < 1e-6, (got, want)
    # a checkpoint that does not fit the run's flags is refused as a bad flag: the message, once, status 2
    density = _cli_forked(tmp_path / "density", 2, "--cp_size", "2", "--max_steps", "4", "--smet_density", "0.25",
                          "--resume_from_checkpoint", checkpoint)
    assert density.returncode == 2 and density.stderr.count("was saved with smet=") == 1
    assert "'density': 0.5" in density.stderr
    assert "Traceback" not in density.stderr, density.stderr


def test_the_sharded_training_state_names_weights_and_optimizer_tensors_and_refuses_other_state():
    from hf_sparse_cp.resharding.resume import training_state

    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    state = training_state(model, opt)
    assert sorted(state) == ["model/bias", "model/weight", *(f"optim/{i}/{k}" for i in (0, 1)
                                                            for k in ("exp_avg", "exp_avg_sq", "step"))]
    assert torch.equal(state["optim/1/exp_avg"], opt.state[model.bias]["exp_avg"])
    opt.state[model.bias]["note"] = 1.0  # not a tensor: it could not be laid out for other processes
    with pytest.raises(TypeError, match="optimizer state 'note' of parameter 1 is a float"):
        training_state(model, opt)


@pytest.mark.parametrize("saved_schedule", [True, False], ids=["curriculum_saved", "curriculum_resumed"])
def test_a_curriculum_checkpoint_and_a_plain_one_do_not_resume_each_other(tmp_path, saved_schedule):
    """A curriculum's FSDP2 checkpoint resumed by a run without --cp_schedule was accepted whatever its global batch:
    the two runs record other settings (world size and batch vs CP and DP degrees and global batch), and compared key
    by key under a sharded state every one was skipped, so the step counter went on over another data order."""
    from hf_sparse_cp.resharding.resume import SHARDED_STATE
    from hf_sparse_cp.trainer.checkpoints import check_checkpoint, read_marker

    curriculum = {"cp_schedule": "0:128:1,3:256:2", "world_size": 4, "smet": None, "world_batch_size": 4}
    plain = {"cp_size": 1, "data_parallel_size": 2, "smet": None, "global_batch_size": 6}
    saved, resumed = (curriculum, plain) if saved_schedule else (plain, curriculum)
    folder = tmp_path / "checkpoint-4"
    (folder / SHARDED_STATE).mkdir(parents=True)
    (folder / SHARDED_STATE / "layout.json").write_text("{}")
    (folder / MARKER).write_text(json.dumps({"complete": True, "step": 4, "settings": saved, "files": {}}))
    # (its own settings resume through the sharded state)
    assert check_checkpoint(folder, saved, read_marker(folder), reshardable=True)
    schedule = "--cp_schedule '0:128:1,3:256:2'"
    cause = (f"was saved by a run with {schedule}, but this run has no --cp_schedule" if saved_schedule
             else f"was saved by a run with no --cp_schedule, but this run has {schedule}")
    with pytest.raises(ValueError, match=re.escape(cause)):
        check_checkpoint(folder, resumed, read_marker(folder), reshardable=True)


FSDP2 = ("--fsdp",
         "--fsdp_config", '{"version": 2, "transformer_layer_cls_to_wrap": ["Qwen2DecoderLayer"]}')


def test_fsdp2_smet_checkpoints_resume_from_4_processes_on_2_and_on_cp_2_with_the_same_global_batch(tmp_path):
    """Saved by 4 FSDP2 processes (batch 1 each) at step 2, resumed by 2 (batch 2 each: the same 4 sequences
    a step), whose step-4 checkpoint 4 processes resume again as CP 2 x DP 2 (batch 2 per CP group): each
    time the sharded state is laid out for the new processes, the scheduler and step counter continue, and
    the steps after the resume and the final weights are those of the uninterrupted 4-process run."""
    from safetensors.torch import load_file

    from hf_sparse_cp.resharding.checkpoint import read_layout
    from hf_sparse_cp.resharding.resume import SHARDED_STATE

    steps = ("--max_steps", "6", "--num_samples", "24", *FSDP2)
    full = _cli_forked(tmp_path / "full", 4, *steps)
    assert full.returncode == 0, full.stderr[-3000:]
    # the state once, as each rank holds it (plus the portable model.safetensors): no gathered copies
    saved = {p.name for p in (tmp_path / "full" / "checkpoint-2").iterdir()}
    assert {SHARDED_STATE, "model.safetensors", "scheduler.pt"} <= saved, saved
    assert not saved & {"optimizer.bin", "pytorch_model_fsdp.bin", "optimizer.pt"}, saved
    on_2 = _cli_forked(tmp_path / "on_2", 2, *steps, "--per_device_train_batch_size", "2",
                       "--resume_from_checkpoint", str(tmp_path / "full" / "checkpoint-2"))
    assert on_2.returncode == 0, on_2.stderr[-3000:]
    assert read_layout(tmp_path / "on_2" / "checkpoint-4" / SHARDED_STATE)[0] == 2
    on_4 = _cli_forked(tmp_path / "on_4", 4, *steps, "--cp_size", "2", "--per_device_train_batch_size", "2",
                       "--resume_from_checkpoint", str(tmp_path / "on_2" / "checkpoint-4"))
    assert on_4.returncode == 0, on_4.stderr[-3000:]
    want = json.loads((tmp_path / "full" / "summary.json").read_text())
    for run, world, cp, resumed_at in (("on_2", 2, 1, 2), ("on_4", 4, 2, 4)):
        got = json.loads((tmp_path / run / "summary.json").read_text())
        assert got["world_size"] == world and got["cp_size"] == cp and got["fsdp2_modules"] >= 3
        # The steps before the resume come from the saved trainer state; those after it were trained here. A
        # step's gradient is the same sum in fp32, reduced in another order (4 ranks of 1 row vs 2 of 2 rows):
        # a few ulps, which Adam's normalised update passes on at about lr x that relative size. A step of the
        # wrong learning rate, moment or weight would move the loss by orders of magnitude more.
        assert len(got["losses"]) == 6 and got["losses"][:2] == want["losses"][:2], run
        assert got["losses"][resumed_at:] == pytest.approx(want["losses"][resumed_at:], rel=1e-5), run
        final, ref = (load_file(tmp_path / name / "checkpoint-6" / "model.safetensors") for name in (run, "full"))
        assert final.keys() == ref.keys()
        for name, weight in ref.items():
            # atol: ~8 ulps at the weights' magnitude (~1), 2000x below one step's change (lr 2e-3)
            torch.testing.assert_close(final[name], weight, rtol=1e-5, atol=1e-6, msg=f"{run} {name}")
    # (another global batch is refused before anything loads: test_a_damaged_or_mismatched_checkpoint_is_refused...)


def test_an_fsdp2_curriculum_checkpoint_resumes_on_another_world_size_with_every_stage_batch_kept(tmp_path):
    """A curriculum (CP 1, then CP 2 from step 3) saved by 4 FSDP2 processes (batch 1 each) in its second
    stage resumes on 2 processes with batch 2 each: every stage's global batch is the saved one (4 and 2
    sequences a step), so the steps after the resume and the final weights are the uninterrupted run's.
    With the per-device batch left at 1 the resume is refused, naming the batch that fits."""
    from safetensors.torch import load_file

    steps = ("--max_steps", "6", "--num_samples", "24", "--cp_schedule", "0:128:1,3:256:2", *FSDP2)
    full = _cli_forked(tmp_path / "full", 4, *steps)
    assert full.returncode == 0, full.stderr[-3000:]
    checkpoint = str(tmp_path / "full" / "checkpoint-4")
    assert json.loads((tmp_path / "full" / "checkpoint-4" / MARKER).read_text())["settings"]["world_batch_size"] == 4
    on_2 = _cli_forked(tmp_path / "on_2", 2, *steps, "--per_device_train_batch_size", "2",
                       "--resume_from_checkpoint", checkpoint)
    assert on_2.returncode == 0, on_2.stderr[-3000:]
    want = json.loads((tmp_path / "full" / "summary.json").read_text())["losses"]
    got = json.loads((tmp_path / "on_2" / "summary.json").read_text())["losses"]
    assert len(got) == 6 and got[:4] == want[:4]
    assert got[4:] == pytest.approx(want[4:], rel=1e-5)  # (fp32 reduction order, as for the DP change above)
    final, ref = (load_file(tmp_path / name / "checkpoint-6" / "model.safetensors") for name in ("on_2", "full"))
    for name, weight in ref.items():
        torch.testing.assert_close(final[name], weight, rtol=1e-5, atol=1e-6, msg=name)
    same = _cli_forked(tmp_path / "same", 4, *steps, "--resume_from_checkpoint", checkpoint)  # the saved layout: exact
    assert same.returncode == 0, same.stderr[-3000:]
    assert json.loads((tmp_path / "same" / "summary.json").read_text())["losses"] == want
    # (2 processes with the batch that fits them: only the missing FSDP2 differs)
    without_fsdp = _cli_forked(tmp_path / "ddp", 2, *steps[:-len(FSDP2)], "--per_device_train_batch_size", "2",
                               "--resume_from_checkpoint", checkpoint)
    assert without_fsdp.returncode != 0 and "only a run with FSDP2 loads it" in without_fsdp.stderr
    refused = _cli_forked(tmp_path / "refused", 2, *steps, "--resume_from_checkpoint", checkpoint)
    assert refused.returncode != 0
    assert "was saved with 4 sequences per step at CP 1" in refused.stderr, refused.stderr[-3000:]
    assert "Set --per_device_train_batch_size 2 --gradient_accumulation_steps 1" in refused.stderr


@pytest.mark.parametrize("strategy", ["steps", "epoch"])
def test_a_save_that_fails_midway_leaves_a_checkpoint_marked_incomplete(tmp_path, strategy):
    """The marker says "in progress" before the Trainer writes a file (at the step or epoch end where it
    decides to save), so a save that dies halfway is refused on resume, not loaded."""
    # (an epoch is 8 steps of the 16 rows)
    trainer = _trainer(tmp_path / "run", **({"save_strategy": "epoch", "max_steps": 8} if strategy == "epoch" else {}))

    def dies_midway(model, trial):
        folder = tmp_path / "run" / f"checkpoint-{trainer.state.global_step}"
        (folder / "model.safetensors").write_bytes(b"partial")
        raise RuntimeError("the disk filled up")

    trainer._save_checkpoint = dies_midway
    with pytest.raises(RuntimeError, match="disk filled up"):
        trainer.train()
    (folder,) = (tmp_path / "run").glob("checkpoint-*")
    assert not json.loads((folder / MARKER).read_text())["complete"]
    with pytest.raises(ValueError, match="is incomplete"):
        _trainer(tmp_path / "resume").train(resume_from_checkpoint=str(folder))


@pytest.mark.parametrize("stops", ["optimizer", "weights"])
def test_a_save_stopped_by_the_file_size_limit_names_the_file_and_the_cause(saved, tmp_path, stops):
    """A checkpoint file that reaches `ulimit -f` fails inside torch.save ("unexpected pos ...") or safetensors
    (which removes its partial file): the error names the checkpoint, the file being written (or the writer's words),
    the limit and the fix, and the checkpoint stays marked incomplete."""
    import resource

    from hf_sparse_cp.trainer.checkpoints import CheckpointSaveError

    sizes = {name: (saved[0] / "checkpoint-2" / name).stat().st_size for name in ("model.safetensors", "optimizer.pt")}
    assert sizes["model.safetensors"] < sizes["optimizer.pt"]
    limit = sum(sizes.values()) // 2 if stops == "optimizer" else sizes["model.safetensors"] // 2
    trainer = _trainer(tmp_path / "run", max_steps=1, save_steps=1)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        with pytest.raises(CheckpointSaveError) as failed:
            trainer.train()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    folder = tmp_path / "run" / "checkpoint-1"
    message = str(failed.value)
    written = "optimizer.pt" if stops == "optimizer" else "a file of it (removed by its writer, which said: "
    assert message.startswith(f"Saving checkpoint '{folder}' failed: {written}")
    assert f"reached this process's file-size limit of {limit:,} bytes (ulimit -f)" in message
    assert "ulimit -f unlimited" in message and "marked incomplete" in message
    assert not json.loads((folder / MARKER).read_text())["complete"]


def test_a_save_stopped_by_a_full_disk_names_it(tmp_path, monkeypatch):
    """The same for a full disk (its free space faked here, after torch.save's own error)."""
    import shutil

    from hf_sparse_cp.trainer.checkpoints import CheckpointSaveError

    trainer = _trainer(tmp_path / "run", max_steps=1, save_steps=1)
    real_save = torch.save

    def fills_the_disk(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10 << 30, 10 << 30, 4096))
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1520000 vs 1519888")

    monkeypatch.setattr(torch, "save", fills_the_disk)
    with pytest.raises(CheckpointSaveError, match=r"checkpoint-1' failed: the disk holding it is full \(4,096 bytes "
                                                  r"free\) \(the last file written: \S+\): free space"):
        trainer.train()


class LongRowsFirst(torch.utils.data.IterableDataset):
    """Rows in order (no sampler): the first four hold 64 real tokens, the rest 24 (then padding)."""

    def __iter__(self):
        for i in range(16):
            ids = torch.arange(64).add(i).remainder(250).add(3)
            mask = torch.arange(64) < (64 if i < 4 else 24)
            yield {"input_ids": ids, "labels": torch.where(mask, ids, -100), "attention_mask": mask.long()}


def _longest_trained(trainer) -> int | None:
    from hf_sparse_cp.trainer.callbacks import StepMetricsCallback

    return next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, StepMetricsCallback)).longest_trained


def test_the_longest_row_trained_survives_a_resume(tmp_path, monkeypatch):
    """The model card's longest sequence trained restarted at a resume: a run whose 64-token rows came before its
    checkpoint and 24-token rows after it said 24 when resumed (the uninterrupted run: 64). The resume reads the
    checkpoint's marker once, for its checks and for this (#50: twice)."""
    from hf_sparse_cp.trainer.checkpoints import MARKER

    def trainer(out):
        t = _trainer(out, logging_steps=3)  # (no training log at the checkpoint's step)
        t.train_dataset = LongRowsFirst()
        return t

    full = trainer(tmp_path / "full")
    full.train()
    assert _longest_trained(full) == 64
    resumed = trainer(tmp_path / "resumed")
    reads, read_text = [], Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: (reads.append(self.name), read_text(self, *a, **k))[1])
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert _longest_trained(resumed) == 64
    assert reads.count(MARKER) == 1


def test_every_node_that_saves_marks_its_checkpoint(tmp_path):
    """With save_on_each_node, the first process of every node saves the checkpoint into its node's folder (the
    Trainer's `should_save`); only global rank 0 wrote the marker, so a second node without shared storage resumed
    its checkpoint unchecked ("not written by an hf-sparse-cp run")."""
    from types import SimpleNamespace

    trainer = _trainer(tmp_path)
    marker = next(cb for cb in trainer.callback_handler.callbacks if isinstance(cb, CheckpointMarkerCallback))
    (tmp_path / "checkpoint-2").mkdir()
    (tmp_path / "checkpoint-2" / "model.safetensors").write_bytes(b"x" * 10)
    (tmp_path / "checkpoint-2" / MARKER).with_suffix(".123.tmp").write_text("{")  # (another node's, being written)
    # a second node's first process
    args = SimpleNamespace(output_dir=str(tmp_path), should_save=True, save_only_model=False, save_total_limit=None)
    state = SimpleNamespace(global_step=2, is_world_process_zero=False, best_model_checkpoint=None)
    marker.on_step_end(args, state, SimpleNamespace(should_save=True))
    assert json.loads((tmp_path / "checkpoint-2" / MARKER).read_text()) == {"complete": False, "step": 2}
    marker.on_save(args, state, None)
    written = json.loads((tmp_path / "checkpoint-2" / MARKER).read_text())
    assert written["complete"] and written["files"] == {"model.safetensors": 10}
    args.should_save = False  # (the node's other processes)
    os.remove(tmp_path / "checkpoint-2" / MARKER)
    marker.on_save(args, state, None)
    assert not (tmp_path / "checkpoint-2" / MARKER).exists()


def test_a_curriculum_with_smet_resumes_before_and_after_a_cp_switch_as_the_uninterrupted_run(tmp_path):
    """CP 2 -> CP 1 (128 tokens) from step 3 -> CP 2 from step 5 on 2 processes, with SMET's gradient regrowth and
    gradient accumulation 2, the first step of the CP 1 stage a topology update (every 2 steps): resumed from its
    step-2 checkpoint (before the switches) and its step-4 one (between them), each run takes every later step in
    its stage and continues exactly: the losses and SMET's logs of every step, the final weights and the optimizer
    state (the masks, Adam's moments, the blocks' step counts) are the uninterrupted run's."""
    from safetensors.torch import load_file

    steps = ("--max_steps", "6", "--cp_schedule", "0:256:2,3:128:1,5:256:2", "--gradient_accumulation_steps", "2",
             "--smet_regrowth", "gradient")
    runs = {"full": _cli_forked(tmp_path / "full", 2, *steps)}
    for saved in (2, 4):
        runs[saved] = _cli_forked(tmp_path / str(saved), 2, *steps, "--resume_from_checkpoint",
                                  str(tmp_path / "full" / f"checkpoint-{saved}"))
    for run in runs.values():
        assert run.returncode == 0, run.stderr[-3000:]

    def logged(name):  # what each step logged, less what time measures
        history = json.loads((tmp_path / name / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
        return [{k: v for k, v in log.items() if k not in ("tokens_per_second", "peak_memory_gib")}
                for log in history if "loss" in log]

    want = logged("full")
    assert [log["smet/topology_updates"] for log in want] == [0, 1, 1, 2, 2, 3]
    for saved in (2, 4):
        got = logged(str(saved))
        assert got == want, (saved, got, want)  # (the steps before the resume come with the checkpoint's state)
        for file in ("model.safetensors", "optimizer.pt"):
            final, ref = (tmp_path / name / "checkpoint-6" / file for name in (str(saved), "full"))
            final, ref = ((load_file(f) if file.endswith("safetensors") else torch.load(f, weights_only=False))
                          for f in (final, ref))
            if file == "optimizer.pt":
                assert ref["state"][0].keys() >= {"block_index", "block_step", "exp_avg", "exp_avg_sq"}
                assert final["param_groups"] == ref["param_groups"]
                final, ref = ({f"{i}/{k}": v for i, state in o["state"].items() for k, v in state.items()}
                              for o in (final, ref))
            assert final.keys() == ref.keys()
            for key, value in ref.items():
                assert torch.equal(final[key], value), (saved, file, key)
