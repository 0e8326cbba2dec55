"""The compiled Triton kernels on a GPU, at realistic sizes, against the fp64 PyTorch reference.

bf16 and fp16, head_dim 64 and 128, 3K-8K tokens, GQA, per-head vertical-slash layouts with
columns, packed documents whose rows are mostly masked, merging into an existing result, the
deterministic mode, the dispatch of `hf_sparse_cp.ops` and torch.compile.
"""

import pytest
import torch
from hf_sparse_cp.kernels import ops as kops
from oracle import TOLERANCE, rel_rms

from hf_sparse_cp import ops as public_ops
from hf_sparse_cp.layout import SparseLayout, compact_sorted
from hf_sparse_cp.pattern import dense_layout
from hf_sparse_cp.reference import reference_backward, reference_forward
from hf_sparse_cp.synthetic import random_layout, random_vertical_slash_layout
from hf_sparse_cp.tokens import TokenMeta

pytestmark = pytest.mark.gpu


def _inputs(b, hq, hk, s, d, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda h, dt=dtype: torch.randn(b, h, s, d, generator=g, device="cuda").to(dt)
    return make(hq), make(hk), make(hk), make(hq), torch.randn(b, hq, s, generator=g, device="cuda")


def _to_cuda(layout):
    return SparseLayout(*(t.cuda() for t in (layout.block_idx, layout.block_cnt, layout.col_idx, layout.col_cnt)),
                        layout.block_size)


def _check(q, k, v, dout, dlse, layout, meta, window=None):
    scale = q.shape[-1] ** -0.5
    out, lse = kops.sparse_attention_forward(q, k, v, layout, scale=scale, q_meta=meta, k_meta=meta,
                                             sliding_window=window)
    f64 = [x.double() for x in (q, k, v)]
    ref_out, ref_lse = reference_forward(*f64, layout, scale=scale, q_meta=meta, k_meta=meta, sliding_window=window)
    tol = TOLERANCE[q.dtype]
    seen = torch.isfinite(ref_lse)
    assert not bool(out.isnan().any() or lse.isnan().any())
    assert rel_rms(out, ref_out) <= tol
    assert torch.equal(torch.isfinite(lse), seen)
    assert rel_rms(lse, ref_lse, seen) <= tol
    assert bool((out[~seen] == 0).all())
    out_q = out.to(q.dtype)
    grads = kops.sparse_attention_backward(q, k, v, out_q, lse, dout, layout, scale=scale, q_meta=meta, k_meta=meta,
                                           sliding_window=window, dlse=dlse)
    ref_grads = reference_backward(*f64, out_q.double(), lse.double(), dout.double(), layout, scale=scale,
                                   q_meta=meta, k_meta=meta, sliding_window=window, dlse=dlse.double())
    for name, got, ref in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert bool(torch.isfinite(got).all()), name
        assert rel_rms(got, ref) <= 2 * tol, name
    return out, lse, grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_vertical_slash_d128_gqa8(dtype):
    s = 4096
    q, k, v, dout, dlse = _inputs(1, 16, 2, s, 128, dtype, seed=0)
    layout = _to_cuda(random_vertical_slash_layout(1, 16, s, 128, 4, 200, generator=torch.Generator().manual_seed(1)))
    assert int(layout.col_cnt.sum()) > 0
    _check(q, k, v, dout, dlse, layout, TokenMeta.contiguous(1, s, "cuda"))


def test_odd_length_d64_window_bf16():
    s = 3001
    q, k, v, dout, dlse = _inputs(2, 4, 2, s, 64, torch.bfloat16, seed=2)
    meta = TokenMeta.contiguous(2, s, "cuda")
    _check(q, k, v, dout, dlse, dense_layout(meta, 64, sliding_window=700), meta, window=700)
    layout = _to_cuda(random_layout(2, 4, s, s, 64, 0.2, 0.01, generator=torch.Generator().manual_seed(3)))
    _check(q, k, v, dout, dlse, layout, meta)


def test_long_rows_of_masked_keys_give_no_nan():
    """Many short packed documents and a padded tail under a layout that lists every causal block:
    almost every listed tile is invisible, whole rows of tiles are masked, padding sees nothing."""
    s, bs = 8192, 128
    q, k, v, dout, dlse = _inputs(1, 8, 2, s, 128, torch.bfloat16, seed=4)
    seg = torch.div(torch.arange(s, device="cuda"), 61, rounding_mode="floor").to(torch.int32).unsqueeze(0)
    seg[:, -300:] = -1
    meta = TokenMeta.from_segments(seg)
    nb = s // bs
    blk = torch.arange(nb, dtype=torch.int32, device="cuda").expand(1, 1, nb, nb)
    valid = blk <= torch.arange(nb, device="cuda").view(1, 1, -1, 1)
    block_idx, block_cnt = compact_sorted(blk, valid)
    empty = torch.empty(1, 1, nb, 0, dtype=torch.int32, device="cuda")
    layout = SparseLayout(block_idx, block_cnt, empty, torch.zeros_like(block_cnt), bs)
    out, lse, _ = _check(q, k, v, dout, dlse, layout, meta)
    assert bool((lse[:, :, -300:] == float("-inf")).all())


def test_merge_into_existing_result():
    s, bs = 4096, 128
    q, k, v, dout, dlse = _inputs(1, 16, 2, s, 128, torch.bfloat16, seed=5)
    meta = TokenMeta.contiguous(1, s, "cuda")
    full = dense_layout(meta, bs)
    half = s // 2
    out, lse = None, None
    for lo, hi in ((0, half), (half, s)):
        km = TokenMeta(meta.index[:, lo:hi], meta.segment[:, lo:hi])
        lay = _to_cuda(random_layout(1, 1, s, hi - lo, bs, 1.0, causal=False))
        out, lse = kops.sparse_attention_forward(q, k[:, :, lo:hi], v[:, :, lo:hi], lay, scale=0.1, q_meta=meta,
                                                 k_meta=km, out=out, lse=lse)
    ref_out, ref_lse = reference_forward(q.double(), k.double(), v.double(), full, scale=0.1, q_meta=meta, k_meta=meta)
    assert rel_rms(out, ref_out) <= TOLERANCE[torch.bfloat16]
    assert rel_rms(lse, ref_lse) <= TOLERANCE[torch.bfloat16]


def test_deterministic_mode_is_bitwise_reproducible():
    s = 4096
    q, k, v, dout, dlse = _inputs(1, 16, 2, s, 128, torch.bfloat16, seed=6)
    meta = TokenMeta.contiguous(1, s, "cuda")
    layout = _to_cuda(random_vertical_slash_layout(1, 16, s, 128, 3, 500, generator=torch.Generator().manual_seed(7)))
    out, lse = kops.sparse_attention_forward(q, k, v, layout, scale=0.1, q_meta=meta, k_meta=meta)
    args = (q, k, v, out.to(q.dtype), lse, dout, layout)
    kw = dict(scale=0.1, q_meta=meta, k_meta=meta, dlse=dlse)
    first = kops.sparse_attention_backward(*args, deterministic=True, **kw)
    again = kops.sparse_attention_backward(*args, deterministic=True, **kw)
    atomic = kops.sparse_attention_backward(*args, deterministic=False, **kw)
    for name, a, b_, c in zip(("dq", "dk", "dv"), first, again, atomic):
        assert torch.equal(a, b_), name
        assert rel_rms(c, a) <= 1e-5, name


def test_public_function_dispatches_to_the_kernels(monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("CUDA bf16 inputs must not reach the PyTorch reference")

    s = 2048
    q, k, v, dout, _ = _inputs(1, 8, 2, s, 128, torch.bfloat16, seed=8)
    layout = _to_cuda(random_layout(1, 8, s, s, 128, 0.3, 0.02, generator=torch.Generator().manual_seed(9)))
    ref_out, _ = reference_forward(q.double(), k.double(), v.double(), layout, scale=128**-0.5,
                                   q_meta=TokenMeta.contiguous(1, s, "cuda"), k_meta=TokenMeta.contiguous(1, s, "cuda"))
    monkeypatch.setattr(public_ops, "reference_forward", refuse)
    monkeypatch.setattr(public_ops, "reference_backward", refuse)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = public_ops.block_sparse_attention(q, k, v, layout)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert rel_rms(out, ref_out) <= TOLERANCE[torch.bfloat16]
    (out.float() * dout.float()).sum().backward()
    assert all(t.grad is not None and bool(torch.isfinite(t.grad).all()) for t in (q, k, v))


def test_torch_compile_traces_the_custom_ops():
    s = 2048
    q, k, v, _, _ = _inputs(1, 8, 2, s, 64, torch.bfloat16, seed=10)
    meta = TokenMeta.contiguous(1, s, "cuda")
    layout = _to_cuda(random_layout(1, 8, s, s, 128, 0.3, 0.02, generator=torch.Generator().manual_seed(11)))

    def attend(q, k, v):
        return kops.sparse_attention_forward(q, k, v, layout, scale=0.125, q_meta=meta, k_meta=meta)

    eager = attend(q, k, v)
    compiled = torch.compile(attend, fullgraph=True)(q, k, v)
    for a, b_ in zip(eager, compiled):
        assert torch.equal(a, b_)


@pytest.mark.parametrize("pattern", ["dense", "vertical_slash"])
def test_model_under_sparse_cp_uses_the_kernels_and_matches_the_reference_path(monkeypatch, pattern):
    """A tiny fp32 Llama on CUDA: the sparse_cp backend through the kernels gives the logits and
    gradients of the same backend through the PyTorch reference. fp32 (exact products in the
    kernels) keeps every layer's estimated layout identical in both runs; bf16 is checked above."""
    from transformers import AutoModelForCausalLM

    import hf_sparse_cp
    from hf_sparse_cp.tiny_models import tiny_config

    hf_sparse_cp.patch(fused_loss=False)
    try:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config("llama", vocab_size=512)).cuda()
        hf_sparse_cp.configure(model, hf_sparse_cp.SparseAttentionConfig(
            pattern=pattern, block_size=64, min_seq_len=1024, vertical_topk=64, slash_topk=128, local_window=64,
            sink_tokens=16))
        ids = torch.randint(0, 512, (1, 4096), device="cuda", generator=torch.Generator("cuda").manual_seed(1))

        def run():
            model.zero_grad(set_to_none=True)
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            return out.logits.float(), [p.grad.float() for p in model.parameters()]

        calls = []
        kernel_forward = kops.sparse_attention_forward
        monkeypatch.setattr(kops, "sparse_attention_forward",
                            lambda *a, **kw: calls.append(1) or kernel_forward(*a, **kw))
        logits, grads = run()
        assert calls, "the sparse_cp backend did not reach the Triton kernels on CUDA"
        monkeypatch.setattr(public_ops, "_use_kernels", lambda *a: False)
        ref_logits, ref_grads = run()
    finally:
        hf_sparse_cp.unpatch()
    tol = TOLERANCE[torch.float32]
    assert rel_rms(logits, ref_logits) <= tol
    for got, ref in zip(grads, ref_grads):
        assert rel_rms(got, ref) <= 4 * tol
