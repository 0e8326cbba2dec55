"""Vertical-slash pattern estimation (MTraining): which key columns and diagonals each head keeps.

At every attention call, the last `last_q` queries of each long document score every earlier
key of their document: a key column's *vertical* score is the attention mass it receives, a
diagonal's *slash* score the mass along offset `q - k`. With `sample_groups`, groups of queries
along the document score too (`scoring_groups`): the document is cut into equal strata, each scored
by its last queries, and a scoring query's mass counts for the queries of its stratum that see the
key (`Stratum`), so the scores estimate the mass every query of the document puts on each key and
offset (weighted sums also in 'mass' mode, plain sums otherwise). Each query head keeps, in every
document with its own budget, its best columns and diagonals (top-k, or top-p with a cap; in 'mass'
mode columns and block diagonals ranked together by estimated mass per block of work, kept until
their mass reaches `mass_target` of the document's attention: `select_mass`; with `mass_near_blocks`
a column takes only the far queries' mass and far diagonals lose the kept columns'), plus the document's
first `sink_tokens` columns and the `local_window` diagonals next to the main one, so a document's
kept tokens do not depend on what else is packed with it. Exact ties go to the lower position
(`rank_order`), in one process as across ranks. Diagonals become key blocks along the block
diagonals they cross (each document's query blocks its own set); kept columns outside those blocks
become token columns.

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

Memory: the scores are [B, H, V, S] fp32 per kind (V: 1, or the chunks' sets); the selection's
sorts and cumulative sums work on tiles of at most `_SELECT_ELEMENTS` entries, the scoring on tiles
of `_SCORE_ELEMENTS`.

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
# Elements of one [heads, entries] tile of the selection's temporaries (sorts, cumulative sums).
_SELECT_ELEMENTS = 1 << 22


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


class Sampling(NamedTuple):
    """Which queries score a document's keys (`scoring_groups`): the last `last_q`, and with `groups` > 0
    as many more groups of `group_size` along it. `weighted`: each scoring query's mass counts for the
    queries of its part of the document that see the key (`Stratum`), so that the scores estimate the
    mass all the document's queries put on each key and diagonal; otherwise plain sums."""

    last_q: int
    groups: int = 0
    group_size: int = 16
    weighted: bool = False
    far_blocks: int = 0
    block_size: int = 1

    @classmethod
    def of(cls, cfg: SparseAttentionConfig) -> Sampling:
        mass = cfg.budget_mode == "mass"
        return cls(cfg.last_q, cfg.sample_groups, cfg.sample_group_size, mass or cfg.sample_groups > 0,
                   cfg.mass_near_blocks if mass else 0, cfg.block_size)


class Stratum(NamedTuple):
    """The queries [lo, hi) of a document starting at `doc_start` that `rows` scoring queries (the last
    of them) stand for: a scoring query's probability of key j counts (hi - max(lo, j))^+ / rows times (the
    queries of the stratum that see j), that of a pair at offset o (hi - max(lo, doc_start + o))^+ / rows.
    With `far_blocks` > 0 a key column takes only the mass of the queries at least that many blocks (of
    `block_size`) after its own (`column_weights`)."""

    lo: int
    hi: int
    rows: int
    doc_start: int
    far_blocks: int = 0
    block_size: int = 1


def scoring_groups(start: int, end: int, sampling: Sampling) -> list[Stratum]:
    """The strata of a document [start, end) whose last queries score it: `sampling.groups` + 1 equal
    parts (integer cuts, the same on every rank), the last one scored by its last `last_q` queries, the
    others by their last `group_size` (fewer in a shorter part)."""
    n = sampling.groups
    cuts = [start + i * (end - start) // (n + 1) for i in range(n + 2)]
    out = []
    for i in range(n + 1):
        lo, hi = cuts[i], cuts[i + 1]
        if hi > lo:
            out.append(Stratum(lo, hi, min(sampling.last_q if i == n else sampling.group_size, hi - lo), start,
                               sampling.far_blocks, sampling.block_size))
    return out


def stratum_weights(stratum: Stratum, positions: torch.Tensor) -> torch.Tensor:
    """The weight of a scoring query of `stratum` for keys, or pair offsets from the document start, at
    `positions` (any shape): (hi - max(lo, position))^+ / rows (see `Stratum`)."""
    return (stratum.hi - positions.clamp_min(stratum.lo)).clamp_min(0) / stratum.rows


def far_from(stratum: Stratum, key_pos: torch.Tensor) -> torch.Tensor:
    """The first query position that is `stratum.far_blocks` blocks or more after each key's block."""
    bs = stratum.block_size
    return (torch.div(key_pos, bs, rounding_mode="floor") + stratum.far_blocks) * bs


def column_weights(stratum: Stratum, key_pos: torch.Tensor) -> torch.Tensor:
    """The weight of a scoring query's mass on the key columns at `key_pos`: `stratum_weights`, or with
    `far_blocks` the far queries of the stratum over the far scoring queries, (hi - max(lo, f))^+ /
    (hi - max(hi - rows, f))^+ for f = `far_from` (0 where no scoring query is far)."""
    if not stratum.far_blocks:
        return stratum_weights(stratum, key_pos)
    first = far_from(stratum, key_pos)
    seen = (stratum.hi - first.clamp_min(stratum.lo)).clamp_min(0)
    scored = (stratum.hi - first.clamp_min(stratum.hi - stratum.rows)).clamp_min(0)
    return torch.where(scored > 0, seen / scored.clamp_min(1), 0)


# -------------------------------------------------------------------------------------------- scoring


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
    g_chunk, n_chunk = _tile_shape(q_rows, k_keys)
    hidden = ~visible
    for h in range(hk):
        for g0 in range(0, g, g_chunk):
            g1 = min(g, g0 + g_chunk)
            for n0 in range(0, n, n_chunk):
                keys = slice(n0, min(n, n0 + n_chunk))
                sc = torch.einsum("grd,ld->grl", qe[h, g0:g1], k_keys[h, keys]) * scale
                yield slice(h * g + g0, h * g + g1), keys, sc.masked_fill(hidden[:, keys], float("-inf"))


def _tile_shape(q_rows: torch.Tensor, k_keys: torch.Tensor) -> tuple[int, int]:
    """(query heads, keys) of one `_score_tiles` tile: [heads, R, keys] within _SCORE_ELEMENTS."""
    (hq, r), (hk, n) = q_rows.shape[:2], k_keys.shape[:2]
    g_chunk = max(1, min(hq // hk, _SCORE_ELEMENTS // max(1, r * n)))
    return g_chunk, max(1, min(n, _SCORE_ELEMENTS // max(1, g_chunk * r)))


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


def _probabilities(q_rows, k_keys, visible, scale, normalizer):
    """`_score_tiles` as attention probabilities: exp(score - row max) / row sum of the rows' whole key set, from
    `normalizer` or, without one, `row_softmax_stats` (a first pass over the scores), unless each tile holds every
    key: then the tile's own max and sum are those of its rows, the same numbers in one pass."""
    if normalizer is None and _tile_shape(q_rows, k_keys)[1] == k_keys.shape[1]:
        for heads, keys, sc in _score_tiles(q_rows, k_keys, visible, scale):
            m = sc.amax(-1, keepdim=True)
            e = torch.exp(sc - torch.where(torch.isfinite(m), m, torch.zeros_like(m)))
            yield heads, keys, e / e.sum(-1, keepdim=True)
        return
    if normalizer is None:
        normalizer = row_softmax_stats(q_rows, k_keys, visible, scale)
    row_max = torch.where(torch.isfinite(normalizer[0]), normalizer[0], torch.zeros_like(normalizer[0]))
    for heads, keys, sc in _score_tiles(q_rows, k_keys, visible, scale):
        yield heads, keys, torch.exp(sc - row_max[heads].unsqueeze(-1)) / normalizer[1][heads].unsqueeze(-1)


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
    stratum: Stratum | None = None,
) -> None:
    """Add the attention mass of query rows at positions `row_pos` on keys at `key_pos`:
    vertical[h, key] += mass the key receives, slash[h, slash_base + row - key] += mass on that
    offset (`slash_base`: the document's start, so that every document has its own offsets).
    `vertical_index` (one per key; default `key_pos`) puts a key's mass elsewhere in `vertical`.
    With a `stratum`, each mass counts its stratum weight (`stratum_weights`; a column's `column_weights`,
    and with `far_blocks` only the mass of the queries that many blocks or more after the key's block).

    Keys after a row are invisible. Probabilities are a softmax over these keys, or, with
    `normalizer` = (row max, row sum of exp(score - max)) of the row's *whole* key set (keys split
    over ranks), exp(score - max) / sum.
    """
    visible = key_pos.unsqueeze(0) <= row_pos.unsqueeze(1)  # [R, L]
    for heads, keys, a in _probabilities(q_rows, k_keys, visible, scale, normalizer):
        diff = row_pos.unsqueeze(1) - key_pos[keys].unsqueeze(0)
        if stratum is not None and stratum.far_blocks:  # the far queries' mass only
            column = (a * (row_pos.unsqueeze(1) >= far_from(stratum, key_pos[keys]).unsqueeze(0))).sum(1)
        else:
            column = a.sum(1)
        if stratum is not None:
            column = column * column_weights(stratum, key_pos[keys]).to(a.dtype)
            a = a * stratum_weights(stratum, stratum.doc_start + diff).to(a.dtype)
        vertical[heads].index_add_(1, (key_pos if vertical_index is None else vertical_index)[keys], column)
        offset = diff.clamp_min(0) + slash_base
        slash[heads].scatter_add_(1, offset.flatten().expand(a.shape[0], -1), a.flatten(1))


def _scoring_kernel(q: torch.Tensor, k: torch.Tensor):
    """The Triton scoring launcher when it takes these tensors (CUDA), else None (PyTorch path)."""
    if not q.is_cuda:
        return None
    from ..kernels import vertical_slash

    return vertical_slash.vertical_slash_scores if vertical_slash.supports(q, k) else None


def score_vertical_slash(
    q: torch.Tensor, k: torch.Tensor, docs: list[tuple[int, int]], last_q: int, scale: float,
    sampling: Sampling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical and slash scores of one batch row.

    q: [Hq, S, D], k: [Hkv, S, D]; docs: (start, end) of the documents to score; sampling: which queries
    score them (default: the last `last_q`, plain sums).
    Returns (vertical [Hq, S], slash [Hq, S]) in fp32 (fp64 for fp64 inputs): vertical[h, j] is the
    attention mass key j receives from its document's scoring queries; slash[h, start + o] the mass on
    offset o = q - k inside the document that begins at `start` (each document its own). Weighted
    sampling scales each query's mass by its `Stratum` weight.
    """
    sampling = Sampling(last_q) if sampling is None else sampling
    hq, s, _ = q.shape
    dtype = compute_dtype(q.dtype)
    vertical = torch.zeros(hq, s, dtype=dtype, device=q.device)
    slash = torch.zeros(hq, s, dtype=dtype, device=q.device)
    kernel = None if sampling.far_blocks else _scoring_kernel(q, k)  # the kernel sums every query's mass
    for start, end in docs:
        for st in scoring_groups(start, end, sampling):
            first, stratum = st.hi - st.rows, st if sampling.weighted else None
            if kernel is not None:
                v_doc, s_doc = kernel(q[:, first : st.hi], k[:, start : st.hi], scale)
                if stratum is not None:  # keys and offsets of the document share the weights' formula
                    w = stratum_weights(stratum, torch.arange(start, st.hi, device=q.device)).to(dtype)
                    v_doc, s_doc = v_doc * w, s_doc * w
                vertical[:, start : st.hi] += v_doc
                slash[:, start : st.hi] += s_doc
                continue
            rows = torch.arange(first, st.hi, device=q.device)
            keys = torch.arange(start, st.hi, device=q.device)
            accumulate_vertical_slash(q[:, first : st.hi].to(dtype), k[:, start : st.hi].to(dtype), rows, keys,
                                      scale, vertical, slash, slash_base=start, stratum=stratum)
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
    q: torch.Tensor, k: torch.Tensor, segments: list[list[EstimationSegment]], last_q: int, scale: float,
    sampling: Sampling | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Scores of every batch row of q [B, Hq, S, D], k [B, Hkv, S, D] with estimation segments, as
    `layout_from_scores` takes them: (vertical, slash), each [Hq, V, S], set j of the row's segments
    at [:, j] as `score_vertical_slash` lays a document out (None for rows without segments);
    sampling: `Sampling.of(cfg)` (default: the last `last_q` queries, plain sums)."""
    n_sets = _num_sets(segments)
    out = []
    for row, row_segs in enumerate(segments):
        if not row_segs:
            out.append(None)
            continue
        per_set = [score_vertical_slash(q[row], k[row], [(sg.start, sg.scored_end) for sg in row_segs if sg.set == j],
                                        last_q, scale, sampling) for j in range(n_sets)]
        out.append((torch.stack([v for v, _ in per_set], 1), torch.stack([sl for _, sl in per_set], 1)))
    return out


# ------------------------------------------------------------------------------------------ selection


def _head_chunks(heads: int, per_head: int):
    """Slices of heads whose [heads, per_head] selection temporaries stay within _SELECT_ELEMENTS."""
    step = max(1, min(heads, _SELECT_ELEMENTS // max(1, per_head)))
    return [slice(h0, min(heads, h0 + step)) for h0 in range(0, heads, step)]


def top_entries(scores: torch.Tensor, m: int, key=None) -> torch.Tensor:
    """int64 [h, min(m, n)]: the indices of each row's best m entries of scores [h, n], best first, exact
    ties to the lower index (`rank_order` by head tiles); `key` (a tile of scores -> what to rank it by,
    computed tile by tile) ranks them by something else."""
    out = torch.empty(scores.shape[0], min(m, scores.shape[-1]), dtype=torch.long, device=scores.device)
    for heads in _head_chunks(scores.shape[0], scores.shape[-1]):
        out[heads] = rank_order(scores[heads] if key is None else key(scores[heads]))[:, : out.shape[1]]
    return out


def rank_order(scores: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [h, n]: each row's entries from the best score to the worst, exact ties broken by position
    (the lower first). positions: [n] or [h, n], the entries' positions when they are not in position
    order (a union of candidates); None: the entries' indices are their positions."""
    if positions is None:
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices
    by_pos = positions.argsort(dim=-1, stable=True).expand(scores.shape)
    return by_pos.gather(-1, torch.sort(scores.gather(-1, by_pos), dim=-1, descending=True, stable=True).indices)


def select_entries(scores: torch.Tensor, mode: str, topk: int, topp: float, cap: int,
                   total: torch.Tensor | None = None, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Boolean [h, n] of the kept entries of each row of scores (only positive scores are kept; exact
    ties go to the lower position).

    `scores` may hold only the candidates of a longer row (every entry that could be kept: its best
    `topk`, or `cap` for top-p), with `total` [h, 1] the whole row's mass (default: the sum of
    `scores`) and `positions` ([n] or [h, n]) the candidates' positions; the selection is the same as
    over the whole row."""
    keep = torch.zeros_like(scores, dtype=torch.bool)
    for heads in _head_chunks(scores.shape[0], scores.shape[-1]):
        sc = scores[heads]
        order = rank_order(sc, positions if positions is None or positions.dim() == 1 else positions[heads])
        vals = sc.gather(-1, order)
        rank = torch.arange(sc.shape[-1], device=sc.device)
        if mode == "topk":
            take = (rank < topk) & (vals > 0)
        else:
            whole = vals.sum(-1, keepdim=True) if total is None else total[heads]
            before = (torch.cumsum(vals, -1) - vals) / whole.clamp_min(torch.finfo(vals.dtype).tiny)
            take = (before < topp) & (rank < cap) & (vals > 0)
        keep[heads] = keep[heads].scatter_(-1, order, take)
    return keep


def block_diagonal_mass(slash: torch.Tensor, block_size: int) -> torch.Tensor:
    """[h, ceil(L / bs) + 1]: the mass on each block diagonal d from slash scores [h, L] of offsets 0..L-1.
    A query at a uniform place in its block reaches block diagonal d through offset o with probability
    (bs - |o - d bs|)^+ / bs, so offset d bs + u (0 <= u < bs) gives (bs - u) / bs to d and u / bs to d + 1."""
    h, n = slash.shape
    bs = block_size
    nb = -(-n // bs)
    blocks = torch.nn.functional.pad(slash, (0, nb * bs - n)).view(h, nb, bs)
    u = torch.arange(bs, device=slash.device, dtype=slash.dtype)
    out = torch.zeros(h, nb + 1, dtype=slash.dtype, device=slash.device)
    out[:, :nb] = blocks @ ((bs - u) / bs)
    out[:, 1:] += blocks @ (u / bs)
    return out


def column_cost(positions: torch.Tensor, start: int, end: int, block_size: int, far_blocks: int = 0) -> torch.Tensor:
    """Blocks of work a kept key column at `positions` adds in a document [start, end): 1 / block_size per
    query block after its own (its own block lies on the always-kept main diagonal), or with `far_blocks`
    per query block that many blocks or more after its own (`SparseAttentionConfig.mass_near_blocks`)."""
    first_qb, end_qb = start // block_size, -(-end // block_size)
    after = torch.div(positions, block_size, rounding_mode="floor") + max(1, far_blocks)
    return (end_qb - torch.clamp_min(after, first_qb)).clamp_min(0) / block_size


def column_ratio(gain: torch.Tensor, positions: torch.Tensor, start: int, end: int, block_size: int,
                 far_blocks: int = 0) -> torch.Tensor:
    """Estimated mass per block of work of key columns ([h, n] gains at `positions`) in a document [start,
    end), 0 for a column that adds no work (what 'mass' mode ranks columns by)."""
    cost = column_cost(positions, start, end, block_size, far_blocks).to(gain.dtype)
    return torch.where(cost > 0, gain / cost.clamp_min(1 / block_size), 0)


def diagonal_cost(diagonals: torch.Tensor, start: int, end: int, block_size: int) -> torch.Tensor:
    """Blocks of work a kept block diagonal d adds in a document [start, end): the query blocks whose block
    d before them holds the document's keys."""
    first_qb, end_qb = start // block_size, -(-end // block_size)
    return (end_qb - first_qb - diagonals).clamp_min(0)


def select_mass(
    col_gain: torch.Tensor,
    col_pos: torch.Tensor,
    diag_gain: torch.Tensor,
    diag: torch.Tensor,
    start: int,
    end: int,
    cfg: SparseAttentionConfig,
    scored_end: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """'mass' mode: the kept key columns and block diagonals of one document [start, end) per head.

    Columns and block diagonals d >= 1 are ranked together by estimated mass per block of work they add to
    the queries [start, scored_end) that scored them (`column_cost`, `diagonal_cost`; exact ties: columns
    by position, then diagonals by d); each head keeps the best until the estimated mass of the main
    diagonal and of what it keeps reaches `mass_target` of those queries' attention (one unit per query;
    mass inside both a kept column and a kept diagonal counts twice): a floor that serves broad heads;
    and beyond it every one whose mass per block is at least `mass_threshold` of the block's queries'
    attention (one price of work for every head and layer). At most `vertical_cap` columns (the best by
    that ratio) compete.

    Args:
        col_gain: [h, n] estimated mass of the columns at positions col_pos ([n] or [h, n]: all of the
            document's, or a union of candidates holding each head's best `vertical_cap`).
        diag_gain: [h, m] estimated mass of the block diagonals `diag` ([m] or [h, m]: each of the
            document's diagonal 0 and those with mass, `block_diagonal_mass`, in any order).
        scored_end: the end of the scoring queries (a causal chunk's start; default `end`).

    Returns:
        (bool [h, n] kept columns, bool [h, m] kept diagonals, d = 0 always).
    """
    (h, n), m = col_gain.shape, diag_gain.shape[-1]
    col_pos, diag = col_pos.expand(h, n), diag.expand(h, m)
    scored_end = end if scored_end is None else scored_end
    keep_c = torch.zeros_like(col_gain, dtype=torch.bool)
    keep_d = torch.zeros_like(diag_gain, dtype=torch.bool)
    for heads in _head_chunks(h, n + m):
        keep_c[heads], keep_d[heads] = _select_mass(col_gain[heads], col_pos[heads], diag_gain[heads], diag[heads],
                                                    start, end, scored_end, cfg)
    return keep_c, keep_d


def _select_mass(col_gain, col_pos, diag_gain, diag, start, end, scored_end, cfg):
    """`select_mass` on one tile of heads (positions and diagonals [h, n] / [h, m])."""
    bs, near = cfg.block_size, cfg.mass_near_blocks
    c_ratio = column_ratio(col_gain, col_pos, start, scored_end, bs, near)
    n = col_gain.shape[-1]
    c_order = rank_order(c_ratio, col_pos)
    eligible = torch.zeros_like(c_ratio, dtype=torch.bool).scatter_(
        -1, c_order, (torch.arange(n, device=col_gain.device) < cfg.vertical_cap).expand_as(c_order))
    c_ratio, col_gain = torch.where(eligible, c_ratio, 0), torch.where(eligible, col_gain, 0)
    keep_c, keep_d = _take_mass(c_ratio, col_gain, col_pos, diag_gain, diag, start, end, scored_end, cfg)
    if near:  # the far diagonals without the mass of the kept columns they cross, then the choice again
        far = diag >= near
        keep_c, keep_d = _take_mass(
            c_ratio, col_gain, col_pos,
            torch.where(far, diag_gain - _crossed_mass(col_gain, col_pos, keep_c, diag, start, scored_end, bs, near),
                        diag_gain).clamp_min(0),
            diag, start, end, scored_end, cfg)
    return keep_c, keep_d


def _crossed_mass(col_gain, col_pos, kept, diag, start, scored_end, bs, far_blocks):
    """[h, m]: the estimated mass of the kept columns inside each block diagonal's blocks: a column's far mass
    spread evenly over the far query blocks it is listed in (the estimate's own assumption), summed over the
    kept columns whose key block lies d or more blocks before the last query block; in position order, so
    that every rank, holding the same kept columns in another order, sums alike."""
    first_qb, end_qb = start // bs, -(-scored_end // bs)
    nkb = max(end_qb - first_qb, 0)
    order = torch.argsort(col_pos, dim=-1, stable=True)
    pos = col_pos.gather(-1, order)
    listed = column_cost(pos, start, scored_end, bs, far_blocks) * bs
    per_block = torch.where(kept.gather(-1, order) & (listed > 0), col_gain.gather(-1, order).double()
                            / listed.clamp_min(1), 0)
    kb = (torch.div(pos, bs, rounding_mode="floor") - first_qb).clamp(0, nkb)
    by_block = torch.zeros(*per_block.shape[:-1], nkb + 1, dtype=torch.float64, device=col_gain.device)
    by_block.scatter_add_(-1, kb, per_block)
    before = torch.nn.functional.pad(by_block.cumsum(-1), (1, 0))  # before[x]: key blocks < x
    return before.gather(-1, (nkb - diag).clamp(0, nkb + 1)).to(col_gain.dtype)


def _take_mass(c_ratio, col_gain, col_pos, diag_gain, diag, start, end, scored_end, cfg):
    """The columns (eligible ones with their ratios, others 0) and block diagonals `select_mass` keeps from
    these gains: ranked together by mass per block of work, taken up to mass_target and by mass_threshold."""
    bs = cfg.block_size
    main = torch.where(diag == 0, diag_gain, 0).sum(-1, keepdim=True)
    d_cost = diagonal_cost(diag, start, scored_end, bs).to(diag_gain.dtype)
    # a diagonal is kept as offset d * bs of the document, so only those inside it (the rest of a document that
    # starts inside a block lies on diagonal (end - start - 1) // bs + 1 and stays unkept)
    d_ok = (diag >= 1) & (diag <= (end - start - 1) // bs) & (d_cost > 0)
    d_ratio = torch.where(d_ok, diag_gain / d_cost.clamp_min(1), 0)
    n = col_gain.shape[-1]
    ratio = torch.cat([c_ratio, d_ratio], -1)
    gain = torch.cat([col_gain, torch.where(d_ok, diag_gain, 0)], -1)
    # tie order: columns by position, then diagonals by d (every column lies before end)
    ids = torch.cat([col_pos - start, (end - start) + diag], -1)
    order = rank_order(ratio, ids)
    g = gain.gather(-1, order)
    before = main + torch.cumsum(g, -1) - g
    r = ratio.gather(-1, order)
    priced = (r >= cfg.mass_threshold * bs) if cfg.mass_threshold > 0 else torch.zeros_like(r, dtype=torch.bool)
    take = ((before < cfg.mass_target * (scored_end - start)) | priced) & (r > 0)
    keep = torch.zeros_like(take).scatter_(-1, order, take)
    return keep[:, :n], keep[:, n:] | (diag == 0)


def _selection_bound(cfg: SparseAttentionConfig, num_segments: int) -> int:
    """Most key columns one head of a row keeps: every estimation segment's budget plus its sinks."""
    return (candidates_per_row(cfg, "vertical") + cfg.sink_tokens) * num_segments


def select_vertical_slash(
    vertical: torch.Tensor, slash: torch.Tensor, docs: list[list[tuple[int, ...]]], cfg: SparseAttentionConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept key columns and kept diagonal offsets ([B, H, S] bool each) from a batch's scores; docs: per
    row, its scored documents as (start, end), or (start, end, scored_end) when only the queries before
    scored_end scored it (a causal chunk). Every document is selected on its own, with its own budget:
    its columns among its keys, its offsets o at [start + o] (as `score_vertical_slash` lays them out;
    in 'mass' mode block diagonal d as offset d * block_size), plus its sink columns and the local
    window's offsets; nothing outside the documents."""
    keep_v = torch.zeros_like(vertical, dtype=torch.bool)
    keep_s = torch.zeros_like(slash, dtype=torch.bool)
    for row, row_docs in enumerate(docs):
        for start, end, *scored_end in row_docs:
            doc = slice(start, end)
            if cfg.budget_mode == "mass":
                diag_gain = block_diagonal_mass(slash[row, :, doc], cfg.block_size)
                diag = torch.arange(diag_gain.shape[-1], device=slash.device)
                cols, diags = select_mass(vertical[row, :, doc], torch.arange(start, end, device=slash.device),
                                          diag_gain, diag, start, end, cfg, *scored_end)
                keep_v[row, :, doc] = cols
                keep_diagonals(keep_s[row], diags, diag, start, cfg.block_size)
            else:
                keep_v[row, :, doc] = select_entries(vertical[row, :, doc], cfg.budget_mode, *budget(cfg, "vertical"))
                keep_s[row, :, doc] = select_entries(slash[row, :, doc], cfg.budget_mode, *budget(cfg, "slash"))
            keep_anchors(keep_v[row], keep_s[row], start, end, cfg)
    return keep_v, keep_s


def keep_diagonals(keep_s: torch.Tensor, kept: torch.Tensor, diag: torch.Tensor, start: int, block_size: int) -> None:
    """Mark kept block diagonals ([h, m] of diagonals `diag` [m], `select_mass`) as the offsets d * bs of the
    document that begins at `start` in keep_s [h, S] (the one offset that crosses block diagonal d only)."""
    offset = torch.where(kept, start + diag * block_size, keep_s.shape[-1])
    padded = torch.nn.functional.pad(keep_s, (0, 1))
    keep_s |= padded.scatter_(-1, offset, True)[:, :-1]


def budget(cfg: SparseAttentionConfig, kind: str) -> tuple[int, float, int]:
    """(topk, topp, cap) of the verticals or the slashes ('vertical' / 'slash')."""
    return getattr(cfg, f"{kind}_topk"), getattr(cfg, f"{kind}_topp"), getattr(cfg, f"{kind}_cap")


def candidates_per_row(cfg: SparseAttentionConfig, kind: str) -> int:
    """Most entries one head of a document keeps of the verticals or slashes, anchors aside: any entry
    that can be kept is among that many best of its row (`select_entries` over candidates; in 'mass' mode,
    the columns best by mass per cost; its block diagonals are all candidates)."""
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
                              [[(sg.start, sg.q_hi, sg.scored_end) for sg in row if sg.set == j] for row in segments],
                              cfg)
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
    return layout_from_scores(meta, cfg, docs, score_rows(q, k, estimation_segments(docs, cfg), cfg.last_q, scale,
                                                          Sampling.of(cfg)))
