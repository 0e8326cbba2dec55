"""The arguments of a public entry point checked for their type, before anything reads them: a wrong one
(a hub id, None, a model's config, a torch module without a transformers config, a model where a Trainer goes,
None or a mapping where a config goes) raised an AttributeError or a ValueError deep inside (`'str' object has
no attribute 'config'`); it is a TypeError naming what to pass."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from transformers import PretrainedConfig


def _what(value: Any) -> str:
    return "None" if value is None else _a(type(value).__name__)


def _a(name: str) -> str:
    return f"{'an' if name[0].lower() in 'aeiou' else 'a'} {name}"


def require_model(model: Any, call: str) -> None:
    """Raise TypeError, naming what to pass, unless `model` is a transformers model (a torch module with a
    transformers config). `call` names the entry point as the user wrote it, e.g. 'configure(model, ...)'."""
    if isinstance(model, torch.nn.Module) and isinstance(getattr(model, "config", None), PretrainedConfig):
        return
    from transformers import Trainer  # (here: the model path imports no Trainer)

    if isinstance(model, str):
        fix = f"load it first, e.g. AutoModelForCausalLM.from_pretrained({model!r}), and pass the model"
    elif isinstance(model, PretrainedConfig):
        fix = "that is a model's config: build the model, e.g. AutoModelForCausalLM.from_config(config), and pass it"
    elif isinstance(model, Trainer):
        fix = "pass the Trainer's model (trainer.model)"
    elif isinstance(model, torch.nn.Module):
        fix = "a torch module without a transformers config: pass a transformers model (a PreTrainedModel)"
    else:
        fix = "pass a transformers model (a PreTrainedModel, e.g. from AutoModelForCausalLM.from_pretrained)"
    raise TypeError(f"{call}: model must be a transformers model, not {_what(model)}: {fix}.")


def require_trainer(trainer: Any, call: str) -> None:
    """Raise TypeError, naming what to pass, unless `trainer` is a transformers Trainer (or a subclass: TRL's, the
    plugin's). `call` names the entry point, e.g. 'attach_to_trainer(trainer, ...)'."""
    from transformers import Trainer

    if isinstance(trainer, Trainer):
        return
    model = isinstance(trainer, torch.nn.Module)
    raise TypeError(f"{call}: trainer must be a transformers Trainer (or a subclass of it: TRL's, SparseTrainer), not "
                    f"{_what(trainer)}: build the Trainer first and pass it"
                    + ("; a model alone takes hf_sparse_cp.configure or enable_sparse_attention." if model else "."))


def require_subclass(base: Any, parent: type, call: str, example: str) -> None:
    """Raise TypeError, naming what to pass, unless `base` is `parent` or a class derived from it (`example` names
    such classes, e.g. "TrainingArguments, or TRL's SFTConfig")."""
    if isinstance(base, type) and issubclass(base, parent):
        return
    got = (f"an instance of {type(base).__name__}: pass its class, type(...)" if isinstance(base, parent) else
           f"the class {base.__name__}" if isinstance(base, type) else _what(base))
    raise TypeError(f"{call}: base must be {parent.__name__} or a class derived from it ({example}), not {got}.")


def require_instance(value: Any, expected: type, call: str, name: str, example: str) -> None:
    """Raise TypeError, naming what to pass (`example`, e.g. 'SMETConfig(density=0.1)'), unless `value`, the
    argument `name` of `call`, is an `expected` (a config or the plugin's arguments)."""
    if isinstance(value, expected):
        return
    fix = f"pass one, e.g. {example}"
    if isinstance(value, Mapping) and hasattr(expected, "from_dict"):
        fix = f"build it from the mapping with {expected.__name__}.from_dict(...)"
    raise TypeError(f"{call}: {name} must be {_a(expected.__name__)}, not {_what(value)}: {fix}.")
