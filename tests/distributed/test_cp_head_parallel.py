"""Head-parallel (`--cp_mode ulysses`) and hybrid (heads x sparse ring) context parallelism under gloo
(2 / 3 / 4 processes) equal one process.

One spawn per world size runs every case. Attention: each rank's output, dq / dk / dv and the kept
fraction it reports against `sequence_attention` (the single-process path) on the whole sequence, sliced
to the rank's tokens, with GQA, uneven head splits, replicated and expanded K/V heads, packed documents
(cu_seq_lens, restarting position_ids), padding, sliding windows and dense layers. Models: a causal-LM
step's loss, gradients (DDP averaging and FSDP2 over CP x DP meshes, gradient checkpointing) and logged
kept fraction against the same step in one process.
"""

from __future__ import annotations

import types
from typing import NamedTuple

import pytest
import torch

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention.sequence import sequence_attention
from hf_sparse_cp.distributed import (
    ContextParallelConfig,
    HeadSplit,
    ParallelDims,
    RingStats,
    context_parallel_attention,
    prepare_context_parallel_inputs,
)
from hf_sparse_cp.distributed.split.blocks import sequence_meta
from hf_sparse_cp.testing.spawn import gloo_runs_by_world

from oracle import TOLERANCE, data_parallel_grad_error, rel_rms

BS, D, WINDOW = 16, 16, 40
# Budgets small enough that the packed documents (70 and 110 tokens) keep under 90% of the blocks dense attention
# computes (the kept fraction's measure), as the padded rows do.
CFG = SparseAttentionConfig(block_size=BS, min_seq_len=64, vertical_topk=3, slash_topk=2, sink_tokens=2,
                            local_window=4, last_q=16, dense_first_layers=0)


class Case(NamedTuple):
    mode: str  # ulysses | hybrid (2 head groups of 2 on 4 ranks) | accelerate (ulysses over accelerate's CP 2 x DP 2)
    heads: tuple[int, int]
    packing: str = "padded"  # padded: 2 rows with padding | cu_seq_lens | position_ids: packed documents in 1 row
    pattern: str = "sparse"  # sparse | dense | window
    dtype: torch.dtype = torch.float32
    sharding: str = "striped"  # the hybrid's ring ('hierarchical': striped, one ring rank per node of 2)
    seq: int = 250

    @property
    def id(self) -> str:
        parts = [self.mode, f"{self.heads[0]}q{self.heads[1]}kv", self.packing, self.pattern]
        if self.mode == "hybrid":
            parts.append(self.sharding)
        return "-".join(parts + [str(self.dtype).removeprefix("torch.")])


# Per world: balanced GQA, an uneven split or K/V heads replicated / expanded, packings, dense and window layers.
CASES = {
    2: [Case("ulysses", (4, 2)), Case("ulysses", (6, 3), "cu_seq_lens"), Case("ulysses", (4, 2), "position_ids"),
        Case("ulysses", (4, 2), pattern="dense"), Case("ulysses", (4, 2), pattern="window"),
        Case("ulysses", (4, 2), dtype=torch.float64)],
    3: [Case("ulysses", (6, 2)), Case("ulysses", (8, 2), "cu_seq_lens"), Case("ulysses", (6, 3), "position_ids"),
        Case("ulysses", (6, 2), pattern="window")],
    4: [Case("ulysses", (4, 2)), Case("ulysses", (12, 3), "cu_seq_lens"), Case("ulysses", (6, 2), "position_ids"),
        Case("hybrid", (4, 2)), Case("hybrid", (6, 3), "cu_seq_lens", sharding="zigzag"),
        Case("hybrid", (4, 2), "position_ids", sharding="contiguous"), Case("hybrid", (4, 2), pattern="window"),
        Case("hybrid", (4, 4), dtype=torch.float64), Case("hybrid", (4, 2), "cu_seq_lens", sharding="hierarchical"),
        Case("accelerate", (4, 2), "position_ids")],
}


def _inputs(case: Case, g: torch.Generator) -> dict:
    """A batch as the Trainer gives it: padded rows, or one row of packed documents."""
    if case.packing == "padded":
        mask = torch.ones(2, case.seq, dtype=torch.long)
        mask[1, case.seq - 37 :] = 0
        return {"input_ids": torch.randint(3, 50, (2, case.seq), generator=g), "attention_mask": mask}
    lengths = [70, 9, 110, case.seq - 189]  # one short document, two long ones with sparse patterns
    ids = torch.randint(3, 50, (1, case.seq), generator=g)
    if case.packing == "cu_seq_lens":
        cu = torch.tensor([0, *lengths]).cumsum(0)[:-1]  # the last 'document' is padding past cu[-1]
        return {"input_ids": ids, "cu_seq_lens_k": cu, "cu_seq_lens_q": cu}
    return {"input_ids": ids, "position_ids": torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)}


def _grad(fn, tensors, dout):
    tensors = [x.detach().clone().requires_grad_() for x in tensors]
    out, kept = fn(*tensors)
    grads = torch.autograd.grad((out.double() * dout).sum(), tensors)
    return {"out": out.detach(), "dq": grads[0], "dk": grads[1], "dv": grads[2]}, kept


def _from_accelerate_mesh(rank: int) -> ParallelDims:
    """Head parallelism over the CP groups of accelerate's device mesh (dp_shard 2 x cp 2)."""
    import types

    from accelerate.parallelism_config import ParallelismConfig

    pc = ParallelismConfig(dp_shard_size=2, cp_size=2)
    fake = types.SimpleNamespace(parallelism_config=pc, torch_device_mesh=pc.build_device_mesh("cpu"))
    par = ParallelDims.from_accelerator(fake, ContextParallelConfig(cp_mode="ulysses"))
    assert par.cp_ranks == (rank - rank % 2, rank - rank % 2 + 1) and (par.mode.name, par.head_size) == ("ulysses", 2)
    return par


def _layouts(world: int, rank: int) -> dict:
    """Every head-parallel layout the cases use, built once per spawn (collective)."""
    out = {"ulysses": ParallelDims.from_config(ContextParallelConfig(cp_size=world, cp_mode="ulysses"))}
    if world == 4:
        for sharding in ("striped", "zigzag", "contiguous"):
            out["hybrid", sharding] = ParallelDims.from_config(ContextParallelConfig(
                cp_size=4, cp_mode="hybrid", cp_ulysses_size=2, cp_sharding=sharding))
        out["hybrid", "hierarchical"] = ParallelDims.from_config(ContextParallelConfig(
            cp_size=4, cp_mode="hybrid", cp_ulysses_size=2, cp_ring="hierarchical", cp_node_size=2))
        assert out["hybrid", "hierarchical"].ring.topology.num_nodes == 2  # the ring's hops go between nodes
        # head groups (0 1) (2 3), rings (0 2) (1 3): one CP group; the ring view's groups are the rings
        assert out["hybrid", "striped"].cp_groups == ((0, 1, 2, 3),)
        assert out["hybrid", "striped"].ring.cp_groups == ((0, 2), (1, 3))
        out["accelerate"] = _from_accelerate_mesh(rank)
    return out


def _attention_case(case: Case, layouts: dict) -> dict:
    g = torch.Generator().manual_seed(case.seq + sum(case.heads) + len(case.id))
    inputs = _inputs(case, g)
    meta = sequence_meta(inputs)
    b, s = inputs["input_ids"].shape
    hq, hkv = case.heads
    cfg = CFG if case.pattern != "dense" else CFG.replace(pattern="dense")
    window = WINDOW if case.pattern == "window" else None
    q, k, v = (torch.randn(b, h, s, D, generator=g).to(case.dtype) for h in (hq, hkv, hkv))
    dout = torch.randn(b, hq, s, D, generator=g, dtype=torch.float64)
    full, ref_kept = _grad(lambda *x: sequence_attention(*x, meta, cfg, sliding_window=window), (q, k, v), dout)

    par = layouts[case.mode] if case.mode in layouts else layouts["hybrid", case.sharding]
    shard = prepare_context_parallel_inputs(inputs, par, block_size=BS)["cp_shard"]
    plan, rank = shard.plan, par.cp_rank
    stats = RingStats()
    def attend(*x):
        result = context_parallel_attention(*x, shard, cfg, sliding_window=window, stats=stats)
        return result.out, result.kept_fraction

    local, kept = _grad(attend, [plan.shard(x, rank, dim=2) for x in (q, k, v)], plan.shard(dout, rank, dim=2))
    errs = {name: rel_rms(local[name], plan.shard(full[name], rank, dim=2)) for name in full}
    pad = plan.source[plan.token_index(rank)] < 0  # the split's padding: zero output
    errs["padding_zero"] = float(local["out"][:, :, pad].abs().max()) if pad.any() else 0.0
    errs["kept"] = abs(float(kept) - float(ref_kept))
    errs["sparse"] = float(ref_kept) < 0.9 if case.pattern == "sparse" else True
    errs["bytes"] = (stats.forward_bytes, stats.backward_bytes, _all_to_all_bytes(par, plan, case, b))
    return errs


def _all_to_all_bytes(par: ParallelDims, plan, case: Case, batch: int) -> tuple[int, int]:
    """What this rank's all-to-alls send (forward, backward). Forward: its piece of every other group
    rank's q heads and the key/value heads they read, and its heads' output over every other rank's
    piece; backward: the gradients of what it received."""
    split = HeadSplit(*case.heads, par.head_size)
    first = par.cp_rank - par.head_rank
    lengths = [plan.local_len_of(first + i) for i in range(par.head_size)]
    me = par.head_rank

    def heads(r: int) -> tuple[int, int]:
        (q_lo, q_hi), (kv_lo, kv_hi) = split.q_range(r), split.kv_range(r)
        return q_hi - q_lo, kv_hi - kv_lo

    forward = backward = 0
    for r in range(par.head_size):
        if r != me:
            forward += lengths[me] * (heads(r)[0] + 2 * heads(r)[1]) + heads(me)[0] * lengths[r]
            backward += lengths[r] * (heads(me)[0] + 2 * heads(me)[1]) + heads(r)[0] * lengths[me]
    size = batch * D * torch.finfo(case.dtype).bits // 8
    return forward * size, backward * size


def _model_step(par: ParallelDims, rank: int, *, fsdp2: bool = False, checkpointing: bool = False) -> dict:
    """A causal-LM forward/backward of packed rows (restarting position_ids): loss, gradients (DDP
    averaging, or FSDP2 over all ranks: dp_shard x cp) and the logged kept fraction equal one process."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    import hf_sparse_cp
    from hf_sparse_cp.distributed import global_mean_loss, global_num_items, rank_loss
    from hf_sparse_cp.integration.stats import pop_kept_fractions
    from hf_sparse_cp.testing.tiny_models import tiny_config

    hf_sparse_cp.patch()
    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=64, num_attention_heads=6, num_key_value_heads=2, hidden_size=96,
                         head_dim=16)
    model = AutoModelForCausalLM.from_config(config).double()
    # (documents of 120 and 70 tokens and small budgets: layer 1 keeps about 75% of the blocks dense attention computes)
    hf_sparse_cp.configure(model, SparseAttentionConfig(block_size=BS, min_seq_len=64, vertical_topk=3, slash_topk=2,
                                                        sink_tokens=2, local_window=4, last_q=16))
    if checkpointing:
        model.gradient_checkpointing_enable()
    g = torch.Generator().manual_seed(5)
    seq = 190
    ids = torch.randint(3, 64, (par.dp_size, seq), generator=g)
    positions = torch.cat([torch.arange(120), torch.arange(seq - 120)]).expand(par.dp_size, seq)
    labels = ids.clone()
    labels[-1, :40] = -100  # DP groups with different token counts
    ref = model(input_ids=ids, labels=labels, position_ids=positions)
    ref_grads = torch.autograd.grad(ref.loss, list(model.parameters()))
    row = slice(par.dp_rank, par.dp_rank + 1)
    pop_kept_fractions(model)  # (the whole batch's)
    with torch.no_grad():
        model(input_ids=ids[row], position_ids=positions[row])
    ref_kept = pop_kept_fractions(model)  # this CP group's row

    if fsdp2:
        mesh = init_device_mesh("cpu", (par.world_size,))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
    inputs = prepare_context_parallel_inputs({"input_ids": ids[row], "labels": labels[row],
                                              "position_ids": positions[row]}, par, block_size=BS)
    num_items = global_num_items(inputs["shift_labels"])
    loss_sum = model(**inputs, num_items_in_batch=1).loss
    loss = rank_loss(loss_sum, num_items, par.world_size)
    kept = pop_kept_fractions(model)
    errs = {"loss": abs(float(global_mean_loss(loss_sum, num_items)) - float(ref.loss)) / float(ref.loss),
            "kept": max(abs(kept[layer] - ref_kept[layer]) for layer in ref_kept),
            "sparse": min(ref_kept.values()) < 0.9}
    errs["grads"] = data_parallel_grad_error(model, loss, ref_grads, par.world_size, fsdp2=fsdp2)
    return errs


def _errors(world: int) -> dict:
    """Refusals, raised on every rank before any collective."""
    msgs = {}
    par = ParallelDims.from_config(ContextParallelConfig(cp_size=world, cp_mode="ulysses"))
    try:
        par.check_model(types.SimpleNamespace(num_attention_heads=world - 1, num_key_value_heads=1))
    except ValueError as e:
        msgs["too_few_heads"] = str(e)
    try:
        ContextParallelConfig(cp_size=world, cp_mode="hybrid", cp_ulysses_size=world + 1).head_size(world)
    except ValueError as e:
        msgs["not_dividing"] = str(e)
    return msgs


def _worker(rank: int, world: int) -> dict:
    layouts = _layouts(world, rank)
    results = {("attention", case.id): _attention_case(case, layouts) for case in CASES[world]}
    results["errors"] = _errors(world)
    modes = {"ulysses": layouts["ulysses"]}
    if world == 4:
        modes["hybrid"] = layouts["hybrid", "striped"]
        modes["ulysses-cp2-dp2"] = ParallelDims.from_config(ContextParallelConfig(cp_size=2, cp_mode="ulysses"))
    for name, par in modes.items():
        results["model", name] = _model_step(par, rank)
        results["model-fsdp2", name] = _model_step(par, rank, fsdp2=True)
    results["model-checkpointing", "ulysses"] = _model_step(layouts["ulysses"], rank, checkpointing=True)
    return results


@pytest.fixture(scope="module")
def spawned():
    """world size -> per-rank results, each world spawned once for the whole module."""
    return gloo_runs_by_world(_worker)


ATTENTION = [pytest.param(world, case, id=f"W{world}-{case.id}") for world, cases in CASES.items() for case in cases]


@pytest.mark.parametrize("world, case", ATTENTION)
def test_head_parallel_attention_equals_one_process(spawned, world, case):
    tol = TOLERANCE[case.dtype]
    for rank, errs in enumerate(r[("attention", case.id)] for r in spawned(world)):
        assert errs["sparse"], "the case must exercise a sparse layout"
        assert errs["padding_zero"] == 0.0, (rank, errs)
        assert errs["out"] <= tol, (rank, errs)
        for name in ("dq", "dk", "dv"):
            assert errs[name] <= 2 * tol, (rank, name, errs)
        assert errs["kept"] < 1e-12, (rank, errs)


@pytest.mark.parametrize("world, case", [p for p in ATTENTION if p.values[1].mode == "ulysses"])
def test_the_all_to_alls_send_what_the_head_split_says_forward_and_backward(spawned, world, case):
    """Forward: the q/k/v pieces of the other ranks' heads (replicated K/V heads once per copy) and the
    output of this rank's heads over their pieces; backward, the gradients of what it received."""
    for errs in (r[("attention", case.id)] for r in spawned(world)):
        forward, backward, expected = errs["bytes"]
        assert (forward, backward) == expected and forward > 0, errs["bytes"]


MODELS = [("W2", 2, "ulysses"), ("W3", 3, "ulysses"), ("W4", 4, "ulysses"), ("W4", 4, "hybrid"),
          ("W4", 4, "ulysses-cp2-dp2")]


@pytest.mark.parametrize("world, mode", [(w, m) for _, w, m in MODELS], ids=[f"{i}-{m}" for i, _, m in MODELS])
@pytest.mark.parametrize("kind", ["model", "model-fsdp2"])
def test_model_loss_gradients_and_kept_fraction_match_one_process(spawned, world, mode, kind):
    # fp64 model; transformers' causal-LM loss casts the logits to fp32, so the loss carries fp32 rounding
    for errs in (r[kind, mode] for r in spawned(world)):
        assert errs["sparse"], errs
        assert errs["loss"] <= 1e-6 and errs["grads"] <= 1e-6, errs
        assert errs["kept"] < 1e-12, errs


@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"W{w}")
def test_gradient_checkpointing_under_head_parallelism_matches_one_process(spawned, world):
    for errs in (r["model-checkpointing", "ulysses"] for r in spawned(world)):
        assert errs["loss"] <= 1e-6 and errs["grads"] <= 1e-6, errs


@pytest.mark.parametrize("world", [2, 3, 4], ids=lambda w: f"W{w}")
def test_degrees_the_heads_cannot_serve_are_refused_naming_the_numbers(spawned, world):
    for r in spawned(world):
        msg = r["errors"]["too_few_heads"]
        assert f"a head-parallel degree of {world} needs at least {world} query heads" in msg
        # (hybrid only where a head group of more than one rank divides the CP degree: 2 at CP 4; at CP 3 the
        # refusal named cp_ulysses_size 2, which does not divide 3)
        assert f"but the model has {world - 1}" in msg and ("--cp_mode hybrid" in msg) == (world == 4), msg
        assert f"cp_ulysses_size={world + 1} does not divide cp_size={world}" in r["errors"]["not_dividing"]
