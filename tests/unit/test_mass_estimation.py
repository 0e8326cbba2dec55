"""The estimator's parts of #34: queries sampled along the document (stratum weights), block diagonals from
slash scores, cost-aware selection to a mass target ('mass' mode), and exact ties broken by position."""

from __future__ import annotations

import pytest
import torch

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention.budgets import Entries, Mass, TopK, TopP
from hf_sparse_cp.attention.budgets.mass import column_ratio, diagonal_cost
from hf_sparse_cp.attention.budgets.ranked import keep_best
from hf_sparse_cp.attention.estimate import estimate_layout
from hf_sparse_cp.attention.scoring import (
    Sampling,
    Stratum,
    accumulate_vertical_slash,
    row_exp_sums,
    row_max,
    score_vertical_slash,
    scoring_groups,
)
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.testing.layouts import planted_qk

BS, D = 16, 16
CFG = SparseAttentionConfig(block_size=BS, min_seq_len=0, budget_mode="mass", mass_target=0.9, mass_threshold=0.0,
                            sink_tokens=0, local_window=1, last_q=8, sample_groups=3, sample_group_size=4)


def test_scoring_groups_cut_a_document_into_strata():
    groups = scoring_groups(10, 107, Sampling(last_q=8, groups=3, group_size=4))
    assert [(g.lo, g.hi) for g in groups] == [(10, 34), (34, 58), (58, 82), (82, 107)]
    assert [g.rows for g in groups] == [4, 4, 4, 8] and {g.doc_start for g in groups} == {10}
    assert [tuple(g)[:4] for g in scoring_groups(0, 3, Sampling(8, 3, 4))] == [(0, 1, 1, 0), (1, 2, 1, 0), (2, 3, 1, 0)]
    assert [tuple(g)[:4] for g in scoring_groups(5, 69, Sampling(8))] == [(5, 69, 8, 5)]  # the last queries alone


@pytest.mark.parametrize("weighted", [False, True])
def test_sampled_scores_are_each_querys_mass_times_its_stratum_weight(weighted):
    g = torch.Generator().manual_seed(1)
    s, docs = 160, [(0, 40), (45, 160)]
    q, k = (torch.randn(h, s, D, generator=g, dtype=torch.float64) for h in (2, 1))
    sampling = Sampling(last_q=8, groups=2, group_size=5, weighted=weighted)
    vertical, slash = score_vertical_slash(q, k, docs, 8, D**-0.5, sampling)
    want_v, want_s = torch.zeros(2, s, dtype=torch.float64), torch.zeros(2, s, dtype=torch.float64)
    for start, end in docs:
        for st in scoring_groups(start, end, sampling):
            for r in range(st.hi - st.rows, st.hi):
                p = torch.softmax((q[:, r] @ k[0, start : r + 1].T) * D**-0.5, -1)  # [H, keys start..r]
                j = torch.arange(start, r + 1)
                w_key = ((st.hi - j.clamp_min(st.lo)).clamp_min(0) / st.rows) if weighted else torch.ones(len(j))
                w_off = ((st.hi - (start + r - j).clamp_min(st.lo)).clamp_min(0) / st.rows) if weighted else 1
                want_v[:, j] += p * w_key
                want_s[:, start + r - j] += p * w_off
    assert torch.allclose(vertical, want_v) and torch.allclose(slash, want_s)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("far_blocks", [0, 2])
def test_one_pass_scores_are_those_of_the_two_pass_softmax_to_the_bit(dtype, far_blocks):
    """Keys that fit in one score tile are scored in one pass (the tile's own max and sum); the numbers must be
    those of the two-pass path that a key set split over ranks takes (row statistics first), bit for bit, and
    so must those of the keys split in two parts whose row statistics are combined (as the ranks combine them)."""
    g = torch.Generator().manual_seed(7)
    r, n = 11, 150
    q, k = torch.randn(6, r, D, generator=g, dtype=dtype) * 2, torch.randn(3, n, D, generator=g, dtype=dtype) * 2
    rows, keys = torch.arange(n - r, n), torch.arange(n)
    sampling = Sampling(r, far_blocks=far_blocks, block_size=BS)
    stratum, encoding = Stratum(40, n, r, 0, far_blocks, BS), sampling.encoding(0, n)
    visible = keys.unsqueeze(0) <= rows.unsqueeze(1)
    parts = [torch.arange(0, n, 3), torch.cat([torch.arange(1, n, 3), torch.arange(2, n, 3)])]
    top = torch.maximum(*(row_max(q, k[:, p], visible[:, p], 0.3) for p in parts))
    sums = sum(row_exp_sums(q, k[:, p], visible[:, p], 0.3, top, encoding.exp_sums) for p in parts)
    normalizer = top, encoding.exp_sums.decode(sums, dtype)
    out = []
    for split in (False, True):
        vertical, slash = torch.zeros(6, n, dtype=torch.int64), torch.zeros(6, n, dtype=torch.int64)
        for p in parts if split else [keys]:
            accumulate_vertical_slash(q, k[:, p], rows, p, 0.3, vertical, slash, encoding,
                                      normalizer=normalizer if split else None, stratum=stratum)
        out.append((vertical, slash))
    assert torch.equal(out[0][0], out[1][0]) and torch.equal(out[0][1], out[1][1])
    assert bool((out[0][0] > 0).any())


def test_scores_are_exact_whatever_the_tiles(monkeypatch):
    """Equal keys score the same to the bit, and tiles of any shape sum to the same scores (each product exact to
    its two vectors, each sum exact): what lets every rank and one process break exact ties alike."""
    import hf_sparse_cp.attention.scoring as scoring

    g = torch.Generator().manual_seed(3)
    q, k = torch.randn(4, 300, D, generator=g), torch.randn(2, 300, D, generator=g)
    k[:, 100:250] = k[:, 100:101]  # a run of equal keys
    scored = {}
    for weighted in (False, True):
        sampling = Sampling(24, groups=2, group_size=6, weighted=weighted, block_size=BS)
        whole = score_vertical_slash(q, k, [(0, 300)], 24, D**-0.5, sampling)
        for elements in (24 * 7, 24 * 40, 24 * 64 * 2):
            monkeypatch.setattr(scoring, "SCORE_ELEMENTS", elements)
            tiled = score_vertical_slash(q, k, [(0, 300)], 24, D**-0.5, sampling)
            assert torch.equal(tiled[0], whole[0]) and torch.equal(tiled[1], whole[1]), (weighted, elements)
        monkeypatch.undo()
        scored[weighted] = whole
    # keys 100..193 are seen by the same scoring queries (rows 194..199 and 276..299): plain sums tie exactly
    assert torch.unique(scored[False][0][:, 100:194], dim=1).shape[1] == 1


def test_mass_block_diagonal_scores_spread_each_offset_over_the_two_diagonals_it_crosses():
    g = torch.Generator().manual_seed(2)
    slash = torch.rand(3, 70, generator=g, dtype=torch.float64)
    got = Mass().diagonal_scores(slash, BS)
    o, d = torch.arange(70), torch.arange(got.shape[1])
    tri = (BS - (o.unsqueeze(0) - d.unsqueeze(1) * BS).abs()).clamp_min(0) / BS  # [d, o]
    assert got.shape == (3, 6) and torch.allclose(got, slash @ tri.T.double())
    assert torch.allclose(got.sum(1), slash.sum(1))


def select_mass(gain, pos, diag_gain, diag, start, end, cfg):
    """The 'mass' budget of `cfg` on one document [start, end) scored by all its queries."""
    return cfg.budget.select(Entries(gain, pos), Entries(diag_gain, diag), start, end, end, cfg.block_size)


def _mass_inputs(g, n=60, start=7, end=103):
    gain = torch.rand(2, n, generator=g, dtype=torch.float64) * 3
    pos = torch.arange(start, start + n)
    diag_gain = torch.rand(2, (end - start) // BS + 2, generator=g, dtype=torch.float64) * 20
    return gain, pos, diag_gain, torch.arange(diag_gain.shape[1])


def test_mass_selection_keeps_the_best_mass_per_cost_until_the_target():
    g = torch.Generator().manual_seed(3)
    start, end = 7, 103
    gain, pos, diag_gain, diag = _mass_inputs(g, start=start, end=end)
    for target, cap, threshold in ((0.5, 100, 0), (0.8, 100, 0), (0.8, 5, 0), (1.0, 100, 0), (0.3, 100, 0.08)):
        cfg = CFG.replace(mass_target=target, vertical_cap=cap, mass_threshold=threshold)
        cols, diags = select_mass(gain, pos, diag_gain, diag, start, end, cfg)
        assert bool(diags[:, 0].all()) and int(cols.sum(1).max()) <= cap
        c_ratio = column_ratio(gain, pos, start, end, BS)
        d_ok = (diag >= 1) & (diag <= (end - start - 1) // BS)
        d_ratio = torch.where(d_ok, diag_gain / diagonal_cost(diag, start, end, BS).clamp_min(1), 0)
        for h in range(2):
            # cap: the best `cap` columns by ratio compete; then everything kept outranks everything not kept
            best_cols = set(c_ratio[h].argsort(descending=True, stable=True)[:cap].tolist())
            items = [(float(c_ratio[h, i]), float(gain[h, i]), bool(cols[h, i])) for i in best_cols]
            items += [(float(d_ratio[h, i]), float(diag_gain[h, i]), bool(diags[h, i])) for i in range(1, len(diag))
                      if d_ok[i]]
            items.sort(key=lambda x: -x[0])
            kept = [x[2] for x in items]
            n_kept = sum(kept)
            assert kept == [True] * n_kept + [False] * (len(kept) - n_kept)
            # the prefix that reaches the target, then every one priced at the threshold or above
            mass_kept = float(diag_gain[h, 0]) + sum(x[1] for x in items[:n_kept])
            reached = next((i + 1 for i in range(len(items)) if float(diag_gain[h, 0])
                            + sum(x[1] for x in items[: i + 1]) >= target * (end - start)), len(items))
            priced = sum(x[0] >= threshold * BS for x in items) if threshold else 0
            positive = sum(x[0] > 0 for x in items)
            assert n_kept == min(max(reached, priced), positive), (n_kept, reached, priced, positive)
            assert mass_kept > 0


@pytest.mark.parametrize("near", [0, 2])
def test_mass_selection_over_candidates_equals_the_whole_row(near):
    g = torch.Generator().manual_seed(4)
    start, end = 7, 103
    gain, pos, diag_gain, diag = _mass_inputs(g, start=start, end=end)
    gain[:, 10:20] = gain[:, 10:11]  # exact ties, split across holders
    cfg = CFG.replace(mass_target=0.85, vertical_cap=6, mass_near_blocks=near)
    whole = select_mass(gain, pos, diag_gain, diag, start, end, cfg)
    # three holders of interleaved columns and diagonals; each offers its best `vertical_cap` columns by ratio
    # (ties: the lower position) and every diagonal it holds, in its own order
    ratio = column_ratio(gain, pos, start, end, BS, near)
    c_idx, d_idx = [], []
    for holder in range(3):
        mine = torch.arange(holder, len(pos), 3)
        order = torch.sort(ratio[:, mine], dim=1, descending=True, stable=True).indices
        best = mine[order[:, : cfg.budget.vertical_cap]]
        c_idx.append(best.flip(1))
        d_idx.append(torch.arange(holder, len(diag), 3).flip(0).expand(2, -1))
    c_idx, d_idx = torch.cat(c_idx, 1), torch.cat(d_idx, 1)
    cols, diags = select_mass(gain.gather(1, c_idx), pos[c_idx], diag_gain.gather(1, d_idx), diag[d_idx], start, end,
                              cfg)
    union_cols = torch.zeros_like(whole[0]).scatter_(1, c_idx, cols)
    union_diags = torch.zeros_like(whole[1]).scatter_(1, d_idx, diags)
    assert torch.equal(union_cols, whole[0]) and torch.equal(union_diags, whole[1])
    assert int(whole[0].sum(1).max()) == cfg.budget.vertical_cap and not bool(whole[1].all())  # the cap and target bind


# (budget, its count and share, the low entries kept): top-k 14 keeps the ten of 0.5, then 4 of 0.25; top-p 0.6
# keeps while the mass before an entry is below 0.6 of 12.5: the ten of 0.5, then 0.25 each up to 7.5 (ten).
@pytest.mark.parametrize("budget, count, share, low", [(TopK(vertical_topk=14), 14, None, 4),
                                                       (TopP(vertical_topp=0.6, vertical_cap=40), 40, 0.6, 10)],
                         ids=["topk", "topp"])
def test_exact_ties_go_to_the_lower_position_in_a_row_and_in_a_union(budget, count, share, low):
    scores = torch.full((2, 40), 0.25)
    scores[:, 30:] = 0.5
    kept = keep_best(Entries(scores, torch.arange(40)), count, share)
    want = torch.zeros(2, 40, dtype=torch.bool)
    want[:, 30:] = True
    want[:, :low] = True
    assert torch.equal(kept, want)
    assert torch.equal(budget.select(Entries(scores, torch.arange(40)), Entries(scores, torch.arange(40)), 0, 40, 40,
                                     BS)[0], want)
    perm = torch.randperm(40, generator=torch.Generator().manual_seed(5))
    union = keep_best(Entries(scores[:, perm], perm.expand(2, -1), scores.sum(1, keepdim=True)), count, share)
    assert torch.equal(torch.zeros_like(kept).scatter_(1, perm.expand(2, -1), union), want)


def test_mass_mode_keeps_more_blocks_for_a_broad_head_than_for_a_focused_one():
    s = 512
    q, k = planted_qk(2, 1, s, 32, [[3, 100], []], [[0], []], generator=torch.Generator().manual_seed(6))
    layout = estimate_layout(q, k, CFG.replace(mass_target=0.9), TokenMeta.contiguous(1, s))
    blocks = layout.num_computed_blocks()[0]
    assert float(blocks[1]) > 3 * float(blocks[0])  # head 1 attends evenly: it needs most of its blocks
    assert float(blocks[0]) < 0.3 * (s // BS) * (s // BS + 1) / 2


@pytest.mark.parametrize("mode", ["topk", "mass"])
def test_sampled_queries_find_a_column_that_only_earlier_queries_use(mode):
    s, col = 512, 40
    q, k = planted_qk(1, 1, s, 32, [[col]], [[0]], generator=torch.Generator().manual_seed(7))
    q[:, :, 400:, :16] = 0.1 * torch.randn(112, 16, generator=torch.Generator().manual_seed(8))  # late: not the column
    budget = {"vertical_topk": 4, "slash_topk": 4} if mode == "topk" else {"mass_target": 0.8}
    cfg = CFG.replace(budget_mode=mode, **budget)
    found = {}
    for groups in (0, 4):
        layout = estimate_layout(q, k, cfg.replace(sample_groups=groups), TokenMeta.contiguous(1, s))
        last = (layout.col_idx[0, 0, -1], layout.block_idx[0, 0, -1])  # the last query block's columns, blocks
        found[groups] = bool((last[0] == col).any() or (last[1] == col // BS).any())
    assert found == {0: False, 4: True}


@pytest.mark.parametrize(("field", "value"), [("mass_target", 0.0), ("mass_target", 1.5), ("mass_threshold", -0.1),
                                              ("mass_threshold", 1.0), ("sample_groups", -1), ("sample_group_size", 0),
                                              ("mass_near_blocks", -1)])
def test_bad_estimator_settings_are_refused(field, value):
    with pytest.raises(ValueError, match=field):
        SparseAttentionConfig(**{field: value})


def test_a_threshold_outside_mass_mode_is_refused_naming_the_mode():
    """mass_threshold is read only in 'mass' mode: with another budget_mode it would do nothing, so it is refused
    (naming the flag that makes it count), unless a layer override runs 'mass' somewhere."""
    with pytest.raises(ValueError, match="--sparse_budget_mode mass"):
        SparseAttentionConfig(budget_mode="topk", mass_threshold=0.01)
    with pytest.raises(ValueError, match="budget_mode='topp'"):
        SparseAttentionConfig(budget_mode="topp", mass_threshold=0.01)
    with pytest.raises(ValueError, match="mass_near_blocks=4 is read only in budget_mode='mass'"):
        SparseAttentionConfig(budget_mode="topk", mass_near_blocks=4)
    with pytest.raises(ValueError, match="budgets of 2 modes; pass --sparse_budget_mode mass or --sparse_budget_mode"):
        SparseAttentionConfig(vertical_topk=64, mass_threshold=0.01)  # fields of two modes and no mode to choose
    # flat keys as earlier versions read them: a field of the mode a layer override selects is that layer's
    mixed = SparseAttentionConfig(budget_mode="topk", mass_threshold=0.01, dense_first_layers=1,
                                  layer_overrides={"2-3": {"budget_mode": "mass"}})
    assert mixed.for_layer(2).budget == Mass(mass_threshold=0.01) and mixed.budget == TopK()
    assert mixed.for_layer(0).pattern == "dense" and mixed.for_layer(5).budget.mode == "topk"
    # a mass config whose override switches some layers to top-k: they run top-k's defaults
    topk_layers = SparseAttentionConfig(budget_mode="mass", mass_threshold=0.01,
                                        layer_overrides={"0": {"budget_mode": "topk"}})
    assert (topk_layers.for_layer(0).budget, topk_layers.for_layer(1).budget) == (TopK(), Mass(mass_threshold=0.01))
    with pytest.raises(ValueError, match=r"layer_overrides\['0'\].*mass_threshold"):
        SparseAttentionConfig(budget_mode="mass",
                              layer_overrides={"0": {"budget_mode": "topk", "mass_threshold": 0.01}})


def test_far_columns_take_only_the_mass_of_queries_far_enough_after_them():
    """With mass_near_blocks n, a key column's score is the mass of the scoring queries n or more blocks after its
    block, weighted by the far queries of their stratum over the far scoring queries; slashes are unchanged."""
    g = torch.Generator().manual_seed(11)
    s, docs, far = 160, [(0, 40), (45, 160)], 2
    q, k = (torch.randn(h, s, D, generator=g, dtype=torch.float64) for h in (2, 1))
    sampling = Sampling(last_q=8, groups=2, group_size=5, weighted=True, far_blocks=far, block_size=BS)
    vertical, slash = score_vertical_slash(q, k, docs, 8, D**-0.5, sampling)
    _, plain_slash = score_vertical_slash(q, k, docs, 8, D**-0.5, sampling._replace(far_blocks=0))
    want = torch.zeros(2, s, dtype=torch.float64)
    for start, end in docs:
        for st in scoring_groups(start, end, sampling):
            for r in range(st.hi - st.rows, st.hi):
                p = torch.softmax((q[:, r] @ k[0, start : r + 1].T) * D**-0.5, -1)
                j = torch.arange(start, r + 1)
                first = ((j - start) // BS + far) * BS + start  # the first query far enough after key j (blocks
                # counted from the document's start)
                seen = (st.hi - first.clamp_min(st.lo)).clamp_min(0)
                scored = (st.hi - first.clamp_min(st.hi - st.rows)).clamp_min(0)
                want[:, j] += p * (r >= first) * torch.where(scored > 0, seen / scored.clamp_min(1), 0)
    assert torch.allclose(vertical, want) and torch.equal(slash, plain_slash)
    # no query is far enough after the document's last `far` blocks (counted from its start at 45)
    last_blocks = 45 + ((160 - 45 - 1) // BS + 1 - far) * BS
    assert bool((vertical[:, last_blocks:] == 0).all())
    assert bool((vertical[:, last_blocks - BS : last_blocks] > 0).all())


def test_far_diagonals_lose_the_mass_of_a_kept_column_they_cross():
    """A heavy column at the document's start (an attention sink) puts its mass in every block diagonal: each
    far diagonal's one block on it. Counted twice, the far diagonals (few blocks each) look valuable and are
    kept; with mass_near_blocks their gain is net of the kept column's mass, and they are not."""
    start, end, near = 0, 512, 2
    nqb = end // BS
    pos = torch.arange(start, end)
    per_block = 8.0  # the sink's mass per far query block
    gain = torch.full((1, end), 0.01, dtype=torch.float64)
    gain[0, 0] = per_block * (nqb - near)
    diag = torch.arange(nqb + 1)
    diag_gain = torch.full((1, nqb + 1), 0.01, dtype=torch.float64)
    diag_gain[0, near:nqb] += per_block  # each far diagonal crosses key block 0 once
    diag_gain[0, 0], diag_gain[0, 1] = float(end), 0.3 * end  # the main and the next diagonal: local attention
    kept = {}
    for n in (0, near):
        cfg = CFG.replace(mass_target=0.5, mass_threshold=0.3, vertical_cap=64, mass_near_blocks=n)
        cols, diags = select_mass(gain, pos, diag_gain, diag, start, end, cfg)
        kept[n] = (cols[0].nonzero().flatten().tolist(), diags[0].nonzero().flatten().tolist())
    assert kept[near] == ([0], [0, 1])
    assert kept[0][0] == [0] and nqb - 1 in kept[0][1]  # the sink counted twice: its diagonal of one block


def test_the_model_card_names_the_mass_settings():
    from hf_sparse_cp.reporting.model_card import _describe_pattern

    text = _describe_pattern(SparseAttentionConfig(budget_mode="mass", mass_threshold=0.01, mass_near_blocks=4))
    assert "at least 0.01 of their queries' attention" in text and "4 or more blocks after them" in text
    assert "blocks after them" not in _describe_pattern(SparseAttentionConfig(budget_mode="mass"))
