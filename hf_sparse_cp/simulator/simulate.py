"""Predicted time of ring attention on a cluster, from the plan the ring executes.

What a rank computes at each ring step and what it sends in each communication slot come from the
same objects `ring_sparse_attention` runs: `TransferSets` and `slot_ops` (through
`traffic.plan_traffic`) for the transfers, the owner of every listed key block for the work
(equal, step by step, to the layouts `RingPlan` builds; tests/unit/test_simulate.py checks both).

Time: a step's compute is a linear cost model of its work (`KernelCosts`: per call, per query
row, per block pair, per padded slot). The transfers follow the ring's schedule exactly
(`ring/attention.py`'s `_run`): slot ('outer', o) is posted before node step o's inner ring and awaited
after it, slot ('inner', o, i) is posted before step (o, i) computes and awaited after it. A
transfer starts when both ends have posted it (or, on a cluster whose transfers cannot progress
while a rank computes, when both have finished computing) and lasts latency + bytes / bandwidth
of its link; sends of one rank in one slot over one kind of link go one after the other. A rank
leaves a slot when it has computed and every transfer it takes part in is done, so a step costs
max(compute, transfer) plus what cannot hide, and a slow rank holds up its neighbours. The
key columns' transfers (rows to their readers forward, dK/dV back backward) are posted before the
ring, as the code posts them, and awaited after it.

A configuration (split, ring shape, layout kind) is one entry of `CONFIGURATIONS`: a function of a
`Workload` (a row's documents and its layouts in any split's order) returning the `RingSetup` to
simulate. The splits are the block shardings and the document planner (`split.documents.plan_documents`,
ragged per-rank block counts), flat or hierarchical rings.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from ..attention.layout import SparseLayout
from ..distributed.comm import RingTopology
from ..distributed.ring.plan import check_global_layout
from ..distributed.split.blocks import BlockSplit, ShardPlan
from ..distributed.split.document_costs import PlannerCosts
from ..distributed.split.documents import plan_documents
from .traffic import COLUMNS, PlanTraffic


@dataclass(frozen=True)
class Link:
    """One direction of a point-to-point link: bytes per second and seconds of latency per transfer."""

    bandwidth: float
    latency: float
    source: str = ""


@dataclass(frozen=True)
class Cluster:
    """Ranks in nodes of `gpus_per_node`; CP ranks are consecutive (CP is the innermost mesh dimension).

    overlap: transfers progress while a rank computes (GPUs: NCCL runs beside the kernels); when
    False a transfer starts only once both ends have finished computing the step.
    """

    name: str
    gpus_per_node: int
    intra: Link
    inter: Link
    overlap: bool = True

    def link(self, a: int, b: int) -> Link:
        return self.intra if a // self.gpus_per_node == b // self.gpus_per_node else self.inter

    def group_link(self, size: int) -> Link:
        """The slowest link of a ring collective over ranks 0..size-1."""
        return self.intra if size <= self.gpus_per_node else self.inter

    def without_network(self) -> Cluster:
        """The same cluster with free communication (to measure what communication costs)."""
        free = Link(float("inf"), 0.0, "ideal")
        return replace(self, intra=free, inter=free)


def all_gather_time(chunk_bytes: float, size: int, link: Link) -> float:
    """Ring all-gather: size - 1 hops of one rank's chunk."""
    return (size - 1) * (link.latency + chunk_bytes / link.bandwidth) if size > 1 else 0.0


def all_reduce_time(nbytes: float, size: int, link: Link) -> float:
    """Ring all-reduce (reduce-scatter + all-gather): 2 (size - 1) hops of nbytes / size."""
    return 2 * (size - 1) * (link.latency + nbytes / size / link.bandwidth) if size > 1 else 0.0


@dataclass
class PlanWork:
    """Work of every rank [W, steps + 1] per ring step (o * node_size + i) and the final column
    ("bar") step, counted over the layout's heads (`heads`) and batch rows:

    blocks: listed key blocks (bar step: listed columns / block_size);
    rows:   query-block rows listing at least one of them;
    padded: rows x the widest row of the step (the shape a padded kernel such as the PyTorch
            reference computes: all of the rank's query blocks, each as wide as the widest; ranks
            of an uneven split, such as the document planner's, count their own blocks);
            in block units;
    calls:  1 where the rank runs the step (the ring skips steps whose layout lists nothing).
    """

    blocks: torch.Tensor
    rows: torch.Tensor
    padded: torch.Tensor
    calls: torch.Tensor
    heads: int


def plan_work(layout: SparseLayout, plan: BlockSplit, topology: RingTopology) -> PlanWork:
    """Per-rank, per-step work of the ring over the global `layout` split by `plan` (any split:
    block shardings, or the document planner's ragged one)."""
    check_global_layout(layout, plan)
    w, bs = plan.cp_size, plan.block_size
    b, h, nqb = layout.block_idx.shape[:3]
    owner = plan.block_owner
    blk = layout.block_idx.long().cpu()
    valid = layout.valid_blocks().cpu()
    # counts[row, source]: listed key blocks of `source` in every (batch row, head, query block)
    counts = torch.zeros(b * h * nqb * w, dtype=torch.float64)
    row_id = torch.arange(b * h * nqb).view(b, h, nqb, 1)
    flat = (row_id * w + owner[blk.clamp_min(0)])[valid]
    counts.index_add_(0, flat, torch.ones(flat.shape, dtype=torch.float64))
    counts = counts.view(b, h, nqb, w).permute(2, 0, 1, 3).reshape(nqb, b * h, w)
    cols = layout.col_cnt.double().cpu().permute(2, 0, 1).reshape(nqb, b * h, 1)
    counts = torch.cat([counts, cols / bs], 2)  # the bar step as source W
    # every rank's query blocks; short ranks padded with block nqb, an empty row appended here
    counts = torch.cat([counts, counts.new_zeros(1, *counts.shape[1:])])
    by_rank = counts[plan.padded_rank_blocks]  # [W, most local blocks, b*h, W+1]
    blocks = by_rank.sum((1, 2))
    rows = (by_rank > 0).sum((1, 2)).double()
    local = torch.tensor([float(plan.blocks_of(r).numel()) for r in range(w)], dtype=torch.float64)
    padded = by_rank.amax((1, 2)) * local.unsqueeze(1) * b * h
    n, l = topology.num_nodes, topology.node_size
    sources = torch.tensor([[topology.source(r, o, i) for o in range(n) for i in range(l)] + [w] for r in range(w)])
    blocks, rows, padded = (x.gather(1, sources) for x in (blocks, rows, padded))
    return PlanWork(blocks, rows, padded, (blocks > 0).double(), h)


@dataclass(frozen=True)
class KernelCosts:
    """Seconds of one attention call (forward or backward) as a linear model of its work (per head
    of the model): call + row x rows + block x blocks + slot x padded."""

    call: float = 0.0
    row: float = 0.0
    block: float = 0.0
    slot: float = 0.0

    def time(self, work: PlanWork, heads: int) -> torch.Tensor:
        """float64 [W, steps + 1]: seconds of every step for a model with `heads` query heads."""
        per_head = heads / work.heads
        return (self.call * work.calls
                + per_head * (self.row * work.rows + self.block * work.blocks + self.slot * work.padded))


@dataclass
class RingTimeline:
    """One pass (forward or backward) of the ring, all ranks starting at 0.

    end [W]: when each rank is done; compute [W]: its seconds of compute; step_compute [T]: the
    busiest rank's compute at each ring step; step_transfer [T]: the longest transfer of the step's
    inner slot; step_time [T]: how long the slowest rank spent in the step (transfers awaited)."""

    end: torch.Tensor
    compute: torch.Tensor
    step_compute: torch.Tensor
    step_transfer: torch.Tensor
    step_time: torch.Tensor

    @property
    def time(self) -> float:
        return float(self.end.max())


def _slot(slot, sends, post, reach, cluster: Cluster) -> tuple[torch.Tensor, float]:
    """When each rank's transfers of `slot` are done (at least `reach`), and the longest transfer."""
    start_at = post if cluster.overlap else reach
    done = reach.clone()
    free: dict[tuple, float] = {}
    longest = 0.0
    for p, by_slot in enumerate(sends):
        for peer, nbytes in by_slot.get(slot, ()):
            link = cluster.link(p, peer)
            key = (p, link is cluster.intra)
            start = max(float(start_at[p]), float(start_at[peer]), free.get(key, 0.0))
            duration = link.latency + nbytes / link.bandwidth
            finish = start + duration
            free[key] = finish
            longest = max(longest, duration)
            done[p] = max(float(done[p]), finish)
            done[peer] = max(float(done[peer]), finish)
    return done, longest


def simulate_ring(step_seconds: torch.Tensor, traffic: PlanTraffic, topology: RingTopology, cluster: Cluster, *,
                  backward: bool, start: torch.Tensor | None = None) -> RingTimeline:
    """Play one pass of the ring's schedule (see the module docstring).

    step_seconds: float64 [W, steps + 1], compute of every ring step and the bar step (0: none).
    start: float64 [W], when each rank enters the ring (default: all at 0).
    """
    w, n, l = topology.size, topology.num_nodes, topology.node_size
    sends = traffic.backward if backward else traffic.forward
    bar = step_seconds[:, -1]
    t = torch.zeros(w, dtype=torch.float64) if start is None else start.to(torch.float64).clone()
    if backward:  # the columns' dK/dV first, then their transfers run beside the ring
        t = t + bar
    columns_post = t.clone()  # forward: the columns' transfers run beside the ring, the bar step after them
    steps = n * l
    step_compute = step_seconds[:, :steps].amax(0)
    step_transfer = torch.zeros(steps, dtype=torch.float64)
    step_time = torch.zeros(steps, dtype=torch.float64)
    for o in range(n + 1):
        post_outer = t.clone()
        if o < n:
            for i in range(l + 1):
                post = t.clone()
                if i < l:
                    t = t + step_seconds[:, o * l + i]
                done, longest = _slot(("inner", o, i), sends, post, t, cluster)
                t = torch.maximum(t, done)
                if i < l:
                    step_transfer[o * l + i] = longest
                    step_time[o * l + i] = float((t - post).max())
        done, _ = _slot(("outer", o), sends, post_outer, t, cluster)
        t = torch.maximum(t, done)
    done, _ = _slot(COLUMNS, sends, columns_post, t, cluster)
    t = torch.maximum(t, done)
    if not backward:
        t = t + bar
    return RingTimeline(t, step_seconds.sum(1), step_compute, step_transfer, step_time)


@dataclass
class RingSetup:
    """What one configuration runs: the global layout, the split and the ring shape."""

    layout: SparseLayout
    plan: BlockSplit
    topology: RingTopology
    sparse: bool  # whether each layer estimates its layout (dense rings skip the estimation)

    def kept_fraction(self) -> float:
        """The layout's kept fraction over the query blocks that hold tokens of the row (`SparseLayout.kept_fraction`
        without metadata over those): a split's padding blocks list nothing and are left out, so every split of a
        row gives the fraction of its layout."""
        plan = self.plan
        real = (plan.source.view(-1, plan.block_size) >= 0).any(1)
        layout = self.layout if bool(real.all()) else self.layout.select(real.nonzero().flatten())
        return float(layout.kept_fraction())


@dataclass(frozen=True)
class Workload:
    """One row to simulate: its runs (documents and padding, in row order) and its layouts.

    lengths, kinds: the runs' tokens and kinds ('sparse', 'dense', 'pad'; `split.document_runs.row_runs`);
    layout(kind, plan, window=None): the global layout of `kind` ('dense': causal within documents, and within
    a sliding `window` of tokens where one is given; or 'sparse') over `plan`'s padded sequence, in `plan`'s
    global order;
    kept_per_row: key blocks a sparse document's query row lists (the planner's cost model);
    planner_costs: the planner's weights (None: `PlannerCosts()`; `simulate_cli` gives the model's linear weight).
    """

    lengths: tuple[int, ...]
    kinds: tuple[str, ...]
    layout: Callable[..., SparseLayout]
    kept_per_row: int | None = None
    planner_costs: PlannerCosts | None = None

    @property
    def seq_len(self) -> int:
        return sum(self.lengths)


def _block_sharding(sharding: str) -> Callable[[Workload, int, int, RingTopology], BlockSplit]:
    def split(workload: Workload, cp_size: int, block_size: int, topology: RingTopology) -> BlockSplit:
        return ShardPlan(sharding, cp_size, block_size, workload.seq_len)
    return split


def _planner(workload: Workload, cp_size: int, block_size: int, topology: RingTopology) -> BlockSplit:
    return plan_documents(list(workload.lengths), list(workload.kinds), cp_size, block_size,
                          kept_per_row=workload.kept_per_row, costs=workload.planner_costs, topology=topology)


def _configuration(split: Callable[[Workload, int, int, RingTopology], BlockSplit], kind: str, *,
                   hierarchical: bool = False):
    def setup(workload: Workload, cp_size: int, block_size: int, gpus_per_node: int) -> RingSetup:
        topology = RingTopology(1, cp_size)
        if hierarchical:
            per_node = min(gpus_per_node, cp_size)
            if cp_size % per_node:
                raise ValueError(f"the hierarchical ring needs whole nodes: cp_size={cp_size} is not a multiple of "
                                 f"{per_node} GPUs per node.")
            topology = RingTopology(cp_size // per_node, per_node)
        plan = split(workload, cp_size, block_size, topology)
        return RingSetup(workload.layout(kind, plan), plan, topology, kind == "sparse")
    setup.kind = kind  # ('dense' or 'sparse': which flags of the command the configuration reads)
    return setup


# name -> f(workload, cp_size, block_size, gpus_per_node) -> RingSetup
CONFIGURATIONS: dict[str, Callable[[Workload, int, int, int], RingSetup]] = {
    "dense ring": _configuration(_block_sharding("zigzag"), "dense"),
    "zigzag sparse": _configuration(_block_sharding("zigzag"), "sparse"),
    "striped sparse": _configuration(_block_sharding("striped"), "sparse"),
    "hierarchical striped sparse": _configuration(_block_sharding("striped"), "sparse", hierarchical=True),
    "planner sparse": _configuration(_planner, "sparse"),
    "hierarchical planner sparse": _configuration(_planner, "sparse", hierarchical=True),
}
