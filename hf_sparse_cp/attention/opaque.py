"""Attention over a given layout as one opaque `torch.library` custom op, for graphs torch.compile traces.

`hf_sparse_cp::layout_attention` runs an engine's forward (`engines.ENGINES`) on raw tensors: q, k, v, the layout's
four index tensors and the tokens' global order and documents. Its backward is a second op,
`hf_sparse_cp::layout_attention_backward`, registered as its gradient (`register_autograd`): it takes the saved inputs,
the output and its log-sum-exp, so the layout that the forward was given reaches the backward as the tensors
themselves, never estimated again. Both ops have fake implementations with the shapes and strides the real ones
return: out as transformers' [B, S, Hq, D] memory, lse [B, Hq, S] in the compute dtype, and the gradients in the
inputs' dtype laid out as [B, S, H, D] ([B, H, S, D] views), as the kernels write them (the reference's are copied
into that memory).

The engine is resolved inside each op from the same inputs (`engines.resolve_engine`), so forward and backward use
one engine. The Flex engine's backward runs its calls again with autograd (`flex.flex_backward`), as it does
eagerly."""

from __future__ import annotations

import torch

from .call import AttentionCall
from .engines import ENGINES, resolve_engine
from .layout import SparseLayout
from .precision import compute_dtype
from .tokens import TokenMeta


def _call(q, k, v, block_idx, block_cnt, col_idx, col_cnt, q_index, q_segment, k_index, k_segment, block_size,
          scale, sliding_window) -> AttentionCall:
    layout = SparseLayout(block_idx, block_cnt, col_idx, col_cnt, block_size)
    return AttentionCall(q, k, v, layout, scale, TokenMeta(q_index, q_segment), TokenMeta(k_index, k_segment),
                         sliding_window)


def _bshd(t: torch.Tensor) -> torch.Tensor:
    """t [B, H, S, D] in [B, S, H, D] memory (a no-op for what the kernels return)."""
    return t.transpose(1, 2).contiguous().transpose(1, 2)


@torch.library.custom_op("hf_sparse_cp::layout_attention", mutates_args=())
def layout_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_idx: torch.Tensor,
                     block_cnt: torch.Tensor, col_idx: torch.Tensor, col_cnt: torch.Tensor, q_index: torch.Tensor,
                     q_segment: torch.Tensor, k_index: torch.Tensor, k_segment: torch.Tensor, block_size: int,
                     scale: float, sliding_window: int | None, implementation: str
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """(out [B, S, Hq, D] in q's dtype, lse [B, Hq, S] in the compute dtype) of exact attention over the layout
    (`block_sparse_attention`'s contract, on raw tensors; the caller checked them)."""
    call = _call(q, k, v, block_idx, block_cnt, col_idx, col_cnt, q_index, q_segment, k_index, k_segment, block_size,
                 scale, sliding_window)
    engine = resolve_engine(q, call.layout, implementation)
    with torch.autocast(q.device.type, enabled=False):
        out, lse = ENGINES[engine].forward(call, out_in_input_dtype=True)
    return out.transpose(1, 2).contiguous(), lse.contiguous()


@layout_attention.register_fake
def _(q, k, v, block_idx, block_cnt, col_idx, col_cnt, q_index, q_segment, k_index, k_segment, block_size, scale,
      sliding_window, implementation):
    b, hq, s, d = q.shape
    return q.new_empty(b, s, hq, d), q.new_empty(b, hq, s, dtype=compute_dtype(q.dtype))


@torch.library.custom_op("hf_sparse_cp::layout_attention_backward", mutates_args=())
def layout_attention_backward(dout: torch.Tensor, dlse: torch.Tensor | None, q: torch.Tensor, k: torch.Tensor,
                              v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, block_idx: torch.Tensor,
                              block_cnt: torch.Tensor, col_idx: torch.Tensor, col_cnt: torch.Tensor,
                              q_index: torch.Tensor, q_segment: torch.Tensor, k_index: torch.Tensor,
                              k_segment: torch.Tensor, block_size: int, scale: float, sliding_window: int | None,
                              implementation: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of `layout_attention`, from the gradients of its out [B, S, Hq, D] and lse, in the inputs'
    dtype as [B, H, S, D] views of [B, S, H, D] memory."""
    call = _call(q, k, v, block_idx, block_cnt, col_idx, col_cnt, q_index, q_segment, k_index, k_segment, block_size,
                 scale, sliding_window)
    engine = resolve_engine(q, call.layout, implementation)
    with torch.autocast(q.device.type, enabled=False):
        grads = ENGINES[engine].backward(call, out.transpose(1, 2), lse, dout.transpose(1, 2), dlse,
                                         grads_in_input_dtype=True)
    return tuple(_bshd(g) for g in grads)


@layout_attention_backward.register_fake
def _(dout, dlse, q, k, v, out, lse, block_idx, block_cnt, col_idx, col_cnt, q_index, q_segment, k_index, k_segment,
      block_size, scale, sliding_window, implementation):
    return tuple(x.new_empty(x.shape[0], x.shape[2], x.shape[1], x.shape[3]).transpose(1, 2) for x in (q, k, v))


# The op's arguments after q, k, v: the layout, the tokens, then the settings.
_TENSORS, _SETTINGS = slice(3, 11), slice(11, 15)


def _setup_context(ctx, inputs, output) -> None:
    ctx.save_for_backward(*inputs[:3], *output, *inputs[_TENSORS])
    ctx.settings = inputs[_SETTINGS]


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, *rest = ctx.saved_tensors
    dq, dk, dv = layout_attention_backward(dout, dlse, q, k, v, out, lse, *rest, *ctx.settings)
    return (dq, dk, dv, *(None,) * 12)


layout_attention.register_autograd(_backward, setup_context=_setup_context)
