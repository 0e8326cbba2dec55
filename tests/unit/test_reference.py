"""The PyTorch engines, the reference and the dense masked form, equal dense attention with the layout applied
as a mask (fp64 oracle), forward and backward, and compose over key splits as a ring step needs."""

import pytest
import torch

from hf_sparse_cp.attention import ops, reference
from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.call import AttentionCall
from hf_sparse_cp.attention.ops import block_sparse_attention
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.testing.layouts import random_layout

from oracle import TOLERANCE, dense_attention, rel_rms, visible


def _inputs(b, hq, hk, s, d, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    make = lambda h: torch.randn(b, h, s, d, generator=g).to(dtype).requires_grad_()
    return make(hq), make(hk), make(hk)


def _random_docs(b, s, seed, pad=0):
    g = torch.Generator().manual_seed(seed)
    seg = torch.zeros(b, s, dtype=torch.int32)
    for row in range(b):
        cuts = sorted(torch.randperm(s - 1, generator=g)[:3].add(1).tolist())
        for c in cuts:
            seg[row, c:] += 1
        if pad:
            seg[row, s - pad :] = -1
    return TokenMeta.from_segments(seg)


ENGINES = pytest.mark.parametrize("engine", ["reference", "masked"])


def _check(q, k, v, layout, q_meta, window=None, engine="reference"):
    out, lse = block_sparse_attention(q, k, v, layout, q_meta=q_meta, sliding_window=window, implementation=engine)
    mask = layout.to_mask(q.shape[1], q.shape[2], k.shape[2]) & visible(q_meta, q_meta, window)
    ref_out, ref_lse = dense_attention(q, k, v, mask)
    tol = TOLERANCE[q.dtype]
    seen = torch.isfinite(ref_lse)
    assert rel_rms(out, ref_out) <= tol
    assert torch.equal(torch.isfinite(lse), seen)
    assert rel_rms(lse, ref_lse, seen) <= tol
    assert bool((out[~seen.unsqueeze(-1).expand_as(out)] == 0).all())

    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    dlse = torch.randn(lse.shape, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((out.double() * dout).sum() + (lse.double() * dlse)[seen].sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref_out * dout).sum() + (ref_lse * dlse)[seen].sum(), (q, k, v))
    for name, a, b_ in zip("qkv", grads, ref_grads):
        assert rel_rms(a, b_) <= 2 * tol, name


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("hq,hk", [(2, 2), (4, 2), (8, 2)], ids=["mha", "gqa2", "gqa4"])
@pytest.mark.parametrize("s,bs", [(64, 16), (111, 16), (257, 32)], ids=["S64", "S111", "S257"])
@ENGINES
def test_random_layouts(dtype, hq, hk, s, bs, engine):
    q, k, v = _inputs(1, hq, hk, s, 16, dtype, seed=s + hq)
    layout = random_layout(1, hq, s, s, bs, 0.35, 0.05, generator=torch.Generator().manual_seed(s))
    _check(q, k, v, layout, TokenMeta.contiguous(1, s), engine=engine)


@ENGINES
def test_shared_layout_packed_documents_and_padding(engine):
    q, k, v = _inputs(2, 4, 2, 150, 16, torch.float64, seed=3)
    meta = _random_docs(2, 150, seed=4, pad=7)
    layout = random_layout(2, 1, 150, 150, 16, 0.5, 0.1, generator=torch.Generator().manual_seed(5))
    _check(q, k, v, layout, meta, engine=engine)


@ENGINES
def test_sliding_window(engine):
    q, k, v = _inputs(1, 4, 2, 200, 16, torch.float64, seed=6)
    meta = TokenMeta.contiguous(1, 200)
    _check(q, k, v, dense_layout(meta, 32, sliding_window=40), meta, window=40, engine=engine)


def test_masked_engine_chunks_do_not_change_results(monkeypatch):
    """One query block per chunk (each with its own key range) gives what one chunk of every row gives."""
    from hf_sparse_cp.attention import masked

    q, k, v = _inputs(1, 4, 2, 130, 16, torch.float64, seed=11)
    layout = random_layout(1, 4, 130, 130, 16, 0.4, 0.05, generator=torch.Generator().manual_seed(12))
    whole = block_sparse_attention(q, k, v, layout, implementation="masked")
    monkeypatch.setattr(masked, "CHUNK_ELEMENTS", 1)
    parts = block_sparse_attention(q, k, v, layout, implementation="masked")
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(parts, whole))


def test_dense_layout_equals_sdpa():
    q, k, v = _inputs(2, 4, 2, 190, 32, torch.float32, seed=7)
    meta = TokenMeta.contiguous(2, 190)
    out, _ = block_sparse_attention(q, k, v, dense_layout(meta, 32))
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert rel_rms(out, ref) <= TOLERANCE[torch.float32]


def test_chunking_does_not_change_results(monkeypatch):
    q, k, v = _inputs(1, 2, 1, 130, 16, torch.float64, seed=8)
    layout = random_layout(1, 2, 130, 130, 16, 0.4, 0.05, generator=torch.Generator().manual_seed(9))
    whole = block_sparse_attention(q, k, v, layout)[0]
    monkeypatch.setattr(reference, "CHUNK_ELEMENTS", 1)  # one query block per chunk
    assert torch.allclose(block_sparse_attention(q, k, v, layout)[0], whole, atol=1e-12)


def test_reference_memory_grows_with_kept_work():
    """Gathered keys per query block follow the layout's width, whatever S; a chunk's score tile
    stays within the chunk budget."""
    bs = 64
    for s in (4096, 16384):
        layout = random_layout(1, 1, s, s, bs, 0.0, 0.0)  # diagonal blocks only
        x = torch.zeros(1, 1, s, 8)
        meta = TokenMeta.contiguous(1, s)
        prob = reference._Problem(AttentionCall(x, x, x, layout, 1.0, meta, meta))
        assert prob.n_keys == bs
        assert prob.chunk * bs * prob.n_keys <= reference.CHUNK_ELEMENTS


def _bad_inputs():
    """(name, q, k, v, layout, q_meta, expected error) per kind of mistake, around one valid call."""
    q, k, v = (t.detach() for t in _inputs(1, 2, 2, 64, 16, torch.float32, seed=0))
    layout, meta = random_layout(1, 2, 64, 64, 16, 0.5), TokenMeta.contiguous(1, 64)
    short = TokenMeta.contiguous(1, 32)
    on_meta_device = TokenMeta(meta.index.to("meta"), meta.segment.to("meta"))
    return [
        ("heads", q[:, :1].expand(1, 3, 64, 16), k, v, random_layout(1, 3, 64, 64, 16, 0.5), meta,
         "multiple of key/value heads"),
        ("layout-length", q, k, v, random_layout(1, 2, 128, 128, 16, 0.5), meta, "query blocks"),
        ("layout-batch", q, k, v, random_layout(2, 2, 64, 64, 16, 0.5), meta, "batch 2"),
        ("3-D q", q[0], k, v, layout, meta, "4-D"),
        ("q_meta-length", q, k, v, layout, TokenMeta(short.index, meta.segment), "q_meta must hold"),
        ("mixed-dtypes", q, k.half(), v.half(), layout, meta, "one floating dtype"),
        ("integer", q.long(), k.long(), v.long(), layout, meta, "one floating dtype"),
        ("k-v-shapes", q, k, v[:, :, :32], layout, meta, "k and v must be"),
        ("meta-device", q, k, v, layout, on_meta_device, "on q's device"),
    ]


@pytest.mark.parametrize("case", range(len(_bad_inputs())), ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_are_refused_with_the_fix(case):
    """The public function and the reference primitive refuse each mistake before computing anything."""
    _, q, k, v, layout, q_meta, message = _bad_inputs()[case]
    with pytest.raises(ValueError, match=message):
        block_sparse_attention(q, k, v, layout, q_meta=q_meta)
    if q.dim() == 4 and k.shape == v.shape:
        k_meta = TokenMeta.contiguous(1, k.shape[2])
        with pytest.raises(ValueError, match=message):
            reference.reference_forward(AttentionCall(q, k, v, layout, 0.25, q_meta, k_meta))


@ENGINES
def test_primitives_compose_over_key_splits(engine):
    """Forward over two key halves merged by LSE, and backward with the final out/lse per half, equal
    the whole: what a ring step relies on."""
    q, k, v = _inputs(1, 4, 2, 96, 16, torch.float64, seed=10)
    meta = TokenMeta.contiguous(1, 96)
    full = dense_layout(meta, 16)
    out, lse = ops.attention_forward(AttentionCall(q, k, v, full, 0.25, meta, meta), implementation=engine)
    halves = []
    for lo, hi in ((0, 48), (48, 96)):
        k_meta = TokenMeta(meta.index[:, lo:hi], meta.segment[:, lo:hi])
        lay = random_layout(1, 1, 96, 48, 16, 1.0, causal=False)
        call = AttentionCall(q, k[:, :, lo:hi], v[:, :, lo:hi], lay, 0.25, meta, k_meta)
        halves.append((lo, hi, k_meta, lay, ops.attention_forward(call, implementation=engine)))
    (_, _, _, _, (o1, l1)), (_, _, _, _, (o2, l2)) = halves
    merged_lse = torch.logaddexp(l1, l2)
    merged = o1 * torch.exp(l1 - merged_lse)[..., None] + o2 * torch.exp(l2 - merged_lse)[..., None]
    assert torch.allclose(merged, out, atol=1e-12) and torch.allclose(merged_lse, lse, atol=1e-12)
    dout = torch.randn_like(out)
    dq, dk, dv = ops.attention_backward(AttentionCall(q, k, v, full, 0.25, meta, meta), out, lse, dout,
                                        implementation=engine)
    dq_sum = torch.zeros_like(dq)
    for lo, hi, k_meta, lay, _ in halves:
        call = AttentionCall(q, k[:, :, lo:hi], v[:, :, lo:hi], lay, 0.25, meta, k_meta)
        dqh, dkh, dvh = ops.attention_backward(call, out, lse, dout, implementation=engine)
        dq_sum += dqh
        assert torch.allclose(dkh, dk[:, :, lo:hi], atol=1e-12) and torch.allclose(dvh, dv[:, :, lo:hi], atol=1e-12)
    assert torch.allclose(dq_sum, dq, atol=1e-12)
