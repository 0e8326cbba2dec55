"""Context parallelism for TRL's trainers whose rows are generated in the training step, GRPOTrainer and RLOOTrainer:
each completes each prompt `num_generations` times, scores the completions, derives advantages from the rewards of
each prompt's group (GRPO normalizes them over the group, RLOO subtracts the leave-one-out mean of the others, after a
KL penalty to the reference model; the groups may span processes: it gathers the rewards over all of them and takes
its own slice by `process_index`), and builds its loss from per-token log-probabilities of the whole rows.

Under CP, the trainer sees the data-parallel view (`DataParallelView`): while its own code runs, its accelerator's
`num_processes`, `process_index` and collectives (`gather`, `reduce`, `pad_across_processes`, the `gather` and
`gather_object` its module imports from accelerate) are the data-parallel ones, over the ranks that hold the same
place in their CP groups, so its groups, slices, normalizations and metrics are those of a data-parallel run without
CP. The generation batch (`_prepare_inputs`: sampling, rewards, advantages, the reference model's and the old policy's
log-probabilities) is computed unsharded on each CP group's first rank alone and broadcast to the group, which then
holds the same prompts and completions (the others' random streams play no part). Under FSDP, whose forwards
gather the sharded parameters from every rank, every rank of the group computes it in step (transformers' generate
forwarding until every rank's completions end, `synced_gpus`) and the first rank's is broadcast. Only the loss's
forward is a CP forward, through the whole-row hooks (`whole_rows.py`): its inputs sharded, its per-token
log-probabilities and entropies gathered back into the whole rows, so every rank of the group computes one process's
loss and metrics.
"""

from __future__ import annotations

import contextlib
import sys
from collections import defaultdict, deque
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist

from ..distributed import ParallelDims
from ..integration.patching import temporarily


def check_generating_trainer(trainer, cp_size: int, dp_size: int) -> None:
    """Raise ValueError, naming the setting and the fix, for a setting of a GRPO or RLOO trainer that CP does not run
    as a data-parallel run does: generation by vLLM or transformers' continuous batching (their own process layouts
    and collectives over all processes) and batch sizes that the data-parallel degree does not fit."""
    args, cp = trainer.args, cp_size
    fix = ("or run without CP (drop --cp_size): sparse attention alone trains it, on one process or with data "
           "parallelism")
    for flag in ("use_vllm", "use_transformers_continuous_batching"):
        if getattr(args, flag, False):
            raise ValueError(
                f"{type(trainer).__name__} with --{flag} under context parallelism (CP {cp}) is not supported: its "
                "generation exchanges prompts and completions over all processes, where each CP group must hold one "
                f"data-parallel rank's. Fix: drop --{flag} (each CP group's first rank then generates with the "
                f"model's generate and shares the completions with its group; under FSDP every rank generates in "
                f"step and the first rank's are shared), {fix}.")
    generations = trainer.num_generations
    if generation_batch_size(args, dp_size) % generations:
        raise ValueError(
            f"{type(trainer).__name__} under context parallelism (CP {cp}, DP {dp_size}): the generation "
            f"batch, per_device_train_batch_size {args.per_device_train_batch_size} x DP {dp_size} x "
            f"steps_per_generation {args.steps_per_generation}, is not a multiple of --num_generations "
            f"{generations} (a CP group holds one data-parallel rank's prompts). Fix: a batch size or "
            f"--steps_per_generation that it divides, {fix}.")
    eval_generations = getattr(trainer, "num_generations_eval", None) or generations
    if (args.per_device_eval_batch_size * dp_size) % eval_generations:
        raise ValueError(
            f"{type(trainer).__name__} under context parallelism (CP {cp}, DP {dp_size}): the evaluation "
            f"batch, per_device_eval_batch_size {args.per_device_eval_batch_size} x DP {dp_size}, is not a "
            f"multiple of the evaluation's num_generations {eval_generations}. Fix: an evaluation batch size that it "
            f"divides, {fix}.")


@contextlib.contextmanager
def generation_batch_counted_by_trl(args) -> Iterator[None]:
    """Inside, a given `--generation_batch_size` of `args` (a GRPO or RLOO config's) is counted over every process, CP
    ranks included, as their configs' `__post_init__` counts it (deriving `steps_per_generation` from it: under CP 2 a
    batch of 8 prompts at 4 per device was 1 step of 4 prompts, on one process 2 steps of 4); restored after. The
    given batch is one data-parallel run's, which a CP group holds one rank's share of (`generation_batch_size`)."""
    given, cp = getattr(args, "generation_batch_size", None), getattr(args, "cp_size", 1)
    if given is None or cp == 1:
        yield
        return
    args.generation_batch_size = given * cp
    try:
        yield
    finally:
        args.generation_batch_size = given


def generation_batch_size(args, dp_size: int) -> int:
    """The prompts per generation of a GRPO or RLOO trainer over all data-parallel ranks: its config counts every
    process (CP ranks included); a CP group holds one data-parallel rank's."""
    return args.per_device_train_batch_size * dp_size * args.steps_per_generation


class DataParallelView:
    """The accelerator `accelerator` as a data-parallel run without CP shows it to this rank: `num_processes` the DP
    degree, `process_index` the DP rank, and collectives over `group`, the ranks that hold this rank's place in
    their CP groups (None: DP 1, nothing to exchange). Every other member is the accelerator's."""

    def __init__(self, accelerator, parallel: ParallelDims, group) -> None:
        self._accelerator, self._group = accelerator, group
        self.num_processes, self.process_index = parallel.dp_size, parallel.dp_rank

    def __getattr__(self, name: str) -> Any:
        return getattr(self._accelerator, name)

    def gather(self, tensor: Any) -> Any:
        """Each DP rank's `tensor` concatenated along the first dimension, in DP order (a scalar: one value each)."""
        from accelerate.utils import recursively_apply

        return recursively_apply(self._gather, tensor)

    def _gather(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.reshape(1) if tensor.dim() == 0 else tensor
        if self._group is None:
            return tensor.clone()
        parts = [torch.empty_like(tensor) for _ in range(self.num_processes)]
        dist.all_gather(parts, tensor.contiguous(), group=self._group)
        return torch.cat(parts)

    def gather_for_metrics(self, tensor: Any, use_gather_object: bool = False) -> Any:
        return self.gather_object(tensor) if use_gather_object else self.gather(tensor)

    def gather_object(self, obj: Any) -> list:
        """Each DP rank's list `obj`, concatenated in DP order (accelerate's gather_object)."""
        if self._group is None:
            return list(obj)
        parts: list[Any] = [None] * self.num_processes
        dist.all_gather_object(parts, obj, group=self._group)
        return [item for part in parts for item in part]

    def reduce(self, tensor: torch.Tensor, reduction: str = "sum", scale: float = 1.0) -> torch.Tensor:
        total = tensor.clone()
        if self._group is not None:
            dist.all_reduce(total, group=self._group)
        return total * scale / (self.num_processes if reduction == "mean" else 1)

    def pad_across_processes(self, tensor: torch.Tensor, dim: int = 0, pad_index: int = 0,
                             pad_first: bool = False) -> torch.Tensor:
        """`tensor` padded with `pad_index` along `dim` to the longest of the DP ranks'."""
        size = self._gather(torch.tensor([tensor.shape[dim]], device=tensor.device)).max().item()
        if size == tensor.shape[dim]:
            return tensor
        shape = list(tensor.shape)
        shape[dim] = size - tensor.shape[dim]
        pad = tensor.new_full(shape, pad_index)
        return torch.cat([pad, tensor] if pad_first else [tensor, pad], dim=dim)


@contextlib.contextmanager
def seen_as(trainer, view: DataParallelView, module: ModuleType) -> Iterator[None]:
    """The trainer's accelerator and the collectives its module `module` imports from accelerate are `view`'s inside
    the block."""
    with (temporarily(trainer, "accelerator", view), temporarily(module, "gather", view.gather),
          temporarily(module, "gather_object", view.gather_object)):
        yield


def share_generation_batches(trainer, patches, parallel: Callable[[], ParallelDims]) -> Callable[[], bool]:
    """Make TRL's GRPOTrainer or RLOOTrainer `trainer` run under CP as a data-parallel run: its own code in the
    data-parallel view (`DataParallelView`), its `_prepare_inputs` (generation, rewards, advantages, reference and old
    log-probabilities) run on each CP group's first rank (on every rank under FSDP) and its result broadcast to the
    group, and its generation batch sized by the DP degree. Returns a function saying whether `_prepare_inputs` runs
    (its forwards are then not CP forwards: they take whole rows on the rank). `patches` undoes it."""
    from accelerate.utils import set_seed

    layout = parallel()
    # (GRPO and RLOO seed each process by its index, `set_seed(seed, device_specific=True)`, that the processes draw
    # different completions: seen data-parallel, by its DP rank, as a data-parallel run's process of that rank draws
    # them)
    set_seed(trainer.args.seed + layout.dp_rank)
    patches.set_attr(trainer.args, "generation_batch_size", generation_batch_size(trainer.args, layout.dp_size))
    # (the completions it logs, `--log_completions`, kept in queues of its generation batch's length, which its
    # __init__ sized by every process's count: its prompts' queue held more than its rewards', and printing the
    # samples indexed past the rewards; attached within the Trainer's __init__, as the launcher attaches, before the
    # trainer's own __init__ builds them: they are then built of the length set here)
    if hasattr(trainer, "_logs"):
        patches.set_attr(trainer, "_logs", _logs_of_length(trainer._logs, trainer.args.generation_batch_size))
    view = DataParallelView(trainer.accelerator, layout, layout.new_data_parallel_group())
    # (the module of its loss, `trl.trainer.grpo_trainer` for a GRPOTrainer or a subclass of it: its code imports
    # accelerate's `gather` and `gather_object` by name)
    module = sys.modules[type(trainer).compute_loss.__module__]
    preparing = [False]
    prepare_inputs, compute_loss = trainer._prepare_inputs, trainer._compute_loss

    def prepare_on_first_rank(generation_batch: dict[str, Any]) -> dict[str, Any]:
        shared: list[Any] = [None]
        metrics = trainer._metrics["train" if trainer.model.training else "eval"]
        # (under FSDP every rank of the group runs it, in step with the others: each forward of sharded parameters
        # gathers them from every rank, and transformers' generate forwards a module that FSDP2 manages until every
        # rank's completions end, `synced_gpus`; the first rank's result is taken, the others' play no part)
        fsdp = getattr(trainer, "is_fsdp_enabled", False)
        if layout.cp_rank == 0 or fsdp:
            preparing[0] = True
            try:
                with seen_as(trainer, view, module):
                    inputs = prepare_inputs(generation_batch)
            except Exception as error:
                failed = f"{type(error).__name__}: {error}"
                if fsdp:  # (every rank of the group computed it: each learns of the failure, the others raise too)
                    _raise_if_one_failed(trainer, layout, failed)
                else:
                    # (the group's other ranks wait in the broadcast: they raise too, naming the cause, rather than
                    # waiting there until the process group's timeout)
                    shared[0] = failed
                    dist.broadcast_object_list(shared, src=layout.cp_ranks[0], group=layout.cp_group)
                raise
            finally:
                preparing[0] = False
            if fsdp:
                _raise_if_one_failed(trainer, layout, None)
        if layout.cp_rank == 0:
            # (with the metrics it logs and the tokens it counted: every rank's log and state are one process's; the
            # others' metrics, their losses', are the same)
            shared[0] = (_to(inputs, torch.device("cpu")), trainer.state.num_input_tokens_seen, dict(metrics))
        # (pickled: exact, whatever the dtypes; its tensors are the step's ids, masks and per-token log-probs)
        dist.broadcast_object_list(shared, src=layout.cp_ranks[0], group=layout.cp_group)
        if isinstance(shared[0], str):
            raise RuntimeError(f"{type(trainer).__name__}: rank {layout.cp_ranks[0]}, which generates and scores the "
                               f"rows of its CP group, failed ({shared[0]}): see its traceback.")
        inputs, trainer.state.num_input_tokens_seen, logged = shared[0]
        if layout.cp_rank != 0:
            metrics.clear()
            metrics.update(logged)
        return _to(inputs, trainer.accelerator.device)

    def loss_seen_data_parallel(model, inputs):
        with seen_as(trainer, view, module):
            return compute_loss(model, inputs)

    patches.set_attr(trainer, "_prepare_inputs", prepare_on_first_rank)
    patches.set_attr(trainer, "_compute_loss", loss_seen_data_parallel)
    return lambda: preparing[0]


def _raise_if_one_failed(trainer, layout: ParallelDims, failed: str | None) -> None:
    """Under FSDP, where every rank of the CP group computes the generation batch: tell the group whether this rank's
    failed (`failed`: its error, or None) and raise, on a rank that did not fail, naming the first rank that did, so
    that no rank goes on to the loss's forwards, which would wait for that rank's parameters until the process group's
    timeout (a failing rank raises its own error after this)."""
    told: list[Any] = [None] * layout.cp_size
    dist.all_gather_object(told, failed, group=layout.cp_group)
    if failed is None and (first := next(((r, e) for r, e in zip(layout.cp_ranks, told) if e), None)):
        raise RuntimeError(f"{type(trainer).__name__}: rank {first[0]} of its CP group failed computing the group's "
                           f"generation batch ({first[1]}): see its traceback.")


def _logs_of_length(logs: dict[str, Any], length: int) -> dict[str, Any]:
    """GRPO's log of completions `logs` (its queues, and dicts of queues by name), empty, with queues of `length`."""
    def queue() -> deque:
        return deque(maxlen=length)

    return {key: defaultdict(queue) if isinstance(value, defaultdict) else queue() for key, value in logs.items()}


def _to(inputs: dict[str, Any], device: torch.device) -> dict[str, Any]:
    from accelerate.utils import send_to_device

    return send_to_device(inputs, device)
