"""The compiled Triton kernels on a GPU, at realistic sizes, against the fp64 PyTorch reference.

Attention: bf16 and fp16, head_dim 64 and 128 (160 and 256: their own tiles), fp32 at 128 and 256, GQA 1/2/4/8,
4K-32K tokens (odd lengths included),
per-head vertical-slash layouts with columns (their gradients in the dq loop, in their own pass and
from the key-major column kernel), sliding windows, packed documents with padding (some with rows
mostly masked, through blocks and through columns), merging into an existing result (and the
backward of each part), bitwise reproducibility, the dispatch of `hf_sparse_cp.attention.ops` (and
its warned fallback to the reference), torch.compile of the custom ops, and the `sparse_cp` model
backend on CUDA (against sdpa, and against its own reference path).
Estimation: the scoring kernels against their reference, reproducible to the bit, and the layout
`estimate_layout` builds on CUDA equal to the one it builds on CPU.

Tensors are created on `DEVICE` with lengths from `SIZES`.
"""

import pytest
import torch

from hf_sparse_cp.attention import estimate as pattern
from hf_sparse_cp.attention import ops as public_ops
from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.call import AttentionCall
from hf_sparse_cp.attention.layout import SparseLayout, compact_sorted
from hf_sparse_cp.attention.reference import reference_backward, reference_forward, reference_vertical_slash
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.config import SparseAttentionConfig
from hf_sparse_cp.kernels import configs
from hf_sparse_cp.kernels import ops as kops
from hf_sparse_cp.kernels import vertical_slash as vs
from hf_sparse_cp.simulator.workloads import random_vertical_slash_layout
from hf_sparse_cp.testing.layouts import planted_qk, random_layout

from oracle import TOLERANCE, kernel_backward, kernel_forward, key_range, rel_rms

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
SIZES = {"short": 4096, "mid": 8192, "odd": 8191, "long": 16384, "longest": 32768, "model": 4096}
BLOCK = 128


def _inputs(b, hq, hk, s, d, dtype, seed):
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    make = lambda h: torch.randn(b, h, s, d, generator=g, device=DEVICE).to(dtype)
    return make(hq), make(hk), make(hk), make(hq), torch.randn(b, hq, s, generator=g, device=DEVICE)


def _docs(s, seed, num_docs=8, pad=37):
    """One row of `num_docs` packed documents of random lengths and a padded tail, on the CPU."""
    g = torch.Generator().manual_seed(seed)
    seg = torch.zeros(1, s, dtype=torch.int32)
    for cut in torch.randperm(s - pad - 1, generator=g)[: num_docs - 1].add(1).tolist():
        seg[:, cut:] += 1
    seg[:, s - pad :] = -1
    return TokenMeta.from_segments(seg)


def _layout(kind, b, heads, s, seed, meta=None):
    """A random layout on DEVICE; vertical-slash diagonals stay inside the documents of `meta` (CPU)."""
    g = torch.Generator().manual_seed(seed)
    if kind == "vertical_slash":  # ~10% of the block diagonals and ~1% of the tokens as columns, per head
        nb = -(-s // BLOCK)
        layout = random_vertical_slash_layout(b, heads, s, BLOCK, num_diagonals=max(2, nb // 10) - 1,
                                              num_verticals=max(8, s // 100), meta=meta, generator=g)
    else:
        layout = random_layout(b, heads, s, s, BLOCK, 0.1, 0.002, generator=g)
    return layout.to(DEVICE)


def _check(q, k, v, dout, dlse, layout, meta, window=None):
    """Kernel forward and backward equal the fp64 reference; returns the kernel results."""
    scale = q.shape[-1] ** -0.5
    out, lse = kernel_forward(AttentionCall(q, k, v, layout, scale, meta, meta, window))
    f64 = [x.double() for x in (q, k, v)]
    ref_out, ref_lse = reference_forward(AttentionCall(*f64, layout, scale, meta, meta, window))
    tol = TOLERANCE[q.dtype]
    seen = torch.isfinite(ref_lse)
    assert not bool(out.isnan().any() or lse.isnan().any())
    assert rel_rms(out, ref_out) <= tol
    assert torch.equal(torch.isfinite(lse), seen)
    assert rel_rms(lse, ref_lse, seen) <= tol
    assert bool((out[~seen] == 0).all())
    out_q = out.to(q.dtype)
    grads = kernel_backward(AttentionCall(q, k, v, layout, scale, meta, meta, window), out_q, lse, dout, dlse=dlse)
    ref_grads = reference_backward(AttentionCall(*f64, layout, scale, meta, meta, window), out_q.double(),
                                   lse.double(), dout.double(), dlse=dlse.double())
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert bool(torch.isfinite(got).all()), name
        assert rel_rms(got, ref) <= 2 * tol, name
    return out, lse, grads


# ---- attention kernels ---------------------------------------------------------------------------

CASES = {  # query heads, key/value heads, size, head_dim, dtype, layout, packed documents
    "gqa8-16K-d128-bf16-vs": (16, 2, "long", 128, torch.bfloat16, "vertical_slash", False),
    "gqa8-16K-d128-fp16-vs": (16, 2, "long", 128, torch.float16, "vertical_slash", False),
    "gqa8-32K-d128-bf16-vs": (16, 2, "longest", 128, torch.bfloat16, "vertical_slash", False),
    "gqa8-8191-d128-fp16-vs-docs": (16, 2, "odd", 128, torch.float16, "vertical_slash", True),
    "gqa8-8191-d64-bf16-vs-docs": (16, 2, "odd", 64, torch.bfloat16, "vertical_slash", True),
    "gqa2-8191-d64-bf16-random": (8, 4, "odd", 64, torch.bfloat16, "random", False),
    "mha-8191-d64-fp16-vs": (8, 8, "odd", 64, torch.float16, "vertical_slash", False),
    "mha-8K-d128-bf16-random-docs": (4, 4, "mid", 128, torch.bfloat16, "random", True),
    # heads above 128 lanes (configs.WIDE_HEAD_TILES): Gemma 3's 4/1 heads of 256, a 160-lane head; fp32's own tiles
    "gqa4-8191-d256-bf16-vs-docs": (4, 1, "odd", 256, torch.bfloat16, "vertical_slash", True),
    "gqa2-4K-d160-fp16-vs": (4, 2, "short", 160, torch.float16, "vertical_slash", False),
    "gqa4-4K-d256-fp32-vs-docs": (4, 1, "short", 256, torch.float32, "vertical_slash", True),
    "gqa8-8191-d128-fp32-vs-docs": (16, 2, "odd", 128, torch.float32, "vertical_slash", True),  # configs.FP32_TILES
}


@pytest.mark.parametrize("case", list(CASES))
def test_kernels_match_the_reference(case):
    hq, hk, size, d, dtype, kind, docs = CASES[case]
    s = SIZES[size]
    q, k, v, dout, dlse = _inputs(1, hq, hk, s, d, dtype, seed=len(case))
    meta = _docs(s, seed=hq + d) if docs else TokenMeta.contiguous(1, s)
    layout = _layout(kind, 1, hq, s, seed=hq + hk, meta=meta)
    assert int(layout.col_cnt.sum()) > 0
    _check(q, k, v, dout, dlse, layout, meta.to(DEVICE))


@pytest.mark.parametrize("override", [
    {"dq": configs.Tiles(128, 64, 64, 8, 3)}, {"dq": configs.Tiles(128, 64, 64, 8, 3, separate_columns=True)},
    {"columns": configs.Tiles(64, 0, 64, 8, 2, query_steps=16)}],
    ids=["columns-in-dq-loop", "separate-column-pass", "key-major-column-kernel"])
def test_every_form_of_the_column_gradients_matches_the_reference(override):
    """The columns' dk/dv inside the dq loop, in their own pass of the dq kernel, and from the key-major
    column kernel (`column_bwd`; tuning may pick any), head_dim 128, bf16, per-head columns."""
    s = SIZES["long"]
    q, k, v, dout, dlse = _inputs(1, 16, 2, s, 128, torch.bfloat16, seed=9)
    layout = _layout("vertical_slash", 1, 16, s, seed=10)
    assert int(layout.col_cnt.sum()) > 0
    with configs.tiles_override(**override):
        _check(q, k, v, dout, dlse, layout, TokenMeta.contiguous(1, s, DEVICE))


@pytest.mark.parametrize("kv_descriptors", [False, True], ids=["pointer-loads", "tma"])
def test_the_tile_major_grid_matches_the_reference(kv_descriptors):
    """The forward and dq in FlexAttention's grid order (`Tiles.tile_major`, the quick call's candidates), with the
    key-major column kernel as tuning may pair them: head_dim 128, bf16, per-head columns, packed documents."""
    s = SIZES["long"]
    q, k, v, dout, dlse = _inputs(1, 16, 2, s, 128, torch.bfloat16, seed=11)
    meta = _docs(s, seed=12)
    layout = _layout("vertical_slash", 1, 16, s, seed=13, meta=meta)
    tiles = configs.Tiles(128, 64, 64, 8, 3, kv_descriptors=kv_descriptors, tile_major=True)
    with configs.tiles_override(forward=tiles, dq=tiles, columns=configs.Tiles(64, 0, 64, 8, 2, query_steps=16)):
        _check(q, k, v, dout, dlse, layout, meta.to(DEVICE))


def test_lean_index_matches_the_reference():
    """The quick call's `Tiles.lean_index` candidates (`configs.SHORTLIST`: int32 row offsets, unmasked loads of whole
    blocks, packed dk/dv CSR entries) for all three kernels at once: head_dim 128, bf16, per-head columns, packed
    documents."""
    s = SIZES["long"]
    q, k, v, dout, dlse = _inputs(1, 16, 2, s, 128, torch.bfloat16, seed=14)
    meta = _docs(s, seed=15)
    layout = _layout("vertical_slash", 1, 16, s, seed=16, meta=meta)
    lean = {kernel: next(t for t in configs.SHORTLIST[kernel] if t.lean_index) for kernel in configs.KERNELS}
    with configs.tiles_override(**lean):
        _check(q, k, v, dout, dlse, layout, meta.to(DEVICE))


def test_sliding_window_batch_of_two_d64_bf16():
    s = SIZES["odd"]
    q, k, v, dout, dlse = _inputs(2, 4, 2, s, 64, torch.bfloat16, seed=2)
    meta = TokenMeta.contiguous(2, s, DEVICE)
    _check(q, k, v, dout, dlse, dense_layout(meta, 64, sliding_window=s // 12), meta, window=s // 12)


def _every_causal_block(s):
    nb = s // BLOCK
    blk = torch.arange(nb, dtype=torch.int32, device=DEVICE).expand(1, 1, nb, nb)
    valid = blk <= torch.arange(nb, device=DEVICE).view(1, 1, -1, 1)
    block_idx, block_cnt = compact_sorted(blk, valid)
    empty = torch.empty(1, 1, nb, 0, dtype=torch.int32, device=DEVICE)
    return SparseLayout(block_idx, block_cnt, empty, torch.zeros_like(block_cnt), BLOCK)


@pytest.mark.parametrize("layout_kind", ["every_causal_block", "vertical_slash"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_long_rows_of_masked_keys_give_no_nan(dtype, layout_kind):
    """Many short packed documents and a padded tail under a layout that lists every causal block, or
    per-head diagonals and columns drawn without regard to the documents: almost every listed tile
    and column is invisible, whole rows of tiles are masked, padding sees nothing."""
    s = SIZES["mid"]
    q, k, v, dout, dlse = _inputs(1, 8, 2, s, 128, dtype, seed=4)
    seg = torch.div(torch.arange(s), 61, rounding_mode="floor").to(torch.int32).unsqueeze(0)
    seg[:, -300:] = -1
    meta = TokenMeta.from_segments(seg)
    layout = _every_causal_block(s) if layout_kind == "every_causal_block" else _layout(layout_kind, 1, 8, s, seed=4)
    _, lse, _ = _check(q, k, v, dout, dlse, layout, meta.to(DEVICE))
    assert bool((lse[:, :, -300:] == float("-inf")).all())


def test_merge_into_existing_result_and_backward_per_part():
    """Two key halves of a per-head layout with columns, the second merged in place into the first's
    (out, lse), equal the whole; each half's backward from the final (out, lse) is its share of the
    whole gradient (what a ring step does). Packed documents with padding, an odd length (the second
    half ends in a partial block)."""
    s = SIZES["odd"]
    q, k, v, dout, dlse = _inputs(1, 16, 2, s, 128, torch.bfloat16, seed=5)
    cpu_meta = _docs(s, seed=5)
    full = _layout("vertical_slash", 1, 16, s, seed=5, meta=cpu_meta)
    meta = cpu_meta.to(DEVICE)
    half = s // 2 // BLOCK * BLOCK
    parts = [(lo, hi, key_range(full, lo, hi), TokenMeta(meta.index[:, lo:hi], meta.segment[:, lo:hi]))
             for lo, hi in ((0, half), (half, s))]
    out, lse = None, None
    for lo, hi, lay, km in parts:
        out, lse = kernel_forward(AttentionCall(q, k[:, :, lo:hi], v[:, :, lo:hi], lay, 0.1, meta, km), out=out,
                                  lse=lse)
    f64 = [x.double() for x in (q, k, v)]
    ref_out, ref_lse = reference_forward(AttentionCall(*f64, full, 0.1, meta, meta))
    tol = TOLERANCE[torch.bfloat16]
    seen = torch.isfinite(ref_lse)
    assert not bool(seen.all()) and torch.equal(torch.isfinite(lse), seen)  # padding stays empty through the merge
    assert rel_rms(out, ref_out) <= tol and rel_rms(lse, ref_lse, seen) <= tol
    ref_dq, ref_dk, ref_dv = reference_backward(AttentionCall(*f64, full, 0.1, meta, meta), out.double(), lse.double(),
                                                dout.double(), dlse=dlse.double())
    dq_sum = torch.zeros_like(ref_dq)
    for lo, hi, lay, km in parts:
        dq, dk, dv = kernel_backward(AttentionCall(q, k[:, :, lo:hi], v[:, :, lo:hi], lay, 0.1, meta, km), out, lse,
                                     dout, dlse=dlse)
        dq_sum += dq.double()
        assert rel_rms(dk, ref_dk[:, :, lo:hi]) <= 2 * tol and rel_rms(dv, ref_dv[:, :, lo:hi]) <= 2 * tol
    assert rel_rms(dq_sum, ref_dq) <= 2 * tol


def test_deterministic_mode_is_bitwise_reproducible():
    s = SIZES["long"]
    q, k, v, dout, dlse = _inputs(1, 16, 2, s, 128, torch.bfloat16, seed=6)
    meta = TokenMeta.contiguous(1, s, DEVICE)
    layout = _layout("vertical_slash", 1, 16, s, seed=7)
    out, lse = kernel_forward(AttentionCall(q, k, v, layout, 0.1, meta, meta))
    out2, lse2 = kernel_forward(AttentionCall(q, k, v, layout, 0.1, meta, meta))
    assert torch.equal(out, out2) and torch.equal(lse, lse2)  # the forward has no atomics
    args = (AttentionCall(q, k, v, layout, 0.1, meta, meta), out.to(q.dtype), lse, dout)
    first = kernel_backward(*args, dlse=dlse, deterministic=True)
    again = kernel_backward(*args, dlse=dlse, deterministic=True)
    atomic = kernel_backward(*args, dlse=dlse, deterministic=False)
    for name, a, b_, c in zip(("dq", "dk", "dv"), first, again, atomic):
        assert torch.equal(a, b_), name
        assert rel_rms(c, a) <= 1e-5, name


def test_public_function_dispatches_to_the_kernels(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("CUDA bf16 inputs must not reach the PyTorch reference")

    s = SIZES["short"]
    q, k, v, dout, _ = _inputs(1, 8, 2, s, 128, torch.bfloat16, seed=8)
    layout = _layout("random", 1, 8, s, seed=9)
    meta = TokenMeta.contiguous(1, s, DEVICE)
    ref_out, _ = reference_forward(AttentionCall(q.double(), k.double(), v.double(), layout, 128**-0.5, meta, meta))
    monkeypatch.setattr(public_ops, "reference_forward", refuse)
    monkeypatch.setattr(public_ops, "reference_backward", refuse)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = public_ops.block_sparse_attention(q, k, v, layout)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert rel_rms(out, ref_out) <= TOLERANCE[torch.bfloat16]
    (out.float() * dout.float()).sum().backward()
    assert all(t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


@pytest.mark.parametrize("dtype,d,reason",
                         [(torch.float64, 64, "dtype torch.float64"), (torch.bfloat16, 288, "head_dim 288")],
                         ids=["fp64", "d288"])
def test_inputs_the_kernels_cannot_take_use_the_reference_and_say_so(dtype, d, reason):
    s = SIZES["short"] // 4
    q, k, v, _, _ = _inputs(1, 4, 2, s, d, dtype, seed=12)
    layout = _layout("random", 1, 4, s, seed=12)
    meta = TokenMeta.contiguous(1, s, DEVICE)
    with pytest.warns(UserWarning, match=f"PyTorch reference \\(slow\\) for {reason}"):
        out, _ = public_ops.block_sparse_attention(q, k, v, layout)
    ref_out, _ = reference_forward(AttentionCall(q, k, v, layout, d**-0.5, meta, meta))
    assert torch.equal(out, ref_out.to(dtype))


def test_torch_compile_traces_the_custom_ops():
    """Forward, merge-in-place and backward ops under torch.compile(fullgraph=True) give the eager bits."""
    s = SIZES["short"] // 2
    q, k, v, dout, dlse = _inputs(1, 8, 2, s, 64, torch.bfloat16, seed=10)
    meta = TokenMeta.contiguous(1, s, DEVICE)
    layout = _layout("random", 1, 8, s, seed=11)

    def attend(q, k, v):
        call = AttentionCall(q, k, v, layout, 0.125, meta, meta)
        out, lse = kernel_forward(call)
        return kernel_forward(call, out=out.clone(), lse=lse.clone())

    def grads(q, k, v, out, lse, dout, dlse):
        return kernel_backward(AttentionCall(q, k, v, layout, 0.125, meta, meta), out, lse, dout, dlse=dlse,
                               deterministic=True)

    eager = attend(q, k, v)
    compiled = torch.compile(attend, fullgraph=True)(q, k, v)
    for a, b_ in zip(eager, compiled):
        assert torch.equal(a, b_)
    args = (q, k, v, eager[0].to(q.dtype), eager[1], dout, dlse)
    for a, b_ in zip(grads(*args), torch.compile(grads, fullgraph=True)(*args)):
        assert torch.equal(a, b_)


# ---- the sparse_cp backend on CUDA ----------------------------------------------------------------

def _tiny_model(attn_implementation="sdpa", dtype=torch.float32, vocab_size=512):
    from transformers import AutoModelForCausalLM

    from hf_sparse_cp.testing.tiny_models import tiny_config

    torch.manual_seed(0)
    config = tiny_config("llama", vocab_size=vocab_size)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn_implementation, dtype=dtype).to(DEVICE)


def _logits_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.float(), [p.grad.float() for p in model.parameters()]


@pytest.mark.parametrize("pattern_name", ["dense", "vertical_slash"])
def test_model_under_sparse_cp_uses_the_kernels_and_matches_the_reference_path(monkeypatch, pattern_name):
    """A tiny fp32 Llama: the sparse_cp backend through the kernels gives the logits and gradients of the
    same backend through the PyTorch reference. fp32 (exact products in the kernels) keeps every layer's
    estimated layout identical in both runs; bf16 is checked against sdpa below."""
    import hf_sparse_cp

    s = SIZES["model"]
    hf_sparse_cp.patch()
    try:
        model = _tiny_model()
        hf_sparse_cp.configure(model, SparseAttentionConfig(
            pattern=pattern_name, block_size=64, min_seq_len=s // 4, vertical_topk=64, slash_topk=128,
            local_window=64, sink_tokens=16))
        ids = torch.randint(0, 512, (1, s), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(1))
        calls = []
        triton_forward = kops.triton_forward
        monkeypatch.setattr(kops, "triton_forward", lambda *a, **kw: calls.append(1) or triton_forward(*a, **kw))
        logits, grads = _logits_and_grads(model, ids)
        assert calls, "the sparse_cp backend did not reach the Triton kernels"
        monkeypatch.setattr(public_ops, "resolve_engine", lambda q, layout, implementation="auto": "reference")
        ref_logits, ref_grads = _logits_and_grads(model, ids)
    finally:
        hf_sparse_cp.unpatch()
    tol = TOLERANCE[torch.float32]
    assert rel_rms(logits, ref_logits) <= tol
    for got, ref in zip(grads, ref_grads):
        assert rel_rms(got, ref) <= 4 * tol


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_model_under_sparse_cp_matches_sdpa(dtype):
    """Dense pattern: sparse_cp through the kernels against sdpa on CUDA. Both runs at `dtype` are compared
    with an fp32 sdpa run: sparse_cp's error is at most twice sdpa's own (plus fp32 rounding), for the
    loss, the logits and every gradient."""
    import hf_sparse_cp

    s = SIZES["model"]
    ids = torch.randint(0, 512, (1, s), device=DEVICE, generator=torch.Generator(DEVICE).manual_seed(2))
    hf_sparse_cp.patch()
    try:
        runs = {}
        for name, impl, dt in (("truth", "sdpa", torch.float32), ("sdpa", "sdpa", dtype), ("ours", "sdpa", dtype)):
            model = _tiny_model(impl, dt)
            if name == "ours":
                hf_sparse_cp.configure(model, SparseAttentionConfig(pattern="dense", block_size=64))
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            runs[name] = (out.loss.detach().float(), out.logits.detach().float(),
                          [p.grad.float() for p in model.parameters()])
    finally:
        hf_sparse_cp.unpatch()
    (t_loss, t_logits, t_grads), (s_loss, s_logits, s_grads), (o_loss, o_logits, o_grads) = (
        runs["truth"], runs["sdpa"], runs["ours"])
    floor = TOLERANCE[torch.float32]
    assert abs(float(o_loss - t_loss)) <= 2 * abs(float(s_loss - t_loss)) + floor * abs(float(t_loss))
    assert rel_rms(o_logits, t_logits) <= 2 * rel_rms(s_logits, t_logits) + floor
    for ours, sdpa, truth in zip(o_grads, s_grads, t_grads):
        assert rel_rms(ours, truth) <= 2 * rel_rms(sdpa, truth) + 4 * floor


# ---- estimation ------------------------------------------------------------------------------------

def test_scoring_kernel_matches_the_reference_and_is_reproducible():
    """Qwen2.5-3B geometry (16 query heads, 2 key heads, d=128), bf16, 64 scoring queries over 32K keys."""
    s = SIZES["longest"]
    g = torch.Generator(device=DEVICE).manual_seed(12)
    q_rows = (2 * torch.randn(16, 64, 128, generator=g, device=DEVICE)).bfloat16()
    k = torch.randn(2, s, 128, generator=g, device=DEVICE).bfloat16()
    vertical, slash = vs.vertical_slash_scores(q_rows, k, 128**-0.5)
    again = vs.vertical_slash_scores(q_rows, k, 128**-0.5)
    assert torch.equal(vertical, again[0]) and torch.equal(slash, again[1])
    ref_v, ref_s = reference_vertical_slash(q_rows.double(), k.double(), 128**-0.5)
    assert rel_rms(vertical, ref_v) <= 1e-4 and rel_rms(slash, ref_s) <= 1e-4


def test_estimated_layout_on_cuda_equals_the_cpu_one():
    """Planted columns and diagonals in the long document of a 32K-token row, budgets equal to the plants:
    the layout built on CUDA (scoring kernels, vectorized construction) is the one built on CPU (PyTorch
    scoring), and it holds every plant."""
    s, hq, hk = SIZES["longest"], 4, 4  # one key head per query head: plants of a GQA group would blur each other
    start = s // 8  # a short document [0, start), then the long one
    g = torch.Generator().manual_seed(13)
    verticals = [sorted((start + torch.randperm(s - start, generator=g)[:2]).tolist()) for _ in range(hq)]
    offsets = [torch.randint(1, s // 2, (1,), generator=g).tolist() for _ in range(hq)]
    q, k = planted_qk(hq, hk, s, 128, verticals, offsets, generator=g)
    seg = torch.zeros(1, s, dtype=torch.int32)
    seg[:, start:] = 1
    cfg = SparseAttentionConfig(vertical_topk=2, slash_topk=1, min_seq_len=s // 4)
    cpu = pattern.estimate_layout(q, k, cfg, TokenMeta.from_segments(seg))
    dev = pattern.estimate_layout(q.to(DEVICE), k.to(DEVICE), cfg, TokenMeta.from_segments(seg.to(DEVICE)))
    for name in ("block_idx", "block_cnt", "col_idx", "col_cnt"):
        assert torch.equal(getattr(dev, name).cpu(), getattr(cpu, name)), name
    bs = cfg.block_size
    for h in range(hq):  # the last query block lists every plant (as a column or inside a listed block)
        listed = set(cpu.col_idx[0, h, -1, : cpu.col_cnt[0, h, -1]].tolist())
        blocks = set(cpu.block_idx[0, h, -1, : cpu.block_cnt[0, h, -1]].tolist())
        for col in verticals[h]:
            assert col in listed or col // bs in blocks, (h, col)
        assert (s - 1 - offsets[h][0]) // bs in blocks, h
