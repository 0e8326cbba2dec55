"""The `sparse_cp` attention call inside a graph that torch.compile traces: two opaque custom ops, no graph break.

Outside a trace the backend estimates the layout from tensors read back to the host, which a graph cannot hold, so a
compiled model used to run each attention call outside the graph (`torch.compiler.disable`: one graph break per
layer). Inside a trace, a one-process call (no context parallelism, as many keys as queries, a layer whose window or
chunk transformers passes on) now goes through two ops instead, each opaque to the compiler:

* `hf_sparse_cp::sequence_plan` does what the eager call does before attention, on the same tensors: the tokens'
  documents and padding (`token_meta_from_kwargs`), the layout (`sequence.sequence_layout`: estimated for long
  documents, else dense; with padding between a row's tokens every key block, `call_tokens.every_key_call`), and
  records the kept fraction on the layer's module as the eager call does (at run time, inside the op: the traced
  graph holds no side effect, which a checkpointed layer's trace would refuse). The layout's widths depend on the
  data: its fake implementation gives them as unbacked sizes, so the graph carries the layout exactly as the eager
  call builds it (no padding to a bound, no recompile per width);
* `hf_sparse_cp::layout_attention` (`attention.opaque`) computes attention over that layout, and its registered
  backward takes the same layout tensors: the gradients are exact and nothing is estimated again.

A call that its layer's settings and length make dense traces as SDPA where the eager call runs SDPA and the trace
knows its rows are plain causal ones (no padding mask, position_ids or cu_seq_lens: `dense_sdpa`), or where
$HF_SPARSE_CP_DENSE_BACKEND=sdpa, whose refusal of packed rows `hf_sparse_cp::dense_call` applies at run time as
eagerly; that op also records the call's kept fraction. Other dense calls run the engine over the dense layout in the
ops: flash-attn's (its documents read back to the host), and SDPA's under 'auto' on rows that may be packed, which the
eager call reads back to choose (a graph cannot branch on that without `torch.cond`).

Context parallelism keeps the eager path: its ring and all-to-all communicate inside the call, between ranks, which
one opaque op per rank would hide from the compiler's collectives; a call through a KV cache, a window or chunk only
the mask carries, a bidirectional mask or multimodal RoPE rows keep it too (`traced_call`), as does a torch before
2.11 (`OPS_MIN_TORCH`).
`$HF_SPARSE_CP_TRACED_ATTENTION=outside` keeps every call outside the graphs, as before the ops (read while tracing;
benchmarks/bench_e2e.py times both)."""

from __future__ import annotations

import functools
import json
import weakref

import torch
from packaging.version import Version

from ..attention.build import with_padding_query_blocks
from ..attention.dense import (
    DENSE_BACKEND_ENV,
    DENSE_BACKENDS,
    dense_backend,
    is_flash_attn_available,
    library_takes,
    sdpa_dense_attention,
)
from ..attention.estimate import pattern_documents
from ..attention.opaque import layout_attention
from ..attention.sequence import sequence_layout
from ..attention.sinks import with_sinks
from ..attention.tokens import padding_between_tokens, padding_queries_see_prior_tokens, token_meta_from_kwargs
from ..backends import choose_backend
from ..config import SparseAttentionConfig
from ..distributed.shard import CP_SHARD_KWARG
from .call_tokens import _BIDIRECTIONAL, every_key_call
from .heads import PADDING_ROWS_KWARG
from .stats import record_kept_fraction
from .upstream import register_ordered_effect, unbacked_size

TRACED_ENV = "HF_SPARSE_CP_TRACED_ATTENTION"
# 'auto': a call the ops take goes through them where the torch traces them (`OPS_MIN_TORCH`); 'ops': on any torch (to
# try one before it); 'outside': outside the graph (a graph break per call).
TRACED_SETTINGS = ("auto", "ops", "outside")
# The oldest torch release whose dynamo was checked to trace the ops (tests/unit/test_torch_compile.py on 2.11, the GPU
# image's, and 2.13). The trace reads each layer's settings parsed beforehand (`layer_settings.parsed_layer`): 2.11's
# dynamo refused the module argument of the `assume_constant_result` function that parsed them while tracing.
OPS_MIN_TORCH = (2, 11)
TORCH_TRACES_THE_OPS = Version(torch.__version__).release >= OPS_MIN_TORCH


def settings_key(cfg: SparseAttentionConfig) -> str:
    """The layer settings as the plan op takes them (JSON), computed where the layer's config is parsed, outside any
    trace (`layer_settings.parsed_layer`)."""
    return json.dumps(cfg.to_dict(), sort_keys=True)


# The attention modules whose config the backend parsed, by the key the plan op takes (`layer_key`), while they live.
_LAYERS: dict[str, weakref.ref] = {}


def layer_key(module: torch.nn.Module) -> str:
    """The key under which the plan op finds `module` to record its kept fraction, computed where the layer's config
    is parsed, outside any trace (`layer_settings.parsed_layer`)."""
    key = f"{type(module).__name__}@{id(module):x}"
    _LAYERS[key] = weakref.ref(module, lambda _: _LAYERS.pop(key, None))
    return key


@functools.lru_cache(maxsize=64)
def _settings(key: str) -> SparseAttentionConfig:
    return SparseAttentionConfig.from_dict(json.loads(key))


def _token_kwargs(position_ids: torch.Tensor | None, cu_seq_lens_q: torch.Tensor | None,
                  cu_seq_lens_k: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The keyword arguments an op's call was given that mark its tokens, as transformers passes them (those set)."""
    return {name: t for name, t in (("position_ids", position_ids), ("cu_seq_lens_q", cu_seq_lens_q),
                                    ("cu_seq_lens_k", cu_seq_lens_k)) if t is not None}


def _record_kept(layer: str, kept: torch.Tensor, grad_enabled: bool) -> None:
    """Record a call's kept fraction on the module `layer` names (`layer_key`), if it is still there."""
    module = _LAYERS[layer]() if layer in _LAYERS else None
    if module is not None:
        record_kept_fraction(module, kept, grad_enabled)


@torch.library.custom_op("hf_sparse_cp::sequence_plan", mutates_args=())
def sequence_plan(q: torch.Tensor, k: torch.Tensor, attention_mask: torch.Tensor | None,
                  position_ids: torch.Tensor | None, cu_seq_lens_q: torch.Tensor | None,
                  cu_seq_lens_k: torch.Tensor | None, settings: str, scale: float, sliding_window: int | None,
                  layer: str, grad_enabled: bool, padding_rows: torch.Tensor | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
                             torch.Tensor, torch.Tensor]:
    """(block_idx, block_cnt, col_idx, col_cnt, q_index, q_segment, k_index, k_segment) of one call of
    q [B, Hq, S, D], k [B, Hkv, S, D] (no gradient), as the eager backend plans it from transformers' keyword
    arguments. The call's kept fraction is recorded on the module `layer` names (`layer_key`; '' for none) as the
    eager call's, in its module's mode with `grad_enabled` (the forward's: a compiled forward runs the op without
    gradients); a call with padding between a row's tokens is not counted, as eagerly. `padding_rows`: the rows whose
    padding queries after their tokens a head reads (`heads.pass_padding_rows_on`), which see the tokens before them
    over the blocks of their row's last block of tokens, as eagerly (`sequence.sequence_attention`)."""
    cfg = _settings(settings)
    b, _, s, _ = q.shape
    kwargs = _token_kwargs(position_ids, cu_seq_lens_q, cu_seq_lens_k)
    if padding_between_tokens(attention_mask) is not None:
        q_meta, meta, layout = every_key_call(b, s, s, q.device, attention_mask, kwargs, cfg.block_size)
    else:
        meta = q_meta = token_meta_from_kwargs(b, s, q.device, attention_mask, kwargs)
        docs = pattern_documents(cfg, meta, b, s, sliding_window)
        layout = sequence_layout(q, k, meta, cfg, docs, scale=scale, sliding_window=sliding_window)
        _record_kept(layer, layout.kept_fraction(meta, sliding_window), grad_enabled)
        if padding_rows is not None:
            q_meta = padding_queries_see_prior_tokens(meta, padding_rows)
            layout = with_padding_query_blocks(layout, meta, q_meta)
    tensors = (*layout.tensors(), q_meta.index, q_meta.segment, meta.index, meta.segment)
    # (fresh tensors: a custom op's outputs alias neither its inputs nor each other)
    return tuple(t.clone(memory_format=torch.contiguous_format) for t in tensors)


@sequence_plan.register_fake
def _(q, k, attention_mask, position_ids, cu_seq_lens_q, cu_seq_lens_k, settings, scale, sliding_window, layer,
      grad_enabled, padding_rows=None):
    b, _, s, _ = q.shape
    nqb = -(-s // _settings(settings).block_size)
    ctx = torch.library.get_ctx()
    heads, blocks, columns = (unbacked_size(ctx) for _ in range(3))
    layout = [q.new_empty(b, heads, nqb, width, dtype=torch.int32) for width in (blocks, columns)]
    counts = [q.new_empty(b, heads, nqb, dtype=torch.int32) for _ in range(2)]
    tokens = [q.new_empty(b, s, dtype=dtype) for dtype in (torch.int64, torch.int32) * 2]
    return layout[0], counts[0], layout[1], counts[1], *tokens


@torch.library.custom_op("hf_sparse_cp::dense_call", mutates_args=())
def dense_call(q: torch.Tensor, k: torch.Tensor, position_ids: torch.Tensor | None, cu_seq_lens_q: torch.Tensor | None,
               cu_seq_lens_k: torch.Tensor | None, sliding_window: int | None, layer: str, grad_enabled: bool,
               check: bool) -> None:
    """What the eager call does around the SDPA call of a dense call of q [B, Hq, S, D], k (no gradient) that
    `dense_sdpa` sends there, at run time: with `check`, choose its backend as eagerly (`dense.dense_backend` on the
    tokens of its keyword arguments: $HF_SPARSE_CP_DENSE_BACKEND=sdpa refuses packed rows, as it does eagerly);
    then record the kept fraction of a dense call (1) on the module `layer` names, as `sequence_plan` does. An ordered
    side effect (`upstream.register_ordered_effect`: the graph keeps it though it returns nothing)."""
    b, _, s, _ = q.shape
    if check:
        kwargs = _token_kwargs(position_ids, cu_seq_lens_q, cu_seq_lens_k)
        dense_backend(q, k, token_meta_from_kwargs(b, s, q.device, None, kwargs), sliding_window)
    _record_kept(layer, torch.ones((), dtype=torch.float64, device=q.device), grad_enabled)


@dense_call.register_fake
def _(q, k, position_ids, cu_seq_lens_q, cu_seq_lens_k, sliding_window, layer, grad_enabled, check):
    return None


_DENSE_CALL_IN_GRAPHS = register_ordered_effect("hf_sparse_cp::dense_call")


@torch.compiler.assume_constant_result
def _flash_attn_installed() -> bool:
    """`dense.is_flash_attn_available`, which imports flash-attn (dynamo would break the graph at the import), as a
    constant of the trace."""
    return is_flash_attn_available()


def dense_sdpa(query: torch.Tensor, key: torch.Tensor, attention_mask, cfg: SparseAttentionConfig,
               sliding_window: int | None, kwargs: dict) -> str | None:
    """How a call inside a trace goes to SDPA where the eager call would (`attention.dense`), decided from what the
    trace knows (no tensor's values): 'plain' for a call that its layer's settings and length make dense
    (`estimate.pattern_documents`: a dense pattern, a window, fewer tokens than min_seq_len), without sinks, whose rows
    are plain causal ones whatever its tensors hold (no padding mask, no position_ids or cu_seq_lens, no window
    shorter than the rows), where the eager call's backend takes SDPA (`dense.dense_backend`: 'auto' on CUDA fp16/bf16
    without flash-attn, outside deterministic mode, or $HF_SPARSE_CP_DENSE_BACKEND=sdpa); 'checked' for one with
    position_ids or cu_seq_lens (or a window) under $HF_SPARSE_CP_DENSE_BACKEND=sdpa, whose rows `dense_call` checks
    as eagerly (refused where packed); None for the others (the ops: the estimated layout, or the dense one of
    packed or padded rows, which 'auto' runs on SDPA eagerly only when the rows it reads back are plain)."""
    s = query.shape[2]
    if kwargs.get("s_aux") is not None or attention_mask is not None or not _DENSE_CALL_IN_GRAPHS:
        return None  # (a torch without ordered effects would drop `dense_call`: the ops' dense layout then)
    backend = choose_backend("Dense attention", DENSE_BACKEND_ENV, DENSE_BACKENDS)
    if backend == "auto" and not (library_takes(query, key) and not _flash_attn_installed()
                                  and not torch.are_deterministic_algorithms_enabled()):
        return None
    if backend not in ("auto", "sdpa") or any(pattern_documents(cfg, None, 1, s, sliding_window)):
        return None
    plain = (sliding_window is None or sliding_window >= s) and all(
        kwargs.get(name) is None for name in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k"))
    return "plain" if plain else "checked" if backend == "sdpa" else None


def traced_setting() -> str:
    """The setting of `TRACED_ENV` ('auto' where unset); an unknown one is a ValueError listing the settings. Read by
    the calls outside the graphs too: a trace that meets the error runs the call outside the graph, where it is
    raised (else a misspelt setting would go unnoticed)."""
    return choose_backend("Traced attention", TRACED_ENV, TRACED_SETTINGS)


def traced_call(query: torch.Tensor, key: torch.Tensor, kwargs: dict) -> bool:
    """Whether a call inside a trace may go through the ops (what decides reads no tensor's values, and no module:
    a call it refuses goes outside the graph, as every call did, without guards on its layer): not set 'outside'
    (`TRACED_ENV`), a torch that traces them (`OPS_MIN_TORCH`, unless set 'ops'), one process (no CP shard), as
    many keys as queries (no KV cache), no bidirectional mask built (`call_tokens.is_bidirectional_mask`), position ids
    of at most two dimensions. (A window or chunk that only the mask carries, `call_refusals.masked_locality`, is the
    caller's to check.)"""
    positions = kwargs.get("position_ids")
    setting = traced_setting()
    return ((setting == "ops" or (setting == "auto" and TORCH_TRACES_THE_OPS))
            and kwargs.get(CP_SHARD_KWARG) is None and query.shape[2] == key.shape[2] and not _BIDIRECTIONAL
            and (positions is None or positions.dim() <= 2))


def traced_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask, parsed: tuple, scale: float, sliding_window: int | None, kwargs: dict
                     ) -> torch.Tensor:
    """The output [B, S, Hq, D] of a call of `module` that `traced_call` takes, through the two ops. `parsed`: the
    layer's config, settings key and layer key, parsed outside the trace (`layer_settings.parsed_layer`)."""
    _, cfg, settings, layer, _ = parsed
    sdpa = dense_sdpa(query, key, attention_mask, cfg, sliding_window, kwargs)
    if sdpa is not None:
        dense_call(query.detach(), key.detach(), kwargs.get("position_ids"), kwargs.get("cu_seq_lens_q"),
                   kwargs.get("cu_seq_lens_k"), sliding_window, layer, torch.is_grad_enabled(), sdpa == "checked")
        return sdpa_dense_attention(query, key, value, scale=scale)
    plan = sequence_plan(query.detach(), key.detach(), attention_mask, kwargs.get("position_ids"),
                         kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k"), settings, scale, sliding_window,
                         layer, torch.is_grad_enabled(), kwargs.get(PADDING_ROWS_KWARG))
    out, lse = layout_attention(query, key, value, *plan, cfg.block_size, scale, sliding_window, cfg.attention_engine)
    sinks = kwargs.get("s_aux")
    if sinks is not None:
        out = with_sinks(out.transpose(1, 2), lse, sinks).transpose(1, 2)
    return out

