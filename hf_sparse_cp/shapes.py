"""The input contract of block-sparse attention, checked by every implementation (kernels and
reference) before any work: shapes, dtypes and devices only, so no check reads device memory."""

from __future__ import annotations

import torch

from .layout import SparseLayout
from .tokens import TokenMeta


def check_tensors(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError, naming the fix, unless q is [B, Hq, Sq, D] and k, v [B, Hkv, Sk, D] in one
    floating dtype on one device, with Hq a multiple of Hkv."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [batch, heads, seq, head_dim]; got {tuple(q.shape)}, "
                         f"{tuple(k.shape)}, {tuple(v.shape)} (transformers' layout: transpose [B, S, H, D] "
                         "with .transpose(1, 2)).")
    b, hq, sq, d = q.shape
    if k.shape != v.shape or k.shape[0] != b or k.shape[3] != d:
        raise ValueError(f"k and v must be [B, Hkv, Sk, {d}] with q's batch {b}; got k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}.")
    if hq % k.shape[1]:
        raise ValueError(f"query heads ({hq}) must be a multiple of key/value heads ({k.shape[1]}).")
    if not q.is_floating_point() or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype} (cast k and v "
                         "with .to(q.dtype)).")
    if k.device != q.device or v.device != q.device:
        raise ValueError(f"q, k, v must be on one device; got {q.device}, {k.device}, {v.device}.")


def check_attention_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: SparseLayout, q_meta: TokenMeta, k_meta: TokenMeta
) -> None:
    """`check_tensors`, and the layout and the token metadata fit them (same shapes, same device)."""
    check_tensors(q, k, v)
    b, hq, sq, _ = q.shape
    layout.check_fits(hq, sq, batch=b)
    for name, meta, length in (("q_meta", q_meta, sq), ("k_meta", k_meta, k.shape[2])):
        if meta.index.shape != (b, length) or meta.segment.shape != (b, length):
            raise ValueError(f"{name} must hold index and segment of shape [B, S] = {(b, length)}; got "
                             f"{tuple(meta.index.shape)} and {tuple(meta.segment.shape)}.")
    stray = {name: t.device for name, t in (("layout", layout.block_idx), ("q_meta", q_meta.index),
                                            ("k_meta", k_meta.index)) if t.device != q.device}
    if stray:
        raise ValueError(f"{', '.join(stray)} must be on q's device {q.device}; got {stray} (move them with .to()).")
