"""Vertical-slash estimation and layout construction."""

import pytest
import torch

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention.build import build_layout, dense_layout, offsets_to_block_diagonals
from hf_sparse_cp.attention.estimate import estimate_layout
from hf_sparse_cp.attention.layout import dense_blocks
from hf_sparse_cp.attention.scoring import score_vertical_slash
from hf_sparse_cp.attention.tokens import PAD_SEGMENT, TokenMeta
from hf_sparse_cp.testing.layouts import PLANTED_LOGIT, local_qk, planted_qk

from oracle import select_vertical_slash, visible

S, D = 1024, 64
VERTICALS = [[5, 300], [77], [500, 600], [], [40, 41], [900], [], [128]]
OFFSETS = [[200], [450, 700], [], [333], [64], [], [1000, 17], [512]]


@pytest.fixture(scope="module")
def planted():
    return planted_qk(8, 2, S, D, VERTICALS, OFFSETS, generator=torch.Generator().manual_seed(0))


def _cfg(**kw):
    base = dict(block_size=64, min_seq_len=128, vertical_topk=2, slash_topk=2, sink_tokens=0, local_window=1,
                last_q=64)
    return SparseAttentionConfig(**base).replace(**kw)


def test_planted_columns_and_diagonals_are_selected(planted):
    q, k = planted
    v_score, s_score = score_vertical_slash(q[0], k[0], [(0, S)], 64, D**-0.5)
    keep_v, keep_s = (x[0] for x in select_vertical_slash(v_score[None], s_score[None], [[(0, S)]], _cfg()))
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
    keep_v, keep_s = (x[0] for x in select_vertical_slash(v_score[None], s_score[None], [[(0, S)]], cfg))
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


def _random_build_inputs(trial: int, g: torch.Generator):
    """Rows of 1-3 packed documents (a padded tail in some), per-head kept block diagonals, kept columns
    shared or per head, dense tokens, and a sliding window in some trials."""
    b, s, bs, heads = 2, int(torch.randint(40, 300, (1,), generator=g)), (16, 32)[trial % 2], 3
    seg = torch.zeros(b, s, dtype=torch.int32)
    for row in range(b):
        for i, cut in enumerate(sorted(torch.randint(1, s, (trial % 3,), generator=g).tolist())):
            seg[row, cut:] = i + 1
        if trial % 4 == 0:
            seg[row, s - s // 5 :] = -1
    nb = -(-s // bs)
    return dict(
        meta=TokenMeta.from_segments(seg),
        block_size=bs,
        diagonals=torch.rand(b, heads, nb, generator=g) < 0.3,
        verticals=torch.rand(b, heads if trial % 2 else 1, s, generator=g) < 0.05,
        dense_tokens=torch.rand(b, s, generator=g) < 0.2,
        sliding_window=int(torch.randint(10, 80, (1,), generator=g)) if trial % 5 == 0 else None,
    )


@pytest.mark.parametrize("trial", range(40))
def test_build_layout_lists_what_is_selected_and_nothing_useless(trial):
    """Against the definition on random inputs: every visible pair that a dense query, a kept block
    diagonal or a kept column selects is listed; every listed block holds a visible pair; every listed
    column is seen by some query of its block; columns never repeat a listed block."""
    kw = _random_build_inputs(trial, torch.Generator().manual_seed(trial))
    meta, bs, window = kw["meta"], kw["block_size"], kw["sliding_window"]
    layout = build_layout(**kw)
    b, s = meta.segment.shape
    heads = max(kw["diagonals"].shape[1], kw["verticals"].shape[1])
    layout.validate(heads, s, s, strict=True)
    mask = layout.to_mask(heads, s, s)
    vis = visible(meta, meta, window=window).expand(b, heads, s, s)
    pos = torch.arange(s)
    block_diag = (pos.view(-1, 1) // bs - pos.view(1, -1) // bs).clamp_min(0)
    selected = (kw["dense_tokens"].view(b, 1, s, 1) | kw["diagonals"][:, :, block_diag]
                | kw["verticals"].unsqueeze(2)) & vis
    assert bool((mask | ~selected).all()), "a selected visible pair is not listed"

    nb = -(-s // bs)
    pad = nb * bs - s

    def per_block(x):  # [B, H, S, S] -> [B, H, NQB, NKB]: any pair of the block
        x = torch.nn.functional.pad(x, (0, pad, 0, pad))
        return x.view(b, heads, nb, bs, nb, bs).any(5).any(3)

    blocks = torch.zeros(b, heads, nb, nb + 1, dtype=torch.bool)
    valid = torch.arange(layout.block_idx.shape[-1]) < layout.block_cnt.unsqueeze(-1)
    blocks.scatter_(-1, torch.where(valid, layout.block_idx.long(), nb).expand(b, heads, nb, -1), True)
    assert not bool((blocks[..., :nb] & ~per_block(vis)).any()), "a listed block holds no visible pair"
    seen_by_block = torch.nn.functional.pad(vis, (0, 0, 0, pad)).view(b, heads, nb, bs, s).any(3)
    col_valid = torch.arange(layout.col_idx.shape[-1]) < layout.col_cnt.unsqueeze(-1)
    col = layout.col_idx.long().clamp_min(0).expand(b, heads, nb, -1)
    assert bool(seen_by_block.gather(-1, col)[col_valid.expand_as(col)].all()), "a listed column is seen by nobody"


@pytest.mark.parametrize("trial", range(6))
def test_the_kept_fraction_counts_the_blocks_a_dense_run_computes(trial):
    """Documents, padding and sliding windows: a dense layout keeps 1.0, and `dense_blocks` is what it lists."""
    kw = _random_build_inputs(trial, torch.Generator().manual_seed(100 + trial))
    meta, bs, window = kw["meta"], kw["block_size"], kw["sliding_window"]
    dense = dense_layout(meta, bs, window)
    listed = dense.block_cnt.sum((1, 2)).double()
    assert torch.equal(dense_blocks(meta, bs, window), listed)
    assert float(dense.kept_fraction(meta, window)) == 1.0


@pytest.mark.parametrize("pattern", ["dense", "sparse"])
def test_a_row_of_padding_only_does_not_count_in_the_kept_fraction(pattern):
    """A batch whose second row is all padding (an empty text padded to the batch's length) keeps what its first
    row keeps: 1.0 for a dense layout, the first row's own fraction for a sparse one (it counted as 0 and halved
    the mean); a batch of padding only keeps 1.0."""
    s, bs = 256, 16
    row = TokenMeta.from_segments(torch.zeros(1, s, dtype=torch.int32))
    batch = TokenMeta.from_segments(torch.tensor([[0] * s, [PAD_SEGMENT] * s], dtype=torch.int32))
    if pattern == "dense":
        one, both = dense_layout(row, bs), dense_layout(batch, bs)
    else:
        q, k = (torch.randn(2, 2, s, 16, generator=torch.Generator().manual_seed(i)) for i in (1, 2))
        cfg = SparseAttentionConfig(block_size=bs, min_seq_len=64, vertical_topk=2, slash_topk=2, sink_tokens=2,
                                    local_window=4, last_q=16)
        one, both = estimate_layout(q[:1], k[:1], cfg, row), estimate_layout(q, k, cfg, batch)
    assert float(one.kept_fraction(row)) < 1.0 or pattern == "dense"
    assert float(both.kept_fraction(batch)) == float(one.kept_fraction(row))
    padding = TokenMeta.from_segments(torch.full((1, s), PAD_SEGMENT, dtype=torch.int32))
    assert float(dense_layout(padding, bs).kept_fraction(padding)) == 1.0


def test_packed_documents_kept_whole_keep_one_not_half():
    """Two packed documents of 4 blocks each, every block of each document's own triangle computed (what a run
    whose layers are all dense computes): 1.0. Over the row's causal triangle (36 blocks) it would be 20/36."""
    bs = 16
    segment = torch.tensor([[0] * 64 + [1] * 64])
    meta = TokenMeta(torch.arange(128).unsqueeze(0), segment)
    layout = dense_layout(meta, bs)
    assert int(layout.block_cnt.sum()) == 20 and float(layout.kept_fraction(meta)) == 1.0
    keep_diagonal = build_layout(meta, bs, dense_tokens=torch.zeros_like(segment, dtype=torch.bool))
    assert float(keep_diagonal.kept_fraction(meta)) == pytest.approx(float(keep_diagonal.block_cnt.sum()) / 20)


def test_kept_fraction_counts_real_tokens_only():
    """Padding appended to a row (right padding, or the blocks a CP split adds) lists no block and
    does not count in the triangle: the kept fraction of the padded row is the unpadded one's."""
    meta = TokenMeta.contiguous(2, 135)
    padded = meta.pad_to(192)
    layout, layout_padded = dense_layout(meta, 16), dense_layout(padded, 16)
    assert float(layout.kept_fraction(meta)) == 1.0 == float(layout_padded.kept_fraction(padded))
    assert float(layout_padded.kept_fraction()) < 1.0  # without the metadata every query block counts


def test_local_qk_scores_decay_with_distance_and_top_k_keeps_few_blocks():
    """local_qk's scaled scores follow PLANTED_LOGIT x exp(-d^2 / (2 span^2)) on average, and a top-k budget
    over them keeps a few contiguous blocks per row where i.i.d. random q and k lose every block."""
    heads, s, span = 64, 2048, 128.0
    q, k = local_qk(heads, heads, s, D, span, generator=torch.Generator().manual_seed(3))
    for d in (0, 128, 256, 512):
        mean = float((q[0, :, d:] * k[0, :, : s - d]).sum(-1).mean()) * D**-0.5
        assert abs(mean - PLANTED_LOGIT * torch.exp(torch.tensor(-(d**2) / (2 * span**2)))) < 0.5, (d, mean)
    cfg = SparseAttentionConfig(block_size=64, min_seq_len=128, vertical_topk=128, slash_topk=128)
    meta = TokenMeta.contiguous(1, s)
    g = torch.Generator().manual_seed(4)
    local = local_qk(4, 2, s, D, span, generator=g)
    scattered = (torch.randn(1, 4, s, D, generator=g), torch.randn(1, 2, s, D, generator=g))
    kept = [float(estimate_layout(q, k, cfg, meta, scale=D**-0.5).kept_fraction(meta)) for q, k in (local, scattered)]
    assert kept[0] < 0.35 < 0.8 < kept[1], kept
