"""The data of a curriculum run (`curriculum.py`): samples cropped to their stage's length (`StageSamples`), handed
out by one batch sampler over the whole run (`StageBatchSampler`), evaluation loaders sharded over the DP ranks of
the stage in progress (`StageDataLoader`), and the check that a stage's collated rows have its length
(`check_row_lengths`); `stage_loader.py` builds the training data loader of them."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np
import torch
from transformers import Trainer

from ..distributed import ParallelDims
from .arguments import flag_errors
from .cp_batches import dp_data_loader
from .stage_plan import Schedule


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

    def order(self, data_epoch: int) -> torch.Tensor | None:
        """The sample order of pass `data_epoch` over the data: a permutation, or None for the dataset's order."""
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
                        orders = {epoch: self.order(epoch)}
                    order = orders[epoch]
                    batch.append((k if order is None else int(order[k]), stage.seq_len))
                yield batch
            position += dims.dp_size * self.batch_size * self.grad_accum


class StageDataLoader:
    """A data loader the accelerator prepares while a curriculum runs (evaluation, prediction), sharded over the
    data-parallel ranks of the stage in progress each time it is used, not of the stage in which it was prepared: the
    Trainer keeps its evaluation loaders across evaluations (`--dataloader_persistent_workers`), and a loader
    prepared at CP 1 x DP 2 handed the two ranks of a later CP 2 group different rows (a wrong eval_loss, or a
    refusal blaming data built differently per process). Re-prepared from the same data loader when the stage's
    DP degree or rank differs; anything else is the prepared loader's."""

    def __init__(self, trainer: Trainer, parallel: Callable[[], ParallelDims], args: tuple, kwargs: dict) -> None:
        self._trainer, self._parallel, self._args, self._kwargs = trainer, parallel, args, kwargs
        self._layout: tuple[int, int] | None = None
        self._loader = self._current()

    def _current(self):
        parallel = self._parallel()
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
        if name.startswith("__") or name in ("_trainer", "_parallel", "_args", "_kwargs", "_layout", "_loader"):
            raise AttributeError(name)  # (not set yet: copy and pickle look for them before __init__ runs)
        return getattr(self._current(), name)


def check_row_lengths(schedule: Schedule, dataset, collator, batch_size: int,
                      lengths: np.ndarray | None = None) -> None:
    """Raise ValueError, naming the fix, unless a micro-batch of every stage, cropped and collated as
    training will, has rows of the stage's length: samples shorter than a stage are never extended, and
    a collator that packs a micro-batch into one row (`DataCollatorWithFlattening`) makes rows longer
    than the cropped samples. The micro-batch is of the first samples; with `lengths` (every sample's tokens,
    `stage_loader.sample_lengths`), of the first that reach the stage (shorter ones train as shorter rows,
    `stage_loader.check_drawn_lengths`), or the longest sample where none does. The refusal is the user's
    (`flag_errors`); an error of the collator keeps its traceback."""
    samples = StageSamples(dataset)
    for i, stage in enumerate(schedule.stages):
        first = list(range(min(batch_size, len(dataset)))) if lengths is None else (
            np.flatnonzero(lengths >= stage.seq_len)[:batch_size].tolist() or [int(lengths.argmax())])
        n = len(first)
        batch = collator([samples[(k, stage.seq_len)] for k in first])
        ids = batch.get("input_ids")
        ids = batch.get("inputs_embeds") if ids is None else ids
        if ids is None or ids.shape[1] == stage.seq_len:
            continue
        row, longest = ids.shape[1], max(sample_length(dataset[k]) for k in first)
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
