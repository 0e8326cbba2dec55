"""What the document planner places: the runs of a batch (`row_runs`: the stretches no row's document crosses, and
their kinds, sparse where some layer's pattern attends a document in them), with the idle documents that only
padding fills marked as padding for the plan (`idle_documents_as_padding`)."""

from __future__ import annotations

import numpy as np
import torch

from ...attention.tokens import PAD_SEGMENT, TokenMeta
from ...config import SparseAttentionConfig
from .document_costs import DENSE, PAD, SPARSE


def sparse_from(cfg: SparseAttentionConfig) -> float:
    """The shortest document that some layer of `cfg` attends with a sparse pattern (`min_seq_len`; inf: every layer
    dense). Every layer's (`layer_configs`: `layer_overrides` may set a lower min_seq_len, or a sparse pattern over a
    dense one), since the plan that keeps such a document at its offset inside a block serves every layer: planned
    from the base pattern alone, a document that only an overridden layer attends sparsely was moved off its offset,
    and that layer's block grid, so its pattern, differed from one process's (#50)."""
    return min((max(layer.min_seq_len, 1) for layer in cfg.layer_configs() if layer.pattern != "dense"),
               default=float("inf"))


def row_runs(meta: TokenMeta, cfg: SparseAttentionConfig, shortest: float | None = None
             ) -> tuple[list[int], list[str]]:
    """The runs of a batch [B, S] the planner places, and their kinds: the stretches between the positions that no
    row's document crosses, consecutive positions that are padding in every row forming one padding run.

    A row's documents and padding runs, for one row or rows with the same documents. Rows with different documents
    (a padded batch of unpacked sequences, an eval set) share a run wherever one row's document spans another's
    boundary: a run holds no part of a document that another run holds, in any row, so moving runs moves whole
    documents. A run is padding if every row pads all of it, sparse if any row's document in it is long enough for a
    pattern in some layer (`sparse_from`), else dense. Padding is `PAD_SEGMENT`, which a run may cut anywhere, and the
    idle documents `idle_documents_as_padding` marks (segment ids below it), which are padding to the planner but, being
    documents attention still computes, are cut only at their edges. A sparse run after padding starts at the block
    boundary before it where that padding reaches it (`_from_block_boundaries`). `shortest`: `sparse_from(cfg)`, where
    the caller has it."""
    seg = meta.segment.cpu().numpy()  # (numpy: runs every step, on up to a million tokens)
    b, s = seg.shape
    pad = seg < 0
    first = np.ones_like(pad)
    first[:, 1:] = seg[:, 1:] != seg[:, :-1]
    all_pad = pad.all(0)
    cut = (first | (seg == PAD_SEGMENT)).all(0)  # no row's document (idle ones too) goes on from the position before
    # a stretch that every row pads is one run from its first cut on (an idle document may delay that cut)
    stretch = np.maximum.accumulate(np.where(all_pad & ~np.append(False, all_pad[:-1]), np.arange(s), 0))
    before = np.cumsum(cut) - cut  # the cuts before each position
    cut &= ~(all_pad & (before > before[stretch]))
    starts = np.flatnonzero(cut)
    sparse = np.zeros(len(starts), dtype=bool)
    shortest = sparse_from(cfg) if shortest is None else shortest
    if shortest < np.inf:  # the runs holding a document long enough for a pattern (a document lies in one run)
        doc = np.flatnonzero(first)  # every row's runs, flat (a row's first token starts one)
        long = (np.diff(np.append(doc, b * s)) >= shortest) & ~pad.reshape(-1)[doc]
        sparse[np.searchsorted(starts, doc[long] % s, side="right") - 1] = True
    padding = np.logical_and.reduceat(all_pad, starts)  # (a run from an idle stretch may go on past it)
    starts, sparse, padding = _from_block_boundaries(starts, sparse, padding, seg == PAD_SEGMENT, cfg.block_size)
    lengths = np.diff(np.append(starts, s))
    kinds = [PAD if p else SPARSE if sp else DENSE for p, sp in zip(padding.tolist(), sparse.tolist())]
    return lengths.tolist(), kinds


def _from_block_boundaries(starts: np.ndarray, sparse: np.ndarray, padding: np.ndarray, padded: np.ndarray,
                           bs: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Start each sparse run that follows padding off a block boundary at the boundary before it, taking the padding
    in between (`padded` [B, S]: `PAD_SEGMENT` in a row, which a run may cut anywhere) into the run; a padding run left
    empty is dropped. The planner keeps a sparse run's offset inside a block (`sparse_leads`) with padding before it:
    the padding the batch already has there serves instead (left-padded rows, whose text starts off a boundary after
    padding every row shares)."""
    starts = starts.copy()
    for i in np.flatnonzero(sparse[1:] & padding[:-1]) + 1:
        off = int(starts[i]) % bs
        if off and starts[i] - off >= starts[i - 1] and padded[:, starts[i] - off:starts[i]].all():
            starts[i] -= off
    kept = np.append(starts[1:] > starts[:-1], True)  # (a padding run the sparse one after it took whole)
    return starts[kept], sparse[kept], padding[kept]


def idle_documents_as_padding(meta: TokenMeta, input_ids: torch.Tensor, shifted: torch.Tensor, pad_token_id: int,
                              ignore_index: int = -100) -> TokenMeta:
    """For the planner, on the host: `meta` [B, S] with every document whose tokens are all `pad_token_id` and have no
    target (`shifted`, the labels shifted, all `ignore_index`) marked idle, a segment id below `PAD_SEGMENT`, one per
    such document (`row_runs` plans idle stretches as padding: placed whole on one rank as one run, not as documents;
    a padding tail that only flattening boundaries delimit: TRL's padding-free rows padded to a multiple, every pad
    token a document of its own; `BlockAlignedFlattening`'s gaps). Only the plan reads it: attention still takes those
    tokens' documents from the batch, so that their outputs, and whatever reads them (a MoE router's loss over every
    token), stay what one process computes; for that the planner cuts an idle document only at its edges (in a
    batch of several rows another row's boundary may fall inside it). (numpy: one bool per token leaves the device,
    and the host's scans of a million tokens take milliseconds, torch's on the CPU hundreds.)"""
    busy = ((input_ids != pad_token_id) | (shifted != ignore_index)).cpu().numpy()
    seg = meta.segment.cpu().numpy()
    b, s = seg.shape
    first = np.ones((b, s), dtype=bool)
    first[:, 1:] = seg[:, 1:] != seg[:, :-1]
    runs = np.flatnonzero(first)  # every row's runs, flat (a row's first token starts one)
    idle = ~np.logical_or.reduceat(busy.reshape(-1), runs)
    idle = np.repeat(idle, np.diff(np.append(runs, b * s))).reshape(b, s)
    marked = np.where(idle, PAD_SEGMENT - 1 - seg, seg)  # (true padding, -1, stays -1)
    return TokenMeta(meta.index.cpu(), torch.from_numpy(marked.astype(np.int32)))


__all__ = ["idle_documents_as_padding", "row_runs", "sparse_from"]
