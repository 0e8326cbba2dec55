"""Work and traffic accounting of sparse ring attention, from the same plan the ring executes.

For a global layout, a sharding and a ring topology: the computed work of every rank at every
ring step plus the final column ("bar") step (block units: listed key blocks, and key columns /
block_size, summed over batch rows and heads), and the bytes every rank sends forward (K/V blocks,
and the key columns' rows to the ranks that list them) and backward (K/V blocks again, dK/dV
accumulators, and the columns' dK/dV back to their holders), counted from the transfers
`ring.plan.slot_ops` schedules, i.e. without the blocks that nobody downstream reads, and from
`ring.plan.column_reads`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.layout import SparseLayout
from ..distributed.comm import RingTopology
from ..distributed.ring.plan import TransferSets, column_reads, pair_work, read_matrix, slot_ops
from ..distributed.split.blocks import BlockSplit

COLUMNS = ("columns",)  # the slot of the key columns' transfers (`PlanTraffic`)


@dataclass
class RingCost:
    """work [W, ring steps + 1] per rank and step (the last is the column step); bytes [W] sent per
    rank; outer_bytes: forward bytes crossing nodes (hierarchical ring); full_ring_bytes: forward
    bytes per rank of a dense ring that sends every shard W - 1 hops; topology: the ring's; sends:
    the forward transfers each position posts per slot (`PlanTraffic.forward`)."""

    work: torch.Tensor
    forward_bytes: torch.Tensor
    backward_bytes: torch.Tensor
    outer_bytes: int
    full_ring_bytes: int
    topology: RingTopology
    sends: list[dict[tuple, list[tuple[int, int]]]]

    @property
    def rank_imbalance(self) -> float:
        """max / mean over ranks of the total work of a rank."""
        per_rank = self.work.sum(1)
        return float(per_rank.max() / per_rank.mean())

    @property
    def step_imbalance(self) -> float:
        """Ring time over ideal time if every step were a barrier: sum over steps of the slowest
        rank's work, over the mean work (an upper bound; see `pipelined_imbalance`)."""
        return float(self.work.max(0).values.sum() / self.work.mean(0).sum())

    @property
    def pipelined_imbalance(self) -> float:
        """Ring time over ideal time as the ring runs: no barrier between steps, transfers free."""
        return pipelined_time(self.work, self.topology, self.sends) / float(self.work.sum(1).mean())


def pipelined_time(work: torch.Tensor, topology: RingTopology,
                   sends: list[dict[tuple, list[tuple[int, int]]]]) -> float:
    """Time of the ring's steps in work units (work [W, steps + 1], the last the column step), with
    transfers taking no time but every wait the ring has. `sends` (`PlanTraffic.forward`) lists the
    transfers each position posts per slot; both ends post a transfer when they start the step
    of its slot (a node step's outer transfers: when they start its inner ring) and wait for it
    before the next, so each end starts the next step only after the other has started this one.
    Ranks that exchange nothing do not wait for each other. The columns' transfers were posted
    before the ring, so a rank's column step follows its own last step."""
    n, l, w = topology.num_nodes, topology.node_size, topology.size
    inner: dict[int, set[tuple[int, int]]] = {}  # step t -> (p, q): p starts t + 1 after q started t
    outer: dict[int, set[tuple[int, int]]] = {}  # node step o -> (p, q): p starts node step o + 1 after q started o
    for p, slots in enumerate(sends):
        for slot, peers in slots.items():
            if slot == COLUMNS:  # posted before the ring, awaited after it
                continue
            kind, key = (inner, slot[1] * l + slot[2]) if slot[0] == "inner" else (outer, slot[1])
            for q, _ in peers:
                kind.setdefault(key, set()).update({(p, q), (q, p)})
    work = work.to(torch.float64)
    starts = [torch.zeros(w, dtype=torch.float64)]
    for t in range(1, n * l):
        start = starts[-1] + work[:, t - 1]
        for p, q in inner.get(t - 1, ()):
            start[p] = max(start[p], starts[t - 1][q])
        if t % l == 0:  # a node step: its outer transfers were posted when the previous one began
            for p, q in outer.get(t // l - 1, ()):
                start[p] = max(start[p], starts[t - l][q])
        starts.append(start)
    return float((starts[-1] + work[:, n * l - 1] + work[:, -1]).max())


def ring_cost(
    layout: SparseLayout,
    plan: BlockSplit,
    topology: RingTopology | None = None,
    *,
    kv_heads: int,
    head_dim: int,
    kv_bytes: int = 2,
    acc_bytes: int = 4,
) -> RingCost:
    """Cost of ring attention over `layout` (global, over the padded sequence) split by `plan`.

    kv_bytes: bytes per K/V element (2 for bf16); acc_bytes: per dK/dV accumulator element (fp32).
    """
    topology = RingTopology(1, plan.cp_size) if topology is None else topology
    w, n, l = plan.cp_size, topology.num_nodes, topology.node_size
    blocks, cols = pair_work(layout, plan)
    sources = torch.tensor([[topology.source(r, o, i) for o in range(n) for i in range(l)] for r in range(w)])
    work = torch.cat([blocks.gather(1, sources), cols.unsqueeze(1)], 1)
    traffic = plan_traffic(layout, plan, topology, kv_heads=kv_heads, head_dim=head_dim, kv_bytes=kv_bytes,
                           acc_bytes=acc_bytes)
    outer = sum(n for sends in traffic.forward for slot, ops in sends.items() if slot[0] == "outer" for _, n in ops)
    # a dense ring: at step t rank r forwards the shard of rank r - t, i.e. every shard but that of rank r + 1
    full = max(plan.num_blocks - plan.blocks_of((r + 1) % w).numel() for r in range(w)) * traffic.block_bytes * kv_bytes
    return RingCost(work, traffic.total(backward=False), traffic.total(backward=True), outer, full, topology,
                    traffic.forward)


@dataclass
class PlanTraffic:
    """What every rank sends: per position, per slot, (peer position, bytes) in forward and backward
    (`slot_ops`' slots, and COLUMNS: the key columns' rows from their holder to each reader, forward,
    their dK/dV back, backward, posted before the ring); block_bytes: K and V elements of one block."""

    forward: list[dict[tuple, list[tuple[int, int]]]]
    backward: list[dict[tuple, list[tuple[int, int]]]]
    block_bytes: int

    def total(self, backward: bool) -> torch.Tensor:
        """int64 [W]: bytes each rank sends in one pass."""
        sends = self.backward if backward else self.forward
        return torch.tensor([sum(n for slot in s.values() for _, n in slot) for s in sends], dtype=torch.int64)


def plan_traffic(layout: SparseLayout, plan: BlockSplit, topology: RingTopology, *, kv_heads: int, head_dim: int,
                 kv_bytes: int = 2, acc_bytes: int = 4) -> PlanTraffic:
    """The ring's transfers for `layout`: K/V at `kv_bytes` per element (bf16), dK/dV at `acc_bytes` (fp32)."""
    sets = TransferSets(read_matrix(layout, plan), plan, topology)
    row = layout.batch * kv_heads * head_dim * 2  # K and V elements of one token
    block = row * plan.block_size
    fwd = [slot_sends(sets, p, block, backward=False, kv_bytes=kv_bytes, acc_bytes=acc_bytes)
           for p in range(plan.cp_size)]
    bwd = [slot_sends(sets, p, block, backward=True, kv_bytes=kv_bytes, acc_bytes=acc_bytes)
           for p in range(plan.cp_size)]
    rows = column_rows(layout, plan)
    for reader, holder in rows.nonzero().tolist():
        n = int(rows[reader, holder]) * row
        fwd[holder].setdefault(COLUMNS, []).append((reader, n * kv_bytes))
        bwd[reader].setdefault(COLUMNS, []).append((holder, n * acc_bytes))
    return PlanTraffic(fwd, bwd, block)


def column_rows(layout: SparseLayout, plan: BlockSplit) -> torch.Tensor:
    """int64 [W, W] on the CPU: [r, s] the key columns rank r's queries list that rank s holds (r != s; the
    diagonal is 0), the rows s sends r (the ring's `BarStep.send` / `recv`)."""
    reads = column_reads(layout, plan).cpu().long()  # [W, padded_len]
    rows = torch.zeros(plan.cp_size, plan.cp_size, dtype=torch.int64)
    rows.index_add_(1, plan.block_owner.repeat_interleave(plan.block_size), reads)
    return rows.fill_diagonal_(0)


def slot_sends(sets: TransferSets, position: int, block_bytes: int, *, backward: bool, kv_bytes: int = 2,
               acc_bytes: int = 4) -> dict[tuple, list[tuple[int, int]]]:
    """The sends `position` posts per slot of `ring.plan.slot_ops`, as (peer position, bytes).

    block_bytes: K and V elements of one block (batch x kv_heads x head_dim x 2 x block_size);
    K/V travel at `kv_bytes` per element, dK/dV accumulators at `acc_bytes`."""
    sends: dict[tuple, list[tuple[int, int]]] = {}
    for slot, ops in slot_ops(sets, position, backward=backward).items():
        for op in ops:
            if op.send:
                per = kv_bytes if op.kind == "kv" else acc_bytes
                sends.setdefault(slot, []).append((op.peer, op.blocks.numel() * block_bytes * per))
    return sends
