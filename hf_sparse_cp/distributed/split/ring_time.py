"""The document planner's estimate of a placement's ring time: attention work per rank and ring step, the K/V
forwarded at each step, and the waits of a ring that runs without barriers.

The ring computes at step s a rank's queries against the K/V of the rank s places before it, and forwards only
the K/V that a rank further on still reads. A document placed whole is all step-0 work of its rank; a document
split over ranks puts the pairs of a query block on rank q and a key block on rank o in step (q - o) mod W. Two
ring neighbours that exchange K/V at a step wait for each other, and for the transfer, which overlaps the step's
compute (double buffered). With transfers free this is `simulator.traffic.pipelined_time`, reproduced from the
placement alone, without a layout, and in numpy: it runs for every plan the planner tries. Equal per-rank work can
still take far longer than ideal when one rank's work comes at the steps its neighbours wait for.
"""

from __future__ import annotations

import numpy as np


def split_step_pairs(owner: np.ndarray, cap: int | None, w: int) -> np.ndarray:
    """[W ranks, W steps] key blocks that queries of a split document read per ring step (one unit: a block pair).

    owner: the rank of each of the document's blocks; cap: key blocks a query block row reads at most (a sparse
    document's kept blocks), the diagonal block taken as kept and the others spread evenly over the earlier blocks
    (the planner knows how many blocks a row keeps, not which); None: every causal block (dense)."""
    rows = np.arange(len(owner))
    spread = None if cap is None else (np.minimum(rows + 1, cap) - 1) / np.maximum(rows, 1)
    by_owner = np.zeros((w, w))  # [q, o]: pairs of queries on q and keys on o
    for o in np.unique(owner):  # (1-D scans per rank: a cumsum down a [blocks, W] array is slower)
        on = owner == o
        before = np.cumsum(on) - on  # per query block: blocks j < i on rank o
        reads = on + before if spread is None else on + spread * before
        by_owner[:, o] = np.bincount(owner, weights=reads, minlength=w)
    q = np.arange(w)[:, None]
    return by_owner[q, (q - np.arange(w)[None, :]) % w]


def _reads(work: np.ndarray) -> np.ndarray:
    """bool [W origin ranks, W steps] from `work` [W ranks, W steps]: [o, d] where rank o + d reads rank o's K/V at
    step d (has work there)."""
    d = np.arange(work.shape[0])
    return work[(d[:, None] + d[None, :]) % len(d), d[None, :]] > 0


def forwarded_tokens(pairs: np.ndarray, owner: np.ndarray, tokens: np.ndarray, w: int) -> np.ndarray:
    """[W origin ranks, W steps] tokens of a split document's K/V forwarded at each step from each origin: an
    origin's tokens travel up to the furthest step at which some rank reads them (`pairs`, `split_step_pairs`;
    `tokens` per block)."""
    d = np.arange(w)
    reach = np.where(_reads(pairs), d[None, :], 0).max(1)  # [o]: the furthest step that reads it
    held = np.bincount(owner, weights=tokens, minlength=w)
    return held[:, None] * (reach[:, None] > d[None, :])


def pipelined_ring_time(work: np.ndarray, transfer: np.ndarray | None = None) -> float:
    """Time of a ring of W ranks over W steps, `work` [W ranks, W steps] (the same units out): a rank starts step
    t + 1 after it computed step t and, where it exchanges K/V with a neighbour at step t (someone further on
    still reads what the sender forwards), once that transfer is done: it starts when both ends started step t and
    takes `transfer` [W origin ranks, W steps] (the forwarded K/V's time; None: free)."""
    w = work.shape[0]
    rank, step = np.arange(w), np.arange(w)
    read_later = np.flip(np.logical_or.accumulate(np.flip(_reads(work), 1), 1), 1)  # [o, d]: some step >= d reads o
    ahead, behind = np.roll(rank, -1), np.roll(rank, 1)
    origin = (rank[None, :] - step[:-1, None]) % w  # [t, p]: whose K/V p forwards at step t
    sends = read_later[origin, step[1:, None]]  # [t, p]: p forwards to p + 1 at t
    busy = np.zeros((w - 1, w)) if transfer is None else transfer[origin, step[:-1, None]] * sends  # [t, p]
    start = np.zeros(w)
    for t in range(w - 1):
        last = start
        link = np.maximum(last, last[ahead]) + busy[t]  # [p]: p -> p + 1 done
        start = np.maximum(last + work[:, t], np.maximum(sends[t] * link, sends[t][behind] * link[behind]))
    return float((start + work[:, -1]).max())
