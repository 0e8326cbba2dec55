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
or without CP): `note_padded_answer_scores` says so once.
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


# set on a decoder whose padded answer scores were noted (`note_padded_answer_scores`)
_NOTED = "_hf_sparse_cp_padded_answers_noted"


def ends_in_padding(attention_mask: torch.Tensor) -> bool:
    """Whether a row of the 2D padding mask [B, S] has padding after its last token, and none pads between two tokens
    (a call with such a gap attends every key, its padding queries as SDPA's: `call_tokens.every_key_call`)."""
    real = attention_mask.bool()
    if (real[:, 1:] & ~real[:, :-1]).sum(-1).add(real[:, 0]).gt(1).any():  # (a gap: `tokens.padding_between_tokens`)
        return False
    return bool((real.any(-1) & ~real[:, -1]).any())


def note_padded_answer_scores(decoder: torch.nn.Module, args, kwargs) -> None:
    """Forward pre-hook (with kwargs) on the decoder of a question-answering model (`registration.guard_registration`):
    the first forward on sparse_cp whose batch (the whole batch under CP: the shard's mask) ends a row in padding logs
    once per decoder that its start and end logits there differ from SDPA's. sparse_cp gives a padding query after a
    row's tokens no attention (its output 0, as transformers' flash_attention_2 does), where SDPA and eager attend it
    to the row's tokens; a language model's or classification head's loss reads no padding position (-100 labels, the
    last real token pooled), but transformers' question-answering loss takes a softmax over every position of the row
    (tiny Llama, fp64, every block kept, a row padded from 60 of 80 tokens: loss 4.3380 against SDPA's 4.3491). Left
    padding gives SDPA's logits and loss: its padding sees no token under either."""
    if decoder.__dict__.get(_NOTED) or upstream.attn_implementation(decoder.config) != BACKEND_NAME:
        return
    shard = kwargs.get(CP_SHARD_KWARG)  # (a CP shard, or a probe in its place: no mask)
    mask = kwargs.get("attention_mask") if shard is None else getattr(shard, "attention_mask", None)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or not ends_in_padding(mask):
        return
    decoder.__dict__[_NOTED] = True
    logger.warning(
        "A question-answering head on sparse_cp scores padding after a row's tokens otherwise than SDPA: sparse_cp "
        "gives such a padding query no attention (output 0, as flash_attention_2 does), where SDPA and eager attend "
        "it to the row's tokens, so the start and end logits at those positions differ from SDPA's, and so does the "
        "loss of start_positions / end_positions (transformers' softmax over every position of the row; the real "
        "tokens' logits are SDPA's). For SDPA's logits and loss, pad on the left (tokenizer.padding_side = 'left'; "
        "run_qa.py then puts the context first), or train with the model's own attention (--sparse_attention false).")
