"""The key-major column kernel (`kernels.column_bwd`, chosen by a "columns" tile override): its index
(`indexing.column_union`) against a Python walk of the layout, and the backward it drives, under
Triton's interpreter, against the fp64 reference and against the default path (the dq kernel's
atomics). Every run checks that the dq kernel left the columns' dk/dv out and the column kernel ran."""

import pytest
import torch
from test_kernels_interpreter import _check_against_reference, _inputs, _kernel_fwd_bwd, _random_docs

from hf_sparse_cp.attention.call import AttentionCall
from hf_sparse_cp.attention.layout import SparseLayout
from hf_sparse_cp.attention.reference import reference_backward, reference_forward
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.kernels import block_sparse_bwd, column_bwd, configs, indexing
from hf_sparse_cp.kernels.indexing import column_union
from hf_sparse_cp.simulator.workloads import random_vertical_slash_layout
from hf_sparse_cp.testing.interpreter import interpreter_pool
from hf_sparse_cp.testing.layouts import random_layout

from oracle import TOLERANCE, kernel_backward, rel_rms

# Tiles under the interpreter: query steps of half a 32-token block, chunks of 16 columns, 2 or 4 steps a
# program, so that rows span several chunks, programs several segments, and layout rows several steps.
KEY_MAJOR = configs.Tiles(16, 16, 16, 1, 1, query_steps=2)
WIDE = configs.Tiles(16, 16, 32, 1, 1, query_steps=4)


@pytest.fixture(scope="module")
def interp():
    with interpreter_pool() as pool:
        yield pool


def _union_by_hand(layout: SparseLayout, k_len: int):
    """Per (row, layout head) the sorted set of listed in-range columns, and each layout row's first and
    last position in it (None for a row without columns)."""
    b, hl, nqb, _ = layout.col_idx.shape
    unions, spans = {}, {}
    for r in range(b):
        for h in range(hl):
            rows = [[c for c in layout.col_idx[r, h, qb, :max(0, int(layout.col_cnt[r, h, qb]))].tolist()
                     if 0 <= c < k_len] for qb in range(nqb)]
            union = sorted({c for row in rows for c in row})
            unions[r, h] = union
            for qb, row in enumerate(rows):
                spans[r, h, qb] = (union.index(row[0]), union.index(row[-1])) if row else None
    return unions, spans


@pytest.mark.parametrize("one_head_a_chunk", [False, True], ids=["one-chunk", "head-chunks"])
@pytest.mark.parametrize("heads,k_len", [(3, 70), (1, 40)], ids=["per-head", "shared-keys-shorter"])
def test_column_union_is_the_sorted_set_of_listed_columns(monkeypatch, heads, k_len, one_head_a_chunk):
    """Tokens, count and spans equal a Python walk, in one pass or one head at a time; slots past the
    count and tokens outside [0, Sk) are left out; an empty row spans [Sk, -1]."""
    if one_head_a_chunk:
        monkeypatch.setattr(indexing, "_CHUNK_ELEMENTS", 1)
    layout = random_layout(2, heads, 64, k_len, 16, 0.3, 0.15, causal=False,
                           generator=torch.Generator().manual_seed(heads))
    col_idx = torch.nn.functional.pad(layout.col_idx, (0, 2), value=-1)
    col_cnt = layout.col_cnt.clone()
    col_idx[0, 0, 1, col_cnt[0, 0, 1]] = k_len + 5  # out of range, counted
    col_cnt[0, 0, 1] += 1
    col_idx[1, -1, 2, 0] = -1  # negative, counted
    col_cnt[1, -1, 2] = max(1, int(col_cnt[1, -1, 2]))
    col_idx[1, 0, 3] = 7  # not counted: the row is empty
    col_cnt[1, 0, 3] = 0
    listed = SparseLayout(layout.block_idx, layout.block_cnt, col_idx, col_cnt, 16)
    union = column_union(col_idx, col_cnt, k_len)
    unions, spans = _union_by_hand(listed, k_len)
    assert union.tokens.shape == (2, heads, k_len) and union.span.shape == (2, heads, 4, 2)
    assert union.tokens.dtype == union.count.dtype == union.span.dtype == torch.int32
    for (r, h), cols in unions.items():
        assert int(union.count[r, h]) == len(cols) > 0
        assert union.tokens[r, h, :len(cols)].tolist() == cols
    for (r, h, qb), span in spans.items():
        assert union.span[r, h, qb].tolist() == (list(span) if span else [k_len, -1]), (r, h, qb)
    assert spans[1, 0, 3] is None


def _run_key_major(*args, tiles):
    """`_kernel_fwd_bwd` with the key-major column kernel (`tiles`), checking that the one dq launch left
    the columns' dk/dv out and the column kernel ran once."""
    modes, launches = [], []
    dq_kernel, col_kernel = block_sparse_bwd._dq_kernel, column_bwd._column_kernel
    dq_kernel.run = lambda *a, _run=dq_kernel.run, **kw: modes.append(kw["COLUMN_GRADS"]) or _run(*a, **kw)
    col_kernel.run = lambda *a, _run=col_kernel.run, **kw: launches.append(kw["STEPS"]) or _run(*a, **kw)
    try:
        result = _kernel_fwd_bwd(*args, tiles={"columns": tiles})
    finally:
        del dq_kernel.run, col_kernel.run
    assert modes == [block_sparse_bwd._NO_COLUMNS] and launches == [tiles.query_steps], (modes, launches)
    return result


def _key_major_then_atomic(q, k, v, layout, q_meta, k_meta, scale, window, dout, dlse, tiles):
    """`_run_key_major`'s out, lse, dq, dk, dv, then the default path's (the dq kernel's column atomics)
    dq, dk, dv from the same forward: one interpreter call for both backward paths."""
    out, lse, *grads = _run_key_major(q, k, v, layout, q_meta, k_meta, scale, window, dout, dlse, tiles=tiles)
    call = AttentionCall(q, k, v, layout, scale, q_meta, k_meta, window)
    modes = []
    dq_kernel = block_sparse_bwd._dq_kernel
    dq_kernel.run = lambda *a, _run=dq_kernel.run, **kw: modes.append(kw["COLUMN_GRADS"]) or _run(*a, **kw)
    try:
        atomic = kernel_backward(call, out.to(q.dtype), lse, dout, dlse=dlse)
    finally:
        del dq_kernel.run
    assert modes == [block_sparse_bwd._ATOMIC], modes  # the dq kernel did the columns, by atomics
    return (out, lse, *grads, *atomic)


def _scenario(name):
    """(q, k, v, dout, dlse, layout, q_meta, k_meta, window) of a named case."""
    if name == "gqa-per-head-vertical-slash":
        s = 160
        meta = TokenMeta.contiguous(1, s)
        layout = random_vertical_slash_layout(1, 4, s, 32, num_diagonals=1, num_verticals=14, sink_tokens=2,
                                              generator=torch.Generator().manual_seed(41))
        return (*_inputs(1, 4, 2, s, s, 32, torch.float32, seed=40), layout, meta, meta, None)
    if name == "shared-layout-packed-documents":
        s = 150
        meta = _random_docs(2, s, seed=42, pad=7)
        layout = random_layout(2, 1, s, s, 32, 0.3, 0.15, generator=torch.Generator().manual_seed(43))
        # 2 query heads on 1 (GQA's 4 on 2 is the case above); the layout's one head serves both, in both rows
        return (*_inputs(2, 2, 1, s, s, 16, torch.float32, seed=44), layout, meta, meta, None)
    if name == "window-partial-block-fp16":
        s = 133
        meta = _random_docs(1, s, seed=45, pad=4, cuts=1)
        layout = random_layout(1, 2, s, s, 32, 0.3, 0.12, generator=torch.Generator().manual_seed(46))
        return (*_inputs(1, 2, 1, s, s, 64, torch.float16, seed=47), layout, meta, meta, 50)
    assert name == "key-shard-longer-than-queries"  # a ring step: 77 queries after 100 keys
    sq, sk = 77, 100
    seg = torch.zeros(1, sq + sk, dtype=torch.int32)
    seg[:, 60:] = 1
    index = torch.arange(sq + sk).unsqueeze(0)
    layout = random_layout(1, 4, sq, sk, 32, 0.4, 0.12, causal=False, generator=torch.Generator().manual_seed(48))
    layout.col_cnt[0, 1, 1] = 0  # a row without columns, its slots left holding tokens (out of use: never read)
    return (*_inputs(1, 4, 2, sq, sk, 16, torch.float32, seed=49), layout, TokenMeta(index[:, sk:], seg[:, sk:]),
            TokenMeta(index[:, :sk], seg[:, :sk]), None)


@pytest.mark.parametrize("tiles", [KEY_MAJOR, WIDE], ids=["chunk16-steps2", "chunk32-steps4"])
@pytest.mark.parametrize("name", ["gqa-per-head-vertical-slash", "shared-layout-packed-documents",
                                  "window-partial-block-fp16", "key-shard-longer-than-queries"])
def test_key_major_columns_match_reference_and_the_atomic_path(interp, name, tiles):
    """GQA (4 query heads on 2), per-head and shared layouts, packed documents with padding, a sliding
    window, a partial last block, rows without columns, keys fewer or more than the queries: dq, dk and
    dv equal the fp64 reference and the default path's (the dq kernel's column atomics)."""
    q, k, v, dout, dlse, layout, q_meta, k_meta, window = _scenario(name)
    counts = layout.col_cnt
    assert int((counts == 0).sum()) > 0 and int((counts >= 2).sum()) > 0  # rows without columns, and with several
    res = _check_against_reference(interp, q, k, v, dout, dlse, layout, q_meta, k_meta, window=window,
                                   tiles=tiles, worker=_key_major_then_atomic)
    grads, atomic = res[2:5], res[5:]
    for label, got, ref in zip(("dq", "dk", "dv"), grads, atomic):
        assert rel_rms(got, ref) <= TOLERANCE[q.dtype] / 4, label


def _both_backward_paths(call, out, lse, dout, dlse):
    """dq, dk, dv of the default path, then of the key-major column kernel."""
    with configs.tiles_override(columns=KEY_MAJOR):
        key_major = kernel_backward(call, out, lse, dout, dlse=dlse)
    return kernel_backward(call, out, lse, dout, dlse=dlse), key_major


def test_entries_out_of_range_are_not_read_through(interp):
    """Ascending rows that list a negative token first or a token past the keys last, and a negative count:
    as in the default path, those rows' dq come out NaN and every other dq row, and dk/dv, equal the fp64
    reference on the layout without the invalid entries (nothing outside the tensors read or written)."""
    s, bs = 64, 16
    q, k, v, dout, dlse = _inputs(1, 2, 1, s, s, 16, torch.float32, seed=61)
    base = random_layout(1, 2, s, s, bs, 0.4, 0.2, generator=torch.Generator().manual_seed(62))
    col, ccnt = torch.nn.functional.pad(base.col_idx, (0, 1), value=-1), base.col_cnt.clone()
    n = int(ccnt[0, 0, 3])
    assert n > 0 and int(ccnt[0, 1, 2]) > 0
    col[0, 0, 3, 1:n + 1] = base.col_idx[0, 0, 3, :n].clone()
    col[0, 0, 3, 0] = -1
    col[0, 1, 2, ccnt[0, 1, 2]] = s + 3
    ccnt[0, 0, 3] += 1
    ccnt[0, 1, 2] += 1
    ccnt[0, 1, 1] = -2
    clean_cnt = base.col_cnt.clone()
    clean_cnt[0, 1, 1] = 0
    clean = SparseLayout(base.block_idx, base.block_cnt, base.col_idx, clean_cnt, bs)
    meta = TokenMeta.contiguous(1, s)
    f64 = AttentionCall(q.double(), k.double(), v.double(), clean, 0.25, meta, meta)
    ref_out, ref_lse = reference_forward(f64)
    out, lse = ref_out.float(), ref_lse.float()
    call = AttentionCall(q, k, v, SparseLayout(base.block_idx, base.block_cnt, col, ccnt, bs), 0.25, meta, meta)
    default, key_major = interp.apply(_both_backward_paths, (call, out, lse, dout, dlse))
    ref = reference_backward(f64, out.double(), lse.double(), dout.double(), dlse=dlse.double())
    rows = torch.zeros(2, s, dtype=torch.bool)
    for h, qb in ((0, 3), (1, 2), (1, 1)):
        rows[h, qb * bs:(qb + 1) * bs] = True
    for dq, dk, dv in (default, key_major):
        assert bool(dq[0][rows].isnan().all()) and not bool(dq[0][~rows].isnan().any())
        assert rel_rms(dq[0][~rows], ref[0][0][~rows]) <= 2 * TOLERANCE[torch.float32]
        for got, r in ((dk, ref[1]), (dv, ref[2])):
            assert rel_rms(got, r) <= 2 * TOLERANCE[torch.float32]


def test_steps_that_miss_a_chunk_between_steps_that_meet_it(interp):
    """A program walks only the query steps whose row meets a chunk: here chunk 0 of head 0 meets layout rows 0
    and 2 but not row 1 between them, chunk 0 of head 1 rows 1 and 3; row 2 of head 0 keeps its cursor over
    the chunk it skips part of; the last program holds one query tile of eight steps (the others never meet a
    chunk). dq, dk, dv equal the fp64 reference and the default path's."""
    sq, sk, bs = 144, 96, 32  # 5 query blocks (the last of 16 rows) after 96 keys, all visible (a ring step)
    rows = {0: [[*range(12), *range(40, 48)], [*range(50, 56)], [3, 5, 60, 61], [], [7, 44]],
            1: [[], [1, 2], [], [1, 62], []]}
    col_idx = torch.full((1, 2, 5, 20), -1, dtype=torch.int32)
    for h, cols in rows.items():
        for qb, c in enumerate(cols):
            col_idx[0, h, qb, :len(c)] = torch.tensor(c, dtype=torch.int32)
    col_cnt = torch.tensor([[[len(c) for c in rows[h]] for h in (0, 1)]], dtype=torch.int32)
    block_idx = torch.full((1, 2, 5, 1), 2, dtype=torch.int32)  # keys 64-95, beside the columns
    layout = SparseLayout(block_idx, torch.ones(1, 2, 5, dtype=torch.int32), col_idx, col_cnt, bs)
    span = column_union(col_idx, col_cnt, sk).span[0]
    assert span[0, :3].tolist() == [[0, 19], [20, 25], [3, 27]] and span[1, :4].tolist() == [[sk, -1], [0, 1],
                                                                                               [sk, -1], [0, 2]]
    index = torch.arange(sk + sq).unsqueeze(0)
    seg = torch.zeros(1, sk + sq, dtype=torch.int32)
    q_meta, k_meta = TokenMeta(index[:, sk:], seg[:, sk:]), TokenMeta(index[:, :sk], seg[:, :sk])
    q, k, v, dout, dlse = _inputs(1, 2, 1, sq, sk, 16, torch.float32, seed=63)
    tiles = configs.Tiles(16, 16, 16, 1, 1, query_steps=8)
    res = _check_against_reference(interp, q, k, v, dout, dlse, layout, q_meta, k_meta, tiles=tiles,
                                   worker=_key_major_then_atomic)
    grads, atomic = res[2:5], res[5:]
    for label, got, ref in zip(("dq", "dk", "dv"), grads, atomic):
        assert rel_rms(got, ref) <= TOLERANCE[q.dtype] / 4, label
