"""Document-aware sharding of a packed row (FlashCP): whole short documents, split long ones.

A packed row holds documents that never attend to each other. Block sharding (striped, zigzag,
contiguous) cuts every document across ranks, so the K/V of a short document travel the ring
although only its own queries read them. The planner instead:

* places a document whole on one rank (Whole-Doc) when it fits: its K/V never leave the rank;
* cuts the documents too costly for one rank into contiguous pieces on consecutive ranks, in ring
  order and document order: a key block is read only on its own rank and the ranks after it, so
  its K/V travel at most as many hops as the document spans ranks, never round the ring;
* splits a document holding most of the row's work over every rank (Per-Doc): striped blocks if it
  has a sparse pattern (every rank and ring step gets an equal share of its vertical-slash work),
  head-tail chunks (2 x CP chunks, rank r takes r and 2CP-1-r; WLB-LLM) if it is dense causal;
* balances per rank the estimated attention work (causal token pairs, or the kept blocks of a
  sparse document) plus the linear work of its tokens plus the K/V it receives, within a token
  cap (activation memory): whole documents first, then the cut brings every rank to one level.
  It sweeps how many documents to cut and to split over the ring and, of the plans whose busiest rank
  is within `PlannerCosts.balance_slack` of the best one tried, keeps the one whose attention the ring
  runs in the least time, its ranks waiting for their neighbours (`ring_time`).

It runs on the CPU per batch and is a pure function of the document lengths, so every rank of a
CP group derives the same plan without communicating. A batch of several rows with different documents is
planned as one row of runs, each a stretch that no row's document crosses (`row_runs`; a padded batch of
unpacked sequences: one run of text and one of padding at the end). The plan re-orders the row: split
documents first, then every rank's whole documents, each document contiguous and in order, a
run with a sparse pattern at the offset inside a block it has in the row (`sparse_leads`: a
block-sparse layout's kept blocks cover other tokens where a document starts elsewhere inside a
block), padding only between documents and never trained on. Attention results do not depend on
the order of documents: every token keeps its document, its position in it (position_ids, so RoPE),
its offset inside a block and its target (labels are shifted before sharding), so the plan computes
what one process computes on the row.

Here the planner itself (`plan_documents`, `plan_row`, and the Per-Doc baseline `split_every_document`); its cost
model in `document_costs.py`, its placements in `document_placement.py`, its result (`DocumentPlan`) in
`document_plan.py`, and the runs it places, read from a batch, in `document_runs.py`.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import numpy as np

from ...attention.tokens import TokenMeta
from ...config import SparseAttentionConfig, check_block_size
from ..comm import RingTopology
from .document_costs import DENSE, PAD, SPARSE, PlannerCosts, _Blocks, kept_blocks_per_row
from .document_placement import _cut, _fill, _Placement, _ring_time
from .document_plan import DocumentPlan, _materialize, sparse_leads
from .document_runs import row_runs, sparse_from
from .ring_time import RingSteps


def _split_counts(must: int, most: int, step_by_one: int):
    """The numbers of documents cut that the sweep tries: one by one for `step_by_one` tries, then
    growing by a quarter, up to `most`."""
    n = must
    while n < most:
        yield n
        n = n + 1 if n < must + step_by_one else max(n + 1, n * 5 // 4)
    if most >= must:
        yield most


def plan_documents(
    lengths: list[int],
    kinds: list[str],
    cp_size: int,
    block_size: int,
    *,
    kept_per_row: int | None = None,
    costs: PlannerCosts | None = None,
    topology: RingTopology | None = None,
) -> DocumentPlan:
    """The document-aware split of one packed row (deterministic: the same on every rank).

    A document holding at least `ring_share` of the row's work is split over the whole ring. Of the
    others, the n costliest are laid out and cut into one contiguous range per rank (`_cut`), and the
    rest placed whole (`_fill`); n is swept from the documents that must be cut (more work than a
    rank's share, or more tokens than it may hold). Of the plans whose busiest rank is within
    `balance_slack` of the best one tried, the one whose attention the ring runs in the least time wins
    (`ring_time`: equal work per rank still waits where it comes at the steps the neighbours wait for);
    on a tie, the one with the fewest documents cut.

    Args:
        lengths: token counts of the row's runs in order (documents and padding runs).
        kinds: per run, 'sparse' (a vertical-slash pattern), 'dense' (causal) or 'pad' (no attention).
        cp_size, block_size: ranks of the CP group and the attention layout's block.
        kept_per_row: key blocks a query block row of a sparse document lists (`kept_blocks_per_row`).
        costs: the cost model's weights.
        topology: the ring the plan runs on (its steps order a split document's work; a hierarchical ring reaches
            another node's K/V only after a whole inner ring); None: a flat ring of `cp_size` ranks.
    """
    check_block_size(block_size)
    if cp_size < 1:
        raise ValueError(f"cp_size={cp_size} must be >= 1.")
    if topology is not None and topology.size != cp_size:
        raise ValueError(f"the ring's topology ({topology.num_nodes} x {topology.node_size} ranks) does not hold "
                         f"cp_size={cp_size} ranks.")
    if len(lengths) != len(kinds) or not lengths:
        raise ValueError("plan_documents needs one kind per run and at least one run.")
    if any(n < 1 for n in lengths) or any(k not in (PAD, DENSE, SPARSE) for k in kinds):
        raise ValueError(f"runs must have >= 1 token and a kind in {(PAD, DENSE, SPARSE)}.")
    costs = PlannerCosts() if costs is None else costs
    w, bs = cp_size, block_size
    leads = sparse_leads(lengths, kinds, bs)
    spans = [n + lead for n, lead in zip(lengths, leads)]  # the tokens a run takes in the plan
    slots = [-(-n // bs) * bs for n in spans]  # and the tokens its blocks hold (a rank's activations)
    blocks = _Blocks.of_row(spans, kinds, kept_per_row, bs, costs)
    work, rotation = blocks.document_work(), blocks.rotation(w)
    token_cap = costs.max_token_ratio * sum(slots) / w + bs
    mean = sum(work) / w
    order = sorted((i for i, k in enumerate(kinds) if k != PAD), key=lambda i: (-work[i], i))
    must = [(work[i] > mean or slots[i] > token_cap) and spans[i] > bs for i in order]  # (a block: not cut)
    ring_work = costs.ring_share * sum(work)
    whole_ring = sum(1 for i in order if w > 1 and work[i] >= ring_work and spans[i] > bs)

    def placement(m: int, n: int) -> _Placement:
        at = _Placement(np.zeros(w), np.zeros(w))
        for i in order[:m]:
            at.spread_over_ring(i, kinds[i], *blocks.of([i]), int(rotation[i]), costs, bs)
        left = _fill(at, order[m + n:], slots, work, token_cap)
        if n or left:  # after the whole documents: the cut brings every rank to one level
            _cut(at, order[m: m + n] + left, blocks, bs, costs, token_cap)
        return at

    def balanced(at: _Placement, slack: float) -> bool:
        return at.load.max() <= at.load.mean() * (1 + slack)

    tried = []  # in order of more traffic: more documents over the whole ring, then more cut
    for m in range(whole_ring, max(whole_ring, sum(must)) + 1):
        before = min((at.load.max() for at in tried), default=np.inf)
        cuttable = sum(1 for i in order[m:] if spans[i] > bs)
        for n in _split_counts(sum(must[m:]), cuttable, costs.extra_splits):
            tried.append(placement(m, n))
            if balanced(tried[-1], costs.balance_slack):  # more cuts would only add traffic
                break
        best = min(at.load.max() for at in tried)
        if balanced(min(tried, key=lambda at: at.load.max()), costs.balance_slack) or best >= before:
            break  # balanced, or one more document over the ring did not help
    lowest = min(at.load.max() for at in tried)
    near = [at for at in tried if at.load.max() <= lowest * (1 + costs.balance_slack)]
    caps = [kept_per_row if k == SPARSE else None for k in kinds]
    over_ring: dict[int, tuple] = {}
    steps = RingSteps(RingTopology(1, w) if topology is None else topology)
    time = functools.partial(_ring_time, blocks=blocks, caps=caps, costs=costs, bs=bs, steps=steps,
                             over_ring=over_ring)
    at = near[0]
    if len(near) > 1:  # (an estimate takes about a ms at CP 32: spent only where there is a choice)
        at = min(near, key=time)  # (ties: the first, fewest documents cut)
    _fill(at, [i for i, k in enumerate(kinds) if k == PAD], lengths, [0.0] * len(lengths), float("inf"))
    return _materialize(at, lengths, leads, kinds, w, bs)


def split_every_document(lengths: list[int], kinds: list[str], cp_size: int, block_size: int) -> DocumentPlan:
    """The Per-Doc baseline (WLB-LLM): every document split over all ranks in head-tail chunks (in
    block units; a document of fewer than 2 x CP blocks round robin), padding runs kept whole."""
    costs = PlannerCosts()
    at = _Placement(np.zeros(cp_size), np.zeros(cp_size))
    dense = [DENSE if k != PAD else PAD for k in kinds]  # head-tail, whatever the pattern
    blocks = _Blocks.of_row(lengths, dense, None, block_size, costs)
    rotation = blocks.rotation(cp_size)
    for i, kind in enumerate(dense):
        if kind != PAD:
            at.spread_over_ring(i, kind, *blocks.of([i]), int(rotation[i]), costs, block_size)
    _fill(at, [i for i, k in enumerate(kinds) if k == PAD], lengths, [0.0] * len(lengths), float("inf"))
    return _materialize(at, lengths, [0] * len(lengths), kinds, cp_size, block_size)


def plan_row(meta: TokenMeta, cfg: SparseAttentionConfig, cp_size: int, costs: PlannerCosts | None = None,
             topology: RingTopology | None = None) -> DocumentPlan:
    """`plan_documents` for the runs (`row_runs`) of a batch's `TokenMeta` [B, S] under pattern settings `cfg`."""
    shortest = sparse_from(cfg)  # (once: ~2 ms a call with layer_overrides)
    lengths, kinds = row_runs(meta, cfg, shortest)
    kept = kept_blocks_per_row(cfg) if cfg.pattern != "dense" else None
    plan = plan_documents(lengths, kinds, cp_size, cfg.block_size, kept_per_row=kept, costs=costs,
                          topology=topology)
    return replace(plan, sparse_from=shortest)


__all__ = ["plan_documents", "plan_row", "split_every_document"]
