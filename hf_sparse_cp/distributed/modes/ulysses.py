"""`--cp_mode ulysses`: head parallelism over the whole CP group. An all-to-all gives each rank the whole sequence
of its share of the heads, on which the layer runs exactly as in one process (the pattern estimated from the whole
sequence with no exchange of candidates, the engines and kernels as without CP)."""

from __future__ import annotations

import torch.nn.functional as F

from ...attention.sequence import sequence_attention
from ...config.files import flag_setting
from ..heads.attention import head_parallel_attention
from ..split.blocks import NestedSplit, ShardPlan
from .base import CPAttention
from .heads import HeadGroupMode


class UlyssesMode(HeadGroupMode):
    name = "ulysses"
    help = ("head parallelism: an all-to-all gives each rank the whole sequence of its share of the heads, whose "
            "pattern it estimates as one process does; at most one rank per query head")

    def head_size(self, config, cp_size: int) -> int:
        return cp_size

    def check_flags(self, config) -> None:
        super().check_flags(config)
        if config.cp_ring != "flat":
            raise ValueError(f"{flag_setting('cp_ring', config.cp_ring)} would be ignored under "
                             f"{flag_setting('cp_mode', self.name)}: it has no ring (every rank attends the whole "
                             f"sequence for its heads). Drop it, or use {flag_setting('cp_mode', 'hybrid')} for heads "
                             "within a node and a ring across nodes.")

    def check_sharding(self, sharding: str) -> None:
        # (zigzag and the document planner balance a ring's causal attention over its ranks; ulysses has none to
        # balance: supporting them would reorder the gathered q, k, v and output at every layer for nothing)
        if sharding not in ("striped", "contiguous"):  # striped: the flag's default
            raise ValueError(f"{flag_setting('cp_sharding', sharding)} would be ignored under "
                             f"{flag_setting('cp_mode', self.name)}: a sharding "
                             "balances a ring's causal attention over its ranks, and ulysses has no ring: every rank "
                             "attends the whole sequence for its share of the heads (the same work whichever tokens it "
                             "holds), and holds one contiguous piece of the sequence for the other layers, which treat "
                             "each token on its own. Drop it (in a --cp_schedule stage that sets cp_mode=ulysses: "
                             f"cp_sharding=contiguous), or use {flag_setting('cp_mode', 'hybrid')} for heads within a "
                             "node and a ring across nodes.")

    def split(self, parallel, sharding, block_size, meta, *, sparse_config, planner_costs):
        self.check_sharding(sharding)
        whole = ShardPlan("contiguous", 1, block_size, meta.index.shape[1], pieces=parallel.head_size)
        return NestedSplit(whole, parallel.head_size)

    def attention(self, query, key, value, shard, cfg, *, scale, sliding_window, sinks, stats) -> CPAttention:
        plan, n = shard.plan, shard.plan.seq_len
        padding_rows = None if shard.padding_queries() is None else shard.padding_rows  # (a split in the row's order)

        def whole_sequence(q, k, v, head_sinks):  # one process's call on its tokens, padded at the sequence's end
            out, kept = sequence_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], shard.unpadded_meta, cfg,
                                           scale=scale, sliding_window=sliding_window, sinks=head_sinks,
                                           padding_rows=padding_rows)
            return F.pad(out, (0, 0, 0, plan.padded_len - n)), kept

        out, kept = head_parallel_attention(query, key, value, shard, whole_sequence, sinks=sinks, stats=stats)
        return CPAttention(out, None, None, kept)


ULYSSES = UlyssesMode()
