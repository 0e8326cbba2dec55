"""A context-length curriculum in one Trainer run: stages of (start, sequence length, CP degree),
switched online at step boundaries, without a restart or a checkpoint.

`--cp_schedule "0:4096:1,100:16384:2,300:65536:4"` trains steps 0-99 on 4096-token samples with CP 1
x DP world, steps 100-299 on 16384 tokens with CP 2, then 65536 tokens with CP 4. A stage starts at
an optimizer step (`100`) or a data epoch (`1.5ep`: once 1.5 passes over the dataset are consumed),
and may change sparse-pattern fields (`100:16384:2:mass_threshold=0.005:min_seq_len=8192`) and how the CP
group shares attention (`300:65536:8:cp_mode=hybrid:cp_ulysses_size=4`: any `ContextParallelConfig` field
but cp_size, on top of the run's flags).

The world size stays constant, so FSDP2's mesh over dp_shard x cp (or DDP's replicas) keeps every
parameter and optimizer shard (AdamW or SMET) where it is; a switch changes only what depends on
the CP degree, each read from the stage of the step being taken (`trainer.state.global_step`):

* the CP and DP groups: every stage's `ParallelDims` is built before training starts (a switch between
  ring, head-parallel and hybrid attention is as cheap as one of the CP degree: parameters and optimizer
  state do not depend on it);
* the data: one batch sampler over the whole run (`StageBatchSampler`, `stage_data.py`) hands each rank, step by
  step, the samples of its DP rank in the current stage, continuing the global sample order across
  stages (none skipped, none repeated), each cropped to the stage's length;
* the sequence sharding of each batch, and the Trainer's token, flop and loss-token counting;
* the sparse pattern, where a stage changes it.

The learning-rate schedule, step counter, logging and checkpoints run on untouched; since the stage
follows from the step, a checkpoint saved in any stage resumes into that stage (the Trainer's own
data skip replays the sampler's earlier batches as index lists only; without it, `ignore_data_skip`,
the sampler begins at the resumed step).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import IntervalStrategy, SaveStrategy

from ..config import MODEL_CONFIG_ATTRIBUTE, language_config
from ..distributed import ContextParallelConfig, ParallelDims
from ..integration import compat, compat_checks, trainer_losses, upstream
from ..integration.call_context import guard_context_parallel
from ..integration.given import require_instance, require_trainer
from ..integration.heads import SEQUENCE_CLASSIFICATION, model_head
from ..integration.layer_settings import model_config_for
from ..integration.models import attention_layers, check_model_supports_context_parallel
from ..integration.patching import PatchSet, record_on, undo_recorded
from ..integration.planner_weights import planned_linear_weight
from ..integration.registration import store_pattern
from ..reporting.model_card import CardStage
from .arguments import flag_errors
from .callbacks import add_to_log
from .cp_batches import first_batch_of_each_run, follow_first_ranks_generators, pad_token_id, step_inputs
from .cp_checks import check_loss, check_training_arguments, warn_inexact
from .cp_steps import count_once_per_cp_group, cp_group_steps
from .schedule import Stage
from .stage_data import StageDataLoader
from .stage_loader import train_data_loader
from .stage_plan import Schedule, build_schedule, check_zigzag_length

logger = logging.getLogger(__name__)

_FEATURE = "curriculum"


class Curriculum:
    """The stages of a run and the state that follows the step being taken; built by `enable_curriculum`,
    whose `patches` record every change a stage makes (undone by `disable_curriculum`)."""

    def __init__(self, trainer: Trainer, schedule: Schedule, dims: Sequence[ParallelDims],
                 patches: PatchSet) -> None:
        self.trainer, self.schedule, self.dims, self.patches = trainer, schedule, dims, patches
        self.index: int | None = None
        # The model's own pattern: a stage's is a training setting, like its CP degree (see `finish`).
        self.pattern = getattr(trainer.model.config, MODEL_CONFIG_ATTRIBUTE, None)
        # In a train() call (`_FinishCurriculum`): outside one, before training too, the model keeps its own pattern.
        self.training = False

    def finish(self) -> None:
        """At the end of training, the model's own pattern back on it (recorded): the model saved after
        the run carries the run's pattern, not the last stage's; so does one saved after an evaluation or
        prediction of the trained model (`stage`)."""
        store_pattern(self.trainer.model, self.pattern, self.patches)
        self.index = None
        self.training = False

    def stage(self) -> int:
        """The stage of the step being taken; on entering a stage in training, its sparse pattern goes onto the
        model. Outside training (an evaluation of the trained model, whose CP layout is its last step's stage's, or a
        baseline one before train(), at the first stage's) the model keeps its own pattern: put back on it, the last
        stage's went into a model saved after the evaluation (stock run_clm's push_to_hub comes after its evaluation),
        the first stage's into one saved after an evaluation before training."""
        index = self.schedule.index_at(self.trainer.state.global_step)
        if not self.training:
            return index
        if index != self.index:
            self.index = index
            stage = self.schedule.stages[index]
            store_pattern(self.trainer.model, self.schedule.configs[index].to_dict(), self.patches)
            dims = self.dims[index]
            logger.info("cp_schedule stage %d from step %d: %d-token samples, CP %d (%s) x DP %d.", index,
                        self.trainer.state.global_step, stage.seq_len, dims.cp_size, dims.mode.name, dims.dp_size)
        return index

    def parallel(self) -> ParallelDims:
        return self.dims[self.stage()]

    def samples(self, first: int, last: int) -> int:
        """The samples optimizer steps `first` to `last - 1` take: per-device batch x accumulation x their stage's DP
        degree each."""
        args = self.trainer.args
        per_rank = args.train_batch_size * args.gradient_accumulation_steps
        return sum(per_rank * self.dims[self.schedule.index_at(step)].dp_size for step in range(first, last))


def card_stages(trainer: Trainer) -> tuple[str | None, list[CardStage]]:
    """The `--cp_schedule` text and stages (`CardStage`) of `trainer`'s curriculum, as its model card states them;
    (None, []) without one."""
    found = next((cb.curriculum for cb in trainer.callback_handler.callbacks if isinstance(cb, _FinishCurriculum)),
                 None)
    if found is None:
        return None, []
    schedule = found.schedule
    return schedule.text, [CardStage(start, stage.seq_len, dims)
                           for start, stage, dims in zip(schedule.starts, schedule.stages, found.dims)]


class _FinishCurriculum(TrainerCallback):
    """Calls `Curriculum.finish` when training ends (before the script saves the model), and marks a `train()` begun."""

    def __init__(self, curriculum: Curriculum) -> None:
        self.curriculum = curriculum

    def on_train_begin(self, args, state, control, **kwargs):
        self.curriculum.training = True

    def on_train_end(self, args, state, control, **kwargs):
        self.curriculum.finish()


class _StageSamplesPerSecond(TrainerCallback):
    """Makes the end of training's `train_samples_per_second` count the samples its steps took: the Trainer counts
    every step at the first stage's total batch size, where a step takes its own stage's (its DP degree's). First
    among the callbacks, so that the reporting ones log the count."""

    def __init__(self, curriculum: Curriculum) -> None:
        self.curriculum, self.first_step = curriculum, 0

    def on_train_begin(self, args, state, control, **kwargs):
        self.first_step = state.global_step  # (a resumed run's: its checkpoint's step)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "train_samples_per_second" in logs and logs.get("train_runtime"):
            samples = self.curriculum.samples(self.first_step, state.global_step)
            add_to_log(state, logs, {"train_samples_per_second": round(samples / logs["train_runtime"], 3)})


class _DataPassEnds(TrainerCallback):
    """Makes --save_strategy, --eval_strategy and --logging_strategy `epoch` act at the end of each pass over the data,
    as without a schedule: the curriculum's sampler is one Trainer epoch of the whole run, whose end the Trainer marks
    once, at the last step (a run of several passes saved and evaluated only then). A pass ends in the step that takes
    its last sample, as the stages' epoch starts count them; the last step's end is the Trainer's own epoch end."""

    def __init__(self, curriculum: Curriculum) -> None:
        self.curriculum, self.taken = curriculum, 0  # taken: samples the steps of this run took so far

    def on_train_begin(self, args, state, control, **kwargs):
        # (a resume that replays no batches starts the samples over at its step: `StageBatchSampler`)
        self.taken = 0 if args.ignore_data_skip else self.curriculum.samples(0, state.global_step)

    def on_step_end(self, args, state, control, **kwargs):
        step, num_samples = state.global_step, len(self.curriculum.trainer.train_dataset)
        before, self.taken = self.taken, self.taken + self.curriculum.samples(step - 1, step)
        passes = self.taken // num_samples
        if step >= state.max_steps or passes == before // num_samples:
            return
        if args.logging_strategy == IntervalStrategy.EPOCH:
            control.should_log = True
        if args.eval_strategy == IntervalStrategy.EPOCH and args.eval_delay <= passes:
            control.should_evaluate = True
        if args.save_strategy == SaveStrategy.EPOCH:
            control.should_save = True


def schedule_for(trainer: Trainer, stages: Sequence[Stage]) -> Schedule:
    """`build_schedule` for a built Trainer: its world size, batch sizes, dataset and the model's pattern."""
    args, dataset = trainer.args, trainer.train_dataset
    world = trainer.accelerator.num_processes
    per_step = [args.train_batch_size * args.gradient_accumulation_steps * ParallelDims.dp_size_for(world, s.cp_size)
                for s in stages]
    return build_schedule(stages, world_size=world, sparse_config=model_config_for(trainer.model),
                          max_steps=args.max_steps, samples_per_step=per_step,
                          num_samples=len(dataset) if hasattr(dataset, "__len__") else None,
                          layers=attention_layers(trainer.model.config),
                          n_layers=language_config(trainer.model.config).num_hidden_layers)


def enable_curriculum(
    trainer: Trainer, schedule: Schedule | Sequence[Stage], cp_config: ContextParallelConfig | None = None
) -> Curriculum:
    """Train `trainer` through the stages of `schedule`; `disable_curriculum(trainer)` undoes it.

    Call after building the Trainer and before `train()`, on every rank (it creates every stage's
    process groups); the model must already use `sparse_cp` (`enable_sparse_attention`).

    Args:
        trainer: the Trainer (its `train_dataset` has a length; `max_steps` set).
        schedule: from `build_schedule`, or the stages of `parse_schedule` (resolved for this Trainer by
            `schedule_for`).
        cp_config: the CP flags other than the degree (sharding, ring, mode); the stages set `cp_size` and
            may change the others.

    Returns:
        The `Curriculum`; the trainer's data loader, CP input preparation and token counting follow it.
    """
    require_trainer(trainer, "enable_curriculum(trainer, ...)")
    if isinstance(schedule, (tuple, list)) and schedule and all(isinstance(s, Stage) for s in schedule):
        schedule = schedule_for(trainer, schedule)
    require_instance(schedule, Schedule, "enable_curriculum(trainer, schedule, ...)", "schedule",
                     "the stages of parse_schedule('0:4096:1,200:16384:2')")
    if cp_config is not None:
        require_instance(cp_config, ContextParallelConfig, "enable_curriculum(trainer, schedule, cp_config)",
                         "cp_config", "ContextParallelConfig(cp_sharding='zigzag')")
    cp_config = ContextParallelConfig() if cp_config is None else cp_config
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    model = trainer.model
    with flag_errors((ValueError,)):  # (what CP cannot compute exactly, naming the fix: a launched script ends
        # with the message; a TypeError of the probe forward through the model is a bug and keeps its traceback)
        if pc is not None and pc.cp_size > 1:
            raise ValueError(f"accelerate's ParallelismConfig(cp_size={pc.cp_size}) fixes the CP degree for the whole "
                             "run; a cp_schedule builds its own groups: drop parallelism_config_cp_size from the "
                             "accelerate config.")
        if any(s.cp_size > 1 for s in schedule.stages):
            # (first: a refusal of the trainer itself, not of a setting whose fix would only meet it next)
            if type(trainer).compute_loss in trainer_losses.cp_whole_row_losses():
                raise ValueError(f"a cp_schedule with {type(trainer).__name__}: a stage crops each sample's "
                                 "input_ids to its length, and a preference sample's prompt and completions are kept "
                                 "whole. Train it under CP with --cp_size (a single CP degree) instead of "
                                 "--cp_schedule.")
            check_model_supports_context_parallel(model)
            check_loss(trainer, max(s.cp_size for s in schedule.stages))
            check_training_arguments(trainer.args, max(s.cp_size for s in schedule.stages))
            warn_inexact(trainer)
        _refuse_split_batches(trainer, schedule)
        configs = []
        for i, stage in enumerate(schedule.stages):
            with stage.refusals(i):
                configs.append(stage.cp_config(cp_config))
                configs[-1].check_model(model.config)  # the stage's layout, before its groups are built
                check_zigzag_length(stage, schedule.configs[i], configs[-1])
    compat_checks.require(f"transformers.Trainer.{compat.TRAINER_CP_INPUTS}")
    built: list[tuple[ContextParallelConfig, ParallelDims]] = []  # one ParallelDims (and its groups) per layout
    for config in configs:
        if not any(config == seen for seen, _ in built):
            built.append((config, ParallelDims.from_config(
                config, model_linear_per_token=planned_linear_weight(model, config))))
    dims = tuple(next(parallel for seen, parallel in built if seen == config) for config in configs)
    pad_id = pad_token_id(trainer, model)
    patches = record_on(trainer, _FEATURE)
    curriculum = Curriculum(trainer, schedule, dims, patches)

    checked_stages: set[int] = set()  # the stages whose first batch was checked, in this train() call
    first_batch = first_batch_of_each_run(trainer)

    def prepare_inputs(inputs: dict[str, Any]) -> dict[str, Any]:
        parallel = curriculum.parallel()
        if parallel.cp_size == 1:
            return inputs
        if first_batch():
            checked_stages.clear()
        stage = curriculum.schedule.index_at(trainer.state.global_step)
        verify = stage not in checked_stages  # (each stage's first batch: its CP groups are new)
        checked_stages.add(stage)
        sparse_config = model_config_for(model)
        return step_inputs(inputs, parallel, sparse_config, pad_id, verify,
                           model_head(model) == SEQUENCE_CLASSIFICATION)

    for handle in guard_context_parallel(model):
        patches.on_undo(handle.remove)
    count_once_per_cp_group(trainer, patches, curriculum.parallel, owns_cp=False)
    follow_first_ranks_generators(trainer, patches, curriculum.parallel)
    cp_group_steps(trainer, patches, curriculum.parallel, prepare_inputs)
    # evaluation batches: sharded over the DP ranks of the stage in progress, whenever the loader is used
    patches.set_attr(trainer.accelerator, "prepare_data_loader",
                     lambda *args, **kwargs: StageDataLoader(trainer, curriculum.parallel, args, kwargs))

    def get_train_dataloader():
        return train_data_loader(trainer, curriculum.schedule, curriculum.dims)

    patches.set_attr(trainer, "get_train_dataloader", get_train_dataloader)
    callbacks = trainer.callback_handler.callbacks
    patches.insert(trainer.callback_handler, "callbacks", len(callbacks), _FinishCurriculum(curriculum))
    # (before the checkpoint marker, which marks a save in progress where its on_step_end sees one decided)
    patches.insert(trainer.callback_handler, "callbacks", 0, _DataPassEnds(curriculum))
    patches.insert(trainer.callback_handler, "callbacks", 0, _StageSamplesPerSecond(curriculum))
    logger.info("cp_schedule: %s (stages from steps %s).", schedule.text, list(schedule.starts))
    return curriculum


def _refuse_split_batches(trainer: Trainer, schedule: Schedule) -> None:
    """Raise ValueError, naming the fix, for accelerate's split_batches where a stage has several data-parallel ranks:
    a step of the curriculum's sampler takes per_device_train_batch_size x accumulation samples on every DP rank of its
    stage, where split_batches means that many in all, split over the ranks (the run took DP-degree times more, and
    trained another run than the flags said, silently). With one DP rank in every stage the two agree."""
    if not upstream.dp_data_loader_options(trainer.accelerator).get("split_batches"):
        return
    world = trainer.accelerator.num_processes
    split = [(i, stage, dp) for i, stage in enumerate(schedule.stages)
             if (dp := ParallelDims.dp_size_for(world, stage.cp_size)) > 1]
    if not split:
        return
    (i, stage, dp), batch = split[0], trainer.args.per_device_train_batch_size
    fix = (f"For the {batch} samples a batch that split_batches shares out, give --per_device_train_batch_size "
           f"{batch // world} without split_batches" if batch % world == 0 else
           f"Drop split_batches and give the samples a step takes per process ({batch} do not split over {world})")
    raise ValueError(
        f"split_batches=True (--accelerator_config) with a cp_schedule whose stage {i} ({stage.text}) has "
        f"{dp} data-parallel ranks: a curriculum's step takes per_device_train_batch_size x "
        f"gradient_accumulation_steps samples on every DP rank of its stage, not that many split over them. {fix} "
        "(at CP 1: a stage at CP degree c takes 1/c of them).")


def disable_curriculum(trainer: Trainer) -> None:
    """Undo `enable_curriculum` on `trainer` (no-op when it is not enabled)."""
    require_trainer(trainer, "disable_curriculum(trainer)")
    undo_recorded(trainer, _FEATURE)
