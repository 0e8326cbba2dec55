"""The context-parallel flags (`ContextParallelConfig`): the CP degree, how the CP group shares attention
(`cp_mode`), how the sequence is split (`cp_sharding`), the ring's shape and the document planner's weights
(`PlannerCosts`). `mesh.ParallelDims` builds the process groups from them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, field
from typing import ClassVar, Literal

from ..config.files import check_field_types


@dataclass(frozen=True)
class PlannerCosts:
    """Weights of the planner's cost model, in attention token pairs (one query against one key:
    4 x heads x head_dim FLOPs forward), so that they do not depend on the block size."""

    linear_per_token: float = field(
        default=9000.0,
        metadata={"help": "Work of the linear layers (projections, MLP) per token, in attention token pairs: "
                  "2 x (weights per layer) / (4 x heads x head_dim), about 9,000 for Qwen2.5-0.5B and 8,700 for "
                  "Qwen2.5-7B."},
    )
    comm_per_token: float = field(
        default=300.0,
        metadata={"help": "Cost of receiving one token's K/V, in attention token pairs: its bytes over the link's "
                  "bandwidth, in the time the GPU computes that many pairs (about 300 for Qwen2.5-0.5B over "
                  "NVLink, a few times more across nodes)."},
    )
    balance_slack: float = field(
        default=0.02,
        metadata={"help": "Imbalance accepted to save traffic: a cut between ranks within this fraction of a "
                  "rank's work of a document's edge moves to the edge, keeping the document whole."},
    )
    max_token_ratio: float = field(
        default=1.25,
        metadata={"help": "Most tokens a rank may hold, as a multiple of the mean (activation memory)."},
    )
    extra_splits: int = field(
        default=8,
        metadata={"help": "Numbers of documents cut tried one by one beyond those that must be cut; past them the "
                  "sweep grows by a quarter per try, up to every document, and stops once the ranks are balanced."},
    )
    ring_share: float = field(
        default=0.5,
        metadata={"help": "A document with at least this share of the row's work is split over the whole ring "
                  "(striped, or head-tail if dense), so that every ring step gets an equal share of it; smaller "
                  "ones are split, if at all, over a few consecutive ranks."},
    )



CP_MODES = ("ring", "ulysses", "hybrid")


@dataclass
class ContextParallelConfig:
    """How the sequence is split over ranks and how K/V travel between them."""

    COMMON_FLAGS: ClassVar[tuple[str, ...]] = ("cp_size", "cp_mode", "cp_sharding")

    cp_size: int = field(
        default=1,
        metadata={"help": "Context-parallel degree: ranks that share one sequence (data-parallel degree = world size "
                  "/ cp_size). With accelerate's ParallelismConfig(cp_size=...) on GPUs, its cp_size is used."},
    )
    cp_mode: Literal["ring", "ulysses", "hybrid"] = field(
        default="ring",
        metadata={"help": "How the CP group shares the attention: 'ring' (the sequence split, K/V blocks travel the "
                  "sparse ring), 'ulysses' (head parallelism: an all-to-all gives each rank the whole sequence of "
                  "its share of the heads, whose pattern it estimates as one process does; at most one rank per "
                  "query head), or 'hybrid' (heads over groups of --cp_ulysses_size ranks within a node, the sparse "
                  "ring across them)."},
    )
    cp_ulysses_size: int | None = field(
        default=None,
        metadata={"help": "For --cp_mode hybrid: ranks per head group (consecutive ranks, within a node; at most the "
                  "query heads); the ring spans cp_size / cp_ulysses_size of them."},
    )
    cp_sharding: Literal["striped", "zigzag", "contiguous", "document"] = field(
        default="striped",
        metadata={"help": "How the sequence is split: 'striped' (block round robin, balances sparse attention), "
                  "'zigzag' (head-tail chunks, balances dense causal attention), 'contiguous', or 'document' "
                  "(packed rows: short documents whole on one rank, their K/V never sent; long ones split; "
                  "planned per batch to balance attention, linear work and traffic)."},
    )
    cp_ring: Literal["flat", "hierarchical"] = field(
        default="flat",
        metadata={"help": "'flat': one ring over the CP group; 'hierarchical': an inner ring within each node and "
                  "an outer ring across nodes whose transfers hide behind the inner ring's compute."},
    )
    cp_node_size: int | None = field(
        default=None,
        metadata={"help": "Ranks per node for the hierarchical ring (default: LOCAL_WORLD_SIZE, set by torchrun and "
                  "accelerate launch)."},
    )
    cp_planner_linear_per_token: float = field(
        default=PlannerCosts.linear_per_token,
        metadata={"help": "For --cp_sharding document: work of the linear layers per token, in attention token pairs "
                  "(2 x weights per layer / (4 x heads x head_dim); about 9,000 for Qwen2.5-0.5B)."},
    )
    cp_planner_comm_per_token: float = field(
        default=PlannerCosts.comm_per_token,
        metadata={"help": "For --cp_sharding document: cost of receiving one token's K/V, in attention token pairs "
                  "(about 300 for Qwen2.5-0.5B over NVLink; a few times more across nodes)."},
    )
    cp_allow_untested_model: bool = field(
        default=False,
        metadata={"help": "Deprecated, no effect: every architecture that passes the model checks (shard reach, "
                  "length-dependent RoPE, token mixing outside attention) trains under context parallelism. "
                  "Accepted so that command lines and recipes of earlier versions run."},
    )

    def __post_init__(self) -> None:
        check_field_types(self)  # (cp_sharding and cp_ring too: their Literal lists the allowed values)
        if self.cp_size < 1:
            raise ValueError(f"cp_size={self.cp_size} must be >= 1 (1 disables context parallelism).")
        if self.cp_node_size is not None and self.cp_node_size < 1:
            raise ValueError(f"cp_node_size={self.cp_node_size} must be >= 1, or unset to use LOCAL_WORLD_SIZE.")
        self._check_mode()
        if self.cp_allow_untested_model:
            warnings.warn("--cp_allow_untested_model is no longer needed and has no effect: every architecture that "
                          "passes the model checks trains under context parallelism; drop the flag.", FutureWarning,
                          stacklevel=2)
        for name in ("cp_planner_linear_per_token", "cp_planner_comm_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (a cost in attention token pairs).")

    def _check_mode(self) -> None:
        """Refuse settings the mode would ignore or cannot run, naming the fix."""
        if self.cp_ulysses_size is not None and self.cp_ulysses_size < 1:
            raise ValueError(f"cp_ulysses_size={self.cp_ulysses_size} must be >= 1.")
        if self.cp_mode == "hybrid":
            if self.cp_ulysses_size is None:
                raise ValueError("--cp_mode hybrid needs --cp_ulysses_size: the ranks of one head group (within a "
                                 "node, e.g. 8 on 8-GPU nodes); the ring spans cp_size / cp_ulysses_size of them.")
            if self.cp_sharding == "document":
                raise ValueError("--cp_sharding document is not available under --cp_mode hybrid (the planner's shards "
                                 "do not cut into equal pieces for a head group); use striped, zigzag or contiguous.")
            return
        if self.cp_ulysses_size is not None:
            raise ValueError(f"--cp_ulysses_size {self.cp_ulysses_size} is the head-group size of --cp_mode hybrid; "
                             f"under --cp_mode {self.cp_mode} it would be ignored: drop it, or use --cp_mode hybrid.")
        if self.cp_mode == "ulysses":
            ignored = [f"--cp_sharding {self.cp_sharding}"] if self.cp_sharding != "striped" else []
            ignored += [f"--cp_ring {self.cp_ring}"] if self.cp_ring != "flat" else []
            if ignored:
                raise ValueError(
                    f"{' and '.join(ignored)} would be ignored under --cp_mode ulysses: it has no ring (every rank "
                    "attends the whole sequence for its heads) and holds one contiguous piece of the sequence for the "
                    "other layers. Drop it, or use --cp_mode hybrid for heads within a node and a ring across nodes."
                )

    def head_size(self, cp_size: int) -> int:
        """Ranks of one head group for a CP group of `cp_size` ranks (1: no head parallelism)."""
        if self.cp_mode == "ring" or cp_size == 1:
            return 1
        if self.cp_mode == "ulysses":
            return cp_size
        if cp_size % self.cp_ulysses_size:
            divisors = [d for d in range(1, cp_size + 1) if cp_size % d == 0]
            raise ValueError(f"cp_ulysses_size={self.cp_ulysses_size} does not divide cp_size={cp_size}: the CP group "
                             f"must split into whole head groups. Use a cp_ulysses_size in {divisors}.")
        return self.cp_ulysses_size

    def planner_costs(self) -> PlannerCosts:
        """The document planner's cost model with these flags' weights."""
        return PlannerCosts(linear_per_token=self.cp_planner_linear_per_token,
                            comm_per_token=self.cp_planner_comm_per_token)
