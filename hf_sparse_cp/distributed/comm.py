"""Ring topology and batched point-to-point transfers.

`RingTopology` is the schedule of (hierarchical) ring attention inside one CP group of
`num_nodes x node_size` ranks, rank position p = node * node_size + local. At outer step o and
inner step i, position p computes with the K/V of position
`(node(p) - o, local(p) - i)`: the outer ring moves a node's K/V to the next node, the inner ring
moves them to the next rank of the node. A flat ring is one node (num_nodes = 1).

`P2PComm` posts a batch of sends and receives on one process group with
`torch.distributed.batch_isend_irecv` and returns a `Pending` to wait on later, so a transfer for
the next step runs while the current step computes.

Every transfer and collective here runs within its group's timeout (the groups of `ParallelDims` take
the default group's, `group_timeout`), and a failure of one, a peer that stopped answering or left, is
raised as `UnresponsiveRankError` naming this rank, the peer and the timeout (`naming_unresponsive_ranks`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


class UnresponsiveRankError(RuntimeError):
    """A transfer or collective of ours that a peer rank did not complete within the process group's
    timeout (stopped, hung, or exited)."""


def rank_and_world() -> tuple[int, int]:
    """This process's rank in the default process group and the group's size; (0, 1) without one."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def group_timeout(group=None) -> timedelta:
    """The timeout of `group`'s operations (default: the default group's, `init_process_group(timeout=...)`, which
    the Trainer sets from `--ddp_timeout`). torch gives a new group its backend's default instead (30 min for
    gloo, 10 for NCCL) and has no public getter: read from the group's backend options (listed in
    `integration.compat`)."""
    group = dist.group.WORLD if group is None else group
    return group._get_backend(group_device(group)).options._timeout


def _is_communication_failure(error: BaseException) -> bool:
    # torch raises DistError subclasses (NCCL, the stores); gloo's transport a RuntimeError from its own sources
    return isinstance(error, dist.DistError) or "gloo" in str(error)


@contextlib.contextmanager
def naming_unresponsive_ranks(what: str, group=None, peers: Iterable[int] | None = None) -> Iterator[None]:
    """Raise a communication failure inside the block (a timeout, a closed connection) as `UnresponsiveRankError`
    naming this rank, `what` it was doing, the peers it waited on (global ranks; default: the group's other
    ranks) and the group's timeout, with torch's error as the cause."""
    try:
        yield
    except RuntimeError as error:
        if isinstance(error, UnresponsiveRankError) or not _is_communication_failure(error):
            raise
        me = dist.get_rank()
        if peers is None:
            peers = dist.get_process_group_ranks(dist.group.WORLD if group is None else group)
        others = sorted({r for r in peers if r != me})
        who = f"rank {others[0]}" if len(others) == 1 else f"one of ranks {others}"
        seconds = group_timeout(group).total_seconds()
        raise UnresponsiveRankError(
            f"rank {me}: {what} did not complete: {who} did not answer within the process group's timeout "
            f"({seconds:g} s: init_process_group's timeout, the Trainer's --ddp_timeout), or left. It is stopped, hung "
            f"or has exited: see its log. This rank stops too. (torch: {str(error).strip()})") from error


def all_reduce(x: torch.Tensor, group, what: str, op=dist.ReduceOp.SUM) -> None:
    """`dist.all_reduce` of `x` in place over `group`; a peer that does not answer raises `UnresponsiveRankError`."""
    with naming_unresponsive_ranks(what, group):
        dist.all_reduce(x, op=op, group=group)


def wait(work, group, what: str, peers: Iterable[int] | None = None) -> None:
    """Wait for an asynchronous operation on `group`; a peer that does not answer raises `UnresponsiveRankError`."""
    with naming_unresponsive_ranks(what, group, peers):
        work.wait()


@dataclass(frozen=True)
class RingTopology:
    """`num_nodes` x `node_size` ranks; position p = node * node_size + local."""

    num_nodes: int
    node_size: int

    def __post_init__(self) -> None:
        if self.num_nodes < 1 or self.node_size < 1:
            raise ValueError(f"a ring needs >= 1 node of >= 1 rank, got {self.num_nodes} x {self.node_size}.")

    @property
    def size(self) -> int:
        return self.num_nodes * self.node_size

    def node(self, p: int) -> int:
        return p // self.node_size

    def local(self, p: int) -> int:
        return p % self.node_size

    def position(self, node: int, local: int) -> int:
        return (node % self.num_nodes) * self.node_size + local % self.node_size

    def holder(self, source: int, outer: int, inner: int) -> int:
        """The position that computes with `source`'s K/V at step (outer, inner)."""
        return self.position(self.node(source) + outer, self.local(source) + inner)

    def chain_position(self, p: int, source: int) -> tuple[int, int]:
        """The step (outer, inner) at which position `p` computes with `source`'s K/V."""
        outer = (self.node(p) - self.node(source)) % self.num_nodes
        return outer, (self.local(p) - self.local(source)) % self.node_size

    def source(self, p: int, outer: int, inner: int) -> int:
        """Whose K/V position `p` computes with at step (outer, inner)."""
        return self.position(self.node(p) - outer, self.local(p) - inner)

    def holders(self) -> torch.Tensor:
        """int64 [size, num_nodes, node_size]: `holder(source, outer, inner)` for every entry."""
        s = torch.arange(self.size).view(-1, 1, 1)
        o = torch.arange(self.num_nodes).view(1, -1, 1)
        i = torch.arange(self.node_size).view(1, 1, -1)
        node = (s // self.node_size + o) % self.num_nodes
        return node * self.node_size + (s % self.node_size + i) % self.node_size


@dataclass
class Transfer:
    """One send (or receive) of a contiguous tensor to (from) a global rank."""

    peer: int
    tensor: torch.Tensor
    send: bool


class Pending:
    """Transfers in flight: `wait()` blocks until they are done (or a peer did not answer within the group's
    timeout: `UnresponsiveRankError`). Holds the tensors until then."""

    def __init__(self, works: list, transfers: list[Transfer], group=None, what: str = "the ring transfer") -> None:
        self._works, self._transfers, self._group, self._what = works, transfers, group, what

    def wait(self) -> None:
        # one work per transfer (gloo), or one for the whole batch (NCCL coalesces it): name the peers it waits on
        per_work = [[t] for t in self._transfers] if len(self._works) == len(self._transfers) else [self._transfers]
        for work, transfers in zip(self._works, per_work):
            sends = sorted({t.peer for t in transfers if t.send})
            receives = sorted({t.peer for t in transfers if not t.send})
            what = f"{self._what} " + " and ".join(
                ([f"to rank(s) {sends}"] if sends else []) + ([f"from rank(s) {receives}"] if receives else []))
            wait(work, self._group, what, peers=sends + receives)
        self._works, self._transfers = [], []


class P2PComm:
    """Batched isend/irecv on one process group; counts the bytes this rank sends."""

    def __init__(self, group) -> None:
        self.group = group
        self.bytes_sent = 0

    def post(self, transfers: list[Transfer], what: str = "the ring transfer") -> Pending:
        """Start every transfer of the batch (posting nothing for an empty one); `what` names them should a peer
        not answer."""
        if not transfers:
            return Pending([], [], self.group)
        ops = []
        for t in transfers:
            if not t.tensor.is_contiguous():
                raise ValueError("point-to-point transfers need contiguous tensors.")
            ops.append(dist.P2POp(dist.isend if t.send else dist.irecv, t.tensor, t.peer, group=self.group))
            if t.send:
                self.bytes_sent += t.tensor.numel() * t.tensor.element_size()
        return Pending(dist.batch_isend_irecv(ops), transfers, self.group, what)


def group_device(group=None) -> torch.device:
    """Where a group's tensors live: this process's current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def warm_up(group=None) -> None:
    """One collective on a group: NCCL creates communicators lazily, and the first
    batch_isend_irecv of a group must involve all of its ranks, which a rank with nothing to send breaks."""
    all_reduce(torch.zeros(1, device=group_device(group)), group, "setting up the context-parallel group")


def reduce_scatter_rows(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """Sum `input` ([cp x n, ...], chunk r for rank r) over the group into `output` ([n, ...]): torch's
    single-tensor reduce-scatter, under its newer name where it has one (the older one warns there)."""
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    with naming_unresponsive_ranks("a reduce-scatter over the context-parallel group", group):
        collective(output, input, group=group)


def all_gather_rows(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """Every rank's `input` ([n, ...]) into `output` ([cp x n, ...], rank r's at chunk r): torch's
    single-tensor all-gather, under its newer name where it has one."""
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    with naming_unresponsive_ranks("an all-gather over the context-parallel group", group):
        collective(output, input, group=group)
