"""What a sparse attention layer allocates and holds as S grows (`hf_sparse_cp.testing.allocations`).

The H200 session of 2026-11-29 measured a 0.5B training step at 12.1, 24.1 and 57.0 GiB for 128K, 256K and 512K
tokens and ran out of memory at 1M: with a budget that grows with S, every checkpointed layer's layout
(col_idx [B, H, NQB, columns]) stayed on its autograd node from the forward to its backward, 23 of them at once."""

import gc

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention import estimate_layout
from hf_sparse_cp.attention.sequence import sequence_attention
from hf_sparse_cp.attention.tokens import PAD_SEGMENT, TokenMeta
from hf_sparse_cp.testing.allocations import AllocationRecorder

from oracle import visible


def test_the_recorder_counts_fresh_storages_and_their_lives():
    with AllocationRecorder() as rec:
        a = torch.zeros(1000)  # 4000 bytes
        a.view(10, 100).add_(1)  # a view and an in-place write: nothing new
        b = a * 2
        del a
        c = torch.ones(3000)
    assert [x.op for x in rec.allocations] == ["zeros", "mul", "ones"]
    assert rec.peak_bytes == 4000 + 12000 and rec.largest == 12000  # a was gone before c came
    assert [x.nbytes for x in rec.at_peak] == [12000, 4000]
    del b, c


def _inputs(s: int, hq: int = 4, hk: int = 2, d: int = 16, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(1, h, s, d, generator=g, requires_grad=True) for h in (hq, hk, hk)]


def _held_after_forward(q, k, v, meta, cfg, window):
    """Bytes that a checkpointed attention call allocated and still holds after its forward, besides its output."""
    with AllocationRecorder(with_sites=False) as rec:
        out = checkpoint(lambda *x: sequence_attention(*x, meta, cfg, sliding_window=window)[0], q, k, v,
                         use_reentrant=False)
        gc.collect()
        held = sum(a.nbytes for a in rec.alive) - out.untyped_storage().nbytes()
    return out, held


@pytest.mark.parametrize(("documents", "window"), [(None, None), ((400, 200, 424), None), (None, 128)])
def test_a_checkpointed_layer_holds_no_layout_between_forward_and_backward(documents, window):
    """Nothing but the output outlives the forward of a checkpointed call (its layout lists up to 272 columns per
    query block); the backward, from the recomputed layout, gives the gradients of a call without checkpointing to
    the bit (GQA, packed documents, a sliding-window layer)."""
    s = 1024
    meta = (TokenMeta.contiguous(1, s) if documents is None else
            TokenMeta.from_segments(torch.repeat_interleave(torch.arange(len(documents)),
                                                            torch.tensor(documents)).unsqueeze(0)))
    cfg = SparseAttentionConfig(budget_mode="topk", vertical_topk=256, slash_topk=2, min_seq_len=256, block_size=32,
                                sink_tokens=16, local_window=32, attention_engine="masked")
    q, k, v = _inputs(s)
    out, held = _held_after_forward(q, k, v, meta, cfg, window)
    assert held == 0
    out.square().sum().backward()
    grads = [x.grad for x in (q, k, v)]
    q, k, v = _inputs(s)
    sequence_attention(q, k, v, meta, cfg, sliding_window=window)[0].square().sum().backward()
    assert all(torch.equal(a, x.grad) for a, x in zip(grads, (q, k, v)))


def _estimation_bytes(s: int) -> tuple[int, int]:
    q, k, _ = (x.detach() for x in _inputs(s, hq=14, hk=2, d=64))
    cfg = SparseAttentionConfig(budget_mode="topk", vertical_topk=200, slash_topk=4, min_seq_len=256, block_size=64)
    with AllocationRecorder(with_sites=False) as rec:
        estimate_layout(q, k, cfg)
    return rec.peak_bytes, rec.largest


def test_estimation_and_layout_grow_linearly_in_s_for_a_fixed_budget():
    """With the budget fixed, no tensor of estimation and layout construction (0.5B's heads: 14 query heads, 2
    key/value heads, head_dim 64) grows faster than S: no dense [heads, blocks, blocks] anywhere."""
    (peak1, largest1), (peak2, largest2) = _estimation_bytes(4096), _estimation_bytes(8192)
    assert peak2 / peak1 <= 2.2 and largest2 / largest1 <= 2.2


def test_a_restored_layout_keeps_only_derived_values_that_still_hold():
    """`take_apart` / `restore` keep the contract of `SparseLayout.derived`: a value whose layout tensors or inputs
    were written in place since it was computed, before the layout was taken apart or between that and its use
    (a token tensor written between a forward and its backward), is computed again, never reused stale."""
    from hf_sparse_cp.testing.layouts import random_layout

    tokens = torch.arange(64)
    calls = []

    def doubled(layout):
        return layout.derived("doubled", (tokens,), None, lambda: calls.append(1) or (tokens * 2,))

    layout = random_layout(1, 2, 64, 64, 16, 0.6, 0.2, generator=torch.Generator().manual_seed(3))
    doubled(layout)
    tensors, skeleton = layout.take_apart()
    assert len(tensors) == 5  # the value travels while it holds
    assert doubled(skeleton.restore(tensors))[0] is tensors[4] and len(calls) == 1
    tokens.add_(1)  # after take_apart: the restored value no longer holds
    assert torch.equal(doubled(skeleton.restore(tensors))[0], tokens * 2) and len(calls) == 2

    layout = random_layout(1, 2, 64, 64, 16, 0.6, 0.2, generator=torch.Generator().manual_seed(4))
    doubled(layout)
    layout.block_cnt[0, 0, 0] = 0  # before take_apart: the kept value is stale, it does not travel
    tensors, skeleton = layout.take_apart()
    assert len(tensors) == 4
    doubled(skeleton.restore(tensors))
    assert len(calls) == 4


def test_derived_values_of_inference_tensors_are_computed_again_not_kept_past_a_write():
    """A layout built or read under `torch.inference_mode` (the kernels' full/partial split at inference on CUDA) holds
    inference tensors, which count no in-place writes: reading their `_version` raised "Inference tensors do not
    track version counter". Nothing can tell whether they were written since, so the value is computed again."""
    from hf_sparse_cp.testing.layouts import random_layout

    calls = []
    with torch.inference_mode():
        tokens = torch.arange(64)
        layout = random_layout(1, 2, 64, 64, 16, 0.6, 0.2, generator=torch.Generator().manual_seed(3))
        for _ in range(2):
            doubled = layout.derived("doubled", (tokens,), None, lambda: calls.append(1) or (tokens * 2,))
            tokens.add_(1)  # (uncounted)
        tensors, skeleton = layout.take_apart()
    assert torch.equal(doubled[0], (tokens - 1) * 2) and len(calls) == 2 and len(tensors) == 4


def _bench_shaped_inputs(s: int, bs: int = 64, heads: int = 14, seed: int = 0, columns: int | None = None) -> dict:
    """bench_e2e's pattern for 0.5B scaled to S: 14 query heads, 0.01 * S kept columns per head (or `columns`, and 64
    sinks), about 0.02 * NB kept block diagonals per head, blocks of 64."""
    g = torch.Generator().manual_seed(seed)
    nb = s // bs
    verticals = torch.zeros(1, heads, s, dtype=torch.bool)
    verticals[..., :64] = True
    verticals.scatter_(-1, torch.rand(1, heads, s, generator=g).argsort(-1)[..., : columns or s // 100], True)
    diagonals = torch.zeros(1, heads, nb, dtype=torch.bool)
    diagonals[..., :2] = True
    diagonals.scatter_(-1, torch.rand(1, heads, nb, generator=g).argsort(-1)[..., : nb // 50], True)
    return dict(meta=TokenMeta.contiguous(1, s), block_size=bs, diagonals=diagonals, verticals=verticals,
                max_verticals=int(verticals.sum(-1).max()))


def test_building_a_layout_peaks_below_twice_its_size(monkeypatch):
    """With bench_e2e's budget, from 512K tokens on a head's [NQB, window] column window exceeds
    build.LAYOUT_ELEMENTS and the columns are built one head at a time (set here at S = 16K): each head's column
    mask is compacted into its slice of col_idx, so the build holds col_idx, a bool per window slot and one head's
    temporaries. It held every head's window values and masks until one compaction: 2.5x the layout."""
    from hf_sparse_cp.attention import build

    monkeypatch.setattr(build, "LAYOUT_ELEMENTS", 1)
    with AllocationRecorder(with_sites=False) as rec:
        layout = build.build_layout(**_bench_shaped_inputs(16384))
    final = sum(x.untyped_storage().nbytes() for x in (layout.block_idx, layout.block_cnt, layout.col_idx,
                                                         layout.col_cnt))
    assert layout.col_idx.shape[-1] > 200  # the columns are most of it
    assert rec.peak_bytes <= 2.0 * final


@pytest.mark.parametrize("s", [4096, 16384])
@pytest.mark.parametrize("columns", [None, 256, 0], ids=["1%", "256", "none"])
@pytest.mark.parametrize("chunk_heads", [None, 1, 3], ids=["every-head", "one-head", "three-block-heads"])
def test_the_memory_model_counts_the_peak_of_building_a_layout(s, columns, chunk_heads, monkeypatch):
    """`layout_construction_bytes` (the memory model's term) is the build's recorded peak within 3%, with 0.01 * S,
    256 or no kept columns per head: every head in one chunk, one head at a time (the columns from 512K), or the key
    blocks three heads at a time (a last chunk of two). The old term (an int64 value and a bool per column slot,
    three int64 per block slot of a chunk) was about 1.5x the peak with columns built one head at a time and 0.5x
    with every head in one chunk."""
    from hf_sparse_cp.attention import build
    from hf_sparse_cp.simulator.memory_model.attention_geometry import layout_construction_bytes

    kw = _bench_shaped_inputs(s, columns=columns)
    if columns == 0:
        del kw["verticals"], kw["max_verticals"]
    block_width = build.build_layout(**kw).block_idx.shape[-1]
    if chunk_heads is not None:
        monkeypatch.setattr(build, "LAYOUT_ELEMENTS", chunk_heads * (s // 64) * block_width)
    with AllocationRecorder(with_sites=False) as rec:
        layout = build.build_layout(**kw)
    window = kw.get("max_verticals", 0)  # the last query block's window holds every kept column of its head
    per_token, chunk = layout_construction_bytes(14, s // 64, layout.block_idx.shape[-1], window, 64)
    assert 0.97 <= (per_token * s + chunk) / rec.peak_bytes <= 1.03


def _listed_columns(kw: dict, layout) -> torch.Tensor:
    """col_idx from the definition: the kept columns of each query block's set (none for set -1), ascending, that a
    query of the block sees and that lie outside the block's listed key blocks, padded with -1."""
    meta, bs = kw["meta"], kw["block_size"]
    b, s = meta.segment.shape
    nb = -(-s // bs)
    heads = layout.col_idx.shape[1]
    seen = torch.nn.functional.pad(visible(meta, meta, window=kw["sliding_window"]), (0, 0, 0, nb * bs - s))
    seen = seen.view(b, 1, nb, bs, s).any(3).expand(b, heads, nb, s)  # [B, H, NQB, S]
    sets = kw["vertical_set"]
    kept = kw["verticals"].expand(b, heads, -1, s).gather(2, sets.clamp_min(0).view(b, 1, nb, 1).expand(
        b, heads, nb, s)) & (sets >= 0).view(b, 1, nb, 1)
    listed = torch.zeros(b, heads, nb, nb + 1, dtype=torch.bool)
    valid = torch.arange(layout.block_idx.shape[-1]) < layout.block_cnt.unsqueeze(-1)
    listed.scatter_(-1, torch.where(valid, layout.block_idx.long(), nb), True)
    columns = kept & seen & ~listed[..., torch.arange(s) // bs]
    width = int(columns.sum(-1).max())
    order = torch.where(columns, torch.arange(s), s).sort(-1).values[..., :width]
    return torch.where(order < s, order, -1).int()


@pytest.mark.parametrize("trial", range(24))
def test_the_columns_of_a_layout_are_those_of_the_definition(trial, monkeypatch):
    """Packed documents (a padded tail in some), sliding windows, kept columns shared by all heads (one key/value
    head's) or per head, several column sets: col_idx and col_cnt are the definition's to the bit, built in one
    head chunk or one head at a time. (With several sets, the window of a partial last query block ran past S into
    the next set and listed its first columns as keys S, S + 1, ...)"""
    from hf_sparse_cp.attention import build

    if trial % 2:
        monkeypatch.setattr(build, "LAYOUT_ELEMENTS", 1)
    g = torch.Generator().manual_seed(trial)
    b, s, bs, heads, sets = 2, int(torch.randint(100, 400, (1,), generator=g)), (16, 32)[trial % 3 == 0], 4, 3
    seg = torch.zeros(b, s, dtype=torch.int32)
    for row in range(b):
        for i, cut in enumerate(sorted(torch.randint(1, s, (trial % 3,), generator=g).tolist())):
            seg[row, cut:] = i + 1
        if trial % 4 == 0:
            seg[row, s - s // 5 :] = PAD_SEGMENT
    nb = -(-s // bs)
    kw = dict(meta=TokenMeta.from_segments(seg), block_size=bs,
              diagonals=torch.rand(b, heads, nb, generator=g) < 0.2,
              verticals=torch.rand(b, heads if trial % 4 < 2 else 1, sets, s, generator=g) < 0.15,
              vertical_set=torch.randint(-1, sets, (b, nb), generator=g),
              dense_tokens=torch.rand(b, s, generator=g) < 0.1,
              sliding_window=int(torch.randint(20, 150, (1,), generator=g)) if trial % 3 == 1 else None)
    layout = build.build_layout(**kw)
    expected = _listed_columns(kw, layout)
    assert torch.equal(layout.col_idx, expected)
    assert torch.equal(layout.col_cnt, (expected >= 0).sum(-1, dtype=torch.int32))



@pytest.mark.parametrize("s", [1 << 15, 1 << 17])
def test_under_the_ring_every_rank_builds_the_whole_sequences_layout(s):
    """Under the ring every rank builds the one-process layout of the whole sequence (`estimate_layout_cp`: the
    global layout, over `CPShard.meta` of the whole batch): the memory model's construction term is the same build's
    bytes at CP 8 as in one process, not an eighth of it."""
    from hf_sparse_cp.simulator.memory_model.presets import PRESETS
    from hf_sparse_cp.simulator.memory_model.settings import StepSettings
    from hf_sparse_cp.simulator.memory_model.step import _Step

    built = {}
    for cp in (1, 8):
        step = _Step(PRESETS["qwen2.5-0.5b"], s, StepSettings(cp=cp))
        assert step.ring == (cp > 1) and step.sparse and step.hq_att == PRESETS["qwen2.5-0.5b"].shape.heads
        per_token, constant = step.geometry.construction
        built[cp] = per_token * step.t + constant
    assert built[8] == pytest.approx(built[1], rel=1e-9)


@pytest.mark.parametrize("chunk", [None, 128], ids=["last-queries", "causal-chunks"])
def test_the_memory_model_counts_every_causal_chunks_score_set(chunk):
    """Issue #50: with estimation='causal_chunks' one process holds a set of scores per chunk (int64 [heads, sets, S]
    vertical and slash sums), S^2 / estimation_chunk in all; the memory model counted one set whatever the chunk
    (`hf-sparse-cp memory` said 1.1M tokens of Qwen2.5-0.5B fit 80 GB with chunks of 1024, whose sets alone take
    270 GB), and the sets, scored into separate tensors and then stacked, were held twice. The estimation's recorded
    peak is the model's term within 10% (0.5B's heads; 63 sets at 8K tokens)."""
    from hf_sparse_cp.simulator.memory_model.presets import PRESETS
    from hf_sparse_cp.simulator.memory_model.settings import StepSettings
    from hf_sparse_cp.simulator.memory_model.step import _Step

    s = 8192
    kw = dict(budget_mode="topk", vertical_topk=200, slash_topk=4, min_seq_len=256, block_size=64, last_q=16)
    cfg = SparseAttentionConfig(**kw, **({} if chunk is None else dict(estimation="causal_chunks",
                                                                       estimation_chunk=chunk)))
    q, k, _ = (x.detach() for x in _inputs(s, hq=14, hk=2, d=64))
    with AllocationRecorder(with_sites=False) as rec:
        estimate_layout(q, k, cfg)
    step = _Step(PRESETS["qwen2.5-0.5b"], s, StepSettings(device="cpu", pattern=cfg))
    predicted = max(per_token * step.t + constant for per_token, constant in (step.geometry.estimation,
                                                                              step.geometry.construction))
    assert 0.9 <= predicted / rec.peak_bytes <= 1.1


def test_the_key_block_csr_holds_about_five_int32_per_layout_slot():
    """Issue #50: the transposed layout that the dK/dV kernel walks (`kernels.indexing.key_block_csr`) is built at
    every backward call over the whole layout: int64 sort keys, their sorted copy, the block ids and the validity
    held beside the sort made 42 bytes per layout slot, ten times block_idx (0.5B's 14 heads at 1M tokens with a 5%
    budget in blocks of 64: 188M slots, 7.9 GB); int32 keys where they fit and nothing held across the sort: 20."""
    from hf_sparse_cp.kernels.indexing import key_block_csr
    from hf_sparse_cp.testing.layouts import random_layout

    s = 16384
    layout = random_layout(1, 14, s, s, 64, 0.1, 0.01, generator=torch.Generator().manual_seed(0))
    partial = torch.rand(layout.block_idx.shape, generator=torch.Generator().manual_seed(1)) < 0.2
    with AllocationRecorder(with_sites=False) as rec:
        row_ptr, entries = key_block_csr(layout.block_idx, layout.block_cnt, partial, 14, 2, s // 64)
    assert row_ptr.dtype == torch.int64 and int(row_ptr[-1]) == int(layout.block_cnt.sum())
    assert rec.peak_bytes <= 24 * layout.block_idx.numel()  # (42 before)
