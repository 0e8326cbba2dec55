"""Balanced sparse ring attention: exact attention over a global layout, the sequence split over a CP group.

`ring_sparse_attention` runs the ring over a layout that every rank holds: under `--cp_mode ring` (and
on each ring of `hybrid`) the layer's layout estimated from every rank's shard (`estimation.py`,
`modes/ring.py`).

Every rank keeps its queries; K/V (key/value heads only, never replicated for GQA) travel the
(hierarchical) ring of `RingTopology`. At each step a rank computes its queries against the K/V
blocks it holds with `attention_forward` and the step's layout (from `RingPlan`), and
merges the partial (out, lse) in fp32 (`merge_attention`). Transfers for the next step are posted
before the current step computes and awaited after it (double buffering); the outer ring's
transfer is posted before the whole inner ring of a node and awaited after it. Steps with nothing
to compute are skipped, and K/V blocks that no rank downstream reads are never sent. The K/V rows
of the layout's key columns go from their holder to each rank that lists them, once, point to point
(overlapped with the ring), and are attended in one more local step.

Backward re-circulates K/V the same way, calls `attention_backward` per step with the final
out/lse, and sends partial dK/dV (accumulated in fp32, fp64 for fp64 inputs) around a second ring
back to the rank that owns the keys; each reader sends its dK/dV of the columns back to their holder
(overlapped with the ring), which sums them in a fixed order.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...attention.call import AttentionCall
from ...attention.engines import resolve_engine
from ...attention.layout import SparseLayout, check_tensors
from ...attention.ops import attention_backward, attention_forward
from ...attention.precision import autocast_inputs, compute_dtype
from ...attention.tokens import TokenMeta
from ..comm import P2PComm, Pending, Transfer
from ..shard import CPShard
from .plan import RingPlan, check_global_layout


@dataclass
class RingStats:
    """What one rank did in ring attention calls (accumulated over calls): steps computed and bytes sent (of which
    those of the key columns)."""

    forward_steps: int = 0
    backward_steps: int = 0
    forward_bytes: int = 0
    backward_bytes: int = 0
    forward_column_bytes: int = 0  # of which the key columns' rows (to their readers)
    backward_column_bytes: int = 0  # of which the key columns' dK/dV (to their holders)


class _BlockBuffer:
    """Rows of some blocks of one source shard: data [2, B, H, len(blocks) * bs, D] (K and V, or
    dK and dV), `blocks` the source-local block indices held, ascending."""

    def __init__(self, data: torch.Tensor, blocks: torch.Tensor, block_size: int) -> None:
        self.data, self.blocks, self.bs = data, blocks, block_size

    def rows(self, blocks: torch.Tensor) -> torch.Tensor:
        pos = torch.searchsorted(self.blocks, blocks)
        return (pos.unsqueeze(1) * self.bs + torch.arange(self.bs)).flatten().to(self.data.device)

    def take(self, blocks: torch.Tensor) -> torch.Tensor:
        if blocks.numel() == self.blocks.numel():
            return self.data
        return self.data.index_select(3, self.rows(blocks))

    def add_(self, blocks: torch.Tensor, data: torch.Tensor) -> None:
        self.data.index_add_(3, self.rows(blocks), data)


def _rows(k: torch.Tensor, v: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """[2, B, H, len(rows), D]: K and V at `rows` of the sequence dimension."""
    return torch.stack([k.index_select(2, rows), v.index_select(2, rows)])


class _Ring:
    """A rank's plan plus the communicators of its inner and outer rings and of its key columns (the CP group)."""

    def __init__(self, ring_plan: RingPlan, shard: CPShard) -> None:
        self.ring_plan = ring_plan
        self.parallel = shard.parallel
        self.inner = P2PComm(shard.parallel.inner_group)
        self.outer = P2PComm(shard.parallel.outer_group)
        self.columns = P2PComm(shard.parallel.cp_group)  # key columns: holder <-> reader, any two ranks

    @property
    def bytes_sent(self) -> int:
        return self.inner.bytes_sent + self.outer.bytes_sent + self.columns.bytes_sent

    def exchange_bars(self, k: torch.Tensor, v: torch.Tensor):
        """Post the column K/V rows this rank's readers list (to each reader) and the receives of those its
        queries list from other ranks (from each holder); returns a function giving this rank's bar buffer
        [2, B, Hkv, n_cols, D] (its own rows and the received ones)."""
        bar, dev = self.ring_plan.bar, k.device
        transfers = [Transfer(self.parallel.global_rank(r), _rows(k, v, rows.to(dev)), True)
                     for r, rows in bar.send.items()]
        received = [(pos.to(dev), torch.empty(2, *k.shape[:2], pos.numel(), k.shape[3], dtype=k.dtype, device=dev))
                    for pos in bar.recv.values()]
        transfers += [Transfer(self.parallel.global_rank(o), t, False) for o, (_, t) in zip(bar.recv, received)]
        pending = self.columns.post(transfers, "the column K/V transfer")

        def result() -> torch.Tensor:
            full = torch.empty(2, *k.shape[:2], bar.tokens.numel(), k.shape[3], dtype=k.dtype, device=dev)
            full[:, :, :, bar.own_pos.to(dev)] = _rows(k, v, bar.own_rows.to(dev))
            pending.wait()
            for pos, rows in received:
                full[:, :, :, pos] = rows
            return full

        return result

    def return_bar_grads(self, grad: torch.Tensor):
        """Post this rank's dK/dV of the columns it received (grad: over its bar buffer) to their holders and
        the receives of its readers' dK/dV of its own rows; returns a function giving [(rows of this rank's
        shard, their dK/dV)]: its own columns', then each reader's in ascending rank, the order they are summed."""
        bar, dev = self.ring_plan.bar, grad.device
        transfers = [Transfer(self.parallel.global_rank(o), grad.index_select(3, pos.to(dev)), True)
                     for o, pos in bar.recv.items()]
        received = [(rows.to(dev), torch.empty(*grad.shape[:3], rows.numel(), grad.shape[4], dtype=grad.dtype,
                                                device=dev)) for rows in bar.send.values()]
        transfers += [Transfer(self.parallel.global_rank(r), t, False) for r, (_, t) in zip(bar.send, received)]
        pending = self.columns.post(transfers, "the column dK/dV transfer")

        def result() -> list[tuple[torch.Tensor, torch.Tensor]]:
            pending.wait()
            return [(bar.own_rows.to(dev), grad.index_select(3, bar.own_pos.to(dev))), *received]

        return result

    def post(self, slot: tuple, ops: dict, kv: dict, acc_of, shape: tuple, kv_dtype, acc_dtype, device,
             arrivals: list) -> Pending:
        """Post the transfers of `slot`; receives are appended to `arrivals` as (op, tensor)."""
        bs = self.ring_plan.plan.block_size
        transfers = []
        for op in ops.get(slot, ()):
            if op.send:
                tensor = kv[op.source].take(op.blocks) if op.kind == "kv" else acc_of(op.source).take(op.blocks)
                tensor = tensor.contiguous()
            else:
                dtype = kv_dtype if op.kind == "kv" else acc_dtype
                tensor = torch.empty(*shape[:3], op.blocks.numel() * bs, shape[4], dtype=dtype, device=device)
                arrivals.append((op, tensor))
            transfers.append(Transfer(self.parallel.global_rank(op.peer), tensor, op.send))
        comm = self.outer if slot[0] == "outer" else self.inner
        return comm.post(transfers)


def _run(ring: _Ring, k, v, ops: dict, step_fn, acc_of=None, acc_dtype=None):
    """Drive the slots: outer step o posts its outer transfers, runs the inner ring (compute per
    step, inner transfers around it), then waits for the outer transfers. Received K/V become the
    buffers of later steps; received dK/dV are added to the accumulators (`acc_of`)."""
    ring_plan = ring.ring_plan
    topo, bs = ring_plan.topology, ring_plan.plan.block_size
    me = ring_plan.position
    kv = {me: _BlockBuffer(torch.stack([k, v]), torch.arange(ring_plan.plan.blocks_of(me).numel()), bs)}
    shape = kv[me].data.shape

    def land(slot, arrivals):
        for op, tensor in arrivals:
            if op.kind == "kv":
                kv[op.source] = _BlockBuffer(tensor, op.blocks, bs)
            else:
                acc_of(op.source).add_(op.blocks, tensor)
        for op in ops.get(slot, ()):
            if op.send and op.kind == "dkv":
                acc_of(op.source, release=True)

    for o in range(topo.num_nodes + 1):
        outer_arrivals: list = []
        outer = ring.post(("outer", o), ops, kv, acc_of, shape, k.dtype, acc_dtype, k.device, outer_arrivals)
        if o < topo.num_nodes:
            for i in range(topo.node_size + 1):
                arrivals: list = []
                inner = ring.post(("inner", o, i), ops, kv, acc_of, shape, k.dtype, acc_dtype, k.device, arrivals)
                if i < topo.node_size:
                    step = ring_plan.step(o, i)
                    if step.layout is not None:
                        step_fn(step, kv[step.source])
                inner.wait()
                land(("inner", o, i), arrivals)
                if 1 <= i < topo.node_size:
                    kv.pop(ring_plan.step(o, i).source, None)
        outer.wait()
        land(("outer", o), outer_arrivals)
        if 1 <= o < topo.num_nodes:
            kv.pop(ring_plan.step(o, 0).source, None)


def _ring_forward(ring: _Ring, q, k, v, scale: float, window: int | None, engine: str):
    ring_plan = ring.ring_plan
    dtype = compute_dtype(q.dtype)
    b, hq, s, d = q.shape
    state = {"out": torch.zeros(b, hq, s, d, dtype=dtype, device=q.device),
             "lse": torch.full((b, hq, s), float("-inf"), dtype=dtype, device=q.device),
             "steps": 0}

    def attend(k_, v_, layout, k_meta):
        state["out"], state["lse"] = attention_forward(
            AttentionCall(q, k_, v_, layout, scale, ring_plan.q_meta, k_meta, window), out=state["out"],
            lse=state["lse"], implementation=engine,
        )
        state["steps"] += 1

    bars = ring.exchange_bars(k, v) if ring_plan.bar is not None else None
    _run(ring, k, v, ring_plan.forward_ops, lambda step, buf: attend(buf.data[0], buf.data[1], step.layout,
                                                                    step.k_meta))
    bar_kv = bars() if bars is not None else None
    if ring_plan.bar_work:
        attend(bar_kv[0], bar_kv[1], ring_plan.bar.layout, ring_plan.bar.k_meta)
    return state["out"], state["lse"], state["steps"], bar_kv


def _ring_backward(ring: _Ring, q, k, v, out, lse, dout, dlse, bar_kv, scale: float, window: int | None,
                   engine: str):
    ring_plan = ring.ring_plan
    dtype = compute_dtype(q.dtype)
    bs = ring_plan.plan.block_size
    me = ring_plan.position
    dq = torch.zeros(q.shape, dtype=dtype, device=q.device)
    home = _BlockBuffer(torch.zeros((2, *k.shape), dtype=dtype, device=k.device),
                        torch.arange(ring_plan.plan.blocks_of(me).numel()), bs)
    accs: dict[int, _BlockBuffer] = {}
    steps = [0]

    def attend_grad(k_, v_, layout, k_meta):
        dq_s, dk_s, dv_s = attention_backward(
            AttentionCall(q, k_, v_, layout, scale, ring_plan.q_meta, k_meta, window), out, lse, dout, dlse=dlse,
            implementation=engine,
        )
        dq.add_(dq_s)
        steps[0] += 1
        return torch.stack([dk_s, dv_s])

    def acc_of(source: int, release: bool = False) -> _BlockBuffer:
        """The dK/dV accumulator for `source`'s keys (`release`: drop it once sent on)."""
        if source == me:
            return home
        if release:
            return accs.pop(source)
        if source not in accs:
            blocks = ring_plan.acc_blocks(source)
            accs[source] = _BlockBuffer(
                torch.zeros(2, *k.shape[:2], blocks.numel() * bs, k.shape[3], dtype=dtype, device=k.device), blocks, bs
            )
        return accs[source]

    def step_fn(step, buf: _BlockBuffer):
        part = _BlockBuffer(attend_grad(buf.data[0], buf.data[1], step.layout, step.k_meta), step.held, bs)
        acc_of(step.source).add_(step.read, part.take(step.read))

    bar_grads = None
    if ring_plan.bar is not None:
        grad = torch.zeros(2, *k.shape[:2], ring_plan.bar.tokens.numel(), k.shape[3], dtype=dtype, device=k.device)
        if ring_plan.bar_work:
            grad = attend_grad(bar_kv[0], bar_kv[1], ring_plan.bar.layout, ring_plan.bar.k_meta)
        bar_grads = ring.return_bar_grads(grad)
    _run(ring, k, v, ring_plan.backward_ops, step_fn, acc_of, dtype)
    if bar_grads is not None:
        for rows, part in bar_grads():  # one index_add_ each: rows repeat across parts, not within one
            home.data.index_add_(3, rows, part)
    return dq, home.data[0], home.data[1], steps[0]


def _layout_holders(ring_plan: RingPlan) -> list:
    """The plan's steps and bar step that hold a layout (each one's `layout`)."""
    return [h for h in (*ring_plan.steps, ring_plan.bar) if h is not None and h.layout is not None]


class _RingSparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, ring, scale, window, stats, engine):
        sent, columns = ring.bytes_sent, ring.columns.bytes_sent
        out, lse, steps, bar_kv = _ring_forward(ring, q, k, v, scale, window, engine)
        out = out.to(q.dtype)
        if stats is not None:
            stats.forward_steps += steps
            stats.forward_bytes += ring.bytes_sent - sent
            stats.forward_column_bytes += ring.columns.bytes_sent - columns
        # the plan's layouts go with the saved tensors, not on ctx: gradient checkpointing drops those after the
        # forward (`SparseLayout.take_apart`); the backward puts the saved (or recomputed) ones back
        holders = _layout_holders(ring.ring_plan)
        parts = [h.layout.take_apart() for h in holders]
        for h in holders:
            h.layout = None
        ctx.save_for_backward(q, k, v, out, lse, bar_kv, *(t for tensors, _ in parts for t in tensors))
        ctx.args = (ring, scale, window, stats, engine, holders, [(len(tensors), sk) for tensors, sk in parts])
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, bar_kv, *layout_tensors = ctx.saved_tensors
        ring, scale, window, stats, engine, holders, skeletons = ctx.args
        at = 0
        for h, (n, skeleton) in zip(holders, skeletons):
            h.layout = skeleton.restore(tuple(layout_tensors[at : at + n]))
            at += n
        sent, columns = ring.bytes_sent, ring.columns.bytes_sent
        with torch.autocast(q.device.type, enabled=False):  # a backward called under autocast computes as forward did
            dq, dk, dv, steps = _ring_backward(ring, q, k, v, out, lse, dout.contiguous(), dlse, bar_kv, scale,
                                               window, engine)
        if stats is not None:
            stats.backward_steps += steps
            stats.backward_bytes += ring.bytes_sent - sent
            stats.backward_column_bytes += ring.columns.bytes_sent - columns
        return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None


def ring_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    layout: SparseLayout,
    shard: CPShard,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    stats: RingStats | None = None,
    check_layout: bool = True,
    implementation: str = "auto",
    q_meta: TokenMeta | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of this rank's queries over the keys `layout` lists, keys spread over the CP group.

    Collective: every rank of the CP group calls it together, with its own shard.

    Args:
        q: [B, Hq, S_local, D]; k, v: [B, Hkv, S_local, D]: this rank's shard (`shard.plan.local_len`
            tokens, in shard order), Hq a multiple of Hkv.
        layout: the *global* layout over the padded sequence, identical on every rank of the CP
            group (e.g. from `estimate_layout_cp`); visibility (causal order, documents, sliding
            window) comes from the global `TokenMeta` in `shard`.
        shard: this rank's `CPShard` (from `prepare_context_parallel_inputs`).
        scale: softmax scale (default 1 / sqrt(D)); sliding_window: as in `block_sparse_attention`.
        stats: if given, accumulates this rank's computed steps and bytes sent.
        check_layout: also check the layout's counts, index ranges and that it lists each key once per query
            block (device synchronizations);
            `context_parallel_attention`, whose layouts are correct by construction, turns it off.
        implementation: the engine of every step ('auto', 'triton', 'flex', 'reference';
            `hf_sparse_cp.attention.engines`), chosen once per call from the global layout.
        q_meta: the queries' `TokenMeta` of the whole sequence where it is not the shard's (padding queries that see
            the tokens before them, `CPShard.padding_queries`); the keys' is always the shard's.
        Under autocast, q, k, v are cast to the autocast dtype and the ring runs with autocast off.

    Returns:
        (out [B, Hq, S_local, D] in q's dtype, lse [B, Hq, S_local] in the compute dtype), equal to
        single-process attention over the whole sequence sliced to this rank's tokens.
        Differentiable in q, k, v and through lse.
    """
    q, k, v = autocast_inputs(q, k, v)
    check_tensors(q, k, v)
    b, hq, s, d = q.shape
    plan = shard.plan
    if k.shape[2] != s:
        raise ValueError(f"k and v must hold the same shard as q ({s} tokens); got {k.shape[2]}.")
    local_len = plan.local_len_of(shard.rank)
    if s != local_len:
        raise ValueError(f"this rank's shard has {local_len} tokens but q has {s}: pass the tensors of the "
                         "sharded inputs (see prepare_context_parallel_inputs), to a model that adds no tokens to them "
                         "(a PEFT prompt-tuning or p-tuning model adds virtual tokens: train it without context "
                         "parallelism).")
    if shard.meta.index.shape[0] != b:
        raise ValueError(f"the shard's TokenMeta has {shard.meta.index.shape[0]} rows but q has {b}.")
    check_global_layout(layout, plan)
    layout.check_fits(hq, plan.padded_len, batch=b)
    if check_layout:
        layout.validate(hq, plan.padded_len, plan.padded_len)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    ring_plan = RingPlan(layout, plan, shard.meta, shard.parallel.topology, shard.parallel.cp_rank, q_meta)
    ring = _Ring(ring_plan, shard)
    engine = resolve_engine(q, layout, implementation)
    with torch.autocast(q.device.type, enabled=False):
        return _RingSparseAttention.apply(q, k.contiguous(), v.contiguous(), ring, scale, sliding_window, stats,
                                          engine)
