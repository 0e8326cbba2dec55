"""The training data loader of a curriculum run (`train_data_loader`, `curriculum.py`), and its samples shorter than
the stage that draws them: a stage crops samples to its length and never extends them, so such a sample trains as a
shorter row (TRL's packing leaves its last rows short). That trains exactly, only not at the stage's length: one
warning counts them. What cannot train is refused: a micro-batch whose rows then differ in length and which the data
collator cannot batch (a stock `default_data_collator` stacks rows) ended a run in a traceback when its step came,
hours in. A dataset whose lengths can be read cheaply (a `datasets.Dataset` with input_ids, a list of samples) is
checked over every micro-batch of the run before training (`check_drawn_lengths`, `CheckedBatchSampler`); any other
at the step (`StageCollator`), in a DataLoader worker too (`DrawnBatchRefused`)."""

from __future__ import annotations

import logging
import multiprocessing
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from transformers import Trainer

from ..distributed import ParallelDims
from ..integration import compat, compat_checks
from .arguments import flag_errors
from .cp_batches import dp_data_loader
from .stage_data import StageBatchSampler, StageSamples, check_row_lengths, sample_length
from .stage_plan import Schedule

logger = logging.getLogger(__name__)


def sample_lengths(dataset) -> np.ndarray | None:
    """The tokens of every sample of `dataset`, where they can be read without loading the samples: a
    `datasets.Dataset`'s input_ids column (arrow's list lengths, a batch at a time) or a list of samples; None for
    any other dataset (a torch Dataset may tokenize in `__getitem__`)."""
    if isinstance(dataset, (list, tuple)):
        return np.fromiter((sample_length(s) for s in dataset), dtype=np.int64, count=len(dataset))
    if "input_ids" not in (getattr(dataset, "column_names", None) or ()) or not hasattr(dataset, "with_format"):
        return None
    import pyarrow.compute as pc

    column = dataset.select_columns(["input_ids"]).with_format("arrow")
    batches = [pc.list_value_length(b.column(0)).to_numpy(zero_copy_only=False) for b in column.iter(65536)]
    return np.concatenate(batches).astype(np.int64) if batches else np.zeros(0, dtype=np.int64)


def _unbatchable(rows: str, lengths: list[int], seq_len: int, error: Exception) -> str:
    """The refusal of a micro-batch (`rows`: which samples, of which stage, and their rows) whose rows of `lengths`
    tokens the data collator could not batch (`error`), with the fix."""
    return (f"{rows} of {lengths} tokens (a stage crops samples to its length and never extends them), which "
            f"the data collator cannot batch ({type(error).__name__}: {error}): {_fix(seq_len)}.")


def _fix(stage_len: int) -> str:
    return (f"give a data collator that pads rows (DataCollatorWithPadding, TRL's SFT collator), train one sample per "
            f"row (--per_device_train_batch_size 1, with --gradient_accumulation_steps for more), or leave out the "
            f"samples shorter than {stage_len} tokens")


def check_drawn_lengths(sampler: StageBatchSampler, lengths: np.ndarray, dataset, collator,
                        begin: int | None = None) -> None:
    """Before training, over every micro-batch the run draws on any rank (`sampler`'s order from its first step, as it
    iterates: from the first sample; from step `begin` on, the step a resume that skips the batches already trained
    begins at, `sampler.first_step()` where None; `lengths`: the tokens of each sample of `dataset`): refuse, naming
    the step, the samples and the fix, the first one whose rows differ in length (samples shorter than their stage)
    that `collator` cannot batch; warn once with the count, per stage, of the samples it draws that are shorter than
    it. The same on every rank: all refuse, or none."""
    schedule, dims, first = sampler.schedule, sampler.dims, sampler.first_step()
    begin = first if begin is None else max(begin, first)
    short, position, batch = {}, 0, sampler.batch_size
    ends = (*schedule.starts[1:], sampler.max_steps)
    for i, (stage, start) in enumerate(zip(schedule.stages, schedule.starts)):
        per_step = dims[i].dp_size * batch * sampler.grad_accum
        position += max(0, min(ends[i], begin) - max(start, first)) * per_step  # (skipped: drawn, not trained)
        start = max(start, begin)
        steps = max(0, ends[i] - start)
        drawn = _drawn(sampler, position, steps * per_step)
        position += steps * per_step
        rows = np.minimum(lengths[drawn], stage.seq_len)
        if (rows < stage.seq_len).any():
            short[i] = (int((rows < stage.seq_len).sum()), int(rows.min()))
        if batch == 1 or len(drawn) == 0:
            continue
        by_batch = rows.reshape(-1, batch)
        mixed = np.flatnonzero(by_batch.min(axis=1) != by_batch.max(axis=1))
        if len(mixed):
            _try_collate(i, stage, start + int(mixed[0]) * batch // per_step,
                         drawn[mixed[0] * batch:(mixed[0] + 1) * batch], dataset, collator)
    if short:
        logger.warning(
            "cp_schedule: samples shorter than the stage that draws them train as shorter rows (a stage crops samples "
            "to its length and never extends them; a padding collator pads them to their micro-batch's longest): %s.",
            "; ".join(f"stage {i} ({schedule.stages[i].text}): {n} of the samples it draws, the shortest of "
                      f"{shortest} tokens" for i, (n, shortest) in short.items()))


def _drawn(sampler: StageBatchSampler, first: int, count: int) -> np.ndarray:
    """The sample indices at global positions `first` to `first + count - 1` of `sampler`'s order."""
    positions = np.arange(first, first + count, dtype=np.int64)
    epochs, indices = np.divmod(positions, sampler.num_samples)
    for epoch in np.unique(epochs):
        order = sampler.order(int(epoch))
        if order is not None:
            indices[epochs == epoch] = order.numpy()[indices[epochs == epoch]]
    return indices


def _try_collate(i: int, stage, step: int, indices: np.ndarray, dataset, collator) -> None:
    """Refuse (`check_drawn_lengths`) the micro-batch of samples `indices` of stage `i` unless `collator` batches it."""
    samples = StageSamples(dataset)
    rows = [samples[(int(k), stage.seq_len)] for k in indices]
    try:
        collator(rows)
    except Exception as e:  # (any collator's: a stack of unequal rows is a RuntimeError)
        with flag_errors((ValueError,)):  # (the user's data: a launched run ends with the message alone)
            raise ValueError(_unbatchable(
                f"cp_schedule stage {i} ({stage.text}): step {step} draws samples {[int(k) for k in indices]}, rows",
                [sample_length(r) for r in rows], stage.seq_len, e)) from e


class CheckedBatchSampler(StageBatchSampler):
    """`StageBatchSampler` whose micro-batches the run trains, from step `begin()` (the Trainer's step: a resume's,
    its checkpoint's), are checked (`check_drawn_lengths` of `lengths`, `dataset`, `collator`) as its iteration
    begins, once the Trainer read the checkpoint's step (after it built the loader): a resume that replays no batches
    (`ignore_data_skip`) draws them from that step and from the first sample, one that skips the batches already
    trained (accelerate's `skip_first_batches`, which iterates this sampler from step 0) draws the rest of step 0's
    order. A check from step 0 tested other micro-batches, or ones the resume skips."""

    def __init__(self, *args, begin: Callable[[], int], lengths: np.ndarray, dataset, collator, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.begin, self.lengths, self.dataset, self.collator, self.checked = begin, lengths, dataset, collator, None

    def check(self) -> None:
        steps = (self.first_step(), self.begin())
        if steps != self.checked:
            check_drawn_lengths(self, self.lengths, self.dataset, self.collator, steps[1])
            self.checked = steps

    def __iter__(self):
        self.check()  # (in the main process, workers or not: it draws the indices)
        return super().__iter__()


class DrawnBatchRefused(ValueError):
    """`StageCollator`'s refusal, the user's (`flag_errors`) by its type: a DataLoader worker's error reaches the main
    process rebuilt from its type and text alone (torch's `ExceptionWrapper.reraise`: `type("Caught ... in DataLoader
    worker process 0. Original Traceback ...")`), which lost the mark an instance carries; the refusal's own message,
    the text's last, is taken back from it."""

    hf_sparse_cp_flag_error = True  # (the mark `flag_errors` sets on an instance)

    def __init__(self, message: str) -> None:
        if message.startswith(f"Caught {type(self).__name__} "):
            message = message.rpartition(f"{type(self).__qualname__}: ")[2].rstrip("\n")
        super().__init__(message)


class StageCollator:
    """The training loader's collator, of `(item, sample)` pairs (`StageBatchSampler` items and their cropped
    samples): a micro-batch whose rows differ in length that `collator` cannot batch is refused naming its samples
    and the fix (`DrawnBatchRefused`), and, where the lengths were not checked before training (`scanned` False), the
    first sample shorter than its stage warned of once, by the first of the loader's worker processes to draw one."""

    def __init__(self, collator, scanned: bool) -> None:
        # (a flag the workers share: each holds its own copy of this collator)
        self.collator, self.warn = collator, None if scanned else multiprocessing.Value("b", True)

    def _first_to_warn(self) -> bool:
        with self.warn.get_lock():
            first, self.warn.value = self.warn.value, False
        return bool(first)

    def __call__(self, drawn: list[tuple[tuple[int, int], dict[str, Any]]]):
        items, rows = [item for item, _ in drawn], [row for _, row in drawn]
        lengths, seq_len = [sample_length(r) for r in rows], items[0][1]
        if self.warn is not None and min(lengths) < seq_len and self._first_to_warn():
            logger.warning("cp_schedule: sample %d holds %d tokens, fewer than its stage's %d: it trains as a shorter "
                           "row (a stage never extends samples; this dataset's lengths could not be read before "
                           "training, and later such samples are not reported).",
                           items[lengths.index(min(lengths))][0], min(lengths), seq_len)
        try:
            return self.collator(rows)
        except Exception as e:
            if len(set(lengths)) < 2:
                raise
            raise DrawnBatchRefused(_unbatchable(
                f"cp_schedule: samples {[k for k, _ in items]} of the {seq_len}-token stage are rows", lengths, seq_len,
                e)) from e


class DrawnSamples(torch.utils.data.Dataset):
    """`StageSamples` items with their item: `(item, sample)`, as `StageCollator` takes them."""

    def __init__(self, dataset) -> None:
        self.samples = StageSamples(dataset)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, item: tuple[int, int]):
        return item, self.samples[item]


def train_data_loader(trainer: Trainer, schedule: Schedule, dims: Sequence[ParallelDims]):
    """The run's training data loader: `StageSamples` in `StageBatchSampler` order over the stages of `schedule`
    (`dims`: each stage's layout), their lengths checked (`check_row_lengths`, `CheckedBatchSampler`), prepared
    without further sharding (the sampler already gives this rank its own batches)."""
    args, dataset = trainer.args, trainer.train_dataset
    collator = trainer.data_collator
    if args.remove_unused_columns:
        compat_checks.require(f"transformers.Trainer.{compat.TRAINER_COLLATOR_WITHOUT_UNUSED}")
        collator = getattr(trainer, compat.TRAINER_COLLATOR_WITHOUT_UNUSED)(collator, description="training")
    if dataset is None or not hasattr(dataset, "__len__"):
        with flag_errors((ValueError,)):  # (the flag against the run's data: a launched run ends with the message)
            raise ValueError("a cp_schedule needs a train_dataset with a length (a map-style dataset).")
    seed = None if args.train_sampling_strategy == "sequential" else (
        args.data_seed if args.data_seed is not None else args.seed)
    lengths = sample_lengths(dataset)
    check_row_lengths(schedule, dataset, collator, args.train_batch_size, lengths)
    # (the Trainer iterates the loader once its state is loaded: a resume's step is known then)
    options = dict(num_samples=len(dataset), batch_size=args.train_batch_size,
                   grad_accum=args.gradient_accumulation_steps, max_steps=args.max_steps, seed=seed,
                   first_step=lambda: trainer.state.global_step if args.ignore_data_skip else 0)
    if lengths is None:
        sampler = StageBatchSampler(schedule, dims, **options)
    else:
        sampler = CheckedBatchSampler(schedule, dims, begin=lambda: trainer.state.global_step, lengths=lengths,
                                      dataset=dataset, collator=collator, **options)
    loader = torch.utils.data.DataLoader(
        DrawnSamples(dataset), batch_sampler=sampler, collate_fn=StageCollator(collator, lengths is not None),
        num_workers=args.dataloader_num_workers, pin_memory=args.dataloader_pin_memory,
        persistent_workers=args.dataloader_persistent_workers)
    return dp_data_loader(trainer, ParallelDims.single())(loader)
