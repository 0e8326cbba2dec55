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
"""

from __future__ import annotations

import bisect
import functools
import heapq
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from ...attention.tokens import PAD_SEGMENT, TokenMeta
from ...config import SparseAttentionConfig, check_block_size
from ..comm import RingTopology
from .blocks import BlockSplit
from .ring_time import RingSteps, forwarded_tokens, pipelined_ring_time, split_step_pairs

PAD, DENSE, SPARSE = "pad", "dense", "sparse"

# The attention kernel's FLOP/s on the pairs it computes over the matrix products': a token pair costs more time
# than its FLOPs' share of the linear layers. About 0.4: our kernels' 284 TFLOP/s on the computed pairs (H100,
# 128K, 5% kept; 299 on an H200) over the 753 TFLOP/s the cluster simulator's H100 calibration gives the linear
# layers and LM head (liger-kernel steps of Qwen2.5-0.5B/1.5B). benchmarks/bench_attention.py measures both rates on
# one GPU (its `rate_shares`: ours over an MLP product's, forward + backward): on an H200 (2026-12-04, 128K, head_dim
# 128) 0.43 on a 5%-kept layout, 0.52 on an estimated one (20% kept), 0.56 dense, over the product's 685 TFLOP/s; one
# GPU's figures, within 0.4 to 0.56, so the constant stays until more GPUs are measured.
ATTENTION_RATE_SHARE = 0.4


def linear_weight(flop_pairs: float) -> float:
    """The planner's `linear_per_token` for linear work per token of `flop_pairs` attention token pairs in FLOPs
    (2 x weights / (4 x heads x head_dim)): in time, at `ATTENTION_RATE_SHARE`."""
    return ATTENTION_RATE_SHARE * flop_pairs


@dataclass(frozen=True)
class PlannerCosts:
    """Weights of the planner's cost model, in attention token pairs (one query against one key:
    4 x heads x head_dim FLOPs forward), so that they do not depend on the block size."""

    linear_per_token: float = field(
        default=9000.0,
        metadata={"help": "Work of the linear layers (projections, MLP, a layer's share of the LM head) per token, "
                  "in attention token pairs: 2 x (weights per layer) / (4 x heads x head_dim) in FLOPs, in time "
                  "(`linear_weight`): about 4,600 for Qwen2.5-0.5B and 14,100 for Qwen2.5-7B. Training counts it "
                  "from the model (`integration.planner_weights`); this default serves where none is counted."},
    )
    comm_per_token: float = field(
        default=300.0,
        metadata={"help": "Cost of receiving one token's K/V, in attention token pairs: its bytes over the link's "
                  "bandwidth, in the time the GPU computes that many pairs (about 300 for Qwen2.5-0.5B over "
                  "NVLink, a few times more across nodes)."},
    )
    balance_slack: float = field(
        default=0.02,
        metadata={"help": "Imbalance accepted to save traffic or ring time: a cut between ranks within this "
                  "fraction of a rank's work of a document's start moves to it, keeping the document whole; of the "
                  "plans whose busiest rank is within it of the best, the one with the quickest ring wins."},
    )
    max_token_ratio: float = field(
        default=1.25,
        metadata={"help": "Most tokens a rank may hold in its blocks (a document's last block counted whole), as a "
                  "multiple of the mean, plus one block (activation memory)."},
    )
    extra_splits: int = field(
        default=8,
        metadata={"help": "Numbers of documents cut tried one by one beyond those that must be cut; past them the "
                  "sweep grows by a quarter per try, up to every document, and stops once the ranks are balanced."},
    )
    ring_share: float = field(
        default=0.5,
        metadata={"help": "A document with at least this share of the row's work is split over the whole ring "
                  "(striped, or head-tail if dense), so that every ring step gets an equal share of it; smaller "
                  "ones are split, if at all, over a few consecutive ranks."},
    )


def kept_blocks_per_row(cfg: SparseAttentionConfig) -> int | None:
    """An upper estimate of the key blocks a query block row of a sparse document lists: the local
    window, the block diagonals its kept diagonals cross and the columns (the budget's most and the
    sinks); None where the budget bounds no diagonals or no columns (every causal block may be kept)."""
    bs, budget = cfg.block_size, cfg.budget
    diagonals, columns = budget.most_diagonal_blocks(bs), budget.most_kept("columns")
    if diagonals is None or columns is None:
        return None
    return 1 + -(-cfg.local_window // bs) + diagonals + -(-(columns + cfg.sink_tokens) // bs)


@dataclass(frozen=True, eq=False)
class DocumentPlan(BlockSplit):
    """A packed row split by documents over `cp_size` ranks (see the module docstring).

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


def _block_costs(lengths: np.ndarray, kinds: list[str], kept_per_row: int | None, bs: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """(attention work, tokens) of every block of the documents `lengths`, in order: a query block row's
    attention is its causal key blocks, capped at `kept_per_row` for a sparse document, of bs^2 token pairs
    each (0 for padding)."""
    nb = -(-lengths // bs)
    first = np.repeat(np.cumsum(nb) - nb, nb)
    row = np.arange(int(nb.sum())) - first
    cap = np.array([kept_per_row if k == SPARSE and kept_per_row else np.iinfo(np.int64).max for k in kinds])
    tokens = np.full(row.size, float(bs))
    tokens[np.cumsum(nb) - 1] = lengths - (nb - 1) * bs
    attention = np.minimum(row + 1, np.repeat(cap, nb)) * float(bs * bs)
    attention[np.repeat(np.array([k == PAD for k in kinds]), nb)] = 0.0
    return attention, tokens


@dataclass
class _Blocks:
    """Every document's blocks in row order: their `work` (attention + `linear_per_token` per token),
    `attention` and `tokens` (`_block_costs`), document i holding blocks first[i]:first[i + 1] (flat arrays:
    the planner runs every step, and a thousand per-document arrays cost more than the plan)."""

    work: np.ndarray
    attention: np.ndarray
    tokens: np.ndarray
    first: np.ndarray

    @classmethod
    def of_row(cls, lengths, kinds, kept_per_row: int | None, bs: int, costs: PlannerCosts) -> _Blocks:
        n = np.array(lengths)
        attention, tokens = _block_costs(n, kinds, kept_per_row, bs)
        return cls(attention + costs.linear_per_token * tokens, attention, tokens,
                   np.concatenate([[0], np.cumsum(-(-n // bs))]))

    @functools.cached_property
    def document_attention(self) -> np.ndarray:
        """Estimated attention work of each document (token pairs)."""
        return np.add.reduceat(self.attention, self.first[:-1])

    def document_work(self) -> list[float]:
        """Estimated work of each document (attention + linear, token pairs)."""
        return np.add.reduceat(self.work, self.first[:-1]).tolist()

    def rotation(self, w: int) -> np.ndarray:
        """The rank each document's stripe starts on: where the blocks before it leave the rotation."""
        return self.first[:-1] % w

    def of(self, docs: list[int]) -> tuple[np.ndarray, np.ndarray]:
        """(work, tokens) of the blocks of `docs`, laid out in that order."""
        picks = [slice(self.first[i], self.first[i + 1]) for i in docs]
        return np.concatenate([self.work[p] for p in picks]), np.concatenate([self.tokens[p] for p in picks])


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


def sparse_from(cfg: SparseAttentionConfig) -> float:
    """The shortest document that some layer of `cfg` attends with a sparse pattern (`min_seq_len`; inf: every layer
    dense). Every layer's (`layer_configs`: `layer_overrides` may set a lower min_seq_len, or a sparse pattern over a
    dense one), since the plan that keeps such a document at its offset inside a block serves every layer: planned
    from the base pattern alone, a document that only an overridden layer attends sparsely was moved off its offset,
    and that layer's block grid, so its pattern, differed from one process's (#50)."""
    return min((max(layer.min_seq_len, 1) for layer in cfg.layer_configs() if layer.pattern != "dense"),
               default=float("inf"))


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


def plan_row(meta: TokenMeta, cfg: SparseAttentionConfig, cp_size: int, costs: PlannerCosts | None = None,
             topology: RingTopology | None = None) -> DocumentPlan:
    """`plan_documents` for the runs (`row_runs`) of a batch's `TokenMeta` [B, S] under pattern settings `cfg`."""
    shortest = sparse_from(cfg)  # (once: ~2 ms a call with layer_overrides)
    lengths, kinds = row_runs(meta, cfg, shortest)
    kept = kept_blocks_per_row(cfg) if cfg.pattern != "dense" else None
    plan = plan_documents(lengths, kinds, cp_size, cfg.block_size, kept_per_row=kept, costs=costs,
                          topology=topology)
    return replace(plan, sparse_from=shortest)


def balance_ratio(plan: DocumentPlan) -> float:
    """max / mean of the planner's estimated per-rank work."""
    return max(plan.work) / (sum(plan.work) / len(plan.work)) if any(plan.work) else 1.0


__all__ = ["DocumentPlan", "PlannerCosts", "balance_ratio", "check_planned_pattern", "idle_documents_as_padding",
           "kept_blocks_per_row", "plan_documents", "plan_row", "row_runs", "sparse_from", "split_every_document"]
