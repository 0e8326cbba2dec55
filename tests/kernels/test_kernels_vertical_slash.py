"""The vertical-slash scoring kernels, run by Triton's interpreter on CPU, against the fp64 reference,
and the estimation path that uses them on CUDA (`hf_sparse_cp.attention.estimate` with the kernels) against the
PyTorch path that runs elsewhere.

Sizes are small (tiles of 16 under the interpreter) but cover several row tiles with a partial last
one, queries as many as keys, odd lengths, several key splits, GQA 1/2/4, a head_dim that is not
a power of two, and fp16 inputs.
"""

import pytest
import torch

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention import estimate as pattern
from hf_sparse_cp.attention import scoring
from hf_sparse_cp.attention.reference import reference_vertical_slash
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.kernels import vertical_slash as vs
from hf_sparse_cp.testing.interpreter import interpreter_pool
from hf_sparse_cp.testing.layouts import planted_qk

from oracle import TOLERANCE, rel_rms


@pytest.fixture(scope="module")
def interp():
    with interpreter_pool() as pool:
        yield pool


# ---- run in the interpreter worker ---------------------------------------------------------------

def _scores_twice(q_rows, k, scale):
    first = vs.vertical_slash_scores(q_rows, k, scale)
    again = vs.vertical_slash_scores(q_rows, k, scale)
    return first, all(torch.equal(a, b) for a, b in zip(first, again))


def _scores_with_the_fp32_tiles(q_rows, k, scale):
    """The scores with the tiles CUDA launches for fp32 inputs (`configs.scoring_tiles`), key splits of 128."""
    from dataclasses import replace

    from hf_sparse_cp.kernels import configs

    tiles = vs.scoring_tiles
    vs.scoring_tiles = lambda on_gpu, dtype=None: replace(configs.scoring_tiles(True, torch.float32),
                                                           keys_per_split=128)
    try:
        return vs.vertical_slash_scores(q_rows, k, scale)
    finally:
        vs.scoring_tiles = tiles


def _with_kernels(fn, *args):
    """Call an estimation or scoring function with the CUDA dispatch of the scores pointed at the (interpreted)
    kernels."""
    dispatch = scoring._scoring_kernel
    scoring._scoring_kernel = lambda q, k: vs.vertical_slash_scores
    try:
        return getattr(scoring if hasattr(scoring, fn) else pattern, fn)(*args)
    finally:
        scoring._scoring_kernel = dispatch


# ---- tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "hq,hk,r,l,d,dtype",
    [
        (2, 1, 5, 60, 16, torch.float32),
        (4, 2, 16, 100, 32, torch.float32),
        (4, 4, 37, 37, 24, torch.float16),
        (4, 1, 40, 203, 16, torch.float32),
    ],
    ids=["gqa2-R5-L60", "gqa2-R16-L100-d32", "mha-R37-L37-d24-fp16", "gqa4-R40-L203"],
)
def test_scores_match_the_reference(interp, hq, hk, r, l, d, dtype):
    g = torch.Generator().manual_seed(r + l)
    q_rows = (2 * torch.randn(hq, r, d, generator=g)).to(dtype)
    k = torch.randn(hk, l, d, generator=g).to(dtype)
    scale = d**-0.5
    (vertical, slash), reproducible = interp.apply(_scores_twice, (q_rows, k, scale))
    ref_v, ref_s = reference_vertical_slash(q_rows.double(), k.double(), scale)
    assert vertical.dtype == slash.dtype == torch.float32 and vertical.shape == slash.shape == (hq, l)
    assert rel_rms(vertical, ref_v) <= TOLERANCE[torch.float32]
    assert rel_rms(slash, ref_s) <= TOLERANCE[torch.float32]
    # each query's probabilities sum to one: both scores carry exactly R units of mass per head
    assert torch.allclose(vertical.double().sum(-1), torch.full((hq,), float(r), dtype=torch.float64), rtol=1e-5)
    assert torch.allclose(slash.double().sum(-1), torch.full((hq,), float(r), dtype=torch.float64), rtol=1e-5)
    assert reproducible  # no atomics: the same inputs give the same bits


def test_the_fp32_scoring_tiles_compute_the_same_scores(interp):
    """The row statistics in 64-key steps (the fp32 tiles on CUDA: `configs.scoring_tiles`) over several key splits,
    a partial last row tile and a head_dim that is not a power of two."""
    g = torch.Generator().manual_seed(7)
    q_rows, k = 2 * torch.randn(4, 70, 40, generator=g), torch.randn(2, 300, 40, generator=g)
    vertical, slash = interp.apply(_scores_with_the_fp32_tiles, (q_rows, k, 40**-0.5))
    ref_v, ref_s = reference_vertical_slash(q_rows.double(), k.double(), 40**-0.5)
    assert rel_rms(vertical, ref_v) <= TOLERANCE[torch.float32] and rel_rms(slash, ref_s) <= TOLERANCE[torch.float32]


def test_packed_row_scores_equal_the_pytorch_path(interp):
    """`score_vertical_slash` over a row of two long documents and a short one: the kernel path (taken
    on CUDA) and the PyTorch path give the same scores."""
    g = torch.Generator().manual_seed(1)
    s, d = 230, 16
    q = torch.randn(4, s, d, generator=g)
    k = torch.randn(2, s, d, generator=g)
    docs = [(0, 90), (90, 100), (100, 230)]
    got_v, got_s = interp.apply(_with_kernels, ("score_vertical_slash", q, k, docs, 24, 0.3))
    ref_v, ref_s = scoring.score_vertical_slash(q, k, docs, 24, 0.3)
    assert rel_rms(got_v, ref_v) <= TOLERANCE[torch.float32]
    assert rel_rms(got_s, ref_s) <= TOLERANCE[torch.float32]


def test_estimated_layout_equals_the_pytorch_path(interp):
    """The whole estimation with the kernels selects the planted columns and diagonals and builds the
    same layout as the PyTorch path (budgets equal to the plants, so no near-tie decides)."""
    s, bs = 512, 32
    verticals = [[7, 300], [100, 401], [33, 250], [60, 61]]
    offsets = [[40, 170], [90, 300], [64, 65], [200, 333]]
    q, k = planted_qk(4, 2, s, 64, verticals, offsets, generator=torch.Generator().manual_seed(2))
    seg = torch.zeros(1, s, dtype=torch.int32)
    seg[:, 480:] = -1  # padding tail
    meta = TokenMeta.from_segments(seg)
    cfg = SparseAttentionConfig(block_size=bs, min_seq_len=256, vertical_topk=2, slash_topk=2, sink_tokens=4,
                                local_window=8, last_q=40)
    got = interp.apply(_with_kernels, ("estimate_layout", q, k, cfg, meta))
    ref = pattern.estimate_layout(q, k, cfg, meta)
    for name in ("block_idx", "block_cnt", "col_idx", "col_cnt"):
        assert torch.equal(getattr(got, name), getattr(ref, name)), name
    mask = ref.to_mask(4, s, s)[0]
    for h in range(4):
        for col in verticals[h]:
            assert bool(mask[h, col:480, col].all()), (h, col)
        for off in offsets[h]:
            rows = torch.arange(off, 480)
            assert bool(mask[h, rows, rows - off].all()), (h, off)


def test_launcher_refuses_bad_inputs():
    q = torch.randn(4, 8, 16)
    with pytest.raises(ValueError, match="0 < R <= L"):
        vs.vertical_slash_scores(q, torch.randn(2, 4, 16), 1.0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        vs.vertical_slash_scores(q, torch.randn(3, 20, 16), 1.0)
    with pytest.raises(ValueError, match="one dtype"):
        vs.vertical_slash_scores(q.double(), torch.randn(2, 20, 16).double(), 1.0)


def test_fold_places_every_chunk_at_its_offsets():
    """The chunk fold on its own: chunk (kt, s) lands at offsets (M0 + s - 1 - kt) * BLOCK, negative ones dropped."""
    h, n_kt, n_slots, block, m0 = 2, 5, 3, 4, 2
    chunks = torch.randn(h, n_kt, n_slots, block, generator=torch.Generator().manual_seed(3))
    length = (m0 + n_slots - 1) * block - 3
    expected = torch.zeros(h, (m0 + n_slots) * block)
    for kt in range(n_kt):
        for s in range(n_slots):
            m = m0 + s - 1 - kt
            if m >= 0:
                expected[:, m * block : (m + 1) * block] += chunks[:, kt, s]
    got = vs.fold_diagonal_chunks(chunks, m0 * block, length)
    assert torch.allclose(got, expected[:, :length])
