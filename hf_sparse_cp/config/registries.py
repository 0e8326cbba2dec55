"""The registries of the variants a user can add (plug-ins): the one rule by which an entry joins a registry
(`register_in`) and the one by which a setting that names an entry is checked (`check_registered`), and the attention
engines' registry, which `hf_sparse_cp.attention.engines` fills (its built-in engines, then any `register_engine`
adds), kept here so that a config checks its attention_engine against it without importing the engines, which import
the config. (The budget modes' registry is in `sections.py`, the CP modes' in `hf_sparse_cp.distributed.modes.base`.)"""

from __future__ import annotations

import importlib
from collections.abc import Collection
from typing import Any

from .files import UnregisteredVariant, setting, value_text

# name -> engine (an `hf_sparse_cp.attention.engines.Engine`), in the order 'auto' walks them
ENGINES: dict[str, Any] = {}
BUILTIN_ENGINES = "hf_sparse_cp.attention.engines"  # the module that registers the built-in engines


def engine_settings() -> tuple[str, ...]:
    """The values `attention_engine` takes: 'auto' (chosen per call) and every registered engine's name. The
    built-in engines register when their module is imported, which this makes sure of (as `sections._registered`
    does for the budget modes)."""
    importlib.import_module(BUILTIN_ENGINES)
    return ("auto", *ENGINES)


def qualified_name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_in(registry: dict[str, Any], name: str, entry: Any, kind: str, attribute: str = "name") -> None:
    """Put `entry` (a class, or an instance) under `name` in `registry`, unless an entry of another class holds that
    name (ValueError naming both, and `attribute`, the entry's naming attribute, to change): neither a built-in variant
    nor a plug-in's is replaced by accident, while a class redefined under its name (a notebook's cell run again)
    replaces its earlier self. `kind`: what the registry holds, for the message ('cp_mode')."""
    held = registry.get(name)
    class_of = lambda x: x if isinstance(x, type) else type(x)  # noqa: E731
    if held is not None and qualified_name(class_of(held)) != qualified_name(class_of(entry)):
        raise ValueError(f"{kind} {name!r} is already registered ({qualified_name(class_of(held))}); give "
                         f"{class_of(entry).__qualname__} another `{attribute}`.")
    registry[name] = entry


def check_registered(name: str, value: Any, registered: Collection[str], own: str, register: str) -> None:
    """Raise ValueError, naming the registered values and how to add one, where setting `name` (a budget_mode, a
    cp_mode, an attention_engine) holds `value`, which is none of them (a list too: `in` would raise TypeError,
    unhashable; a name: `UnregisteredVariant`); worded as `check_field_types` words a value its Literal does not list.
    `own`: what the user adds ('a mode'), `register`: the call that registers it
    ('hf_sparse_cp.distributed.register_cp_mode(instance)')."""
    if not isinstance(value, str) or value not in registered:
        error = UnregisteredVariant if isinstance(value, str) else ValueError
        raise error(f"{setting(name, value)} ({type(value).__name__}) is not valid: use one of "
                    f"{', '.join(map(value_text, registered))} ({own} of your own: {register} first).")
