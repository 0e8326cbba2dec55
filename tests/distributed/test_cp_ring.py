"""Sparse ring attention under context parallelism (gloo, 2 / 3 / 4 processes) equals one process.

One spawn per world size runs every case and returns, per rank, the relative RMS error of its
out / lse / dq / dk / dv against the single-process result sliced to its tokens; the tests assert
on them. World 4 also runs the hierarchical ring (2 nodes x 2), a data x context parallel model
step (dp 2 x cp 2) and the layout built from accelerate's device mesh.
"""

from __future__ import annotations

import time
import types
from typing import NamedTuple

import pytest
import torch
import torch.distributed as dist

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention import dense_layout, estimate_layout
from hf_sparse_cp.attention.ops import block_sparse_attention
from hf_sparse_cp.attention.tokens import PAD_SEGMENT, TokenMeta
from hf_sparse_cp.distributed import (
    ContextParallelConfig,
    CPShard,
    ParallelDims,
    RingStats,
    ShardPlan,
    context_parallel_attention,
    estimate_layout_cp,
    quiesce_process_groups,
    ring_sparse_attention,
)
from hf_sparse_cp.distributed.comm import P2PComm, Transfer
from hf_sparse_cp.simulator.workloads import random_vertical_slash_layout
from hf_sparse_cp.testing.spawn import gloo_runs_by_world

from oracle import TOLERANCE, column_rows_to_send, data_parallel_grad_error, rel_rms

BS, D = 16, 16


class Case(NamedTuple):
    sharding: str
    pattern: str  # dense | sparse | window
    seq: int
    dtype: torch.dtype = torch.float64
    heads: tuple[int, int] = (4, 2)
    packed: bool = False  # two rows of packed documents with padding

    @property
    def id(self) -> str:
        parts = [self.sharding, self.pattern, f"S{self.seq}", "gqa" if self.heads[0] != self.heads[1] else "mha"]
        if self.packed:
            parts.append("packed")
        if self.dtype != torch.float64:
            parts.append(str(self.dtype).removeprefix("torch."))
        return "-".join(parts)


SHARDINGS = ("contiguous", "zigzag", "striped")
FLAT_CASES = (
    [Case(sh, "dense", 203) for sh in SHARDINGS]
    + [Case(sh, "sparse", 250, packed=True) for sh in SHARDINGS]
    + [Case("striped", "window", 189, heads=(2, 2)), Case("zigzag", "sparse", 111, dtype=torch.float32),
       Case("striped", "sparse", 111, dtype=torch.bfloat16)]
)
FLEX_CASES = [Case("striped", "sparse", 250, packed=True), Case("zigzag", "window", 189, heads=(2, 2))]
HIER_CASES = [Case(sh, "dense", 203) for sh in SHARDINGS] + [Case(sh, "sparse", 250, packed=True) for sh in SHARDINGS]
ESTIMATION_CASES = list(SHARDINGS)
WINDOW = 40


def _documents(batch: int, seq: int, packed: bool, g: torch.Generator) -> TokenMeta:
    seg = torch.zeros(batch, seq, dtype=torch.int32)
    if packed:
        for row in range(batch):
            for cut in sorted(torch.randperm(seq - 2, generator=g)[:3].add(1).tolist()):
                seg[row, cut:] += 1
            seg[row, seq - 7 * (row + 1) :] = PAD_SEGMENT
    return TokenMeta.from_segments(seg)


def _errors(rank, plan, local: dict, full: dict, real: torch.Tensor) -> dict:
    """Relative RMS error per tensor of this rank's results against the full ones sliced to its tokens."""
    errs = {}
    for name, mine in local.items():
        ref = plan.shard(full[name], rank, dim=2)
        if name == "lse":
            seen = torch.isfinite(ref)
            errs["lse_pattern"] = 0.0 if torch.equal(torch.isfinite(mine), seen) else 1.0
            errs[name] = rel_rms(mine, ref, seen)
        else:
            errs[name] = rel_rms(mine, ref)
    errs["padding_zero"] = float(local["out"][..., ~real, :].abs().max()) if (~real).any() else 0.0
    return errs


def _attend_and_grad(fn, q, k, v, dout, dlse):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = fn(q, k, v)
    seen = torch.isfinite(lse)
    loss = (out.double() * dout).sum() + (lse.double().masked_fill(~seen, 0.0) * dlse).sum()
    dq, dk, dv = torch.autograd.grad(loss, (q, k, v))
    return {"out": out.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def _ring_case(case: Case, par: ParallelDims, rank: int, stats: RingStats | None = None,
               implementation: str = "auto") -> dict:
    """This rank's errors against one process; with the flex engine the forward only (no Flex backward on CPU)."""
    g = torch.Generator().manual_seed(case.seq * 7 + len(case.id))
    hq, hk = case.heads
    batch = 2 if case.packed else 1
    plan = ShardPlan(case.sharding, par.cp_size, BS, case.seq)
    p = plan.padded_len
    meta = _documents(batch, case.seq, case.packed, g).pad_to(p)
    window = WINDOW if case.pattern == "window" else None
    if case.pattern == "sparse":
        layout = random_vertical_slash_layout(batch, hq, p, BS, num_diagonals=3, num_verticals=6, meta=meta,
                                              generator=g)
        length = p  # the single-process reference runs on the padded sequence (random values in the padding)
    else:
        layout = dense_layout(meta, BS, sliding_window=window)
        length = case.seq  # the reference sees only the real tokens; the shards are padded with zeros
    q = torch.randn(batch, hq, length, D, generator=g).to(case.dtype)
    k = torch.randn(batch, hk, length, D, generator=g).to(case.dtype)
    v = torch.randn(batch, hk, length, D, generator=g).to(case.dtype)
    dout = torch.randn(batch, hq, p, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(batch, hq, p, generator=g, dtype=torch.float64)

    ref_layout = layout if length == p else dense_layout(TokenMeta(meta.index[:, :length], meta.segment[:, :length]),
                                                         BS, sliding_window=window)
    ref_meta = TokenMeta(meta.index[:, :length], meta.segment[:, :length])
    full = _attend_and_grad(
        lambda q_, k_, v_: block_sparse_attention(q_, k_, v_, ref_layout, q_meta=ref_meta, sliding_window=window),
        q, k, v, dout[:, :, :length], dlse[:, :, :length],
    )
    pad = p - length
    full = {n: torch.nn.functional.pad(t, (0, 0, 0, pad) if t.dim() == 4 else (0, pad),
                                       value=float("-inf") if n == "lse" else 0.0) for n, t in full.items()}

    shard = CPShard(par, plan, meta)
    ring = lambda q_, k_, v_: ring_sparse_attention(q_, k_, v_, layout, shard, sliding_window=window, stats=stats,
                                                    implementation=implementation)
    mine = [plan.shard(x, rank, dim=2) for x in (q, k, v)]
    if implementation == "flex":
        with torch.no_grad():
            local = dict(zip(("out", "lse"), ring(*mine)))
    else:
        local = _attend_and_grad(ring, *mine, plan.shard(dout, rank, dim=2), plan.shard(dlse, rank, dim=2))
    real = plan.token_index(rank) < case.seq
    errs = _errors(rank, plan, local, full, real)
    if stats is not None and case.pattern == "sparse":
        row = batch * hk * D * 2  # K and V elements of one token; dK/dV accumulate in fp64 for fp64, else fp32
        fwd, bwd = column_rows_to_send(layout, plan.block_owner, rank)
        errs["column_minimum"] = (fwd * row * k.element_size(), bwd * row * (8 if case.dtype == torch.float64 else 4))
        errs["columns"] = (stats.forward_column_bytes, stats.backward_column_bytes)
    return errs


def _checkpointed_ring(par: ParallelDims, rank: int) -> dict:
    """A ring call under gradient checkpointing: what it allocated in layout code and still holds after its
    forward (its plan's layouts travel with the saved tensors), and whether its gradients equal those of the
    call without checkpointing."""
    import gc

    from torch.utils.checkpoint import checkpoint

    from hf_sparse_cp.testing.allocations import AllocationRecorder

    g = torch.Generator().manual_seed(11)
    plan = ShardPlan("zigzag", par.cp_size, BS, 256)
    meta = _documents(1, 256, False, g).pad_to(plan.padded_len)
    layout = random_vertical_slash_layout(1, 4, plan.padded_len, BS, num_diagonals=3, num_verticals=24, meta=meta,
                                          generator=g)
    shard = CPShard(par, plan, meta)
    x = [plan.shard(torch.randn(1, h, plan.padded_len, D, generator=g, dtype=torch.float64), rank, dim=2)
         for h in (4, 2, 2)]
    attend = lambda *t: ring_sparse_attention(*t, layout, shard)[0]  # noqa: E731
    grads, held = [], None
    for wrap in (lambda *t: checkpoint(attend, *t, use_reentrant=False), attend):
        inputs = [t.clone().requires_grad_() for t in x]
        with AllocationRecorder() as rec:
            out = wrap(*inputs)
            gc.collect()
            held = [a.site for a in rec.alive if "attention/layout.py" in a.site] if held is None else held
        out.square().sum().backward()
        grads.append([t.grad for t in inputs])
    return {"held_layout_sites": held, "same_grads": all(torch.equal(a, b) for a, b in zip(*grads))}


def _estimation_case(sharding: str, par: ParallelDims, rank: int) -> dict:
    """Estimated layout under CP == single-process layout, the same on every rank; attention matches."""
    g = torch.Generator().manual_seed(11)
    seq = 290
    plan = ShardPlan(sharding, par.cp_size, BS, seq)
    p = plan.padded_len
    seg = torch.zeros(1, seq, dtype=torch.int32)
    seg[:, 40:] = 1  # a short dense document, then a long sparse one
    meta = TokenMeta.from_segments(seg).pad_to(p)
    cfg = SparseAttentionConfig(block_size=BS, min_seq_len=96, vertical_topk=6, slash_topk=10, sink_tokens=3,
                                local_window=5, last_q=20)
    q = torch.randn(1, 4, p, D, generator=g, dtype=torch.float64)
    k = torch.randn(1, 2, p, D, generator=g, dtype=torch.float64)
    v = torch.randn(1, 2, p, D, generator=g, dtype=torch.float64)
    ref = estimate_layout(q, k, cfg, meta)
    shard = CPShard(par, plan, meta)
    local = [plan.shard(x, rank, dim=2) for x in (q, k, v)]
    mine = estimate_layout_cp(local[0], local[1], cfg, shard)
    fields = ("block_idx", "block_cnt", "col_idx", "col_cnt")
    same = all(torch.equal(getattr(mine, f), getattr(ref, f)) for f in fields)
    every = [None] * par.cp_size
    dist.all_gather_object(every, [getattr(mine, f) for f in fields], group=par.cp_group)
    same_everywhere = all(torch.equal(a, b) for other in every for a, b in zip(other, every[0]))

    dout = torch.randn(1, 4, p, D, generator=g, dtype=torch.float64)
    dlse = torch.randn(1, 4, p, generator=g, dtype=torch.float64)
    full = _attend_and_grad(lambda q_, k_, v_: block_sparse_attention(q_, k_, v_, ref, q_meta=meta), q, k, v,
                            dout, dlse)
    ring = _attend_and_grad(lambda q_, k_, v_: context_parallel_attention(q_, k_, v_, shard, cfg)[:2],
                            *local, plan.shard(dout, rank, dim=2), plan.shard(dlse, rank, dim=2))
    errs = _errors(rank, plan, ring, full, plan.token_index(rank) < seq)
    errs["same_as_single"] = float(same)
    errs["same_on_all_ranks"] = float(same_everywhere)
    errs["sparse"] = float(float(ref.kept_fraction()) < 0.9)
    return errs


def _model_step(par: ParallelDims, rank: int, fsdp2: bool = False) -> dict:
    """A causal-LM forward/backward under CP (x DP): loss and gradients equal the single-process step.

    With `fsdp2`, the model is sharded with FSDP2 over all ranks (dp_shard x cp, as accelerate
    does under a ParallelismConfig with CP) and its gradients come reduced by FSDP itself.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    import hf_sparse_cp
    from hf_sparse_cp.distributed import global_mean_loss, global_num_items, prepare_context_parallel_inputs, rank_loss
    from hf_sparse_cp.testing.tiny_models import tiny_config

    cfg = SparseAttentionConfig(block_size=BS, min_seq_len=64, vertical_topk=8, slash_topk=8, sink_tokens=2,
                                local_window=4, last_q=16)

    hf_sparse_cp.patch()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=64)).double()
    hf_sparse_cp.configure(model, cfg)
    g = torch.Generator().manual_seed(5)
    seq = 157
    ids = torch.randint(3, 64, (par.dp_size, seq), generator=g)
    labels = ids.clone()
    labels[-1, :40] = -100  # DP groups with different token counts
    ref = model(input_ids=ids, labels=labels)
    ref_grads = torch.autograd.grad(ref.loss, list(model.parameters()))

    if fsdp2:
        mesh = init_device_mesh("cpu", (par.world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    row = slice(par.dp_rank, par.dp_rank + 1)
    inputs = prepare_context_parallel_inputs({"input_ids": ids[row], "labels": labels[row]}, par, block_size=BS)
    num_items = global_num_items(inputs["shift_labels"])
    loss_sum = model(**inputs, num_items_in_batch=1).loss  # the sum of this rank's token losses
    loss = rank_loss(loss_sum, num_items, par.world_size)
    errs = {"loss": abs(float(global_mean_loss(loss_sum, num_items)) - float(ref.loss)) / float(ref.loss)}
    errs["grads"] = data_parallel_grad_error(model, loss, ref_grads, par.world_size, fsdp2=fsdp2)
    return errs


def _errors_raised(world: int) -> dict:
    """Misconfigurations raise actionable errors on every rank (before any collective)."""
    msgs = {}
    try:
        ParallelDims.from_config(ContextParallelConfig(cp_size=3 if world != 3 else 2))
    except ValueError as e:
        msgs["cp_not_dividing"] = str(e)
    return msgs


def _from_accelerate_mesh(rank: int, world: int) -> dict:
    """ParallelDims from accelerate's ParallelismConfig device mesh (dp_shard 2 x cp 2), ring on its CP group."""
    from accelerate.parallelism_config import ParallelismConfig

    pc = ParallelismConfig(dp_shard_size=2, cp_size=2)
    fake = types.SimpleNamespace(parallelism_config=pc, torch_device_mesh=pc.build_device_mesh("cpu"))
    par = ParallelDims.from_accelerator(fake, ContextParallelConfig())
    errs = _ring_case(Case("striped", "sparse", 250, packed=True), par, par.cp_rank)
    errs["cp_ranks_ok"] = float(par.cp_ranks == (rank - rank % 2, rank - rank % 2 + 1) and par.dp_size == 2
                              and par.cp_groups == ((0, 1), (2, 3)))
    return errs


def _ring_shift(par: ParallelDims, rank: int) -> dict:
    """P2PComm alone: a tensor passed around the ring, each step's transfer posted, then awaited."""
    comm = P2PComm(par.cp_group)
    w = par.cp_size
    held = torch.full((3,), float(rank))
    seen = [float(held[0])]
    for _ in range(w - 1):
        incoming = torch.empty(3)
        pending = comm.post([Transfer(par.global_rank((rank + 1) % w), held, True),
                             Transfer(par.global_rank((rank - 1) % w), incoming, False)])
        pending.wait()
        held = incoming
        seen.append(float(held[0]))
    return {"seen": seen, "bytes": comm.bytes_sent}


LATE_S = 2.0  # how late the last rank comes to the teardown: far above the scheduling noise of a busy machine


def _quiesce(rank: int, world: int) -> float:
    """Seconds this rank spends in quiesce_process_groups while the last rank comes LATE_S late (the ranks start
    together: a barrier first, so earlier work that one rank finished later does not count)."""
    dist.barrier()
    if rank == world - 1:
        time.sleep(LATE_S)
    start = time.perf_counter()
    quiesce_process_groups(settle_s=0.0)
    return time.perf_counter() - start


def _kept_fraction_case(world: int) -> dict:
    """The kept fraction a model's layers log, under CP (every sharding) minus in one process, on a
    sequence that every split pads differently, and on a batch whose second row is padding only (an empty text:
    it counts in neither)."""
    from transformers import AutoModelForCausalLM

    import hf_sparse_cp
    from hf_sparse_cp.distributed import prepare_context_parallel_inputs
    from hf_sparse_cp.integration.stats import pop_kept_fractions
    from hf_sparse_cp.testing.tiny_models import tiny_config

    hf_sparse_cp.patch()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=64)).double()
    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=BS, min_seq_len=64, vertical_topk=8, slash_topk=8,
                                                        sink_tokens=2, local_window=4, last_q=16))
    ids = torch.randint(3, 64, (2, 135), generator=torch.Generator().manual_seed(3))
    batches = {"": {"input_ids": ids[:1]},
               ", empty row": {"input_ids": ids, "attention_mask": torch.tensor([[1], [0]]).expand(2, 135)}}
    gaps, sparse = {}, True
    with torch.no_grad():
        for name, batch in batches.items():
            model(**batch)
            ref = pop_kept_fractions(model)
            sparse &= min(ref.values()) < 0.9
            for sharding in SHARDINGS:
                par = ParallelDims.from_config(ContextParallelConfig(cp_size=world, cp_sharding=sharding))
                model(**prepare_context_parallel_inputs(batch, par, block_size=BS))
                gaps[sharding + name] = max(abs(v - ref[layer]) for layer, v in pop_kept_fractions(model).items())
    return {"gaps": gaps, "sparse": sparse}


def _worker(rank: int, world: int) -> dict:
    flat = ParallelDims.from_config(ContextParallelConfig(cp_size=world))
    results = {"comm": _ring_shift(flat, rank)}
    for case in FLAT_CASES:
        stats = RingStats()
        results[("flat", case.id)] = _ring_case(case, flat, rank, stats)
        results[("stats", case.id)] = stats
    for sharding in ESTIMATION_CASES:
        results[("estimation", sharding)] = _estimation_case(sharding, flat, rank)
    if world == 2:
        results["checkpointed"] = _checkpointed_ring(flat, rank)
        for case in FLEX_CASES:
            results[("flex", case.id)] = _ring_case(case, flat, rank, implementation="flex")
    results["errors"] = _errors_raised(world)
    results["kept_fraction"] = _kept_fraction_case(world)
    if world == 4:
        hier = ParallelDims.from_config(ContextParallelConfig(cp_size=4, cp_ring="hierarchical", cp_node_size=2))
        results["hierarchical"] = hier.hierarchical
        for case in HIER_CASES:
            results[("hier", case.id)] = _ring_case(case, hier, rank, RingStats())
        results["model"] = _model_step(ParallelDims.from_config(ContextParallelConfig(cp_size=2)), rank)
        results["model_fsdp2"] = _model_step(ParallelDims.from_config(ContextParallelConfig(cp_size=2)), rank,
                                             fsdp2=True)
        results["accelerate"] = _from_accelerate_mesh(rank, world)
    else:
        results["model"] = _model_step(flat, rank)
        results["model_fsdp2"] = _model_step(flat, rank, fsdp2=True)
    results["quiesce_s"] = _quiesce(rank, world)
    return results


@pytest.fixture(scope="module")
def spawned():
    """world size -> per-rank results, each world spawned once for the whole module."""
    return gloo_runs_by_world(_worker)


def _assert_close(per_rank: list[dict], dtype: torch.dtype = torch.float64) -> None:
    tol = TOLERANCE[dtype]
    for rank, errs in enumerate(per_rank):
        assert errs["lse_pattern"] == 0.0, f"rank {rank}: queries that see no key differ"
        assert errs["padding_zero"] == 0.0, f"rank {rank}: padding queries got a nonzero output"
        for name in ("out", "lse"):
            assert errs[name] <= tol, (rank, name, errs)
        for name in ("dq", "dk", "dv"):
            assert errs[name] <= 2 * tol, (rank, name, errs)


WORLDS = pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"W{w}")


@WORLDS
def test_quiesce_waits_for_every_rank(spawned, world):
    """The teardown step's barrier: the ranks on time wait for the late one, which waits far less (on a busy
    machine its barrier takes scheduling time too, so it is compared with the others' waits, not with zero)."""
    waits = [r["quiesce_s"] for r in spawned(world)]
    assert min(waits[:-1]) >= LATE_S / 2 and waits[-1] < min(waits[:-1]) - LATE_S / 2, waits


@WORLDS
def test_communicator_passes_tensors_around_the_ring(spawned, world):
    for rank, r in enumerate(spawned(world)):
        assert r["comm"]["seen"] == [float((rank - t) % world) for t in range(world)]
        assert r["comm"]["bytes"] == (world - 1) * 3 * 4


@WORLDS
@pytest.mark.parametrize("case", FLAT_CASES, ids=lambda c: c.id)
def test_ring_equals_single_process(spawned, world, case):
    _assert_close([r[("flat", case.id)] for r in spawned(world)], case.dtype)


@pytest.mark.parametrize("case", FLEX_CASES, ids=lambda c: c.id)
def test_ring_forward_with_the_flex_engine_equals_single_process(spawned, case):
    """Every ring step's layout (and the columns' bar step) through FlexAttention (its eager CPU path)."""
    for rank, errs in enumerate(r[("flex", case.id)] for r in spawned(2)):
        assert errs["lse_pattern"] == 0.0 and errs["padding_zero"] == 0.0, (rank, errs)
        assert errs["out"] <= TOLERANCE[case.dtype] and errs["lse"] <= TOLERANCE[case.dtype], (rank, errs)


@pytest.mark.parametrize("case", HIER_CASES, ids=lambda c: c.id)
def test_hierarchical_ring_2_nodes_x_2(spawned, case):
    results = spawned(4)
    assert all(r["hierarchical"] for r in results)
    _assert_close([r[("hier", case.id)] for r in results], case.dtype)


@WORLDS
def test_key_columns_go_only_to_the_ranks_that_list_them(spawned, world):
    """Each key column another rank lists leaves its holder once per such rank, its dK/dV once back (flat and,
    at 4 ranks, hierarchical rings; every sparse case)."""
    runs = [("flat", c) for c in FLAT_CASES] + ([("hier", c) for c in HIER_CASES] if world == 4 else [])
    checked = 0
    for ring, case in runs:
        for errs in (r[(ring, case.id)] for r in spawned(world)):
            if "columns" in errs:
                assert errs["columns"] == errs["column_minimum"], (ring, case.id, errs)
                checked += sum(errs["column_minimum"])
    assert checked > 0


@WORLDS
@pytest.mark.parametrize("sharding", ESTIMATION_CASES)
def test_estimation_gives_the_single_process_layout_on_every_rank(spawned, world, sharding):
    per_rank = [r[("estimation", sharding)] for r in spawned(world)]
    for errs in per_rank:
        assert errs["sparse"] == 1.0, "the case must exercise a sparse layout"
        assert errs["same_as_single"] == 1.0
        assert errs["same_on_all_ranks"] == 1.0
    _assert_close(per_rank)


@WORLDS
def test_empty_steps_are_skipped_and_unread_kv_is_not_sent(spawned, world):
    contiguous = [r[("stats", Case("contiguous", "dense", 203).id)] for r in spawned(world)]
    striped = [r[("stats", Case("striped", "dense", 203).id)] for r in spawned(world)]
    for rank, st in enumerate(contiguous):
        # causal + contiguous: rank r reads ranks 0..r only, so it computes r + 1 steps
        assert st.forward_steps == st.backward_steps == rank + 1
    assert contiguous[-1].forward_bytes == 0  # nobody reads the last rank's K/V
    assert sum(s.forward_bytes for s in contiguous) < sum(s.forward_bytes for s in striped)
    assert all(st.forward_steps == world for st in striped)  # striped: every step has work


def test_a_checkpointed_ring_call_holds_no_layout_between_forward_and_backward(spawned):
    for r in spawned(2):
        assert r["checkpointed"] == {"held_layout_sites": [], "same_grads": True}


@WORLDS
def test_model_loss_and_gradients_match_without_cp_under_ddp_and_fsdp2(spawned, world):
    # The model runs in fp64, but transformers' causal-LM loss casts the logits to fp32, so the loss
    # and the gradient scale carry fp32 rounding (a wrong token count would be off by percents).
    for r in spawned(world):
        for errs in (r["model"], r["model_fsdp2"]):
            assert errs["loss"] <= 1e-6, errs
            assert errs["grads"] <= 1e-6, errs


def test_layout_from_accelerate_device_mesh(spawned):
    results = [r["accelerate"] for r in spawned(4)]
    assert all(r["cp_ranks_ok"] == 1.0 for r in results)
    _assert_close(results)


@WORLDS
def test_logged_kept_fraction_equals_one_process_under_every_sharding(spawned, world):
    for r in spawned(world):
        assert r["kept_fraction"]["sparse"]
        assert all(gap < 1e-12 for gap in r["kept_fraction"]["gaps"].values()), r["kept_fraction"]


@WORLDS
def test_cp_size_not_dividing_the_world_is_an_actionable_error(spawned, world):
    for r in spawned(world):
        msg = r["errors"]["cp_not_dividing"]
        assert "does not divide the world size" in msg and "--num_processes" in msg
