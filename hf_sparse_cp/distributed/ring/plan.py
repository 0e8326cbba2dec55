"""From one global layout to what every rank of a CP group computes, receives and sends.

The global `SparseLayout` (NQB = padded_len / block_size query blocks, the same on every rank)
lists, per query block, key blocks and key columns of the whole sequence. Sharding gives every
block an owner.

Key *blocks* travel the ring (see `RingTopology`): the K/V of source shard s reach the rank at
step (outer, inner) along a tree rooted at s, the outer ring carrying them node to node, each
node's inner ring rank to rank. `TransferSets` (the same on every rank) records per source, per
step, which of the source's blocks the holder *reads* (its queries list them), *holds* (reads, or
forwards to someone downstream who reads them: blocks nobody downstream reads are never sent),
and which blocks its dK/dV *accumulator* covers in the backward pass, where partial dK/dV travel
the ring with the K/V and the last reader sends the sum home.

Key *columns* (verticals) do not travel the ring: shipping a column's whole block to every
reader would cost a block per column, and all sink columns live on one shard, which would load
one ring step of every rank. Each rank gathers the K/V rows of the columns its own query blocks
list into a compact "bar" buffer (MTraining's bar buffer), attended in one extra step: the rows it
holds from its shard, every other row from its holder, point to point and once per reader
(`column_reads`: who lists which token, from the global layout, so both ends know every transfer's
size). The backward sends each reader's dK/dV of those rows back to their holder only, which adds
its readers' partials in ascending rank order. Columns only their holder lists never travel (the
whole documents of a document-aware split keep all their K/V home).

`RingPlan` is one rank's part: per ring step, the layout of its query blocks against the blocks it
holds (indices re-numbered into the received buffer) and the key metadata of that buffer; the bar
step; and per communication slot the transfers to post. A step whose layout lists nothing is
skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...attention.layout import SparseLayout
from ...attention.tokens import TokenMeta
from ..comm import RingTopology
from ..split.blocks import BlockSplit


def check_global_layout(layout: SparseLayout, plan: BlockSplit) -> None:
    """Raise ValueError unless `layout` is a global layout over `plan`'s padded sequence."""
    if layout.block_size != plan.block_size:
        raise ValueError(
            f"the layout's block_size ({layout.block_size}) differs from the shard plan's ({plan.block_size}); under "
            "context parallelism every layer must use the block size the sequence was sharded with."
        )
    if layout.num_q_blocks != plan.num_blocks:
        raise ValueError(
            f"the layout has {layout.num_q_blocks} query blocks but the padded sequence has {plan.num_blocks}: build "
            "the global layout over the padded sequence (TokenMeta.pad_to(plan.padded_len))."
        )


def read_flags(layout: SparseLayout, plan: BlockSplit) -> torch.Tensor:
    """bool [cp_size * num_blocks] on the layout's device: entry r * num_blocks + kb says that rank r's queries list
    global key block kb (columns excluded)."""
    check_global_layout(layout, plan)
    dev = layout.block_idx.device
    w, nb = plan.cp_size, plan.num_blocks
    qowner = plan.block_owner.to(dev).view(1, 1, -1, 1)
    # Unused slots mark a spare last flag: no boolean index, whose size the host would have to read.
    reads = torch.zeros(w * nb + 1, dtype=torch.bool, device=dev)
    flat = qowner * nb + layout.block_idx.long().clamp_min(0)
    reads[torch.where(layout.valid_blocks(), flat, w * nb)] = True
    return reads[:-1]


def read_matrix(layout: SparseLayout, plan: BlockSplit) -> torch.Tensor:
    """bool [cp_size, num_blocks] on the CPU: rank r's queries list global key block kb (columns excluded)."""
    return read_flags(layout, plan).view(plan.cp_size, plan.num_blocks).cpu()


def pair_work(layout: SparseLayout, plan: BlockSplit) -> tuple[torch.Tensor, torch.Tensor]:
    """Computed work in block units, summed over batch rows and heads, on the CPU:
    (float64 [W, W]: listed key blocks of source s for rank r's queries,
     float64 [W]: listed key columns / block_size for rank r's queries, the bar step)."""
    check_global_layout(layout, plan)
    dev = layout.block_idx.device
    w, bs = plan.cp_size, plan.block_size
    owner = plan.block_owner.to(dev)
    qowner = owner.view(1, 1, -1, 1)
    blocks = torch.zeros(w * w, dtype=torch.float64, device=dev)
    valid = layout.valid_blocks()
    flat = (qowner * w + owner[layout.block_idx.long().clamp_min(0)])[valid]
    blocks.index_add_(0, flat, torch.ones(flat.shape, dtype=torch.float64, device=dev))
    cols = torch.zeros(w, dtype=torch.float64, device=dev)
    per_qblock = layout.col_cnt.double().sum((0, 1)) / bs  # [NQB]
    cols.index_add_(0, owner, per_qblock)
    return blocks.view(w, w).cpu(), cols.cpu()


def column_reads(layout: SparseLayout, plan: BlockSplit, source: int | None = None) -> torch.Tensor:
    """bool [cp_size, K] on the layout's device: entry [r, t] says that rank r's queries list key token t as a
    column, t a global token (K = padded_len) or, given `source`, a row of that rank's shard (K = its
    local_len: who reads the rows it holds). Marks a flag per entry instead of sorting the listed columns: linear
    in the layout's size (tens of millions of entries at 128K tokens)."""
    dev = layout.col_idx.device
    w, bs = plan.cp_size, plan.block_size
    owner = plan.block_owner.to(dev)
    col = layout.col_idx.long().clamp_min(0)
    listed = layout.valid_cols()
    if source is None:
        key, size = col, plan.padded_len
    else:
        listed = listed & (owner[col // bs] == source)
        key, size = plan.block_local_index.to(dev)[col // bs] * bs + col % bs, plan.local_len_of(source)
    flags = torch.zeros(w * size + 1, dtype=torch.bool, device=dev)
    flags[torch.where(listed, owner.view(1, 1, -1, 1) * size + key, w * size)] = True  # unused slots: the spare flag
    return flags[:-1].view(w, size)


def _pack_rows(flags: torch.Tensor) -> torch.Tensor:
    """uint8 [ceil(R / 8), K]: bool [R, K] flags, 8 rows a byte (bit j of byte i: row 8 i + j)."""
    rows, k = flags.shape
    flags = torch.cat([flags, flags.new_zeros(-rows % 8, k)]).view(-1, 8, k).to(torch.uint8)
    return (flags << torch.arange(8, dtype=torch.uint8, device=flags.device).view(1, 8, 1)).sum(1, dtype=torch.uint8)


def _unpack_rows(packed: torch.Tensor, rows: int) -> torch.Tensor:
    """bool [rows, K] from `_pack_rows`' bytes (on the host)."""
    bits = (packed.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1
    return bits.flatten(0, 1)[:rows].bool()


def _suffix_any(x: torch.Tensor, dim: int) -> torch.Tensor:
    """out[..., j, ...] = x[..., j:, ...].any(dim)."""
    return x.flip(dim).to(torch.uint8).cummax(dim).values.flip(dim).bool()


def _prefix_any(x: torch.Tensor, dim: int) -> torch.Tensor:
    return x.to(torch.uint8).cummax(dim).values.bool()


class TransferSets:
    """Per source shard s, step (outer o, inner i) and source-local block: what the holder
    `topology.holder(s, o, i)` reads, holds and accumulates. Identical on every rank.

    read       bool [W, N, L, nkb]: blocks the holder's queries list.
    held       bool [W, N, L, nkb]: blocks it receives (reads or forwards); all at the source itself.
    acc        bool [W, N, L, nkb]: blocks of the dK/dV accumulator it sends on (backward): at inner
               position i >= 1 the reads of positions 1..i of its node; at a node entry (i = 0,
               o >= 1) the reads of nodes 1..o (the source's own node reports home through its inner ring).
    last_inner int [W, N]: last inner position >= 1 that reads (0: none), where the inner accumulator turns home.
    last_outer int [W]: last node step >= 1 that reads (0: none), where the outer accumulator turns home.
    """

    def __init__(self, reads: torch.Tensor, plan: BlockSplit, topology: RingTopology) -> None:
        """reads: `read_matrix` of the global layout (bool [W, num_blocks], CPU)."""
        if topology.size != plan.cp_size:
            raise ValueError(f"the ring has {topology.size} ranks but the sequence is split over {plan.cp_size}.")
        self.topology, self.plan = topology, plan
        w, n, l = plan.cp_size, topology.num_nodes, topology.node_size
        reads = torch.nn.functional.pad(reads, (0, 1))  # the last column: no block, never read
        by_source = reads[:, plan.padded_rank_blocks]  # [reader, source, nkb]
        read = by_source[topology.holders(), torch.arange(w).view(-1, 1, 1)]  # [W, N, L, nkb]
        node_read = read.any(2)  # [W, N, nkb]
        held = _suffix_any(read, 2)
        held[:, :, 0] = _suffix_any(node_read, 1)
        held[:, 0, 0] = True
        held &= (plan.padded_rank_blocks < plan.num_blocks).view(w, 1, 1, -1)  # a short shard's filler slots
        inner_reads = read.clone()
        inner_reads[:, :, 0] = False
        acc = _prefix_any(inner_reads, 2)
        outer_reads = node_read.clone()
        outer_reads[:, 0] = False
        acc[:, :, 0] = _prefix_any(outer_reads, 1)
        acc[:, 0, 0] = False
        self.read, self.held, self.acc = read, held, acc
        self.last_inner = (read.any(-1) * torch.arange(l)).amax(-1)  # position 0 contributes 0
        self.last_outer = (node_read.any(-1) * torch.arange(n)).amax(-1)

    def blocks(self, which: str, source: int, outer: int, inner: int) -> torch.Tensor:
        """Source-local block indices (int64, ascending) of set `which` ('read', 'held', 'acc')."""
        return getattr(self, which)[source, outer, inner].nonzero().flatten()


@dataclass
class Op:
    """One transfer of a rank: K/V ('kv') or an accumulated dK/dV ('dkv') of `source`'s `blocks`."""

    send: bool
    kind: str
    source: int
    peer: int  # ring position
    blocks: torch.Tensor


@dataclass
class RingStep:
    """What one rank computes at step (outer, inner): its queries against `source`'s held blocks."""

    outer: int
    inner: int
    source: int
    held: torch.Tensor  # source-local blocks in the buffer, ascending
    read: torch.Tensor  # source-local blocks the queries list
    layout: SparseLayout | None  # indices into the buffer; None: nothing to compute
    k_meta: TokenMeta


def slot_ops(sets: TransferSets, position: int, *, backward: bool) -> dict[tuple, list[Op]]:
    """Transfers of `position`, per slot: ('outer', o) posted before outer step o's inner ring and
    awaited after it; ('inner', o, i) posted before step (o, i) and awaited after it. Slot
    ('outer', N) and ('inner', o, L) carry only the last hop of dK/dV accumulators.

    Sources are visited in ascending order with a fixed order of kinds, so both ends of every
    transfer list them in the same relative order.
    """
    topo = sets.topology
    n, l = topo.num_nodes, topo.node_size
    ops: dict[tuple, list[Op]] = {}

    def add(slot, send, kind, s, peer, which, o, i):
        blocks = sets.blocks(which, s, o, i)
        if blocks.numel():
            ops.setdefault(slot, []).append(Op(send, kind, s, peer, blocks))

    for s in range(topo.size):
        o, i = topo.chain_position(position, s)

        def pos(outer: int, inner: int, s: int = s) -> int:
            return topo.holder(s, outer, inner)

        # K/V: inner hop (o, i-1) -> (o, i) in slot (o, i-1); outer hop between node entries in slot o-1.
        if i >= 1:
            add(("inner", o, i - 1), False, "kv", s, pos(o, i - 1), "held", o, i)
        if i + 1 < l:
            add(("inner", o, i), True, "kv", s, pos(o, i + 1), "held", o, i + 1)
        if i == 0 and o >= 1:
            add(("outer", o - 1), False, "kv", s, pos(o - 1, 0), "held", o, 0)
        if i == 0 and o + 1 < n:
            add(("outer", o), True, "kv", s, pos(o + 1, 0), "held", o + 1, 0)
        if not backward:
            continue
        # dK/dV inside a node: position i passes its sum to i+1 in slot (o, i+1); the last reader e
        # sends it to the node's entry in slot (o, e+1).
        e = int(sets.last_inner[s, o])
        if 1 <= i < e:
            add(("inner", o, i + 1), True, "dkv", s, pos(o, i + 1), "acc", o, i)
        if 2 <= i <= e:
            add(("inner", o, i), False, "dkv", s, pos(o, i - 1), "acc", o, i - 1)
        if i == e >= 1:
            add(("inner", o, e + 1), True, "dkv", s, pos(o, 0), "acc", o, e)
        if i == 0 and e >= 1:
            add(("inner", o, e + 1), False, "dkv", s, pos(o, e), "acc", o, e)
        # dK/dV across nodes: node entry o passes its sum to entry o+1 in slot o+1; the last
        # reading node E sends it home in slot E+1.
        big_e = int(sets.last_outer[s])
        if i == 0 and 1 <= o < big_e:
            add(("outer", o + 1), True, "dkv", s, pos(o + 1, 0), "acc", o, 0)
        if i == 0 and 2 <= o <= big_e:
            add(("outer", o), False, "dkv", s, pos(o - 1, 0), "acc", o - 1, 0)
        if i == 0 and o == big_e >= 1:
            add(("outer", big_e + 1), True, "dkv", s, s, "acc", big_e, 0)
        if s == position and big_e >= 1:
            add(("outer", big_e + 1), False, "dkv", s, pos(big_e, 0), "acc", big_e, 0)
    return ops


def _shard_into_buffer(plan: BlockSplit, source: int, held: torch.Tensor) -> torch.Tensor:
    """int64 [num_blocks]: the position of each global key block in the buffer of `source`'s `held` blocks
    (source-local, ascending), -1 for blocks that are not there."""
    buffer_pos = torch.full((plan.max_local_blocks,), -1, dtype=torch.long)
    buffer_pos[held] = torch.arange(held.numel())
    return torch.where(plan.block_owner == source, buffer_pos[plan.block_local_index], -1)


@dataclass
class BarStep:
    """The columns this rank's queries list, attended in one step over a compact buffer.

    tokens: the buffer, the global key tokens its queries list as columns (ascending); own_pos:
    the buffer positions of those it holds, own_rows their rows in its shard; recv: holder position
    -> buffer positions of the tokens it receives from that rank (ascending tokens, as the holder
    sends them); send: reader position -> rows of this rank's shard that reader lists (ascending),
    sent to it. recv and send cover other ranks only, ascending positions (the backward sends dK/dV
    the other way). layout: this rank's query blocks against the buffer (columns only); k_meta:
    metadata of the buffer's tokens.
    """

    tokens: torch.Tensor
    own_pos: torch.Tensor
    own_rows: torch.Tensor
    recv: dict[int, torch.Tensor]
    send: dict[int, torch.Tensor]
    layout: SparseLayout
    k_meta: TokenMeta


def _bar_step(listed: torch.Tensor, readers: torch.Tensor, mine: SparseLayout, plan: BlockSplit, meta: TokenMeta,
              position: int) -> BarStep | None:
    """The bar step of the rank at `position`, whose query blocks' layout is `mine`, from host copies of
    `mine.listed_columns` (`listed`) and `column_reads(..., position)` (`readers`); None when it neither
    lists nor sends a column."""
    bs = plan.block_size
    tokens = listed.nonzero().flatten()
    send = {r: rows for r in range(plan.cp_size) if r != position and (rows := readers[r].nonzero().flatten()).numel()}
    if not tokens.numel() and not send:
        return None
    owner = plan.block_owner[tokens // bs]
    recv = {o: pos for o in range(plan.cp_size) if o != position and (pos := (owner == o).nonzero().flatten()).numel()}
    own_pos = (owner == position).nonzero().flatten()
    own = tokens[own_pos]
    own_rows = plan.block_local_index[own // bs] * bs + own % bs
    tok = tokens.to(mine.col_idx.device)
    return BarStep(tokens, own_pos, own_rows, recv, send, mine.columns_into(tokens),
                   TokenMeta(meta.index[:, tok], meta.segment[:, tok]))


class RingPlan:
    """One rank's ring schedule for one global layout (see the module docstring).

    layout: the global layout (identical on every rank); plan: the sequence split; meta: the
    whole padded sequence's `TokenMeta` [B, padded_len]; position: this rank's ring position; q_meta: the queries'
    where they are not `meta`'s (padding queries that see the tokens before them), else None.
    `bar` is None when this rank neither lists a column nor holds one another rank lists; `bar_work`
    says whether its queries list any column.
    """

    def __init__(self, layout: SparseLayout, plan: BlockSplit, meta: TokenMeta, topology: RingTopology,
                 position: int, q_meta: TokenMeta | None = None) -> None:
        self.topology, self.plan, self.position = topology, plan, position
        meta = meta.pad_to(plan.padded_len)
        dev = layout.block_idx.device
        bs = plan.block_size
        mine = layout.select(plan.blocks_of(position))  # this rank's query blocks
        # What the host plans from, read back in one copy: the read matrix, this rank's columns (a flag per token)
        # and the readers of the rows it holds, a bit per rank: padded_len + ceil(W / 8) x local_len bytes, not a
        # [W, padded_len] reader matrix (32 MB at 1M tokens and CP 32), and no more for a ragged shard's long one.
        w, nb, n, ln = plan.cp_size, plan.num_blocks, plan.padded_len, plan.local_len_of(position)
        readers = _pack_rows(column_reads(layout, plan, position))
        flags = [f.view(torch.uint8) for f in (read_flags(layout, plan), mine.listed_columns(n))] + [readers.flatten()]
        reads, listed, readers = torch.cat(flags).cpu().split([w * nb, n, readers.numel()])
        self.sets = TransferSets(reads.view(torch.bool).view(w, nb), plan, topology)
        self.q_meta = plan.shard_meta(meta if q_meta is None else q_meta, position)
        self.steps: list[RingStep] = []
        for o in range(topology.num_nodes):
            for i in range(topology.node_size):
                s = topology.source(position, o, i)
                held = self.sets.blocks("held", s, o, i)
                read = self.sets.blocks("read", s, o, i)
                step_layout = mine.blocks_into(_shard_into_buffer(plan, s, held)) if read.numel() else None
                tok = ((plan.blocks_of(s)[held] * bs).unsqueeze(1) + torch.arange(bs)).flatten().to(dev)
                k_meta = TokenMeta(meta.index[:, tok], meta.segment[:, tok])
                self.steps.append(RingStep(o, i, s, held, read, step_layout, k_meta))
        self.bar = _bar_step(listed.view(torch.bool), _unpack_rows(readers.view(-1, ln), w), mine, plan, meta,
                             position)
        self.bar_work = self.bar is not None and bool(self.bar.tokens.numel())
        self.forward_ops = slot_ops(self.sets, position, backward=False)
        self.backward_ops = slot_ops(self.sets, position, backward=True)

    def step(self, outer: int, inner: int) -> RingStep:
        return self.steps[outer * self.topology.node_size + inner]

    def acc_blocks(self, source: int) -> torch.Tensor:
        """Blocks of this rank's dK/dV accumulator for `source` (empty at the source itself)."""
        o, i = self.topology.chain_position(self.position, source)
        return self.sets.blocks("acc", source, o, i)
