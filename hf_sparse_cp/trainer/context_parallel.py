"""Context parallelism inside a stock `Trainer`: one reversible patch of the trainer instance.

The Trainer's own CP input preparation (and accelerate's `maybe_context_parallel` behind it, and
its SDPA mask hooks on the model) accepts SDPA only and splits buffers contiguously.
`enable_trainer_context_parallel` replaces it, on this trainer object only, with the plugin's:
every batch is sharded once, at data time, with shifted labels and global position_ids, and
carries the `CPShard` that the `sparse_cp` backend runs the ring with. Where accelerate does not
own the CP mesh (CPU / gloo runs with `--cp_size`), the patch also makes the dataloader shard
over data-parallel ranks only (every rank of a CP group gets the same batch). Either way the
Trainer's token count, flops, batch size and the loss's token count (and TRL's logged `num_tokens`) count
each CP group's batch once, the losses a step or an evaluation batch returns (which the Trainer logs, keeps for
`train_loss` and gathers for `eval_loss`) are the CP group's, the logits an evaluation or prediction step returns
(for `compute_metrics`, `predict()`) are the whole sequence's in the batch's order, and an attention call that arrives
without the shard during a CP forward is an error.
`disable_trainer_context_parallel` undoes all of it. The pieces, which a curriculum of CP degrees
(`trainer/curriculum.py`) reuses: the batches (`cp_batches.py`), the steps and counts (`cp_steps.py`), with the token
losses (`cp_token_loss.py`), NEFTune's noise (`cp_neftune.py`) and the evaluation's gathers (`cp_metrics.py`).
"""

from __future__ import annotations

import logging
from typing import Any

from transformers import Trainer

from ..distributed import ContextParallelConfig, ParallelDims
from ..integration import compat, compat_checks
from ..integration.call_context import guard_context_parallel
from ..integration.given import require_instance, require_trainer
from ..integration.heads import SEQUENCE_CLASSIFICATION, model_head
from ..integration.layer_settings import model_config_for
from ..integration.models import check_model_supports_context_parallel
from ..integration.patching import record_on, undo_recorded
from ..integration.planner_weights import planned_linear_weight
from .arguments import flag_errors
from .cp_batches import (
    dp_data_loader,
    first_batch_of_each_run,
    follow_first_ranks_generators,
    pad_token_id,
    step_inputs,
)
from .cp_checks import check_loss, check_training_arguments, warn_inexact
from .cp_steps import count_once_per_cp_group, cp_group_steps

logger = logging.getLogger(__name__)

_FEATURE = "context_parallel"


def _accelerate_owns_cp(trainer: Trainer) -> bool:
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    return pc is not None and pc.cp_size > 1


def _refuse_group_settings(cp_config: ContextParallelConfig, world_size: int) -> None:
    """Refuse, naming them and the fix, the settings of how a CP group shares its sequences (`--cp_mode ulysses`)
    in a run without context parallelism, which would ignore them: `torchrun --nproc_per_node 2 train.py --cp_mode
    ulysses` (the CP degree forgotten) would train data-parallel without a word."""
    given = cp_config.group_settings()
    if given:
        with flag_errors():
            processes = f"{world_size} process" + ("es" if world_size > 1 else "")
            raise ValueError(
                f"{', '.join(given)}: {'they' if len(given) > 1 else 'it'} would be ignored: this run has no context "
                f"parallelism (a CP degree of 1 over {processes}). Add --cp_size N to split each sequence over N "
                f"processes (N dividing the processes launched), or drop {'them' if len(given) > 1 else 'it'}.")


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
    require_trainer(trainer, "enable_trainer_context_parallel(trainer, ...)")
    if cp_config is not None:
        require_instance(cp_config, ContextParallelConfig, "enable_trainer_context_parallel(trainer, cp_config)",
                         "cp_config", "ContextParallelConfig(cp_size=2)")
    cp_config = cp_config or ContextParallelConfig()
    parallel = ParallelDims.from_accelerator(trainer.accelerator, cp_config,
                                             model_linear_per_token=planned_linear_weight(trainer.model, cp_config))
    if parallel.cp_size == 1:
        _refuse_group_settings(cp_config, parallel.world_size)
        return parallel
    model = trainer.model
    with flag_errors((ValueError,)):  # (what CP cannot compute exactly, naming the fix: a launched script ends
        # with the message; a TypeError of the probe forward through the model is a bug and keeps its traceback)
        check_model_supports_context_parallel(model, parallel=parallel)
        check_loss(trainer, parallel.cp_size, parallel)
        check_training_arguments(trainer.args, parallel.cp_size)
    warn_inexact(trainer)
    compat_checks.require(f"transformers.Trainer.{compat.TRAINER_CP_INPUTS}")
    sparse_config = model_config_for(model)
    pad_id = pad_token_id(trainer, model)
    patches = record_on(trainer, _FEATURE)

    first_batch = first_batch_of_each_run(trainer)

    def prepare_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
        return step_inputs(inputs, parallel, sparse_config, pad_id, first_batch(),
                           model_head(model) == SEQUENCE_CLASSIFICATION)

    for handle in guard_context_parallel(model):
        patches.on_undo(handle.remove)
    owns_cp = _accelerate_owns_cp(trainer)
    count_once_per_cp_group(trainer, patches, lambda: parallel, owns_cp)
    follow_first_ranks_generators(trainer, patches, lambda: parallel)
    cp_group_steps(trainer, patches, lambda: parallel, prepare_inputs)
    if owns_cp:
        # accelerate's CP model preparation hooks every attention layer to drop its mask for SDPA's
        # `is_causal` (and refuses sliding-window models); the sparse ring reads the CPShard instead
        compat_checks.require(f"accelerate.Accelerator.{compat.ACCELERATOR_PREPARE_CP}")
        patches.set_attr(trainer.accelerator, compat.ACCELERATOR_PREPARE_CP, lambda *args: args)
    # (under accelerate's CP group too: its loaders shard a map-style dataset over the DP ranks, but dispatch an
    # iterable one's batches over all processes, and seed their workers by the process index)
    patches.set_attr(trainer.accelerator, "prepare_data_loader", dp_data_loader(trainer, parallel))
    logger.info("Sparse context parallelism on: %s", parallel)
    return parallel


def disable_trainer_context_parallel(trainer: Trainer) -> None:
    """Undo `enable_trainer_context_parallel` on `trainer` (no-op when it is not enabled)."""
    require_trainer(trainer, "disable_trainer_context_parallel(trainer)")
    undo_recorded(trainer, _FEATURE)
