"""Vertical-slash pattern estimation (MTraining): which key columns and diagonals each head keeps.

At every attention call, the last `last_q` queries of each long document score every earlier
key of their document: a key column's *vertical* score is the attention mass it receives, a
diagonal's *slash* score the mass along offset `q - k`. Each query head keeps, in every document
with its own budget, its best columns and diagonals (top-k, or top-p with a cap), plus the
document's first `sink_tokens` columns and the `local_window` diagonals next to the main one, so a
document's kept tokens do not depend on what else is packed with it. Diagonals become key blocks
along the block diagonals they cross (each document's query blocks its own set); kept columns
outside those blocks become token columns.

With `estimation="causal_chunks"` the pattern of a query never depends on a later token (in
teacher-forced training the default estimation lets a position's keys depend on the queries after
it, the question and the answer included). A document is cut into chunks of `estimation_chunk`
tokens from its start; chunk c >= 1 takes the verticals and slashes chosen, with the same budget, by
the last `last_q` queries before the chunk over the keys before the chunk, and the first chunk is
dense (no earlier query exists; its causal triangle is (C/S)^2 of the document's). Each chunk is an
*estimation segment*: it scores like a document that ends where the chunk begins, and its kept sets
sit beside the others the way documents' sets do (a query block takes the set of its first valid
query, so a block across a chunk boundary takes the earlier chunk's, estimated before all its
queries). Chunks rather than a set per query block: n chunks cost n/2 times the scoring of one
estimation and n sets of kept columns ([H, n, S] booleans per row), and the pattern a query takes is
at most `estimation_chunk` tokens older than the query. Uniform chunks rather than growing ones keep
that staleness the same at every position.

Documents shorter than `min_seq_len` stay dense (every causal block of the document); so does
every layer with a sliding window (already local) and every layer whose pattern is "dense".
GQA: the queries of a group are scored against their shared key head, never a replicated one.

Scoring runs on CUDA in the Triton kernels of `hf_sparse_cp.kernels.vertical_slash` (no [H, R, L]
probabilities in memory, no atomics), elsewhere in PyTorch by tiles of heads and keys. It is also
split into pieces that serve a sequence split over ranks (`hf_sparse_cp.distributed.estimation`):
`row_softmax_stats` gives the partial softmax normaliser of query rows over some keys,
`accumulate_vertical_slash` adds the mass those keys receive, and `layout_from_scores` turns
reduced scores into the layout. Scores are fp32 (fp64 for fp64 inputs).

The kept sets become a `SparseLayout` in `build.py`. Host synchronizations per call: one to read
the documents of the batch (none when the caller passes no token metadata: one document per row),
one to size the window of kept columns a query block can see, and one to size the layout's padded
widths.
"""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple

import torch

from ..config import SparseAttentionConfig
from .build import build_layout, dense_layout, diagonal_set_of_blocks, offsets_to_block_diagonals
from .layout import SparseLayout
from .precision import compute_dtype
from .tokens import PAD_SEGMENT, TokenMeta, run_starts

# Elements of one [heads, rows, keys] score tile of the PyTorch scoring path.
_SCORE_ELEMENTS = 1 << 24
# Score sets beyond this many bytes per call (causal chunks, a long sequence) earn a warning naming the fix.
SCORE_SET_WARN_BYTES = 1 << 30


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


class EstimationSegment(NamedTuple):
    """One estimated pattern of a document: the last `last_q` queries before `scored_end` score the
    document's keys [start, scored_end), and the queries [q_lo, q_hi) take the kept sets, which are
    set `set` of their batch row (every segment of a row with one index lies in its own document)."""

    start: int
    scored_end: int
    q_lo: int
    q_hi: int
    set: int


def estimation_segments(docs: list[list[tuple[int, int]]], cfg: SparseAttentionConfig
                        ) -> list[list[EstimationSegment]]:
    """Per batch row, the estimation segments of its sparse documents: the whole document scored by
    its last queries ('last_queries', one set), or chunk c >= 1 of `estimation_chunk` tokens scored by
    the queries before it, as set c - 1 ('causal_chunks'; the first chunk is dense)."""
    if cfg.estimation == "last_queries":
        return [[EstimationSegment(st, en, st, en, 0) for st, en in row] for row in docs]
    c = cfg.estimation_chunk
    return [[EstimationSegment(st, lo, lo, min(en, lo + c), i) for st, en in row
             for i, lo in enumerate(range(st + c, en, c))] for row in docs]


def _num_sets(segments: list[list[EstimationSegment]]) -> int:
    return 1 + max((sg.set for row in segments for sg in row), default=0)


# -------------------------------------------------------------------------------------------- scoring


def last_query_rows(start: int, end: int, last_q: int, device=None) -> torch.Tensor:
    """Positions of the (at most) `last_q` final queries of [start, end) that score its keys."""
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
    slash_base: int = 0,
    vertical_index: torch.Tensor | None = None,
) -> None:
    """Add the attention mass of query rows at positions `row_pos` on keys at `key_pos`:
    vertical[h, key] += mass the key receives, slash[h, slash_base + row - key] += mass on that
    offset (`slash_base`: the document's start, so that every document has its own offsets).
    `vertical_index` (one per key; default `key_pos`) puts a key's mass elsewhere in `vertical`.

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
        vertical[heads].index_add_(1, (key_pos if vertical_index is None else vertical_index)[keys], a.sum(1))
        offset = (row_pos.unsqueeze(1) - key_pos[keys].unsqueeze(0)).clamp_min(0) + slash_base
        slash[heads].scatter_add_(1, offset.flatten().expand(a.shape[0], -1), a.flatten(1))


def _scoring_kernel(q: torch.Tensor, k: torch.Tensor):
    """The Triton scoring launcher when it takes these tensors (CUDA), else None (PyTorch path)."""
    if not q.is_cuda:
        return None
    from ..kernels import vertical_slash

    return vertical_slash.vertical_slash_scores if vertical_slash.supports(q, k) else None


def score_vertical_slash(
    q: torch.Tensor, k: torch.Tensor, docs: list[tuple[int, int]], last_q: int, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical and slash scores of one batch row.

    q: [Hq, S, D], k: [Hkv, S, D]; docs: (start, end) of the documents to score.
    Returns (vertical [Hq, S], slash [Hq, S]) in fp32 (fp64 for fp64 inputs): vertical[h, j] is the
    attention mass key j receives from its document's last `last_q` queries; slash[h, start + o] the
    mass on offset o = q - k inside the document that begins at `start` (each document its own).
    """
    hq, s, _ = q.shape
    dtype = compute_dtype(q.dtype)
    vertical = torch.zeros(hq, s, dtype=dtype, device=q.device)
    slash = torch.zeros(hq, s, dtype=dtype, device=q.device)
    kernel = _scoring_kernel(q, k)
    for start, end in docs:
        r = min(last_q, end - start)
        if kernel is not None:
            v_doc, s_doc = kernel(q[:, end - r : end], k[:, start:end], scale)
            vertical[:, start:end] += v_doc
            slash[:, start:end] += s_doc
            continue
        rows = last_query_rows(start, end, last_q, q.device)
        keys = torch.arange(start, end, device=q.device)
        accumulate_vertical_slash(q[:, end - r : end].to(dtype), k[:, start:end].to(dtype), rows, keys, scale,
                                  vertical, slash, slash_base=start)
    return vertical, slash


def warn_if_costly(n_sets: int, nbytes: int, cfg: SparseAttentionConfig) -> None:
    """Warn, naming the fix, when a call's causal-chunk score sets take more than SCORE_SET_WARN_BYTES."""
    if n_sets > 1 and nbytes > SCORE_SET_WARN_BYTES:
        warnings.warn(
            f"estimation='causal_chunks' with estimation_chunk={cfg.estimation_chunk} scores {n_sets} chunk sets here: "
            f"{nbytes / 2**30:.1f} GiB of scores per attention call (under context parallelism every rank holds them "
            "and reduce-scatters the slashes); a larger estimation_chunk (1/16 of the sequence or more) keeps this "
            "small.",
            stacklevel=3)


def score_rows(
    q: torch.Tensor, k: torch.Tensor, segments: list[list[EstimationSegment]], last_q: int, scale: float
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Scores of every batch row of q [B, Hq, S, D], k [B, Hkv, S, D] with estimation segments, as
    `layout_from_scores` takes them: (vertical, slash), each [Hq, V, S], set j of the row's segments
    at [:, j] as `score_vertical_slash` lays a document out (None for rows without segments)."""
    n_sets = _num_sets(segments)
    out = []
    for row, row_segs in enumerate(segments):
        if not row_segs:
            out.append(None)
            continue
        per_set = [score_vertical_slash(q[row], k[row], [(sg.start, sg.scored_end) for sg in row_segs if sg.set == j],
                                        last_q, scale) for j in range(n_sets)]
        out.append((torch.stack([v for v, _ in per_set], 1), torch.stack([sl for _, sl in per_set], 1)))
    return out


# ------------------------------------------------------------------------------------------ selection


def select_entries(scores: torch.Tensor, mode: str, topk: int, topp: float, cap: int,
                   total: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [..., n] of the kept entries of each row of scores (only positive scores are kept).

    `scores` may hold only the candidates of a longer row (every entry that could be kept: its best
    `topk`, or `cap` for top-p), with `total` [..., 1] the whole row's mass (default: the sum of
    `scores`); the selection is the same as over the whole row."""
    n = scores.shape[-1]
    if mode == "topk":
        kk = min(topk, n)
        if kk == 0:
            return torch.zeros_like(scores, dtype=torch.bool)
        vals, idx = torch.topk(scores, kk, dim=-1)
        keep = torch.zeros_like(scores, dtype=torch.bool)
        return keep.scatter_(-1, idx, vals > 0)
    vals, idx = torch.sort(scores, dim=-1, descending=True)
    total = (vals.sum(-1, keepdim=True) if total is None else total).clamp_min(torch.finfo(vals.dtype).tiny)
    before = (torch.cumsum(vals, -1) - vals) / total  # mass of the better-ranked entries
    rank = torch.arange(n, device=scores.device)
    take = (before < topp) & (rank < cap) & (vals > 0)
    return torch.zeros_like(take).scatter_(-1, idx, take)


def _selection_bound(cfg: SparseAttentionConfig, num_segments: int) -> int:
    """Most key columns one head of a row keeps: every estimation segment's budget plus its sinks."""
    return (candidates_per_row(cfg, "vertical") + cfg.sink_tokens) * num_segments


def select_vertical_slash(
    vertical: torch.Tensor, slash: torch.Tensor, docs: list[list[tuple[int, int]]], cfg: SparseAttentionConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept key columns and kept diagonal offsets ([B, H, S] bool each) from a batch's scores; docs: per
    row, its scored documents. Every document is selected on its own, with its own budget: its
    columns among its keys, its offsets o at [start + o] (as `score_vertical_slash` lays them out),
    plus its sink columns and the local window's offsets; nothing outside the documents."""
    keep_v = torch.zeros_like(vertical, dtype=torch.bool)
    keep_s = torch.zeros_like(slash, dtype=torch.bool)
    for row, row_docs in enumerate(docs):
        for start, end in row_docs:
            doc = slice(start, end)
            keep_v[row, :, doc] = select_entries(vertical[row, :, doc], cfg.budget_mode, *budget(cfg, "vertical"))
            keep_s[row, :, doc] = select_entries(slash[row, :, doc], cfg.budget_mode, *budget(cfg, "slash"))
            keep_anchors(keep_v[row], keep_s[row], start, end, cfg)
    return keep_v, keep_s


def budget(cfg: SparseAttentionConfig, kind: str) -> tuple[int, float, int]:
    """(topk, topp, cap) of the verticals or the slashes ('vertical' / 'slash')."""
    return getattr(cfg, f"{kind}_topk"), getattr(cfg, f"{kind}_topp"), getattr(cfg, f"{kind}_cap")


def candidates_per_row(cfg: SparseAttentionConfig, kind: str) -> int:
    """Most entries one head of a document keeps of the verticals or slashes, anchors aside: any entry
    that can be kept is among that many best of its row (`select_entries` over candidates)."""
    topk, _, cap = budget(cfg, kind)
    return topk if cfg.budget_mode == "topk" else cap


def keep_anchors(keep_v: torch.Tensor, keep_s: torch.Tensor, start: int, end: int, cfg: SparseAttentionConfig) -> None:
    """Keep the document [start, end)'s first `sink_tokens` columns and `local_window` diagonals
    (keep_v, keep_s: [H, S] of its row)."""
    keep_v[:, start : min(end, start + cfg.sink_tokens)] = True
    keep_s[:, start : min(end, start + cfg.local_window)] = True


def segment_diagonals(keep_s: torch.Tensor, meta: TokenMeta, segments: list[list[EstimationSegment]],
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept block diagonals per estimation segment, side by side, and where each query block's set
    begins (`build_layout`'s `diagonals` and `diagonal_start`), from kept offsets [B, H, V, S] laid out
    as `select_vertical_slash` returns each set. A segment's set spans the blocks from its document's
    start to its last query; the query blocks whose first valid query it holds take it."""
    bs = block_size
    sets, spans = [[] for _ in segments], [[] for _ in segments]
    width = 0
    for row, row_segs in enumerate(segments):
        used = 0
        for sg in row_segs:
            nb = (sg.q_hi - 1) // bs - sg.start // bs + 1
            offsets = torch.nn.functional.pad(keep_s[row, :, sg.set, sg.start : sg.q_hi],
                                              (0, nb * bs - (sg.q_hi - sg.start)))
            sets[row].append(offsets_to_block_diagonals(offsets, bs))
            spans[row].append(used)
            used += nb
        width = max(width, used)
    b, h = keep_s.shape[:2]
    diagonals = torch.zeros(b, h, max(width, 1), dtype=torch.bool, device=keep_s.device)
    for row, row_sets in enumerate(sets):
        if row_sets:
            diagonals[row, :, : sum(x.shape[-1] for x in row_sets)] = torch.cat(row_sets, -1)
    return diagonals, diagonal_set_of_blocks(meta, bs, _query_ranges(segments), spans)


def _query_ranges(segments: list[list[EstimationSegment]]) -> list[list[tuple[int, int]]]:
    return [[(sg.q_lo, sg.q_hi) for sg in row] for row in segments]


def layout_from_scores(
    meta: TokenMeta,
    cfg: SparseAttentionConfig,
    docs: list[list[tuple[int, int]]],
    scores: list[tuple[torch.Tensor, torch.Tensor] | None],
) -> SparseLayout:
    """The layout once every row with estimation segments (`estimation_segments(docs, cfg)`) has its
    (vertical, slash) scores ([H, V, S] each, or [H, S] for one set; None for rows without segments):
    the queries of every segment get its selected verticals and slashes, every other token its dense
    causal document prefix."""
    segments = estimation_segments(docs, cfg)
    if not any(segments):
        return dense_layout(meta, cfg.block_size)
    first = next(sc[0] for sc in scores if sc is not None)
    n_sets = _num_sets(segments)
    warn_if_costly(n_sets, len(scores) * 2 * first.shape[0] * first.shape[-1] * n_sets * first.element_size(), cfg)
    zeros = torch.zeros(*first.shape[:1], n_sets, first.shape[-1], dtype=first.dtype, device=first.device)
    vertical = torch.stack([zeros if sc is None else sc[0].view_as(zeros) for sc in scores])  # [B, H, V, S]
    slash = torch.stack([zeros if sc is None else sc[1].view_as(zeros) for sc in scores])
    keep_v, keep_s = (torch.stack(x, 2) for x in zip(*(
        select_vertical_slash(vertical[:, :, j], slash[:, :, j],
                              [[(sg.start, sg.q_hi) for sg in row if sg.set == j] for row in segments], cfg)
        for j in range(n_sets))))
    return layout_from_kept(meta, cfg, segments, keep_v, keep_s)


def layout_from_kept(
    meta: TokenMeta,
    cfg: SparseAttentionConfig,
    segments: list[list[EstimationSegment]],
    keep_v: torch.Tensor,
    keep_s: torch.Tensor,
) -> SparseLayout:
    """The layout from the kept columns and offsets of every estimation segment ([B, H, V, S] bool each,
    set j of a row at [:, :, j], as `select_vertical_slash` lays them out, anchors included)."""
    dense_tokens = meta.segment != PAD_SEGMENT
    for row, row_segs in enumerate(segments):
        for sg in row_segs:
            dense_tokens[row, sg.q_lo : sg.q_hi] = False
    bound = max(_selection_bound(cfg, len(row_segs)) for row_segs in segments)
    diagonals, diagonal_start = segment_diagonals(keep_s, meta, segments, cfg.block_size)
    if cfg.estimation == "last_queries":  # one set, read by every query block
        verticals, vertical_set = keep_v[:, :, 0], None
    else:
        verticals = keep_v
        vertical_set = diagonal_set_of_blocks(meta, cfg.block_size, _query_ranges(segments),
                                              [[sg.set for sg in row] for row in segments])
    return build_layout(meta, cfg.block_size, diagonals=diagonals, diagonal_start=diagonal_start, verticals=verticals,
                        vertical_set=vertical_set, dense_tokens=dense_tokens, max_verticals=bound)


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

    Args:
        q: [B, Hq, S, D]; k: [B, Hkv, S, D] (after RoPE), Hq a multiple of Hkv.
        cfg: the layer's pattern settings (`SparseAttentionConfig.for_layer`).
        meta: the tokens' documents and padding (default: one document per row).
        scale: softmax scale of the scores (default 1 / sqrt(D)).
        sliding_window: the layer's window; such layers are dense (already local).
        docs: `pattern_documents` of this call when the caller has it already.

    Returns:
        The `SparseLayout` [B, Hq, NQB, ...] (one shared head when every document is dense).
        Deterministic: the same inputs give the same layout on every rank.
    """
    b, _, s, d = q.shape
    docs = pattern_documents(cfg, meta, b, s, sliding_window) if docs is None else docs
    meta = TokenMeta.contiguous(b, s, q.device) if meta is None else meta
    if not any(docs):
        return dense_layout(meta, cfg.block_size, sliding_window)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    return layout_from_scores(meta, cfg, docs, score_rows(q, k, estimation_segments(docs, cfg), cfg.last_q, scale))
