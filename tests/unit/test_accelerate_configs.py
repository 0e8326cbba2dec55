"""accelerate launch configs this machine cannot run, refused by `hf-sparse-cp launch` / `train` once, before any
process starts, naming the fix (`launch/accelerate_config.py`): gpu_ids that leave a process without an
accelerator (or that accelerate launch cannot read), FSDP1 or DeepSpeed where they cannot run."""

import importlib.util
import json

import pytest
import torch
from transformers import HfArgumentParser

from hf_sparse_cp import SparseTrainingArguments, cli
from hf_sparse_cp.launch import accelerate_config, processes
from hf_sparse_cp.launch.accelerate_config import config_mistake
from hf_sparse_cp.trainer import sparse_trainer
from hf_sparse_cp.trainer.arguments import is_flag_error
from hf_sparse_cp.trainer.plugin_arguments import parsing_for_launch

BASE = {"compute_environment": "LOCAL_MACHINE", "num_machines": 1, "machine_rank": 0, "use_cpu": False}
MULTI_GPU = {**BASE, "distributed_type": "MULTI_GPU", "num_processes": 2}
FSDP1 = {**BASE, "distributed_type": "FSDP", "num_processes": 2,
         "fsdp_config": {"fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP", "fsdp_state_dict_type": "FULL_STATE_DICT"}}
FSDP2 = {**FSDP1, "fsdp_config": {**FSDP1["fsdp_config"], "fsdp_version": 2}}
DEEPSPEED = {**BASE, "distributed_type": "DEEPSPEED", "num_processes": 2, "deepspeed_config": {"zero_stage": 2}}


@pytest.fixture
def machine(monkeypatch, tmp_path):
    """Run `cli.main` on a machine of N accelerators (`machine(N)`) where nothing starts (the commands it would
    start are returned); the configs are written to tmp_path."""
    monkeypatch.chdir(tmp_path)
    for name in ("WORLD_SIZE", *accelerate_config.VISIBILITY_ENV):
        monkeypatch.delenv(name, raising=False)
    started = []
    monkeypatch.setattr(processes, "run_forwarding_signals", lambda command, env=None: started.append(command) or 0)
    (tmp_path / "train.py").write_text("")

    def on(accelerators: int):
        monkeypatch.setattr(torch.accelerator, "device_count", lambda: accelerators)
        return started
    return on


def _launch(capsys, tmp_path, config: dict, *args: str, command: str = "launch") -> str | None:
    """The error `hf-sparse-cp COMMAND --config_file config.json ARGS` ends with; None when it launches."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    script = ["train.py"] if command == "launch" else ["--max_steps", "1"]
    argv = [command, "--config_file", "config.json", *args, *script] if command == "launch" else [
        command, "--config_file", "config.json", *script, *args]
    try:
        assert cli.main(argv) == 0
    except SystemExit as e:
        assert e.code == 2, e.code
        err = capsys.readouterr().err
        usage = cli.LAUNCH_USAGE if command == "launch" else cli.TRAIN_USAGE
        assert err.startswith(f"usage: {usage}\nhf-sparse-cp {command}: error: "), err
        return err.split("error: ", 1)[1].removeprefix("--config_file config.json ")
    return None


def test_gpu_ids_that_leave_a_process_without_its_accelerator_are_refused_before_any_starts(machine, capsys,
                                                                                             tmp_path):
    """accelerate launch passes gpu_ids as CUDA_VISIBLE_DEVICES: fewer ids than processes per machine, an id listed
    twice or one the machine lacks left processes without a device of their own (each failing after all had
    started); gpu_ids as a YAML number or list ended in accelerate's AttributeError, one id on its multi-GPU launcher
    in its ValueError."""
    started = machine(4)
    four = {**MULTI_GPU, "num_processes": 4}
    refused = {
        "0,1": (four, "starts 4 processes per machine, each on an accelerator of its own, and its gpu_ids \"0,1\" "
                "lists 2: list 4 ids, e.g. gpu_ids: \"0,1,2,3\", or gpu_ids: all, or set its num_processes to 2."),
        "0,0": (MULTI_GPU, "lists accelerator 0 more than once in its gpu_ids \"0,0\", and each process takes an "
                "accelerator of its own: list 2 ids, e.g. gpu_ids: \"0,1\", or gpu_ids: all."),
        "3,4": (MULTI_GPU, "names accelerator 4 in its gpu_ids \"3,4\", and this machine has 4 "
                "(torch.accelerator.device_count()), ids 0 to 3: list 2 of those, or gpu_ids: all."),
        "0,,1": (MULTI_GPU, "has an empty id in its gpu_ids \"0,,1\": list 2 ids, e.g. gpu_ids: \"0,1\", or gpu_ids: "
                 "all."),
        "0": (MULTI_GPU, "runs on accelerate's multi-GPU launcher (MULTI_GPU), which refuses fewer than two gpu_ids "
              "on one machine, and its gpu_ids \"0\" names one: list 2 ids, e.g. gpu_ids: \"0,1\", or gpu_ids: all."),
        0: ({**MULTI_GPU, "distributed_type": "MULTI_CPU"}, "sets gpu_ids: 0, which accelerate launch reads as a "
            "string of comma-separated accelerator ids: write it quoted (gpu_ids: \"0\"), or gpu_ids: all."),
        (0, 1): (FSDP2, "sets gpu_ids: [0, 1], which accelerate launch reads as a string of comma-separated "
                 "accelerator ids: write it quoted (gpu_ids: \"0,1\"), or gpu_ids: all."),
    }
    for gpu_ids, (config, message) in refused.items():
        given = list(gpu_ids) if isinstance(gpu_ids, tuple) else gpu_ids
        assert _launch(capsys, tmp_path, {**config, "gpu_ids": given}) == message + "\n", gpu_ids
    assert _launch(capsys, tmp_path, {**four, "gpu_ids": "0,1"}, command="train") == refused["0,1"][1] + "\n"
    assert not started
    for config in ({**four, "gpu_ids": "3,2,1,0"}, {**MULTI_GPU, "gpu_ids": "all"}, {**MULTI_GPU, "gpu_ids": "2, 3"},
                   {**four, "gpu_ids": "0,1", "use_cpu": True}):
        assert _launch(capsys, tmp_path, config) is None, config
    # ids count from the machine's first accelerator, which a visibility variable hides from this process's count
    assert _launch(capsys, tmp_path, {**MULTI_GPU, "gpu_ids": "4,5"}) is not None
    with pytest.MonkeyPatch.context() as env:
        env.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
        assert _launch(capsys, tmp_path, {**MULTI_GPU, "gpu_ids": "4,5"}) is None
    # without accelerators, the processes of a config without parallelism_config run on the CPU: ids do not matter
    machine(0)
    assert _launch(capsys, tmp_path, {**four, "gpu_ids": "0,1"}) is None
    assert len(started) == 6


def test_fsdp1_without_accelerators_is_refused_before_any_starts(machine, capsys, tmp_path):
    """An FSDP config without fsdp_version: 2 (accelerate's default is 1) started every process on a machine without
    accelerators, each then failing in accelerate's FSDP plugin ('There are currently no available devices found')
    or, without sync_module_states, in FSDP1's wrap ('Inconsistent compute device'); FSDP2 trains there."""
    started = machine(0)
    message = ("runs FSDP version 1 (its fsdp_config's fsdp_version; accelerate's default is 1), which accelerate runs "
               "only on accelerators, and this machine has none: set fsdp_version: 2 in its fsdp_config (FSDP2, which "
               "the plugin runs on CPU processes over gloo).\n")
    for command in ("launch", "train"):
        assert _launch(capsys, tmp_path, FSDP1, command=command) == message
    assert not started
    assert _launch(capsys, tmp_path, FSDP2) is None
    machine(2)
    assert _launch(capsys, tmp_path, FSDP1) is None
    assert len(started) == 2


def test_fsdp1_in_a_process_without_accelerator_is_refused_as_its_flags_parse(tmp_path, monkeypatch):
    """What a process that `accelerate launch` or torchrun started meets at its parser (the launcher's check stands
    for it under `hf-sparse-cp`), before its data: FSDP1 from the accelerate config's variables or from --fsdp."""
    monkeypatch.setattr(sparse_trainer, "_has_accelerator", lambda: False)

    def parse(*flags):
        with parsing_for_launch():  # (as one of several processes: --fsdp is not refused for running alone)
            return HfArgumentParser(SparseTrainingArguments).parse_args_into_dataclasses(
                ["--output_dir", str(tmp_path), "--report_to", "none", *flags])

    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    parse()  # (alone: what an Accelerator built with an FSDP plugin leaves in its process, not a launch's config)
    monkeypatch.setenv("FSDP_VERSION", "1")  # (`accelerate launch` of a config without fsdp_version)
    with pytest.raises(ValueError, match=r"^FSDP version 1 \(the accelerate config's fsdp_version; accelerate's "
                       r"default is 1\) runs only on accelerators, and this machine has none: set fsdp_version: 2 in "
                       "the accelerate config's fsdp_config") as refused:
        parse()
    assert is_flag_error(refused.value)  # (a launched run ends with the message alone, once)
    monkeypatch.setenv("FSDP_VERSION", "2")
    parse()
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    with pytest.raises(ValueError, match=r"^FSDP version 1 \(--fsdp_config's version\) runs only on accelerators, "
                       "and this machine has none: set --fsdp_config '{\"fsdp_version\": 2}'"):
        parse("--fsdp", "full_shard auto_wrap", "--fsdp_config", '{"version": 1}')
    parse("--fsdp", "full_shard auto_wrap")  # (transformers' default: FSDP2)


@pytest.mark.parametrize("flags, variable, message", [
    # the run trained to its end, then failed: 'No such file or directory: .../checkpoint-4/pytorch_model_fsdp.bin'
    # (its best checkpoint's FSDP state, which --save_only_model does not save)
    (("--eval_strategy", "steps", "--save_strategy", "steps", "--save_only_model", "true", "--load_best_model_at_end",
      "true"), None, r"^--load_best_model_at_end under FSDP reloads the best checkpoint's FSDP state "
     r"\(pytorch_model_fsdp.bin\), which --save_only_model does not save: drop --save_only_model or "
     r"--load_best_model_at_end\.$"),
    # the run trained with both on
    (("--activation_checkpointing", "true"), ("FSDP_ACTIVATION_CHECKPOINTING", "true"),
     r"^--activation_checkpointing and FSDP's own activation checkpointing \(activation_checkpointing in the FSDP "
     r"config\) cannot both be on: drop --activation_checkpointing"),
    # the run trained and marked each checkpoint complete holding no weights (#50; the Trainer refuses the pair where
    # FSDP runs on accelerators): FSDP2's default state dict type, from an accelerate config, is sharded
    (("--save_strategy", "steps", "--save_only_model", "true"), ("FSDP_STATE_DICT_TYPE", "SHARDED_STATE_DICT"),
     r"^--save_only_model under FSDP with a sharded state_dict_type saves checkpoints without the model's weights "
     r"\(the Trainer refuses the pair where FSDP runs on accelerators\): set "),
], ids=["save_only_model-load_best", "two-checkpointings", "save_only_model-sharded"])
def test_what_the_trainer_refuses_under_fsdp_is_refused_without_accelerator_as_the_flags_parse(
        tmp_path, monkeypatch, flags, variable, message):
    """The Trainer refuses these under FSDP as it builds its accelerator; on CPU processes FSDP2 starts after that
    (`enable_cpu_fsdp2`), so they passed: from --fsdp and from an accelerate config's variables."""
    monkeypatch.setattr(sparse_trainer, "_has_accelerator", lambda: False)

    def parse(*more):
        with parsing_for_launch():
            return HfArgumentParser(SparseTrainingArguments).parse_args_into_dataclasses(
                ["--output_dir", str(tmp_path), "--report_to", "none", *flags, *more])

    # (the variable's setting in --fsdp_config: FSDP_ACTIVATION_CHECKPOINTING=true as activation_checkpointing: True)
    setting = {variable[0][len("FSDP_"):].lower(): variable[1] == "true" or variable[1]} if variable else {}
    fsdp_config = {"version": 2, **setting}
    with pytest.raises(ValueError, match=message) as refused:
        parse("--fsdp", "full_shard", "--fsdp_config", json.dumps(fsdp_config))
    assert is_flag_error(refused.value)
    parse()  # (without FSDP the Trainer reloads model.safetensors, checkpoints once)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # `accelerate launch` of an FSDP2 config
    monkeypatch.setenv("FSDP_VERSION", "2")
    if variable:
        monkeypatch.setenv(*variable)
    with pytest.raises(ValueError, match=message):
        parse()


@pytest.mark.parametrize("variable, flags, message", [
    ("FSDP_ACTIVATION_CHECKPOINTING", ("--activation_checkpointing", "true"),
     r"^--activation_checkpointing and FSDP's own activation checkpointing"),
    ("FSDP_OFFLOAD_PARAMS", (), r"set fsdp_offload_params: false in the accelerate config\.$"),
], ids=["two-checkpointings", "offload"])
def test_an_accelerate_configs_fsdp_setting_under_the_fsdp_flag_is_refused_without_accelerator(
        tmp_path, monkeypatch, variable, flags, message):
    """`accelerate launch` of an FSDP config beside --fsdp: the FSDP plugin takes what --fsdp and --fsdp_config leave
    unset from the config's FSDP_* variables, and the refusals read --fsdp's alone, so both checkpointings trained on
    (the plugin built from these flags held activation_checkpointing=True), and CPU offload passed to fail in
    `train()`."""
    monkeypatch.setattr(sparse_trainer, "_has_accelerator", lambda: False)
    for name, value in (("ACCELERATE_USE_FSDP", "true"), ("FSDP_VERSION", "2"), (variable, "true")):
        monkeypatch.setenv(name, value)
    with parsing_for_launch(), pytest.raises(ValueError, match=message) as refused:
        HfArgumentParser(SparseTrainingArguments).parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--report_to", "none", "--fsdp", "full_shard", "--fsdp_config",
             '{"version": 2}', *flags])
    assert is_flag_error(refused.value)


def test_fsdp_cpu_offload_in_a_process_without_accelerator_is_refused_as_its_flags_parse(tmp_path, monkeypatch):
    """`--fsdp "full_shard auto_wrap offload"` (or an accelerate config's fsdp_offload_params) on CPU processes passed
    the flags and failed in `train()` as FSDP2 sharded the model, after the data: 'Cannot access accelerator device
    when none is available' (its offload pins the parameters in host memory for an accelerator)."""
    monkeypatch.setattr(sparse_trainer, "_has_accelerator", lambda: False)

    def parse(*flags):
        with parsing_for_launch():
            return HfArgumentParser(SparseTrainingArguments).parse_args_into_dataclasses(
                ["--output_dir", str(tmp_path), "--report_to", "none", *flags])

    for flags in (("--fsdp", "full_shard auto_wrap offload"),
                  ("--fsdp", "full_shard auto_wrap", "--fsdp_config", '{"cpu_offload": true}')):
        with pytest.raises(ValueError, match=r"^FSDP's CPU offload pins the parameters in host memory for an "
                           r"accelerator, and this machine has none .*: drop offload from --fsdp \(cpu_offload from "
                           r"--fsdp_config\)\.$") as refused:
            parse(*flags)
        assert is_flag_error(refused.value)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")  # `accelerate launch` of an FSDP2 config with offload
    monkeypatch.setenv("FSDP_VERSION", "2")
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "true")
    with pytest.raises(ValueError, match="set fsdp_offload_params: false in the accelerate config"):
        parse()
    monkeypatch.setenv("FSDP_OFFLOAD_PARAMS", "false")
    parse()
    monkeypatch.delenv("ACCELERATE_USE_FSDP")
    monkeypatch.delenv("FSDP_VERSION")
    parse("--fsdp", "full_shard auto_wrap")
    monkeypatch.setattr(sparse_trainer, "_has_accelerator", lambda: True)
    parse("--fsdp", "full_shard auto_wrap", "--fsdp_config", '{"version": 1}')


def test_deepspeed_is_refused_before_any_starts_under_cp_or_when_not_installed(machine, capsys, tmp_path,
                                                                                monkeypatch):
    """A DeepSpeed config under CP started every process, each refusing DeepSpeed under CP; without DeepSpeed
    installed, accelerate launch ended in its ImportError's traceback after the example's flags had parsed."""
    started = machine(2)
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "deepspeed" else
                        find_spec(name, *a))
    under_cp = "DeepSpeed (--deepspeed <the accelerate config>) under context parallelism (CP 2) is not supported"
    for command in ("launch", "train"):
        assert _launch(capsys, tmp_path, DEEPSPEED, "--cp_size", "2", command=command).startswith(under_cp)
        assert _launch(capsys, tmp_path, DEEPSPEED, command=command) == (
            "runs DeepSpeed (distributed_type: DEEPSPEED), which is not installed: pip install deepspeed, or shard "
            "with FSDP2 instead (distributed_type: FSDP with fsdp_version: 2 in its fsdp_config, e.g. `--config_file "
            "fsdp2_cp8_1node`).\n")
    assert not started
    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    if find_spec("deepspeed") is None:
        monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: name == "deepspeed" or find_spec(name, *a))
    assert _launch(capsys, tmp_path, DEEPSPEED) is None
    assert _launch(capsys, tmp_path, DEEPSPEED, "--cp_size", "2").startswith(under_cp)


def test_a_config_accelerate_launch_names_the_fault_of_is_left_to_it():
    """A missing or odd process count is accelerate launch's to name (its own message): not refused here."""
    for config in ({**MULTI_GPU, "num_processes": None}, {**MULTI_GPU, "num_processes": "2"},
                   {**MULTI_GPU, "num_machines": 0}):
        assert config_mistake(config, 0) is None
    assert config_mistake({**MULTI_GPU, "num_processes": None, "gpu_ids": 1}, 0).startswith("sets gpu_ids: 1")
    for config in ({**MULTI_GPU, "distributed_type": None, "gpu_ids": "0"},  # (accelerate names a missing type)
                   {**MULTI_GPU, "gpu_ids": "GPU-8d2f,GPU-11ab"}):  # (devices by UUID: no index to check)
        assert config_mistake(config, 2) is None
