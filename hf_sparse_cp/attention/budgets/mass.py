"""The 'mass' budget: key columns and block diagonals ranked together by estimated attention mass per
block of work they add, kept until their mass reaches a share of the document's attention, and beyond that
every one worth a price of work; broad heads keep more, focused heads less.

A column's work is the query blocks after its own (its own block lies on the always-kept main diagonal),
a block diagonal's the query blocks it crosses. With `mass_near_blocks` n, each query block's n nearest
block diagonals serve the keys near it: a column is valued by the queries n or more blocks after it, and
the far block diagonals lose the estimated mass of the kept columns they cross (chosen again with it), so
that no mass counts twice. Blocks are counted from the document's start, so that a document selects the
same wherever it sits in a packed row (a document that does not start on a block boundary costs a little
more work than this counts).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..chunks import head_chunks
from .base import SELECT_ELEMENTS, Budget, Entries, Kind, rank_order


def block_diagonal_sums(slash: torch.Tensor, block_size: int) -> torch.Tensor:
    """[h, ceil(L / bs) + 1]: block_size times the mass on each block diagonal d from slashes [h, L] of offsets
    0..L-1 (floating point or fixed-point int64: integer weights, exact). A query at a uniform place in its block
    reaches block diagonal d through offset o with probability (bs - |o - d bs|)^+ / bs, so offset d bs + u
    (0 <= u < bs) gives (bs - u) / bs to d and u / bs to d + 1."""
    h, n = slash.shape
    bs = block_size
    nb = -(-n // bs)
    blocks = torch.nn.functional.pad(slash, (0, nb * bs - n)).view(h, nb, bs)
    u = torch.arange(bs, device=slash.device, dtype=slash.dtype)
    out = torch.zeros(h, nb + 1, dtype=slash.dtype, device=slash.device)
    out[:, :nb] = (blocks * (bs - u)).sum(-1)
    out[:, 1:] += (blocks * u).sum(-1)
    return out


def _document_blocks(positions: torch.Tensor, start: int, block_size: int) -> torch.Tensor:
    """The block of each position in blocks counted from the document's start: a document is priced the same
    wherever it sits in a row's blocks."""
    return torch.div(positions - start, block_size, rounding_mode="floor")


def column_cost(positions: torch.Tensor, start: int, end: int, block_size: int, far_blocks: int = 0) -> torch.Tensor:
    """Blocks of work a kept key column at `positions` adds in a document [start, end): 1 / block_size per
    query block after its own, or with `far_blocks` per query block that many blocks or more after its own
    (blocks counted from the document's start)."""
    end_qb = -(-(end - start) // block_size)
    after = _document_blocks(positions, start, block_size) + max(1, far_blocks)
    return (end_qb - torch.clamp_min(after, 0)).clamp_min(0) / block_size


def column_ratio(gain: torch.Tensor, positions: torch.Tensor, start: int, end: int, block_size: int,
                 far_blocks: int = 0) -> torch.Tensor:
    """Estimated mass per block of work of key columns ([h, n] gains at `positions`) in a document [start,
    end), 0 for a column that adds no work."""
    cost = column_cost(positions, start, end, block_size, far_blocks).to(gain.dtype)
    return torch.where(cost > 0, gain / cost.clamp_min(1 / block_size), 0)


def diagonal_cost(diagonals: torch.Tensor, start: int, end: int, block_size: int) -> torch.Tensor:
    """Blocks of work a kept block diagonal d adds in a document [start, end): the document's query blocks
    (counted from its start) whose block d before them holds the document's keys."""
    return (-(-(end - start) // block_size) - diagonals).clamp_min(0)


@dataclass
class Mass(Budget):
    """Columns and block diagonals by estimated mass per block of work, up to `mass_target` of each head's
    attention and beyond it by `mass_threshold`, at most `vertical_cap` columns."""

    mode = "mass"
    COMMON_FLAGS: ClassVar[tuple[str, ...]] = ("mass_target",)
    scoring = {"last_q": 32, "sample_groups": 4}  # (measured with: docs/accuracy.md)
    weighted = True

    mass_target: float = field(
        default=0.9,
        metadata={"help": "The share of each head's estimated attention mass (per document, or per chunk with "
                  "causal_chunks) that its best columns and block diagonals must reach, in (0, 1]: a floor that "
                  "gives broad heads the blocks they need (mass in both a kept column and a kept diagonal counts "
                  "twice, so the mass kept is somewhat lower)."},
    )
    mass_threshold: float = field(
        default=0.0025,
        metadata={"help": "Beyond mass_target, also keep every column or block diagonal whose estimated mass per "
                  "block of work is at least this share of the attention of the block's queries, in [0, 1): one "
                  "price of work for every head and layer, so that budget goes where a block buys the most mass; "
                  "0 keeps mass_target alone. 0.01 is a block holding one hundredth of its queries' attention."},
    )
    mass_near_blocks: int = field(
        default=0,
        metadata={"help": "n > 0 leaves each query block's n nearest block diagonals (its own and n - 1 before it) "
                  "to serve the keys near it, so that no mass counts twice: a key column is valued by the "
                  "attention of the queries n or more blocks after its own and by that work alone, and the block "
                  "diagonals from n on lose the estimated mass of the kept columns that cross them. 0: every "
                  "column and diagonal valued by all its mass. On CUDA it scores in PyTorch, not the Triton "
                  "scoring kernel."},
    )
    vertical_cap: int = field(default=1024, metadata={"help": "Most key columns a head keeps."})

    def __post_init__(self) -> None:
        super().__post_init__()
        if not 0.0 < self.mass_target <= 1.0:
            raise ValueError(f"mass_target={self.mass_target} must be in (0, 1]; 0.9 or 0.95 are usual.")
        if not 0.0 <= self.mass_threshold < 1.0:
            raise ValueError(f"mass_threshold={self.mass_threshold} must be in [0, 1): 0 turns it off, 0.001-0.01 "
                             "are usual.")
        if self.mass_near_blocks < 0:
            raise ValueError(f"mass_near_blocks={self.mass_near_blocks} must be >= 0.")
        if self.vertical_cap < 1:
            raise ValueError(f"vertical_cap={self.vertical_cap} must be >= 1.")

    @property
    def far_blocks(self) -> int:
        return self.mass_near_blocks

    def diagonal_step(self, block_size: int) -> int:
        return block_size

    def diagonal_sums(self, slash: torch.Tensor, block_size: int) -> torch.Tensor:
        return block_diagonal_sums(slash, block_size)

    def most_kept(self, kind: Kind) -> int | None:
        return self.vertical_cap if kind == "columns" else None

    def column_key(self, start: int, scored_end: int, block_size: int):
        return lambda gain, positions: column_ratio(gain, positions, start, scored_end, block_size,
                                                    self.mass_near_blocks)

    def select(self, columns: Entries, diagonals: Entries, start: int, end: int, scored_end: int,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Columns and block diagonals d >= 1 ranked together by estimated mass per block of work they add to
        the queries [start, scored_end) that scored them (exact ties: columns by position, then diagonals by
        d); each head keeps the best until the mass of the main diagonal and of what it keeps reaches
        `mass_target` of those queries' attention (one unit per query), and beyond it every one whose mass
        per block is at least `mass_threshold` of the block's queries' attention. At most `vertical_cap`
        columns (the best by that ratio) compete. `diagonals`: each of the segment's block diagonal 0 and
        those with mass (`diagonal_scores`), in any order; block diagonal 0 is always kept."""
        (h, n), m = columns.scores.shape, diagonals.scores.shape[-1]
        col_pos, diag = columns.ids.expand(h, n), diagonals.ids.expand(h, m)
        keep_c = torch.zeros_like(columns.scores, dtype=torch.bool)
        keep_d = torch.zeros_like(diagonals.scores, dtype=torch.bool)
        for heads in head_chunks(h, n + m, SELECT_ELEMENTS):
            keep_c[heads], keep_d[heads] = self._select(columns.scores[heads], col_pos[heads],
                                                        diagonals.scores[heads], diag[heads], start, end, scored_end,
                                                        block_size)
        return keep_c, keep_d

    def _select(self, col_gain, col_pos, diag_gain, diag, start, end, scored_end, bs):
        """`select` on one tile of heads (positions and diagonals [h, n] / [h, m])."""
        near = self.mass_near_blocks
        c_ratio = column_ratio(col_gain, col_pos, start, scored_end, bs, near)
        n = col_gain.shape[-1]
        c_order = rank_order(c_ratio, col_pos)
        eligible = torch.zeros_like(c_ratio, dtype=torch.bool).scatter_(
            -1, c_order, (torch.arange(n, device=col_gain.device) < self.vertical_cap).expand_as(c_order))
        c_ratio, col_gain = torch.where(eligible, c_ratio, 0), torch.where(eligible, col_gain, 0)
        keep_c, keep_d = self._take(c_ratio, col_gain, col_pos, diag_gain, diag, start, end, scored_end, bs)
        if near:  # the far diagonals without the mass of the kept columns they cross, then the choice again
            crossed = _crossed_mass(col_gain, col_pos, keep_c, diag, start, scored_end, bs, near)
            far_gain = torch.where(diag >= near, diag_gain - crossed, diag_gain).clamp_min(0)
            keep_c, keep_d = self._take(c_ratio, col_gain, col_pos, far_gain, diag, start, end, scored_end, bs)
        return keep_c, keep_d

    def _take(self, c_ratio, col_gain, col_pos, diag_gain, diag, start, end, scored_end, bs):
        """The columns (eligible ones with their ratios, others 0) and block diagonals kept from these gains:
        ranked together by mass per block of work, taken up to mass_target and by mass_threshold."""
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
        priced = (r >= self.mass_threshold * bs) if self.mass_threshold > 0 else torch.zeros_like(r, dtype=torch.bool)
        take = ((before < self.mass_target * (scored_end - start)) | priced) & (r > 0)
        keep = torch.zeros_like(take).scatter_(-1, order, take)
        return keep[:, :n], keep[:, n:] | (diag == 0)

    def describe(self) -> str:
        return ("mass: key columns and block diagonals by estimated mass per block of work until "
                f"{self.mass_target} of each head's attention"
                + (f", and those with at least {self.mass_threshold} of their queries' attention per block"
                   if self.mass_threshold else "")
                + (f", columns valued by the queries {self.mass_near_blocks} or more blocks after them and far "
                   "diagonals without the kept columns' mass" if self.mass_near_blocks else "")
                + f" (at most {self.vertical_cap} columns)")


def _crossed_mass(col_gain, col_pos, kept, diag, start, scored_end, bs, far_blocks):
    """[h, m]: the estimated mass of the kept columns inside each block diagonal's blocks: a column's far mass
    spread evenly over the far query blocks it is listed in (the estimate's own assumption), summed over the
    kept columns whose key block lies d or more blocks before the last query block; in position order, so
    that every rank, holding the same kept columns in another order, sums alike."""
    nkb = max(-(-(scored_end - start) // bs), 0)
    order = torch.argsort(col_pos, dim=-1, stable=True)
    pos = col_pos.gather(-1, order)
    listed = column_cost(pos, start, scored_end, bs, far_blocks) * bs
    per_block = torch.where(kept.gather(-1, order) & (listed > 0), col_gain.gather(-1, order).double()
                            / listed.clamp_min(1), 0)
    kb = _document_blocks(pos, start, bs).clamp(0, nkb)
    by_block = torch.zeros(*per_block.shape[:-1], nkb + 1, dtype=torch.float64, device=col_gain.device)
    by_block.scatter_add_(-1, kb, per_block)
    before = torch.nn.functional.pad(by_block.cumsum(-1), (1, 0))  # before[x]: key blocks < x
    return before.gather(-1, (nkb - diag).clamp(0, nkb + 1)).to(col_gain.dtype)
