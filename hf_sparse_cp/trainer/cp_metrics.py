"""The evaluation loop's gathers under CP (`context_parallel.py`): every rank of a CP group evaluates the same batch, so
`gather_for_metrics` (and Seq2SeqTrainer's `gather`) keep each CP group's values once
(`gather_metrics_once_per_cp_group`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer

from ..distributed import ParallelDims


def gather_metrics_once_per_cp_group(trainer: Trainer, patches, parallel: Callable[[], ParallelDims],
                                      in_step: Callable[[], bool], batch_rows: Callable[[], int | None],
                                      stream_last: Callable[[], tuple[Any, int] | None]) -> None:
    """Make `gather_for_metrics` (the evaluation loop's gather of losses) keep each CP group's values once.

    Every rank of a CP group evaluates the same batch, so accelerate's gather over all processes holds each value
    cp_size times, interleaved by rank, and its truncation of the last batch (`remainder`, counted over the
    data-parallel ranks that `dp_data_loader` shards over) keeps the wrong ones: a short last batch skews
    `eval_loss`. The wrapper keeps the values of each CP group's first rank, in data-parallel order, then truncates
    as accelerate does; a loader without a length (an iterable evaluation set: `run_clm.py --streaming`, which
    accelerate dispatches from rank 0 without CP, knowing the remainder) knows none, so the last batch's rows are
    those the last step took (`batch_rows()`; the evaluation loop repeats a batch's loss per_device_eval_batch_size
    times: a short last batch's row counted twice), or, with several data-parallel ranks, those of the stream that
    the shard counted (`stream_last()`: the loader whose last global batch holds copies of the first rows, and the
    number). What a training or prediction step gathers (`in_step()`) is computed from each rank's own shard (TRL's
    sums of token entropy, correct top-1 tokens and label tokens, its MoE auxiliary loss, which it averages): the
    wrapper keeps every rank's, grouped by sample over the CP group (each sample's cp_size shard values together), and
    truncates a short last batch by whole samples, so that a sum over them is the batch's and a mean the mean over its
    shards (the stock truncation kept the first rank's shard alone). Seq2SeqTrainer's evaluation loop gathers with
    accelerate's `gather` instead, untruncated: the wrapper of `evaluation_loop` swaps it for one that keeps each CP
    group's values once, untruncated alike."""
    from accelerate.utils import gather_object, recursively_apply

    acc = trainer.accelerator
    gather_for_metrics = acc.gather_for_metrics

    def gather(input_data, use_gather_object=False):
        par = parallel()
        if par.cp_size == 1 or par.world_size == 1:
            return gather_for_metrics(input_data, use_gather_object=use_gather_object)
        try:
            recursively_apply(lambda x: x, input_data, error_on_other_type=True)
            all_tensors = True
        except TypeError:
            all_tensors = False
        if in_step() and (use_gather_object or not all_tensors):
            return gather_for_metrics(input_data, use_gather_object=use_gather_object)
        state = acc.gradient_state
        cut = state.remainder if state.end_of_dataloader and state.remainder > 0 else None
        loader, stream = stream_last() or (None, None)
        if state.end_of_dataloader and loader is not None and loader is state.active_dataloader:
            # (with several data-parallel ranks, accelerate's shard of an iterable set completes the last global batch
            # with copies of its first rows, whose values the prediction step kept alike: `stream_rows.py`)
            cut = stream
        elif state.end_of_dataloader and state.remainder < 0 and batch_rows() is not None:
            cut = batch_rows() * par.dp_size  # (DP 1's short last batch; an uncounted shard's copies kept)
        if use_gather_object or not all_tensors:
            data = gather_object(input_data)
            n = len(data) // par.world_size
            return [x for g in par.cp_groups for x in data[g[0] * n:(g[0] + 1) * n]][:cut]
        if in_step():
            ranks = torch.tensor(par.cp_groups)  # [data-parallel group, CP rank] -> global rank

            def grouped(t):  # [dp x n samples x cp, ...]: each sample's shard values together
                by_rank = t.reshape(par.world_size, -1, *t.shape[1:])[ranks.to(t.device)]
                return by_rank.movedim(1, 2).flatten(0, 1)[:cut].flatten(0, 1)
        else:
            def grouped(t):  # [dp x n samples, ...]: each CP group's first rank's
                return _first_ranks_values(t, par)[:cut]

        return recursively_apply(grouped, acc.gather(input_data))

    def gather_untruncated(input_data):
        par = parallel()
        if par.cp_size == 1 or par.world_size == 1:
            return acc.gather(input_data)
        return recursively_apply(lambda t: _first_ranks_values(t, par), acc.gather(input_data))

    evaluation_loop = trainer.evaluation_loop

    def evaluating(*args, **kwargs):
        # Seq2SeqTrainer's evaluate() and predict() gather with accelerate's `gather`, untruncated (with
        # `predict_with_generate`, its generated tokens): every rank of a CP group evaluates the group's batch, so each
        # row was kept cp_size times (predictions and labels of 3 rows: 6). Keep each CP group's once, as untruncated
        if trainer.gather_function == acc.gather:
            trainer.gather_function = gather_untruncated
        try:
            return evaluation_loop(*args, **kwargs)
        finally:  # (the loop sets its gather back to gather_for_metrics when it ends; one that raised leaves ours)
            if trainer.gather_function is gather_untruncated:
                trainer.gather_function = acc.gather

    patches.set_attr(acc, "gather_for_metrics", gather)
    patches.set_attr(trainer, "gather_function", gather)
    patches.set_attr(trainer, "evaluation_loop", evaluating)

def _first_ranks_values(gathered: torch.Tensor, parallel: ParallelDims) -> torch.Tensor:
    """The values of each CP group's first rank, in data-parallel order, of a gather over all ranks ([world x n, ...]:
    rank-major)."""
    first = torch.tensor(parallel.cp_groups)[:, 0].to(gathered.device)
    return gathered.reshape(parallel.world_size, -1, *gathered.shape[1:])[first].flatten(0, 1)
