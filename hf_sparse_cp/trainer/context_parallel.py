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
`disable_trainer_context_parallel` undoes all of it. The pieces a curriculum of CP degrees reuses
(`trainer/curriculum.py`) are public: `pad_token_id`, `dp_data_loader`, `count_once_per_cp_group`,
`follow_first_ranks_generators`, `first_batch_of_each_run`, `cp_group_steps`.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from transformers import Trainer
from transformers.trainer_pt_utils import find_batch_size

from ..config import SparseAttentionConfig
from ..distributed import (
    CP_SHARD_KWARG,
    ContextParallelConfig,
    CPShard,
    ParallelDims,
    global_num_items,
    prepare_context_parallel_inputs,
)
from ..distributed.comm import all_reduce, naming_unresponsive_ranks
from ..distributed.loss import rank_loss
from ..integration import compat
from ..integration.architectures import (
    computes_unshifted_loss,
)
from ..integration.backend import cp_forward_shard, cp_forwards_begun, guard_context_parallel, model_config_for
from ..integration.composite import tower_names
from ..integration.given import require_instance, require_trainer
from ..integration.heads import (
    BATCH_OUTPUT_HEADS,
    LANGUAGE_MODEL,
    SEQUENCE_CLASSIFICATION,
    TOKEN_CLASSIFICATION,
    base_model,
    model_head,
    pool_over_cp_group,
)
from ..integration.models import check_model_supports_context_parallel
from ..integration.patching import record_on, temporarily, undo_recorded
from ..integration.planner_weights import planned_linear_weight
from .adapter_loss import regularizer_share
from .arguments import flag_errors
from .callbacks import EvaluationStepsCallback
from .cp_checks import check_loss, check_training_arguments, warn_inexact
from .generated_rows import share_generation_batches
from .router_loss import loss_share, model_loss_share, router_loss_over_cp_group
from .stream_rows import count_stream, rank_stream_rows, read_whole_stream, stream_rows
from .token_ids import CheckedCollate, label_classes_of, vocabulary_of
from .whole_rows import hook_whole_row_forwards, whole_sequence_outputs

logger = logging.getLogger(__name__)

_FEATURE = "context_parallel"


def _accelerate_owns_cp(trainer: Trainer) -> bool:
    pc = getattr(trainer.accelerator, "parallelism_config", None)
    return pc is not None and pc.cp_size > 1


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
    options = compat.dp_data_loader_options(acc)
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
        loader.worker_init_fn = compat.seed_workers_by(loader.worker_init_fn, parallel.dp_rank)
        loader.collate_fn = CheckedCollate(loader.collate_fn, vocabulary, towers, classes)
        compat.track_data_loader(acc, prepared)
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
    between them): every rank alike; a loader's workers are seeded on their own (`compat.seed_workers_by`).
    `parallel()` is the CP layout of the step in progress."""
    compat.require("transformers.Trainer.get_batch_samples")
    compat.require("transformers.Trainer.evaluation_loop")
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
    divides = owns_cp or compat.token_count_divides_by_get_cp_size()
    compat.require(f"transformers.Trainer.{compat.TRAINER_COUNT_ITEMS}")
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
    compat.require(f"transformers.Trainer.{compat.TRAINER_TRACK_TOKENS}")
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


def _token_loss(model_output, labels: torch.Tensor, shift_labels: bool = False, num_items_in_batch=None):
    """The loss a causal LM or a token-classification head computes of its labels (transformers' `ForCausalLMLoss`,
    `ForTokenClassification`: the cross-entropy in fp32, each position predicting the next one's label where
    `shift_labels`), called as the Trainer calls its label smoother: the sum over `num_items_in_batch`, else the mean
    over the targets."""
    logits = model_output["logits"] if isinstance(model_output, dict) else model_output[0]
    if shift_labels:
        logits, labels = logits[..., :-1, :], labels[..., 1:]
    labels = labels.to(logits.device)
    loss = torch.nn.functional.cross_entropy(logits.float().flatten(0, -2), labels.flatten(), reduction="sum")
    return loss / (labels.ne(-100).sum() if num_items_in_batch is None else num_items_in_batch)


def smooth_labels_over_cp_group(trainer: Trainer, patches, parallel: Callable[[], ParallelDims]) -> None:
    """Make the Trainer's label smoothing (`--label_smoothing_factor`), and the loss of a model whose forward takes no
    loss keywords or of a token-classification head, under CP what they are in one process.

    The Trainer hands its label smoother the logits and `labels` of the step's inputs, which it shifts (for a model
    class in transformers' causal-LM mapping; others' labels it smooths as given); under CP those are a rank's shard,
    and the targets are shifted before sharding (`shift_labels`). So the CP inputs hand it the shard's shifted targets
    as `labels` (without `shift_labels`, so that the model computes no loss of its own), and the smoother, told not to
    shift, computes the stock per-token loss (1 - eps) nll + eps mean(-log p) on them; where the Trainer smooths
    unshifted labels, on the shard's unshifted labels (the batch's, sharded as its input_ids). Its normalization is the
    CP group's: `num_items_in_batch`, the batch's count that the Trainer already takes once per CP group, where the
    Trainer passes it; else the loss sum over the group's count (`rank_loss`, `global_num_items`), as the model's loss.
    A model whose forward takes no loss keywords (`model_accepts_loss_kwargs` False: remote code without **kwargs)
    computes its loss itself, as the mean over its shard's tokens, whose mean over the CP group is not the batch's:
    with the Trainer's own compute_loss it computes logits only, and the causal-LM loss of the shard's targets
    (`_token_loss`) takes the smoother's place, over the group's count. So does a token-classification head's
    (`heads.TOKEN_CLASSIFICATION`: transformers' forward drops the loss keywords, its loss is its shard's mean), on the
    shard's unshifted labels, and a decoder's of an encoder-decoder family (`computes_unshifted_loss`: the mean of
    its labels unshifted, whatever keywords it gets; it was refused under CP), over the group's count of those
    labels, not the Trainer's count of shifted ones. With gradient accumulation the token-classification head's count
    is its micro-batch's (`_micro_batch_count`), not the accumulated window's the Trainer hands it: one process sums
    the micro-batches' own means (the Trainer divides none by the steps). A sequence-classification head's pooled
    logits and row labels are the batch's on every rank (`heads.BATCH_OUTPUT_HEADS`): the stock smoother smooths them
    (`cp_group_steps` takes the rank's share). `parallel()` is the CP layout of the step in progress (constant, or a
    curriculum's stage); a stage at CP 1 runs the stock smoother (the model's loss)."""
    smoother, prepare = trainer.label_smoother, getattr(trainer, compat.TRAINER_CP_INPUTS)
    head = model_head(trainer.model)
    # (the decoder of an encoder-decoder family: its forward's loss is the mean of its labels unshifted, whatever the
    # loss keywords it is given)
    unshifted_lm = head == LANGUAGE_MODEL and computes_unshifted_loss(trainer.model.config)
    # (a token-classification head's forward drops the loss keywords whatever its signature: its loss is its shard's
    # mean; a sequence-classification head's loss is every rank's alike, `cp_group_steps` takes its share)
    own_loss = smoother is None and type(trainer).compute_loss is Trainer.compute_loss and (
        head == TOKEN_CLASSIFICATION or unshifted_lm
        or (head == LANGUAGE_MODEL and not trainer.model_accepts_loss_kwargs))
    if own_loss:
        smoother = _token_loss
    if smoother is None:
        return
    ignore_index = getattr(smoother, "ignore_index", -100)
    unshifted: list[torch.Tensor | None] = [None]  # the step's shard's labels, unshifted

    def prepare_targets(model, inputs: dict[str, Any]):
        context, inputs = prepare(model, inputs)
        if parallel().cp_size > 1 and "shift_labels" in inputs:
            unshifted[0] = inputs.get("labels")
            inputs = {**inputs, "labels": inputs["shift_labels"]}
            del inputs["shift_labels"]
        return context, inputs

    def smooth(model_output, labels, shift_labels=False, num_items_in_batch=None):
        par = parallel()
        # (a causal LM's own loss shifts whatever its class's name, an encoder-decoder family's decoder's never; the
        # Trainer's check of the name misses a causal LM that FSDP2 renamed)
        shift = ((head == LANGUAGE_MODEL and not unshifted_lm) if own_loss
                 else shift_labels or compat.smoother_shifts_labels(trainer.model))
        if par.cp_size == 1 or head in BATCH_OUTPUT_HEADS:  # (its pooled logits and row labels: the batch's)
            return smoother(model_output, labels, shift_labels=shift, num_items_in_batch=num_items_in_batch)
        if not shift:  # the Trainer smooths the labels as given
            labels = unshifted[0]
        if own_loss and unshifted_lm:
            # (the model's mean over its unshifted labels, which the Trainer's count of shifted ones is not: the CP
            # group's count of them, scaled as the Trainer scales the model's loss when it counts, by the processes)
            count = global_num_items(labels, par.cp_group, ignore_index)
            scaled_by_trainer = num_items_in_batch is not None and trainer.args.average_tokens_across_devices
            num_items_in_batch = count if scaled_by_trainer else None
        elif (own_loss and head == TOKEN_CLASSIFICATION and num_items_in_batch is not None and trainer.model.training
              and trainer.args.gradient_accumulation_steps > 1):
            # (the head's loss is each micro-batch's own mean, which the Trainer does not divide by the accumulation
            # steps, as it hands a model that takes loss keywords the accumulated window's count: one process sums the
            # micro-batches' means. In training only, where every rank steps; an evaluation counts one batch)
            num_items_in_batch = _micro_batch_count(labels, par, trainer.args.average_tokens_across_devices,
                                                    ignore_index)
        if num_items_in_batch is not None:
            return smoother(model_output, labels, num_items_in_batch=num_items_in_batch)
        loss_sum = smoother(model_output, labels, num_items_in_batch=1)
        return rank_loss(loss_sum, global_num_items(labels, par.cp_group, ignore_index), par.cp_size)

    patches.set_attr(trainer, compat.TRAINER_CP_INPUTS, prepare_targets)
    patches.set_attr(trainer, "label_smoother", smooth)


def neftune_over_cp_group(trainer: Trainer, patches) -> NEFTuneNoise | None:
    """Make NEFTune (`--neftune_noise_alpha`) under CP add one process's noise, to the bit.

    transformers' NEFTune hook adds to the embeddings uniform noise of magnitude alpha / sqrt(L x d), L the length of
    the tensor the embedding layer returns, drawn in that tensor's shape: under CP a rank's shard, so the noise was
    sqrt(CP) times one process's, and once scaled, still other draws than one process's (the run equalled one process
    in distribution only). The Trainer's hook is kept off (its `neftune_noise_alpha` unset on this trainer), and the
    plugin's (`NEFTuneNoise`, on in training steps) draws the noise of the whole batch [B, S, d] as one process does
    and adds its rank's shard of it: the ranks of a CP group, seeded alike, draw what one process draws. None
    without NEFTune."""
    alpha = trainer.neftune_noise_alpha
    if alpha is None:
        return None
    model = trainer.model
    embeddings = base_model(model).get_input_embeddings()
    noise = NEFTuneNoise(alpha)
    patches.set_attr(trainer, "neftune_noise_alpha", None)  # (the Trainer then never adds its hook)
    patches.on_undo(embeddings.register_forward_hook(noise).remove)
    return noise


class NEFTuneNoise:
    """NEFTune's noise on the input embeddings' output (transformers' `neftune_post_forward_hook`) while `on` (in a
    training step) and the layer trains, drawn over the whole sequence of a CP forward and sharded as its tokens are
    (`neftune_over_cp_group`). A picklable object: the hook stays on the trained model, which must pickle."""

    def __init__(self, alpha: float):
        self.alpha, self.on = alpha, False

    def __call__(self, module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        if not (self.on and module.training):
            return output
        shard = cp_forward_shard()
        length = output.size(1) if shard is None else shard.plan.seq_len
        # (transformers' magnitude, in its dtype: alpha over a float32 square root)
        magnitude = self.alpha / torch.sqrt(torch.tensor(length * output.size(2)))
        noise = output.new_zeros(output.size(0), length, *output.shape[2:]).uniform_(-magnitude, magnitude)
        return output + (noise if shard is None else shard.plan.shard(noise, shard.rank, pad_value=0.0))


def _micro_batch_count(labels: torch.Tensor, parallel: ParallelDims, averaged: bool, ignore_index: int) -> torch.Tensor:
    """The Trainer's loss token count (`num_items_in_batch`, in the form `count_once_per_cp_group` gives it) of the
    micro-batch whose shard's targets are `labels` alone, not of the accumulated window: every DP group's batch where
    the count is averaged across devices (the shards of every rank: each CP group's batch once), else the CP group's
    times the DP degree. Collective."""
    if averaged:
        return global_num_items(labels, ignore_index=ignore_index)
    return global_num_items(labels, parallel.cp_group, ignore_index) * parallel.dp_size


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
    trainers, the experimental ORPO and CPO: `compat.cp_whole_row_losses`) gets its batches whole instead: each forward
    of its model and reference model in a step is sharded and its outputs gathered back into the whole rows
    (`whole_rows.py`), so its loss and the metrics it gathers are the batch's on every rank of the group. A
    sequence-classification or question-answering head (`heads.BATCH_OUTPUT_HEADS`) computes the batch's outputs on
    every rank of a CP forward (`heads.pool_over_cp_group`, hooked here) and the batch's loss from them: the step takes
    the rank's share of it (`model_loss_share`), and a prediction step returns those outputs as they are (hidden states
    after them gathered). `parallel()` is the CP layout of the step in progress (constant, or a curriculum's stage)."""
    training_step, prediction_step, compute_loss = trainer.training_step, trainer.prediction_step, trainer.compute_loss
    in_step = [False]  # (`_gather_metrics_once_per_cp_group`: what a step gathers is its shard's)
    predicting = [False]
    rows = [None]  # the rows of the last step's batch (`_gather_metrics_once_per_cp_group`)
    # the last prediction step's loader and the stream's rows of its global batch, where it holds copies (same)
    stream_last: list[tuple[Any, int] | None] = [None]
    shard: list[CPShard | None] = [None]  # the step's batch's (None: the batch ran unsharded)
    whole_rows = type(trainer).compute_loss in compat.cp_whole_row_losses()
    # (GRPO's and RLOO's rows are generated in the step, unsharded on each CP group's first rank: those forwards are
    # not CP's)
    preparing = (share_generation_batches(trainer, patches, parallel)
                 if type(trainer).compute_loss in compat.cp_generated_row_losses() else lambda: False)
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
    _gather_metrics_once_per_cp_group(trainer, patches, parallel, lambda: in_step[0] and not whole_rows,
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


def _gather_metrics_once_per_cp_group(trainer: Trainer, patches, parallel: Callable[[], ParallelDims],
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


def _say_unsplit_step(trainer: Trainer, cp_size: int) -> None:
    """Warn once per trainer that a training step ran no forward on a CP shard: its `training_step` ran the model on
    the batch itself, outside the Trainer's prepared inputs (TRL's experimental OnlineDPOTrainer; a script's own
    step): every rank of the group then computes the whole rows, one process's result without CP's memory saving, while
    the run's start said each sequence was split."""
    if trainer.__dict__.get("_hf_sparse_cp_said_unsplit"):
        return
    trainer.__dict__["_hf_sparse_cp_said_unsplit"] = True
    logger.warning(
        "Context parallelism (CP %d) split no sequence in this training step: %s.training_step runs the model on the "
        "batch itself, outside the Trainer's prepared inputs (its compute_loss), so every rank of a CP group "
        "computed the whole rows: one process's result, with none of CP's memory saving. Drop --cp_size (data "
        "parallelism trains on more rows a step with the same processes), or compute the step's loss through the "
        "Trainer's compute_loss.", cp_size, type(trainer).__qualname__)


def _first_ranks_values(gathered: torch.Tensor, parallel: ParallelDims) -> torch.Tensor:
    """The values of each CP group's first rank, in data-parallel order, of a gather over all ranks ([world x n, ...]:
    rank-major)."""
    first = torch.tensor(parallel.cp_groups)[:, 0].to(gathered.device)
    return gathered.reshape(parallel.world_size, -1, *gathered.shape[1:])[first].flatten(0, 1)


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
        check_loss(trainer, parallel.cp_size)
        check_training_arguments(trainer.args, parallel.cp_size)
    warn_inexact(trainer)
    compat.require(f"transformers.Trainer.{compat.TRAINER_CP_INPUTS}")
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
        compat.require(f"accelerate.Accelerator.{compat.ACCELERATOR_PREPARE_CP}")
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
