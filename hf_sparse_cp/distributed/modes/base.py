"""What a CP mode is (`CPMode`): how the ranks of a CP group share one sequence's attention, answering every
question the layers above would otherwise branch on; and the registry of modes by name.

A mode answers:
* its checks: the flags it cannot run or would ignore (`check_flags`), the sharding it takes
  (`check_sharding`: the one rule behind both the flags and `prepare_context_parallel_inputs`'s argument),
  the model heads it needs (`check_model`);
* its head-group size and the mode a CP degree runs as (`resolve`: a hybrid whose head groups fill the CP group
  is ulysses, one of head groups of one rank is the ring);
* how it splits the sequence (`split`);
* its attention (`attention`): one result type for every mode, `CPAttention`, with the kept fraction one process
  reports for the call;
* how it describes itself (`describe`: the start-up line and the model card).

`ParallelDims` builds the process groups from the head-group size alone (head groups of consecutive ranks, the
ring over the ranks at the same place of every head group), so a mode need not build groups.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any, ClassVar, NamedTuple

import torch

from ...config.files import flag_setting
from ...config.registries import NamedInstances

if TYPE_CHECKING:
    from ...attention.layout import SparseLayout
    from ...attention.tokens import TokenMeta
    from ...config import SparseAttentionConfig
    from ..mesh import ParallelDims
    from ..ring.attention import RingStats
    from ..shard import CPShard
    from ..split.blocks import BlockSplit
    from ..split.document_costs import PlannerCosts


class CPAttention(NamedTuple):
    """The result of `context_parallel_attention`, whatever the mode."""

    out: torch.Tensor  # [B, Hq, S_local, D], this rank's tokens
    lse: torch.Tensor | None  # [B, Hq, S_local] where the mode computes it over this rank's tokens (the ring)
    layout: SparseLayout | None  # the global layout, where one layout covers the sequence (the ring)
    kept_fraction: torch.Tensor  # 0-d float64: what the logs report for the call (`kept_fraction.py`)


class CPMode(ABC):
    """How a CP group shares attention (see the module docstring). Subclasses set `name` and `help` (the
    `--cp_mode` flag's text for this mode); `modes/__init__.py` registers an instance (`register_cp_mode`)."""

    name: ClassVar[str]
    help: ClassVar[str]
    # (`config` below: the `ContextParallelConfig`, which looks its mode up here: not imported, to keep one
    # import direction)

    def __repr__(self) -> str:
        return f"<CP mode {self.name!r}>"

    def check_flags(self, config) -> None:
        """Raise ValueError, naming the fix, for flags this mode cannot run or would ignore."""
        if config.cp_ulysses_size is not None:
            hybrid = flag_setting("cp_mode", "hybrid")
            raise ValueError(f"{flag_setting('cp_ulysses_size', config.cp_ulysses_size)} is the head-group size of "
                             f"{hybrid}; under {flag_setting('cp_mode', self.name)} it would be ignored: drop it, or "
                             f"use {hybrid}.")
        self.check_sharding(config.cp_sharding)

    def check_sharding(self, sharding: str) -> None:
        """Raise ValueError, naming the fix, unless this mode splits the sequence with `sharding` (by default it
        takes every sharding)."""
        return None

    @abstractmethod
    def head_size(self, config, cp_size: int) -> int:
        """Ranks of one head group in a CP group of `cp_size` ranks (1: no head parallelism); raises naming the
        fix when the degree cannot split so."""

    def resolve(self, config, cp_size: int) -> tuple[CPMode, int]:
        """(the mode a CP group of `cp_size` ranks runs, its head-group size): one mode per layout, so that a
        layout is described and computed the same way whatever flags led to it (`runs_as`)."""
        heads = 1 if cp_size == 1 else self.head_size(config, cp_size)  # (one rank: nothing to share)
        return self.runs_as(heads, cp_size), heads

    def runs_as(self, head_size: int, cp_size: int) -> CPMode:
        """The mode that computes this mode's layout of head groups of `head_size` ranks in a CP group of `cp_size`:
        by default this one (a mode registered by a user runs its own attention whatever its head groups)."""
        return self

    def check_model(self, model_config: Any, head_size: int) -> None:
        """Raise ValueError, naming the numbers, unless a model with `model_config` runs in head groups of
        `head_size` ranks (by default any model does)."""
        return None

    @abstractmethod
    def split(self, parallel: ParallelDims, sharding: str, block_size: int, meta: TokenMeta, *,
              sparse_config: SparseAttentionConfig, planner_costs: PlannerCosts) -> BlockSplit:
        """How a batch whose documents `meta` [B, S] describes splits over the CP group of `parallel`."""

    @abstractmethod
    def attention(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, shard: CPShard,
                  cfg: SparseAttentionConfig, *, scale: float | None, sliding_window: int | None,
                  sinks: torch.Tensor | None, stats: RingStats | None) -> CPAttention:
        """This rank's attention output for its shard (see `context_parallel_attention`). Collective."""

    @abstractmethod
    def describe(self, parallel: ParallelDims) -> str:
        """How the CP group of `parallel` shares attention, in words (the start-up line, the model card)."""


_MODES = NamedInstances(CPMode, "hf_sparse_cp.distributed.CPMode", "cp_mode", "the --cp_mode value",
                        "hf_sparse_cp.distributed.register_cp_mode", "its `help`, implement its abstract methods")


def register_cp_mode(mode: CPMode) -> CPMode:
    """Make `mode` (an instance of a `CPMode` subclass) selectable as `ContextParallelConfig(cp_mode=mode.name)`.
    A name registered to a mode of another class is refused: the built-in modes, and a plug-in's, cannot be replaced
    by accident (a class redefined under its name, a notebook's cell run again, replaces its earlier instance)."""
    return _MODES.register(mode)


def cp_mode_named(name: str) -> CPMode:
    """The registered mode called `name`; ValueError naming the modes otherwise."""
    return _MODES.named(name)


def cp_modes() -> tuple[CPMode, ...]:
    """Every registered mode, in registration order."""
    return _MODES.entries()


def context_parallel_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    shard: CPShard,
    cfg: SparseAttentionConfig,
    *,
    scale: float | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    stats: RingStats | None = None,
) -> CPAttention:
    """Sparse attention of a sequence split over a CP group, by the group's mode: what the attention backend
    calls under CP. Collective over the CP group.

    Args:
        query: [B, Hq, S_local, D]; key, value: [B, Hkv, S_local, D], after RoPE: this rank's part of the sequence
            (`prepare_context_parallel_inputs`).
        shard: this rank's `CPShard` (its `parallel.mode` runs the call); cfg: the layer's pattern config (and its
            `attention_engine`).
        scale: softmax scale (default 1 / sqrt(D)); sliding_window: the layer's window, or None.
        sinks: the layer's learned sink logits [Hq] (`attention.sinks`), applied once to each query's final
            result, or None.
        stats: if given, a `RingStats` accumulating this rank's ring steps and the bytes it sends.
        Under autocast, q, k, v are cast to the autocast dtype and attention runs with autocast off.

    Returns:
        `CPAttention`: out [B, Hq, S_local, D] in q's dtype, equal to single-process attention over the whole
        sequence sliced to this rank's tokens (zeros for padding), differentiable in q, k, v; where the mode has
        them, lse (over the keys, without the sinks) and the global layout; and the kept fraction one process
        reports for the call.
    """
    shard.check_no_kv_cache(query, key)
    return shard.parallel.mode.attention(query, key, value, shard, cfg, scale=scale, sliding_window=sliding_window,
                                         sinks=sinks, stats=stats)
