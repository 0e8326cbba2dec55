"""The interface every budget mode implements, and the ranking the modes share.

A budget decides, per head of one estimation segment (a document, or one of its causal chunks), which
key columns and diagonals to keep, from their estimated attention mass. The estimation pipeline
(`attention/estimate.py`) asks it how it wants the diagonals scored (`diagonal_sums`: per token offset,
or per block diagonal), what a rank offers under context parallelism (`offered`, `column_key`: every
entry the whole row's selection keeps must be among them), and the selection (`select`); the planner,
the memory model and the simulator size rows with `most_kept` / `most_diagonal_blocks`, the model card
says it with `describe`. Exact ties go to the lower position everywhere (`rank_order`), so the union of
the ranks' candidates selects what one process selects.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, Literal, NamedTuple

import torch

from ...config.sections import BudgetSection
from ..chunks import head_chunks

# Elements of one [heads, entries] tile of the selection's temporaries (sorts, cumulative sums).
SELECT_ELEMENTS = 1 << 22

Kind = Literal["columns", "diagonals"]


class Entries(NamedTuple):
    """Scored entries of one kind of one segment: `scores` [h, n] (estimated mass per head), their `ids`
    (key positions; for diagonals, `diagonal_step` x id is the offset in the document): [n] ascending (a
    whole row) or [h, n] in any order (candidates), and `total` [h, 1], the whole row's mass, when `scores`
    hold only candidates (default: their sum)."""

    scores: torch.Tensor
    ids: torch.Tensor
    total: torch.Tensor | None = None


class Budget(BudgetSection, ABC):
    """A budget mode: its fields (a dataclass) and what it decides. `weighted`: its scores estimate the
    mass of every query of a document (each scoring query weighted by the queries it stands for, see
    `scoring.Stratum`) rather than summing the scoring queries' mass. A mode implements `most_kept`, `select`
    and `describe` (abstract: a mode without one is refused when registered or built, naming it)."""

    weighted: ClassVar[bool] = False

    @property
    def far_blocks(self) -> int:
        """Blocks after its own from which a key column's mass counts (0: every scoring query's)."""
        return 0

    def diagonal_step(self, block_size: int) -> int:
        """Tokens between two diagonals it ranks: 1 (every offset q - k) or block_size (block diagonals)."""
        return 1

    def diagonal_sums(self, slash: torch.Tensor, block_size: int) -> torch.Tensor:
        """`diagonal_step` times the scores of the diagonals it ranks ([h, m]) from slashes [h, L] of offsets
        0..L-1 of one segment: integer weights, so that fixed-point slashes (int64, `exact.FixedPoint`) give
        exact fixed-point sums; linear, so partial sums of slashes give partial sums of these."""
        return slash

    def diagonal_scores(self, slash: torch.Tensor, block_size: int) -> torch.Tensor:
        """The scores of the diagonals it ranks ([h, m]) from floating-point slash scores [h, L] of offsets
        0..L-1 of one segment (`diagonal_sums` over `diagonal_step`)."""
        step = self.diagonal_step(block_size)
        sums = self.diagonal_sums(slash, block_size)
        return sums if step == 1 else sums / step

    @abstractmethod
    def most_kept(self, kind: Kind) -> int | None:
        """Most entries of `kind` a head keeps in a segment, anchors aside (None: any number). Under context
        parallelism each rank offers at most this many of its entries (`offered`): a `select` that keeps more
        would select from fewer candidates than one process does."""

    def most_diagonal_blocks(self, block_size: int) -> int | None:
        """Most block diagonals a head's kept diagonals cross in a query block row (None: any number): a
        kept token offset crosses two, a kept block diagonal one."""
        most = self.most_kept("diagonals")
        return None if most is None else most * (2 if self.diagonal_step(block_size) == 1 else 1)

    def offered(self, kind: Kind, held: torch.Tensor) -> torch.Tensor:
        """How many of the `held` entries of `kind` a rank offers (each rank's best): enough that every
        entry the whole row's selection keeps is offered by its holder."""
        most = self.most_kept(kind)
        return held if most is None else torch.clamp_max(held, most)

    def column_key(self, start: int, scored_end: int, block_size: int) -> Callable | None:
        """What the offered columns are the best by (a tile of scores, their positions -> a rank key),
        None: their scores."""
        return None

    @abstractmethod
    def select(self, columns: Entries, diagonals: Entries, start: int, end: int, scored_end: int,
               block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(bool [h, n] kept columns, bool [h, m] kept diagonals) of the segment whose queries [start, end)
        take the pattern that the queries before `scored_end` scored over its keys from `start`."""

    @abstractmethod
    def describe(self) -> str:
        """One line for the model card."""


def rank_order(scores: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """int64 [h, n]: each row's entries from the best score to the worst, exact ties broken by position
    (the lower first). positions: [n] or [h, n], the entries' positions when they are not in position
    order (a union of candidates); None: the entries' indices are their positions."""
    if positions is None:
        return torch.sort(scores, dim=-1, descending=True, stable=True).indices
    by_pos = positions.argsort(dim=-1, stable=True).expand(scores.shape)
    return by_pos.gather(-1, torch.sort(scores.gather(-1, by_pos), dim=-1, descending=True, stable=True).indices)


def top_entries(scores: torch.Tensor, m: int, key: Callable | None = None) -> torch.Tensor:
    """int64 [h, min(m, n)]: the indices of each row's best m entries of scores [h, n], best first, exact
    ties to the lower index (`rank_order` by head tiles); `key` (a tile of scores -> what to rank it by,
    computed tile by tile) ranks them by something else."""
    out = torch.empty(scores.shape[0], min(m, scores.shape[-1]), dtype=torch.long, device=scores.device)
    for heads in head_chunks(scores.shape[0], scores.shape[-1], SELECT_ELEMENTS):
        out[heads] = rank_order(scores[heads] if key is None else key(scores[heads]))[:, : out.shape[1]]
    return out
