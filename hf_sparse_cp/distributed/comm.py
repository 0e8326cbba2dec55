"""Ring topology and batched point-to-point transfers.

`RingTopology` is the schedule of (hierarchical) ring attention inside one CP group of
`num_nodes x node_size` ranks, rank position p = node * node_size + local. At outer step o and
inner step i, position p computes with the K/V of position
`(node(p) - o, local(p) - i)`: the outer ring moves a node's K/V to the next node, the inner ring
moves them to the next rank of the node. A flat ring is one node (num_nodes = 1).

`P2PComm` posts a batch of sends and receives on one process group with
`torch.distributed.batch_isend_irecv` and returns a `Pending` to wait on later, so a transfer for
the next step runs while the current step computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


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
    """Transfers in flight: `wait()` blocks until they are done. Holds the tensors until then."""

    def __init__(self, works: list, tensors: list[torch.Tensor]) -> None:
        self._works, self._tensors = works, tensors

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works, self._tensors = [], []


class P2PComm:
    """Batched isend/irecv on one process group; counts the bytes this rank sends."""

    def __init__(self, group) -> None:
        self.group = group
        self.bytes_sent = 0

    def post(self, transfers: list[Transfer]) -> Pending:
        """Start every transfer of the batch (posting nothing for an empty one)."""
        if not transfers:
            return Pending([], [])
        ops = []
        for t in transfers:
            if not t.tensor.is_contiguous():
                raise ValueError("point-to-point transfers need contiguous tensors.")
            ops.append(dist.P2POp(dist.isend if t.send else dist.irecv, t.tensor, t.peer, group=self.group))
            if t.send:
                self.bytes_sent += t.tensor.numel() * t.tensor.element_size()
        return Pending(dist.batch_isend_irecv(ops), [t.tensor for t in transfers])


def group_device(group=None) -> torch.device:
    """Where a group's tensors live: this process's current GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def warm_up(group=None) -> None:
    """One collective on a group: NCCL creates communicators lazily, and the first
    batch_isend_irecv of a group must involve all of its ranks, which a rank with nothing to send breaks."""
    dist.all_reduce(torch.zeros(1, device=group_device(group)), group=group)


def reduce_scatter_rows(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """Sum `input` ([cp x n, ...], chunk r for rank r) over the group into `output` ([n, ...]): torch's
    single-tensor reduce-scatter, under its newer name where it has one (the older one warns there)."""
    collective = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    collective(output, input, group=group)


def all_gather_rows(output: torch.Tensor, input: torch.Tensor, group) -> None:
    """Every rank's `input` ([n, ...]) into `output` ([cp x n, ...], rank r's at chunk r): torch's
    single-tensor all-gather, under its newer name where it has one."""
    collective = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    collective(output, input, group=group)
