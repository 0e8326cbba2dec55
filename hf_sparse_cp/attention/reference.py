"""Exact attention restricted to a `SparseLayout`, in plain PyTorch (the kernels' fp32 reference).

Work proceeds in chunks of query blocks: each chunk gathers only the keys its layout lists, so
memory grows with the computed work, never with S^2. Backward recomputes the probabilities per
chunk (flash-attention style) from the saved output and log-sum-exp, and scatters dK/dV into the
key/value heads directly, so GQA needs no replicated K/V. Arithmetic is fp32 whatever the input
dtype (fp64 for fp64 inputs); outputs come back in the input dtype, the log-sum-exp in fp32 (fp64).
"""

from __future__ import annotations

import torch

from .call import AttentionCall
from .layout import valid_slots
from .precision import compute_dtype
from .tokens import PAD_SEGMENT

# Elements of the [B, H, chunk, block, keys] score tensor processed at once.
CHUNK_ELEMENTS = 1 << 24


class _Problem:
    """Shapes, padded tensors and per-chunk key gathering shared by forward and backward."""

    def __init__(self, call: AttentionCall):
        call.check()
        q, k, layout, window = call.q, call.k, call.layout, call.sliding_window
        b, hq, sq, d = q.shape
        hk, sk = k.shape[1], k.shape[2]
        self.b, self.hq, self.hk, self.sq, self.sk, self.d = b, hq, hk, sq, sk, d
        self.group = hq // hk
        self.dtype = compute_dtype(q.dtype)
        bs = self.bs = layout.block_size
        self.nqb = layout.num_q_blocks
        self.sq_pad, self.sk_pad = self.nqb * bs, -(-sk // bs) * bs
        self.layout = layout
        self.window = window
        self.q_meta = call.q_meta.pad_to(self.sq_pad)
        self.k_meta = call.k_meta.pad_to(self.sk_pad)
        self.lh = layout.head_index(hq).to(q.device)
        self.kv_head = torch.arange(hq, device=q.device) // self.group
        n_keys = layout.block_idx.shape[-1] * bs + layout.col_idx.shape[-1]
        self.n_keys = n_keys
        self.chunk = max(1, min(self.nqb, CHUNK_ELEMENTS // max(1, b * hq * bs * max(n_keys, 1))))

    def chunks(self):
        for c0 in range(0, self.nqb, self.chunk):
            yield c0, min(self.nqb, c0 + self.chunk)

    def pad_q(self, x: torch.Tensor) -> torch.Tensor:
        """[B, H, Sq, ...] -> [B, H, NQB, bs, ...] in the compute dtype."""
        x = x.to(self.dtype)
        if self.sq_pad != self.sq:
            x = torch.nn.functional.pad(x, (0,) * (2 * (x.dim() - 3)) + (0, self.sq_pad - self.sq))
        return x.reshape(self.b, x.shape[1], self.nqb, self.bs, *x.shape[3:])

    def keys(self, c0: int, c1: int):
        """Key token indices [B, Hq, C, N] and the visibility mask [B, Hq, C, bs, N] of a chunk."""
        lay = self.layout
        bs = self.bs
        blk = lay.block_idx[:, :, c0:c1].long()[:, self.lh]
        bcnt = lay.block_cnt[:, :, c0:c1].long()[:, self.lh]
        col = lay.col_idx[:, :, c0:c1].long()[:, self.lh]
        ccnt = lay.col_cnt[:, :, c0:c1].long()[:, self.lh]
        dev = blk.device
        blk_ok = valid_slots(blk, bcnt)
        tok = (blk.clamp_min(0).unsqueeze(-1) * bs + torch.arange(bs, device=dev)).flatten(-2)
        tok_ok = blk_ok.repeat_interleave(bs, dim=-1)
        col_ok = valid_slots(col, ccnt)
        idx = torch.cat([tok, col.clamp_min(0)], -1)
        ok = torch.cat([tok_ok, col_ok], -1)

        b_ar = torch.arange(self.b, device=dev)[:, None]
        k_index = self.k_meta.index[b_ar, idx.flatten(1)].view(idx.shape)
        k_seg = self.k_meta.segment[b_ar, idx.flatten(1)].view(idx.shape)
        q_index = self.q_meta.index[:, c0 * bs : c1 * bs].view(self.b, 1, c1 - c0, bs, 1)
        q_seg = self.q_meta.segment[:, c0 * bs : c1 * bs].view(self.b, 1, c1 - c0, bs, 1)
        k_index, k_seg = k_index.unsqueeze(-2), k_seg.unsqueeze(-2)
        vis = ok.unsqueeze(-2) & (k_index <= q_index) & (k_seg == q_seg) & (q_seg != PAD_SEGMENT)
        if self.window is not None:
            vis &= q_index - k_index < self.window
        return idx, vis

    def gather(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """Rows of a [B, Hk, Sk, D] tensor at key indices [B, Hq, C, N] -> [B, Hq, C, N, D], compute dtype."""
        flat = self.flat_index(idx).flatten()
        return x.reshape(-1, x.shape[-1]).index_select(0, flat).view(*idx.shape, x.shape[-1]).to(self.dtype)

    def flat_index(self, idx: torch.Tensor) -> torch.Tensor:
        b_off = torch.arange(self.b, device=idx.device).view(-1, 1, 1, 1) * (self.hk * self.sk)
        h_off = self.kv_head.view(1, -1, 1, 1) * self.sk
        return b_off + h_off + idx.clamp_max(self.sk - 1)


def _scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Scaled scores [B, H, C, bs, N]; an infinite score is made NaN. Only non-finite inputs give
    one, and -inf would otherwise pass for an invisible key: a query whose visible keys all
    scored -inf would get out = 0 as if it saw nothing, hiding the divergence."""
    s = torch.einsum("bhcqd,bhcnd->bhcqn", q, k) * scale
    return s.masked_fill_(s.isinf(), float("nan"))


def _probs(scores: torch.Tensor, vis: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    # Only invisible pairs are zeroed: a query that sees no key has no visible pair (lse = -inf),
    # and a NaN lse (non-finite inputs) must give NaN probabilities, not zeros.
    return torch.where(vis, torch.exp(scores - lse.unsqueeze(-1)), 0.0)


def _forward(q, k, v, prob: _Problem, scale: float):
    out = torch.empty(prob.b, prob.hq, prob.nqb, prob.bs, prob.d, dtype=prob.dtype, device=q.device)
    lse = torch.empty(prob.b, prob.hq, prob.nqb, prob.bs, dtype=prob.dtype, device=q.device)
    qp = prob.pad_q(q)
    for c0, c1 in prob.chunks():
        idx, vis = prob.keys(c0, c1)
        kc, vc = prob.gather(k, idx), prob.gather(v, idx)
        s = _scores(qp[:, :, c0:c1], kc, scale).masked_fill(~vis, float("-inf"))
        l = torch.logsumexp(s, dim=-1)
        p = _probs(s, vis, l)
        out[:, :, c0:c1] = torch.einsum("bhcqn,bhcnd->bhcqd", p, vc)
        lse[:, :, c0:c1] = l
    out = out.flatten(2, 3)[:, :, : prob.sq]
    return out, lse.flatten(2, 3)[:, :, : prob.sq]


def _backward(q, k, v, out, lse, dout, dlse, prob: _Problem, scale: float):
    qp, op, dop, lp = prob.pad_q(q), prob.pad_q(out), prob.pad_q(dout), prob.pad_q(lse)
    delta = (op * dop).sum(-1)
    if dlse is not None:
        delta = delta - prob.pad_q(dlse)
    dq = torch.zeros_like(qp)
    dk = torch.zeros(prob.b * prob.hk * prob.sk, prob.d, dtype=prob.dtype, device=q.device)
    dv = torch.zeros_like(dk)
    for c0, c1 in prob.chunks():
        idx, vis = prob.keys(c0, c1)
        kc, vc = prob.gather(k, idx), prob.gather(v, idx)
        qc = qp[:, :, c0:c1]
        p = _probs(_scores(qc, kc, scale), vis, lp[:, :, c0:c1])
        dp = torch.einsum("bhcqd,bhcnd->bhcqn", dop[:, :, c0:c1], vc)
        ds = p * (dp - delta[:, :, c0:c1].unsqueeze(-1)) * scale
        dq[:, :, c0:c1] = torch.einsum("bhcqn,bhcnd->bhcqd", ds, kc)
        flat = prob.flat_index(idx).flatten()
        dk.index_add_(0, flat, torch.einsum("bhcqn,bhcqd->bhcnd", ds, qc).reshape(-1, prob.d))
        dv.index_add_(0, flat, torch.einsum("bhcqn,bhcqd->bhcnd", p, dop[:, :, c0:c1]).reshape(-1, prob.d))
    dq = dq.flatten(2, 3)[:, :, : prob.sq]
    shape = (prob.b, prob.hk, prob.sk, prob.d)
    return dq, dk.view(shape), dv.view(shape)


def reference_forward(call: AttentionCall) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of one call (`AttentionCall`: q, k, v, the layout's keys, the scale, the tokens' order and
    documents, the sliding window) in PyTorch: the fp32 (fp64) reference of the kernels.

    Returns:
        (out [B, Hq, Sq, D], lse [B, Hq, Sq]) in the compute dtype (fp32; fp64 for fp64 inputs);
        queries that see no key get out = 0 and lse = -inf. A query with a non-finite score for a
        key it sees (NaN or Inf in q or that key) gets NaN out and lse, never zeros.
    """
    return _forward(call.q, call.k, call.v, _Problem(call), call.scale)


def reference_backward(call: AttentionCall, out: torch.Tensor, lse: torch.Tensor, dout: torch.Tensor,
                       dlse: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The gradients of `reference_forward(call)`, recomputing probabilities per chunk of query blocks.

    Args:
        call: as for `reference_forward`.
        out, lse: the *final* attention output and log-sum-exp of these queries, which may cover
            more keys than this layout (ring attention): probabilities are exp(s - lse), so each
            key set contributes its exact share of the gradient.
        dout: gradient of out [B, Hq, Sq, D]; dlse: the gradient reaching lse [B, Hq, Sq], or None.

    Returns:
        (dq [B, Hq, Sq, D], dk, dv [B, Hkv, Sk, D]) in the compute dtype.
    """
    return _backward(call.q, call.k, call.v, out, lse, dout, dlse, _Problem(call), call.scale)


def reference_vertical_slash(q_rows: torch.Tensor, k: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The scores of the vertical-slash scoring kernel (`kernels.vertical_slash.vertical_slash_scores`) in
    plain PyTorch, fp32 (fp64 for fp64 inputs), through the dense [Hq, R, L] probabilities (small sizes:
    tests). q_rows [Hq, R, D] are the last R queries of a document, k [Hkv, L, D] its keys; returns
    (vertical [Hq, L], slash [Hq, L])."""
    dtype = torch.float64 if q_rows.dtype == torch.float64 else torch.float32
    hq, r, _ = q_rows.shape
    l = k.shape[1]
    kk = k.to(dtype).repeat_interleave(hq // k.shape[0], 0)
    pos = torch.arange(l - r, l, device=k.device)
    key = torch.arange(l, device=k.device)
    s = torch.einsum("hrd,hld->hrl", q_rows.to(dtype), kk) * scale
    p = torch.softmax(s.masked_fill(key > pos[:, None], float("-inf")), dim=-1)
    offset = (pos[:, None] - key).clamp_min(0).flatten().expand(hq, -1)
    slash = torch.zeros(hq, l, dtype=dtype, device=k.device).scatter_add_(1, offset, p.flatten(1))
    return p.sum(1), slash
