"""Trainer callbacks of the plugin: sparsity logging, the step's speed and memory, and SMET's attach-and-log
callback."""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Mapping
from typing import Any

import torch
from transformers import TrainerCallback

from ..attention.tokens import PAD_SEGMENT
from ..distributed.split.blocks import batch_meta
from ..integration.stats import LOG_KEY, PEAK_MEMORY, TOKENS_PER_SECOND, layer_log_key, pop_kept_fractions
from ..smet import unwrap_smet

logger = logging.getLogger(__name__)

GIB = 2**30


def add_to_log(state, logs: dict, extra: dict) -> None:
    """Add `extra` to the log being written and to its entry in the Trainer's history."""
    logs.update(extra)
    if state.log_history:
        state.log_history[-1].update(extra)


class SparsityLoggingCallback(TrainerCallback):
    """Adds the per-layer kept fraction of attention blocks to every Trainer log: the blocks computed over the
    blocks dense attention computes on the same batches (1.0 for a layer that runs dense, whatever the packing).

    Keys: `sparse/kept_fraction` (mean over layers) and `sparse/kept_fraction/layer_NN`; in a training log of several
    processes, the mean over the processes (each process's batches are its own under data parallelism; the ranks of
    a CP group hold the same value). A training log shows the calls with gradients only: not a trainer's generation
    in training mode (TRL GRPO's prompts) nor a reference model's log-probabilities. The callback must run before the
    reporting callbacks (TensorBoard, W&B) so they see the keys: `attach_to_trainer` puts it first.
    """

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        # Forwards before train() (a check of the loaded model, a generation) left their sums on the layers, which
        # the end of training's log then showed as the run's (1.0 for a dense check where the steps kept 0.55).
        if model is not None:
            pop_kept_fractions(model)

    def on_log(self, args, state, control, logs=None, model=None, **kwargs):
        if logs is None or model is None:
            return
        # (a training log its steps' calls, an evaluation's its forwards', another log (the end of training's) both;
        # never the calls in training mode without gradients, which TRL's generation in a step makes)
        mode = True if "loss" in logs else False if any(key.startswith("eval_") for key in logs) else None
        per_layer = pop_kept_fractions(model, training=mode, without_grad=False)
        if "loss" in logs and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            per_layer = _mean_over_processes(per_layer, model, args.device)  # (training logs: every rank writes them)
        if not per_layer:
            return
        extra = {layer_log_key(layer): round(v, 5) for layer, v in per_layer.items()}
        extra[LOG_KEY] = round(sum(per_layer.values()) / len(per_layer), 5)
        add_to_log(state, logs, extra)


def _mean_over_processes(per_layer: dict[int, float], model: torch.nn.Module, device: torch.device
                         ) -> dict[int, float]:
    """`pop_kept_fractions`' per-layer means averaged over the processes that recorded each layer, with one
    all-reduce whose size every process knows from the model (its layers' indices), also where one recorded none."""
    layers = sorted({-1} | {int(m.layer_idx) for m in model.modules() if getattr(m, "layer_idx", None) is not None})
    slot = {layer: i for i, layer in enumerate(layers)}
    sums = torch.zeros(len(layers), 2, dtype=torch.float64, device=device)
    for layer, value in per_layer.items():
        sums[slot[layer]] += torch.tensor([value, 1.0], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(sums)
    return {layer: float(sums[i, 0] / sums[i, 1]) for layer, i in slot.items() if sums[i, 1] > 0}


def peak_memory_bytes(device: torch.device) -> int | None:
    """This process's peak memory: on CUDA the most bytes allocated since the last
    `torch.cuda.reset_peak_memory_stats`, on a CPU the peak resident set of the process so far (what the operating
    system reports; None where Python cannot read it, e.g. on Windows)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        import resource
    except ImportError:  # (Windows)
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # (macOS reports bytes, Linux KiB)


class StepMetricsCallback(TrainerCallback):
    """Adds to every training log the speed and memory of the steps since the previous one, as TRL and axolotl
    users read them: `tokens_per_second`, the real (non-padding) tokens trained per second of wall time over all
    processes, each sequence counted once however many context-parallel ranks split it; `peak_memory_gib`, the
    largest peak of any process (`peak_memory_bytes`). Under CP it also replaces TRL's `num_tokens` (counted on
    each rank's padded shard) by the total of real tokens, as one process counts them, in the training logs and as
    `eval_num_tokens` (the training tokens so far) in an evaluation's.

    `count(inputs, cp_size)` is called with every training batch (each rank of a CP group sees the whole batch); a
    trainer whose batches hold no `input_ids` (TRL GRPO's prompts, which it completes in the step; ORPO's and CPO's
    chosen and rejected ids) logs no tokens/s.
    Like the sparsity logging, it must run before the reporting callbacks: `attach_to_trainer` puts it first.
    It also keeps `longest_trained`, the most real tokens of any training sequence (row) of any process so far, as
    of the last training log, checkpoint or the end of training (the model card states it); a checkpoint's marker
    records it, and a resume from it continues from there (`resume_longest`).
    """

    def __init__(self) -> None:
        # this rank's share of the real tokens trained (its batches' over the CP degree): in all, and since the last log
        self.total: torch.Tensor | None = None
        self.since_log: torch.Tensor | None = None
        self.longest: torch.Tensor | None = None  # this rank's longest row (a tensor: no device sync per step)
        self.longest_trained: int | None = None
        self.first_step = 0  # the step this train() call started from (a resume's checkpoint step; the card says it)
        self.cp_size = 1
        self._last_log = time.perf_counter()
        self._clock_from_first_step = False

    def count(self, inputs: Mapping[str, Any] | list, cp_size: int) -> None:
        if not isinstance(inputs, Mapping) or (inputs.get("input_ids") is None and inputs.get("inputs_embeds") is None):
            # (TRL GRPO's batch of prompts, which it completes in the step; ORPO's and CPO's batches, which hold
            # `chosen_input_ids` and `rejected_input_ids`, concatenated in their own forward)
            return
        per_row = (batch_meta(inputs).segment != PAD_SEGMENT).sum(-1)
        tokens = per_row.sum().double() / cp_size
        self.total = tokens if self.total is None else self.total + tokens
        self.since_log = tokens if self.since_log is None else self.since_log + tokens
        longest = per_row.max() if per_row.numel() else None
        if longest is not None:
            self.longest = longest if self.longest is None else torch.maximum(self.longest, longest)
        # (the largest so far: TRL's own count holds every CP stage's shards, also in a curriculum's later CP 1 stage)
        self.cp_size = max(self.cp_size, cp_size)

    @classmethod
    def of(cls, trainer) -> StepMetricsCallback | None:
        """The instance among `trainer`'s callbacks (`attach_to_trainer` adds it), or None."""
        return next((cb for cb in trainer.callback_handler.callbacks if isinstance(cb, cls)), None)

    def resume_longest(self, longest: int) -> None:
        """Continue a run whose checkpoint says its rows held up to `longest` real tokens (the checkpoint's marker,
        `checkpoints.py`): the rows trained before the resume count."""
        held = torch.tensor(longest)
        self.longest = held if self.longest is None else torch.maximum(self.longest, held)

    def on_train_end(self, args, state, control, **kwargs):
        # (every rank ends training: the longest row of all of them, for a run that logged no step since its last)
        self._gather_longest(args)

    def on_save(self, args, state, control, **kwargs):
        # (every rank saves, before the checkpoint's marker records `longest_trained`: it runs after this callback)
        self._gather_longest(args)

    def _gather_longest(self, args) -> None:
        # (every rank takes part, also one that knows no row yet: a resume without shared storage gives the
        # checkpoint's longest to the first node alone, and one at the last step trains no row)
        longest = self.longest.to(device=args.device, dtype=torch.float64).reshape(1) if self.longest is not None \
            else torch.full((1,), -1.0, dtype=torch.float64, device=args.device)
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(longest, op=torch.distributed.ReduceOp.MAX)
        if longest.item() >= 0:
            self.longest_trained = int(longest.item())

    def on_train_begin(self, args, state, control, **kwargs):
        # (the Trainer has loaded a resumed checkpoint's state by now)
        self.since_log, self._last_log, self.first_step = None, time.perf_counter(), state.global_step
        # A resume first skips the batches its checkpoint trained (an iterable dataset's are fetched and dropped):
        # its first interval starts at its first trained step.
        self._clock_from_first_step = state.global_step > 0
        if args.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(args.device)

    def on_step_begin(self, args, state, control, **kwargs):
        if self._clock_from_first_step:
            self._last_log, self._clock_from_first_step = time.perf_counter(), False

    def on_log(self, args, state, control, logs=None, **kwargs):
        # (every rank writes the training and evaluation logs)
        if logs is not None and "eval_num_tokens" in logs and self.cp_size > 1:
            total = self._counts(args.device)[0]
            torch.distributed.all_reduce(total)
            add_to_log(state, logs, {"eval_num_tokens": float(round(total.item()))})
        if logs is None or "loss" not in logs:  # (training logs only from here on)
            return
        peak = peak_memory_bytes(args.device)
        longest = self.longest.to(device=args.device, dtype=torch.float64).reshape(1) if self.longest is not None \
            else torch.zeros(1, dtype=torch.float64, device=args.device)
        stats = torch.cat([self._counts(args.device),
                           torch.tensor([float(peak or 0)], dtype=torch.float64, device=args.device), longest])
        if torch.distributed.is_initialized():
            torch.distributed.all_reduce(stats[:2])
            torch.distributed.all_reduce(stats[2:], op=torch.distributed.ReduceOp.MAX)
        total, since_log, peak_all, longest_all = stats.tolist()
        if self.longest is not None:
            self.longest_trained = int(longest_all)
        now = time.perf_counter()
        extra = {} if self.total is None else {TOKENS_PER_SECOND: round(since_log / max(now - self._last_log, 1e-9), 1)}
        if peak is not None:
            extra[PEAK_MEMORY] = round(peak_all / GIB, 3)
        if "num_tokens" in logs and self.cp_size > 1:
            extra["num_tokens"] = float(round(total))
        add_to_log(state, logs, extra)
        self.since_log, self._last_log = None, now
        if args.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(args.device)

    def _counts(self, device: torch.device) -> torch.Tensor:
        """float64 [2] on `device`: this rank's shares of the real tokens trained, in all and since the last log."""
        return torch.stack([x.to(device) if x is not None else torch.zeros((), dtype=torch.float64, device=device)
                            for x in (self.total, self.since_log)])


class EvaluationStepsCallback(TrainerCallback):
    """Makes `evaluate()`'s and `predict()`'s `<prefix>_steps_per_second` count the steps their evaluation loop took
    (its batches: on every rank, one a global batch of the eval batch size times the data-parallel degree), as one
    process does for the same global batches. The Trainer counts ceil(samples / (eval batch size x world size)), and
    under context parallelism the world size holds each CP group's ranks too (CP 2: half the steps). The samples per
    second are the evaluation set's already. First among the callbacks, so that the reporting ones log the count."""

    def __init__(self) -> None:
        self.steps = 0  # the evaluation loop's steps since its metrics were last reported

    def on_prediction_step(self, args, state, control, **kwargs):
        self.steps += 1

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._count(state, logs)

    def on_predict(self, args, state, control, metrics=None, **kwargs):
        self._count(None, metrics)

    def _count(self, state, metrics: dict | None) -> None:
        """Put the loop's steps into `metrics` (and into the Trainer's history with `state`), if they are its."""
        for key in [k for k in metrics or () if k.endswith("_steps_per_second") and k != "train_steps_per_second"]:
            runtime = metrics.get(key.removesuffix("_steps_per_second") + "_runtime")
            if self.steps and runtime:
                metrics[key] = round(self.steps / runtime, 3)
                if state is not None and state.log_history:
                    state.log_history[-1][key] = metrics[key]
            self.steps = 0


class SMETCallback(TrainerCallback):
    """Attaches SMET when training begins (after accelerate has prepared the model and a checkpoint was
    loaded), sets the prune-rate decay horizon from `max_steps`, and logs `smet/density` (the whole model's),
    `smet/topology_updates` and `smet/replaced_fraction` (share of active blocks replaced at the last
    topology update). A step the loss scaler skipped leaves no masked gradient to the next update."""

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        smet = unwrap_smet(optimizer)
        if smet is None:
            raise RuntimeError("SMETCallback found no SMET optimizer; install it with "
                               "hf_sparse_cp.install_smet(trainer, config).")
        if smet.config.prune_decay_steps is None:
            smet.schedule_horizon = state.max_steps
        if state.is_world_process_zero and 0 < state.max_steps < smet.config.update_interval:
            # (a short run with the default interval of 100 kept its first blocks: static sparsity, unsaid)
            logger.warning(
                "SMET will not change which blocks are active in this run: max_steps=%d is below "
                "--smet_update_interval %d (prune and regrow every update_interval optimizer steps), so the blocks "
                "chosen at set-up train throughout. For dynamic sparse training pass a smaller --smet_update_interval "
                "(e.g. %d).", state.max_steps, smet.config.update_interval, max(2, state.max_steps // 4))
        smet.attach()

    def on_optimizer_step(self, args, state, control, optimizer=None, **kwargs):
        # a step the loss scaler skipped (fp16: an inf or NaN gradient) kept its masked gradient for the next one
        smet = unwrap_smet(optimizer)
        if smet is not None and getattr(optimizer, "step_was_skipped", False):
            smet.discard_masked_gradients()

    def on_log(self, args, state, control, logs=None, optimizer=None, **kwargs):
        smet = unwrap_smet(optimizer)
        if logs is None or smet is None:
            return
        add_to_log(state, logs, {
            "smet/density": round(smet.trained_density(), 5),
            "smet/topology_updates": smet.topology_updates,
            "smet/replaced_fraction": round(smet.last_replaced_fraction, 5),
        })
