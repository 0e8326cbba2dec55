"""What an attention call asks that sparse_cp does not compute, each refused naming the model type and the fix:
attention dropout, soft-capping and unsupported keywords (`unsupported_feature`, `refuse_unsupported`),
cross-attention and bidirectional layers, keys a layer makes itself (`own_keys_refusal`), a window or chunk only the
mask carries (`masked_locality`, `refuse_masked_locality`), position rows CP cannot pack by (`positions_refusal`)
and attention weights (`refuse_attention_weights`). A probe forward records the same refusals before training
(`models.check_model_supports_context_parallel`)."""

from __future__ import annotations

import numbers
from collections.abc import Callable

import torch

from ..attention.sinks import sink_shape_error
from ..distributed.shard import CPShard
from .architectures import ATTENTION_LAYER_TYPES, CONFIG_DROPOUTS
from .call_tokens import (
    builds_sliding_window_mask,
    cache_key_length,
    cache_tokens_held,
    is_bidirectional_mask,
    mask_window,
)
from .composite import tower_refusal
from .layer_settings import layer_settings_refusal

# The attributes attention layers copy their config's attention dropout (`architectures.CONFIG_DROPOUTS`) into when
# they are built (what they pass as `dropout` while training).
MODULE_DROPOUTS = ("attention_dropout", "attn_dropout", "dropout", "dropout_p", "dropout_prob", "attn_drop")


def dropout_probability(owner, name: str) -> float | None:
    """The dropout probability `owner.name` holds (a number, or an `nn.Dropout`'s p), or None."""
    value = getattr(owner, name, None)
    value = value.p if isinstance(value, torch.nn.Dropout) else value
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def config_dropout(config) -> tuple[str, float] | None:
    """(field, value) of the first attention-dropout field of a transformers config above 0, or None."""
    for name in CONFIG_DROPOUTS:
        value = dropout_probability(config, name)
        if value:
            return name, value
    return None


def dropout_fix(config, context_parallel: bool = False) -> str:
    """How to train without attention dropout: build the model with its config's field at 0 (its attention layers
    copy the value when they are built, so a change of `model.config` afterwards does not reach them); dense
    attention, the other fix, `context_parallel` runs without CP (whose ring needs the sparse backend)."""
    found = config_dropout(config) if config is not None else None
    field = found[0] if found else next((n for n in CONFIG_DROPOUTS if hasattr(config, n)), "attention_dropout")
    return (f"build the model with {field}=0.0 (e.g. from_pretrained(..., {field}=0.0), or its config's {field} set "
            f"to 0.0 before from_config): its attention layers copy the value when they are built, so setting "
            f"model.config.{field} afterwards does not reach them. Or train with dense attention (--sparse_attention "
            f"false{', without --cp_size' if context_parallel else ''}).")


def _layer_type(module: torch.nn.Module) -> str | None:
    """The layer's entry of `config.layer_types` ('sliding_attention', 'chunked_attention', ...), or None."""
    config = getattr(module, "config", None)
    types, layer = getattr(config, "layer_types", None) or (), getattr(module, "layer_idx", None)
    return types[layer] if isinstance(layer, int) and 0 <= layer < len(types) else None


def mask_only_window(module: torch.nn.Module, sliding_window: int | None,
                     attention_mask: torch.Tensor | None = None) -> tuple[int | None, int | None]:
    """The sliding window of a layer whose model builds it into the attention mask (which sparse_cp does not use)
    without passing it to the attention function, e.g. Qwen2-MoE, PhiMoE: (window, None) for a layer that
    `config.layer_types` declares 'sliding_attention' (the mask holds `config.sliding_window`, as transformers'
    `create_sliding_window_causal_mask` builds it); (None, its size) when the config has a window and no layer types,
    so that which layers use it is the model's own code; (sliding_window, None) otherwise.

    A family whose modeling code never builds a sliding-window mask (`call_tokens.builds_sliding_window_mask`: a Llama
    or GPT-2 config that carries the field) attends past the field in its own forward (SDPA does), and was refused for
    documents longer than it; only transformers' `generate` builds its window into the mask there (for a StaticCache;
    a DynamicCache's sliding layers hold the window's keys alone): such a call gets (the window of `attention_mask`,
    `call_tokens.mask_window`, or None; None), computed as SDPA computes it. So does one whose attention passes the
    field on while its mask never holds it (OLMoE's: SDPA and eager attend past the window, which only
    flash-attention applies; sparse_cp applied it, 27% from SDPA's logits). Under torch.compile, where the mask is not
    read, (None, its size) as before."""
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return sliding_window, None
    typed = getattr(config, "layer_types", None) is not None
    never_masked = not typed and builds_sliding_window_mask(config) is False
    if sliding_window is not None and not (never_masked and sliding_window == window):
        return sliding_window, None
    if not typed:
        if never_masked and not torch.compiler.is_compiling():
            return mask_window(attention_mask), None
        return None, window
    return (window, None) if _layer_type(module) == "sliding_attention" else (None, None)


def masked_locality(module: torch.nn.Module, unseen_window: int | None) -> tuple[str, int] | None:
    """('chunk', size) for a layer that `config.layer_types` declares 'chunked_attention' (Llama 4: its chunks of
    `config.attention_chunk_size` tokens are in its attention mask only), ('window', size) for the window
    `mask_only_window` found unseen, else None: what sparse_cp cannot apply to this layer."""
    chunk = getattr(getattr(module, "config", None), "attention_chunk_size", None)
    if (_layer_type(module) == "chunked_attention" and isinstance(chunk, int) and not isinstance(chunk, bool)
            and chunk > 0):
        return "chunk", chunk
    return ("window", unseen_window) if unseen_window is not None else None


def locality_refusal(module: torch.nn.Module, locality: tuple[str, int], what: str, fix: str) -> ValueError:
    """The error for `what` (e.g. 'a document of 9000 tokens') in a layer whose window or chunk (`masked_locality`)
    only its attention mask carries, naming `fix` ahead of the dense implementations."""
    config = getattr(module, "config", None)
    model_type = getattr(config, "model_type", type(module).__name__)
    kind, size = locality
    dense = "load the model with attn_implementation='sdpa' or 'eager' (--sparse_attention false)."
    if kind == "chunk":
        return ValueError(
            f"sparse_cp does not implement chunked attention (layer {getattr(module, 'layer_idx', '?')} of model type "
            f"'{model_type}' attends within chunks of attention_chunk_size={size} tokens, which its attention mask "
            f"carries and sparse_cp does not use), and {what}: {fix}, or {dense}")
    if builds_sliding_window_mask(config) is False:  # (under torch.compile only: `mask_only_window`)
        return ValueError(
            f"{type(module).__name__} of model type '{model_type}' has config.sliding_window={size}, which its own "
            "forward attends past (SDPA does; only generate's masks may hold it), and under torch.compile sparse_cp "
            f"does not read the mask that says which, and {what}. {fix[:1].upper()}{fix[1:]}, run it without "
            f"torch.compile, or {dense}")
    return ValueError(
        f"{type(module).__name__} of model type '{model_type}' puts its sliding window (config.sliding_window={size}) "
        "into the attention mask only, without passing it to the attention function, and config.layer_types does "
        f"not say which layers use it; sparse_cp does not use that mask, so it cannot apply the window, and {what}. "
        f"{fix[:1].upper()}{fix[1:]}, or {dense}")


def refuse_masked_locality(module: torch.nn.Module, unseen_window: int | None, length: int,
                            extents: Callable[[], torch.Tensor] | None, attention_mask: torch.Tensor | None) -> None:
    """Refuse a call in which a query would see a key of its own document that the window or chunk the model put
    into its attention mask only (`masked_locality`) hides: sparse_cp gets the 2D padding mask, so it would attend
    past them. `length`: the keys of the call (its padded length under CP); `extents`: the least and greatest
    position of each document (`tokens.document_extents`), None where unknown (the length is checked). Through a KV
    cache, a chunk is checked on the tokens the cache holds with the queries (`call_tokens.cache_tokens_held`): a
    sliding cache of a chunked layer holds fewer keys than a chunk, but they may lie in the chunk before the
    queries' (transformers refuses flash-attention so)."""
    locality = masked_locality(module, unseen_window)
    if locality is not None and locality[0] == "chunk" and extents is None:
        length = max(length, cache_tokens_held(attention_mask) or 0)
    if locality is None or length <= locality[1]:
        return
    kind, size = locality
    if extents is None:
        through_cache = cache_key_length(attention_mask) is not None
        raise locality_refusal(
            module, locality, f"this call spans {length} tokens{' (through a KV cache)' if through_cache else ''}",
            f"keep the prompt and the generated tokens to at most {size} tokens" if through_cache else
            f"train sequences of at most {size} tokens")
    low, high = extents().unbind(-1)
    longest = int((high - low + 1).max()) if low.numel() else 0
    if longest > size:
        raise locality_refusal(module, locality, f"this call has a document of {longest} tokens",
                               f"train documents of at most {size} tokens")
    if kind == "chunk":
        crossing = (low // size != high // size).nonzero()
        if crossing.numel():
            i = int(crossing[0, 0])
            raise locality_refusal(
                module, locality, f"this call has a document at positions {int(low[i])}..{int(high[i])}, across a "
                f"chunk boundary (chunks follow position_ids)", f"give each document position_ids from 0 and at most "
                f"{size} tokens")


# Keyword arguments of transformers' attention calls that change what attention computes, which sparse_cp does not
# implement (a call that carries one is refused rather than computed without it).
# (`s_aux`, the learned sinks of GPT-OSS and others, is computed: `attention.sinks`; Inkling 2's are per token.)
_UNSUPPORTED_KWARGS = {
    "sinks": "learned attention sinks per token",  # Inkling 2
    "position_bias": "an additive bias on the attention logits",  # Inkling's relative logits, T5-style models
    "indices": "a selection of key indices per query",  # DeepSeek-V3.2's sparse attention (DSA)
    "block_indices": "a selection of key blocks per query",
}


# The names transformers gives a decoder layer's cross-attention module (BART, Marian, Pegasus, Whisper and their kin:
# `encoder_attn`; BERT-style decoders: `crossattention`), which a forward without encoder states never calls.
CROSS_ATTENTION_NAMES = ("encoder_attn", "crossattention", "cross_attn", "cross_attention")


def _decoder_attention_built_non_causal(module: torch.nn.Module) -> bool:
    """Whether `module` is a decoder's attention built with `is_causal=False` and nothing else says it is
    cross-attention: BART's `encoder_attn`, or BigBird-Pegasus's decoder self-attention (built so, causal by the
    mask its eager attention reads)."""
    return (getattr(module, "is_decoder", False) and getattr(module, "is_causal", True) is False
            and not getattr(module, "is_cross_attention", False) and "CrossAttention" not in type(module).__name__)


def is_cross_attention(module: torch.nn.Module, name: str = "") -> bool:
    """Whether `module` (called `name` in its model, where known) is a cross-attention layer: its `is_cross_attention`
    (Mllama's) or class name says so, it is a decoder's attention built non-causal
    (`_decoder_attention_built_non_causal`: a call tells BART's `encoder_attn` from BigBird-Pegasus's self-attention
    by its mask), or `name` passes through one of `CROSS_ATTENTION_NAMES`."""
    return (getattr(module, "is_cross_attention", False) or "CrossAttention" in type(module).__name__
            or _decoder_attention_built_non_causal(module)
            or any(part in CROSS_ATTENTION_NAMES for part in name.split(".")))


def unsupported_feature(module: torch.nn.Module, softcap, kwargs, heads: int, attention_mask=None) -> str | None:
    """What a call of `module` with `heads` query heads asks of attention that sparse_cp does not implement (the
    sentence of its refusal, naming the model type and the fix), or None: soft-capping, a keyword of
    `_UNSUPPORTED_KWARGS`, learned sinks (`s_aux`) of another shape than one per query head or in a layer whose
    `config.layer_types` entry is not a plain attention layer (DeepSeek-V4's compressed layers append keys of their
    own making, which sparse_cp would take for a KV cache), a layer of a composite model's vision or audio tower
    (`composite.tower_key`), a cross-attention layer (`is_cross_attention`: Mllama's, BART's
    `encoder_attn`; a decoder's attention built non-causal is cross-attention where `attention_mask` is the encoder's,
    transformers' bidirectional one, else a self-attention that only its mask makes causal), or a bidirectional
    layer (the module's `is_causal`, or
    `is_causal=False` passed to the call). A probe forward records it (`ProbedCall.unsupported`), so that the model
    checks refuse it before training."""
    model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    if softcap is not None:
        return (f"sparse_cp does not implement attention logit soft-capping (softcap={softcap}, model type "
                f"'{model_type}'); load this model with attn_implementation='eager', which computes it "
                "(--sparse_attention false; SDPA does not soft-cap).")
    found = next(((name, what) for name, what in _UNSUPPORTED_KWARGS.items() if kwargs.get(name) is not None), None)
    sinks, layer_type = kwargs.get("s_aux"), _layer_type(module)
    if sinks is not None and layer_type not in (None, *ATTENTION_LAYER_TYPES):
        found = "s_aux", (f"learned attention sinks in a layer of type '{layer_type}' (it computes them in "
                          f"{', '.join(ATTENTION_LAYER_TYPES)} layers)")
    elif sinks is not None and sink_shape_error(sinks, heads):
        found = "s_aux", sink_shape_error(sinks, heads)
    if found:
        name, what = found
        return (f"sparse_cp does not implement {what} ({name}, model type '{model_type}'); load this model with "
                "attn_implementation='eager' (--sparse_attention false).")
    tower = tower_refusal(getattr(module, "config", None), f"this layer ({type(module).__name__}, model type "
                                                            f"'{model_type}')")
    if tower:  # (a composite model switched whole: `composite.backend_selection` keeps it out)
        return tower
    if _decoder_attention_built_non_causal(module) and not is_bidirectional_mask(attention_mask):
        return (f"sparse_cp only computes causal self-attention, but this layer ({type(module).__name__}) of model "
                f"type '{model_type}' is a decoder's self-attention built with is_causal=False (called without an "
                "encoder's mask): only the causal mask that eager attention reads makes it causal, and sparse_cp "
                "takes a layer built with is_causal=False for a bidirectional one. Load the model with "
                "attn_implementation='eager' (--sparse_attention false).")
    if is_cross_attention(module):
        return (f"sparse_cp only computes causal self-attention, but this layer ({type(module).__name__}) of model "
                f"type '{model_type}' is cross-attention: its queries attend to the keys of another sequence (an "
                "image's features, an encoder's output). Load the model with attn_implementation='sdpa' "
                "(--sparse_attention false), or train it on batches without the cross-attention inputs (images, "
                "encoder_hidden_states: its text-only, decoder-only forward skips those layers).")
    if not getattr(module, "is_causal", True) or kwargs.get("is_causal") is False:
        return (f"sparse_cp only computes causal self-attention, but this layer ({type(module).__name__}) of model "
                f"type '{model_type}' is bidirectional; use attn_implementation='sdpa' for it (--sparse_attention "
                "false).")
    return None


def own_keys_refusal(module: torch.nn.Module, q_len: int, k_len: int, attention_mask, under_cp: bool) -> str | None:
    """The refusal of a call with more (or fewer) keys than queries that no KV cache explains, or None. sparse_cp reads
    the keys beyond the queries as the earlier tokens a transformers Cache holds (decoding, a chunk of prefill, PEFT's
    prefix tuning), placed before the queries; it knows a cache call by the mask its mask function built for the
    cache's key length (`call_tokens.cache_key_length`). Keys a layer makes itself without a Cache (memory tokens,
    learned register keys, compressed keys) have no place it could know, so their attention would be computed with
    a guessed alignment; under context parallelism no call goes through a cache."""
    cached = None if under_cp else cache_key_length(attention_mask)
    if k_len == q_len or k_len == cached:
        return None
    model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    source = ("the call is under context parallelism, where there is no KV cache" if under_cp else
              "no KV cache of this forward gives them" if cached is None else
              f"this forward's KV cache gives {cached}")
    return (f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}, model type '{model_type}') handed "
            f"sparse_cp {k_len} keys for {q_len} queries, but {source}: the layer adds keys of its own (memory tokens, "
            "learned or compressed keys), and sparse_cp only places keys beyond the queries as a transformers Cache's "
            "earlier tokens (pass past keys as a Cache: cache= / past_key_values=). Load this model with "
            "attn_implementation='sdpa' or 'eager' (--sparse_attention false).")


def positions_refusal(module: torch.nn.Module, shard: CPShard, kwargs) -> str | None:
    """The refusal of a call under CP whose layer hands it `position_ids=None` or multimodal RoPE rows [R, B, S] while
    the batch packs documents by its [B, S] position_ids (`CPShard.packed_by_positions`), or None: such a model expands
    them to its rotary rows without packing by them (Qwen2-VL's and GLM-4V's text models attend across their restarts,
    as one process then does: `with_forward_positions`), but the batch was split into those documents."""
    call = kwargs.get("position_ids")
    if not shard.packed_by_positions or "position_ids" not in kwargs or (call is not None and call.dim() <= 2):
        return None
    model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    return (f"{type(module).__name__} (model type '{model_type}') gets "
            f"{'position_ids=None' if call is None else f'multimodal RoPE position_ids of {call.dim()} dimensions'} "
            "from its layer: the model expands the batch's restarting [batch, seq] position_ids to its RoPE rows and "
            "does not pack documents by them (its mask attends across them; it packs by the text row of "
            "[4, batch, seq] position_ids only), but context parallelism split the batch into those documents. Pass "
            "position_ids of shape [4, batch, seq] with the text positions first to pack documents, or flattened "
            "packing's cu_seq_lens (DataCollatorWithFlattening(return_flash_attn_kwargs=True)), or position_ids that "
            "do not restart.")


def _same_value(held: float | None, dropout) -> bool:
    """Whether a module's dropout probability `held` is the call's `dropout`, NaN included."""
    return held is not None and (held == dropout or (held != held and dropout != dropout))


def refuse_unsupported(module: torch.nn.Module, dropout: float, softcap, attention_mask, kwargs, heads: int
                        ) -> None:
    model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
    if attention_mask is not None and not isinstance(attention_mask, torch.Tensor):
        raise TypeError(f"sparse_cp takes attention_mask as a 2D padding mask tensor [batch, seq] or None, not "
                        f"{type(attention_mask).__name__} {attention_mask!r:.60} (model type '{model_type}').")
    # (a probability outside [0, 1) is refused as such: NaN passed `dropout > 0` as no dropout, and so did -0.1)
    improbable = isinstance(dropout, numbers.Real) and not 0 <= dropout < 1
    if improbable or (dropout and dropout > 0):
        held = [f"{type(module).__name__}.{name}" for name in MODULE_DROPOUTS
                if _same_value(dropout_probability(module, name), dropout)]
        got = f"dropout={dropout}{f' from {held[0]}' if held else ''} for model type '{model_type}'"
        fix = dropout_fix(getattr(module, "config", None))
        raise ValueError(f"attention {got} is no dropout probability (a number in [0, 1), 0.0 for none): {fix}"
                         if improbable else f"sparse_cp does not implement attention dropout (got {got}); {fix}")
    unsupported = unsupported_feature(module, softcap, kwargs, heads, attention_mask)
    if unsupported:
        raise ValueError(unsupported)
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError(
            f"sparse_cp received a {attention_mask.dim()}D attention mask (model type '{model_type}'); it takes the 2D "
            "padding mask that its registered mask function produces. A model that builds its own mask (LayoutLM's, "
            "MarkupLM's) cannot run on it: load it with attn_implementation='sdpa' or 'eager' (--sparse_attention "
            "false). Otherwise pass the 2D padding mask rather than a custom 4D one (documents packed in a row: "
            "position_ids restarting at 0 at each document's first token, as DataCollatorWithFlattening gives them, "
            "not a block-diagonal mask; a 2D mask alone would let them attend to each other), and call "
            "hf_sparse_cp.patch() before building the model."
        )
    refusal = layer_settings_refusal(module)  # (last: a layer refused above cannot run whatever its settings)
    if refusal:
        raise ValueError(refusal)


def refuse_attention_weights(module: torch.nn.Module, kwargs) -> None:
    """Refuse `output_attentions=True`: sparse_cp never forms the attention weights (the model would return an empty
    tuple of them)."""
    if kwargs.get("output_attentions"):
        model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
        raise ValueError(
            f"sparse_cp does not compute attention weights (output_attentions=True, model type '{model_type}'); for "
            "them, switch the model to eager attention first: model.set_attn_implementation('eager') (and back with "
            "model.set_attn_implementation('sparse_cp')).")
