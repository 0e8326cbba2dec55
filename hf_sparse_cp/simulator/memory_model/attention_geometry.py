"""The sizes of one attention call's layout and of the buffers built around it (estimation, layout construction,
the PyTorch reference's chunks), from the pattern's budgets and the layer's window."""

from __future__ import annotations

import math
from dataclasses import dataclass

from ...attention import build, estimate, reference, scoring
from ...config import SparseAttentionConfig
from .architecture import Architecture
from .settings import StepSettings, padded_tokens


@dataclass(frozen=True)
class AttentionGeometry:
    """Sizes of one attention call's layout and of the buffers built around it (bytes)."""

    layout_per_token: float  # the layout (and the kernels' split of it), per query token of the rank
    construction: tuple[float, float]  # layout construction at its peak, its output included: (per token, constant)
    estimation: tuple[float, float]  # the estimation's buffers at their peak: (per token, constant)
    workspace_forward: float  # the reference's chunk temporaries (0 on the Triton path)
    workspace_backward: float
    width: str  # where the layout's width comes from


def estimation_sets(cfg: SparseAttentionConfig, seq_len: int) -> tuple[int, int]:
    """(score sets, scored offsets) of one document of `seq_len` tokens: 1 and seq_len with 'last_queries';
    with 'causal_chunks' one set per chunk after the first, each scoring the keys before it
    (`estimate.estimation_segments`). One process holds every set's scores over the whole row ([heads, sets, S]),
    a ring rank the slash sums of every set's offsets: both grow as S^2 / estimation_chunk."""
    segments = estimate.estimation_segments([[(0, seq_len)]], cfg)[0]
    return max(1, len(segments)), max(seq_len, sum(sg.scored_end - sg.start for sg in segments))


def layout_construction_bytes(heads: int, query_blocks: int, block_width: int, columns: int,
                              block_size: int, sets: int = 1) -> tuple[float, float]:
    """The peak of `build.build_layout` over its inputs, its output included, for one row of `heads` heads and
    `query_blocks` query blocks that list up to `block_width` key blocks and read a window of up to `columns` kept
    columns (0: none) of `sets` sets of kept columns (causal chunks: `estimation_sets`): (bytes per token held for
    every head, bytes of one head chunk's temporaries). Counted on the code; tests/unit/test_layout_memory.py checks
    it against `AllocationRecorder`."""
    n, tokens = heads * query_blocks, query_blocks * block_size

    def chunk(width: int) -> int:  # elements of a [chunk heads, NQB, width] tensor (`head_chunks`)
        return max(1, min(heads, build.LAYOUT_ELEMENTS // max(1, query_blocks * width))) * query_blocks * width

    # First the document starts of `first_visible_keys` (three int64 and a bool per token); with columns, then
    # their listing (`_compact` over [heads, S]: int32 positions and their int64 copy per head and token, an int64
    # arange per token) beside the masked copy of the kept columns and the diagonals' counts (below).
    first = ((n * 44 + (13 * heads + 8) * tokens * sets) / tokens if columns else 25.0, 0.0)
    # Held through the block pass: block_idx and block_cnt (int32), four int64 per (head, query block) (the kept
    # diagonals' list, each block's base, rank and count); with columns also each window's start and span (int64),
    # the masked copy of the kept columns (bool [heads, S]) and every head's column mask (a bool per window slot).
    blocks_held = n * (4 * block_width + 4) + (n * (16 + columns) + heads * tokens * sets if columns else 0)
    # The block pass peaks at six int64 and a bool per element of its chunk (dense and diagonal key blocks, ranks,
    # the gathered diagonals, the two `where`s).
    phases = [first, ((blocks_held + 32 * n) / tokens, 49.0 * chunk(block_width))]
    # The column pass peaks in its first chunk's compaction: col_idx (int32, at most the window wide) and col_cnt,
    # `_compact`'s int32 window positions and their int64 copy (nothing of the block pass is left).
    if columns:
        phases.append(((blocks_held + n * (4 * columns + 4)) / tokens, 12.0 * chunk(columns)))
    return max(phases, key=lambda bytes_: bytes_[0] * tokens + bytes_[1])


def attention_geometry(arch: Architecture, s: StepSettings, seq_len: int, tokens: int, heads: int,
                        ring: bool, window: int | None = None) -> AttentionGeometry:
    """Layout widths from the pattern's budgets: a kept diagonal offset crosses at most two block
    diagonals, plus the local window's and the sink's; columns: the vertical budget and the sinks. `tokens` and
    `heads`: the queries and heads of one attention call on this rank; `ring`: the call runs a ring; `window`: the
    layer's sliding window (such a layer runs dense, unestimated, over the blocks of its window:
    `estimate.pattern_documents`, `build.dense_layout`)."""
    cfg, sh = s.pattern, arch.shape
    bs, hq = cfg.block_size, heads
    # the row's blocks (what a query block may list: no padding key) and, under the ring, the tokens of the sequence as
    # its split pads it, over which every rank builds the global layout and holds the estimation's kept flags
    nqb_global, nqb = math.ceil(seq_len / bs), math.ceil(tokens / bs)
    held = padded_tokens(seq_len, s) if ring else tokens
    sparse = estimates_sparse(s, seq_len, window)
    if sparse:
        window = math.ceil((cfg.local_window - 1) / bs) + 1
        diagonals = cfg.budget.most_diagonal_blocks(bs)
        if diagonals is not None:
            width = min(nqb_global, diagonals + window + 1)
            basis = f"{width} blocks: the budget's bound"
        elif s.kept_curve is not None and s.kept_curve.measures(cfg):
            at = s.kept_curve.at(seq_len)
            width = min(nqb_global, math.ceil(at.width_share * nqb_global))
            basis = f"{width} blocks: {at.width_share:.3f} of the row ({at.basis}; {at.source})"
        else:
            width = nqb_global
            basis = f"{nqb_global} blocks: every block of the row (the bound" + (
                "; the kept-fraction curve measured another pattern)" if s.kept_curve is not None else ")")
        columns = cfg.budget.most_kept("columns")  # (None: a budget that bounds no columns, every key of the row)
        cols = seq_len if columns is None else columns + cfg.sink_tokens
    elif window is None:
        width, cols = nqb_global, 0  # every causal block, on one shared head
        hq, basis = 1, "dense: every causal block"
    else:  # the blocks a query block's window reaches (its first query's reaches furthest back), on one shared head
        width, cols = min(nqb_global, math.ceil((window - 1) / bs) + 1), 0
        hq, basis = 1, f"{width} blocks: a sliding window of {window} tokens"
    # block_idx and col_idx (int32) and two counts per (head, query block); the Triton path adds its
    # full/partial split (an int32 copy of block_idx, a flag per slot) and backward's per-key-block list
    per_block = hq * (4 * width + 4 * cols + 8) + (hq * width * 9 if s.device == "cuda" else 0)
    construction = (0.0, 0.0)
    # causal chunks: one set of scores and kept columns per chunk after the first (1 with 'last_queries')
    sets, offsets = estimation_sets(cfg, seq_len) if sparse else (1, seq_len)
    if sparse:
        # the build, over the whole sequence under the ring (every rank builds the one-process layout:
        # distributed/ring/estimation.py), counted per token of this call; beside it the kept flags of every
        # set (bool [2, heads, sets, S], over the whole sequence on every rank) that it is built from
        built = math.ceil(held / bs)
        per_token, constant = layout_construction_bytes(hq, built, width, cols, bs, sets)
        construction = ((per_token * built * bs + 2 * hq * sets * held) / tokens if ring else per_token
                        + 2 * hq * sets, constant)
    estimation = (0.0, 0.0)
    if sparse:
        # vertical and slash scores (int64 [heads, sets, S]) and the kept flags [2, heads, sets, S]; the
        # reference scoring's tiles: about seven fp32 [group heads, last_q, keys] tensors (scores, exp,
        # masks, int64 offsets) of at most scoring.SCORE_ELEMENTS elements, and their keys in fp64 [keys, D]
        group = sh.heads // sh.kv_heads
        tile = min(scoring.SCORE_ELEMENTS, group * cfg.scoring.last_q * tokens)
        tile_keys = min(tokens, scoring.SCORE_ELEMENTS // max(1, group * cfg.scoring.last_q, sh.head_dim))
        if ring:
            # distributed/ring/estimation.py: the verticals of this rank's keys of every set (int64), the slash sums
            # over every set's offsets (int64), which every rank holds twice while it packs their diagonals for the
            # reduce-scatter (the sums and the rank-major send buffer), and the kept flags of every set over the
            # whole sequence
            cp = held / tokens  # (the ring's ranks)
            per_token = (heads * (8 * offsets / cp + 2 * 8 * offsets + 2 * sets * held)) / tokens
        else:
            per_token = heads * (8 * 2 + 2) * sets
        per_token += cfg.scoring.last_q
        estimation = (per_token, 7 * 4 * tile + 8 * sh.head_dim * tile_keys if s.device == "cpu" else 0.0)
    forward = backward = 0.0
    if s.device == "cpu":
        # Chunks of query blocks with at most reference.CHUNK_ELEMENTS score elements. Per element, a chunk's
        # temporaries in attention/reference.py hold at their peak ~13.2 bytes in forward (scores, exp, the
        # probabilities, masks) and ~17.6 in backward (probabilities, dp, ds), plus the gathered fp32 keys and
        # values (8 x head_dim / block_size, 8.8 in backward); the previous chunk's leave ~5.2 (7.8) bytes
        # per element alive until the loop rebinds them. Counted on the code, checked with a tensor-byte tracker.
        n_keys = width * bs + cols
        chunk = max(1, min(nqb, reference.CHUNK_ELEMENTS // (heads * bs * n_keys)))
        per_block_elements = heads * bs * n_keys
        full, last = chunk * per_block_elements, (nqb - (math.ceil(nqb / chunk) - 1) * chunk) * per_block_elements
        for new, old, kv_part in ((13.2, 5.2, 8.0), (17.6, 7.8, 8.8)):
            fresh = new + kv_part * sh.head_dim / bs
            if nqb <= chunk:
                peak = full * fresh
            elif math.ceil(nqb / chunk) == 2:
                peak = max(full * fresh, last * fresh + full * old)
            else:
                peak = full * (fresh + old)
            forward, backward = (peak, backward) if forward == 0.0 else (forward, peak)
    return AttentionGeometry(per_block / bs, construction, estimation, forward, backward, basis)


def estimates_sparse(s: StepSettings, seq_len: int, window: int | None) -> bool:
    """Whether a layer of sliding window `window` (None: global) estimates a sparse pattern at `seq_len`."""
    return s.pattern.pattern != "dense" and seq_len >= s.pattern.min_seq_len and window is None
