"""The sparse pattern each attention layer runs: the model's (`model_config_for`) and the layer's (`layer_config`),
parsed once and kept on the module (`parsed_layer`, read inside traces by `fresh_parsed_layer`), the refusal of a
layer that cannot read its own (`layer_settings_refusal`), and `forget_layer_state` to drop what the calls kept."""

from __future__ import annotations

import torch

from ..config import MODEL_CONFIG_ATTRIBUTE, SparseAttentionConfig, pattern_holders
from .compiled import layer_key, settings_key
from .stats import pop_kept_fractions

_LAYER_CONFIG = "_hf_sparse_cp_layer_config"
_LAYER_REFUSAL = "_hf_sparse_cp_layer_refusal"  # (why the parsed layer config is not its layer's: `parsed_layer`)


def model_config_for(module: torch.nn.Module) -> SparseAttentionConfig:
    """The sparse config stored on the module's model config (see `hf_sparse_cp.configure`), or the default."""
    return SparseAttentionConfig.stored_on(getattr(module, "config", None)) or SparseAttentionConfig()


def layer_config(module: torch.nn.Module) -> SparseAttentionConfig:
    """The config of this attention layer (`for_layer` of its model's config), parsed once and kept on
    the module for as long as the model config holds the same settings object (`parsed_layer`)."""
    return parsed_layer(module)[1]


def parsed_layer(module: torch.nn.Module) -> tuple:
    """(the model config's settings object, the layer's config, its `compiled.settings_key`, the module's
    `compiled.layer_key`, the module's id), parsed where `fresh_parsed_layer` finds none and kept on the module: a
    traced call reads these rather than parse them inside the trace."""
    cached = fresh_parsed_layer(module)
    if cached is None:
        model_cfg, layer_idx = model_config_for(module), getattr(module, "layer_idx", None)
        cfg = model_cfg.for_layer(layer_idx)
        raw = getattr(getattr(module, "config", None), MODEL_CONFIG_ATTRIBUTE, None)
        cached = (raw, cfg, settings_key(cfg), layer_key(module), id(module))
        module.__dict__[_LAYER_CONFIG] = cached
        module.__dict__[_LAYER_REFUSAL] = None if layer_idx is not None else _layerless_refusal(module, model_cfg)
    return cached


def _layerless_refusal(module: torch.nn.Module, model_cfg: SparseAttentionConfig) -> str | None:
    """Why a module without `layer_idx` cannot run its layer's pattern: the pattern differs between layers
    (dense_first_layers, layer_overrides), which every such layer would ignore, running the pattern's base; None
    where every layer runs one pattern."""
    if len(model_cfg.layer_configs()) == 1:
        return None
    return (f"this attention layer ({type(module).__name__}) has no `layer_idx`, which sparse_cp reads to give each "
            f"layer its pattern: with dense_first_layers={model_cfg.dense_first_layers} and layer_overrides="
            f"{model_cfg.layer_overrides} every such layer would run the pattern's base settings instead. Set "
            "self.layer_idx (the layer's index among the decoder layers) in its __init__, as transformers' attention "
            "layers do, or configure a pattern that is one for every layer (dense_first_layers=0, no "
            "layer_overrides).")


def configless_refusal(module: torch.nn.Module) -> str | None:
    """Why a module without `config` cannot run the configured pattern (None where it has one): the pattern is
    stored on the model's config (`configure`), which the backend reads through the module's."""
    if getattr(module, "config", None) is not None:
        return None
    return (f"this attention layer ({type(module).__name__}) has no `config`, through which sparse_cp reads the "
            "pattern that hf_sparse_cp.configure stores on the model's config: it would run the default pattern, not "
            "the one configured. Keep the model's config on the attention module (self.config = config in its "
            "__init__), as transformers' attention layers do.")


def layer_settings_refusal(module: torch.nn.Module) -> str | None:
    """Why `module`'s calls cannot run its layer's configured pattern (`configless_refusal`,
    `_layerless_refusal`), or None. Parses the layer's config where it is not parsed yet (`parsed_layer`)."""
    refusal = configless_refusal(module)
    if refusal is None:
        parsed_layer(module)
        refusal = module.__dict__.get(_LAYER_REFUSAL)
    return refusal


def fresh_parsed_layer(module: torch.nn.Module) -> tuple | None:
    """What `parsed_layer` kept on the module, or None where its model config holds settings it has not parsed, or
    where the module is a copy (`copy.deepcopy`) holding its original's (whose layer key names the original). Read
    inside a trace (dynamo guards on the settings object, the kept one and the module: other settings trace again),
    where parsing would take dynamo through json and the config's validation (torch 2.11's dynamo also refuses a
    module as the argument of a function it would call at trace time, `torch.compiler.assume_constant_result`)."""
    raw = getattr(getattr(module, "config", None), MODEL_CONFIG_ATTRIBUTE, None)
    cached = module.__dict__.get(_LAYER_CONFIG)
    return None if cached is None or cached[0] is not raw or cached[4] != id(module) else cached


def parse_layer_configs(model: torch.nn.Module) -> None:
    """Parse the layer config of every module of `model` whose config holds the pattern's settings (`parsed_layer`),
    as a change of the settings (`registration.store_pattern`) does: a compiled model's next trace finds them parsed
    (a layer it finds unparsed runs outside the graph once, `_traced_call`)."""
    holders = [id(holder) for holder in pattern_holders(model.config)]
    for module in model.modules():
        if id(getattr(module, "config", None)) in holders:
            parsed_layer(module)


def forget_layer_state(model: torch.nn.Module) -> None:
    """Drop what the backend's calls keep on `model`'s attention modules (each layer's parsed config, its kept
    fractions no log has read): undoing the switch to the backend leaves the modules as they were."""
    pop_kept_fractions(model)
    for module in model.modules():
        module.__dict__.pop(_LAYER_CONFIG, None)
        module.__dict__.pop(_LAYER_REFUSAL, None)
