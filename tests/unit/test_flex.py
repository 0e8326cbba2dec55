"""The FlexAttention engine on CPU (Flex's eager path; torch has no Flex backward on CPU, so gradients
and speed are in test_flex_gpu.py): its masks equal the layout's, its forward equals the fp64
reference (alone, merged into a running result, split over key ranges like ring steps), and the
engine setting (config field, environment variable, 'auto' and its timing table)."""

import json
import math
import os

import pytest
import torch

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention import engines
from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.call import AttentionCall
from hf_sparse_cp.attention.flex import FLEX_BLOCK, flex_calls
from hf_sparse_cp.attention.merge import merge_attention
from hf_sparse_cp.attention.ops import attention_forward, block_sparse_attention
from hf_sparse_cp.attention.reference import reference_forward
from hf_sparse_cp.attention.tokens import PAD_SEGMENT, TokenMeta
from hf_sparse_cp.simulator.workloads import random_vertical_slash_layout
from hf_sparse_cp.testing.layouts import random_layout

from oracle import TOLERANCE, key_range, rel_rms, visible

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _documents(batch: int, seq: int, g: torch.Generator) -> TokenMeta:
    """Rows of 3 packed documents of random lengths, each row ending in padding of its own length."""
    seg = torch.zeros(batch, seq, dtype=torch.int32)
    for row in range(batch):
        for cut in sorted(torch.randperm(seq - 2, generator=g)[:2].add(1).tolist()):
            seg[row, cut:] += 1
        seg[row, seq - 9 * (row + 1):] = PAD_SEGMENT
    return TokenMeta.from_segments(seg)


def _layout(kind: str, batch: int, heads: int, seq: int, bs: int, meta: TokenMeta, g: torch.Generator):
    if kind == "random":  # arbitrary blocks and columns per query block
        return random_layout(batch, heads, seq, seq, bs, 0.3, 0.05, generator=g)
    if kind == "vertical_slash":  # per-head verticals inside the documents, diagonals
        return random_vertical_slash_layout(batch, heads, seq, bs, num_diagonals=-(-seq // bs) // 4, num_verticals=12,
                                            sink_tokens=3, meta=meta, generator=g)
    return dense_layout(meta, bs)


def _inputs(batch, hq, hk, seq, d, dtype, g):
    return [torch.randn(batch, h, seq, d, generator=g, dtype=torch.float64).to(dtype) for h in (hq, hk, hk)]


def _block_lists(kv_num, kv_idx, nk):
    dense = torch.zeros(*kv_num.shape, nk + 1, dtype=torch.bool)
    valid = torch.arange(kv_idx.shape[-1]) < kv_num.unsqueeze(-1)
    return dense.scatter_(-1, torch.where(valid, kv_idx.long(), nk), True)[..., :nk]


MASK_CASES = {  # layout kind, block size, layout heads (1: shared), sliding window
    "random-b16-per-head": ("random", 16, 4, None),
    "random-b64-shared-window": ("random", 64, 1, 45),
    "vs-b16-per-head": ("vertical_slash", 16, 4, None),
    "vs-b32-per-head-window": ("vertical_slash", 32, 4, 70),
    "vs-b256-per-head": ("vertical_slash", 256, 4, None),
    "dense-b128": ("dense", 128, 1, None),
}


@pytest.mark.parametrize("case", list(MASK_CASES))
def test_flex_masks_equal_the_layout_mask(case):
    """The pairs the Flex calls' mask_mods keep are exactly the layout's listed keys that are visible
    (documents, padding, causal order, window), blocks and columns each once; every kept pair lies in
    a block the BlockMask lists, and its full blocks hold only kept pairs (what compiled Flex relies on)."""
    from torch.nn.attention.flex_attention import create_mask

    kind, bs, layout_heads, window = MASK_CASES[case]
    g = torch.Generator().manual_seed(len(case))
    b, hq, hk, s = 2, 4, 2, 397
    meta = _documents(b, s, g)
    layout = _layout(kind, b, layout_heads, s, bs, meta, g)
    assert (int(layout.col_cnt.sum()) > 0) == (kind != "dense")  # every sparse case lists key columns
    expected = layout.to_mask(hq, s, s) & visible(meta, meta, window)

    calls = flex_calls(layout, meta, meta, hq, hk, sliding_window=window)
    assert len(calls) == (2 if int(layout.col_cnt.sum()) else 1)
    got = torch.zeros(b, hq, s, s, dtype=torch.int32)
    fb = max(bs, FLEX_BLOCK)
    for call in calls:
        bm = call.block_mask
        kv_len = s if call.keys is None else call.keys.shape[-1]
        mask = create_mask(bm.mask_mod, b, hq, s, kv_len, device="cpu")
        nq, nk = -(-s // fb), -(-kv_len // fb)
        partial = _block_lists(bm.kv_num_blocks, bm.kv_indices, nk)
        full = (_block_lists(bm.full_kv_num_blocks, bm.full_kv_indices, nk) if bm.full_kv_num_blocks is not None
                else torch.zeros_like(partial))
        assert not bool((partial & full).any())
        tiles = torch.nn.functional.pad(mask, (0, nk * fb - kv_len, 0, nq * fb - s)).view(b, hq, nq, fb, nk, fb)
        assert not bool(tiles.any(5).any(3)[~(partial | full)].any()), "a kept pair outside the listed blocks"
        edge = torch.zeros(nq * fb, nk * fb, dtype=torch.bool)
        edge[:s, :kv_len] = True
        whole = (tiles | ~edge.view(1, 1, nq, fb, nk, fb)).all(5).all(3)
        assert bool(whole[full].all()), "a full block with a pair the mask_mod drops"
        if call.keys is None:
            got += mask.int()
        else:  # buffer positions back to key tokens
            tokens = call.keys.repeat_interleave(hq // hk, 1).view(b, hq, 1, kv_len).expand(b, hq, s, kv_len)
            got.scatter_add_(-1, tokens, mask.int())
    assert int(got.max()) <= 1, "a pair computed twice"
    assert torch.equal(got.bool(), expected)


FORWARD_CASES = {  # layout kind, block size, dtype, window
    "vs-b32-fp64": ("vertical_slash", 32, torch.float64, None),
    "random-b16-fp32-window": ("random", 16, torch.float32, 60),
    "dense-b64-fp32": ("dense", 64, torch.float32, None),
}


@pytest.mark.parametrize("case", list(FORWARD_CASES))
def test_flex_forward_matches_the_reference(case):
    """attention_forward and block_sparse_attention (no autograd) with the flex engine against the fp64
    reference, on packed documents with padding, GQA, columns."""
    kind, bs, dtype, window = FORWARD_CASES[case]
    g = torch.Generator().manual_seed(3 + len(case))
    b, hq, hk, s, d = 2, 4, 2, 301, 16
    meta = _documents(b, s, g)
    layout = _layout(kind, b, hq, s, bs, meta, g)
    q, k, v = _inputs(b, hq, hk, s, d, dtype, g)
    scale = d**-0.5
    ref_out, ref_lse = reference_forward(
        AttentionCall(q.double(), k.double(), v.double(), layout, scale, meta, meta, window))
    out, lse = attention_forward(AttentionCall(q, k, v, layout, scale, meta, meta, window), implementation="flex")
    seen = torch.isfinite(ref_lse)
    assert out.dtype == lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(torch.isfinite(lse), seen) and bool((out[~seen] == 0).all())
    assert rel_rms(out, ref_out) <= TOLERANCE[dtype]
    assert rel_rms(lse, ref_lse, seen) <= TOLERANCE[dtype]  # natural log, like the reference's
    with torch.no_grad():
        public, public_lse = block_sparse_attention(q, k, v, layout, q_meta=meta, sliding_window=window,
                                                    implementation="flex")
    assert public.dtype == dtype
    assert rel_rms(public, ref_out) <= TOLERANCE[dtype] and rel_rms(public_lse, ref_lse, seen) <= TOLERANCE[dtype]


def test_flex_parts_over_key_ranges_merge_into_the_whole():
    """Like ring steps: Flex over two key ranges of a layout (the first a fresh result, the second merged
    into it by attention_forward) gives the whole layout's result; and Flex's lse merges with the
    reference's through merge_attention (the same log-sum-exp convention)."""
    g = torch.Generator().manual_seed(11)
    b, hq, hk, s, d, bs, cut = 1, 4, 2, 256, 16, 32, 96
    meta = _documents(b, s, g)
    layout = _layout("vertical_slash", b, hq, s, bs, meta, g)
    q, k, v = _inputs(b, hq, hk, s, d, torch.float64, g)
    ref_out, ref_lse = reference_forward(AttentionCall(q, k, v, layout, 0.25, meta, meta))
    keys = lambda lo, hi: TokenMeta(meta.index[:, lo:hi], meta.segment[:, lo:hi])
    first, second = key_range(layout, 0, cut), key_range(layout, cut, s)
    out, lse = attention_forward(AttentionCall(q, k[:, :, :cut], v[:, :, :cut], first, 0.25, meta, keys(0, cut)),
                                 implementation="flex")
    merged = attention_forward(AttentionCall(q, k[:, :, cut:], v[:, :, cut:], second, 0.25, meta, keys(cut, s)),
                               out=out.clone(), lse=lse.clone(), implementation="flex")
    mixed = merge_attention(out, lse,
                            *reference_forward(AttentionCall(q, k[:, :, cut:], v[:, :, cut:], second, 0.25, meta,
                                                             keys(cut, s))))
    seen = torch.isfinite(ref_lse)
    for got_out, got_lse in (merged, mixed):
        assert rel_rms(got_out, ref_out) <= TOLERANCE[torch.float64]
        assert torch.equal(torch.isfinite(got_lse), seen)
        assert rel_rms(got_lse, ref_lse, seen) <= TOLERANCE[torch.float64]


def test_merge_is_differentiable_with_finite_gradients_where_nothing_was_seen():
    """The Flex engine merges its two calls under autograd: gradcheck of merge_attention in fp64, and
    finite gradients (zero for the out of a part that saw nothing) on queries with no key in a part
    or in both."""
    g = torch.Generator().manual_seed(5)
    out_a, out_b = (torch.randn(2, 3, 6, 4, generator=g, dtype=torch.float64) for _ in range(2))
    lse_a, lse_b = (torch.randn(2, 3, 6, generator=g, dtype=torch.float64) for _ in range(2))
    leaves = [t.requires_grad_() for t in (out_a, lse_a, out_b, lse_b)]
    assert torch.autograd.gradcheck(merge_attention, leaves)

    empty_a, empty_b = torch.zeros(2, 3, 6, dtype=torch.bool), torch.zeros(2, 3, 6, dtype=torch.bool)
    empty_a[..., :2], empty_b[..., 1:3] = True, True  # query 1 sees nothing in either part
    parts = []
    for out, lse, empty in ((out_a, lse_a, empty_a), (out_b, lse_b, empty_b)):
        parts += [torch.where(empty.unsqueeze(-1), 0.0, out.detach()).requires_grad_(),
                  torch.where(empty, float("-inf"), lse.detach()).requires_grad_()]
    merged_out, merged_lse = merge_attention(*parts)
    assert bool((merged_out[..., 1, :] == 0).all()) and bool((merged_lse[..., 1] == float("-inf")).all())
    loss = (merged_out * torch.randn(merged_out.shape, generator=g, dtype=torch.float64)).sum()
    loss = loss + merged_lse.masked_fill(merged_lse.isinf(), 0.0).sum()
    grads = torch.autograd.grad(loss, parts)
    assert all(bool(torch.isfinite(x).all()) for x in grads)
    assert bool((grads[0][empty_a] == 0).all()) and bool((grads[2][empty_b] == 0).all())


def test_flex_gradients_on_cpu_are_refused_with_the_fix():
    g = torch.Generator().manual_seed(2)
    meta = TokenMeta.contiguous(1, 128)
    q, k, v = (x.requires_grad_() for x in _inputs(1, 2, 1, 128, 16, torch.float32, g))
    with pytest.raises(ValueError, match="CUDA only.*implementation='reference'"):
        block_sparse_attention(q, k, v, dense_layout(meta, 32), implementation="flex")


def test_tiny_model_with_the_flex_engine_matches_the_reference_engine(monkeypatch):
    """The setting reaches the backend: a tiny Llama's logits under sparse_cp with attention_engine='flex'
    (which runs Flex in both layers, the dense first one and the sparse one) equal those with 'reference'
    (no autograd: Flex's CPU path is forward only)."""
    from transformers import AutoModelForCausalLM

    import hf_sparse_cp
    from hf_sparse_cp.attention import engines
    from hf_sparse_cp.testing.tiny_models import tiny_config

    calls = []
    flex = engines.flex_block_sparse_attention
    monkeypatch.setattr(engines, "flex_block_sparse_attention", lambda call: calls.append(call.layout) or flex(call))
    hf_sparse_cp.patch()
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=2),
                                                 attn_implementation="sparse_cp").eval()
        ids = torch.randint(0, model.config.vocab_size, (1, 192), generator=torch.Generator().manual_seed(1))
        logits = {}
        for engine in ("flex", "reference"):
            hf_sparse_cp.configure(model, SparseAttentionConfig(
                attention_engine=engine, block_size=16, min_seq_len=64, vertical_topk=16, slash_topk=2,
                sink_tokens=4, local_window=8, last_q=16, dense_first_layers=1))
            with torch.no_grad():
                logits[engine] = model(input_ids=ids).logits
    finally:
        hf_sparse_cp.unpatch()
    assert len(calls) == 2 and int(calls[1].col_cnt.sum()) > 0  # layer 1 sparse, with columns
    assert rel_rms(logits["flex"], logits["reference"]) <= TOLERANCE[torch.float32]


# ---- the engine setting ----------------------------------------------------------------------------


def test_engine_field_is_typed_and_validated():
    assert SparseAttentionConfig().attention_engine == "auto"
    assert SparseAttentionConfig(attention_engine="flex").attention_engine == "flex"
    with pytest.raises(ValueError, match="attention_engine.*'triton'"):
        SparseAttentionConfig(attention_engine="cuda")
    assert SparseAttentionConfig.from_dict({"attention_engine": "triton"}).attention_engine == "triton"


def test_environment_variable_replaces_auto_only(monkeypatch):
    q = torch.zeros(1, 2, 64, 16)
    layout = dense_layout(TokenMeta.contiguous(1, 64), 32)
    assert engines.resolve_engine(q, layout) == "reference"  # auto off CUDA
    monkeypatch.setenv(engines.ENGINE_ENV, "flex")
    assert engines.resolve_engine(q, layout) == "flex"
    assert engines.resolve_engine(q, layout, "reference") == "reference"  # an explicit setting wins
    monkeypatch.setenv(engines.ENGINE_ENV, "fastest")
    with pytest.raises(ValueError, match="HF_SPARSE_CP_ATTENTION_ENGINE.*'flex'"):
        engines.resolve_engine(q, layout)
    with pytest.raises(ValueError, match="implementation='cuda' is unknown"):
        engines.resolve_engine(q, layout, "cuda")


def _table(device="GPU X", rows=None) -> dict:
    def row(seq_len, kept, columns, triton_ms, flex_ms, head_dim=128):
        return {"seq_len": seq_len, "kept_fraction": kept, "has_columns": columns, "head_dim": head_dim,
                "triton_ms": triton_ms, "flex_ms": flex_ms}

    rows = rows if rows is not None else [
        row(32768, 0.05, True, 1.0, 2.0), row(32768, 0.20, True, 3.0, 2.0), row(32768, 1.0, False, 9.0, 8.0),
        row(131072, 0.05, True, 4.0, 3.0), row(131072, 1.0, False, 90.0, 95.0),
    ]
    return {"kind": engines.TABLE_KIND, "device": device, "rows": rows}


@pytest.mark.parametrize("seq_len,kept,columns,head_dim,expected", [
    (32768, 0.06, True, 128, "triton"),   # a layout with columns: the kernels, whatever the table says
    (32768, 0.15, True, 128, "triton"),   # ... where its row says Flex was faster too
    (40000, 0.9, False, 128, "flex"),     # the rows without columns, nearest length 32K
    (100000, 0.9, False, 128, "triton"),  # ... nearest length 128K
    (262144, 0.5, False, 64, "triton"),   # no row of head_dim 64: the default
    (40000, 0.9, False, 64, "triton"),    # ... even where the nearest row of another head_dim says Flex
])
def test_auto_picks_the_faster_engine_of_the_nearest_measured_shape(seq_len, kept, columns, head_dim, expected):
    shape = engines.CallShape(seq_len, kept, columns, head_dim)
    assert engines.pick_from_table(_table(), "GPU X", shape) == expected


def test_auto_default_without_a_table_for_this_gpu():
    shape = engines.CallShape(32768, 1.0, False, 128)
    assert engines.pick_from_table(None, "GPU X", shape) == engines.DEFAULT_ENGINE == "triton"
    assert engines.pick_from_table(_table(device="GPU Y"), "GPU X", shape) == "triton"
    assert engines.pick_from_table(_table(rows=[]), "GPU X", shape) == "triton"


def test_engine_table_file_is_read_checked_and_reread(tmp_path, monkeypatch):
    path = tmp_path / "table.json"
    monkeypatch.setenv(engines.TABLE_ENV, str(path))
    with pytest.raises(ValueError, match="does not exist"):
        engines.engine_table()
    path.write_text(json.dumps({"kind": "something else", "rows": []}))
    with pytest.raises(ValueError, match="not an engine table"):
        engines.engine_table()
    path.write_text(json.dumps(_table()))
    assert engines.engine_table()["device"] == "GPU X"
    path.write_text(json.dumps(_table(device="GPU Z")))
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))  # a later write, whatever the clock's grain
    assert engines.engine_table()["device"] == "GPU Z"
    monkeypatch.delenv(engines.TABLE_ENV)
    assert engines.engine_table() is None


def test_call_shape_of_a_layout():
    meta = TokenMeta.contiguous(1, 256)
    q = torch.zeros(1, 4, 256, 64)
    shape = engines.CallShape.of(q, dense_layout(meta, 32))
    assert shape == engines.CallShape(256, 1.0, False, 64)
    g = torch.Generator().manual_seed(1)
    sparse = random_vertical_slash_layout(1, 4, 256, 32, num_diagonals=1, num_verticals=8, generator=g)
    shape = engines.CallShape.of(q, sparse)
    assert shape.has_columns and 0 < shape.kept_fraction < 1
    assert math.isclose(shape.kept_fraction, float(sparse.kept_fraction()))



def test_engines_are_registered_objects_and_each_choice_is_logged_once(caplog):
    """Every engine takes the call as one `AttentionCall`; the ops dispatch to the registered object; the
    engine chosen for a reason is logged the first time only."""
    assert engines.engine_settings() == ("auto", "triton", "flex", "reference", "masked")
    assert all(isinstance(e, engines.Engine) and e.name == name for name, e in engines.ENGINES.items())
    assert "named only" in engines.ENGINES["masked"].declines(torch.zeros(1, 1, 1, 8))  # never chosen by 'auto'
    engines._logged.cache_clear()
    q, k, v = (torch.randn(1, 2, 64, 16, generator=torch.Generator().manual_seed(i)) for i in range(3))
    meta = TokenMeta.contiguous(1, 64)
    layout = dense_layout(meta, 16)
    with caplog.at_level("INFO", logger="hf_sparse_cp.attention.engines"):
        for _ in range(3):
            out, lse = attention_forward(AttentionCall(q, k, v, layout, 0.25, meta, meta))
    # the choice is logged once, with why the registry's other engines declined the call
    lines = [line for line in caplog.text.splitlines() if "Block-sparse attention engine: reference (auto;" in line]
    assert len(lines) == 1
    assert all(f"{name} declined: {engine.declines(q)}" in lines[0]
               for name, engine in engines.ENGINES.items() if name != "reference")
    want = engines.ENGINES["reference"].part(AttentionCall(q, k, v, layout, 0.25, meta, meta))
    assert torch.equal(out, want[0]) and torch.equal(lse, want[1])
