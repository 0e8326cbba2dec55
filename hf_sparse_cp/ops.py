"""Block-sparse attention over a `SparseLayout`: primitives, autograd, and the public function.

Layers, bottom up:
* forward/backward primitives (`sparse_attention_forward`, `sparse_attention_backward`) that pick
  the implementation by device: the Triton kernels of `hf_sparse_cp.kernels` on CUDA, the PyTorch
  reference (`hf_sparse_cp.reference`) elsewhere. Ring attention calls these per ring step.
* `_BlockSparseAttention`, an autograd Function that saves tensors and calls the primitives;
* `block_sparse_attention`, the documented public function with shape checks.
"""

from __future__ import annotations

import math
import warnings

import torch

from .layout import SparseLayout
from .merge import merge_attention
from .reference import reference_backward, reference_forward
from .shapes import check_tensors
from .tokens import TokenMeta


def _use_kernels(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """CUDA tensors the compiled kernels take go to them (imported lazily, so CPU-only use never
    imports triton); everything else to the PyTorch reference, with a warning on CUDA, where the
    reference is a slow surprise (fp64, head_dim above the kernels' maximum)."""
    if not q.is_cuda:
        return False
    from .kernels.ops import unsupported

    reason = unsupported(q)
    if reason is not None:
        warnings.warn(f"block-sparse attention on CUDA uses the PyTorch reference (slow) for {reason}.", stacklevel=3)
    return reason is None


def sparse_attention_forward(q, k, v, layout, *, scale, q_meta, k_meta, sliding_window=None, out=None, lse=None):
    """(out, lse) in the compute dtype (fp32; fp64 for fp64 inputs) for the keys the layout lists.

    With `out` and `lse` (a running result over other keys, in the compute dtype), this part is
    merged into them and the merged pair returned: the kernels merge in place in the same pass
    (a ring step costs no extra pass), the reference merges through the log-sum-exp afterwards.
    """
    if (out is None) != (lse is None):
        raise ValueError("pass both `out` and `lse` to merge into them, or neither.")
    if _use_kernels(q, k, v):
        from .kernels.ops import sparse_attention_forward as kernel_forward

        return kernel_forward(q, k, v, layout, scale=scale, q_meta=q_meta, k_meta=k_meta,
                              sliding_window=sliding_window, out=out, lse=lse)
    part = reference_forward(q, k, v, layout, scale=scale, q_meta=q_meta, k_meta=k_meta, sliding_window=sliding_window)
    return part if out is None else merge_attention(out, lse, *part)


def sparse_attention_backward(q, k, v, out, lse, dout, layout, *, scale, q_meta, k_meta, sliding_window=None, dlse=None):
    """(dq, dk, dv) in the compute dtype; `out`/`lse` are the final ones (see `reference_backward`)."""
    if _use_kernels(q, k, v):
        from .kernels.ops import sparse_attention_backward as kernel_backward

        return kernel_backward(
            q, k, v, out, lse, dout, layout,
            scale=scale, q_meta=q_meta, k_meta=k_meta, sliding_window=sliding_window, dlse=dlse,
        )
    return reference_backward(
        q, k, v, out, lse, dout, layout,
        scale=scale, q_meta=q_meta, k_meta=k_meta, sliding_window=sliding_window, dlse=dlse,
    )


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, q_meta, k_meta, scale, window):
        out, lse = sparse_attention_forward(q, k, v, layout, scale=scale, q_meta=q_meta, k_meta=k_meta,
                                            sliding_window=window)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.args = (layout, q_meta, k_meta, scale, window)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse = ctx.saved_tensors
        layout, q_meta, k_meta, scale, window = ctx.args
        dq, dk, dv = sparse_attention_backward(
            q, k, v, out, lse, dout, layout,
            scale=scale, q_meta=q_meta, k_meta=k_meta, sliding_window=window, dlse=dlse,
        )
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


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
    """Exact attention over the keys `layout` lists, restricted to visible pairs.

    q: [B, Hq, Sq, D]; k, v: [B, Hkv, Sk, D] with Hq a multiple of Hkv (no replication needed).
    q_meta / k_meta: global order and documents of the tokens (default: one causal document,
    queries and keys at the same positions). sliding_window: keys `sliding_window` or more tokens
    before the query are invisible (transformers' convention).

    Returns (out [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq] in the compute dtype). Queries that
    see no key get out = 0 and lse = -inf. Differentiable in q, k, v and through lse.
    """
    check_tensors(q, k, v)
    b, hq, sq, d = q.shape
    if q_meta is None:
        q_meta = TokenMeta.contiguous(b, sq, q.device)
    if k_meta is None:
        k_meta = q_meta if k.shape[2] == sq else TokenMeta.contiguous(b, k.shape[2], q.device)
    layout.validate(hq, sq, k.shape[2])  # the rest of the contract is checked by the implementation
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return _BlockSparseAttention.apply(q, k, v, layout, q_meta, k_meta, scale, sliding_window)
