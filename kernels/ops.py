"""The Triton kernels as `torch.library` custom ops, and the raw-tensor functions built on them.

Custom ops (composable with torch.compile; each has a fake implementation for tracing):

* `hf_sparse_cp::block_sparse_attn_fwd`: (out, lse fp32) of a layout; out in fp32, or in the
  input dtype laid out as transformers' [B, S, H, D] (a [B, H, S, D] view of it);
* `hf_sparse_cp::block_sparse_attn_fwd_merge_`: the same, merged in place into an existing
  (out, lse) (ring attention: one pass per step, no separate merge);
* `hf_sparse_cp::block_sparse_attn_bwd`: (dq, dk, dv) in fp32, or in the input dtype laid out as
  [B, S, H, D] ([B, H, S, D] views).

The ops take the layout in the form the kernels read it (`indexing.LayoutSplit`: blocks full ones
first with their counts, the run of fully visible columns; the backward also the partial slots).
`triton_forward` / `triton_backward` pick the op, compute that split unless the caller passes the
one it keeps, make strides kernel-friendly and check what only the kernels require (dtype,
head_dim, merge buffers, device). They take raw tensors: the layout's
index tensors and the tokens' global index and document, as `hf_sparse_cp.attention.ops` unpacks
them from `SparseLayout` / `TokenMeta` after checking the input contract. This package imports
nothing from the rest of hf_sparse_cp.

The ops run the compiled kernels on CUDA tensors; CPU tensors are accepted only where Triton
interprets the kernels (`interpreter.interpreter_pool`: slow, for tests and debugging).
"""

from typing import Optional

import torch

from . import block_sparse_bwd, block_sparse_fwd
from .indexing import LayoutSplit, split_layout
from .limits import outside_limits, shared_memory_shortfall


def kernels_are_interpreted() -> bool:
    """Whether this process's kernels were decorated for Triton's interpreter (TRITON_INTERPRET=1)."""
    from triton.runtime.jit import JITFunction

    return not isinstance(block_sparse_fwd._forward_kernel, JITFunction)


def _launchers(device: torch.device):
    if device.type != "cuda" and not kernels_are_interpreted():
        raise ValueError(
            f"the Triton kernels run on CUDA tensors (got {device.type}): off CUDA use the reference engine "
            "(implementation='reference' of block_sparse_attention; a model's SparseAttentionConfig("
            "attention_engine='auto'), which takes it off CUDA), or run the kernels in Triton's interpreter "
            "(hf_sparse_cp.testing.interpreter.interpreter_pool)."
        )
    return block_sparse_fwd, block_sparse_bwd


@torch.library.custom_op("hf_sparse_cp::block_sparse_attn_fwd", mutates_args=())
def block_sparse_attn_fwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    block_idx: torch.Tensor, block_cnt: torch.Tensor, full_cnt: torch.Tensor,
    col_idx: torch.Tensor, col_cnt: torch.Tensor, col_full: torch.Tensor,
    q_index: torch.Tensor, q_segment: torch.Tensor, k_index: torch.Tensor, k_segment: torch.Tensor,
    scale: float, block_size: int, window: Optional[int], out_in_input_dtype: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    out = block_sparse_fwd.result_buffer(q, out_in_input_dtype)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
    _launchers(q.device)[0].forward(
        q, k, v, block_idx, block_cnt, full_cnt, col_idx, col_cnt, col_full, q_index, q_segment, k_index, k_segment,
        out, lse, scale=scale, block_size=block_size, window=window, merge=False,
    )
    return out, lse


@block_sparse_attn_fwd.register_fake
def _(q, k, v, block_idx, block_cnt, full_cnt, col_idx, col_cnt, col_full, q_index, q_segment, k_index, k_segment,
      scale, block_size, window, out_in_input_dtype):
    return block_sparse_fwd.result_buffer(q, out_in_input_dtype), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("hf_sparse_cp::block_sparse_attn_fwd_merge_", mutates_args=("out", "lse"))
def block_sparse_attn_fwd_merge_(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    block_idx: torch.Tensor, block_cnt: torch.Tensor, full_cnt: torch.Tensor,
    col_idx: torch.Tensor, col_cnt: torch.Tensor, col_full: torch.Tensor,
    q_index: torch.Tensor, q_segment: torch.Tensor, k_index: torch.Tensor, k_segment: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor,
    scale: float, block_size: int, window: Optional[int],
) -> None:
    _launchers(q.device)[0].forward(
        q, k, v, block_idx, block_cnt, full_cnt, col_idx, col_cnt, col_full, q_index, q_segment, k_index, k_segment,
        out, lse, scale=scale, block_size=block_size, window=window, merge=True,
    )


@block_sparse_attn_fwd_merge_.register_fake
def _(q, k, v, block_idx, block_cnt, full_cnt, col_idx, col_cnt, col_full, q_index, q_segment, k_index, k_segment,
      out, lse, scale, block_size, window):
    return None


@torch.library.custom_op("hf_sparse_cp::block_sparse_attn_bwd", mutates_args=())
def block_sparse_attn_bwd(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
    out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor, dlse: Optional[torch.Tensor],
    block_idx: torch.Tensor, block_cnt: torch.Tensor, full_cnt: torch.Tensor, partial: torch.Tensor,
    col_idx: torch.Tensor, col_cnt: torch.Tensor, col_full: torch.Tensor,
    q_index: torch.Tensor, q_segment: torch.Tensor, k_index: torch.Tensor, k_segment: torch.Tensor,
    scale: float, block_size: int, window: Optional[int], deterministic: bool, grads_in_input_dtype: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _launchers(q.device)[1].backward(
        q, k, v, out, lse, dout, dlse, block_idx, block_cnt, full_cnt, partial, col_idx, col_cnt, col_full, q_index,
        q_segment, k_index, k_segment, scale=scale, block_size=block_size, window=window,
        deterministic=deterministic, grads_in_input_dtype=grads_in_input_dtype,
    )


@block_sparse_attn_bwd.register_fake
def _(q, k, v, out, lse, dout, dlse, block_idx, block_cnt, full_cnt, partial, col_idx, col_cnt, col_full, q_index,
      q_segment, k_index, k_segment, scale, block_size, window, deterministic, grads_in_input_dtype):
    return tuple(block_sparse_fwd.result_buffer(x, grads_in_input_dtype) for x in (q, k, v))


def _unit_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check(q: torch.Tensor) -> None:
    reason = outside_limits(q)
    if reason is not None:
        raise ValueError(f"the Triton kernels cannot take {reason}; use implementation='reference' (fp64, larger "
                         "heads) or cast q, k, v.")
    reason = shared_memory_shortfall(q.device, q.shape[-1]) if q.is_cuda else None
    if reason is not None:
        raise ValueError(f"the Triton kernels cannot run on {reason}; use implementation='flex' or 'auto' "
                         "(--sparse_attention_engine), which computes these calls with FlexAttention.")


def triton_forward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    q_tokens: tuple[torch.Tensor, torch.Tensor],
    k_tokens: tuple[torch.Tensor, torch.Tensor],
    *,
    scale: float,
    block_size: int,
    window: int | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    out_in_input_dtype: bool = False,
    split: LayoutSplit | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Block-sparse attention forward on the Triton kernels.

    Args:
        q: [B, Hq, Sq, D]; k, v: [B, Hkv, Sk, D], Hq a multiple of Hkv, one dtype of `SUPPORTED_DTYPES`.
        layout: (block_idx [B, Hl, NQB, nb], block_cnt [B, Hl, NQB], col_idx [B, Hl, NQB, nc],
            col_cnt [B, Hl, NQB]), int32, the tensors of a `SparseLayout`.
        q_tokens, k_tokens: (global index int64 [B, S], document int32 [B, S]) of the queries / keys.
        scale: softmax scale; block_size: the layout's block; window: sliding window or None.
        out, lse: a running result to merge into in place (fp32 [B, Hq, Sq, D] with unit stride
            along D, contiguous fp32 [B, Hq, Sq]), or None for a fresh result.
        out_in_input_dtype: a fresh out is written in q's dtype, in [B, S, Hq, D] memory (returned
            as its [B, Hq, S, D] view), instead of fp32 (which a ring merges into).
        split: `indexing.split_layout` of this layout, tokens and window (computed here when None);
            callers that run a layout more than once compute it once.

    Returns:
        (out, lse fp32); the merge buffers themselves when given.
    """
    _check(q)
    q, k, v = _unit_stride(q), _unit_stride(k), _unit_stride(v)
    split = _split_of(layout, q_tokens, k_tokens, block_size, window, split)
    args = _kernel_layout(layout, split) + tuple(t.contiguous() for t in (*q_tokens, *k_tokens))
    if out is None and lse is None:
        return torch.ops.hf_sparse_cp.block_sparse_attn_fwd(q, k, v, *args, scale, block_size, window,
                                                             out_in_input_dtype)
    if out is None or lse is None:
        raise ValueError("pass both `out` and `lse` to merge into them, or neither.")
    if out.shape != q.shape or out.dtype != torch.float32 or out.stride(-1) != 1:
        raise ValueError(f"merge buffer `out` must be fp32 {tuple(q.shape)} with unit stride along D; got "
                         f"{out.dtype} {tuple(out.shape)}.")
    if lse.shape != q.shape[:3] or lse.dtype != torch.float32 or not lse.is_contiguous():
        raise ValueError(f"merge buffer `lse` must be a contiguous fp32 {tuple(q.shape[:3])}; got {lse.dtype} "
                         f"{tuple(lse.shape)}.")
    torch.ops.hf_sparse_cp.block_sparse_attn_fwd_merge_(q, k, v, *args, out, lse, scale, block_size, window)
    return out, lse


def triton_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
    q_tokens: tuple[torch.Tensor, torch.Tensor],
    k_tokens: tuple[torch.Tensor, torch.Tensor],
    *,
    scale: float,
    block_size: int,
    window: int | None = None,
    dlse: torch.Tensor | None = None,
    deterministic: bool | None = None,
    grads_in_input_dtype: bool = False,
    split: LayoutSplit | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Block-sparse attention backward on the Triton kernels.

    Args:
        q, k, v, layout, q_tokens, k_tokens, scale, block_size, window: as for `triton_forward`.
        out, lse: the *final* output [B, Hq, Sq, D] and log-sum-exp [B, Hq, Sq] of the queries (they
            may cover more keys than this layout: a ring step). dout: the gradient of out.
        dlse: the gradient reaching lse, or None.
        deterministic: bitwise reproducible column gradients (slower); None follows
            `torch.are_deterministic_algorithms_enabled()`. Block gradients and dq always are.
        grads_in_input_dtype: return the gradients in the inputs' dtype, in [B, S, H, D] memory
            ([B, H, S, D] views), instead of fp32 (which a ring sums over its steps).
        split: as for `triton_forward`.

    Returns:
        (dq [B, Hq, Sq, D], dk [B, Hkv, Sk, D], dv [B, Hkv, Sk, D]), fp32 unless `grads_in_input_dtype`.
    """
    _check(q)
    if out.shape != q.shape or dout.shape != q.shape or lse.shape != q.shape[:3]:
        raise ValueError(f"out/dout must be {tuple(q.shape)} and lse {tuple(q.shape[:3])}; got {tuple(out.shape)}, "
                         f"{tuple(dout.shape)}, {tuple(lse.shape)}.")
    if dlse is not None and dlse.shape != lse.shape:
        raise ValueError(f"dlse must be shaped like lse {tuple(lse.shape)}; got {tuple(dlse.shape)}.")
    if deterministic is None:
        deterministic = torch.are_deterministic_algorithms_enabled()
    # the kernels multiply dout with v in the inputs' dtype; other engines take a dout of any floating dtype
    q, k, v, out, dout = (_unit_stride(x) for x in (q, k, v, out, dout.to(q.dtype)))
    split = _split_of(layout, q_tokens, k_tokens, block_size, window, split)
    block_idx, block_cnt, full_cnt, *cols = _kernel_layout(layout, split)
    args = (block_idx, block_cnt, full_cnt, split.partial.contiguous(), *cols,
            *(t.contiguous() for t in (*q_tokens, *k_tokens)))
    return torch.ops.hf_sparse_cp.block_sparse_attn_bwd(
        q, k, v, out, lse.contiguous(), dout, None if dlse is None else dlse.contiguous(), *args,
        scale, block_size, window, bool(deterministic), grads_in_input_dtype,
    )


def _split_of(layout: tuple, q_tokens: tuple, k_tokens: tuple, block_size: int, window: int | None,
              split: LayoutSplit | None) -> LayoutSplit:
    """The given split, checked against the layout's shapes, or the layout's split computed now."""
    if split is None:
        return split_layout(*layout, *q_tokens, *k_tokens, block_size, window)
    block_idx, block_cnt, _, col_cnt = layout
    expected = (tuple(block_idx.shape), tuple(block_cnt.shape), tuple(block_idx.shape), (*col_cnt.shape, 2))
    if tuple(tuple(t.shape) for t in split) != expected:
        raise ValueError(f"the layout split's shapes {[tuple(t.shape) for t in split]} do not fit the layout "
                         f"{expected}: compute it with indexing.split_layout from this layout.")
    return split


def _kernel_layout(layout: tuple, split: LayoutSplit) -> tuple[torch.Tensor, ...]:
    """(block_idx full blocks first, block_cnt, full_cnt, col_idx, col_cnt, col_full), contiguous."""
    _, block_cnt, col_idx, col_cnt = layout
    return tuple(t.contiguous() for t in (split.block_idx, block_cnt, split.full_cnt, col_idx, col_cnt,
                                          split.col_full))
