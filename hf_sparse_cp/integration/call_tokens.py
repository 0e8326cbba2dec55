"""What the backend reads from the masks and token tensors transformers hands an attention call: the mask function
registered with the backend (`sparse_cp_mask`), the key length a KV cache gives the call (`cache_key_length`), a
StaticCache's unfilled slots, and the token metadata every layer of a forward shares, read back to the host once per
forward (`PerForward`)."""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from types import SimpleNamespace

import torch
from transformers.masking_utils import bidirectional_mask_function, causal_mask_function, flash_attention_mask

from ..attention.layout import SparseLayout, write_version
from ..attention.tokens import (
    TokenMeta,
    padding_between_tokens,
    padding_queries_see_prior_tokens,
    rows_pad_after_tokens,
    token_meta_from_kwargs,
)
from ..config import language_config
from .composite import tower_refusal
from .upstream import register_ordered_effect

# What a mask `sparse_cp_mask` refuses holds (`NonCausalMask`): a model's overlay on the causal mask, transformers'
# bidirectional mask, or a mask that lets a query see the key after it (either).
_NON_CAUSAL = {
    "overlay": "overlays its own mask on the causal one (an or/and mask function: e.g. bidirectional attention over "
               "image tokens, or a bidirectional text model)",
    "bidirectional": "builds a bidirectional attention mask (transformers' create_bidirectional_mask: an encoder, "
                     "cross-attention, or a text model with config.is_causal=False)",
    "next key": "lets tokens see later ones in its attention mask: it overlays its own mask on the causal one (e.g. "
                "a bidirectional prefix of packed documents), or it is bidirectional",
}


class NonCausalMask(ValueError):
    """The refusal of a mask that lets a query see a later key (`sparse_cp_mask`; `cause`: a key of `_NON_CAUSAL`):
    the backend computes causal attention only. `config`: the model's (its type is named), `fix`: how to train it
    instead; `refusal` is the message without the fix (a tower's names its own)."""

    def __init__(self, config, cause: str,
                 fix: str = "load it with attn_implementation='sdpa' or 'eager' (--sparse_attention false)"):
        model_type = getattr(config, "model_type", "unknown")
        self.refusal = tower_refusal(config, f"this model (type '{model_type}')") or (
            f"sparse_cp computes causal attention only, but this model (type '{model_type}') {_NON_CAUSAL[cause]}")
        super().__init__(self.refusal if self.refusal.endswith(".") else f"{self.refusal}; {fix}.")


class UnroutedMask(ValueError):
    """The refusal of a mask built for a model whose attention never reaches the backend (`computes_own_attention`):
    its own attention code would read the mask."""

    def __init__(self, config):
        model_type = getattr(config, "model_type", "unknown")
        super().__init__(
            f"Model type '{model_type}' computes attention in its own code, not through transformers' "
            "AttentionInterface, so attn_implementation='sparse_cp' cannot take effect: its attention would read the "
            "2D padding mask sparse_cp's mask function hands over (None where no token is padded) as its causal mask, "
            "and let tokens see later ones. Load it with attn_implementation='eager' or 'sdpa' (--sparse_attention "
            "false), or use a model whose architecture routes attention through AttentionInterface "
            "(docs/context-parallelism.md lists the tested ones).")


class RefusedAtMask(ValueError):
    """The refusal, at its mask, of a model whose layers would read the mask the backend hands over in a way it
    cannot compute (`BiasedMask`, `IndexedMask`): its message names the model type and the fix."""


class BiasedMask(RefusedAtMask):
    """The refusal of a mask to which the model adds its ALiBi position bias (Falcon with `alibi=True`, whose forward
    materializes the mask for it): the backend takes the 2D padding mask, without the bias."""

    def __init__(self, config):
        super().__init__(
            f"Model type '{getattr(config, 'model_type', 'unknown')}' with alibi=True adds its ALiBi position bias to "
            "the attention mask, which sparse_cp does not use (it takes the 2D padding mask and applies causality "
            "itself), so it cannot compute this model's attention: load it with attn_implementation='sdpa' or 'eager' "
            "(--sparse_attention false).")


class IndexedMask(RefusedAtMask):
    """The refusal of a mask built for a model whose layers select the keys each query reads with an indexer of
    their own (`selects_keys_by_index`): the indexer reads the 4D mask eager and sdpa get."""

    def __init__(self, config):
        super().__init__(
            f"Model type '{getattr(config, 'model_type', 'unknown')}' selects the keys each query attends to with a "
            "sparse-attention indexer of its own (DeepSeek-V3.2-style DSA), which reads the 4D mask eager and sdpa "
            "get, while sparse_cp hands over the 2D padding mask and computes its own pattern, not the indexer's "
            "selection: load it with attn_implementation='eager' (or 'sdpa' where the model offers it; "
            "--sparse_attention false).")


class OwnMask(RefusedAtMask):
    """The refusal of a mask built for a model whose attention layers make a mask of their own from the one they get
    (`builds_own_mask`): they read it as the 4D mask eager and sdpa get."""

    def __init__(self, config):
        super().__init__(
            f"Model type '{getattr(config, 'model_type', 'unknown')}' builds its own 4D attention mask in its "
            "attention layers (a dynamic mask of the keys each head keeps) from the 4D mask eager and sdpa get, while "
            "sparse_cp hands over the 2D padding mask and computes its own pattern, not the model's: load it with "
            "attn_implementation='sdpa' or 'eager' (--sparse_attention false).")


def selects_keys_by_index(config) -> bool:
    """Whether `config` has layers of transformers' type 'indexed_attention' (DeepSeek-V3.2, GLM-5 DSA, Hunyuan-V4,
    AXK2, ...), whose indexer selects the keys each query reads from the mask the model builds for them (DeepSeek-V4's
    compressed layers, whose indexer reads no mask, are of other types)."""
    return "indexed_attention" in (getattr(config, "layer_types", None) or ())


# A method of an attention class that makes the layer's own mask from the one the model hands it (Doge's dynamic mask
# attention, which indexes it as [batch, 1, query, key]).
_OWN_MASK_METHODS = ("prepare_dynamic_mask",)


def builds_own_mask(config) -> bool:
    """Whether `config` is that of a transformers model family whose attention layers build a mask of their own from
    the 4D one they get (`_OWN_MASK_METHODS`: Doge's), which the 2D padding mask sparse_cp hands over fails in
    (an IndexError inside the model with a padded batch). Judged as `computes_own_attention` judges."""
    module = _modeling_module(config)
    return module is not None and _defines_own_mask(module.__name__)


@functools.cache
def _defines_own_mask(module_name: str) -> bool:
    """Whether a class of the imported module `module_name` has a method of `_OWN_MASK_METHODS`."""
    return any(isinstance(value, type) and any(hasattr(value, m) for m in _OWN_MASK_METHODS)
               for value in vars(sys.modules[module_name]).values())


def builds_sliding_window_mask(config) -> bool | None:
    """Whether `config`'s transformers model family builds a sliding-window attention mask anywhere (its modeling
    module imports masking_utils' `create_sliding_window_causal_mask`: Mistral, Mixtral, PhiMoE, Qwen3-MoE, ...);
    False for one that never does (Llama, GPT-2, OLMo 2: a `sliding_window` in their config is read by no code, and
    SDPA attends past it); None where unknown (`_modeling_module`: remote code, a composite config)."""
    module = _modeling_module(config)
    return None if module is None else hasattr(module, "create_sliding_window_causal_mask")


def _modeling_module(config):
    """The imported transformers modeling module of `config`'s family, or None (a composite config, one holding its
    language model's, `language_config`: that model's module computes attention; a module not imported, or outside
    transformers: remote code)."""
    prefix, _, family = type(config).__module__.rpartition(".configuration_")
    if not prefix.startswith("transformers.models.") or language_config(config) is not config:
        return None
    return sys.modules.get(f"{prefix}.modeling_{family}")


def computes_own_attention(config) -> bool:
    """Whether `config` is that of a transformers model family whose modeling module cannot dispatch attention to a
    registered implementation (it never reads `ALL_ATTENTION_FUNCTIONS`: bloom, mpt, xglm), yet builds its
    masks through the mask interface, which transformers (5.25) lets it select sparse_cp for. A composite config
    (one holding its language model's, `language_config`: that model's module computes attention) and a module not
    imported or outside transformers (remote code) are not judged."""
    module = _modeling_module(config)
    return module is not None and not hasattr(module, "ALL_ATTENTION_FUNCTIONS")


def sparse_cp_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                   attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask function registered with the backend: transformers' flash-attention one, which hands over the 2D
    padding mask (None when no token is padded), over the columns SDPA reads (`padding_columns_as_sdpa_reads`:
    through a cache, a mask longer or shorter than the tokens seen is cut or padded with zeros; a StaticCache's then
    covers its unfilled slots too, which `kv_length` counts). Where it would be None through a cache that gives more
    keys than queries, a mask of ones over the tokens held is returned instead, so that the backend always knows
    which slots hold none; wherever the cache gives the keys of earlier tokens (`kv_length` above `q_length`) the
    mask is returned, and the key length and the tokens held it was built for are kept for the backend
    (`cache_key_length`, `cache_slots_held`).

    A mask the backend cannot compute raises `NonCausalMask`, naming the fix: one that transformers combines from the
    causal one and a model's own overlay (`or_mask_function` / `and_mask_function`, for which it sets `use_vmap`, or
    a block overlay: bidirectional image tokens), and any other that lets a query see the key after it
    (`_sees_next_key`: a block overlay under packing, a bidirectional window). transformers' bidirectional mask
    (`create_bidirectional_mask`: an encoder's, cross-attention's, a decoder's with `config.is_causal=False`; the
    attention layers of some models, e.g. Splinter's, do not say `is_causal=False`, so only the mask shows it) is
    returned marked (`is_bidirectional_mask`), for the attention call handed it to refuse. The mask of a model whose
    attention never reaches the backend raises `UnroutedMask` (its own attention would take it for a causal mask;
    under torch.compile, not checked: the check reads module state a trace would break on), and one a model adds its
    ALiBi bias to raises `BiasedMask`, one whose layers select keys by an indexer of their own `IndexedMask` (the
    indexer would fail on the 2D mask, naming no fix), and one whose layers build a mask of their own from it
    `OwnMask` (likewise)."""
    config = kwargs.get("config")
    if getattr(config, "alibi", False) is True:
        raise BiasedMask(config)
    if selects_keys_by_index(config):
        raise IndexedMask(config)
    if not torch.compiler.is_compiling() and computes_own_attention(config):
        raise UnroutedMask(config)
    if not torch.compiler.is_compiling() and builds_own_mask(config):
        raise OwnMask(config)
    function = kwargs.get("mask_function")
    if kwargs.get("use_vmap") or getattr(function, "__name__", None) == "or_mask":
        raise NonCausalMask(kwargs.get("config"), "overlay")
    if function is bidirectional_mask_function:
        mask = flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset,
                                    attention_mask=attention_mask, **kwargs)
        # (a mask of its own, never the caller's tensor, which a causal call may be handed too)
        mask = (torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device")) if mask is None
                else mask.clone())
        key = id(mask)
        _BIDIRECTIONAL[key] = weakref.ref(mask, lambda _: _BIDIRECTIONAL.pop(key, None))
        return mask
    if _sees_next_key(function, batch_size, q_length, kv_length, q_offset, kv_offset, kwargs.get("device"),
                      kwargs.get("config")):
        raise NonCausalMask(kwargs.get("config"), "next key")
    mask = _causal_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask, **kwargs)
    window = _generated_window(function, attention_mask, kwargs.get("config"))
    if window is not None and mask_window(mask) is None:
        # (a tensor of its own, never a view: a model may take a view of it, `.view(batch, -1)` (GPT-2), which
        # `mask_window` follows to it; None cannot be marked)
        if mask is None:
            mask = torch.ones(batch_size, kv_length, dtype=torch.bool, device=kwargs.get("device"))
        elif mask._base is not None:
            entry = _cache_entry(mask)
            mask = mask.clone()
            if entry is not None:
                _record_cache_call(mask, *entry[1:])
        key = id(mask)
        _WINDOWED[key] = (weakref.ref(mask, lambda _: _WINDOWED.pop(key, None)), window)
    return mask


def _causal_mask(batch_size: int, q_length: int, kv_length: int, q_offset, kv_offset: int,
                 attention_mask: torch.Tensor | None, **kwargs) -> torch.Tensor | None:
    """`sparse_cp_mask`'s mask of a causal call (see there): the 2D padding mask, or None."""
    built = _cache_entry(attention_mask)
    if built is not None and built[1] == kv_length and built[3] == kv_offset:
        # (built here already: `generate` builds a compileable cache's mask before the forward, which builds its mask
        # again from it, as transformers returns a 4D mask as it is; read as a padding mask of the sequence's first
        # columns, a sliding layer's mask past the window lost its last slots)
        return attention_mask
    attention_mask = padding_columns_as_sdpa_reads(attention_mask, kv_length, kv_offset)
    mask = flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask,
                                **kwargs)
    if mask is None and kv_length != q_length:
        held = min(int(q_offset) + q_length - kv_offset, kv_length)
        mask = torch.ones(batch_size, held, dtype=torch.bool, device=kwargs.get("device"))
    if kv_length != q_length:
        # (contiguous: `generate` makes a compileable cache's masks contiguous, which would copy the column slice of a
        # sliding layer's mask, and the copy would not be the object recorded here)
        mask = mask.contiguous()
        _record_cache_call(mask, kv_length, q_offset + q_length, kv_offset)
    return mask


def _record_cache_call(mask: torch.Tensor, kv_length: int, tokens_held, kv_offset: int) -> None:
    """Keep the key length, the tokens held and the key offset `mask` was built for through a cache (`_CACHE_KEYS`)."""
    key = id(mask)
    _CACHE_KEYS[key] = [weakref.ref(mask, lambda _: _CACHE_KEYS.pop(key, None)), kv_length, tokens_held, kv_offset]


def padding_columns_as_sdpa_reads(attention_mask: torch.Tensor | None, kv_length: int, kv_offset: int
                                  ) -> torch.Tensor | None:
    """The 2D padding mask cut or zero-padded to the `kv_offset + kv_length` columns transformers' SDPA and eager
    masks read (`prepare_padding_mask`, `padding_mask_function`): column i is the token at position i of the
    sequence the cache holds, so a mask longer than the tokens seen is read by its first columns, and a shorter one
    makes the tokens past it padding. Flash-attention's mask function reads the last `kv_length` columns, which are
    those only for a mask of the tokens' length. Without a cache `kv_length` is the mask's own length (unchanged: a
    mask of another length than the input's is refused, `tokens.check_padding_mask`); a StaticCache's columns past
    its tokens are unfilled slots (`cache_slots_held`)."""
    if attention_mask is None or attention_mask.dim() != 2:
        return attention_mask
    extra = kv_offset + kv_length - attention_mask.shape[-1]
    if extra < 0:
        return attention_mask[:, :kv_offset + kv_length]
    return torch.nn.functional.pad(attention_mask, (0, extra)) if extra else attention_mask


def _sees_next_key(mask_function, batch_size: int, q_length: int, kv_length: int, q_offset, kv_offset: int,
                   device, config=None) -> bool:
    """Whether transformers' index-based `mask_function` lets some query see the key right after it (its position
    plus one, among the call's keys), which no causal mask does. transformers' causal function and its compositions
    that keep it (`_causal_composition`) are known not to; any other (a model's own) is evaluated, as transformers'
    SDPA mask evaluates it by broadcasting, on those B x q_length pairs only, once per mask (a forward). A probe
    forward on the meta device evaluates it on the CPU; a function of meta tensors is not read. Under torch.compile
    (whose dynamo before 2.13 cannot read a closure) the evaluation stays in the graph, and so does its refusal
    (`refuse_next_key`, an op the graph keeps): reading the answer here would break the graph."""
    if mask_function is None or (not torch.compiler.is_compiling() and _causal_composition(mask_function) == "causal"):
        return False
    device = torch.device("cpu" if device is None or torch.device(device).type == "meta" else device)
    batch = torch.arange(batch_size, device=device)[:, None]
    query = (torch.arange(q_length, device=device) + q_offset)[None, :]
    key = (query + 1).clamp(kv_offset, kv_offset + kv_length - 1)  # (no key after the last: `key > query` below)
    sees = torch.as_tensor(mask_function(batch, torch.zeros_like(batch), query, key))
    if sees.device.type == "meta":
        return False
    sees = (sees & (key > query).to(sees.device)).any()
    if torch.compiler.is_compiling():
        # (a torch without ordered effects would drop the op from the graph: run outside it there, a graph break)
        refuse = refuse_next_key if _REFUSED_IN_GRAPHS else _refuse_next_key_outside_graphs
        refuse(sees, getattr(config, "model_type", "unknown"), getattr(config, "base_config_key", None))
        return False
    return bool(sees)


_REFUSE_NEXT_KEY = "hf_sparse_cp::refuse_next_key"


@torch.library.custom_op(_REFUSE_NEXT_KEY, mutates_args=())
def refuse_next_key(sees: torch.Tensor, model_type: str, base_config_key: str | None) -> None:
    """Raise `NonCausalMask` where `sees` (a mask function's answer, `_sees_next_key`) holds, for a model of
    `model_type` (and tower `base_config_key`, `composite.tower_refusal`). An ordered side effect of a compiled
    forward's mask build (`upstream.register_ordered_effect`: the graph keeps it though it returns nothing), which
    before handed the answer to its first attention call on a list: a Python side effect, which the trace of an
    activation-checkpointed layer refuses (that layer then ran outside the graph)."""
    if bool(sees):
        raise NonCausalMask(SimpleNamespace(model_type=model_type, base_config_key=base_config_key), "next key")


@refuse_next_key.register_fake
def _(sees, model_type, base_config_key):
    return None


_REFUSED_IN_GRAPHS = register_ordered_effect(_REFUSE_NEXT_KEY)


@torch.compiler.disable
def _refuse_next_key_outside_graphs(sees: torch.Tensor, model_type: str, base_config_key: str | None) -> None:
    refuse_next_key(sees, model_type, base_config_key)


# transformers' compositions of mask functions (masking_utils), by qualified name, and the closure variable that holds
# their parts. (An and-mask sees a pair only where each part does; positions remapped per packed document compare
# positions, which restart at each document.)
_AND, _AND_PARTS = "and_masks.<locals>.and_mask", "mask_functions"
_REMAPPED, _REMAPPED_PART = "remap_positions_for_packed_sequence.<locals>.inner_mask", "mask_function"
_PACKED_DOCUMENTS = "packed_sequence_mask_function.<locals>.inner_mask"


def _masking_utils_name(function) -> str | None:
    """The qualified name of a function of transformers' masking_utils, None for any other."""
    return getattr(function, "__qualname__", None) if getattr(function, "__module__", None) == \
        "transformers.masking_utils" else None


def _closure_value(function, name: str):
    names, cells = getattr(function.__code__, "co_freevars", ()), function.__closure__ or ()
    return cells[names.index(name)].cell_contents if name in names else None


def _causal_composition(function) -> str | None:
    """What is known of a mask function without evaluating it: 'causal' for transformers' causal function and an
    and-mask of transformers' that has a causal part (a window's, a chunk's, a packed batch's: it never sees a later
    key); 'within documents' for the causal function on positions remapped per packed document (it sees the first key
    of the next document, which transformers always ands with the documents' own mask of the same positions: the
    and-mask is then causal); None for anything else (evaluated)."""
    if function is causal_mask_function:
        return "causal"
    name = _masking_utils_name(function)
    if name == _AND and isinstance(parts := _closure_value(function, _AND_PARTS), tuple):
        kinds = [_causal_composition(part) for part in parts]
        packed = any(_masking_utils_name(part) == _PACKED_DOCUMENTS for part in parts)
        return "causal" if "causal" in kinds or ("within documents" in kinds and packed) else None
    if name == _REMAPPED and _causal_composition(_closure_value(function, _REMAPPED_PART)) == "causal":
        return "within documents"
    return None


# The sliding window of each mask `sparse_cp_mask` built from a window that the model's own forward never builds
# (`_generated_window`), by id (a weak reference checks that the mask is the same object; the entry goes with it).
_WINDOWED: dict[int, tuple[weakref.ref, int]] = {}
_SLIDING_OVERLAY = "sliding_window_overlay.<locals>.inner_mask"


def mask_window(attention_mask: torch.Tensor | None) -> int | None:
    """The sliding window `attention_mask` (or the mask it is a view of, of the same shape) carries where
    `sparse_cp_mask` built it from generate's window for a model whose own forward builds none (`_generated_window`),
    else None."""
    entry = _recorded(_WINDOWED, attention_mask)
    return None if entry is None else entry[1]


def _generated_window(function, attention_mask: torch.Tensor | None, config) -> int | None:
    """The sliding window of a mask that transformers' `generate` builds from `config.sliding_window`
    (`create_masks_for_generate`, for a compileable cache: a StaticCache) for a model whose own forward never builds
    one (no `layer_types`, `builds_sliding_window_mask` False: a Llama config that carries the field): its mask
    function's window, or that of generate's mask the forward builds its own from. None for any other mask, and
    under torch.compile (not read: `call_refusals.mask_only_window` then refuses beyond the field, as before)."""
    if (torch.compiler.is_compiling() or getattr(config, "layer_types", None) is not None
            or builds_sliding_window_mask(config) is not False):
        return None
    window = _function_window(function)
    return mask_window(attention_mask) if window is None else window


def _function_window(function) -> int | None:
    """The window of transformers' `sliding_window_overlay` in mask `function` (alone or in an and-mask: the
    narrowest), or None."""
    name = _masking_utils_name(function)
    if name == _SLIDING_OVERLAY:
        window = _closure_value(function, "sliding_window")
        return window if isinstance(window, int) and not isinstance(window, bool) else None
    if name == _AND and isinstance(parts := _closure_value(function, _AND_PARTS), tuple):
        windows = [w for w in map(_function_window, parts) if w is not None]
        return min(windows) if windows else None
    return None


# The masks `sparse_cp_mask` built from transformers' bidirectional mask function, by id (a weak reference checks
# that the mask is the same object). The attention call handed one refuses it (`is_bidirectional_mask`), not the mask
# function: a BART-family decoder builds its cross-attention's mask at every forward, which a decoder-only forward
# never hands to a layer.
_BIDIRECTIONAL: dict[int, weakref.ref] = {}


def is_bidirectional_mask(attention_mask: torch.Tensor | None) -> bool:
    """Whether `attention_mask` is one `sparse_cp_mask` built for transformers' bidirectional mask (an encoder's,
    cross-attention's, a decoder's with `config.is_causal=False`)."""
    ref = _BIDIRECTIONAL.get(id(attention_mask))
    return ref is not None and ref() is attention_mask


# The key length, the tokens held (`cache_tokens_held`: an int, or a StaticCache's offset tensor plus an int, read
# once, when first asked for) and the key offset of each mask `sparse_cp_mask` built for a call through a KV cache, by
# the mask's id (a weak reference checks that the mask is the same object; the entry goes with it).
_CACHE_KEYS: dict[int, list] = {}


def cache_key_length(attention_mask: torch.Tensor | None) -> int | None:
    """The number of keys the KV cache gives the attention calls that receive `attention_mask` (the `kv_length` that
    transformers built the mask for from the cache), or None when the mask was not built for a call through a cache
    (no cache, or one that holds no earlier token)."""
    entry = _cache_entry(attention_mask)
    return None if entry is None else entry[1]


def cache_tokens_held(attention_mask: torch.Tensor | None) -> int | None:
    """The number of tokens (padding included) the KV cache holds once it has taken the queries of the calls that
    receive `attention_mask` (the queries' offset in the cache plus their number), or None as `cache_key_length`."""
    entry = _cache_entry(attention_mask)
    if entry is None:
        return None
    entry[2] = int(entry[2])  # (a StaticCache's offset is a tensor: read back once per mask, not once per layer)
    return entry[2]


def cache_slots_held(attention_mask: torch.Tensor | None) -> int | None:
    """How many of a cache call's key slots hold tokens (`cache_tokens_held` less the tokens the cache no longer hands
    the call: a sliding layer's keys start at `kv_offset`), or None as `cache_key_length`. A StaticCache's later slots
    hold none: its mask covers them too (`padding_columns_as_sdpa_reads`), but they are not tokens."""
    held = cache_tokens_held(attention_mask)
    return None if held is None else held - _cache_entry(attention_mask)[3]


def _cache_entry(attention_mask: torch.Tensor | None) -> list | None:
    return _recorded(_CACHE_KEYS, attention_mask)


def _recorded(registry: dict, attention_mask: torch.Tensor | None):
    """The entry of `registry` (by id, its first item a weak reference to the mask) of `attention_mask`, or of the mask
    it is a view of with the same shape (GPT-2's forward takes `attention_mask.view(batch, -1)` of the mask generate
    built), or None."""
    for mask in (attention_mask, getattr(attention_mask, "_base", None)):
        entry = None if mask is None else registry.get(id(mask))
        if entry is not None and entry[0]() is mask and mask.shape == attention_mask.shape:
            return entry
    return None


def cache_slots_mask(attention_mask: torch.Tensor | None, held: int, k_len: int) -> torch.Tensor | None:
    """The 2D mask of a call's `k_len` key slots: the mask's first `held` columns (those of the slots holding tokens,
    `cache_slots_held`), followed by zeros for the slots a StaticCache has not filled yet."""
    if attention_mask is None:
        return None
    filled = attention_mask[:, :held]
    return torch.cat([filled, filled.new_zeros(filled.shape[0], k_len - held)], -1) if held < k_len else filled


class PerForward:
    """One value computed from the tensors transformers hands every layer of a forward (the same objects: the 2D
    mask, `position_ids`, `cu_seq_lens_k`), kept until a call brings other tensors (by identity and in-place
    version) or another `extra` key: what it reads back to the host is read once per forward, not once per layer."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._refs: tuple = ()
        self._value = None

    def get(self, extra: tuple, tensors: tuple, compute: Callable):
        key = (extra, tuple(None if t is None else (id(t), write_version(t)) for t in tensors))
        if self._key == key and all((ref is None) == (t is None) and (ref is None or ref() is t)
                                    for ref, t in zip(self._refs, tensors)):
            return self._value
        value = compute()
        self._key, self._refs, self._value = key, tuple(None if t is None else weakref.ref(t) for t in tensors), value
        return value


_GAPS, _METAS = PerForward(), PerForward()


def padding_between_tokens_once(attention_mask: torch.Tensor | None) -> int | None:
    """`tokens.padding_between_tokens`, read once per forward's mask."""
    if attention_mask is None:
        return None
    return _GAPS.get((), (attention_mask,), lambda: padding_between_tokens(attention_mask))


_READ_ROWS = PerForward()


def padding_rows_once(meta: TokenMeta, rows: torch.Tensor | None) -> torch.Tensor | None:
    """`rows` (bool [B]: the rows whose padding queries a head reads, `heads.pass_padding_rows_on`) where one of them
    has padding after its tokens by `meta` (its documents, read back once per forward), else None: a call with no
    such padding query runs as for a language model (a dense one on a library kernel). Read once per forward."""
    if rows is None:
        return None
    return _READ_ROWS.get((), (meta.segment, rows), lambda: rows if rows_pad_after_tokens(meta, rows) else None)


def batch_token_meta(batch: int, seq_len: int, device: torch.device, attention_mask: torch.Tensor | None,
                     kwargs: dict) -> TokenMeta:
    """`token_meta_from_kwargs`, one object per forward: the layers share it, and with it the documents it reads
    back to the host once (`TokenMeta.documents`)."""
    sources = (attention_mask, kwargs.get("cu_seq_lens_k"), kwargs.get("position_ids"))
    return _METAS.get((batch, seq_len, device), sources,
                      lambda: token_meta_from_kwargs(batch, seq_len, device, attention_mask, kwargs))


def every_key_call(batch: int, q_len: int, k_len: int, device: torch.device, attention_mask: torch.Tensor | None,
                   kwargs: dict, block_size: int) -> tuple[TokenMeta, TokenMeta, SparseLayout]:
    """(q_meta, k_meta, layout) of a call that attends densely over every key block, each pair's visibility from its
    tokens: a call through a KV cache (decoding, a chunk of prefill), or one with padding between a row's tokens,
    which the pattern's documents cannot hold (`padding_between_tokens`). The queries are the last q_len of the
    tokens the cache holds, its first `held` key slots (`cache_slots_held`: a StaticCache's later slots hold none, and
    are padding here); padding queries see the tokens before them, as SDPA's do (the loss may read them)."""
    held = cache_slots_held(attention_mask)
    if held is None:  # (no cache: the keys are the queries' tokens, which the mask covers)
        held = k_len if attention_mask is None else attention_mask.shape[-1]
    held = min(held, k_len)
    k_meta = token_meta_from_kwargs(batch, k_len, device, cache_slots_mask(attention_mask, held, k_len),
                                    kwargs if q_len == k_len else {})
    seen = padding_queries_see_prior_tokens(k_meta)
    q_meta = TokenMeta(seen.index[:, held - q_len:held], seen.segment[:, held - q_len:held])
    nqb, nkb = -(-q_len // block_size), -(-k_len // block_size)
    blk = torch.arange(nkb, dtype=torch.int32, device=device).expand(batch, 1, nqb, nkb)
    cnt = torch.full((batch, 1, nqb), nkb, dtype=torch.int32, device=device)
    return q_meta, k_meta, SparseLayout.from_blocks(blk, cnt, block_size)
