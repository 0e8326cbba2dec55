"""The Trainer's steps and counts under CP (`context_parallel.py`): each CP group's batch counted once
(`count_once_per_cp_group`), and a training or prediction step that shards the batch and returns on every rank what
one process returns for it (`cp_group_steps`: the CP group's loss, whole-sequence logits, whole-row trainers, label
smoothing, NEFTune and the metrics' gather set up with it). A curriculum of CP degrees uses them too
(`curriculum.py`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer
from transformers.trainer_pt_utils import find_batch_size

from ..distributed import CP_SHARD_KWARG, CPShard, ParallelDims, global_num_items
from ..distributed.comm import all_reduce
from ..integration import compat, compat_checks, trainer_losses, upstream
from ..integration.call_context import cp_forwards_begun
from ..integration.heads import BATCH_OUTPUT_HEADS, model_head, pool_over_cp_group
from ..integration.patching import temporarily
from .adapter_loss import regularizer_share
from .callbacks import EvaluationStepsCallback
from .cp_metrics import gather_metrics_once_per_cp_group
from .cp_neftune import neftune_over_cp_group
from .cp_token_loss import smooth_labels_over_cp_group
from .generated_rows import share_generation_batches
from .router_loss import loss_share, model_loss_share, router_loss_over_cp_group
from .stream_rows import rank_stream_rows, stream_rows
from .whole_rows import hook_whole_row_forwards, whole_sequence_outputs

logger = logging.getLogger(__name__)


def count_once_per_cp_group(trainer: Trainer, patches, parallel: Callable[[], ParallelDims], owns_cp: bool) -> None:
    """Every rank of a CP group sees the same (unsharded) batch in the Trainer's loop: make its token,
    flop and batch-size accounting, and the steps of evaluate()'s and predict()'s steps per second
    (`callbacks.EvaluationStepsCallback`), count that batch once per group, as without CP. `parallel()` is the
    CP layout of the step in progress (constant, or a curriculum's stage).

    The loss's token count (`num_items_in_batch`) is, under CP, always in the form the Trainer gives with
    `average_tokens_across_devices`, which compute_loss multiplies by the number of processes (dp x cp):
    without the flag, it is the CP group's whole count times the DP degree (`cp_group_steps` runs compute_loss
    with the flag seen on), so a rank's loss is cp x its shard's sum over its group's count, whose mean over the
    ranks is each DP group's batch mean as without CP. The Trainer's own count without the flag, the group's
    count over the CP degree, is fractional: TRL's loss clamps it to 1 (`num_tokens.clamp(min=1)`), which halved
    the loss of a batch with one target under CP 2."""
    def cp_size() -> int:
        return parallel().cp_size

    if not owns_cp:
        # transformers reads the CP degree from accelerate's ParallelismConfig only; with it, the
        # total batch size and `num_items_in_batch` (the loss's token count) divide by the CP degree
        patches.set_attr(trainer, "get_cp_size", cp_size)
    divides = owns_cp or upstream.token_count_divides_by_get_cp_size()
    compat_checks.require(f"transformers.Trainer.{compat.TRAINER_COUNT_ITEMS}")
    count = getattr(trainer, compat.TRAINER_COUNT_ITEMS)

    def count_once(batch_samples, device):
        if cp_size() == 1:
            return count(batch_samples, device)
        if not trainer.args.average_tokens_across_devices:
            with temporarily(trainer, "get_cp_size", lambda: 1):  # the rank's count: its CP group's batch's
                items = count(batch_samples, device)
            return items if items is None else items * parallel().dp_size
        # the gathered count holds each CP group's batch cp_size times (exactly)
        items = count(batch_samples, device)
        return items if items is None or divides else items // cp_size()

    patches.set_attr(trainer, compat.TRAINER_COUNT_ITEMS, count_once)
    flops = trainer.floating_point_ops
    patches.set_attr(trainer, "floating_point_ops", lambda inputs: flops(inputs) / cp_size())
    compat_checks.require(f"transformers.Trainer.{compat.TRAINER_TRACK_TOKENS}")
    track = getattr(trainer, compat.TRAINER_TRACK_TOKENS)

    def track_once(inputs):
        before = trainer.state.num_input_tokens_seen
        track(inputs)  # gathers every rank's count: each CP group's batch cp_size times
        trainer.state.num_input_tokens_seen = before + (trainer.state.num_input_tokens_seen - before) // cp_size()

    patches.set_attr(trainer, compat.TRAINER_TRACK_TOKENS, track_once)
    patches.insert(trainer.callback_handler, "callbacks", 0, EvaluationStepsCallback())
    # (TRL's `num_tokens`, counted on each rank's padded shard, is replaced by `callbacks.StepMetricsCallback`)


def _cp_group_mean(loss: torch.Tensor | None, parallel: ParallelDims) -> torch.Tensor | None:
    if loss is None or parallel.cp_size == 1:
        return loss
    total = loss.detach().clone()
    all_reduce(total, parallel.cp_group, "the all-reduce of the reported loss")
    return total / parallel.cp_size


def _count_for_batch_mean(shift_labels: torch.Tensor, parallel: ParallelDims) -> torch.Tensor:
    """The label count to hand `compute_loss` with a rank's shard of a batch that its trainer's prediction step passes
    without one (TRL SFTTrainer's), so that the CP group's mean of the shards' losses (`_cp_group_mean`) is the batch's
    token mean, which compute_loss returns without a count and without CP. It is the CP group's own count (its
    `shift_labels` summed over the group), never the other data-parallel groups' (the Trainer's count gathers every
    rank's: with DP 2 x CP 2 each group's loss was weighed by the other group's rows), times the DP degree: compute_loss
    multiplies a counted loss by the processes (dp x cp), `average_tokens_across_devices` seen on (`cp_group_steps`)."""
    return global_num_items(shift_labels, parallel.cp_group) * parallel.dp_size


def cp_group_steps(trainer: Trainer, patches, parallel: Callable[[], ParallelDims],
                   prepare: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Make the Trainer shard each batch with `prepare`, and its `training_step` and `prediction_step` return on every
    rank of a CP group what one process returns for the group's batch.

    `prepare(batch)` is this rank's model inputs for the batch, with its `CPShard` (the batch itself where the step in
    progress runs without CP). A CP rank's loss is its shard's share (its token losses over the batch's count, times
    the ranks whose gradients are averaged): only the mean over the ranks is the batch's loss. The Trainer gathers that
    mean for the losses it logs, but keeps rank 0's own value for the steps after the last log (in `train_loss`), and
    `gather_for_metrics` drops the losses of the ranks past the last sample of an evaluation set smaller than a
    gathered batch (rank 0's kept alone for `eval_loss`). Averaged over the CP group, every rank holds what a
    data-parallel rank holds without CP, so each of those values is exact. The gradients are untouched (the backward
    runs inside the step). A prediction step that hands `compute_loss` the whole batch (TRL SFTTrainer's) has it
    sharded there, and TRL's loss, handed no label count, the CP group's. A prediction step's logits (and any other
    per-token output) are gathered over the CP group into the whole sequence, in the batch's order
    (`whole_sequence_outputs`), and its labels are the batch's (the stock step and TRL's read them before sharding):
    `preprocess_logits_for_metrics`, `compute_metrics` and `predict()` see what one process gives them; label
    smoothing is the CP group's (`smooth_labels_over_cp_group`), and NEFTune's noise one process's
    (`neftune_over_cp_group`). A trainer whose loss is built from the outputs of whole rows (TRL's DPO, KTO and Reward
    trainers, the experimental ORPO and CPO: `trainer_losses.cp_whole_row_losses`) gets its batches whole instead:
    each forward of its model and reference model in a step is sharded and its outputs gathered back into the whole rows
    (`whole_rows.py`), so its loss and the metrics it gathers are the batch's on every rank of the group. A
    sequence-classification or question-answering head (`heads.BATCH_OUTPUT_HEADS`) computes the batch's outputs on
    every rank of a CP forward (`heads.pool_over_cp_group`, hooked here) and the batch's loss from them: the step takes
    the rank's share of it (`model_loss_share`), and a prediction step returns those outputs as they are (hidden states
    after them gathered). `parallel()` is the CP layout of the step in progress (constant, or a curriculum's stage)."""
    training_step, prediction_step, compute_loss = trainer.training_step, trainer.prediction_step, trainer.compute_loss
    in_step = [False]  # (`gather_metrics_once_per_cp_group`: what a step gathers is its shard's)
    predicting = [False]
    rows = [None]  # the rows of the last step's batch (`gather_metrics_once_per_cp_group`)
    # the last prediction step's loader and the stream's rows of its global batch, where it holds copies (same)
    stream_last: list[tuple[Any, int] | None] = [None]
    shard: list[CPShard | None] = [None]  # the step's batch's (None: the batch ran unsharded)
    whole_rows = type(trainer).compute_loss in trainer_losses.cp_whole_row_losses()
    # (GRPO's and RLOO's rows are generated in the step, unsharded on each CP group's first rank: those forwards are
    # not CP's)
    preparing = (share_generation_batches(trainer, patches, parallel)
                 if type(trainer).compute_loss in trainer_losses.cp_generated_row_losses() else lambda: False)
    hook_forwards = hook_whole_row_forwards(trainer, patches, parallel, prepare,
                                            lambda: in_step[0] and not preparing())
    # (a sequence-classification or question-answering head's outputs and loss are the batch's on every rank: how
    # many outputs of a prediction step are its)
    batch_outputs = BATCH_OUTPUT_HEADS.get(model_head(trainer.model), 0)
    if batch_outputs:
        patches.on_undo(pool_over_cp_group(trainer.model).remove)

    def prepare_inputs(_model, inputs: dict[str, Any]):
        if whole_rows:  # (its model's forwards shard themselves)
            return contextlib.nullcontext, inputs
        prepared = prepare(inputs)
        shard[0] = prepared.get(CP_SHARD_KWARG)
        return contextlib.nullcontext, prepared

    @contextlib.contextmanager
    def stepping(prediction: bool):
        in_step[0], predicting[0], shard[0] = True, prediction, None
        if whole_rows:
            hook_forwards()
        try:
            yield
        finally:
            in_step[0], predicting[0], shard[0] = False, False, None

    noise = neftune_over_cp_group(trainer, patches)

    def step(model, inputs, *rest, **kwargs):
        rows[0], stream_last[0] = find_batch_size(inputs), None
        begun = cp_forwards_begun()
        with stepping(False):
            if noise is not None:
                noise.on = True
            try:
                loss = training_step(model, inputs, *rest, **kwargs)
            finally:
                if noise is not None:
                    noise.on = False
        if parallel().cp_size > 1 and cp_forwards_begun() == begun:
            _say_unsplit_step(trainer, parallel().cp_size)
        return _cp_group_mean(loss, parallel())

    # (TRL SFTTrainer's loss divides by the count it is handed, else by its inputs' targets, a shard's; the Trainer's
    # own, handed none, is the model's or the smoother's: `smooth_labels_over_cp_group`)
    counts_inputs = type(trainer).compute_loss is not Trainer.compute_loss

    def loss_of_shards(model, inputs, return_outputs=False, num_items_in_batch=None):
        if parallel().cp_size == 1 or whole_rows:  # (a whole-row trainer's forwards shard themselves)
            return compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if predicting[0] and shard[0] is None:
            # a prediction step of the trainer's own (TRL SFTTrainer's) hands compute_loss the whole batch: shard it,
            # as the Trainer's step does (through label smoothing's wrapper where it is on, which hands the smoother
            # the shard's targets as `labels`)
            _, inputs = getattr(trainer, compat.TRAINER_CP_INPUTS)(model, inputs)
        targets = inputs.get("shift_labels", inputs.get("labels"))
        with contextlib.ExitStack() as seen:
            if num_items_in_batch is None and counts_inputs and targets is not None:
                # handed no count (an evaluation; a model whose forward takes no loss keywords, in training), TRL's loss
                # is its shard's mean: hand it the CP group's count, with its scaling of a counted loss's MoE aux term
                # for gradient accumulation undone (the Trainer divides the step's loss by it, as without a count)
                num_items_in_batch = _count_for_batch_mean(targets, parallel())
                seen.enter_context(temporarily(trainer, "current_gradient_accumulation_steps", 1))
            if num_items_in_batch is not None and not trainer.args.average_tokens_across_devices:
                # (a count under CP takes the flag's form: `count_once_per_cp_group`)
                seen.enter_context(temporarily(trainer.args, "average_tokens_across_devices", True))
            # (the MoE router loss's and an adapter regularizer's value on each rank follow what this compute_loss
            # does with the loss)
            share = model_loss_share(trainer, num_items_in_batch, parallel().cp_size)
            # (a sequence-classification or question-answering head's loss, of its outputs, is the batch's on every
            # rank, and so are those terms: the rank's share of the whole loss is taken below)
            seen.enter_context(loss_share(1.0 if batch_outputs else share))
            seen.enter_context(regularizer_share(model, 1.0 if batch_outputs else share))
            result = compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)
        if not batch_outputs:
            return result
        return (result[0] * share, result[1]) if return_outputs else result * share

    def predict_batch(model, inputs, *rest, **kwargs):
        with stepping(True):
            loss, *outputs = prediction_step(model, inputs, *rest, **kwargs)
            # (a batch without labels runs unsharded in the stock step: each rank computes the whole sequence)
            logits = outputs[0] if shard[0] is not None and outputs else None
            if logits is not None and not batch_outputs:
                outputs[0] = whole_sequence_outputs(logits, shard[0])
            elif isinstance(logits, tuple) and len(logits) > batch_outputs:  # (the head's outputs, then hidden states)
                outputs[0] = (*logits[:batch_outputs], *whole_sequence_outputs(logits[batch_outputs:], shard[0]))
        return (_cp_group_mean(loss, parallel()), *outputs)

    def predict(model, inputs, *rest, **kwargs):
        rows[0] = find_batch_size(inputs)
        state = trainer.accelerator.gradient_state
        real = rank_stream_rows(state.active_dataloader) if state.end_of_dataloader else None
        stream_last[0] = None if real is None else (state.active_dataloader, stream_rows(state.active_dataloader))
        if real is None:
            return predict_batch(model, inputs, *rest, **kwargs)
        # the last global batch of an iterable set ends with copies of its first rows (`stream_rows.py`), which the
        # gather drops: a rank's loss is its stream rows' alone, as one process's short last batch, over its own
        # token count (not the ranks' total, which counted the copies); its outputs keep the batch's rows, to gather
        # alike
        with temporarily(trainer.args, "average_tokens_across_devices", False):
            if real == 0:
                return predict_batch(model, inputs, *rest, **kwargs)
            loss, *outputs = predict_batch(model, _first_rows(inputs, rows[0], real), *rest, **kwargs)
        return (loss, *(_as_rows(x, real, rows[0]) for x in outputs))

    patches.set_attr(trainer, compat.TRAINER_CP_INPUTS, prepare_inputs)
    patches.set_attr(trainer, "training_step", step)
    patches.set_attr(trainer, "prediction_step", predict)
    patches.set_attr(trainer, "compute_loss", loss_of_shards)
    router_loss_over_cp_group(trainer.model, patches)
    smooth_labels_over_cp_group(trainer, patches, parallel)
    # (what a whole-row trainer's step gathers is already the batch's)
    gather_metrics_once_per_cp_group(trainer, patches, parallel, lambda: in_step[0] and not whole_rows,
                                      lambda: rows[0], lambda: stream_last[0])


def _first_rows(inputs: dict[str, Any], rows: int, keep: int) -> dict[str, Any]:
    """The batch's first `keep` of its `rows` rows: each tensor with `rows` rows cut, the rest as given."""
    return {k: v[:keep] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows else v
            for k, v in inputs.items()}


def _as_rows(output, real: int, rows: int):
    """A prediction step's output for `real` rows given `rows` rows (its last repeated), so that the ranks' outputs
    gather alike; tuples of them alike."""
    if isinstance(output, torch.Tensor) and output.dim() and output.shape[0] == real:
        return torch.cat([output, output[-1:].expand(rows - real, *output.shape[1:])])
    if isinstance(output, tuple | list):
        return type(output)(_as_rows(x, real, rows) for x in output)
    return output

def _say_unsplit_step(trainer: Trainer, cp_size: int) -> None:
    """Warn once per trainer, on the first process (as CP's notes at start: every rank's step runs unsplit alike),
    that a training step ran no forward on a CP shard: its `training_step` ran the model on the batch itself, outside
    the Trainer's prepared inputs (TRL's experimental OnlineDPOTrainer; a script's own step): every rank of the group
    then computes the whole rows, one process's result without CP's memory saving, while the run's start said each
    sequence was split."""
    if trainer.__dict__.get("_hf_sparse_cp_said_unsplit"):
        return
    trainer.__dict__["_hf_sparse_cp_said_unsplit"] = True
    if not trainer.is_world_process_zero():  # (the launcher shows every process's log: the warning printed N times)
        return
    logger.warning(
        "Context parallelism (CP %d) split no sequence in this training step: %s.training_step runs the model on the "
        "batch itself, outside the Trainer's prepared inputs (its compute_loss), so every rank of a CP group "
        "computed the whole rows: one process's result, with none of CP's memory saving. Drop --cp_size (data "
        "parallelism trains on more rows a step with the same processes), or compute the step's loss through the "
        "Trainer's compute_loss.", cp_size, type(trainer).__qualname__)
