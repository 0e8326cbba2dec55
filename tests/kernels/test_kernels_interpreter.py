"""The Triton kernels, run by Triton's interpreter on CPU, against the fp64 PyTorch reference.

The kernels execute in a worker process started with TRITON_INTERPRET=1 (see
`hf_sparse_cp.testing.interpreter`); this process only builds inputs and compares. Sizes are
small (S ~ 100-260, blocks of 16/32, D 16-128) but cover sub-tiling, partial blocks, GQA ratios
1/2/8, shared and per-head layouts, columns, packed documents with padding, sliding windows,
queries that see nothing, non-finite inputs, merging into an existing result, and the deterministic mode.
fp32 and fp16 only: the interpreter cannot multiply bf16 (bf16 runs in tests marked gpu).
"""

import functools
from dataclasses import replace

import pytest
import torch
import triton
import triton.language as tl

from hf_sparse_cp.attention.build import dense_layout, with_padding_query_blocks
from hf_sparse_cp.attention.call import AttentionCall
from hf_sparse_cp.attention.layout import SparseLayout
from hf_sparse_cp.attention.ops import attention_backward, attention_forward, block_sparse_attention
from hf_sparse_cp.attention.reference import reference_backward, reference_forward
from hf_sparse_cp.attention.tokens import PAD_SEGMENT, TokenMeta, padding_queries_see_prior_tokens
from hf_sparse_cp.kernels import block_sparse_bwd, block_sparse_fwd, configs
from hf_sparse_cp.kernels.indexing import (
    block_summary,
    full_column_range,
    key_block_csr,
    split_full_blocks,
    split_layout,
)
from hf_sparse_cp.kernels.tiles import columns_out_of_range, key_block_entry, key_block_steps
from hf_sparse_cp.simulator.workloads import random_vertical_slash_layout
from hf_sparse_cp.testing.interpreter import interpreter_blocker, interpreter_pool
from hf_sparse_cp.testing.layouts import random_layout

from oracle import TOLERANCE, kernel_backward, kernel_forward, key_range, rel_rms, visible


@pytest.fixture(scope="module")
def interp():
    with interpreter_pool() as pool:
        yield pool


# ---- run in the interpreter worker ---------------------------------------------------------------

def _kernel_fwd_bwd(q, k, v, layout, q_meta, k_meta, scale, window, dout, dlse, deterministic=False, tiles=None):
    with configs.tiles_override(**(tiles or {})):
        call = AttentionCall(q, k, v, layout, scale, q_meta, k_meta, window)
        out, lse = kernel_forward(call)
        grads = kernel_backward(call, out.to(q.dtype), lse, dout, dlse=dlse, deterministic=deterministic)
    return (out, lse, *grads)


def _deterministic_backward(partial_bytes, args, kwargs, dq_tiles):
    saved = block_sparse_bwd.DETERMINISTIC_PARTIAL_BYTES
    block_sparse_bwd.DETERMINISTIC_PARTIAL_BYTES = partial_bytes  # force several query-tile chunks
    try:
        with configs.tiles_override(dq=dq_tiles):
            return kernel_backward(*args, deterministic=True, **kwargs)
    finally:
        block_sparse_bwd.DETERMINISTIC_PARTIAL_BYTES = saved


def _deterministic_flags_through_the_public_function(q, k, v, layout):
    """The `deterministic` argument the backward launcher receives from `block_sparse_attention` with
    torch's deterministic-algorithms switch off, then on (the public path as on CUDA)."""
    from hf_sparse_cp.attention.ops import block_sparse_attention

    seen, launch = [], block_sparse_bwd.backward

    def spy(*args, **kwargs):
        seen.append(kwargs["deterministic"])
        return launch(*args, **kwargs)

    block_sparse_bwd.backward = spy
    try:
        for mode in (False, True):
            torch.use_deterministic_algorithms(mode)
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            out, _ = block_sparse_attention(*x, layout, implementation="triton")
            out.sum().backward()
    finally:
        torch.use_deterministic_algorithms(False)
        block_sparse_bwd.backward = launch
    return seen


def _public_function_fwd_bwd(q, k, v, layout):
    """As transformers calls it: q, k, v are [B, H, S, D] views of [B, S, H, D] projections; returns the
    output, whether it and the gradients reaching those views lie in [B, S, H, D] memory, lse and the
    gradients."""
    leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    views = [t.transpose(1, 2) for t in leaves]
    in_layout = []
    for t in views:
        t.register_hook(lambda g: in_layout.append(g.transpose(1, 2).is_contiguous()))
    out, lse = block_sparse_attention(*views, layout, implementation="triton")
    in_layout.append(out.transpose(1, 2).is_contiguous())
    (out.float() * torch.linspace(-1, 1, out.shape[-1])).sum().backward()
    return out.detach(), in_layout, lse.detach(), [t.grad.transpose(1, 2) for t in leaves]


def _public_function_as_transformers_calls_it(q, k, v, layout, q_meta, k_meta, scale, window, dout, dlse, tiles=None):
    """`_kernel_fwd_bwd` through `block_sparse_attention` and autograd, on [B, H, S, D] views of [B, S, H, D]
    tensors; results in fp32 ([B, H, S, D])."""
    leaves = [t.transpose(1, 2).contiguous().requires_grad_() for t in (q, k, v)]
    out, lse = block_sparse_attention(*(t.transpose(1, 2) for t in leaves), layout, scale=scale, q_meta=q_meta,
                                      k_meta=k_meta, sliding_window=window, implementation="triton")
    grads = torch.autograd.grad((out, lse), leaves, (dout, dlse))
    return (out.detach().float(), lse.detach(), *(g.transpose(1, 2).float() for g in grads))


def _opcheck_ops():
    import hf_sparse_cp.kernels.ops  # noqa: F401  (registers the ops: the interpreter's process may not have yet)

    b, hq, hk, s, d, bs = 1, 2, 1, 40, 16, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(b, h, s, d, generator=g) for h in (hq, hk, hk))
    layout = random_layout(b, hq, s, s, bs, 0.6, 0.2, generator=g)
    meta = TokenMeta.contiguous(b, s)
    tokens = (meta.index.contiguous(), meta.segment, meta.index.contiguous(), meta.segment)
    split = split_layout(layout.block_idx, layout.block_cnt, layout.col_idx, layout.col_cnt, *tokens, bs, None)
    kernel_layout = (split.block_idx, layout.block_cnt, split.full_cnt, layout.col_idx, layout.col_cnt,
                     split.col_full)
    lay_meta = (*kernel_layout, *tokens)
    bwd_meta = (*kernel_layout[:3], split.partial, *kernel_layout[3:], *tokens)
    hf = torch.ops.hf_sparse_cp
    for in_dtype in (False, True):
        torch.library.opcheck(hf.block_sparse_attn_fwd.default, (q.half(), k.half(), v.half(), *lay_meta, 0.25, bs,
                                                                 None, in_dtype))
    out, lse = hf.block_sparse_attn_fwd(q, k, v, *lay_meta, 0.25, bs, None, False)
    torch.library.opcheck(hf.block_sparse_attn_fwd_merge_.default,
                          (q, k, v, *lay_meta, out.clone(), lse.clone(), 0.25, bs, 24))
    dout, dlse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    for dl in (None, dlse):
        torch.library.opcheck(hf.block_sparse_attn_bwd.default,
                              (q, k, v, out, lse, dout, dl, *bwd_meta, 0.25, bs, None, False, False))
    half = [t.half() for t in (q, k, v, out)]
    torch.library.opcheck(hf.block_sparse_attn_bwd.default,
                          (*half, lse, dout.half(), dlse, *bwd_meta, 0.25, bs, None, False, True))


# ---- helpers in this process ---------------------------------------------------------------------

def _inputs(b, hq, hk, sq, sk, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, sq, d, generator=g).to(dtype)
    k = torch.randn(b, hk, sk, d, generator=g).to(dtype)
    v = torch.randn(b, hk, sk, d, generator=g).to(dtype)
    dout = torch.randn(b, hq, sq, d, generator=g).to(dtype)
    dlse = torch.randn(b, hq, sq, generator=g)
    return q, k, v, dout, dlse


def _random_docs(b, s, seed, pad=0, cuts=3):
    g = torch.Generator().manual_seed(seed)
    seg = torch.zeros(b, s, dtype=torch.int32)
    for row in range(b):
        for c in sorted(torch.randperm(s - 1, generator=g)[:cuts].add(1).tolist()):
            seg[row, c:] += 1
        if pad:
            seg[row, s - pad:] = -1
    return TokenMeta.from_segments(seg)


def _check_against_reference(interp, q, k, v, dout, dlse, layout, q_meta, k_meta, window=None, scale=None,
                             tiles=None, worker=_kernel_fwd_bwd):
    """Kernel forward and backward (with `tiles` overriding the launchers' tiles; run by `worker`, which
    takes `_kernel_fwd_bwd`'s arguments and returns out, lse, dq, dk, dv, then anything more it computed in
    the same call) equal the fp64 reference; returns the worker's results."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    res = interp.apply(worker, (q, k, v, layout, q_meta, k_meta, scale, window, dout, dlse), {"tiles": tiles})
    out, lse, dq, dk, dv = res[:5]
    f64 = [x.double() for x in (q, k, v)]
    ref_out, ref_lse = reference_forward(AttentionCall(*f64, layout, scale, q_meta, k_meta, window))
    tol = TOLERANCE[q.dtype]
    seen = torch.isfinite(ref_lse)
    assert out.dtype == lse.dtype == torch.float32
    assert rel_rms(out, ref_out) <= tol
    assert torch.equal(torch.isfinite(lse), seen) and bool((lse[~seen] == float("-inf")).all())
    assert rel_rms(lse, ref_lse, seen) <= tol
    assert bool((out[~seen] == 0).all())
    # the backward takes the kernel's own (rounded) output, as autograd hands it over
    ref_grads = reference_backward(AttentionCall(*f64, layout, scale, q_meta, k_meta, window),
                                   out.to(q.dtype).double(), lse.double(), dout.double(), dlse=dlse.double())
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert got.dtype == torch.float32 and got.shape == ref.shape, name
        assert bool(torch.isfinite(got).all()), name
        assert rel_rms(got, ref) <= 2 * tol, name
    return res


# ---- tests ---------------------------------------------------------------------------------------

@pytest.mark.parametrize(
    "hq,hk,s,bs,d,dtype",
    [
        (2, 2, 111, 16, 16, torch.float32),
        (4, 2, 257, 32, 32, torch.float16),
        (8, 1, 130, 16, 16, torch.float32),
        (4, 2, 200, 32, 64, torch.float32),
    ],
    ids=["mha-S111-bs16-d16-fp32", "gqa2-S257-bs32-d32-fp16", "gqa8-S130-bs16-d16-fp32", "gqa2-S200-bs32-d64-fp32"],
)
def test_random_layouts_match_reference(interp, hq, hk, s, bs, d, dtype):
    q, k, v, dout, dlse = _inputs(1, hq, hk, s, s, d, dtype, seed=s + hq)
    layout = random_layout(1, hq, s, s, bs, 0.35, 0.08, generator=torch.Generator().manual_seed(s))
    meta = TokenMeta.contiguous(1, s)
    _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta)


def test_vertical_slash_layout_matches_reference(interp):
    s, bs = 192, 32
    q, k, v, dout, dlse = _inputs(1, 4, 2, s, s, 32, torch.float32, seed=11)
    layout = random_vertical_slash_layout(1, 4, s, bs, num_diagonals=1, num_verticals=12,
                                          generator=torch.Generator().manual_seed(12))
    assert int(layout.col_cnt.sum()) > 0
    meta = TokenMeta.contiguous(1, s)
    _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta)


def test_other_tiles_compute_the_same_function(interp):
    """Tiles chosen by tuning (configs.tiles_override) change only the work split: query tiles of half
    a block in the forward and dq, whole-block query steps and half-block key tiles in dk/dv, wider
    column steps, the columns' dk/dv in their own pass; packed documents and padding so that masked
    and unmasked tiles both occur."""
    s, bs = 160, 32
    q, k, v, dout, dlse = _inputs(1, 4, 2, s, s, 32, torch.float32, seed=21)
    meta = _random_docs(1, s, seed=23, pad=5)
    layout = random_vertical_slash_layout(1, 4, s, bs, num_diagonals=2, num_verticals=10, meta=meta,
                                          generator=torch.Generator().manual_seed(22))
    assert int(layout.col_cnt.sum()) > 0
    tiles = {"forward": configs.Tiles(16, 32, 32, 1, 1), "dq": configs.Tiles(16, 32, 32, 1, 1, separate_columns=True),
             "dkdv": configs.Tiles(32, 16, 16, 1, 1)}
    _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta, tiles=tiles)


def test_the_fp32_tiles_compute_the_same_function(interp):
    """The tiles CUDA launches take for fp32 inputs (`configs.FP32_TILES`: 64-row query tiles in 32-key steps, dk/dv
    in 64-key programs of 32-row steps) inside 64-token layout blocks, with columns, documents and padding."""
    s, bs = 200, 64
    q, k, v, dout, dlse = _inputs(1, 4, 2, s, s, 32, torch.float32, seed=21)
    meta = _random_docs(1, s, seed=23, pad=5)
    layout = random_vertical_slash_layout(1, 4, s, bs, num_diagonals=1, num_verticals=10, meta=meta,
                                          generator=torch.Generator().manual_seed(22))
    assert int(layout.col_cnt.sum()) > 0
    _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta, tiles=configs.FP32_TILES)


def test_fp16_head_dim_128_gqa8_packed_documents(interp):
    """The model-sized head (d 128) in fp16 with 8 query heads per key/value head, per-head vertical-slash
    layouts with columns, packed documents with padding, a length that is not a block multiple."""
    s, bs = 133, 32
    q, k, v, dout, dlse = _inputs(1, 8, 1, s, s, 128, torch.float16, seed=31)
    meta = _random_docs(1, s, seed=32, pad=6)
    layout = random_vertical_slash_layout(1, 8, s, bs, num_diagonals=1, num_verticals=10, meta=meta,
                                          generator=torch.Generator().manual_seed(33))
    assert int(layout.col_cnt.sum()) > 0
    _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta)


@pytest.mark.parametrize("d,tiles", [(256, None), (256, "16-bit"), (256, "fp32"), (160, "16-bit")])
def test_heads_above_128_lanes_with_columns_documents_and_padding(interp, d, tiles):
    """Gemma's head (d 256; `limits.MAX_HEAD_DIM`) and a 160-lane one (masked lanes of a 256-wide tile) in fp16, 2
    query heads on 1 key/value head, a vertical-slash layout with columns in 64-token blocks, packed documents with
    padding: with the interpreter's tiles and with the tiles CUDA launches above 128 lanes (`configs.WIDE_HEAD_TILES`,
    `FP32_WIDE_HEAD_TILES`: the same function)."""
    s, bs = 256, 64
    q, k, v, dout, dlse = _inputs(1, 2, 1, s, s, d, torch.float16, seed=41)
    meta = _random_docs(1, s, seed=42, pad=9)
    layout = random_vertical_slash_layout(1, 2, s, bs, num_diagonals=1, num_verticals=12, meta=meta,
                                          generator=torch.Generator().manual_seed(43))
    assert int(layout.col_cnt.sum()) > 0
    wide = {None: None, "16-bit": configs.WIDE_HEAD_TILES, "fp32": configs.FP32_WIDE_HEAD_TILES}[tiles]
    _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta, tiles=wide)


def test_packed_documents_padding_and_shared_layout(interp):
    """Batch of 2 rows with 4 documents each and 7 padding tokens; one layout for all heads."""
    q, k, v, dout, dlse = _inputs(2, 4, 2, 150, 150, 32, torch.float32, seed=3)
    meta = _random_docs(2, 150, seed=4, pad=7)
    layout = random_layout(2, 1, 150, 150, 32, 0.5, 0.1, generator=torch.Generator().manual_seed(5))
    out, lse, *_ = _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta)
    assert bool((lse[:, :, -7:] == float("-inf")).all())  # padding queries see nothing


def test_sliding_window_and_head_dim_48(interp):
    q, k, v, dout, dlse = _inputs(1, 2, 2, 200, 200, 48, torch.float32, seed=6)
    meta = TokenMeta.contiguous(1, 200)
    layout = dense_layout(meta, 32, sliding_window=40)
    assert layout.col_idx.shape[-1] == 0  # also covers a layout without columns
    _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta, window=40)


def test_queries_that_see_nothing_get_zero_and_no_nan(interp):
    """Query blocks with an empty layout row, and documents whose listed keys all lie in other documents."""
    s, bs = 96, 16
    q, k, v, dout, dlse = _inputs(1, 2, 1, s, s, 16, torch.float32, seed=7)
    seg = torch.zeros(1, s, dtype=torch.int32)
    seg[:, 40:] = 1
    meta = TokenMeta.from_segments(seg)
    nqb = s // bs
    blk = torch.zeros(1, 2, nqb, 1, dtype=torch.int32)  # every query block lists key block 0 only
    cnt = torch.ones(1, 2, nqb, dtype=torch.int32)
    cnt[:, 1, 2] = 0  # head 1, query block 2 lists nothing
    empty = torch.empty(1, 2, nqb, 0, dtype=torch.int32)
    layout = SparseLayout(blk, cnt, empty, torch.zeros_like(cnt), bs)
    out, lse, dq, dk, dv = _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta)
    blind = lse == float("-inf")
    assert int(blind.sum()) >= s  # the whole second document of both heads
    assert bool((dq[blind] == 0).all())


def test_padding_queries_that_see_the_tokens_before_them(interp):
    """The dense call of a row padded between its tokens: its padding queries read the real keys before them (as
    SDPA's), not their own padding key; padding before a row's first token and past a narrow window sees nothing."""
    s, bs = 70, 16
    q, k, v, dout, dlse = _inputs(2, 2, 1, s, s, 32, torch.float32, seed=11)
    mask = torch.ones(2, s, dtype=torch.bool)
    mask[0, 5:40] = False
    mask[1, :9] = False
    k_meta = TokenMeta.from_segments(torch.zeros(2, s, dtype=torch.int32).masked_fill(~mask, PAD_SEGMENT))
    q_meta = padding_queries_see_prior_tokens(k_meta)
    assert bool((q_meta.segment[0, 5:40] == 0).all()) and bool((q_meta.segment[1, :9] == PAD_SEGMENT).all())
    blocks = -(-s // bs)
    layout = SparseLayout.from_blocks(torch.arange(blocks, dtype=torch.int32).expand(2, 1, blocks, blocks),
                                      torch.full((2, 1, blocks), blocks, dtype=torch.int32), bs)
    for window in (None, 24):
        _check_against_reference(interp, q, k, v, dout, dlse, layout, q_meta, k_meta, window=window)


def test_padding_queries_after_a_rows_tokens_over_their_last_blocks_keys(interp):
    """A head that reads the padding after a row's tokens (`sequence.sequence_attention`'s padding_rows): a sparse
    per-head layout with columns, its query blocks of padding only given the key blocks and columns of the row's last
    block of tokens (`build.with_padding_query_blocks`), the padding queries of row 0 seeing the tokens before them and
    row 1's none; with and without a window. The kernels equal the fp64 reference, and row 0's padding queries see keys
    (row 1's do not)."""
    s, bs, hq = 100, 16, 4
    q, k, v, dout, dlse = _inputs(2, hq, 2, s, s, 16, torch.float32, seed=13)
    seg = torch.zeros(2, s, dtype=torch.int32)
    seg[:, 30:] = 1  # (two packed documents, padding after the second from 55)
    seg[:, 55:] = PAD_SEGMENT
    k_meta = TokenMeta.from_segments(seg)
    q_meta = padding_queries_see_prior_tokens(k_meta, torch.tensor([True, False]))
    sparse = random_layout(2, hq, s, s, bs, 0.5, 0.1, generator=torch.Generator().manual_seed(14))
    layout = with_padding_query_blocks(sparse, k_meta, q_meta)
    assert torch.equal(layout.block_cnt[0, :, 4:], sparse.block_cnt[0, :, 3:4].expand(hq, 3))
    for window in (None, 40):
        out, lse, *_ = _check_against_reference(interp, q, k, v, dout, dlse, layout, q_meta, k_meta, window=window)
        if window is None:
            assert bool(torch.isfinite(lse[0, :, 55:]).any()) and not bool(torch.isfinite(lse[1, :, 55:]).any())


def test_non_finite_inputs_give_nan_rows_not_zeros(interp):
    """NaN or Inf in q or k makes exactly the rows that read them NaN, in the forward and the backward; an
    Inf key component gives -inf scores to the queries of the opposite sign, which must not pass for
    masked keys (a row whose visible scores are all -inf would come out as a row that saw nothing).
    Queries that see no key (padding, an empty layout row) stay at out = 0, lse = -inf."""
    s, bs, hq, hk = 80, 16, 4, 2
    q, k, v, dout, dlse = _inputs(1, hq, hk, s, s, 16, torch.float32, seed=41)
    seg = torch.zeros(1, s, dtype=torch.int32)
    seg[:, 30:] = 1
    seg[:, 74:] = -1
    meta = TokenMeta.from_segments(seg)
    layout = random_layout(1, hq, s, s, bs, 0.6, 0.1, generator=torch.Generator().manual_seed(42))
    layout.block_cnt[:, 1, 3] = 0  # head 1, queries 48-63 list nothing
    layout.col_cnt[:, 1, 3] = 0
    sees = (layout.to_mask(hq, s, s) & visible(meta, meta))[0]  # [Hq, S, S]
    q[0, 0, 40, 3] = float("nan")
    q[0, 1, 50, :] = float("nan")  # in the empty layout row
    q[0, 2, 77, 0] = float("inf")  # padding
    k[0, 0, 0, 5] = float("inf")  # the first key of document 0: its only key for query 0
    k[0, 1, 33, :] = float("nan")
    affected = torch.cat([sees[:2, :, 0], sees[2:, :, 33]])  # key/value head 0 serves query heads 0 and 1
    affected[0, 40] = True
    blind = ~sees.any(-1)
    assert bool(affected[0, 0]) and bool(blind[1, 48:64].all()) and bool(blind[:, 74:].all())

    out, lse, dq, dk, dv = interp.apply(_kernel_fwd_bwd, (q, k, v, layout, meta, meta, 0.25, None, dout, dlse))
    ref_out, ref_lse = reference_forward(AttentionCall(q.double(), k.double(), v.double(), layout, 0.25, meta, meta))
    for got in (out, ref_out):
        assert torch.equal(got[0].isnan().any(-1), affected) and bool(got[0][affected].isnan().all())
    assert torch.equal(lse[0].isnan(), affected) and torch.equal(ref_lse[0].isnan(), affected)
    assert bool((out[0][blind] == 0).all()) and bool((lse[0][blind] == float("-inf")).all())
    rest = ~affected & ~blind
    assert rel_rms(out[0][rest], ref_out[0][rest]) <= TOLERANCE[torch.float32]
    assert rel_rms(lse[0][rest], ref_lse[0][rest]) <= TOLERANCE[torch.float32]
    assert bool(dq[0][affected].isnan().all())  # NaN lse gives NaN probabilities, not zero gradients
    assert not bool(dk[0, 0, 0].isfinite().any()) and not bool(dv[0, 0, 0].isfinite().any())
    assert not bool(dk[0, 1, 33].isfinite().any()) and not bool(dv[0, 1, 33].isfinite().any())


@pytest.mark.parametrize("hq,hk,d,s,bs,dtype,window,scale", [
    (7, 1, 80, 40, 32, torch.float32, 5, 1.0), (4, 1, 112, 1, 64, torch.float16, None, None),
    (6, 2, 96, 47, 16, torch.float32, 20, 0.05)], ids=["gqa7-d80-window5", "mqa-d112-fp16-S1", "gqa3-d96-window20"])
def test_model_shapes_through_the_public_function(interp, hq, hk, d, s, bs, dtype, window, scale):
    """Shapes of transformers models beyond the ones above: a group of 7 query heads and MQA, head_dims 80, 96 and
    112 (masked lanes of a 128-wide tile), a single token, lengths off the block, a window shorter than a block,
    scales other than 1/sqrt(d), two rows padded differently (left and right): the public function and its
    autograd, on [B, S, H, D] memory as transformers passes it, equal the fp64 reference."""
    q, k, v, dout, dlse = _inputs(2, hq, hk, s, s, d, dtype, seed=hq + d)
    seg = torch.zeros(2, s, dtype=torch.int32)
    seg[0, s - s // 8:], seg[1, : s // 5] = PAD_SEGMENT, PAD_SEGMENT
    meta = TokenMeta.from_segments(seg)
    layout = random_layout(2, hq, s, s, bs, 0.5, 0.1, generator=torch.Generator().manual_seed(d))
    _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta, window=window, scale=scale,
                             worker=_public_function_as_transformers_calls_it)


@pytest.mark.parametrize(
    "hq,hk,s,d,dtype",
    [(4, 2, 128, 16, torch.float32), (8, 1, 125, 64, torch.float16)],
    ids=["gqa2-S128-d16-fp32", "gqa8-S125-d64-fp16"],
)
def test_merge_into_existing_result(interp, hq, hk, s, d, dtype):
    """Two key halves, the second merged into the first's (out, lse) in place, equal the whole; the
    backward per half with the final (out, lse) sums to the whole: what a ring step does. Packed
    documents and padding, so some rows see nothing in one half or in both."""
    bs = 16
    q, k, v, dout, dlse = _inputs(1, hq, hk, s, s, d, dtype, seed=8)
    meta = _random_docs(1, s, seed=9, pad=5, cuts=1)
    full = random_layout(1, hq, s, s, bs, 0.6, 0.1, generator=torch.Generator().manual_seed(10))
    halves = [(lo, hi, key_range(full, lo, hi), TokenMeta(meta.index[:, lo:hi], meta.segment[:, lo:hi]))
              for lo, hi in ((0, 64), (64, s))]
    assert all(int(lay.col_cnt.sum()) > 0 for _, _, lay, _ in halves)
    scale = 0.3
    call = lambda lo, hi, lay, km: AttentionCall(q, k[:, :, lo:hi], v[:, :, lo:hi], lay, scale, meta, km)
    (lo0, hi0, lay0, km0), (lo1, hi1, lay1, km1) = halves
    out, lse = interp.apply(kernel_forward, (call(lo0, hi0, lay0, km0),), {})
    out, lse = interp.apply(kernel_forward, (call(lo1, hi1, lay1, km1),), dict(out=out, lse=lse))
    ref_out, ref_lse = reference_forward(AttentionCall(q.double(), k.double(), v.double(), full, scale, meta, meta))
    seen = torch.isfinite(ref_lse)
    assert not bool(seen.all())  # padding rows stay empty through the merge
    assert torch.equal(torch.isfinite(lse), seen)
    assert rel_rms(out, ref_out) <= TOLERANCE[dtype]
    assert rel_rms(lse, ref_lse, seen) <= TOLERANCE[dtype]
    assert bool((out[~seen] == 0).all())

    ref_dq, ref_dk, ref_dv = reference_backward(
        AttentionCall(q.double(), k.double(), v.double(), full, scale, meta, meta), out.double(), lse.double(),
        dout.double(), dlse=dlse.double())
    dq_sum = torch.zeros_like(ref_dq)
    for lo, hi, lay, km in halves:
        dq, dk, dv = interp.apply(kernel_backward, (call(lo, hi, lay, km), out, lse, dout), dict(dlse=dlse))
        dq_sum += dq.double()
        assert rel_rms(dk, ref_dk[:, :, lo:hi]) <= 2 * TOLERANCE[dtype]
        assert rel_rms(dv, ref_dv[:, :, lo:hi]) <= 2 * TOLERANCE[dtype]
    assert rel_rms(dq_sum, ref_dq) <= 2 * TOLERANCE[dtype]


@pytest.mark.parametrize("separate_columns,tile_major", [(False, False), (True, False), (False, True)],
                         ids=["columns-in-dq-loop", "separate-column-pass", "tile-major-grid"])
def test_deterministic_mode_matches_reference(interp, separate_columns, tile_major):
    """Column gradients through per-tile partials summed per key row in a fixed order, in one chunk of
    query tiles and in three (bitwise reproducibility needs a GPU's atomics to mean anything: gpu tests);
    a tile-major grid (`Tiles.tile_major`) writes each tile's partials where the sums read them."""
    s, bs = 160, 32
    hq = 2
    q, k, v, dout, dlse = _inputs(1, hq, 1, s, s, 16, torch.float32, seed=13)
    meta = TokenMeta.contiguous(1, s)
    layout = random_layout(1, hq, s, s, bs, 0.3, 0.2, generator=torch.Generator().manual_seed(14))
    assert int(layout.col_cnt.sum()) > 0
    scale = 0.25
    out, lse = reference_forward(AttentionCall(q, k, v, layout, scale, meta, meta))
    args = (AttentionCall(q, k, v, layout, scale, meta, meta), out, lse, dout)
    kwargs = dict(dlse=dlse)
    q64, k64, v64, out64, lse64, dout64 = (x.double() for x in (q, k, v, out, lse, dout))
    ref = reference_backward(AttentionCall(q64, k64, v64, layout, scale, meta, meta), out64, lse64, dout64,
                             dlse=dlse.double())
    tile_bytes = hq * layout.col_idx.shape[-1] * 16 * 4 * 2  # one query tile's partials (5 tiles in all)
    for budget in (2 * tile_bytes, 1 << 30):
        dq_tiles = configs.Tiles(32, 16, 16, 1, 1, separate_columns=separate_columns, tile_major=tile_major)
        grads = interp.apply(_deterministic_backward, (budget, args, kwargs, dq_tiles))
        for name, a, r in zip(("dq", "dk", "dv"), grads, ref):
            assert rel_rms(a, r) <= 2 * TOLERANCE[torch.float32], (name, budget)


def test_deterministic_switch_reaches_the_kernel_through_the_public_function(interp):
    q, k, v, _, _ = _inputs(1, 2, 1, 64, 64, 16, torch.float32, seed=17)
    layout = random_layout(1, 2, 64, 64, 16, 0.5, 0.1, generator=torch.Generator().manual_seed(18))
    assert interp.apply(_deterministic_flags_through_the_public_function, (q, k, v, layout)) == [False, True]


def test_custom_ops_pass_opcheck(interp):
    """Schemas, fake implementations, mutation declarations and autograd/AOT dispatch of the three ops."""
    interp.apply(_opcheck_ops)


def test_compiled_kernels_refuse_cpu_tensors():
    """In a normal process the kernels are compiled for CUDA: CPU tensors get a clear error, not a crash."""
    q = torch.randn(1, 1, 32, 16)
    meta = TokenMeta.contiguous(1, 32)
    with pytest.raises(ValueError, match="CUDA tensors"):
        kernel_forward(AttentionCall(q, q, q, dense_layout(meta, 16), 0.25, meta, meta))


def test_interpreter_refuses_the_triton_numpy_pair_it_cannot_run():
    """Triton 3.6's interpreter fails on our count-bounded loops under numpy 2.4+ (triton#9171)."""
    assert "triton>=3.7" in interpreter_blocker("3.6.0", "2.5.2")
    assert interpreter_blocker("3.6.0", "2.3.5") is None
    assert interpreter_blocker("3.9.0", "2.5.2") is None
    assert interpreter_blocker("3.7.0+git1a2b", "2.4.0rc1") is None


def test_primitives_refuse_bad_inputs():
    q = torch.randn(1, 2, 32, 16)
    meta = TokenMeta.contiguous(1, 32)
    lay = dense_layout(meta, 16)
    with pytest.raises(ValueError, match="one floating dtype"):
        kernel_forward(AttentionCall(q, q.half(), q.half(), lay, 1.0, meta, meta))
    with pytest.raises(ValueError, match="multiple of key/value heads"):
        one = q[:, :1].expand(1, 3, 32, 16)
        kernel_forward(AttentionCall(q, one, one, lay, 1.0, meta, meta))
    with pytest.raises(ValueError, match="query blocks"):
        kernel_forward(AttentionCall(q, q, q, dense_layout(TokenMeta.contiguous(1, 64), 16), 1.0, meta, meta))
    with pytest.raises(ValueError, match="cannot take dtype torch.float64"):
        kernel_forward(AttentionCall(q.double(), q.double(), q.double(), lay, 1.0, meta, meta))
    with pytest.raises(ValueError, match="merge buffer"):
        kernel_forward(AttentionCall(q, q, q, lay, 1.0, meta, meta), out=q.half(), lse=torch.zeros(1, 2, 32))


def test_backward_refuses_misshapen_gradients_on_every_engine():
    """out, dout, lse and dlse of another shape than the call's get one clear ValueError from every engine (the
    reference and the masked form failed inside their arithmetic)."""
    q, k, v, dout, dlse = _inputs(1, 4, 2, 40, 40, 16, torch.float32, seed=20)
    meta = TokenMeta.contiguous(1, 40)
    call = AttentionCall(q, k, v, dense_layout(meta, 16), 0.25, meta, meta)
    out, lse = reference_forward(call)
    for engine in ("triton", "reference", "masked"):
        for bad in (dict(dout=dout[..., :-1]), dict(dlse=dlse[..., :-1]), dict(out=out[:, :2]), dict(lse=lse[..., 1:])):
            args = dict(out=out, lse=lse, dout=dout, dlse=dlse) | bad
            with pytest.raises(ValueError, match="must be shaped like q"):
                attention_backward(call, args.pop("out"), args.pop("lse"), args.pop("dout"), implementation=engine,
                                   **args)


def test_a_gradient_in_another_dtype_than_the_inputs(interp):
    """dout in fp16 for fp32 inputs (and fp32 for fp16 ones), as the primitive takes it: the kernels compute the
    gradients the reference computes from it (they failed to compile: a matrix product of two dtypes)."""
    meta = TokenMeta.contiguous(1, 40)
    for dtype, dout_dtype in ((torch.float32, torch.float16), (torch.float16, torch.float32)):
        q, k, v, dout, dlse = _inputs(1, 4, 2, 40, 40, 16, dtype, seed=21)
        dout = dout.to(dout_dtype)
        layout = random_layout(1, 4, 40, 40, 16, 0.6, 0.2, generator=torch.Generator().manual_seed(22))
        call = AttentionCall(q, k, v, layout, 0.25, meta, meta)
        out, lse = reference_forward(call)
        grads = interp.apply(kernel_backward, (call, out, lse, dout), dict(dlse=dlse))
        f64 = AttentionCall(q.double(), k.double(), v.double(), layout, 0.25, meta, meta)
        ref = reference_backward(f64, out.double(), lse.double(), dout.to(dtype).double(), dlse=dlse.double())
        for got, want in zip(grads, ref):
            assert rel_rms(got, want) <= 2 * TOLERANCE[dtype]


def test_int32_token_indices_give_what_int64_ones_give():
    """A TokenMeta with an int32 index (the kernels clamp theirs to int32 anyway): the reference, which pads the
    tokens to whole blocks with an index past every real one, failed to build that padding in int32."""
    q, k, v, _, _ = _inputs(1, 2, 1, 40, 40, 16, torch.float32, seed=23)
    meta = _random_docs(1, 40, seed=24, pad=3)
    narrow = TokenMeta(meta.index.int(), meta.segment)
    layout = random_layout(1, 2, 40, 40, 16, 0.6, 0.2, generator=torch.Generator().manual_seed(25))
    for engine in ("reference", "masked"):
        want = attention_forward(AttentionCall(q, k, v, layout, 0.25, meta, meta), implementation=engine)
        got = attention_forward(AttentionCall(q, k, v, layout, 0.25, narrow, narrow), implementation=engine)
        assert all(torch.equal(a, b) for a, b in zip(got, want)), engine


def test_keys_not_a_block_multiple_and_fewer_than_the_queries(interp):
    """A ring step's shapes: 77 queries after 100 keys (neither a multiple of the block size), a layout
    over the keys without the causal structure, two documents crossing the query/key boundary."""
    sq, sk, bs = 77, 100, 32
    q, k, v, dout, dlse = _inputs(1, 4, 2, sq, sk, 16, torch.float32, seed=15)
    seg = torch.zeros(1, sq + sk, dtype=torch.int32)
    seg[:, 60:] = 1
    index = torch.arange(sq + sk).unsqueeze(0)
    k_meta = TokenMeta(index[:, :sk], seg[:, :sk])
    q_meta = TokenMeta(index[:, sk:], seg[:, sk:])
    layout = random_layout(1, 4, sq, sk, bs, 0.6, 0.1, causal=False, generator=torch.Generator().manual_seed(16))
    assert int(layout.col_cnt.sum()) > 0 and int((layout.block_idx == sk // bs).sum()) > 0  # the partial key block
    _check_against_reference(interp, q, k, v, dout, dlse, layout, q_meta, k_meta)


def _empty_layout_run(q, k, v, dout, layout, meta, out, lse):
    fresh = kernel_forward(AttentionCall(q, k, v, layout, 0.5, meta, meta))
    grads = kernel_backward(AttentionCall(q, k, v, layout, 0.5, meta, meta), fresh[0], fresh[1], dout)
    merged = kernel_forward(AttentionCall(q, k, v, layout, 0.5, meta, meta), out=out, lse=lse)
    return fresh, grads, merged


def test_empty_layout(interp):
    """No block and no column anywhere (zero-width index tensors): nothing is seen, gradients are zero, and
    merging the empty part leaves an existing result exactly as it was."""
    s, bs = 70, 16
    q, k, v, dout, _ = _inputs(1, 4, 2, s, s, 16, torch.float32, seed=17)
    meta = TokenMeta.contiguous(1, s)
    nqb = -(-s // bs)
    empty = torch.empty(1, 4, nqb, 0, dtype=torch.int32)
    layout = SparseLayout(empty, torch.zeros(1, 4, nqb, dtype=torch.int32), empty, torch.zeros(1, 4, nqb,
                          dtype=torch.int32), bs)
    out, lse = reference_forward(AttentionCall(q, k, v, dense_layout(meta, bs), 0.5, meta, meta))
    (f_out, f_lse), grads, (m_out, m_lse) = interp.apply(_empty_layout_run,
                                                         (q, k, v, dout, layout, meta, out.clone(), lse.clone()))
    assert bool((f_out == 0).all()) and bool((f_lse == float("-inf")).all())
    assert all(bool((g == 0).all()) for g in grads)
    assert torch.equal(m_out, out) and torch.equal(m_lse, lse)


# ---- adversarial layouts, invalid layouts, 1M-token index arithmetic -----------------------------

def _layout_from_lists(blocks, cols, block_size):
    """A per-head layout [1, H, NQB, ...] from per (head, query block) lists of key blocks and columns,
    kept as given (order, duplicates)."""
    width = lambda rows: max((len(x) for row in rows for x in row), default=0)
    def pack(rows):
        idx = torch.full((1, len(rows), len(rows[0]), width(rows)), -1, dtype=torch.int32)
        cnt = torch.zeros(1, len(rows), len(rows[0]), dtype=torch.int32)
        for h, row in enumerate(rows):
            for qb, x in enumerate(row):
                idx[0, h, qb, :len(x)] = torch.tensor(x, dtype=torch.int32)
                cnt[0, h, qb] = len(x)
        return idx, cnt
    return SparseLayout(*pack(blocks), *pack(cols), block_size)


@pytest.mark.parametrize("s", [1, 2, 15, 17, 33])
def test_adversarial_layouts_match_reference(interp, s):
    """Lengths of 1, 2, 15, 17 and block + 1 tokens (block 16) with a duplicated key block, a column
    inside a listed block and (from two query blocks on) an empty row: the kernels compute what the
    reference computes on the layout as listed (a duplicate counts twice in both)."""
    bs, nqb = 16, -(-s // 16)
    q, k, v, dout, dlse = _inputs(1, 2, 1, s, s, 16, torch.float32, seed=50 + s)
    blocks = [[[qb] for qb in range(nqb)] for _ in range(2)]
    cols = [[[] for _ in range(nqb)] for _ in range(2)]
    blocks[0][0] = [0, 0]  # duplicate
    cols[1][nqb - 1] = [min(s - 1, (nqb - 1) * bs + 1)]  # inside the listed diagonal block
    if nqb > 1:
        blocks[0][nqb - 1] = [0] + blocks[0][nqb - 1]
        cols[0][nqb - 1] = [1]
        blocks[1][1], cols[1][1] = [], []  # empty row
    layout = _layout_from_lists(blocks, cols, bs)
    meta = TokenMeta.contiguous(1, s)
    _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta)


def test_out_of_range_layout_entries_give_nan_rows_and_change_nothing_else(interp):
    """Key blocks past the keys or negative, columns past the keys or negative, a block count above
    the slots and a negative column count (no host check runs on the kernels' path): the query rows
    of those layout rows come out NaN (forward and dq), every other row, and dk/dv, are what the
    reference computes on the layout without the invalid entries; nothing outside the tensors is
    read or written (dk/dv rows are exact)."""
    s, bs, nkb = 64, 16, 4
    q, k, v, dout, dlse = _inputs(1, 2, 1, s, s, 16, torch.float32, seed=61)
    base = random_layout(1, 2, s, s, bs, 0.5, 0.15, generator=torch.Generator().manual_seed(62))
    pad = lambda t: torch.nn.functional.pad(t, (0, 1), value=-1)
    blk, bcnt, col, ccnt = pad(base.block_idx), base.block_cnt.clone(), pad(base.col_idx), base.col_cnt.clone()
    for h, qb, value in ((0, 1, nkb), (0, 2, -3)):
        blk[0, h, qb, bcnt[0, h, qb]] = value
        bcnt[0, h, qb] += 1
    for h, qb, value in ((1, 2, s + 3), (1, 3, -1)):
        col[0, h, qb, ccnt[0, h, qb]] = value
        ccnt[0, h, qb] += 1
    bcnt[0, 1, 0] = blk.shape[-1] + 1
    ccnt[0, 0, 3] = -2
    bad = [(0, 1), (0, 2), (1, 2), (1, 3), (1, 0), (0, 3)]
    invalid = SparseLayout(blk, bcnt, col, ccnt, bs)
    clean_ccnt = base.col_cnt.clone()
    clean_ccnt[0, 0, 3] = 0
    clean = SparseLayout(base.block_idx, base.block_cnt, base.col_idx, clean_ccnt, bs)
    meta = TokenMeta.contiguous(1, s)
    scale = 0.25
    ref_out, ref_lse = reference_forward(AttentionCall(q.double(), k.double(), v.double(), clean, scale, meta, meta))
    out, lse = interp.apply(kernel_forward, (AttentionCall(q, k, v, invalid, scale, meta, meta),), {})
    rows = torch.zeros(2, s, dtype=torch.bool)
    for h, qb in bad:
        rows[h, qb * bs:(qb + 1) * bs] = True
    assert bool(out[0][rows].isnan().all()) and bool(lse[0][rows].isnan().all())
    assert not bool(out[0][~rows].isnan().any())
    assert rel_rms(out[0][~rows], ref_out[0][~rows]) <= TOLERANCE[torch.float32]
    f_out, f_lse = ref_out.float(), ref_lse.float()
    dq, dk, dv = interp.apply(kernel_backward, (AttentionCall(q, k, v, invalid, scale, meta, meta), f_out, f_lse, dout),
                              dict(dlse=dlse))
    ref_dq, ref_dk, ref_dv = reference_backward(
        AttentionCall(q.double(), k.double(), v.double(), clean, scale, meta, meta), f_out.double(), f_lse.double(),
        dout.double(), dlse=dlse.double())
    assert bool(dq[0][rows].isnan().all()) and not bool(dq[0][~rows].isnan().any())
    assert rel_rms(dq[0][~rows], ref_dq[0][~rows]) <= 2 * TOLERANCE[torch.float32]
    for got, ref in ((dk, ref_dk), (dv, ref_dv)):
        assert rel_rms(got, ref) <= 2 * TOLERANCE[torch.float32]


@triton.jit
def _columns_out_of_range_probe(ColIdx, ColCnt, Out, max_cols, k_len, CHUNK: tl.constexpr):
    """The column range check of layout row `program_id` as the forward and dq kernels run it, written out."""
    lay = tl.program_id(0)
    tl.store(Out + lay, columns_out_of_range(ColIdx, lay, max_cols, tl.load(ColCnt + lay), k_len, CHUNK).to(tl.int32))


def _columns_out_of_range_flags(col_idx, col_cnt, k_len, chunk):
    out = torch.full(col_cnt.shape, -1, dtype=torch.int32)
    _columns_out_of_range_probe[(col_cnt.numel(),)](col_idx, col_cnt, out, col_idx.shape[-1], k_len, chunk)
    return out.tolist()


def test_the_column_range_check_flags_the_same_rows_in_wide_and_narrow_loads(interp):
    """Compiled launches check a row's columns in `configs.COLUMN_CHECK_CHUNK`-slot loads (one round trip for a
    row of up to that many; the column step's 64 slots took one per 64), the interpreter's in the column step's:
    both flag exactly the rows listing a token outside [0, k_len) among their counted slots, wherever it sits
    (first slot, past the first narrow chunk, last counted slot), and never the slots past the count."""
    k_len, max_cols = 4096, 1100
    col_idx = torch.randint(0, k_len, (6, max_cols), generator=torch.Generator().manual_seed(7), dtype=torch.int32)
    col_cnt = torch.tensor([1100, 1100, 1100, 700, 0, 1025], dtype=torch.int32)
    col_idx[0, 0] = -1  # first slot
    col_idx[1, 1099] = k_len  # the last counted slot, past the first wide chunk
    col_idx[2, 70] = k_len + 9  # past the first narrow chunk
    col_idx[3, 700:] = -5  # slots past the count: never read
    col_idx[4, :] = k_len  # nothing counted
    expected = [1, 1, 1, 0, 0, 0]
    for chunk in (16, 64, configs.COLUMN_CHECK_CHUNK):
        assert interp.apply(_columns_out_of_range_flags, (col_idx, col_cnt, k_len, chunk)) == expected, chunk


@triton.jit
def _key_block_steps_probe(RowPtr, Entries, OutEntry, OutSub, per_entry):
    """The dk/dv kernel's walk over CSR segment 0, its entries and sub-steps written out. `Entries`
    holds the segment's own entries: the walk reads them at `lo` past `Entries - lo`."""
    lo, n_steps = key_block_steps(RowPtr, 0, per_entry)
    for i in range(n_steps):
        entry, r = key_block_entry(Entries - lo, lo, i, per_entry)
        tl.store(OutEntry + i, entry)
        tl.store(OutSub + i, r)


def _walk_segment(row_ptr, entries, per_entry):
    n = int(row_ptr[1] - row_ptr[0]) * per_entry
    out_entry = torch.full((n,), -1, dtype=torch.int32)
    out_sub = torch.full((n,), -1, dtype=torch.int32)
    _key_block_steps_probe[(1,)](row_ptr, entries, out_entry, out_sub, per_entry)
    return out_entry, out_sub


def _dense_shared_entries_before_last_key_block(batch, num_blocks):
    """Entries of a dense causal shared layout's key-block CSR before the last key block of the last
    batch row: every row lists num_blocks * (num_blocks + 1) / 2 blocks, the last key block once."""
    return batch * num_blocks * (num_blocks + 1) // 2 - 1


def test_full_and_partial_blocks_and_the_key_block_csr_of_a_dense_shared_layout():
    """The launchers' split of each row's blocks into full ones (no mask) and partial ones, and the CSR
    the dk/dv kernel walks: int64 row pointers, each key block's full entries before its partial ones,
    the count the 1M-token test below uses, and key blocks out of range left out."""
    meta = TokenMeta.contiguous(2, 8 * 16)
    lay = dense_layout(meta, 16)
    summary = block_summary(meta.index, meta.segment, 16)
    blk, full_cnt, partial = split_full_blocks(lay.block_idx, lay.block_cnt, summary, summary, None)
    assert torch.equal(full_cnt, lay.block_cnt - 1)  # all but the diagonal block
    assert torch.equal(blk, lay.block_idx) and int(partial.sum()) == 16
    row_ptr, entries = key_block_csr(blk, lay.block_cnt, partial, 8, 2, 8)
    assert row_ptr.dtype == torch.int64 and entries.dtype == torch.int32 and row_ptr.numel() == 2 * 16 + 1
    assert entries[row_ptr[0]:row_ptr[1]].tolist() == list(range(1, 8))  # key block 0: full below the diagonal
    assert entries[row_ptr[1]:row_ptr[2]].tolist() == [0]
    last = 2 * 15  # the last key block of the last batch row: listed by the last query block only, partially
    assert int(row_ptr[last]) == int(row_ptr[last + 1]) == _dense_shared_entries_before_last_key_block(2, 8)
    assert entries[row_ptr[last + 1]:row_ptr[last + 2]].tolist() == [7] and int(row_ptr[-1]) == 72
    bad = blk.clone()
    bad[0, 0, 3, 0], bad[1, 0, 5, 1] = 8, -1  # out of range: dropped, not filed under another segment
    _, _, bad_partial = split_full_blocks(bad, lay.block_cnt, summary, summary, None)
    assert bool(bad_partial[0, 0, 3].any()) and int(bad_partial.sum()) == 18
    row_ptr2, _ = key_block_csr(bad, lay.block_cnt, bad_partial, 8, 2, 8)
    assert int(row_ptr2[-1]) == 70


def test_window_and_documents_make_blocks_partial():
    """A block pair is full only inside one document, below the diagonal and inside the window."""
    seg = torch.zeros(1, 64, dtype=torch.int32)
    seg[:, 40:] = 1
    meta = TokenMeta.from_segments(seg)
    summary = block_summary(meta.index, meta.segment, 16)
    blocks = torch.tensor([[[[0, -1, -1], [0, 1, -1], [0, 1, 2], [0, 2, 3]]]], dtype=torch.int32)
    cnt = torch.tensor([[[1, 2, 3, 3]]], dtype=torch.int32)
    blk, full_cnt, _ = split_full_blocks(blocks, cnt, summary, summary, None)
    # query block 2 holds the document cut (tokens 32-47): all its pairs partial; query block 3 (document
    # 1) sees key blocks 0 and 2 partially (other document / the cut) and its diagonal partially
    assert full_cnt.tolist() == [[[0, 1, 0, 0]]]
    assert blk[0, 0, 1].tolist() == [0, 1, -1]
    _, full_win, _ = split_full_blocks(blocks, cnt, summary, summary, 20)
    assert full_win.tolist() == [[[0, 0, 0, 0]]]  # query block 1 reaches 31 - 0 >= 20 tokens back in block 0
    keys_first = torch.tensor([[[[-1, -1, -1], [1, 0, -1], [1, 0, 2], [3, 0, 2]]]], dtype=torch.int32)
    blk, full_cnt, partial = split_full_blocks(keys_first, cnt, summary, summary, None)
    assert blk[0, 0, 1].tolist() == [0, 1, -1] and partial[0, 0, 1].tolist() == [False, True, False]


@pytest.mark.parametrize("tokens,group,batch", [(1 << 20, 16, 1), (3 << 19, 8, 1), (1 << 20, 8, 2), (1 << 20, 16, 2)])
def test_dkdv_walk_is_exact_past_2_31_steps(interp, tokens, group, batch):
    """At 1M-1.5M tokens (dense shared layout, block 128, the launchers' dk/dv tiles) the last key
    block's CSR segment starts past 2**31 / steps_per_entry: the walk over it, run by Triton's
    interpreter on the real index helpers with the real row pointers (only its entries allocated),
    visits exactly that segment's entries and sub-steps."""
    bs = 128
    tiles = configs.dkdv_tiles(bs, 128, on_gpu=True)
    per_entry = group * bs // tiles.block_m  # a shared layout's entry stands for the group's heads
    lo = _dense_shared_entries_before_last_key_block(batch, tokens // bs)
    assert lo * group * (bs // 32) >= 1 << 31  # the int32 step counter of the 32-row steps launched before
    row_ptr = torch.tensor([lo, lo + 1], dtype=torch.int64)
    entries = torch.tensor([tokens // bs - 1], dtype=torch.int32)
    got_entry, got_sub = interp.apply(_walk_segment, (row_ptr, entries, per_entry))
    assert got_entry.tolist() == [tokens // bs - 1] * per_entry
    assert got_sub.tolist() == list(range(per_entry))


def test_public_function_returns_the_input_dtype_in_transformers_layout(interp):
    """The kernels write the public function's output and the gradients of q, k, v in the input dtype,
    in [B, S, H, D] memory (what the attention backend hands transformers, and takes back, without a
    cast or a transpose copy), and they equal the fp64 reference's."""
    q, k, v, _, _ = _inputs(1, 4, 2, 48, 48, 32, torch.float16, seed=71)
    layout = random_layout(1, 4, 48, 48, 16, 0.5, 0.1, generator=torch.Generator().manual_seed(72))
    out, transformers_layout, lse, grads = interp.apply(_public_function_fwd_bwd, (q, k, v, layout))
    assert out.dtype == torch.float16 and all(transformers_layout) and lse.dtype == torch.float32
    ref = [t.double().requires_grad_() for t in (q, k, v)]
    ref_out, _ = block_sparse_attention(*ref, layout, implementation="reference")
    (ref_out * torch.linspace(-1, 1, 32, dtype=torch.float64)).sum().backward()
    assert rel_rms(out, ref_out) <= TOLERANCE[torch.float16]
    for got, r in zip(grads, ref):
        assert got.dtype == torch.float16 and rel_rms(got, r.grad) <= 2 * TOLERANCE[torch.float16]


# ---- columns every query of a block sees: no mask (issue #18) -------------------------------------

def _rows_full_columns(col_lists, meta, bs, window=None):
    """full_column_range of a one-head layout with these per-query-block column lists."""
    layout = _layout_from_lists([[[] for _ in col_lists]], [col_lists], bs)
    summary = block_summary(meta.index, meta.segment, bs)
    return full_column_range(layout.col_idx, layout.col_cnt, summary, meta.index, meta.segment, window)[0, 0].tolist()


def test_full_column_range_is_the_run_every_query_of_the_block_sees():
    bs = 16
    meta = TokenMeta.contiguous(1, 80)
    # block 4 (queries 64-79): columns up to its first query (64) are seen by all its queries, 70 only by some;
    # block 1 lists one column past its own queries (unused slots, -1, never count); block 0 nothing
    assert _rows_full_columns([[], [3, 40], [], [0, 1, 2], [5, 9, 63, 64, 70]], meta, bs) == [
        [0, 0], [0, 1], [0, 0], [0, 3], [0, 4]]
    # a document starting at 20: block 2 (queries 32-47) sees columns 20+ fully, earlier ones not at all
    seg = torch.zeros(1, 80, dtype=torch.int32)
    seg[:, 20:] = 1
    docs = TokenMeta.from_segments(seg)
    assert _rows_full_columns([[], [], [3, 20, 25], [], []], docs, bs)[2] == [1, 3]
    # the block holding the document cut (queries 16-31): no column is seen by all its queries
    assert _rows_full_columns([[], [3, 10], [], [], []], docs, bs)[1] == [0, 0]
    # window 40: block 4's last query (79) reaches back to 40: columns 30 and 35 stay masked
    assert _rows_full_columns([[], [], [], [], [30, 35, 41, 50, 63]], meta, bs, window=40)[4] == [2, 5]
    # padding among the queries, or a column outside the keys: masked
    pad = TokenMeta.from_segments(torch.cat([torch.zeros(1, 75), -torch.ones(1, 5)], 1))
    assert _rows_full_columns([[], [], [], [], [5, 9]], pad, bs)[4] == [0, 0]
    assert _rows_full_columns([[], [], [], [], [5, 90, 9]], meta, bs)[4] == [0, 1]


def _forward_with_split(q, k, v, layout, meta, split):
    from hf_sparse_cp.kernels.ops import triton_forward

    raw = (layout.block_idx, layout.block_cnt, layout.col_idx, layout.col_cnt)
    return triton_forward(q, k, v, raw, (meta.index, meta.segment), (meta.index, meta.segment), scale=0.25,
                          block_size=layout.block_size, split=split)


def test_fully_visible_column_steps_run_without_the_mask(interp):
    """Rows with 16-column steps of fully visible columns (before the block, one document) and masked
    ones (inside the diagonal block, across a document cut, the window's edge) equal the reference,
    forward and backward, for the columns' dk/dv in the dq loop and in their own pass. A split that
    claims every column of a row fully visible changes that row's result: the mask really is left out."""
    s, bs = 96, 16
    q, k, v, dout, dlse = _inputs(1, 2, 1, s, s, 16, torch.float32, seed=81)
    seg = torch.zeros(1, s, dtype=torch.int32)
    seg[:, 24:] = 1
    meta = TokenMeta.from_segments(seg)
    nqb = s // bs
    blocks = [[[qb] for qb in range(nqb)] for _ in range(2)]
    cols = [[[] for _ in range(nqb)] for _ in range(2)]
    cols[0][5] = list(range(0, 80, 2)) + [82, 85]  # 12 before the cut, 28 seen by all of block 5, two inside it
    cols[1][4] = list(range(24, 62)) + [66]  # 38 seen by all of block 4, one inside it
    cols[1][3] = list(range(10, 40))  # before and after the cut
    layout = _layout_from_lists(blocks, cols, bs)
    summary = block_summary(meta.index, meta.segment, bs)
    ranges = full_column_range(layout.col_idx, layout.col_cnt, summary, meta.index, meta.segment, None)[0]
    assert ranges[0, 5].tolist() == [12, 40] and ranges[1, 4].tolist() == [0, 38] and ranges[1, 3].tolist() == [14, 30]
    for dq_tiles in (configs.Tiles(16, 16, 16, 1, 1), configs.Tiles(16, 16, 16, 1, 1, separate_columns=True)):
        _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta, window=None,
                                 tiles={"dq": dq_tiles})
    _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta, window=40)

    tokens = (meta.index, meta.segment, meta.index, meta.segment)
    split = split_layout(layout.block_idx, layout.block_cnt, layout.col_idx, layout.col_cnt, *tokens, bs, None)
    forged = split._replace(col_full=torch.stack([torch.zeros_like(layout.col_cnt), layout.col_cnt], -1))
    (out, _), (bad, _) = (interp.apply(_forward_with_split, (q, k, v, layout, meta, sp)) for sp in (split, forged))
    ref, _ = reference_forward(AttentionCall(q.double(), k.double(), v.double(), layout, 0.25, meta, meta))
    assert rel_rms(out, ref) <= TOLERANCE[torch.float32]
    # only whole steps inside the claimed run go unmasked: the first step of (head 0, block 5) and of (head 1,
    # block 3) hold columns of the other document; every last step holds unused slots and stays masked
    changed = (bad - out).abs().amax(-1)[0] > 1e-3  # [H, S]
    expected = torch.zeros_like(changed)
    expected[0, 80:], expected[1, 48:64] = True, True
    assert torch.equal(changed, expected)


# ---- the split computed once per layout (issue #18) ----------------------------------------------

def _counting_split_layout(calls):
    from hf_sparse_cp.kernels import indexing

    real = indexing.split_layout
    return lambda *args: calls.append(args[-1]) or real(*args)


def _split_calls_of_a_training_step(q, k, v, layout):
    """How often a training step's forward and backward through the public function compute the kernels'
    split of the layout, and how often two more forwards over the same layout (as ring steps) do."""
    from hf_sparse_cp.kernels import indexing

    calls, real = [], indexing.split_layout
    indexing.split_layout = _counting_split_layout(calls)
    try:
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        meta = TokenMeta.contiguous(1, q.shape[2])
        out, _ = block_sparse_attention(*x, layout, q_meta=meta, k_meta=meta, implementation="triton")
        out.sum().backward()
        step = len(calls)
        for _ in range(2):
            kernel_forward(AttentionCall(q, k, v, layout, 0.25, meta, meta))
        return step, len(calls) - step
    finally:
        indexing.split_layout = real


def test_a_training_step_computes_the_split_once(interp):
    q, k, v, _, _ = _inputs(1, 2, 1, 48, 48, 16, torch.float32, seed=91)
    layout = random_layout(1, 2, 48, 48, 16, 0.6, 0.2, generator=torch.Generator().manual_seed(92))
    assert interp.apply(_split_calls_of_a_training_step, (q, k, v, layout)) == (1, 0)


def _checkpointed_step(q, k, v, layout):
    """(split computations, gradients) of a step through the public function under gradient checkpointing, and
    the gradients of the same step without it."""
    from torch.utils.checkpoint import checkpoint

    from hf_sparse_cp.kernels import indexing

    meta = TokenMeta.contiguous(1, q.shape[2])
    attend = lambda *x: block_sparse_attention(*x, layout, q_meta=meta, k_meta=meta, implementation="triton")[0]  # noqa: E731
    calls, real = [], indexing.split_layout
    indexing.split_layout = _counting_split_layout(calls)
    try:
        grads = []
        for wrap in (lambda *x: checkpoint(attend, *x, use_reentrant=False), attend):
            x = [t.clone().requires_grad_() for t in (q, k, v)]
            wrap(*x).square().sum().backward()
            grads.append([t.grad for t in x])
        return len(calls), grads
    finally:
        indexing.split_layout = real


def test_a_checkpointed_step_restores_the_split_saved_with_the_layout(interp):
    """The layout and its split travel with the saved tensors (`SparseLayout.take_apart`): the backward of a
    checkpointed call computes no split of its own and gives the gradients of a call without checkpointing."""
    q, k, v, _, _ = _inputs(1, 2, 1, 48, 48, 16, torch.float32, seed=94)
    layout = random_layout(1, 2, 48, 48, 16, 0.6, 0.2, generator=torch.Generator().manual_seed(95))
    calls, (checkpointed, plain) = interp.apply(_checkpointed_step, (q, k, v, layout))
    assert calls == 1  # kept on the layout object the forward, its recomputation and the plain step share
    assert all(torch.equal(a, b) for a, b in zip(checkpointed, plain))


def test_the_split_kept_on_a_layout_follows_what_it_was_computed_from(monkeypatch):
    """Kept per layout, token tensors and window; computed again after an in-place write to the layout
    or its tokens, for other tokens or another window, and for a layout built again; nothing kept
    under torch.compile; no autograd."""
    from dataclasses import replace

    from hf_sparse_cp.attention.engines import kernel_split
    from hf_sparse_cp.kernels import indexing

    calls = []
    monkeypatch.setattr(indexing, "split_layout", _counting_split_layout(calls))
    meta = TokenMeta.contiguous(1, 64)
    layout = random_layout(1, 2, 64, 64, 16, 0.6, 0.2, generator=torch.Generator().manual_seed(93))
    first = kernel_split(layout, meta, meta, None)
    assert kernel_split(layout, meta, meta, None) is first and calls == [None]
    assert not any(t.requires_grad for t in first)
    assert kernel_split(layout, meta, meta, 20) is not first and calls == [None, 20]
    other = TokenMeta(meta.index.clone(), meta.segment.clone())  # equal values, other tensors
    again = kernel_split(layout, other, other, None)
    assert again is not first and kernel_split(layout, other, other, None) is again and len(calls) == 3

    assert int(again.full_cnt[0, 0, 3]) > 0
    layout.block_cnt[0, 0, 3] = 0  # an in-place write: the kept split no longer holds
    emptied = kernel_split(layout, other, other, None)
    assert emptied is not again and int(emptied.full_cnt[0, 0, 3]) == 0 and len(calls) == 4
    other.segment[0, 40:] = 1  # so do the token tensors
    cut = kernel_split(layout, other, other, None)
    assert cut is not emptied and not torch.equal(cut.full_cnt, emptied.full_cnt) and len(calls) == 5

    rebuilt = replace(layout, block_size=16)
    assert kernel_split(rebuilt, other, other, None) is not cut and len(calls) == 6
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    traced = replace(layout, block_size=16)
    kernel_split(traced, other, other, None)
    kernel_split(traced, other, other, None)
    assert len(calls) == 8


def test_a_split_kept_eagerly_is_not_read_by_a_fullgraph_trace():
    """A layout whose split was kept by an eager call traces under torch.compile(fullgraph=True) (the lookup
    compares tensor versions, data-dependent in a trace: the GPU session of 2026-11-27 failed there), and the
    traced split equals the eager one."""
    from hf_sparse_cp.attention.engines import kernel_split

    meta = TokenMeta.contiguous(1, 64)
    layout = random_layout(1, 2, 64, 64, 16, 0.6, 0.2, generator=torch.Generator().manual_seed(94))
    eager = kernel_split(layout, meta, meta, None)
    torch._dynamo.reset()
    traced = torch.compile(lambda: tuple(kernel_split(layout, meta, meta, None)), fullgraph=True, backend="eager")()
    assert len(traced) == len(eager) and all(torch.equal(a, b) for a, b in zip(traced, eager))


# ---- dk/dv written in the input dtype by the dk/dv kernel (issue #18) ----------------------------

def _backward_and_its_dkdv_outputs(q, k, v, out, lse, dout, layout, meta, deterministic, in_input_dtype):
    """The primitive backward's gradients, and the tensors the dk/dv kernel was given to write."""
    kernel, written = block_sparse_bwd._dkdv_kernel, []
    real_run = kernel.run

    def run(*args, **kwargs):
        written.append(args[8:10])  # DK, DV
        return real_run(*args, **kwargs)

    kernel.run = run
    try:
        grads = kernel_backward(AttentionCall(q, k, v, layout, 0.25, meta, meta), out, lse, dout,
                                deterministic=deterministic, grads_in_input_dtype=in_input_dtype)
    finally:
        del kernel.run
    (dk_arg, dv_arg), = written
    return grads, [(g.data_ptr(), g.dtype) == (a.data_ptr(), a.dtype) for g, a in zip(grads[1:], (dk_arg, dv_arg))]


@pytest.mark.parametrize("columns,deterministic,in_input_dtype", [
    (True, False, True), (True, True, True), (False, False, True), (True, False, False)],
    ids=["columns-atomic-fp16", "columns-deterministic-fp16", "no-columns-fp16", "columns-fp32-for-a-ring"])
def test_dkdv_kernel_writes_the_returned_gradients(interp, columns, deterministic, in_input_dtype):
    """The dk/dv kernel writes the returned dk and dv themselves: in the input dtype in [B, S, H, D]
    memory (no fp32 buffer copied afterwards), seeded with the columns' fp32 sums (atomic or
    deterministic), or fp32 contiguous (what a ring sums over its steps); equal to the fp64 reference
    at the dtype's tolerance."""
    s, bs = 48, 16
    q, k, v, dout, _ = _inputs(1, 4, 2, s, s, 16, torch.float16, seed=95)
    meta = TokenMeta.contiguous(1, s)
    layout = (random_layout(1, 4, s, s, bs, 0.5, 0.2, generator=torch.Generator().manual_seed(96)) if columns
              else dense_layout(meta, bs))
    assert (int(layout.col_cnt.sum()) > 0) == columns
    out, lse = reference_forward(AttentionCall(q.double(), k.double(), v.double(), layout, 0.25, meta, meta))
    out = out.half()
    grads, written_by_kernel = interp.apply(_backward_and_its_dkdv_outputs, (q, k, v, out, lse.float(), dout, layout,
                                                                              meta, deterministic, in_input_dtype))
    assert written_by_kernel == [True, True]
    ref = reference_backward(AttentionCall(q.double(), k.double(), v.double(), layout, 0.25, meta, meta), out.double(),
                             lse, dout.double())
    dtype = torch.float16 if in_input_dtype else torch.float32
    for name, got, r in zip(("dq", "dk", "dv"), grads, ref):
        assert got.dtype == dtype and got.shape == r.shape, name
        assert got.transpose(1, 2).is_contiguous() if in_input_dtype else got.is_contiguous(), name
        assert rel_rms(got, r) <= 2 * TOLERANCE[torch.float16], name


# ---- TMA tensor descriptors for the forward's key blocks (issue #18, behind Tiles.kv_descriptors) --

def _kernels_through_descriptors(*args, tiles):
    """`_kernel_fwd_bwd`, checking that the forward and dq launches loaded key blocks through descriptors."""
    seen, kernels = [], (block_sparse_fwd._forward_kernel, block_sparse_bwd._dq_kernel)
    for kernel in kernels:
        kernel.run = lambda *a, _run=kernel.run, **kw: seen.append(kw["KV_DESCRIPTORS"]) or _run(*a, **kw)
    try:
        result = _kernel_fwd_bwd(*args, tiles=tiles)
    finally:
        for kernel in kernels:
            del kernel.run
    assert seen == [True, True], seen
    return result


@pytest.mark.parametrize("d,dtype,window", [(48, torch.float32, None), (16, torch.float16, 40)],
                         ids=["d48-fp32", "d16-fp16-window"])
def test_key_blocks_through_tensor_descriptors_match_reference(interp, d, dtype, window):
    """The forward's and dq's key-block tiles loaded through TMA tensor descriptors (zeros past the keys
    and past head_dim 48 in a 64-lane tile), full and partial blocks, columns by gather, packed
    documents and padding: forward and backward equal the reference."""
    s, bs = 100, 32
    q, k, v, dout, dlse = _inputs(1, 4, 2, s, s, d, dtype, seed=97)
    meta = _random_docs(1, s, seed=98, pad=3)
    layout = random_vertical_slash_layout(1, 4, s, bs, num_diagonals=2, num_verticals=8, meta=meta,
                                          generator=torch.Generator().manual_seed(99))
    tma = configs.Tiles(32, 16, 16, 1, 1, kv_descriptors=True)
    _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta, window=window,
                             tiles={"forward": tma, "dq": tma}, worker=_kernels_through_descriptors)


def test_tensor_descriptors_only_where_the_tensors_allow_them():
    """TMA needs a 16-byte aligned base and 16-byte multiples as strides: otherwise the launch keeps
    its pointer loads."""
    x = torch.randn(1, 2, 8, 16)
    assert block_sparse_fwd.descriptors_fit(x, x.half())
    assert not block_sparse_fwd.descriptors_fit(torch.randn(1, 2, 8, 20).half())  # rows of 40 bytes
    assert not block_sparse_fwd.descriptors_fit(torch.randn(1 * 2 * 8 * 16 + 1)[1:].view(1, 2, 8, 16))  # base + 4 B
    assert not block_sparse_fwd.descriptors_fit(torch.randn(1, 2, 0, 16))


# ---- a tile-major grid for the forward and dq (Flex's program order, behind Tiles.tile_major) -------

def _packed_case_with_columns(seed, num_verticals=8):
    """S 100 in blocks of 32, GQA 2, d 16, fp32: q, k, v, dout, dlse, packed documents with padding (their tokens'
    metadata) and a vertical-slash layout over them with key columns; from the seeds `seed`, `seed` + 1, + 2."""
    s = 100
    q, k, v, dout, dlse = _inputs(1, 4, 2, s, s, 16, torch.float32, seed=seed)
    meta = _random_docs(1, s, seed=seed + 1, pad=3)
    layout = random_vertical_slash_layout(1, 4, s, 32, num_diagonals=2, num_verticals=num_verticals, meta=meta,
                                          generator=torch.Generator().manual_seed(seed + 2))
    assert int(layout.col_cnt.sum()) > 0
    return q, k, v, dout, dlse, meta, layout

def _kernels_in_tile_major_order(*args, tiles):
    """`_kernel_fwd_bwd` with `tiles`, then again with the same tiles in the launchers' grid order; returns the
    first results, the (TILE_MAJOR, grid) of the first run's forward, dq and dk/dv launches, and the second run's
    out, lse, dq."""
    seen, kernels = [], (block_sparse_fwd._forward_kernel, block_sparse_bwd._dq_kernel, block_sparse_bwd._dkdv_kernel)
    for kernel in kernels:
        kernel.run = lambda *a, _run=kernel.run, **kw: seen.append((kw["TILE_MAJOR"], kw["grid"])) or _run(*a, **kw)
    try:
        result = _kernel_fwd_bwd(*args, tiles=tiles)
    finally:
        for kernel in kernels:
            del kernel.run
    out, lse, dq, *_ = _kernel_fwd_bwd(*args, tiles={k: replace(t, tile_major=False) for k, t in tiles.items()})
    return (*result, seen, (out, lse, dq))


def test_tile_major_grid_computes_the_same_function(interp):
    """Forward and dq launched with the query tiles of one head next to each other (grid (tiles, B x Hq)), dk/dv
    with the key tiles of one kv head (grid (key tiles, B x Hkv)): forward and backward equal the reference, and
    out, lse and dq are bitwise those of the launchers' grid (B x Hq, tiles) with the same tiles, each program
    computing what it did (dk/dv take the columns' atomic sums, whose order the dq grid changes); packed
    documents, padding, columns, GQA 2."""
    q, k, v, dout, dlse, meta, layout = _packed_case_with_columns(101)
    s = q.shape[2]
    tiles = configs.Tiles(16, 16, 16, 1, 1, tile_major=True)
    res = _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta, worker=_kernels_in_tile_major_order,
                                   tiles={"forward": tiles, "dq": tiles, "dkdv": configs.Tiles(16, 32, 16, 1, 1,
                                                                                               tile_major=True)})
    n_tiles = -(-s // 16)
    assert res[5] == [(True, (n_tiles, 4)), (True, (n_tiles, 4)), (True, (-(-s // 32), 2))]
    for name, got, launched in zip(("out", "lse", "dq"), (res[0], res[1], res[2]), res[6]):
        assert torch.equal(got, launched), name


# ---- masked column steps reading their slots again (Tiles.column_meta_reload) -------------------------------

def _kernels_with_and_without_meta_reload(*args, tiles):
    """`_kernel_fwd_bwd` with `tiles`, then its out, lse, dq, dk, dv with the same tiles without
    `column_meta_reload`."""
    result = _kernel_fwd_bwd(*args, tiles=tiles)
    plain = {k: replace(t, column_meta_reload=False) for k, t in tiles.items()}
    return (*result, _kernel_fwd_bwd(*args, tiles=plain)[:5])


def test_masked_column_steps_reading_their_slots_again_compute_the_same_function(interp):
    """With `Tiles.column_meta_reload` a masked column step takes its keys' token metadata from the row's slots read
    again, not from the tokens its K/V gather loaded: forward and backward equal the reference, and are bitwise
    those of the launchers' column steps (the same tokens, the same arithmetic). Packed documents, padding and a
    sliding window make most column steps masked; slots past the row's count and partly used last steps too."""
    q, k, v, dout, dlse, meta, layout = _packed_case_with_columns(111, num_verticals=12)
    tiles = configs.Tiles(16, 16, 16, 1, 1, column_meta_reload=True)
    res = _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta, window=40,
                                   worker=_kernels_with_and_without_meta_reload, tiles={"forward": tiles, "dq": tiles})
    for name, got, plain in zip(("out", "lse", "dq", "dk", "dv"), res[:5], res[-1]):
        assert torch.equal(got, plain), name


# ---- the compiled path's custom op on the kernels (attention.opaque) ----------------------------------------

def _opcheck_the_custom_ops_on_the_kernels(q, k, v, layout, meta):
    """torch.library.opcheck of `hf_sparse_cp::layout_attention` and its backward op with the kernels as the engine;
    returns the op's out and lse."""
    from hf_sparse_cp.attention.opaque import layout_attention, layout_attention_backward

    tensors = (layout.block_idx, layout.block_cnt, layout.col_idx, layout.col_cnt, meta.index, meta.segment,
               meta.index, meta.segment)
    rest = (layout.block_size, 0.25, None, "triton")
    torch.library.opcheck(layout_attention, (q, k, v, *tensors, *rest))
    out, lse = layout_attention(q, k, v, *tensors, *rest)
    g = torch.Generator().manual_seed(5)
    dout, dlse = torch.randn(out.shape, generator=g), torch.randn(lse.shape, generator=g)
    saved = (t.detach() for t in (q, k, v, out, lse))
    torch.library.opcheck(layout_attention_backward, (dout, dlse, *saved, *tensors, *rest))
    return out.detach(), lse.detach()


@pytest.mark.parametrize("memory", ["bshd", "bhsd"])
def test_the_compiled_paths_custom_op_on_the_kernels_passes_opcheck(interp, memory):
    """The compiled step's attention op (`attention.opaque`) declares fake outputs whose shapes and strides the
    compiler trusts: with the kernels as its engine (the GPU's), not only the reference the CPU tests run, opcheck
    (fake against real outputs, autograd registration, AOT dispatch) passes for the op and its backward, q, k, v in
    transformers' [B, S, H, D] memory or contiguous; out and lse equal the fp64 reference."""
    q, k, v, _, _, meta, layout = _packed_case_with_columns(121)
    s = q.shape[2]
    if memory == "bshd":
        q, k, v = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = interp.apply(_opcheck_the_custom_ops_on_the_kernels, (q, k, v, layout, meta))
    assert out.shape == (1, s, 4, 16) and lse.shape == (1, 4, s)
    want_out, want_lse = reference_forward(AttentionCall(*(t.detach().double() for t in (q, k, v)), layout, 0.25,
                                                         meta, meta, None))
    assert rel_rms(out.transpose(1, 2), want_out) < TOLERANCE[torch.float32]
    seen = torch.isfinite(want_lse)
    assert torch.equal(torch.isfinite(lse), seen) and rel_rms(lse, want_lse, seen) < TOLERANCE[torch.float32]


# ---- FlexAttention's row addressing (Tiles.lean_index) ------------------------------------------------------

def _kernels_with_and_without_lean_index(*args, tiles, int32_max=None):
    """`_kernel_fwd_bwd` with `tiles` (with `int32_max` as the launchers' int32 bound on row offsets, so that a
    small test takes the int64 rows of a lean launch), then its out, lse, dq, dk, dv with the same tiles without
    `lean_index`; returns the first results, the lean flags each launch of the first run saw, and the second
    run's results."""
    seen, kernels = [], (block_sparse_fwd._forward_kernel, block_sparse_bwd._dq_kernel, block_sparse_bwd._dkdv_kernel)
    names = ("LEAN", "REP", "ROWS_I32", "WHOLE_ROWS")
    for kernel in kernels:
        kernel.run = lambda *a, _run=kernel.run, **kw: seen.append({n: kw[n] for n in names if n in kw}) or _run(*a,
                                                                                                                **kw)
    saved = block_sparse_fwd.INT32_MAX
    block_sparse_fwd.INT32_MAX = saved if int32_max is None else int32_max
    try:
        result = _kernel_fwd_bwd(*args, tiles=tiles)
    finally:
        block_sparse_fwd.INT32_MAX = saved
        for kernel in kernels:
            del kernel.run
    plain = {k: replace(t, lean_index=False) for k, t in tiles.items()}
    return (*result, seen, _kernel_fwd_bwd(*args, tiles=plain)[:5])


@pytest.mark.parametrize("s,d,shared,int32_max,flags", [
    (128, 16, False, None, {"REP": 1, "ROWS_I32": True, "WHOLE_ROWS": True}),
    (100, 48, True, None, {"REP": 2, "ROWS_I32": True, "WHOLE_ROWS": False}),
    (128, 16, True, 0, {"REP": 2, "ROWS_I32": False, "WHOLE_ROWS": True}),
], ids=["whole-rows-per-head", "masked-rows-shared", "int64-rows-shared"])
def test_lean_index_computes_the_same_function(interp, s, d, shared, int32_max, flags):
    """With `Tiles.lean_index` the forward's and dq's key blocks and each dk/dv step's query rows are addressed from
    their head's base (int32 row offsets where they fit, else int64), loaded without masks where the rows fill
    whole layout blocks and the head its lanes, and dk/dv decode packed CSR entries: forward and backward equal the
    reference and are bitwise those of the launchers' addressing. GQA 2, packed documents with padding (partial
    blocks), columns; per-head and shared layouts (an entry for both heads of the group)."""
    q, k, v, dout, dlse = _inputs(1, 4, 2, s, s, d, torch.float32, seed=121 + s)
    meta = _random_docs(1, s, seed=122, pad=3)
    layout = random_vertical_slash_layout(1, 1 if shared else 4, s, 32, num_diagonals=2, num_verticals=8, meta=meta,
                                          generator=torch.Generator().manual_seed(123))
    lean = configs.Tiles(16, 16, 16, 1, 1, lean_index=True)
    tiles = {"forward": lean, "dq": lean, "dkdv": configs.Tiles(16, 32, 16, 1, 1, lean_index=True)}
    res = _check_against_reference(interp, q, k, v, dout, dlse, layout, meta, meta, tiles=tiles,
                                   worker=functools.partial(_kernels_with_and_without_lean_index, int32_max=int32_max))
    rows = {"ROWS_I32": flags["ROWS_I32"], "WHOLE_ROWS": flags["WHOLE_ROWS"]}
    assert res[5] == [rows, rows, {"LEAN": True, "REP": flags["REP"], **rows}], res[5]
    for name, got, plain in zip(("out", "lse", "dq", "dk", "dv"), res[:5], res[6]):
        assert torch.equal(got, plain), name


def test_packed_key_block_csr_entries_carry_the_head_in_their_high_bits():
    """`key_block_csr(packed=True)` (lean dk/dv launches) lists the same entries in the same order, each as
    head_in_group << PACKED_BLOCK_BITS | query_block instead of head_in_group * NQB + query_block, with the same row
    pointers; `packed_entries_fit` bounds the heads per group and the query blocks."""
    from hf_sparse_cp.kernels.indexing import PACKED_BLOCK_BITS, packed_entries_fit

    s, bs = 160, 16
    meta = TokenMeta.contiguous(1, s)
    layout = random_layout(1, 8, s, s, bs, 0.5, 0.0, generator=torch.Generator().manual_seed(131))
    summary = block_summary(meta.index, meta.segment, bs)
    blk, _, partial = split_full_blocks(layout.block_idx, layout.block_cnt, summary, summary, None)
    nqb = layout.num_q_blocks
    row_ptr, entries = key_block_csr(blk, layout.block_cnt, partial, 8, 2, nqb)
    packed_ptr, packed = key_block_csr(blk, layout.block_cnt, partial, 8, 2, nqb, packed=True)
    assert torch.equal(row_ptr, packed_ptr) and packed.dtype == torch.int32 and entries.numel() > 0
    assert torch.equal(packed, (entries // nqb) << PACKED_BLOCK_BITS | entries % nqb)
    assert int(packed.max()) >> PACKED_BLOCK_BITS == 3  # 4 query heads per key head
    assert packed_entries_fit(128, 1 << PACKED_BLOCK_BITS) and not packed_entries_fit(129, 8)
    assert not packed_entries_fit(8, (1 << PACKED_BLOCK_BITS) + 1)
