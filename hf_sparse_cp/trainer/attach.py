"""Glue between the plugin and a stock Trainer script, each step with its undo.

* `enable_sparse_attention` / `disable_sparse_attention`: register the backend, opt into the lean
  loss, switch the model to `sparse_cp`, turn gradient checkpointing on at long lengths;
* `attach_to_trainer` / `detach_from_trainer`: the sparsity-logging callback and context parallelism.

Everything they change is recorded (`patching.PatchSet`) on the model or the trainer, and the
matching disable call restores exactly that.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import weakref
from collections.abc import Callable, Collection, Mapping
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from transformers import Trainer, TrainingArguments

from ..config import BACKEND_NAME, SparseAttentionConfig, language_config
from ..config.files import unread_fields_checked_by_caller
from ..distributed import ContextParallelConfig, ParallelDims
from ..distributed.comm import group_timeout, rank_and_world
from ..integration import fsdp_class_names, upstream
from ..integration.architectures import uses_every_parameter
from ..integration.fused_ops import (
    describe_fused_ops,
    disable_fused_ops,
    enable_fused_ops,
    liger_settings,
    resolve_fused_ops,
)
from ..integration.given import require_instance, require_model, require_trainer
from ..integration.interfaces import is_patched, patch, unpatch
from ..integration.layer_settings import forget_layer_state, model_config_for
from ..integration.lean_loss import disable_lean_loss, enable_lean_loss, is_lean_loss_enabled
from ..integration.memory_savers import disable_memory_savers, enable_memory_savers, token_tiles_enabled
from ..integration.models import (
    attention_layers,
    check_mask_only_locality,
    check_model_supports_sparse_attention,
    sliding_window_layers,
)
from ..integration.patching import PatchSet, attached_patches, record_on, undo_recorded
from ..integration.registration import guard_registration, select_backend, store_pattern
from ..integration.stats import pop_kept_fractions
from ..launch_env import launched_world_size
from .arguments import SparseAttentionFlags, SparseCPArguments, flag_errors
from .callbacks import SparsityLoggingCallback, StepMetricsCallback
from .checkpoints import protect_checkpoints
from .context_parallel import disable_trainer_context_parallel, enable_trainer_context_parallel
from .cpu_fsdp import disable_cpu_fsdp2, set_up_fsdp2
from .curriculum import disable_curriculum, enable_curriculum, schedule_for
from .schedule import parse_schedule

logger = logging.getLogger(__name__)

_SPARSE_ATTENTION = "sparse_attention"
_SPARSITY_LOGGING = "sparsity_logging"
_STEP_METRICS = "step_metrics"
_CHECKPOINTS = "checkpoints"
_DDP_TIMEOUT = "ddp_timeout"
_PREPARED_AFTER_EVALUATION = "prepared_after_evaluation"
_UNUSED_PARAMETERS = "unused_parameters"
_SHIFTED_SMOOTHING = "shifted_smoothing"
# A Trainer built by a script under `hf_sparse_cp.run` records its change of class under this name
# (`hf_sparse_cp.launch.launched`).
LAUNCHED = "launched"
# transformers >= 5.2x reads `activation_checkpointing` (`gradient_checkpointing` is its deprecated alias)
_CHECKPOINTING_FLAGS = ("activation_checkpointing", "gradient_checkpointing")


def checkpointing_enabled(training_args: TrainingArguments) -> bool:
    """Whether the Trainer will checkpoint activations (under either name of the flag)."""
    if not isinstance(training_args, TrainingArguments):
        raise TypeError(f"checkpointing_enabled(training_args): training_args must be TrainingArguments (or a "
                        f"subclass: trainer.args), not {type(training_args).__name__}.")
    return bool(getattr(training_args, "activation_checkpointing", None) or training_args.gradient_checkpointing)


def enable_sparse_attention(
    model: torch.nn.Module,
    sparse_args: SparseCPArguments,
    attention_config: SparseAttentionConfig | SparseAttentionFlags | None = None,
    training_args: TrainingArguments | None = None,
    max_length: int | None = None,
    explicit: Collection[str] | None = None,
    packed_documents: bool = False,
) -> SparseAttentionConfig:
    """Train `model` with the `sparse_cp` backend; `disable_sparse_attention(model)` undoes it.

    Args:
        model: a transformers causal LM.
        sparse_args: the plugin's switches (`--sparse_config`, `--sparse_fused_loss`,
            `--sparse_gradient_checkpointing_min_length`).
        attention_config: the pattern parsed from the command line (`SparseAttentionFlags`, or the
            config itself); flags that differ from the defaults override `--sparse_config`.
        training_args, max_length: when both are given and `max_length` reaches
            `sparse_gradient_checkpointing_min_length`, gradient checkpointing is turned on in `training_args`;
            from `sparse_token_tiling_min_length` on, the MLPs and RMSNorms run in token tiles
            (`integration.memory_savers.enable_memory_savers`, as is `sparse_offload_layer_inputs`).
        explicit: the pattern fields given explicitly (`arguments.explicit_fields`): they beat
            `--sparse_config` whatever their value (without it, flags that differ from the defaults do).
        packed_documents: whether the training rows pack several documents each. A `max_length` longer than a
            sliding window or attention chunk that only the model's attention mask carries is refused here
            (`models.check_mask_only_locality`) unless they do (each document may still fit; every call is checked).

    Returns:
        The `SparseAttentionConfig` in use. Registers the backend (`patch()`) and, with `sparse_fused_loss`,
        the lean loss (`enable_lean_loss()`) if they are not yet; calling it again replaces the
        previous settings. The model then pickles and deep-copies: the copy holds the settings, the backend
        selection, the registration guard and the memory savers (on its own modules), and
        `disable_sparse_attention(copy)` restores those on the copy; the registrations and the training
        arguments stay the original's to undo (`patching.PatchSet`).
    """
    require_model(model, "enable_sparse_attention(model, ...)")
    require_instance(sparse_args, SparseCPArguments, "enable_sparse_attention(model, sparse_args, ...)",
                     "sparse_args", "SparseCPArguments(sparse_attention=True)")
    # (a run's arguments checked their pattern across their --cp_schedule stages, which may read what it does not)
    with unread_fields_checked_by_caller() if getattr(training_args, "cp_schedule", None) else contextlib.nullcontext():
        config = sparse_args.attention_config(attention_config, explicit)
    # (a fix under CP drops it: its ring needs this backend)
    cp = max(d for _, d in training_args.cp_degrees()) > 1 if hasattr(training_args, "cp_degrees") else False
    with flag_errors((ValueError,)):  # (what the kernels do not compute, naming the fix: the message alone)
        check_model_supports_sparse_attention(model, context_parallel=cp)
    with flag_errors():  # (the user's settings against this model: a launched script ends with the message alone)
        config.check_layers(language_config(model.config).num_hidden_layers)
    if max_length is not None:
        config.check_sparse_at(max_length, attention_layers(model.config))
    undo_recorded(model, _SPARSE_ATTENTION)
    patches = record_on(model, _SPARSE_ATTENTION)
    try:
        _switch(model, patches, sparse_args, config, training_args, max_length, cp)
        with flag_errors((ValueError,)):  # (again, switched: the attention layers are probed now)
            check_model_supports_sparse_attention(model, context_parallel=cp)
        if max_length is not None:
            check_mask_only_locality(model, max_length, packed_documents)
    except BaseException:
        patches.undo()  # nothing of a refused switch stays
        raise
    return config


def _switch(model: torch.nn.Module, patches: PatchSet, sparse_args: SparseCPArguments, config: SparseAttentionConfig,
            training_args: TrainingArguments | None, max_length: int | None, context_parallel: bool) -> None:
    """What `enable_sparse_attention` changes, each change recorded in `patches` (`context_parallel`: training
    under CP, whose refusals' dense fixes drop it)."""
    if not is_patched():
        patch()
        patches.on_undo(unpatch, outside=True)
    if sparse_args.sparse_fused_loss and not is_lean_loss_enabled():
        enable_lean_loss()
        patches.on_undo(disable_lean_loss, outside=True)
    with flag_errors((ValueError,)):  # (an architecture whose attention the backend never reaches: the message alone)
        previous = select_backend(model, context_parallel)
    store_pattern(model, config.to_dict(), patches)
    patches.on_undo(functools.partial(forget_layer_state, model))
    if previous is not None and previous != BACKEND_NAME:
        patches.on_undo(functools.partial(_set_attn_implementation, model, previous))
    remove_guard = guard_registration(model)
    if remove_guard is not None:
        patches.on_undo(remove_guard)
    if (training_args is not None and sparse_args.checkpointing_due(max_length)
            and not checkpointing_enabled(training_args)):
        logger.warning("Sequence length %d >= --sparse_gradient_checkpointing_min_length %d: turning gradient "
                       "checkpointing on.", max_length, sparse_args.sparse_gradient_checkpointing_min_length)
        for name in _CHECKPOINTING_FLAGS:
            if hasattr(training_args, name):
                patches.set_attr(training_args, name, True, outside=True)
    with flag_errors((ValueError,)):  # (a setting this machine cannot run, naming the fix: the message alone)
        choice = fused_ops_choice(model, sparse_args, training_args)
    if choice != "off":  # before the token tiles, which wrap the fused modules
        enable_fused_ops(model, choice, liger_settings(getattr(training_args, "liger_kernel_config", None),
                                                       sparse_args.sparse_fused_loss))
        patches.on_undo(functools.partial(disable_fused_ops, model))
    if choice == "liger" and getattr(training_args, "use_liger_kernel", False):
        # applied here, before the token tiles: the Trainer's own application would replace them
        patches.set_attr(training_args, "use_liger_kernel", False, outside=True)
    savers = sparse_args.memory_savers(max_length)
    if savers.active:
        enable_memory_savers(model, savers)
        patches.on_undo(functools.partial(disable_memory_savers, model))


def fused_ops_choice(model: torch.nn.Module, sparse_args: SparseCPArguments,
                     training_args: TrainingArguments | None) -> str:
    """'liger', 'compile' or 'off' (`integration.fused_ops`): `training_fused_ops` with training arguments, else
    `--sparse_fused_ops` on CUDA where the model is."""
    if training_args is not None:
        return training_fused_ops(sparse_args.sparse_fused_ops, training_args)
    return resolve_fused_ops(sparse_args.sparse_fused_ops, any(p.is_cuda for p in model.parameters()))


def training_fused_ops(setting: str, training_args: TrainingArguments) -> str:
    """'liger', 'compile' or 'off' for `--sparse_fused_ops setting` in a Trainer of `training_args`: the
    Trainer's `--use_liger_kernel` asks for liger-kernel's kernels (with 'auto', or 'liger'); on CUDA when the
    Trainer trains there; 'auto' leaves a model the Trainer compiles whole (`compiles_whole`) to torch.compile. Raises
    ValueError, naming the fix, for what this machine cannot run (also checked as the plugin's arguments parse,
    before a script builds its data)."""
    if getattr(training_args, "use_liger_kernel", False):
        if setting not in ("auto", "liger"):
            raise ValueError(f"--use_liger_kernel asks for liger-kernel's kernels and --sparse_fused_ops {setting} "
                             "for something else; drop one of the two.")
        setting = "liger"
    return resolve_fused_ops(setting, torch.cuda.is_available() and not training_args.use_cpu,
                             compiled=compiles_whole(training_args))


def compiles_whole(training_args: TrainingArguments) -> bool:
    """Whether a Trainer of `training_args` compiles the model whole: `--torch_compile`, or without it accelerate's
    dynamo backend (`accelerate launch --dynamo_backend`, a config file's `dynamo_config`), which the Trainer's
    TorchDynamoPlugin then reads from $ACCELERATE_DYNAMO_BACKEND."""
    if getattr(training_args, "torch_compile", False):
        return True
    return os.environ.get("ACCELERATE_DYNAMO_BACKEND", "no").lower() != "no"


def _set_attn_implementation(model: torch.nn.Module, implementation: str | dict) -> None:
    model.set_attn_implementation(implementation)


def disable_sparse_attention(model: torch.nn.Module) -> None:
    """Undo `enable_sparse_attention(model, ...)`: the model's attention implementation and stored
    settings, the training arguments it changed, and the registrations it made (no-op when not enabled)."""
    require_model(model, "disable_sparse_attention(model)")
    undo_recorded(model, _SPARSE_ATTENTION)


def check_launch(trainer: Trainer) -> None:
    """Raise ValueError, naming the fix, when the processes launched and the Trainer's view of them
    disagree: e.g. torchrun on CPU without `--use_cpu` starts N processes that accelerate then runs
    as N independent single-process jobs, each training its own model with no gradient sync."""
    launched = max(rank_and_world()[1], launched_world_size() or 1)
    running = trainer.accelerator.num_processes
    if launched == running:
        return
    if not trainer.args.use_cpu and not torch.accelerator.is_available():
        fix = ("Without a GPU, pass --use_cpu (use_cpu=True in TrainingArguments; SparseTrainingArguments sets it on a "
               "machine without an accelerator): accelerate joins CPU processes only when told.")
    else:
        # (the arguments set accelerate's state up as they are built: where a process built them before it forked
        # the launched ones, each keeps that one-process state, with the group never joined)
        fix = ("The TrainingArguments were built before these processes were launched (outside the function given to "
               "accelerate's notebook_launcher, or to a launcher that forks): each process keeps their one-process "
               "set-up. Build the TrainingArguments inside that function.")
    raise ValueError(f"{launched} processes were launched but the Trainer sees {running}: each would train its own "
                     f"model without gradient sync. {fix}")


def apply_ddp_timeout(trainer: Trainer, patches: PatchSet) -> None:
    """Make the Trainer's `--ddp_timeout` the default process group's timeout, which the context-parallel groups
    then take (`ParallelDims`): transformers passes it to accelerate on GPUs but not on CPU processes, whose gloo
    group then keeps its 30 min default, so a stopped rank left the others waiting that long."""
    if not (dist.is_available() and dist.is_initialized()):
        return
    wanted, previous = timedelta(seconds=trainer.args.ddp_timeout), group_timeout()
    if wanted != previous:
        upstream.set_process_group_timeout(wanted)
        patches.on_undo(functools.partial(upstream.set_process_group_timeout, previous), outside=True)


def describe_layers(model: torch.nn.Module, max_length: int | None,
                    pattern: SparseAttentionConfig | None = None) -> tuple[str, str]:
    """How the model's layers attend (sparse or dense, and why) with `pattern` (default: the model's), and a note when
    `max_length` leaves them all dense ('' otherwise): the start-up line's first part and its ending."""
    config = model.config
    cfg = model_config_for(model) if pattern is None else pattern
    n = language_config(config).num_hidden_layers
    sliding = sliding_window_layers(config)
    dense = [i for i in range(n) if cfg.for_layer(i).pattern == "dense" and i not in sliding]
    sparse = [i for i in range(n) if i not in dense and i not in sliding]
    parts = [f"{len(sparse)} of {n} layers vertical-slash (block {cfg.block_size})"]
    if dense:
        parts.append(f"{_ranges(dense)} dense (pattern)")
    if sliding:
        parts.append(f"{_ranges(sliding)} sliding-window (dense within the window)")
    note = ""
    if sparse and max_length is not None and max_length < cfg.min_seq_len:
        note = (f" At {max_length} tokens no document reaches min_seq_len={cfg.min_seq_len}: every layer runs "
                "dense. For a trial run that shows sparsity at this length, give --sparse_config trial (a shipped "
                "pattern sparse at 1K-4K tokens); --sparse_min_seq_len alone keeps nearly every block there.")
    return "sparse_cp: " + "; ".join(parts), note


def _ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5] -> 'layers 0-2, 5'; [0] -> 'layer 0'."""
    runs, start = [], layers[0]
    for a, b in zip(layers, [*layers[1:], None]):
        if b != a + 1:
            runs.append(f"{start}-{a}" if a > start else str(a))
            start = b
    return ("layers " if len(layers) > 1 else "layer ") + ", ".join(runs)


def count_step_metrics(trainer: Trainer, patches: PatchSet,
                       check: Callable[[Any], None] | None = None) -> StepMetricsCallback:
    """Log tokens per second and peak memory with every training log (`StepMetricsCallback`, first among the
    callbacks, so the reporters see them): the trainer's `training_step` counts each batch's tokens (and passes it
    to `check`, e.g. `row_length_watch`) before it trains on it."""
    metrics = StepMetricsCallback()
    patches.insert(trainer.callback_handler, "callbacks", 0, metrics)
    training_step = trainer.training_step

    def counting_step(model, inputs, *rest, **kwargs):
        metrics.count(inputs, trainer.get_cp_size())
        if check is not None:
            check(inputs)
        return training_step(model, inputs, *rest, **kwargs)

    patches.set_attr(trainer, "training_step", counting_step)
    return metrics


def log_sparsity(trainer: Trainer, patches: PatchSet) -> None:
    """Log the kept fraction with every log (`SparsityLoggingCallback`, first among the callbacks, so the reporters
    see its keys; not a second one where the trainer has one), and make an evaluation's log count its own forwards
    only: the trainer's `evaluation_loop` drops the evaluation-mode sums left before it (a user's check of the model,
    a generation), which no callback event can (none fires before the loop's first forward)."""
    if not any(isinstance(cb, SparsityLoggingCallback) for cb in trainer.callback_handler.callbacks):
        patches.insert(trainer.callback_handler, "callbacks", 0, SparsityLoggingCallback())
    evaluation_loop = trainer.evaluation_loop

    def own_forwards_loop(*args, **kwargs):
        pop_kept_fractions(trainer.model, training=False)
        return evaluation_loop(*args, **kwargs)

    patches.set_attr(trainer, "evaluation_loop", own_forwards_loop)


def savers_left_off(trainer: Trainer, sparse_args: SparseCPArguments, tokens: int) -> list[str]:
    """The memory savers that rows of `tokens` tokens would have turned on (the thresholds of `sparse_args`) and the
    trainer's model runs without: set up for shorter rows, or for a length not known."""
    off = []
    if sparse_args.checkpointing_due(tokens) and not checkpointing_enabled(trainer.args):
        off.append("gradient checkpointing (--sparse_gradient_checkpointing_min_length "
                   f"{sparse_args.sparse_gradient_checkpointing_min_length})")
    if sparse_args.memory_savers(tokens).tiled and not token_tiles_enabled(trainer.model):
        off.append(f"token tiles (--sparse_token_tiling_min_length {sparse_args.sparse_token_tiling_min_length})")
    return off


def row_length_watch(trainer: Trainer, sparse_args: SparseCPArguments,
                     max_length: int | None) -> Callable[[Any], None]:
    """A check of each training batch (`count_step_metrics`) that warns once, naming the fix, at the first whose rows
    are long enough for a memory saver that the run, set up for rows of `max_length` tokens (None: not known), left
    off (`savers_left_off`): a --sparse_max_length shorter than the data, or a dataset whose first row is shorter
    than the others. It reads the batch's shape only (no device sync)."""
    warned = False

    def check(inputs: Any) -> None:
        nonlocal warned
        if warned:
            return
        rows = inputs.get("input_ids", inputs.get("inputs_embeds")) if isinstance(inputs, Mapping) else None
        tokens = rows.shape[1] if isinstance(rows, torch.Tensor) and rows.dim() >= 2 else 0
        if max_length is not None and tokens <= max_length:
            return
        off = savers_left_off(trainer, sparse_args, tokens)
        if off:
            warned = True
            set_for = ("a length not known at set-up" if max_length is None else
                       f"rows of {max_length} tokens (--sparse_max_length / max_length)")
            logger.warning("A training batch holds rows of %d tokens; the memory savers were set up for %s, and %s "
                           "stay off: pass --sparse_max_length %d (the longest rows), or cut the rows to the length "
                           "given.", tokens, set_for, " and ".join(off), tokens)

    return check


def skip_unused_parameter_search(trainer: Trainer, model: Any, training_args: TrainingArguments) -> None:
    """Where `model`'s architecture uses every parameter (`uses_every_parameter`) and `--ddp_find_unused_parameters` is
    unset, set it to False: the Trainer's default without gradient checkpointing has DDP search the graph after every
    backward, and warn at every run that it found nothing. Call it before the Trainer builds its accelerator from
    `training_args`; for a model built after that (`model_init`'s first and a model TRL loads from its name, both in
    the Trainer class's `__init__`) it sets the DDP settings the accelerator was built with too. Undone by
    `detach_from_trainer`."""
    config = getattr(model, "config", None)
    if training_args.ddp_find_unused_parameters is not None or config is None or not uses_every_parameter(config):
        return
    patches = attached_patches(trainer, _UNUSED_PARAMETERS) or record_on(trainer, _UNUSED_PARAMETERS)
    patches.set_attr(training_args, "ddp_find_unused_parameters", False, outside=True)
    handler = getattr(getattr(trainer, "accelerator", None), "ddp_handler", None)
    if handler is not None:
        patches.set_attr(handler, "find_unused_parameters", False, outside=True)


def prepare_for_training_after_evaluation(trainer: Trainer, patches: PatchSet) -> None:
    """Make `train()` after `evaluate()` (or `predict()`) wrap the model for training as a run that trains first does.

    An evaluation before any training prepares the model in accelerate's evaluation mode (no DDP wrapper) and marks
    it prepared; the training's `accelerator.prepare` then returns it as it is. Without DDP, each process stepped with
    its own gradients: its own batch's under data parallelism, its shard's share under CP (the ranks' weights
    diverged from the first step, the step's grad norm a rank's own). A model prepared for evaluation only is
    prepared again when the Trainer prepares it for training: its mark, its entry among the accelerator's models
    and its mixed-precision forward are taken back first."""
    accelerator = trainer.accelerator
    original = accelerator.prepare_model
    evaluated: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its __dict__ entries before

    def prepare_model(model, device_placement=None, evaluation_mode=False):
        before = evaluated.pop(model, None) if not evaluation_mode else None
        if before is not None:
            for name, value in before.items():
                if value is _ABSENT:
                    model.__dict__.pop(name, None)
                else:
                    model.__dict__[name] = value
            accelerator._models[:] = [m for m in accelerator._models if m is not model]
        fresh = evaluation_mode and not getattr(model, "_is_accelerate_prepared", False)
        saved = {name: model.__dict__.get(name, _ABSENT) for name in _PREPARED_MEMBERS} if fresh else None
        prepared = original(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        if fresh and prepared is model:
            evaluated[model] = saved
        return prepared

    patches.set_attr(accelerator, "prepare_model", prepare_model)


def shift_smoothed_labels_under_fsdp(trainer: Trainer, patches: PatchSet) -> None:
    """Make the Trainer's label smoothing (`--label_smoothing_factor`) of a causal LM under FSDP2 shift its labels,
    as it does without FSDP: the Trainer decides by the model class's name, which FSDP2 replaces
    (`fsdp_class_names.smoother_shifts_labels`). Under CP the CP group's smoother decides so itself
    (`cp_token_loss.smooth_labels_over_cp_group`); this is the runs without CP's. No-op without label smoothing
    or FSDP."""
    smoother = trainer.label_smoother
    if smoother is None or not trainer.is_fsdp_enabled:
        return

    def smooth(model_output, labels, shift_labels=False, num_items_in_batch=None):
        shift = shift_labels or fsdp_class_names.smoother_shifts_labels(trainer.model)
        return smoother(model_output, labels, shift_labels=shift, num_items_in_batch=num_items_in_batch)

    patches.set_attr(trainer, "label_smoother", smooth)


_ABSENT = object()
# What accelerate's `prepare_model` sets on the model itself in evaluation mode: the mark that it was prepared and
# the mixed-precision forward (autocast, outputs in fp32) with the forward it wraps.
_PREPARED_MEMBERS = ("_is_accelerate_prepared", "forward", "_original_forward")


def attach_to_trainer(
    trainer: Trainer,
    sparse_args: SparseCPArguments,
    cp_config: ContextParallelConfig | None = None,
    *,
    max_length: int | None = None,
    cp_schedule: str | None = None,
) -> ParallelDims:
    """Add the plugin to a built Trainer; `detach_from_trainer(trainer)` undoes it.

    Args:
        trainer: the Trainer, before `train()`.
        sparse_args: with `sparse_log_sparsity`, the sparsity-logging callback goes first (before the
            reporters, so TensorBoard / W&B see its keys).
        cp_config: the plugin's CP flags; with a CP size above 1 (here or in accelerate's
            `ParallelismConfig`) the trainer switches to sparse context parallelism.
        max_length: the training sequence length, when known: the start-up line then says whether
            any document reaches `min_seq_len`.
        cp_schedule: a context-length curriculum (`schedule.parse_schedule`): the stages' CP degrees
            replace `cp_config.cp_size`, switched online at step boundaries (`curriculum.py`).

    Returns:
        The `ParallelDims` in use (with a schedule, the first stage's). Checkpoints the trainer saves
        are marked complete only once every rank has saved, and `train(resume_from_checkpoint=...)`
        refuses an incomplete, damaged or mismatched one (`checkpoints.py`). The trainer's `--ddp_timeout`
        becomes the process group's timeout (`apply_ddp_timeout`). The Trainer's `--fsdp` on CPU processes runs
        FSDP2 (`enable_cpu_fsdp2`, as `SparseTrainer` does; accelerate alone trains unsharded DDP replicas there).
    """
    require_trainer(trainer, "attach_to_trainer(trainer, ...)")
    require_instance(sparse_args, SparseCPArguments, "attach_to_trainer(trainer, sparse_args, ...)", "sparse_args",
                     "SparseCPArguments(sparse_attention=True)")
    if cp_config is not None:
        require_instance(cp_config, ContextParallelConfig, "attach_to_trainer(trainer, sparse_args, cp_config)",
                         "cp_config", "ContextParallelConfig(cp_size=2)")
    with flag_errors():  # (the processes launched against the Trainer's view: a launched script ends with the message)
        check_launch(trainer)
    if attached_patches(trainer, _DDP_TIMEOUT) is None:
        apply_ddp_timeout(trainer, record_on(trainer, _DDP_TIMEOUT))
    if attached_patches(trainer, _PREPARED_AFTER_EVALUATION) is None:
        prepare_for_training_after_evaluation(trainer, record_on(trainer, _PREPARED_AFTER_EVALUATION))
    with flag_errors():  # (--fsdp on CPU processes: FSDP2, as SparseTrainer runs it; accelerate alone runs DDP)
        set_up_fsdp2(trainer)
    if attached_patches(trainer, _STEP_METRICS) is None:
        sparse = upstream.attn_implementation(trainer.model.config) == BACKEND_NAME
        count_step_metrics(trainer, record_on(trainer, _STEP_METRICS),
                           row_length_watch(trainer, sparse_args, max_length) if sparse else None)
    if sparse_args.sparse_log_sparsity and attached_patches(trainer, _SPARSITY_LOGGING) is None:
        log_sparsity(trainer, record_on(trainer, _SPARSITY_LOGGING))
    if cp_schedule is None:
        parallel = enable_trainer_context_parallel(trainer, cp_config)
    else:
        if cp_config is not None and cp_config.cp_size != 1:
            with flag_errors():
                raise ValueError(f"--cp_schedule sets the CP degree of each stage; drop --cp_size {cp_config.cp_size}.")
        with flag_errors():  # (the stages against this Trainer's data, batch and max_steps: epochs out of order)
            schedule = schedule_for(trainer, parse_schedule(cp_schedule))
        curriculum = enable_curriculum(trainer, schedule, cp_config)
        parallel = curriculum.dims[0]
        cp_schedule = schedule.text
    if parallel.cp_size == 1 and cp_schedule is None and attached_patches(trainer, _SHIFTED_SMOOTHING) is None:
        shift_smoothed_labels_under_fsdp(trainer, record_on(trainer, _SHIFTED_SMOOTHING))
    if attached_patches(trainer, _CHECKPOINTS) is None:
        protect_checkpoints(trainer, parallel, record_on(trainer, _CHECKPOINTS), cp_schedule=cp_schedule)
    if trainer.is_world_process_zero() and upstream.attn_implementation(trainer.model.config) == BACKEND_NAME:
        fused = describe_fused_ops(trainer.model, compiled=compiles_whole(trainer.args))
        if cp_schedule is not None:
            logger.warning("sparse_cp: cp_schedule %s (FROM:SEQ_LEN:CP_SIZE); %s; %d stages:\n%s", cp_schedule, fused,
                           len(curriculum.dims), "\n".join(describe_stages(trainer.model, curriculum)))
        else:
            layers, note = describe_layers(trainer.model, max_length)
            how = parallel.describe() if parallel.cp_size > 1 else "off"
            logger.warning("%s; %s; context parallelism: %s.%s", layers, fused, how, note)
    return parallel


def describe_stages(model: torch.nn.Module, curriculum) -> list[str]:
    """One line per stage of `curriculum` (`curriculum.Curriculum`) for the start-up report: from which step, its
    sequence length, its CP layout and how the model's layers attend with its pattern at that length."""
    schedule, lines = curriculum.schedule, []
    for i, (start, stage, dims) in enumerate(zip(schedule.starts, schedule.stages, curriculum.dims)):
        layers, note = describe_layers(model, stage.seq_len, schedule.configs[i])
        if note:
            layers = f"every layer dense (no document reaches min_seq_len={schedule.configs[i].min_seq_len})"
        layout = dims.describe() if dims.cp_size > 1 else f"no CP, DP {dims.dp_size}"
        lines.append(f"  stage {i} from step {start}: {stage.seq_len} tokens, {layout}; "
                     f"{layers.removeprefix('sparse_cp: ')}.")
    return lines


def attach_to_rebuilt_model(trainer: Trainer, cp_config: ContextParallelConfig | None = None,
                            cp_schedule: str | None = None) -> ParallelDims:
    """Set context parallelism (or the `cp_schedule` curriculum) up again on `trainer.model`, rebuilt by the
    Trainer's `model_init` at `train()` after `attach_to_trainer` (the same `cp_config` and `cp_schedule`): the hooks
    they put on the model, its sparse pattern and the stages' patterns belong to the model they were set up on.
    Returns the `ParallelDims` in use (with a schedule, the first stage's), on the process groups built before for
    the same ranks."""
    require_trainer(trainer, "attach_to_rebuilt_model(trainer, ...)")
    if cp_schedule is not None:
        disable_curriculum(trainer)
        with flag_errors():
            schedule = schedule_for(trainer, parse_schedule(cp_schedule))
        return enable_curriculum(trainer, schedule, cp_config).dims[0]
    disable_trainer_context_parallel(trainer)
    return enable_trainer_context_parallel(trainer, cp_config)


def detach_from_trainer(trainer: Trainer) -> None:
    """Undo `attach_to_trainer`: the logging callback, checkpoint protection and context parallelism, and for a
    Trainer a script built under `hf_sparse_cp.run`, its class (no-op when not attached)."""
    require_trainer(trainer, "detach_from_trainer(trainer)")
    disable_curriculum(trainer)
    disable_trainer_context_parallel(trainer)
    undo_recorded(trainer, _SHIFTED_SMOOTHING)
    undo_recorded(trainer, _CHECKPOINTS)
    undo_recorded(trainer, _SPARSITY_LOGGING)
    undo_recorded(trainer, _STEP_METRICS)
    undo_recorded(trainer, _DDP_TIMEOUT)
    undo_recorded(trainer, _PREPARED_AFTER_EVALUATION)
    undo_recorded(trainer, _UNUSED_PARAMETERS)
    disable_cpu_fsdp2(trainer)
    undo_recorded(trainer, LAUNCHED)
