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

The CP mode (`modes/`) says how many ranks form a head group (1: none); the layout follows from that
number alone: head groups of `head_size` consecutive ranks (their all-to-alls turn the sequence split
into a head split), and a ring over the ranks at the same place of every head group (CP position
p = o x head_size + i is rank i of head group o and position o of ring i): the whole CP group without
head groups, none where one head group fills the CP group. `ParallelDims` owns all of it: the head
group, and the ring's own view (`ParallelDims.ring`, whose CP fields describe the ring).
"""

from __future__ import annotations

import logging
import os
import time
import weakref
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch.distributed as dist

from ..config.registries import is_plugin
from ..launch_env import in_launched_group, launched_world_size
from .comm import RingTopology, group_timeout, naming_unresponsive_ranks, warm_up

if TYPE_CHECKING:
    from .split.document_costs import PlannerCosts

logger = logging.getLogger(__name__)


def _launch_hint(env: Mapping[str, str]) -> str:
    """How to start the processes, for a run that finds itself alone."""
    if "ACCELERATE_MIXED_PRECISION" in env and not in_launched_group(env):
        # accelerate's simple launcher (a MULTI_CPU config without --mpirun_hostfile) starts one process
        return ("`accelerate launch` started a single process. A MULTI_CPU config starts its processes with MPI only "
                "(--mpirun_hostfile); for N processes on this machine use a MULTI_GPU config (accelerate then starts "
                "them with torchrun, and without CUDA the script trains on CPU over gloo: see "
                "recipes/accelerate/cpu_2proc_cp2.yaml), or `hf-sparse-cp launch --nproc N script.py ...`.")
    return ("launch it with `torchrun --nproc_per_node N`, accelerate launch or `hf-sparse-cp launch --nproc N "
            "script.py ...` (`hf-sparse-cp train --nproc N` for the example), or call "
            "torch.distributed.init_process_group before building the parallel dimensions.")


def check_sizes(world_size: int, cp_size: int) -> None:
    """Raise a ValueError that says how to fix it when `cp_size` does not divide `world_size`."""
    if cp_size < 1 or world_size % cp_size:
        # the sizes that divide it as '1 or 3' ('[1, 3]' read as a range, holding a refused 2)
        *first, last = [d for d in range(1, world_size + 1) if world_size % d == 0]
        divisors = f"{', '.join(map(str, first))} or {last}" if first else str(last)
        multiple = max(1, -(-world_size // max(cp_size, 1))) * max(cp_size, 1)
        raise ValueError(
            f"cp_size={cp_size} does not divide the world size {world_size} (the number of processes): the ranks "
            f"must split into data-parallel groups of cp_size. Use a cp_size that divides it ({divisors}), or launch "
            f"a multiple of {cp_size} processes (e.g. {multiple}: torchrun --nproc_per_node {multiple}, accelerate "
            f"launch --num_processes {multiple}, hf-sparse-cp launch --nproc {multiple})."
        )


def check_launched(cp_sizes: Iterable[int], env: Mapping[str, str] = os.environ) -> None:
    """Raise a ValueError that says how to launch unless this process's launch can run these CP degrees: none
    above 1 in a process that runs alone, each dividing the number of processes (WORLD_SIZE, which torchrun and
    accelerate launch set with RANK: `launched_world_size`). Cheap: call it before building data, which a refused
    launch would waste."""
    world = launched_world_size(env)
    for cp_size in cp_sizes:
        if cp_size > 1 and world is None:
            raise ValueError(f"cp_size={cp_size} splits each sequence over {cp_size} processes, and this one runs "
                             f"alone: {_launch_hint(env)} N: a multiple of {cp_size}; or train with cp_size 1 in "
                             "one process.")
        check_sizes(world or 1, cp_size)


def ring_shape(cp_size: int, config, env: Mapping[str, str] = os.environ, *,
               stride: int = 1) -> tuple[int, int]:
    """(num_nodes, node_size) of a ring of `cp_size` ranks; (1, cp_size) for a flat ring. `stride`: the
    ring takes every stride-th rank of the CP group (the ring of a hybrid layout, one rank per head group),
    so a node holds 1 / stride of its ranks in the ring."""
    if config.cp_ring == "flat" or cp_size == 1:
        return 1, cp_size
    per_node = _ring_node_size(cp_size, config, env, stride)
    if per_node >= cp_size:
        # (in the launch's ranks, as the flags count them: a hybrid's ring holds 1 / stride of each)
        logger.warning("cp_ring='hierarchical': the CP group (%d ranks) fits in one node of %d ranks, so there is "
                       "no ring across nodes: the ring is flat, within the node.", cp_size * stride, per_node * stride)
        return 1, cp_size
    if per_node == 1:
        given = (f"--cp_node_size {config.cp_node_size}" if config.cp_node_size is not None
                 else f"LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']}")
        logger.warning("cp_ring='hierarchical' with one rank per node (%s%s): an inner ring of one rank has nothing "
                       "to overlap the outer ring with, so the ring is flat, across the %d nodes. Launch several ranks "
                       "per node (or set --cp_node_size) for the hierarchical ring.",
                       given, f", one head group of {stride}" if stride > 1 else "", cp_size)
    return cp_size // per_node, per_node


def _ring_node_size(cp_size: int, config, env: Mapping[str, str], stride: int) -> int:
    """The ring's ranks per node for `ring_shape` (of the hierarchical ring of `cp_size` ranks), or a ValueError
    naming where the ranks per node come from (--cp_node_size, LOCAL_WORLD_SIZE) and the fix."""
    per_node = config.cp_node_size
    if per_node is None and env.get("LOCAL_WORLD_SIZE"):
        local = env["LOCAL_WORLD_SIZE"]
        if not local.strip().isdigit() or int(local) < 1:  # (set by hand: int() failed, or 0 divided by zero)
            raise ValueError(f"LOCAL_WORLD_SIZE={local!r} is not a count of ranks per node, which the hierarchical "
                             "ring reads: unset it (torchrun and accelerate launch set it), or give --cp_node_size.")
        per_node = int(local)
    if per_node is None:
        raise ValueError(
            "cp_ring='hierarchical' needs the number of ranks per node: launch with torchrun or accelerate launch "
            "(they set LOCAL_WORLD_SIZE) or pass --cp_node_size."
        )
    given = (f"--cp_node_size {config.cp_node_size}" if config.cp_node_size is not None
             else f"LOCAL_WORLD_SIZE={env['LOCAL_WORLD_SIZE']}")
    if per_node % stride:
        raise ValueError(f"a node holds {per_node} ranks ({given}), which do not split into head groups of {stride} "
                         "(--cp_ulysses_size): use a head group size that divides the ranks per node.")
    # The checks in the ring's ranks (1 / stride of the launch's), the refusals in the launch's and --cp_size's (#50:
    # a hybrid's said 'a node holds 3 ranks (LOCAL_WORLD_SIZE=6), which is not a multiple of cp_size=2' to --cp_size 4)
    group = cp_size * stride
    if per_node >= group and per_node % group:
        raise ValueError(
            f"a node holds {per_node} ranks ({given}), which is not a multiple of cp_size={group}: some CP groups "
            "would straddle two nodes unevenly. Use a cp_size that divides the ranks per node or is a multiple of it"
            + (", or the --cp_node_size your nodes hold." if config.cp_node_size is not None else ".")
        )
    if per_node < group and group % per_node:
        raise ValueError(
            f"cp_size={group} is not a multiple of the {per_node} ranks per node ({given}): the hierarchical ring "
            "needs whole nodes. Use a cp_size that is a multiple of the ranks per node, or cp_ring='flat'."
        )
    return per_node // stride


def check_ring(config, env: Mapping[str, str] = os.environ) -> None:
    """Raise `ring_shape`'s ValueError (naming the fix) when the hierarchical ring of `config` (a
    `ContextParallelConfig`) cannot be laid over the nodes of this launch (--cp_node_size, or the LOCAL_WORLD_SIZE
    of `env`); nothing to check for a flat ring, a CP group without a ring, or a launch that says no ranks per node.
    Cheap: the launch checks call it before the data is built, which a refused ring would waste."""
    if config.cp_ring == "flat" or (config.cp_node_size is None and not env.get("LOCAL_WORLD_SIZE")):
        return
    _, heads = config.mode.resolve(config, config.cp_size)
    if config.cp_size // heads > 1:
        _ring_node_size(config.cp_size // heads, config, env, heads)


class ParallelDims:
    """Sizes, process groups and ring topology of context x data parallelism for this rank.

    Attributes: world_size, rank, cp_size, dp_size, cp_rank (position in the CP group), dp_rank,
    cp_ranks (global ranks of this CP group), cp_group, topology (`RingTopology`: nodes x ranks
    per node), inner_group / outer_group (the two rings; the inner one is the CP group when flat),
    sharding (the configured sequence split), planner_costs (the document planner's weights, None for
    its defaults); mode (the `CPMode` this layout runs; None for `single()` without one), head_size (ranks
    of a head group, 1 without head groups), head_group / head_rank (this rank's head group and its place
    in it), ring (with head groups and a ring across them: the ring's view, a `ParallelDims` whose CP
    fields are the ring's ranks and groups; None otherwise), cp_groups (the global ranks of every CP group, in
    data-parallel order: how a gather over all ranks maps to the groups). With head groups, topology, inner_group
    and outer_group describe the ring's view.
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
        mode=None,
        head_size: int = 1,
        head_group=None,
        ring: ParallelDims | None = None,
        cp_groups: tuple[tuple[int, ...], ...] | None = None,
    ) -> None:
        self.world_size = world_size
        self.rank = rank
        self.cp_ranks = cp_ranks
        self.cp_size = len(cp_ranks)
        self.dp_size = self.dp_size_for(world_size, self.cp_size)
        self.cp_rank = cp_ranks.index(rank)
        self.dp_rank = rank // self.cp_size
        self.cp_group = cp_group
        self.topology = topology
        self.inner_group = inner_group
        self.outer_group = outer_group
        self.sharding = sharding
        self.planner_costs = planner_costs
        if self.cp_size % head_size:
            raise ValueError(f"head groups of {head_size} ranks do not divide a CP group of {self.cp_size}.")
        self.mode, self.head_size, self.head_group, self.ring = mode, head_size, head_group, ring
        self.head_rank = self.cp_rank % head_size
        # (None: CP groups of consecutive ranks, as `from_config` builds them)
        self.cp_groups = cp_groups or tuple(tuple(range(r, r + self.cp_size))
                                            for r in range(0, world_size, self.cp_size))

    def __repr__(self) -> str:
        t = self.topology
        heads = f", heads over {self.head_size} ranks" if self.head_size > 1 else ""
        ring = f" x ring of {self.ring_size}" if self.head_size > 1 and self.ring_size > 1 else ""
        return (
            f"ParallelDims(world={self.world_size}, cp={self.cp_size} x dp={self.dp_size}, rank={self.rank} "
            f"(cp_rank={self.cp_rank}, dp_rank={self.dp_rank}), mode={self.mode.name}{heads}{ring}, "
            f"ring={t.num_nodes} node(s) x {t.node_size}, sharding={self.sharding})"
        )

    @staticmethod
    def dp_size_for(world_size: int, cp_size: int) -> int:
        """The data-parallel degree of CP groups of `cp_size` ranks over `world_size` processes: `dp_size` of the
        layout they make, for where it is needed before that layout is built (a curriculum's stages, the start-up
        checks). Raises `check_sizes`' ValueError, naming the fix, where `cp_size` does not divide `world_size` (a
        floor division counted the ranks left over as none, or a DP degree of 0)."""
        check_sizes(world_size, cp_size)
        return world_size // cp_size

    @property
    def hierarchical(self) -> bool:
        return self.topology.num_nodes > 1 and self.topology.node_size > 1

    @property
    def ring_size(self) -> int:
        """Ranks of the ring: the CP group without head groups, the head groups with them (1: no ring)."""
        return self.cp_size // self.head_size

    def describe(self) -> str:
        """How this layout shares a sequence, in words (the start-up line, the model card)."""
        # (a mode of one's own is named: one that subclasses a built-in mode would read as that mode)
        own = f" (cp_mode {self.mode.name!r})" if is_plugin(self.mode) else ""
        return (f"CP {self.cp_size} x DP {self.dp_size} ({self.world_size} processes): each sequence split over "
                f"{self.cp_size} ranks, {self.mode.describe(self)}{own}")

    def check_model(self, model_config) -> None:
        """Raise ValueError, naming the numbers, unless the mode runs a model with `model_config` in this
        layout's head groups."""
        self.mode.check_model(model_config, self.head_size)

    def global_rank(self, position: int) -> int:
        """Global rank of the CP group member at ring `position`."""
        return self.cp_ranks[position]

    def new_data_parallel_group(self):
        """Create the data-parallel groups, the ranks at one place in every CP group (a collective: every rank calls
        it), with the default group's timeout as the CP groups; returns this rank's (None at DP 1)."""
        if self.dp_size == 1:
            return None
        return _new_groups([[members[place] for members in self.cp_groups] for place in range(self.cp_size)],
                           self.rank, "dp")

    @classmethod
    def single(cls, sharding: str = "striped", mode=None) -> ParallelDims:
        """One process, no communication (CP size 1); `mode`: what a CP group of one runs (`CPMode.resolve`)."""
        return cls(world_size=1, rank=0, cp_ranks=(0,), cp_group=None, topology=RingTopology(1, 1),
                   inner_group=None, outer_group=None, sharding=sharding, mode=mode)

    @classmethod
    def from_config(cls, config, *, env: Mapping[str, str] = os.environ,
                    model_linear_per_token: float | None = None) -> ParallelDims:
        """Build from the plugin's own flags (`config`, a `ContextParallelConfig`) over the default process group
        (gloo on CPU, or any backend); `model_linear_per_token`: the document planner's linear weight counted from
        the model (`integration.planner_weights`), used unless the config sets one.

        Call on every rank after `torch.distributed.init_process_group`: it creates the CP groups
        (consecutive ranks) and, for the hierarchical ring, the per-node and cross-node groups; with
        head groups, the head groups and the rings across them (each once per default group: a layout
        built again reuses them).
        """
        if not (dist.is_available() and dist.is_initialized()):
            if config.cp_size != 1:
                raise ValueError(f"cp_size={config.cp_size} needs several processes joined by torch.distributed, but "
                                 f"this one runs alone: {_launch_hint(env)}")
            return cls.single(config.cp_sharding, config.mode.resolve(config, 1)[0])
        world, rank = dist.get_world_size(), dist.get_rank()
        check_sizes(world, config.cp_size)
        w = config.cp_size
        groups = [list(range(d * w, (d + 1) * w)) for d in range(world // w)]
        return cls._build(world, rank, groups, config, env, cp_group=None,
                          model_linear_per_token=model_linear_per_token)

    @classmethod
    def from_accelerator(cls, accelerator, config, *, model_linear_per_token: float | None = None) -> ParallelDims:
        """Build from an `accelerate.Accelerator`: its `ParallelismConfig` (cp_size, device mesh, CP
        group) when it has one with cp_size > 1, else the plugin's `config` (CPU / gloo runs). The
        plugin's --cp_mode decides how the CP group shares attention either way; `model_linear_per_token`
        as in `from_config`."""
        pc = getattr(accelerator, "parallelism_config", None)
        if pc is not None and getattr(pc, "sp_size", 1) > 1:
            raise ValueError(
                f"accelerate's ParallelismConfig(sp_size={pc.sp_size}) is DeepSpeed's Ulysses (sp_backend="
                f"'{getattr(pc, 'sp_backend', 'deepspeed')}'), which runs under DeepSpeed only. For head parallelism "
                f"with FSDP2 set sp_size to 1 and cp_size to {pc.sp_size} in the accelerate config "
                f"(parallelism_config_cp_size: {pc.sp_size}) and pass --cp_mode ulysses: the plugin splits the heads "
                "over accelerate's CP group."
            )
        if pc is None or pc.cp_size == 1:
            return cls.from_config(config, model_linear_per_token=model_linear_per_token)
        if config.cp_size not in (1, pc.cp_size):
            raise ValueError(
                f"--cp_size={config.cp_size} disagrees with accelerate's ParallelismConfig(cp_size={pc.cp_size}); "
                "set one of them (the accelerate config on GPUs)."
            )
        if pc.tp_size > 1:
            raise ValueError(f"sparse context parallelism does not compose with tensor parallelism (tp_size="
                             f"{pc.tp_size}); set it to 1.")
        mesh = accelerator.torch_device_mesh
        names = list(mesh.mesh_dim_names)
        ranks = mesh.mesh.movedim(names.index("cp"), -1).reshape(-1, pc.cp_size)
        groups = [[int(r) for r in row] for row in ranks]
        return cls._build(dist.get_world_size(), dist.get_rank(), groups, config, os.environ,
                          cp_group=mesh["cp"].get_group(), model_linear_per_token=model_linear_per_token)

    @classmethod
    def _build(cls, world: int, rank: int, cp_groups: list[list[int]], config,
               env: Mapping[str, str], cp_group, model_linear_per_token: float | None) -> ParallelDims:
        w = len(cp_groups[0])
        mode, h = config.mode.resolve(config, w)
        if mode is not config.mode:
            logger.info("--cp_mode %s with head groups of %d in a CP group of %d runs as '%s'.", config.cp_mode, h, w,
                        mode.name)
        mine = next(g for g in cp_groups if rank in g)
        # Every rank takes part in creating every group, in the same order (`_new_groups`).
        if cp_group is None and w > 1:
            cp_group = _new_groups(cp_groups, rank, "cp")
        created = [cp_group]
        common = dict(world_size=world, rank=rank, planner_costs=config.planner_costs(model_linear_per_token))
        head_group, ring = None, None
        if h == 1:  # the ring is the CP group
            topology, inner, outer = _rings(cp_groups, cp_group, config, env, rank, stride=1)
            sharding = config.cp_sharding
        else:
            # head group o: positions o*h .. o*h + h - 1; ring i: positions i, i + h, ... (ascending global ranks,
            # the order of every group's collectives)
            head_group = _new_groups([g[o * h : (o + 1) * h] for g in cp_groups for o in range(w // h)], rank,
                                     "head")
            created.append(head_group)
            topology, inner, outer, sharding = RingTopology(1, 1), None, None, "contiguous"
            if h < w:
                rings = [g[i::h] for g in cp_groups for i in range(h)]
                ring_group = _new_groups(rings, rank, "ring")
                topology, inner, outer = _rings(rings, ring_group, config, env, rank, stride=h)
                created.append(ring_group)
                ring = cls(cp_ranks=tuple(next(r for r in rings if rank in r)), cp_group=ring_group,
                           topology=topology, inner_group=inner, outer_group=outer, sharding=config.cp_sharding,
                           cp_groups=tuple(sorted(map(tuple, rings))), **common)
                ring.dp_size, ring.dp_rank = cls.dp_size_for(world, w), rank // w
                sharding = config.cp_sharding
        created += [inner, outer]
        layout = cls(cp_ranks=tuple(mine), cp_group=cp_group, topology=topology, inner_group=inner,
                     outer_group=outer, sharding=sharding, mode=mode, head_size=h, head_group=head_group, ring=ring,
                     cp_groups=tuple(sorted(map(tuple, cp_groups))), **common)
        for group in {id(g): g for g in created if g is not None}.values():
            warm_up(group)
        logger.info("%s", layout)
        return layout


# The groups `_new_groups` created, by (role, ranks, timeout), under the default group they were created in (a weak
# key: dropped with it at `destroy_process_group`, which shuts them down). A layout built again (a `model_init` model at
# each train(), a curriculum's stages, another Trainer) reuses them: torch keeps every group until the default one goes,
# so new ones would pile up (gloo's with their worker threads). Every rank asks for the same lists in the same order,
# so every rank finds the same ones here and the `new_group` calls, collective over the default group, stay matched.
# The role keeps a layout's groups apart as before where two roles hold the same ranks (a head group that fills the
# CP group), so that their transfers can still be in flight together.
_created: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _new_groups(members: list[list[int]], rank: int, role: str):
    """A process group for every list of `members` (on every rank, in the same order), each with the default
    group's timeout (`--ddp_timeout`), which torch does not pass on to new groups: created once per default group
    and `role` (what the layout uses them for: "cp", "head", ...), then reused; returns this rank's (None if it is
    in none)."""
    timeout, mine = group_timeout(), None
    created = _created.setdefault(dist.group.WORLD, {})
    for ranks in members:
        key = (role, tuple(ranks), timeout)
        if key not in created:
            created[key] = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            mine = created[key]
    return mine


def _rings(rings: list[list[int]], group, config, env: Mapping[str, str], rank: int, *,
           stride: int) -> tuple[RingTopology, object, object]:
    """(topology, inner group, outer group) of this rank's ring among `rings` (lists of global ranks in
    ring order, `group` this rank's ring group): flat, or for the hierarchical ring a group per node and
    one across nodes. `stride`: see `ring_shape`."""
    w = len(rings[0])
    num_nodes, node_size = ring_shape(w, config, env, stride=stride)
    if num_nodes == 1:
        return RingTopology(1, w), group, None
    cp_size = w * stride
    if any(r != list(range(r[0], r[0] + cp_size, stride)) for r in rings):
        raise ValueError("the hierarchical ring needs each CP group to be consecutive ranks (CP innermost in the "
                         "device mesh); use cp_ring='flat'.")
    topology = RingTopology(num_nodes, node_size)
    inner = _new_groups([r[node * node_size : (node + 1) * node_size] for r in rings for node in range(num_nodes)],
                        rank, "inner")
    outer = _new_groups([r[local::node_size] for r in rings for local in range(node_size)], rank, "outer")
    return topology, inner, outer


def quiesce_process_groups(settle_s: float = 0.1) -> None:
    """Call once a distributed run's last collective is done, before its process groups are torn
    down (`destroy_process_group`, garbage collection, interpreter exit). No-op without one.

    A barrier completes every rank's earlier collectives; `settle_gloo_workers` then lets this
    process's gloo workers finish releasing them (why: there).
    """
    if dist.is_available() and dist.is_initialized():
        with naming_unresponsive_ranks("the barrier before the process groups are torn down"):
            dist.barrier()
        settle_gloo_workers(settle_s)


# How long a rank at interpreter exit waits for the others to get there (`every_rank_at_exit`): a rank that failed
# alone after training (its script's `sys.exit(1)`) leaves this long after its failure, not the group's timeout later
EXIT_WAIT_S = 30.0
_EXIT_KEY = "hf_sparse_cp/exit"


def every_rank_at_exit(store, wait_s: float = EXIT_WAIT_S, poll_s: float = 0.05) -> bool:
    """Whether every rank of the default process group got to its interpreter exit within `wait_s` of this one, as
    the ranks agree in the group's store (no collective): all of them get the same answer, so either all go through
    the exit barrier (`quiesce_process_groups`) or none does, and none waits there on a rank that is not coming.

    After training one rank may fail alone (its script's `sys.exit(1)`, which python records nowhere an exit
    handler can read), the others waiting in another collective for it: the barrier then held it until the group's
    timeout (30 minutes by default), where without the plugin its exit ends the job through the launcher at once.
    `store`: the default group's (`upstream.default_store()`). False where it does not answer (its host gone)."""
    world = dist.get_world_size()
    if world == 1:
        return True
    # (torchrun's workers restarted after a failure, --max_restarts, share its store with the ended ones' keys)
    key = f"{_EXIT_KEY}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    decision = f"{key}/decision"
    try:
        if store.add(f"{key}/arrived", 1) == world:  # the last to come: all are here, unless one left first
            return store.compare_set(decision, "", "all") == b"all"
        deadline = time.monotonic() + wait_s
        try:
            while time.monotonic() < deadline and not store.check([decision]):
                time.sleep(poll_s)
        except KeyboardInterrupt:  # (Ctrl-C while it waits: it leaves now, without the exit handler's traceback)
            pass
        # (the decision made meanwhile, else this rank's: it leaves, and a rank coming later learns it)
        return store.compare_set(decision, "", "left") == b"all"
    except RuntimeError:  # (torch's DistError: the store's host gone)
        return False


def settle_gloo_workers(settle_s: float = 0.1) -> None:
    """Pause `settle_s` without the GIL so this process's gloo workers finish releasing the collectives
    they completed. Local (no collective): safe on one rank alone, before or after its groups are destroyed.

    A gloo worker thread releases a completed collective's tensors after the caller's wait returned; a tensor
    whose Python object went meanwhile is freed by the worker, which takes the GIL for it while holding its
    group's lock. A group destroyed at that moment by a thread holding the GIL deadlocks with it, and once the
    interpreter finalises, the worker's take of the GIL ends its thread, which C++ aborts ("terminate called
    without an active exception"; the evidence is in benchmarks/results/README.md).
    """
    time.sleep(settle_s)
