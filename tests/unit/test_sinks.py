"""Learned attention sinks (`s_aux`, GPT-OSS): the op's output normalised with one extra logit per head in the
softmax's denominator equals an explicit fp64 softmax over the visible keys and the sink logit, forward and backward
(q, k, v and the sinks), on the dense and the sparse path; tiny GPT-OSS, GraniteSWA and Flint through the
backend equal their eager attention."""

import pytest
import torch
from transformers import AutoModelForCausalLM

import hf_sparse_cp
from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention.ops import block_sparse_attention
from hf_sparse_cp.attention.sequence import sequence_attention
from hf_sparse_cp.attention.sinks import with_sinks
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.integration.stats import pop_kept_fractions
from hf_sparse_cp.testing.layouts import random_layout
from hf_sparse_cp.testing.tiny_models import released_model_types, tiny_config

from oracle import rel_rms, visible

B, HQ, HK, S, D = 2, 4, 2, 96, 16


def _explicit_with_sinks(q, k, v, sinks, mask, scale):
    """fp64 attention whose softmax runs over the visible keys and the sink logit of the head (no value)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    s = (torch.einsum("bhqd,bhkd->bhqk", q, k) * scale).masked_fill(~mask, float("-inf"))
    logits = torch.cat([s, sinks[None, :, None, None].expand(*s.shape[:-1], 1)], -1)
    return torch.einsum("bhqk,bhkd->bhqd", torch.softmax(logits, -1)[..., :-1], v)


def _inputs():
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, S, D, generator=g, dtype=torch.float64).requires_grad_() for h in (HQ, HK, HK))
    sinks = (2 * torch.randn(HQ, generator=g, dtype=torch.float64)).requires_grad_()
    segment = torch.zeros(B, S, dtype=torch.int32)
    segment[0, 40:] = 1  # two documents in row 0, and padding at the end of row 1
    segment[1, 80:] = -1
    return q, k, v, sinks, TokenMeta.from_segments(segment)


def _check(out, q, k, v, sinks, mask):
    """out (and its gradients in q, k, v and the sinks) against the explicit softmax under `mask`; queries that see
    no key (padding) give zeros."""
    ref = _explicit_with_sinks(q, k, v, sinks, mask, 0.3)
    ref = torch.where(mask.any(-1, keepdim=True), ref, 0.0)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    grads = torch.autograd.grad(out, (q, k, v, sinks), dout)
    ref_grads = torch.autograd.grad(ref, (q, k, v, sinks), dout)
    errors = [rel_rms(out, ref)] + [rel_rms(got, want) for got, want in zip(grads, ref_grads)]
    assert max(errors) < 1e-12, errors


@pytest.mark.parametrize("window", [None, 24])
def test_a_dense_call_with_sinks_equals_an_explicit_softmax_with_the_sink_logit_in_fp64(window):
    """A dense call with sinks runs the kernels' path over the dense layout (SDPA returns no log-sum-exp)."""
    q, k, v, sinks, meta = _inputs()
    out, kept = sequence_attention(q, k, v, meta, SparseAttentionConfig(pattern="dense", block_size=16), scale=0.3,
                                   sliding_window=window, sinks=sinks)
    assert float(kept) == 1.0
    _check(out, q, k, v, sinks, visible(meta, meta, window))


def test_a_sparse_layout_with_sinks_equals_an_explicit_softmax_over_its_keys_in_fp64():
    """The sinks join the denominator of the keys the layout keeps, once per query."""
    q, k, v, sinks, meta = _inputs()
    layout = random_layout(B, HQ, S, S, 16, 0.5, generator=torch.Generator().manual_seed(2))
    out, lse = block_sparse_attention(q, k, v, layout, scale=0.3, q_meta=meta)
    mask = layout.to_mask(HQ, S, S) & visible(meta, meta)
    assert float(mask.sum()) < 0.9 * HQ * float(visible(meta, meta).sum())  # (sparse: keys are skipped)
    _check(with_sinks(out, lse, sinks), q, k, v, sinks, mask)


def test_fp32_sink_gradients_keep_their_precision_where_the_sink_takes_a_small_share():
    """Where a query's keys outweigh its sink logit (lse - sink large: long contexts), the sink's share of the
    softmax is small and its gradient with it. sigmoid's backward, y * (1 - y), lost 1 - y to rounding: in fp32 (the
    compute dtype of bf16 models) the sink gradient was 6% off at lse - sink = 16 and exactly 0 from 17.3 on, where
    the explicit softmax over the keys and the sink (stock eager) keeps it. fp32 now equals fp64 to fp32 precision."""
    gaps = torch.tensor([0.0, 5.0, 10.0, 16.0, 18.0, 25.0, 40.0], dtype=torch.float64)
    out = torch.randn(1, 1, len(gaps), 8, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    grads = {}
    for dtype in (torch.float64, torch.float32):
        sinks, lse = torch.zeros(1, dtype=dtype, requires_grad=True), gaps.to(dtype)[None, None].requires_grad_()
        kept = with_sinks(out.to(dtype), lse, sinks)
        grads[dtype] = torch.autograd.grad(kept.sum(), (sinks, lse))
        assert torch.allclose(kept.double(), out * torch.sigmoid(gaps)[:, None], rtol=1e-6)
    for got, want in zip(grads[torch.float32], grads[torch.float64]):
        assert torch.allclose(got.double(), want, rtol=1e-5, atol=0), (got, want)


def _loss_and_grads(model, ids):
    model.zero_grad()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _with_visible_sinks(model):
    """`model` with its learned sinks drawn at scale 2 (their init is ~0.02 or 0), so that they change the output."""
    with torch.no_grad():
        for module in model.modules():
            if isinstance(getattr(module, "sinks", None), torch.nn.Parameter):
                module.sinks.normal_(0.0, 2.0)
    return model


@pytest.mark.parametrize("model_type", released_model_types("gpt_oss", "granite_swa", "flint"))
def test_tiny_models_with_sinks_equal_eager_and_train_with_a_sparse_budget(model_type):
    """GPT-OSS (layers alternately sliding and full), GraniteSWA and Flint pass their sinks as `s_aux`: a pattern
    that keeps every block gives eager's loss and gradients (the sinks' among them) in fp32; a real budget skips
    blocks, its loss and gradients finite."""
    hf_sparse_cp.patch()
    try:
        torch.manual_seed(0)
        ref = _with_visible_sinks(AutoModelForCausalLM.from_config(tiny_config(model_type, sliding_window=48),
                                                                   attn_implementation="eager"))
        # (a config of its own: configure() switches the config it is given)
        ours = AutoModelForCausalLM.from_config(tiny_config(model_type, sliding_window=48))
        ours.load_state_dict(ref.state_dict())
        ids = torch.randint(3, 259, (2, 150), generator=torch.Generator().manual_seed(1))
        ref_loss, ref_grads = _loss_and_grads(ref, ids)
        hf_sparse_cp.configure(ours, SparseAttentionConfig(pattern="dense", block_size=32))
        loss, grads = _loss_and_grads(ours, ids)
        assert abs(float(loss - ref_loss)) < 1e-5 and grads.keys() == ref_grads.keys()
        assert any("sinks" in name for name in grads)
        for name, grad in grads.items():
            assert rel_rms(grad, ref_grads[name]) < 2e-5, name
        hf_sparse_cp.configure(ours, SparseAttentionConfig(block_size=16, min_seq_len=64, vertical_topk=2,
                                                           slash_topk=2, local_window=16, dense_first_layers=0))
        loss, grads = _loss_and_grads(ours, ids)
        assert torch.isfinite(loss) and all(torch.isfinite(g).all() for g in grads.values())
        assert min(pop_kept_fractions(ours).values()) < 1.0  # the budget skipped blocks
    finally:
        hf_sparse_cp.unpatch()


def test_tiny_gpt_oss_decoding_through_a_kv_cache_equals_eager():
    """The cached path (a chunk of queries over more keys) applies the sinks too: the logits of a prompt's last
    tokens given its first ones in the cache equal eager's."""
    hf_sparse_cp.patch()
    try:
        torch.manual_seed(0)
        ref = _with_visible_sinks(AutoModelForCausalLM.from_config(tiny_config("gpt_oss", sliding_window=48),
                                                                   attn_implementation="eager"))
        ours = AutoModelForCausalLM.from_config(tiny_config("gpt_oss", sliding_window=48))
        ours.load_state_dict(ref.state_dict())
        hf_sparse_cp.configure(ours, SparseAttentionConfig(pattern="dense", block_size=32))
        ids = torch.randint(3, 259, (1, 90), generator=torch.Generator().manual_seed(1))
        logits = []
        with torch.no_grad():
            for model in (ref, ours):
                cache = model(input_ids=ids[:, :70], use_cache=True).past_key_values
                logits.append(model(input_ids=ids[:, 70:], past_key_values=cache, use_cache=True).logits)
        assert rel_rms(logits[1], logits[0]) < 2e-5
    finally:
        hf_sparse_cp.unpatch()
