"""The registries of the variants a user can add (plug-ins): the one rule by which an entry joins a registry
(`register_in`), the one by which a setting that names an entry is checked (`check_registered`), a registry of
named instances (`NamedInstances`: the CP modes', the SMET modes'), and the attention
engines' registry, which `hf_sparse_cp.attention.engines` fills (its built-in engines, then any `register_engine`
adds), kept here so that a config checks its attention_engine against it without importing the engines, which import
the config. (The budget modes' registry is in `sections.py`, the CP modes' in `hf_sparse_cp.distributed.modes.base`, the
SMET modes' in `hf_sparse_cp.smet.modes.base`.) `Variants`: a registry as a setting that selects one of its entries
reads it, the setting's command-line flag too (`VariantFlag`)."""

from __future__ import annotations

import argparse
import importlib
from collections.abc import Callable, Collection
from dataclasses import dataclass
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


def is_plugin(entry: Any) -> bool:
    """Whether `entry` (a variant: a class, or an instance) is a user's, defined outside this package: what the
    package's own variants hold by construction (tested) is checked on a plug-in's only, and a plug-in is named where
    it would read as the built-in variant it subclasses."""
    cls = entry if isinstance(entry, type) else type(entry)
    return not cls.__module__.startswith("hf_sparse_cp.")


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


@dataclass(frozen=True)
class Variants:
    """What a setting that selects a registered variant (`cp_mode`, `budget_mode`, `attention_engine`, a SMET `mode`)
    takes: the names `names()` gives when asked (the registry as it is then), checked by `check`; `own` and `register`
    as `check_registered` takes them. `flag()`: the metadata that makes the setting's field, as a command-line flag,
    read the registry too (`VariantFlag`)."""

    names: Callable[[], Collection[str]]
    own: str
    register: str

    def check(self, name: str, value: Any) -> None:
        """Refuse `value` of setting `name` unless it names a registered variant (`check_registered`)."""
        check_registered(name, value, self.names(), self.own, self.register)

    def flag(self) -> dict[str, Any]:
        """The entries of the field's metadata that HfArgumentParser (transformers', TRL's copy) hands its flag's
        `add_argument`: `VariantFlag` as its action, reading this registry."""
        return {"action": VariantFlag, "variants": self}


class VariantFlag(argparse._StoreAction):  # (argparse's 'store', HfArgumentParser's default)
    """The action of a flag that selects a registered variant (`--cp_mode`, `--sparse_budget_mode`,
    `--sparse_attention_engine`, `--smet_mode`; its field's metadata gives it: `Variants.flag`).

    HfArgumentParser makes a Literal field's flag take its Literal's values alone (argparse `choices`): the built-in
    variants, which the field lists for typing and the flag reference, while a config file or code may name any
    registered one. This action reads the registry as the command line parses instead: a variant the script registered
    on import, before its parser parses, is taken, one nobody registered is refused naming the registered ones and how
    to register one (`check_registered`'s words), and `--help` lists the registered ones (`{ring,ulysses,hybrid,...}`).

    A parser that only splits a command line into flags and their values, which a launcher reads before the script runs
    (so before it registers anything), sets `checks_variants = False`: the value is checked where the script's parser
    reads it. A parser whose flags are read before the script runs sets `unregistered_note`: what its refusal adds
    (where the flag goes instead)."""

    def __init__(self, option_strings: list[str], dest: str, variants: Variants, choices: Any = None,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)  # (`choices`, the Literal's: the registry says, below)
        self.variants = variants

    @property
    def metavar(self) -> str:
        """`{ring,ulysses,hybrid}`, as argparse shows `choices`: every variant registered when `--help` prints."""
        return "{" + ",".join(self.variants.names()) + "}"

    @metavar.setter
    def metavar(self, value: Any) -> None:  # (argparse's `metavar` keyword: the registry's names stand)
        pass

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        if getattr(parser, "checks_variants", True):
            try:
                self.variants.check(self.dest, values)
            except ValueError as e:  # (argparse's error: the usage and one line, status 2)
                raise argparse.ArgumentError(self, f"{e}{getattr(parser, 'unregistered_note', '')}") from None
        super().__call__(parser, namespace, values, option_string)


class NamedInstances:
    """A registry of plug-in instances by their `name` (the CP modes, the SMET modes), in registration order:
    `register` takes an instance of `base` with a name (`register_in`'s rule for a name already held), `named` gives
    the one a setting names, refusing an unknown name with the registered ones.

    Args:
        base: the class every entry subclasses; `public`: where users import it ('hf_sparse_cp.smet.SMETMode').
        kind: what the registry holds, as its setting says it ('cp_mode', 'SMET mode').
        selects: the setting whose value selects an entry ('the --cp_mode value').
        register: the registering function's public name ('hf_sparse_cp.smet.register_smet_mode').
        duties: what a subclass must do besides its name ('its `help`, implement its abstract methods').
        check: what else an entry must hold, checked once it has a name (raises naming the fix), or None.
    """

    def __init__(self, base: type, public: str, kind: str, selects: str, register: str, duties: str,
                 check: Callable[[Any], None] | None = None) -> None:
        self._entries: dict[str, Any] = {}
        self.base, self.public, self.kind, self.selects, self.register_name, self.duties, self.check = (
            base, public, kind, selects, register, duties, check)

    def register(self, entry: Any) -> Any:
        """Add `entry` (see the class); returns it."""
        cls = self.base.__name__
        if not isinstance(entry, self.base):
            raise TypeError(f"{self.register_name.rsplit('.', 1)[-1]} takes an instance of a {cls} subclass "
                            f"({self.public}), not {type(entry).__name__} {entry!r}: subclass {cls}, set its `name`, "
                            f"{self.duties}, and register an instance.")
        name = getattr(entry, "name", None)
        if not isinstance(name, str) or not name:
            raise ValueError(f"{type(entry).__name__} has no `name` (a class attribute, {self.selects} that selects "
                             "it): set one before registering it.")
        if self.check is not None:
            self.check(entry)
        register_in(self._entries, name, entry, self.kind)
        return entry

    def named(self, name: str) -> Any:
        """The entry registered as `name`; ValueError naming the registered ones otherwise."""
        if not isinstance(name, str) or name not in self._entries:  # (a list: `in` a TypeError, unhashable)
            raise ValueError(f"{self.kind}={name!r} is unknown; use one of {', '.join(map(repr, self._entries))} (a "
                             f"mode of your own: {self.register_name}(instance) first).")
        return self._entries[name]

    def entries(self) -> tuple[Any, ...]:
        """Every entry, in registration order."""
        return tuple(self._entries.values())


# What `attention_engine` takes (its flag: `--sparse_attention_engine`).
ENGINES_SETTING = Variants(engine_settings, "an engine", "hf_sparse_cp.attention.register_engine(instance)")
