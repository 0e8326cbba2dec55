"""FlexAttention (`torch.nn.attention.flex_attention`) as a second engine for block-sparse attention.

It computes the function the Triton kernels and the reference compute: exact softmax attention over
the keys a `SparseLayout` lists, restricted to the pairs `TokenMeta` makes visible (causal order,
documents, padding, sliding window). A layout becomes at most two Flex calls (`flex_calls`), merged
through their log-sum-exp like two ring steps:

* the listed key blocks: a `BlockMask` over the keys in Flex blocks of `FLEX_BLOCK` tokens (or the
  layout's block when larger; Flex's kernels tile at 128). A Flex block whose layout blocks are all
  listed and whose pairs are all visible is full (no mask evaluated there); one that holds some
  listed block is partial, and its `mask_mod` keeps the visible pairs of the listed layout blocks;
* the key columns: Flex cannot gather single keys, so the K/V rows of the columns are gathered into a
  buffer per key/value head (the union of the columns its query heads list, in key order), and a
  second BlockMask over that buffer lists per query block the buffer blocks holding one of its
  columns; its `mask_mod` keeps exactly that query block's columns (a bit set per query block), where
  visible.

The mask_mods encode the whole mask: Flex's eager path (CPU) evaluates them on every pair and ignores
the block lists, which only tell compiled Flex which tiles to visit. Every per-call tensor reaches
Flex inside the mask_mod closures and the BlockMask, per query head (a layout shared by all heads is
expanded), with the keys of the block lists padded to their full width: calls of one sequence length
and key-buffer size share one compiled graph (`flex_attention_compiled`).

Forward (`flex_forward`) and a differentiable single-process form (`flex_block_sparse_attention`,
Flex's own backward through both calls and the merge) serve `hf_sparse_cp.attention.ops`; the ring's
backward (`flex_backward`) takes the *final* out / lse of the queries, recomputes each Flex call of
the step with autograd and feeds it the gradient its part of the merge receives, so each ring step
contributes its exact share. Flex has no backward on CPU (torch refuses it); CUDA only there.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any

import torch

from ..backends import is_available
from ..kernels.indexing import block_summary, split_full_blocks
from .call import AttentionCall
from .layout import SparseLayout
from .merge import merge_attention
from .precision import compute_dtype
from .tokens import PAD_SEGMENT, TokenMeta

# Tokens per Flex block: Flex's kernels tile queries and keys by up to 128, and a BlockMask block must
# be a multiple of the tile.
FLEX_BLOCK = 128
# Compiled Flex graphs allowed per process: one per (grad mode, call kind, sequence length, key-buffer
# size); hitting it raises instead of Flex's silent fallback to its unfused eager path.
FLEX_RECOMPILE_LIMIT = 64


def is_flex_available() -> bool:
    """True when this torch has FlexAttention's BlockMask (checked once)."""
    return is_available("torch.nn.attention.flex_attention", "BlockMask")


@dataclass(frozen=True)
class FlexCall:
    """One Flex call of a layout: its BlockMask, and `keys` ([B, Hkv, P] int64 key rows gathered
    into the call's key buffer, padded), or None when the call reads k and v as they are."""

    block_mask: Any
    keys: torch.Tensor | None


def _dense(idx: torch.Tensor, cnt: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """bool [B, H, rows, cols]: the listed entries of index lists [B, H, R, N] (R <= rows)."""
    b, h, r, _ = idx.shape
    valid = torch.arange(idx.shape[-1], device=idx.device) < cnt.unsqueeze(-1)
    out = torch.zeros(b, h, rows, cols + 1, dtype=torch.bool, device=idx.device)
    out[:, :, :r].scatter_(-1, torch.where(valid, idx.long(), cols), True)
    return out[..., :cols]


def _coarse(mask: torch.Tensor, r_q: int, r_k: int, every: bool) -> torch.Tensor:
    """[B, H, NQ, NK] -> [B, H, NQ / r_q, NK / r_k]: whether any (or, with `every`, all) entries of each
    r_q x r_k tile are set."""
    b, h, nq, nk = mask.shape
    tiles = mask.view(b, h, nq // r_q, r_q, nk // r_k, r_k)
    return tiles.all(5).all(3) if every else tiles.any(5).any(3)


def _lists(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(counts int32 [...], indices int32 [..., N]) of the set entries of a bool [..., N] in ascending
    order, padded with 0 to the full width N (a width that only depends on the shapes)."""
    n = mask.shape[-1]
    slot = torch.where(mask, mask.cumsum(-1) - 1, n)
    idx = torch.zeros(*mask.shape[:-1], n + 1, dtype=torch.int32, device=mask.device)
    idx.scatter_(-1, slot, torch.arange(n, dtype=torch.int32, device=mask.device).expand_as(slot))
    return mask.sum(-1, dtype=torch.int32), idx[..., :n].contiguous()


def _visibility(q_meta: TokenMeta, window: int | None):
    """vis(b, q_idx, k_index, k_segment): whether a query sees a key (the reference's rule: the key not
    after the query, the same document, the query not padding, inside the window)."""
    q_index, q_seg = q_meta.index, q_meta.segment

    def vis(b, q_idx, k_index, k_seg):
        qi, qs = q_index[b, q_idx], q_seg[b, q_idx]
        seen = (k_index <= qi) & (k_seg == qs) & (qs != PAD_SEGMENT)
        if window is not None:
            seen = seen & (qi - k_index < window)
        return seen

    return vis


def _block_mask(partial: torch.Tensor, full: torch.Tensor | None, mask_mod, fb: int, q_len: int, kv_len: int,
                for_backward: bool):
    from torch.nn.attention.flex_attention import BlockMask

    cnt, idx = _lists(partial)
    full_cnt, full_idx = _lists(full) if full is not None else (None, None)
    return BlockMask.from_kv_blocks(cnt, idx, full_cnt, full_idx, BLOCK_SIZE=fb, mask_mod=mask_mod,
                                    seq_lengths=(q_len, kv_len), compute_q_blocks=for_backward)


def flex_calls(
    layout: SparseLayout,
    q_meta: TokenMeta,
    k_meta: TokenMeta,
    num_q_heads: int,
    num_kv_heads: int,
    *,
    sliding_window: int | None = None,
    for_backward: bool = True,
) -> list[FlexCall]:
    """The Flex calls that compute attention over `layout` (see the module docstring).

    Args:
        layout: the keys of each query block; q_meta [B, Sq] / k_meta [B, Sk]: the tokens.
        num_q_heads, num_kv_heads: of q and k (query head h reads key head h // (Hq / Hkv)).
        sliding_window: keys `sliding_window` or more tokens before a query are invisible.
        for_backward: also build the transposed block lists Flex's backward reads.

    Returns:
        Up to two `FlexCall`s: the listed blocks (when the layout has block slots), then the columns
        (when it lists any). One host synchronization (the size of the column buffer).
    """
    bs = layout.block_size
    fb = max(bs, FLEX_BLOCK)
    r = fb // bs
    group = num_q_heads // num_kv_heads
    q_len, k_len = q_meta.index.shape[1], k_meta.index.shape[1]
    nq_f, nk_f = -(-q_len // fb), -(-k_len // fb)
    qm, km = q_meta.pad_to(nq_f * fb), k_meta.pad_to(nk_f * fb)  # the mask_mods may read a tile's padded rows
    vis = _visibility(qm, sliding_window)
    heads = layout.head_index(num_q_heads).to(layout.block_idx.device)  # the layout head of each query head
    calls = []

    if layout.block_idx.shape[-1]:
        blk, full_cnt, _ = split_full_blocks(layout.block_idx, layout.block_cnt,
                                             block_summary(q_meta.index, q_meta.segment, bs),
                                             block_summary(k_meta.index, k_meta.segment, bs), sliding_window)
        listed = _dense(layout.block_idx, layout.block_cnt, nq_f * r, nk_f * r)[:, heads].contiguous()
        full = _dense(blk, full_cnt, nq_f * r, nk_f * r)[:, heads]
        full_f = _coarse(full, r, r, every=True)
        k_index, k_seg = km.index, km.segment

        def block_mod(b, h, q_idx, kv_idx):
            return listed[b, h, q_idx // bs, kv_idx // bs] & vis(b, q_idx, k_index[b, kv_idx], k_seg[b, kv_idx])

        partial_f = _coarse(listed, r, r, every=False) & ~full_f
        calls.append(FlexCall(_block_mask(partial_f, full_f, block_mod, fb, q_len, k_len, for_backward), None))

    column = _column_call(layout, k_meta, num_q_heads, num_kv_heads, heads, group, nq_f, fb, vis, q_len,
                          for_backward) if layout.col_idx.shape[-1] else None
    if column is not None:
        calls.append(column)
    return calls


def _column_call(layout: SparseLayout, k_meta: TokenMeta, num_q_heads: int, num_kv_heads: int, heads, group: int,
                 nq_f: int, fb: int, vis, q_len: int, for_backward: bool) -> FlexCall | None:
    """The call over the gathered columns (see `flex_calls`), or None when no column is listed."""
    bs, dev = layout.block_size, layout.col_idx.device
    b, hl, nqb, _ = layout.col_idx.shape
    k_len = k_meta.index.shape[1]
    valid = layout.valid_cols()
    col = torch.where(valid, layout.col_idx.long(), k_len)  # unused slots point past the keys
    # key/value head of each layout head (a shared layout: one buffer for all key heads)
    kv_of = torch.arange(hl, device=dev) // group if hl > 1 else torch.zeros(1, dtype=torch.long, device=dev)
    hu = num_kv_heads if hl > 1 else 1
    used = torch.zeros(b, hu, k_len + 1, dtype=torch.bool, device=dev)
    used[torch.arange(b, device=dev).view(-1, 1, 1, 1), kv_of.view(1, -1, 1, 1), col] = True
    used = used[..., :k_len]
    longest = int(used.sum(-1).max())
    if longest == 0:
        return None
    # buffer size: whole Flex blocks, a power of two of them (few distinct sizes, so few compiled graphs)
    size = fb * 2 ** math.ceil(math.log2(-(-longest // fb)))
    pos = used.cumsum(-1) - 1  # buffer position of each used key
    keys = torch.zeros(b, hu, size + 1, dtype=torch.long, device=dev)
    keys.scatter_(-1, torch.where(used, pos, size), torch.arange(k_len, device=dev).expand(b, hu, k_len))
    keys = keys[..., :size]
    filled = torch.arange(size, device=dev) < used.sum(-1, keepdim=True)
    flat = keys.flatten(1)
    c_index = torch.where(filled, k_meta.index.gather(1, flat).view(b, hu, size), torch.iinfo(torch.int64).max // 2)
    c_seg = torch.where(filled, k_meta.segment.gather(1, flat).view(b, hu, size), PAD_SEGMENT)
    c_index = c_index.expand(b, num_kv_heads, size).contiguous()
    c_seg = c_seg.expand(b, num_kv_heads, size).contiguous()

    # per (layout head, query block): the bit set of its columns' buffer positions, 32 to a word
    where = pos[:, kv_of].gather(-1, col.clamp_max(k_len - 1).flatten(2)).view_as(col)
    bits = torch.where(valid, torch.ones_like(where) << (where & 31), 0)
    words = torch.zeros(b, hl, nq_f * (fb // bs), size // 32, dtype=torch.int64, device=dev)
    words[:, :, :nqb].scatter_add_(-1, torch.where(valid, where >> 5, 0), bits)  # distinct bits: a sum is an OR
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)[:, heads].contiguous()

    def column_mod(b, h, q_idx, kv_idx):
        word = words[b, h, q_idx // bs, kv_idx // 32]
        kvh = h // group
        member = ((word >> (kv_idx % 32)) & 1) == 1
        return member & vis(b, q_idx, c_index[b, kvh, kv_idx], c_seg[b, kvh, kv_idx])

    hq = num_q_heads
    touched = (words.view(b, hq, nq_f * (fb // bs), size // fb, fb // 32) != 0).any(-1)
    partial_f = _coarse(touched, fb // bs, 1, every=False)
    keys = keys.expand(b, num_kv_heads, size)
    return FlexCall(_block_mask(partial_f, None, column_mod, fb, q_len, size, for_backward), keys)


@functools.cache
def flex_attention_compiled():
    """torch.compile'd flex_attention, one per process (static shapes: one graph per call shape)."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def _lse_request() -> dict:
    """Keyword asking flex_attention for the log-sum-exp: `return_aux` where this torch has it (it
    deprecates `return_lse`), else `return_lse`."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return {"return_lse": True}
    return {"return_aux": AuxRequest(lse=True)}


def recompile_guard():
    """A context in which compiled Flex raises at the recompile limit instead of falling back to Flex's
    unfused eager path, with the limit raised to FLEX_RECOMPILE_LIMIT (settings this torch knows only)."""
    settings = {"recompile_limit": FLEX_RECOMPILE_LIMIT, "fail_on_recompile_limit_hit": True}
    return torch._dynamo.config.patch(**{k: v for k, v in settings.items() if hasattr(torch._dynamo.config, k)})


def _attend(call: FlexCall, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float):
    """(out [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq], natural log) of one Flex call: compiled on
    CUDA, Flex's eager path elsewhere."""
    if call.keys is not None:
        rows = call.keys.unsqueeze(-1).expand(-1, -1, -1, k.shape[-1])
        k, v = k.gather(2, rows), v.gather(2, rows)
    kwargs = {"block_mask": call.block_mask, "scale": scale, "enable_gqa": True, **_lse_request()}
    if q.is_cuda:
        with recompile_guard():
            out, aux = flex_attention_compiled()(q, k, v, **kwargs)
    else:
        from torch.nn.attention.flex_attention import flex_attention

        out, aux = flex_attention(q, k, v, **kwargs)
    return out, getattr(aux, "lse", aux)


def _merged(parts: list, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The parts merged in the compute dtype (differentiable); nothing seen for no part."""
    dtype = compute_dtype(q.dtype)
    if not parts:
        return (q.new_zeros(q.shape, dtype=dtype),
                torch.full(q.shape[:3], float("-inf"), dtype=dtype, device=q.device))
    out, lse = parts[0][0].to(dtype), parts[0][1].to(dtype)
    for part in parts[1:]:
        out, lse = merge_attention(out, lse, *part)
    return out, lse


def flex_forward(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of `call` with FlexAttention (no autograd).

    Returns:
        (out [B, Hq, Sq, D], lse [B, Hq, Sq]) in the compute dtype; queries that see no key get out 0
        and lse -inf.
    """
    q, k, v = call.q, call.k, call.v
    calls = flex_calls(call.layout, call.q_meta, call.k_meta, q.shape[1], k.shape[1],
                       sliding_window=call.sliding_window, for_backward=False)
    with torch.no_grad():
        return _merged([_attend(c, q.detach(), k.detach(), v.detach(), call.scale) for c in calls], q)


def flex_backward(call: AttentionCall, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                  dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of attention of `call`, given the queries' *final* out / lse (which may cover more keys:
    ring attention), with FlexAttention. CUDA only (torch has no Flex backward on CPU).

    Each Flex call i of the layout is run again with autograd; its part (out_i, lse_i) entered the
    final result with weight w_i = exp(lse_i - lse), so it receives dout_i = w_i dout and
    dlse_i = w_i (dout . (out_i - out) + dlse), with which Flex's backward gives exactly this key set's
    share of dq, dk, dv.

    Args:
        call: the call; out, lse: the final output [B, Hq, Sq, D] and log-sum-exp [B, Hq, Sq] of the queries.
        dout: gradient of out; dlse: gradient reaching lse, or None.

    Returns:
        (dq [B, Hq, Sq, D], dk, dv [B, Hkv, Sk, D]) in the compute dtype.
    """
    q, k, v = call.q, call.k, call.v
    dtype = compute_dtype(q.dtype)
    calls = flex_calls(call.layout, call.q_meta, call.k_meta, q.shape[1], k.shape[1],
                       sliding_window=call.sliding_window)
    leaves = [x.detach().requires_grad_() for x in (q, k, v)]
    with torch.enable_grad():
        parts = [_attend(c, *leaves, call.scale) for c in calls]
    if not parts:
        return tuple(torch.zeros(x.shape, dtype=dtype, device=x.device) for x in (q, k, v))
    out, lse, dout = out.to(dtype), lse.to(dtype), dout.to(dtype)
    outputs, grads = [], []
    for out_i, lse_i in parts:
        w = torch.where(lse == float("-inf"), 0.0, torch.exp(lse_i.to(dtype) - lse))
        g_lse = (dout * (out_i.to(dtype) - out)).sum(-1)
        if dlse is not None:
            g_lse = g_lse + dlse.to(dtype)
        outputs += [out_i, lse_i]
        grads += [(w.unsqueeze(-1) * dout).to(out_i.dtype), (w * g_lse).to(lse_i.dtype)]
    got = torch.autograd.grad(outputs, leaves, grads, allow_unused=True)
    return tuple(torch.zeros(x.shape, dtype=dtype, device=x.device) if g is None else g.to(dtype)
                 for g, x in zip(got, (q, k, v)))


def flex_block_sparse_attention(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of `call` with FlexAttention, differentiable through Flex's own backward (both calls and their
    merge): what `block_sparse_attention` runs with the 'flex' engine.

    Returns:
        (out [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq] in the compute dtype). Gradients flow to q, k,
        v, also through lse; on CUDA only (torch has no Flex backward on CPU).
    """
    q, k, v = call.q, call.k, call.v
    needs_grad = torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v))
    if needs_grad and not q.is_cuda:
        raise ValueError("the flex engine computes gradients on CUDA only (torch has no FlexAttention backward on "
                         f"{q.device.type}): there use the reference engine (implementation='reference' of "
                         "block_sparse_attention; a model's SparseAttentionConfig(attention_engine='auto'), which "
                         "takes it off CUDA), or run under torch.no_grad().")
    calls = flex_calls(call.layout, call.q_meta, call.k_meta, q.shape[1], k.shape[1],
                       sliding_window=call.sliding_window, for_backward=needs_grad)
    inputs = (q, k, v) if needs_grad else (q.detach(), k.detach(), v.detach())  # Flex on CPU refuses requires_grad
    out, lse = _merged([_attend(c, *inputs, call.scale) for c in calls], q)
    return out.to(q.dtype), lse
