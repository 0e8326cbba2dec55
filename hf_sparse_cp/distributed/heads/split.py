"""Which attention heads each rank of a head-parallel group computes (DeepSpeed-Ulysses's split).

Rank r of a group of P takes the contiguous query heads [r Hq / P, (r + 1) Hq / P) (rounded down: as
even as the count allows, so P need not divide Hq, though the busiest rank then sets the pace) and the
key/value heads they read under grouped-query attention (query head j reads key head j // (Hq / Hkv)).
Where P <= Hkv and P divides both, every rank reads its own Hkv / P key heads. Otherwise some key heads
go to several ranks: that replication is what `kv_heads_sent` counts (each copy is a full-sequence K
and V of one head on its rank, `replicated_kv_bytes`). A rank whose query heads read their key heads
unevenly (a run of query heads that starts or ends inside a group) gets one K/V head per query head
(`kv_index`), so the local attention sees ordinary multi-head (or evenly grouped) attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...config.files import flag_setting


@dataclass(frozen=True)
class HeadSplit:
    """Query and key/value heads of `size` ranks: `q_range(r)`, `kv_range(r)`, `kv_index(r)`."""

    q_heads: int
    kv_heads: int
    size: int

    def __post_init__(self) -> None:
        if self.q_heads < 1 or self.kv_heads < 1 or self.q_heads % self.kv_heads:
            raise ValueError(f"{self.q_heads} query heads and {self.kv_heads} key/value heads: the query heads must "
                             "be a multiple of the key/value heads.")
        if not 1 <= self.size <= self.q_heads:
            # The degrees to suggest divide the one refused, so a CP degree it divides (the CP degree itself under
            # ulysses, a multiple of it under hybrid) splits into their head groups too; a divisor of the heads
            # alone (7 of 14 heads at CP 64) would only be refused next by the CP check.
            fits = [d for d in range(1, self.q_heads + 1) if self.size % d == 0]
            balanced = [d for d in fits if self.q_heads % d == 0]
            ring = f"{flag_setting('cp_mode', 'ring')} (no head parallelism, any number of heads)"
            fix = (f"use a head-parallel degree of at most {self.q_heads} that divides {self.size} ({fits}; balanced "
                   f"over the heads: {balanced}): {flag_setting('cp_mode', 'hybrid')} with "
                   f"{flag_setting('cp_ulysses_size')} among those and the ring over the rest of the CP degree, or "
                   f"{ring}." if fits != [1] else
                   f"no head-parallel degree above 1 that divides {self.size} fits {self.q_heads} heads: use {ring}.")
            raise ValueError(
                f"a head-parallel degree of {self.size} needs at least {self.size} query heads, but the model has "
                f"{self.q_heads} (and {self.kv_heads} key/value heads): every rank must compute at least one head; "
                f"{fix}"
            )

    @property
    def group(self) -> int:
        """Query heads per key/value head."""
        return self.q_heads // self.kv_heads

    def q_range(self, rank: int) -> tuple[int, int]:
        return rank * self.q_heads // self.size, (rank + 1) * self.q_heads // self.size

    def kv_range(self, rank: int) -> tuple[int, int]:
        lo, hi = self.q_range(rank)
        return lo // self.group, (hi - 1) // self.group + 1

    def kv_index(self, rank: int) -> torch.Tensor | None:
        """For a rank whose query heads read its key/value heads unevenly: int64 [its query heads], the
        local key/value head each one reads (expand K/V with it); None where they read them evenly."""
        lo, hi = self.q_range(rank)
        kv_lo, kv_hi = self.kv_range(rank)
        reads = torch.arange(lo, hi) // self.group - kv_lo
        n_q, n_kv = hi - lo, kv_hi - kv_lo
        if n_q % n_kv == 0 and torch.equal(reads, torch.arange(n_q) // (n_q // n_kv)):
            return None
        return reads

    @property
    def balanced(self) -> bool:
        """Whether every rank computes the same number of query heads."""
        return self.q_heads % self.size == 0

    @property
    def busiest(self) -> int:
        """Query heads of the busiest rank (ceil(Hq / P))."""
        return -(-self.q_heads // self.size)

    @property
    def busiest_kv(self) -> int:
        """Key/value heads of the rank holding the most (a rank whose query heads read theirs unevenly expands K/V
        to one head per query head, `kv_index`)."""
        return max(hi - lo if self.kv_index(r) is not None else kv_hi - kv_lo
                   for r in range(self.size) for (lo, hi), (kv_lo, kv_hi) in [(self.q_range(r), self.kv_range(r))])

    @property
    def kv_heads_sent(self) -> int:
        """Key/value heads held over all ranks (>= kv_heads; the excess is replication)."""
        return sum(hi - lo for lo, hi in map(self.kv_range, range(self.size)))

    def replicated_kv_bytes(self, tokens: int, head_dim: int, element_size: int) -> int:
        """Bytes of K and V copies beyond one per key/value head, over the group, for `tokens` tokens: the
        memory the replication costs (each rank's copies hold the whole sequence) and, spread over the
        group, what the all-to-all sends for them."""
        return 2 * (self.kv_heads_sent - self.kv_heads) * tokens * head_dim * element_size
