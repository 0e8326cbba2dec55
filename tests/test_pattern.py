"""Vertical-slash estimation and layout construction."""

import pytest
import torch
from oracle import visible

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.pattern import (
    build_layout,
    dense_layout,
    estimate_layout,
    offsets_to_block_diagonals,
    score_vertical_slash,
    select_vertical_slash,
)
from hf_sparse_cp.synthetic import planted_qk
from hf_sparse_cp.tokens import TokenMeta

S, D = 1024, 64
VERTICALS = [[5, 300], [77], [500, 600], [], [40, 41], [900], [], [128]]
OFFSETS = [[200], [450, 700], [], [333], [64], [], [1000, 17], [512]]


@pytest.fixture(scope="module")
def planted():
    return planted_qk(8, 2, S, D, VERTICALS, OFFSETS, generator=torch.Generator().manual_seed(0))


def _cfg(**kw):
    base = dict(block_size=64, min_seq_len=128, vertical_topk=2, slash_topk=2, sink_tokens=0, local_window=1,
                last_q=64)
    base.update(kw)
    return SparseAttentionConfig(**base)


def test_planted_columns_and_diagonals_are_selected(planted):
    q, k = planted
    v_score, s_score = score_vertical_slash(q[0], k[0], [(0, S)], 64, D**-0.5)
    keep_v, keep_s = select_vertical_slash(v_score, s_score, [(0, S)], _cfg())
    for h in range(8):
        assert set(VERTICALS[h]) <= set(keep_v[h].nonzero().flatten().tolist()), h
        assert set(OFFSETS[h]) <= set(keep_s[h].nonzero().flatten().tolist()), h


def test_unplanted_heads_do_not_find_the_plants(planted):
    """Control: the selection is driven by the data (random heads would pick other columns)."""
    q, k = planted
    v_score, _ = score_vertical_slash(q[0], k[0], [(0, S)], 64, D**-0.5)
    assert v_score[1].argmax().item() == 77 and v_score[3].argmax().item() != 77


def test_top_p_keeps_the_mass_within_the_cap(planted):
    q, k = planted
    v_score, s_score = score_vertical_slash(q[0], k[0], [(0, S)], 64, D**-0.5)
    cfg = _cfg(budget_mode="topp", vertical_topp=0.5, slash_topp=0.5, vertical_cap=3, slash_cap=50)
    keep_v, keep_s = select_vertical_slash(v_score, s_score, [(0, S)], cfg)
    assert int(keep_v.sum(-1).max()) <= 3
    for h in range(8):
        kept_mass = v_score[h][keep_v[h]].sum() / v_score[h].sum()
        assert kept_mass >= 0.5 or keep_v[h].sum() == 3
        assert set(OFFSETS[h][:1]) <= set(keep_s[h].nonzero().flatten().tolist())


def test_layout_covers_every_selected_pair(planted):
    q, k = planted
    cfg = _cfg(sink_tokens=16, local_window=64)
    layout = estimate_layout(q, k, cfg)
    layout.validate(8, S, S, strict=True)
    mask = layout.to_mask(8, S, S)[0]
    qi = torch.arange(S)
    for h in range(8):
        for col in VERTICALS[h] + list(range(16)):
            assert bool(mask[h, qi >= col, col].all()), (h, col)
        for off in OFFSETS[h] + list(range(64)):
            rows = qi[off:]
            assert bool(mask[h, rows, rows - off].all()), (h, off)
    assert 0.05 < float(layout.kept_fraction()) < 0.5


def test_estimation_is_deterministic(planted):
    q, k = planted
    a, b = estimate_layout(q, k, _cfg()), estimate_layout(q.clone(), k.clone(), _cfg())
    for name in ("block_idx", "block_cnt", "col_idx", "col_cnt"):
        assert torch.equal(getattr(a, name), getattr(b, name))


def test_short_sequences_and_dense_pattern_are_dense(planted):
    q, k = planted
    meta = TokenMeta.contiguous(1, S)
    dense = dense_layout(meta, 64)
    assert float(dense.kept_fraction()) == 1.0
    for cfg in (_cfg(min_seq_len=S + 1), _cfg(pattern="dense")):
        lay = estimate_layout(q, k, cfg)
        assert torch.equal(lay.block_idx, dense.block_idx) and int(lay.col_cnt.sum()) == 0


def test_packed_documents_never_cross(planted):
    q, k = planted
    seg = torch.zeros(1, S, dtype=torch.int32)
    seg[:, 100:] = 1  # short documents (< min_seq_len): dense
    seg[:, 420:] = 2  # long document: sparse
    seg[:, 1000:] = -1  # padding
    meta = TokenMeta.from_segments(seg)
    layout = estimate_layout(q, k, _cfg(min_seq_len=400, sink_tokens=4, local_window=8), meta)
    layout.validate(8, S, S, strict=True)
    mask = layout.to_mask(8, S, S)[0]
    vis = visible(meta, meta)[0, 0]
    bs = 64
    for h in range(8):
        blocks = mask[h].view(S // bs, bs, S // bs, bs).any(3).any(1)
        useful = (mask[h] & vis).view(S // bs, bs, S // bs, bs).any(3).any(1)
        assert torch.equal(blocks, useful), "a listed block holds no visible pair"
    # the short documents keep their whole causal prefix
    rows = torch.arange(100, 420)
    assert bool((mask[:, rows][:, :, 100:420] | ~vis[rows][:, 100:420]).all())
    # the long document gets its own sink columns
    assert bool(mask[:, 600:1000, 420:424].all())


def test_offsets_to_block_diagonals_covers_every_crossed_block():
    g = torch.Generator().manual_seed(3)
    for s, bs in ((100, 16), (128, 32)):
        keep = torch.rand(3, s, generator=g) < 0.05
        diag = offsets_to_block_diagonals(keep, bs)
        nb = -(-s // bs)
        for h in range(3):
            crossed = torch.zeros(nb, dtype=torch.bool)
            allowed = torch.zeros(nb + 1, dtype=torch.bool)
            for o in keep[h].nonzero().flatten().tolist():
                allowed[o // bs] = allowed[-(-o // bs)] = True
                for qi in range(o, s):
                    crossed[qi // bs - (qi - o) // bs] = True
            assert not bool((crossed & ~diag[h]).any())
            assert not bool((diag[h] & ~allowed[:nb]).any())


def test_build_layout_with_sliding_window_lists_only_window_blocks():
    meta = TokenMeta.contiguous(1, 300)
    layout = build_layout(meta, 32, dense_tokens=torch.ones(1, 300, dtype=torch.bool), sliding_window=50)
    mask = layout.to_mask(1, 300, 300)[0, 0]
    vis = visible(meta, meta, window=50)[0, 0]
    assert bool((mask | ~vis).all())  # every visible pair is listed
    assert int(layout.block_cnt.max()) <= 3  # a 50-token window reaches at most 2 blocks back
