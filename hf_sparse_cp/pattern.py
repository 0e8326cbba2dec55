"""Vertical-slash pattern estimation (MTraining) and layout construction.

At every attention call, the last `last_q` queries of each long document score every earlier
key of their document: a key column's *vertical* score is the attention mass it receives, a
diagonal's *slash* score the mass along offset `q - k`. Each query head keeps its best columns
and diagonals (top-k, or top-p with a cap), plus the document's first `sink_tokens` columns and
the `local_window` diagonals next to the main one. Diagonals become key blocks along the block
diagonals they cross; kept columns outside those blocks become token columns.

Documents shorter than `min_seq_len` stay dense (every causal block of the document); so does
every layer with a sliding window (already local) and every layer whose pattern is "dense".
GQA: the queries of a group are scored against their shared key head, never a replicated one.

Scoring is split into pieces that also serve a sequence split over ranks
(`hf_sparse_cp.distributed.estimation`): `row_softmax_stats` gives the partial softmax normaliser
of query rows over some keys, `accumulate_vertical_slash` adds the mass those keys receive, and
`layout_from_scores` turns reduced scores into the layout. Scores are fp32 (fp64 for fp64 inputs).
"""

from __future__ import annotations

import math

import torch

from .config import SparseAttentionConfig
from .layout import SparseLayout, compact_sorted
from .tokens import PAD_SEGMENT, TokenMeta, document_starts

# Elements of one [group, rows, keys] score tile in estimation.
_SCORE_ELEMENTS = 1 << 24


def documents(segment_row: torch.Tensor) -> list[tuple[int, int]]:
    """(start, end) of each non-padding document of one row of segment ids."""
    ids, counts = torch.unique_consecutive(segment_row, return_counts=True)
    ends = torch.cumsum(counts, 0).tolist()
    starts = [0] + ends[:-1]
    return [(s, e) for s, e, i in zip(starts, ends, ids.tolist()) if i != PAD_SEGMENT]


def score_dtype(x: torch.Tensor) -> torch.dtype:
    """Estimation arithmetic: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def last_query_rows(start: int, end: int, last_q: int, device=None) -> torch.Tensor:
    """Positions of the (at most) `last_q` final queries of the document [start, end) that score it."""
    return torch.arange(max(start, end - last_q), end, device=device)


def _score_tiles(q_rows: torch.Tensor, k_keys: torch.Tensor, visible: torch.Tensor, scale: float):
    """Masked, scaled scores tile by tile: yields (query heads slice, scores [heads, R, L]).

    q_rows: [Hq, R, D], k_keys: [Hkv, L, D] in the estimation dtype; visible: bool [R, L]. Query
    heads of a GQA group are scored against their shared key head; tiles bound the memory.
    """
    hq, r, d = q_rows.shape
    hk = k_keys.shape[0]
    g = hq // hk
    qe = q_rows.view(hk, g, r, d)
    g_chunk = max(1, min(g, _SCORE_ELEMENTS // max(1, r * k_keys.shape[1])))
    for h in range(hk):
        for g0 in range(0, g, g_chunk):
            g1 = min(g, g0 + g_chunk)
            sc = torch.einsum("grd,ld->grl", qe[h, g0:g1], k_keys[h]) * scale
            yield slice(h * g + g0, h * g + g1), sc.masked_fill(~visible, float("-inf"))


def row_softmax_stats(
    q_rows: torch.Tensor, k_keys: torch.Tensor, visible: torch.Tensor, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per query row, the max score over these keys and the sum of exp(score - max) ([Hq, R] each).

    Partial statistics of a sharded key set combine across ranks as M = max(m), Z = sum(z exp(m - M)).
    Rows that see none of these keys give (-inf, 0).
    """
    hq, r = q_rows.shape[:2]
    row_max = torch.full((hq, r), float("-inf"), dtype=q_rows.dtype, device=q_rows.device)
    row_sum = torch.zeros(hq, r, dtype=q_rows.dtype, device=q_rows.device)
    for heads, sc in _score_tiles(q_rows, k_keys, visible, scale):
        m = sc.amax(-1)
        safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
        row_max[heads] = m
        row_sum[heads] = torch.exp(sc - safe.unsqueeze(-1)).sum(-1)
    return row_max, row_sum


def accumulate_vertical_slash(
    q_rows: torch.Tensor,
    k_keys: torch.Tensor,
    row_pos: torch.Tensor,
    key_pos: torch.Tensor,
    scale: float,
    vertical: torch.Tensor,
    slash: torch.Tensor,
    normalizer: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """Add the attention mass of query rows at positions `row_pos` on keys at `key_pos`:
    vertical[h, key] += mass the key receives, slash[h, row - key] += mass on that offset.

    Keys after a row are invisible. Probabilities are a softmax over these keys, or, with
    `normalizer` = (row max, row sum of exp(score - max)) of the row's *whole* key set (keys split
    over ranks), exp(score - max) / sum.
    """
    visible = key_pos.unsqueeze(0) <= row_pos.unsqueeze(1)  # [R, L]
    offset = (row_pos.unsqueeze(1) - key_pos.unsqueeze(0)).clamp_min(0)
    for heads, sc in _score_tiles(q_rows, k_keys, visible, scale):
        if normalizer is None:
            a = torch.softmax(sc, dim=-1)
        else:
            a = torch.exp(sc - normalizer[0][heads].unsqueeze(-1)) / normalizer[1][heads].unsqueeze(-1)
        vertical[heads].index_add_(1, key_pos, a.sum(1))
        slash[heads].scatter_add_(1, offset.flatten().expand(a.shape[0], -1), a.flatten(1))


def score_vertical_slash(
    q: torch.Tensor, k: torch.Tensor, docs: list[tuple[int, int]], last_q: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical and slash scores of one batch row.

    q: [Hq, S, D], k: [Hkv, S, D]; docs: (start, end) of the documents to score.
    Returns (vertical [Hq, S], slash [Hq, S]) in fp32 (fp64 for fp64 inputs): vertical[h, j] is the
    attention mass key j receives from its document's last `last_q` queries; slash[h, o] the mass
    on offset o = q - k.
    """
    hq, s, _ = q.shape
    dtype = score_dtype(q)
    vertical = torch.zeros(hq, s, dtype=dtype, device=q.device)
    slash = torch.zeros(hq, s, dtype=dtype, device=q.device)
    for start, end in docs:
        rows = last_query_rows(start, end, last_q, q.device)
        keys = torch.arange(start, end, device=q.device)
        accumulate_vertical_slash(q[:, rows].to(dtype), k[:, start:end].to(dtype), rows, keys, scale, vertical, slash)
    return vertical, slash


def _select(scores: torch.Tensor, mode: str, topk: int, topp: float, cap: int) -> torch.Tensor:
    """Boolean [H, S] of the kept entries of each row of scores (only positive scores are kept)."""
    n = scores.shape[-1]
    if mode == "topk":
        kk = min(topk, n)
        if kk == 0:
            return torch.zeros_like(scores, dtype=torch.bool)
        vals, idx = torch.topk(scores, kk, dim=-1)
        keep = torch.zeros_like(scores, dtype=torch.bool)
        return keep.scatter_(-1, idx, vals > 0)
    vals, idx = torch.sort(scores, dim=-1, descending=True)
    total = vals.sum(-1, keepdim=True).clamp_min(torch.finfo(vals.dtype).tiny)
    before = (torch.cumsum(vals, -1) - vals) / total  # mass of the better-ranked entries
    rank = torch.arange(n, device=scores.device)
    take = (before < topp) & (rank < cap) & (vals > 0)
    return torch.zeros_like(take).scatter_(-1, idx, take)


def select_vertical_slash(
    vertical: torch.Tensor, slash: torch.Tensor, docs: list[tuple[int, int]], cfg: SparseAttentionConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept key columns and kept diagonal offsets ([H, S] bool each) of one batch row."""
    keep_v = _select(vertical, cfg.budget_mode, cfg.vertical_topk, cfg.vertical_topp, cfg.vertical_cap)
    keep_s = _select(slash, cfg.budget_mode, cfg.slash_topk, cfg.slash_topp, cfg.slash_cap)
    for start, end in docs:
        keep_v[:, start : min(end, start + cfg.sink_tokens)] = True
    keep_s[:, : cfg.local_window] = True
    return keep_v, keep_s


def offsets_to_block_diagonals(keep_offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block diagonals d = qb - kb crossed by the kept token diagonals ([..., S] -> [..., ceil(S/bs)]).

    Tokens q, k with q - k = o lie in blocks whose block distance is floor(o/bs) or ceil(o/bs).
    """
    s = keep_offsets.shape[-1]
    nb = -(-s // block_size)
    o = torch.arange(s, device=keep_offsets.device)
    hits = torch.zeros(*keep_offsets.shape[:-1], nb + 1, dtype=torch.int32, device=keep_offsets.device)
    for d in (o // block_size, -(-o // block_size)):
        hits.index_add_(-1, d, keep_offsets.to(torch.int32))
    return hits[..., :nb] > 0


def build_layout(
    meta: TokenMeta,
    block_size: int,
    *,
    diagonals: torch.Tensor | None = None,
    verticals: torch.Tensor | None = None,
    dense_tokens: torch.Tensor | None = None,
    sliding_window: int | None = None,
) -> SparseLayout:
    """Layout of one full (unsharded) sequence per row.

    meta: tokens in global order. diagonals: bool [B, H, NB], block diagonals kept per head.
    verticals: bool [B, H, S], key columns kept per head. dense_tokens: bool [B, S], queries whose
    whole causal document prefix is kept. Blocks that hold no visible pair (other documents,
    outside the sliding window, padding-only) are never listed.
    """
    bs = block_size
    b, s = meta.segment.shape
    dev = meta.segment.device
    nqb = -(-s // bs)
    s_pad = nqb * bs
    padded = meta.pad_to(s_pad)
    big = torch.iinfo(torch.int64).max // 4
    valid_q = (padded.segment != PAD_SEGMENT).view(b, nqb, bs)
    start = document_starts(meta)
    start = torch.cat([start, torch.full((b, s_pad - s), big, device=dev, dtype=start.dtype)], 1).view(b, nqb, bs)
    qb = torch.arange(nqb, device=dev)

    lo_tok = torch.where(valid_q, start, big).amin(-1)  # [B, NQB] first visible key token
    lo = torch.where(lo_tok < big, lo_tok // bs, qb + 1)
    if sliding_window is not None:
        win_lo = torch.div(qb * bs - sliding_window - bs + 1, bs, rounding_mode="floor") + 1
        lo = torch.maximum(lo, win_lo.clamp_min(0))
    if dense_tokens is None:
        dense_lo = torch.full_like(lo, big)
    else:
        dt = torch.nn.functional.pad(dense_tokens, (0, s_pad - s)).view(b, nqb, bs) & valid_q
        dense_lo = torch.where(dt, start // bs, big).amin(-1)
    dense_lo = torch.maximum(dense_lo, lo)  # [B, NQB]

    def listed(kb: torch.Tensor, diag_hit: torch.Tensor | None) -> torch.Tensor:
        """Whether key block kb ([B, H, NQB, N]) is listed for its query block."""
        qbx = qb.view(1, 1, -1, 1)
        ok = (kb >= lo.unsqueeze(1).unsqueeze(-1)) & (kb <= qbx)
        dense = kb >= dense_lo.unsqueeze(1).unsqueeze(-1)
        return ok & (dense if diag_hit is None else dense | diag_hit)

    cands, oks = [], []
    width = int((qb - dense_lo + 1).clamp(min=0, max=nqb).max()) if nqb else 0
    if width:
        kb = qb.view(1, 1, -1, 1) - torch.arange(width, device=dev)
        cands.append(kb.expand(b, 1, nqb, width))
        oks.append(listed(kb, None))
    heads = 1
    if diagonals is not None:
        heads = diagonals.shape[1]
        d_list, d_cnt = compact_sorted(torch.arange(nqb, device=dev).expand_as(diagonals), diagonals)
        kb = qb.view(1, 1, -1, 1) - d_list.long().unsqueeze(2)
        d_ok = torch.arange(d_list.shape[-1], device=dev) < d_cnt.unsqueeze(-1)
        cands.append(kb.expand(b, heads, nqb, -1))
        oks.append(listed(kb, d_ok.unsqueeze(2)) & d_ok.unsqueeze(2))
    if cands:
        cand = torch.cat([c.expand(b, heads, nqb, -1) for c in cands], -1)
        ok = torch.cat([o.expand(b, heads, nqb, -1) for o in oks], -1)
        block_idx, block_cnt = compact_sorted(cand, ok)
    else:
        block_idx = torch.empty(b, heads, nqb, 0, dtype=torch.int32, device=dev)
        block_cnt = torch.zeros(b, heads, nqb, dtype=torch.int32, device=dev)

    if verticals is not None and bool(verticals.any()):
        heads = max(heads, verticals.shape[1])
        v_list, v_cnt = compact_sorted(torch.arange(s, device=dev).expand_as(verticals), verticals)
        v = v_list.long().unsqueeze(2)  # [B, H, 1, NV]
        v_ok = torch.arange(v_list.shape[-1], device=dev) < v_cnt.unsqueeze(-1)
        cb = v // bs
        qbx = qb.view(1, 1, -1, 1)
        diag_hit = None
        if diagonals is not None:
            row = torch.arange(b * diagonals.shape[1], device=dev).view(b, -1, 1, 1) * nqb
            diag_hit = diagonals.reshape(-1)[row + (qbx - cb).clamp(0, nqb - 1)]
        covered = listed(cb, diag_hit)
        col_ok = v_ok.unsqueeze(2) & (v < qbx * bs) & (v >= lo_tok.view(b, 1, nqb, 1)) & ~covered
        if sliding_window is not None:
            col_ok &= v > qbx * bs + bs - 1 - sliding_window
        col_idx, col_cnt = compact_sorted(v.expand(b, -1, nqb, -1), col_ok)
        if block_idx.shape[1] != heads:
            block_idx = block_idx.expand(b, heads, nqb, -1).contiguous()
            block_cnt = block_cnt.expand(b, heads, nqb).contiguous()
    else:
        col_idx = torch.empty(b, heads, nqb, 0, dtype=torch.int32, device=dev)
        col_cnt = torch.zeros(b, heads, nqb, dtype=torch.int32, device=dev)
    return SparseLayout(block_idx, block_cnt, col_idx, col_cnt, bs)


def dense_layout(meta: TokenMeta, block_size: int, sliding_window: int | None = None) -> SparseLayout:
    """Every block that holds a visible pair, shared by all heads (exact dense attention)."""
    return build_layout(meta, block_size, dense_tokens=meta.segment != PAD_SEGMENT, sliding_window=sliding_window)


def long_documents(meta: TokenMeta, cfg: SparseAttentionConfig) -> list[list[tuple[int, int]]]:
    """Per batch row, the documents long enough (>= min_seq_len) for a sparse pattern."""
    return [
        [(st, en) for st, en in documents(meta.segment[row]) if en - st >= max(cfg.min_seq_len, 1)]
        for row in range(meta.segment.shape[0])
    ]


def layout_from_scores(
    meta: TokenMeta,
    cfg: SparseAttentionConfig,
    docs: list[list[tuple[int, int]]],
    scores: list[tuple[torch.Tensor, torch.Tensor] | None],
) -> SparseLayout:
    """The layout once every sparse row has its (vertical, slash) scores ([H, S] each; None for rows
    without long documents): long documents get their selected verticals and slashes, every other
    token its dense causal document prefix."""
    b, s = meta.segment.shape
    dev = meta.segment.device
    if not any(docs):
        return dense_layout(meta, cfg.block_size)
    heads = next(sc[0].shape[0] for sc in scores if sc is not None)
    dense_tokens = meta.segment != PAD_SEGMENT
    diagonals = torch.zeros(b, heads, -(-s // cfg.block_size), dtype=torch.bool, device=dev)
    verticals = torch.zeros(b, heads, s, dtype=torch.bool, device=dev)
    for row, row_docs in enumerate(docs):
        if not row_docs:
            continue
        for st, en in row_docs:
            dense_tokens[row, st:en] = False
        keep_v, keep_s = select_vertical_slash(scores[row][0], scores[row][1], row_docs, cfg)
        diagonals[row] = offsets_to_block_diagonals(keep_s, cfg.block_size)
        verticals[row] = keep_v
    return build_layout(meta, cfg.block_size, diagonals=diagonals, verticals=verticals, dense_tokens=dense_tokens)


def estimate_layout(
    q: torch.Tensor,
    k: torch.Tensor,
    cfg: SparseAttentionConfig,
    meta: TokenMeta | None = None,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
) -> SparseLayout:
    """The layout for one attention call: vertical-slash for long documents, dense for the rest.

    q: [B, Hq, S, D], k: [B, Hkv, S, D] (after RoPE), meta: the tokens' documents (default: one
    document per row). Deterministic: the same inputs give the same layout on every rank.
    """
    b, _, s, d = q.shape
    meta = TokenMeta.contiguous(b, s, q.device) if meta is None else meta
    if cfg.pattern == "dense" or sliding_window is not None:
        return dense_layout(meta, cfg.block_size, sliding_window)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    docs = long_documents(meta, cfg)
    scores = [score_vertical_slash(q[row], k[row], row_docs, cfg.last_q, scale) if row_docs else None
              for row, row_docs in enumerate(docs)]
    return layout_from_scores(meta, cfg, docs, scores)
