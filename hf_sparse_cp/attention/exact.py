"""Exact arithmetic for the pattern estimation's scores, so that one process and every context-parallel
split of a sequence compute bit-identical scores whatever their tiles, shapes and summation orders: exact
ties from equal inputs (repeated tokens, constant keys) stay exact ties everywhere and break by position.

Two pieces. Query-key products (`exact_scores`): each vector is rounded `on_grid`, `grid_bits(D)` bits on
a grid of a power of two of its own, so that every partial sum of a score's products is exactly
representable in fp64 and an fp64 GEMM of them is exact in any order. Sums (`FixedPoint`): each term is
rounded once to a fixed-point int64 and the integers are added, exact in any order, over tiles and ranks
(int64 collectives); a sum is rounded to floating point once, from its integer, where it is read.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

# Magnitude bits of an int64 sum, one spare.
INT64_BITS = 62


def grid_bits(d: int) -> int:
    """Bits kept per entry of D-vectors: d products of two entries, each a multiple of 2^-2b of the vectors'
    scales and at most 1, sum exactly in fp64 (2b + log2(d) <= 53): 23 bits for d = 64, 22 for d = 128 (fp32
    has 24), so that a score is about as precise as an fp32 product's."""
    return (53 - math.ceil(math.log2(max(d, 1)))) // 2


def on_grid(x: torch.Tensor) -> torch.Tensor:
    """fp64 [..., D]: each vector of x [..., D] rounded to `grid_bits(D)` bits below 2^e, e the exponent of its
    largest entry (a grid of its own: a function of the vector alone)."""
    exponent = torch.frexp(x.abs().amax(-1, keepdim=True).double()).exponent
    per_unit = torch.ldexp(torch.ones(exponent.shape, dtype=torch.float64, device=x.device),
                           grid_bits(x.shape[-1]) - exponent)
    return (x.double() * per_unit).round_().div_(per_unit)  # power-of-two scalings: exact


def exact_scores(q: torch.Tensor, k: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """scale x q.k^T ([..., R, L] in `dtype`) of queries [..., R, D] and keys [L, D] `on_grid`: one fp64 GEMM
    whose every partial sum is exact, so each entry is a function of its own two vectors only, whatever the
    shapes, tiles and summation order."""
    return (q @ k.transpose(-1, -2)).mul_(scale).to(dtype)


class FixedPoint(NamedTuple):
    """Fixed-point numbers n x 2^-bits held in int64: sums of them are exact in any order."""

    bits: int

    @classmethod
    def for_sums_below(cls, bound: float) -> FixedPoint:
        """The finest fixed point whose sums stay below `bound` (>= 1) in int64."""
        return cls(INT64_BITS - math.ceil(math.log2(max(bound, 1.0))))

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x (non-negative, finite) rounded to this fixed point, int64 (x times 2^bits is exact in x's dtype, so
        rounding it there is rounding it exactly)."""
        return (x * 2.0**self.bits).round_().long()

    def decode(self, n: torch.Tensor, dtype: torch.dtype = torch.float64, divisor_bits: int = 0) -> torch.Tensor:
        """The value of fixed-point integers n (divided by 2^divisor_bits), rounded once to `dtype`."""
        return (n.double() * 2.0 ** -(self.bits + divisor_bits)).to(dtype)
