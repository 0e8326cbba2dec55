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
stay dense. Scoring (`scoring.py`) runs in PyTorch by tiles, exactly (`hf_sparse_cp.attention.exact`):
each query-key score exact to its two vectors, each sum an int64 fixed-point sum, so that any tiling and
any context-parallel split give the same scores to the bit and exact ties from equal inputs stay ties;
the budget reads them as fp64 (one process on CUDA scores in the Triton kernels instead). Host
synchronizations per call: the batch's documents (once per metadata object, `TokenMeta.documents`), the window of kept
columns a query block can see, and the layout's padded widths.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch

from ..config import SparseAttentionConfig
from ..config.registries import is_plugin
from .budgets import Entries
from .build import build_layout, dense_layout, diagonal_set_of_blocks, offsets_to_block_diagonals
from .exact import FixedPoint
from .layout import SparseLayout, check_meta, check_scale, check_tensors, check_window
from .scoring import Sampling, fixed_vertical_slash
from .tokens import PAD_SEGMENT, TokenMeta

# Score sets beyond this many bytes per call (causal chunks, a long sequence) earn a warning naming the fix.
SCORE_SET_WARN_BYTES = 1 << 30


# ------------------------------------------------------------------------------------------ documents


def long_documents(meta: TokenMeta, cfg: SparseAttentionConfig) -> list[list[tuple[int, int]]]:
    """Per batch row, the documents long enough (>= min_seq_len) for a sparse pattern."""
    shortest = max(cfg.min_seq_len, 1)
    return [[(st, en) for st, en in row if en - st >= shortest] for row in meta.documents]


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
    hq, s = q.shape[1], q.shape[2]
    out = []
    for row, row_segs in enumerate(segments):
        if not row_segs:
            out.append(None)
            continue
        # Each set is summed in place into its slice: with causal chunks the S / estimation_chunk sets are the
        # call's largest buffer, and stacking them from separate tensors held them twice (the memory model:
        # `simulator.memory_model.attention_geometry.estimation_sets`).
        vertical, slash = (torch.zeros(hq, n_sets, s, dtype=torch.int64, device=q.device) for _ in range(2))
        for j in range(n_sets):
            fixed_vertical_slash(q[row], k[row], [(sg.start, sg.scored_end) for sg in row_segs if sg.set == j],
                                 scale, sampling, out=(vertical[:, j], slash[:, j]))
        out.append((vertical, slash))
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



def _check_selection(budget, selection: Any, columns: Entries, diagonals: Entries) -> None:
    """Raise TypeError, naming the fix, unless a budget mode's `select` returned (columns, diagonals): bool masks of
    its entries' shapes (else it ended in the marking, 'Index tensor must have the same number of dimensions')."""
    wants = [list(columns.scores.shape), list(diagonals.scores.shape)]
    pair = isinstance(selection, (tuple, list)) and len(selection) == 2
    if pair and all(isinstance(m, torch.Tensor) and m.dtype == torch.bool and list(m.shape) == want
                    for m, want in zip(selection, wants)):
        return
    got = [f"{m.dtype} {list(m.shape)}" if isinstance(m, torch.Tensor) else type(m).__name__
           for m in (selection if pair else [selection])]
    raise TypeError(f"budget mode {budget.mode!r} ({type(budget).__qualname__}.select) returned {', '.join(got)}: it "
                    f"must return (kept columns, kept diagonals), two bool tensors of the shapes of the scores it was "
                    f"given ({wants[0]} and {wants[1]}: heads x entries).")


def _check_most_kept(budget, cols: torch.Tensor, diags: torch.Tensor) -> None:
    """Raise ValueError, naming the fix, where a budget mode's `select` kept more entries of a kind for one head than
    its `most_kept` says it keeps: under context parallelism each rank offers only that many of its best (`offered`),
    so the selection would differ from one process's, silently."""
    for kind, kept in (("columns", cols), ("diagonals", diags)):
        most = budget.most_kept(kind)
        if most is None or not kept.numel():
            continue
        count = int(kept.sum(-1).amax())
        if count > most:
            raise ValueError(
                f"budget mode {budget.mode!r} ({type(budget).__qualname__}) kept {count} {kind} of a segment for one "
                f"head, where its most_kept({kind!r}) says at most {most}: under context parallelism each rank offers "
                f"only its best {most}, and the pattern would differ from one process's. Make most_kept return a "
                "bound its select never passes (None: any number).")


def select_into(keep_v: torch.Tensor, keep_s: torch.Tensor, cfg: SparseAttentionConfig, columns: Entries,
                diagonals: Entries, sg: EstimationSegment) -> None:
    """The budget stage of one segment: mark what `cfg.budget` keeps of its scored columns and diagonals
    (whole rows, or the candidates every rank offered) and its anchors in its set's keep_v, keep_s [H, S]."""
    budget = cfg.budget
    selection = budget.select(columns, diagonals, sg.start, sg.q_hi, sg.scored_end, cfg.block_size)
    if is_plugin(budget):  # (a host read: the package's own modes bound their `select` by construction, tested)
        _check_selection(budget, selection, columns, diagonals)
        _check_most_kept(budget, *selection)
    cols, diags = selection
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
    set j of a row at [:, :, j], as `estimate`'s `KeptEntries` holds them, anchors included)."""
    dense_tokens = meta.segment != PAD_SEGMENT
    for row, row_segs in enumerate(segments):
        for sg in row_segs:
            dense_tokens[row, sg.q_lo : sg.q_hi] = False
    columns = cfg.budget.most_kept("columns")  # every segment's budget and sinks (None: any number, counted)
    bound = None if columns is None else max((columns + cfg.sink_tokens) * len(row_segs) for row_segs in segments)
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

    Raises:
        ValueError: q and k are not of these shapes (one length S: the pattern is estimated over a whole
            sequence, queries and keys at the same positions), or `meta` is not [B, S]; naming the shapes.
    """
    check_tensors(q, k, k)
    check_window(sliding_window)
    check_scale(scale)
    check_meta("meta", meta)
    if not isinstance(cfg, SparseAttentionConfig):
        raise TypeError(f"cfg must be a SparseAttentionConfig (a layer's: config.for_layer(i)); got "
                        f"{type(cfg).__name__}.")
    b, hq, s, _ = q.shape
    if hq == 0:  # (a reshape's RuntimeError inside)
        raise ValueError(f"q has 0 heads ({tuple(q.shape)}): a layout is estimated per query head; give at least 1.")
    if k.shape[2] != s:  # (a layout of another length: silently wrong, or an IndexError in attention)
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} must have the same length S: a layout is "
                         "estimated over one whole sequence, its queries and keys at the same positions.")
    if meta is not None and (meta.index.shape != (b, s) or meta.segment.shape != (b, s)):
        raise ValueError(f"meta must hold index and segment of shape [B, S] = {(b, s)}; got "
                         f"{tuple(meta.index.shape)} and {tuple(meta.segment.shape)}.")
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
