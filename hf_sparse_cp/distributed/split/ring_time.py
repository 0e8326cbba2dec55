"""The document planner's estimate of a placement's ring time: attention work per rank and ring step, the K/V
forwarded at each step, and the waits of a ring that runs without barriers.

The ring computes at step (o, i) a rank's queries against the K/V of the rank o nodes and i places before it
(`RingTopology.source`; a flat ring is one node), and forwards only the K/V that a rank further on still reads.
A document placed whole is all step-0 work of its rank; a document split over ranks puts the pairs of a query
block on rank q and a key block on rank k at the step where q computes with k's K/V. Two ring neighbours that
exchange K/V at a step wait for each other, and for the transfer, which overlaps the step's compute (double
buffered); a hierarchical ring's outer transfer overlaps a whole inner ring. With transfers free this is
`simulator.traffic.pipelined_time`, reproduced from the placement alone, without a layout, and in numpy: it runs
for every plan the planner tries. Equal per-rank work can still take far longer than ideal when one rank's work
comes at the steps its neighbours wait for (in a hierarchical ring, K/V from another node arrive only after a
whole inner ring).
"""

from __future__ import annotations

import numpy as np

from ..comm import RingTopology


class RingSteps:
    """The steps of a (hierarchical) ring of `topology` as index tables, step t = outer * node_size + inner:
    `source` [W, T] whose K/V rank p computes with at step t, `holder` [W, T] which rank computes with origin x's
    K/V at step t."""

    def __init__(self, topology: RingTopology) -> None:
        self.topology, self.size = topology, topology.size
        w, t = self.size, np.arange(self.size)[None, :]
        self.holder = topology.holders().reshape(w, w).numpy()
        self.source = np.empty_like(self.holder)
        self.source[self.holder, t] = np.arange(w)[:, None]
        self.inner_next = self.holder[:, 1:2] if topology.node_size > 1 else np.arange(w)[:, None]  # [W, 1]
        self.outer_next = self.holder[:, topology.node_size:topology.node_size + 1] \
            if topology.num_nodes > 1 else np.arange(w)[:, None]  # p's inner and outer ring neighbours

    @classmethod
    def flat(cls, size: int) -> RingSteps:
        return cls(RingTopology(1, size))

    def reads(self, work: np.ndarray) -> np.ndarray:
        """bool [W origin ranks, T steps] from `work` [W ranks, T steps]: where the rank computing with an origin's
        K/V at a step has work there."""
        return work[self.holder, np.arange(self.size)[None, :]] > 0

    def forwards(self, reads: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """bool ([W origins, T steps], [W origins, N node steps]) from `reads`: whether an origin's K/V go on to the
        next rank of the inner ring after a step (a later step of the same node step reads them), and to the next
        node after a node step (a later node step reads them)."""
        n, g = self.topology.num_nodes, self.topology.node_size
        by_node = reads.reshape(self.size, n, g)
        later = np.flip(np.logical_or.accumulate(np.flip(by_node, 2), 2), 2)  # a step >= i of node step o reads
        inner = np.concatenate([later[:, :, 1:], np.zeros((self.size, n, 1), dtype=bool)], 2)
        node_reads = by_node.any(2)
        outer = np.flip(np.logical_or.accumulate(np.flip(node_reads, 1), 1), 1)
        outer = np.concatenate([outer[:, 1:], np.zeros((self.size, 1), dtype=bool)], 1)
        return inner.reshape(self.size, self.size), outer


def split_step_pairs(owner: np.ndarray, cap: int | None, steps: RingSteps) -> np.ndarray:
    """[W ranks, T steps] key blocks that queries of a split document read per ring step (one unit: a block pair).

    owner: the rank of each of the document's blocks; cap: key blocks a query block row reads at most (a sparse
    document's kept blocks), the diagonal block taken as kept and the others spread evenly over the earlier blocks
    (the planner knows how many blocks a row keeps, not which); None: every causal block (dense)."""
    w = steps.size
    rows = np.arange(len(owner))
    spread = None if cap is None else (np.minimum(rows + 1, cap) - 1) / np.maximum(rows, 1)
    by_owner = np.zeros((w, w))  # [q, k]: pairs of queries on q and keys on k
    for k in np.unique(owner):  # (1-D scans per rank: a cumsum down a [blocks, W] array is slower)
        on = owner == k
        before = np.cumsum(on) - on  # per query block: blocks j < i on rank k
        reads = on + before if spread is None else on + spread * before
        by_owner[:, k] = np.bincount(owner, weights=reads, minlength=w)
    return by_owner[np.arange(w)[:, None], steps.source]


def forwarded_tokens(pairs: np.ndarray, owner: np.ndarray, tokens: np.ndarray, steps: RingSteps
                     ) -> tuple[np.ndarray, np.ndarray]:
    """Tokens of a split document's K/V forwarded from each origin: ([W origins, T steps] along the inner ring after
    each step, [W origins, N node steps] to the next node after each node step), as far as some rank reads them
    (`pairs`, `split_step_pairs`; `tokens` per block)."""
    inner, outer = steps.forwards(steps.reads(pairs))
    held = np.bincount(owner, weights=tokens, minlength=steps.size)[:, None]
    return held * inner, held * outer


def pipelined_ring_time(work: np.ndarray, steps: RingSteps | None = None, inner: np.ndarray | None = None,
                        outer: np.ndarray | None = None) -> float:
    """Time of a ring over its steps, `work` [W ranks, T steps] (the same units out): a rank starts step t + 1 after
    it computed step t and, where it exchanges K/V with an inner neighbour at step t (someone further on still reads
    what the sender forwards), once that transfer is done: it starts when both ends started step t and takes
    `inner` [W origins, T steps] (the forwarded K/V's time; None: free). A node step's outer transfers (`outer`
    [W origins, N node steps]) start when both ends start the node step and are awaited before the next one.
    `steps`: None, a flat ring."""
    w = work.shape[0]
    steps = RingSteps.flat(w) if steps is None else steps
    g = steps.topology.node_size
    inner_sends, outer_sends = steps.forwards(steps.reads(work))
    src = steps.source
    ahead, up = steps.inner_next[:, 0], steps.outer_next[:, 0]
    behind, down = np.argsort(ahead), np.argsort(up)
    start, node_start = np.zeros(w), np.zeros(w)
    for t in range(w - 1):
        sends = inner_sends[src[:, t], t]  # [p]: p forwards to its inner neighbour after step t
        busy = 0.0 if inner is None else inner[src[:, t], t] * sends
        link = np.maximum(start, start[ahead]) + busy  # [p]: p -> its inner neighbour done
        nxt = np.maximum(start + work[:, t], np.maximum(sends * link, sends[behind] * link[behind]))
        if (t + 1) % g == 0:  # a node step ends: its outer transfers, posted when it began, are awaited
            o = t // g
            sends = outer_sends[src[:, o * g], o]
            busy = 0.0 if outer is None else outer[src[:, o * g], o] * sends
            link = np.maximum(node_start, node_start[up]) + busy
            nxt = np.maximum(nxt, np.maximum(sends * link, sends[down] * link[down]))
            node_start = nxt
        start = nxt
    return float((start + work[:, -1]).max())
