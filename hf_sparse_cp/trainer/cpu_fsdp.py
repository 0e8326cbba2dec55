"""The Trainer's `--fsdp` with FSDP2 on CPU processes (gloo).

accelerate turns an FSDP plugin into its FSDP run type only on accelerator devices: on CPU processes
(`use_cpu`, `MULTI_CPU`) it drops the plugin and the Trainer wraps the model in DDP, so `--fsdp` (or an
accelerate config of FSDP, which `accelerate launch` passes on as `ACCELERATE_USE_FSDP` and `FSDP_*`
variables) asks for sharding and silently trains replicas. `enable_cpu_fsdp2` gives accelerate's state the
run type and plugin it would have chosen on a GPU (the plugin built from the same `TrainingArguments`, or
from accelerate's variables), so
`train()` takes the Trainer's own FSDP2 path: `fully_shard` through `accelerator.prepare`, the
optimizer built on the sharded parameters, sharded checkpoints through `torch.distributed.checkpoint`.
"""

from __future__ import annotations

import logging
import os
import sys

import torch
from accelerate import PartialState
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, parse_flag_from_env, str_to_bool
from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy
from transformers import Trainer, TrainingArguments

from ..integration import compat_checks
from ..integration.given import require_trainer
from ..integration.patching import record_on, undo_recorded

logger = logging.getLogger(__name__)

_FEATURE = "cpu_fsdp2"
# The first PEFT release whose adapter saves under FSDP's own activation checkpointing kept their weights
# (`check_peft_checkpointing`).
PEFT_SAVES_WRAPPED_ADAPTERS = (0, 22)


def enable_cpu_fsdp2(trainer: Trainer) -> bool:
    """Run `trainer`'s requested FSDP2 on CPU processes; `disable_cpu_fsdp2(trainer)` undoes it.

    Call after building the Trainer and before `train()`.

    Args:
        trainer: a Trainer whose arguments ask for FSDP (`--fsdp ... --fsdp_config '{"fsdp_version": 2}'`), or
            launched by `accelerate launch` with an FSDP config (`fsdp_version: 2`).

    Returns:
        True when it switched accelerate to FSDP2 (CPU processes, FSDP asked for, accelerate running
        DDP); False when there is nothing to do (no FSDP asked for, or accelerate already runs it).

    Raises:
        ValueError: FSDP version 1 or CPU offload asked for on CPU processes (`check_cpu_fsdp_version`); what FSDP2
            fails on with the trainer's model (`check_fsdp2_model`).
    """
    require_trainer(trainer, "enable_cpu_fsdp2(trainer)")
    plugin_args, state = trainer.args.fsdp_plugin_args, trainer.accelerator.state
    if plugin_args is None and parse_flag_from_env("ACCELERATE_USE_FSDP") and "FSDP_VERSION" in os.environ:
        # `accelerate launch` of an FSDP config sets both (the plugin reads its FSDP_* variables itself); an Accelerator
        # built with an FSDP plugin (an earlier Trainer's --fsdp) sets ACCELERATE_USE_FSDP alone in its process, which
        # must not turn a later Trainer without --fsdp into FSDP (version 1, which then failed on the CPU device)
        plugin_args = {}
    if (plugin_args is None or getattr(state, "fsdp_plugin", None) is not None
            or state.distributed_type != DistributedType.MULTI_CPU):
        return False
    check_cpu_fsdp_version(trainer.args)  # (FSDP1 and CPU offload, named with their fix)
    plugin = FullyShardedDataParallelPlugin(**plugin_args)
    check_fsdp2_model(trainer.model, plugin)
    if state.mixed_precision != "no":  # what accelerate's state does with the plugin on a GPU
        plugin.set_mixed_precision(state.mixed_precision)
    patches = record_on(trainer, _FEATURE)
    # Both states, as accelerate's own set-up does: every later `AcceleratorState()` (e.g. the optimizer
    # wrapper's) copies the process state's run type over the accelerator state's.
    patches.set_attr(PartialState(), "distributed_type", DistributedType.FSDP)
    patches.set_attr(state, "distributed_type", DistributedType.FSDP)
    patches.set_attr(state, "fsdp_plugin", plugin)
    patches.set_attr(trainer, "is_fsdp_enabled", True)
    logger.info("FSDP on %d CPU processes: FSDP2 (accelerate's FSDP run type) instead of DDP.",
                trainer.accelerator.num_processes)
    return True


def check_cpu_fsdp_version(args: TrainingArguments) -> None:
    """Raise ValueError, naming the fix, when `args` (their `--fsdp`, else accelerate launch's FSDP variables,
    which also give a setting that `--fsdp` leaves unset, as the FSDP plugin reads them) ask for FSDP version 1 on CPU
    processes: accelerate's FSDP1 plugin finds no device there (and FSDP1 refuses a CPU one), which each process met
    only as its Trainer built the accelerator, after the data; for CPU offload, whose pinned memory needs an
    accelerator; or with what the Trainer refuses under FSDP (`--activation_checkpointing` beside FSDP's own,
    `--save_only_model` with `--load_best_model_at_end`). Call it on a machine without accelerator."""
    if args.fsdp_plugin_args is not None:
        version, where = args.fsdp_plugin_args["fsdp_version"], "--fsdp_config's version"
        fix = "--fsdp_config '{\"fsdp_version\": 2}'"
    elif str_to_bool(os.environ.get("ACCELERATE_USE_FSDP", "false")) and "FSDP_VERSION" in os.environ:
        # (`accelerate launch` sets both, FSDP_VERSION 1 for a config without fsdp_version; an Accelerator built with
        # an FSDP plugin sets ACCELERATE_USE_FSDP alone in its process, which later arguments there must not misread)
        version, where = os.environ["FSDP_VERSION"], "the accelerate config's fsdp_version; accelerate's default is 1"
        fix = "fsdp_version: 2 in the accelerate config's fsdp_config"
    else:
        return
    if str(version) != "2":
        raise ValueError(f"FSDP version {version} ({where}) runs only on accelerators, and this machine has none: set "
                         f"{fix} (FSDP2, which the plugin runs on CPU processes over gloo).")
    # CPU offload pins the sharded parameters in host memory for an accelerator: FSDP2 failed at `train()`, as it
    # sharded the model after the data ('Cannot access accelerator device when none is available').
    offload, from_flags = _plugin_setting(args, "cpu_offload", "FSDP_OFFLOAD_PARAMS")
    drop = ("drop offload from --fsdp (cpu_offload from --fsdp_config)" if from_flags else
            "set fsdp_offload_params: false in the accelerate config")
    if offload:
        raise ValueError("FSDP's CPU offload pins the parameters in host memory for an accelerator, and this machine "
                         f"has none (the parameters already live in CPU memory): {drop}.")
    # The Trainer refuses these pairs as it builds its accelerator, where FSDP runs; on CPU processes FSDP2 starts after
    # that (`enable_cpu_fsdp2`): a run trained with both checkpointings on, and one with the second pair trained to
    # its end, then failed reloading the best checkpoint's FSDP state
    own_checkpointing, _ = _plugin_setting(args, "activation_checkpointing", "FSDP_ACTIVATION_CHECKPOINTING")
    if own_checkpointing and getattr(args, "activation_checkpointing", False):  # (transformers >= 5.2x: attach.py)
        raise ValueError("--activation_checkpointing and FSDP's own activation checkpointing (activation_checkpointing "
                         "in the FSDP config) cannot both be on: drop --activation_checkpointing (FSDP's own avoids "
                         "the extra AllGather in the backward pass that the Trainer's adds).")
    if args.save_only_model and args.load_best_model_at_end:
        raise ValueError("--load_best_model_at_end under FSDP reloads the best checkpoint's FSDP state "
                         "(pytorch_model_fsdp.bin), which --save_only_model does not save: drop --save_only_model or "
                         "--load_best_model_at_end.")
    # (on CPU processes the run trained and marked each checkpoint complete holding no weights: the model of a sharded
    # state dict type is saved with the optimizer's state, which --save_only_model skips)
    if args.save_only_model and _sharded_state_dict_type(args):
        where = ("set state_dict_type FULL_STATE_DICT in --fsdp_config" if args.fsdp_plugin_args is not None else
                 "set fsdp_state_dict_type: FULL_STATE_DICT in the accelerate config (FSDP2's default is sharded)")
        raise ValueError("--save_only_model under FSDP with a sharded state_dict_type saves checkpoints without the "
                         f"model's weights (the Trainer refuses the pair where FSDP runs on accelerators): {where}, "
                         "or drop --save_only_model.")


def set_up_fsdp2(trainer: Trainer) -> None:
    """`trainer`'s FSDP2: on CPU processes switched on (`enable_cpu_fsdp2`, which checks it against the model);
    accelerate's own (on accelerators) checked against the model (`check_fsdp2_model`). Raises as they do."""
    if not enable_cpu_fsdp2(trainer):
        check_fsdp2_model(trainer.model, getattr(trainer.accelerator.state, "fsdp_plugin", None))


def check_fsdp2_model(model: torch.nn.Module | None, plugin: FullyShardedDataParallelPlugin | None) -> None:
    """Raise ValueError, naming the fix, where FSDP2 under `plugin` (CPU processes' or accelerate's own on
    accelerators; None without FSDP) fails on `model` (None until `train()` with a model_init): a PEFT model under
    FSDP's own activation checkpointing (`check_peft_checkpointing`); an auto-wrap policy accelerate's FSDP2 fails on
    (`check_auto_wrap_policy`)."""
    if model is None or plugin is None or str(plugin.fsdp_version) != "2":
        return
    check_peft_checkpointing(model, plugin)
    check_auto_wrap_policy(model, plugin)


def check_peft_checkpointing(model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin) -> None:
    """Raise ValueError, naming the fix, when `model` is a PEFT model (a PeftModel or PeftMixedModel, whose save picks
    the adapter's weights by their modules' names), PEFT is older than 0.22 and `plugin` turns on FSDP's own
    activation checkpointing: the run trained, then saved an adapter without weights. The checkpoint wrapper renames
    the modules (`layers.0._checkpoint_wrapped_module.self_attn.q_proj`), PEFT 0.21 looked the weights up under those
    names, and the state dict gathered from FSDP2's shards keeps the plain ones: nothing matched (measured under
    FSDP2 on 2 CPU processes: PEFT 0.21.2 saved no tensor, 0.22.0 the trained ones; a model saved whole, with tuner
    layers injected, kept them under both)."""
    peft = sys.modules.get("peft")
    if (not plugin.activation_checkpointing or peft is None
            or compat_checks.release("peft") >= PEFT_SAVES_WRAPPED_ADAPTERS):
        return
    if isinstance(model, (peft.PeftModel, peft.PeftMixedModel)):
        raise ValueError("A PEFT model under FSDP's own activation checkpointing (activation_checkpointing in the FSDP "
                         f"config) saves an adapter without weights with PEFT {peft.__version__} (it looks them up "
                         "under the checkpoint wrapper's module names, which the gathered state dict does not use): "
                         "upgrade PEFT to 0.22 or newer, or drop activation_checkpointing from the FSDP config and set "
                         "the Trainer's --gradient_checkpointing instead (--activation_checkpointing where "
                         "transformers has it).")


def check_auto_wrap_policy(model: torch.nn.Module, plugin: FullyShardedDataParallelPlugin) -> None:
    """Raise ValueError, naming the fix, where accelerate's FSDP2 fails on `model` under `plugin`'s auto-wrap policy,
    which it met in `train()`, after the data and model were built, with messages that named no fix: a
    transformer_layer_cls_to_wrap naming no class of the model; SIZE_BASED_WRAP selecting a module list (FSDP2
    shards only modules with a forward) or a module holding the embeddings or the LM head (accelerate then shards
    those inside the sharded module again); FSDP's own activation checkpointing without a policy (it checkpoints the
    modules the policy wraps: TypeError 'NoneType' object is not callable, from an accelerate config without
    fsdp_auto_wrap_policy). The layer classes named are the model's `_no_split_modules`."""
    if plugin.auto_wrap_policy is None:
        if plugin.activation_checkpointing:
            raise ValueError("FSDP's own activation checkpointing (activation_checkpointing) checkpoints the modules "
                             "the auto-wrap policy wraps, and none is set (accelerate's prepare failed: 'NoneType' "
                             "object is not callable): set fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP in the "
                             "accelerate config (FSDP_AUTO_WRAP_POLICY), or \"auto_wrap_policy\": "
                             "\"TRANSFORMER_BASED_WRAP\" in --fsdp_config (its default; NO_WRAP wraps nothing); or "
                             "drop activation_checkpointing and set --gradient_checkpointing.")
        return
    layers = ", ".join(getattr(model, "_no_split_modules", None) or []) or "see the model's decoder layer class"
    try:
        policy = fsdp2_prepare_auto_wrap_policy(plugin, model)
    except ValueError as error:  # ('Could not find the transformer layer class X in the model.')
        raise ValueError(f"{str(error).rstrip('.')}: name a class of the model's layers in "
                         f"transformer_layer_cls_to_wrap (this model's layers: {layers}).") from error
    if getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy) is not size_based_auto_wrap_policy:
        return
    carved = [getattr(model, name, lambda: None)() for name in ("get_input_embeddings", "get_output_embeddings")]
    carved = [module for module in carved if module is not None]  # (what accelerate shards apart, as it reads them)
    for name, module in reversed(list(model.named_modules())):  # (inner modules first, as accelerate shards them)
        if not name or module in carved or not policy(module):
            continue
        container = isinstance(module, torch.nn.ModuleList | torch.nn.ModuleDict)
        if container or any(inner in carved for inner in module.modules()):
            what = "module list" if container else "module holding the embeddings or LM head"
            raise ValueError(f"SIZE_BASED_WRAP's min_num_params ({plugin.min_num_params}) wraps the {what} {name} "
                             f"({sum(p.numel() for p in module.parameters())} parameters), which accelerate's FSDP2 "
                             "cannot shard: use TRANSFORMER_BASED_WRAP with transformer_layer_cls_to_wrap (this "
                             f"model's layers: {layers}).")


def _sharded_state_dict_type(args: TrainingArguments) -> bool:
    """Whether the FSDP2 plugin built from `args` (else from accelerate launch's variables) takes a sharded
    state dict type, as the Trainer reads it ("SHARDED_STATE_DICT" in its name; 3, its number, from a variable)."""
    value = (args.fsdp_plugin_args or {}).get("state_dict_type") or os.environ.get("FSDP_STATE_DICT_TYPE",
                                                                                   "SHARDED_STATE_DICT")
    return "SHARDED_STATE_DICT" in str(value).upper() or str(value) == "3"


def _plugin_setting(args: TrainingArguments, key: str, variable: str) -> tuple[bool, bool]:
    """(on, whether the flags set it) of the FSDP plugin's boolean setting `key` as accelerate's plugin reads it: from
    --fsdp / --fsdp_config, else from accelerate launch's FSDP_* environment `variable` (the plugin's own fallback for a
    setting they leave unset: an accelerate config's, under --fsdp too)."""
    value = (args.fsdp_plugin_args or {}).get(key)
    if value is not None:
        return bool(value), True
    return str_to_bool(os.environ.get(variable, "false")) == 1, False


def disable_cpu_fsdp2(trainer: Trainer) -> None:
    """Undo `enable_cpu_fsdp2` (no-op when it is not enabled)."""
    require_trainer(trainer, "disable_cpu_fsdp2(trainer)")
    undo_recorded(trainer, _FEATURE)
