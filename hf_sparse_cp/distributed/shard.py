"""What a model forward under context parallelism carries: `CPShard`, one rank's view of a batch split over
its CP group, which the `sparse_cp` attention backend receives as the keyword `cp_shard`
(`inputs.prepare_context_parallel_inputs` builds it).
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

import torch

from ..attention.tokens import (
    PAD_SEGMENT,
    BatchDocumentExtents,
    TokenMeta,
    padding_queries_see_prior_tokens,
    rows_pad_after_tokens,
)
from .comm import all_gather_rows, all_reduce

if TYPE_CHECKING:
    from .mesh import ParallelDims
    from .split.blocks import BlockSplit

CP_SHARD_KWARG = "cp_shard"


class CPShard:
    """One rank's view of a batch split over its CP group.

    parallel: the parallel layout (groups, ring topology); plan: how the sequence was split
    (a `ShardPlan`, or a `DocumentPlan` that re-orders the documents of a packed row);
    meta: documents and global order of the *whole* batch [B, plan.padded_len] (padding marked),
    identical on every rank, from which any rank's shard metadata follows; documents: the extents of the whole
    batch's documents in the positions transformers' masks compare (`tokens.BatchDocumentExtents`, computed when
    first called), by which the backend checks a window or chunk that only the model's mask carries (None: unknown,
    the padded length is checked instead); attention_mask: the whole batch's 2D padding mask [B, plan.seq_len] as the
    batch carried it (None without one), which the CP router loss hands the model's function with the gathered tokens;
    packed_by_positions: whether `meta`'s documents come from the batch's restarting [B, S] position_ids, which a
    multimodal RoPE model expands to its rotary rows without packing by them (the backend refuses that);
    input_ids: the whole batch's token ids [B, plan.seq_len] (None: it came as inputs_embeds), by which a
    sequence-classification head finds the token it pools (`integration/heads.py`); padding_rows: bool [B] or None,
    the rows whose padding after their tokens the model's head reads (a question-answering or sequence-classification
    head), set for the forward by the decoder's pre-hook (`heads.pass_padding_rows_on`): their padding queries attend
    as SDPA's (`padding_queries`).

    Not a dataclass on purpose: FSDP2's mixed precision (`cast_forward_inputs`, on with bf16 parameters) rebuilds every
    dataclass among a forward's inputs at each module it wraps, so a dataclass shard reached every decoder layer as a
    copy, without what the batch's first computed (the documents read back to the host again, layer by layer) nor its
    identity (which the whole-row hooks know it by); a plain object passes as it is. Equal only to itself.
    """

    def __init__(self, parallel: ParallelDims, plan: BlockSplit, meta: TokenMeta,
                 documents: BatchDocumentExtents | None = None, attention_mask: torch.Tensor | None = None,
                 packed_by_positions: bool = False, input_ids: torch.Tensor | None = None) -> None:
        self.parallel, self.plan, self.meta, self.documents = parallel, plan, meta, documents
        self.attention_mask, self.packed_by_positions, self.input_ids = attention_mask, packed_by_positions, input_ids
        self.padding_rows: torch.Tensor | None = None
        self._padding_queries: tuple = (None, None)

    def __repr__(self) -> str:
        return (f"CPShard(rank {self.rank} of CP {self.parallel.cp_size}, batch {tuple(self.meta.index.shape)}, "
                f"{type(self.plan).__name__})")

    @property
    def rank(self) -> int:
        return self.parallel.cp_rank

    @cached_property
    def unpadded_meta(self) -> TokenMeta:
        """`meta` without the split's padding at the sequence's end (its first `plan.seq_len` tokens), one object per
        batch: the layers that attend the whole sequence share it, and with it the documents it reads back to the host
        once (`TokenMeta.documents`)."""
        n = self.plan.seq_len
        return TokenMeta(self.meta.index[:, :n], self.meta.segment[:, :n])

    def padding_queries(self) -> tuple[TokenMeta, torch.Tensor | None] | None:
        """(the whole batch's query metadata [B, plan.padded_len], in which the padding after the tokens of the rows
        `padding_rows` names sees the tokens before it, `tokens.padding_queries_see_prior_tokens`; the global position
        of the real token each such query follows, int64 [B, padded_len], -1 elsewhere, where the split reorders the
        row, else None: `build.with_padding_query_blocks`), or None where no such row pads after its tokens (its
        documents read back once per batch). The split's own padding sees nothing. Under a split that reorders the row
        (the document planner) such a query keeps its place in the split, its index that of its row's last token plus
        its distance from it (causal, and the window's distance as in the row). Computed once per rows tensor."""
        rows = self.padding_rows
        if rows is None:
            return None
        if self._padding_queries[0] is not rows:
            self._padding_queries = (rows, self._seeing_padding(rows) if self.plan.keeps_order
                                     else self._seeing_reordered_padding(rows))
        return self._padding_queries[1]

    def _seeing_padding(self, rows: torch.Tensor) -> tuple[TokenMeta, None] | None:
        meta = self.unpadded_meta
        n = meta.segment.shape[-1]
        if not rows_pad_after_tokens(meta, rows):
            return None
        seen = padding_queries_see_prior_tokens(meta, rows).segment
        return TokenMeta(self.meta.index, torch.cat([seen, self.meta.segment[:, n:]], 1)), None

    def _seeing_reordered_padding(self, rows: torch.Tensor) -> tuple[TokenMeta, torch.Tensor] | None:
        meta, n = self.meta, self.plan.seq_len
        source = self.plan.source.to(meta.segment.device)  # (each global position's place in the row, -1: split's)
        held = (source >= 0).nonzero().flatten()
        place = source[held]
        b = meta.segment.shape[0]
        segment = meta.segment.new_full((b, n), PAD_SEGMENT)
        segment[:, place] = meta.segment[:, held]
        index = meta.index.new_zeros(b, n)
        index[:, place] = meta.index[:, held]
        row = TokenMeta(torch.arange(n, device=segment.device).expand(b, n), segment)  # (the row in its order)
        if not rows_pad_after_tokens(row, rows):
            return None
        seen = padding_queries_see_prior_tokens(row, rows).segment
        position = row.index
        last = torch.where(segment != PAD_SEGMENT, position, -1).cummax(-1).values
        anchor = index.gather(1, last.clamp_min(0))  # (the global position of the row's token before each)
        follows = (seen != PAD_SEGMENT) & (segment == PAD_SEGMENT)
        q_segment, q_index = meta.segment.clone(), meta.index.clone()
        q_segment[:, held] = seen[:, place]
        q_index[:, held] = torch.where(follows, anchor + position - last, index)[:, place]
        anchors = torch.full_like(meta.index, -1)
        anchors[:, held] = torch.where(follows, anchor, -1)[:, place]
        return TokenMeta(q_index, q_segment), anchors

    def whole_sequence(self, x: torch.Tensor) -> torch.Tensor:
        """The batch's tensor over its whole sequence, from every CP rank's tensor over its shard (an all-gather over
        the CP group: every rank receives it). Differentiable: the backward sums the gradient of the whole sequence
        over the CP group and hands each rank that of its own positions, so that a loss every rank of the group
        computes from the whole sequence, its gradients averaged over the ranks (DDP, FSDP2), trains as in one
        process.

        Args:
            x: this rank's per-token output (a forward's logits, hidden states, per-token log-probabilities),
                [B, local_len, ...].

        Returns:
            [B, plan.seq_len, ...]: the positions of the batch as it was passed in, in its order (the split's padding
            dropped, a document plan's re-ordering undone). Memory: the gathered tensor ([CP x B, longest shard, ...])
            and the result, each about B x seq_len x the rest.
        """
        return _WholeSequence.apply(x, self)

    def at_positions(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Each row's entry at one position of the batch's sequence, from every CP rank's tensor over its shard: taken
        on the rank holding it and summed over the CP group (an all-reduce of [B, ...]: every rank receives it).
        Differentiable as `whole_sequence`: the backward sums the gradient over the CP group and hands it to the
        rank holding the position.

        Args:
            x: this rank's per-token output, [B, local_len, ...].
            positions: int64 [B] on x's device, a position of each row in the batch as it was passed in.

        Returns:
            [B, ...]: `whole_sequence(x)[arange(B), positions]`, without gathering the whole sequence.
        """
        return _AtPositions.apply(x, self, positions)

    def _gather(self, x: torch.Tensor) -> torch.Tensor:
        plan, cp = self.plan, self.parallel.cp_size
        b, longest = x.shape[0], plan.max_local_blocks * plan.block_size
        if x.shape[1] == longest:
            mine = x.contiguous()
        else:  # (a document plan's shorter shard)
            mine = x.new_zeros((b, longest, *x.shape[2:]))
            mine[:, : x.shape[1]] = x
        gathered = x.new_empty((cp * b, *mine.shape[1:]))
        all_gather_rows(gathered, mine, self.parallel.cp_group)
        rank, index = (t.to(x.device) for t in plan.original_in_shards)
        rows = torch.arange(b, device=x.device)[:, None]
        return gathered.view(cp, *mine.shape)[rank[None], rows, index[None]]

    @staticmethod
    def check_no_kv_cache(query: torch.Tensor, key: torch.Tensor) -> None:
        """Raise ValueError unless queries and keys are the same part of the sequence: a KV cache is not sharded."""
        if query.shape[2] != key.shape[2]:
            raise ValueError(
                f"under context parallelism queries and keys must be this rank's same part of the sequence (got "
                f"{query.shape[2]} queries, {key.shape[2]} keys): decoding with a KV cache is not sharded, so run "
                "generation without cp_shard; a PEFT prefix-tuning model adds its virtual keys to every layer, so "
                "train it without context parallelism.")


class _WholeSequence(torch.autograd.Function):
    """`CPShard.whole_sequence` with its gradient: forward, the all-gather of the shards into the whole sequence;
    backward, the sum over the CP group of every rank's gradient of the whole sequence, of which each rank keeps the
    positions of its own shard (the split's padding gets none)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: CPShard) -> torch.Tensor:
        ctx.shard = shard
        return shard._gather(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        shard = ctx.shard
        total = grad.contiguous().clone()
        all_reduce(total, shard.parallel.cp_group, "the all-reduce of a whole-sequence output's gradient")
        return shard.plan.shard(total, shard.rank, pad_value=0), None


class _AtPositions(torch.autograd.Function):
    """`CPShard.at_positions` with its gradient: forward, each row's entry at its position on the rank holding it,
    zeros elsewhere, summed over the CP group; backward, the sum over the CP group of every rank's gradient, which
    the holder of each row's position keeps there (the other positions, and the other ranks, get none)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, shard: CPShard, positions: torch.Tensor) -> torch.Tensor:
        owner, local = (t.to(x.device)[positions] for t in shard.plan.original_in_shards)
        mine = owner == shard.rank
        rows = torch.arange(x.shape[0], device=x.device)
        local = local.clamp(max=x.shape[1] - 1)  # (another rank's index may lie past a shorter shard)
        picked = torch.where(mine.view(-1, *[1] * (x.dim() - 2)), x[rows, local], 0).contiguous()
        all_reduce(picked, shard.parallel.cp_group, "the all-reduce of the entries of a position of each row")
        ctx.shard, ctx.shape = shard, x.shape
        ctx.save_for_backward(rows[mine], local[mine])
        return picked

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        rows, local = ctx.saved_tensors
        total = grad.contiguous().clone()
        all_reduce(total, ctx.shard.parallel.cp_group, "the all-reduce of the gradient of a position of each row")
        out = total.new_zeros(ctx.shape)
        out[rows, local] = total[rows]
        return out, None, None
