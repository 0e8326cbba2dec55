"""The library kernels of dense calls (`hf_sparse_cp.attention.dense`): flash-attn and SDPA.

flash-attn needs CUDA, so on CPU its `flash_attn_varlen_func` is replaced by a stand-in written
from flash-attn's documented contract (sequences by `cu_seqlens`, query head h reads key head
h // (Hq / Hk), causal, `window_size=(left, right)`), which records its calls. What is tested is
ours: the backend choice, the documents handed to flash-attn, padding, windows, gradients, which
calls of a model take the path, and that a model's logits, gradients and kept fractions do not
change with it. SDPA runs on CPU (its math backend) when forced, and is chosen by 'auto' for plain
causal rows when the tensors are ones a library takes. The GPU tests at the end run the real
flash-attn where it is installed and SDPA's CUDA backends.
"""

import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention import dense
from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.ops import block_sparse_attention
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.backends import is_available
from hf_sparse_cp.integration.stats import pop_kept_fractions
from hf_sparse_cp.testing.tiny_models import tiny_config

from oracle import TOLERANCE, rel_rms


def _varlen_stand_in(calls):
    def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                               softmax_scale=None, causal=False, window_size=(-1, -1), alibi_slopes=None,
                               deterministic=False, return_attn_probs=False):
        bounds = cu_seqlens_q.tolist()
        calls.append({"cu_seqlens": bounds, "max_seqlen": max_seqlen_q, "window_size": window_size,
                      "same_k": torch.equal(cu_seqlens_q, cu_seqlens_k) and max_seqlen_k == max_seqlen_q})
        assert cu_seqlens_q.dtype == torch.int32 and q.dim() == k.dim() == 3 and not dropout_p
        assert max_seqlen_q == max(hi - lo for lo, hi in zip(bounds, bounds[1:]))
        group = q.shape[1] // k.shape[1]
        left, right = window_size
        outs = []
        for lo, hi in zip(bounds, bounds[1:]):
            i, j = torch.arange(hi - lo).view(-1, 1), torch.arange(hi - lo).view(1, -1)
            ok = (j <= i) if causal else torch.ones(hi - lo, hi - lo, dtype=torch.bool)
            ok = ok & ((j >= i - left) if left >= 0 else True) & ((j <= i + right) if right >= 0 else True)
            ks, vs = (x[lo:hi].double().repeat_interleave(group, 1) for x in (k, v))
            s = torch.einsum("qhd,khd->hqk", q[lo:hi].double(), ks) * softmax_scale
            p = torch.softmax(s.masked_fill(~ok, float("-inf")), -1)
            outs.append(torch.einsum("hqk,khd->qhd", p, vs).to(q.dtype))
        return torch.cat(outs)

    return flash_attn_varlen_func


@pytest.fixture
def flash_calls(monkeypatch):
    """flash-attn 'installed' (the stand-in) and taking CPU tensors; yields the list of its calls."""
    calls = []
    module = types.ModuleType("flash_attn")
    module.flash_attn_varlen_func = _varlen_stand_in(calls)
    monkeypatch.setitem(sys.modules, "flash_attn", module)
    monkeypatch.setattr(dense, "library_takes", lambda q, k: True)
    monkeypatch.delenv(dense.DENSE_BACKEND_ENV, raising=False)
    is_available.cache_clear()
    yield calls
    is_available.cache_clear()


def _packed_meta():
    seg = torch.tensor([[0] * 5 + [1] * 4 + [-1] * 3,
                        [-1] * 2 + [0] * 4 + [1] * 6])
    return TokenMeta.from_segments(seg)


def test_varlen_documents_skip_padding_and_split_rows():
    keep, cu, longest = dense.varlen_documents(_packed_meta())
    assert keep.tolist() == [*range(9), *range(14, 24)]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 9, 13, 19] and longest == 6
    keep, cu, longest = dense.varlen_documents(TokenMeta.contiguous(2, 7))
    assert keep is None and cu.tolist() == [0, 7, 14] and longest == 7


@pytest.mark.parametrize("window", [None, 3], ids=["causal", "window3"])
def test_flash_path_equals_the_dense_layout(flash_calls, window):
    """Same outputs (zeros for padding) and gradients as our attention over the dense layout."""
    meta = _packed_meta()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 12, 16, generator=g, dtype=torch.float64).requires_grad_() for h in (4, 2, 2))
    dout = torch.randn(2, 12, 4, 16, generator=g, dtype=torch.float64)
    out = dense.flash_dense_attention(q, k, v, meta, scale=0.3, sliding_window=window)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, _ = block_sparse_attention(q, k, v, dense_layout(meta, 16, window), scale=0.3, q_meta=meta, k_meta=meta,
                                    sliding_window=window)
    ref = ref.transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert flash_calls[0]["window_size"] == ((-1, -1) if window is None else (window - 1, 0))
    assert flash_calls[0]["same_k"]
    assert out.shape == (2, 12, 4, 16) and torch.allclose(out, ref, atol=1e-12)
    assert bool((out[0, 9:] == 0).all()) and bool((out[1, :2] == 0).all())
    for got, expected in zip(grads, ref_grads):
        assert torch.allclose(got, expected, atol=1e-12)


def test_backend_choice(flash_calls, monkeypatch):
    q = torch.randn(1, 4, 8, 16)
    meta = TokenMeta.contiguous(1, 8)
    assert dense.dense_backend(q, q, meta) == "flash_attn"
    assert dense.dense_backend(q, q, meta, None, "kernels") == "kernels"
    monkeypatch.setenv(dense.DENSE_BACKEND_ENV, "kernels")
    assert dense.dense_backend(q, q, meta) == "kernels"
    monkeypatch.setenv(dense.DENSE_BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match="one of"):
        dense.dense_backend(q, q, meta)
    monkeypatch.undo()  # the real checks from here: CPU tensors are refused, flash-attn may be missing
    is_available.cache_clear()
    assert dense.dense_backend(q, q, meta) == "kernels"
    if not dense.is_flash_attn_available():
        with pytest.raises(ValueError, match=r"hf-sparse-cp\[flash\]"):
            dense.dense_backend(q, q, meta, None, "flash_attn")
    with monkeypatch.context() as m, pytest.raises(ValueError, match="CUDA fp16/bf16"):
        m.setattr(dense, "is_flash_attn_available", lambda: True)
        dense.dense_backend(q, q, meta, None, "flash_attn")


@pytest.fixture
def library_without_flash_attn(monkeypatch):
    """Tensors a library takes (as on CUDA in bf16), flash-attn not installed: 'auto' may choose SDPA."""
    monkeypatch.setattr(dense, "library_takes", lambda q, k: True)
    monkeypatch.setattr(dense, "is_flash_attn_available", lambda: False)
    monkeypatch.delenv(dense.DENSE_BACKEND_ENV, raising=False)


@pytest.mark.parametrize("case,expected", [
    ("one document per row", "sdpa"), ("window as long as the row", "sdpa"), ("packed", "kernels"),
    ("padding", "kernels"), ("sliding window", "kernels"), ("deterministic", "kernels")])
def test_auto_takes_sdpa_for_plain_causal_rows_only(library_without_flash_attn, monkeypatch, case, expected):
    """SDPA computes causal attention per row: 'auto' gives it the calls that are exactly that and nothing
    else (packed documents, padding, a shorter window, deterministic mode stay on the kernels)."""
    q = torch.randn(2, 4, 12, 16)
    seg = torch.zeros(2, 12, dtype=torch.int32)
    window = {"sliding window": 5, "window as long as the row": 12}.get(case)
    if case == "packed":
        seg[1, 7:] = 1
    if case == "padding":
        seg[0, :3] = -1
    if case == "deterministic":
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert dense.dense_backend(q, q, TokenMeta.from_segments(seg), window) == expected


def test_forced_sdpa_refuses_what_it_cannot_compute(monkeypatch):
    q = torch.randn(1, 4, 12, 16)
    monkeypatch.setenv(dense.DENSE_BACKEND_ENV, "sdpa")
    assert dense.dense_backend(q, q, TokenMeta.contiguous(1, 12)) == "sdpa"
    with pytest.raises(ValueError, match="plain causal attention only.*=auto"):
        dense.dense_backend(q, q, _packed_meta())
    with pytest.raises(ValueError, match="sliding window"):
        dense.dense_backend(q, q, TokenMeta.contiguous(1, 12), 4)


def test_sdpa_path_equals_the_dense_layout():
    """GQA 6/2, fp64 on random inputs: the same outputs and gradients as our attention over the dense layout."""
    meta = TokenMeta.contiguous(2, 37)
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, h, 37, 16, generator=g, dtype=torch.float64).requires_grad_() for h in (6, 2, 2))
    dout = torch.randn(2, 37, 6, 16, generator=g, dtype=torch.float64)
    out = dense.sdpa_dense_attention(q, k, v, scale=0.21)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref, _ = block_sparse_attention(q, k, v, dense_layout(meta, 16), scale=0.21, q_meta=meta, k_meta=meta)
    ref = ref.transpose(1, 2)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    tol = TOLERANCE[torch.float64]
    assert out.shape == (2, 37, 6, 16) and rel_rms(out, ref) <= tol
    assert all(rel_rms(a, b) <= tol for a, b in zip(grads, ref_grads))


def _model_run(input_ids, position_ids, backend, monkeypatch):
    monkeypatch.setenv(dense.DENSE_BACKEND_ENV, backend)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("llama", num_hidden_layers=3)).double()
    hf_sparse_cp.configure(model, SparseAttentionConfig(
        block_size=16, min_seq_len=96, vertical_topk=4, slash_topk=4, local_window=16, sink_tokens=4,
        dense_first_layers=0, layer_overrides={"1": {"pattern": "dense"}}))
    out = model(input_ids=input_ids, position_ids=position_ids)
    out.logits.logsumexp(-1).mean().backward()
    return out.logits.detach(), [p.grad for p in model.parameters()], pop_kept_fractions(model)


def test_model_dense_calls_take_flash_attn_and_change_nothing(flash_calls, monkeypatch):
    """Packed documents of 40 and 120 tokens: layer 1 (dense) takes flash-attn with the two documents;
    layers 0 and 2 are sparse for the long document and stay on our attention. Logits, gradients and
    kept fractions equal those of the run without flash-attn."""
    hf_sparse_cp.patch()
    try:
        ids = torch.randint(3, 259, (1, 160), generator=torch.Generator().manual_seed(1))
        pos = torch.cat([torch.arange(40), torch.arange(120)]).unsqueeze(0)
        logits, grads, kept = _model_run(ids, pos, "auto", monkeypatch)
        assert [c["cu_seqlens"] for c in flash_calls] == [[0, 40, 160]]
        ref_logits, ref_grads, ref_kept = _model_run(ids, pos, "kernels", monkeypatch)
        assert len(flash_calls) == 1
    finally:
        hf_sparse_cp.unpatch()
    assert kept == pytest.approx(ref_kept) and kept[1] > kept[0]
    tol = TOLERANCE[torch.float64]
    assert rel_rms(logits, ref_logits) <= tol
    assert all(rel_rms(g, r) <= tol for g, r in zip(grads, ref_grads))


def test_model_dense_calls_take_sdpa_for_plain_rows_and_change_nothing(library_without_flash_attn, monkeypatch):
    """One sequence of 160 tokens, no packing: layer 1 (dense) runs SDPA, layers 0 and 2 stay sparse on our
    attention; a packed batch keeps every call on our attention. Logits, gradients and kept fractions equal
    those of the run on the kernels."""
    calls = []
    real = dense.sdpa_dense_attention
    monkeypatch.setattr(dense, "sdpa_dense_attention", lambda *a, **kw: calls.append(a[0].shape) or real(*a, **kw))
    from hf_sparse_cp.attention import sequence  # where the backend's one-process path calls it from
    monkeypatch.setattr(sequence, "sdpa_dense_attention", dense.sdpa_dense_attention)
    hf_sparse_cp.patch()
    try:
        ids = torch.randint(3, 259, (1, 160), generator=torch.Generator().manual_seed(2))
        pos = torch.arange(160).unsqueeze(0)
        logits, grads, kept = _model_run(ids, pos, "auto", monkeypatch)
        assert len(calls) == 1 and calls[0][2] == 160
        ref_logits, ref_grads, ref_kept = _model_run(ids, pos, "kernels", monkeypatch)
        packed = torch.cat([torch.arange(40), torch.arange(120)]).unsqueeze(0)
        _model_run(ids, packed, "auto", monkeypatch)
        assert len(calls) == 1
    finally:
        hf_sparse_cp.unpatch()
    assert kept == pytest.approx(ref_kept) and kept[1] > kept[0]
    tol = TOLERANCE[torch.float64]
    assert rel_rms(logits, ref_logits) <= tol
    assert all(rel_rms(g, r) <= tol for g, r in zip(grads, ref_grads))


@pytest.mark.gpu
@pytest.mark.parametrize("window", [None, 200], ids=["causal", "window200"])
def test_real_flash_attn_equals_the_kernels_on_cuda(window):
    """With flash-attn installed: the flash path and our kernels on the dense layout agree in bf16
    within twice the error each has against an fp64 reference (packed documents, padding, GQA)."""
    pytest.importorskip("flash_attn")
    from oracle import dense_attention, visible

    s = 2048
    seg = torch.zeros(2, s, dtype=torch.int32, device="cuda")
    seg[:, 700:] = 1
    seg[1, 1900:] = -1
    meta = TokenMeta.from_segments(seg)
    g = torch.Generator(device="cuda").manual_seed(3)
    q, k, v = (torch.randn(2, h, s, 128, generator=g, device="cuda").bfloat16() for h in (16, 2, 2))
    assert dense.dense_backend(q, k, meta, window, "flash_attn") == "flash_attn"
    flash = dense.flash_dense_attention(q, k, v, meta, scale=128**-0.5, sliding_window=window)
    ours, _ = block_sparse_attention(q, k, v, dense_layout(meta, 128, window), scale=128**-0.5, q_meta=meta,
                                     k_meta=meta, sliding_window=window)
    ref, _ = dense_attention(q, k, v, visible(meta, meta, window), scale=128**-0.5)
    ref, ours = ref.transpose(1, 2), ours.transpose(1, 2)
    valid = (seg != -1).unsqueeze(-1).unsqueeze(-1).expand_as(ref)
    assert rel_rms(flash, ref, valid) <= TOLERANCE[torch.bfloat16]
    assert rel_rms(flash, ref, valid) <= 2 * rel_rms(ours, ref, valid) + 1e-3


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_sdpa_path_on_cuda_is_as_accurate_as_the_kernels(dtype):
    """SDPA's CUDA backends (cuDNN first) on plain causal rows, GQA 16/2, head_dim 128: within twice our
    kernels' error against an fp64 reference, forward and gradients; 'auto' chooses it (without flash-attn)."""
    from oracle import dense_attention, visible

    s = 2048
    meta = TokenMeta.contiguous(2, s, "cuda")
    g = torch.Generator(device="cuda").manual_seed(4)
    q, k, v = (torch.randn(2, h, s, 128, generator=g, device="cuda").to(dtype).requires_grad_() for h in (16, 2, 2))
    dout = torch.randn(2, s, 16, 128, generator=g, device="cuda").to(dtype)
    if not dense.is_flash_attn_available():
        assert dense.dense_backend(q, k, meta) == "sdpa"
    scale = 128**-0.5
    got = dense.sdpa_dense_attention(q, k, v, scale=scale)
    ours, _ = block_sparse_attention(q, k, v, dense_layout(meta, 128), scale=scale, q_meta=meta, k_meta=meta)
    ours = ours.transpose(1, 2)
    x64 = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, _ = dense_attention(*x64, visible(meta, meta, None), scale=scale)
    ref = ref.transpose(1, 2)
    def with_grads(out, inputs):
        return [out, *torch.autograd.grad(out, inputs, dout.to(out.dtype))]

    for a, b, r in zip(with_grads(got, (q, k, v)), with_grads(ours, (q, k, v)), with_grads(ref, x64)):
        assert rel_rms(a, r) <= TOLERANCE[dtype] and rel_rms(a, r) <= 2 * rel_rms(b, r) + 1e-3
