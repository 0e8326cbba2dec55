"""How SMET's density becomes whole blocks per row (`kept_blocks`), and the warning at set-up when that moves a
weight's density far from the one asked (`warn_if_rounded`)."""

from __future__ import annotations

import functools
import logging
import math
from collections.abc import Sequence

logger = logging.getLogger(__name__)

# How far (relative) a weight's density may move from the one asked before set-up says so. Rounding moves a row of
# B blocks by up to 1/(2B): within 5% from 10 kept blocks a row (density x blocks per row >= 10).
TOLERANCE = 0.05


def kept_blocks(blocks_per_row: int, density: float) -> int:
    """Active blocks of a row of `blocks_per_row`: the nearest whole number to `density` of them, at least one (a row
    without any would be cut off from every input) and at most all."""
    return min(blocks_per_row, max(1, round(density * blocks_per_row)))


def _trained(density: float, weights: Sequence[tuple[int, int]]) -> float:
    """The density `weights` (rows, blocks per row) train at when `density` is asked: the smet/density log's."""
    return sum(rows * kept_blocks(blocks, density) for rows, blocks in weights) / sum(rows * b for rows, b in weights)


def _worst(density: float, blocks_per_row: Sequence[int]) -> float:
    """The largest relative move of a row's density from `density`."""
    return max(abs(kept_blocks(blocks, density) / blocks - density) / density for blocks in blocks_per_row)


@functools.cache  # (once per set-up: a Trainer builds the parameter groups twice)
def warn_if_rounded(density: float, block_size: int, weights: tuple[tuple[int, int], ...]) -> None:
    """Warn when a weight of `weights` (rows, blocks per row) trains at a density more than `TOLERANCE` from
    `density`: the density the weights train at, the rows that move, and what comes closer (the smaller block size
    dividing every weight's columns that comes closest; a density every row keeps exactly)."""
    widths = sorted({blocks for _, blocks in weights})
    far = [blocks for blocks in widths if _worst(density, [blocks]) > TOLERANCE]
    if not far:
        return
    rows = "; ".join(f"a row of {blocks * block_size} columns keeps {kept_blocks(blocks, density)} of its {blocks} "
                     f"blocks ({kept_blocks(blocks, density) / blocks:.3g})" for blocks in far)
    columns = math.gcd(*(blocks * block_size for blocks in widths))
    # the largest smaller block size within the tolerance, else the closest (largest of equals), if closer
    smaller = [size for size in range(block_size - 1, 0, -1) if columns % size == 0]
    moves = {size: _worst(density, [blocks * block_size // size for blocks in widths]) for size in smaller}
    best = min(moves, key=lambda size: (max(moves[size], TOLERANCE), -size), default=None)
    closer = [] if best is None or moves[best] >= _worst(density, widths) else [
        f"block_size (--smet_block_size) {best} trains at "
        f"{_trained(density, [(n, blocks * block_size // best) for n, blocks in weights]):.3g}"]
    step = math.gcd(*widths)  # every row keeps a multiple of 1/step exactly
    closer.append(f"ask for a density every row keeps exactly, a multiple of 1/{step} (e.g. "
                  f"{max(1, round(density * step)) / step:.3g})")
    logger.warning("SMET trains at density %.3g, not the %s asked: every row keeps a whole number of its blocks of "
                   "block_size=%d input columns, at least one, and %s. Closer: %s.", _trained(density, weights),
                   density, block_size, rows, "; or ".join(closer))
