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

Scoring runs on CUDA in the Triton kernels of `hf_sparse_cp.kernels.vertical_slash` (no [H, R, L]
probabilities in memory, no atomics), elsewhere in PyTorch by tiles of heads and keys. It is also
split into pieces that serve a sequence split over ranks (`hf_sparse_cp.distributed.estimation`):
`row_softmax_stats` gives the partial softmax normaliser of query rows over some keys,
`accumulate_vertical_slash` adds the mass those keys receive, and `layout_from_scores` turns
reduced scores into the layout. Scores are fp32 (fp64 for fp64 inputs).

Layout construction is vectorized on the layout's device: per query block, the listed key blocks
come from counts of kept block diagonals (no sort, no [NQB, NKB] matrix) and the columns from an
order-keeping compaction of the kept key columns. Host synchronizations per call: one to read the
documents of the batch (none when the caller passes no token metadata: one document per row) and
one to size the layout's padded widths.
"""

from __future__ import annotations

import math

import torch

from .config import SparseAttentionConfig
from .layout import SparseLayout
from .tokens import PAD_SEGMENT, TokenMeta, document_starts, run_starts

# Elements of one [heads, rows, keys] score tile of the PyTorch scoring path.
_SCORE_ELEMENTS = 1 << 24
# Elements of one [heads, query blocks, candidates] tile of layout construction (bounds its temporaries).
_LAYOUT_ELEMENTS = 1 << 24
# "No such block / token" in the integer arithmetic of layout construction.
_BIG = torch.iinfo(torch.int64).max // 4


# ------------------------------------------------------------------------------------------ documents


def _document_table(segment: torch.Tensor) -> list[list[tuple[int, int]]]:
    """(start, end) of the non-padding documents of every row of [B, S] segment ids, read with one
    device-to-host copy."""
    b, s = segment.shape
    if s == 0:
        return [[] for _ in range(b)]
    flat = run_starts(segment).flatten().nonzero().flatten()
    rows = [[] for _ in range(b)]
    starts, ids = torch.stack([flat, segment.flatten()[flat].to(flat.dtype)]).tolist()
    for i, (pos, doc) in enumerate(zip(starts, ids)):
        row, start = divmod(pos, s)
        nxt = starts[i + 1] if i + 1 < len(starts) else b * s
        end = min(nxt - row * s, s)
        if doc != PAD_SEGMENT:
            rows[row].append((start, end))
    return rows


def long_documents(meta: TokenMeta, cfg: SparseAttentionConfig) -> list[list[tuple[int, int]]]:
    """Per batch row, the documents long enough (>= min_seq_len) for a sparse pattern."""
    shortest = max(cfg.min_seq_len, 1)
    return [[(st, en) for st, en in row if en - st >= shortest] for row in _document_table(meta.segment)]


# -------------------------------------------------------------------------------------------- scoring


def score_dtype(x: torch.Tensor) -> torch.dtype:
    """Estimation arithmetic: fp32, or fp64 for fp64 inputs."""
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def last_query_rows(start: int, end: int, last_q: int, device=None) -> torch.Tensor:
    """Positions of the (at most) `last_q` final queries of the document [start, end) that score it."""
    return torch.arange(max(start, end - last_q), end, device=device)


def _score_tiles(q_rows: torch.Tensor, k_keys: torch.Tensor, visible: torch.Tensor, scale: float):
    """Masked, scaled scores tile by tile: yields (query heads slice, keys slice, scores [heads, R, keys]).

    q_rows: [Hq, R, D], k_keys: [Hkv, L, D] in the estimation dtype; visible: bool [R, L]. Query
    heads of a GQA group are scored against their shared key head; tiles of heads and keys bound
    the memory whatever L.
    """
    hq, r, d = q_rows.shape
    hk, n = k_keys.shape[:2]
    g = hq // hk
    qe = q_rows.view(hk, g, r, d)
    g_chunk = max(1, min(g, _SCORE_ELEMENTS // max(1, r * n)))
    n_chunk = max(1, min(n, _SCORE_ELEMENTS // max(1, g_chunk * r)))
    for h in range(hk):
        for g0 in range(0, g, g_chunk):
            g1 = min(g, g0 + g_chunk)
            for n0 in range(0, n, n_chunk):
                keys = slice(n0, min(n, n0 + n_chunk))
                sc = torch.einsum("grd,ld->grl", qe[h, g0:g1], k_keys[h, keys]) * scale
                yield slice(h * g + g0, h * g + g1), keys, sc.masked_fill(~visible[:, keys], float("-inf"))


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
    for heads, _, sc in _score_tiles(q_rows, k_keys, visible, scale):
        m_old, m_tile = row_max[heads], sc.amax(-1)
        m_new = torch.maximum(m_old, m_tile)
        safe = torch.where(torch.isfinite(m_new), m_new, torch.zeros_like(m_new))
        tile_sum = torch.exp(sc - safe.unsqueeze(-1)).sum(-1)
        row_sum[heads] = row_sum[heads] * torch.exp(m_old - safe) + tile_sum
        row_max[heads] = m_new
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
    if normalizer is None:
        normalizer = row_softmax_stats(q_rows, k_keys, visible, scale)
    row_max = torch.where(torch.isfinite(normalizer[0]), normalizer[0], torch.zeros_like(normalizer[0]))
    for heads, keys, sc in _score_tiles(q_rows, k_keys, visible, scale):
        a = torch.exp(sc - row_max[heads].unsqueeze(-1)) / normalizer[1][heads].unsqueeze(-1)
        vertical[heads].index_add_(1, key_pos[keys], a.sum(1))
        offset = (row_pos.unsqueeze(1) - key_pos[keys].unsqueeze(0)).clamp_min(0)
        slash[heads].scatter_add_(1, offset.flatten().expand(a.shape[0], -1), a.flatten(1))


def _scoring_kernel(q: torch.Tensor, k: torch.Tensor):
    """The Triton scoring launcher when it takes these tensors (CUDA), else None (PyTorch path)."""
    if not q.is_cuda:
        return None
    from .kernels import vertical_slash

    return vertical_slash.vertical_slash_scores if vertical_slash.supports(q, k) else None


def score_vertical_slash(
    q: torch.Tensor, k: torch.Tensor, docs: list[tuple[int, int]], last_q: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical and slash scores of one batch row.

    q: [Hq, S, D], k: [Hkv, S, D]; docs: (start, end) of the documents to score.
    Returns (vertical [Hq, S], slash [Hq, S]) in fp32 (fp64 for fp64 inputs): vertical[h, j] is the
    attention mass key j receives from its document's last `last_q` queries; slash[h, o] the mass
    on offset o = q - k, summed over the documents.
    """
    hq, s, _ = q.shape
    dtype = score_dtype(q)
    vertical = torch.zeros(hq, s, dtype=dtype, device=q.device)
    slash = torch.zeros(hq, s, dtype=dtype, device=q.device)
    kernel = _scoring_kernel(q, k)
    for start, end in docs:
        r = min(last_q, end - start)
        if kernel is not None:
            v_doc, s_doc = kernel(q[:, end - r : end], k[:, start:end], scale)
            vertical[:, start:end] += v_doc
            slash[:, : end - start] += s_doc
            continue
        rows = last_query_rows(start, end, last_q, q.device)
        keys = torch.arange(start, end, device=q.device)
        accumulate_vertical_slash(q[:, end - r : end].to(dtype), k[:, start:end].to(dtype), rows, keys, scale,
                                  vertical, slash)
    return vertical, slash


def score_rows(
    q: torch.Tensor, k: torch.Tensor, docs: list[list[tuple[int, int]]], last_q: int, scale: float
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """`score_vertical_slash` of every batch row of q [B, Hq, S, D], k [B, Hkv, S, D] with documents
    to score (None for the others), as `layout_from_scores` takes them."""
    return [score_vertical_slash(q[row], k[row], row_docs, last_q, scale) if row_docs else None
            for row, row_docs in enumerate(docs)]


# ------------------------------------------------------------------------------------------ selection


def _select(scores: torch.Tensor, mode: str, topk: int, topp: float, cap: int) -> torch.Tensor:
    """Boolean [..., S] of the kept entries of each row of scores (only positive scores are kept)."""
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


def _selection_bound(cfg: SparseAttentionConfig, num_docs: int) -> int:
    """Most key columns one head of a row keeps: its budget plus the sinks of its documents."""
    budget = cfg.vertical_topk if cfg.budget_mode == "topk" else cfg.vertical_cap
    return budget + cfg.sink_tokens * num_docs


def select_vertical_slash(
    vertical: torch.Tensor, slash: torch.Tensor, docs: list[list[tuple[int, int]]], cfg: SparseAttentionConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept key columns and kept diagonal offsets ([B, H, S] bool each) from a batch's scores; docs: per
    row, its scored documents. The budget's picks plus every document's sink columns and the local
    window's diagonals; nothing for a row without documents."""
    keep_v = _select(vertical, cfg.budget_mode, cfg.vertical_topk, cfg.vertical_topp, cfg.vertical_cap)
    keep_s = _select(slash, cfg.budget_mode, cfg.slash_topk, cfg.slash_topp, cfg.slash_cap)
    for row, row_docs in enumerate(docs):
        if not row_docs:
            keep_v[row] = False
            keep_s[row] = False
            continue
        keep_s[row, :, : cfg.local_window] = True
        for start, end in row_docs:
            keep_v[row, :, start : min(end, start + cfg.sink_tokens)] = True
    return keep_v, keep_s


def offsets_to_block_diagonals(keep_offsets: torch.Tensor, block_size: int) -> torch.Tensor:
    """Block diagonals d = qb - kb crossed by the kept token diagonals ([..., S] -> [..., ceil(S/bs)]).

    Tokens q, k with q - k = o lie in blocks whose block distance is floor(o/bs) or ceil(o/bs):
    block diagonal d is crossed by an offset in [d*bs, (d+1)*bs) (floor) or in ((d-1)*bs, d*bs] (ceil).
    """
    s = keep_offsets.shape[-1]
    nb = -(-s // block_size)
    pad = nb * block_size - s
    keep = keep_offsets.bool()
    floor_hit = torch.nn.functional.pad(keep, (0, pad)).unflatten(-1, (nb, block_size)).any(-1)
    after = torch.nn.functional.pad(keep[..., 1:], (0, pad + 1))  # after[o] = keep[o + 1]
    ceil_hit = after.unflatten(-1, (nb, block_size)).any(-1)[..., :-1]  # block d - 1 of `after` serves d
    return floor_hit | torch.nn.functional.pad(ceil_hit, (1, 0))


# ---------------------------------------------------------------------------------------------- layout


def _compact(values: torch.Tensor, keep: torch.Tensor, width: int) -> torch.Tensor:
    """The kept values of each row in their order, in `width` int32 slots padded with -1.

    values broadcasts to keep's shape [..., N]; every row keeps at most `width` entries.
    """
    slot = torch.where(keep, keep.cumsum(-1, dtype=torch.int32) - 1, width).long()
    out = torch.full((*keep.shape[:-1], width + 1), -1, dtype=torch.int32, device=keep.device)
    out.scatter_(-1, slot, values.to(torch.int32).expand(keep.shape))  # dropped entries all land in the spare slot
    return out[..., :width]


def _head_chunks(heads: int, per_head: int):
    """Head ranges whose [heads, per_head] temporaries stay within _LAYOUT_ELEMENTS."""
    step = max(1, min(heads, _LAYOUT_ELEMENTS // max(1, per_head)))
    for h0 in range(0, heads, step):
        yield h0, min(heads, h0 + step)


def _one_or_range(x: torch.Tensor, h0: int, h1: int) -> torch.Tensor:
    """Heads h0:h1 of a [H, ...] tensor, or its single shared head."""
    return x if x.shape[0] == 1 else x[h0:h1]


def _first_visible_keys(meta: TokenMeta, block_size: int, sliding_window: int | None):
    """Per query block of [B, S] tokens: (valid queries bool [B, NQB, bs], their document starts
    [B, NQB, bs], the first key token any of them sees [B, NQB], the first key block that holds a
    visible key [B, NQB]; qb + 1 for a block of padding only)."""
    bs = block_size
    b, s = meta.segment.shape
    nqb = -(-s // bs)
    s_pad = nqb * bs
    qb = torch.arange(nqb, device=meta.segment.device)
    valid_q = (meta.pad_to(s_pad).segment != PAD_SEGMENT).view(b, nqb, bs)
    start = torch.nn.functional.pad(document_starts(meta), (0, s_pad - s), value=_BIG).view(b, nqb, bs)
    lo_tok = torch.where(valid_q, start, _BIG).amin(-1)
    lo = torch.where(lo_tok < _BIG, lo_tok // bs, qb + 1)
    if sliding_window is not None:
        win_lo = torch.div(qb * bs - sliding_window - bs + 1, bs, rounding_mode="floor") + 1
        lo = torch.maximum(lo, win_lo.clamp_min(0))
    return valid_q, start, lo_tok, lo


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
    return _build_layout(meta, block_size, diagonals, verticals, dense_tokens, sliding_window, max_verticals=None)


def _build_layout(meta, block_size, diagonals, verticals, dense_tokens, sliding_window, max_verticals):
    """`build_layout`; `max_verticals`, a bound on the kept columns of any (row, head) known to the
    caller, spares the host synchronization that would measure it."""
    bs = block_size
    b, s = meta.segment.shape
    dev = meta.segment.device
    nqb = -(-s // bs)
    s_pad = nqb * bs
    qb = torch.arange(nqb, device=dev)

    # per query block: the first visible key token, the first listable key block, the first dense one
    valid_q, start, lo_tok, lo = _first_visible_keys(meta, bs, sliding_window)
    if dense_tokens is None:
        dense_lo = torch.full_like(lo, _BIG)
    else:
        dt = torch.nn.functional.pad(dense_tokens, (0, s_pad - s)).view(b, nqb, bs) & valid_q
        dense_lo = torch.where(dt, start // bs, _BIG).amin(-1)
    dense_lo = torch.maximum(dense_lo, lo)

    # Listed key blocks of (head, query block): {qb - d : d kept, lo <= qb - d < dense_lo} (ascending,
    # i.e. kept diagonals d in (qb - dense_lo, qb - lo] taken in descending order), then the dense
    # range [dense_lo, qb]. The diagonals are a slice of the head's sorted kept list, found by counting.
    n_dense = (qb - dense_lo + 1).clamp_min(0).unsqueeze(1)  # [B, 1, NQB]
    if diagonals is None:
        heads_b, d_list, i_hi, n_diag = 1, None, None, torch.zeros_like(n_dense)
    else:
        heads_b = diagonals.shape[1]
        kept_upto = torch.nn.functional.pad(diagonals.cumsum(-1), (1, 0))  # [B, H, NB + 1]: #kept d < x
        d_list = _compact(torch.arange(nqb, device=dev), diagonals, nqb).long()

        def kept_at_most(x):  # [B, heads_b, NQB]: kept diagonals d <= x, per query block
            return kept_upto.gather(-1, (x + 1).unsqueeze(1).expand(b, heads_b, nqb))

        i_hi = kept_at_most(qb - lo)
        n_diag = (i_hi - kept_at_most((qb - dense_lo).clamp(-1, nqb - 1))).clamp_min(0)
    block_cnt = (n_diag + n_dense).to(torch.int32)  # [B, heads_b, NQB]

    # Columns of (head, query block): kept columns up to the end of the query block, visible from it, outside
    # its listed blocks. The mask is built in head chunks and compacted once its width is known.
    col_masks, col_widths, heads, v_list = [], [], heads_b, None
    any_vertical = torch.zeros((), dtype=torch.bool, device=dev)
    if verticals is not None:
        verticals = verticals & (meta.segment != PAD_SEGMENT).unsqueeze(1)  # nobody sees a padding key
        any_vertical = verticals.any()
        nv = int(verticals.sum(-1).max()) if max_verticals is None else max_verticals
        v_list = _compact(torch.arange(s, device=dev), verticals, min(nv, s))
        heads = max(heads_b, verticals.shape[1])
        for row in range(b):
            for h0, h1 in _head_chunks(heads, nqb * v_list.shape[-1]):
                mask = _column_mask(v_list[row], diagonals, row, h0, h1, qb, lo[row], lo_tok[row], dense_lo[row],
                                    bs, sliding_window)
                col_masks.append(mask)
                col_widths.append(mask.sum(-1).amax() if mask.numel() else torch.zeros((), device=dev))
    sizes = torch.stack([block_cnt.amax() if block_cnt.numel() else torch.zeros((), device=dev, dtype=torch.int32),
                         *(w.to(torch.int32) for w in col_widths), any_vertical.to(torch.int32)]).tolist()
    block_width, col_width, has_columns = sizes[0], max(sizes[1:-1], default=0), bool(sizes[-1])

    slot = torch.arange(block_width, device=dev)
    block_idx = torch.empty(b, heads_b, nqb, block_width, dtype=torch.int32, device=dev)
    for row in range(b):
        for h0, h1 in _head_chunks(heads_b, nqb * block_width):
            dense_kb = dense_lo[row].view(1, nqb, 1) + slot - n_diag[row, h0:h1].unsqueeze(-1)
            kb = torch.where(slot < block_cnt[row, h0:h1].unsqueeze(-1), dense_kb, -1)
            if d_list is not None:
                rank = (i_hi[row, h0:h1].unsqueeze(-1) - 1 - slot).clamp(0, nqb - 1)
                d = d_list[row, h0:h1].unsqueeze(1).expand(-1, nqb, -1).gather(-1, rank)
                kb = torch.where(slot < n_diag[row, h0:h1].unsqueeze(-1), qb.view(1, nqb, 1) - d, kb)
            block_idx[row, h0:h1] = kb
    if not has_columns:
        empty = torch.empty(b, heads_b, nqb, 0, dtype=torch.int32, device=dev)
        return SparseLayout(block_idx, block_cnt, empty, torch.zeros_like(block_cnt), bs)

    col_idx = torch.empty(b, heads, nqb, col_width, dtype=torch.int32, device=dev)
    col_cnt = torch.empty(b, heads, nqb, dtype=torch.int32, device=dev)
    masks = iter(col_masks)
    for row in range(b):
        for h0, h1 in _head_chunks(heads, nqb * v_list.shape[-1]):
            mask = next(masks)
            col_idx[row, h0:h1] = _compact(_one_or_range(v_list[row], h0, h1).unsqueeze(1), mask, col_width)
            col_cnt[row, h0:h1] = mask.sum(-1, dtype=torch.int32)
    if heads_b != heads:
        block_idx = block_idx.expand(b, heads, nqb, -1).contiguous()
        block_cnt = block_cnt.expand(b, heads, nqb).contiguous()
    return SparseLayout(block_idx, block_cnt, col_idx, col_cnt, bs)


def _column_mask(v_row, diagonals, row, h0, h1, qb, lo, lo_tok, dense_lo, bs, sliding_window) -> torch.Tensor:
    """bool [h1 - h0, NQB, NV]: which kept columns (v_row [Hv, NV], ascending, -1 padded) each query
    block of heads h0:h1 lists as token columns."""
    nqb, n = qb.shape[0], h1 - h0
    v = _one_or_range(v_row, h0, h1).long().unsqueeze(1)  # [n or 1, 1, NV]
    qbx = qb.view(1, nqb, 1)
    cb = v // bs
    covered = (cb >= lo.view(1, nqb, 1)) & (cb >= dense_lo.view(1, nqb, 1))  # inside the dense range
    if diagonals is not None:
        diag = _one_or_range(diagonals[row], h0, h1).unsqueeze(1).expand(n, nqb, -1)
        diag_hit = diag.gather(-1, (qbx - cb).clamp(0, nqb - 1).expand(n, nqb, -1))
        covered = covered | ((cb >= lo.view(1, nqb, 1)) & diag_hit)
    ok = (v >= 0) & (v < (qbx + 1) * bs) & (v >= lo_tok.view(1, nqb, 1)) & ~covered
    if sliding_window is not None:
        ok &= v > qbx * bs - sliding_window  # seen by the first query of the block (the widest window)
    return ok.expand(n, nqb, -1)


def dense_layout(meta: TokenMeta, block_size: int, sliding_window: int | None = None) -> SparseLayout:
    """Every block that holds a visible pair, shared by all heads (exact dense attention)."""
    return build_layout(meta, block_size, dense_tokens=meta.segment != PAD_SEGMENT, sliding_window=sliding_window)


def dense_kept_fraction(meta: TokenMeta, block_size: int, sliding_window: int | None = None) -> torch.Tensor:
    """`dense_layout(meta, block_size, sliding_window).kept_fraction()` without building the layout
    (for dense layers that run another kernel); a 0-d float64 tensor, no host synchronization."""
    _, _, _, lo = _first_visible_keys(meta, block_size, sliding_window)
    nqb = lo.shape[-1]
    listed = (torch.arange(nqb, device=lo.device) - lo + 1).clamp_min(0)
    return listed.double().sum(-1).mean() / (nqb * (nqb + 1) / 2)


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
    if not any(docs):
        return dense_layout(meta, cfg.block_size)
    zeros = torch.zeros_like(next(sc[0] for sc in scores if sc is not None))
    vertical = torch.stack([zeros if sc is None else sc[0] for sc in scores])  # [B, H, S]
    slash = torch.stack([zeros if sc is None else sc[1] for sc in scores])
    keep_v, keep_s = select_vertical_slash(vertical, slash, docs, cfg)
    dense_tokens = meta.segment != PAD_SEGMENT
    for row, row_docs in enumerate(docs):
        for st, en in row_docs:
            dense_tokens[row, st:en] = False
    bound = max(_selection_bound(cfg, len(row_docs)) for row_docs in docs)
    return _build_layout(meta, cfg.block_size, offsets_to_block_diagonals(keep_s, cfg.block_size), keep_v,
                         dense_tokens, None, max_verticals=bound)


def pattern_documents(
    cfg: SparseAttentionConfig, meta: TokenMeta | None, batch: int, seq_len: int, sliding_window: int | None = None
) -> list[list[tuple[int, int]]]:
    """Per batch row, the documents that get a sparse pattern in this call: none for a dense or
    sliding-window layer, else those of at least `min_seq_len` tokens (meta None: one document per
    row, known without reading the device). A call without any runs dense."""
    if cfg.pattern == "dense" or sliding_window is not None:
        return [[] for _ in range(batch)]
    if meta is None:
        return [[(0, seq_len)] if seq_len >= max(cfg.min_seq_len, 1) else [] for _ in range(batch)]
    return long_documents(meta, cfg)


def estimate_layout(
    q: torch.Tensor,
    k: torch.Tensor,
    cfg: SparseAttentionConfig,
    meta: TokenMeta | None = None,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    docs: list[list[tuple[int, int]]] | None = None,
) -> SparseLayout:
    """The layout for one attention call: vertical-slash for long documents, dense for the rest.

    q: [B, Hq, S, D], k: [B, Hkv, S, D] (after RoPE), meta: the tokens' documents (default: one
    document per row); docs: `pattern_documents` of this call when the caller has it already.
    Deterministic: the same inputs give the same layout on every rank.
    """
    b, _, s, d = q.shape
    docs = pattern_documents(cfg, meta, b, s, sliding_window) if docs is None else docs
    meta = TokenMeta.contiguous(b, s, q.device) if meta is None else meta
    if not any(docs):
        return dense_layout(meta, cfg.block_size, sliding_window)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return layout_from_scores(meta, cfg, docs, score_rows(q, k, docs, cfg.last_q, scale))
