"""`--cp_mode hybrid`: heads over head groups of `--cp_ulysses_size` consecutive ranks (inside a node), the sparse
ring across them: CP position p = o x cp_ulysses_size + i is rank i of head group o and position o of ring i. The
ring's shard of the sequence is cut into one contiguous piece per rank of a head group, whose all-to-all assembles
it for a share of the heads (`heads/`); the ring runs on it (`ring.RING`)."""

from __future__ import annotations

from ...config.files import flag_setting
from ..heads.attention import head_parallel_attention
from ..shard import CPShard
from ..split.blocks import NestedSplit, ShardPlan
from .base import CPAttention
from .heads import HeadGroupMode
from .ring import RING, check_one_block_size, ring_shape


class HybridMode(HeadGroupMode):
    name = "hybrid"
    help = "heads over groups of --cp_ulysses_size ranks within a node, the sparse ring across them"

    def check_flags(self, config) -> None:
        if config.cp_ulysses_size is None:
            raise ValueError(f"{flag_setting('cp_mode', self.name)} needs {flag_setting('cp_ulysses_size')}: the ranks "
                             "of one head group (within a node, e.g. 8 on 8-GPU nodes); the ring spans cp_size / "
                             "cp_ulysses_size of them.")
        self.check_sharding(config.cp_sharding)

    def check_sharding(self, sharding: str) -> None:
        if sharding == "document":
            raise ValueError(f"{flag_setting('cp_sharding', sharding)} is not available under "
                             f"{flag_setting('cp_mode', self.name)} (the planner's shards do not cut into equal pieces "
                             "for a head group); use striped, zigzag or contiguous.")

    def check_model(self, model_config, head_size: int) -> None:
        super().check_model(model_config, head_size)
        check_one_block_size(model_config, self.name)  # (the ring across the head groups)

    def head_size(self, config, cp_size: int) -> int:
        if cp_size % config.cp_ulysses_size:
            divisors = [d for d in range(1, cp_size + 1) if cp_size % d == 0]
            raise ValueError(f"cp_ulysses_size={config.cp_ulysses_size} does not divide cp_size={cp_size}: the CP "
                             f"group must split into whole head groups. Use a cp_ulysses_size in {divisors}.")
        return config.cp_ulysses_size

    def split(self, parallel, sharding, block_size, meta, *, sparse_config, planner_costs):
        self.check_sharding(sharding)
        ring = ShardPlan(sharding, parallel.ring_size, block_size, meta.index.shape[1], pieces=parallel.head_size)
        return NestedSplit(ring, parallel.head_size)

    def attention(self, query, key, value, shard, cfg, *, scale, sliding_window, sinks, stats) -> CPAttention:
        ring_shard = CPShard(shard.parallel.ring, shard.plan.outer, shard.meta)  # this rank's ring and its split
        ring_shard.padding_rows = shard.padding_rows

        def over_the_ring(q, k, v, head_sinks):
            result = RING.attention(q, k, v, ring_shard, cfg, scale=scale, sliding_window=sliding_window,
                                    sinks=head_sinks, stats=stats)
            return result.out, result.kept_fraction

        out, kept = head_parallel_attention(query, key, value, shard, over_the_ring, sinks=sinks, stats=stats)
        return CPAttention(out, None, None, kept)

    def describe(self, parallel) -> str:
        return (f"hybrid: {super().describe(parallel)} within head groups, and a {ring_shape(parallel.ring)} of "
                f"{parallel.ring_size} ranks across them ({parallel.sharding} sharding)")


HYBRID = HybridMode()
