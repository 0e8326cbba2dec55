"""Glue between the plugin and a stock Trainer script."""

from __future__ import annotations

import logging

import torch
from transformers import Trainer, TrainingArguments

from .arguments import SparseCPArguments
from .callbacks import SparsityLoggingCallback
from .config import SparseAttentionConfig
from .distributed import ContextParallelConfig, ParallelLayout
from .model import configure
from .registration import patch
from .trainer_cp import enable_trainer_context_parallel

logger = logging.getLogger(__name__)


def enable_sparse_attention(
    model: torch.nn.Module,
    sparse_args: SparseCPArguments,
    attention_config: SparseAttentionConfig | None = None,
    training_args: TrainingArguments | None = None,
    max_length: int | None = None,
) -> SparseAttentionConfig:
    """Register the backend, switch `model` to it with `attention_config`, and turn gradient
    checkpointing on for long sequences. Returns the config in use."""
    config = sparse_args.attention_config(attention_config)
    patch(fused_loss=sparse_args.fused_loss)
    configure(model, config)
    threshold = sparse_args.gradient_checkpointing_min_length
    if (
        training_args is not None
        and max_length is not None
        and threshold
        and max_length >= threshold
        and not checkpointing_enabled(training_args)
    ):
        logger.info("Sequence length %d >= %d: turning gradient checkpointing on.", max_length, threshold)
        # transformers >= 5.2x reads `activation_checkpointing` (`gradient_checkpointing` is its deprecated alias)
        for name in ("activation_checkpointing", "gradient_checkpointing"):
            if hasattr(training_args, name):
                setattr(training_args, name, True)
    return config


def checkpointing_enabled(training_args: TrainingArguments) -> bool:
    """Whether the Trainer will checkpoint activations (under either name of the flag)."""
    return bool(getattr(training_args, "activation_checkpointing", None) or training_args.gradient_checkpointing)


def attach_to_trainer(
    trainer: Trainer, sparse_args: SparseCPArguments, cp_config: ContextParallelConfig | None = None
) -> ParallelLayout:
    """Add the plugin's callbacks to `trainer` (sparsity logging first, before the reporters) and,
    when a CP size above 1 is set (accelerate's ParallelismConfig or `cp_config`), switch it to
    sparse context parallelism. Returns the parallel layout in use."""
    if sparse_args.log_sparsity and not any(
        isinstance(cb, SparsityLoggingCallback) for cb in trainer.callback_handler.callbacks
    ):
        trainer.callback_handler.callbacks.insert(0, SparsityLoggingCallback())
    return enable_trainer_context_parallel(trainer, cp_config)
