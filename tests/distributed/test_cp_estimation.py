"""The pattern estimated from a sequence split over 3 ranks (gloo) selects from every rank's best
candidates: the same layout as one process over the whole sequence, on every rank, in top-k, top-p
and mass modes, with sampled scoring queries, several documents, two batch rows, causal chunks and the
document planner's uneven split, and with exact ties (broken by position) under every sharding in fp32
and bf16; and its collectives carry the slash sums (block diagonals in mass mode) and a few candidates,
not the whole score buffer."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention.budgets import Entries, TopK, TopP
from hf_sparse_cp.attention.budgets.naive import naive_select
from hf_sparse_cp.attention.estimate import estimate_layout, estimation_segments, long_documents
from hf_sparse_cp.attention.tokens import PAD_SEGMENT, TokenMeta
from hf_sparse_cp.testing.spawn import run_gloo

BS, D, HQ, HKV, WORLD = 16, 16, 4, 2, 3
# Budgets far below any rank's share of a document, so each rank's candidates are a strict subset.
CFG = SparseAttentionConfig(block_size=BS, min_seq_len=64, vertical_topk=6, slash_topk=5, sink_tokens=2,
                            local_window=4, last_q=8)
CASES = {
    "striped top-k": CFG,
    "striped top-p": CFG.replace(budget_mode="topp", vertical_topp=0.6, slash_topp=0.7, vertical_cap=7, slash_cap=9),
    "striped causal chunks": CFG.replace(estimation="causal_chunks", estimation_chunk=48),
    "planner top-p": CFG.replace(budget_mode="topp", vertical_topp=0.5, slash_topp=0.8, vertical_cap=5, slash_cap=12),
    "striped top-k, two rows": CFG,
    "striped top-k, fp32": CFG,
    "striped top-k, sampled": CFG.replace(sample_groups=3, sample_group_size=4),
    "striped mass, sampled": CFG.replace(budget_mode="mass", mass_target=0.7, mass_threshold=0.0, vertical_cap=7,
                                         sample_groups=2, sample_group_size=4),
    "planner mass, fp32": CFG.replace(budget_mode="mass", mass_target=0.8, mass_threshold=0.0),
    "striped mass threshold, sampled": CFG.replace(budget_mode="mass", mass_target=0.3, mass_threshold=0.05,
                                                   vertical_cap=9, sample_groups=3, sample_group_size=2),
    "striped mass near blocks, sampled": CFG.replace(budget_mode="mass", mass_target=0.5, mass_threshold=0.05,
                                                     mass_near_blocks=2, vertical_cap=9, sample_groups=3,
                                                     sample_group_size=4),
    "striped causal chunks, mass sampled": CFG.replace(estimation="causal_chunks", estimation_chunk=48,
                                                       budget_mode="mass", mass_target=0.8, mass_threshold=0.0,
                                                       sample_groups=2, sample_group_size=4),
    "planner mass, default threshold": CFG.replace(budget_mode="mass"),
}
# The default threshold (0.0025 of a block's attention) keeps every block of these short documents' random scores:
# the case checks that the planner's split selects the same (dense) layout, not a sparse one. Every other case keeps
# under 95% of the blocks dense attention computes (`SparseLayout.kept_fraction`).
DENSE_CASES = {"planner mass, default threshold"}
# Exact ties: every key the same vector with dyadic entries (exact scores in any order), so that each row's
# probabilities are equal and, with one scoring query, every column and offset of a document scores the same.
TIE_CFG = CFG.replace(last_q=1, sink_tokens=0, local_window=1, vertical_topk=6, slash_topk=5)
TIE_MODES = {"top-k": TIE_CFG,
             "top-p": TIE_CFG.replace(budget_mode="topp", vertical_topp=0.6017, slash_topp=0.3017, vertical_cap=200,
                                      slash_cap=9),
             "mass": TIE_CFG.replace(budget_mode="mass", mass_target=0.6017, mass_threshold=0.0, vertical_cap=5),
             "mass, near blocks": TIE_CFG.replace(budget_mode="mass", mass_target=0.6017, vertical_cap=5,
                                                  mass_threshold=0.05, mass_near_blocks=2)}
# Two long documents (one starting inside a block), a short dense one, padding; a second row, other documents.
RUNS = [(0, 300), (1, 40), (2, 411), (PAD_SEGMENT, 9)]
OTHER_ROW = [(0, 120), (1, 500), (PAD_SEGMENT, 140)]
FIELDS = ("block_idx", "block_cnt", "col_idx", "col_cnt")
# torch's collectives by kind, under the names of torch 2.13 and of earlier versions.
COLLECTIVES = {"all_reduce": "all_reduce", "reduce_scatter_single": "reduce_scatter",
               "reduce_scatter_tensor": "reduce_scatter", "all_gather_single": "all_gather",
               "all_gather_into_tensor": "all_gather"}


@pytest.mark.parametrize("budget", [TopK(9, 9), TopP(0.5, 0.5, 11, 11), TopP(0.99, 0.99, 11, 11)], ids=str)
def test_candidates_select_what_the_whole_row_selects(budget):
    g = torch.Generator().manual_seed(0)
    scores = torch.rand(3, 200, generator=g, dtype=torch.float64) ** 4
    scores[:, ::7] = 0  # entries never kept
    whole = torch.tensor(naive_select(budget, scores, scores, 0, 200, 200, BS)[0])
    # split into 4 holders; each offers its best (`offered`) with the mass of all it holds
    m, pos = int(budget.offered("columns", torch.tensor(50))), torch.randperm(200, generator=g).view(4, 50)
    best = [scores[:, p].topk(m, dim=1) for p in pos]
    vals = torch.cat([v for v, _ in best], 1)
    where = torch.cat([p[i] for p, (_, i) in zip(pos, best)], 1)
    offered = Entries(vals, where, scores.sum(1, keepdim=True))
    kept, _ = budget.select(offered, offered, 0, 200, 200, BS)
    union = torch.zeros_like(whole).scatter_(1, torch.where(kept, where, 0), kept)
    assert torch.equal(union, whole) and 0 < int(whole.sum()) < whole.numel() // 4


@pytest.mark.parametrize("sharding", ["striped", "zigzag", "planner"])
def test_tokens_before_counts_each_ranks_tokens(sharding):
    from hf_sparse_cp.distributed import ShardPlan
    from hf_sparse_cp.distributed.split.documents import plan_row

    meta = TokenMeta.from_segments(torch.cat([torch.full((n,), d, dtype=torch.int32) for d, n in RUNS]).unsqueeze(0))
    s = meta.segment.shape[1]
    plan = plan_row(meta, CFG, WORLD) if sharding == "planner" else ShardPlan(sharding, WORLD, BS, s)
    positions = torch.arange(plan.padded_len + 1)
    want = torch.stack([torch.searchsorted(plan.token_index(r), positions) for r in range(WORLD)], 1)
    assert torch.equal(plan.tokens_before(positions), want)


def _case(rank: int, world: int) -> dict:
    from hf_sparse_cp.distributed import ContextParallelConfig, CPShard, ParallelDims, ShardPlan, estimate_layout_cp
    from hf_sparse_cp.distributed.split.documents import plan_row

    par = ParallelDims.from_config(ContextParallelConfig(cp_size=world))
    sent = []

    def counted(name, call):
        def collective(*args, **kwargs):
            sent.append((name, max(t.numel() * t.element_size() for t in args[:2] if torch.is_tensor(t))))
            return call(*args, **kwargs)
        return collective

    for name, kind in COLLECTIVES.items():
        if hasattr(dist, name):  # this process only: count what the estimation sends
            setattr(dist, name, counted(kind, getattr(dist, name)))

    out = {}
    for case, cfg in CASES.items():
        rows = [RUNS, OTHER_ROW] if case.endswith("two rows") else [RUNS]
        meta = TokenMeta.from_segments(torch.stack([torch.cat([torch.full((n,), d, dtype=torch.int32) for d, n in runs])
                                                    for runs in rows]))
        plan = plan_row(meta, cfg, world) if case.startswith("planner") else ShardPlan("striped", world, BS,
                                                                                        meta.segment.shape[1])
        gmeta = plan.global_meta(meta)
        g = torch.Generator().manual_seed(len(out))
        dtype = torch.float32 if "fp32" in case else torch.float64
        q, k = (torch.randn(len(rows), h, plan.padded_len, D, generator=g, dtype=dtype) for h in (HQ, HKV))
        ref = estimate_layout(q, k, cfg, gmeta)  # one process, over the same (global) order
        mine = (x.index_select(2, plan.token_index(rank)) for x in (q, k))
        sent.clear()
        layout = estimate_layout_cp(*mine, cfg, CPShard(par, plan, gmeta))
        every = [None] * world
        dist.all_gather_object(every, [getattr(layout, f) for f in FIELDS], group=par.cp_group)
        out[case] = {
            "same_as_single": all(torch.equal(getattr(layout, f), getattr(ref, f)) for f in FIELDS),
            "same_on_all_ranks": all(torch.equal(a, b) for other in every for a, b in zip(other, every[0])),
            "sparse": float(ref.kept_fraction(gmeta)) < 0.95,
            "collectives": [n for n, _ in sent],
            "bytes": dict(sent[3:]),
            # what the reduce-scatter sums: the diagonals the budget ranks of every segment (its scored offsets, or in
            # 'mass' mode its block diagonals)
            "summed": sum(cfg.budget.diagonal_scores(torch.zeros(1, sg.scored_end - sg.start), BS).shape[1]
                          for row in estimation_segments(long_documents(gmeta, cfg), cfg) for sg in row),
        }
    return out


def _ties(rank: int, world: int) -> dict:
    from hf_sparse_cp.distributed import ContextParallelConfig, CPShard, ParallelDims, ShardPlan, estimate_layout_cp
    from hf_sparse_cp.distributed.split.documents import plan_row

    par = ParallelDims.from_config(ContextParallelConfig(cp_size=world))
    meta = TokenMeta.from_segments(torch.cat([torch.full((n,), d, dtype=torch.int32) for d, n in RUNS]).unsqueeze(0))
    g = torch.Generator().manual_seed(0)
    out = {}
    for sharding in ("striped", "zigzag", "planner"):
        plan = plan_row(meta, CFG, world) if sharding == "planner" else ShardPlan(sharding, world, BS,
                                                                                   meta.segment.shape[1])
        gmeta = plan.global_meta(meta)
        q = torch.randint(-2, 3, (1, HQ, plan.padded_len, D), generator=g) / 4
        k = torch.full((1, HKV, plan.padded_len, D), 0.5)
        for dtype in (torch.float32, torch.bfloat16):
            for mode, cfg in TIE_MODES.items():
                qd, kd = q.to(dtype), k.to(dtype)
                ref = estimate_layout(qd, kd, cfg, gmeta)
                mine = (x.index_select(2, plan.token_index(rank)) for x in (qd, kd))
                layout = estimate_layout_cp(*mine, cfg, CPShard(par, plan, gmeta))
                every = [None] * world
                dist.all_gather_object(every, [getattr(layout, f) for f in FIELDS], group=par.cp_group)
                out[(sharding, str(dtype), mode)] = {
                    "same_as_single": all(torch.equal(getattr(layout, f), getattr(ref, f)) for f in FIELDS),
                    "same_on_all_ranks": all(torch.equal(a, b) for other in every for a, b in zip(other, every[0])),
                    "sparse": float(ref.kept_fraction(gmeta)) < 0.95,
                }
    return out


@pytest.fixture(scope="module")
def runs():
    return run_gloo(_case, WORLD)


@pytest.mark.parametrize("case", list(CASES))
def test_estimation_across_ranks_equals_one_process(runs, case):
    for r in (run[case] for run in runs):
        assert (r["sparse"] or case in DENSE_CASES) and r["same_as_single"] and r["same_on_all_ranks"]


@pytest.mark.parametrize("case", list(CASES))
def test_the_scores_move_as_slash_sums_and_candidates(runs, case):
    for r in (run[case] for run in runs):
        # three small all-reduces (scoring queries, row max, row sums), then a reduce-scatter of the
        # slashes and one all-gather of the candidates: no all-reduce of the score buffer
        assert r["collectives"] == ["all_reduce"] * 3 + ["reduce_scatter", "all_gather"]
        # the reduce-scatter sums the slash scores (the scored offsets of each segment, packed; in 'mass'
        # mode their block diagonals) as exact fixed-point int64; the candidates are a fraction of the
        # slashes, where an all-reduce of the [2, H, sets, S] buffer sent both halves, unscored positions
        # included, twice
        assert r["bytes"]["reduce_scatter"] == HQ * -(-r["summed"] // WORLD) * WORLD * 8
        if "mass" not in case:
            assert r["bytes"]["all_gather"] < 0.5 * r["bytes"]["reduce_scatter"]


@pytest.fixture(scope="module")
def tie_runs():
    return run_gloo(_ties, WORLD)


@pytest.mark.parametrize("mode", list(TIE_MODES))
@pytest.mark.parametrize("dtype", ["torch.float32", "torch.bfloat16"])
@pytest.mark.parametrize("sharding", ["striped", "zigzag", "planner"])
def test_exact_ties_are_broken_by_position_on_every_rank_as_in_one_process(tie_runs, sharding, dtype, mode):
    for r in (run[(sharding, dtype, mode)] for run in tie_runs):
        assert r["sparse"] and r["same_as_single"] and r["same_on_all_ranks"]
