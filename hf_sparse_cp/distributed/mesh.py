"""The parallel dimensions (`ParallelDims`): context-parallel (CP) and data-parallel (DP) sizes,
groups and node grouping.

Ranks are arranged like accelerate's device mesh (dp_replicate, dp_shard, cp): CP is the innermost
dimension, so a CP group is `cp_size` consecutive ranks and the ranks of one node are contiguous.
Every CP rank receives the same batch and keeps its shard of the sequence; FSDP2 shards the model
over dp_shard x cp, and the loss is reduced over every rank (see `hf_sparse_cp.distributed.loss`).

On GPUs the sizes and the CP group come from accelerate's `ParallelismConfig(cp_size=...)`
(`ParallelDims.from_accelerator`). On CPU (gloo), where accelerate refuses a parallelism
config, the plugin's own `--cp_size` builds the same dimensions (`ParallelDims.from_config`), so one
script runs on a laptop and on a cluster.

The hierarchical ring splits a CP group into `num_nodes` x `node_size` ranks: an inner ring within
a node and an outer ring across nodes, each with its own process group so that their transfers can
be in flight together.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar, Literal

import torch.distributed as dist

from ..files import check_field_types
from .comm import RingTopology, group_timeout, naming_unresponsive_ranks, warm_up
from .document_sharding import PlannerCosts

logger = logging.getLogger(__name__)


@dataclass
class ContextParallelConfig:
    """How the sequence is split over ranks and how K/V travel between them."""

    COMMON_FLAGS: ClassVar[tuple[str, ...]] = ("cp_size", "cp_sharding")

    cp_size: int = field(
        default=1,
        metadata={"help": "Context-parallel degree: ranks that share one sequence (data-parallel degree = world size "
                  "/ cp_size). With accelerate's ParallelismConfig(cp_size=...) on GPUs, its cp_size is used."},
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
        metadata={"help": "Train an architecture outside the registry of models tested exact under context "
                  "parallelism (hf_sparse_cp.integration.architectures.ARCHITECTURES) if it passes the checks "
                  "for shard reach, length-dependent RoPE and token mixing outside attention."},
    )

    def __post_init__(self) -> None:
        check_field_types(self)  # (cp_sharding and cp_ring too: their Literal lists the allowed values)
        if self.cp_size < 1:
            raise ValueError(f"cp_size={self.cp_size} must be >= 1 (1 disables context parallelism).")
        if self.cp_node_size is not None and self.cp_node_size < 1:
            raise ValueError(f"cp_node_size={self.cp_node_size} must be >= 1, or unset to use LOCAL_WORLD_SIZE.")
        for name in ("cp_planner_linear_per_token", "cp_planner_comm_per_token"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name}={getattr(self, name)} must be >= 0 (a cost in attention token pairs).")

    def planner_costs(self) -> PlannerCosts:
        """The document planner's cost model with these flags' weights."""
        return PlannerCosts(linear_per_token=self.cp_planner_linear_per_token,
                            comm_per_token=self.cp_planner_comm_per_token)


def _launch_hint(env: Mapping[str, str]) -> str:
    """How to start the processes, for a run that finds itself alone."""
    if "ACCELERATE_MIXED_PRECISION" in env and "WORLD_SIZE" not in env:
        # accelerate's simple launcher (a MULTI_CPU config without --mpirun_hostfile) starts one process
        return ("`accelerate launch` started a single process. A MULTI_CPU config starts its processes with MPI only "
                "(--mpirun_hostfile); for N processes on this machine use a MULTI_GPU config (accelerate then starts "
                "them with torchrun, and without CUDA the script trains on CPU over gloo: see "
                "recipes/accelerate/cpu_2proc_cp2.yaml), or `hf-sparse-cp train --nproc N`.")
    return ("launch it with torchrun, accelerate launch or `hf-sparse-cp train --nproc N` (or call "
            "torch.distributed.init_process_group before building the parallel dimensions).")


def check_sizes(world_size: int, cp_size: int) -> None:
    """Raise a ValueError that says how to fix it when `cp_size` does not divide `world_size`."""
    if cp_size < 1 or world_size % cp_size:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        multiple = max(1, -(-world_size // max(cp_size, 1))) * max(cp_size, 1)
        raise ValueError(
            f"cp_size={cp_size} does not divide the world size {world_size} (the number of processes): the ranks "
            f"must split into data-parallel groups of cp_size. Use a cp_size in {divisors}, or launch a multiple "
            f"of {cp_size} processes (e.g. --num_processes {multiple})."
        )


def check_launched(cp_sizes: Iterable[int], env: Mapping[str, str] = os.environ) -> None:
    """Raise a ValueError that says how to launch unless this process's launch can run these CP degrees: none
    above 1 in a process that runs alone, each dividing the number of processes (WORLD_SIZE, which torchrun and
    accelerate launch set). Cheap: call it before building data, which a refused launch would waste."""
    world = int(env.get("WORLD_SIZE", "1"))
    for cp_size in cp_sizes:
        if cp_size > 1 and "WORLD_SIZE" not in env:
            raise ValueError(f"cp_size={cp_size} splits each sequence over {cp_size} processes, and this one runs "
                             f"alone: {_launch_hint(env)}")
        check_sizes(world, cp_size)


def ring_shape(cp_size: int, config: ContextParallelConfig, env: Mapping[str, str] = os.environ) -> tuple[int, int]:
    """(num_nodes, node_size) of the ring inside one CP group; (1, cp_size) for a flat ring."""
    if config.cp_ring == "flat" or cp_size == 1:
        return 1, cp_size
    per_node = config.cp_node_size
    if per_node is None and env.get("LOCAL_WORLD_SIZE"):
        per_node = int(env["LOCAL_WORLD_SIZE"])
    if per_node is None:
        raise ValueError(
            "cp_ring='hierarchical' needs the number of ranks per node: launch with torchrun or accelerate launch "
            "(they set LOCAL_WORLD_SIZE) or pass --cp_node_size."
        )
    if per_node >= cp_size:
        if per_node % cp_size:
            raise ValueError(
                f"a node holds {per_node} ranks, which is not a multiple of cp_size={cp_size}: some CP groups would "
                "straddle two nodes unevenly. Use a cp_size that divides the ranks per node or is a multiple of it."
            )
        logger.warning("cp_ring='hierarchical': the CP group (%d ranks) fits in one node of %d ranks, so there is "
                       "no ring across nodes: the ring is flat, within the node.", cp_size, per_node)
        return 1, cp_size
    if cp_size % per_node:
        raise ValueError(
            f"cp_size={cp_size} is not a multiple of the {per_node} ranks per node: the hierarchical ring needs whole "
            "nodes. Use a cp_size that is a multiple of the ranks per node, or cp_ring='flat'."
        )
    if per_node == 1:
        logger.warning("cp_ring='hierarchical' with one rank per node (%s): an inner ring of one rank has nothing to "
                       "overlap the outer ring with, so the ring is flat, across the %d nodes. Launch several ranks "
                       "per node (or set --cp_node_size) for the hierarchical ring.",
                       "--cp_node_size 1" if config.cp_node_size == 1 else "LOCAL_WORLD_SIZE=1", cp_size)
    return cp_size // per_node, per_node


class ParallelDims:
    """Sizes, process groups and ring topology of context x data parallelism for this rank.

    Attributes: world_size, rank, cp_size, dp_size, cp_rank (position in the CP group), dp_rank,
    cp_ranks (global ranks of this CP group), cp_group, topology (`RingTopology`: nodes x ranks
    per node), inner_group / outer_group (the two rings; the inner one is the CP group when flat),
    sharding (the configured sequence split), planner_costs (the document planner's weights).
    """

    def __init__(
        self,
        *,
        world_size: int,
        rank: int,
        cp_ranks: tuple[int, ...],
        cp_group,
        topology: RingTopology,
        inner_group,
        outer_group,
        sharding: str,
        planner_costs: PlannerCosts | None = None,
    ) -> None:
        self.world_size = world_size
        self.rank = rank
        self.cp_ranks = cp_ranks
        self.cp_size = len(cp_ranks)
        self.dp_size = world_size // self.cp_size
        self.cp_rank = cp_ranks.index(rank)
        self.dp_rank = rank // self.cp_size
        self.cp_group = cp_group
        self.topology = topology
        self.inner_group = inner_group
        self.outer_group = outer_group
        self.sharding = sharding
        self.planner_costs = PlannerCosts() if planner_costs is None else planner_costs

    def __repr__(self) -> str:
        t = self.topology
        return (
            f"ParallelDims(world={self.world_size}, cp={self.cp_size} x dp={self.dp_size}, rank={self.rank} "
            f"(cp_rank={self.cp_rank}, dp_rank={self.dp_rank}), ring={t.num_nodes} node(s) x {t.node_size}, "
            f"sharding={self.sharding})"
        )

    @property
    def hierarchical(self) -> bool:
        return self.topology.num_nodes > 1 and self.topology.node_size > 1

    def global_rank(self, position: int) -> int:
        """Global rank of the CP group member at ring `position`."""
        return self.cp_ranks[position]

    @classmethod
    def single(cls, sharding: str = "striped") -> ParallelDims:
        """One process, no communication (CP size 1)."""
        return cls(world_size=1, rank=0, cp_ranks=(0,), cp_group=None, topology=RingTopology(1, 1),
                   inner_group=None, outer_group=None, sharding=sharding)

    @classmethod
    def from_config(cls, config: ContextParallelConfig, *, env: Mapping[str, str] = os.environ) -> ParallelDims:
        """Build from the plugin's own flags over the default process group (gloo on CPU, or any backend).

        Call on every rank after `torch.distributed.init_process_group`: it creates the CP groups
        (consecutive ranks) and, for the hierarchical ring, the per-node and cross-node groups.
        """
        if not (dist.is_available() and dist.is_initialized()):
            if config.cp_size != 1:
                raise ValueError(f"cp_size={config.cp_size} needs several processes joined by torch.distributed, but "
                                 f"this one runs alone: {_launch_hint(env)}")
            return cls.single(config.cp_sharding)
        world, rank = dist.get_world_size(), dist.get_rank()
        check_sizes(world, config.cp_size)
        w = config.cp_size
        groups = [list(range(d * w, (d + 1) * w)) for d in range(world // w)]
        return cls._build(world, rank, groups, config, env, cp_group=None)

    @classmethod
    def from_accelerator(cls, accelerator, config: ContextParallelConfig | None = None, *,
                         env: Mapping[str, str] = os.environ) -> ParallelDims:
        """Build from an `accelerate.Accelerator`: its `ParallelismConfig` (cp_size, device mesh, CP
        group) when it has one with cp_size > 1, else the plugin's `config` (CPU / gloo runs)."""
        config = ContextParallelConfig() if config is None else config
        pc = getattr(accelerator, "parallelism_config", None)
        if pc is None or pc.cp_size == 1:
            return cls.from_config(config, env=env)
        if config.cp_size not in (1, pc.cp_size):
            raise ValueError(
                f"--cp_size={config.cp_size} disagrees with accelerate's ParallelismConfig(cp_size={pc.cp_size}); "
                "set one of them (the accelerate config on GPUs)."
            )
        if pc.tp_size > 1 or getattr(pc, "sp_size", 1) > 1:
            raise ValueError(
                f"sparse context parallelism does not compose with tensor or sequence parallelism (tp_size="
                f"{pc.tp_size}, sp_size={getattr(pc, 'sp_size', 1)}); set them to 1."
            )
        mesh = accelerator.torch_device_mesh
        names = list(mesh.mesh_dim_names)
        ranks = mesh.mesh.movedim(names.index("cp"), -1).reshape(-1, pc.cp_size)
        groups = [[int(r) for r in row] for row in ranks]
        return cls._build(dist.get_world_size(), dist.get_rank(), groups, config, env,
                          cp_group=mesh["cp"].get_group())

    @classmethod
    def _build(cls, world: int, rank: int, cp_groups: list[list[int]], config: ContextParallelConfig,
               env: Mapping[str, str], cp_group) -> ParallelDims:
        w = len(cp_groups[0])
        num_nodes, node_size = ring_shape(w, config, env)
        if num_nodes > 1 and any(g != list(range(g[0], g[0] + w)) for g in cp_groups):
            raise ValueError("the hierarchical ring needs each CP group to be consecutive ranks (CP innermost in the "
                             "device mesh); use cp_ring='flat'.")
        topology = RingTopology(num_nodes, node_size)
        mine = next(g for g in cp_groups if rank in g)
        # Every rank takes part in creating every group, in the same order; each with the default group's
        # timeout (`--ddp_timeout`), which torch does not pass on to new groups.
        timeout = group_timeout()
        if cp_group is None and w > 1:
            for g in cp_groups:
                created = dist.new_group(g, timeout=timeout)
                if rank in g:
                    cp_group = created
        inner, outer = cp_group, None
        if num_nodes > 1:
            for g in cp_groups:
                for node in range(num_nodes):
                    created = dist.new_group(g[node * node_size : (node + 1) * node_size], timeout=timeout)
                    if rank in g and topology.node(g.index(rank)) == node:
                        inner = created
                for local in range(node_size):
                    created = dist.new_group(g[local::node_size], timeout=timeout)
                    if rank in g and topology.local(g.index(rank)) == local:
                        outer = created
        layout = cls(world_size=world, rank=rank, cp_ranks=tuple(mine), cp_group=cp_group, topology=topology,
                     inner_group=inner, outer_group=outer, sharding=config.cp_sharding,
                     planner_costs=config.planner_costs())
        for group in {id(g): g for g in (cp_group, inner, outer) if g is not None}.values():
            warm_up(group)
        logger.info("%s", layout)
        return layout


def quiesce_process_groups(settle_s: float = 0.1) -> None:
    """Call once a distributed run's last collective is done, before its process groups are torn
    down (`destroy_process_group`, garbage collection, interpreter exit). No-op without one.

    A gloo worker thread that releases a finished collective's tensors takes the GIL while holding
    its group's lock, so a group destroyed at that moment by a thread holding the GIL deadlocks with
    it, and at interpreter exit the worker is killed instead (the evidence is in
    benchmarks/results/README.md). A barrier completes every rank's earlier collectives; sleeping
    `settle_s` without the GIL lets the workers finish releasing them.
    """
    if dist.is_available() and dist.is_initialized():
        with naming_unresponsive_ranks("the barrier before the process groups are torn down"):
            dist.barrier()
        time.sleep(settle_s)
