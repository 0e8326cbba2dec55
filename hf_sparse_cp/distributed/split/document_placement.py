"""Where the document planner puts a row's documents: whole on one rank (`_fill`), cut into contiguous ranges on
consecutive ranks (`_cut`) or split over the whole ring (`_Placement.spread_over_ring`), and the estimated time the
ring takes over a placement (`_ring_time`). The planner (`documents.plan_documents`) sweeps placements built from
these; `document_plan._materialize` turns the one it keeps into a `DocumentPlan`."""

from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass, field

import numpy as np

from .document_costs import SPARSE, PlannerCosts, _Blocks
from .ring_time import RingSteps, forwarded_tokens, pipelined_ring_time, split_step_pairs


def _split_blocks(nb: int, kind: str, w: int, rotation: int) -> np.ndarray:
    """Owner rank of each block of a document split over the whole ring: striped (continuing a
    rotation over ranks), or head-tail for a dense causal one. (numpy: planning runs every step, and
    numpy's calls on small arrays cost a tenth of torch's.)"""
    j = np.arange(nb)
    if kind == SPARSE or nb < 2 * w:
        return (j + rotation) % w
    chunk = j * 2 * w // nb  # 2w chunks of near-equal size
    return np.where(chunk < w, chunk, 2 * w - 1 - chunk)


@dataclass
class _Placement:
    """Documents placed whole (`placed`: rank) or split (`split`: owner rank per block; `over_ring`: those
    split over every rank), and the estimated work per rank and the tokens its blocks hold (the padding of a
    document's last block included: what the rank's activations take)."""

    load: np.ndarray
    tokens: np.ndarray
    placed: dict[int, int] = field(default_factory=dict)
    split: dict[int, np.ndarray] = field(default_factory=dict)
    over_ring: set[int] = field(default_factory=set)

    def spread_over_ring(self, i: int, kind: str, work: np.ndarray, tokens: np.ndarray, rotation: int,
                         costs: PlannerCosts, bs: int) -> None:
        """Split document i (its blocks' `work` and `tokens`) over every rank (`_split_blocks`); each
        rank receives all its other tokens."""
        w = len(self.load)
        owner = _split_blocks(len(work), kind, w, rotation)
        held = np.bincount(owner, weights=tokens, minlength=w)
        self.load += np.bincount(owner, weights=work, minlength=w) + costs.comm_per_token * (tokens.sum() - held)
        self.tokens += np.bincount(owner, minlength=w) * float(bs)
        self.split[i] = owner
        self.over_ring.add(i)


def _cut(at: _Placement, docs: list[int], blocks: _Blocks, bs: int, costs: PlannerCosts, token_cap: float) -> None:
    """Lay `docs` out in order and cut the sequence into one contiguous range of blocks per rank, in
    ring order, at the lowest work level the ranks can share: each rank takes the blocks that bring it
    up to the level, within `token_cap` tokens and at least what the ranks after it have no room for, the
    last one the rest; the level is searched by
    bisection (a fixed per-rank share would push onto the last ranks the work of those the token cap
    stops short: the cheap heads of long causal documents). A cut that falls within `balance_slack` of
    a document's start moves to it, so that the document stays whole; a document cut anyway is split
    over consecutive ranks, every piece read only by its own rank and the ranks after it (K/V travel at
    most one hop per rank it spans, never round the ring). `blocks`: every document's blocks.

    (Python lists and bisect in the loop over ranks: numpy's per-call cost on scalars dominated.)"""
    w = len(at.load)
    work, _ = blocks.of(docs)
    nb = [int(blocks.first[i + 1] - blocks.first[i]) for i in docs]
    total = [0.0, *np.cumsum(work).tolist()]
    held = [float(k * bs) for k in range(len(work) + 1)]  # the tokens the first k blocks hold
    doc_first = [0, *np.cumsum(nb).tolist()]  # block range of each document
    doc_of = np.repeat(np.arange(len(docs)), nb).tolist()
    size = len(doc_of)
    base_load, base_tokens = at.load.tolist(), at.tokens.tolist()
    # tokens the ranks after each rank can still take: a rank stopped short by its level leaves no more to the
    # last rank than fits (the token cap bounds activation memory, which no balance may trade away)
    room = [max(0.0, (token_cap - t) // bs * bs) for t in base_tokens]  # (whole blocks)
    room_after = [sum(room[r + 1:]) for r in range(w)]

    def ends_at(level: float) -> tuple[list[int], list[float]]:
        """Each rank's end block and its load when every rank but the last takes up to `level`."""
        ends, loads, start = [], [], 0
        for r in range(w):
            comm = costs.comm_per_token * ((start - doc_first[doc_of[start]]) * bs if start < size else 0)
            end = size
            if r < w - 1:
                end = bisect.bisect_right(total, total[start] + level - base_load[r] - comm) - 1
                most = bisect.bisect_right(held, held[start] + token_cap - base_tokens[r]) - 1
                least = max(start, bisect.bisect_left(held, held[size] - room_after[r]))
                end = max(min(end, most), least)
                if 0 < end < size and doc_first[doc_of[end]] != end:  # inside a document: its start if close
                    edge = doc_first[doc_of[end]]
                    if edge >= least and total[end] - total[edge] <= costs.balance_slack * level:
                        end = edge
            ends.append(end)
            loads.append(base_load[r] + total[end] - total[start] + comm)
            start = end
        return ends, loads

    lo = (total[-1] + sum(base_load)) / w  # no level below the mean fits
    ends, loads = ends_at(lo)
    hi = max(loads)  # (the level the first try reached: taking up to it, every rank but the last takes more)
    while hi - lo > 1e-3 * lo:
        mid = (lo + hi) / 2
        try_ends, try_loads = ends_at(mid)
        if max(try_loads) < max(loads):
            ends, loads = try_ends, try_loads
        if try_loads[-1] > mid:  # the last rank took more than the level: too low
            lo = mid
        else:
            hi = mid
    owner = np.repeat(np.arange(w), np.diff([0, *ends]))
    at.load[:] = loads
    at.tokens[:] = [t + held[e] - held[s] for t, s, e in zip(base_tokens, [0, *ends[:-1]], ends)]
    for j, i in enumerate(docs):
        ranks = owner[doc_first[j]: doc_first[j + 1]]
        if ranks[0] == ranks[-1]:
            at.placed[i] = int(ranks[0])
        else:
            at.split[i] = ranks


def _ring_time(at: _Placement, blocks: _Blocks, caps: list[int | None], costs: PlannerCosts, bs: int,
               steps: RingSteps, over_ring: dict[int, tuple]) -> float:
    """Estimated time of the attention of `at` over the ring of `steps`, in token pairs (`ring_time`): a whole
    document's attention in step 0 of its rank, a split one's spread over the steps by its blocks' owners, and its
    K/V forwarded at `comm_per_token`; `caps`: per document, the key blocks a query block row reads at most (None:
    dense); `over_ring`: the steps' work and forwarded tokens of the documents split over every rank, by document,
    filled as they come (the same split in every placement)."""
    w = len(at.load)
    work, inner, outer = np.zeros((w, w)), np.zeros((w, w)), np.zeros((w, steps.topology.num_nodes))
    docs = list(at.placed)
    work[:, 0] = np.bincount([at.placed[i] for i in docs], weights=blocks.document_attention[docs], minlength=w)
    for i, owner in at.split.items():
        if i in at.over_ring and i in over_ring:  # (a document cut in one placement may go over the ring in another)
            pairs, (to_inner, to_outer) = over_ring[i]
        else:
            pairs = split_step_pairs(owner, caps[i], steps) * float(bs * bs)
            to_inner, to_outer = forwarded_tokens(pairs, owner, blocks.tokens[blocks.first[i]:blocks.first[i + 1]],
                                                  steps)
            if i in at.over_ring:
                over_ring[i] = pairs, (to_inner, to_outer)
        work += pairs
        inner += to_inner
        outer += to_outer
    return pipelined_ring_time(work, steps, inner * costs.comm_per_token, outer * costs.comm_per_token)


def _fill(at: _Placement, docs: list[int], lengths, work, token_cap: float) -> list[int]:
    """Place `docs` (costliest first) whole, each on the least loaded rank with room for its tokens; return those
    that no rank has room for (after documents spread over the ring, a document shorter than the cap can still
    fit nowhere), for the cut to split within the cap."""
    heap = [(float(load), r) for r, load in enumerate(at.load)]
    heapq.heapify(heap)
    left = []
    for i in docs:
        skipped, r = [], None
        while heap:
            lo, rank = heapq.heappop(heap)
            if at.tokens[rank] + lengths[i] <= token_cap:
                r = rank
                break
            skipped.append((lo, rank))
        for item in skipped:
            heapq.heappush(heap, item)
        if r is None:
            left.append(i)
            continue
        at.placed[i] = r
        at.load[r] += work[i]
        at.tokens[r] += lengths[i]
        heapq.heappush(heap, (float(at.load[r]), r))
    return left
