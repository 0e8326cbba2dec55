"""The ranked budgets: each head keeps its best key columns and its best diagonals (token offsets), each
kind on its own: a fixed number ('topk', MTraining's) or the fewest whose scores reach a share of the row's
score mass ('topp', capped)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from ..chunks import head_chunks
from .base import SELECT_ELEMENTS, Budget, Entries, Kind, rank_order


def keep_best(entries: Entries, count: int, share: float | None = None) -> torch.Tensor:
    """Boolean [h, n]: each row's entries from the best (exact ties to the lower position), the first
    `count`, and with `share` only while the mass before an entry is below that share of the row's mass
    (`entries.total`, default the sum of the scores); positive scores only. A row of candidates that holds
    every entry such a selection keeps (and for `share` every better one) selects the same."""
    scores, positions = entries.scores, entries.ids
    keep = torch.zeros_like(scores, dtype=torch.bool)
    for heads in head_chunks(scores.shape[0], scores.shape[-1], SELECT_ELEMENTS):
        sc = scores[heads]
        order = rank_order(sc, None if positions.dim() == 1 else positions[heads])  # (a whole row: in order)
        vals = sc.gather(-1, order)
        take = (torch.arange(sc.shape[-1], device=sc.device) < count) & (vals > 0)
        if share is not None:
            whole = vals.sum(-1, keepdim=True) if entries.total is None else entries.total[heads]
            before = (torch.cumsum(vals, -1) - vals) / whole.clamp_min(torch.finfo(vals.dtype).tiny)
            take &= before < share
        keep[heads] = keep[heads].scatter_(-1, order, take)
    return keep


def _check(budget, counts: tuple[str, ...], shares: tuple[str, ...] = ()) -> None:
    for name in counts:
        if getattr(budget, name) < 0:
            raise ValueError(f"{name}={getattr(budget, name)} must be >= 0.")
    for name in shares:
        if not 0.0 < getattr(budget, name) <= 1.0:
            raise ValueError(f"{name}={getattr(budget, name)} must be in (0, 1]; 0.9 or 0.95 are usual.")


@dataclass
class TopK(Budget):
    """A fixed number of key columns and of diagonals per head (MTraining's budget)."""

    mode = "topk"
    COMMON_FLAGS: ClassVar[tuple[str, ...]] = ("vertical_topk", "slash_topk")

    vertical_topk: int = field(
        default=512, metadata={"help": "Key columns kept per head (sink tokens come on top)."})
    slash_topk: int = field(
        default=1024, metadata={"help": "Diagonals kept per head (the local window comes on top)."})

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self, ("vertical_topk", "slash_topk"))

    def most_kept(self, kind: Kind) -> int:
        return self.vertical_topk if kind == "columns" else self.slash_topk

    def select(self, columns, diagonals, start, end, scored_end, block_size):
        return keep_best(columns, self.vertical_topk), keep_best(diagonals, self.slash_topk)

    def describe(self) -> str:
        return f"top-k: {self.vertical_topk} key columns and {self.slash_topk} diagonals per head"


@dataclass
class TopP(Budget):
    """The fewest key columns, and diagonals, whose scores reach a share of the head's score mass."""

    mode = "topp"

    vertical_topp: float = field(
        default=0.9, metadata={"help": "Cumulative score mass of key columns kept per head, in (0, 1]."})
    slash_topp: float = field(
        default=0.9, metadata={"help": "Cumulative score mass of diagonals kept per head, in (0, 1]."})
    vertical_cap: int = field(default=1024, metadata={"help": "Most key columns a head keeps."})
    slash_cap: int = field(default=4096, metadata={"help": "Most diagonals a head keeps."})

    def __post_init__(self) -> None:
        super().__post_init__()
        _check(self, (), ("vertical_topp", "slash_topp"))
        for name in ("vertical_cap", "slash_cap"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 1.")

    def most_kept(self, kind: Kind) -> int:
        return self.vertical_cap if kind == "columns" else self.slash_cap

    def select(self, columns, diagonals, start, end, scored_end, block_size):
        return (keep_best(columns, self.vertical_cap, self.vertical_topp),
                keep_best(diagonals, self.slash_cap, self.slash_topp))

    def describe(self) -> str:
        return (f"top-p: {self.vertical_topp} / {self.slash_topp} of the score mass in key columns / diagonals (at "
                f"most {self.vertical_cap} / {self.slash_cap}) per head")
