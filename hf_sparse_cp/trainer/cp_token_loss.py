"""The token losses of a CP step that a rank's shard does not give alone (`context_parallel.py`): the Trainer's label
smoothing, and the loss of a model that computes its shard's mean itself (a forward without loss keywords, a
token-classification head, an encoder-decoder's decoder), each over the CP group's count:
`smooth_labels_over_cp_group`."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from transformers import Trainer

from ..distributed import ParallelDims, global_num_items
from ..distributed.loss import rank_loss
from ..integration import compat, fsdp_class_names
from ..integration.architectures import computes_unshifted_loss
from ..integration.heads import BATCH_OUTPUT_HEADS, LANGUAGE_MODEL, TOKEN_CLASSIFICATION, model_head


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
                 else shift_labels or fsdp_class_names.smoother_shifts_labels(trainer.model))
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

def _micro_batch_count(labels: torch.Tensor, parallel: ParallelDims, averaged: bool, ignore_index: int) -> torch.Tensor:
    """The Trainer's loss token count (`num_items_in_batch`, in the form `count_once_per_cp_group` gives it) of the
    micro-batch whose shard's targets are `labels` alone, not of the accumulated window: every DP group's batch where
    the count is averaged across devices (the shards of every rank: each CP group's batch once), else the CP group's
    times the DP degree. Collective."""
    if averaged:
        return global_num_items(labels, ignore_index=ignore_index)
    return global_num_items(labels, parallel.cp_group, ignore_index) * parallel.dp_size
