"""Document-aware sharding of a packed row (FlashCP): whole short documents, split long ones.

A packed row holds documents that never attend to each other. Block sharding (striped, zigzag,
contiguous) cuts every document across ranks, so the K/V of a short document travel the ring
although only its own queries read them. The planner instead:

* places a document whole on one rank (Whole-Doc) when it fits: its K/V never leave the rank;
* splits the documents too costly for one rank over all ranks (Per-Doc): striped blocks for a
  document with a sparse pattern (every rank and ring step gets an equal share of its
  vertical-slash work), head-tail chunks (2 x CP chunks, rank r takes r and 2CP-1-r; WLB-LLM) for a
  dense causal one;
* balances per rank the estimated attention work (causal token pairs, or the kept blocks of a
  sparse document) plus the linear work of its tokens plus the K/V it receives, sweeping how many
  of the costliest documents to split and keeping the plan with the fewest splits whose busiest
  rank is within `PlannerCosts.balance_slack` of the best one tried.

It runs on the CPU per batch and is a pure function of the document lengths, so every rank of a
CP group derives the same plan without communicating. The plan re-orders the row: split
documents first, then every rank's whole documents, each document contiguous and in order, a
document with a sparse pattern starting on a block boundary (its pattern then does not depend on
what else was packed), padding only between documents and never trained on. Attention results do
not depend on the order of documents: every token keeps its document, its position in it
(position_ids, so RoPE) and its target (labels are shifted before sharding).
"""

from __future__ import annotations

import functools
import heapq
from dataclasses import dataclass, field

import numpy as np
import torch

from ..attention.tokens import PAD_SEGMENT, TokenMeta, run_starts
from ..config import SparseAttentionConfig, check_block_size
from .sharding import BlockSplit

PAD, DENSE, SPARSE = "pad", "dense", "sparse"
# The sweep stops once the busiest rank is within this fraction of the mean.
_MIN_GAIN = 0.005


@dataclass(frozen=True)
class PlannerCosts:
    """Weights of the planner's cost model, in attention token pairs (one query against one key:
    4 x heads x head_dim FLOPs forward), so that they do not depend on the block size."""

    linear_per_token: float = field(
        default=9000.0,
        metadata={"help": "Work of the linear layers (projections, MLP) per token, in attention token pairs: "
                  "2 x (weights per layer) / (4 x heads x head_dim), about 9,000 for Qwen2.5-0.5B and 8,700 for "
                  "Qwen2.5-7B."},
    )
    comm_per_token: float = field(
        default=300.0,
        metadata={"help": "Cost of receiving one token's K/V, in attention token pairs: its bytes over the link's "
                  "bandwidth, in the time the GPU computes that many pairs (about 300 for Qwen2.5-0.5B over "
                  "NVLink, a few times more across nodes)."},
    )
    balance_slack: float = field(
        default=0.02,
        metadata={"help": "Imbalance accepted to save traffic: the plan with the fewest split documents whose "
                  "busiest rank is within this fraction of the best plan found."},
    )
    max_token_ratio: float = field(
        default=1.25,
        metadata={"help": "Most tokens a rank may hold, as a multiple of the mean (activation memory)."},
    )
    extra_splits: int = field(
        default=8,
        metadata={"help": "Split counts tried one by one beyond the documents that must be split; past them the "
                  "sweep grows by a quarter per try, up to every document, and stops once the ranks are balanced."},
    )


def attention_work(length: int, kind: str, block_size: int, kept_per_row: int | None = None) -> float:
    """Estimated attention work of one document in token pairs: its causal blocks, each query block
    row capped at `kept_per_row` key blocks for a sparse document, of block_size^2 pairs; 0 for padding."""
    nb = -(-length // block_size)
    if kind == PAD:
        return 0.0
    k = nb if kind != SPARSE or kept_per_row is None else min(nb, kept_per_row)
    return (k * (k + 1) / 2 + (nb - k) * k) * block_size**2


def _row_work(nb: int, kind: str, kept_per_row: int | None, block_size: int) -> np.ndarray:
    """`attention_work` per query block row (float64 [nb], token pairs)."""
    rows = np.arange(1, nb + 1, dtype=np.float64)
    if kind == PAD:
        return np.zeros(nb)
    rows = np.minimum(rows, kept_per_row) if kind == SPARSE and kept_per_row is not None else rows
    return rows * block_size**2


def kept_blocks_per_row(cfg: SparseAttentionConfig) -> int:
    """An upper estimate of the key blocks a query block row of a sparse document lists: the local
    window, each kept diagonal crossing two block diagonals, and the columns (budget and sinks)."""
    slash = cfg.slash_topk if cfg.budget_mode == "topk" else cfg.slash_cap
    vertical = cfg.vertical_topk if cfg.budget_mode == "topk" else cfg.vertical_cap
    bs = cfg.block_size
    return 1 + -(-cfg.local_window // bs) + 2 * slash + -(-(vertical + cfg.sink_tokens) // bs)


@dataclass(frozen=True, eq=False)
class DocumentPlan(BlockSplit):
    """A packed row split by documents over `cp_size` ranks (see the module docstring).

    lengths, kinds: every run of the row (documents and padding, in row order) and its kind
    ('sparse', 'dense', 'pad'); split: the runs split over all ranks; work: per rank the estimated
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
    """Owner rank of each block of a split document: striped (continuing a rotation over ranks),
    or head-tail for a dense causal one. (numpy: planning runs every step, and numpy's calls on
    small arrays cost a tenth of torch's.)"""
    j = np.arange(nb)
    if kind == SPARSE or nb < 2 * w:
        return (j + rotation) % w
    chunk = j * 2 * w // nb  # 2w chunks of near-equal size
    return np.where(chunk < w, chunk, 2 * w - 1 - chunk)


class _Candidate:
    """Loads of one sweep point: `split` documents split, the others placed greedily."""

    def __init__(self, split: list[int], placed: dict[int, int], load: list[float], owners: dict[int, np.ndarray]):
        self.split, self.placed, self.load, self.owners = split, placed, load, owners

    @property
    def cost(self) -> float:
        return max(self.load)


class _SplitShares:
    """Per document, once: the owner of each block if it is split, and the work and tokens that
    gives every rank. The stripe of a document starts where the blocks of the documents before it
    in the row would leave it, so that a document's split does not depend on which others split."""

    def __init__(self, lengths, kinds, kept_per_row, w: int, bs: int, costs: PlannerCosts) -> None:
        self.lengths, self.kinds, self.kept, self.w, self.bs, self.costs = lengths, kinds, kept_per_row, w, bs, costs
        blocks = [-(-n // bs) for n in lengths]
        self.rotation = np.cumsum([0, *blocks[:-1]]) % w
        self.cache: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}

    def __call__(self, i: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(owner per block, work per rank, tokens per rank) of document i split."""
        if i not in self.cache:
            w, bs, n, kind = self.w, self.bs, self.lengths[i], self.kinds[i]
            nb = -(-n // bs)
            owner = _split_blocks(nb, kind, w, int(self.rotation[i]))
            held = np.bincount(owner, minlength=w).astype(np.float64) * bs
            received = np.maximum(n - held, 0) if kind != PAD else np.zeros(w)
            work = (np.bincount(owner, weights=_row_work(nb, kind, self.kept, bs), minlength=w)
                    + self.costs.linear_per_token * held + self.costs.comm_per_token * received)
            self.cache[i] = owner, work, held
        return self.cache[i]


def _evaluate(order: list[int], n_split: int, lengths, work, shares: _SplitShares, w: int,
              token_cap: float) -> _Candidate:
    split = sorted(order[:n_split])
    load_v, tokens_v = np.zeros(w), np.zeros(w)
    owners: dict[int, np.ndarray] = {}
    for i in split:
        owners[i], doc_work, held = shares(i)
        load_v += doc_work
        tokens_v += held
    load, tokens = load_v.tolist(), tokens_v.tolist()
    heap = [(load[r], r) for r in range(w)]
    heapq.heapify(heap)
    placed: dict[int, int] = {}
    for i in order[n_split:]:
        skipped = []
        while True:  # the least loaded rank with room for the document's tokens (else the least loaded)
            lo, r = heapq.heappop(heap)
            if tokens[r] + lengths[i] <= token_cap or not heap:
                break
            skipped.append((lo, r))
        if tokens[r] + lengths[i] > token_cap and skipped:
            skipped.append((lo, r))
            lo, r = min(skipped, key=lambda t: (tokens[t[1]], t[1]))
            skipped.remove((lo, r))
        for item in skipped:
            heapq.heappush(heap, item)
        placed[i] = r
        load[r] += work[i]
        tokens[r] += lengths[i]
        heapq.heappush(heap, (load[r], r))
    return _Candidate(split, placed, load, owners)


def _split_counts(must: int, most: int, step_by_one: int):
    """The numbers of split documents the sweep tries: one by one for `step_by_one` tries, then
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
) -> DocumentPlan:
    """The document-aware split of one packed row (deterministic: the same on every rank).

    Args:
        lengths: token counts of the row's runs in order (documents and padding runs).
        kinds: per run, 'sparse' (a vertical-slash pattern), 'dense' (causal) or 'pad' (no attention).
        cp_size, block_size: ranks of the CP group and the attention layout's block.
        kept_per_row: key blocks a query block row of a sparse document lists (`kept_blocks_per_row`).
        costs: the cost model's weights.
    """
    check_block_size(block_size)
    if cp_size < 1:
        raise ValueError(f"cp_size={cp_size} must be >= 1.")
    if len(lengths) != len(kinds) or not lengths:
        raise ValueError("plan_documents needs one kind per run and at least one run.")
    if any(n < 1 for n in lengths) or any(k not in (PAD, DENSE, SPARSE) for k in kinds):
        raise ValueError(f"runs must have >= 1 token and a kind in {(PAD, DENSE, SPARSE)}.")
    costs = PlannerCosts() if costs is None else costs
    w, bs = cp_size, block_size
    work = [attention_work(n, k, bs, kept_per_row) + costs.linear_per_token * n for n, k in zip(lengths, kinds)]
    total_tokens = sum(lengths)
    token_cap = costs.max_token_ratio * total_tokens / w + bs
    mean = sum(work) / w
    order = sorted(range(len(lengths)), key=lambda i: (-work[i], i))
    must = sum(1 for i in order if (work[i] > mean or lengths[i] > token_cap) and kinds[i] != PAD)
    splittable = sum(1 for i in order if kinds[i] != PAD and lengths[i] > bs)
    shares = _SplitShares(lengths, kinds, kept_per_row, w, bs, costs)
    tried = []  # in order of more split documents, i.e. more traffic
    for n_split in _split_counts(must, splittable, costs.extra_splits):
        if any(kinds[i] == PAD for i in order[:n_split]):
            break
        tried.append(_evaluate(order, n_split, lengths, work, shares, w, token_cap))
        if tried[-1].cost <= sum(tried[-1].load) / w * (1 + _MIN_GAIN):  # balanced: more splits only add traffic
            break
    if not tried:
        tried.append(_evaluate(order, 0, lengths, work, shares, w, token_cap))
    lowest = min(c.cost for c in tried)
    return _materialize(next(c for c in tried if c.cost <= lowest * (1 + costs.balance_slack)), lengths, kinds, w, bs)


def split_every_document(lengths: list[int], kinds: list[str], cp_size: int, block_size: int) -> DocumentPlan:
    """The Per-Doc baseline (WLB-LLM): every document split over all ranks in head-tail chunks (in
    block units; a document of fewer than 2 x CP blocks round robin), padding runs kept whole."""
    costs = PlannerCosts()
    work = [attention_work(n, k, block_size) + costs.linear_per_token * n for n, k in zip(lengths, kinds)]
    docs = [i for i, k in enumerate(kinds) if k != PAD]
    order = docs + [i for i, k in enumerate(kinds) if k == PAD]
    dense = [DENSE if k != PAD else PAD for k in kinds]  # head-tail, whatever the pattern
    shares = _SplitShares(lengths, dense, None, cp_size, block_size, costs)
    cand = _evaluate(order, len(docs), lengths, work, shares, cp_size, float("inf"))
    return _materialize(cand, lengths, kinds, cp_size, block_size)


def _materialize(cand: _Candidate, lengths, kinds, w: int, bs: int) -> DocumentPlan:
    """Global order, block owners and segments of a candidate."""
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

    for i in cand.split:
        pieces.append((starts[i], lengths[i]))
        pad_to_block(lengths[i])
        owners.append(torch.from_numpy(cand.owners[i]))
    split_blocks = np.zeros(w, dtype=np.int64)
    for i in cand.split:
        split_blocks += np.bincount(cand.owners[i], minlength=w)
    by_rank: list[list[int]] = [[] for _ in range(w)]
    for i, rank in sorted(cand.placed.items(), key=lambda t: (kinds[t[0]] != SPARSE, t[0])):
        by_rank[rank].append(i)  # sparse documents first (block aligned), then in row order
    for r in range(w):
        used = 0
        for i in by_rank[r]:
            if kinds[i] == SPARSE:
                used = pad_to_block(used)
            pieces.append((starts[i], lengths[i]))
            used += lengths[i]
        used = pad_to_block(used)
        if not used and not split_blocks[r]:  # a rank the row cannot feed still gets a (padding) block: no empty shard
            pieces.append((-1, bs))
            used = bs
        owners.append(torch.full((used // bs,), r, dtype=torch.long))
    return DocumentPlan(w, bs, sum(lengths), tuple(lengths), tuple(kinds), tuple(cand.split), tuple(pieces),
                        torch.cat(owners), tuple(cand.load))


def row_runs(meta: TokenMeta, cfg: SparseAttentionConfig) -> tuple[list[int], list[str]]:
    """The runs of a batch's rows (documents and padding, the same in every row) and their kinds."""
    seg = meta.segment
    if seg.shape[0] > 1 and not bool((seg == seg[:1]).all()):
        raise ValueError(
            "document sharding plans one packed row, but the rows of this batch have different documents: pack "
            "each batch into one row (DataCollatorWithFlattening, or --pack_documents) or use "
            "--cp_sharding striped."
        )
    starts = run_starts(seg[:1])[0].nonzero().flatten().tolist() + [seg.shape[1]]
    ids = seg[0, starts[:-1]].tolist()
    lengths = [b - a for a, b in zip(starts, starts[1:])]
    sparse_ok = cfg.pattern != "dense"
    kinds = [PAD if d == PAD_SEGMENT else SPARSE if sparse_ok and n >= max(cfg.min_seq_len, 1) else DENSE
             for d, n in zip(ids, lengths)]
    return lengths, kinds


def plan_row(meta: TokenMeta, cfg: SparseAttentionConfig, cp_size: int, costs: PlannerCosts | None = None
             ) -> DocumentPlan:
    """`plan_documents` for the documents of a batch's `TokenMeta` [B, S] under pattern settings `cfg`."""
    lengths, kinds = row_runs(meta, cfg)
    kept = kept_blocks_per_row(cfg) if cfg.pattern != "dense" else None
    return plan_documents(lengths, kinds, cp_size, cfg.block_size, kept_per_row=kept, costs=costs)


def balance_ratio(plan: DocumentPlan) -> float:
    """max / mean of the planner's estimated per-rank work."""
    return max(plan.work) / (sum(plan.work) / len(plan.work)) if any(plan.work) else 1.0


__all__ = ["DocumentPlan", "PlannerCosts", "attention_work", "balance_ratio", "kept_blocks_per_row", "plan_documents",
           "plan_row", "row_runs", "split_every_document"]
