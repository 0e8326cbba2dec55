"""What the backend takes in a composite model (a vision-language model: a language model beside vision or audio
towers): the language model only. The towers (SigLIP, CLIP, Qwen2-VL's vision transformer, Mllama's vision model)
attend bidirectionally over their patches, which sparse_cp does not compute; transformers selects an attention
implementation per sub-config (`PreTrainedModel.set_attn_implementation` with a dict), so they keep theirs.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch

from ..config import language_config

# What a tower that was on the backend itself runs instead (the backend computes causal attention only).
TOWER_FALLBACK = "sdpa"

# The `base_config_key` of the sub-configs of a composite model's towers (transformers' names).
TOWER_CONFIG_KEYS = ("vision_config", "audio_config")
# The tower (its key in `TOWER_CONFIG_KEYS`) of a model that takes each of transformers' `input_modalities`.
_TOWER_OF_MODALITY = {"image": "vision_config", "video": "vision_config", "audio": "audio_config"}


def _input_modalities(config: Any) -> set[str]:
    """The `input_modalities` transformers declares for the models of `config`'s class, read from its modeling module
    (the sibling of its configuration module, which a model built from it has imported) among the names it exports
    (its `__all__`: a trace of the attention call reads them, and dynamo breaks the graph on a module's logger);
    empty where none is."""
    module = sys.modules.get(type(config).__module__.replace(".configuration_", ".modeling_"))
    found: set[str] = set()
    for name in getattr(module, "__all__", ()) if module is not None else ():
        value = getattr(module, name, None)
        if isinstance(value, type) and getattr(value, "config_class", None) is type(config):
            modalities = getattr(value, "input_modalities", ())
            found.update((modalities,) if isinstance(modalities, str) else modalities)
    return found


def tower_key(config: Any) -> str | None:
    """The key of the composite model's tower (one of `TOWER_CONFIG_KEYS`) whose config `config` is: its
    `base_config_key`, or for a config without one (a composite holds Pixtral's under Mistral 3, Gemma 3n's audio tower
    and Voxtral's encoder under AutoConfig sub-configs, which give them none) the tower of the inputs its models take
    (`input_modalities`: images, video or audio, no text); None for another config (a language model's, a
    composite's own)."""
    key = getattr(config, "base_config_key", None)
    if key in TOWER_CONFIG_KEYS:
        return key
    if config is None or key:
        return None
    modalities = _input_modalities(config)
    if not modalities or "text" in modalities:
        return None
    return next((_TOWER_OF_MODALITY[m] for m in ("audio", "image", "video") if m in modalities), None)


def tower_refusal(config: Any, what: str) -> str | None:
    """The refusal of `what` (e.g. 'this layer (CLIPAttention, model type 'clip_vision_model')') of a composite
    model's vision or audio tower on the backend (`tower_key`), naming the switch that keeps the towers off it; None
    for another config."""
    tower = tower_key(config)
    if tower is None:
        return None
    return (f"sparse_cp computes a language model's causal self-attention, but {what} is in the model's "
            f"{tower.removesuffix('_config')} tower, which attends over its own inputs as a whole; switch the "
            "language model alone: hf_sparse_cp.configure(model) or --sparse_attention (its towers keep their "
            f"attention), or load the model with attn_implementation={{'text_config': 'sparse_cp', '{tower}': "
            "'sdpa'} (a tower loaded alone: attn_implementation='sdpa').")


def _sub_configs(config: Any) -> dict[str, Any]:
    """The sub-configs `config` holds (its `sub_configs` keys that are set), by key."""
    keys = getattr(config, "sub_configs", None) or {}
    return {key: sub for key in keys if (sub := getattr(config, key, None)) is not None and sub is not config}


def _holds(config: Any, text: Any) -> bool:
    """Whether `config` is the text config `text` or holds it among its sub-configs (at any depth)."""
    return config is text or any(_holds(sub, text) for sub in _sub_configs(config).values())


def backend_selection(config: Any, backend: str) -> str | dict:
    """The argument of `set_attn_implementation` that selects `backend` for a model of `config` and its language
    model (`language_config`), each tower keeping its implementation ('sdpa' for one that was on `backend`): the
    name itself for a model without towers."""
    text = language_config(config)
    return _selection(config, text, backend) if config is not text and _holds(config, text) else backend


def _selection(config: Any, text: Any, backend: str) -> str | dict:
    """`backend_selection` of `config`, which holds the text config `text`."""
    if config is text:
        return backend
    selection: dict[str, Any] = {"": backend}
    for key, sub in _sub_configs(config).items():
        if _holds(sub, text):
            selection[key] = _selection(sub, text, backend)
        else:
            impl = getattr(sub, "_attn_implementation", None)
            selection[key] = TOWER_FALLBACK if impl == backend else impl
    return selection


def implementations(config: Any, inherited: str | None = None) -> str | dict | None:
    """The argument of `set_attn_implementation` that restores the implementation of `config` and of each of its
    sub-configs (the name alone for a config without sub-configs). A sub-config that has none (MPT's attn_config,
    which no module of the model reads) takes its parent's: transformers refuses to restore None ('Specified
    `attn_implementation="None"` is not supported'), which hid the refusal of the switch it undid."""
    own = getattr(config, "_attn_implementation", None) or inherited
    subs = {key: implementations(sub, own) for key, sub in _sub_configs(config).items()}
    return {"": own, **subs} if subs else own


@contextlib.contextmanager
def switched_to(model: torch.nn.Module, backend: str) -> Iterator[None]:
    """`model` switched to `backend` inside the block as `backend_selection` switches it, its implementations
    (`implementations`) restored after."""
    previous = implementations(model.config)
    model.set_attn_implementation(backend_selection(model.config, backend))
    try:
        yield
    finally:
        if previous is not None and implementations(model.config) != previous:
            model.set_attn_implementation(previous)


def tower_names(model: torch.nn.Module) -> list[str]:
    """The names of `model`'s towers: the transformers models inside it whose config neither is the model's nor
    holds its text config (their modules keep their own attention)."""
    from transformers import PreTrainedModel

    config = getattr(model, "config", None)
    if config is None:
        return []
    text = language_config(config)
    return [name for name, module in model.named_modules()
            if name and isinstance(module, PreTrainedModel) and module.config is not config
            and not _holds(module.config, text)]


def in_tower(name: str, towers: list[str]) -> bool:
    """Whether the module `name` (of the model `tower_names` read) is one of the towers or inside one."""
    return any(name == tower or name.startswith(f"{tower}.") for tower in towers)
