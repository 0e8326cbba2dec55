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

What a call reads besides its arguments lives beside it: its masks and token tensors as `TokenMeta`
(`call_tokens.py`), the probe or CP shard of the forward in progress (`call_context.py`), the layer's pattern
(`layer_settings.py`), the forward's position_ids (`forward_positions.py`), and what it refuses (`call_refusals.py`).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from ..attention.layout import check_dims, check_scale
from ..attention.ops import block_sparse_attention
from ..attention.precision import autocast_inputs
from ..attention.sequence import sequence_attention
from ..attention.sinks import with_sinks
from ..attention.tokens import (
    BatchDocumentExtents,
)
from ..config import BACKEND_NAME
from ..distributed.modes import context_parallel_attention
from ..distributed.shard import CP_SHARD_KWARG, CPShard
from .architectures import length_counted_query_scales, moved_query_scales
from .call_context import IN_PROGRESS, ProbedCall, cp_forward_shard, current_probe
from .call_refusals import (
    is_cross_attention,
    mask_only_window,
    masked_locality,
    own_keys_refusal,
    positions_refusal,
    refuse_attention_weights,
    refuse_masked_locality,
    refuse_unsupported,
    unsupported_feature,
)
from .call_tokens import (
    NonCausalMask,
    batch_token_meta,
    every_key_call,
    is_bidirectional_mask,
    padding_between_tokens_once,
    padding_rows_once,
)
from .compiled import traced_attention, traced_call, traced_setting
from .forward_positions import with_forward_positions
from .heads import PADDING_ROWS_KWARG, refuse_unpooled_head, with_padding_rows, with_shard_padding_rows
from .layer_settings import configless_refusal, fresh_parsed_layer, layer_config
from .stats import record_kept_fraction


def is_registered() -> bool:
    """Whether transformers knows `attn_implementation="sparse_cp"` (by `patch()`, or anyone's registration)."""
    return BACKEND_NAME in AttentionInterface() and BACKEND_NAME in AttentionMaskInterface()


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
    window, unseen_window = mask_only_window(module, sliding_window, attention_mask)
    parsed = fresh_parsed_layer(module)  # (None: settings not parsed yet, which the call outside the graph parses)
    if parsed is None or IN_PROGRESS["probes and CP forwards"] or masked_locality(module, unseen_window) is not None:
        return None
    refuse_unsupported(module, dropout, softcap, attention_mask, kwargs, query.shape[1])
    kwargs = with_padding_rows(module, with_forward_positions(kwargs, query.shape[2]), query.shape[0], query.device)
    refuse_attention_weights(module, kwargs)
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
    probe = current_probe()
    if probe is not None:
        unsupported = (unsupported_feature(module, softcap, kwargs, query.shape[1], attention_mask)
                       or own_keys_refusal(module, query.shape[2], key.shape[2], attention_mask, shard is probe)
                       or configless_refusal(module))  # (`_layerless_refusal` needs the pattern: at the call)
        probe.calls.append(ProbedCall(module, shard is probe, None if attention_mask is None else attention_mask.dim(),
                                      sliding_window, unsupported))
        return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None
    traced_setting()  # (a misspelt setting of the compiled path, refused in eager runs too)
    if shard is None and cp_forward_shard() is not None:
        raise RuntimeError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', '?')}) was called without the "
            "context-parallel shard while the model runs under context parallelism: its decoder layer does not pass "
            "the attention keyword arguments on, so it would attend within this rank's shard only. Train this model "
            "without context parallelism."
        )
    refuse_unsupported(module, dropout, softcap, attention_mask, kwargs, query.shape[1])
    if shard is not None:
        refused = positions_refusal(module, shard, kwargs)
        if refused:
            raise ValueError(refused)
        refuse_unpooled_head(module)
        query = _row_scaled_queries(module, query, shard)
        with_shard_padding_rows(module, shard, query.shape[0], query.device)
    elif query.shape[2] == key.shape[2]:
        kwargs = with_padding_rows(module, with_forward_positions(kwargs, query.shape[2]), query.shape[0],
                                   query.device)
    own_keys = own_keys_refusal(module, query.shape[2], key.shape[2], attention_mask, shard is not None)
    if own_keys:
        raise ValueError(own_keys)
    refuse_attention_weights(module, kwargs)
    sliding_window, unseen_window = mask_only_window(module, sliding_window, attention_mask)
    refuse_masked_locality(module, unseen_window, *_call_documents(query, key, attention_mask, shard, kwargs),
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
                                  sinks=sinks, padding_rows=padding_rows_once(meta, kwargs.get(PADDING_ROWS_KWARG)))
    # Through a KV cache, or with padding between a row's tokens: every key block (not counted)
    q_meta, k_meta, layout = every_key_call(b, q_len, k_len, query.device, attention_mask, kwargs, cfg.block_size)
    out, lse = block_sparse_attention(query, key, value, layout, scale=scale, q_meta=q_meta, k_meta=k_meta,
                                      sliding_window=sliding_window, check_layout=False,
                                      implementation=cfg.attention_engine)
    return with_sinks(out, lse, sinks), None
