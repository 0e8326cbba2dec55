"""`SMETAdam`'s state as a checkpoint holds it: each state tensor laid out like its parameter (`as_saved`), the
settings that fix the sparse state's shape recorded with it, and the checks loading makes before it takes a saved
state (`check_saved_groups`, `check_settings`, `check_names`, `loaded_state`), each naming the fix."""

from __future__ import annotations

from typing import Any

import torch

from .adam import DENSE_STATE
from .dtensor import like_param, local, local_rows_of
from .masks import BlockGrid

# The SMETConfig fields that fix the shape and meaning of the sparse state: `state_dict` records them
# in its SMET parameter groups as `smet_<field>`, and loading refuses a checkpoint where they differ.
STATE_FIELDS = ("mode", "density", "block_size")
# Where `state_dict` keeps `last_replaced_fraction` (in its SMET groups), so that a resumed run logs what the
# uninterrupted one logs until its next topology update.
REPLACED_KEY = "smet_last_replaced_fraction"


class SavedStateMismatch(ValueError):
    """A saved SMET state that does not fit this optimizer (saved by another optimizer, or with other settings, target
    modules or weights): the checkpoint's, which the message names the fix for, not a bug."""


def check_saved_groups(saved_groups: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """Refuse a saved optimizer state that SMET did not save, or whose parameter groups (`saved_groups`) hold other
    numbers of parameters than ours (`groups`), naming the fix."""
    if not any("smet" in saved for saved in saved_groups):
        # (a stock optimizer's state: its groups would be refused below as grouped otherwise, naming a wrong fix)
        raise SavedStateMismatch(
            "The checkpoint's optimizer state was not saved by SMET (its parameter groups carry no 'smet' flag: "
            "another optimizer saved it, e.g. torch's AdamW in a run without --smet), so it has no SMET masks "
            "or compact moments: resume that checkpoint without --smet, or start SMET from its weights without "
            "its optimizer state (load the model from the checkpoint folder, not resume_from_checkpoint)."
        )
    if len(saved_groups) != len(groups) or any(
        len(s["params"]) != len(g["params"]) for s, g in zip(saved_groups, groups)
    ):
        targets = _saved_targets(saved_groups)
        differ = targets and targets != _saved_targets(groups)  # (else: the same targets, another model)
        raise SavedStateMismatch(
            "The saved optimizer has a different parameter grouping "
            f"({[len(s['params']) for s in saved_groups]} vs "
            f"{[len(g['params']) for g in groups]} parameters per group); build the optimizer "
            "the same way (same model, same target_modules" + (
                f": the checkpoint's sparse weights are {targets}, e.g. --smet_target_modules {','.join(targets)}"
                if differ else "") + ") before loading."
        )


def check_settings(saved_group: dict[str, Any], settings: dict[str, Any]) -> None:
    """Refuse a saved SMET group whose recorded mode, density or block size differ from ours: its
    masks and compact moments would not fit (or, broadcast into our shapes, silently be wrong)."""
    differ = [
        f"{key.removeprefix('smet_')}={saved_group[key]!r} (this run: {value!r})"
        for key, value in settings.items()
        if key in saved_group and saved_group[key] != value
    ]
    if differ:
        raise SavedStateMismatch(
            f"The checkpoint's SMET optimizer state was saved with {', '.join(differ)}; resume with the same "
            "SMET settings (e.g. the same --smet_density and --smet_block_size), or start a new run from the "
            "saved model without its optimizer state."
        )


# Module names that wrappers insert in parameter names (torch.compile, FSDP1, activation checkpointing): a
# checkpoint saved with one of them names the same weights.
_WRAPPER_NAMES = {"_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"}


def _same_weight(saved: str, current: str) -> bool:
    """Whether two parameter names name the same weight of a model, one perhaps wrapped (`_WRAPPER_NAMES`, a
    leading `module.` of DDP, a prefix such as PEFT's `base_model.model.`)."""
    def plain(name: str) -> str:
        parts = [part for part in name.split(".") if part not in _WRAPPER_NAMES]
        return ".".join(parts[1:] if parts[:1] == ["module"] else parts)

    a, b = plain(saved), plain(current)
    return a == b or a.endswith(f".{b}") or b.endswith(f".{a}")


def check_names(saved_groups: list[dict[str, Any]], groups: list[dict[str, Any]]) -> None:
    """Refuse a saved state whose groups list other weights than ours where both record their names: weights of
    one shape (q_proj and o_proj of multi-head attention) would take each other's masks and moments unnoticed
    (a checkpoint saved with other target_modules)."""
    for saved, group in zip(saved_groups, groups):
        if not saved.get("param_names") or not group.get("param_names"):
            continue
        for old, new in zip(saved["param_names"], group["param_names"]):
            if not _same_weight(old, new):
                targets = _saved_targets(saved_groups)
                raise SavedStateMismatch(
                    f"The checkpoint's optimizer state was saved for {old} where this run has {new} "
                    f"({'sparse' if group['smet'] else 'dense'} parameters): resume with the same target_modules "
                    f"(the checkpoint's sparse weights: {targets}), e.g. --smet_target_modules {','.join(targets)}, "
                    "or start a new run from the saved model without its optimizer state."
                )


def _saved_targets(groups: list[dict[str, Any]]) -> list[str]:
    """The target names of the sparse weights that SMET `groups` (a saved state's, an optimizer's) list by name (empty
    where unnamed): a module's name for its `.weight`, a fused experts stack's own (`gate_up_proj`)."""
    return sorted({parts[-2] if parts[-1] == "weight" else parts[-1] for g in groups if g.get("smet")
                   for parts in [n.split(".") for n in g.get("param_names") or ()] if len(parts) > 1})


def loaded_state(param: torch.Tensor, saved: dict[str, Any], grid: BlockGrid | None,
                 slot_state: dict[str, torch.dtype]) -> dict[str, torch.Tensor]:
    """`param`'s state from its `saved` one, checked against the layout this run gives it: a sparse weight's (`grid`;
    None: a dense parameter) compact moments, block index and step counters and its mode's per-block `slot_state`."""
    shard = local(param)
    sparse = grid is not None
    if sparse:
        # (as saved: a stack's per-row states `[slices, rows per slice, ...]`, see `as_saved`)
        rows = (grid.slices, grid.slice_rows) if grid.stacked else (grid.rows,)
        block_shape = (*rows, grid.k, grid.block_size)
        expected = {
            "exp_avg": (block_shape, param.dtype),
            "exp_avg_sq": (block_shape, param.dtype),
            "block_index": (block_shape[:-1], grid.index_dtype),
            "block_step": (block_shape[:-1], torch.int32),
        }
        expected.update({name: (block_shape[:-1], dtype) for name, dtype in slot_state.items()})
    else:
        expected = {name: (tuple(shard.shape), param.dtype) for name in DENSE_STATE}
    missing = set(expected) - set(saved)
    if missing:
        raise SavedStateMismatch(
            f"Saved optimizer state lacks {sorted(missing)} for a {'sparse' if sparse else 'dense'} parameter; "
            "it was saved with another optimizer or SMET mode."
        )
    state = {"step": torch.as_tensor(float(saved["step"]), dtype=torch.float32)}
    for name, (shape, dtype) in expected.items():
        value = local_rows_of(param, saved[name])
        if tuple(value.shape) != tuple(shape):
            raise SavedStateMismatch(
                f"Saved SMET state {name!r} has local shape {tuple(value.shape)}, expected {tuple(shape)}: the "
                "checkpoint was written for weights of other shapes, or with another density or block_size; "
                "resume with the same model and SMET config."
            )
        state[name] = value.to(device=shard.device, dtype=dtype)
        if sparse and grid.stacked:
            state[name] = state[name].reshape(grid.rows, *shape[2:])
    if sparse and state["block_index"].numel():
        index = state["block_index"]
        if int(index.min()) < 0 or int(index.max()) >= grid.blocks_per_row:
            raise SavedStateMismatch("Saved SMET block index is out of range for this parameter; wrong checkpoint?")
    return state


def as_saved(param: torch.Tensor, value: torch.Tensor, grid: BlockGrid | None) -> torch.Tensor:
    """A state tensor as saved: laid out like `param` (`like_param`); a sparse stack's (`grid.stacked`) per-row
    states `[slices, rows per slice, ...]`, so that they shard as the stack does, by whole slices."""
    if value.dim() == 0:
        return value
    if value.dtype == torch.int16:
        # Collectives (gloo, NCCL) have no int16: checkpoints carry the block index as int32.
        value = value.to(torch.int32)
    if grid is not None and grid.stacked:
        value = grid.per_slice(value)
    return like_param(param, value)
