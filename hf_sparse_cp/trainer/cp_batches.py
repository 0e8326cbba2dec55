"""A CP group's batches (`context_parallel.py`): the data loader that shards over the data-parallel ranks only, so that
every rank of a CP group takes the same batch (`dp_data_loader`), the group's first rank's random generators that
every rank's batch building follows (`follow_first_ranks_generators`), and this rank's share of a batch
(`step_inputs`, padded with `pad_token_id`, checked the same on the group's ranks at `first_batch_of_each_run`). A
curriculum of CP degrees uses them too (`curriculum.py`)."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import Trainer

from ..config import SparseAttentionConfig
from ..distributed import ParallelDims, prepare_context_parallel_inputs
from ..distributed.comm import naming_unresponsive_ranks
from ..integration import compat_checks, upstream
from ..integration.composite import tower_names
from .arguments import flag_errors
from .stream_rows import count_stream, read_whole_stream
from .token_ids import CheckedCollate, label_classes_of, vocabulary_of


def pad_token_id(trainer: Trainer, model: torch.nn.Module) -> int:
    """The token that pads a CP split: the tokenizer's (or the model config's) pad token, else 0."""
    for source in (trainer.processing_class, getattr(model, "config", None)):
        pad = getattr(source, "pad_token_id", None)
        if pad is not None:
            return int(pad)
    return 0

def dp_data_loader(trainer: Trainer, parallel: ParallelDims):
    """`Accelerator.prepare_data_loader` sharding over the data-parallel ranks only, each process reading its own
    batches. accelerate's default for an iterable dataset (`run_clm.py --streaming`) is to dispatch: rank 0 reads
    a batch per process and splits them over all processes, whatever `num_processes` says, which hands the ranks
    of a CP group different rows. Raises ValueError, naming the fix, for a `dispatch_batches` the user set. Its
    batches' token ids are checked against the model's vocabulary and their labels against its head's classes where
    they are built, on the host, and a composite model's batches for its towers' inputs (`token_ids.CheckedCollate`):
    every rank of the group refuses a bad one together."""
    from accelerate.data_loader import prepare_data_loader

    acc = trainer.accelerator
    options = upstream.dp_data_loader_options(acc)
    if options["dispatch_batches"]:
        raise ValueError(
            f"dispatch_batches=True (--accelerator_config) under context parallelism (CP {parallel.cp_size}): "
            "rank 0 would read the batches and split them over all processes, so the ranks of a CP group would "
            "hold different rows. Drop it (or set '{\"dispatch_batches\": false}'): every process then reads "
            "the data itself, as it must build the same data (the same files, or seeded).")
    vocabulary, classes = vocabulary_of(trainer.model), label_classes_of(trainer.model)
    towers = bool(tower_names(trainer.model))

    def prepare(data_loader, device_placement=None, slice_fn_for_dispatch=None):
        _refuse_uneven_batches(data_loader, options, parallel)
        prepared = prepare_data_loader(
            read_whole_stream(data_loader, parallel.dp_size),
            acc.device,
            num_processes=parallel.dp_size,
            process_index=parallel.dp_rank,
            put_on_device=acc.device_placement if device_placement is None else device_placement,
            slice_fn_for_dispatch=slice_fn_for_dispatch,
            **{**options, "dispatch_batches": False},
        )
        # the ranks of a CP group take the same samples: their workers draw the same random numbers (the Trainer
        # seeds a worker by the process index, which differs within the group; accelerate's loader iterates the
        # torch loader it wraps, `base_dataloader`)
        loader = getattr(prepared, "base_dataloader", prepared)
        loader.worker_init_fn = upstream.seed_workers_by(loader.worker_init_fn, parallel.dp_rank)
        loader.collate_fn = CheckedCollate(loader.collate_fn, vocabulary, towers, classes)
        upstream.track_data_loader(acc, prepared)
        count_stream(prepared)
        return prepared

    return prepare


def _refuse_uneven_batches(data_loader, options: dict[str, Any], parallel: ParallelDims) -> None:
    """Raise ValueError, naming the fix, where `even_batches` false (--accelerator_config) would hand the DP ranks
    different numbers of batches: the ranks then wait on each other's collectives for ever (training hung, evaluation
    failed on a mismatched gather), as under stock data parallelism."""
    if options.get("even_batches", True) or options.get("split_batches") or parallel.dp_size == 1:
        return
    try:
        batches = len(data_loader)
    except TypeError:  # (an iterable set: its shard completes every rank's last batch whatever even_batches says)
        return
    if batches % parallel.dp_size:
        raise ValueError(
            f"even_batches=False (--accelerator_config) with {batches} batches over {parallel.dp_size} data-parallel "
            f"ranks (CP {parallel.cp_size}): the ranks would take different numbers of steps and wait on each other "
            "for ever, as under stock data parallelism. Drop it (accelerate then completes the last batches with the "
            f"first rows), or give the set a multiple of {parallel.dp_size} batches.")


def first_batch_of_each_run(trainer: Trainer) -> Callable[[], bool]:
    """A function that says, batch by batch, whether the batch is the first of a `train()` call (a run, or its
    resume): the Trainer starts each with a new `state`. The CP ranks' batches are checked to be the same there
    (`check_same_batch`): data built differently on each process shows at the first step, and the check costs
    nothing later."""
    checked = None

    def first() -> bool:
        nonlocal checked
        if checked is trainer.state:
            return False
        checked = trainer.state
        return True

    return first


def follow_first_ranks_generators(trainer: Trainer, patches, parallel: Callable[[], ParallelDims]) -> None:
    """Start each training step's batches, and each evaluation's or prediction's, on every rank of a CP group, from the
    random generators (torch's CPU one, Python's, numpy's) of the group's first rank: a collator drawing from them (a
    random crop) then builds the same batch on every rank, the one that one process builds. The ranks draw alike as
    long as they run the same code, but a draw on the main process alone (a callback sampling a generation there) or
    a CPU dropout of a rank's shard put the others' generators elsewhere, and from the next batch on the ranks trained
    and evaluated on a mix of different rows, checked at a run's first batch only (`check_same_batch`). One broadcast
    of the states (about 7 KB) per training step and per evaluation batch, before the loader builds batches
    (`get_batch_samples`; `evaluation_loop`'s every draw from its loader, as a callback's `on_prediction_step` may draw
    between them): every rank alike; a loader's workers are seeded on their own (`upstream.seed_workers_by`).
    `parallel()` is the CP layout of the step in progress."""
    compat_checks.require("transformers.Trainer.get_batch_samples")
    compat_checks.require("transformers.Trainer.evaluation_loop")
    get_batch_samples, evaluation_loop = trainer.get_batch_samples, trainer.evaluation_loop

    def follow() -> None:
        layout = parallel()
        if layout.cp_size > 1:
            states = [(torch.get_rng_state(), random.getstate(), np.random.get_state())]
            with naming_unresponsive_ranks("the broadcast of the first CP rank's random generators", layout.cp_group):
                dist.broadcast_object_list(states, src=layout.cp_ranks[0], group=layout.cp_group)
            torch.set_rng_state(states[0][0])
            random.setstate(states[0][1])
            np.random.set_state(states[0][2])

    def following_batch_samples(epoch_iterator, num_batches, device):
        follow()
        return get_batch_samples(epoch_iterator, num_batches, device)

    def following_evaluation_loop(dataloader, *args, **kwargs):
        return evaluation_loop(_FollowingLoader(dataloader, follow), *args, **kwargs)

    patches.set_attr(trainer, "get_batch_samples", following_batch_samples)
    patches.set_attr(trainer, "evaluation_loop", following_evaluation_loop)


class _FollowingLoader:
    """`loader` (an evaluation's), each of whose batches is drawn after `follow()`: accelerate's loader builds a
    batch ahead, during the draw of the one before, so each build follows the call made just before its draw."""

    def __init__(self, loader, follow: Callable[[], None]):
        self._loader, self._follow = loader, follow

    def __iter__(self):
        batches = iter(self._loader)
        while True:
            self._follow()
            try:
                batch = next(batches)
            except StopIteration:
                return
            yield batch

    def __len__(self) -> int:
        return len(self._loader)  # (TypeError for a loader without one, as the Trainer's `has_length` expects)

    def __getattr__(self, name: str):
        return getattr(self._loader, name)  # (the Trainer reads `dataset`, `batch_size`; callbacks what they need)

def step_inputs(inputs: dict[str, Any], parallel: ParallelDims, sparse_config: SparseAttentionConfig, pad_id: int,
                verify_same_batch: bool, labels_per_row: bool = False) -> dict[str, Any]:
    """This rank's share of a training batch (`prepare_context_parallel_inputs`); a batch that CP cannot split,
    refused naming the fix (padding between a row's tokens, rows that differ across the CP group), is the user's
    (`flag_errors`). With `labels_per_row` (a sequence-classification head's: [B], or [B, labels] multi-label) the
    labels are the batch's on every rank, neither sharded nor shifted."""
    rows = {"labels": inputs["labels"]} if labels_per_row and "labels" in inputs else {}
    with flag_errors((ValueError,)):
        return prepare_context_parallel_inputs({k: v for k, v in inputs.items() if k not in rows}, parallel,
                                               block_size=sparse_config.block_size, pad_token_id=pad_id,
                                               sparse_config=sparse_config, verify_same_batch=verify_same_batch) | rows
