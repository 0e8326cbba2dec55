"""Non-finite q, k or v come out as NaN in the rows they reach, never as the zeros of a query that saw
nothing (issue #14): in the PyTorch reference (the public op's CPU path), its backward, and the merge
of partial results. The Triton kernel's counterpart runs in test_kernels_interpreter.py."""

import pytest
import torch

from hf_sparse_cp.attention.merge import merge_attention
from hf_sparse_cp.attention.ops import block_sparse_attention
from hf_sparse_cp.attention.tokens import TokenMeta
from hf_sparse_cp.testing.layouts import random_layout

from oracle import visible

S, BS, HQ, HK, D = 80, 16, 4, 2, 16
NAN, INF = float("nan"), float("inf")


def _problem(dtype, seed=0):
    """Random q, k, v; two documents and 6 padding tokens; a random layout with columns in which head 1's
    query block 3 lists nothing; and which keys each query sees ([1, HQ, S, S])."""
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, h, S, D, generator=g).to(dtype) for h in (HQ, HK, HK))
    seg = torch.zeros(1, S, dtype=torch.int32)
    seg[:, 30:] = 1
    seg[:, 74:] = -1
    meta = TokenMeta.from_segments(seg)
    layout = random_layout(1, HQ, S, S, BS, 0.6, 0.1, generator=g)
    layout.block_cnt[:, 1, 3] = 0
    layout.col_cnt[:, 1, 3] = 0
    sees = layout.to_mask(HQ, S, S) & visible(meta, meta)
    return q, k, v, meta, layout, sees


def _key_seen_by(sees, kv_head, key):
    """[HQ, S]: the (query head, query) pairs that see key `key` of key/value head `kv_head`."""
    hit = torch.zeros(HQ, S, dtype=torch.bool)
    group = HQ // HK
    hit[kv_head * group : (kv_head + 1) * group] = sees[0, kv_head * group : (kv_head + 1) * group, :, key]
    return hit


def _attention(q, k, v, layout, meta):
    """Forward, and the q/k/v gradients of a random linear function of out and lse (through autograd)."""
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = block_sparse_attention(*leaves, layout, q_meta=meta)
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(out.shape, generator=g).to(out.dtype)
    dlse = torch.randn(lse.shape, generator=g)
    seen = lse != -INF  # rows that saw nothing have no lse gradient (as a caller masks them)
    torch.autograd.backward([out, lse], [dout, torch.where(seen, dlse, 0.0)])
    return out.detach(), lse.detach(), [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_non_finite_inputs_reach_exactly_the_rows_that_read_them(dtype):
    q, k, v, meta, layout, sees = _problem(dtype)
    clean_out, clean_lse, _ = _attention(q, k, v, layout, meta)
    blind = clean_lse[0] == -INF  # [HQ, S]: queries that see no key
    assert bool(blind[1, 48:64].all()) and bool(blind[:, 74:].all())  # the empty layout row, the padding
    q, k = q.clone(), k.clone()
    q[0, 0, 40, 3] = NAN  # a query that sees keys
    q[0, 1, 50, :] = NAN  # a query of the empty layout row: sees nothing, stays empty
    q[0, 2, 77, 0] = INF  # a padding query: sees nothing, stays empty
    k[0, 0, 35, 5] = INF  # +-inf scores, by the sign of q[..., 5]: the -inf ones must not pass for masked keys
    k[0, 1, 12, :] = NAN
    affected = _key_seen_by(sees, 0, 35) | _key_seen_by(sees, 1, 12)
    affected[0, 40] = True
    assert int(affected.sum()) > 20 and not bool((affected & blind).any())

    out, lse, (dq, dk, dv) = _attention(q, k, v, layout, meta)
    assert bool(out[0][affected].isnan().all()) and bool(lse[0][affected].isnan().all())
    rest = ~affected
    torch.testing.assert_close(out[0][rest], clean_out[0][rest], rtol=0, atol=0)
    torch.testing.assert_close(lse[0][rest], clean_lse[0][rest], rtol=0, atol=0)
    assert bool((out[0][blind] == 0).all()) and bool((lse[0][blind] == -INF).all())
    # the backward keeps them non-finite: NaN where the forward was NaN, never clean zeros
    assert bool(dq[0][affected].isnan().all())
    assert not bool(dk[0, 0, 35].isfinite().any()) and not bool(dk[0, 1, 12].isfinite().any())
    assert not bool(dv[0, 0, 35].isfinite().any()) and not bool(dv[0, 1, 12].isfinite().any())


def test_a_non_finite_value_reaches_the_rows_that_see_its_key():
    q, k, v, meta, layout, sees = _problem(torch.float32, seed=2)
    v = v.clone()
    v[0, 1, 20, 7] = INF
    out, lse, _ = _attention(q, k, v, layout, meta)
    affected = _key_seen_by(sees, 1, 20)
    assert int(affected.sum()) > 0
    assert not bool(out[0][affected].isfinite().all(-1).any())  # every such row has a non-finite entry
    assert bool(lse.isfinite()[0][~(lse[0] == -INF)].all())  # v does not enter the log-sum-exp


def test_merge_treats_only_minus_inf_as_no_key():
    g = torch.Generator().manual_seed(3)
    out_a, out_b = torch.randn(5, 8, generator=g), torch.randn(5, 8, generator=g)
    lse_a = torch.tensor([0.3, NAN, NAN, INF, -INF])
    lse_b = torch.tensor([NAN, -INF, NAN, 1.2, 2.5])
    out_a[1:3] = NAN  # a part with NaN lse has NaN out (the reference and the kernel give both)
    out_b[0] = NAN
    out_b[2] = NAN
    out_a[4] = 0.0  # saw nothing
    out, lse = merge_attention(out_a, lse_a, out_b, lse_b)
    # NaN with a finite part, with an empty part, with another NaN part; +inf (an overflowed score)
    assert bool(out[:4].isnan().all()) and bool(lse[:4].isnan().all())
    # a part that saw no key leaves the other exactly as it was
    assert torch.equal(out[4], out_b[4]) and lse[4] == lse_b[4]
    both_empty = merge_attention(torch.zeros(1, 8), torch.tensor([-INF]), torch.zeros(1, 8), torch.tensor([-INF]))
    assert bool((both_empty[0] == 0).all()) and both_empty[1].item() == -INF
