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

A question-answering head's loss also reads the padding after a row's tokens, and so does a sequence-classification
head whose pad_token_id is not the batch's padding: `pass_padding_rows_on` hands the attention calls the rows whose
padding the head reads, whose padding queries then attend to the row's tokens as SDPA's (with or without CP, under
every mode and sharding); so do every row's for a head of an architecture's own (one process: CP refuses such a head),
a model without a head (AutoModel; under CP too, in a loop of its own: `with_shard_padding_rows`) and where a decoder
layer does not hand the rows on (`with_padding_rows`). A language model's and a
token-classification head's padding queries get no attention (output 0, as flash_attention_2's): no loss reads them,
and they cost nothing.
"""

from __future__ import annotations

import functools

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
from .call_tokens import PerForward

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


# Set on the modules of a model whose head `pool_over_cp_group` hooks (`refuse_unpooled_head` reads it).
_POOLED = "_hf_sparse_cp_head_pooled_over_cp_group"


class _PoolingHandle:
    """What `pool_over_cp_group` returns: `remove()` takes its hook and its marks off."""

    def __init__(self, model: torch.nn.Module, handle: torch.utils.hooks.RemovableHandle) -> None:
        self.model, self.handle = model, handle

    def remove(self) -> None:
        self.handle.remove()
        for module in self.model.modules():
            module.__dict__.pop(_POOLED, None)


def pool_over_cp_group(model: torch.nn.Module) -> _PoolingHandle:
    """Make the sequence-classification or question-answering head of `model` (`BATCH_OUTPUT_HEADS`) compute the
    batch's outputs on every rank of a forward under context parallelism (see the module docstring); outside one it is
    untouched. Returns the handle whose `remove()` undoes it; the hook is a module-level function: the model still
    pickles."""
    base, head = base_model(model), model_head(model)
    hook = (functools.partial(_pooled_at_every_position, base.config) if head == SEQUENCE_CLASSIFICATION
            else _whole_sequence)
    handle = getattr(base, _HEAD_LAYERS[head]).register_forward_hook(hook)
    for module in base.modules():
        module.__dict__[_POOLED] = True
    return _PoolingHandle(base, handle)


# the heads whose loss or outputs may read a padding position (`pass_padding_rows_on`)
PADDING_READING_HEADS = (SEQUENCE_CLASSIFICATION, QUESTION_ANSWERING)
# The keyword under which the decoder of a model with such a head hands its attention calls the rows whose padding
# queries the head reads (bool [B], the whole batch's under CP), as `cp_shard` reaches them: through the decoder
# layers' keyword arguments (`pass_padding_rows_on`).
PADDING_ROWS_KWARG = "sparse_cp_padding_rows"
# Set on every module of the decoder of a model with such a head or a head `model_head` does not know
# (`mark_padding_read`), to the head (`OWN_HEAD` for the latter): its attention calls that come without the rows
# attend every row's padding queries (`with_padding_rows`).
_READS_PADDING = "_hf_sparse_cp_head_reads_padding"
OWN_HEAD = "a head of its architecture's own"


def mark_padding_read(decoder: torch.nn.Module, head: str | None) -> None:
    """Mark the modules of `decoder` (that of a model with a `head` of `PADDING_READING_HEADS`, or with a head of its
    architecture's own, `model_head` None, whose reading of padding is not known) for `with_padding_rows` and
    `refuse_unpooled_head`; `unmark_padding_read` undoes it."""
    for module in decoder.modules():
        module.__dict__[_READS_PADDING] = head or OWN_HEAD


def unmark_padding_read(decoder: torch.nn.Module) -> None:
    for module in decoder.modules():
        module.__dict__.pop(_READS_PADDING, None)


def with_padding_rows(module: torch.nn.Module, kwargs: dict, batch: int, device: torch.device) -> dict:
    """An attention call's keyword arguments, with every row under `PADDING_ROWS_KWARG` where the call of `module`, a
    layer of a model marked by `mark_padding_read`, came without the rows `pass_padding_rows_on` gives a decoder:
    that of a head of an architecture's own (GPT-2's, OPT's, GPT-NeoX's, Falcon's question-answering and
    sequence-classification heads: their padding queries got no attention, their logits at padding positions
    0.02-0.15 from SDPA's, tiny models in fp64), or of a decoder layer that does not hand its keyword arguments on to
    attention (StableLM's in transformers 5.25). Every row's padding queries then attend as SDPA's: exact, at the cost
    of the padding the rows would have spared."""
    if kwargs.get(PADDING_ROWS_KWARG) is not None or not module.__dict__.get(_READS_PADDING):
        return kwargs
    return {**kwargs, PADDING_ROWS_KWARG: every_row(batch, device)}


_EVERY_ROW = PerForward()


def every_row(batch: int, device: torch.device) -> torch.Tensor:
    """bool [batch], every row: one tensor per (batch, device) outside a trace, so that what the calls of a forward
    read of it back to the host (`call_tokens.padding_rows_once`, keyed by the tensor) is read once per forward, not
    once per layer."""
    if torch.compiler.is_compiling():
        return torch.ones(batch, dtype=torch.bool, device=device)
    return _EVERY_ROW.get((batch, device), (), lambda: torch.ones(batch, dtype=torch.bool, device=device))


def refuse_unpooled_head(module: torch.nn.Module) -> None:
    """Refuse a call of `module` on a CP shard where it is a layer of a model with a head of `BATCH_OUTPUT_HEADS`
    (`mark_padding_read`) that is not pooled over the CP group (`pool_over_cp_group`, which the Trainer's CP steps
    hook): in a loop of one's own over `prepare_context_parallel_inputs` each rank's pooled logits, or start and end
    logits, were its shard's, not the row's (tiny Mistral, fp64, CP 2: rank 0's pooled logits 0.68 from SDPA's),
    without a word."""
    head = module.__dict__.get(_READS_PADDING)
    if head in BATCH_OUTPUT_HEADS and not module.__dict__.get(_POOLED):
        outputs = "pooled logits" if head == SEQUENCE_CLASSIFICATION else "start and end logits"
        raise ValueError(
            f"A model with a {head} head runs on a context-parallel shard outside the Trainer's CP steps (a loop of "
            f"its own over prepare_context_parallel_inputs): its {outputs} and their loss would be each rank's "
            "shard's, not the row's, as the Trainer's steps make them (they pool the head over the CP group). Train "
            "it with transformers' Trainer and --cp_size, or without context parallelism.")


def with_shard_padding_rows(module: torch.nn.Module, shard, batch: int, device: torch.device) -> None:
    """`with_padding_rows` under CP: where the call of `module`, a layer of a model marked by `mark_padding_read`,
    runs on a CP shard to which no pre-hook gave the rows (`pass_padding_rows_on`: a model without a head, AutoModel,
    in a loop of its own over `prepare_context_parallel_inputs`), every row's padding queries attend as SDPA's
    (`CPShard.padding_queries`), as in one process. Before, they got no attention under CP only: the hidden states
    at padding positions 2.09 from SDPA's (tiny Llama, fp64, CP 2, every block kept), unsaid."""
    if getattr(shard, "padding_rows", False) is None and module.__dict__.get(_READS_PADDING):  # (a CPShard)
        shard.padding_rows = every_row(batch, device)


def padding_rows_read(head: str, attention_mask: torch.Tensor, input_ids: torch.Tensor | None,
                      pad_token_id: int | None) -> torch.Tensor:
    """bool [B]: the rows of a batch with the 2D padding mask `attention_mask` [B, S] whose padding positions a head of
    `PADDING_READING_HEADS` reads: every row for a question-answering head (its loss is a softmax over every position
    of the row); for a sequence-classification head the rows whose pooled token (`last_token_positions`, by the
    batch's `input_ids` and the config's `pad_token_id`) is padding by the mask (the batch pads with another token than
    pad_token_id, or comes as inputs_embeds, whose last position is pooled). Reads nothing back to the host."""
    batch, seq_len = attention_mask.shape
    if head == QUESTION_ANSWERING:
        return torch.ones(batch, dtype=torch.bool, device=attention_mask.device)
    pooled = last_token_positions(input_ids, pad_token_id, batch, seq_len, attention_mask.device)
    return ~attention_mask.bool().gather(1, pooled[:, None]).squeeze(1)


def pass_padding_rows_on(head: str, decoder: torch.nn.Module, args, kwargs):
    """Forward pre-hook (with kwargs, `head` bound) on the decoder of a model with a head of `PADDING_READING_HEADS`
    (`registration.guard_registration`): where it runs on sparse_cp with a 2D padding mask (the whole batch's under
    CP: the shard's mask and input_ids), the rows whose padding the head reads (`padding_rows_read`) go on to the
    attention calls under `PADDING_ROWS_KWARG`, which attend those rows' padding queries after their tokens to the
    tokens before them, as SDPA and eager do (`sequence.sequence_attention`); transformers' flash_attention_2 gives
    them no attention, as sparse_cp does for a language model's or token-classification head's, whose loss reads no
    padding position (-100 labels), so that their padding costs nothing. Without it a question-answering loss differed
    from SDPA's (tiny Llama, fp64, every block kept, a row padded from 60 of 80 tokens: 4.3380 against 4.3491), and so
    did the pooled logits of a sequence-classification head that pools a padding position (0.16 from SDPA's).
    Keyword arguments reach the layers' gradient-checkpoint recomputation as well."""
    if kwargs.get(PADDING_ROWS_KWARG) is not None or upstream.attn_implementation(decoder.config) != BACKEND_NAME:
        return None
    shard = kwargs.get(CP_SHARD_KWARG)  # (a CP shard, or a probe in its place: no mask)
    mask = kwargs.get("attention_mask") if shard is None else getattr(shard, "attention_mask", None)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2:
        return None
    ids = kwargs.get("input_ids", args[0] if args else None) if shard is None else getattr(shard, "input_ids", None)
    rows = padding_rows_read(head, mask, ids, decoder.config.get_text_config().pad_token_id)
    if shard is None:
        return args, {**kwargs, PADDING_ROWS_KWARG: rows}
    shard.padding_rows = rows  # (the batch's: every rank's modes read them from the shard, `CPShard.padding_queries`)
    return None
