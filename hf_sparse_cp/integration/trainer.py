"""Glue between the plugin and a stock Trainer script, each step with its undo.

* `enable_sparse_attention` / `disable_sparse_attention`: register the backend, opt into the lean
  loss, switch the model to `sparse_cp`, turn gradient checkpointing on at long lengths;
* `attach_to_trainer` / `detach_from_trainer`: the sparsity-logging callback and context parallelism.

Everything they change is recorded (`patching.PatchSet`) on the model or the trainer, and the
matching disable call restores exactly that.
"""

from __future__ import annotations

import logging

import torch
from transformers import Trainer, TrainingArguments

from ..config import BACKEND_NAME, MODEL_CONFIG_ATTRIBUTE, SparseAttentionConfig
from ..distributed import ContextParallelConfig, ParallelDims
from . import compat
from .arguments import SparseCPArguments
from .callbacks import SparsityLoggingCallback
from .checkpoints import protect_checkpoints
from .context_parallel import disable_trainer_context_parallel, enable_trainer_context_parallel
from .lean_loss import disable_lean_loss, enable_lean_loss, is_lean_loss_enabled
from .patching import attached_patches, record_on, undo_recorded
from .registration import is_patched, patch, unpatch

logger = logging.getLogger(__name__)

_SPARSE_ATTENTION = "sparse_attention"
_SPARSITY_LOGGING = "sparsity_logging"
_CHECKPOINTS = "checkpoints"
# transformers >= 5.2x reads `activation_checkpointing` (`gradient_checkpointing` is its deprecated alias)
_CHECKPOINTING_FLAGS = ("activation_checkpointing", "gradient_checkpointing")


def checkpointing_enabled(training_args: TrainingArguments) -> bool:
    """Whether the Trainer will checkpoint activations (under either name of the flag)."""
    return bool(getattr(training_args, "activation_checkpointing", None) or training_args.gradient_checkpointing)


def enable_sparse_attention(
    model: torch.nn.Module,
    sparse_args: SparseCPArguments,
    attention_config: SparseAttentionConfig | None = None,
    training_args: TrainingArguments | None = None,
    max_length: int | None = None,
) -> SparseAttentionConfig:
    """Train `model` with the `sparse_cp` backend; `disable_sparse_attention(model)` undoes it.

    Args:
        model: a transformers causal LM.
        sparse_args: the plugin's switches (`--sparse_config`, `--fused_loss`,
            `--gradient_checkpointing_min_length`).
        attention_config: the pattern parsed from the command line; flags that differ from the
            defaults override `--sparse_config`.
        training_args, max_length: when both are given and `max_length` reaches
            `gradient_checkpointing_min_length`, gradient checkpointing is turned on in `training_args`.

    Returns:
        The `SparseAttentionConfig` in use. Registers the backend (`patch()`) and, with `fused_loss`,
        the lean loss (`enable_lean_loss()`) if they are not yet; calling it again replaces the
        previous settings.
    """
    config = sparse_args.attention_config(attention_config)
    undo_recorded(model, _SPARSE_ATTENTION)
    patches = record_on(model, _SPARSE_ATTENTION)
    if not is_patched():
        patch()
        patches.on_undo(unpatch)
    if sparse_args.fused_loss and not is_lean_loss_enabled():
        enable_lean_loss()
        patches.on_undo(disable_lean_loss)
    previous = compat.attn_implementation(model.config)
    patches.set_attr(model.config, MODEL_CONFIG_ATTRIBUTE, config.to_dict())
    model.set_attn_implementation(BACKEND_NAME)
    if previous is not None and previous != BACKEND_NAME:
        patches.on_undo(lambda: model.set_attn_implementation(previous))
    threshold = sparse_args.gradient_checkpointing_min_length
    if (
        training_args is not None
        and max_length is not None
        and threshold
        and max_length >= threshold
        and not checkpointing_enabled(training_args)
    ):
        logger.info("Sequence length %d >= %d: turning gradient checkpointing on.", max_length, threshold)
        for name in _CHECKPOINTING_FLAGS:
            if hasattr(training_args, name):
                patches.set_attr(training_args, name, True)
    return config


def disable_sparse_attention(model: torch.nn.Module) -> None:
    """Undo `enable_sparse_attention(model, ...)`: the model's attention implementation and stored
    settings, the training arguments it changed, and the registrations it made (no-op when not enabled)."""
    undo_recorded(model, _SPARSE_ATTENTION)


def attach_to_trainer(
    trainer: Trainer, sparse_args: SparseCPArguments, cp_config: ContextParallelConfig | None = None
) -> ParallelDims:
    """Add the plugin to a built Trainer; `detach_from_trainer(trainer)` undoes it.

    Args:
        trainer: the Trainer, before `train()`.
        sparse_args: with `log_sparsity`, the sparsity-logging callback goes first (before the
            reporters, so TensorBoard / W&B see its keys).
        cp_config: the plugin's CP flags; with a CP size above 1 (here or in accelerate's
            `ParallelismConfig`) the trainer switches to sparse context parallelism.

    Returns:
        The `ParallelDims` in use. Checkpoints the trainer saves are marked complete only once
        every rank has saved, and `train(resume_from_checkpoint=...)` refuses an incomplete,
        damaged or mismatched one (`checkpoints.py`).
    """
    callbacks = trainer.callback_handler.callbacks
    if sparse_args.log_sparsity and not any(isinstance(cb, SparsityLoggingCallback) for cb in callbacks):
        record_on(trainer, _SPARSITY_LOGGING).insert(callbacks, 0, SparsityLoggingCallback())
    parallel = enable_trainer_context_parallel(trainer, cp_config)
    if attached_patches(trainer, _CHECKPOINTS) is None:
        protect_checkpoints(trainer, parallel, record_on(trainer, _CHECKPOINTS))
    return parallel


def detach_from_trainer(trainer: Trainer) -> None:
    """Undo `attach_to_trainer`: the logging callback, checkpoint protection and context parallelism
    (no-op when not attached)."""
    disable_trainer_context_parallel(trainer)
    undo_recorded(trainer, _CHECKPOINTS)
    undo_recorded(trainer, _SPARSITY_LOGGING)
