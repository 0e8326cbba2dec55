"""SMET in a stock `Trainer`: the optimizer factory standing in for `--optim`, and `install_smet` /
`uninstall_smet` (the callback that attaches the masks once accelerate has prepared, and under
FSDP2 sharded, the model lives in `callbacks.py`)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any

from torch import nn
from transformers import Trainer, TrainingArguments

from ..integration.given import require_instance, require_trainer
from ..integration.patching import record_on, undo_recorded
from ..smet import SMETConfig
from ..smet.factory import SUPPORTED_OPTIMIZERS, SMETOptimizerFactory, smet_param_groups
from .callbacks import SMETCallback

_FEATURE = "smet"
# The --optim values that select an optimizer SMET stands in for (torch's AdamW; the fused kernel changes no maths).
SMET_OPTIMS = ("adamw_torch", "adamw_torch_fused")


def _optim_name(training_args: TrainingArguments) -> str:
    """`--optim` as typed (the arguments hold an `OptimizerNames`, whose str() is 'OptimizerNames.ADAFACTOR')."""
    return getattr(training_args.optim, "value", training_args.optim)


def check_smet_optim(training_args: TrainingArguments) -> None:
    """Raise ValueError, naming the flag as typed and the fix, unless `--optim` selects an optimizer SMET stands in
    for; by name, so that an --optim whose package is missing (bitsandbytes' adamw_8bit) is refused as SMET's, not
    answered with an ImportError asking to install a package whose optimizer would then be refused."""
    optim = _optim_name(training_args)
    if optim not in SMET_OPTIMS:
        raise ValueError(
            f"--optim {optim} with --smet: SMET is an AdamW of its own and stands in for torch's AdamW only: use "
            f"--optim {' or '.join(SMET_OPTIMS)} (or leave --optim unset), or train without --smet."
        )


def smet_optimizer_cls_and_kwargs(
    training_args: TrainingArguments, config: SMETConfig,
    decay_names: Callable[[nn.Module], Collection[str]] | None = None,
) -> tuple[type, dict[str, Any]]:
    """What to pass as `Trainer(optimizer_cls_and_kwargs=...)`: a SMET factory standing in for the
    stock optimizer `--optim` selects, with its learning rate, betas, epsilon and weight decay, applied to the
    parameters `decay_names(model)` lists (a Trainer's `get_decay_parameter_names`: not to norms and biases,
    as the stock optimizer; default: `smet_param_groups`')."""
    check_smet_optim(training_args)
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(training_args)
    if optimizer_cls not in SUPPORTED_OPTIMIZERS:  # (a transformers release that maps these names elsewhere)
        raise ValueError(
            f"--optim {_optim_name(training_args)} selects {optimizer_cls.__name__}; SMET stands in for "
            f"{[c.__name__ for c in SUPPORTED_OPTIMIZERS]} only: use --optim adamw_torch or adamw_torch_fused."
        )
    kwargs = dict(kwargs, weight_decay=training_args.weight_decay)
    return SMETOptimizerFactory, {"optimizer_cls": optimizer_cls, "config": config, "decay_names": decay_names,
                                  **kwargs}


def install_smet(trainer: Trainer, config: SMETConfig) -> Trainer:
    """Make `trainer` train with SMET. Call before `train()`; `uninstall_smet` undoes it.

    Args:
        trainer: a Trainer built without `optimizers=` (the SMET factory builds the optimizer, which
            also works under FSDP2, where `Trainer(optimizers=...)` is refused).
        config: the SMET settings.

    Returns:
        The trainer, with `optimizer_cls_and_kwargs` set and `SMETCallback` first among its callbacks.
        Installing again replaces the previous installation. A model SMET cannot train (no trainable
        weight in `config.target_modules`, e.g. a LoRA model, whose base weights are frozen; or targets
        that reach a PEFT adapter's weights) is refused here, not when `train()` builds the optimizer.
    """
    require_trainer(trainer, "install_smet(trainer, ...)")
    require_instance(config, SMETConfig, "install_smet(trainer, config)", "config",
                     "SMETConfig(density=0.1), or SMETArguments(...).to_config()")
    if trainer.optimizer is not None:
        raise ValueError(
            "The Trainer already has an optimizer; build it without `optimizers=` and let install_smet create SMET."
        )
    smet_param_groups(trainer.model, config, weight_decay=0.0)
    undo_recorded(trainer, _FEATURE)
    patches = record_on(trainer, _FEATURE)
    patches.set_attr(trainer, "optimizer_cls_and_kwargs", smet_optimizer_cls_and_kwargs(
        trainer.args, config, trainer.get_decay_parameter_names))
    patches.insert(trainer.callback_handler, "callbacks", 0, SMETCallback())
    return trainer


def uninstall_smet(trainer: Trainer) -> None:
    """Undo `install_smet` (the optimizer choice and the callback); a no-op when it is not installed."""
    require_trainer(trainer, "uninstall_smet(trainer)")
    undo_recorded(trainer, _FEATURE)
