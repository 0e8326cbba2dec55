"""The document planner's result: `DocumentPlan`, a packed row split by documents (a `BlockSplit` whose ranks hold
different numbers of blocks), built from a placement (`_materialize`), the padding a sparse run takes before it
(`sparse_leads`), and the checks and figures read from a plan (`check_planned_pattern`, `balance_ratio`)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from ...config import SparseAttentionConfig
from .blocks import BlockSplit
from .document_costs import SPARSE
from .document_placement import _Placement


@dataclass(frozen=True, eq=False)
class DocumentPlan(BlockSplit):
    """A packed row split by documents over `cp_size` ranks (see `documents`' module docstring).

    lengths, kinds: every run of the row (documents and padding, in row order) and its kind
    ('sparse', 'dense', 'pad'); split: the runs split over several ranks; work: per rank the estimated
    work the planner balanced (attention + linear + K/V received, token pairs). `segments(rank)`
    lists a rank's (run, start, end) pieces.
    """

    cp_size: int
    block_size: int
    seq_len: int
    lengths: tuple[int, ...]
    kinds: tuple[str, ...]
    split: tuple[int, ...]
    pieces: tuple[tuple[int, int], ...]
    owners: torch.Tensor
    work: tuple[float, ...]
    # the shortest document planned as sparse, kept at its offset inside a block (`sparse_from`; inf: none): the
    # kinds `plan_row` read from a pattern; 1 for kinds given to `plan_documents`, which the plan cannot check
    sparse_from: float = 1

    sharding = "document"

    @functools.cached_property
    def rank_blocks(self) -> tuple[torch.Tensor, ...]:
        return tuple((self.owners == r).nonzero().flatten() for r in range(self.cp_size))

    @functools.cached_property
    def source(self) -> torch.Tensor:
        # `pieces` lists (original start or -1 for padding, tokens) in global order
        # (numpy: torch.repeat_interleave is ~30x slower on the CPU at a million tokens)
        start, count = np.array(self.pieces, dtype=np.int64).reshape(-1, 2).T
        shift = np.where(start >= 0, start - (np.cumsum(count) - count), -(1 << 62))  # original - global position
        pos = np.arange(int(count.sum()), dtype=np.int64) + np.repeat(shift, count)
        return torch.from_numpy(np.where(pos >= 0, pos, -1))

    def segments(self, rank: int) -> list[tuple[int, int, int]]:
        """`rank`'s pieces of the row as (run, start, end), token offsets inside the run, in shard order."""
        src = self.source[self.token_index(rank)]
        src = src[src >= 0]
        if not src.numel():
            return []
        starts = torch.tensor([0, *self.lengths], dtype=torch.long).cumsum(0)
        run = torch.searchsorted(starts, src, right=True) - 1
        cut = torch.ones(src.numel(), dtype=torch.bool)
        cut[1:] = (run[1:] != run[:-1]) | (src[1:] != src[:-1] + 1)
        first = cut.nonzero().flatten()
        last = torch.cat([first[1:], torch.tensor([src.numel()])]) - 1
        r = run[first]
        return list(zip(r.tolist(), (src[first] - starts[r]).tolist(), (src[last] - starts[r] + 1).tolist()))


def sparse_leads(lengths: list[int], kinds: list[str], bs: int) -> list[int]:
    """The padding each run takes before it in the plan: for a sparse run, its start's offset inside a block in the
    row, so that its documents keep their offsets inside a block (a block-sparse layout's kept blocks cover the other
    tokens of their blocks, which depend on where a document starts inside one: aligned otherwise, the run would
    compute something else than one process on the row); 0 for the others (dense attention and padding do not depend
    on the blocks)."""
    starts = np.cumsum([0, *lengths[:-1]]) % bs
    return [int(off) if kind == SPARSE else 0 for off, kind in zip(starts.tolist(), kinds)]


def _materialize(at: _Placement, lengths, leads, kinds, w: int, bs: int) -> DocumentPlan:
    """Global order, block owners and segments of a placement, each run after its lead of padding (`sparse_leads`)."""
    starts = [0]
    for n in lengths[:-1]:
        starts.append(starts[-1] + n)
    pieces: list[tuple[int, int]] = []  # (original start or -1 for padding, tokens), in global order
    owners: list[torch.Tensor] = []

    def pad_to_block(used: int) -> int:
        extra = -used % bs
        if extra:
            pieces.append((-1, extra))
        return used + extra

    def after_lead(i: int) -> int:
        if leads[i]:
            pieces.append((-1, leads[i]))
        pieces.append((starts[i], lengths[i]))
        return leads[i] + lengths[i]

    split = sorted(at.split)
    for i in split:
        pad_to_block(after_lead(i))
        owners.append(torch.from_numpy(at.split[i]))
    split_blocks = np.zeros(w, dtype=np.int64)
    for i in split:
        split_blocks += np.bincount(at.split[i], minlength=w)
    by_rank: list[list[int]] = [[] for _ in range(w)]
    for i, rank in sorted(at.placed.items(), key=lambda t: (kinds[t[0]] != SPARSE, t[0])):
        by_rank[rank].append(i)  # sparse documents first (from a block boundary, after a lead), then in row order
    for r in range(w):
        used = 0
        for i in by_rank[r]:
            if kinds[i] == SPARSE:
                used = pad_to_block(used)
            used += after_lead(i)
        used = pad_to_block(used)
        if not used and not split_blocks[r]:  # a rank the row cannot feed still gets a (padding) block: no empty shard
            pieces.append((-1, bs))
            used = bs
        owners.append(torch.full((used // bs,), r, dtype=torch.long))
    return DocumentPlan(w, bs, sum(lengths), tuple(lengths), tuple(kinds), tuple(split), tuple(pieces),
                        torch.cat(owners), tuple(at.load.tolist()))


def check_planned_pattern(plan: BlockSplit, cfg: SparseAttentionConfig) -> None:
    """Raise ValueError, naming the fix, when `plan` (a `DocumentPlan`; any other split passes) was planned for a
    pattern under which documents that a layer running `cfg` attends sparsely were dense: the planner moved them off
    their offset inside a block, which changes their block grid, so their sparse pattern and the layer's result
    against one process's (#50: `prepare_context_parallel_inputs(..., sharding="document")` without the model's
    `sparse_config` planned for the default pattern's min_seq_len, 8192, and a model sparse from 64 tokens trained on
    losses 1e-4 and gradients 20% off one process's, silently)."""
    if not isinstance(plan, DocumentPlan) or cfg.pattern == "dense" or max(cfg.min_seq_len, 1) >= plan.sparse_from:
        return
    planned = ("no document sparse" if plan.sparse_from == float("inf")
               else f"documents sparse from {int(plan.sparse_from)} tokens on")
    raise ValueError(
        f"this layer attends documents of {max(cfg.min_seq_len, 1)} tokens or more with a sparse pattern (min_seq_len"
        f"={cfg.min_seq_len}), but the batch was split by document (cp_sharding='document') for a pattern with "
        f"{planned}: the planner keeps only those at their offset inside a block, and a sparse document moved off it "
        "attends otherwise than in one process. Pass the model's pattern to prepare_context_parallel_inputs: "
        "sparse_config=hf_sparse_cp.SparseAttentionConfig.stored_on(model.config) (the Trainer does).")


def balance_ratio(plan: DocumentPlan) -> float:
    """max / mean of the planner's estimated per-rank work."""
    return max(plan.work) / (sum(plan.work) / len(plan.work)) if any(plan.work) else 1.0


__all__ = ["DocumentPlan", "balance_ratio", "check_planned_pattern", "sparse_leads"]
