"""What each budget mode keeps of one segment, computed densely in fp64 with plain loops from the modes'
definitions (no tiles, no candidates, no tensors): the oracle the tests hold the budgets against, on
random scores and ties.

`naive_select(budget, vertical, slash, start, end, scored_end, block_size)` takes a segment's whole rows:
vertical [h, n] (the key columns start .. start + n - 1) and slash [h, L] (its offsets 0 .. L - 1), and
returns (kept columns [h][n], kept offsets [h][L]) as lists of booleans; in 'mass' mode a kept block
diagonal d is the offset d x block_size.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _ranked(values: Sequence[float], count: int, share: float | None = None) -> list[bool]:
    """The first `count` entries by value (ties: the lower index), positive ones, and with `share` only while
    the values before an entry sum to less than that share of all values."""
    total, before, keep = sum(values), 0.0, [False] * len(values)
    for rank, i in enumerate(sorted(range(len(values)), key=lambda i: (-values[i], i))):
        keep[i] = rank < count and values[i] > 0 and (share is None or before < share * total)
        before += values[i]
    return keep


def _topk(budget, vertical, slash, start, end, scored_end, bs):
    return ([_ranked(row, budget.vertical_topk) for row in vertical],
            [_ranked(row, budget.slash_topk) for row in slash])


def _topp(budget, vertical, slash, start, end, scored_end, bs):
    return ([_ranked(row, budget.vertical_cap, budget.vertical_topp) for row in vertical],
            [_ranked(row, budget.slash_cap, budget.slash_topp) for row in slash])


def _mass_head(budget, column_gain, offsets, start, end, scored_end, bs):
    """One head of 'mass' mode: (kept columns, kept offsets)."""
    # blocks counted from the document's start
    near, end_qb = budget.mass_near_blocks, -(-(scored_end - start) // bs)
    n, length = len(column_gain), len(offsets)
    blocks = [max(0, end_qb - (j // bs + max(1, near))) for j in range(n)]  # far query blocks
    ratio = [column_gain[j] / (blocks[j] / bs) if blocks[j] else 0.0 for j in range(n)]
    competing = set(sorted(range(n), key=lambda j: (-ratio[j], j))[: budget.vertical_cap])
    ratio = [ratio[j] if j in competing else 0.0 for j in range(n)]
    gain = [column_gain[j] if j in competing else 0.0 for j in range(n)]
    diagonals = -(-length // bs) + 1
    mass = [sum(offsets[o] * max(0, bs - abs(o - d * bs)) / bs for o in range(length)) for d in range(diagonals)]

    def take(diag_gain):
        cost = [max(0, end_qb - d) for d in range(diagonals)]
        ok = [1 <= d <= (end - start - 1) // bs and cost[d] > 0 for d in range(diagonals)]
        items = [(ratio[j], gain[j], j, ("column", j)) for j in range(n)]
        items += [(diag_gain[d] / cost[d] if ok[d] else 0.0, diag_gain[d] if ok[d] else 0.0, end - start + d,
                   ("diagonal", d)) for d in range(diagonals)]
        before, kept = diag_gain[0], {("diagonal", 0)}
        for r, g, _, what in sorted(items, key=lambda item: (-item[0], item[2])):
            priced = budget.mass_threshold > 0 and r >= budget.mass_threshold * bs
            if r > 0 and (before < budget.mass_target * (scored_end - start) or priced):
                kept.add(what)
            before += g
        return kept

    kept = take(mass)
    if near:
        crossed = [sum(gain[j] / blocks[j] for j in range(n)
                       if ("column", j) in kept and blocks[j] and j // bs < end_qb - d)
                   for d in range(diagonals)]
        kept = take([max(0.0, mass[d] - crossed[d]) if d >= near else mass[d] for d in range(diagonals)])
    columns = [("column", j) in kept for j in range(n)]
    return columns, [o % bs == 0 and ("diagonal", o // bs) in kept for o in range(length)]


def _mass(budget, vertical, slash, start, end, scored_end, bs):
    heads = [_mass_head(budget, v, s, start, end, scored_end, bs) for v, s in zip(vertical, slash)]
    return [c for c, _ in heads], [o for _, o in heads]


NAIVE = {"topk": _topk, "topp": _topp, "mass": _mass}


def naive_select(budget, vertical: torch.Tensor, slash: torch.Tensor, start: int, end: int, scored_end: int,
                 block_size: int) -> tuple[list[list[bool]], list[list[bool]]]:
    """(kept columns [h][n], kept offsets [h][L]) of one segment by `budget` (see the module docstring)."""
    return NAIVE[budget.mode](budget, vertical.double().tolist(), slash.double().tolist(), start, end, scored_end,
                              block_size)
