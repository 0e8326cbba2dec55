"""Block-sparse attention over a `SparseLayout`: the dispatching primitives, autograd, the public op.

Layers, bottom up:
* `attention_forward` / `attention_backward`: one forward / backward of a call (`call.AttentionCall`) by the
  engine `engines.resolve_engine` names (`engines.ENGINES`: the Triton kernels, FlexAttention, the PyTorch
  reference), which checks the input contract. Ring attention calls these once per ring step.
* `_BlockSparseAttention`: the autograd Function of the kernels and the reference; it saves tensors
  and calls the primitives (the Flex engine differentiates through Flex's own backward).
* `block_sparse_attention`: the documented public op.
"""

from __future__ import annotations

import math

import torch

from .call import AttentionCall
from .engines import ENGINES, resolve_engine
from .layout import SparseLayout, check_meta, check_scale, check_tensor_types, check_tensors, check_window
from .precision import autocast_inputs
from .tokens import TokenMeta


def attention_forward(
    call: AttentionCall,
    *,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    out_in_input_dtype: bool = False,
    implementation: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """One forward of `call` (no autograd).

    Args:
        call: q [B, Hq, Sq, D], k, v [B, Hkv, Sk, D] (Hq a multiple of Hkv, one floating dtype), the layout
            (which keys each query block reads: indices into k's sequence), the softmax scale, the global order
            and documents of queries and keys, and the sliding window (keys that many tokens or more before a
            query are invisible).
        out, lse: a running result over other keys, in the compute dtype, to merge this part into
            (the kernels merge in place, in the same pass; the reference through the log-sum-exp).
        out_in_input_dtype: return a fresh out in q's dtype (the kernels write it so, in transformers'
            [B, S, H, D] memory, returned as its [B, Hq, S, D] view) instead of the compute dtype.
        implementation: the engine: 'auto' (see `hf_sparse_cp.attention.engines`), 'triton', 'flex',
            'reference' or 'masked'.

    Returns:
        (out [B, Hq, Sq, D], lse [B, Hq, Sq]) in the compute dtype (fp32; fp64 for fp64 inputs), out in
        q's dtype with `out_in_input_dtype`.
        Queries that see no key get out = 0 and lse = -inf; a query with a non-finite score on a key
        it sees (NaN/Inf in q or in that key) gets NaN out and lse.
    """
    if (out is None) != (lse is None):
        raise ValueError("pass both `out` and `lse` to merge into them, or neither.")
    return ENGINES[resolve_engine(call.q, call.layout, implementation)].forward(call, out, lse, out_in_input_dtype)


def attention_backward(
    call: AttentionCall,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    *,
    dlse: torch.Tensor | None = None,
    deterministic: bool | None = None,
    grads_in_input_dtype: bool = False,
    implementation: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One backward of `call` (no autograd).

    Args:
        call, implementation: as for `attention_forward`.
        out, lse: the *final* output and log-sum-exp of the queries, which may cover more keys than
            this layout (ring attention): each key set contributes its exact share of the gradient.
        dout: gradient of out [B, Hq, Sq, D]; dlse: gradient reaching lse [B, Hq, Sq], or None.
        deterministic: kernels only: bitwise reproducible column gradients; None follows
            `torch.are_deterministic_algorithms_enabled()`. The flex engine runs each of its Flex calls
            again with autograd (CUDA only).
        grads_in_input_dtype: return the gradients in the inputs' dtype (the kernels write them so,
            in transformers' [B, S, H, D] memory) instead of the compute dtype.

    Returns:
        (dq [B, Hq, Sq, D], dk, dv [B, Hkv, Sk, D]) in the compute dtype, or the inputs' dtype.
    """
    # every engine's contract (the reference and the masked form failed deep inside on a misshapen one)
    shape = tuple(call.q.shape)
    if (tuple(out.shape), tuple(dout.shape), tuple(lse.shape)) != (shape, shape, shape[:3]) or (
            dlse is not None and tuple(dlse.shape) != shape[:3]):
        raise ValueError(f"out and dout must be shaped like q {shape}, lse and dlse {shape[:3]}; got out "
                         f"{tuple(out.shape)}, dout {tuple(dout.shape)}, lse {tuple(lse.shape)}, dlse "
                         f"{None if dlse is None else tuple(dlse.shape)}.")
    return ENGINES[resolve_engine(call.q, call.layout, implementation)].backward(call, out, lse, dout, dlse,
                                                                                deterministic, grads_in_input_dtype)


class _BlockSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, rest, engine):
        out, lse = ENGINES[engine].forward(AttentionCall(q, k, v, *rest), out_in_input_dtype=True)
        # the layout (and the kernels' split of it) goes with the saved tensors, not on ctx: gradient
        # checkpointing drops those after the forward (`SparseLayout.take_apart`)
        layout_tensors, skeleton = rest[0].take_apart()
        ctx.save_for_backward(q, k, v, out, lse, *layout_tensors)
        ctx.args = (skeleton, rest[1:], engine)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, *layout_tensors = ctx.saved_tensors
        skeleton, rest, engine = ctx.args
        call = AttentionCall(q, k, v, skeleton.restore(tuple(layout_tensors)), *rest)
        with torch.autocast(q.device.type, enabled=False):  # a backward called under autocast computes as forward did
            dq, dk, dv = ENGINES[engine].backward(call, out, lse, dout, dlse, grads_in_input_dtype=True)
        return dq, dk, dv, None, None


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
    check_layout: bool = True,
    implementation: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention over the keys `layout` lists, restricted to visible pairs. Differentiable.

    Args:
        q: [B, Hq, Sq, D]; k, v: [B, Hkv, Sk, D] with Hq a multiple of Hkv (no replication needed).
        layout: per query block, the key blocks and key columns to compute (`estimate_layout`,
            `build_layout`, `dense_layout`).
        scale: softmax scale (default 1 / sqrt(D)).
        q_meta / k_meta: global order and documents of the tokens (default: one causal document,
            queries and keys at the same positions).
        sliding_window: keys `sliding_window` or more tokens before the query are invisible
            (transformers' convention).
        check_layout: also check the layout's counts, index ranges and that it lists each key once per query block
            (reads it: device synchronizations); the attention backend, whose layouts are correct by construction,
            turns it off.
        Under autocast, q, k, v are cast to the autocast dtype (as SDPA takes them) and the
        computation itself runs with autocast off, in the compute dtype.
        implementation: the engine: 'auto' (the faster of the Triton kernels and FlexAttention on CUDA
            by a measured table, the PyTorch reference off CUDA; see `hf_sparse_cp.attention.engines`),
            'triton', 'flex' (differentiable through Flex's own backward, CUDA only), 'reference' or 'masked'.

    Returns:
        (out [B, Hq, Sq, D] in q's dtype, lse [B, Hq, Sq] in the compute dtype); from the kernels, out
        lies in transformers' [B, S, H, D] memory (`out.transpose(1, 2)` is contiguous). Queries that see
        no key get out = 0 and lse = -inf; a query with a non-finite score on a key it sees (NaN/Inf in
        q or in that key) gets NaN out and lse, never zeros. Gradients flow to q, k, v, also through lse.
    """
    check_tensor_types(q, k, v)
    if not isinstance(layout, SparseLayout):
        raise TypeError(f"layout must be a SparseLayout (from estimate_layout, build_layout or dense_layout); got "
                        f"{type(layout).__name__}.")
    check_window(sliding_window)
    check_scale(scale)
    check_meta("q_meta", q_meta)
    check_meta("k_meta", k_meta)
    q, k, v = autocast_inputs(q, k, v)
    check_tensors(q, k, v)
    b, hq, sq, d = q.shape
    if q_meta is None:
        q_meta = TokenMeta.contiguous(b, sq, q.device)
    if k_meta is None:
        k_meta = q_meta if k.shape[2] == sq else TokenMeta.contiguous(b, k.shape[2], q.device)
    if check_layout:
        layout.validate(hq, sq, k.shape[2])
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    engine = resolve_engine(q, layout, implementation)
    call = AttentionCall(q, k, v, layout, scale, q_meta, k_meta, sliding_window)
    with torch.autocast(q.device.type, enabled=False):
        if ENGINES[engine].differentiable:
            return ENGINES[engine].attention(call)
        return _BlockSparseAttention.apply(q, k, v, call[3:], engine)
