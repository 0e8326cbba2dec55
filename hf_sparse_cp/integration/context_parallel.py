"""Context parallelism inside a stock `Trainer`: one reversible patch of the trainer instance.

The Trainer's own CP input preparation (and accelerate's `maybe_context_parallel` behind it, and
its SDPA mask hooks on the model) accepts SDPA only and splits buffers contiguously.
`enable_trainer_context_parallel` replaces it, on this trainer object only, with the plugin's:
every batch is sharded once, at data time, with shifted labels and global position_ids, and
carries the `CPShard` that the `sparse_cp` backend runs the ring with. Where accelerate does not
own the CP mesh (CPU / gloo runs with `--cp_size`), the patch also makes the dataloader shard
over data-parallel ranks only (every rank of a CP group gets the same batch) and counts the
loss's tokens once per CP group.
`disable_trainer_context_parallel` undoes all of it.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

import torch
from transformers import Trainer

from ..distributed import ContextParallelConfig, ParallelDims, prepare_context_parallel_inputs
from . import compat
from .backend import model_config_for
from .models import check_model_supports_context_parallel
from .patching import record_on, undo_recorded

logger = logging.getLogger(__name__)

_FEATURE = "context_parallel"


def _accelerate_owns_cp(trainer: Trainer) -> bool:
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    return pc is not None and pc.cp_size > 1


def _pad_token_id(trainer: Trainer, model: torch.nn.Module) -> int:
    for source in (trainer.processing_class, getattr(model, "config", None)):
        pad = getattr(source, "pad_token_id", None)
        if pad is not None:
            return int(pad)
    return 0


def _dp_data_loader(trainer: Trainer, parallel: ParallelDims):
    """`Accelerator.prepare_data_loader` sharding over the data-parallel ranks only."""
    from accelerate.data_loader import prepare_data_loader

    acc = trainer.accelerator

    def prepare(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        prepared = prepare_data_loader(
            data_loader,
            acc.device,
            num_processes=parallel.dp_size,
            process_index=parallel.dp_rank,
            split_batches=acc.split_batches,
            put_on_device=acc.device_placement if device_placement is None else device_placement,
            rng_types=acc.rng_types.copy(),
            dispatch_batches=acc.dispatch_batches,
            even_batches=acc.even_batches,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            use_seedable_sampler=acc.use_seedable_sampler,
            data_seed=acc.dataloader_config.data_seed,
            non_blocking=acc.non_blocking,
            use_stateful_dataloader=acc.use_stateful_dataloader,
        )
        compat.track_data_loader(acc, prepared)
        return prepared

    return prepare


def enable_trainer_context_parallel(
    trainer: Trainer, cp_config: ContextParallelConfig | None = None
) -> ParallelDims:
    """Make `trainer` train with sparse context parallelism. Call after building the Trainer and
    before `train()`; the model must already use `sparse_cp` (`enable_sparse_attention`).

    Args:
        trainer: the Trainer; patched on this instance only (`disable_trainer_context_parallel`
            undoes it).
        cp_config: the plugin's CP flags (`--cp_size`, any backend, gloo on CPU); accelerate's
            `ParallelismConfig(cp_size=...)` takes precedence when it sets one (GPUs).

    Returns:
        The `ParallelDims` in use; with a CP size of 1 nothing is patched.
    """
    parallel = ParallelDims.from_accelerator(trainer.accelerator, cp_config)
    if parallel.cp_size == 1:
        return parallel
    model = trainer.model
    check_model_supports_context_parallel(model)
    compat.require(f"transformers.Trainer.{compat.TRAINER_CP_INPUTS}")
    block_size = model_config_for(model).block_size
    pad_token_id = _pad_token_id(trainer, model)
    patches = record_on(trainer, _FEATURE)

    def prepare_inputs(_model, inputs: dict[str, Any]):
        return contextlib.nullcontext, prepare_context_parallel_inputs(
            inputs, parallel, block_size=block_size, pad_token_id=pad_token_id
        )

    patches.set_attr(trainer, compat.TRAINER_CP_INPUTS, prepare_inputs)
    if _accelerate_owns_cp(trainer):
        # accelerate's CP model preparation hooks every attention layer to drop its mask for SDPA's
        # `is_causal` (and refuses sliding-window models); the sparse ring reads the CPShard instead
        compat.require(f"accelerate.Accelerator.{compat.ACCELERATOR_PREPARE_CP}")
        patches.set_attr(trainer.accelerator, compat.ACCELERATOR_PREPARE_CP, lambda *args: args)
    else:
        compat.require(f"transformers.Trainer.{compat.TRAINER_NUM_ITEMS}")
        count_items = getattr(trainer, compat.TRAINER_NUM_ITEMS)

        def num_items_once_per_cp_group(batch_samples, device):
            # every rank of a CP group counted the same full batch: count it once
            n = count_items(batch_samples, device)
            return None if n is None else n / parallel.cp_size

        patches.set_attr(trainer, compat.TRAINER_NUM_ITEMS, num_items_once_per_cp_group)
        patches.set_attr(trainer.accelerator, "prepare_data_loader", _dp_data_loader(trainer, parallel))
    logger.info("Sparse context parallelism on: %s", parallel)
    return parallel


def disable_trainer_context_parallel(trainer: Trainer) -> None:
    """Undo `enable_trainer_context_parallel` on `trainer` (no-op when it is not enabled)."""
    undo_recorded(trainer, _FEATURE)
