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
* the data: one batch sampler over the whole run (`StageBatchSampler`) hands each rank, step by
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

import dataclasses
import logging
import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import IntervalStrategy, SaveStrategy

from ..config import MODEL_CONFIG_ATTRIBUTE, SparseAttentionConfig, language_config
from ..distributed import ContextParallelConfig, ParallelDims, ShardPlan, check_sizes
from ..integration import compat
from ..integration.backend import guard_context_parallel, model_config_for
from ..integration.given import require_instance, require_trainer
from ..integration.heads import SEQUENCE_CLASSIFICATION, model_head
from ..integration.models import attention_layers, check_model_supports_context_parallel
from ..integration.patching import PatchSet, record_on, undo_recorded
from ..integration.planner_weights import planned_linear_weight
from ..integration.registration import store_pattern
from ..reporting.model_card import CardStage
from ..smet import SMETConfig
from .arguments import flag_errors
from .callbacks import add_to_log
from .context_parallel import (
    count_once_per_cp_group,
    cp_group_steps,
    dp_data_loader,
    first_batch_of_each_run,
    follow_first_ranks_generators,
    pad_token_id,
    step_inputs,
)
from .cp_checks import check_loss, check_training_arguments, warn_inexact
from .schedule import Stage, parse_schedule

logger = logging.getLogger(__name__)

_FEATURE = "curriculum"


@dataclass(frozen=True)
class Schedule:
    """Validated stages with their start steps (epochs resolved), for one run."""

    stages: tuple[Stage, ...]
    starts: tuple[int, ...]
    configs: tuple[SparseAttentionConfig, ...]

    @property
    def text(self) -> str:
        return ",".join(s.text for s in self.stages)

    def index_at(self, step: int) -> int:
        """The stage of the optimizer step that follows `step` completed steps."""
        return max(i for i, start in enumerate(self.starts) if start <= step)


def _seq_len_fix(seq_len: int, unit: int) -> str:
    lower, upper = max(unit, seq_len // unit * unit), -(-seq_len // unit) * unit
    return f"seq_len={lower}" + (f" or {upper}" if upper != lower else "")


def build_schedule(
    stages: Sequence[Stage],
    *,
    world_size: int,
    sparse_config: SparseAttentionConfig,
    max_steps: int,
    samples_per_step: Sequence[int] | None = None,
    num_samples: int | None = None,
    layers: Sequence[int] | None = None,
    n_layers: int | None = None,
) -> Schedule:
    """Validate `stages` for a run and resolve epoch starts into steps.

    Args:
        stages: `parse_schedule`'s stages, in order.
        world_size: the processes of the run (constant over the stages).
        sparse_config: the run's sparse pattern; a stage's `sparse` fields go on top.
        max_steps: the run's optimizer steps (`--max_steps`).
        samples_per_step: distinct samples one step consumes in each stage (per-device batch x gradient
            accumulation x DP degree); needed for epoch starts.
        num_samples: samples in the dataset; needed for epoch starts.
        layers: the model's layers that run the pattern (`models.attention_layers`), for the check that
            each stage's pattern stays sparse at its length (default: the stage's config itself).
        n_layers: the model's decoder layers, which a stage's `layer_overrides` keys must stay within.

    Returns:
        The `Schedule`. Raises ValueError, naming the fix, when a CP degree does not divide the world
        size, a sequence length does not split into whole blocks per CP rank, a sparse field is unknown or
        invalid or runs every layer dense at the stage's length (`SparseAttentionConfig.check_sparse_at`), the
        first stage does not start at 0 or the starts do not increase within max_steps.
    """
    if max_steps <= 0:
        raise ValueError("a cp_schedule needs the run's length in optimizer steps, whether its stages start at steps "
                         "or epochs (an epoch start is resolved into a step within it): set --max_steps.")
    configs = []
    for i, stage in enumerate(stages):
        with stage.refusals(i):
            check_sizes(world_size, stage.cp_size)
        config = _stage_config(i, stage, sparse_config)
        with stage.refusals(i):
            config.check_sparse_at(stage.seq_len, layers)
            if n_layers is not None:
                config.check_layers(n_layers)
        configs.append(config)
    return Schedule(tuple(stages), _starts(stages, max_steps, samples_per_step, num_samples), tuple(configs))


def check_schedule_flags(text: str, sparse_config: SparseAttentionConfig | None, max_steps: int,
                         cp_config: ContextParallelConfig | None = None) -> None:
    """Raise `build_schedule`'s ValueError for what the flags alone decide, as they parse (before a launch starts
    processes that would each refuse them): with the run's pattern `sparse_config` (None: not known yet) each
    stage's fields and whole blocks per CP rank, with the run's CP flags `cp_config` (None: the defaults) each
    stage's CP layout (`enable_curriculum` builds the same), and with --max_steps the starts (with an epoch start,
    resolved from the data, what the starts given alone decide: `_check_given_starts`). The world size, the model and
    the data are checked once the run has them."""
    stages = parse_schedule(text)
    for i, stage in enumerate(stages):
        with stage.refusals(i):
            stage_cp = stage.cp_config(cp_config or ContextParallelConfig())
        if sparse_config is not None:
            config = _stage_config(i, stage, sparse_config)
            with stage.refusals(i):
                _check_zigzag_length(stage, config, stage_cp)
    if max_steps > 0 and all(stage.from_step is not None for stage in stages[1:]):
        _starts(stages, max_steps)
    elif max_steps > 0:
        _check_given_starts(stages, max_steps)


def _check_zigzag_length(stage: Stage, sparse_config: SparseAttentionConfig, cp_config: ContextParallelConfig) -> None:
    """Raise ValueError, naming the fix, when `stage` shards its sequences zigzag (`cp_config`: the stage's) at a
    length that is not whole head and tail chunks of blocks on every rank: each sequence would be padded to the next
    multiple of 2 x blocks x CP (#50: `0:256:4:cp_sharding=zigzag` with 64-token blocks passed the whole-blocks check
    and trained every rank on 128 tokens, 64 of them padding)."""
    if stage.cp_size == 1 or cp_config.cp_sharding != "zigzag":
        return
    block = sparse_config.block_size
    plan = ShardPlan("zigzag", stage.cp_size, block, stage.seq_len)  # (the split the stage's batches get)
    if plan.padded_len != stage.seq_len:
        unit, padded = plan.granularity, plan.padded_len
        raise ValueError(
            f"seq_len={stage.seq_len} does not split into zigzag's head and tail chunks of whole {block}-token blocks "
            f"on each of {stage.cp_size} CP ranks (a multiple of {unit} does): every sequence would be "
            f"padded to {padded} tokens. Use {_seq_len_fix(stage.seq_len, unit)}, cp_sharding=striped (whole blocks "
            "per rank suffice), or another block_size.")


def _check_given_starts(stages: Sequence[Stage], max_steps: int) -> None:
    """Raise `_starts`' ValueError for what a schedule with epoch starts decides before the data resolve them: the
    first stage at 0, the step starts and the epoch starts each increasing (the stages follow one another, and an
    epoch is reached at a later step than an earlier one), no step start at or after max_steps."""
    if stages[0].from_step or stages[0].from_epoch:
        raise ValueError(_FIRST_START.format(stages[0].text))
    for unit, kind in (("step", "from_step"), ("epoch", "from_epoch")):
        # (the first stage, at 0, is at step 0 and at epoch 0)
        given = [(0, 0)] + [(i, getattr(stage, kind)) for i, stage in enumerate(stages[1:], 1)
                            if getattr(stage, kind) is not None]
        for (j, earlier), (i, start) in zip(given, given[1:]):
            if start <= earlier:
                raise ValueError(_ORDER.format(i=i, text=stages[i].text, unit=unit, start=f"{start:g}", j=j,
                                               earlier=f"{earlier:g}"))
    last = max((stage.from_step for stage in stages if stage.from_step is not None), default=0)
    if last >= max_steps:
        raise ValueError(_LAST_START.format(last, max_steps))


def _stage_config(i: int, stage: Stage, sparse_config: SparseAttentionConfig) -> SparseAttentionConfig:
    """Stage `i`'s pattern: `sparse_config` with its fields. Raises ValueError, naming the stage, for a field that
    is unknown or invalid, or a length that does not split into whole blocks per CP rank."""
    with stage.refusals(i):
        unknown = set(stage.sparse) - set(SparseAttentionConfig.keys())
        smet = sorted(k for k in unknown if k.removeprefix("smet_") in _SMET_FIELDS and k != "mode")
        if smet:  # (`mode` alone may be meant as the pattern's budget.mode)
            flags = " ".join(f"--smet_{k.removeprefix('smet_')} {stage.sparse[k]}" for k in smet)
            raise ValueError(f"{smet} are SMET settings, which hold for the whole run (a stage changes the sequence "
                             "length, the CP layout and the sparse-attention pattern only): drop them from the stage "
                             f"and set them for the run ({flags}).")
        if any(key.startswith("layer_overrides") for key in unknown):
            raise ValueError("a stage cannot set layer_overrides: give them in the run's --sparse_config file, where "
                             "they hold for every stage (a stage's fields reach the layers whose overrides do not set "
                             "them).")
        if unknown:
            hint = "; use e.g. mass_threshold=0.005 or cp_mode=ulysses."
            if "mode" in unknown:
                mode = stage.sparse["mode"]
                hint = (f": the budget's mode is budget_mode={mode} (or budget.mode={mode}); SMET's, --smet_mode, "
                        "holds for the whole run.")
            raise ValueError(f"{sorted(unknown)} are not sparse-pattern fields (SparseAttentionConfig) or CP fields "
                             f"(ContextParallelConfig){hint}")
        config = stage.sparse_config(sparse_config)
        unit = config.block_size * stage.cp_size
        if stage.seq_len % unit:
            raise ValueError(
                f"seq_len={stage.seq_len} does not split into whole blocks of {config.block_size} tokens over "
                f"{stage.cp_size} CP ranks (a multiple of {unit} does): use {_seq_len_fix(stage.seq_len, unit)}, or "
                "another block_size.")
    return config


def _starts(stages: Sequence[Stage], max_steps: int, samples_per_step: Sequence[int] | None = None,
            num_samples: int | None = None) -> tuple[int, ...]:
    """The stages' start steps (`build_schedule`'s arguments), each after the one before and within max_steps."""
    starts, consumed = [], 0  # consumed: samples taken before the latest stage's start
    resolved: dict[int, str] = {}  # the epoch starts the data resolved, for a refusal that names their step
    for i, stage in enumerate(stages):
        if stage.from_step is not None or i == 0:
            start = stage.from_step if stage.from_step is not None else int(stage.from_epoch > 0)
        elif samples_per_step is None or not num_samples:
            raise ValueError(f"cp_schedule stage {i} ({stage.text}) starts at an epoch, which needs a dataset with a "
                             "length: start it at a step instead.")
        else:  # the first step boundary at which `from_epoch` passes over the dataset are consumed
            need = stage.from_epoch * num_samples - consumed
            start = starts[-1] + max(0, math.ceil(need / samples_per_step[i - 1]))
            resolved[i] = (f" Stage {i} ({stage.text}) starts at step {start}, the first by which {stage.from_epoch:g} "
                           f"passes over the {num_samples} samples are taken.")
        if i and start <= starts[-1]:
            raise ValueError(_ORDER.format(i=i, text=stage.text, unit="step", start=start, j=i - 1, earlier=starts[-1])
                             + resolved.get(i - 1, "") + resolved.get(i, ""))
        if i and samples_per_step is not None:
            consumed += (start - starts[-1]) * samples_per_step[i - 1]
        starts.append(start)
    if starts[0] != 0:
        raise ValueError(_FIRST_START.format(stages[0].text))
    if starts[-1] >= max_steps:
        raise ValueError(_LAST_START.format(starts[-1], max_steps) + resolved.get(len(stages) - 1, ""))
    return tuple(starts)


_SMET_FIELDS = frozenset(f.name for f in dataclasses.fields(SMETConfig))
_ORDER = ("cp_schedule stage {i} ({text}) starts at {unit} {start}, not after stage {j} ({unit} {earlier}): order the "
          "stages by their start.")
_FIRST_START = "cp_schedule's first stage ({}) must start at 0 (or 0ep)."
_LAST_START = ("cp_schedule's last stage starts at step {0}, at or after --max_steps {1}: raise --max_steps above {0} "
               "or start the stage earlier.")


def sample_length(sample: dict[str, Any]) -> int:
    """The tokens of a sample: its input_ids', or its inputs_embeds' ([tokens, hidden]: a script or a vision-language
    model passing embeddings)."""
    for key in ("input_ids", "inputs_embeds"):
        if key in sample:
            return len(sample[key])
    raise ValueError(f"a cp_schedule crops each sample to its stage's length, and this sample has neither input_ids "
                     f"nor inputs_embeds to measure it by (its fields: {sorted(sample)}): give one of them.")


class StageSamples(torch.utils.data.Dataset):
    """`dataset[index]` cropped to a length: items are `(index, seq_len)`; every field as long as the
    sample's input_ids or inputs_embeds (labels, attention_mask, position_ids, ...) keeps its first `seq_len`
    tokens, and a packed row's document lengths (`seq_lengths`, TRL's packing) those of its first `seq_len` tokens."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, item: tuple[int, int]) -> dict[str, Any]:
        index, seq_len = item
        sample = self.dataset[index]
        length = sample_length(sample)
        cropped = {k: v[:seq_len] if _is_sequence(v) and len(v) == length else v for k, v in sample.items()}
        lengths = sample.get(_DOCUMENT_LENGTHS)
        if _is_sequence(lengths) and sum(int(n) for n in lengths) == length:
            cropped[_DOCUMENT_LENGTHS] = _crop_document_lengths(lengths, seq_len)
        return cropped


# A packed row's document lengths, summing to its tokens: TRL's packing stores them, from which its collator builds
# the restarting position_ids (a row cropped with lengths left whole got position_ids longer than its tokens).
_DOCUMENT_LENGTHS = "seq_lengths"


def _crop_document_lengths(lengths, seq_len: int):
    """The lengths of the documents of a packed row's first `seq_len` tokens (the last one cut), of `lengths`' type."""
    kept, total = [], 0
    for n in (int(n) for n in lengths):
        if total >= seq_len:
            break
        kept.append(min(n, seq_len - total))
        total += kept[-1]
    if isinstance(lengths, torch.Tensor):
        return torch.tensor(kept, dtype=lengths.dtype)
    return type(lengths)(kept) if isinstance(lengths, (list, tuple)) else np.asarray(kept, dtype=lengths.dtype)


def _is_sequence(value: Any) -> bool:
    """A list, or an array with dimensions (a tensor, a numpy array: a `datasets` format's), not a scalar."""
    return isinstance(value, (list, tuple)) or len(getattr(value, "shape", ())) > 0


class StageBatchSampler(torch.utils.data.Sampler):
    """This rank's micro-batches over a whole curriculum run, as `StageSamples` items.

    Samples are taken in one global order (the dataset in order, or a permutation per pass seeded by
    `seed`) across stages. In a stage with DP degree n, each optimizer step takes the next
    `n x batch_size x grad_accum` samples and hands them out as accelerate does: micro-batch j of DP
    rank d is the (j x n + d)-th batch of `batch_size` samples of the step. The sampler yields
    `max_steps x grad_accum` micro-batches: one Trainer epoch is the whole run.

    `first_step()`, read as iteration begins, is the optimizer step of the first micro-batch: 0, but a
    resume that replays no batches (`ignore_data_skip`) iterates from its own step, whose stage the
    batches must have; its samples then start from the first, as the Trainer's data starts over.
    """

    def __init__(self, schedule: Schedule, dims: Sequence[ParallelDims], *, num_samples: int, batch_size: int,
                 grad_accum: int, max_steps: int, seed: int | None,
                 first_step: Callable[[], int] = lambda: 0) -> None:
        self.schedule, self.dims = schedule, dims
        self.num_samples, self.batch_size, self.grad_accum = num_samples, batch_size, grad_accum
        self.max_steps, self.seed, self.first_step = max_steps, seed, first_step

    def __len__(self) -> int:
        return self.max_steps * self.grad_accum

    def _order(self, data_epoch: int) -> torch.Tensor | None:
        if self.seed is None:
            return None
        return torch.randperm(self.num_samples, generator=torch.Generator().manual_seed(self.seed + data_epoch))

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        position, orders = 0, {}
        for step in range(self.first_step(), self.max_steps):
            i = self.schedule.index_at(step)
            stage, dims = self.schedule.stages[i], self.dims[i]
            for j in range(self.grad_accum):
                first = position + (j * dims.dp_size + dims.dp_rank) * self.batch_size
                batch = []
                for p in range(first, first + self.batch_size):
                    epoch, k = divmod(p, self.num_samples)
                    if epoch not in orders:
                        orders = {epoch: self._order(epoch)}
                    order = orders[epoch]
                    batch.append((k if order is None else int(order[k]), stage.seq_len))
                yield batch
            position += dims.dp_size * self.batch_size * self.grad_accum


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
    per_step = [args.train_batch_size * args.gradient_accumulation_steps * (world // s.cp_size) for s in stages]
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
            check_model_supports_context_parallel(model)
            check_loss(trainer, max(s.cp_size for s in schedule.stages))
            if type(trainer).compute_loss in compat.cp_whole_row_losses():
                raise ValueError(f"a cp_schedule with {type(trainer).__name__}: a stage crops each sample's "
                                 "input_ids to its length, and a preference sample's prompt and completions are kept "
                                 "whole. Train it under CP with --cp_size (a single CP degree) instead of "
                                 "--cp_schedule.")
            check_training_arguments(trainer.args, max(s.cp_size for s in schedule.stages))
            warn_inexact(trainer)
        _refuse_split_batches(trainer, schedule)
        configs = []
        for i, stage in enumerate(schedule.stages):
            with stage.refusals(i):
                configs.append(stage.cp_config(cp_config))
                configs[-1].check_model(model.config)  # the stage's layout, before its groups are built
                _check_zigzag_length(stage, schedule.configs[i], configs[-1])
    compat.require(f"transformers.Trainer.{compat.TRAINER_CP_INPUTS}")
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
                     lambda *args, **kwargs: StageDataLoader(trainer, curriculum, args, kwargs))

    def get_train_dataloader():
        return _train_data_loader(trainer, curriculum)

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
    if not compat.dp_data_loader_options(trainer.accelerator).get("split_batches"):
        return
    world = trainer.accelerator.num_processes
    split = [(i, stage) for i, stage in enumerate(schedule.stages) if stage.cp_size < world]
    if not split:
        return
    (i, stage), batch = split[0], trainer.args.per_device_train_batch_size
    fix = (f"For the {batch} samples a batch that split_batches shares out, give --per_device_train_batch_size "
           f"{batch // world} without split_batches" if batch % world == 0 else
           f"Drop split_batches and give the samples a step takes per process ({batch} do not split over {world})")
    raise ValueError(
        f"split_batches=True (--accelerator_config) with a cp_schedule whose stage {i} ({stage.text}) has "
        f"{world // stage.cp_size} data-parallel ranks: a curriculum's step takes per_device_train_batch_size x "
        f"gradient_accumulation_steps samples on every DP rank of its stage, not that many split over them. {fix} "
        "(at CP 1: a stage at CP degree c takes 1/c of them).")


class StageDataLoader:
    """A data loader the accelerator prepares while a curriculum runs (evaluation, prediction), sharded over the
    data-parallel ranks of the stage in progress each time it is used, not of the stage in which it was prepared: the
    Trainer keeps its evaluation loaders across evaluations (`--dataloader_persistent_workers`), and a loader
    prepared at CP 1 x DP 2 handed the two ranks of a later CP 2 group different rows (a wrong eval_loss, or a
    refusal blaming data built differently per process). Re-prepared from the same data loader when the stage's
    DP degree or rank differs; anything else is the prepared loader's."""

    def __init__(self, trainer: Trainer, curriculum: Curriculum, args: tuple, kwargs: dict) -> None:
        self._trainer, self._curriculum, self._args, self._kwargs = trainer, curriculum, args, kwargs
        self._layout: tuple[int, int] | None = None
        self._loader = self._current()

    def _current(self):
        parallel = self._curriculum.parallel()
        layout = (parallel.dp_size, parallel.dp_rank)
        if layout != self._layout:
            self._loader = dp_data_loader(self._trainer, parallel)(*self._args, **self._kwargs)
            self._layout = layout
        return self._loader

    def __iter__(self):
        return iter(self._current())

    def __len__(self) -> int:
        return len(self._current())

    def __getattr__(self, name: str):
        if name.startswith("__") or name in ("_trainer", "_curriculum", "_args", "_kwargs", "_layout", "_loader"):
            raise AttributeError(name)  # (not set yet: copy and pickle look for them before __init__ runs)
        return getattr(self._current(), name)


def _train_data_loader(trainer: Trainer, curriculum: Curriculum):
    """The run's training data loader: `StageSamples` in `StageBatchSampler` order, prepared without
    further sharding (the sampler already gives this rank its own batches)."""
    args, dataset = trainer.args, trainer.train_dataset
    collator = trainer.data_collator
    if args.remove_unused_columns:
        compat.require(f"transformers.Trainer.{compat.TRAINER_COLLATOR_WITHOUT_UNUSED}")
        collator = getattr(trainer, compat.TRAINER_COLLATOR_WITHOUT_UNUSED)(collator, description="training")
    if dataset is None or not hasattr(dataset, "__len__"):
        with flag_errors((ValueError,)):  # (the flag against the run's data: a launched run ends with the message)
            raise ValueError("a cp_schedule needs a train_dataset with a length (a map-style dataset).")
    check_row_lengths(curriculum.schedule, dataset, collator, args.train_batch_size)
    seed = None if args.train_sampling_strategy == "sequential" else (
        args.data_seed if args.data_seed is not None else args.seed)
    # (the Trainer iterates the loader once its state is loaded: a resume's step is known then)
    sampler = StageBatchSampler(curriculum.schedule, curriculum.dims, num_samples=len(dataset),
                                batch_size=args.train_batch_size, grad_accum=args.gradient_accumulation_steps,
                                max_steps=args.max_steps, seed=seed,
                                first_step=lambda: trainer.state.global_step if args.ignore_data_skip else 0)
    loader = torch.utils.data.DataLoader(
        StageSamples(dataset), batch_sampler=sampler, collate_fn=collator, num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory, persistent_workers=args.dataloader_persistent_workers)
    return dp_data_loader(trainer, ParallelDims.single())(loader)


def check_row_lengths(schedule: Schedule, dataset, collator, batch_size: int) -> None:
    """Raise ValueError, naming the fix, unless a micro-batch of every stage, cropped and collated as
    training will, has rows of the stage's length: samples shorter than a stage are never extended, and
    a collator that packs a micro-batch into one row (`DataCollatorWithFlattening`) makes rows longer
    than the cropped samples. The refusal is the user's (`flag_errors`); an error of the collator keeps its
    traceback."""
    samples, n = StageSamples(dataset), min(batch_size, len(dataset))
    for i, stage in enumerate(schedule.stages):
        batch = collator([samples[(k, stage.seq_len)] for k in range(n)])
        ids = batch.get("input_ids")
        ids = batch.get("inputs_embeds") if ids is None else ids
        if ids is None or ids.shape[1] == stage.seq_len:
            continue
        row, longest = ids.shape[1], max(sample_length(dataset[k]) for k in range(n))
        why = (f"the samples hold {longest} tokens, and a stage crops samples to its length but never extends "
               f"them: give samples of at least {max(s.seq_len for s in schedule.stages)} tokens (the longest stage; "
               "--sparse_max_length in the example script), or shorten the stage" if row < stage.seq_len else
               f"the data collator turns {n} samples of up to {stage.seq_len} tokens into longer rows (packing them "
               "into one row, as DataCollatorWithFlattening / --pack_documents do, or padding), while a stage crops "
               "each sample, not the row: train a curriculum with one sample per row, without packing, or with rows "
               "packed before the collator (TRL's packing=True, or restarting position_ids in the data) one to a "
               "batch: --per_device_train_batch_size 1, with --gradient_accumulation_steps for more")
        with flag_errors((ValueError,)):  # (a launched run ends with the message alone, not a traceback per rank)
            raise ValueError(f"cp_schedule stage {i} ({stage.text}) would train rows of {row} tokens, not "
                             f"{stage.seq_len}: {why}.")


def disable_curriculum(trainer: Trainer) -> None:
    """Undo `enable_curriculum` on `trainer` (no-op when it is not enabled)."""
    require_trainer(trainer, "disable_curriculum(trainer)")
    undo_recorded(trainer, _FEATURE)
