"""Every private transformers / accelerate member the plugin touches, in one place, version-guarded.

The public APIs (`AttentionInterface.register`, `TrainerCallback`, `Accelerator.prepare_data_loader`,
...) carry most of the integration; a few things have no public hook yet, and this module is the
only place that names them. `PRIVATE_MEMBERS` lists each with what we use it for;
`check_private_members` verifies that each still exists with the parameters we rely on
(`tests/test_compat.py` runs it, so an upgrade that breaks one fails with the member's name), and
`require` does the same at the moment a feature needs one, raising an error that names the member,
the versions this code was written for, and what to do.
"""

from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any

# The releases this module was written and tested against (inclusive).
TESTED_VERSIONS = {"transformers": ("5.0", "5.24"), "accelerate": ("1.10", "1.15")}

# Names of the private methods the plugin replaces on a Trainer / Accelerator instance.
TRAINER_CP_INPUTS = "_prepare_context_parallel_inputs"
TRAINER_TRACK_TOKENS = "_track_num_input_tokens"
TRAINER_COUNT_ITEMS = "_get_num_items_in_batch"
ACCELERATOR_PREPARE_CP = "_prepare_cp"
TRAINER_COLLATOR_WITHOUT_UNUSED = "_get_collator_with_removed_columns"
TRAINER_LOAD_MODEL = "_load_from_checkpoint"
TRAINER_LOAD_OPTIMIZER = "_load_optimizer_and_scheduler"
TRAINER_SAVE_OPTIMIZER = "_save_optimizer_and_scheduler"


@dataclass(frozen=True)
class PrivateMember:
    """A private member: `owner` (a module or class, dotted), `name`, the parameters we call or
    replace it with (None: not a function), and why we touch it."""

    owner: str
    name: str
    parameters: tuple[str, ...] | None
    used_for: str
    on_instances: bool = False  # set in __init__, so only an instance has it

    @property
    def qualified(self) -> str:
        return f"{self.owner}.{self.name}"


PRIVATE_MEMBERS = (
    PrivateMember("transformers.Trainer", TRAINER_CP_INPUTS, ("self", "model", "inputs"),
                  "replaced per trainer: the Trainer's CP input preparation accepts SDPA only"),
    PrivateMember("transformers.Trainer", TRAINER_TRACK_TOKENS, ("self", "inputs"),
                  "wrapped per trainer: under CP every rank of a group counts the same batch"),
    PrivateMember("transformers.Trainer", TRAINER_COUNT_ITEMS, ("self", "batch_samples", "device"),
                  "wrapped per trainer before transformers 5.19: the loss's token count divides by the CP degree "
                  "there only when accelerate's ParallelismConfig sets one"),
    PrivateMember("transformers.Trainer", TRAINER_COLLATOR_WITHOUT_UNUSED, ("self", "data_collator", "description"),
                  "a cp_schedule's data loader drops the columns the model does not take, as the Trainer's does"),
    PrivateMember("transformers.Trainer", TRAINER_LOAD_MODEL, ("self", "resume_from_checkpoint", "model"),
                  "replaced per trainer while resuming FSDP2: the sharded state loads the model"),
    PrivateMember("transformers.Trainer", TRAINER_LOAD_OPTIMIZER, ("self", "checkpoint"),
                  "replaced per trainer while resuming FSDP2: the sharded state loads the optimizer"),
    PrivateMember("transformers.Trainer", TRAINER_SAVE_OPTIMIZER, ("self", "output_dir"),
                  "replaced per trainer under FSDP2: the sharded state instead of accelerate's gathered copies"),
    PrivateMember("accelerate.Accelerator", ACCELERATOR_PREPARE_CP, ("self", "*args"),
                  "replaced per accelerator: its CP model hooks drop the attention mask for SDPA"),
    PrivateMember("accelerate.Accelerator", "_dataloaders", None,
                  "a data loader prepared over the DP ranks only is registered for checkpointing", on_instances=True),
    PrivateMember("transformers.AttentionInterface", "_global_mapping", None,
                  "unpatch(): there is no public unregister"),
    PrivateMember("transformers.masking_utils.AttentionMaskInterface", "_global_mapping", None,
                  "unpatch(): there is no public unregister"),
    PrivateMember("transformers.loss.loss_utils", "LOSS_MAPPING", None,
                  "the lean loss applies only where a model uses the stock causal-LM loss"),
    PrivateMember("transformers.utils.generic", "can_return_tuple", ("func",),
                  "the lean-loss forward honours return_dict=False like the stock forwards"),
    PrivateMember("transformers.PretrainedConfig", "_attn_implementation", None,
                  "the attention implementation a model uses (model checks under CP)"),
)
_BY_NAME = {m.qualified: m for m in PRIVATE_MEMBERS}


def _resolve(dotted: str) -> Any:
    module, _, attr = dotted.rpartition(".")
    try:
        return importlib.import_module(dotted)
    except ImportError:
        return getattr(importlib.import_module(module), attr)


def _parameters(fn: Any) -> tuple[str, ...]:
    prefix = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    return tuple(prefix.get(p.kind, "") + p.name for p in inspect.signature(fn).parameters.values())


def _versions() -> str:
    found = []
    for package, (low, high) in TESTED_VERSIONS.items():
        version = getattr(importlib.import_module(package), "__version__", "?")
        found.append(f"{package} {version} (written for {low} to {high})")
    return ", ".join(found)


def problem(member: PrivateMember, instance: Any = None) -> str | None:
    """Why `member` cannot be used as the plugin uses it, or None. Instance members are checked on
    `instance` (skipped without one)."""
    if member.on_instances and instance is None:
        return None
    try:
        owner = instance if member.on_instances else _resolve(member.owner)
    except (ImportError, AttributeError) as e:
        return f"{member.owner} cannot be imported ({e})"
    if not hasattr(owner, member.name):
        return f"{member.qualified} no longer exists"
    if member.parameters is not None:
        found = _parameters(getattr(owner, member.name))
        if found != member.parameters:
            return f"{member.qualified} takes ({', '.join(found)}), not ({', '.join(member.parameters)})"
    return None


def check_private_members(instances: dict[str, Any] | None = None) -> list[str]:
    """One line per private member that changed: what changed, what the plugin uses it for, the
    installed and tested versions. `instances` maps an owner (e.g. "accelerate.Accelerator") to an
    object on which its instance members are checked."""
    instances = instances or {}
    lines = []
    for member in PRIVATE_MEMBERS:
        why = problem(member, instances.get(member.owner))
        if why is not None:
            lines.append(f"{why}; hf-sparse-cp uses it because {member.used_for}. Installed: {_versions()}.")
    return lines


def require(qualified: str, instance: Any = None) -> None:
    """Raise RuntimeError, naming the member, the versions and the fix, unless the private member
    `qualified` (e.g. "transformers.Trainer._track_num_input_tokens") is usable."""
    member = _BY_NAME[qualified]
    why = problem(member, instance)
    if why is not None:
        raise RuntimeError(
            f"{why}: hf-sparse-cp relies on it because {member.used_for}. Installed: {_versions()}. Install a "
            "transformers / accelerate release in the tested range, or an hf-sparse-cp release that supports yours."
        )


def token_count_divides_by_get_cp_size() -> bool:
    """Whether the Trainer's `num_items_in_batch` (gathered over every rank) divides by its `get_cp_size()`,
    as from transformers 5.19 on; before, by accelerate's `ParallelismConfig` sizes only."""
    import transformers
    from packaging.version import Version

    return Version(transformers.__version__).release >= (5, 19)


def unregister(interface: type, name: str) -> None:
    """Remove `name` from an `AttentionInterface`-style registry (no public unregister exists)."""
    interface._global_mapping.pop(name, None)


def stock_causal_lm_loss():
    """The loss function transformers' causal-LM models use by default."""
    from transformers.loss.loss_utils import LOSS_MAPPING

    return LOSS_MAPPING["ForCausalLM"]


def can_return_tuple(func):
    """transformers' decorator that turns a forward's output into a tuple when `return_dict=False`."""
    from transformers.utils.generic import can_return_tuple as decorator

    return decorator(func)


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a transformers model config selects."""
    return getattr(config, "_attn_implementation", None)


def track_data_loader(accelerator: Any, data_loader: Any) -> None:
    """Register a data loader we prepared ourselves with `accelerator`, which saves and restores the
    state of the data loaders it tracks with checkpoints."""
    require("accelerate.Accelerator._dataloaders", accelerator)
    accelerator._dataloaders.append(data_loader)
