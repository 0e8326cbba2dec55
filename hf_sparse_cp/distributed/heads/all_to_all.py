"""The all-to-all of head parallelism: from a sequence split to a head split and back, differentiable.

`HeadExchange.to_heads` turns every rank's sequence piece of all heads into every piece of this rank's
heads (`heads.HeadSplit`): one all-to-all carries q, k and v together. `to_sequence` sends an output
of this rank's heads back to the ranks that hold its tokens. Both are a `torch.distributed.all_to_all_single`
with per-rank split sizes (pieces and head counts may differ between ranks) inside an autograd Function
whose backward is the reverse all-to-all, so gradients take the way back: dq, dk, dv return to the
sequence split (the gradients of a replicated key/value head summed over its copies by the packing's
autograd) and the output's gradient goes to the head split. gloo (CPU) and NCCL both implement
`all_to_all_single` with split sizes, so one code path serves both.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from ..comm import naming_unresponsive_ranks
from .split import HeadSplit


class _AllToAll(torch.autograd.Function):
    """`flat` (chunk r for rank r, sizes `send`) -> the chunks every rank sent here (sizes `recv`)."""

    @staticmethod
    def forward(ctx, flat, send, recv, group, rank, stats):
        out = flat.new_empty(sum(recv))
        with naming_unresponsive_ranks("the head-parallel all-to-all", group):
            dist.all_to_all_single(out, flat, recv, send, group=group)
        ctx.args = (send, recv, group, rank, stats)
        if stats is not None:
            stats.forward_bytes += (sum(send) - send[rank]) * flat.element_size()
        return out

    @staticmethod
    def backward(ctx, grad):
        send, recv, group, rank, stats = ctx.args
        out = grad.new_empty(sum(send))
        with naming_unresponsive_ranks("the head-parallel all-to-all (backward)", group):
            dist.all_to_all_single(out, grad.contiguous(), send, recv, group=group)
        if stats is not None:
            stats.backward_bytes += (sum(recv) - recv[rank]) * grad.element_size()
        return out, None, None, None, None, None


def all_to_all(flat: torch.Tensor, send: Sequence[int], recv: Sequence[int], group, rank: int,
               stats=None) -> torch.Tensor:
    """Differentiable `all_to_all_single` of a 1-D tensor with split sizes. Collective over `group`.

    Args:
        flat: [sum(send)], the chunk for group rank r at its r-th place; send / recv: elements sent to
            and received from each group rank (recv[r] must be what rank r sends here).
        group: the process group (None: the default group); rank: this rank's position in it.
        stats: a `RingStats` whose forward_bytes / backward_bytes count what this rank sends.

    Returns:
        [sum(recv)]: the chunks received, in group rank order.
    """
    return _AllToAll.apply(flat, list(send), list(recv), group, rank, stats)


class HeadExchange:
    """The all-to-alls between a sequence split and a head split over one head group.

    Args:
        split: which heads each rank of the group takes.
        lengths: the tokens of every group rank's sequence piece, in group rank order.
        rank: this rank's position in the group; group: the head group's process group.
        stats: counts the bytes this rank sends (see `all_to_all`).
    """

    def __init__(self, split: HeadSplit, lengths: Sequence[int], rank: int, group, stats=None) -> None:
        if len(lengths) != split.size:
            raise ValueError(f"{len(lengths)} sequence pieces for a head group of {split.size} ranks.")
        self.split, self.lengths, self.rank, self.group, self.stats = split, list(lengths), rank, group, stats

    def _heads(self, rank: int) -> tuple[int, int]:
        """(query heads, key/value heads) rank `rank` computes."""
        (q_lo, q_hi), (kv_lo, kv_hi) = self.split.q_range(rank), self.split.kv_range(rank)
        return q_hi - q_lo, kv_hi - kv_lo

    def to_heads(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Every piece of this rank's heads. Collective over the head group.

        Args:
            q: [B, Hq, L, D]; k, v: [B, Hkv, L, D]: this rank's sequence piece (L = lengths[rank]).

        Returns:
            q [B, nq, sum(lengths), D] and k, v [B, nkv, sum(lengths), D]: this rank's query heads and the
            key/value heads they read (one per query head where they read them unevenly, `HeadSplit.kv_index`),
            the pieces one after another in group rank order.
        """
        b, _, length, d = q.shape
        if length != self.lengths[self.rank] or k.shape[2] != length or v.shape != k.shape:
            raise ValueError(f"this rank's piece has {self.lengths[self.rank]} tokens; got q {tuple(q.shape)}, "
                             f"k {tuple(k.shape)}, v {tuple(v.shape)}.")
        if q.shape[1] != self.split.q_heads or k.shape[1] != self.split.kv_heads:
            raise ValueError(f"the head split is for {self.split.q_heads} query and {self.split.kv_heads} key/value "
                             f"heads; got {q.shape[1]} and {k.shape[1]}.")
        parts, send = [], []
        for r in range(self.split.size):
            (q_lo, q_hi), (kv_lo, kv_hi) = self.split.q_range(r), self.split.kv_range(r)
            parts += [q[:, q_lo:q_hi].reshape(-1), k[:, kv_lo:kv_hi].reshape(-1), v[:, kv_lo:kv_hi].reshape(-1)]
            send.append(b * length * d * ((q_hi - q_lo) + 2 * (kv_hi - kv_lo)))
        nq, nkv = self._heads(self.rank)
        recv = [b * n * d * (nq + 2 * nkv) for n in self.lengths]
        chunks = all_to_all(torch.cat(parts), send, recv, self.group, self.rank, self.stats).split(recv)
        pieces = [c.split([b * nq * n * d, b * nkv * n * d, b * nkv * n * d]) for c, n in zip(chunks, self.lengths)]
        q_h, k_h, v_h = (torch.cat([p[i].view(b, h, n, d) for p, n in zip(pieces, self.lengths)], 2)
                         for i, h in enumerate((nq, nkv, nkv)))
        reads = self.split.kv_index(self.rank)
        if reads is not None:
            reads = reads.to(k_h.device)
            k_h, v_h = k_h.index_select(1, reads), v_h.index_select(1, reads)
        return q_h, k_h, v_h

    def to_sequence(self, out: torch.Tensor) -> torch.Tensor:
        """All heads of this rank's piece from every rank's `out` of its heads. Collective over the head group.

        Args:
            out: [B, nq, sum(lengths), D], this rank's query heads over every piece (as `to_heads` lays them).

        Returns:
            [B, Hq, lengths[rank], D].
        """
        b, nq, total, d = out.shape
        if nq != self._heads(self.rank)[0] or total != sum(self.lengths):
            raise ValueError(f"expected [B, {self._heads(self.rank)[0]}, {sum(self.lengths)}, D], "
                             f"got {tuple(out.shape)}.")
        parts = [piece.reshape(-1) for piece in out.split(self.lengths, 2)]
        send = [b * nq * n * d for n in self.lengths]
        mine = self.lengths[self.rank]
        heads = [self._heads(r)[0] for r in range(self.split.size)]
        recv = [b * h * mine * d for h in heads]
        chunks = all_to_all(torch.cat(parts), send, recv, self.group, self.rank, self.stats).split(recv)
        return torch.cat([c.view(b, h, mine, d) for c, h in zip(chunks, heads)], 1)
