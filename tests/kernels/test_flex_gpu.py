"""The FlexAttention engine compiled on a GPU, against the fp64 PyTorch reference: forward and backward
(Flex's own, through both calls and their merge), the ring's per-step backward from the final out / lse,
one compiled graph per shape, and 'auto' running the engine its table picks.

Small sizes (4K tokens, one shape for most cases so that they share Flex's compiled graphs, each new
shape costing a compilation): these run first in `benchmarks/gpu_session.sh quick` (without the fp16
case), whose time is short. Nothing here runs without CUDA.
"""

import json

import pytest
import torch

from hf_sparse_cp.attention import engines
from hf_sparse_cp.attention.build import dense_layout
from hf_sparse_cp.attention.call import AttentionCall
from hf_sparse_cp.attention.ops import attention_backward, attention_forward, block_sparse_attention
from hf_sparse_cp.attention.reference import reference_backward, reference_forward
from hf_sparse_cp.attention.tokens import PAD_SEGMENT, TokenMeta
from hf_sparse_cp.simulator.workloads import random_vertical_slash_layout

from oracle import TOLERANCE, key_range, rel_rms

pytestmark = pytest.mark.gpu

DEVICE = "cuda"
S, HQ, HK, BLOCK = 4096, 8, 2, 128


def _documents(s: int) -> TokenMeta:
    """Three packed documents and a padded tail."""
    seg = torch.zeros(1, s, dtype=torch.int32)
    seg[:, s // 3:] = 1
    seg[:, s // 2 + 77:] = 2
    seg[:, s - 45:] = PAD_SEGMENT
    return TokenMeta.from_segments(seg)


def _case(kind: str, d: int, dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    meta = _documents(S) if kind != "dense" else TokenMeta.contiguous(1, S)
    if kind == "dense":
        layout = dense_layout(meta, BLOCK)
    else:  # ~10% of the block diagonals, ~1% of the tokens as columns, per head
        layout = random_vertical_slash_layout(1, HQ, S, BLOCK, num_diagonals=3, num_verticals=40, sink_tokens=4,
                                              meta=meta, generator=g)
        assert int(layout.col_cnt.sum()) > 0
    gd = torch.Generator(device=DEVICE).manual_seed(seed)
    make = lambda h: torch.randn(1, h, S, d, generator=gd, device=DEVICE)
    q, k, v = make(HQ).to(dtype), make(HK).to(dtype), make(HK).to(dtype)
    dout, dlse = make(HQ).to(dtype), torch.randn(1, HQ, S, generator=gd, device=DEVICE)
    return layout.to(DEVICE), meta.to(DEVICE), q, k, v, dout, dlse


def _reference(q, k, v, dout, dlse, layout, meta, window=None):
    f64 = [x.double() for x in (q, k, v)]
    scale = q.shape[-1] ** -0.5
    out, lse = reference_forward(AttentionCall(*f64, layout, scale, meta, meta, window))
    grads = reference_backward(AttentionCall(*f64, layout, scale, meta, meta, window), out, lse, dout.double(),
                               dlse=dlse.double())
    return out, lse, grads


CASES = {  # layout, head_dim, dtype, sliding window
    "vs-docs-d128-bf16": ("vertical_slash", 128, torch.bfloat16, None),
    "dense-d128-bf16": ("dense", 128, torch.bfloat16, None),
    "vs-docs-d64-fp16-window": ("vertical_slash", 64, torch.float16, 700),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flex_engine_forward_and_backward_match_the_reference(case):
    """block_sparse_attention with the flex engine: out, lse and the gradients of q, k, v (through out and
    lse) against fp64, with the tolerances of the kernels' tests."""
    kind, d, dtype, window = CASES[case]
    layout, meta, q, k, v, dout, dlse = _case(kind, d, dtype, seed=len(case))
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, dlse, layout, meta, window)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out, lse = block_sparse_attention(q, k, v, layout, q_meta=meta, sliding_window=window, implementation="flex")
    seen = torch.isfinite(ref_lse)
    tol = TOLERANCE[dtype]
    assert out.dtype == dtype and lse.dtype == torch.float32
    assert torch.equal(torch.isfinite(lse), seen) and bool((out[~seen] == 0).all())
    assert rel_rms(out, ref_out) <= tol and rel_rms(lse, ref_lse, seen) <= tol
    loss = (out.float() * dout.float()).sum() + (lse.masked_fill(~seen, 0.0) * dlse).sum()
    for name, got, ref in zip(("dq", "dk", "dv"), torch.autograd.grad(loss, (q, k, v)), ref_grads):
        assert bool(torch.isfinite(got).all()), name
        assert rel_rms(got, ref) <= 2 * tol, name


def test_flex_backward_per_key_range_sums_to_the_whole():
    """The ring's contract: forward over two key ranges merged, then each range's backward from the final
    out / lse (Flex recomputed with autograd) sums to the whole layout's gradients."""
    layout, meta, q, k, v, dout, dlse = _case("vertical_slash", 128, torch.bfloat16, seed=3)
    ref_out, ref_lse, ref_grads = _reference(q, k, v, dout, dlse, layout, meta)
    scale, cut = 128**-0.5, S // 2  # two ranges of one length: one compiled graph serves both
    parts = [(key_range(layout, 0, cut), slice(0, cut)), (key_range(layout, cut, S), slice(cut, S))]
    keys = lambda sl: TokenMeta(meta.index[:, sl], meta.segment[:, sl])
    out = lse = None
    for part, sl in parts:
        merged = {} if out is None else {"out": out, "lse": lse}
        out, lse = attention_forward(AttentionCall(q, k[:, :, sl], v[:, :, sl], part, scale, meta, keys(sl)),
                                     implementation="flex", **merged)
    seen, tol = torch.isfinite(ref_lse), TOLERANCE[torch.bfloat16]
    assert rel_rms(out, ref_out) <= tol and rel_rms(lse, ref_lse, seen) <= tol
    dq = torch.zeros_like(q, dtype=torch.float32)
    dk, dv = torch.zeros_like(k, dtype=torch.float32), torch.zeros_like(v, dtype=torch.float32)
    for part, sl in parts:
        g = attention_backward(AttentionCall(q, k[:, :, sl], v[:, :, sl], part, scale, meta, keys(sl)),
                               out.to(q.dtype), lse, dout, dlse=dlse, implementation="flex")
        dq += g[0]
        dk[:, :, sl] += g[1]
        dv[:, :, sl] += g[2]
    for name, got, ref in zip(("dq", "dk", "dv"), (dq, dk, dv), ref_grads):
        assert rel_rms(got, ref) <= 2 * TOLERANCE[torch.bfloat16], name


def test_one_compiled_graph_per_call_shape():
    """A second layout of the same shapes (other blocks, other columns, same buffer size) runs the graphs the
    first one compiled: every per-call tensor reaches Flex as a graph input, none as a constant."""
    from torch._dynamo.utils import counters

    layout, meta, q, k, v, dout, _ = _case("vertical_slash", 128, torch.bfloat16, seed=5)
    other, *_ = _case("vertical_slash", 128, torch.bfloat16, seed=6)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    for lay in (layout, other):
        out, _ = block_sparse_attention(q, k, v, lay, q_meta=meta, implementation="flex")
        out.backward(dout)
        if lay is layout:
            graphs = counters["stats"]["unique_graphs"]
    assert counters["stats"]["unique_graphs"] == graphs


def test_auto_runs_the_engine_its_table_picks(tmp_path, monkeypatch):
    layout, meta, q, *_ = _case("dense", 128, torch.bfloat16, seed=7)
    shape = engines.CallShape.of(q, layout)
    row = {"seq_len": S, "kept_fraction": shape.kept_fraction, "has_columns": False, "head_dim": 128}
    for triton_ms, flex_ms, expected in ((2.0, 1.0, "flex"), (1.0, 2.0, "triton")):
        path = tmp_path / f"table-{expected}.json"
        path.write_text(json.dumps({"kind": engines.TABLE_KIND, "device": torch.cuda.get_device_name(),
                                    "rows": [{**row, "triton_ms": triton_ms, "flex_ms": flex_ms}]}))
        monkeypatch.setenv(engines.TABLE_ENV, str(path))
        assert engines.resolve_engine(q, layout) == expected
        out, _ = block_sparse_attention(q, q[:, :HK], q[:, :HK], layout, q_meta=meta)
        assert bool(torch.isfinite(out).all())
