"""Exact attention over a `SparseLayout` by dense arithmetic: each chunk of query rows against the keys any of
its queries sees, with the keys the layout does not list (and the pairs `TokenMeta` hides) masked out.

It computes the function the kernels and the reference compute, and skips no work inside a chunk's key range:
it is never faster than dense attention. Where dense attention is cheap, on a CPU at a few thousand tokens,
its batched matmuls over whole key ranges still beat the reference's per-block key gathers by several times,
which makes it the engine for CPU experiments with a pattern at those lengths (`attention_engine="masked"`);
its memory per chunk grows with the sequence, so 'auto' never picks it. Arithmetic in the compute dtype (fp32;
fp64 for fp64 inputs), as the reference.
"""

from __future__ import annotations

import torch

from .call import AttentionCall
from .layout import SparseLayout
from .precision import compute_dtype
from .tokens import PAD_SEGMENT, TokenMeta

# Elements of a chunk's [B, Hq, rows, keys] score tensor.
CHUNK_ELEMENTS = 1 << 24


def _chunks(layout: SparseLayout, b: int, hq: int, sq: int, sk: int):
    """Query row ranges [r0, r1) of whole query blocks, each within CHUNK_ELEMENTS scores."""
    bs = layout.block_size
    step = max(1, CHUNK_ELEMENTS // max(1, b * hq * bs * sk)) * bs
    return [(r0, min(sq, r0 + step)) for r0 in range(0, sq, step)]


def _mask(layout: SparseLayout, hq: int, q_meta: TokenMeta, k_meta: TokenMeta, window: int | None, r0: int,
          r1: int) -> tuple[torch.Tensor, slice]:
    """(bool [B, Hq, r1 - r0, K] of the visible listed keys of query rows r0:r1, the key range K of every key
    any of them sees)."""
    bs, sk = layout.block_size, k_meta.index.shape[1]
    blocks = torch.arange(r0 // bs, -(-r1 // bs), device=layout.block_idx.device)
    listed = layout.select(blocks).to_mask(hq, len(blocks) * bs, sk)[:, :, : r1 - r0]
    qi, qs = q_meta.index[:, r0:r1, None], q_meta.segment[:, r0:r1, None]
    ki, ks = k_meta.index[:, None, :], k_meta.segment[:, None, :]
    seen = (ki <= qi) & (ks == qs) & (qs != PAD_SEGMENT)
    if window is not None:
        seen &= qi - ki < window
    mask = listed & seen.unsqueeze(1)
    keys = mask.flatten(0, 2).any(0).nonzero()
    span = slice(int(keys[0]), int(keys[-1]) + 1) if len(keys) else slice(0, 0)
    return mask[..., span], span


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float, mask: torch.Tensor) -> torch.Tensor:
    """Scaled scores [B, Hkv, G, R, K] of q [B, Hkv, G, R, D] against k [B, Hkv, K, D], invisible pairs -inf;
    an infinite score on a visible pair is made NaN (as the reference does: non-finite inputs must not pass
    for invisible keys)."""
    s = torch.matmul(q, k.unsqueeze(2).transpose(-1, -2)) * scale
    return s.masked_fill_(s.isinf(), float("nan")).masked_fill_(~mask, float("-inf"))


def _grouped(x: torch.Tensor, hk: int) -> torch.Tensor:
    """[B, Hq, S, ...] -> [B, Hkv, G, S, ...]: the query heads of each key/value head side by side."""
    return x.reshape(x.shape[0], hk, x.shape[1] // hk, *x.shape[2:])


def masked_forward(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of one call (`AttentionCall`) over the keys its layout lists, densely per chunk of query rows.

    Returns: as `reference.reference_forward` (out [B, Hq, Sq, D], lse [B, Hq, Sq] in the compute dtype; queries
    that see no key get out = 0 and lse = -inf, non-finite scores on seen keys NaN).
    """
    call.check()
    q, k, v, layout, scale = call.q, call.k, call.v, call.layout, call.scale
    b, hq, sq, d = q.shape
    hk, dtype = k.shape[1], compute_dtype(q.dtype)
    qg, kc, vc = _grouped(q.to(dtype), hk), k.to(dtype), v.to(dtype)
    out = torch.zeros(b, hk, hq // hk, sq, d, dtype=dtype, device=q.device)
    lse = torch.full((b, hk, hq // hk, sq), float("-inf"), dtype=dtype, device=q.device)
    for r0, r1 in _chunks(layout, b, hq, sq, k.shape[2]):
        mask, span = _mask(layout, hq, call.q_meta, call.k_meta, call.sliding_window, r0, r1)
        mask = _grouped(mask, hk)
        s = _scores(qg[:, :, :, r0:r1], kc[:, :, span], scale, mask)
        lse[..., r0:r1] = l = torch.logsumexp(s, dim=-1)
        p = torch.where(mask, torch.exp(s - l.unsqueeze(-1)), 0.0)
        out[:, :, :, r0:r1] = torch.matmul(p, vc[:, :, span].unsqueeze(2))
    return out.reshape(b, hq, sq, d), lse.reshape(b, hq, sq)


def masked_backward(call: AttentionCall, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                    dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `masked_forward(call)`, recomputing the probabilities per chunk from the *final* out and
    lse (which may cover more keys than this layout: ring attention).

    Args and Returns: as `reference.reference_backward`.
    """
    call.check()
    q, k, v, layout, scale = call.q, call.k, call.v, call.layout, call.scale
    b, hq, sq, d = q.shape
    hk, dtype = k.shape[1], compute_dtype(q.dtype)
    qg, kc, vc = _grouped(q.to(dtype), hk), k.to(dtype), v.to(dtype)
    dog, lg = _grouped(dout.to(dtype), hk), _grouped(lse.to(dtype), hk)
    delta = (_grouped(out.to(dtype), hk) * dog).sum(-1)
    if dlse is not None:
        delta = delta - _grouped(dlse.to(dtype), hk)
    dq = torch.zeros_like(qg)
    dk, dv = torch.zeros_like(kc), torch.zeros_like(vc)
    for r0, r1 in _chunks(layout, b, hq, sq, k.shape[2]):
        mask, span = _mask(layout, hq, call.q_meta, call.k_meta, call.sliding_window, r0, r1)
        mask = _grouped(mask, hk)
        qr, dor = qg[:, :, :, r0:r1], dog[:, :, :, r0:r1]
        p = torch.where(mask, torch.exp(_scores(qr, kc[:, :, span], scale, mask) - lg[..., r0:r1, None]), 0.0)
        dp = torch.matmul(dor, vc[:, :, span].unsqueeze(2).transpose(-1, -2))
        ds = p * (dp - delta[..., r0:r1, None]) * scale
        dq[:, :, :, r0:r1] = torch.matmul(ds, kc[:, :, span].unsqueeze(2))
        dk[:, :, span] += torch.einsum("bhgrk,bhgrd->bhkd", ds, qr)
        dv[:, :, span] += torch.einsum("bhgrk,bhgrd->bhkd", p, dor)
    return dq.reshape(b, hq, sq, d), dk, dv
