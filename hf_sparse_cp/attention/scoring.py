"""How a document's scoring queries score its keys: the vertical (per key column) and slash (per diagonal) sums
of their attention mass, exactly (`hf_sparse_cp.attention.exact`), in tiles of `SCORE_ELEMENTS`; which queries
score (`Sampling`, `scoring_groups`) and how much each counts for (`Stratum`). The scores stage of
`estimate.estimate` on one process, and of every rank's shard under context parallelism
(`hf_sparse_cp.distributed.ring.estimation`). One process on CUDA scores in the Triton kernels of
`hf_sparse_cp.kernels.vertical_slash` instead (fp32 sums, rounded to the same fixed point).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from ..backends import is_triton_available
from ..config import SparseAttentionConfig
from .exact import FixedPoint, exact_scores, on_grid
from .precision import compute_dtype

# Elements of one [heads, rows, keys] score tile of the PyTorch scoring path.
SCORE_ELEMENTS = 1 << 24


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
    """The Triton scoring launcher when it takes these tensors (CUDA, Triton installed), else None (PyTorch path)."""
    if not q.is_cuda or not is_triton_available():
        return None
    from ..kernels import vertical_slash

    return vertical_slash.vertical_slash_scores if vertical_slash.supports(q, k) else None


def fixed_vertical_slash(
    q: torch.Tensor, k: torch.Tensor, docs: list[tuple[int, int]], scale: float, sampling: Sampling,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`score_vertical_slash` as exact fixed-point sums: int64 (vertical, slash) [Hq, S], each document's in
    its `sampling.encoding(start, end).mass`. On CUDA the Triton kernel's fp32 sums are rounded to it instead
    (not exact: a context-parallel split, scored in PyTorch, can break exact ties otherwise). `out`: two zeroed
    int64 [Hq, S] tensors (views of a caller's larger buffer allowed) to add the sums into, returned."""
    hq, s, _ = q.shape
    dtype = compute_dtype(q.dtype)
    if out is None:
        out = tuple(torch.zeros(hq, s, dtype=torch.int64, device=q.device) for _ in range(2))
    vertical, slash = out
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
