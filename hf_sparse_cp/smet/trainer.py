"""SMET in a stock `Trainer` script: `--smet` flags, the optimizer factory, and the callback that
attaches the masks once accelerate has prepared (and, under FSDP2, sharded) the model."""

from __future__ import annotations

import dataclasses
import logging
import typing
from dataclasses import dataclass, field
from typing import Any

from transformers import Trainer, TrainerCallback, TrainingArguments

from .config import SMETConfig
from .factory import SUPPORTED_OPTIMIZERS, SMETOptimizerFactory
from .optimizer import SMETAdam

logger = logging.getLogger(__name__)

FLAG_PREFIX = "smet_"


def _prefixed_fields(cls: type, prefix: str) -> list[tuple[str, Any, dataclasses.Field]]:
    """The fields of dataclass `cls` renamed `prefix + name`, with their types, defaults and help."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if f.default_factory is not dataclasses.MISSING:
            new = field(default_factory=f.default_factory, metadata=f.metadata)
        else:
            new = field(default=f.default, metadata=f.metadata)
        out.append((prefix + f.name, hints[f.name], new))
    return out


# Every SMETConfig field as a `--smet_<field>` flag, generated so help texts and defaults live once.
SMETFlags = dataclasses.make_dataclass("SMETFlags", _prefixed_fields(SMETConfig, FLAG_PREFIX))
SMETFlags.__module__ = __name__


@dataclass
class SMETArguments(SMETFlags):
    """Switches for a Trainer script: `--smet`, `--smet_config FILE`, and `--smet_<field>` for every
    `SMETConfig` field (e.g. `--smet_density 0.1 --smet_update_interval 50`)."""

    smet: bool = field(
        default=False,
        metadata={"help": "Train with the SMET optimizer (dynamic sparse training / sparse fine-tuning with a "
                  "stable Adam and compact optimizer state)."},
    )
    smet_config: str | None = field(
        default=None,
        metadata={"help": "YAML/JSON file with the SMETConfig; --smet_* flags that differ from their defaults "
                  "override it."},
    )

    def to_config(self) -> SMETConfig:
        """The SMET config: the `--smet_config` file if given, with non-default flags on top."""
        flags = {f.name: getattr(self, FLAG_PREFIX + f.name) for f in dataclasses.fields(SMETConfig)}
        if self.smet_config is None:
            return SMETConfig(**flags)
        config = SMETConfig.from_file(self.smet_config)
        default = SMETConfig()
        changed = {name: value for name, value in flags.items() if value != getattr(default, name)}
        if changed:
            logger.info("Command-line SMET flags override %s: %s", self.smet_config, changed)
            config = dataclasses.replace(config, **changed)
        return config


def smet_optimizer_cls_and_kwargs(
    training_args: TrainingArguments, config: SMETConfig
) -> tuple[type, dict[str, Any]]:
    """What to pass as `Trainer(optimizer_cls_and_kwargs=...)`: a SMET factory standing in for the
    stock optimizer `--optim` selects, with its learning rate, betas, epsilon and weight decay."""
    optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(training_args)
    if optimizer_cls not in SUPPORTED_OPTIMIZERS:
        raise ValueError(
            f"--optim {training_args.optim} selects {optimizer_cls.__name__}; SMET stands in for "
            f"{[c.__name__ for c in SUPPORTED_OPTIMIZERS]} only: use --optim adamw_torch or adamw_torch_fused."
        )
    kwargs = dict(kwargs, weight_decay=training_args.weight_decay)
    return SMETOptimizerFactory, {"optimizer_cls": optimizer_cls, "config": config, **kwargs}


def unwrap_smet(optimizer: Any) -> SMETAdam | None:
    """The `SMETAdam` inside `optimizer` (accelerate wraps it), or None."""
    for candidate in (optimizer, getattr(optimizer, "optimizer", None)):
        if isinstance(candidate, SMETAdam):
            return candidate
    return None


class SMETCallback(TrainerCallback):
    """Attaches SMET when training begins (after accelerate has prepared the model and a checkpoint was
    loaded), sets the prune-rate decay horizon from `max_steps`, and logs `smet/density`,
    `smet/topology_updates` and `smet/replaced_fraction` (share of active blocks replaced at the last
    topology update)."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        smet = unwrap_smet(optimizer)
        if smet is None:
            raise RuntimeError(
                "SMETCallback found no SMET optimizer; install it with hf_sparse_cp.smet.install_smet(trainer, config)."
            )
        if smet.config.prune_decay_steps is None:
            smet.schedule_horizon = state.max_steps
        smet.attach()

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        smet = unwrap_smet(optimizer)
        if logs is None or smet is None:
            return
        extra = {
            "smet/density": round(smet.density(), 5),
            "smet/topology_updates": smet.topology_updates,
            "smet/replaced_fraction": round(smet.last_replaced_fraction, 5),
        }
        logs.update(extra)
        if state.log_history:
            state.log_history[-1].update(extra)


def install_smet(trainer: Trainer, config: SMETConfig) -> Trainer:
    """Make `trainer` train with SMET: its optimizer is built by the SMET factory (works under FSDP2,
    where `Trainer(optimizers=...)` is refused) and `SMETCallback` attaches it. Call before `train()`."""
    if trainer.optimizer is not None:
        raise ValueError(
            "The Trainer already has an optimizer; build it without `optimizers=` and let install_smet create SMET."
        )
    trainer.optimizer_cls_and_kwargs = smet_optimizer_cls_and_kwargs(trainer.args, config)
    if not any(isinstance(cb, SMETCallback) for cb in trainer.callback_handler.callbacks):
        trainer.callback_handler.callbacks.insert(0, SMETCallback())
    return trainer
