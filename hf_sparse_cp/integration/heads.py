"""The head a model puts on its decoder, and what context parallelism does for a classification head.

Under CP each rank's forward holds its shard of every row. A language-model head and a token-classification head
(transformers' `GenericForTokenClassification`: Llama, Qwen2, Mistral, ...) score every token on its own: the rank's
logits are its shard's, and the loss of them is the CP group's where the Trainer computes it
(trainer/cp_token_loss.py).
A sequence-classification head (`GenericForSequenceClassification`) scores every token and pools one per row, the last
that is not padding, which lies on one rank of the group under any split. `pool_over_cp_group` hooks its score layer:
in a CP forward the layer's output becomes, at every position, the row's pooled logits, taken on the rank holding the
token and summed over the group (`CPShard.at_positions`, differentiable), so that whatever position of its shard the
model's own pooling picks, every rank holds one process's pooled logits and computes the model's own loss of them (any
problem type: regression, single- or multi-label). The pooled token follows the model's rule on the whole batch's
input_ids, which the shard carries (`last_token_positions`). A question-answering head (`GenericForQuestionAnswering`)
scores every token with a start and an end logit, and its loss is a softmax of them over every position of the row:
`pool_over_cp_group` makes its layer's output the whole sequence's ([B, S, 2], gathered over the CP group,
`CPShard.whole_sequence`, differentiable), so that every rank holds one process's start and end logits and loss.
Either head's outputs and loss are then the batch's on every rank (`BATCH_OUTPUT_HEADS`: the Trainer takes the rank's
share of the loss, trainer/cp_steps.py).

A question-answering head's loss also reads the padding after a row's tokens, where sparse_cp differs from SDPA (with
or without CP), and so does a sequence-classification head whose pad_token_id is not the batch's padding:
`note_padding_read_by_head` says so once.
"""

from __future__ import annotations

import functools
import logging

import torch
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
)

from ..config import BACKEND_NAME
from ..distributed.shard import CP_SHARD_KWARG
from . import upstream
from .call_context import cp_forward_shard

logger = logging.getLogger(__name__)

LANGUAGE_MODEL, TOKEN_CLASSIFICATION = "language model", "token classification"
SEQUENCE_CLASSIFICATION, QUESTION_ANSWERING = "sequence classification", "question answering"
# The heads whose outputs ([B, ...] pooled logits; [B, S] start and end logits) and loss are the batch's on every rank
# of a CP forward, and how many of the outputs a prediction step returns first are theirs (per-token hidden states
# may follow).
BATCH_OUTPUT_HEADS = {SEQUENCE_CLASSIFICATION: 1, QUESTION_ANSWERING: 2}
# name of the layer `pool_over_cp_group` hooks
_HEAD_LAYERS = {SEQUENCE_CLASSIFICATION: "score", QUESTION_ANSWERING: "qa_outputs"}


def base_model(model: torch.nn.Module) -> torch.nn.Module:
    """`model`, or the model a PEFT model wraps (`get_base_model`)."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def model_head(model: torch.nn.Module) -> str | None:
    """`LANGUAGE_MODEL` (`get_output_embeddings()` set), `TOKEN_CLASSIFICATION`, `SEQUENCE_CLASSIFICATION` or
    `QUESTION_ANSWERING` (a class whose forward is transformers' generic one of that head: the forwards this module is
    exact for), else None (a head's forward of an architecture's own: GPT-2's)."""
    base = base_model(model)
    head = getattr(base, "get_output_embeddings", None)
    if head is not None and head() is not None:
        return LANGUAGE_MODEL
    forward = getattr(type(base), "forward", None)
    if forward is GenericForTokenClassification.forward:
        return TOKEN_CLASSIFICATION
    if forward is GenericForSequenceClassification.forward:
        return SEQUENCE_CLASSIFICATION
    if forward is GenericForQuestionAnswering.forward:
        return QUESTION_ANSWERING
    return None


def last_token_positions(input_ids: torch.Tensor | None, pad_token_id: int | None, batch: int, seq_len: int,
                         device: torch.device) -> torch.Tensor:
    """int64 [batch]: the token of each row a sequence-classification head pools, by transformers' rule
    (`GenericForSequenceClassification.forward`): the rightmost that is not `pad_token_id` (position 0 in a row of
    padding only); the row's last position without a pad token or without input_ids (inputs_embeds)."""
    if pad_token_id is None or input_ids is None:
        return torch.full((batch,), seq_len - 1, dtype=torch.long, device=device)
    non_pad = (input_ids != pad_token_id).to(device, torch.int32)
    return (torch.arange(seq_len, device=device, dtype=torch.int32) * non_pad).argmax(-1).long()


def _pooled_at_every_position(config, module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor | None:
    shard = cp_forward_shard()
    if shard is None:
        return None
    positions = last_token_positions(shard.input_ids, config.get_text_config().pad_token_id, output.shape[0],
                                     shard.plan.seq_len, output.device)
    return shard.at_positions(output, positions).unsqueeze(1).expand_as(output)


def _whole_sequence(module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor | None:
    shard = cp_forward_shard()
    return None if shard is None else shard.whole_sequence(output)


def pool_over_cp_group(model: torch.nn.Module) -> torch.utils.hooks.RemovableHandle:
    """Make the sequence-classification or question-answering head of `model` (`BATCH_OUTPUT_HEADS`) compute the
    batch's outputs on every rank of a forward under context parallelism (see the module docstring); outside one it is
    untouched. Returns the hook's handle (remove it to undo); the hook is a module-level function: the model still
    pickles."""
    base, head = base_model(model), model_head(model)
    hook = (functools.partial(_pooled_at_every_position, base.config) if head == SEQUENCE_CLASSIFICATION
            else _whole_sequence)
    return getattr(base, _HEAD_LAYERS[head]).register_forward_hook(hook)


# set on a decoder whose head's reading of padding was noted (`note_padding_read_by_head`)
_NOTED = "_hf_sparse_cp_padding_read_noted"
# the heads whose loss or outputs may read a padding position (`note_padding_read_by_head`)
PADDING_READING_HEADS = (SEQUENCE_CLASSIFICATION, QUESTION_ANSWERING)


def padding_after_tokens(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """bool [B, S]: the padding after a row's last token, by the 2D padding mask [B, S]; None where a row pads between
    two tokens (a call with such a gap attends every key, its padding queries as SDPA's: `call_tokens.every_key_call`).
    """
    real = attention_mask.bool()
    if (real[:, 1:] & ~real[:, :-1]).sum(-1).add(real[:, 0]).gt(1).any():  # (a gap: `tokens.padding_between_tokens`)
        return None
    return ~real & (real.long().cummax(-1).values > 0)


def note_padding_read_by_head(head: str, decoder: torch.nn.Module, args, kwargs) -> None:
    """Forward pre-hook (with kwargs, `head` bound) on the decoder of a model with a head of `PADDING_READING_HEADS`
    (`registration.guard_registration`): the first forward on sparse_cp whose head reads padding after a row's tokens
    (the whole batch under CP: the shard's mask and input_ids) logs so once per decoder. sparse_cp gives such a padding
    query no attention (its output 0, as transformers' flash_attention_2 does), where SDPA and eager attend it to the
    row's tokens. A language model's or token-classification head's loss reads no padding position (-100 labels), but
    transformers' question-answering loss takes a softmax over every position of the row (tiny Llama, fp64, every
    block kept, a row padded from 60 of 80 tokens: loss 4.3380 against SDPA's 4.3491; left padding, which sees no token
    under either, gives SDPA's), and a sequence-classification head pools the last token that is not its config's
    pad_token_id, a padding position where the batch pads with another token (pooled logits 0.16 from SDPA's)."""
    if decoder.__dict__.get(_NOTED) or upstream.attn_implementation(decoder.config) != BACKEND_NAME:
        return
    shard = kwargs.get(CP_SHARD_KWARG)  # (a CP shard, or a probe in its place: no mask)
    mask = kwargs.get("attention_mask") if shard is None else getattr(shard, "attention_mask", None)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return
    padding = padding_after_tokens(mask)
    if padding is None or not padding.any():
        return
    if head == SEQUENCE_CLASSIFICATION:
        ids = (kwargs.get("input_ids", args[0] if args else None) if shard is None
               else getattr(shard, "input_ids", None))
        pad_token_id = decoder.config.get_text_config().pad_token_id
        pooled = last_token_positions(ids, pad_token_id, mask.shape[0], mask.shape[1], mask.device)
        rows = padding.gather(1, pooled[:, None]).squeeze(1).nonzero().flatten().tolist()
        if not rows:
            return
        what = (f"a sequence-classification head pools the last token of each row that is not its config's "
                f"pad_token_id ({pad_token_id}), which in row {rows[0]} of the batch is padding by its attention mask "
                "(the batch pads with another token, or comes as inputs_embeds, whose last position is pooled)")
        fix = ("set model.config.pad_token_id to the token that pads the batch (the tokenizer's pad_token_id), or "
               "train with the model's own attention (--sparse_attention false)")
        reads = "the pooled logits and their loss differ from SDPA's"
    else:
        what = "a question-answering head scores every position of a row, padding included"
        fix = ("pad on the left (tokenizer.padding_side = 'left'; run_qa.py then puts the context first), or train "
               "with the model's own attention (--sparse_attention false)")
        reads = ("the start and end logits at the padding after a row's tokens differ from SDPA's, and so does the "
                 "loss of start_positions / end_positions (transformers' softmax over every position of the row; the "
                 "real tokens' logits are SDPA's)")
    decoder.__dict__[_NOTED] = True
    logger.warning(
        f"A head on sparse_cp reads padding otherwise than SDPA: {what}. sparse_cp gives a padding query after a "
        "row's tokens no attention (output 0, as flash_attention_2 does), where SDPA and eager attend it to the "
        f"row's tokens, so {reads}. For SDPA's: {fix}.")
