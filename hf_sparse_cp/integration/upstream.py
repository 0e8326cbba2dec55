"""The calls through which the plugin uses upstream members that are private or differ between releases: each checks
its member first (`compat_checks.require`, which names the member, the versions and the fix) and reads it the way this
release has it. The members and why the plugin needs them are listed in `compat.PATCHES`."""

from __future__ import annotations

import functools
import inspect
from datetime import timedelta
from typing import Any, Literal

from .architectures import transformers_release
from .compat import ORDERED_EFFECTS_SINCE
from .compat_checks import member_name, release, require, versions


def token_count_divides_by_get_cp_size() -> bool:
    """Whether the Trainer's `num_items_in_batch` (gathered over every rank) divides by its `get_cp_size()`,
    as from transformers 5.19 on; before, by accelerate's `ParallelismConfig` sizes only."""
    return transformers_release() >= (5, 19)


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


def slice_logits_to_keep(hidden: Any, logits_to_keep: Any) -> Any:
    """The hidden states a causal LM's `lm_head` gets for `logits_to_keep`, as this release's models slice them:
    transformers' `slice_logits_to_keep` where it exists (5.24 adds 2D tensors: positions per row, or a boolean mask
    whose kept positions come out flattened to [N, H]), else the last `n` positions of an int or the positions of a
    1D tensor."""
    from transformers import modeling_utils

    stock = getattr(modeling_utils, "slice_logits_to_keep", None)
    if stock is not None:
        return stock(hidden, logits_to_keep)
    return hidden[:, slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep, :]


def cache_field() -> str:
    """The name of the KV-cache field of transformers' causal-LM outputs in this release."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    require("transformers.modeling_outputs.CausalLMOutputWithPast.cache")
    return member_name("transformers.modeling_outputs.CausalLMOutputWithPast.cache", CausalLMOutputWithPast)


def checkpointing_method(action: Literal["enable", "disable"] = "enable") -> str:
    """The model method that turns activation checkpointing on or off in this release: transformers 5.23 renamed
    `gradient_checkpointing_*` to `activation_checkpointing_*` (the old names stay as deprecated aliases)."""
    from transformers import PreTrainedModel

    name = f"activation_checkpointing_{action}"
    return name if hasattr(PreTrainedModel, name) else f"gradient_checkpointing_{action}"


def convolution_class() -> type:
    """torch's base class of every convolution module (private: `torch.nn.modules.conv._ConvNd`)."""
    require("torch.nn.modules.conv._ConvNd")
    from torch.nn.modules.conv import _ConvNd

    return _ConvNd


def unbacked_size(ctx: Any) -> Any:
    """A new unbacked size (a SymInt >= 0) in the shape environment of a custom op's fake implementation `ctx`
    (`torch.library.get_ctx()`), whether or not dynamo's capture_dynamic_output_shape_ops is set (torch's
    `ctx.new_dynamic_size` requires it; private `allocate_size`). Without a shape environment (a plain fake tensor
    mode), torch's own refusal."""
    require("torch._library.fake_impl.allocate_size")
    require("torch._library.fake_impl.FakeImplCtx._shape_env", ctx)
    from torch._library.fake_impl import allocate_size

    return ctx.new_dynamic_size() if ctx._shape_env is None else allocate_size(ctx._shape_env)


def register_ordered_effect(op: str) -> bool:
    """Make the custom op named `op` ('namespace::name', which returns nothing) an ordered side effect: the graphs
    torch.compile builds keep it in its place, where they would drop a pure op whose output no one reads (torch's
    private `_register_effectful_op`; no public way). Returns whether it did: a torch before `ORDERED_EFFECTS_SINCE`
    has no such registry, and the caller then keeps what the op does outside the graphs."""
    if release("torch") < ORDERED_EFFECTS_SINCE:
        return False
    require("torch.library._register_effectful_op")
    require("torch._library.effects.EffectType")
    from torch._library.effects import EffectType
    from torch.library import _register_effectful_op

    _register_effectful_op(op, EffectType.ORDERED)
    return True


def set_process_group_timeout(timeout: timedelta) -> None:
    """Make `timeout` the default process group's (torch's private `_set_pg_timeout`; no public setter)."""
    require("torch.distributed.distributed_c10d._set_pg_timeout")
    from torch.distributed.distributed_c10d import _set_pg_timeout

    _set_pg_timeout(timeout)


def default_store() -> Any:
    """The default process group's store (torch's private `_get_default_store`; no public getter)."""
    require("torch.distributed.distributed_c10d._get_default_store")
    from torch.distributed.distributed_c10d import _get_default_store

    return _get_default_store()


def attn_implementation(config: Any) -> str | None:
    """The attention implementation a transformers model config selects."""
    return getattr(config, "_attn_implementation", None)


def track_data_loader(accelerator: Any, data_loader: Any) -> None:
    """Register a data loader we prepared ourselves with `accelerator`, which saves and restores the
    state of the data loaders it tracks with checkpoints."""
    require("accelerate.Accelerator._dataloaders", accelerator)
    accelerator._dataloaders.append(data_loader)


def seed_workers_by(worker_init_fn: Any, rank: int) -> Any:
    """The Trainer's `worker_init_fn` (`partial(transformers.trainer_utils.seed_worker, ..., rank=...)`) seeding the
    workers as process `rank` would; any other function (or None) as given."""
    from transformers.trainer_utils import seed_worker

    if isinstance(worker_init_fn, functools.partial) and worker_init_fn.func is seed_worker \
            and "rank" in worker_init_fn.keywords:
        return functools.partial(seed_worker, *worker_init_fn.args, **{**worker_init_fn.keywords, "rank": rank})
    return worker_init_fn


# `accelerate.data_loader.prepare_data_loader` arguments a DP-only data loader sets itself; every other one
# is read from the accelerator (as its own `prepare_data_loader` passes them) or its `dataloader_config`.
_DP_LOADER_OWN = ("dataloader", "device", "num_processes", "process_index", "put_on_device", "slice_fn_for_dispatch",
                  "torch_device_mesh", "rng_types")


def dp_data_loader_options(accelerator: Any) -> dict[str, Any]:
    """The settings `accelerator.prepare_data_loader` passes to `accelerate.data_loader.prepare_data_loader`,
    read by the function's own parameter names (so an option a new accelerate adds is passed on too).
    Raises RuntimeError, naming it, for a parameter the accelerator does not hold under that name."""
    from accelerate.data_loader import prepare_data_loader

    options, config = {}, getattr(accelerator, "dataloader_config", None)
    for name in inspect.signature(prepare_data_loader).parameters:
        if name in _DP_LOADER_OWN:
            continue
        if hasattr(accelerator, name):
            options[name] = getattr(accelerator, name)
        elif config is not None and hasattr(config, name):
            options[name] = getattr(config, name)
        else:
            raise RuntimeError(
                f"accelerate.data_loader.prepare_data_loader takes {name!r}, which hf-sparse-cp finds neither on the "
                f"Accelerator nor on its dataloader_config. Installed: {versions('accelerate')}. Install an "
                "accelerate release in the tested range, or an hf-sparse-cp release that supports yours.")
    options["rng_types"] = list(accelerator.rng_types)
    return options
