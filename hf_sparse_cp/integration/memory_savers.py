"""The memory savers (`hf_sparse_cp.memory.MemorySavers`) applied to a transformers model, reversibly.

`enable_memory_savers(model, savers)` replaces `forward` on module instances, each change recorded
on the model (`patching.record_on`); `disable_memory_savers(model)` restores them. A copy of the model
(pickle, `copy.deepcopy`) keeps them, each calling the copy's own module, and its record restores the copy:
* token tiles: the `mlp`, `input_layernorm` and `post_attention_layernorm` of every decoder layer and
  the decoder's final `norm` run through `tiled_rows`. Only classes known to treat every token on
  its own are tiled (`architectures.tileable_classes`); any other module there is refused, naming it.
* host offload: every decoder layer (a transformers `GradientCheckpointingLayer`) runs inside
  `HostOffload`, whose hooks see what the checkpoint saves of the call: the layer's inputs.
"""

from __future__ import annotations

import torch

from ..config.model_fields import decoder_layers
from ..memory.offload import HostOffload
from ..memory.savers import MemorySavers
from ..memory.tiling import tiled_rows
from . import upstream
from .architectures import tileable_classes
from .patching import record_on, undo_recorded

_FEATURE = "memory_savers"
_LAYER_MODULES = ("input_layernorm", "post_attention_layernorm", "mlp")


def layer_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every decoder layer's `mlp`, `input_layernorm` and `post_attention_layernorm` and of the
    decoder's final `norm`, of whatever class (the modules token tiles and the compiled fused ops take)."""
    names = {m: n for n, m in model.named_modules()}
    found = [getattr(layer, attr) for layer in decoder_layers(model) for attr in _LAYER_MODULES if hasattr(layer, attr)]
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model
    if isinstance(getattr(decoder, "norm", None), torch.nn.Module):
        found.append(decoder.norm)
    return [(names.get(m, "?"), m) for m in found if isinstance(m, torch.nn.Module)]


def rowwise_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(name, module) of every module the token tiles apply to (`layer_modules`). Raises ValueError when one of
    them is not of a class known to be row-wise (`architectures.tileable_classes`)."""
    rowwise, found = tileable_classes(), layer_modules(model)
    if not found:
        raise ValueError(f"{type(model).__name__} has no decoder layers with an `mlp` or RMSNorms to tile; turn "
                         "token tiles off (--sparse_token_tiling_min_length 0).")
    for name, m in found:
        if type(m).__name__ not in rowwise:
            raise ValueError(f"{name} is a {type(m).__name__}, not known to treat every token on its "
                             f"own (tiles take {sorted(rowwise)}); turn token tiles off "
                             "(--sparse_token_tiling_min_length 0).")
    return found


class ReplacedForward:
    """A module's replaced `forward`: an object bound to its module rather than a closure, so that a copy
    of the model (pickle, `copy.deepcopy`) gets its own, calling the copy's module, and its record undoes it."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        replaced = module.forward
        # A method of this module is kept as its function and bound at each call: a bound method is pickled as
        # `getattr(module, "forward")`, which could find this object once the module's attributes are restored.
        bound_here = getattr(replaced, "__self__", None) is module
        self._function = replaced.__func__ if bound_here else None
        self._replaced = None if bound_here else replaced

    @property
    def inner(self):
        """The forward this one replaced, when it was not a method of the module (another replaced forward)."""
        return self._replaced

    def replaced(self, *args, **kwargs):
        """The forward this one replaced."""
        if self._function is not None:
            return self._function(self.module, *args, **kwargs)
        return self._replaced(*args, **kwargs)


class _TiledForward(ReplacedForward):
    def __init__(self, module: torch.nn.Module, tile_tokens: int) -> None:
        super().__init__(module)
        self.tile_tokens = tile_tokens

    def __call__(self, hidden_states: torch.Tensor) -> torch.Tensor:
        params = [p for p in self.module.parameters() if p.requires_grad]
        return tiled_rows(self.replaced, hidden_states, params, self.tile_tokens)


class _OffloadingForward(ReplacedForward):
    def __init__(self, layer: torch.nn.Module, offload: HostOffload) -> None:
        super().__init__(layer)
        self.offload = offload

    def __call__(self, *args, **kwargs):
        layer = self.module
        if not (layer.training and torch.is_grad_enabled()):
            return self.replaced(*args, **kwargs)
        if not layer.gradient_checkpointing:
            raise ValueError("--sparse_offload_layer_inputs keeps the inputs that gradient checkpointing saves; turn "
                             "gradient checkpointing on (--gradient_checkpointing, or "
                             f"model.{upstream.checkpointing_method()}()).")
        with self.offload:
            return self.replaced(*args, **kwargs)


def enable_memory_savers(model: torch.nn.Module, savers: MemorySavers) -> None:
    """Apply `savers` to `model`; `disable_memory_savers(model)` undoes it. Raises ValueError when
    they are already enabled there, or when token tiles meet a module not known to be row-wise."""
    modules = rowwise_modules(model) if savers.tiled else []
    layers = decoder_layers(model) if savers.offload_layer_inputs else []
    if savers.offload_layer_inputs and not layers:
        raise ValueError(f"{type(model).__name__} has no transformers GradientCheckpointingLayer to offload the inputs "
                         "of; turn --sparse_offload_layer_inputs off.")
    patches = record_on(model, _FEATURE)
    for _, module in modules:
        patches.set_attr(module, "forward", _TiledForward(module, savers.tile_tokens))
    offload = HostOffload()
    for layer in layers:
        patches.set_attr(layer, "forward", _OffloadingForward(layer, offload))


def token_tiles_enabled(model: torch.nn.Module) -> bool:
    """Whether `enable_memory_savers` put `model`'s MLPs and RMSNorms into token tiles."""
    return any(isinstance(m.__dict__.get("forward"), _TiledForward) for m in model.modules())


def disable_memory_savers(model: torch.nn.Module) -> bool:
    """Undo `enable_memory_savers(model, ...)`; False when they were not enabled."""
    return undo_recorded(model, _FEATURE)
