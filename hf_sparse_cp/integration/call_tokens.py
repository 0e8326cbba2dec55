"""What the backend reads from the masks and token tensors transformers hands an attention call: the mask function
registered with the backend (`sparse_cp_mask`), the key length a KV cache gives the call (`cache_key_length`), a
StaticCache's unfilled slots, and the token metadata every layer of a forward shares, read back to the host once per
forward (`PerForward`)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from transformers.masking_utils import flash_attention_mask

from ..attention.tokens import TokenMeta, padding_between_tokens, token_meta_from_kwargs


def sparse_cp_mask(batch_size: int, q_length: int, kv_length: int, q_offset=0, kv_offset: int = 0,
                   attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """The mask function registered with the backend: transformers' flash-attention one, which hands over the 2D
    padding mask of the tokens seen (None when none is padded); that mask is shorter than the keys when a cache has
    more key slots than tokens (a StaticCache: `kv_length` counts its slots). Where it would be None there, a mask
    of ones over the tokens held is returned instead, so that the backend always knows which slots hold none, and
    wherever the cache gives the keys of earlier tokens (`kv_length` above `q_length`) the mask is returned, and the
    key length it was built for is kept for the backend (`cache_key_length`).

    A mask that transformers combines from the causal one and a model's own overlay (`or_mask_function` /
    `and_mask_function`, for which it sets `use_vmap`, or a block overlay: bidirectional image tokens, a bidirectional
    text model) is refused: the backend computes causal attention, documents, windows and padding only. So is one
    that lets a query see the key after it (`_sees_next_key`): a block overlay under packing."""
    if (kwargs.get("use_vmap") or getattr(kwargs.get("mask_function"), "__name__", None) == "or_mask"
            or _sees_next_key(kwargs.get("mask_function"), batch_size, q_length, kv_length, kwargs.get("device"))):
        config = kwargs.get("config")
        raise ValueError(
            f"sparse_cp computes causal attention only, but this model (type "
            f"'{getattr(config, 'model_type', 'unknown')}') overlays its own mask on the causal one (an or/and mask "
            "function: e.g. bidirectional attention over image tokens, or a bidirectional text model); load it with "
            "attn_implementation='sdpa' (--sparse_attention false).")
    mask = flash_attention_mask(batch_size, q_length, kv_length, q_offset, kv_offset, attention_mask=attention_mask,
                                **kwargs)
    if mask is None and kv_length != q_length:
        held = min(int(q_offset) + q_length - kv_offset, kv_length)
        mask = torch.ones(batch_size, held, dtype=torch.bool, device=kwargs.get("device"))
    if kv_length != q_length:
        # (contiguous: `generate` makes a compileable cache's masks contiguous, which would copy the column slice of a
        # sliding layer's mask, and the copy would not be the object recorded here)
        mask = mask.contiguous()
        key = id(mask)
        _CACHE_KEYS[key] = weakref.ref(mask, lambda _: _CACHE_KEYS.pop(key, None)), kv_length, q_offset + q_length
    return mask


def _sees_next_key(mask_function, batch_size: int, q_length: int, kv_length: int, device) -> bool:
    """Whether transformers' index-based `mask_function` of a packed batch (an `and_mask` of the causal mask and the
    documents: the or-mask of a block overlay, HRM's bidirectional prefix, is then inside it) lets some query see the
    key right after it, which no causal mask does. Evaluated, as transformers' SDPA mask evaluates it by broadcasting,
    on those B x (S - 1) pairs only, once per mask (a forward)."""
    if getattr(mask_function, "__name__", None) != "and_mask" or q_length != kv_length or q_length < 2:
        return False
    batch = torch.arange(batch_size, device=device)[:, None]
    query = torch.arange(q_length - 1, device=device)[None, :]
    return bool(torch.as_tensor(mask_function(batch, torch.zeros_like(batch), query, query + 1)).any())


# The key length and the tokens held (`cache_tokens_held`: an int, or a StaticCache's offset tensor plus an int, read
# only when asked for) of each mask `sparse_cp_mask` built for a call through a KV cache, by the mask's id (a weak
# reference checks that the mask is the same object; the entry goes with it).
_CACHE_KEYS: dict[int, tuple[weakref.ref, int, object]] = {}


def cache_key_length(attention_mask: torch.Tensor | None) -> int | None:
    """The number of keys the KV cache gives the attention calls that receive `attention_mask` (the `kv_length` that
    transformers built the mask for from the cache), or None when the mask was not built for a call through a cache
    (no cache, or one that holds no earlier token)."""
    return _cache_entry(attention_mask)[0]


def cache_tokens_held(attention_mask: torch.Tensor | None) -> int | None:
    """The number of tokens (padding included) the KV cache holds once it has taken the queries of the calls that
    receive `attention_mask` (the queries' offset in the cache plus their number), or None as `cache_key_length`."""
    held = _cache_entry(attention_mask)[1]
    return None if held is None else int(held)


def _cache_entry(attention_mask: torch.Tensor | None) -> tuple:
    ref, kv_length, held = _CACHE_KEYS.get(id(attention_mask), (None, None, None))
    return (kv_length, held) if ref is not None and ref() is attention_mask else (None, None)


def cache_slots_mask(attention_mask: torch.Tensor | None, k_len: int) -> torch.Tensor | None:
    """The 2D mask of a call's `k_len` cache slots: its last `k_len` columns, or the whole mask followed by zeros for
    the slots a StaticCache has not filled yet (the mask covers the tokens it holds)."""
    if attention_mask is None or attention_mask.shape[-1] >= k_len:
        return attention_mask
    unfilled = attention_mask.new_zeros(attention_mask.shape[0], k_len - attention_mask.shape[-1])
    return torch.cat([attention_mask, unfilled], -1)


class PerForward:
    """One value computed from the tensors transformers hands every layer of a forward (the same objects: the 2D
    mask, `position_ids`, `cu_seq_lens_k`), kept until a call brings other tensors (by identity and in-place
    version) or another `extra` key: what it reads back to the host is read once per forward, not once per layer."""

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._refs: tuple = ()
        self._value = None

    def get(self, extra: tuple, tensors: tuple, compute: Callable):
        key = (extra, tuple(None if t is None else (id(t), t._version) for t in tensors))
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


def batch_token_meta(batch: int, seq_len: int, device: torch.device, attention_mask: torch.Tensor | None,
                     kwargs: dict) -> TokenMeta:
    """`token_meta_from_kwargs`, one object per forward: the layers share it, and with it the documents it reads
    back to the host once (`TokenMeta.documents`)."""
    sources = (attention_mask, kwargs.get("cu_seq_lens_k"), kwargs.get("position_ids"))
    return _METAS.get((batch, seq_len, device), sources,
                      lambda: token_meta_from_kwargs(batch, seq_len, device, attention_mask, kwargs))
