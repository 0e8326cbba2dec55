"""A document's pattern depends on its own tokens and on positions inside it only (issue #41): the same
document packed at every offset modulo the block size, after other documents, keeps the same columns and
diagonals (relative to its start) as alone at position 0, in every budget mode, with sampled scoring
queries, far blocks ('mass_near_blocks') and causal chunks."""

from __future__ import annotations

import pytest
import torch

from hf_sparse_cp import SparseAttentionConfig
from hf_sparse_cp.attention.estimate import estimate_whole_rows
from hf_sparse_cp.attention.tokens import TokenMeta

BS, D, DOC = 16, 16, 230
BASE = SparseAttentionConfig(block_size=BS, min_seq_len=64, sink_tokens=2, local_window=4, last_q=24)
MODES = {
    "top-k": BASE.replace(budget_mode="topk", vertical_topk=12, slash_topk=20),
    "top-p": BASE.replace(budget_mode="topp", vertical_topp=0.6, slash_topp=0.6, vertical_cap=100, slash_cap=100),
    "top-k, sampled": BASE.replace(budget_mode="topk", vertical_topk=12, slash_topk=20, sample_groups=3,
                                   sample_group_size=6),
    "mass": BASE.replace(budget_mode="mass", mass_target=0.7, mass_threshold=0.0),
    "mass, threshold": BASE.replace(budget_mode="mass", mass_target=0.4, mass_threshold=0.05, sample_groups=2,
                                    sample_group_size=8),
    "mass, near blocks": BASE.replace(budget_mode="mass", mass_target=0.7, mass_threshold=0.005, mass_near_blocks=2,
                                      sample_groups=2, sample_group_size=8),
    "mass, causal chunks": BASE.replace(budget_mode="mass", mass_target=0.7, mass_threshold=0.0,
                                        estimation="causal_chunks", estimation_chunk=3 * BS),
}


def _kept_in_document(cfg: SparseAttentionConfig, prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(kept columns, kept offsets) [H, sets, DOC] of one fixed document packed after a short document of
    `prefix` tokens (random, another per prefix) and before a long one, relative to the document's start."""
    g = torch.Generator().manual_seed(0)
    q_doc, k_doc = (torch.randn(h, DOC, D, generator=g) for h in (4, 2))
    other = torch.Generator().manual_seed(1 + prefix)
    n = prefix + DOC + 90
    q, k = (torch.randn(1, h, n, D, generator=other) for h in (4, 2))
    q[0, :, prefix : prefix + DOC], k[0, :, prefix : prefix + DOC] = q_doc, k_doc
    runs = [(0, prefix), (1, DOC), (2, 90)]
    meta = TokenMeta.from_segments(torch.cat([torch.full((m,), d, dtype=torch.int32) for d, m in runs]).unsqueeze(0))
    kept = estimate_whole_rows(q, k, cfg, meta).kept
    return kept.keep_v[0, :, :, prefix : prefix + DOC], kept.keep_s[0, :, :, prefix : prefix + DOC]


@pytest.mark.parametrize("mode", list(MODES))
def test_a_document_keeps_the_same_pattern_at_every_offset_in_a_block(mode):
    cfg = MODES[mode]
    alone_v, alone_s = _kept_in_document(cfg, 0)
    assert 0 < int(alone_v.sum()) + int(alone_s.sum()) < 0.5 * (alone_v.numel() + alone_s.numel())
    for prefix in [*range(1, BS), 2 * BS + 5, 3 * BS]:
        kept_v, kept_s = _kept_in_document(cfg, prefix)
        assert torch.equal(kept_v, alone_v) and torch.equal(kept_s, alone_s), prefix
