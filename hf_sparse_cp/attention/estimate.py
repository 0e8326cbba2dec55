"""Vertical-slash pattern estimation (MTraining): which key columns and diagonals each head keeps.

One pipeline (`estimate`): the *documents* of a call long enough for a sparse pattern, their estimation
*segments*, the *scores* of each segment's keys, the *budget* that keeps the best of them (`cfg.budget`,
`hf_sparse_cp.attention.budgets`) and the *layout* built from what it kept. The scores stage is the
caller's: one process scores whole rows (`estimate_layout`), a context-parallel rank scores its shard and
gathers every rank's candidates (`hf_sparse_cp.distributed.ring.estimation`); the other stages are the same.

Scores: the last `last_q` queries of each long document score every earlier key of their document (a
column's *vertical* score is the attention mass it receives, a diagonal's *slash* score the mass along
offset q - k), and with `sample_groups` groups of queries along it (`scoring_groups`); in a `weighted`
budget or with groups, a scoring query's mass counts for the queries of its stratum that see the key
(`Stratum`), so the scores estimate the mass of every query of the document. Each document is selected
on its own, plus its first `sink_tokens` columns and `local_window` diagonals, so its kept tokens do not
depend on what is packed with it; exact ties go to the lower position. With `estimation="causal_chunks"`
a document is cut into chunks of `estimation_chunk` tokens; chunk c >= 1 is a segment scored by the last
queries before it over the keys before it (the first chunk dense), so no query's pattern depends on a
later token; its kept sets sit beside the others ([H, V, S] per row, V sets; a query block takes the set
of its first valid query). Documents shorter than `min_seq_len`, sliding-window layers and dense layers
stay dense. Scoring runs in PyTorch by tiles of `SCORE_ELEMENTS`, exactly (`hf_sparse_cp.attention.exact`):
each query-key score exact to its two vectors, each sum an int64 fixed-point sum, so that any tiling and
any context-parallel split give the same scores to the bit and exact ties from equal inputs stay ties;
the budget reads them as fp64. One process on CUDA scores in the Triton kernels of
`hf_sparse_cp.kernels.vertical_slash` instead (fp32 sums, rounded to the same fixed point). Host
synchronizations per call: the batch's documents (none without token metadata), the window of kept
columns a query block can see, and the layout's padded widths.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import NamedTuple

import torch

from ..config import SparseAttentionConfig
from .budgets import Entries
from .build import build_layout, dense_layout, diagonal_set_of_blocks, offsets_to_block_diagonals
from .exact import FixedPoint, exact_scores, on_grid
from .layout import SparseLayout
from .precision import compute_dtype
from .tokens import PAD_SEGMENT, TokenMeta, run_starts

# Elements of one [heads, rows, keys] score tile of the PyTorch scoring path.
SCORE_ELEMENTS = 1 << 24
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


# -------------------------------------------------------------------------------------------- scoring


class Sampling(NamedTuple):
    """Which queries score a document's keys (`scoring_groups`): the last `last_q`, and `groups` more groups of
    `group_size` along it; `weighted`: each one's mass counts for its stratum (`Stratum`), else plain sums;
    `far_blocks`: the budget's (`Budget.far_blocks`)."""

    last_q: int
    groups: int = 0
    group_size: int = 16
    weighted: bool = False
    far_blocks: int = 0
    block_size: int = 1

    @classmethod
    def of(cls, cfg: SparseAttentionConfig) -> Sampling:
        sc, budget = cfg.scoring, cfg.budget
        return cls(sc.last_q, sc.sample_groups, sc.sample_group_size, budget.weighted or sc.sample_groups > 0,
                   budget.far_blocks, cfg.block_size)

    def encoding(self, start: int, scored_end: int) -> ScoreEncoding:
        """The fixed points of the segment whose keys [start, scored_end) these queries score (`ScoreEncoding`)."""
        keys = max(scored_end - start, 1)
        # A column or offset gets at most the mass of the document's queries (with far blocks, the total of the
        # columns at most `rows` times that); a block diagonal sums block_size of them (its offsets' weights in
        # integers, `Budget.diagonal_sums`). One bound whatever the far blocks, so that slashes do not depend on them.
        rows = max(self.last_q, self.group_size)
        return ScoreEncoding(FixedPoint.for_sums_below(keys * rows * self.block_size), FixedPoint.for_sums_below(keys))


class ScoreEncoding(NamedTuple):
    """The fixed points (`exact.FixedPoint`) of one segment's scores: `mass`, its column and slash sums (and
    their totals), `exp_sums`, its query rows' softmax denominators; the same on every rank."""

    mass: FixedPoint
    exp_sums: FixedPoint


class Stratum(NamedTuple):
    """The queries [lo, hi) of a document at `doc_start` that its last `rows` scoring queries stand for: a
    probability of key j counts (hi - max(lo, j))^+ / rows times, of offset o (hi - max(lo, doc_start + o))^+ /
    rows; with `far_blocks` a column only the queries that many blocks after its own (`column_weights`)."""

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
    """The first query position that is `stratum.far_blocks` blocks or more after each key's block, in blocks
    counted from the document's start (so that a document scores alike wherever it sits)."""
    bs, start = stratum.block_size, stratum.doc_start
    return (torch.div(key_pos - start, bs, rounding_mode="floor") + stratum.far_blocks) * bs + start


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


def _score_tiles(q_rows: torch.Tensor, k_keys: torch.Tensor, visible: torch.Tensor, scale: float):
    """Masked, scaled scores tile by tile: yields (query heads slice, keys slice, scores [heads, R, keys]) of
    q_rows [Hq, R, D], k_keys [Hkv, L, D] (visible: bool [R, L]), a GQA group against its shared key head, in
    the compute dtype of the inputs; tiles of heads and keys bound the memory whatever L. Each score is exact
    to its two vectors (`exact.exact_scores`): the same in any tile, shard or process."""
    hq, r, d = q_rows.shape
    hk, n = k_keys.shape[:2]
    g = hq // hk
    dtype = compute_dtype(q_rows.dtype, k_keys.dtype)
    qe = on_grid(q_rows).view(hk, g, r, d)
    g_chunk, n_chunk = _tile_shape(q_rows, k_keys)
    hidden = ~visible
    for h in range(hk):
        for n0 in range(0, n, n_chunk):
            keys = slice(n0, min(n, n0 + n_chunk))
            ke = on_grid(k_keys[h, keys])
            for g0 in range(0, g, g_chunk):
                g1 = min(g, g0 + g_chunk)
                sc = exact_scores(qe[h, g0:g1], ke, scale, dtype)
                yield slice(h * g + g0, h * g + g1), keys, sc.masked_fill(hidden[:, keys], float("-inf"))


def _tile_shape(q_rows: torch.Tensor, k_keys: torch.Tensor) -> tuple[int, int]:
    """(query heads, keys) of one `_score_tiles` tile: [heads, R, keys] scores and the keys in fp64 [keys, D]
    within SCORE_ELEMENTS."""
    (hq, r, d), (hk, n) = q_rows.shape, k_keys.shape[:2]
    g_chunk = max(1, min(hq // hk, SCORE_ELEMENTS // max(1, r * n)))
    return g_chunk, max(1, min(n, SCORE_ELEMENTS // max(1, g_chunk * r, d)))


def _finite(m: torch.Tensor) -> torch.Tensor:
    """Row maxima with -inf (a row that sees no key) as 0, to subtract."""
    return torch.where(torch.isfinite(m), m, torch.zeros_like(m))


def row_max(q_rows: torch.Tensor, k_keys: torch.Tensor, visible: torch.Tensor, scale: float) -> torch.Tensor:
    """[Hq, R]: each query row's largest score over these keys (-inf for a row that sees none); the maximum
    of a sharded key set's partial maxima, exactly."""
    out = torch.full(q_rows.shape[:2], float("-inf"), dtype=compute_dtype(q_rows.dtype, k_keys.dtype),
                     device=q_rows.device)
    for heads, _, sc in _score_tiles(q_rows, k_keys, visible, scale):
        out[heads] = torch.maximum(out[heads], sc.amax(-1))
    return out


def row_exp_sums(q_rows: torch.Tensor, k_keys: torch.Tensor, visible: torch.Tensor, scale: float,
                 maxima: torch.Tensor, fixed: FixedPoint) -> torch.Tensor:
    """int64 [Hq, R]: each query row's sum of exp(score - maxima) over these keys in the fixed point `fixed`;
    the sum of a sharded key set's partial sums (with the whole set's maxima), exactly."""
    out = torch.zeros(q_rows.shape[:2], dtype=torch.int64, device=q_rows.device)
    for heads, _, sc in _score_tiles(q_rows, k_keys, visible, scale):
        out[heads] += fixed.encode(torch.exp(sc - _finite(maxima[heads]).unsqueeze(-1))).sum(-1)
    return out


def _probabilities(q_rows, k_keys, visible, scale, normalizer, fixed: FixedPoint):
    """`_score_tiles` as attention probabilities exp(score - row max) / row sum over the rows' whole key set, from
    `normalizer` (row max, row sum) or, without one, from these keys (`row_max`, `row_exp_sums` in `fixed`; in one
    pass when one tile holds every key)."""
    dtype = compute_dtype(q_rows.dtype, k_keys.dtype)
    if normalizer is None and _tile_shape(q_rows, k_keys)[1] == k_keys.shape[1]:
        for heads, keys, sc in _score_tiles(q_rows, k_keys, visible, scale):
            e = torch.exp(sc - _finite(sc.amax(-1, keepdim=True)))
            yield heads, keys, e / fixed.decode(fixed.encode(e).sum(-1, keepdim=True), dtype)
        return
    if normalizer is None:
        top = row_max(q_rows, k_keys, visible, scale)
        normalizer = top, fixed.decode(row_exp_sums(q_rows, k_keys, visible, scale, top, fixed), dtype)
    top = _finite(normalizer[0])
    for heads, keys, sc in _score_tiles(q_rows, k_keys, visible, scale):
        yield heads, keys, torch.exp(sc - top[heads].unsqueeze(-1)) / normalizer[1][heads].unsqueeze(-1)


def accumulate_vertical_slash(
    q_rows: torch.Tensor, k_keys: torch.Tensor, row_pos: torch.Tensor, key_pos: torch.Tensor, scale: float,
    vertical: torch.Tensor, slash: torch.Tensor, encoding: ScoreEncoding,
    normalizer: tuple[torch.Tensor, torch.Tensor] | None = None, slash_base: int = 0,
    vertical_index: torch.Tensor | None = None, stratum: Stratum | None = None,
) -> None:
    """Add the attention mass of query rows at `row_pos` on keys at `key_pos` (keys after a row invisible), in
    the fixed point `encoding.mass` (int64 `vertical`, `slash`): vertical[h, key] += the mass the key receives
    (at `vertical_index` when given), slash[h, slash_base + row - key] += the mass on that offset (`slash_base`:
    the document's start). With a `stratum`, each mass counts its stratum weight (`stratum_weights`; a
    column's `column_weights`). Probabilities are a softmax over these keys, or with `normalizer` = (row max,
    row sum of exp(score - max)) of the row's whole key set (keys split over ranks) exp(score - max) / sum.
    Each (row, key) mass is rounded once and the sums are exact: any split of the rows and keys adds up to the
    same integers."""
    visible = key_pos.unsqueeze(0) <= row_pos.unsqueeze(1)  # [R, L]
    mass = encoding.mass
    for heads, keys, a in _probabilities(q_rows, k_keys, visible, scale, normalizer, encoding.exp_sums):
        diff = row_pos.unsqueeze(1) - key_pos[keys].unsqueeze(0)
        column = a
        if stratum is not None and stratum.far_blocks:  # the far queries' mass only
            column = a * (row_pos.unsqueeze(1) >= far_from(stratum, key_pos[keys]).unsqueeze(0))
        if stratum is not None:
            column = column * column_weights(stratum, key_pos[keys]).to(a.dtype)
            a = a * stratum_weights(stratum, stratum.doc_start + diff).to(a.dtype)
        vertical[heads].index_add_(1, (key_pos if vertical_index is None else vertical_index)[keys],
                                   mass.encode(column).sum(1))
        offset = diff.clamp_min(0) + slash_base
        slash[heads].scatter_add_(1, offset.flatten().expand(a.shape[0], -1), mass.encode(a).flatten(1))


def _scoring_kernel(q: torch.Tensor, k: torch.Tensor):
    """The Triton scoring launcher when it takes these tensors (CUDA), else None (PyTorch path)."""
    if not q.is_cuda:
        return None
    from ..kernels import vertical_slash

    return vertical_slash.vertical_slash_scores if vertical_slash.supports(q, k) else None


def fixed_vertical_slash(
    q: torch.Tensor, k: torch.Tensor, docs: list[tuple[int, int]], scale: float, sampling: Sampling,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`score_vertical_slash` as exact fixed-point sums: int64 (vertical, slash) [Hq, S], each document's in
    its `sampling.encoding(start, end).mass`. On CUDA the Triton kernel's fp32 sums are rounded to it instead
    (not exact: a context-parallel split, scored in PyTorch, can break exact ties otherwise)."""
    hq, s, _ = q.shape
    dtype = compute_dtype(q.dtype)
    vertical = torch.zeros(hq, s, dtype=torch.int64, device=q.device)
    slash = torch.zeros(hq, s, dtype=torch.int64, device=q.device)
    kernel = None if sampling.far_blocks else _scoring_kernel(q, k)  # the kernel sums every query's mass
    for start, end in docs:
        encoding = sampling.encoding(start, end)
        for st in scoring_groups(start, end, sampling):
            first, stratum = st.hi - st.rows, st if sampling.weighted else None
            if kernel is not None:
                v_doc, s_doc = kernel(q[:, first : st.hi], k[:, start : st.hi], scale)
                if stratum is not None:  # keys and offsets of the document share the weights' formula
                    w = stratum_weights(stratum, torch.arange(start, st.hi, device=q.device)).to(dtype)
                    v_doc, s_doc = v_doc * w, s_doc * w
                vertical[:, start : st.hi] += encoding.mass.encode(v_doc)
                slash[:, start : st.hi] += encoding.mass.encode(s_doc)
                continue
            rows = torch.arange(first, st.hi, device=q.device)
            keys = torch.arange(start, st.hi, device=q.device)
            accumulate_vertical_slash(q[:, first : st.hi], k[:, start : st.hi], rows, keys, scale, vertical, slash,
                                      encoding, slash_base=start, stratum=stratum)
    return vertical, slash


def score_vertical_slash(
    q: torch.Tensor, k: torch.Tensor, docs: list[tuple[int, int]], last_q: int, scale: float,
    sampling: Sampling | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Vertical and slash scores of one batch row, q: [Hq, S, D], k: [Hkv, S, D], of the documents `docs`
    ((start, end)) by the queries `sampling` says (default: the last `last_q`, plain sums). Returns (vertical
    [Hq, S], slash [Hq, S]), fp32 (fp64 for fp64 inputs): vertical[h, j] the mass key j receives from its
    document's scoring queries, slash[h, start + o] the mass on offset o = q - k of the document at `start`;
    each rounded once from its exact sum (`fixed_vertical_slash`)."""
    sampling = Sampling(last_q) if sampling is None else sampling
    fixed = fixed_vertical_slash(q, k, docs, scale, sampling)
    dtype = compute_dtype(q.dtype)
    vertical, slash = (torch.zeros(x.shape, dtype=dtype, device=q.device) for x in fixed)
    for start, end in docs:
        mass = sampling.encoding(start, end).mass
        for out, sums in zip((vertical, slash), fixed):
            out[:, start:end] = mass.decode(sums[:, start:end], dtype)
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
    q: torch.Tensor, k: torch.Tensor, segments: list[list[EstimationSegment]], cfg: SparseAttentionConfig, scale: float,
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Scores of every batch row of q [B, Hq, S, D], k [B, Hkv, S, D] with estimation segments by the scoring
    queries of `cfg` (`Sampling.of(cfg)`), as `layout_from_scores` takes them with the same `cfg`: (vertical,
    slash), each int64 [Hq, V, S] exact fixed-point sums (`fixed_vertical_slash`), set j of the row's segments
    at [:, j] as `score_vertical_slash` lays a document out (None for rows without segments)."""
    sampling = Sampling.of(cfg)
    n_sets = _num_sets(segments)
    out = []
    for row, row_segs in enumerate(segments):
        if not row_segs:
            out.append(None)
            continue
        per_set = [fixed_vertical_slash(q[row], k[row], [(sg.start, sg.scored_end) for sg in row_segs if sg.set == j],
                                        scale, sampling) for j in range(n_sets)]
        out.append((torch.stack([v for v, _ in per_set], 1), torch.stack([sl for _, sl in per_set], 1)))
    return out


# --------------------------------------------------------------------------------------------- budget


def keep_anchors(keep_v: torch.Tensor, keep_s: torch.Tensor, start: int, end: int, cfg: SparseAttentionConfig) -> None:
    """Keep the document [start, end)'s first `sink_tokens` columns and `local_window` diagonals
    (keep_v, keep_s: [H, S] of its row)."""
    keep_v[:, start : min(end, start + cfg.sink_tokens)] = True
    keep_s[:, start : min(end, start + cfg.local_window)] = True


def _mark(keep: torch.Tensor, kept: torch.Tensor, positions: torch.Tensor) -> None:
    """keep[h, positions[h, i]] = True where kept[h, i] (positions [n] or [h, n], keep [H, S])."""
    at = torch.where(kept, positions.expand_as(kept), keep.shape[-1])
    keep |= torch.nn.functional.pad(keep, (0, 1)).scatter_(-1, at, True)[:, :-1]


def select_into(keep_v: torch.Tensor, keep_s: torch.Tensor, cfg: SparseAttentionConfig, columns: Entries,
                diagonals: Entries, sg: EstimationSegment) -> None:
    """The budget stage of one segment: mark what `cfg.budget` keeps of its scored columns and diagonals
    (whole rows, or the candidates every rank offered) and its anchors in its set's keep_v, keep_s [H, S]."""
    budget = cfg.budget
    cols, diags = budget.select(columns, diagonals, sg.start, sg.q_hi, sg.scored_end, cfg.block_size)
    _mark(keep_v, cols, columns.ids)
    _mark(keep_s, diags, sg.start + diagonals.ids * budget.diagonal_step(cfg.block_size))
    keep_anchors(keep_v, keep_s, sg.start, sg.q_hi, cfg)


def row_entries(cfg: SparseAttentionConfig, vertical: torch.Tensor, slash: torch.Tensor, start: int, end: int,
                fixed: FixedPoint | None = None) -> tuple[Entries, Entries]:
    """The entries of the segment [start, end) from whole rows of scores (vertical, slash [H, S] of its set):
    floating point, or int64 sums in the fixed point `fixed` (its `ScoreEncoding.mass`), then read as fp64
    with their totals summed exactly, as a context-parallel split sums them."""
    budget, bs = cfg.budget, cfg.block_size
    ids = torch.arange(start, end, device=vertical.device)
    if fixed is None:
        diagonals = budget.diagonal_scores(slash[:, start:end], bs)
        return Entries(vertical[:, start:end], ids), Entries(diagonals, torch.arange(diagonals.shape[-1],
                                                                                      device=ids.device))
    sums = budget.diagonal_sums(slash[:, start:end], bs)
    step_bits = budget.diagonal_step(bs).bit_length() - 1
    return (Entries(fixed.decode(vertical[:, start:end]), ids, fixed.decode(vertical[:, start:end].sum(-1, True))),
            Entries(fixed.decode(sums, divisor_bits=step_bits), torch.arange(sums.shape[-1], device=ids.device),
                    fixed.decode(sums.sum(-1, True), divisor_bits=step_bits)))


def select_vertical_slash(
    vertical: torch.Tensor, slash: torch.Tensor, docs: list[list[tuple[int, ...]]], cfg: SparseAttentionConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept key columns and diagonal offsets ([B, H, S] bool each) from a batch's scores; docs: per row, its
    scored documents as (start, end), or (start, end, scored_end) when only the queries before scored_end
    scored it (a causal chunk); each is selected on its own (`select_into`)."""
    keep_v, keep_s = (torch.zeros_like(x, dtype=torch.bool) for x in (vertical, slash))
    for row, row_docs in enumerate(docs):
        for start, end, *scored_end in row_docs:
            select_into(keep_v[row], keep_s[row], cfg, *row_entries(cfg, vertical[row], slash[row], start, end),
                        EstimationSegment(start, (scored_end or [end])[0], start, end, 0))
    return keep_v, keep_s


# --------------------------------------------------------------------------------------------- layout


def segment_diagonals(keep_s: torch.Tensor, meta: TokenMeta, segments: list[list[EstimationSegment]],
                      block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Kept block diagonals per segment side by side, and where each query block's set begins (`build_layout`'s
    `diagonals`, `diagonal_start`), from kept offsets [B, H, V, S]: a segment's set spans the blocks from its
    document's start to its last query, and the query blocks whose first valid query it holds take it."""
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


def layout_from_kept(meta: TokenMeta, cfg: SparseAttentionConfig, segments: list[list[EstimationSegment]],
                     keep_v: torch.Tensor, keep_s: torch.Tensor) -> SparseLayout:
    """The layout from the kept columns and offsets of every estimation segment ([B, H, V, S] bool each,
    set j of a row at [:, :, j], as `select_vertical_slash` lays them out, anchors included)."""
    dense_tokens = meta.segment != PAD_SEGMENT
    for row, row_segs in enumerate(segments):
        for sg in row_segs:
            dense_tokens[row, sg.q_lo : sg.q_hi] = False
    columns = cfg.budget.most_kept("columns")  # every segment's budget and sinks
    bound = max((columns + cfg.sink_tokens) * len(row_segs) for row_segs in segments)
    diagonals, diagonal_start = segment_diagonals(keep_s, meta, segments, cfg.block_size)
    if cfg.estimation == "last_queries":  # one set, read by every query block
        verticals, vertical_set = keep_v[:, :, 0], None
    else:
        verticals = keep_v
        vertical_set = diagonal_set_of_blocks(meta, cfg.block_size, _query_ranges(segments),
                                              [[sg.set for sg in row] for row in segments])
    return build_layout(meta, cfg.block_size, diagonals=diagonals, diagonal_start=diagonal_start, verticals=verticals,
                        vertical_set=vertical_set, dense_tokens=dense_tokens, max_verticals=bound)


def layout_from_scores(meta: TokenMeta, cfg: SparseAttentionConfig, docs: list[list[tuple[int, int]]],
                       scores: list[tuple[torch.Tensor, torch.Tensor] | None]) -> SparseLayout:
    """The layout once every row with estimation segments (`estimation_segments(docs, cfg)`) has its
    (vertical, slash) scores ([H, V, S] each, or [H, S] for one set; None for rows without segments): the
    int64 fixed-point sums `score_rows` gives (what `estimate_layout` selects from), or floating point
    scores: the budget and layout stages of `estimate`."""
    return estimate(cfg, meta, lambda segments: _row_entries(cfg, segments, scores), docs=docs).layout


def _row_entries(cfg: SparseAttentionConfig, segments: list[list[EstimationSegment]],
                 scores: list[tuple[torch.Tensor, torch.Tensor] | None]) -> Iterable[tuple[Entries, Entries]]:
    """Each segment's entries (in `estimate`'s order) from every row's whole scores."""
    first = next(sc[0] for sc in scores if sc is not None)
    n_sets = _num_sets(segments)
    warn_if_costly(n_sets, len(scores) * 2 * first.shape[0] * first.shape[-1] * n_sets * first.element_size(), cfg)
    sampling = Sampling.of(cfg)
    for row, row_segs in enumerate(segments):
        for sg in row_segs:
            vertical, slash = (x.view(x.shape[0], n_sets, -1)[:, sg.set] for x in scores[row])
            fixed = None if vertical.is_floating_point() else sampling.encoding(sg.start, sg.scored_end).mass
            yield row_entries(cfg, vertical, slash, sg.start, sg.q_hi, fixed)


class KeptEntries(NamedTuple):
    """What a layout is built from (`layout_from_kept`): every row's segments, the kept columns and offsets
    ([B, H, V, S] bool each, anchors included)."""

    segments: list[list[EstimationSegment]]
    keep_v: torch.Tensor
    keep_s: torch.Tensor


class Estimate(NamedTuple):
    """`estimate`'s result: the layout, and the entries it was built from (None: dense)."""

    layout: SparseLayout
    kept: KeptEntries | None


# Scores stage: each estimation segment's (columns, diagonals) entries, in row order, from the segments of a call.
Scores = Callable[[list[list[EstimationSegment]]], Iterable[tuple[Entries, Entries]]]


def estimate(cfg: SparseAttentionConfig, meta: TokenMeta, scores: Scores, *, sliding_window: int | None = None,
             docs: list[list[tuple[int, int]]] | None = None) -> Estimate:
    """The pipeline: documents -> segments -> scores -> budget -> layout.

    Args:
        cfg: the layer's pattern settings; meta: the tokens' documents and padding [B, S].
        scores: the scores stage (`Scores`): one process scores whole rows, a CP rank gathers every rank's
            candidates; the budget keeps the same entries of either.
        sliding_window: the layer's window (such layers are dense); docs: `pattern_documents` of this
            call when the caller has them already.

    Returns:
        The `Estimate`: a layout [B, Hq, NQB, ...] (dense: one shared head), the same on every rank.
    """
    b, s = meta.segment.shape
    docs = pattern_documents(cfg, meta, b, s, sliding_window) if docs is None else docs
    segments = estimation_segments(docs, cfg)
    if not any(segments):
        return Estimate(dense_layout(meta, cfg.block_size, sliding_window), None)
    flat = [(row, sg) for row, row_segs in enumerate(segments) for sg in row_segs]
    keep = None
    for (row, sg), (columns, diagonals) in zip(flat, scores(segments)):
        if keep is None:  # [2, B, H, V, S]: kept columns, kept offsets
            keep = columns.scores.new_zeros(2, b, columns.scores.shape[0], _num_sets(segments), s, dtype=torch.bool)
        select_into(keep[0, row, :, sg.set], keep[1, row, :, sg.set], cfg, columns, diagonals, sg)
    kept = KeptEntries(segments, *keep)
    return Estimate(layout_from_kept(meta, cfg, *kept), kept)


def estimate_layout(q: torch.Tensor, k: torch.Tensor, cfg: SparseAttentionConfig, meta: TokenMeta | None = None, *,
                    scale: float | None = None, sliding_window: int | None = None,
                    docs: list[list[tuple[int, int]]] | None = None) -> SparseLayout:
    """The layout for one attention call: vertical-slash for long documents, dense for the rest.

    Args:
        q: [B, Hq, S, D]; k: [B, Hkv, S, D] (after RoPE), Hq a multiple of Hkv.
        cfg: the layer's pattern settings (`SparseAttentionConfig.for_layer`).
        meta: the tokens' documents and padding (default: one document per row).
        scale: softmax scale of the scores (default 1 / sqrt(D)).
        sliding_window: the layer's window; such layers are dense (already local).
        docs: `pattern_documents` of this call when the caller has it already.

    Returns:
        The `SparseLayout` [B, Hq, NQB, ...] (one shared head when every document is dense), the same for
        the same inputs on every rank.
    """
    return estimate_whole_rows(q, k, cfg, meta, scale=scale, sliding_window=sliding_window, docs=docs).layout


def estimate_whole_rows(q: torch.Tensor, k: torch.Tensor, cfg: SparseAttentionConfig, meta: TokenMeta | None = None,
                        *, scale: float | None = None, sliding_window: int | None = None,
                        docs: list[list[tuple[int, int]]] | None = None) -> Estimate:
    """`estimate_layout`, with the kept entries the layout was built from (`Estimate`)."""
    b, _, s, d = q.shape
    docs = pattern_documents(cfg, meta, b, s, sliding_window) if docs is None else docs
    meta = TokenMeta.contiguous(b, s, q.device) if meta is None else meta
    scale = 1.0 / math.sqrt(d) if scale is None else scale

    def whole_rows(segments: list[list[EstimationSegment]]) -> Iterable[tuple[Entries, Entries]]:
        return _row_entries(cfg, segments, score_rows(q, k, segments, cfg, scale))

    return estimate(cfg, meta, whole_rows, sliding_window=sliding_window, docs=docs)
