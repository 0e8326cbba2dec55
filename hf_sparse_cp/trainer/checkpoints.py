"""Checkpoints that say whether they are complete, and resumes that refuse what does not fit.

The Trainer writes a checkpoint file by file, on every rank, and `resume_from_checkpoint=True`
takes the newest folder: a run that dies while saving leaves a folder that looks like a checkpoint.
`protect_checkpoints` adds a marker, `hf_sparse_cp_checkpoint.json`, to every checkpoint of a run:

* written as "in progress" before the Trainer starts saving (the step at which it will save);
* rewritten as complete, with every file's size and the run's settings (CP degree, data-parallel
  degree, SMET's density, block size and mode), once every rank has finished saving; with it the longest
  row trained so far, which a resume carries on (the model card states it).

`train(resume_from_checkpoint=True)` takes the newest complete checkpoint (the Trainer's choice, the newest
folder, may be one still in progress), and `train(resume_from_checkpoint=...)` checks the checkpoint before anything
is loaded: a marker still in progress, a missing or resized file, a checkpoint of `--save_only_model` (no optimizer,
schedule or random state to continue from), settings that differ from this run's, or a PEFT adapter of other tensors
(other LoRA target modules or rank: `check_adapter_fits`; or PEFT switched on or off since the save) are an error that
names the cause. A
checkpoint without a marker (written without the plugin) is loaded as the Trainer would, with a warning that
nothing could be checked.

Some differences are resumed rather than refused: another data-parallel or context-parallel degree (under
a curriculum, another world size), when both runs train with FSDP2 (the checkpoint then holds its
sharded state, `resharding/resume.py`) and the global batch (per-device batch x gradient accumulation x
DP degree; under a curriculum, every stage's) is the saved one, so that step k still trains on the
samples it trained on before. So is a curriculum's schedule changed from the checkpoint's step on (stages added,
changed or dropped that start at that step or later: `_schedule_change`), whose earlier steps trained as they did.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import logging
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from accelerate.utils.constants import FSDP_MODEL_NAME, OPTIMIZER_NAME
from transformers import Trainer, TrainerCallback, TrainerState, TrainingArguments
from transformers.trainer import TRAINING_ARGS_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints
from transformers.utils import (
    ADAPTER_CONFIG_NAME,
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

from ..checkpoint_marker import MARKER, newest_complete_checkpoint, read_marker
from ..distributed import ParallelDims
from ..integration import compat, compat_checks
from ..integration.adapters import has_adapter
from ..integration.architectures import transformers_release
from ..integration.patching import PatchSet, temporarily
from ..resharding.checkpoint import read_layout
from ..resharding.resume import SHARDED_STATE, has_sharded_state, resharded_loading, runs_fsdp2, sharded_saving
from ..smet.checkpoint import SavedStateMismatch
from ..smet.factory import SMETOptimizerFactory
from .arguments import flag_errors
from .callbacks import StepMetricsCallback
from .schedule import parse_schedule

try:
    import resource  # (POSIX: the file-size limit)
except ImportError:
    resource = None

logger = logging.getLogger(__name__)


def run_settings(trainer: Trainer, parallel: ParallelDims, cp_schedule: str | None = None) -> dict[str, Any]:
    """What a checkpoint must share with the run that resumes it: the CP and DP degrees and the global
    batch, or under a context-length curriculum its schedule, world size and world batch (per-device batch
    x gradient accumulation x world size: the samples a step takes at CP 1, each stage's global batch
    times its CP degree; the step then says the stage)."""
    smet = None
    factory, kwargs = trainer.optimizer_cls_and_kwargs or (None, {})
    if factory is SMETOptimizerFactory:
        config = kwargs["config"]
        smet = {"mode": config.mode, "density": config.density, "block_size": config.block_size}
    args = trainer.args
    if cp_schedule is not None:
        return {"cp_schedule": cp_schedule, "world_size": parallel.world_size, "smet": smet,
                "world_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps
                * parallel.world_size}
    return {"cp_size": parallel.cp_size, "data_parallel_size": parallel.dp_size, "smet": smet,
            "global_batch_size": args.per_device_train_batch_size * args.gradient_accumulation_steps * parallel.dp_size}


def _is_marker(path: Path) -> bool:
    """The marker, or a temporary file of it (another node's, being written on shared storage)."""
    return path.name == MARKER or (path.name.startswith(Path(MARKER).stem + ".") and path.suffix == ".tmp")


def _write(path: Path, content: dict) -> None:
    """Write JSON so that a reader sees the old file or the new one, never half of one (a temporary file per process:
    with save_on_each_node on shared storage, every node's first process writes the same file)."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(content, indent=2) + "\n")
    os.replace(tmp, path)


def _saving_folder(args: TrainingArguments, state: TrainerState) -> Path:
    """The checkpoint folder the Trainer saves at its current step (`args.output_dir`/checkpoint-N)."""
    return Path(args.output_dir) / f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}"


class CheckpointMarkerCallback(TrainerCallback):
    """Marks each checkpoint in progress before it is saved and complete once every rank saved it, and only then
    deletes the checkpoints `--save_total_limit` lets go (`defer_rotation`).
    Must come after transformers' flow callback, which decides at each step or epoch end whether to
    save (a save decided after an evaluation, `save_strategy="best"`, gets only the final marker)."""

    def __init__(self, trainer: Trainer, parallel: ParallelDims, cp_schedule: str | None = None) -> None:
        self.trainer, self.parallel, self.cp_schedule = trainer, parallel, cp_schedule

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save and args.should_save:  # (every node's first process with save_on_each_node)
            folder = _saving_folder(args, state)
            folder.mkdir(parents=True, exist_ok=True)
            _write(folder / MARKER, {"complete": False, "step": state.global_step})

    on_epoch_end = on_step_end  # where the flow callback decides an epoch-end save

    def on_save(self, args, state, control, **kwargs):
        self.trainer.accelerator.wait_for_everyone()  # every rank's files are written
        if args.should_save:  # (each node marks what it saved, with save_on_each_node: its own files)
            folder = _saving_folder(args, state)
            files = {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*"))
                     if p.is_file() and not _is_marker(p)}
            metrics = StepMetricsCallback.of(self.trainer)
            longest = None if metrics is None else metrics.longest_trained  # (gathered by its on_save, just before)
            _write(folder / MARKER, {"complete": True, "step": state.global_step,
                                     "settings": run_settings(self.trainer, self.parallel, self.cp_schedule),
                                     "files": files, "longest_trained": longest,
                                     "model_only": bool(args.save_only_model)})
            rotate_checkpoints(output_dir=str(folder.parent), save_total_limit=args.save_total_limit,
                               best_model_checkpoint=state.best_model_checkpoint, use_mtime=True)


def defer_rotation(trainer: Trainer, patches: PatchSet) -> None:
    """The Trainer deletes the checkpoints past `--save_total_limit` as its first process has written its own files
    of a new one, before the other ranks have written theirs: a rank failing then (its disk full, its node lost) left
    only the new checkpoint, incomplete, which a resume refuses, and the complete one before it deleted. `trainer`
    saves with no limit, and `CheckpointMarkerCallback` deletes them once every rank has saved; recorded in
    `patches`."""
    save_checkpoint = getattr(trainer, compat.TRAINER_SAVE_CHECKPOINT)

    def save(*args, **kwargs):
        with temporarily(trainer.args, "save_total_limit", None):
            save_checkpoint(*args, **kwargs)
        folder = _saving_folder(trainer.args, trainer.state)
        if trainer.args.should_save and (folder / TRAINING_ARGS_NAME).exists():  # (the arguments as the run has them)
            torch.save(trainer.args, folder / TRAINING_ARGS_NAME)

    patches.set_attr(trainer, compat.TRAINER_SAVE_CHECKPOINT, save)


class AgreedJitCheckpoint(TrainerCallback):
    """transformers' just-in-time checkpoint on SIGTERM (`--enable_jit_checkpoint`), saved by every rank at the same
    step, as a scheduled save.

    transformers' handler requests the checkpoint from a timer thread, and each rank's `JITCheckpointCallback` takes
    it at whichever hook comes next there: on several processes one rank saves while another trains on (a CP ring,
    DDP's gradient reduction), each waiting in a different collective until the launcher kills them, which leaves a
    folder holding only transformers' `checkpoint-is-incomplete.txt`. Here the timer only notes the request; at each
    step end the ranks gather whether any of them has one, and if so all stop after saving this step's checkpoint
    where the Trainer saves (after the step's log): marked in progress, then complete, as any other."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.requested = trainer, False

    def request(self) -> None:
        """Replaces the JIT checkpoint manager's `_enable_checkpoint`, which its SIGTERM timer calls."""
        self.requested = True

    def on_step_end(self, args, state, control, **kwargs):
        accelerator = self.trainer.accelerator  # (one flag gathered per step, only with --enable_jit_checkpoint)
        if bool(accelerator.gather(torch.tensor([int(self.requested)], device=accelerator.device)).any()):
            self.requested = False
            control.should_save = control.should_training_stop = True


def resumed_folder(output_dir: str) -> str:
    """The checkpoint `resume_from_checkpoint=True` resumes from: the newest complete one of `output_dir`. The
    Trainer takes the newest folder, which a run that ended while saving leaves incomplete: a requeued job passing
    True would stop there at every start, so the newer incomplete ones are passed over with a warning (left on disk: a
    save of their step writes them anew); refused when no complete one is left, or none is there (the Trainer's own
    error, a traceback from every rank, named no fix)."""
    folder, passed = newest_complete_checkpoint([output_dir]) if os.path.isdir(output_dir) else (None, [])
    if folder is None and not passed:
        raise ValueError(f"resume_from_checkpoint=True: {output_dir!r} holds no checkpoint ({PREFIX_CHECKPOINT_DIR}-N "
                         "folder) to resume from: drop --resume_from_checkpoint to train from the start, or give a "
                         "checkpoint's path (--resume_from_checkpoint PATH).")
    names = ", ".join(path.name for path in passed)
    if folder is None:
        raise ValueError(f"resume_from_checkpoint=True: no complete checkpoint in {output_dir!r}: {names} "
                         f"{'is' if len(passed) == 1 else 'are'} incomplete (the run ended while saving). Delete "
                         f"{'it' if len(passed) == 1 else 'them'} to train from the start, or resume from another "
                         "run's checkpoint (--resume_from_checkpoint PATH).")
    if passed:
        logger.warning("resume_from_checkpoint=True: resuming from %s, the newest complete checkpoint; passed over %s "
                       "(incomplete: the run ended while saving).", folder, names)
    return str(folder)


def resume_step_metrics(trainer: Trainer, marker: dict[str, Any] | None) -> None:
    """Carry what a checkpoint's `marker` (`read_marker`) says of the rows trained before it (`longest_trained`) into
    `trainer`'s step metrics, which the model card reads: they count only the rows this process trains."""
    metrics = StepMetricsCallback.of(trainer)
    longest = None if marker is None else marker.get("longest_trained")
    if metrics is not None and longest is not None:
        metrics.resume_longest(longest)


class CheckpointSaveError(OSError):
    """A checkpoint could not be written for a cause outside the run (the file-size limit, a full disk)."""


# A disk with less free space than this after a failed save is taken as full.
FULL_DISK_BYTES = 16 << 20


def failed_save(folder: Path, error: BaseException) -> str | None:
    """Why writing the checkpoint `folder` failed with `error`, naming the file being written, when its marker says
    the save was in progress and the cause is one the writers' own errors do not name (torch: "unexpected pos ..."):
    this process's file-size limit (`ulimit -f`) or a full disk. None otherwise (not saving, or another cause)."""
    try:
        if json.loads((folder / MARKER).read_text()).get("complete", True):
            return None
    except (OSError, ValueError):  # no marker (not saving; rank > 0 may not see it yet), or half of one
        return None
    files = [p for p in folder.rglob("*") if p.is_file() and p.name != MARKER]
    chain, cause = [], error
    while cause is not None:
        chain.append(cause)
        cause = cause.__cause__ or cause.__context__
    said = " ".join(str(e) for e in chain)
    codes = {e.errno for e in chain if isinstance(e, OSError)}

    def reports(code: int) -> bool:  # (by errno, or in the words of a writer outside Python: safetensors)
        return code in codes or os.strerror(code) in said

    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0] if resource is not None else None
    if limit is not None and limit != resource.RLIM_INFINITY:
        at_limit = [p.name for p in files if p.stat().st_size >= limit]
        if at_limit or reports(errno.EFBIG):
            written = at_limit[0] if at_limit else f"a file of it (removed by its writer, which said: {error})"
            return (f"{written} reached this process's file-size limit of {limit:,} bytes (ulimit -f) while it was "
                    "written: raise the limit (`ulimit -f unlimited` in the shell that launches the run).")
    free = shutil.disk_usage(folder).free
    if free < FULL_DISK_BYTES or reports(errno.ENOSPC):
        last = f" (the last file written: {max(files, key=lambda p: p.stat().st_mtime).name})" if files else ""
        return (f"the disk holding it is full ({free:,} bytes free){last}: free space, keep fewer checkpoints "
                "(--save_total_limit N) or write them to a disk with room (--output_dir).")
    return None


# The settings a checkpoint's sharded state lets a resume change (with the global batch kept), and their names.
_RESHARDABLE = {"data_parallel_size": "DP degree", "cp_size": "CP degree", "world_size": "world size"}
# What decides the samples of each step: checked once the layout fits (`check_checkpoint`).
_BATCHES = ("global_batch_size", "world_batch_size")
# The settings `check_checkpoint` judges by a rule of their own, not by equality with the saved ones: a curriculum's
# schedule (first: one changed only from the checkpoint's step on resumes, `_schedule_change`) and the batches (last).
_OWN_RULES = ("cp_schedule", *_BATCHES)


def check_checkpoint(folder: str | Path, settings: dict[str, Any], marker: dict[str, Any] | None, *,
                     reshardable: bool = False) -> bool:
    """Raise ValueError, naming the cause, unless `folder` is a complete checkpoint saved with
    `settings`, as its `marker` (`read_marker`) says; warn when it has none (nothing can be checked).

    Returns whether the checkpoint loads from its sharded state (`resharding.resume.resharded_loading`):
    it holds one and this run trains with FSDP2 (`reshardable`). Such a checkpoint may then have been
    saved with another data-parallel or context-parallel degree (under a curriculum: another world size)
    as long as the global batch (every stage's) is the same: the CP degree decides how a sequence's
    attention is split over processes, not what it computes, so the model, optimizer and data order
    continue alike. So may a checkpoint saved without FSDP (DDP's or one process's, whose weights and optimizer
    state are whole) resumed without it. A run without FSDP2 is refused a sharded checkpoint (its optimizer state
    is there only), and an FSDP2 run one saved without FSDP (nothing there for FSDP to load)."""
    folder = Path(folder)
    if not folder.is_dir():
        # (the newest complete one: a newer folder a run stopped while saving would be refused in turn)
        near = newest_complete_checkpoint([folder.parent])[0] if folder.parent.is_dir() else None
        fix = (f"resume from one that does, e.g. the newest there: --resume_from_checkpoint {near}" if near else
               "give a checkpoint-N folder that a run saved in its --output_dir")
        raise ValueError(f"Checkpoint {str(folder)!r} does not exist: {fix}.")
    sharded = has_sharded_state(folder)
    if sharded and not reshardable:
        fsdp = "--fsdp with --fsdp_config '{\"fsdp_version\": 2}'"
        weights = (f"start a new run from its weights (--model_name_or_path {folder}: the optimizer and the schedule "
                   "start over)")
        world = settings.get("world_size", settings.get("cp_size", 1) * settings.get("data_parallel_size", 1))
        fix = (f"FSDP2 shards over 2 processes or more, and this run is one: resume on several with {fsdp}, or "
               f"{weights}" if world == 1 else f"Resume with {fsdp}, or {weights}")
        raise ValueError(f"Checkpoint {str(folder)!r} was saved by an FSDP2 run, which keeps the optimizer state as "
                         f"each rank held it (hf_sparse_cp_sharded_state/); only a run with FSDP2 loads it. {fix}.")
    if reshardable and not sharded and not any(p.name.startswith(FSDP_MODEL_NAME) for p in folder.iterdir()):
        raise ValueError(f"Checkpoint {str(folder)!r} was saved by a run without FSDP: it holds no FSDP state (neither "
                         f"{SHARDED_STATE}/ nor accelerate's {FSDP_MODEL_NAME}*), which this FSDP2 run loads the model "
                         "and optimizer from. Resume it without --fsdp, as it was saved, or start a new FSDP2 run from "
                         f"its weights (--model_name_or_path {folder}).")
    # (the checkpoint folders as get_last_checkpoint finds them: folders checkpoint-N)
    steps = [] if marker is not None else sorted(
        int(p.name.rsplit("-", 1)[1]) for p in folder.glob(PREFIX_CHECKPOINT_DIR + "-*")
        if p.name.rsplit("-", 1)[1].isdigit() and p.is_dir())
    if steps:  # (the Trainer's own error, raised on every rank, names no fix)
        newest = newest_complete_checkpoint([folder])[0]
        raise ValueError(f"{str(folder)!r} is a run's output folder, not a checkpoint: it holds checkpoints "
                         f"({', '.join(f'{PREFIX_CHECKPOINT_DIR}-{step}' for step in steps)}). "
                         + (f"Resume from one of them, e.g. the newest complete one: --resume_from_checkpoint {newest}."
                            if newest is not None else "None of them is complete (each saved in part): start anew."))
    if marker is None:
        logger.warning("Checkpoint %s was not written by an hf-sparse-cp run (no %s): resuming without checking "
                       "that it is complete and fits this run.", folder, MARKER)
        return sharded
    if not marker.get("complete"):
        raise ValueError(f"Checkpoint {str(folder)!r} is incomplete: the run ended while it was being saved. Resume "
                         "from an earlier checkpoint (resume_from_checkpoint=True takes the newest complete one).")
    for name, size in marker["files"].items():
        path = folder / name
        if not path.is_file() or path.stat().st_size != size:
            found = "missing" if not path.is_file() else f"{path.stat().st_size} bytes, saved with {size}"
            raise ValueError(f"Checkpoint {str(folder)!r} is damaged: {name} is {found}. Resume from another "
                             "checkpoint.")
    if marker.get("model_only"):
        raise ValueError(f"Checkpoint {str(folder)!r} was saved with --save_only_model: it holds the weights and the "
                         "step, not the optimizer, learning-rate schedule and random state, so a resume would go on "
                         "with a new optimizer and a restarted schedule. Start a new run from its weights "
                         f"(--model_name_or_path {folder}), or resume from a checkpoint saved without "
                         "--save_only_model.")
    saved = marker["settings"]
    if ("cp_schedule" in saved) != ("cp_schedule" in settings):
        # (their settings name other quantities: compared key by key, a curriculum's checkpoint under FSDP2 resumed
        # without its schedule skipped every check, the global batch among them)
        def run(s: dict) -> str:
            return f"--cp_schedule {s['cp_schedule']!r}" if "cp_schedule" in s else "no --cp_schedule"

        raise ValueError(f"Checkpoint {str(folder)!r} was saved by a run with {run(saved)}, but this run has "
                         f"{run(settings)}: a curriculum takes each step's samples by its stage, so the step counter, "
                         "schedule and data position of one cannot continue the other. Resume with the flags it was "
                         f"saved with, or start a new run from its weights (--model_name_or_path {folder}: the "
                         "optimizer and the schedule start over).")
    if "cp_schedule" in saved and saved["cp_schedule"] != settings["cp_schedule"]:
        why = _schedule_change(saved["cp_schedule"], settings["cp_schedule"], marker["step"])
        if why is not None:
            raise ValueError(f"Checkpoint {str(folder)!r} was saved at step {marker['step']} with --cp_schedule "
                             f"{saved['cp_schedule']!r}, but this run has {settings['cp_schedule']!r}: {why} Resume "
                             "with the schedule it was saved with, changing or adding only stages that start at step "
                             f"{marker['step']} or later, or start a new run from its weights (--model_name_or_path "
                             f"{folder}: the optimizer and the schedule start over).")
    # A state that does not depend on the processes (DDP's or one process's: the weights and optimizer whole in the
    # main process's files, every rank loading the same) continues at another degree as the sharded one does.
    whole = not sharded and _whole_state(folder)
    for key, value in settings.items():
        if key in _OWN_RULES or saved.get(key) == value or (key in _RESHARDABLE and (sharded or whole)):
            continue
        hint = ""
        if key in _RESHARDABLE:
            hint = (f" Another {_RESHARDABLE[key]} resumes from a checkpoint whose state is whole (saved without FSDP) "
                    "or saved with FSDP2 (--fsdp with --fsdp_config '{\"fsdp_version\": 2}', which saves its sharded "
                    "state) into a run with FSDP2; this one holds state laid out for its processes. Or start a new "
                    f"run from its weights (--model_name_or_path {folder}: the optimizer and the schedule start "
                    "over).")
        elif key == "smet":
            hint = _smet_flags(saved.get(key))
        raise ValueError(f"Checkpoint {str(folder)!r} was saved with {key}={saved.get(key)!r}, but this run has "
                         f"{key}={value!r}: resume with the settings it was saved with (a different "
                         f"parallel layout or SMET topology cannot continue it exactly).{hint}")
    # Last, once the layout fits: the fix it names is then all that is left (a marker written before the
    # global batch was recorded has none to compare).
    for key in _BATCHES:
        batch = settings.get(key)
        if batch is not None and saved.get(key, batch) != batch:
            raise ValueError(_other_global_batch(folder, saved[key], settings))
    return sharded


def _schedule_change(saved: str, now: str, step: int) -> str | None:
    """Why a run with the --cp_schedule `now` cannot continue exactly a checkpoint saved after `step` steps of one
    with `saved`, or None where it can: the stages that trained steps 0 to step - 1 are unchanged and every stage
    changed, added or removed starts at `step` or later. Each step's stage and samples (`StageBatchSampler`) follow
    from the stages up to its own (an epoch start too: from the samples the stages before it took), so the steps
    before the checkpoint are those `now` trains, and the steps after it those of an uninterrupted run of `now`."""
    old, new = parse_schedule(saved), parse_schedule(now)
    same = next((i for i, (a, b) in enumerate(zip(old, new)) if a.text != b.text), min(len(old), len(new)))
    differ = [(stages[same], whose) for stages, whose in ((old, "the saved schedule"), (new, "this run's"))
              if same < len(stages)]
    said = " and ".join(f"{stage.text} in {whose}" for stage, whose in differ)
    if any(stage.from_step is None for stage, _ in differ):  # (the data resolve it into a step: the marker says none)
        return (f"stage {same} differs ({said}) and starts at an epoch, which the data resolve into a step, so "
                "whether it starts after the checkpoint cannot be checked; write its start as a step.")
    first = min((stage.from_step for stage, _ in differ), default=step)
    if first < step:
        return (f"stage {same} differs ({said}) from step {first} on, before the checkpoint's step {step}: the steps "
                "before the checkpoint trained with the saved stages.")
    return None


def _whole_state(folder: Path) -> bool:
    """Whether the checkpoint `folder` holds its weights and optimizer whole, as the Trainer saves them without FSDP
    or DeepSpeed (whose shards, accelerate's FSDP files or `global_step*` folders, are laid out for the processes)."""
    names = [p.name for p in folder.iterdir()]
    return "optimizer.pt" in names and not any(n.startswith((FSDP_MODEL_NAME, "global_step")) for n in names)


def _other_global_batch(folder: Path, saved: int, settings: dict[str, Any]) -> str:
    """The refusal of another global batch, with per-device batch and accumulation flags that match it."""
    if "world_batch_size" in settings:
        dp, now, degree, launch = settings["world_size"], settings["world_batch_size"], "world size", "a world size"
        text = (f"Checkpoint {str(folder)!r} was saved with {saved} sequences per step at CP 1 (each stage's global "
                f"batch times its CP degree), but this run takes {now} (per_device_train_batch_size x "
                f"gradient_accumulation_steps x world size {dp}): step k would train on other samples than it did. ")
    else:
        dp, now = settings["data_parallel_size"], settings["global_batch_size"]
        degree, launch = "DP degree", "a DP degree (processes / --cp_size)"
        text = (f"Checkpoint {str(folder)!r} was saved with a global batch of {saved} sequences per step, but this "
                f"run has {now} (per_device_train_batch_size x gradient_accumulation_steps x DP degree {dp}): step k "
                "would train on other samples than it did. ")
    if saved % dp:
        return text + f"No per-device batch gives {saved} at {degree} {dp}: launch with {launch} that divides {saved}."
    return text + (f"Set --per_device_train_batch_size {saved // dp} --gradient_accumulation_steps 1 (or any "
                   f"pair whose product is {saved // dp}).")


def _smet_flags(saved: dict | None) -> str:
    """The flags that give a resume the SMET settings a checkpoint was saved with."""
    if saved is None:
        return " It was saved without SMET: drop --smet (and --smet_config)."
    # (a mode of one's own too: --smet_mode takes any mode registered when the flags parse, `registries.VariantFlag`)
    return (f" Resume with --smet --smet_mode {saved['mode']} --smet_density {saved['density']} --smet_block_size "
            f"{saved['block_size']} (flags beat a --smet_config file).")


def check_weights_fit(folder: Path, model: Any) -> None:
    """Raise ValueError, naming a weight and both shapes, when the checkpoint `folder`'s `model.safetensors` (or, under
    FSDP with a sharded state dict type, its sharded state: `_fsdp_state`) holds a weight of another shape than
    `model`'s of the same name: a checkpoint of another model (a PEFT model's: its base model, e.g. its vocabulary
    resized otherwise), which the Trainer's load refuses only with a traceback from every rank. (A checkpoint without
    them, e.g. a PEFT adapter's file, is left to the Trainer.)"""
    path = folder / "model.safetensors"
    if path.is_file():
        saved = _shapes(path)
    elif (state := _fsdp_state(folder)) is not None:
        saved = state[1]
    else:
        return
    adapters = set(getattr(model, "peft_config", ()))  # (an adapter's own tensors are `check_adapter_fits`'s)
    shapes = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()
              if not _is_adapter_tensor(name, adapters)}
    for name, shape in saved.items():
        if name in shapes and shapes[name] != shape:
            raise ValueError(f"Checkpoint {str(folder)!r} was saved by another model: its {name} is "
                             f"{list(shape)}, this model's {list(shapes[name])}. Resume with the model it was "
                             f"trained with (its config.json), or start a new run from its weights "
                             f"(--model_name_or_path {folder}).")


def check_adapter_fits(folder: Path, model: Any, marked: bool = True) -> None:
    """Raise ValueError, naming a tensor and the adapter settings saved, when `model` is a PEFT model whose adapter
    (the one the Trainer resumes, its first active one) has other tensors than the checkpoint `folder` saved: other
    target modules, rank or modules to save (TRL's --lora_target_modules, --lora_r). The Trainer's load refuses those
    only with a traceback from every rank (another rank: the adapter's "size mismatch"; another number of tensors: the
    optimizer's parameter groups; under FSDP2 with a sharded state dict type, a KeyError or a size mismatch), and
    resumes as many target modules as saved but other ones silently, with one tensor's optimizer state on another's.
    The saved tensors are read without loading them (`_saved_tensors`); a checkpoint holding no adapter file and no
    sharded state (the plugin's or accelerate's) is left to the Trainer.

    A checkpoint the plugin `marked` is refused too when PEFT was switched on or off since: the whole model's weights
    and no adapter resumed by a PEFT model (the Trainer loads no weight, then fails on the optimizer's parameter
    groups), an adapter and no whole model resumed by a model without one (the Trainer looks for a sharded model);
    under FSDP with a sharded state dict type, which saves neither, a sharded state (the plugin's, or accelerate's
    distributed checkpoint) of such other parameters (its load fails on a KeyError or a missing key)."""
    adapter = has_adapter(model)
    if marked:
        _check_peft_kept(folder, model, adapter)
    found = _saved_tensors(folder, model) if adapter else None
    if found is None:
        return
    where, saved, ours = found
    base = model.state_dict().keys()  # (a run that resized the vocabulary saves the base model's embedding weights too)
    # (PEFT names a module to save's copy as the base's module: one this run drops is in the base model but not in its
    # adapter; told from a resized vocabulary's embedding weights where it is no embedding)
    besides = [key for key in saved if key not in ours and key in base
               and where.name in (ADAPTER_SAFE_WEIGHTS_NAME, f"{FSDP_MODEL_NAME}_0")]
    embeddings = _embedding_weights(model)
    dropped = [key for key in besides if key not in embeddings]
    saved = {key: shape for key, shape in saved.items() if key in ours or key not in base or key in dropped}
    differ = ([f"its {key} is not in this run's adapter" for key in saved if key not in ours]
              + [f"this run's {key} is not in it" for key in ours if key not in saved]
              + [f"its {key} is {list(saved[key])}, this run's {list(ours[key])}" for key in saved
                 if key in ours and saved[key] != ours[key]])
    config_path = next((path / ADAPTER_CONFIG_NAME for path in (where.parent, folder)
                        if (path / ADAPTER_CONFIG_NAME).is_file()), None)
    saved_config = _saved_adapter_config(config_path) if config_path is not None else None
    if saved_config is not None:
        # (a module to save that this run drops: the filter above keeps its saved copy out, named as the base's module)
        modules = [sorted(set(c.get("modules_to_save") or ())) for c in (saved_config,
                                                                          model.peft_config[_adapter_name(model)]
                                                                          .to_dict())]
        if modules[0] != modules[1]:
            differ.append(f"its modules_to_save are {modules[0]}, this run's {modules[1]}")
    if not differ:
        return
    note = ""
    if saved_config is not None:
        flags, settings = _adapter_flags(saved_config), str(config_path)
    else:  # (FSDP with a sharded state dict type saves no adapter_config.json: its tensors show the LoRA settings)
        shown = f"{where.relative_to(folder)}{'/' * where.is_dir()}"
        settings = _lora_settings(saved)
        settings["modules_to_save"] = sorted({*settings["modules_to_save"], *(key.split(".")[-2] for key in dropped)})
        flags, settings = _adapter_flags(settings), f"as its {shown} shows"
        saved_embeddings = sorted(set(besides) - set(dropped))
        if saved_embeddings:  # (a module to save, or a resized vocabulary's: its tensors do not tell)
            note = (f"; its {', '.join(saved_embeddings)} too: --lora_modules_to_save "
                    f"{' '.join(key.split('.')[-2] for key in saved_embeddings)} where it was a module to save")
    raise ValueError(f"Checkpoint {str(folder)!r} holds a PEFT adapter with other tensors than this run's "
                     f"({len(differ)} differ; e.g. {differ[0]}): its optimizer state cannot continue this run's "
                     f"adapter. Resume with the adapter settings it was saved with ({settings}"
                     f"{'; TRL: ' + flags if flags else ''}{note}), or train from the start in a new --output_dir.")


def _adapter_name(model: Any) -> str:
    """The adapter of the PEFT model `model` that the Trainer resumes: its first active one."""
    active = model.active_adapters
    return (active() if callable(active) else active)[0]


def _embedding_weights(model: Any) -> set[str]:
    """The names in `model`'s state dict of its input and output embeddings' tensors (a targeted one's base layer's
    too)."""
    embeddings = {id(module) for module in (model.get_input_embeddings(), model.get_output_embeddings())
                  if module is not None}
    return {f"{name}.{key}" for name, module in model.named_modules() if id(module) in embeddings
            for key in module.state_dict()}


def _adapter_files(folder: Path) -> list[Path]:
    """The adapter weights files of the checkpoint `folder`, as the Trainer's load finds them: in the folder, or each of
    several adapters in its own subfolder (PEFT saves an adapter not named "default" there)."""
    return [p for d in (folder, *sorted(sub for sub in folder.iterdir() if sub.is_dir()))
            for p in (d / ADAPTER_SAFE_WEIGHTS_NAME, d / ADAPTER_WEIGHTS_NAME) if p.is_file()]


def _saved_tensors(folder: Path, model: Any) -> tuple[Path, dict[str, tuple[int, ...]],
                                                      dict[str, tuple[int, ...]]] | None:
    """Where the checkpoint `folder` holds the adapter that the PEFT model `model` resumes, with each tensor's shape
    there and in `model` under the same names; None where it holds none of them (or `model` is no `PeftModel` and the
    checkpoint has no sharded state). What the resume loads, read without loading a tensor: the plugin's sharded state
    (FSDP2: every parameter, by its name in the model, of which the adapter's are taken: `_is_adapter_tensor`), else
    the adapter's safetensors file (in its own subfolder where it has one) by PEFT's names
    (`get_peft_model_state_dict`), or, under FSDP with a sharded state dict type, accelerate's distributed checkpoint
    (its metadata): its optimizer state's parameters where it holds Adam's moments (by their names in the model: a
    module to save's copy is told from the base's), else the adapter by PEFT's names."""
    if has_sharded_state(folder):
        adapters = set(getattr(model, "peft_config", ()))
        saved = {name: shape for name, shape in _sharded_parameters(folder).items()
                 if _is_adapter_tensor(name, adapters)}
        ours = {name: tuple(p.shape) for name, p in model.named_parameters() if _is_adapter_tensor(name, adapters)}
        return folder / SHARDED_STATE, saved, ours
    peft = sys.modules["peft"]
    if not isinstance(model, peft.PeftModel):
        return None
    name = _adapter_name(model)
    files = {path.parent: path for path in _adapter_files(folder) if path.name == ADAPTER_SAFE_WEIGHTS_NAME}
    path = files.get(folder / name, files.get(folder))
    if path is not None:
        saved = _shapes(path)
    elif (state := _fsdp_state(folder)) is not None and all(key.startswith("base_model.") for key in state[1]):
        trained = _optimized_parameters(folder)  # (a whole model's state is `_check_peft_kept`'s)
        if trained is not None:
            return folder / f"{OPTIMIZER_NAME}_0", trained, {
                name: tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}
        path, saved = state
    else:
        return None
    # (PEFT's own choice of whether to save the embedding weights too may read the base model's config from the Hub)
    return path, saved, {key: tuple(tensor.shape) for key, tensor in
                         peft.get_peft_model_state_dict(model, adapter_name=name, save_embedding_layers=False).items()}


def _fsdp_state(folder: Path) -> tuple[Path, dict[str, tuple[int, ...]]] | None:
    """Where the checkpoint `folder`, saved under FSDP with a sharded state dict type (no weights file), holds the
    model's state, and each tensor's shape: the plugin's sharded state (every parameter, by its name in the model), else
    accelerate's distributed checkpoint (its metadata: a PEFT model's adapter by PEFT's names, or the whole model's
    state dict); None where it holds neither."""
    if has_sharded_state(folder):
        return folder / SHARDED_STATE, _sharded_parameters(folder)
    dcp = folder / f"{FSDP_MODEL_NAME}_0"
    return (dcp, _dcp_shapes(dcp)) if (dcp / ".metadata").is_file() else None


def _is_adapter_tensor(name: str, adapters: set[str]) -> bool:
    """Whether the model's parameter `name` is a tensor of one of the PEFT `adapters` (by their names): PEFT keeps each
    adapter's tensors (lora_A, lora_B, a module to save's copy, ...) under its name, `q_proj.lora_A.default.weight`,
    and the base weights it renames, which differ with the targets (`q_proj.base_layer.weight`, a module to save's
    `original_module`), under none."""
    return not adapters.isdisjoint(name.split("."))


def _sharded_parameters(folder: Path) -> dict[str, tuple[int, ...]]:
    """Each parameter the plugin's sharded state of the checkpoint `folder` holds, by its name in the model, with its
    shape."""
    return {name.split("/", 1)[1]: tuple(saved.shape) for name, saved in read_layout(folder / SHARDED_STATE)[1].items()
            if name.startswith("model/")}


def _check_peft_kept(folder: Path, model: Any, adapter: bool) -> None:
    """Raise ValueError, naming what the checkpoint `folder` holds and the fix, when a run with an `adapter` (PEFT)
    resumes one that holds the whole model's weights and no adapter, or a run without one a checkpoint that holds an
    adapter and not the whole model: its optimizer state is for other parameters than `model` trains."""
    adapters = _adapter_files(folder)
    whole = [name for name in (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME)
             if (folder / name).is_file()]
    if bool(adapters) != bool(whole):
        saved_adapter, holds = bool(adapters), str(adapters[0].relative_to(folder)) if adapters else whole[0]
    elif not adapters and (state := _fsdp_state(folder)) is not None:
        # (FSDP with a sharded state dict type saves neither: its sharded state's tensor names tell, a PEFT model's all
        # under `base_model.`; only where they are not this run's, which its load fails on with a KeyError)
        where, shapes = state
        names = set(shapes)
        if not names or names == {name for name, _ in model.named_parameters()}:
            return
        saved_adapter, holds = all(n.startswith("base_model.") for n in names), f"its parameters in {where.name}/"
    else:
        return
    if adapter and not saved_adapter:
        weights = (f" (--model_name_or_path {folder})" if whole else
                   ", the whole model its run saved in its --output_dir at the end (--model_name_or_path that folder)")
        raise ValueError(f"Checkpoint {str(folder)!r} holds the whole model's weights ({holds}) and no PEFT adapter: "
                         "it was saved by a run without PEFT, whose optimizer state is the whole model's, and this run "
                         "trains an adapter. Resume it without the adapter, as it was saved (TRL: without --use_peft), "
                         f"or train from the start in a new --output_dir: a new LoRA run may start from its weights"
                         f"{weights}.")
    if not adapter and saved_adapter:
        config = adapters[0].parent / ADAPTER_CONFIG_NAME if adapters else None
        settings = _saved_adapter_config(config) if config else _lora_settings(shapes)
        flags = " ".join(("--use_peft", _adapter_flags(settings) or "with its LoRA settings"))
        raise ValueError(f"Checkpoint {str(folder)!r} holds a PEFT adapter ({holds}) and not the whole model's "
                         "weights: it was saved by a PEFT run, whose optimizer state is the adapter's, and this run "
                         "trains the whole model. Resume it with the adapter it was saved with ("
                         f"{f'{config}; ' if config else ''}TRL: {flags}), or train from the start in a new "
                         "--output_dir.")


def _saved_adapter_config(config_path: Path) -> dict[str, Any]:
    """The saved adapter_config.json `config_path` ({} where there is none)."""
    return json.loads(config_path.read_text()) if config_path.is_file() else {}


def _adapter_flags(config: dict[str, Any]) -> str:
    """TRL's flags for the LoRA settings of a saved adapter `config` (adapter_config.json's; "" where it has none)."""
    targets = config.get("target_modules")  # (a list, saved from PEFT's set in any order; or a regex, a string)
    targets = " ".join(sorted(targets)) if isinstance(targets, list) else targets
    modules = " ".join(sorted(config.get("modules_to_save") or ())) or None
    flags = ("lora_target_modules", targets), ("lora_r", config.get("r")), ("lora_modules_to_save", modules)
    return " ".join(f"--{flag} {value}" for flag, value in flags if value is not None)


def _lora_settings(saved: dict[str, tuple[int, ...]]) -> dict[str, Any]:
    """The LoRA settings that `saved` tensors ({name: shape}, by PEFT's names or the model's) show, as
    adapter_config.json gives them: the target modules (those with a lora_A or lora_embedding_A), their rank where they
    share one, the modules to save (by the model's names only: PEFT's give a saved copy its base module's name)."""
    found: dict[str, dict[str, int]] = {"lora_A": {}, "lora_embedding_A": {}, "modules_to_save": {}}
    for name, shape in saved.items():
        segments = name.split(".")
        for part, modules in found.items():
            if part in segments[1:]:
                modules[segments[segments.index(part) - 1]] = shape[0]
    targets = {**found["lora_A"], **found["lora_embedding_A"]}
    ranks = set(targets.values())
    return {"target_modules": sorted(targets) or None, "r": ranks.pop() if len(ranks) == 1 else None,
            "modules_to_save": sorted(found["modules_to_save"])}


def _shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of the safetensors file `path`, read from its header."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as saved:
        return {name: tuple(saved.get_slice(name).get_shape()) for name in saved.keys()}


def _dcp_shapes(folder: Path, prefix: str = "model.") -> dict[str, tuple[int, ...]]:
    """The shape of each tensor of the state that accelerate saved as the distributed checkpoint `folder` (FSDP with a
    sharded state dict type: {"model": state dict}, or {"optimizer": {"state": ...}}) under `prefix`, by its name
    after it, read from its metadata."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    saved = FileSystemReader(str(folder)).read_metadata().state_dict_metadata
    return {name.removeprefix(prefix): tuple(meta.size) for name, meta in saved.items()
            if name.startswith(prefix) and isinstance(meta, TensorStorageMetadata)}


def _optimized_parameters(folder: Path) -> dict[str, tuple[int, ...]] | None:
    """The parameters whose optimizer state accelerate saved in the checkpoint `folder` as a distributed checkpoint
    (FSDP with a sharded state dict type), by their names in the model, each with its shape, that of Adam's first
    moment; None where there is none, or some parameter's state holds no first moment (another optimizer: its state's
    shapes need not be the parameter's)."""
    path = folder / f"{OPTIMIZER_NAME}_0"
    if not (path / ".metadata").is_file():
        return None
    state = _dcp_shapes(path, "optimizer.state.")
    names = {key.rpartition(".")[0] for key in state}
    if not names or any(f"{name}.exp_avg" not in state for name in names):
        return None
    return {name: state[f"{name}.exp_avg"] for name in sorted(names)}


# The transformers release whose Trainer resumes the optimizer of a run of several CPU processes: before it, it loads
# the state to `args.device`, which accelerate makes 'cpu:0' there, a location torch.load cannot restore ("don't know
# how to restore data location ... (tagged with cpu:0)", after the model has loaded).
CPU_PROCESSES_RESUME_SINCE = (5, 18)


def check_optimizer_resumable(trainer: Trainer) -> None:
    """Raise ValueError, naming the upgrade, where the installed transformers cannot load `trainer`'s optimizer state
    (several CPU processes before `CPU_PROCESSES_RESUME_SINCE`; FSDP loads it its own way)."""
    device, args = trainer.args.device, trainer.args
    if transformers_release() >= CPU_PROCESSES_RESUME_SINCE or args.world_size == 1 or device.type != "cpu" \
            or device.index is None or getattr(trainer, "is_fsdp_enabled", False):
        return
    since = ".".join(map(str, CPU_PROCESSES_RESUME_SINCE))
    raise ValueError(
        f"transformers {'.'.join(map(str, transformers_release()))} cannot resume the optimizer of a run of "
        f"{args.world_size} CPU processes: its Trainer loads the state to {str(device)!r}, which torch.load cannot "
        f"restore. Upgrade transformers to {since} or later (pip install 'transformers>={since}'), resume with FSDP "
        "(--fsdp, which loads the sharded state), or resume in one process.")


def _other_layout(saved: dict[str, Any], settings: dict[str, Any]) -> bool:
    """Whether a checkpoint saved with `saved` settings resumes at another CP / DP degree (world size) than
    `settings`'."""
    return any(key in saved and key in settings and saved[key] != settings[key] for key in _RESHARDABLE)


@contextlib.contextmanager
def first_rank_rng_loading(trainer: Trainer) -> Iterator[None]:
    """While it is open, a resume loads the random state (torch's, Python's, numpy's, the accelerator's) that the saved
    run's first process saved, on every process. The Trainer reads the file of its own process name (rng_state.pth in
    one process, rng_state_<rank>.pth in several), which a checkpoint saved at another CP or DP degree may not hold: it
    then resumed with the generators as the run's start left them, and a collator's crops or NEFTune's noise went on
    otherwise than the uninterrupted run's (#50). The first process's is every CP rank's (each step's batches start
    from the CP group's first rank's, `follow_first_ranks_generators`), and one process's."""
    compat_checks.require(f"transformers.Trainer.{compat.TRAINER_LOAD_RNG}")
    load = getattr(trainer, compat.TRAINER_LOAD_RNG)

    def load_first_ranks(checkpoint):
        saved = [] if checkpoint is None else [path for name in ("rng_state.pth", "rng_state_0.pth")
                                               if (path := Path(checkpoint) / name).is_file()]
        if not saved:
            return load(checkpoint)
        args = trainer.args
        name = f"rng_state_{args.process_index}.pth" if args.world_size > 1 else "rng_state.pth"
        with tempfile.TemporaryDirectory() as folder:  # (the Trainer's own loader, for every device's generator)
            shutil.copyfile(saved[0], os.path.join(folder, name))
            return load(folder)

    with temporarily(trainer, compat.TRAINER_LOAD_RNG, load_first_ranks):
        yield


def _as_flag(resume_from_checkpoint: str | bool | None) -> str | bool | None:
    """`--resume_from_checkpoint true` (or false) as the Trainer's `True` (`False`), unless a folder has that name: a
    script hands `train()` the string it parsed (`TrainingArguments.resume_from_checkpoint` is a str), which the Trainer
    took for a checkpoint's path (#50: "Checkpoint 'true' does not exist", where a requeued job's flag should take the
    newest complete checkpoint)."""
    if isinstance(resume_from_checkpoint, str) and resume_from_checkpoint.lower() in ("true", "false") and \
            not os.path.isdir(resume_from_checkpoint):
        return resume_from_checkpoint.lower() == "true"
    return resume_from_checkpoint


def protect_checkpoints(trainer: Trainer, parallel: ParallelDims, patches: PatchSet,
                        cp_schedule: str | None = None) -> None:
    """Mark the checkpoints `trainer` saves (with FSDP2, adding their sharded state) and check a checkpoint
    before `train()` resumes from it, resuming another DP or CP degree through the sharded state; recorded in
    `patches`. With `cp_schedule` (a curriculum's canonical text) the settings
    checked are the schedule and the world size instead of the CP and DP degrees."""
    callbacks = trainer.callback_handler.callbacks
    sharded_saving(trainer, patches)  # (its files are in the marker's list)
    defer_rotation(trainer, patches)
    marker = CheckpointMarkerCallback(trainer, parallel, cp_schedule)
    patches.insert(trainer.callback_handler, "callbacks", len(callbacks), marker)
    manager = next((c.jit_manager for c in callbacks if getattr(c, "jit_manager", None) is not None), None)
    if manager is not None:  # (--enable_jit_checkpoint) before the marker, whose on_step_end then sees the save
        agreed = AgreedJitCheckpoint(trainer)
        patches.set_attr(manager, "_enable_checkpoint", agreed.request)
        patches.insert(trainer.callback_handler, "callbacks", callbacks.index(marker), agreed)
    train = trainer.train

    @functools.wraps(train)
    def checked_train(resume_from_checkpoint=None, *args, **kwargs):
        resume_from_checkpoint = _as_flag(resume_from_checkpoint)
        folder = resume_from_checkpoint
        settings = run_settings(trainer, parallel, cp_schedule)
        try:
            with flag_errors():  # (a checkpoint that does not fit the run's flags: refused as a bad flag)
                if folder is True:  # (the newest complete checkpoint; refused where there is none)
                    folder = resume_from_checkpoint = resumed_folder(trainer.args.output_dir)
                marker = read_marker(folder) if folder else None  # (read once: checked, then resumed from)
                reshard = bool(folder) and check_checkpoint(folder, settings, marker,
                                                            reshardable=runs_fsdp2(trainer))
                if folder:
                    check_weights_fit(Path(folder), trainer.model)
                    check_adapter_fits(Path(folder), trainer.model, marked=marker is not None)
                if folder and not reshard:  # (a resharded resume takes the optimizer from the sharded state)
                    check_optimizer_resumable(trainer)
            if folder:
                resume_step_metrics(trainer, marker)
            with contextlib.ExitStack() as loading:
                if reshard:
                    loading.enter_context(resharded_loading(trainer))
                if marker is not None and _other_layout(marker.get("settings", {}), settings):
                    loading.enter_context(first_rank_rng_loading(trainer))
                # (a SMET state saved with other target modules, which the marker does not record, is refused as the
                # optimizer loads it: a bad flag too, not a traceback from every rank)
                loading.enter_context(flag_errors((SavedStateMismatch,)))
                return train(resume_from_checkpoint, *args, **kwargs)
        except Exception as e:
            saving = _saving_folder(trainer.args, trainer.state)
            why = failed_save(saving, e)
            if why is None:
                raise
            raise CheckpointSaveError(f"Saving checkpoint {str(saving)!r} failed: {why} Nothing before it is lost: "
                                      "the checkpoint is marked incomplete, which a resume refuses and "
                                      "resume_from_checkpoint=True passes over for the one before it.") from e

    patches.set_attr(trainer, "train", checked_train)
