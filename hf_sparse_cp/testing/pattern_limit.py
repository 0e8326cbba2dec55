"""The best pattern of a family, chosen from a layer's exact attention probabilities: the limit of any
estimator of that family, and the attention mass any layout keeps.

`query_block_mass` sums a layer's exact causal softmax probabilities over the queries of each query
block: M[h, qb, k], the mass key k receives from query block qb ([H, NQB, S], never [S, S]). The
share of the dense mass a layout keeps (`layout_mass`) and the best patterns come from it:

* block pattern: any key blocks, greedily by mass (each block costs 1);
* vertical-slash pattern: key columns at token granularity (a kept column serves every later query)
  and block diagonals (a kept diagonal d lists key block qb - d for every query block qb), greedily
  by true mass per unit of block cost. A column's cost is 1/block_size per query block that lists it;
  a column inside a kept diagonal's block is not listed, so each choice changes the gain and cost of
  the items it overlaps, and the greedy keeps both up to date.

Both keep the main block diagonal first (every query sees its own key). Each head's greedy order is a
`Trajectory`: its items with the cumulative cost (block units, the layout's `num_computed_blocks`) and
kept mass. A kept fraction becomes a pattern in two ways: `per_head_steps` (the same budget for every
head) and `allocate` (one budget split across heads and layers by marginal mass per block cost: the
upper concave hull of every head's trajectory, segments taken by slope, which maximizes the total kept
mass that the trajectories can reach). The mass kept is the sum of the kept probabilities over all
queries, so the mean mass recall over (head, query) pairs is mass / (heads x S).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..attention.build import build_layout
from ..attention.layout import SparseLayout, compact_sorted
from ..attention.tokens import TokenMeta

FAMILIES = ("block", "vertical_slash")


@torch.no_grad()
def query_block_mass(q: torch.Tensor, k: torch.Tensor, scale: float, block_size: int, rows: int = 512) -> torch.Tensor:
    """Exact causal attention mass per (query block, key), in fp32.

    Args:
        q: [1, Hq, S, D]; k: [1, Hkv, S, D] (after RoPE), S a multiple of block_size; scale: softmax scale.
        rows: query rows per probability tile ([rows, S] fp32 at a time), a multiple of block_size.

    Returns:
        M [Hq, S / block_size, S]: M[h, qb, k] = sum over the queries of block qb of head h's probability of key k.
    """
    _, hq, s, _ = q.shape
    if s % block_size or rows % block_size:
        raise ValueError(f"S={s} and rows={rows} must be multiples of block_size={block_size}.")
    group = hq // k.shape[1]
    out = torch.zeros(hq, s // block_size, s)
    for h in range(hq):
        kh = k[0, h // group].float()
        for r0 in range(0, s, rows):
            r1 = min(s, r0 + rows)
            sc = (q[0, h, r0:r1].float() @ kh[:r1].T) * scale
            sc.masked_fill_(torch.arange(r1) > torch.arange(r0, r1).unsqueeze(1), float("-inf"))
            out[h, r0 // block_size : r1 // block_size, :r1] = torch.softmax(sc, -1).view(-1, block_size, r1).sum(1)
    return out


def block_mass(mass: torch.Tensor, block_size: int) -> torch.Tensor:
    """[H, NQB, NKB] mass per (query block, key block) from M [H, NQB, S]."""
    h, nqb, s = mass.shape
    return mass.view(h, nqb, s // block_size, block_size).sum(-1)


@torch.no_grad()
def layout_mass(layout: SparseLayout, mass: torch.Tensor) -> torch.Tensor:
    """float64 [Hq]: the exact attention mass each head's listed keys hold, from M [Hq, NQB, S] of the
    same block size (`query_block_mass`) and a one-row layout over the same S."""
    bs = layout.block_size
    hq = mass.shape[0]
    lh = layout.head_index(hq)
    blk, col = layout.block_idx[0, lh].long(), layout.col_idx[0, lh].long()
    blocks = block_mass(mass, bs).double()
    kept = (blocks.gather(-1, blk.clamp_min(0)) * layout.valid_blocks()[0, lh]).sum((1, 2))
    return kept + (mass.double().gather(-1, col.clamp_min(0)) * layout.valid_cols()[0, lh]).sum((1, 2))


@dataclass
class Trajectory:
    """The greedy order of one layer's heads.

    items: int64 [H, N], the chosen items in order (block pattern: qb * NKB + kb; vertical-slash: a key
    column j < S, or S + d for block diagonal d), -1 past `steps`; cost, mass: float64 [H, N + 1], the
    cumulative block cost and kept mass after each step (entry 0: the main diagonal alone, repeated past
    `steps`); steps: int64 [H], the items each head has.
    """

    family: str
    seq_len: int
    block_size: int
    items: torch.Tensor
    cost: torch.Tensor
    mass: torch.Tensor
    steps: torch.Tensor

    @property
    def heads(self) -> int:
        return self.items.shape[0]

    def at(self, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cost, mass) [H] of each head after its first `steps` [H] items."""
        idx = steps.unsqueeze(1)
        return self.cost.gather(1, idx).squeeze(1), self.mass.gather(1, idx).squeeze(1)

    def split(self, heads: list[int]) -> list[Trajectory]:
        """The trajectories of consecutive groups of `heads` heads (e.g. the layers of a joint greedy), each
        as long as its longest head."""
        out, first = [], 0
        for n in heads:
            rows = slice(first, first + n)
            width = int(self.steps[rows].max()) if n else 0
            out.append(Trajectory(self.family, self.seq_len, self.block_size, self.items[rows, :width],
                                  self.cost[rows, : width + 1], self.mass[rows, : width + 1], self.steps[rows]))
            first += n
        return out

    def layout(self, steps: torch.Tensor) -> SparseLayout:
        """The one-row layout [1, H, NQB, ...] of each head's first `steps` [H] items."""
        bs, s = self.block_size, self.seq_len
        nqb = s // bs
        chosen = torch.arange(self.items.shape[1]).unsqueeze(0) < steps.unsqueeze(1)
        items = torch.where(chosen, self.items, -1)
        if self.family == "block":
            keep = torch.zeros(self.heads, nqb * nqb + 1, dtype=torch.bool)
            keep.scatter_(1, torch.where(chosen, items, nqb * nqb), True)
            keep = keep[:, :-1].view(self.heads, nqb, nqb) | torch.eye(nqb, dtype=torch.bool)
            idx, cnt = compact_sorted(torch.arange(nqb).expand_as(keep), keep)
            return SparseLayout.from_blocks(idx.unsqueeze(0), cnt.unsqueeze(0), bs)
        cols = torch.zeros(self.heads, s + nqb + 1, dtype=torch.bool)
        cols.scatter_(1, torch.where(chosen, items, s + nqb), True)
        diagonals = cols[:, s : s + nqb].clone()
        diagonals[:, 0] = True
        return build_layout(TokenMeta.contiguous(1, s), bs, diagonals=diagonals.unsqueeze(0),
                            verticals=cols[:, :s].unsqueeze(0))


def _trajectory(family, s, bs, picks, gains, costs, cost0, mass0) -> Trajectory:
    """Pack per-step picks / gains / costs [steps, H] (pick -1: the head had stopped) into a Trajectory."""
    h = cost0.shape[0]
    if picks:
        items, gain, cost = torch.stack(picks, 1), torch.stack(gains, 1), torch.stack(costs, 1)
    else:
        items, gain, cost = (torch.zeros(h, 0, dtype=torch.long), torch.zeros(h, 0, dtype=torch.float64),
                             torch.zeros(h, 0, dtype=torch.float64))
    valid = items >= 0
    cum_cost = torch.cat([cost0.unsqueeze(1), cost0.unsqueeze(1) + (cost * valid).cumsum(1)], 1)
    cum_mass = torch.cat([mass0.unsqueeze(1), mass0.unsqueeze(1) + (gain * valid).cumsum(1)], 1)
    return Trajectory(family, s, bs, items, cum_cost, cum_mass, valid.sum(1))


@torch.no_grad()
def block_trajectory(mass: torch.Tensor, block_size: int, max_fraction: float = 0.9) -> Trajectory:
    """Best block pattern of every head: the main diagonal, then blocks by mass (ties: lowest index first),
    up to `max_fraction` of the causal blocks. mass: M [H, NQB, S] (`query_block_mass`)."""
    blocks = block_mass(mass, block_size).double()
    h, nqb, _ = blocks.shape
    below = torch.ones(nqb, nqb, dtype=torch.bool).tril(-1).flatten()
    flat = torch.where(below, blocks.flatten(1), -1.0)
    n = min(int(below.sum()), int(max_fraction * nqb * (nqb + 1) / 2) - nqb)
    vals, order = torch.sort(flat, dim=1, descending=True, stable=True)
    vals, order = vals[:, : max(n, 0)], order[:, : max(n, 0)]
    cost0 = torch.full((h,), float(nqb), dtype=torch.float64)
    mass0 = blocks.diagonal(dim1=1, dim2=2).sum(1)
    return _trajectory("block", mass.shape[-1], block_size, list(order.T), list(vals.T),
                       [torch.ones(h, dtype=torch.float64)] * vals.shape[1], cost0, mass0)


@torch.no_grad()
def vertical_slash_trajectory(mass: torch.Tensor, block_size: int, max_fraction: float = 0.9) -> Trajectory:
    """Best vertical-slash pattern of every head: block diagonal 0, then one item per head and step, the
    column or block diagonal with the most mass not yet kept per unit of block cost it adds (ties: the
    lowest item), up to `max_fraction` of the causal blocks. mass: M [H, NQB, S] (`query_block_mass`)."""
    m = mass.double()
    h, nqb, s = m.shape
    bs = block_size
    budget = max_fraction * nqb * (nqb + 1) / 2
    heads, qbs = torch.arange(h), torch.arange(nqb)
    kb = torch.arange(s) // bs
    blocks = block_mass(mass, bs).double()
    own = m.gather(1, kb.view(1, 1, s).expand(h, 1, s)).squeeze(1)
    gain_c = m.sum(1) - own  # columns: mass outside their own (always kept) block
    cost_c = ((nqb - 1 - kb) / bs).double().expand(h, s).clone()
    diag_idx = (qbs.view(1, nqb) - qbs.view(nqb, 1)).clamp_min(0)  # [d, qb] -> key block qb - d
    on_diag = qbs.view(1, nqb) >= qbs.view(nqb, 1)
    gain_d = (blocks.gather(2, diag_idx.T.unsqueeze(0).expand(h, nqb, nqb)).transpose(1, 2) * on_diag).sum(2)
    cost_d = (nqb - qbs).double().expand(h, nqb).clone()
    kept_c = torch.zeros(h, s, dtype=torch.bool)
    kept_d = torch.zeros(h, nqb, dtype=torch.bool)
    kept_d[:, 0] = True
    cost0 = torch.full((h,), float(nqb), dtype=torch.float64)
    mass0 = blocks.diagonal(dim1=1, dim2=2).sum(1)
    spent = cost0.clone()
    picks, gains, costs = [], [], []
    active = torch.ones(h, dtype=torch.bool)

    def ratio(gain, cost, kept):
        return torch.where(kept | (cost <= 1e-9), -1.0, gain / cost.clamp_min(1e-9))

    ratio_c = ratio(gain_c, cost_c, kept_c)
    while True:
        rc, jc = ratio_c.max(1)
        rd, jd = ratio(gain_d, cost_d, kept_d).max(1)
        is_diag = rd > rc  # a tie goes to the column (the lower item)
        pick = torch.where(is_diag, s + jd, jc)
        g = torch.where(is_diag, gain_d[heads, jd], gain_c[heads, jc])
        c = torch.where(is_diag, cost_d[heads, jd], cost_c[heads, jc])
        active &= (torch.maximum(rc, rd) > 0) & (spent + c <= budget)
        if not bool(active.any()):
            break
        picks.append(torch.where(active, pick, -1))
        gains.append(torch.where(active, g, 0.0))
        costs.append(torch.where(active, c, 0.0))
        spent += torch.where(active, c, 0.0)
        is_col, is_diag = active & ~is_diag, active & is_diag
        if bool(is_col.any()):  # the diagonals crossing the column's key block lose its mass and cost
            kept_c[heads[is_col], jc[is_col]] = True
            ratio_c[heads[is_col], jc[is_col]] = -1.0
            col = m[heads, :, jc]  # [H, NQB]
            at = kb[jc].unsqueeze(1) + qbs.unsqueeze(0)  # query block of diagonal d in the column's key block
            hit = (at < nqb) & (qbs > 0).unsqueeze(0) & is_col.unsqueeze(1)
            gain_d -= torch.where(hit, col.gather(1, at.clamp_max(nqb - 1)), 0.0)
            cost_d -= hit.double() / bs
        if bool(is_diag.any()):  # the columns in the diagonal's blocks are covered there
            kept_d[heads[is_diag], jd[is_diag]] = True
            at = kb.unsqueeze(0) + jd.unsqueeze(1)  # [H, S]: the query block where the diagonal meets column j
            hit = (at < nqb) & is_diag.unsqueeze(1)
            gain_c -= torch.where(hit, m.gather(1, at.clamp_max(nqb - 1).unsqueeze(1)).squeeze(1), 0.0)
            cost_c -= hit.double() / bs
            ratio_c = ratio(gain_c, cost_c, kept_c)
    return _trajectory("vertical_slash", s, bs, picks, gains, costs, cost0, mass0)


def trajectories(family: str, masses: list[torch.Tensor], block_size: int, max_fraction: float = 0.9,
                 layers_per_loop: int = 0) -> list[Trajectory]:
    """Every layer's trajectory of `family` from its M [H, NQB, S]: the heads of `layers_per_loop` layers
    (0: all) in one greedy (each head's steps are its own, so a joint loop gives each layer's trajectory in
    a fraction of the Python steps of one loop per layer; the vertical-slash greedy is a loop over items,
    its memory grows with the heads of a loop)."""
    if family not in FAMILIES:
        raise ValueError(f"family {family!r} is unknown; use one of {FAMILIES}.")
    build = block_trajectory if family == "block" else vertical_slash_trajectory
    step = layers_per_loop or len(masses)
    out: list[Trajectory] = []
    for first in range(0, len(masses), step):
        group = masses[first : first + step]
        out += build(torch.cat(group), block_size, max_fraction).split([m.shape[0] for m in group])
    return out


def per_head_steps(traj: Trajectory, fraction: float) -> torch.Tensor:
    """int64 [H]: the most steps of each head within `fraction` of its causal blocks (at least none)."""
    nqb = traj.seq_len // traj.block_size
    within = traj.cost <= fraction * nqb * (nqb + 1) / 2 + 1e-9
    within[:, 1:] &= torch.arange(1, within.shape[1]).unsqueeze(0) <= traj.steps.unsqueeze(1)
    return (within.long().cumprod(1).sum(1) - 1).clamp_min(0)


def _upper_hull(cost: list[float], mass: list[float]) -> list[int]:
    """Indices of the points on the upper concave hull of a curve with increasing cost, from its start."""
    hull: list[int] = []
    for i in range(len(cost)):
        while len(hull) >= 2:
            a, b = hull[-2], hull[-1]
            if (mass[b] - mass[a]) * (cost[i] - cost[a]) <= (mass[i] - mass[a]) * (cost[b] - cost[a]):
                hull.pop()
            else:
                break
        hull.append(i)
    return hull


def allocate(trajs: list[Trajectory], fraction: float) -> list[torch.Tensor]:
    """Steps per head ([H] per trajectory) of one budget, `fraction` of all heads' causal blocks together,
    split by marginal mass per block cost: hull segments of every head's trajectory taken by slope (ties:
    the earlier trajectory and head), until the next one does not fit."""
    total = 0.0
    spent = 0.0
    segments = []
    for t, traj in enumerate(trajs):
        nqb = traj.seq_len // traj.block_size
        total += traj.heads * nqb * (nqb + 1) / 2
        spent += float(traj.cost[:, 0].sum())
        for h in range(traj.heads):
            n = int(traj.steps[h]) + 1
            cost, mass = traj.cost[h, :n].tolist(), traj.mass[h, :n].tolist()
            hull = _upper_hull(cost, mass)
            for a, b in zip(hull, hull[1:]):
                segments.append(((mass[b] - mass[a]) / (cost[b] - cost[a]), t, h, b, cost[b] - cost[a]))
    segments.sort(key=lambda x: (-x[0], x[1], x[2], x[3]))
    steps = [torch.zeros(traj.heads, dtype=torch.long) for traj in trajs]
    for _, t, h, b, c in segments:
        if spent + c > fraction * total + 1e-9:
            break
        spent += c
        steps[t][h] = b
    return steps


ALLOCATIONS = ("per_head", "allocated")


def limit_steps(trajs: list[Trajectory], fraction: float, allocation: str) -> list[torch.Tensor]:
    """Steps per head of every layer's trajectory for one kept fraction: the same budget for every head
    ('per_head') or one budget across heads and layers ('allocated')."""
    if allocation == "per_head":
        return [per_head_steps(t, fraction) for t in trajs]
    if allocation == "allocated":
        return allocate(trajs, fraction)
    raise ValueError(f"allocation {allocation!r} is unknown; use one of {ALLOCATIONS}.")


def layer_figures(kept_blocks: list[torch.Tensor], kept_mass: list[torch.Tensor], seq_len: int,
                  block_size: int, layers: list[int] | None = None) -> dict:
    """Model-wide figures from per-layer, per-head kept blocks and kept mass ([H] each) of the measured layers
    (`layers`: their indices in the model, default 0, 1, ...): the kept fraction and mean mass recall of every
    layer and their means over the layers (equal weights: every layer has the same heads and causal blocks),
    and the worst layer (its index in the model) and its recall."""
    nqb = seq_len // block_size
    causal = nqb * (nqb + 1) / 2
    layers = list(range(len(kept_blocks))) if layers is None else list(layers)
    kept = [float(b.double().mean()) / causal for b in kept_blocks]
    recall = [float(m.double().mean()) / seq_len for m in kept_mass]
    worst = min(range(len(recall)), key=recall.__getitem__)
    return {"kept_fraction": sum(kept) / len(kept), "recall_mean": sum(recall) / len(recall),
            "recall_worst_layer": recall[worst], "worst_layer": layers[worst], "layers": layers,
            "layer_kept_fraction": kept, "layer_recall": recall}
