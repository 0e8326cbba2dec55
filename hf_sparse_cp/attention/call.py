"""One block-sparse attention call (`AttentionCall`): what every engine and its primitives take, from the
public op and the ring's steps down to the engines' forward and backward (the kernels take its raw tensors)."""

from __future__ import annotations

from typing import NamedTuple

import torch

from .layout import SparseLayout, check_attention_inputs
from .tokens import TokenMeta


class AttentionCall(NamedTuple):
    """One call: q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D] over the keys `layout` lists, with the softmax `scale`,
    the tokens' order and documents (`q_meta`, `k_meta`) and the layer's `sliding_window`."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    layout: SparseLayout
    scale: float
    q_meta: TokenMeta
    k_meta: TokenMeta
    sliding_window: int | None = None

    def check(self) -> None:
        check_attention_inputs(self.q, self.k, self.v, self.layout, self.q_meta, self.k_meta)

    def tokens(self) -> tuple[torch.Tensor, ...]:
        return self.q_meta.index, self.q_meta.segment, self.k_meta.index, self.k_meta.segment

