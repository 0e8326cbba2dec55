"""Token-count-correct loss under context x data parallelism.

The loss of a step is the mean over *all* target tokens of the global batch: every CP rank holds
a slice of a sequence and every DP rank other sequences, each with its own number of targets. A
rank's loss must therefore be its *sum* of token losses divided by the global token count, and
gradient averaging (FSDP2 over dp_shard x cp, DDP) divides by the number of ranks, which
`rank_loss` undoes. Then the averaged gradient is exactly the gradient of the global token mean,
as without CP.

With the Trainer this is `num_items_in_batch` = `global_num_items(...)` (the models' loss is
sum / num_items_in_batch) followed by the multiplication by the number of processes that the
Trainer applies with `average_tokens_across_devices`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import all_reduce


def _reduce(x: torch.Tensor, group) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        all_reduce(x, group, "the all-reduce of the loss's token count")
    return x


def global_num_items(shift_labels: torch.Tensor, group=None, ignore_index: int = -100) -> torch.Tensor:
    """Number of target tokens over every rank of `group` (default: all ranks, i.e. CP x DP).

    `shift_labels` are this rank's sharded targets (labels shifted before sharding). Collective.
    """
    count = (shift_labels != ignore_index).sum().to(torch.int64)
    return _reduce(count, group)


def rank_loss(loss_sum: torch.Tensor, num_items: torch.Tensor, grad_average_size: int) -> torch.Tensor:
    """This rank's loss: its sum of token losses over the global count, times the number of ranks
    whose gradients are averaged (so the average is the gradient of the global token mean)."""
    return loss_sum * grad_average_size / num_items.clamp_min(1).to(loss_sum.dtype)


def global_mean_loss(loss_sum: torch.Tensor, num_items: torch.Tensor, group=None) -> torch.Tensor:
    """The global token mean from every rank's (detached) loss sum, for logging. Collective."""
    total = _reduce(loss_sum.detach().clone(), group)
    return total / num_items.clamp_min(1).to(total.dtype)
