"""The `sparse_cp` attention function, as transformers calls it.

transformers passes q, k, v as [B, H, S, D] with key/value heads not expanded, plus keyword
arguments that describe packing (`position_ids`, `cu_seq_lens_k`) and the layer (`sliding_window`,
`softcap`, ...). This module turns those into `TokenMeta`, estimates the layout for the layer and
runs exact attention restricted to it (`hf_sparse_cp.attention`). It never sees or builds a [S, S]
mask.

Calls that run dense (dense or sliding-window layers, batches without a long document) go to
flash-attn where it is installed, or to SDPA for plain causal rows (`hf_sparse_cp.attention.dense`).

Under context parallelism the inputs carry a `CPShard` (keyword `cp_shard`, added by
`hf_sparse_cp.distributed.prepare_context_parallel_inputs`): q, k, v are then this rank's part of the
sequence, and the layer runs as the CP group's mode shares it
(`hf_sparse_cp.distributed.context_parallel_attention`).
"""

from __future__ import annotations

import contextlib
import math
import numbers
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import NamedTuple

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..attention.layout import check_dims, check_scale
from ..attention.ops import block_sparse_attention
from ..attention.precision import autocast_inputs
from ..attention.sequence import sequence_attention
from ..attention.sinks import sink_shape_error, with_sinks
from ..attention.tokens import (
    BatchDocumentExtents,
    packing_positions,
)
from ..config import BACKEND_NAME, MODEL_CONFIG_ATTRIBUTE, SparseAttentionConfig, pattern_holders
from ..distributed.modes import context_parallel_attention
from ..distributed.shard import CP_SHARD_KWARG, CPShard
from .architectures import ATTENTION_LAYER_TYPES, CONFIG_DROPOUTS, length_counted_query_scales, moved_query_scales
from .call_tokens import (
    NonCausalMask,
    PerForward,
    batch_token_meta,
    cache_key_length,
    cache_tokens_held,
    every_key_call,
    is_bidirectional_mask,
    padding_between_tokens_once,
)
from .compiled import layer_key, settings_key, traced_attention, traced_call, traced_setting
from .composite import tower_refusal
from .stats import pop_kept_fractions, record_kept_fraction

_LAYER_CONFIG = "_hf_sparse_cp_layer_config"
_LAYER_REFUSAL = "_hf_sparse_cp_layer_refusal"  # (why the parsed layer config is not its layer's: `parsed_layer`)
_GUARD_TOKENS = "_hf_sparse_cp_cp_forward"

# The CP shard of the model forward under context parallelism in progress, None outside one (see
# `guard_context_parallel`).
_CP_FORWARD: ContextVar = ContextVar("hf_sparse_cp_cp_forward", default=None)


def is_registered() -> bool:
    """Whether transformers knows `attn_implementation="sparse_cp"` (by `patch()`, or anyone's registration)."""
    return BACKEND_NAME in AttentionInterface() and BACKEND_NAME in AttentionMaskInterface()


class ProbedCall(NamedTuple):
    """One attention call of a probe forward: the attention module, whether the probe arrived in place of
    the CP shard, the dimensions of the mask it got (None: none; the registered mask function gives
    None or the 2D padding mask, so anything else is a mask the model built itself), the sliding window it
    passed and what it asked that sparse_cp does not implement (`unsupported_feature`)."""

    module: torch.nn.Module
    reached: bool
    mask_dims: int | None
    sliding_window: int | None = None
    unsupported: str | None = None


class AttentionProbe:
    """Stands in for the CP shard in a probe forward (`models.check_attention_routed`,
    `models.check_model_supports_context_parallel`): the backend records every attention call
    (`ProbedCall`) and returns zeros."""

    def __init__(self) -> None:
        self.calls: list[ProbedCall] = []


_PROBE: ContextVar[AttentionProbe | None] = ContextVar("hf_sparse_cp_probe", default=None)

# How many probes and forwards under context parallelism are in progress in this process (the context variables
# above, counted): while any is, calls inside a trace go outside the graph, where those are read. A trace guards on
# this global's value (reading a context variable would break the graph).
_IN_PROGRESS = {"probes and CP forwards": 0}


def _count_in_progress(change: int) -> None:
    _IN_PROGRESS["probes and CP forwards"] += change


@contextlib.contextmanager
def probing(probe: AttentionProbe) -> Iterator[None]:
    """Attention calls inside the block go to `probe` instead of computing."""
    token = _PROBE.set(probe)
    _count_in_progress(1)
    try:
        yield
    finally:
        _count_in_progress(-1)
        _PROBE.reset(token)


def guard_context_parallel(model: torch.nn.Module) -> list:
    """Make an attention call that arrives without the CP shard an error while a forward of `model`
    with the shard runs: such a call would attend within this rank's shard only. Returns the hook
    handles (remove them to undo). The hooks are module-level functions: the model still pickles."""
    return [model.register_forward_pre_hook(_enter_cp_forward, with_kwargs=True),
            model.register_forward_hook(_leave_cp_forward, with_kwargs=True, always_call=True)]


# How many forwards with the CP shard began in this process (`cp_forwards_begun`).
_BEGUN = [0]


def cp_forwards_begun() -> int:
    """How many forwards of a model `guard_context_parallel` hooks began with the CP shard in this process so far."""
    return _BEGUN[0]


def _enter_cp_forward(module: torch.nn.Module, args, kwargs) -> None:
    if kwargs.get(CP_SHARD_KWARG) is not None:
        _BEGUN[0] += 1
        module.__dict__.setdefault(_GUARD_TOKENS, []).append(_CP_FORWARD.set(kwargs[CP_SHARD_KWARG]))
        _count_in_progress(1)


def _leave_cp_forward(module: torch.nn.Module, args, kwargs, output) -> None:
    tokens = module.__dict__.get(_GUARD_TOKENS)
    if tokens and kwargs.get(CP_SHARD_KWARG) is not None:
        _CP_FORWARD.reset(tokens.pop())
        _count_in_progress(-1)
        if not tokens:  # (the outermost forward: nothing stays on the module)
            del module.__dict__[_GUARD_TOKENS]


def cp_forward_shard():
    """The `CPShard` of the forward under context parallelism in progress of a model `guard_context_parallel` hooks,
    or None outside one."""
    return _CP_FORWARD.get()


# The keyword under which a configured model's forward passes its `position_ids` on to the attention calls
# (`pass_positions_on`), as `cp_shard` reaches them: through the decoder layers' keyword arguments.
POSITIONS_KWARG = "sparse_cp_position_ids"


def pass_positions_on(module: torch.nn.Module, args, kwargs):
    """Forward pre-hook (with kwargs) of a configured model: its `position_ids` (given without an attention mask, where
    they pack documents) go on to the attention calls under `POSITIONS_KWARG` too. Some decoder layers keep
    `position_ids` from their attention call (Llama 4's: only its mask packs documents by them), which would then
    attend across the documents. Keyword arguments reach the layers' gradient-checkpoint recomputation as well."""
    positions = kwargs.get("position_ids")
    if (positions is None or kwargs.get("attention_mask") is not None or kwargs.get(POSITIONS_KWARG) is not None
            or kwargs.get(CP_SHARD_KWARG) is not None):
        return None
    return args, {**kwargs, POSITIONS_KWARG: positions}


_TEXT_ROWS = PerForward()


def with_forward_positions(kwargs: dict, seq_len: int) -> dict:
    """An attention call's keyword arguments, with the model forward's `position_ids` (`pass_positions_on`) where the
    call got neither them nor `cu_seq_lens_k` and they are one per token ([B or 1, seq_len] or [seq_len]). A call
    that carries `position_ids=None` is left as it is: its layer was told there are none, and so was the model's mask
    (Qwen2-VL's text model hands its layers and `create_causal_mask` the text row of [4, B, S] positions only, None
    for 2D ones, which it expands to its three RoPE rows: transformers does not pack documents by those). A call
    that carries multimodal RoPE rows [R, B, S] takes the documents of the forward's [R', B, S] ones
    (`tokens.packing_positions`): GLM-4V's text model hands its mask the text row of [4, B, S] positions and its
    layers the three rows after it."""
    positions, call = kwargs.get(POSITIONS_KWARG), kwargs.get("position_ids")
    if positions is None or kwargs.get("cu_seq_lens_k") is not None or positions.shape[-1] != seq_len:
        return kwargs
    if call is not None and call.dim() > 2 and positions.dim() > 2:  # (one text row object per forward: its
        # documents are then read back once, `batch_token_meta`)
        return {**kwargs, "position_ids": _TEXT_ROWS.get((), (positions,), lambda: packing_positions(positions))}
    if "position_ids" in kwargs or positions.dim() > 2:
        return kwargs
    return {**kwargs, "position_ids": positions if positions.dim() == 2 else positions[None]}


def model_config_for(module: torch.nn.Module) -> SparseAttentionConfig:
    """The sparse config stored on the module's model config (see `hf_sparse_cp.configure`), or the default."""
    return SparseAttentionConfig.stored_on(getattr(module, "config", None)) or SparseAttentionConfig()


def layer_config(module: torch.nn.Module) -> SparseAttentionConfig:
    """The config of this attention layer (`for_layer` of its model's config), parsed once and kept on
    the module for as long as the model config holds the same settings object (`parsed_layer`)."""
    return parsed_layer(module)[1]


def parsed_layer(module: torch.nn.Module) -> tuple:
    """(the model config's settings object, the layer's config, its `compiled.settings_key`, the module's
    `compiled.layer_key`, the module's id), parsed where `fresh_parsed_layer` finds none and kept on the module: a
    traced call reads these rather than parse them inside the trace."""
    cached = fresh_parsed_layer(module)
    if cached is None:
        model_cfg, layer_idx = model_config_for(module), getattr(module, "layer_idx", None)
        cfg = model_cfg.for_layer(layer_idx)
        raw = getattr(getattr(module, "config", None), MODEL_CONFIG_ATTRIBUTE, None)
        cached = (raw, cfg, settings_key(cfg), layer_key(module), id(module))
        module.__dict__[_LAYER_CONFIG] = cached
        module.__dict__[_LAYER_REFUSAL] = None if layer_idx is not None else _layerless_refusal(module, model_cfg)
    return cached


def _layerless_refusal(module: torch.nn.Module, model_cfg: SparseAttentionConfig) -> str | None:
    """Why a module without `layer_idx` cannot run its layer's pattern: the pattern differs between layers
    (dense_first_layers, layer_overrides), which every such layer would ignore, running the pattern's base; None
    where every layer runs one pattern."""
    if len(model_cfg.layer_configs()) == 1:
        return None
    return (f"this attention layer ({type(module).__name__}) has no `layer_idx`, which sparse_cp reads to give each "
            f"layer its pattern: with dense_first_layers={model_cfg.dense_first_layers} and layer_overrides="
            f"{model_cfg.layer_overrides} every such layer would run the pattern's base settings instead. Set "
            "self.layer_idx (the layer's index among the decoder layers) in its __init__, as transformers' attention "
            "layers do, or configure a pattern that is one for every layer (dense_first_layers=0, no "
            "layer_overrides).")


def _configless_refusal(module: torch.nn.Module) -> str | None:
    """Why a module without `config` cannot run the configured pattern (None where it has one): the pattern is
    stored on the model's config (`configure`), which the backend reads through the module's."""
    if getattr(module, "config", None) is not None:
        return None
    return (f"this attention layer ({type(module).__name__}) has no `config`, through which sparse_cp reads the "
            "pattern that hf_sparse_cp.configure stores on the model's config: it would run the default pattern, not "
            "the one configured. Keep the model's config on the attention module (self.config = config in its "
            "__init__), as transformers' attention layers do.")


def layer_settings_refusal(module: torch.nn.Module) -> str | None:
    """Why `module`'s calls cannot run its layer's configured pattern (`_configless_refusal`,
    `_layerless_refusal`), or None. Parses the layer's config where it is not parsed yet (`parsed_layer`)."""
    refusal = _configless_refusal(module)
    if refusal is None:
        parsed_layer(module)
        refusal = module.__dict__.get(_LAYER_REFUSAL)
    return refusal


def fresh_parsed_layer(module: torch.nn.Module) -> tuple | None:
    """What `parsed_layer` kept on the module, or None where its model config holds settings it has not parsed, or
    where the module is a copy (`copy.deepcopy`) holding its original's (whose layer key names the original). Read
    inside a trace (dynamo guards on the settings object, the kept one and the module: other settings trace again),
    where parsing would take dynamo through json and the config's validation (torch 2.11's dynamo also refuses a
    module as the argument of a function it would call at trace time, `torch.compiler.assume_constant_result`)."""
    raw = getattr(getattr(module, "config", None), MODEL_CONFIG_ATTRIBUTE, None)
    cached = module.__dict__.get(_LAYER_CONFIG)
    return None if cached is None or cached[0] is not raw or cached[4] != id(module) else cached


def parse_layer_configs(model: torch.nn.Module) -> None:
    """Parse the layer config of every module of `model` whose config holds the pattern's settings (`parsed_layer`),
    as a change of the settings (`registration.store_pattern`) does: a compiled model's next trace finds them parsed
    (a layer it finds unparsed runs outside the graph once, `_traced_call`)."""
    holders = [id(holder) for holder in pattern_holders(model.config)]
    for module in model.modules():
        if id(getattr(module, "config", None)) in holders:
            parsed_layer(module)


def forget_layer_state(model: torch.nn.Module) -> None:
    """Drop what the backend's calls keep on `model`'s attention modules (each layer's parsed config, its kept
    fractions no log has read): undoing the switch to the backend leaves the modules as they were."""
    pop_kept_fractions(model)
    for module in model.modules():
        module.__dict__.pop(_LAYER_CONFIG, None)
        module.__dict__.pop(_LAYER_REFUSAL, None)


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


def mask_only_window(module: torch.nn.Module, sliding_window: int | None) -> tuple[int | None, int | None]:
    """The sliding window of a layer whose model builds it into the attention mask (which sparse_cp does not use)
    without passing it to the attention function, e.g. Qwen2-MoE, PhiMoE: (window, None) for a layer that
    `config.layer_types` declares 'sliding_attention' (the mask holds `config.sliding_window`, as transformers'
    `create_sliding_window_causal_mask` builds it); (None, its size) when the config has a window and no layer types,
    so that which layers use it is the model's own code; (sliding_window, None) otherwise."""
    config = getattr(module, "config", None)
    window = getattr(config, "sliding_window", None)
    if sliding_window is not None or not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return sliding_window, None
    if getattr(config, "layer_types", None) is None:
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
    return ValueError(
        f"{type(module).__name__} of model type '{model_type}' puts its sliding window (config.sliding_window={size}) "
        "into the attention mask only, without passing it to the attention function, and config.layer_types does "
        f"not say which layers use it; sparse_cp does not use that mask, so it cannot apply the window to {what}. "
        f"{fix[:1].upper()}{fix[1:]}, or {dense}")


def _refuse_masked_locality(module: torch.nn.Module, unseen_window: int | None, length: int,
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


def _row_scaled_queries(module: torch.nn.Module, query: torch.Tensor, shard: CPShard) -> torch.Tensor:
    """`query` [B, H, L, D] of a CP call, where the layer scales its queries by positions counted from the tensor's
    length (`architectures.length_counted_query_scales`), moved from the scales of this rank's shard positions to
    those of the tokens' positions in the row, as one process scales them (to the rounding of a division and a
    product); any other layer's as they are."""
    scales = length_counted_query_scales(module)
    if scales is None:
        return query
    plan = shard.plan
    row = plan.source[plan.token_index(shard.rank)].clamp_min(0).to(query.device)  # (padding: any position)
    return moved_query_scales(query, scales, row)


def _same_value(held: float | None, dropout) -> bool:
    """Whether a module's dropout probability `held` is the call's `dropout`, NaN included."""
    return held is not None and (held == dropout or (held != held and dropout != dropout))


def _refuse_unsupported(module: torch.nn.Module, dropout: float, softcap, attention_mask, kwargs, heads: int
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


def _refuse_attention_weights(module: torch.nn.Module, kwargs) -> None:
    """Refuse `output_attentions=True`: sparse_cp never forms the attention weights (the model would return an empty
    tuple of them)."""
    if kwargs.get("output_attentions"):
        model_type = getattr(getattr(module, "config", None), "model_type", type(module).__name__)
        raise ValueError(
            f"sparse_cp does not compute attention weights (output_attentions=True, model type '{model_type}'); for "
            "them, switch the model to eager attention first: model.set_attn_implementation('eager') (and back with "
            "model.set_attn_implementation('sparse_cp')).")


def sparse_cp_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention backend registered as `sparse_cp` (transformers' attention-function interface).

    Args:
        module: the attention layer (its `config` holds the sparse settings, `layer_idx` its index).
        query: [B, Hq, S, D]; key, value: [B, Hkv, Sk, D] (after RoPE; this rank's shard under CP).
        attention_mask: the 2D padding mask from the registered mask function, or None.
        dropout, softcap: must be 0 / None (refused otherwise). scaling: softmax scale.
        sliding_window: the layer's window, or None. kwargs: `position_ids`, `cu_seq_lens_k` (packing),
            `cp_shard` (context parallelism), `s_aux` (learned sink logits [Hq]: `attention.sinks`).

    Returns:
        (attention output [B, S, Hq, D], None).

    Inside a graph torch.compile traces (a stock script's --torch_compile compiles the whole model), a one-process
    call runs as custom ops the graph holds (`compiled`: no graph break); the others run outside the graph, as
    every call does eagerly.
    """
    check_dims(query, key, value)  # (before anything unpacks their shapes: "not enough values to unpack")
    check_scale(scaling)  # (a dense call's SDPA took a NaN scale without a word)
    if torch.compiler.is_compiling() and traced_call(query, key, kwargs):
        out = _traced_call(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                           kwargs)
        if out is not None:
            return out, None
    return _call_outside_graphs(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                                **kwargs)


def _traced_call(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap, kwargs
                 ) -> torch.Tensor | None:
    """The output [B, S, Hq, D] of a call inside a trace through the custom ops (`compiled.traced_attention`), with
    the eager call's checks (none reads a tensor's values), or None for a call the ops do not take
    (`compiled.traced_call`), or of a layer whose settings are not parsed yet (`fresh_parsed_layer`)."""
    window, unseen_window = mask_only_window(module, sliding_window)
    parsed = fresh_parsed_layer(module)  # (None: settings not parsed yet, which the call outside the graph parses)
    if parsed is None or _IN_PROGRESS["probes and CP forwards"] or masked_locality(module, unseen_window) is not None:
        return None
    _refuse_unsupported(module, dropout, softcap, attention_mask, kwargs, query.shape[1])
    kwargs = with_forward_positions(kwargs, query.shape[2])
    _refuse_attention_weights(module, kwargs)
    query, key, value, scaling, value_dim = _engine_inputs(query, key, value, scaling)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    with torch.autocast(query.device.type, enabled=False):
        out = traced_attention(module, query, key, value, attention_mask, parsed, scale, window, kwargs)
    return out[..., :value_dim].contiguous()


# Outside any graph torch.compile traces: the layout is estimated from tensors read back to the host, with per-forward
# caches a trace cannot hold (dynamo failed on the layout build once shapes went dynamic); the calls `_traced_call`
# does not take. The rest of the model compiles around the call.
@torch.compiler.disable
def _call_outside_graphs(module, query, key, value, attention_mask, dropout, scaling, sliding_window, softcap,
                         **kwargs) -> tuple[torch.Tensor, None]:
    if is_bidirectional_mask(attention_mask) and not is_cross_attention(module):  # (cross-attention's own refusal)
        raise NonCausalMask(getattr(module, "config", None), "bidirectional")
    shard = kwargs.get(CP_SHARD_KWARG)
    probe = _PROBE.get()
    if probe is not None:
        unsupported = (unsupported_feature(module, softcap, kwargs, query.shape[1], attention_mask)
                       or own_keys_refusal(module, query.shape[2], key.shape[2], attention_mask, shard is probe)
                       or _configless_refusal(module))  # (`_layerless_refusal` needs the pattern: at the call)
        probe.calls.append(ProbedCall(module, shard is probe, None if attention_mask is None else attention_mask.dim(),
                                      sliding_window, unsupported))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None
    traced_setting()  # (a misspelt setting of the compiled path, refused in eager runs too)
    if shard is None and _CP_FORWARD.get() is not None:
        raise RuntimeError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) was called without the "
            "context-parallel shard while the model runs under context parallelism: its decoder layer does not pass "
            "the attention keyword arguments on, so it would attend within this rank's shard only. Train this model "
            "without context parallelism."
        )
    _refuse_unsupported(module, dropout, softcap, attention_mask, kwargs, query.shape[1])
    if shard is not None:
        refused = positions_refusal(module, shard, kwargs)
        if refused:
            raise ValueError(refused)
        query = _row_scaled_queries(module, query, shard)
    elif query.shape[2] == key.shape[2]:
        kwargs = with_forward_positions(kwargs, query.shape[2])
    own_keys = own_keys_refusal(module, query.shape[2], key.shape[2], attention_mask, shard is not None)
    if own_keys:
        raise ValueError(own_keys)
    _refuse_attention_weights(module, kwargs)
    sliding_window, unseen_window = mask_only_window(module, sliding_window)
    _refuse_masked_locality(module, unseen_window, *_call_documents(query, key, attention_mask, shard, kwargs),
                            attention_mask)
    query, key, value, scaling, value_dim = _engine_inputs(query, key, value, scaling)
    with torch.autocast(query.device.type, enabled=False):
        out, kept = _attend(query, key, value, attention_mask, layer_config(module), scaling, sliding_window, shard,
                            kwargs)
    if kept is not None:
        record_kept_fraction(module, kept)
    return out[..., :value_dim].transpose(1, 2).contiguous(), None


def _call_documents(query: torch.Tensor, key: torch.Tensor, attention_mask: torch.Tensor | None, shard, kwargs
                    ) -> tuple[int, Callable[[], torch.Tensor] | None]:
    """The length of a call's keys (under CP, the padded whole sequence) and the extents of its documents
    (`tokens.document_extents`, computed when asked for; None for a decoding step with a KV cache, or a shard that
    does not carry them)."""
    if shard is not None:
        return shard.meta.index.shape[-1], shard.documents
    b, _, q_len, _ = query.shape
    if q_len != key.shape[2]:
        return key.shape[2], None
    return q_len, lambda: BatchDocumentExtents(
        batch_token_meta(b, q_len, query.device, attention_mask, kwargs), attention_mask, kwargs)()


def _engine_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, float | None, int]:
    """(q, k, v, scaling, the values' width) as the engines take them: in autocast's dtype (`autocast_inputs`) and of
    one head dimension (`_same_head_dim`: multi-head latent attention, DeepSeek-V3's values narrower than q and k),
    the scale then fixed to the unpadded q's; the output is sliced back to the values' width."""
    query, key, value = autocast_inputs(query, key, value)
    value_dim = value.shape[-1]
    if value_dim != query.shape[-1]:
        scaling = query.shape[-1] ** -0.5 if scaling is None else scaling
        query, key, value = _same_head_dim(query, key, value)
    return query, key, value, scaling, value_dim


def _same_head_dim(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q, k, v zero-padded to one head dimension (the engines and the ring take one): zeros added to the values give
    zero output columns (sliced off), zeros added to queries and keys leave every score as it was; exact, and the
    padding gets no gradient. The softmax scale must be fixed before (it is the unpadded q's)."""
    width = max(query.shape[-1], value.shape[-1])
    return tuple(torch.nn.functional.pad(t, (0, width - t.shape[-1])) for t in (query, key, value))


def _attend(query, key, value, attention_mask, cfg, scaling, sliding_window, shard, kwargs
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The attention output [B, Hq, S, D] of one call (see `sparse_cp_attention_forward`) and its kept
    fraction (None for a decoding step with a KV cache, which is not counted)."""
    b, _, q_len, d = query.shape
    k_len = key.shape[2]
    scale = 1.0 / math.sqrt(d) if scaling is None else scaling
    sinks = kwargs.get("s_aux")
    if shard is not None:
        result = context_parallel_attention(query, key, value, shard, cfg, scale=scale, sliding_window=sliding_window,
                                            sinks=sinks)
        return result.out, result.kept_fraction
    if q_len == k_len and padding_between_tokens_once(attention_mask) is None:
        meta = batch_token_meta(b, q_len, query.device, attention_mask, kwargs)
        return sequence_attention(query, key, value, meta, cfg, scale=scale, sliding_window=sliding_window,
                                  sinks=sinks)
    # Through a KV cache, or with padding between a row's tokens: every key block (not counted)
    q_meta, k_meta, layout = every_key_call(b, q_len, k_len, query.device, attention_mask, kwargs, cfg.block_size)
    out, lse = block_sparse_attention(query, key, value, layout, scale=scale, q_meta=q_meta, k_meta=k_meta,
                                      sliding_window=sliding_window, check_layout=False,
                                      implementation=cfg.attention_engine)
    return with_sinks(out, lse, sinks), None
