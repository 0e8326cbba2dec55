"""The flash-attn path of dense calls (`hf_sparse_cp.attention.flash_dense`).

flash-attn needs CUDA, so on CPU its `flash_attn_varlen_func` is replaced by a stand-in written
from flash-attn's documented contract (sequences by `cu_seqlens`, query head h reads key head
h // (Hq / Hk), causal, `window_size=(left, right)`), which records its calls. What is tested is
ours: the backend choice, the documents handed to flash-attn, padding, windows, gradients, which
calls of a model take the path, and that a model's logits, gradients and kept fractions do not
change with it. The GPU test at the end runs the real flash-attn where it is installed.
"""

import sys
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention import flash_dense
from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.ops import block_sparse_attention
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.backends import is_available
from hf_sparse_cp.examples.tiny_model import tiny_config
from hf_sparse_cp.integration.stats import pop_kept_fractions

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
    monkeypatch.setattr(flash_dense, "flash_attn_takes", lambda q, k: True)
    monkeypatch.delenv(flash_dense.DENSE_BACKEND_ENV, raising=False)
    is_available.cache_clear()
    yield calls
    is_available.cache_clear()


def _packed_meta():
    seg = torch.tensor([[0] * 5 + [1] * 4 + [-1] * 3,
                        [-1] * 2 + [0] * 4 + [1] * 6])
    return TokenMeta.from_segments(seg)


def test_varlen_documents_skip_padding_and_split_rows():
    keep, cu, longest = flash_dense.varlen_documents(_packed_meta())
    assert keep.tolist() == [*range(9), *range(14, 24)]
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 5, 9, 13, 19] and longest == 6
    keep, cu, longest = flash_dense.varlen_documents(TokenMeta.contiguous(2, 7))
    assert keep is None and cu.tolist() == [0, 7, 14] and longest == 7


@pytest.mark.parametrize("window", [None, 3], ids=["causal", "window3"])
def test_flash_path_equals_the_dense_layout(flash_calls, window):
    """Same outputs (zeros for padding) and gradients as our attention over the dense layout."""
    meta = _packed_meta()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 12, 16, generator=g, dtype=torch.float64).requires_grad_() for h in (4, 2, 2))
    dout = torch.randn(2, 12, 4, 16, generator=g, dtype=torch.float64)
    out = flash_dense.flash_dense_attention(q, k, v, meta, scale=0.3, sliding_window=window)
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
    assert flash_dense.use_flash_attn(q, q) and not flash_dense.use_flash_attn(q, q, "kernels")
    monkeypatch.setenv(flash_dense.DENSE_BACKEND_ENV, "kernels")
    assert not flash_dense.use_flash_attn(q, q)
    monkeypatch.setenv(flash_dense.DENSE_BACKEND_ENV, "flash")
    with pytest.raises(ValueError, match="one of"):
        flash_dense.use_flash_attn(q, q)
    monkeypatch.undo()  # the real checks from here: CPU tensors are refused, flash-attn may be missing
    is_available.cache_clear()
    assert not flash_dense.use_flash_attn(q, q)
    if not flash_dense.is_flash_attn_available():
        with pytest.raises(ValueError, match=r"hf-sparse-cp\[flash\]"):
            flash_dense.use_flash_attn(q, q, "flash_attn")
    with monkeypatch.context() as m, pytest.raises(ValueError, match="CUDA fp16/bf16"):
        m.setattr(flash_dense, "is_flash_attn_available", lambda: True)
        flash_dense.use_flash_attn(q, q, "flash_attn")


def _model_run(input_ids, position_ids, backend, monkeypatch):
    monkeypatch.setenv(flash_dense.DENSE_BACKEND_ENV, backend)
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
    assert flash_dense.use_flash_attn(q, k, "flash_attn")
    flash = flash_dense.flash_dense_attention(q, k, v, meta, scale=128**-0.5, sliding_window=window)
    ours, _ = block_sparse_attention(q, k, v, dense_layout(meta, 128, window), scale=128**-0.5, q_meta=meta,
                                     k_meta=meta, sliding_window=window)
    ref, _ = dense_attention(q, k, v, visible(meta, meta, window), scale=128**-0.5)
    ref, ours = ref.transpose(1, 2), ours.transpose(1, 2)
    valid = (seg != -1).unsqueeze(-1).unsqueeze(-1).expand_as(ref)
    assert rel_rms(flash, ref, valid) <= TOLERANCE[torch.bfloat16]
    assert rel_rms(flash, ref, valid) <= 2 * rel_rms(ours, ref, valid) + 1e-3
