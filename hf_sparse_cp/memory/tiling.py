"""A row-wise module computed in token tiles: its [tokens, features] intermediates never exist whole.

A decoder's MLP and RMSNorms treat every token on its own, so their training memory can be bounded
by a tile of tokens instead of the sequence (DeepSpeed ALST's tiled MLP). `tiled_rows` runs the
module tile by tile without autograd in forward, keeping only its input; backward runs each tile
again with autograd and takes that tile's gradients at once. The module's weight gradients are
summed over the tiles in fp32 (fp64 for fp64 weights) and returned once, through autograd, like any other gradient.

Memory, per token: the input (which the caller usually holds anyway) instead of every saved
intermediate (an MLP's four [tokens, intermediate] tensors, an RMSNorm's fp32 copy); the
intermediates of one tile at a time. Cost: one more forward of the module per backward.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..attention.precision import compute_dtype


def _tiles(n: int, tile: int):
    for start in range(0, n, tile):
        yield slice(start, min(n, start + tile))


class _TiledRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fn, tile, *params):
        rows = x.reshape(-1, x.shape[-1])
        out = None
        with torch.no_grad():
            for t in _tiles(rows.shape[0], tile):
                part = fn(rows[t])
                if out is None:  # the output is written tile by tile, never held twice
                    out = part.new_empty(rows.shape[0], part.shape[-1])
                out[t] = part
        ctx.fn, ctx.tile, ctx.params = fn, tile, params
        device = x.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(x)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad_out):
        (x,) = ctx.saved_tensors
        params = ctx.params
        wanted = [i for i, p in enumerate(params) if ctx.needs_input_grad[3 + i]]
        rows = x.detach().reshape(-1, x.shape[-1])
        grads = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = torch.empty_like(rows) if ctx.needs_input_grad[0] else None
        sums = {i: torch.zeros(params[i].shape, dtype=compute_dtype(params[i].dtype), device=params[i].device)
                for i in wanted}
        device, autocast, dtype = ctx.autocast
        for t in _tiles(rows.shape[0], ctx.tile):
            tile = rows[t].requires_grad_(grad_x is not None)
            with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=autocast):
                out = ctx.fn(tile)
            inputs = ([tile] if grad_x is not None else []) + [params[i] for i in wanted]
            tile_grads = torch.autograd.grad(out, inputs, grads[t], allow_unused=True)
            if grad_x is not None:
                grad_x[t] = tile_grads[0]
                tile_grads = tile_grads[1:]
            for i, g in zip(wanted, tile_grads):
                if g is not None:
                    sums[i] += g
        param_grads = [sums[i].to(p.dtype) if i in sums else None for i, p in enumerate(params)]
        return (None if grad_x is None else grad_x.view_as(x)), None, None, *param_grads


def tiled_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, params: Sequence[torch.Tensor],
               tile_tokens: int) -> torch.Tensor:
    """`fn(x)` computed `tile_tokens` rows at a time, with gradients as if computed whole.

    Args:
        fn: a function of [n, features] rows that treats every row on its own and reads no other
            state that changes between forward and backward (a module's bound `forward`: an MLP,
            an RMSNorm). Its randomness, if any, is not replayed: use it without dropout.
        x: [..., features]; every leading dimension is flattened into rows.
        params: the tensors `fn` reads that need gradients (the module's parameters).
        tile_tokens: rows per tile, >= 1.

    Returns:
        [..., out_features], `fn`'s output. Backward gives x and every parameter in `params` their
        gradients: x's per tile, the parameters' summed over the tiles in fp32 (fp64 for fp64
        parameters) and cast to their dtype once. Under autocast, backward recomputes under the
        autocast state of forward.
    """
    if tile_tokens < 1:
        raise ValueError(f"tile_tokens={tile_tokens} must be >= 1.")
    if not (torch.is_grad_enabled() and (x.requires_grad or any(p.requires_grad for p in params))):
        return fn(x)
    return _TiledRows.apply(x, fn, tile_tokens, *params)
