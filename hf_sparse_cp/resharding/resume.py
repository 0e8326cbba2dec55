"""A Trainer's FSDP2 checkpoint as each rank holds it, resumed with any DP or CP degree (slice intersection).

The Trainer's own FSDP checkpoint (accelerate's) gathers the model and the optimizer state into whole
tensors on one process (`pytorch_model_fsdp.bin`, `optimizer.bin`): the optimizer's fp32 moments of a
multi-billion-parameter model in one process's memory, and a copy of the weights beside the
`model.safetensors` the Trainer writes anyway. With FSDP2, `sharded_saving` replaces that part of the
save: the model's parameters and the optimizer's state are written as each rank holds them
(`checkpoint.save_sharded_state`, in `SHARDED_STATE`), with the param groups'
hyperparameters (the scheduled learning rate among them) and the scheduler; the portable
`model.safetensors` stays. A resume into an FSDP2 run (`checkpoints.check_checkpoint` decides; the
global batch and SMET settings must match, the DP and CP degrees may differ) loads that state with
`load_sharded_state` into this run's FSDP2 shards (`load_resharded`); the scheduler, trainer state (step
counter) and data position load as in any resume. An optimizer whose state is not all tensors, or a run
that reloads its best checkpoint at the end (accelerate's loader reads it), keeps accelerate's save.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor, Replicate
from transformers import Trainer
from transformers.trainer import SCHEDULER_NAME

from ..distributed.comm import rank_and_world
from ..integration import compat, compat_checks
from ..integration.patching import PatchSet
from .boxes import TargetLayout
from .checkpoint import LAYOUT_FILE, load_sharded_state, save_sharded_state

logger = logging.getLogger(__name__)

SHARDED_STATE = "hf_sparse_cp_sharded_state"  # the checkpoint's subfolder
PARAM_GROUPS = "param_groups.pt"  # in it: the optimizer's param groups without their tensors


def runs_fsdp2(trainer: Trainer) -> bool:
    return bool(trainer.is_fsdp_enabled and getattr(trainer.accelerator, "is_fsdp2", False))


def has_sharded_state(folder: str | os.PathLike) -> bool:
    return (Path(folder) / SHARDED_STATE / LAYOUT_FILE).is_file()


def _ordered(optimizer) -> list[torch.nn.Parameter]:
    """The parameters in the order `state_dict()` numbers them."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def training_state(model: torch.nn.Module, optimizer) -> dict[str, torch.Tensor]:
    """{"model/NAME": parameter, "optim/INDEX/KEY": optimizer state tensor}: DTensors as FSDP2 holds them
    (a plain tensor, such as AdamW's step, held whole by every rank)."""
    state = {f"model/{name}": p.detach() for name, p in model.named_parameters()}
    for index, entries in optimizer.state_dict()["state"].items():
        for key, value in entries.items():
            if not torch.is_tensor(value):  # (it would be lost on a resharded resume)
                raise TypeError(f"optimizer state {key!r} of parameter {index} is a {type(value).__name__}, not a "
                                "tensor (the sharded state holds tensors only: AdamW's and SMET's are)")
            state[f"optim/{index}/{key}"] = value
    return state


def sharded_saving(trainer: Trainer, patches: PatchSet) -> None:
    """Under FSDP2, `trainer`'s checkpoints hold the model and optimizer state as each rank holds it
    instead of accelerate's gathered copies (see the module docstring); recorded in `patches`."""
    name = compat.TRAINER_SAVE_OPTIMIZER
    compat_checks.require(f"transformers.Trainer.{name}")
    original = getattr(trainer, name)

    def save(output_dir: str) -> None:
        if not runs_fsdp2(trainer) or trainer.args.load_best_model_at_end:
            return original(output_dir)
        try:
            tensors = training_state(trainer.model, trainer.optimizer)
        except TypeError as e:  # (the same on every rank: the optimizer's structure is)
            logger.warning("Checkpoint %s is saved by accelerate, gathered, and resumes only with its own DP and CP "
                           "degrees: %s.", output_dir, e)
            return original(output_dir)
        folder = Path(output_dir) / SHARDED_STATE
        save_sharded_state(tensors, folder, writes_layout=trainer.args.should_save)  # (each node's, save_on_each_node)
        if trainer.args.should_save:
            groups = [{k: v for k, v in g.items() if k != "params"}
                      for g in trainer.optimizer.state_dict()["param_groups"]]
            torch.save(groups, folder / PARAM_GROUPS)
            torch.save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))

    patches.set_attr(trainer, name, save)


def _targets(model: torch.nn.Module, optimizer, world: int):
    """(name, global meta tensor) -> where this run holds it: a parameter's and its optimizer state's on
    the parameter's FSDP2 mesh and placements; 0-dim state (a step counter) whole on every rank."""
    params, ordered = dict(model.named_parameters()), _ordered(optimizer)
    everywhere = TargetLayout(torch.arange(world), (Replicate(),))

    def target(name: str, tensor: torch.Tensor) -> TargetLayout:
        kind, key, *_ = name.split("/")
        param = params[key] if kind == "model" else ordered[int(key)]
        if tensor.dim() == 0 or not isinstance(param, DTensor):
            return everywhere
        mesh = param.device_mesh
        return TargetLayout(mesh.mesh, tuple(param.placements), mesh)

    return target


def load_resharded(folder: str | os.PathLike, model: torch.nn.Module, optimizer) -> None:
    """Load the sharded state of checkpoint `folder` (saved by any number of processes) into this run's
    FSDP2 `model` and `optimizer`; call on every rank."""
    _, world = rank_and_world()
    loaded = load_sharded_state(Path(folder) / SHARDED_STATE, _targets(model, optimizer, world))
    with torch.no_grad():
        for name, p in model.named_parameters():
            local = p.to_local() if isinstance(p, DTensor) else p
            value = loaded.pop(f"model/{name}")
            local.copy_(value.to_local() if isinstance(value, DTensor) else value)
    state: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in loaded.items():
        _, index, key = name.split("/")
        state.setdefault(int(index), {})[key] = value
    groups = torch.load(Path(folder) / SHARDED_STATE / PARAM_GROUPS, weights_only=True)
    current = optimizer.state_dict()["param_groups"]
    if len(groups) != len(current):
        raise ValueError(f"Checkpoint {str(folder)!r} has {len(groups)} optimizer param groups, this run "
                         f"{len(current)}: build the optimizer as the run that saved it did.")
    optimizer.load_state_dict({"state": state, "param_groups": [{**saved, "params": now["params"]}
                                                                for saved, now in zip(groups, current)]})


@contextlib.contextmanager
def resharded_loading(trainer: Trainer) -> Iterator[None]:
    """While it is open, `trainer.train(resume_from_checkpoint=...)` loads the model and optimizer from
    the checkpoint's sharded state, the scheduler from its own file. Replaces the Trainer's private
    `_load_from_checkpoint` and `_load_optimizer_and_scheduler` on the instance (`compat.py`):
    transformers offers no public hook for how a resume loads the model and optimizer (callbacks run
    after both are loaded)."""
    for name in (compat.TRAINER_LOAD_MODEL, compat.TRAINER_LOAD_OPTIMIZER):
        compat_checks.require(f"transformers.Trainer.{name}")

    def load_model(resume_from_checkpoint, model=None):
        pass  # the model is loaded with the optimizer, from the same sharded state

    def load_state(checkpoint):
        load_resharded(checkpoint, trainer.model, trainer.optimizer)
        trainer.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))

    patches = PatchSet()
    patches.set_attr(trainer, compat.TRAINER_LOAD_MODEL, load_model)
    patches.set_attr(trainer, compat.TRAINER_LOAD_OPTIMIZER, load_state)
    try:
        yield
    finally:
        patches.undo()
